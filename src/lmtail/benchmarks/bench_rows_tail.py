"""Speed and peak memory of the decode tail after the exchange: lmtail.tail.compose.rows_tail's fused
path vs torch.topk alone, a sort-based torch sampler and rows_tail's reference path, A-B-B-A
in one process.

Shape legend: rows [R, V] bf16 (R = gbs on one rank), k = 256 candidates, sp [R, 5] fp32.
  base       torch.topk(rows, 256)                     (no sampling at all)
  fused      rows_tail(rows, k=256, sampling_params=sp, path="fused")   (the C kernel)
  sort       a sort-based top-k/top-p sampler in torch: fp32 logits / T, a stable full-row
             sort, top-k mask, softmax, cumsum top-p mask, renormalize, inverse-cdf draw at u
  reference  rows_tail(..., path="reference") (exact_topk + sample_rows), the declared reference
Mixes: "k50 p0.9 T0.8" (top_k=50, top_p=0.9, T=0.8, seeded u) and "k-off p0.95" (top-k off,
top_p=0.95, T=1, seeded u). Checks before timing: fused == reference bitwise (every output);
fused's top-k == torch.topk's values bitwise; the sort sampler's first 256 sorted ids/values
== fused's bitwise and its tokens equal fused's on >= 90% of the rows fused does not flag
truncated (fp32 softmax vs the declared float64 one: near-ties may differ). Ratio = median paired time / torch.topk's (< 1: faster).
Peak memory: the extra resident peak of one call in a fresh process, beyond the rows.

    .venv/bin/python -m lmtail.benchmarks.bench_rows_tail                 # the full table
    .venv/bin/python -m lmtail.benchmarks.bench_rows_tail --gbs 128 --v 201088 --rounds 7
    .venv/bin/python -m lmtail.benchmarks.bench_rows_tail --quick         # a smoke run
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from lmtail.bench import abba, assert_bitwise, format_table
from lmtail.numerics import draw_u
from lmtail.tail.sampler import COL, SAMPLING_COLUMNS
from lmtail.tail.compose import rows_tail

K = 256
MIXES = {"k50 p0.9 T0.8": (50, 0.9, 0.8), "k-off p0.95": (0, 0.95, 1.0)}
FIELDS = ("topk_values", "topk_indices", "tokens", "logprobs", "truncated")


def make_rows(R: int, V: int, seed: int = 0) -> torch.Tensor:
    """[R, V] bf16 logit-like rows: a N(0, 2^2) bulk plus 16 peaked tokens at 14..18 (most
    of the mass, as in a real LM's row), built row by row (no [R, V] fp32 temporary)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.empty(R, V, dtype=torch.bfloat16)
    for i in range(R):
        x = torch.randn(V, generator=g) * 2.0
        x[torch.randint(V, (16,), generator=g)] = 14.0 + 4.0 * torch.rand(16, generator=g)
        rows[i] = x.to(torch.bfloat16)
    return rows


def make_params(R: int, mix: str) -> torch.Tensor:
    """[R, 5] fp32: the mix's (top_k, top_p, T), u = draw_u(seed=row, position=7), min_p 0."""
    top_k, top_p, t = MIXES[mix]
    u = torch.from_numpy(draw_u(range(R), 7)).double()
    rows = [{"top_k": top_k, "top_p": top_p, "temperature": t, "u": float(u[i]), "min_p": 0.0} for i in range(R)]
    return torch.tensor([[r[c] for c in SAMPLING_COLUMNS] for r in rows], dtype=torch.float32)


def sort_sampler(rows: torch.Tensor, sp: torch.Tensor):
    """The usual torch sampler (fp32): returns (tokens [R], sorted ids [R, V], values [R, V])."""
    vals, ids = torch.sort(rows, dim=-1, descending=True, stable=True)  # [R, V] ties: lower id
    top_k, top_p, t, u = sp[:, COL.top_k].long(), sp[:, COL.top_p], sp[:, COL.temperature], sp[:, COL.u]
    z = vals.float() / t[:, None]  # [R, V]
    pos = torch.arange(rows.shape[1])
    kth = torch.where(top_k > 0, top_k - 1, torch.full_like(top_k, rows.shape[1] - 1))
    z = z.masked_fill(pos[None, :] > kth[:, None], float("-inf"))
    p = torch.softmax(z, dim=-1)
    c = torch.cumsum(p, dim=-1)
    p = p.masked_fill((c - p) >= top_p[:, None], 0.0)
    c = torch.cumsum(p, dim=-1)
    slot = (c / c[:, -1:] <= u[:, None]).sum(dim=-1).clamp(max=rows.shape[1] - 1)
    slot = torch.minimum(slot, (p > 0).sum(dim=-1) - 1)
    return ids.gather(1, slot[:, None])[:, 0], ids, vals


def _as_dict(out) -> dict:
    return {f: getattr(out, f) for f in FIELDS}


def fused(rows: torch.Tensor, sp: torch.Tensor):
    return rows_tail(rows, k=K, sampling_params=sp, path="fused")


def reference(rows: torch.Tensor, sp: torch.Tensor):
    return rows_tail(rows, k=K, sampling_params=sp, path="reference")


def case(R: int, V: int, mix: str, rounds: int):
    rows = make_rows(R, V, seed=V + R)
    sp = make_params(R, mix)
    want = _as_dict(fused(rows, sp))

    def check(name, out, base_out):
        if name == "fused":
            assert_bitwise(out.topk_values, base_out.values, what="fused vs torch.topk values")
            assert_bitwise(_as_dict(out), _as_dict(reference(rows, sp)), what="fused vs reference")
        elif name == "reference":
            assert_bitwise(_as_dict(out), want, what="reference vs fused")
        elif name == "sort":
            tok, ids, vals = out
            assert_bitwise(ids[:, :K].contiguous(), want["topk_indices"], what="sort ids")
            assert_bitwise(vals[:, :K].contiguous(), want["topk_values"], what="sort values")
            full = ~want["truncated"]  # rows whose exact answer the k candidates hold
            agree = (tok == want["tokens"])[full].double().mean().item() if full.any() else 1.0
            assert agree >= 0.9, f"sort sampler tokens agree with fused on {agree:.0%} < 90% of rows"

    arms = {"torch.topk": lambda: torch.topk(rows, K),
            "fused": lambda: fused(rows, sp),
            "sort": lambda: sort_sampler(rows, sp),
            "reference": lambda: reference(rows, sp)}
    return abba(arms, base="torch.topk", rounds=rounds, check=check)


# VmHWM (the address space's resident high-water mark) starts fresh at exec, unlike
# ru_maxrss, which a child inherits from its parent's peak.
_MEM_CHILD = r"""
import json, sys, torch
def hwm_kib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
sys.path.insert(0, {bench_dir!r})
import bench_rows_tail as b
R, V, arm = {R}, {V}, {arm!r}
rows = b.make_rows(R, V); sp = b.make_params(R, "k-off p0.95")
f = {{"torch.topk": lambda: torch.topk(rows, b.K), "fused": lambda: b.fused(rows, sp),
     "sort": lambda: b.sort_sampler(rows, sp), "reference": lambda: b.reference(rows, sp)}}[arm]
if arm == "fused": b.rows_tail(rows[:1, :300], k=8, path="fused")  # build/load the kernel first
before = hwm_kib()
out = f()
after = hwm_kib()
print(json.dumps({{"extra_mib": (after - before) / 1024.0, "rows_mib": rows.numel() * 2 / 2**20}}))
"""


def peak_memory(R: int, V: int) -> str:
    """Markdown table: each arm's extra peak RSS in a fresh process (top-k-off mix)."""
    from pathlib import Path

    lines = [f"### peak memory beyond the rows, one call, [R={R}, V={V}] bf16, k={K}", "",
             "| arm | extra peak RSS | rows themselves |", "|---|---:|---:|"]
    for arm in ("torch.topk", "fused", "sort", "reference"):
        code = _MEM_CHILD.format(bench_dir=str(Path(__file__).parent), R=R, V=V, arm=arm)
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        got = json.loads(res.stdout.strip().splitlines()[-1])
        lines.append(f"| {arm} | {got['extra_mib']:.1f} MiB | {got['rows_mib']:.1f} MiB |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gbs", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--v", type=int, nargs="+", default=[49152, 201088])
    p.add_argument("--mix", nargs="+", default=list(MIXES), choices=list(MIXES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory table")
    p.add_argument("--quick", action="store_true", help="gbs 8, V 49152, 3 rounds (a smoke run)")
    args = p.parse_args()
    if args.quick:
        args.gbs, args.v, args.rounds = [8], [49152], 3
    results = {}
    for V in args.v:
        for R in args.gbs:
            for mix in args.mix:
                results[f"gbs={R} V={V} {mix}"] = case(R, V, mix, args.rounds)
    print(format_table(results, title=f"rows_tail after the exchange, k={K}, {torch.get_num_threads()} "
                       f"thread(s); ratio = time / torch.topk(rows, {K})'s"))
    if not args.no_memory:
        print(peak_memory(max(args.gbs), max(args.v)))


if __name__ == "__main__":
    main()
