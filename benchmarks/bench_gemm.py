"""Speed of gemm_bf16_chain against torch's fp32 matmul on pre-widened weights.

Shape legend: a [M, H] bf16, w [H, V] bf16 (w32 = w.float(), widened once, untimed).
  arm A: a.float() @ w32                     (MKL sgemm, fp32 weights: 2x the bytes)
  arm B: gemm_bf16_chain(a, w)               (declared fp32 fma chain, bf16 weights)
The arms alternate A B, B A, A B, ... in one process; each round gives the ratio B/A,
and the report is the median of those paired ratios plus how many rounds each arm won.
(torch's bf16 CPU matmul is far slower than both and is not measured.)

    .venv/bin/python benchmarks/bench_gemm.py            # M = 1, 8, 128 at H=2880, V=25136
    .venv/bin/python benchmarks/bench_gemm.py --m 128 --rounds 11
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.kernels.gemm import available_backends, gemm_bf16_chain


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_one(M: int, H: int, V: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(M)
    a = torch.randn(M, H, generator=g).bfloat16()  # [M, H]
    w = (torch.randn(H, V, generator=g) * 0.02).bfloat16()  # [H, V]
    w32 = w.float()  # [H, V], widened once outside the timing
    out = torch.empty(M, V)  # [M, V]
    arm_a = lambda: torch.matmul(a.float(), w32)  # noqa: E731
    arm_b = lambda: gemm_bf16_chain(a, w, out=out)  # noqa: E731
    arm_a(), arm_b()  # warm up: MKL buffers, kernel build/load
    ta, tb = [], []
    for r in range(rounds):
        if r % 2 == 0:
            ta.append(_timed(arm_a)), tb.append(_timed(arm_b))
        else:
            tb.append(_timed(arm_b)), ta.append(_timed(arm_a))
    ratios = [b / a_ for a_, b in zip(ta, tb)]
    return {"M": M, "torch_ms": 1e3 * statistics.median(ta),
            "chain_ms": 1e3 * statistics.median(tb), "ratio": statistics.median(ratios),
            "chain_wins": sum(x < 1 for x in ratios), "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 8, 128])
    p.add_argument("--h", type=int, default=2880)
    p.add_argument("--v", type=int, default=25136)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    print(f"gemm_bf16_chain vs torch fp32 matmul: H={args.h} V={args.v} "
          f"threads={torch.get_num_threads()} backend={available_backends()[0]}")
    print(f"{'M':>5} {'torch fp32 ms':>14} {'chain ms':>10} {'ratio (median paired)':>22} "
          f"{'chain won':>10}")
    for M in args.m:
        r = bench_one(M, args.h, args.v, args.rounds)
        print(f"{r['M']:>5} {r['torch_ms']:>14.1f} {r['chain_ms']:>10.1f} {r['ratio']:>22.2f} "
              f"{r['chain_wins']:>6}/{r['rounds']}")


if __name__ == "__main__":
    main()
