"""decode_tail vs torch's fp32 matmul on pre-widened weights, A-B-B-A in one process.

    python -m lmtail.benchmarks.bench_tail [--gbs 128 --h 2880 --v 25136 --k 256 --rounds 7] [--quick]
    python -m lmtail.benchmarks.bench_tail --stages [--gbs 1 8 32 128] [--orders amx32 dp32]

Arms (base: torch):
  torch   xa @ w32: the GEMM alone, bf16 inputs widened to fp32 beforehand (outside timing)
  lmtail  decode_tail(x, gamma, w, ...): norm, the GEMM in its declared order, the default
          exchange's candidates (exact fp32 top-k and chunk masses), merge and the sampler, on
          the bf16 weights
  lmtail tail_path=reference   the same with top-k + sampler on the reference path
          (checked bitwise equal to the fused path's outputs before timing)
so the ratio lmtail / torch is an upper bound on the GEMM's own cost. Before timing, both
arms' logits are checked against float64: ref = (a @ w) * rms in float64 with a the bf16
GEMM input bf16(x * gamma) (exact) and rms from reference.tail.rms_ref, within the stated
tolerance H * 2^-24 * (|a| @ |w|) * rms per element (any order of fp32 sums of H terms)
plus 2^-20 relative (the fp32 rms). Shape legend: gbs rows, H hidden, V vocab shard,
k candidates.

--stages: one rank's decode_tail cut into its stages, each timed on its own (the same
internal calls decode_tail makes, in its order; checked bitwise equal to decode_tail's
outputs first): validate, norm (normed_rows), gemm (logits_from in each --orders order),
then for exchange "candidates" shard_partials (exact top-(k+1) keys + 256 chunk masses),
merge and sampler, for "mirror" the bf16 cast and rows_tail (the fused pass). Rows sampled
with a mix of top-k / top-p / temperatures. Each stage's median over --rounds rounds (the
orders and exchanges alternate A B B A), its share of the stage sum, and beside them torch's
fp32 matmul on pre-widened weights and its bf16 matmul (oneDNN; only where the CPU has
AVX512-BF16: elsewhere its reference path takes minutes, shown as "-").
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from lmtail.tail import candidates
from lmtail.tail import compose as tail_mod
from lmtail.bench import abba, assert_bitwise, assert_within, format_table
from lmtail.tail.config import GEMM_ORDERS, TailConfig
from lmtail.kernels import cpu
from lmtail.reference.tail import rms_ref
from lmtail.tail.sampler import SamplingParams, sampling_tensor
from lmtail.tail.compose import decode_tail

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


STAGES = {"candidates": ("validate", "norm", "gemm", "shard_partials", "merge", "sampler"),
          "mirror": ("validate", "norm", "gemm", "mirror cast", "rows_tail")}


def tail_stages(x, gamma, w, sp, cfg: TailConfig) -> tuple[list[float], object]:
    """One rank's decode_tail(x, gamma, w, sampling_params=sp, config=cfg) as its stages
    (the calls decode_tail makes, in its order): ([seconds per stage of STAGES[cfg.exchange]],
    the TailOutput)."""
    t = [time.perf_counter()]
    v = tail_mod.head_shard_width(w)
    tail_mod.validate_tail_inputs(x, gamma, w, sp, cfg, vocab_size=v)
    t.append(time.perf_counter())
    a, rms = tail_mod.normed_rows(x, gamma, cfg)  # [gbs, H] bf16, [gbs]
    t.append(time.perf_counter())
    logits = tail_mod.logits_from(a, rms, w, cfg)  # [gbs, V]
    t.append(time.perf_counter())
    if cfg.exchange == "candidates":
        part = candidates.shard_partials(logits, col0=0, v=v, k=cfg.k, nan_fold=cfg.nan_fold, sp=sp)
        t.append(time.perf_counter())
        merged = candidates.merge(part, k=cfg.k)
        t.append(time.perf_counter())
        out = tail_mod.owned_candidates(merged, sp, cfg, logits, v)
    else:
        mirror = logits.to(torch.bfloat16)  # [gbs, V]
        t.append(time.perf_counter())
        out = tail_mod.owned_tail(mirror, sp, cfg, logits)
    t.append(time.perf_counter())
    return [b - a for a, b in zip(t, t[1:])], out


def _median_stages(runs: list[list[float]]) -> list[float]:
    return [statistics.median(r[i] for r in runs) for i in range(len(runs[0]))]


def stages_main(a) -> None:
    """--stages: the stage table for every gbs (module docstring)."""
    has_bf16 = cpu.has("avx512_bf16")
    print(f"CPU flags: {' '.join(cpu.features()) or '-'}; {torch.get_num_threads()} thread(s); "
          f"H={a.h} V_s={a.v} k={a.k}, {a.rounds} rounds")
    rows = ["| gbs | exchange | gemm order | " + " | ".join(f"{s} ms (share)" for s in STAGES["candidates"])
            + " | mirror cast / rows_tail ms | stage sum ms | torch fp32 mm ms | torch bf16 mm ms | sum / fp32 mm |",
            "|---:|---|---|" + "---:|" * (len(STAGES["candidates"]) + 5)]
    for gbs in a.gbs:
        g = torch.Generator().manual_seed(gbs)
        x = torch.randn(gbs, a.h, generator=g)  # [gbs, H]
        gamma = 1.0 + 0.1 * torch.randn(a.h, generator=g)  # [H]
        w = (torch.randn(a.h, a.v, generator=g) * 0.05).to(torch.bfloat16)  # [H, V]
        sp = sampling_tensor([SamplingParams(top_k=(0, 50, 256)[i % 3], top_p=(1.0, 0.9, 0.95)[i % 3],
                                             temperature=(1.0, 0.8, 0.6)[i % 3], seed=i) for i in range(gbs)],
                             positions=list(range(gbs)))
        cfgs = [TailConfig(k=a.k, eps=EPS, exchange=ex, gemm_order=o) for o in a.orders
                for ex in ("candidates", "mirror")]
        for cfg in cfgs:  # each staged call equals decode_tail's outputs, bit for bit
            _, out = tail_stages(x, gamma, w, sp, cfg)
            want = decode_tail(x, gamma, w, sampling_params=sp, config=cfg)
            for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated", "logits"):
                assert_bitwise(getattr(out, f), getattr(want, f), what=f"staged {f} ({cfg.exchange}, {cfg.gemm_order})")
        w32, xa = w.float(), (x * gamma).to(torch.bfloat16)
        runs = {i: [] for i in range(len(cfgs))}
        mm32, mm16 = [], []
        for r in range(a.rounds):
            for i in (range(len(cfgs)) if r % 2 == 0 else reversed(range(len(cfgs)))):
                runs[i].append(tail_stages(x, gamma, w, sp, cfgs[i])[0])
            t0 = time.perf_counter()
            xa.float() @ w32
            mm32.append(time.perf_counter() - t0)
            if has_bf16:
                t0 = time.perf_counter()
                xa @ w
                mm16.append(time.perf_counter() - t0)
        f32 = statistics.median(mm32)
        f16 = f"{statistics.median(mm16) * 1e3:.2f}" if mm16 else "-"
        for i, cfg in enumerate(cfgs):
            med = _median_stages(runs[i])
            tot = sum(med)
            cells = [f"{m * 1e3:.2f} ({m / tot:.0%})" for m in med]
            if cfg.exchange == "candidates":
                body, tail_cells = cells, "-"
            else:
                body, tail_cells = cells[:3] + ["-"] * 3, " / ".join(cells[3:])
            rows.append(f"| {gbs} | {cfg.exchange} | {cfg.gemm_order} | " + " | ".join(body)
                        + f" | {tail_cells} | {tot * 1e3:.2f} | {f32 * 1e3:.2f} | {f16} | {tot / f32:.2f} |")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", action="store_true", help="time decode_tail stage by stage (docstring)")
    ap.add_argument("--orders", nargs="+", default=["amx32", "dp32"], choices=GEMM_ORDERS, help="--stages: GEMM orders")
    ap.add_argument("--gbs", type=int, nargs="+", default=None, help="rows (default 128; --stages: 1 8 32 128)")
    ap.add_argument("--h", type=int, default=2880)
    ap.add_argument("--v", type=int, default=25136)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="gbs 8, V 4096, 3 rounds (a smoke run)")
    a = ap.parse_args()
    if a.stages:
        a.gbs = a.gbs or [1, 8, 32, 128]
        if a.quick:
            a.gbs, a.v, a.rounds = [1, 8], 4096, 3
        stages_main(a)
        return
    a.gbs = (a.gbs or [128])[0]
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
