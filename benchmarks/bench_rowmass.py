"""Speed of row_mass_fast (C kernel) against the torch reference sampler.row_mass.

Shape legend: row [R, V] float64 (bf16 logits widened), scale [R] float64.
  arm A: lmtail.sampler.row_mass(row, scale)              (torch: exp64's float64 passes)
  arm B: lmtail.kernels.rowmass.row_mass_fast(row, scale) (C kernel, the same bits)
Two scales: 1.0 (lse1, the call every row makes; the C kernel skips the division when
the scale is a power of two) and 0.7 (a temperature: a real division). The arms alternate
A B, B A, ... in one process; the report is the median of the paired ratios A/B (how
many times faster the kernel is) and whether every round's bits agreed.

    .venv/bin/python benchmarks/bench_rowmass.py             # R = 128, V = 25136
    .venv/bin/python benchmarks/bench_rowmass.py --r 8 128 --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.kernels.rowmass import available_backends, row_mass_fast
from lmtail.sampler import row_mass


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _same(a, b) -> bool:
    return all(torch.equal(x.view(torch.int64), y.view(torch.int64)) for x, y in zip(a, b))


def bench_one(R: int, V: int, temp: float, rounds: int) -> dict:
    g = torch.Generator().manual_seed(R)
    row = (torch.randn(R, V, generator=g) * 4).bfloat16().double()  # [R, V]
    scale = torch.full((R,), temp, dtype=torch.float64)  # [R]
    arm_a = lambda: row_mass(row, scale)  # noqa: E731
    arm_b = lambda: row_mass_fast(row, scale)  # noqa: E731
    arm_a(), arm_b()  # warm up: kernel build/load, allocator
    ta, tb, same = [], [], True
    for r in range(rounds):
        order = (arm_a, arm_b) if r % 2 == 0 else (arm_b, arm_a)
        res = {fn: _timed(fn) for fn in order}
        ta.append(res[arm_a][0]), tb.append(res[arm_b][0])
        same &= _same(res[arm_a][1], res[arm_b][1])
    ratios = [a / b for a, b in zip(ta, tb)]
    return {"R": R, "temp": temp, "torch_ms": 1e3 * statistics.median(ta),
            "c_ms": 1e3 * statistics.median(tb), "ratio": statistics.median(ratios),
            "same": same}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--r", type=int, nargs="+", default=[128])
    p.add_argument("--v", type=int, default=25136)
    p.add_argument("--temps", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"row_mass: torch reference vs C kernel, V={args.v} "
          f"threads={torch.get_num_threads()} backend={available_backends()[0]}")
    print(f"{'R':>5} {'scale':>6} {'torch ms':>9} {'C ms':>7} {'torch/C (median paired)':>24} "
          f"{'bits equal':>11}")
    for R in args.r:
        for temp in args.temps:
            r = bench_one(R, args.v, temp, args.rounds)
            print(f"{r['R']:>5} {r['temp']:>6} {r['torch_ms']:>9.1f} {r['c_ms']:>7.1f} "
                  f"{r['ratio']:>24.1f} {str(r['same']):>11}")


if __name__ == "__main__":
    main()
