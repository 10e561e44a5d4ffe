"""decode_tail vs torch's fp32 matmul on pre-widened weights, side by side.

    python benchmarks/bench_tail.py [--gbs 128 --h 2880 --v 25136 --rounds 7]

Arms alternate in one process (A B B A ...); each round's ratio is tail / matmul, and the
median of the paired ratios is reported with how many rounds each arm won. The matmul arm
is the GEMM alone (x_bf16.float() @ W_f32 with W widened beforehand, outside the timing);
the tail arm is the whole decode_tail (norm, GEMM in its declared order, mirror, top-k,
sampler) on the bf16 weights, so the ratio is an upper bound on the GEMM's own cost.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.sampler import SamplingParams, sampling_tensor
from lmtail.tail import decode_tail


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--h", type=int, default=2880)
    ap.add_argument("--v", type=int, default=25136)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.gbs, a.h, generator=g)
    gamma = torch.ones(a.h)
    w = (torch.randn(a.h, a.v, generator=g) * 0.05).to(torch.bfloat16)
    w32 = w.float()
    xa = x.to(torch.bfloat16).float()
    sp = sampling_tensor([SamplingParams(top_k=50, top_p=0.9, temperature=0.8, seed=i) for i in range(a.gbs)],
                         positions=[0] * a.gbs)

    def tail():
        decode_tail(x, gamma, w, k=a.k, sampling_params=sp, emit_logits=False)

    def mm():
        xa @ w32

    tail(), mm()  # warm up (first call compiles/loads the kernel)
    ratios, t_tail, t_mm = [], [], []
    for r in range(a.rounds):
        order = (tail, mm) if r % 2 == 0 else (mm, tail)
        times = {}
        for f in order:
            t0 = time.perf_counter()
            f()
            times[f] = time.perf_counter() - t0
        t_tail.append(times[tail])
        t_mm.append(times[mm])
        ratios.append(times[tail] / times[mm])
    print(f"shape gbs={a.gbs} H={a.h} V_s={a.v} k={a.k}, threads={torch.get_num_threads()}, rounds={a.rounds}")
    print(f"decode_tail median {statistics.median(t_tail) * 1e3:.0f} ms; torch fp32 matmul median {statistics.median(t_mm) * 1e3:.0f} ms")
    print(f"paired ratio tail/matmul: median {statistics.median(ratios):.2f} "
          f"(min {min(ratios):.2f}, max {max(ratios):.2f}); matmul faster in {sum(x > 1 for x in ratios)}/{a.rounds} rounds")


if __name__ == "__main__":
    main()
