"""The bf16 all-to-all exchange vs an fp32 all-gather of the logits (vLLM V1), side by side;
then the whole vocab-parallel decode_tail with batch_groups G = 1 / 2 / 4 and fence on/off.

    python benchmarks/bench_exchange.py [--section all|exchange|overlap]
        exchange: [--gbs 32 --v 201088 --vtp 2 4 --rounds 8]
        overlap:  [--ov-gbs 32 64 --ov-h 2880 --ov-vs 25136 --ov-k 256 --ov-rounds 8]

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

Overlap section (VTP=2, one hop, 1 torch thread per rank): `decode_tail(..., group=WORLD,
batch_groups=G)` at G = 1, 2, 4 with sampling_params set, arms alternating in one spawned
job (palindromic order, flipped every round), barrier before each call, a call's time =
max over ranks; per round an arm's time is the mean of its two calls; reported: median
time, median paired ratio vs the baseline arm, rounds the arm beat the baseline. Every
call's outputs are checked bitwise against the arm's first call, and the arms' outputs
are all-gathered into global row order (owned_rows differs with G) and asserted bitwise
equal across arms. To separate the overlap from the cost of splitting the GEMM, the same
alternation times the parts: the GEMM alone over G row blocks (no collective), G blocking
all-to-alls alone, exchange_rows(G) (the overlapped path decode_tail runs) and a serial
emulation of it (each block's all-to-all waited before the next block's GEMM); the overlap
is what exchange_rows(G) saves over serial(G). fence=True vs False is timed the same way.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lmtail.exchange import exchange_rows
from lmtail.launch import launch
from lmtail.layout import owned_rows
from lmtail.tail import decode_tail, shard_logits


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


# ---------------------------------------------------------------------------------------
# overlap section: decode_tail with batch_groups G = 1 / 2 / 4 and fence, VTP = 2
# ---------------------------------------------------------------------------------------
def _timed(fn):
    """Barrier, call, max wall time over ranks. Returns (seconds, result)."""
    dist.barrier()
    t0 = time.perf_counter()
    res = fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt), res


def _alternate(arms, rounds, same):
    """Time each arm twice per round in palindromic order (flipped every round); the first
    (untimed) call of an arm is its reference and every timed result must satisfy
    same(reference, result). Returns ({name: reference}, {name: [per-round mean s]})."""
    names = list(arms)
    refs = {n: arms[n]() for n in names}  # warm-up + reference outputs
    times = {n: [] for n in names}
    for i in range(rounds):
        per = {n: [] for n in names}
        for n in (names + names[::-1]) if i % 2 == 0 else (names[::-1] + names):
            dt, res = _timed(arms[n])
            assert same(refs[n], res), f"arm {n}: a timed call's output differs bitwise from its first call"
            per[n].append(dt)
        for n in names:
            times[n].append(statistics.mean(per[n]))
    return refs, times


def _bits(t):
    """A tensor as int64 bit patterns (bf16 -> int16, fp32 -> int32 views), flattened to [rows, -1]."""
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype == torch.float32:
        t = t.view(torch.int32)
    return t.to(torch.int64).reshape(t.shape[0], -1)


def _tail_bits(out):
    """[R, 2k+3] int64: topk values / indices, token, logprob, truncated bit patterns."""
    return torch.cat([_bits(out.topk_values), _bits(out.topk_indices), _bits(out.tokens),
                      _bits(out.logprobs), _bits(out.truncated)], dim=1)


def _tail_same(a, b):
    return torch.equal(_tail_bits(a), _tail_bits(b)) and torch.equal(_bits(a.logits), _bits(b.logits))


def _global_rows(out, gbs, g_n):
    """All-gather this arm's per-rank outputs into global row order: [gbs, 2k+3] int64."""
    vtp, mine = dist.get_world_size(), _tail_bits(out)  # [R, 2k+3]
    parts = [torch.empty_like(mine) for _ in range(vtp)]
    dist.all_gather(parts, mine)
    glob = torch.empty((gbs, mine.shape[1]), dtype=torch.int64)  # [gbs, 2k+3]
    for r in range(vtp):
        glob[owned_rows(r, vtp, gbs, None, g_n)] = parts[r]
    return glob


def _inputs(rank, gbs, h, vs):
    """The same hidden/gamma/sampling params on every rank; rank r's own W shard [H, V_s]."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(gbs, h, generator=g)  # [gbs, H] fp32
    gamma = torch.rand(h, generator=g) + 0.5  # [H]
    u = torch.rand(gbs, generator=g)  # [gbs]
    sp = torch.stack([torch.full((gbs,), 50.0), torch.full((gbs,), 0.9), torch.full((gbs,), 0.8),
                      u, torch.full((gbs,), 0.02)], dim=1)  # [gbs, 5] top_k top_p temp u min_p
    w = (torch.randn(h, vs, generator=torch.Generator().manual_seed(1 + rank)) * 0.05).to(torch.bfloat16)
    return x, gamma, w, sp


def _serial_rows(row_logits, gbs, g_n):
    """exchange_rows(G) without the overlap: block g's all-to-all is waited before block
    g+1's GEMM. Same bytes out: ([R, V] bf16, [gbs, V_s] fp32)."""
    vtp, block = dist.get_world_size(), gbs // g_n
    recv, parts = [], []
    for g in range(g_n):
        lg = row_logits(slice(g * block, (g + 1) * block))  # [gbs/G, V_s]
        m = lg.to(torch.bfloat16).contiguous()
        out = torch.empty_like(m)
        dist.all_to_all_single(out, m)
        c = out.shape[1]
        recv.append(out.view(vtp, block // vtp, c).permute(1, 0, 2).reshape(block // vtp, vtp * c))
        parts.append(lg)
    return torch.cat(recv), torch.cat(parts)


def _parts_arms(x, gamma, w, gbs, groups):
    """GEMM alone, all-to-all alone, exchange_rows (overlapped) and serial, per G."""
    def row_logits(rows):
        return shard_logits(x, gamma, w, rows=rows)

    mirror = shard_logits(x, gamma, w).to(torch.bfloat16)  # [gbs, V_s]

    def gemm(g_n):
        return lambda: torch.cat([row_logits(slice(i * gbs // g_n, (i + 1) * gbs // g_n)) for i in range(g_n)])

    def a2a(g_n):
        def f():
            outs = []
            for blk in mirror.chunk(g_n):
                outs.append(torch.empty_like(blk))
                dist.all_to_all_single(outs[-1], blk.contiguous())
            return torch.cat(outs)
        return f

    arms = {}
    for g_n in groups:
        arms[f"gemm G={g_n}"], arms[f"a2a G={g_n}"] = gemm(g_n), a2a(g_n)
        arms[f"overlap G={g_n}"] = lambda g_n=g_n: exchange_rows(row_logits, gbs=gbs, batch_groups=g_n)
        if g_n > 1:
            arms[f"serial G={g_n}"] = lambda g_n=g_n: _serial_rows(row_logits, gbs, g_n)
    return arms


def _pair_bits(a, b):
    """Bitwise equality of two results that are a tensor or a tuple of tensors."""
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return len(a) == len(b) and all(torch.equal(_bits(p), _bits(q)) for p, q in zip(a, b))


def _overlap_job(rank, gbs, h, vs, k, rounds, groups):
    vtp = dist.get_world_size()
    x, gamma, w, sp = _inputs(rank, gbs, h, vs)
    kw = dict(k=k, group=dist.group.WORLD)

    def tail(g_n, fence=False):
        rows = sp[owned_rows(rank, vtp, gbs, None, g_n)]  # [R, 5] in receive order
        return lambda: decode_tail(x, gamma, w, sampling_params=rows, batch_groups=g_n, fence=fence, **kw)

    refs, t_g = _alternate({f"G={g}": tail(g) for g in groups}, rounds, _tail_same)
    glob = {n: _global_rows(o, gbs, int(n[2:])) for n, o in refs.items()}
    base = f"G={groups[0]}"
    assert all(torch.equal(glob[base], glob[n]) for n in glob), "arms differ bitwise across G"
    assert all(torch.equal(_bits(refs[base].logits), _bits(o.logits)) for o in refs.values())
    prefs, t_p = _alternate(_parts_arms(x, gamma, w, gbs, groups), max(2, rounds // 2), _pair_bits)
    for g_n in groups[1:]:
        assert _pair_bits(prefs[f"overlap G={g_n}"], prefs[f"serial G={g_n}"]), "serial emulation bytes"
        assert _pair_bits(prefs[f"overlap G={g_n}"][1], prefs[f"overlap G={groups[0]}"][1]), "logits bytes"
    frefs, t_f = _alternate({"fence=False": tail(groups[0]), "fence=True": tail(groups[0], True)},
                            rounds, _tail_same)
    assert _tail_same(frefs["fence=False"], frefs["fence=True"]), "fence changed an output"
    return t_g, t_p, t_f


def _row(name, ts, base, note=""):
    """One table line: median ms, median paired ratio ts/base, rounds ts was faster."""
    ratios = [t / b for t, b in zip(ts, base)]
    won = f"{sum(r < 1 for r in ratios)}/{len(ratios)}" if ts is not base else "-"
    return f"  {name:<28} {1e3 * statistics.median(ts):>9.1f} {statistics.median(ratios):>7.3f} {won:>6}  {note}"


def _print_overlap(gbs, vtp, vs, t_g, t_p, t_f, groups):
    a2a_b = gbs * vs * (vtp - 1) * 2 // vtp
    g1 = groups[0]
    print(f"gbs={gbs}: R={gbs // vtp} rows/rank, a2a {a2a_b:,} B received per rank; "
          f"outputs bitwise equal across all arms (asserted)")
    print(f"  {'arm':<28} {'median ms':>9} {'ratio':>7} {'won':>6}  ratio vs")
    for name, ts in t_g.items():
        print(_row("decode_tail " + name, ts, t_g[f"G={g1}"], f"decode_tail G={g1}"))
    for name, ts in t_f.items():
        print(_row(f"decode_tail G={g1} " + name, ts, t_f["fence=False"], "fence=False"))
    print(f"  parts ({len(next(iter(t_p.values())))} rounds):")
    for name, ts in t_p.items():
        ref = {"gemm": f"gemm G={g1}", "a2a": f"a2a G={g1}"}.get(name.split()[0], f"overlap G={g1}")
        print(_row(name, ts, t_p[ref], ref))
    for g_n in groups[1:]:
        ov, se = t_p[f"overlap G={g_n}"], t_p[f"serial G={g_n}"]
        saved = statistics.median([s - o for s, o in zip(se, ov)])
        print(_row(f"overlap/serial G={g_n}", ov, se, f"serial G={g_n}; overlap saved "
                   f"{1e3 * saved:.1f} ms (median)"))


def overlap_section(gbs_list, h, vs, k, rounds, groups=(1, 2, 4)):
    vtp = 2
    print(f"\ndecode_tail over VTP={vtp} gloo ranks (1 thread each), H={h} V_s={vs} V={vtp * vs} "
          f"k={k}, sampling on; {rounds} rounds, arms alternated; time = max over ranks; ratio = "
          f"median paired per-round ratio; won = rounds faster than the reference")
    for gbs in gbs_list:
        t_g, t_p, t_f = launch(_overlap_job, vtp, args=(gbs, h, vs, k, rounds, tuple(groups)),
                               timeout_s=300, threads=1)[0]
        _print_overlap(gbs, vtp, vs, t_g, t_p, t_f, groups)


def exchange_section(a):
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



def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gbs", type=int, default=32)
    ap.add_argument("--v", type=int, default=201088)  # GPT-OSS vocab (padded), divisible by 8
    ap.add_argument("--vtp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--section", choices=("all", "exchange", "overlap"), default="all")
    ap.add_argument("--ov-gbs", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--ov-h", type=int, default=2880)  # GPT-OSS hidden
    ap.add_argument("--ov-vs", type=int, default=25136)  # V_s per rank (V = 2 * V_s)
    ap.add_argument("--ov-k", type=int, default=256)
    ap.add_argument("--ov-rounds", type=int, default=8)
    a = ap.parse_args()
    if a.section != "overlap":
        exchange_section(a)
    if a.section != "exchange":
        overlap_section(a.ov_gbs, a.ov_h, a.ov_vs, a.ov_k, a.ov_rounds)



if __name__ == "__main__":
    main()
