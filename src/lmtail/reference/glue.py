"""References for the glue ops (norms.py, router.py, orders.py), written once, in NumPy.

Two kinds of reference live here:

1. Slow scalar emulations (`emu_*`): plain Python loops over numpy.float32 scalars. Each fp32
   fma is computed exactly with fractions.Fraction and rounded once to fp32 (RNE, with
   subnormals and overflow); +, *, /, sqrt on np.float32 scalars are IEEE; bf16 rounding is
   ml_dtypes'. They follow each op's declared order literally and share no arithmetic code
   with the torch path, so they pin its bytes on small shapes (the byte gates).

2. float64 range checks (`*_range`, `router_check`, `compare`): the exact value E of each
   declared sum and its range E +- (gamma(depth, u) * sum|terms| + slack), with depth and u
   taken from the sum's declaration (numerics.SumDecl, passed in by the caller), where slack
   = 2 gamma(n+4, u_fp64) sum|terms| (the float64 evaluation error of E, 2**29 times below the
   fp32 bound) + depth * 2**-150 (fp32 underflow, half the smallest subnormal a rounding).
   The ends are pushed through the rest of the op with the op's own round-to-nearest at each
   declared rounding point. Every rounding is monotone, so the image of the ends bounds every
   value the op can produce: this is the outward rounding of the ends (a directed rounding
   would be looser by up to an ulp and would hide double-rounding bugs). fp32 steps are
   evaluated in float64 and rounded once to fp32, which is the IEEE fp32 result (53 >= 2*24+2).
   Sums whose partial sums may overflow fp32 are `free` (anything accepted, counted).

Arrays: float64 holding fp32 or bf16 values (bf16 and fp32 values are exact in float64).
Shape legend: T rows, H width, S slots, R routed slots, G parts, P part width, K slices,
E experts, k chosen, N reduced width.
"""
from __future__ import annotations

import math
from fractions import Fraction

import ml_dtypes
import numpy as np
import torch

from ..numerics import U, Decl, SumDecl, exp64, gamma
from .contract import range_margin

BF16 = ml_dtypes.bfloat16
F32 = np.float32
_OVF32 = 2.0**128 - 2.0**103  # the smallest value that rounds to +inf in fp32
_GUARD32 = float(np.float32(1e-20))


# =======================================================================================
# rounding helpers
# =======================================================================================
def r32(v) -> np.ndarray:
    """Round float64 to the nearest fp32 (RNE), returned as float64."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)


def rbf(v) -> np.ndarray:
    """Round fp32 values (held in float64) to bf16 (RNE), returned as float64."""
    return np.asarray(v, np.float64).astype(np.float32).astype(BF16).astype(np.float64)


def bf16_array(a) -> np.ndarray:
    """Any float array -> bf16 values as float32 (rounded once, RNE)."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


# =======================================================================================
# 1. slow scalar emulation
# =======================================================================================
def _fr_round_f32(q: Fraction) -> float:
    """Round an exact nonzero rational to the nearest fp32 (ties to even)."""
    a = abs(q)
    e = a.numerator.bit_length() - a.denominator.bit_length()  # 2**e <= a < 2**(e+2)
    if (Fraction(2) ** e) > a:
        e -= 1
    if (Fraction(2) ** (e + 1)) <= a:
        e += 1
    qe = max(e, -126) - 23  # quantum exponent (subnormals share -149)
    m = a / (Fraction(2) ** qe)
    fl = m.numerator // m.denominator
    rem = m - fl
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and fl % 2 == 1):
        fl += 1
    v = Fraction(fl) * (Fraction(2) ** qe)
    mag = math.inf if v >= 2**128 else float(v)
    return -mag if q < 0 else mag


def fma_f32(a, b, c) -> np.float32:
    """Exact fp32 fused multiply-add: round_f32(a*b + c) computed with Fractions."""
    a, b, c = float(F32(a)), float(F32(b)), float(F32(c))
    if math.isnan(a) or math.isnan(b) or math.isnan(c):
        return F32(math.nan)
    if math.isinf(a) or math.isinf(b):
        if a == 0 or b == 0:
            return F32(math.nan)
        p = math.copysign(math.inf, a) * math.copysign(1.0, b)
        if math.isinf(c) and c != p:
            return F32(math.nan)
        return F32(p)
    if math.isinf(c):
        return F32(c)
    q = Fraction(a) * Fraction(b) + Fraction(c)
    if q == 0:  # exact zero: -0 only for (-0 product) + (-0)
        neg_p = (math.copysign(1.0, a) * math.copysign(1.0, b)) < 0
        both_neg = neg_p and (a == 0 or b == 0) and math.copysign(1.0, c) < 0
        return F32(-0.0 if both_neg else 0.0)
    return F32(_fr_round_f32(q))


def _bf(v) -> np.float32:
    return F32(np.asarray(v, np.float32).astype(BF16).astype(np.float32)[()])


def emu_fma_sum(a_row, b_row, *, lanes: int, vec: int, reverse_butterfly: bool = False) -> np.float32:
    """One row's declared sum (orders.py), literally: lane t does fma over its elements
    (p*lanes + t)*vec + j for p, j increasing (zero-padded past the row), then an xor
    butterfly in each 32-lane group, then the group totals in group order."""
    a_row = [F32(v) for v in a_row]
    b_row = [F32(v) for v in b_row]
    n = len(a_row)
    passes = -(-n // (lanes * vec))
    lane_acc = []
    for t in range(lanes):
        acc = F32(0.0)
        for p in range(passes):
            for j in range(vec):
                i = (p * lanes + t) * vec + j
                ai, bi = (a_row[i], b_row[i]) if i < n else (F32(0.0), F32(0.0))
                acc = fma_f32(ai, bi, acc)
        lane_acc.append(acc)
    offs = (1, 2, 4, 8, 16) if reverse_butterfly else (16, 8, 4, 2, 1)
    totals = []
    for g in range(lanes // 32):
        v = lane_acc[32 * g : 32 * g + 32]
        for off in offs:
            v = [F32(v[i] + v[i ^ off]) for i in range(32)]
        totals.append(v[0])
    tot = totals[0]
    for x in totals[1:]:
        tot = F32(tot + x)
    return tot


def emu_inv_rms(h_row, *, n: int, eps: float, lanes: int, vec: int, reverse_butterfly=False) -> np.float32:
    ssq = emu_fma_sum(h_row, h_row, lanes=lanes, vec=vec, reverse_butterfly=reverse_butterfly)
    with np.errstate(all="ignore"):
        m = F32(ssq / F32(n))
        d = F32(m + F32(eps))
        r = F32(np.sqrt(d))
        return F32(F32(1.0) / r)


def _emu_y(h_row, g_row, inv, rounding: str) -> list:
    out = []
    with np.errstate(all="ignore"):
        for hj, gj in zip(h_row, g_row):
            t = F32(F32(hj) * inv)
            if rounding == "mlx":
                out.append(_bf(F32(F32(gj) * _bf(t))))
            else:
                out.append(_bf(F32(t * F32(gj))))
    return out


def _order_kw(order) -> dict:
    return dict(lanes=order.lanes, vec=order.vec, reverse_butterfly=order.reverse_butterfly)


def emu_add_rms(x, res, g, *, eps, order) -> tuple[np.ndarray, np.ndarray]:
    """x, res [T, H] (bf16 values), g [H] -> (h, y) [T, H] float32 holding bf16 values."""
    hs, ys = [], []
    with np.errstate(all="ignore"):
        for xr, rr in zip(np.asarray(x, np.float32), np.asarray(res, np.float32)):
            h = [_bf(F32(F32(a) + F32(b))) for a, b in zip(xr, rr)]
            inv = emu_inv_rms(h, n=len(h), eps=eps, **_order_kw(order))
            hs.append(h)
            ys.append(_emu_y(h, g, inv, "once"))
    return np.array(hs, np.float32), np.array(ys, np.float32)


def emu_add_rms32(x, res, g, *, eps, order) -> tuple[np.ndarray, np.ndarray]:
    """The q32 body's fp32 norm (model.body.add_rms_rows32), literally: x [T, H] fp32 values,
    res [T, H] fp32 values or None (+0.0), g [H] -> (h, y) [T, H] float32 with h = fl32(x + res),
    inv = emu_inv_rms(h) in `order`, y = fl32(fl32(h * inv) * g): emu_add_rms without its bf16
    roundings."""
    x = np.asarray(x, np.float32)
    res = np.zeros_like(x) if res is None else np.asarray(res, np.float32)
    hs, ys = [], []
    with np.errstate(all="ignore"):
        for xr, rr in zip(x, res):
            h = [F32(F32(a) + F32(b)) for a, b in zip(xr, rr)]
            inv = emu_inv_rms(h, n=len(h), eps=eps, **_order_kw(order))
            hs.append(h)
            ys.append([F32(F32(hj * inv) * F32(gj)) for hj, gj in zip(h, g)])
    return np.array(hs, np.float32).reshape(x.shape), np.array(ys, np.float32).reshape(x.shape)


def emu_moe_add_rms(x, slots, w, g, *, eps, n_shared, order) -> tuple[np.ndarray, np.ndarray]:
    """x [T, H], slots [S, T, H], w [T, R], g [H] -> (h, y) [T, H] (bf16 values)."""
    x = np.asarray(x, np.float32)
    slots = np.asarray(slots, np.float32)
    s_n, t_n, h_n = slots.shape
    r_n = s_n - n_shared
    hs, ys = [], []
    with np.errstate(all="ignore"):
        for t in range(t_n):
            h = []
            for j in range(h_n):
                acc = F32(0.0)
                for s in range(r_n):
                    acc = fma_f32(w[t][s], slots[s, t, j], acc)
                if n_shared:
                    sh = F32(slots[r_n, t, j])
                    for s in range(r_n + 1, s_n):
                        sh = F32(sh + slots[s, t, j])
                    acc = F32(acc + sh)
                c = _bf(acc)
                h.append(_bf(F32(F32(x[t, j]) + c)))
            inv = emu_inv_rms(h, n=h_n, eps=eps, **_order_kw(order))
            hs.append(h)
            ys.append(_emu_y(h, g, inv, "once"))
    return np.array(hs, np.float32), np.array(ys, np.float32)


def emu_rms_parts(x, g, *, part: int, rounding: str, eps, order) -> np.ndarray:
    """x [T, H] (bf16 values), g [H] -> y [T, H]: each part normalized on its own."""
    x = np.asarray(x, np.float32)
    ys = []
    for row in x:
        y = []
        for p0 in range(0, len(row), part):
            seg = list(row[p0 : p0 + part])
            inv = emu_inv_rms(seg, n=part, eps=eps, **_order_kw(order))
            y += _emu_y(seg, g[p0 : p0 + part], inv, rounding)
        ys.append(y)
    return np.array(ys, np.float32)


def emu_router_topk(slices, k: int, *, bias=None, scale=2.5) -> tuple[np.ndarray, np.ndarray]:
    """slices [K, T, E] fp32 -> (ids [T, k] int64, weights [T, k] fp32), one row at a time.
    The sigmoid's exp is numerics.exp64 (the declared primitive), taken element by element."""
    slices = np.asarray(slices, np.float32)
    n_k, t_n, e_n = slices.shape
    ids_out, w_out = [], []
    with np.errstate(all="ignore"):
        for t in range(t_n):
            s_row, key = [], []
            for e in range(e_n):
                lg = F32(slices[0, t, e])
                for i in range(1, n_k):
                    lg = F32(lg + slices[i, t, e])
                ex = F32(float(exp64(torch.tensor([-float(lg)], dtype=torch.float64))[0]))
                s = F32(F32(1.0) / F32(F32(1.0) + ex))
                s_row.append(s)
                key.append(s if bias is None else F32(s + F32(bias[e])))
            order = sorted(range(e_n), key=lambda e: (0 if math.isnan(key[e]) else 1,
                                                     0.0 if math.isnan(key[e]) else float(key[e]), -e),
                           reverse=True)
            sel = order[:k]
            tot = s_row[sel[0]]
            for e in sel[1:]:
                tot = F32(tot + s_row[e])
            den = F32(tot + F32(1e-20))
            ids_out.append(sel)
            w_out.append([F32(F32(s_row[e] / den) * F32(scale)) for e in sel])
    return np.array(ids_out, np.int64), np.array(w_out, np.float32)


# =======================================================================================
# 2. float64 ranges
# =======================================================================================
def sum_range(terms, decl: SumDecl, axis: int = -1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bounds of a declared sum of `terms` (exact float64 values) into an fp32 result.

    Returns (lo, hi, free), lo/hi already rounded to fp32: every sum of these terms with at
    most decl.depth roundings of unit decl.u per term lies in [lo, hi]. NaN ends: the sum is NaN by
    definition (a NaN term, or +inf and -inf). +-inf terms alone: the sum is that inf.
    free: partial sums might overflow fp32 with mixed signs (anything accepted there).
    """
    terms = np.asarray(terms, np.float64)
    n = terms.shape[axis]
    with np.errstate(invalid="ignore", over="ignore"):
        nan = np.isnan(terms).any(axis)
        pinf = np.isposinf(terms).any(axis)
        ninf = np.isneginf(terms).any(axis)
        fin = np.where(np.isfinite(terms), terms, 0.0)
        e_ = fin.sum(axis)
        a_ = np.abs(fin).sum(axis)
        g = decl.bound()
        slack = 2 * gamma(n + 4, U["fp64"]) * a_ + decl.depth * 2.0**-150
        lo = e_ - g * a_ - slack
        hi = e_ + g * a_ + slack
        ovf = (1 + g) * a_ + slack >= _OVF32
        nonneg = (fin >= 0).all(axis)
        hi = np.where(ovf & nonneg, np.inf, hi)
        free = ovf & ~nonneg & ~pinf & ~ninf & ~nan
        lo = np.where(pinf, np.inf, np.where(ninf, -np.inf, lo))
        hi = np.where(pinf, np.inf, np.where(ninf, -np.inf, hi))
        nan = nan | (pinf & ninf)
        lo = np.where(nan, np.nan, lo)
        hi = np.where(nan, np.nan, hi)
    return r32(lo), r32(hi), free


def _inv_chain(ssq, n: int, eps: float) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = r32(ssq / n)
        d = r32(m + float(np.float32(eps)))
        r = r32(np.sqrt(d))
        return r32(1.0 / r)


def inv_range(ssq_lo, ssq_hi, n: int, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """inv = fl32(1/fl32(sqrt(fl32(fl32(ssq/n) + eps32)))) is decreasing in ssq."""
    return _inv_chain(ssq_hi, n, eps), _inv_chain(ssq_lo, n, eps)


def squares_range(h_lo, h_hi) -> tuple[np.ndarray, np.ndarray]:
    """Element-wise bounds of h*h for h in [h_lo, h_hi] (exact in float64 for bf16/fp32 h)."""
    with np.errstate(invalid="ignore", over="ignore"):
        a, b = h_lo * h_lo, h_hi * h_hi
        lo = np.where((h_lo <= 0) & (h_hi >= 0), 0.0, np.minimum(a, b))
        hi = np.maximum(a, b)
        nan = np.isnan(h_lo) | np.isnan(h_hi)
        return np.where(nan, np.nan, lo), np.where(nan, np.nan, hi)


def _minmax(*cands):
    return np.minimum.reduce(cands), np.maximum.reduce(cands)


def y_range(h_lo, h_hi, inv_lo, inv_hi, g, rounding: str) -> tuple[np.ndarray, np.ndarray]:
    """y from h in [h_lo, h_hi] [..., N], inv in [inv_lo, inv_hi] [..., 1], gamma g [N]:
    once: bf16(fl32(fl32(h*inv)*g)); mlx: bf16(fl32(g*bf16(fl32(h*inv)))). Products of
    bf16/fp32 by fp32 are exact in float64; rounding is monotone, so corners bound all."""
    with np.errstate(invalid="ignore", over="ignore"):
        t_lo, t_hi = _minmax(h_lo * inv_lo, h_lo * inv_hi, h_hi * inv_lo, h_hi * inv_hi)
        t_lo, t_hi = r32(t_lo), r32(t_hi)
        if rounding == "mlx":
            t_lo, t_hi = rbf(t_lo), rbf(t_hi)
        p_lo, p_hi = _minmax(t_lo * g, t_hi * g)
        return rbf(r32(p_lo)), rbf(r32(p_hi))


def norm_range(h_lo, h_hi, g, *, ssq: SumDecl, eps: float, rounding: str = "once"):
    """y bounds for rows [..., N] whose h lies in [h_lo, h_hi], the sum of squares as
    declared by `ssq`; returns (lo, hi, free)."""
    sq_lo, sq_hi = squares_range(h_lo, h_hi)
    s_lo, _, free_a = sum_range(sq_lo, ssq)
    _, s_hi, free_b = sum_range(sq_hi, ssq)
    i_lo, i_hi = inv_range(s_lo, s_hi, h_lo.shape[-1], eps)
    y_lo, y_hi = y_range(h_lo, h_hi, i_lo[..., None], i_hi[..., None], g, rounding)
    free = np.broadcast_to((free_a | free_b)[..., None], y_lo.shape)
    return y_lo, y_hi, free


def norm_range32(h, g, *, ssq: SumDecl, eps: float):
    """y bounds of the fp32 norm y = fl32(fl32(h * inv) * g) for rows h [..., N] (a point:
    fp32 values), the sum of squares as declared by `ssq`: norm_range's chain without the
    final bf16 rounding. Returns (lo, hi, free)."""
    h = np.asarray(h, np.float64)
    sq = squares_range(h, h)[0]
    s_lo, s_hi, free = sum_range(sq, ssq)
    i_lo, i_hi = inv_range(s_lo, s_hi, h.shape[-1], eps)
    with np.errstate(invalid="ignore", over="ignore"):
        inv_lo, inv_hi = i_lo[..., None], i_hi[..., None]
        t_lo, t_hi = _minmax(h * inv_lo, h * inv_hi)  # h * inv: exact in float64
        p_lo, p_hi = _minmax(r32(t_lo) * g, r32(t_hi) * g)
        return r32(p_lo), r32(p_hi), np.broadcast_to(free[..., None], h.shape)


def add_h32_ref(x, res) -> np.ndarray:
    """h = fl32(x + res) element-wise for fp32 x, res (res None: x + 0.0); float64 holds the
    exact IEEE fp32 sum (53 >= 2*24 + 2)."""
    res = 0.0 if res is None else np.asarray(res, np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        return r32(np.asarray(x, np.float64) + res)


def add_h_ref(x, res) -> np.ndarray:
    """h = bf16(fl32(x + res)) element-wise (a point: no sums)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return rbf(r32(np.asarray(x, np.float64) + np.asarray(res, np.float64)))


def moe_h_range(x, slots, w, *, n_shared: int, combine: SumDecl):
    """h bounds for moe_add_rms: the combine as a range from its declaration, each end rounded
    to bf16 (c = bf16(...)), then h = bf16(fl32(x + c)). Returns (lo, hi, free) [T, H]."""
    x = np.asarray(x, np.float64)
    sl = np.asarray(slots, np.float64)  # [S, T, H]
    r = sl.shape[0] - n_shared
    with np.errstate(invalid="ignore", over="ignore"):
        terms = np.concatenate([np.asarray(w, np.float64).T[:r, :, None] * sl[:r], sl[r:]], 0)
    c_lo, c_hi, free = sum_range(terms, combine, axis=0)  # [T, H]
    with np.errstate(invalid="ignore", over="ignore"):
        h_lo = rbf(r32(x + rbf(c_lo)))
        h_hi = rbf(r32(x + rbf(c_hi)))
    return h_lo, h_hi, free


def router_ranges(slices, bias=None, *, logit: SumDecl):
    """Bounds of logit, s and key [T, E] for router_topk: logit is the fp32 sum of the K
    slices as `logit` declares it; e = fl32(exp64(-logit)) with exp64 within 2 ulp64 of exp (the
    reference takes np.exp widened by 2**-48 relative); s = fl32(1/fl32(1+e)); key =
    fl32(s + bias). Returns dict of (lo, hi) pairs."""
    sl = np.asarray(slices, np.float64)
    l_lo, l_hi, _ = sum_range(sl, logit, axis=0)
    with np.errstate(over="ignore", invalid="ignore"):
        e_lo = r32(np.exp(-l_hi) * (1 - 2.0**-48))
        e_hi = r32(np.exp(-l_lo) * (1 + 2.0**-48))
        s_lo = r32(1.0 / r32(1.0 + e_hi))
        s_hi = r32(1.0 / r32(1.0 + e_lo))
        b = 0.0 if bias is None else np.asarray(bias, np.float64)
        k_lo, k_hi = (s_lo, s_hi) if bias is None else (r32(s_lo + b), r32(s_hi + b))
    return {"logit": (l_lo, l_hi), "s": (s_lo, s_hi), "key": (k_lo, k_hi)}


# =======================================================================================
# comparing an output with its range
# =======================================================================================
def compare(name: str, out, lo, hi, *, free=None) -> tuple[bool, float, str]:
    """out must be NaN where the range is NaN (the defined result), inside [lo, hi]
    elsewhere; free positions are not checked. Returns (ok, worst margin in range widths
    (reference.contract.range_margin: 0 on an end, negative outside; inf if nothing was
    checked), detail)."""
    out = np.asarray(out, np.float64)
    free = np.zeros(out.shape, bool) if free is None else np.broadcast_to(free, out.shape)
    nan_exp = (np.isnan(lo) | np.isnan(hi)) & ~free
    num = ~free & ~nan_exp
    bad_nan = nan_exp & ~np.isnan(out)
    with np.errstate(invalid="ignore"):
        bad_num = num & (np.isnan(out) | (out < lo) | (out > hi))
    margin = math.inf
    if num.any():
        margin = float(range_margin(out[num], lo[num], hi[num])[1].min())
    bad = bad_nan | bad_num
    n_bad = int(bad.sum())
    detail = (f"{name}: {int(num.sum())} in range checks, {int(nan_exp.sum())} NaN by definition, "
              f"{int(free.sum())} unconstrained, {n_bad} bad")
    if n_bad:
        pos = tuple(int(i) for i in np.argwhere(bad)[0])
        detail += (f"; first {name}{list(pos)} = {float(out[pos])!r} outside float64's "
                   f"[{float(lo[pos])!r}, {float(hi[pos])!r}]")
    return n_bad == 0, margin, detail


def router_check(slices, bias, k: int, scale: float, ids, w, *, decl: Decl) -> tuple[bool, float, str]:
    """Check router_topk's (ids, weights) against float64 ranges.

    ids: no unchosen expert may be certainly above a chosen one (its key lo > the chosen's
    key hi); point-equal keys must go to the lower id; the returned order must be key
    descending then id ascending under the same rules. NaN keys rank below everything.
    Overlapping ranges are near-ties: accepted and counted. weights: inside the range of
    fl32(fl32(s_j / fl32(sum + 1e-20)) * scale), the sum of the selected s as declared.
    decl: router_topk's declaration (sums "logit" and "s_sum").
    """
    ids = np.asarray(ids, np.int64)
    t_n, e_n = np.asarray(slices).shape[1:]
    if ids.shape != (t_n, k) or (ids < 0).any() or (ids >= e_n).any():
        return False, -math.inf, f"ids: bad shape {ids.shape} or id out of [0, {e_n})"
    if any(len(set(r)) != k for r in ids.tolist()):
        return False, -math.inf, "ids: an expert chosen twice in one row"
    rg = router_ranges(slices, bias, logit=decl.sum("logit"))
    k_lo, k_hi = (np.where(np.isnan(v), -np.inf, v) for v in rg["key"])
    point = k_lo == k_hi
    rows = np.arange(t_n)[:, None]
    chosen = np.zeros((t_n, e_n), bool)
    chosen[rows, ids] = True
    c_hi, c_lo, c_pt = k_hi[rows, ids], k_lo[rows, ids], point[rows, ids]  # [T, k]
    eid = np.arange(e_n)
    # pairs (chosen c, unchosen u): [T, k, E]
    uc = ~chosen[:, None, :]
    above = uc & (k_lo[:, None, :] > c_hi[:, :, None])
    tie = uc & point[:, None, :] & c_pt[:, :, None] & (k_lo[:, None, :] == c_lo[:, :, None]) \
        & (eid[None, None, :] < ids[:, :, None])
    same_pt = point[:, None, :] & c_pt[:, :, None] & (k_lo[:, None, :] == c_lo[:, :, None])
    near = uc & ~above & ~same_pt & (k_hi[:, None, :] >= c_lo[:, :, None])
    nxt_above = c_lo[:, 1:] > c_hi[:, :-1]
    nxt_tie = c_pt[:, 1:] & c_pt[:, :-1] & (c_lo[:, 1:] == c_lo[:, :-1]) & (ids[:, 1:] < ids[:, :-1])
    n_sel_bad = int((above | tie).any((1, 2)).sum() + (nxt_above | nxt_tie).any(1).sum())
    s_lo, s_hi = (v[rows, ids] for v in rg["s"])  # [T, k]
    sum_lo = sum_range(s_lo, decl.sum("s_sum"))[0]
    sum_hi = sum_range(s_hi, decl.sum("s_sum"))[1]
    with np.errstate(all="ignore"):
        d_lo, d_hi = r32(sum_lo + _GUARD32), r32(sum_hi + _GUARD32)
        sc = float(np.float32(scale))
        w_lo = r32(r32(s_lo / d_hi[:, None]) * sc)
        w_hi = r32(r32(s_hi / d_lo[:, None]) * sc)
    ok_w, margin, det_w = compare("weights", w, w_lo, w_hi)
    det = (f"ids: {n_sel_bad} rows with a certain misselection or misorder, "
           f"{int(near.any((1, 2)).sum())} rows with a near-tie; {det_w}")
    return ok_w and n_sel_bad == 0, margin, det
