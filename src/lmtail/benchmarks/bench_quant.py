"""Speed of gemm_q on SmolLM2's own GGUF weights (Q4_1 body, Q8_0 tied head) against the
bf16 GEMM on a bf16 copy and torch's fp32 matmul on the exactly dequantized weight.

Shape legend: a [M, K] fp32; w QuantWeight (N, K) read from the GGUF (layer 0); its copies,
made once, untimed: w16t = bf16(dequantize(w)).T [K, N] contiguous (gemm_bf16's plain
layout), w32t = dequantize(w).T [K, N] fp32, a16 = bf16(a).
  base "gemm_q"       gemm_q(a, w, threads=t)
       "gemm_bf16"    gemm_bf16(a16, w16t, order="amx32", threads=t)  (bf16-rounded weights)
       "torch fp32"   a @ w32t with torch.set_num_threads(t)
       "read"         (M = 1) a torch sum over an fp32 buffer of w's byte count: a plain
                      memory read of the same bytes, the bandwidth at that size (cache included)
       "entry", "against"  (--against FILE) the package's lmtail_gemm_q called directly
                      (ctypes, no Python checks), and the same entry built from another
                      gemm_q.c (e.g. `git show <rev>:src/lmtail/kernels/quant/gemm_q.c`), both on
                      gemm_q's default backend: a before / after of a kernel change, checked
                      bit-equal; the summary gives against / entry and the rounds entry won
Cases: the distinct linears of a block (q,o 576x576, k,v 192x576, gate,up 1536x576, down
576x1536; N x K) and the head (49152x576 Q8_0) at M = 1, 4, 16, 512 (the head's M = 512 only
with --head-prefill), threads 1 and 2; alternating A-B-B-A rounds (lmtail.bench.abba).
Before timing, every arm is checked against float64: gemm_q inside gemm_q_range of its
declaration, gemm_bf16 inside gemm_range of its own (on the bf16 weight), torch fp32 within
gamma_fp32(K) * sum|a w|. The summary gives each arm's time relative to gemm_q (< 1: faster
than gemm_q) and gemm_q's bytes/s of weight next to the read arm's.

    .venv/bin/python -m lmtail.benchmarks.bench_quant                  # all cases, 7 rounds
    .venv/bin/python -m lmtail.benchmarks.bench_quant --quick          # M = 1 and 16, 3 rounds
    .venv/bin/python -m lmtail.benchmarks.bench_quant --m 1 4 --threads 1 --rounds 9
    .venv/bin/python -m lmtail.benchmarks.bench_quant --cpu-time      # 1 thread, CPU time (loaded machine)
    git show e9ca336:src/lmtail/kernels/quant/gemm_q.c > /tmp/old_gemm_q.c
    .venv/bin/python -m lmtail.benchmarks.bench_quant --against /tmp/old_gemm_q.c --m 1 4 16 --rounds 15
"""
from __future__ import annotations

import argparse
import ctypes
import platform
import statistics
import time
from pathlib import Path

import gguf
import numpy as np
import torch

from lmtail.bench import abba, format_table, wall_time
from lmtail.kernels import _cc
from lmtail.kernels.quant import gemm_q as Q
from lmtail.kernels.gemm.bf16 import gemm_bf16, gemm_decl
from lmtail.kernels.quant.gemm_q import QuantWeight, available_backends, dequantize, gemm_q, gemm_q_decl
from lmtail.model.gguf_loader import locate_gguf
from lmtail.numerics import U, gamma
from lmtail.reference.gemm import gemm_range, in_range
from lmtail.reference.quant import gemm_q_range

LINEARS = {"q,o": "blk.0.attn_q.weight", "k,v": "blk.0.attn_k.weight",
           "gate,up": "blk.0.ffn_gate.weight", "down": "blk.0.ffn_down.weight",
           "head": "token_embd.weight"}
MIN_ROUND_S = 0.02  # each arm's round lasts at least this long (calls repeated)


def make_check(a: torch.Tensor, w: QuantWeight, a16: torch.Tensor, w16t: torch.Tensor,
               w32t: torch.Tensor):
    """check(name, out, base_out): each arm inside its own float64 range (module docstring)."""
    K = a.shape[1]
    a64, w64 = a.double().numpy(), w32t.double().numpy()
    mag = np.abs(a64) @ np.abs(w64)
    s64 = a64 @ w64
    lo16, hi16 = gemm_range(a16, w16t, gemm_decl(K, "amx32"))

    def check(name, out, base_out):
        if name == "gemm_bf16":
            assert in_range(out, lo16, hi16).all(), name
        elif name == "torch fp32":
            err = np.abs(out.double().numpy() - s64)
            assert (err <= gamma(K, U["fp32"]) * mag * (1 + 2.0**-40)).all(), name
        elif name in ("entry", "against"):  # the same declared order, another call: bit-equal
            assert torch.equal(out.view(torch.int32), base_out.view(torch.int32)), name
        elif name != "read":  # the read arm computes a different thing, by design
            raise AssertionError(f"unknown arm {name!r}")

    lo, hi = gemm_q_range(a, w, gemm_q_decl(K, w.fmt))
    return check, (lo, hi)


def torch_mm(a, w32t, t):
    torch.set_num_threads(t)
    return a @ w32t


def thread_cpu_time(fn) -> float:
    """Seconds of this thread's CPU time one call of fn takes (--cpu-time: on a loaded
    machine, the time the arm ran rather than waited; single-thread arms only)."""
    t0 = time.thread_time()
    fn()
    return time.thread_time() - t0


def against_entry(source: str):
    """lmtail_gemm_q of another gemm_q.c (built and cached like the package's own), bound."""
    f = _cc.load_c_library(Path(source)).lmtail_gemm_q
    f.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                  ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def against_arm(f, a: torch.Tensor, w: QuantWeight, out: torch.Tensor, threads: int):
    """An --against arm: f (an lmtail_gemm_q) on gemm_q's default backend (a C one), into out."""
    backend = available_backends()[0]
    if backend not in Q.ISA:
        raise ValueError(f"--against needs a C backend of gemm_q; the default here is {backend!r}")
    M, K = a.shape

    def run():
        rc = f(a.data_ptr(), K, w.data.data_ptr(), Q.FMT_CODE[w.fmt], w.shape[0], K, out.data_ptr(),
               w.shape[0], M, threads, Q.ISA[backend])
        if rc != 0:
            raise RuntimeError(f"the --against build of lmtail_gemm_q failed: {rc}")
        return out
    return run


def case(w: QuantWeight, M: int, threads: int, rounds: int, copies, timer=wall_time, against=None):
    """One (linear, M, threads) case: (ABBAResult, bytes of w)."""
    w16t, w32t = copies
    K = w.shape[1]
    g = torch.Generator().manual_seed(M * 7 + w.shape[0])
    a = torch.randn(M, K, generator=g)  # [M, K]
    a16 = a.bfloat16()
    out_q, out_16 = torch.empty(M, w.shape[0]), torch.empty(M, w.shape[0])
    arms = {}
    if against is not None:  # first: in A-B-B-A order neither follows torch's arm (its OpenMP
        # threads spin on after a call and take the cores from the arm that comes next)
        arms["entry"] = against_arm(Q.native_library().lmtail_gemm_q, a, w, torch.empty(M, w.shape[0]), threads)
        arms["against"] = against_arm(against, a, w, torch.empty(M, w.shape[0]), threads)
    arms.update({"gemm_q": lambda: gemm_q(a, w, out=out_q, threads=threads),
                 "gemm_bf16": lambda: gemm_bf16(a16, w16t, order="amx32", out=out_16, threads=threads),
                 "torch fp32": lambda: torch_mm(a, w32t, threads)})
    if M == 1:
        flat = torch.ones(w.nbytes // 4)
        arms["read"] = lambda: flat.sum()
    check, (lo, hi) = make_check(a, w, a16, w16t, w32t)
    assert in_range(gemm_q(a, w, threads=threads), lo, hi).all(), "gemm_q outside its declared range"
    t0 = time.perf_counter()
    arms["gemm_q"]()
    number = max(1, int(MIN_ROUND_S / max(time.perf_counter() - t0, 1e-7)))
    torch.set_num_threads(threads)  # the read arm's threads (torch fp32 sets its own)
    return abba(arms, base="gemm_q", rounds=rounds, number=number, check=check, timer=timer), w.nbytes


def summary(rows) -> str:
    lines = ["### gemm_q summary (time relative to gemm_q: > 1 = slower than gemm_q)", "",
             "| linear | N x K | fmt | M | threads | gemm_q | gemm_bf16 / gemm_q | torch fp32 / gemm_q "
             "| gemm_q GB/s | read GB/s | GFLOP/s | against / entry (entry faster in) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (label, w, M, t), res, nbytes in rows:
        tq = res.median_s["gemm_q"]
        read = f"{nbytes / res.median_s['read'] / 1e9:.1f}" if "read" in res.names else "-"
        vs = "-"
        if "against" in res.names:
            te, ta = res.times["entry"], res.times["against"]
            vs = (f"{statistics.median(x / y for x, y in zip(ta, te)):.2f} "
                  f"({sum(y < x for x, y in zip(ta, te))}/{res.rounds})")
        lines.append(f"| {label} | {w.shape[0]}x{w.shape[1]} | {w.fmt} | {M} | {t} | {tq * 1e6:.1f} us | "
                     f"{res.ratio['gemm_bf16']:.2f} | {res.ratio['torch fp32']:.2f} | "
                     f"{nbytes / tq / 1e9:.1f} | {read} | {2 * M * w.shape[0] * w.shape[1] / tq / 1e9:.1f} | {vs} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[1, 4, 16, 512])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--linears", nargs="+", default=list(LINEARS), choices=list(LINEARS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--head-prefill", action="store_true", help="also the head at M = 512")
    p.add_argument("--quick", action="store_true", help="M = 1 and 16, 3 rounds")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this thread's CPU time (implies --threads 1): for a loaded machine")
    p.add_argument("--against", metavar="FILE", default=None,
                   help="also time lmtail_gemm_q built from this gemm_q.c (before / after a change)")
    args = p.parse_args()
    against = against_entry(args.against) if args.against else None
    timer = thread_cpu_time if args.cpu_time else wall_time
    if args.cpu_time:
        args.threads = [1]
    if args.quick:
        args.m, args.rounds = [1, 16], 3
    flags = sorted({f for f in open("/proc/cpuinfo").read().split()
                    if f.startswith(("avx512", "avx2", "fma", "f16c"))}) if platform.system() == "Linux" else []
    print(f"# gemm_q backends={available_backends()}  CPU flags: {' '.join(flags)}")
    tensors = {t.name: t for t in gguf.GGUFReader(locate_gguf()).tensors}
    rows = []
    for label in args.linears:
        w = QuantWeight.from_gguf(tensors[LINEARS[label]])
        w32 = dequantize(w)  # [N, K]
        copies = (w32.bfloat16().t().contiguous(), w32.t().contiguous())
        for M in args.m:
            if label == "head" and M > 16 and not args.head_prefill:
                continue
            for t in args.threads:
                res, nbytes = case(w, M, t, args.rounds, copies, timer, against)
                rows.append(((label, w, M, t), res, nbytes))
                print(format_table({f"{label} M={M} t={t}": res},
                                   title=f"{label} {w.fmt} {w.shape[0]}x{w.shape[1]} M={M} threads={t} "
                                         "(base gemm_q)"), flush=True)
    print(summary(rows))


if __name__ == "__main__":
    main()
