"""The seed's tail shape on VDPBF16PS (issue 31, target 4): the dp32 GEMM against torch's
matmuls, and the whole decode_tail (dp32) against a naive torch tail, A-B-B-A in one process.

Shape legend: a [M, H] bf16 activations (M = gbs), w [H, V] bf16 head shard (plain) and
pw = pack_weight(w) (the load-time VNNI layout), made once, untimed; x [gbs, H] fp32 hidden
states, gamma [H] fp32.

GEMM table, per M (base "torch bf16"; every cell = torch bf16's time / the arm's, > 1 = faster):
  "dp32 avx512bf16" / "... pk"   gemm_bf16(a, w | pw, order="dp32", backend="avx512bf16")
  "dp32 avx512" / "... pk"       the FMA emulation of the same order (--emulation; also avx2),
                                 or alone where the CPU lacks AVX512-BF16
  "torch bf16"                   a @ w (oneDNN; bf16 result)
  "torch fp32"                   a.float() @ w.float() (pre-widened weight)
Checked before timing (bench_gemm.make_check): the dp32 arms bit-equal to each other and in
their declared float64 range, the torch arms within gamma_fp32(H) * sum|a w| of float64.

Tail table at --tail-gbs (base "torch naive tail"; ratio = the arm's time / the base's, < 1 =
faster; the issue's target is <= 0.8):
  "torch naive tail"   RMSNorm in torch ops -> bf16, the bf16 matmul, torch.topk(k) and
                       torch.multinomial(softmax(logits / T), 1) over the whole row
  "torch top-k tail"   the same, the multinomial over softmax(top-k values / T) only (cheaper:
                       torch's multinomial over a 25k-wide row costs more than its matmul)
  "lmtail dp32"        decode_tail(x, gamma, w, gemm_order="dp32", sampling params: top-k /
                       top-p / temperature mixed over the rows), plain weight
  "lmtail dp32 pk"     the same on pw
  "torch bf16 mm"      the matmul alone (what the naive tail spends outside its host ops)
Checked: the lmtail arms' logits within float64's bound (as bench_tail.logits_check) and the two
lmtail arms bitwise equal in every output; the naive tail's logits within the bf16 bound.

    python -m lmtail.benchmarks.bench_dp32 --threads 2
    python -m lmtail.benchmarks.bench_dp32 --threads 1 --gbs 1 8 32 128 --rounds 7
    python -m lmtail.benchmarks.bench_dp32 --quick          # a smoke run
"""
from __future__ import annotations

import argparse

import torch

from lmtail.bench import abba, assert_bitwise, assert_within, format_table
from lmtail.benchmarks.bench_gemm import make_check, make_data
from lmtail.benchmarks.bench_tail import EPS
from lmtail.tail.config import TailConfig
from lmtail.kernels import cpu
from lmtail.kernels.gemm.bf16 import available_backends, gemm_bf16, pack_weight
from lmtail.reference.tail import rms_ref
from lmtail.tail.sampler import SamplingParams, sampling_tensor
from lmtail.tail.compose import decode_tail


def gemm_case(M: int, H: int, V: int, rounds: int, backends: tuple[str, ...]):
    """abba of the dp32 rows (plain and packed) and torch's matmuls at M rows (base torch bf16)."""
    a, w = make_data(M, H, V)
    pw = pack_weight(w)
    w32 = w.float()  # [H, V], widened once, untimed
    outs = {}

    def out(name):
        return outs.setdefault(name, torch.empty(M, V))  # [M, V]
    arms = {"torch bf16": lambda: torch.matmul(a, w),
            "torch fp32": lambda: torch.matmul(a.float(), w32)}
    for b in backends:
        arms[f"dp32 {b}"] = lambda b=b, o=out(b): gemm_bf16(a, w, order="dp32", backend=b, out=o)
        arms[f"dp32 {b} pk"] = lambda b=b, o=out(b + " pk"): gemm_bf16(a, pw, order="dp32", backend=b, out=o)
    return abba(arms, base="torch bf16", rounds=rounds, check=make_check(a, w))


def naive_tail(x, gamma, w, k: int, temps: torch.Tensor, gen: torch.Generator, full_row: bool):
    """RMSNorm (torch ops) -> bf16 matmul -> topk(k) -> multinomial(softmax(. / T)) over the
    whole row (full_row) or over the k top values only (the cheaper spelling)."""
    xn = x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + EPS) * gamma  # [gbs, H]
    logits = torch.matmul(xn.to(torch.bfloat16), w).float()  # [gbs, V]
    top = torch.topk(logits, k, dim=1)
    if full_row:
        tokens = torch.multinomial(torch.softmax(logits / temps[:, None], dim=1), 1, generator=gen)  # [gbs, 1]
    else:
        pick = torch.multinomial(torch.softmax(top.values / temps[:, None], dim=1), 1, generator=gen)  # [gbs, 1]
        tokens = top.indices.gather(1, pick)
    return logits, top, tokens


def tail_case(gbs: int, H: int, V: int, k: int, rounds: int):
    """abba of decode_tail (dp32, plain and packed head) against the naive torch tail."""
    g = torch.Generator().manual_seed(gbs)
    x = torch.randn(gbs, H, generator=g)  # [gbs, H]
    gamma = 1.0 + 0.1 * torch.randn(H, generator=g)  # [H]
    w = (torch.randn(H, V, generator=g) * 0.05).to(torch.bfloat16)  # [H, V]
    pw = pack_weight(w)
    params = [SamplingParams(top_k=(0, 50, 256)[i % 3], top_p=(1.0, 0.9, 0.95)[i % 3],
                             temperature=(1.0, 0.8, 0.6)[i % 3], seed=i) for i in range(gbs)]
    sp = sampling_tensor(params, positions=list(range(gbs)))
    temps = torch.tensor([p.temperature for p in params])  # [gbs]
    cfg = TailConfig(k=k, eps=EPS, gemm_order="dp32")
    gen = torch.Generator().manual_seed(0)
    arms = {"torch naive tail": lambda: naive_tail(x, gamma, w, k, temps, gen, True),
            "torch top-k tail": lambda: naive_tail(x, gamma, w, k, temps, gen, False),
            "lmtail dp32": lambda: decode_tail(x, gamma, w, sampling_params=sp, config=cfg),
            "lmtail dp32 pk": lambda: decode_tail(x, gamma, pw, sampling_params=sp, config=cfg),
            "torch bf16 mm": lambda: torch.matmul((x * gamma).to(torch.bfloat16), w)}
    rms = torch.from_numpy(rms_ref(x, eps=EPS, interleaved=False))[:, None]  # [gbs, 1]
    a64 = (x * gamma).to(torch.bfloat16).double()  # [gbs, H]: the tail's GEMM input (exact)
    ref = (a64 @ w.double()) * rms  # [gbs, V]
    mag = (a64.abs() @ w.double().abs()) * rms  # [gbs, V]
    first = {}

    def check(name, out, base_out):
        if name.startswith("lmtail"):  # any order of fp32 sums of H terms, plus the fp32 rms
            assert_within(out.logits, ref, atol=H * 2.0**-24 * mag, rtol=2.0**-20, what=f"{name} logits")
            for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated", "logits"):
                if f in first:
                    assert_bitwise(getattr(out, f), first[f], what=f"{name} {f}")
                first.setdefault(f, getattr(out, f))
        elif name.startswith("torch") and name.endswith("tail"):  # bf16 input and result: 2^-8 each
            assert_within(out[0], ref, atol=2.0**-7 * mag, rtol=2.0**-8, what="torch naive tail logits")
    return abba(arms, base="torch naive tail", rounds=rounds, check=check)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbs", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--h", type=int, default=2880)
    p.add_argument("--v", type=int, default=25_136)
    p.add_argument("--k", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads first")
    p.add_argument("--tail-gbs", type=int, default=128, help="the whole-tail case's rows (0: none)")
    p.add_argument("--emulation", action="store_true", help="also the FMA emulations (dp32 avx512, avx2)")
    p.add_argument("--quick", action="store_true", help="gbs 1 and 8, V 4096, 3 rounds, tail gbs 8 (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.gbs, args.v, args.rounds, args.tail_gbs = [1, 8], 4096, 3, 8
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    have = available_backends("dp32")
    backends = tuple(b for b in ("avx512bf16",) + (("avx512", "avx2") if args.emulation else ()) if b in have)
    if not backends:  # no AVX512-BF16: the table with the fastest emulation this CPU has
        backends = tuple(b for b in ("avx512", "avx2", "c") if b in have)[:1]
    if not backends:
        raise SystemExit(f"no dp32 backend here (no C compiler?); CPU: {' '.join(cpu.features())}")
    print(f"# dp32 on the seed's tail shape: H={args.h} V_s={args.v} threads={torch.get_num_threads()} "
          f"backends={backends}; CPU flags: {' '.join(cpu.features())}")
    results, rows = {}, []
    for M in args.gbs:
        res = results[f"M={M}"] = gemm_case(M, args.h, args.v, args.rounds, backends)
        speed = {n: 1.0 / res.ratio[n] for n in res.names}
        rows.append(f"| {M} | " + " | ".join(f"{speed[f'dp32 {b}']:.2f}x / {speed[f'dp32 {b} pk']:.2f}x"
                                             for b in backends)
                    + f" | 1.00 ({res.median_s['torch bf16'] * 1e3:.1f} ms) | {speed['torch fp32']:.2f}x |")
        print(rows[-1], flush=True)
    head = " | ".join(f"dp32 {b} (plain / packed)" for b in backends)
    print(f"\n### GEMM speed relative to torch bf16 (> 1 = faster), {torch.get_num_threads()} thread(s)\n")
    print(f"| M | {head} | torch bf16 | torch fp32 |\n|---:|" + "---:|" * (len(backends) + 2))
    print("\n".join(rows))
    if args.tail_gbs:
        res = tail_case(args.tail_gbs, args.h, args.v, args.k, args.rounds)
        results[f"tail gbs={args.tail_gbs}"] = res
        print()
        print(format_table({f"tail gbs={args.tail_gbs}": res},
                           title=f"decode_tail (dp32) vs a naive torch tail, gbs={args.tail_gbs}, "
                                 f"{torch.get_num_threads()} thread(s); ratio = time / the naive tail's"))


if __name__ == "__main__":
    main()
