"""The bf16 all-to-all exchange vs an fp32 all-gather of the logits (vLLM V1), side by side.

    python benchmarks/bench_exchange.py [--gbs 32 --v 201088 --vtp 2 4 --rounds 8]

Both arms start from the same [gbs, V_s] fp32 shard logits on every rank:
  A  lmtail: bf16 mirror, one all-to-all (exchange.exchange_rows) -> [R, V] owned rows;
  B  vLLM V1: all-gather the fp32 shards -> every rank holds [gbs, V] (then re-laid out
     to vocab order), the way vLLM's LogitsProcessor gathers before sampling.
Bytes a rank RECEIVES from its peers, analytically (one hop):
  A = R * V_s * (VTP - 1) * 2 = gbs * V_s * (VTP - 1) * 2 / VTP,  B = gbs * V_s * (VTP - 1) * 4,
  so B / A = 2 * VTP; and counted, by wrapping the collectives and adding up the peer
slabs of every output they fill. Wall time: arms alternate (A B B A ...) in one set of
gloo ranks; each arm's time per round is the max over ranks (barrier before each arm),
and the median of the per-round ratios B / A is reported with how many rounds A won.
CPU gloo over localhost: the ratios, not the absolute times, are the result.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lmtail.exchange import exchange_rows
from lmtail.launch import launch


def analytic(gbs, v, vtp):
    """(bytes received per rank by A, by B)."""
    vs = v // vtp
    return gbs * vs * (vtp - 1) * 2 // vtp, gbs * vs * (vtp - 1) * 4


class Counter:
    """Wraps dist.all_to_all_single / all_gather_single; counts peer bytes received."""

    def __init__(self):
        self.bytes = 0
        self.a2a, self.ag = dist.all_to_all_single, dist.all_gather_single

    def __enter__(self):
        def a2a(out, inp, *a, group=None, **kw):
            n = dist.get_world_size(group)
            self.bytes += out.nbytes - out.nbytes // n  # every slab but this rank's own
            return self.a2a(out, inp, *a, group=group, **kw)

        def ag(out, inp, *a, group=None, **kw):
            n = dist.get_world_size(group)
            self.bytes += out.nbytes - out.nbytes // n
            return self.ag(out, inp, *a, group=group, **kw)

        dist.all_to_all_single, dist.all_gather_single = a2a, ag
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single, dist.all_gather_single = self.a2a, self.ag


def arm_a2a(logits, gbs):
    recv, _ = exchange_rows(lambda rows: logits[rows], gbs=gbs)  # [R, V] bf16
    return recv


def arm_allgather(logits, gbs):
    vtp = dist.get_world_size()
    out = torch.empty((vtp * gbs, logits.shape[1]), dtype=torch.float32)  # [VTP*gbs, V_s]
    dist.all_gather_single(out, logits.contiguous())
    return out.view(vtp, gbs, -1).permute(1, 0, 2).reshape(gbs, -1)  # [gbs, V] vocab order


def _rank_job(rank, gbs, v, rounds):
    vtp = dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    logits = torch.randn(gbs, v // vtp, generator=g)  # [gbs, V_s] fp32
    counted = []
    for arm in (arm_a2a, arm_allgather):
        with Counter() as c:
            arm(logits, gbs)
        counted.append(c.bytes)
    times = {arm_a2a: [], arm_allgather: []}
    order = [arm_a2a, arm_allgather, arm_allgather, arm_a2a]
    for i in range(rounds):
        for arm in order if i % 2 == 0 else order[1:3] + [order[0], order[3]]:
            dist.barrier()
            t0 = time.perf_counter()
            arm(logits, gbs)
            dt = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            times[arm].append(float(dt))
    a = [statistics.mean(times[arm_a2a][2 * i:2 * i + 2]) for i in range(rounds)]
    b = [statistics.mean(times[arm_allgather][2 * i:2 * i + 2]) for i in range(rounds)]
    return counted, a, b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--v", type=int, default=201088)  # GPT-OSS vocab (padded), divisible by 8
    ap.add_argument("--vtp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args()
    print(f"gbs={a.gbs} V={a.v}  bytes = received per rank from peers; time = median paired "
          f"ratio over {a.rounds} rounds (gloo, localhost)")
    print(f"{'VTP':>4} {'a2a bf16 B':>12} {'counted':>12} {'ag fp32 B':>12} {'counted':>12} "
          f"{'bytes ag/a2a':>12} {'a2a ms':>8} {'ag ms':>8} {'time ag/a2a':>11} {'a2a won':>8}")
    for vtp in a.vtp:
        (counted_a, counted_b), ta, tb = launch(_rank_job, vtp, args=(a.gbs, a.v, a.rounds),
                                               timeout_s=300, threads=1)[0]
        an_a, an_b = analytic(a.gbs, a.v, vtp)
        ratios = [y / x for x, y in zip(ta, tb)]
        print(f"{vtp:>4} {an_a:>12,} {counted_a:>12,} {an_b:>12,} {counted_b:>12,} {an_b / an_a:>12.2f} "
              f"{1e3 * statistics.median(ta):>8.2f} {1e3 * statistics.median(tb):>8.2f} "
              f"{statistics.median(ratios):>11.2f} {sum(r > 1 for r in ratios):>4}/{len(ratios)}")
    for gbs, vtp in ((128, 8), (64, 16)):
        an_a, an_b = analytic(gbs, a.v, vtp)
        print(f"analytic only, gbs={gbs} VTP={vtp}: a2a {an_a:,} B vs all-gather {an_b:,} B "
              f"per rank ({an_b / an_a:.0f}x)")


if __name__ == "__main__":
    main()
