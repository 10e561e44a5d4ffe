"""float64 NumPy references for the numerics contract: range margins, the tail's bound
against the ideal logits, and the sampler's decisions with their margins.

Three pieces, each written once here and imported by lmtail.contract and the tests:

  * `range_margin(y, lo, hi)`: where an output sits in its declared range, in range widths
    (docs/contract.md, "margin"): min(y - lo, hi - y) / (hi - lo), in [0, 1/2] inside,
    negative outside; a zero-width range scores 1/2 when hit exactly.
  * `ideal_bound(x, gamma, w, ...)`: the float64 ideal logits `ref` (no rounding anywhere,
    reference.tail.logits_ref) and per element the declared bound `delta` on
    |bf16 mirror of any conforming op - ref|: the farthest end of
    mirror_range(logits_range(...)) from ref. The range already carries the deterministic
    rounding of `a`, so the hull [ref - delta, ref + delta] holds both the ideal value and
    every output the declaration allows.
  * `sample_decision(r, delta, ...)`: one row's sampler decisions made on values
    known only to +- delta (and masses known to +- slack), with the margin of each
    decision and whether all of them are certain. delta = 0 is the exact mode (the
    sampler kind: the values are the bf16 candidates themselves; equal values are then
    ordered by the lower id, which is exact, not a near-tie).

Shape legend: gbs rows, H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import math

import numpy as np

from ..numerics import U, Decl, gamma
from .tail import as_np, head_values, logits_range, logits_ref, mirror_range

GREEDY_T = 1e-5  # temperature below this is greedy (compared in float64 after widening the fp32 temperature)


# ---------------------------------------------------------------------------------------
# margins
# ---------------------------------------------------------------------------------------
def range_margin(y, lo, hi):
    """Position of y in [lo, hi], elementwise, in units of the range width.

    Returns (inside [..] bool, margin [..] float64): margin = min(y - lo, hi - y) / (hi - lo)
    (1/2 at the centre, 0 on an end, negative outside: -0.3 is 0.3 widths past an end).
    A zero-width range gives 1/2 when y equals it and -inf otherwise; NaN anywhere (y or an
    end) is outside with margin -inf, as is an infinite y with a finite range."""
    y, lo, hi = as_np(y), as_np(lo), as_np(hi)
    with np.errstate(invalid="ignore", over="ignore"):
        inside = (y >= lo) & (y <= hi)
        width = hi - lo
        d = np.minimum(y - lo, hi - y)
        m = np.where(width > 0, d / np.where(width > 0, width, 1.0),
                     np.where(inside, 0.5, -np.inf))
    m = np.where(np.isnan(m) | ~np.isfinite(y) & ~inside, -np.inf, m)
    m = np.where(~np.isfinite(width) & inside, 0.5, m)  # an infinite range holds anything
    return inside, m


# ---------------------------------------------------------------------------------------
# the tail's declared bound against the ideal logits
# ---------------------------------------------------------------------------------------
def ideal_bound(x, gamma_, w, *, eps, decl, hidden_actual=None, interleaved=True, deferred_rms=True,
                col_chunk=8192):
    """(ref [gbs, V], delta [gbs, V]) float64 for a single-rank tail over the full vocab.

    ref: reference.tail.logits_ref (ideal). delta >= 0: max(hi - ref, ref - lo) where
    (lo, hi) = logits_range(..., decl=decl) (decl: the tail's numerics.Decl), rounded
    outward to bf16 by mirror_range when the declaration has a "mirror:bf16" rounding point
    (the mirror exchange: decisions on the bf16 mirror), as is otherwise (the candidates
    exchange: decisions on the fp32 logits); so any op inside its declared range decides
    on values within ref +- delta. Computed col_chunk vocab columns at a time (the range
    is column-separable), so a 49k vocab needs a few hundred MB, not several GB.
    w: [H, V] bf16 values, or a Q8_0 head (kernels.quant.gemm_q.QuantWeight (V, H)): the ideal
    logits then use its exact dequantized values (reference.tail.head_values), and decl
    must be the Q8_0 head's (tail_decl(..., head_input="fp32"))."""
    w64 = head_values(w)
    kw = dict(hidden_actual=hidden_actual, interleaved=interleaved)
    ref = logits_ref(x, gamma_, w64, eps=eps, **kw)
    mirror = any(pt.startswith("mirror:") for pt in decl.rounding_points)
    delta = np.empty_like(ref)
    for c0 in range(0, w64.shape[1], col_chunk):
        sl = slice(c0, c0 + col_chunk)
        lo, hi = logits_range(x, gamma_, w64[:, sl], eps=eps, decl=decl, deferred_rms=deferred_rms, **kw)
        if mirror:
            lo, hi = mirror_range(lo, hi)
        delta[:, sl] = np.maximum(np.maximum(hi - ref[:, sl], ref[:, sl] - lo), 0.0)
    return ref, delta


def sampler_slack(v: int, k: int) -> float:
    """Relative bound on the float64 error of a mass, a cdf or a p ratio, for the op and
    this reference together: the op's sums have depth ceil(V/256) + 8 (full row) and k
    (candidates), exp64 is < 2 ulp, one division each; this module's own cumulative sums
    have depth <= V. 4 * gamma(V + k + 64, u64) covers both with room (2e-11 at V = 49k)."""
    return 4.0 * gamma(v + k + 64, U["fp64"])


def decl_slack(decl: Decl, v: int, k: int) -> float:
    """sampler_slack with the op's part read from its declaration: 4 * gamma(v + k + 64 +
    the declared depths of its sums, u64) (the same room for exp64, the divisions and this
    module's own cumulative sums of depth <= V + k)."""
    return 4.0 * gamma(v + k + 64 + sum(s.depth for s in decl.sums), U["fp64"])


# ---------------------------------------------------------------------------------------
# one row's sampler decisions with margins
# ---------------------------------------------------------------------------------------
def _masses(e_lo, e_hi, n):
    """Prefix masses of the first j slots among the first n (j = 0..n), as bounds of
    mass(prefix j) / mass(first n): lo uses the prefix low and the rest high."""
    a_lo = np.concatenate([[0.0], np.cumsum(e_lo[:n])])  # [n+1]
    a_hi = np.concatenate([[0.0], np.cumsum(e_hi[:n])])
    with np.errstate(invalid="ignore", divide="ignore"):  # 0/0 stays NaN: never certain
        lo = a_lo / (a_lo + (a_hi[n] - a_hi))
        hi = a_hi / (a_hi + (a_lo[n] - a_lo))
    lo[0] = hi[0] = 0.0  # the empty prefix
    return lo, hi


def sample_decision(r, delta, *, top_k, top_p, temperature, u, min_p=0.0, k, slack):
    """One row's sampler outcome on values r [V] float64 known to +- delta [V].

    Returns dict: token, slot (position in the descending order), greedy, n_filter,
    n_keep, truncated (the defined flag: top_k > k, ties at the top-k threshold past slot k,
    or top-k disabled and the kept top-p set needs mass past slot k, top_p >= 1 included),
    comparable (the exact token can be drawn from the first k candidates: not truncated by
    top-k, and no kept slot past k carries mass after min-p; a top-p truncation that min-p
    brings back within k is comparable), certified (every decision below is certain),
    margin (the smallest decision margin
    relative to its bound: > 1 certain; inf when nothing is uncertain), why (which decision
    is a near-tie: "argmax", "top-k", "top-p", "min-p", "slot", "order").
    Decisions: the greedy argmax; the top-k cut; the top-p cut (the mass before the first
    dropped slot is >= top_p, before the last kept one < top_p); the min-p cut; the draw
    (cdf before the slot <= u < cdf at the slot); and that the prefix sets at those cuts
    are the same for every value in the bounds (order)."""
    r, delta = np.asarray(r, np.float64), np.asarray(delta, np.float64)
    n_v = r.size
    order = np.lexsort((np.arange(n_v), -r))
    rs, ds = r[order], delta[order]
    exact = not ds.any()
    lo_v, hi_v = rs - ds, rs + ds
    pre_min = np.minimum.accumulate(lo_v)  # [V]
    suf_max = np.maximum.accumulate(hi_v[::-1])[::-1]
    why, margins = [], []

    def cut(j, what):  # the set of the first j slots is the same for all values in bounds
        if exact or j <= 0 or j >= n_v:
            return
        gap = pre_min[j - 1] - suf_max[j]
        bound = ds[j - 1] + ds[j]
        margins.append((rs[j - 1] - rs[j]) / bound if bound > 0 else math.inf)
        if not gap > 0:
            why.append(what)

    out = dict(greedy=bool(temperature < GREEDY_T), truncated=False, comparable=True)
    if out["greedy"]:
        cut(1, "argmax")
        return _done(out, order, 0, 1, 1, why, margins)
    n_f = n_v if top_k <= 0 else int(np.sum(rs >= rs[min(int(top_k), n_v) - 1]))
    trunc_k = top_k > 0 and (top_k > k or n_f > k)
    if top_k > 0:
        cut(n_f, "top-k")
    # masses are ratios, so each array may take its own shift: e (ideal) by its max
    # rs[0] (e[0] = 1, never underflows), the bounds by the largest upper value.
    mh = hi_v.max()
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        e = np.exp((rs - rs[0]) / temperature)
        e_lo = np.exp((lo_v - mh) / temperature) * (1 - slack)
        e_hi = np.exp((hi_v - mh) / temperature) * (1 + slack)
    mb = np.concatenate([[0.0], np.cumsum(e[:n_f])]) / math.fsum(e[:n_f])  # [n_f+1] mass before
    mb_lo, mb_hi = _masses(e_lo, e_hi, n_f)
    n_keep = n_f
    if top_p < 1:
        n_keep = max(1, int(np.sum(mb[:n_f] < top_p)))
        if n_keep > 1:
            _decide(margins, why, "top-p", top_p - mb[n_keep - 1], top_p - mb_hi[n_keep - 1] - slack,
                    mb[n_keep - 1], mb_hi[n_keep - 1], slack)
        if n_keep < n_f:
            _decide(margins, why, "top-p", mb[n_keep] - top_p, mb_lo[n_keep] - slack - top_p,
                    mb[n_keep], mb_lo[n_keep], slack, strict=False)
            cut(n_keep, "top-p")
    trunc_p = top_k <= 0 and n_keep > k and bool(e[k:n_keep].any())  # mass past slot k
    if min_p > 0:
        ratio = e[:n_keep] / e[0]
        n_min = max(1, int(np.sum(ratio >= min_p)))
        with np.errstate(invalid="ignore", over="ignore", under="ignore"):
            r_lo = np.exp((lo_v[:n_keep] - hi_v[0]) / temperature) * (1 - slack) ** 2
            r_hi = np.exp((hi_v[:n_keep] - lo_v[0]) / temperature) * (1 + slack) ** 2
        _decide(margins, why, "min-p", ratio[n_min - 1] - min_p, r_lo[n_min - 1] - min_p,
                ratio[n_min - 1], r_lo[n_min - 1], slack, strict=False)
        if n_min < n_keep:
            _decide(margins, why, "min-p", min_p - ratio[n_min], min_p - r_hi[n_min],
                    ratio[n_min], r_hi[n_min], slack)
            cut(n_min, "min-p")
        n_keep = n_min
    out["truncated"] = bool(trunc_k or trunc_p)
    out["comparable"] = not trunc_k and not (n_keep > k and e[k:n_keep].any())
    cdf = np.cumsum(e[:n_keep]) / math.fsum(e[:n_keep])  # [n_keep]
    c_lo, c_hi = _masses(e_lo, e_hi, n_keep)  # [n_keep+1]: cdf_j is index j+1
    pos = min(int(np.sum(cdf <= u)), n_keep - 1)
    if pos > 0:
        _decide(margins, why, "slot", u - cdf[pos - 1], u - c_hi[pos] - slack, cdf[pos - 1],
                c_hi[pos], slack, strict=False)
        cut(pos, "order")
    if pos < n_keep - 1:
        _decide(margins, why, "slot", cdf[pos] - u, c_lo[pos + 1] - slack - u, cdf[pos],
                c_lo[pos + 1], slack)
        cut(pos + 1, "order")
    return _done(out, order, pos, n_f, n_keep, why, margins)


def _decide(margins, why, what, gap, sure_gap, value, bound_end, slack, strict=True):
    """Record one threshold decision: gap is its float64 margin, sure_gap the margin left
    at the worst end of the bounds (certain iff > 0, or >= 0 when not strict)."""
    err = abs(bound_end - value) + slack
    margins.append(gap / err if err > 0 else math.inf)
    if not (sure_gap > 0 or (not strict and sure_gap >= 0)):
        why.append(what)


def _done(out, order, pos, n_f, n_keep, why, margins):
    out.update(token=int(order[pos]), slot=int(pos), n_filter=int(n_f), n_keep=int(n_keep),
               certified=not why, why=tuple(dict.fromkeys(why)),
               margin=min(margins) if margins else math.inf)
    return out


def logprob_ref(row) -> np.ndarray:
    """[V] float64 raw log-probabilities at T = 1 over the full row (fsum normalizer)."""
    v = as_np(row).reshape(-1)
    m = v.max()
    return v - (m + math.log(math.fsum(np.exp(v - m))))
