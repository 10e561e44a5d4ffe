"""Speed of gemm_bf16 (orders "amx32", "dp32" and "chain", every path) against torch's matmuls.

Shape legend: a [gbs, H] bf16, w [H, V] bf16; w32 = w.float() and pw = pack_weight(w) are
made once, untimed.
  base "torch fp32"    a.float() @ w32              (MKL sgemm on pre-widened weights)
       "torch bf16"    a @ w                        (oneDNN; bf16 result)
       "chain <b>"     gemm_bf16(a, w, order="chain", backend=b)
       "amx32 <b>"     gemm_bf16(a, w, order="amx32", backend=b)      plain [H, V] weight
       "amx32 <b> pk"  gemm_bf16(a, pw, order="amx32", backend=b)     packed weight
       "dp32 <b>", "dp32 <b> pk"   the same in the dp32 order (VDPBF16PS's; emulated without it)
  for every backend this machine has ("c" only at gbs = 1: it is the portable fallback).
Before timing, abba's check requires every amx32 arm to be bit-equal to the first amx32
arm's output, the chain arms to each other, and every arm to lie within its float64 range
(lmtail arms: reference.gemm.gemm_range of their declaration; torch arms: gamma_fp32(H)
* sum|a w|, plus half a bf16 ulp for the bf16 result), on the first 2048 columns.
The last case is gbs = 1 over the full GPT-OSS vocab (V = 201,088, 1.16 GB of weight)
against "read": a torch sum over the same bytes, i.e. the machine's read bandwidth now.
`--model-shapes` times instead the SmolLM2 body's linears (q|k|v, o, gate|up, down,
lm_head) at M = 1, 4 and 256 rows with the plain weight the model passes: torch fp32
(base), torch bf16, "amx32 <b>" for every vector backend, and at M = 1 "read" (a torch sum
over the weight's bytes: the read bandwidth at that size, cache included).

    .venv/bin/python -m lmtail.benchmarks.bench_gemm                 # gbs 1 8 32 128 + full vocab
    .venv/bin/python -m lmtail.benchmarks.bench_gemm --quick         # a smoke run
    .venv/bin/python -m lmtail.benchmarks.bench_gemm --gbs 128 --rounds 9 --no-full-vocab
    .venv/bin/python -m lmtail.benchmarks.bench_gemm --model-shapes --threads 1   # the model's shapes
    .venv/bin/python -m lmtail.benchmarks.bench_gemm --threads 2 --no-full-vocab --base "torch bf16" \
        --only "dp32 avx512bf16"        # VDPBF16PS (plain and packed) against torch's bf16 matmul
"""
from __future__ import annotations

import argparse
import platform

import numpy as np
import torch

from lmtail.bench import abba, assert_bitwise, format_table
from lmtail.kernels.gemm.bf16 import ORDERS, available_backends, gemm_bf16, gemm_decl, pack_weight
from lmtail.numerics import U, gamma
from lmtail.reference.gemm import gemm_range, in_range

CHECK_COLS = 2048
FULL_VOCAB = 201_088


def make_data(gbs: int, H: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(gbs, H, generator=g).bfloat16()  # [gbs, H]
    w = (torch.randn(H, V, generator=g) * 0.02).bfloat16()  # [H, V]
    return a, w


def make_check(a: torch.Tensor, w: torch.Tensor):
    """check(name, out, base_out): bitwise within each order, and inside the float64 range."""
    H = a.shape[1]
    ws = w[:, :CHECK_COLS].contiguous()
    ranges = {o: gemm_range(a, ws, gemm_decl(H, o)) for o in ORDERS}
    a64, w64 = a.double().numpy(), ws.double().numpy()
    s64, mag = a64 @ w64, np.abs(a64) @ np.abs(w64)
    first: dict[str, torch.Tensor] = {}

    def in_torch_range(name, out):
        tol = (gamma(H, U["fp32"]) + 2 * gamma(H, U["fp64"])) * mag
        if "bf16" in name:  # the bf16 result rounds once more
            tol = tol + U["bf16"] * (np.abs(s64) + tol)
        err = np.abs(out[:, :CHECK_COLS].double().numpy() - s64)
        if not (err <= tol).all():
            raise AssertionError(f"arm {name!r} is outside gamma_fp32(H) * sum|a w| of float64")

    def check(name: str, out, base_out) -> None:
        for o in ORDERS:
            if name.startswith(o + " "):
                if o in first:
                    assert_bitwise(out, first[o], what=f"arm {name!r}")
                first.setdefault(o, out)
                if not in_range(out[:, :CHECK_COLS], *ranges[o]).all():
                    raise AssertionError(f"arm {name!r} is outside its declared float64 range")
                return
        in_torch_range(name, out.float())

    in_torch_range("torch fp32", (a.float() @ ws.float()))
    return check


def gemm_arms(a, w, *, with_torch: bool = True, with_c: bool = False) -> dict:
    pw = pack_weight(w)
    outs: dict[str, torch.Tensor] = {}

    def out(name):  # each arm writes its own preallocated [gbs, V] result
        return outs.setdefault(name, torch.empty(a.shape[0], w.shape[1]))
    arms = {}
    if with_torch:
        w32 = w.float()  # [H, V], widened once, untimed
        arms["torch fp32"] = lambda: torch.matmul(a.float(), w32)
        arms["torch bf16"] = lambda: torch.matmul(a, w)
    for b in available_backends("amx32"):
        if b == "c" and not with_c:
            continue
        arms[f"amx32 {b}"] = lambda b=b, o=out(f"a{b}"): gemm_bf16(a, w, order="amx32", backend=b, out=o)
        arms[f"amx32 {b} pk"] = lambda b=b, o=out(f"p{b}"): gemm_bf16(a, pw, order="amx32", backend=b, out=o)
    for b in available_backends("dp32"):
        if b == "c" and not with_c:
            continue
        arms[f"dp32 {b}"] = lambda b=b, o=out(f"d{b}"): gemm_bf16(a, w, order="dp32", backend=b, out=o)
        arms[f"dp32 {b} pk"] = lambda b=b, o=out(f"q{b}"): gemm_bf16(a, pw, order="dp32", backend=b, out=o)
    for b in available_backends("chain"):
        if b in ("c", "numba") and not with_c:
            continue
        arms[f"chain {b}"] = lambda b=b, o=out(f"c{b}"): gemm_bf16(a, w, order="chain", backend=b, out=o)
    return arms


def bandwidth_case(H: int, V: int, rounds: int):
    """gbs = 1 over [H, V] vs a torch sum over the same bytes (the read bandwidth)."""
    a, w = make_data(1, H, V, seed=1)
    arms = gemm_arms(a, w, with_torch=False)
    flat = w.view(torch.float32) if V % 2 == 0 else w.view(-1)[: (H * V) // 2 * 2].view(torch.float32)
    arms = {"read": lambda: flat.sum(), "torch bf16": lambda: torch.matmul(a, w), **arms}
    check = make_check(a, w)

    def check_or_skip(name, out, base_out):
        if name != "read":  # the read arm computes a different thing, by design
            check(name, out, base_out)

    return abba(arms, base="read", rounds=rounds, check=check_or_skip), 2 * H * V


# the SmolLM2-135M linears as [H, V] = [in, out] (hidden 576, 9 + 2*3 heads of 64, MLP 1536)
MODEL_SHAPES = {"q|k|v": (576, 960), "o": (576, 576), "gate|up": (576, 3072),
                "down": (1536, 576), "lm_head": (576, 49_152)}


def model_shape_case(M: int, H: int, V: int, rounds: int):
    """One body linear at M rows: torch fp32 (base), torch bf16, every amx32 vector backend
    on the plain weight, and at M = 1 the read arm over w's bytes."""
    a, w = make_data(M, H, V, seed=M + V)
    arms = {k: f for k, f in gemm_arms(a, w).items()
            if k.startswith(("torch", "amx32")) and not k.endswith(" pk")}
    if M == 1:
        flat = w.view(-1).view(torch.float32)  # H * V is even for every model shape
        arms["read"] = lambda: flat.sum()
    check = make_check(a, w)

    def check_or_skip(name, out, base_out):
        if name != "read":  # the read arm computes a different thing, by design
            check(name, out, base_out)

    number = max(1, int(5e7 / (M * H * V)))  # a few milliseconds per timed round
    return abba(arms, base="torch fp32", rounds=rounds, check=check_or_skip, number=number)


def decode_step_case(M: int, rounds: int, layers: int = 30):
    """One decode step's linears at M rows: `layers` layers of distinct weights and the
    lm_head (268 MB of bf16 at 30 layers, so the weights stream from memory as in a real
    step). Base "read": a torch sum over all those bytes. Each arm returns its lm_head
    output, which the check compares (bitwise within amx32, float64 ranges for torch)."""
    g = torch.Generator().manual_seed(M)
    shapes = [s for s in MODEL_SHAPES.values() if s != MODEL_SHAPES["lm_head"]]
    ws = [(torch.randn(H, V, generator=g) * 0.02).bfloat16() for _ in range(layers) for H, V in shapes]
    a, head = make_data(M, *MODEL_SHAPES["lm_head"], seed=M)
    ws.append(head)
    xs = {H: torch.randn(M, H, generator=g).bfloat16() for H in {w.shape[0] for w in ws}}
    xs[head.shape[0]] = a  # [M, 576]: the lm_head's input is the checked one
    w32s = [w.float() for w in ws]  # pre-widened once, untimed
    flats = [w.view(-1).view(torch.float32) for w in ws]

    def arm(fn):
        def run():
            out = None
            for w, w32 in zip(ws, w32s):
                out = fn(xs[w.shape[0]], w, w32)
            return out
        return run
    arms = {"read": lambda: [f.sum() for f in flats],
            "torch fp32": arm(lambda x, w, w32: torch.matmul(x.float(), w32)),
            "torch bf16": arm(lambda x, w, w32: torch.matmul(x, w))}
    for b in available_backends("amx32"):
        if b != "c":
            arms[f"amx32 {b}"] = arm(lambda x, w, w32, b=b: gemm_bf16(x, w, order="amx32", backend=b))
    check = make_check(a, head)

    def check_or_skip(name, out, base_out):
        if name != "read":
            check(name, out, base_out)

    nbytes = sum(w.numel() * 2 for w in ws)
    return abba(arms, base="read", rounds=rounds, check=check_or_skip), nbytes


def model_shapes(Ms, rounds: int) -> dict:
    results = {}
    for M in (m for m in Ms if m <= 8):
        res, nbytes = decode_step_case(M, rounds)
        results[f"decode step M={M}"] = res
        print(f"# decode step M={M} (30 layers + lm_head, {nbytes / 1e6:.0f} MB of bf16 weight): "
              + "  ".join(f"{n}: {res.median_s[n] * 1e3:.1f} ms = {nbytes / res.median_s[n] / 1e9:.1f} GB/s"
                          for n in res.names), flush=True)
    for M in Ms:
        for name, (H, V) in MODEL_SHAPES.items():
            res = results[f"M={M} {name} [{H}, {V}]"] = model_shape_case(M, H, V, rounds)
            rate = "  ".join(
                f"{arm}: {2 * H * V / res.median_s[arm] / 1e9:.1f} GB/s" if M == 1 else
                f"{arm}: {2 * M * H * V / res.median_s[arm] / 1e9:.0f} GFLOP/s"
                for arm in res.names)
            print(f"# M={M} {name} [{H}, {V}]  {rate}", flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbs", "--m", type=int, nargs="+", default=[1, 8, 32, 128], dest="gbs")
    p.add_argument("--h", type=int, default=2880)
    p.add_argument("--v", type=int, default=25_136)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-full-vocab", action="store_true", help="skip the gbs=1 V=201,088 case")
    p.add_argument("--quick", action="store_true", help="gbs 1 and 8, V=4096, 3 rounds")
    p.add_argument("--model-shapes", action="store_true",
                   help="the SmolLM2 body's linears at M = --model-m (default 1 4 256)")
    p.add_argument("--model-m", type=int, nargs="+", default=[1, 4, 256])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--base", default="torch fp32", help="the arm every ratio divides by")
    p.add_argument("--only", nargs="+", default=None, metavar="PREFIX",
                   help="time only the arms whose names start with one of these (and the base)")
    args = p.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.gbs, args.v, args.rounds, args.no_full_vocab = [1, 8], 4096, 3, True
    flags = sorted({f for f in open("/proc/cpuinfo").read().split()
                    if f.startswith(("avx512", "amx", "avx2", "fma"))}) if platform.system() == "Linux" else []
    print(f"# gemm_bf16: H={args.h} V={args.v} threads={torch.get_num_threads()} "
          f"amx32 backends={available_backends('amx32')} dp32 backends={available_backends('dp32')} "
          f"chain backends={available_backends('chain')}")
    print(f"# CPU flags: {' '.join(flags)}")
    if args.model_shapes:
        print(format_table(model_shapes(args.model_m, args.rounds),
                           title=f"gemm_bf16 at the model's shapes, threads={torch.get_num_threads()} "
                                 "(base: torch fp32; ratio < 1: faster)"))
        return
    results = {}
    for gbs in args.gbs:
        a, w = make_data(gbs, args.h, args.v)
        arms = gemm_arms(a, w, with_c=gbs == 1)
        if args.only:
            arms = {n: f for n, f in arms.items() if n == args.base or n.startswith(tuple(args.only))}
        if args.base not in arms:
            raise SystemExit(f"--base {args.base!r} is not an arm here: {sorted(arms)}")
        results[f"gbs={gbs}"] = abba(arms, base=args.base, rounds=args.rounds,
                                     check=make_check(a, w))
        print(format_table({f"gbs={gbs}": results[f"gbs={gbs}"]}, title=f"gbs={gbs} (base: {args.base})"),
              flush=True)
    if not args.no_full_vocab:
        res, nbytes = bandwidth_case(args.h, FULL_VOCAB, max(3, args.rounds))
        results[f"gbs=1 V={FULL_VOCAB}"] = res
        print(format_table({"full vocab": res}, title=f"gbs=1 V={FULL_VOCAB} (base: read bandwidth)"))
        for name in res.names:
            print(f"  {name:<18} {nbytes / res.median_s[name] / 1e9:6.1f} GB/s of weight "
                  f"({1 / res.ratio[name]:.0%} of the read bandwidth)")
    print(format_table(results, title="gemm_bf16, all cases (ratio < 1: faster than the base)"))


if __name__ == "__main__":
    main()
