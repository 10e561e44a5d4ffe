"""SmolLM2 body speed: the q32 body (generate's default: the file's own blocks through gemm_q,
fp32 stream, one native call per step) vs the declared body (bf16 GEMMs in the amx32 order)
vs the fp32 body (the receipts' reference), side by side; and prefill growth with length.

Arms alternate (A B B A, lmtail.bench.abba) after a check: the two bodies are different
numerics, so they must agree on the greedy next token (fp32 logits) of every row; the
prefill lengths of one body are checked to reproduce the one-shot bytes chunk by chunk.

    .venv/bin/python -m lmtail.benchmarks.bench_model [--rows 4] [--steps 8] [--rounds 3] [--threads 1]

The comparison with Hugging Face transformers lives in benchmarks/peers/hf/bench.py.
Shape legend: B rows, P prompt tokens, H hidden, V vocab.
"""
from __future__ import annotations

import argparse
import time

import torch

from lmtail.bench import abba, format_table
from lmtail.model import llama
from lmtail.model.gguf_loader import load_model


def decode_run(bundle, ops, rows: int, steps: int, prompt: int = 32):
    """(next-token argmax [B] of the last step, seconds per decode step) after a prefill."""
    cache = llama.new_cache(bundle.config, pad=torch.zeros(rows, dtype=torch.int64), capacity=prompt + steps)
    llama.prefill(bundle, torch.arange(100, 100 + prompt).repeat(rows, 1), cache, ops=ops)  # [B, P]
    nxt = torch.full((rows, 1), 500, dtype=torch.int64)
    t = time.perf_counter()
    for _ in range(steps):
        _, y = llama.forward(bundle, nxt, cache, ops=ops)  # [B, 1, H]
    dt = (time.perf_counter() - t) / steps
    return llama.logits_fp32(bundle, y[:, -1]).argmax(-1), dt


def prefill_run(bundle, ops, tokens: int):
    """(h [1, H] of the last position, seconds) of one prompt of `tokens` tokens."""
    ids = (torch.arange(tokens) * 7919 % 30000 + 100)[None]  # [1, P]
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=tokens)
    t = time.perf_counter()
    h = llama.prefill(bundle, ids, cache, ops=ops)
    return h, time.perf_counter() - t


def same_argmax(name, out, base_out):
    if not torch.equal(out[0], base_out[0]):
        raise AssertionError(f"{name}: greedy next tokens {out[0].tolist()} != {base_out[0].tolist()}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_model()
    bodies = {"q32": llama.lmtail_ops(body="q32"), "declared": llama.lmtail_ops(), "fp32 body": llama.FP32_OPS}
    res = {}
    for rows in (1, args.rows):
        res[f"decode step, B={rows}"] = abba(
            {k: (lambda o=o: decode_run(bundle, o, rows, args.steps)) for k, o in bodies.items()},
            base="q32", rounds=args.rounds, check=same_argmax, timer=lambda fn: fn()[1])
    res["prefill 128"] = abba({k: (lambda o=o: prefill_run(bundle, o, 128)) for k, o in bodies.items()},
                              base="q32", rounds=args.rounds, timer=lambda fn: fn()[1],
                              check="skip:different numerics; the decode cases check agreement")
    print(format_table(res, title=f"SmolLM2 body: q32 vs declared vs fp32 (threads={args.threads}; ratio > 1 = "
                                  f"slower than the q32 body)"))
    print("| prefill tokens | q32 body | per token | per token / first |\n|---:|---:|---:|---:|")
    first = None
    for n in args.lengths:
        _, s = prefill_run(bundle, bodies["q32"], n)
        first = first or s / n
        print(f"| {n} | {s:.2f} s | {s / n * 1e3:.2f} ms | {s / n / first:.2f} |")


if __name__ == "__main__":
    main()
