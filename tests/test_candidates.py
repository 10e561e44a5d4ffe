"""decode_tail(exchange="candidates"): the shard top-(k+1) + chunk-partials exchange.

Checked here, every comparison on bits (integer views):
  * one rank: top-k values/ids, the taps (outside, has_outside, m1, S1, mT, ST, nans) and
    the logprobs are bitwise lmtail.reference.candidates.candidates_emulation of the fp32
    logits (emit_logits), over V < 256 (empty chunks), V not a multiple of 256, k = V,
    ties, +-0, +-inf, NaN (nan_fold), all -inf / all +inf rows and every sampler mode;
  * VTP shards in one process (candidates.shard_partials -> pack -> unpack -> merge, the
    bytes the exchange carries): the merge of any VTP dividing 256 is the emulation's;
  * ranks: spawned gloo jobs (lmtail.launch) over the layouts of tests/test_exchange.py,
    gathered with layout.owned_rows, bitwise the single-rank call (a 2-rank job in the
    default suite; the 8-rank job, with a 3-rank group refused before any collective, is
    marked slow);
  * errors, and planted wrong variants (VTP-dependent chunk bounds, a candidate list cut
    short, chunk partials combined out of order) that the same comparisons show red;
  * the payload per row against the bf16 mirror's.

Shape legend: R rows, gbs global rows, H hidden, V vocab, V_s = V / VTP, k candidates,
C = 256 mass chunks.
"""
from __future__ import annotations

import re
import time
from dataclasses import replace
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import bits, gather_rows as gather, same_bits
from lmtail.tail import candidates
from lmtail.contract.exchange_kinds import special_logits_data
from lmtail.launch import launch
from lmtail.tail.layout import owned_rows
from lmtail.numerics import log64
from lmtail.reference.candidates import MASS_CHUNKS, candidates_emulation, declared_bounds
from lmtail.reference.tail import topk_ref
from lmtail.tail.compose import decode_tail

H = 48
TAPS = ("outside", "has_outside", "m1", "S1", "mT", "ST", "nans")
MASSES = ("m1", "S1", "mT", "ST")
FIELDS = ("topk_values", "topk_indices", "tokens", "logprobs", "truncated")
INF = float("inf")


# ---------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------
def sampling(g, gbs, k, cols=5):
    """[gbs, cols] fp32 params covering greedy, top-k off/on/> k, top-p, min-p, T = 1 and not."""
    pick = lambda vals: torch.tensor(vals, dtype=torch.float32)[torch.randint(0, len(vals), (gbs,), generator=g)]
    sp = torch.stack([pick([-1.0, 0.0, 1.0, 3.0, k, k + 2]), pick([1.0, 0.9, 0.5, 0.2]),
                      pick([0.0, 0.7, 1.0, 1.3]), torch.rand(gbs, generator=g) * 0.999,
                      pick([0.0, 0.1])], 1).to(torch.float32)
    sp[0::6, 0], sp[0::6, 2] = 0.0, 1.3  # every mode on some row: the T pass (top-k off, T != 1)
    sp[1::6, 0], sp[1::6, 2] = -1.0, 0.7
    sp[2::6, 0], sp[2::6, 2] = 0.0, 1.0  # top-k off at T = 1
    sp[3::6, 2] = 0.0  # greedy
    return sp[:, :cols].contiguous()


def random_inputs(seed, gbs, v, *, k, distinct=None, sp_cols=5):
    """(hidden [gbs, H] fp32, gamma [H], W [H, V] bf16, sp [gbs, sp_cols] | None); distinct:
    W has only that many different columns, so logits tie everywhere (also at the top)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, H, generator=g) * 2
    gamma = torch.rand(H, generator=g) + 0.5
    if distinct:
        base = torch.randn(H, distinct, generator=g) * 0.2
        w = base[:, torch.randint(0, distinct, (v,), generator=g)]
    else:
        w = torch.randn(H, v, generator=g) * 0.2
    sp = sampling(g, gbs, k, sp_cols) if sp_cols else None
    return x, gamma, w.to(torch.bfloat16).contiguous(), sp


def special_inputs(seed, gbs, v, *, k, sp_cols=5, all_inf=False):
    """Inputs whose logits (gemm_order "chain", IEEE subnormals) hold +-inf, NaN, +0, -0 and
    ties: the contract's construction (contract.exchange_kinds.special_logits_data: lane 0
    +-4 by row, lane 1 2**-16; columns c % 8 == 0 +-inf, 1 NaN or -inf, 2 +0, 3 -0, 4 a tie
    with column 5; all_inf: rows of all +inf or all -inf), with this file's sampling rows."""
    d = special_logits_data(seed, gbs, v, k=k, nan_fold=False, sampled=False, all_inf=all_inf)
    g = torch.Generator().manual_seed(seed + 1)
    sp = sampling(g, gbs, k, sp_cols) if sp_cols else None
    assert d["w"].shape[0] == H
    return d["x"], d["gamma"], d["w"].contiguous(), sp


def t_pass(sp) -> np.ndarray | None:
    """[R] float64: the row's T where the sampler normalizes over the whole row at T != 1
    (top-k off, sampled: T >= 1e-5 after the exact fp32 widening), else 0 (sampler semantics)."""
    if sp is None:
        return None
    t = sp[:, 2].double()
    on = (sp[:, 0] <= 0) & (t >= 1e-5) & (t != 1.0)
    return torch.where(on, t, torch.zeros_like(t)).numpy()


# ---------------------------------------------------------------------------------------
# the comparison (green for the real thing, red for the planted variants)
# ---------------------------------------------------------------------------------------
def _t(a) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def mismatches(got: dict, want: dict, *, mass_rows=None) -> list[str]:
    """The names of the fields of got (torch tensors) whose bits differ from want (the
    emulation's numpy arrays); masses compared on mass_rows [R] bool only (None: all)."""
    bad = []
    for name, g in got.items():
        if g is None:
            continue
        w = _t(want[name])
        if name in MASSES and mass_rows is not None:
            g, w = g[mass_rows], w[torch.from_numpy(mass_rows)]
        if not same_bits(g.contiguous(), w):
            bad.append(name)
    return bad


def op_view(out) -> dict:
    """A TailOutput's candidates fields under the emulation's names."""
    got = {"values": out.topk_values, "ids": out.topk_indices}
    got.update({n: out.taps.get(n) for n in TAPS})
    return got


def emulate(logits, sp, *, k, nan_fold, **kw) -> dict:
    return candidates_emulation(logits, k=k, nan_fold=nan_fold, temperatures=t_pass(sp), **kw)


def mass_rows_of(want, nan_fold):
    return None if nan_fold else want["nans"] == 0


def expected_logprobs(logits, tokens, want) -> torch.Tensor:
    """[R] fp32: fp32(v_tok - (m1 + log64(S1))), the declared raw logprob from the emulation."""
    lse1 = _t(want["m1"]) + log64(_t(want["S1"]))
    v_tok = logits.double().gather(1, tokens[:, None])[:, 0]
    return (v_tok - lse1).to(torch.float32)


def check_single(x, gamma, w, sp, *, k, nan_fold=False, **kw):
    """One-rank candidates decode_tail on these inputs, checked bitwise against the emulation."""
    out = decode_tail(x, gamma, w, k=k, sampling_params=sp, nan_fold=nan_fold, exchange="candidates",
                      debug_taps=True, **kw)
    want = emulate(out.logits, sp, k=k, nan_fold=nan_fold)
    assert out.topk_values.dtype == torch.float32
    assert mismatches(op_view(out), want, mass_rows=mass_rows_of(want, nan_fold)) == []
    if sp is None:
        assert out.tokens is None and out.taps["nans"] is None and "m1" not in out.taps
        return out, want
    assert all(out.taps.get(n) is not None for n in TAPS), sorted(out.taps)
    assert same_bits(out.logprobs, expected_logprobs(out.logits, out.tokens, want))
    greedy = sp[:, 2] < 1e-5
    assert torch.equal(out.tokens[greedy], out.topk_indices[greedy, 0])
    assert not bool(out.truncated[greedy].any())
    assert bool((out.topk_indices == out.tokens[:, None]).any(dim=1).all())  # a candidate per row
    return out, want


# ---------------------------------------------------------------------------------------
# one rank vs the emulation
# ---------------------------------------------------------------------------------------
SINGLE = [  # (seed, gbs, V, k, distinct columns, sp columns)
    (0, 24, 104, 5, None, 5),  # V < 256: empty chunks, widths 0/1
    (1, 16, 104, 104, None, 5),  # k = V: no lane outside
    (2, 24, 300, 7, None, 4),  # V not a multiple of 256: widths 1/2
    (3, 24, 1000, 16, 6, 5),  # ties everywhere (6 distinct columns), widths 3/4
    (4, 16, 2048, 5, None, 3),  # V a multiple of 256: width 8; [R, 3] params
    (5, 16, 37, 37, 3, 5),  # V < 256, k = V, ties
    (6, 16, 512, 1, None, 5),  # k = 1
]


@pytest.mark.parametrize("seed, gbs, v, k, distinct, sp_cols", SINGLE)
def test_single_rank_is_the_emulation(seed, gbs, v, k, distinct, sp_cols):
    x, gamma, w, sp = random_inputs(seed, gbs, v, k=k, distinct=distinct, sp_cols=sp_cols)
    out, want = check_single(x, gamma, w, sp, k=k)
    check_single(x, gamma, w, None, k=k)  # top-k only
    # the merged top-k is the exact fp32 top-k (an independent sort)
    rv, ri = topk_ref(out.logits, k)
    assert np.array_equal(ri, want["ids"]) and np.array_equal(rv.astype(np.float32), want["values"])
    assert bool(_t(want["has_outside"]).all()) == (k < v)
    if distinct and k < v:  # ties reach the top-k threshold and past slot k
        assert bool((out.topk_values[:, -1] == out.taps["outside"]).any())
    assert bool((out.taps["ST"] != 0).any()) and bool((out.taps["ST"] == 0).any())  # T pass on some rows


@pytest.mark.parametrize("special", [False, True])
def test_all_greedy_batches_are_the_emulation(special, monkeypatch):
    """A batch whose rows are ALL greedy takes sample_merged's slot-0 read (no filtered
    distribution): bitwise the emulation's sampler on random and special (inf / NaN folded /
    ties) rows. Planted: the slot-0 read taking slot 1's value for the logprob is red."""
    v, k = 296, 9
    x, gamma, w, sp = (special_inputs(40, 24, v, k=k) if special else random_inputs(41, 24, v, k=k))
    sp = sp.clone()
    sp[:, 2] = 0.0  # every row greedy
    kw = dict(nan_fold=True, gemm_order="chain") if special else {}
    out, want = check_single(x, gamma, w, sp, k=k, **kw)
    real = candidates.MergedStats.lse1
    monkeypatch.setattr(candidates.MergedStats, "lse1", lambda st: real(st) + (st.mg.values[:, 0].double()
                                                                               - st.mg.values[:, 1].double()))
    real_stats = candidates.kernel.owner_stats

    def slot1_stats(keys, mass):  # the C kernel's slot-0 logprob read off slot 1
        got = real_stats(keys, mass)
        if got is None or got[3] is None:
            return got
        vals, ids, stats, lp0, ok = got
        return vals, ids, stats, (vals[:, 1].double() - stats[4]).to(torch.float32), ok

    monkeypatch.setattr(candidates.kernel, "owner_stats", slot1_stats)
    bad = decode_tail(x, gamma, w, k=k, sampling_params=sp, exchange="candidates", debug_taps=True, **kw)
    assert not same_bits(bad.logprobs, out.logprobs)


@pytest.mark.parametrize("v, k", [(104, 5), (104, 104), (40, 3), (296, 9)])
def test_single_rank_special_values(v, k):
    x, gamma, w, sp = special_inputs(7 + v, 24, v, k=k)
    out, want = check_single(x, gamma, w, sp, k=k, nan_fold=True, gemm_order="chain")
    lg = out.logits
    assert bool(torch.isnan(lg).any() and (lg == INF).any() and (lg == -INF).any())
    assert bool(((lg == 0) & (bits(lg) < 0)).any() and ((lg == 0) & (bits(lg) == 0)).any()), "+0 and -0"
    assert bool((out.taps["nans"] > 0).any()) and bool((out.taps["m1"] == INF).any())
    # without sampling, NaN need not be folded: the top-k then orders NaN by its bits
    out2 = decode_tail(x, gamma, w, k=k, exchange="candidates", debug_taps=True, gemm_order="chain")
    assert mismatches(op_view(out2), emulate(out2.logits, None, k=k, nan_fold=False)) == []
    # no -0 comes back: -0 reads +0
    assert not bool(((out.topk_values == 0) & (bits(out.topk_values) < 0)).any())


@pytest.mark.parametrize("nan_fold", [False, True])
def test_single_rank_all_inf_rows(nan_fold):
    x, gamma, w, sp = special_inputs(3, 16, 104, k=5, all_inf=True)
    out, want = check_single(x, gamma, w, sp, k=5, nan_fold=nan_fold, gemm_order="chain")
    neg = x[:, 0] < 0
    assert bool(neg.any() and (~neg).any())
    assert bool((out.logits[neg] == -INF).all() and (out.logits[~neg] == INF).all())
    assert torch.equal(out.taps["m1"], torch.where(neg, -INF, INF).double())
    assert bool((out.taps["S1"] == 104.0).all())  # every lane a term of exactly 1


# ---------------------------------------------------------------------------------------
# VTP shards in one process: the bytes the exchange carries, merged
# ---------------------------------------------------------------------------------------
def shard_merge(logits, vtp, *, k, nan_fold, sp, cut=None):
    """The owner's Merged for full rows logits [R, V] split over vtp shards: each shard's
    partials packed, the slabs side by side in rank order (what the exchange delivers),
    unpacked and merged. cut: keys [n, k1] -> keys [n, k1], a planted wrong shard list."""
    r, v = logits.shape
    vs = v // vtp
    slabs = []
    for rank in range(vtp):
        p = candidates.shard_partials(logits[:, rank * vs:(rank + 1) * vs].contiguous(), col0=rank * vs, v=v, k=k,
                                      nan_fold=nan_fold, sp=sp)
        if cut is not None:
            p = replace(p, keys=cut(p.keys))
        slabs.append(candidates.pack(p))
    recv = torch.cat(slabs, dim=1)  # [R, VTP*B]
    assert recv.shape[1] == vtp * candidates.payload_bytes(k, vtp, sp is not None)
    return candidates.merge(candidates.unpack(recv, vtp=vtp, k=k, sp=sp), k=k)


def merged_view(mg) -> dict:
    got = {"values": mg.values, "ids": mg.ids, "outside": mg.outside, "has_outside": mg.has_outside,
           "nans": mg.nans}
    if mg.mass is not None:
        got.update(zip(MASSES, mg.mass))
    return got


def special_logits(seed, r, v) -> torch.Tensor:
    """[r, v] fp32 rows with every special value, ties and sign-mixed zeros."""
    g = torch.Generator().manual_seed(seed)
    lg = torch.randn(r, v, generator=g) * 3
    lg = torch.where(torch.rand(r, v, generator=g) < 0.3, torch.round(lg), lg)  # ties
    specials = torch.tensor([float("nan"), INF, -INF, 0.0, -0.0, 1e-40, -1e-40, 3e38])
    mask = torch.rand(r, v, generator=g) < 0.1
    lg[mask] = specials[torch.randint(0, len(specials), (int(mask.sum()),), generator=g)]
    lg[0] = -INF
    lg[1, 5:] = -INF
    return lg


@pytest.mark.parametrize("v, vtps, k", [(104, (1, 2, 4, 8), 5), (104, (2, 8), 20), (1000, (1, 8), 3),
                                        (512, (256,), 4), (2048, (4, 8), 64)])
def test_shards_merge_to_the_emulation(v, vtps, k):
    g = torch.Generator().manual_seed(v + k)
    lg = torch.randn(12, v, generator=g) * 3
    lg[:, : v // 2] = torch.round(lg[:, : v // 2])  # ties
    sp = sampling(g, 12, k)
    want = emulate(lg, sp, k=k, nan_fold=False)
    for vtp in vtps:
        assert mismatches(merged_view(shard_merge(lg, vtp, k=k, nan_fold=False, sp=sp)), want) == [], vtp
        top = shard_merge(lg, vtp, k=k, nan_fold=False, sp=None)  # keys only
        assert top.mass is None and mismatches(merged_view(top), want) == [], vtp


def test_shards_merge_special_values():
    lg = special_logits(11, 16, 104)
    g = torch.Generator().manual_seed(1)
    sp = sampling(g, 16, 6)
    for nan_fold in (True, False):
        want = emulate(lg, sp, k=6, nan_fold=nan_fold)
        for vtp in (1, 2, 8):
            mg = shard_merge(lg, vtp, k=6, nan_fold=nan_fold, sp=sp)
            assert mismatches(merged_view(mg), want, mass_rows=mass_rows_of(want, nan_fold)) == [], (vtp, nan_fold)
    # and the sampler on the merge of 8 shards is the one-rank sampler's, byte for byte
    one = candidates.sample_merged(shard_merge(lg, 1, k=6, nan_fold=True, sp=sp), sp, nan_fold=True)
    eight = candidates.sample_merged(shard_merge(lg, 8, k=6, nan_fold=True, sp=sp), sp, nan_fold=True)
    assert all(same_bits(a, b) for a, b in zip(one, eight))


# ---------------------------------------------------------------------------------------
# planted wrong variants: the same comparisons go red
# ---------------------------------------------------------------------------------------
def rank_local_bounds(v: int, vtp: int) -> np.ndarray:
    """A WRONG chunking that moves with VTP: each rank cuts its V_s columns into C / VTP
    chunks of width ceil(V_s / (C / VTP)) (the last ones short or empty)."""
    vs, c = v // vtp, MASS_CHUNKS // vtp
    w = -(-vs // c)
    local = np.minimum(np.arange(c) * w, vs)
    return np.concatenate([r * vs + local for r in range(vtp)] + [np.array([v])])


def test_planted_chunk_bounds_that_move_with_vtp_are_red():
    x, gamma, w, sp = random_inputs(21, 24, 1000, k=5)
    out = decode_tail(x, gamma, w, k=5, sampling_params=sp, exchange="candidates", debug_taps=True)
    got = op_view(out)
    assert mismatches(got, emulate(out.logits, sp, k=5, nan_fold=False, bounds=declared_bounds(1000))) == []
    b1, b8 = rank_local_bounds(1000, 1), rank_local_bounds(1000, 8)
    assert not np.array_equal(b1, b8) and not np.array_equal(b8, declared_bounds(1000))
    for b in (b1, b8):
        bad = mismatches(got, emulate(out.logits, sp, k=5, nan_fold=False, bounds=b))
        assert "S1" in bad and set(bad) <= set(MASSES), bad
    # the variant's S1 differs between VTP 1 and 8 (the declared one cannot: test_shards_*)
    e1 = emulate(out.logits, sp, k=5, nan_fold=False, bounds=b1)
    e8 = emulate(out.logits, sp, k=5, nan_fold=False, bounds=b8)
    assert not np.array_equal(e1["S1"].view(np.int64), e8["S1"].view(np.int64))


def _cut_keys(keep):
    """A planted shard list: only the first `keep` keys are real, the rest pads."""
    def cut(keys):
        out = keys.clone()
        out[:, keep:] = candidates.PAD_KEY
        return out
    return cut


def test_planted_short_candidate_lists_are_red():
    k, v, vtp = 6, 104, 8
    g = torch.Generator().manual_seed(4)
    lg = torch.randn(8, v, generator=g)
    lg[:, 13:13 + k + 1] = 10.0 + torch.arange(k + 1, 0, -1, dtype=torch.float32)  # shard 1 holds the top k + 1
    sp = sampling(g, 8, k)
    want = emulate(lg, sp, k=k, nan_fold=False)
    assert set(want["ids"].reshape(-1).tolist()) <= set(range(13, 26))
    assert mismatches(merged_view(shard_merge(lg, vtp, k=k, nan_fold=False, sp=sp)), want) == []
    bad = mismatches(merged_view(shard_merge(lg, vtp, k=k, nan_fold=False, sp=sp, cut=_cut_keys(k - 1))), want)
    assert {"values", "ids"} <= set(bad), bad  # k - 1 keys a shard: the merged top-k is wrong
    bad = mismatches(merged_view(shard_merge(lg, vtp, k=k, nan_fold=False, sp=sp, cut=_cut_keys(k))), want)
    assert bad == ["outside"], bad  # k keys a shard: the (k+1)-th is wrong


def _digit_transpose(vtp_a: int, vtp_b: int) -> np.ndarray:
    """A WRONG combine order: the 256 chunk terms taken rank-major in hop order (a, b)
    transposed (slab r = a_i * b + b_i read as b_i * a + a_i), the order a merge that
    kept the hop layout's slab order would use."""
    c = MASS_CHUNKS // (vtp_a * vtp_b)
    ranks = [bi * vtp_a + ai for ai in range(vtp_a) for bi in range(vtp_b)]
    return np.concatenate([np.arange(r * c, (r + 1) * c) for r in ranks])


def test_planted_out_of_order_combine_is_red():
    x, gamma, w, sp = random_inputs(31, 32, 2048, k=5)
    sp[:, 0] = 0.0  # top-k off: the T pass runs on the T != 1 rows
    out = decode_tail(x, gamma, w, k=5, sampling_params=sp, exchange="candidates", debug_taps=True)
    got = op_view(out)
    chunk_order = np.arange(MASS_CHUNKS)
    assert mismatches(got, emulate(out.logits, sp, k=5, nan_fold=False, combine_order=chunk_order)) == []
    swapped = chunk_order.copy()
    swapped[[0, 1]] = [1, 0]
    for name, order in {"hops (2, 4) transposed": _digit_transpose(2, 4), "chunks 0 and 1 swapped": swapped}.items():
        bad = mismatches(got, emulate(out.logits, sp, k=5, nan_fold=False, combine_order=order))
        assert "S1" in bad and "ST" in bad and set(bad) <= {"S1", "ST"}, (name, bad)
    # Not wrong variants: the halving tree adds lane t and t + 128 first, then t and t + 64,
    # ..., so any order that maps lane pairs to lane pairs at every level gives the same
    # sums (float addition commutes): reversal (t -> 255 - t) and rotations (t -> t + s
    # mod 256, e.g. the slabs rotated by one rank of 8) are such maps. The same bits on
    # every row: why the planted orders above are other permutations.
    for order in (chunk_order[::-1], np.roll(chunk_order, 1), np.roll(chunk_order, 32)):
        assert mismatches(got, emulate(out.logits, sp, k=5, nan_fold=False, combine_order=order)) == []


# ---------------------------------------------------------------------------------------
# errors and sizes
# ---------------------------------------------------------------------------------------
def test_bogus_exchange_is_a_value_error():
    x, gamma, w, sp = random_inputs(0, 4, 104, k=5)
    with pytest.raises(ValueError, match=r"exchange must be one of \('mirror', 'candidates'\); got 'bogus'"):
        decode_tail(x, gamma, w, k=5, exchange="bogus")


def test_vtp_must_divide_256():
    for vtp in (1, 2, 8, 64, 256):
        candidates.check_vtp(vtp)
    for vtp in (3, 6, 12, 512):
        with pytest.raises(ValueError, match=rf"needs VTP dividing 256 .*got VTP={vtp} \(use exchange='mirror'\)"):
            candidates.check_vtp(vtp)


def _nan_message(exchange, *args, **kw):
    try:
        decode_tail(*args, exchange=exchange, **kw)
    except ValueError as e:
        return str(e)
    return None


def test_nan_rows_are_the_mirror_paths_errors():
    x, gamma, w, sp = special_inputs(5, 16, 104, k=5)
    nan_rows = torch.nonzero(x[:, 0] > 0)[:, 0].tolist()
    kw = dict(k=5, sampling_params=sp, gemm_order="chain")
    msg = _nan_message("candidates", x, gamma, w, **kw)
    assert msg is not None and msg == _nan_message("mirror", x, gamma, w, **kw)
    assert msg.startswith(f"decode_tail: NaN in the logits of rows {nan_rows[:8]}"), msg
    assert _nan_message("candidates", x, gamma, w, nan_fold=True, **kw) is None
    # all-NaN rows: a ValueError with or without the fold, the mirror path's words
    wn = torch.zeros(H, 104)
    wn[0], wn[2] = INF, -INF
    wn = wn.to(torch.bfloat16)
    for nan_fold in (False, True):
        msg = _nan_message("candidates", x, gamma, wn, nan_fold=nan_fold, **kw)
        assert msg is not None and msg == _nan_message("mirror", x, gamma, wn, nan_fold=nan_fold, **kw)
        want = "are all NaN" if nan_fold else "NaN in the logits of rows"
        assert want in msg and str(nan_rows[:8]) in msg, msg
    # without sampling there is no NaN policy: top-k only, no error
    assert _nan_message("candidates", x, gamma, wn, k=5, gemm_order="chain") is None


@pytest.mark.parametrize("vtp", [2, 4, 8])
def test_payload_is_ten_times_smaller_than_the_mirror(vtp):
    vs = 25_136  # the shard width, at every VTP
    cand, mirror = candidates.payload_bytes(256, vtp, True), 2 * vs
    print(f"VTP {vtp}: candidates payload {cand} B/row/rank vs mirror {mirror} B: {mirror / cand:.1f}x smaller")
    assert cand * 10 <= mirror
    c = 256 // vtp
    assert cand == 257 * 8 + c * (8 + 8 + 4) + 8 and candidates.payload_bytes(256, vtp, False) == 257 * 8


def test_packed_rows_carry_what_the_owner_needs():
    """pack -> unpack on one rank returns the kernel's partials bit for bit: m1 through its
    exact fp32 copy, mT recomputed from it on the rows that need the T pass (rows 0-2), 0
    elsewhere; a chunk whose max is -0 reads +0 on both sides."""
    g = torch.Generator().manual_seed(5)
    lg = torch.randn(6, 300, generator=g) * 4
    lg[0, :] = -0.0  # every chunk max is -0 (read +0)
    lg[1, 10:40] = -torch.inf
    sp = torch.tensor([[0, 1, .7, .5, 0]] * 3 + [[5, 1, .7, .5, 0], [0, 1, 1, .5, 0], [0, 1, 0, .5, 0]],
                      dtype=torch.float32)
    part = candidates.shard_partials(lg, col0=0, v=300, k=7, nan_fold=False, sp=sp)
    back = candidates.unpack(candidates.pack(part), vtp=1, k=7, sp=sp)
    assert same_bits(back.keys, part.keys) and same_bits(back.nans, part.nans)
    assert same_bits(back.mass, part.mass)
    m1 = back.mass[0, :, 0]
    assert bool((bits(m1) == 0).all())  # +0.0, never -0.0
    # planted: mT recomputed as m1 * (1/T) (one more rounding) is not the kernel's value
    at_t = candidates.needs_t(sp)
    planted = back.mass[:, :, 0] * (1.0 / sp[:, 2].double())[:, None]
    assert not same_bits(planted[at_t], part.mass[at_t][:, :, 2])


# ---------------------------------------------------------------------------------------
# ranks: spawned jobs, gathered and compared bitwise with the single-rank call
# ---------------------------------------------------------------------------------------
V, GBS, K = 104, 32, 5  # V_s = 13 at VTP 8


def case_inputs(case):
    if case.get("specials"):
        return special_inputs(case["seed"], case["gbs"], V, k=case["k"], sp_cols=case["sp_cols"])
    return random_inputs(case["seed"], case["gbs"], V, k=case["k"], distinct=case.get("distinct"),
                         sp_cols=case["sp_cols"])


def tail_kw(case):
    return dict(k=case["k"], nan_fold=case.get("nan_fold", False), debug_taps=True,
                emit_logits=case.get("emit_logits", True), exchange="candidates",
                gemm_order="chain" if case.get("specials") else "amx32")


def make_cases(layouts):
    variants = [dict(), dict(sp_cols=None), dict(k=20), dict(k=V), dict(distinct=5),
                dict(specials=True, nan_fold=True), dict(sp_cols=3), dict(emit_logits=False)]
    cases = []
    for i, (vtp, hops, g) in enumerate(layouts):
        case = dict(vtp=vtp, hops=hops, G=g, seed=100 + i, gbs=GBS, k=K, sp_cols=5, fence=i % 4 == 1)
        case.update(variants[i % len(variants)])
        cases.append(case)
    return cases


RANK_LAYOUTS = [(8, (8,), 1), (8, (8,), 2), (8, (8,), 4), (8, (2, 4), 1), (8, (4, 2), 1), (8, (2, 2, 2), 1),
                (4, (4,), 1), (4, (4,), 2), (4, (2, 2), 1), (2, (2,), 1), (2, (2,), 4), (1, (1,), 1),
                (8, (2, 4), 1), (8, (8,), 1), (4, (4,), 4), (2, (2,), 2)]


def _shard(w, r, vtp):
    vs = w.shape[1] // vtp
    return w[:, r * vs:(r + 1) * vs].contiguous()


def _parents(rank, world):
    parents = {world: dist.group.WORLD}
    for vtp in (4, 2, 1):
        if vtp < world:
            made = [dist.new_group(list(range(b, b + vtp))) for b in range(0, world, vtp)]
            parents[vtp] = made[rank // vtp]
    return parents


def _run_case(case, p):
    pr = p.rank()
    x, gamma, w, sp = case_inputs(case)
    rows = owned_rows(pr, case["vtp"], case["gbs"], case["hops"], case["G"])
    return pr, decode_tail(x, gamma, _shard(w, pr, case["vtp"]), sampling_params=None if sp is None else sp[rows],
                           group=p, hops=case["hops"], batch_groups=case["G"], fence=case["fence"], timeout=60,
                           **tail_kw(case))


def _errors(rank, world, parents):
    """Per rank: the NaN messages of both exchanges on the same inputs, the bogus exchange,
    and (rank 0 alone) a group of 3 ranks, which must refuse before any collective."""
    x, gamma, w, sp = special_inputs(9, 16, V, k=K)
    vtp = world
    rows = owned_rows(rank, vtp, 16)
    kw = dict(k=K, group=dist.group.WORLD, timeout=60, gemm_order="chain", sampling_params=sp[rows])
    out = {ex: _nan_message(ex, x, gamma, _shard(w, rank, vtp), **kw) for ex in ("candidates", "mirror", "bogus")}
    three = dist.new_group([0, 1, 2]) if world >= 3 else None
    if rank == 0 and three is not None:
        out["vtp3"] = _nan_message("candidates", x[:6], gamma, _shard(w, 0, 8), k=K, group=three, timeout=10)
    dist.monitored_barrier(timeout=timedelta(seconds=60))  # every rank still in step
    return out


def _ranks_job(rank, world, cases):
    parents = _parents(rank, world)
    outs = [_run_case(case, parents[case["vtp"]]) for case in cases]
    return dict(outs=outs, errors=_errors(rank, world, parents))


def check_ranks(res, cases, world, *, shift=0):
    """Every case's per-rank outputs, gathered with layout.owned_rows (each row moved by
    `shift`: a planted wrong map), must be bitwise the single-rank call's."""
    for i, case in enumerate(cases):
        x, gamma, w, sp = case_inputs(case)
        ref = decode_tail(x, gamma, w, sampling_params=sp, **dict(tail_kw(case), emit_logits=True))
        vtp, gbs = case["vtp"], case["gbs"]
        maps = {r: [(j + shift) % gbs for j in owned_rows(r, vtp, gbs, case["hops"], case["G"])]
                for r in range(vtp)}
        for b in range(0, world, vtp):
            outs = dict(res[gr]["outs"][i] for gr in range(b, b + vtp))
            assert sorted(outs) == list(range(vtp))
            for f in FIELDS:
                want = getattr(ref, f)
                if want is None:
                    assert all(getattr(o, f) is None for o in outs.values()), (case, f)
                    continue
                got = gather({r: getattr(o, f) for r, o in outs.items()}, maps, gbs)
                assert same_bits(got, want), (case, f)
            for key, want in ref.taps.items():
                if want is None:
                    assert all(o.taps[key] is None for o in outs.values()), (case, key)
                    continue
                assert same_bits(gather({r: o.taps[key] for r, o in outs.items()}, maps, gbs), want), (case, key)
            for r, o in outs.items():
                vs = V // vtp
                if case.get("emit_logits", True):
                    assert same_bits(o.logits, ref.logits[:, r * vs:(r + 1) * vs].contiguous()), (case, r)
                else:
                    assert o.logits is None


def check_rank_errors(res, world):
    for gr in range(world):
        e = res[gr]["errors"]
        assert e["candidates"] == e["mirror"], (gr, e)  # the same NaN words, or both None
        assert re.search(r"exchange must be one of \('mirror', 'candidates'\); got 'bogus'", e["bogus"]), e["bogus"]
    assert any(res[gr]["errors"]["candidates"] for gr in range(world)), "some rank owns a NaN row"
    msg = res[0]["errors"].get("vtp3")
    if world >= 3:
        assert msg is not None and re.search(r"needs VTP dividing 256 .*got VTP=3", msg), msg


FAST_LAYOUTS = [(2, (2,), 1), (2, (2,), 2), (1, (1,), 1)]


def test_two_ranks_are_bitwise_one_rank():
    """A 2-rank job (spawning is most of its time): VTP 2 over the world with G 1 and 2,
    VTP 1 over each rank alone; specials with nan_fold, k = V (k1 > V_s), the NaN and
    bogus-exchange errors on every rank."""
    cases = make_cases(FAST_LAYOUTS)
    cases[1].update(specials=True, nan_fold=True)
    cases[2].update(k=V)
    t0 = time.monotonic()
    res = launch(_ranks_job, 2, args=(2, cases), timeout_s=240, threads=1)
    print(f"2-rank job: {time.monotonic() - t0:.1f} s")
    check_ranks(res, cases, 2)
    check_rank_errors(res, 2)
    with pytest.raises(AssertionError):  # a planted wrong ownership map: the same comparison goes red
        check_ranks(res, cases, 2, shift=1)


@pytest.mark.slow
def test_eight_ranks_are_bitwise_one_rank():
    """One 8-rank job: VTP 8 over the world, 4/2/1 over subgroups, every hop layout and G."""
    cases = make_cases(RANK_LAYOUTS)
    t0 = time.monotonic()
    res = launch(_ranks_job, 8, args=(8, cases), timeout_s=600, threads=1)
    print(f"8-rank job: {time.monotonic() - t0:.1f} s")
    check_ranks(res, cases, 8)
    check_rank_errors(res, 8)
    seen = {(c["vtp"], c["hops"], c["G"]) for c in cases}
    assert {(8, (2, 2, 2), 1), (8, (4, 2), 1), (8, (2, 4), 1), (4, (2, 2), 1), (8, (8,), 4)} <= seen


def test_truncated_flags_match_the_mirror_on_bf16_exact_values():
    """On logits that are bf16 values (so both exchanges see the same numbers), the
    candidates sampler's truncated flag on top-k rows (top_k > k, or a lane outside the k
    candidates tied with the top-k threshold) equals the mirror sampler's (sampler.sample_rows
    over the full bf16 row), and so do the candidates. Planted: an outside-lane test with a
    strict > misses the ties (some rows then differ)."""
    from lmtail.tail.sampler import decide, plan_on, sample_rows
    from lmtail.tail.topk import exact_topk

    g = torch.Generator().manual_seed(3)
    r, v, k = 16, 300, 8
    tied = torch.randint(-4, 5, (r, v), generator=g).to(torch.float32) * 0.5  # 9 values: ties everywhere
    distinct = torch.randn(r, v, generator=g).to(torch.bfloat16).to(torch.float32)
    rows = torch.where(torch.arange(r)[:, None] % 2 == 0, tied, distinct)  # [R, V] bf16-exact
    top_k = torch.tensor([3.0, 5.0, 8.0, 12.0])[torch.arange(r) % 4]
    sp = torch.stack([top_k, torch.ones(r), torch.full((r,), 0.7), torch.full((r,), 0.4), torch.zeros(r)], 1)
    merged = shard_merge(rows, 4, k=k, nan_fold=False, sp=sp)
    vals, ids, _ = exact_topk(rows.to(torch.bfloat16), k=k)
    assert torch.equal(merged.ids, ids) and same_bits(merged.values.to(torch.bfloat16), vals)
    _, _, tr_c = candidates.sample_merged(merged, sp, nan_fold=False)
    _, _, tr_m = sample_rows(vals, ids, rows.to(torch.bfloat16), sp)
    assert torch.equal(tr_c, tr_m) and bool(tr_m.any()) and bool((~tr_m).any())

    class Strict(candidates.MergedStats):
        def ties_past_k(self, thr, in_k):
            return self.mg.has_outside & (self.out > thr[:, 0])

    plan = plan_on(merged.values, sp, Strict(merged, sp, False))
    assert not torch.equal(decide(plan, merged.values, merged.ids)[2], tr_m)


# ---------------------------------------------------------------------------------------
# the one-rank shortcuts: the wire skipped, the owner's stats in one C call
# ---------------------------------------------------------------------------------------
def _partials_bits(p) -> list:
    return [bits(p.keys)] + ([] if p.mass is None else [bits(p.mass), p.nans])


@pytest.mark.parametrize("v, k", [(104, 5), (104, 104), (40, 3), (1000, 9), (49152 // 64, 20)])
def test_one_rank_wire_is_the_identity(v, k):
    """decode_tail skips pack -> unpack at one rank: on the partials one rank sends (random
    and special rows, every sampler mode, with and without nan_fold and sampling), unpack(
    pack(p), vtp=1) is p byte for byte (keys, mass incl. the recomputed mT, nans), except
    m1 / mT of a row with NaN lanes and no nan_fold, which the tail refuses before any output
    reads them. Planted: a wire that sends m1 for mT (no recomputation at T) is red."""
    g = torch.Generator().manual_seed(v + k)
    for lg in (torch.randn(24, v, generator=g) * 3, special_logits(v, 24, v)):
        sp = sampling(g, 24, k)
        sp[5, 2] = 2.0  # a power-of-two T (the kernel's exact inverse)
        for nan_fold in (False, True):
            for s in (sp, None):
                p = candidates.shard_partials(lg, col0=0, v=v, k=k, nan_fold=nan_fold, sp=s)
                q = candidates.unpack(candidates.pack(p), vtp=1, k=k, sp=s)
                ok = torch.ones(24, dtype=torch.bool) if nan_fold else ~torch.isnan(lg).any(dim=1)
                if s is not None:
                    p = replace(p, mass=p.mass[ok])
                    q = replace(q, mass=q.mass[ok])
                same = all(torch.equal(a, b) for a, b in zip(_partials_bits(p), _partials_bits(q)))
                assert same, (nan_fold, s is None)
                if s is not None:
                    planted = q.mass.clone()
                    planted[:, :, 2] = torch.where(planted[:, :, 3] != 0, planted[:, :, 0], planted[:, :, 2])
                    assert not torch.equal(bits(planted), bits(p.mass))


def _merge_torch(p, k):
    """candidates.merge's torch ops (the C call disabled)."""
    top = candidates.kernel.top_keys(p.keys, k + 1)
    vals, ids = candidates.split_fp32_keys(top)
    mass = None
    if p.mass is not None:
        mass = (candidates.combine(p.mass[:, :, 0], p.mass[:, :, 1])
                + candidates.combine(p.mass[:, :, 2], p.mass[:, :, 3]))
    return vals, ids, top, mass


@pytest.mark.parametrize("vtp", [1, 2, 8])
def test_owner_stats_is_the_torch_ops(vtp):
    """kernels.tail.shard_partials.owner_stats (values, ids, m1, S1, mT, ST, lse1, slot 0's
    logprob) equals split_fp32_keys, combine and m1 + log64(S1) bit for bit on random and
    special rows (NaN folded, +-inf, all -inf rows, empty chunks); a NaN chunk max declines
    (ok False) and merge then takes combine's torch path, the same bytes. Planted: the T
    pair's log-sum-exp for lse1 is red."""
    v, k = 104 * 4, 6
    g = torch.Generator().manual_seed(vtp)
    for lg, nan_fold in ((special_logits(3, 16, v), True), (torch.randn(16, v, generator=g) * 4, False),
                         (special_logits(4, 16, v), False)):
        sp = sampling(g, 16, k)
        vs = v // vtp
        parts = [candidates.shard_partials(lg[:, r * vs:(r + 1) * vs].contiguous(), col0=r * vs, v=v, k=k,
                                           nan_fold=nan_fold, sp=sp) for r in range(vtp)]
        recv = torch.cat([candidates.pack(p) for p in parts], dim=1)
        p = candidates.unpack(recv, vtp=vtp, k=k, sp=sp) if vtp > 1 else parts[0]
        vals, ids, top, mass = _merge_torch(p, k)
        got = candidates.kernel.owner_stats(top, p.mass)
        assert torch.equal(bits(got[0]), bits(vals)) and torch.equal(got[1], ids)
        nan_rows = torch.isnan(p.mass[:, :, 0]).any(dim=1) | torch.isnan(p.mass[:, :, 2]).any(dim=1)
        assert got[4] == (not bool(nan_rows.any()))
        mg = candidates.merge(p, k=k)
        for a, b in zip(mg.mass, mass):
            assert torch.equal(bits(a), bits(b))
        if not got[4]:
            assert mg.lse1 is None and mg.lp0 is None
            continue
        lse1 = mass[0] + log64(mass[1])
        assert torch.equal(bits(got[2][4]), bits(lse1)) and torch.equal(bits(mg.lse1), bits(lse1))
        lp0 = (vals[:, 0].double() - lse1).to(torch.float32)
        assert torch.equal(bits(got[3]), bits(lp0))
        keys_only = candidates.kernel.owner_stats(top, None)
        assert keys_only[2] is None and torch.equal(bits(keys_only[0]), bits(vals))
        # planted: the T pair's stats in place of the T = 1 pair's are red
        t_rows = mass[3] != 0
        assert bool(t_rows.any()) and not torch.equal(bits((mass[2] + log64(mass[3]))[t_rows]), bits(lse1[t_rows]))


@pytest.mark.parametrize("v, k", [(104, 5), (104, 104), (40, 1), (1000, 9), (2000, 300)])
def test_c_sampler_is_plan_on(v, k, monkeypatch):
    """sample_merged's one C call (kernels.tail.shard_partials.sample_candidates) gives the bytes
    of sampler.plan_on + decide over MergedStats (the C call disabled): tokens, logprobs,
    truncated, on random and special rows (ties, +-inf, folded NaN, all -inf rows), every
    sampler mode, [R, 3|4|5] params, k above 256, and on batches with greedy rows among
    sampled ones. Planted: a draw at (u + 0.37) mod 1 is red."""
    g = torch.Generator().manual_seed(v * 7 + k)
    real = candidates.kernel.sample_candidates
    for lg, nan_fold in ((torch.randn(30, v, generator=g) * 3, False), (special_logits(v, 30, v), True)):
        lg[:, : v // 3] = torch.round(lg[:, : v // 3])  # ties
        for cols in (5, 4, 3):
            sp = sampling(g, 30, k, cols)
            if cols >= 4:
                sp[7, 3] = 0.0  # u = 0: the first kept slot
            mg = candidates.merge(candidates.shard_partials(lg, col0=0, v=v, k=k, nan_fold=nan_fold, sp=sp), k=k)
            assert mg.stats is not None
            got = real(mg.values, mg.ids, sp, mg.stats, mg.outside, mg.has_outside, nan_fold=nan_fold)
            assert got is not None
            monkeypatch.setattr(candidates.kernel, "sample_candidates", lambda *a, **kw: None)
            want = candidates.sample_merged(mg, sp, nan_fold=nan_fold)
            monkeypatch.setattr(candidates.kernel, "sample_candidates", real)
            assert all(same_bits(a, b) for a, b in zip(got, want)), (cols, nan_fold)
            assert all(same_bits(a, b) for a, b in zip(candidates.sample_merged(mg, sp, nan_fold=nan_fold), want))
            if cols >= 4 and k > 1:
                sp2 = sp.clone()
                sp2[:, 3] = torch.remainder(sp2[:, 3] + 0.37, 1.0).clamp(max=0.999)
                planted = real(mg.values, mg.ids, sp2, mg.stats, mg.outside, mg.has_outside, nan_fold=nan_fold)
                assert not all(same_bits(a, b) for a, b in zip(planted, want))
