"""float64 references for gemm_q (GGUF Q8_0 / Q4_1 weights): the format's values, the exact
product, the range the declaration allows, and an emulation of the declared order
"lanes32" one rounding at a time (gemm_q_emulation, torch fp32). Imports no op: the weight is read from its
bytes here (any object with .fmt, .shape (N, K) and .data [N, NB*BS] uint8 will do, e.g.
kernels.quant.gemm_q.QuantWeight).

Shape legend:
  M rows;  K summed axis (a multiple of 32);  NB = K/32;  N output columns (weight rows)
  a [M, K] fp32;  w (N, K) in blocks;  results [M, N] float64

The values are the format's own, from the bytes (little-endian):
  Q8_0 (34 B): d fp16, q[32] int8                   value j = d * q[j]          (exact)
  Q4_1 (20 B): d fp16, m fp16, qs[16] uint8         q[j] = qs[j] & 15, q[j+16] = qs[j] >> 4
                                                    value j = fp32(d * q[j] + m)
The Q4_1 sum d*q + m is exact in float64 (at most 15 + 11 significant bits within fp16's
exponent range), so the one fp32 rounding the format defines is applied to the exact value.
"""
from __future__ import annotations

import numpy as np
import torch

from lmtail.numerics import U, Decl, fma32, gamma
from lmtail.reference.gemm import add_ftz, fma_ftz

_BS = {"Q8_0": 34, "Q4_1": 20}


def dequantize_f64(w) -> np.ndarray:
    """The format's values of w, float64 [N, K] (module docstring), from its bytes."""
    N, K = w.shape
    blk = np.asarray(w.data).reshape(N, K // 32, _BS[w.fmt])  # [N, NB, BS]
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float64)  # [N, NB, 1]
    if w.fmt == "Q8_0":
        q = blk[..., 2:].copy().view(np.int8).astype(np.float64)  # [N, NB, 32]
        return (d * q).reshape(N, K)
    m = blk[..., 2:4].copy().view(np.float16).astype(np.float64)
    qs = blk[..., 4:]  # [N, NB, 16]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.float64)  # [N, NB, 32]
    return (d * q + m).astype(np.float32).astype(np.float64).reshape(N, K)


def gemm_q_f64(a, w) -> np.ndarray:
    """a [M, K] (fp32, widened exactly) @ dequantize_f64(w)^T in float64: [M, N]."""
    return np.asarray(a, dtype=np.float64) @ dequantize_f64(w).T


def gemm_q_range(a, w, decl: Decl) -> tuple[np.ndarray, np.ndarray]:
    """float64 [M, N] (lo, hi) that a correct result of the declared op must lie in.

    With S = sum_k a w and mag = sum_k |a w| over the format's values, d = the depth of the
    declared sum "gemm" (the most roundings one product goes through: NB lane steps + 5 tree
    levels) and n = its roundings per element:
        |out - S| <= gamma_fp32(d) * mag + 2 n eta + (float64 slack)
    eta = 2^-150 (gradual underflow, the declaration's flush=False). Elements whose row of a
    or row of w holds a NaN or inf, or that could overflow, get (-inf, +inf)."""
    gsum = decl.sum("gemm")
    a64 = np.asarray(a, dtype=np.float64)
    w64 = dequantize_f64(w)  # [N, K]
    K = a64.shape[1]
    fin_a, fin_w = np.isfinite(a64), np.isfinite(w64)
    a64, w64 = np.where(fin_a, a64, 0.0), np.where(fin_w, w64, 0.0)
    s = a64 @ w64.T  # [M, N]
    mag = np.abs(a64) @ np.abs(w64).T  # [M, N]
    rel = gsum.bound()
    slack = (rel + 2 * gamma(K, U["fp64"])) * mag * (1 + 2.0**-40) + gsum.underflow()
    bad = ~(fin_a.all(axis=1)[:, None] & fin_w.all(axis=1)[None, :])
    bad |= mag * (1 + rel) >= float(np.finfo(np.float32).max)
    return np.where(bad, -np.inf, s - slack), np.where(bad, np.inf, s + slack)


def _values_f32(w, *, m_separate: bool):
    """The weight's fp32 values as terms [N, K] (one term; Q4_1 with m_separate: d*q and m,
    two terms, each exact in fp32)."""
    N, K = w.shape
    if not (m_separate and w.fmt == "Q4_1"):
        return [dequantize_f64(w).astype(np.float32)]
    blk = np.asarray(w.data).reshape(N, K // 32, _BS[w.fmt])
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float64)
    m = blk[..., 2:4].copy().view(np.float16).astype(np.float64)
    qs = blk[..., 4:]
    q = np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.float64)
    return [(d * q).astype(np.float32).reshape(N, K), np.broadcast_to(m, q.shape).astype(np.float32).reshape(N, K)]


def gemm_q_emulation(a, w, *, lanes: int = 32, m_separate: bool = False):
    """The declared order "lanes32", one rounding at a time: fp32 torch [M, N].

    Values from the bytes (dequantize_f64, exact in fp32); `lanes` fp32 chains from +0,
    lane j = numerics.fma32(a[lanes*b + j], value, lane j) per block b in order; then the
    halving tree l[j] = fl32(l[j] + l[j+h]); a NaN result -> 0x7FC00000. lanes=32 and
    m_separate=False are the declaration; lanes=16 and m_separate=True (Q4_1: fma with d*q,
    then a second fma with m) are planted wrong variants for the contract's controls."""
    a32 = torch.as_tensor(np.asarray(a, dtype=np.float32))  # [M, K]
    M, K = a32.shape
    N = w.shape[0]
    terms = [torch.from_numpy(np.ascontiguousarray(t)).reshape(1, N, K // lanes, lanes)
             for t in _values_f32(w, m_separate=m_separate)]  # [1, N, B, lanes] each
    a3 = a32.reshape(M, 1, K // lanes, lanes)  # [M, 1, B, lanes]
    acc = torch.zeros(M, N, lanes, dtype=torch.float32)  # [M, N, lanes]
    for b in range(K // lanes):
        for t in terms:
            acc = fma32(a3[:, :, b], t[:, :, b], acc)
    h = lanes // 2
    while h >= 1:
        acc = acc[..., :h] + acc[..., h:2 * h]
        h //= 2
    out = acc[..., 0]
    return torch.where(torch.isnan(out), torch.tensor(float("nan")), out)


# ---------------------------------------------------------------------------------------
# gemm_bq: the order "bq32" (kernels/quant/gemm_bq.c's declaration), modelled exactly
# ---------------------------------------------------------------------------------------
# Shape legend (bq32): parts [3, M, K] fp32 (bf16 values); q [N, NB, 32] fp32 integers;
# d, m [N, NB] fp32; the block arrays [NB, M, N] (every block's chains side by side).
_SCALE64 = np.float32(2.0**64)  # moves a tiny exact value into fp32's normal range, exactly


def bq_fields(w):
    """(d [N, NB], m [N, NB] or None, q [N, NB, 32]) as float32 from w's bytes: fp16 d and m
    widened exactly, q the block's integers (Q8_0 int8, Q4_1 0..15)."""
    N, K = w.shape
    blk = np.asarray(w.data).reshape(N, K // 32, _BS[w.fmt])  # [N, NB, BS]
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if w.fmt == "Q8_0":
        return d, None, blk[..., 2:].copy().view(np.int8).astype(np.float32)
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blk[..., 4:]
    return d, m, np.concatenate((qs & 15, qs >> 4), axis=-1).astype(np.float32)


def bq_split(a, parts: int = 3) -> np.ndarray:
    """Step 1 of bq32: fp32 a [M, K] -> [parts, M, K] float32 bf16 values, by bits.
    p0 = a's high 16 bits, r = a - p0 (exact), p1 = r's high 16 bits, p2 = r - p1; a non-finite
    a: p0 = a (NaN: 0x7FC0), the others +0; a zero or subnormal part: +0. parts=2 (p2 dropped)
    is a planted wrong variant."""
    a = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    u = a.view(np.uint32)
    ex = u & np.uint32(0x7F800000)
    nonfinite, normal = ex == 0x7F800000, (ex != 0) & (ex != 0x7F800000)
    hi = np.uint32(0xFFFF0000)

    def keep(h):  # a part's fp32 bits: +0 where its exponent is 0
        return np.where((h & np.uint32(0x7F800000)) != 0, h, np.uint32(0))

    h0 = u & hi
    p0 = np.where(nonfinite, np.where((u & np.uint32(0x7FFFFF)) != 0, np.uint32(0x7FC00000), h0),
                  np.where(normal, h0, np.uint32(0)))
    with np.errstate(all="ignore"):
        r = a - h0.view(np.float32)
        h1 = r.view(np.uint32) & hi
        h2 = (r - h1.view(np.float32)).view(np.uint32) & hi
    p1 = np.where(normal, keep(h1), np.uint32(0))
    p2 = np.where(normal, keep(h2), np.uint32(0))
    out = [p0, p1, p2][:parts]
    return np.stack([p.astype(np.uint32).view(np.float32) for p in out])


def _fma32_ftz(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma of any fp32 a, b, c (none subnormal), rounded once (numerics.fma32: exact),
    then flushed to the zero of its sign when tiny after rounding (decided, as
    reference.gemm.fma_ftz does, on the same fma scaled by 2^64 into the normal range)."""
    a, b, c = (np.broadcast_to(np.asarray(x, np.float32), np.broadcast_shapes(a.shape, b.shape, c.shape))
               for x in (a, b, c))
    r = fma32(torch.from_numpy(a.copy()), torch.from_numpy(b.copy()), torch.from_numpy(c.copy())).numpy()
    near = (r != 0) & (np.abs(r) <= np.float32(2.0**-126))
    if near.any():
        zero = np.zeros_like(r)
        with np.errstate(all="ignore"):
            a_s, c_s = np.where(near, a * _SCALE64, zero), np.where(near, c * _SCALE64, zero)
        big = fma32(torch.from_numpy(a_s), torch.from_numpy(np.where(near, b, zero)), torch.from_numpy(c_s)).numpy()
        r = np.where(near & (np.abs(big) < np.float32(2.0**-62)), np.copysign(zero, r), r)
    return r


def _block_sums(p: np.ndarray, q: np.ndarray | None, *, pair_sum_last: bool) -> np.ndarray:
    """Step 3 for every block side by side: p [P, M, K] parts, q [N, NB, 32] (None: every
    q = 1, i.e. s) -> c [NB, M, N] (or [NB, M, 1]). pair_sum_last=True (planted) adds
    c = (c + e) + o."""
    P, M, K = p.shape
    nb = K // 32
    pb = p.reshape(P, M, nb, 32).transpose(0, 2, 1, 3)[..., None, :]  # [P, NB, M, 1, 32]
    qb = np.ones((1, nb, 1, 1, 32), np.float32) if q is None else q.transpose(1, 0, 2)[None, :, None]  # [1, NB, 1, N, 32]
    c = np.zeros((nb, M, qb.shape[3]), np.float32)
    for t in range(P):
        e = np.zeros_like(c)
        o = np.zeros_like(c)
        for i in range(0, 32, 2):
            e = fma_ftz(pb[t, ..., i], qb[0, ..., i], e)
            o = fma_ftz(pb[t, ..., i + 1], qb[0, ..., i + 1], o)
        c = add_ftz(add_ftz(c, e), o) if pair_sum_last else add_ftz(c, add_ftz(e, o))
    return c


def bq_row_sums(a) -> np.ndarray:
    """s [M, NB] fp32 of bq32's step 4: step 3's c with every q = 1, from bq_split(a)."""
    return _block_sums(bq_split(a), None, pair_sum_last=False)[..., 0].T.copy()


def gemm_bq_emulation(a, w, *, parts: int = 3, pair_sum_last: bool = False, d_rounded: bool = False):
    """The declared order "bq32", one rounding at a time, FTZ/DAZ explicit: fp32 torch [M, N].

    a [M, K] fp32; w anything with .fmt, .shape (N, K), .data (the GGUF bytes). The keyword
    switches plant wrong variants for tests (defaults = the declaration): parts=2 (a 2-part
    split: p2 dropped), pair_sum_last=True (c = (c + e) + o), d_rounded=True (y = y + fl(d*c):
    the scale's product rounded before the add)."""
    p = bq_split(a, parts)  # [P, M, K]
    d, m, q = bq_fields(w)
    c = _block_sums(p, q, pair_sum_last=pair_sum_last)  # [NB, M, N]
    s = _block_sums(p, None, pair_sum_last=pair_sum_last)[..., 0] if m is not None else None  # [NB, M]
    y = np.zeros(c.shape[1:], np.float32)  # [M, N]
    for b in range(c.shape[0]):
        if d_rounded:
            with np.errstate(all="ignore"):
                prod = (d[None, :, b] * c[b]).astype(np.float32)
            prod = np.where(np.abs(prod) < np.float32(2.0**-126), np.copysign(np.float32(0), prod), prod)
            y = add_ftz(y, prod)
        else:
            y = _fma32_ftz(d[None, :, b], c[b], y)
        if m is not None:
            y = _fma32_ftz(m[None, :, b], s[b][:, None], y)
    y = np.where(np.isnan(y), np.float32(np.nan), y).astype(np.float32)
    return torch.from_numpy(y)


def bq_values_f64(w) -> np.ndarray:
    """The real weight values bq32 sums, float64 [N, K]: d*q (Q8_0, = the format's value) or
    d*q + m (Q4_1: exact in float64; the format's fp32 value rounds it once)."""
    d, m, q = bq_fields(w)
    v = d.astype(np.float64)[..., None] * q
    if m is not None:
        v = v + m.astype(np.float64)[..., None]
    return v.reshape(w.shape)


def gemm_bq_f64(a, w) -> np.ndarray:
    """a [M, K] (fp32, widened exactly) @ bq_values_f64(w)^T in float64: [M, N]."""
    return np.asarray(a, dtype=np.float64) @ bq_values_f64(w).T


def gemm_bq_range(a, w, decl: Decl) -> tuple[np.ndarray, np.ndarray]:
    """float64 [M, N] (lo, hi) a correct result of gemm_bq must lie in.

    The declared sum's terms are a*d*q and (Q4_1) a*m, each exact (the parts add up to a), so
    with S = sum_k a (d q + m) and mag = sum_k |a| (|d q| + |m|) (the sum of |terms|; for
    Q8_0 sum |a w|), d = the depth of the declared sum "gemm":
        |out - S| <= gamma_fp32(d) * mag + uf + (float64 slack)
    uf, the flushes (FTZ / DAZ, each drops less than 2^-126 where it happens): a flushed part
    or subnormal a drops < 2^-125 |a-term| per lane scale: 2^-124 sum_k (|d q| + |m|); the 102
    roundings of a block's c (and of s) scaled by |d_b| (|m_b|) into y: 2^-125 * 102 sum_b
    (|d_b| + |m_b|); y's own NB (2 NB) steps: 2^-125 * 2 NB. Elements whose row of a or of w
    holds a NaN or inf, or that could overflow (in y, or in a block's c or s), get (-inf, +inf)."""
    gsum = decl.sum("gemm")
    a64 = np.asarray(a, dtype=np.float64)
    M, K = a64.shape
    nb = K // 32
    d, m, q = bq_fields(w)
    dq = d.astype(np.float64)[..., None] * q  # [N, NB, 32]
    mm = np.zeros_like(d, dtype=np.float64) if m is None else m.astype(np.float64)
    v = (dq + mm[..., None]).reshape(w.shape)  # [N, K] real values
    fin_a, fin_w = np.isfinite(a64), np.isfinite(v)
    a64, v = np.where(fin_a, a64, 0.0), np.where(fin_w, v, 0.0)
    dq, mm = np.where(np.isfinite(dq), dq, 0.0), np.where(np.isfinite(mm), mm, 0.0)
    absv = (np.abs(dq) + np.abs(mm)[..., None]).reshape(w.shape)  # [N, K]
    s = a64 @ v.T
    mag = np.abs(a64) @ absv.T
    rel = gsum.bound()
    uf = 2.0**-124 * absv.sum(axis=1) + 2.0**-125 * (102 * (np.abs(np.where(np.isfinite(d), d, 0)).astype(np.float64)
                                                            + np.abs(mm)).sum(axis=1) + 2 * 2 * nb)
    slack = (rel + 2 * gamma(K, U["fp64"])) * mag * (1 + 2.0**-40) + uf[None, :]
    bad = ~(fin_a.all(axis=1)[:, None] & fin_w.all(axis=1)[None, :])
    big = float(np.finfo(np.float32).max) / 2
    bad |= mag * (1 + rel) >= big
    ab = np.abs(a64).reshape(M, nb, 32)
    cmax = np.einsum("mbk,nbk->mnb", ab, np.abs(q).astype(np.float64)).max(axis=2)  # [M, N] the largest block |c|
    bad |= (cmax >= big) | (ab.sum(axis=2).max(axis=1)[:, None] >= big)
    return np.where(bad, -np.inf, s - slack), np.where(bad, np.inf, s + slack)
