"""decode_tail vs torch's fp32 matmul on pre-widened weights, A-B-B-A in one process.

    python benchmarks/bench_tail.py [--gbs 128 --h 2880 --v 25136 --k 256 --rounds 7] [--quick]

Arms (base: torch):
  torch   xa @ w32: the GEMM alone, bf16 inputs widened to fp32 beforehand (outside timing)
  lmtail  decode_tail(x, gamma, w, ...): norm, the GEMM in its declared order, the bf16
          mirror, exact top-k and the sampler (tail_path "fused", the default), on the bf16 weights
  lmtail tail_path=reference   the same with top-k + sampler on the reference path
          (checked bitwise equal to the fused path's outputs before timing)
so the ratio lmtail / torch is an upper bound on the GEMM's own cost. Before timing, both
arms' logits are checked against float64: ref = (a @ w) * rms in float64 with a the bf16
GEMM input bf16(x * gamma) (exact) and rms from reference.tail.rms_ref, within the stated
tolerance H * 2^-24 * (|a| @ |w|) * rms per element (any order of fp32 sums of H terms)
plus 2^-20 relative (the fp32 rms). Shape legend: gbs rows, H hidden, V vocab shard,
k candidates.
"""
from __future__ import annotations

import argparse

import torch

from lmtail.bench import abba, assert_bitwise, assert_within, format_table
from lmtail.reference.tail import rms_ref
from lmtail.sampler import SamplingParams, sampling_tensor
from lmtail.tail import decode_tail

EPS = 1e-5


def logits_check(x, gamma, w):
    """check(name, out, base_out): each arm's fp32 logits within the stated bound of float64."""
    rms = torch.from_numpy(rms_ref(x, eps=EPS, interleaved=False))  # [gbs]
    a = (x * gamma).to(torch.bfloat16).double()  # [gbs, H]
    ref = (a @ w.double()) * rms[:, None]  # [gbs, V]
    atol = x.shape[1] * 2.0**-24 * (a.abs() @ w.double().abs()) * rms[:, None]

    def check(name, out, base_out):
        assert_within(out.logits, ref, atol=atol, rtol=2.0**-20, what=f"{name} logits")
        assert_within(base_out * rms[:, None].float(), ref, atol=atol, rtol=2.0**-20, what="torch logits")
    return check


def paths_check(x, gamma, w, fused):
    """logits_check, and every lmtail arm's outputs bitwise the default (fused) path's."""
    logits_ok = logits_check(x, gamma, w)

    def check(name, out, base_out):
        logits_ok(name, out, base_out)
        for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
            assert_bitwise(getattr(out, f), getattr(fused, f), what=f"{name} {f} vs the fused tail path")
    return check


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gbs", type=int, default=128)
    ap.add_argument("--h", type=int, default=2880)
    ap.add_argument("--v", type=int, default=25136)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="gbs 8, V 4096, 3 rounds (a smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.gbs, a.v, a.rounds = 8, 4096, 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(a.gbs, a.h, generator=g)  # [gbs, H]
    gamma = torch.ones(a.h)  # [H]
    w = (torch.randn(a.h, a.v, generator=g) * 0.05).to(torch.bfloat16)  # [H, V]
    w32 = w.float()
    xa = x.to(torch.bfloat16).float()  # [gbs, H]: the tail's GEMM input (gamma = 1)
    sp = sampling_tensor([SamplingParams(top_k=50, top_p=0.9, temperature=0.8, seed=i) for i in range(a.gbs)],
                         positions=[0] * a.gbs)
    arms = {"torch": lambda: xa @ w32,
            "lmtail": lambda: decode_tail(x, gamma, w, k=a.k, sampling_params=sp, eps=EPS),
            "lmtail tail_path=reference": lambda: decode_tail(x, gamma, w, k=a.k, sampling_params=sp, eps=EPS,
                                                              tail_path="reference")}
    res = abba(arms, base="torch", rounds=a.rounds, check=paths_check(x, gamma, w, arms["lmtail"]()))
    case = f"gbs={a.gbs} H={a.h} V_s={a.v} k={a.k}"
    print(format_table({case: res}, title=f"decode_tail vs torch fp32 matmul, "
                       f"{torch.get_num_threads()} thread(s); ratio = time / torch's"))


if __name__ == "__main__":
    main()
