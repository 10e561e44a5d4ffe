"""Speed of row_mass per backend (torch float64 passes vs the C kernels), A-B-B-A in one process.

Shape legend: row [R, V] float64 (bf16 logits widened), scale [R] float64.
  base   row_mass(row, scale, backend="torch")
  arms   row_mass(row, scale, backend=b) for every other backend this CPU runs
Every backend gives the same bytes: each arm's (m, S, nz) is checked bitwise against the
torch backend's before timing. Two scales: 1.0 (the call every row makes; the C kernel
skips the division for a power of two) and 0.7 (a temperature: a real division). Ratio =
median paired time / torch's (< 1: faster than torch).

    .venv/bin/python -m lmtail.benchmarks.bench_rowmass             # R = 128, V = 25136
    .venv/bin/python -m lmtail.benchmarks.bench_rowmass --r 8 128 --rounds 7
"""
from __future__ import annotations

import argparse

import torch

from lmtail.bench import abba, check_bitwise, format_table
from lmtail.kernels.tail.rowmass import available_backends, row_mass


def case(R: int, V: int, temp: float, rounds: int):
    g = torch.Generator().manual_seed(R)
    row = (torch.randn(R, V, generator=g) * 4).bfloat16().double()  # [R, V]
    scale = torch.full((R,), temp, dtype=torch.float64)  # [R]
    arms = {b: (lambda b=b: row_mass(row, scale, backend=b)) for b in ("torch",) + tuple(
        x for x in available_backends() if x != "torch")}
    return abba(arms, base="torch", rounds=rounds, check=check_bitwise)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--r", type=int, nargs="+", default=[128])
    p.add_argument("--v", type=int, default=25136)
    p.add_argument("--temps", type=float, nargs="+", default=[1.0, 0.7])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="R = 8, 3 rounds (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.r, args.rounds = [8], 3
    results = {f"R={R} V={args.v} scale={t}": case(R, args.v, t, args.rounds) for R in args.r for t in args.temps}
    print(format_table(results, title=f"row_mass by backend (bits equal to torch's, checked), "
                       f"{torch.get_num_threads()} thread(s); ratio = time / torch's"))


if __name__ == "__main__":
    main()
