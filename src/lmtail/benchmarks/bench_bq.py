"""Speed of gemm_bq (order bq32) on SmolLM2's own GGUF linears against gemm_q (lanes32) and
torch's fp32 matmul.

Shape legend: a [M, K] fp32; w QuantWeight (N, K) read from the GGUF (layer 0: q,o 576x576,
gate,up 1536x576, down 576x1536; N x K: H = 576, F = 1536 from the loader's config); its
copies, made once, untimed: wp = pack_bq(w) (gemm_bq's load layout), w32t = dequantize(w).T
[K, N] fp32.
  base "gemm_bq"     gemm_bq(a, wp, threads=t) on its best native backend (backend=None)
       "gemm_q"      gemm_q(a, w, threads=t)   (lanes32: a third of bq32's multiply-adds)
       "torch fp32"  a @ w32t with torch.set_num_threads(t)
Before timing each arm's output is checked against its own reference: gemm_bq == the bq32
model's bytes (reference.quant.gemm_bq_emulation), gemm_q == the lanes32 model's
(reference.quant.gemm_q_emulation), torch fp32 within gamma_fp32(K) * sum|a w|. Arms are
alternated A B B A in one process (lmtail.bench.abba); ratios are arm time / gemm_bq time (> 1:
gemm_bq faster). On a CPU without AMX the "amx" path exists only emulated (the tile model, for
exactness, not speed) and is not timed.

    .venv/bin/python -m lmtail.benchmarks.bench_bq                 # M = 1, 4, 16, 64; threads 1
    .venv/bin/python -m lmtail.benchmarks.bench_bq --m 1 16 --threads 1 2 --rounds 9
"""
from __future__ import annotations

import argparse
import platform

import gguf
import numpy as np
import torch

from lmtail.bench import abba, format_table
from lmtail.kernels import cpu
from lmtail.kernels.quant.gemm_bq import GEMM_BQ, available_backends, gemm_bq, pack_bq
from lmtail.kernels.quant.gemm_q import QuantWeight, dequantize, gemm_q
from lmtail.model.gguf_loader import locate_gguf
from lmtail.numerics import U, gamma
from lmtail.reference.quant import gemm_bq_emulation, gemm_q_emulation

LINEARS = {"q,o": "blk.0.attn_q.weight", "gate,up": "blk.0.ffn_gate.weight", "down": "blk.0.ffn_down.weight"}


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def check_outputs(a, w, wp, w32t, threads):
    """Each arm against its own reference (module docstring); AssertionError naming the arm."""
    assert torch.equal(bits(gemm_bq(a, wp, threads=threads)), bits(gemm_bq_emulation(a.numpy(), w))), "gemm_bq"
    assert torch.equal(bits(gemm_q(a, w, threads=threads)), bits(gemm_q_emulation(a.numpy(), w))), "gemm_q"
    a64, w64 = a.double().numpy(), w32t.double().numpy()
    err = np.abs((a @ w32t).double().numpy() - a64 @ w64)
    assert (err <= gamma(a.shape[1], U["fp32"]) * (np.abs(a64) @ np.abs(w64)) * (1 + 2.0**-40)).all(), "torch fp32"


def torch_mm(a, w32t, t):
    torch.set_num_threads(t)
    return a @ w32t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lmtail.benchmarks.bench_bq")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="M = 1 and 16, 3 rounds")
    args = ap.parse_args(argv)
    if args.quick:
        args.m, args.rounds = [1, 16], 3
    tensors = {t.name: t for t in gguf.GGUFReader(locate_gguf()).tensors}
    bq_row = GEMM_BQ.pick(None, rows=16).name
    print(f"CPU {platform.processor() or platform.machine()}; features {sorted(cpu.features())}")
    print(f"gemm_bq backends {available_backends()} (emulated: {GEMM_BQ.names(emulated=True)[len(available_backends()):]}); "
          f"picked for 16 rows: {bq_row!r}" + ("" if "amx" in available_backends() else
                                                 "; no AMX here: the amx path runs only emulated, untimed"))
    results = {}
    for label, name in LINEARS.items():
        w = QuantWeight.from_gguf(tensors[name])
        wp, w32t = pack_bq(w), dequantize(w).t().contiguous()
        for M in args.m:
            for t in args.threads:
                g = torch.Generator().manual_seed(M * 7 + w.shape[0])
                a = torch.randn(M, w.shape[1], generator=g)
                check_outputs(a, w, wp, w32t, t)
                out_b, out_q = torch.empty(M, w.shape[0]), torch.empty(M, w.shape[0])
                arms = {"gemm_bq": lambda: gemm_bq(a, wp, out=out_b, threads=t),
                        "gemm_q": lambda: gemm_q(a, w, out=out_q, threads=t),
                        "torch fp32": lambda: torch_mm(a, w32t, t)}
                key = f"{label} {w.shape[0]}x{w.shape[1]} {w.fmt} M={M} t={t}"
                results[key] = abba(arms, base="gemm_bq", rounds=args.rounds, number=max(1, 64 // M),
                                    check="skip:each arm checked against its own reference first")
                print(key, {n: f"{results[key].ratio[n]:.3f}" for n in arms}, flush=True)
    print(format_table(results, "gemm_bq (bq32) vs gemm_q (lanes32) vs torch fp32; ratio = arm / gemm_bq"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
