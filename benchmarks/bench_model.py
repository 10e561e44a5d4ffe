"""SmolLM2 fp32 forward speed: decode steps for 1 row vs B rows, side by side, and prefill.

Timings on a shared machine are noisy, so the arms alternate (A B B A ...) in one process
and the report is the median per-round ratio; absolute tokens/s are printed for reference.

    .venv/bin/python benchmarks/bench_model.py [--rows 4] [--steps 8] [--rounds 4] [--threads 1]

Shape legend: B rows, P prompt tokens, H hidden.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.model.gguf_loader import load_model
from lmtail.model.llama import forward, new_cache


def decode_seconds(bundle, rows: int, steps: int, prompt: int = 32) -> float:
    """Seconds per decode step (T = 1) of `rows` rows after a `prompt`-token prefill."""
    cache = new_cache(bundle.config, pad=torch.zeros(rows, dtype=torch.int64), capacity=prompt + steps)
    forward(bundle, torch.arange(100, 100 + prompt).repeat(rows, 1), cache)  # [B, P]
    nxt = torch.full((rows, 1), 500, dtype=torch.int64)
    t = time.perf_counter()
    for _ in range(steps):
        forward(bundle, nxt, cache)
    return (time.perf_counter() - t) / steps


def prefill_seconds(bundle, tokens: int) -> float:
    cache = new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=tokens)
    t = time.perf_counter()
    forward(bundle, torch.arange(100, 100 + tokens)[None], cache)
    return time.perf_counter() - t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_model()
    decode_seconds(bundle, 1, 2)  # warm-up
    one, many = [], []
    for r in range(args.rounds):
        order = (1, args.rows) if r % 2 == 0 else (args.rows, 1)
        got = {rows: decode_seconds(bundle, rows, args.steps) for rows in order}
        one.append(got[1])
        many.append(got[args.rows])
    ratio = statistics.median(m / o for m, o in zip(many, one))
    won = sum(m < o * args.rows for m, o in zip(many, one))
    print(f"decode, 1 row : {1 / statistics.median(one):7.1f} tokens/s ({statistics.median(one) * 1e3:.0f} ms/step)")
    print(f"decode, {args.rows} rows: {args.rows / statistics.median(many):7.1f} tokens/s "
          f"({statistics.median(many) * 1e3:.0f} ms/step)")
    print(f"step time {args.rows} rows / 1 row: median {ratio:.2f} over {args.rounds} rounds "
          f"(batched cheaper per token in {won}/{args.rounds})")
    s = prefill_seconds(bundle, 128)
    print(f"prefill 128 tokens: {s:.2f} s = {128 / s:.0f} tokens/s  (threads={args.threads})")


if __name__ == "__main__":
    main()
