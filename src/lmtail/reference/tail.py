"""float64 NumPy references for the decode tail: norm, GEMM, top-k, sampler.

Two kinds of reference live here:
  * ideal values: the real-number math in float64 with no intermediate rounding
    (`logits_ref`, `topk_ref`, `sampler_ref`), for distances and token certification;
  * declared ranges: `logits_range` emulates the op's declared rounding points exactly
    where they are deterministic (x*gamma in fp32, the bf16 rounding of `a`) and turns
    each declared sum into exact +- gamma(depth, u) * sum|terms| (+ its underflow slack,
    with DAZ inputs where the sum declares flush), propagated through the op and rounded
    outward to the output dtype. The op's output must lie inside. Depth, u and flush
    come from the op's declaration (a numerics.Decl with sums "ssq" and "gemm"), which
    the caller passes in: this module never imports the op it checks.

The head W is [H, V] (bf16 values, a tensor or an array) or a GGUF block weight (an
object with .fmt, .shape (V, H), .data: kernels.quant.gemm_q.QuantWeight, the Q8_0 head), read
through `head_values` as its exact values (reference.quant.dequantize_f64, transposed).
Which activation the GEMM reads comes from the declaration: with a rounding point
"a:bf16" it is bf16(fp32(x*gamma)), without one (the Q8_0 head, head_input "fp32") the
fp32 product itself.

Shape legend: gbs rows, H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from ..numerics import U, Decl, SumDecl, exp64, gamma, log64
from .gemm import daz
from .quant import dequantize_f64

BF16 = ml_dtypes.bfloat16
_W64 = 4 * 2.0**-53  # widening for float64 arithmetic on interval ends


def as_np(t) -> np.ndarray:
    """torch tensor (any float dtype) or array -> float64 ndarray, exactly."""
    if isinstance(t, torch.Tensor):
        t = t.detach()
        if t.dtype == torch.bfloat16:
            t = t.float()
        return t.double().numpy()
    return np.asarray(t, dtype=np.float64)


def head_values(w) -> np.ndarray:
    """The head as float64 [H, V], exactly: a [H, V] tensor or array as is (as_np); a
    GGUF block weight (.fmt, shape (V, H), .data) by its format's values
    (reference.quant.dequantize_f64), transposed."""
    if hasattr(w, "fmt") and hasattr(w, "data"):
        return dequantize_f64(w).T
    return as_np(w)


def real_lanes(h: int, h_u: int, interleaved: bool) -> np.ndarray:
    lane = np.arange(h)
    if not interleaved or h == h_u:
        return lane < h_u
    g = h // 4
    return (lane % g) < (g - (h - h_u) // 4)


def _prep(x, gamma_, h_u, interleaved):
    x = as_np(x)
    h = x.shape[1]
    h_u = h if h_u is None else h_u
    real = real_lanes(h, h_u, interleaved)
    x = np.where(real, x, 0.0)
    return x, as_np(gamma_).reshape(h), real, h_u


# ---------------------------------------------------------------------------------------
# ideal values
# ---------------------------------------------------------------------------------------
def rms_ref(x, *, eps, hidden_actual=None, interleaved=True) -> np.ndarray:
    """[gbs] float64: 1 / sqrt(sum_real x^2 / H_u + eps), squares summed with fsum."""
    x, _, _, h_u = _prep(x, np.ones(np.shape(x)[1]), hidden_actual, interleaved)
    ssq = np.array([math.fsum(r * r) for r in x])
    return 1.0 / np.sqrt(ssq / h_u + eps)


def logits_ref(x, gamma_, w, *, eps, hidden_actual=None, interleaved=True) -> np.ndarray:
    """[gbs, V] float64: ((x * rms) * gamma) @ W with W's values (head_values: bf16, or a
    Q8_0 head's exact values), no rounding of the activations; pad lanes contribute nothing."""
    rms = rms_ref(x, eps=eps, hidden_actual=hidden_actual, interleaved=interleaved)
    x, g, real, _ = _prep(x, gamma_, hidden_actual, interleaved)
    a = np.where(real, x * g, 0.0)
    return (a @ head_values(w)) * rms[:, None]


def topk_ref(values, k: int, *, nan_fold: bool = True):
    """Row-wise exact top-k of float64 values: the k largest, ties to the lower id, NaN
    (when folded) below every number. Returns (values [R, k], ids [R, k])."""
    v = as_np(values)
    out_v, out_i = [], []
    for row in v:
        ids = np.arange(row.size)
        nan = np.isnan(row)
        key = np.where(nan, 0.0, -row)  # -0.0 and +0.0 compare equal: a tie
        order = np.lexsort((ids, key, nan if nan_fold else np.zeros_like(nan)))[:k]
        out_v.append(row[order])
        out_i.append(ids[order])
    return np.array(out_v), np.array(out_i)


def sampler_ref(row, *, top_k=0, top_p=1.0, temperature=1.0, u=0.5, min_p=0.0) -> dict:
    """One row, the obvious way over the FULL row (no k truncation): HF order top-k,
    softmax(v/T) over the filtered set, top-p keeping the crossing token, min-p, then
    pos = #{j : cdf_j <= u}. Returns token, kept ids (in order), their probabilities
    (before the final renormalization) and logprob (raw, T=1, full row)."""
    v = as_np(row).reshape(-1)
    order = np.lexsort((np.arange(v.size), -v))
    sv = v[order]
    m1 = sv.max()
    logprob_all = v - (m1 + math.log(math.fsum(np.exp(v - m1))))
    if temperature < 1e-5:
        tok = int(order[0])
        return {"token": tok, "kept": [tok], "probs": [1.0], "logprob": logprob_all[tok]}
    n = v.size if top_k <= 0 else int(np.sum(sv >= sv[min(top_k, v.size) - 1]))
    z = sv[:n] / temperature
    e = np.exp(z - z.max())
    p = e / math.fsum(e)
    keep = 1 if top_p < 1 else n
    if top_p < 1:
        mass = 0.0
        keep = 0
        for pi in p:
            if mass < top_p:
                keep += 1
                mass += pi
            else:
                break
    p = p[:keep]
    p = p[: max(1, int(np.sum(p >= min_p * p[0])))]
    cdf = np.cumsum(p) / math.fsum(p)
    pos = min(int(np.sum(cdf <= u)), p.size - 1)
    tok = int(order[pos])
    return {"token": tok, "kept": [int(i) for i in order[: p.size]], "probs": list(p),
            "logprob": logprob_all[tok]}


# ---------------------------------------------------------------------------------------
# declared ranges
# ---------------------------------------------------------------------------------------
def _fp32(a):
    return np.asarray(a, dtype=np.float32)


def _down(a, dtype):
    """Largest value of `dtype` <= a (float64 in, float64 out)."""
    r = np.asarray(a, dtype=np.float64).astype(dtype).astype(np.float64)
    step = np.nextafter(r.astype(dtype), dtype(-np.inf)).astype(np.float64)
    return np.where(r > a, step, r)


def _up(a, dtype):
    r = np.asarray(a, dtype=np.float64).astype(dtype).astype(np.float64)
    step = np.nextafter(r.astype(dtype), dtype(np.inf)).astype(np.float64)
    return np.where(r < a, step, r)


def _round_range(lo, hi, u, dtype):
    """An fp32 rounding point on [lo, hi]: widen by u relative, then outward to dtype."""
    lo = lo - np.abs(lo) * (u + _W64)
    hi = hi + np.abs(hi) * (u + _W64)
    return _down(lo, dtype), _up(hi, dtype)


def rms_range(x, *, eps, ssq: SumDecl, hidden_actual=None, interleaved=True):
    """fp32 [gbs] bounds on the op's rms: ssq within ssq.bound() (gamma(depth, u) of the
    declared sum) of the exact sum, then four fp32 rounding points (/H_u, +eps, sqrt, 1/s)
    each within u32, rounded outward."""
    x, _, _, h_u = _prep(x, np.ones(np.shape(x)[1]), hidden_actual, interleaved)
    u = U["fp32"]
    sq = x * x  # exact in float64 (fp32 inputs)
    s = np.array([math.fsum(r) for r in sq])
    gm = ssq.bound()
    lo, hi = _round_range(s * (1 - gm), s * (1 + gm), 0.0, np.float32)
    lo, hi = _round_range(lo / h_u, hi / h_u, u, np.float32)
    e32 = float(np.float32(eps))
    lo, hi = _round_range(lo + e32, hi + e32, u, np.float32)
    lo, hi = _round_range(np.sqrt(lo), np.sqrt(hi), u, np.float32)
    with np.errstate(divide="ignore"):
        return _round_range(1.0 / hi, 1.0 / lo, u, np.float32)


def gemm_input(x, gamma_, *, hidden_actual=None, interleaved=True, rms=None, bf16=True) -> np.ndarray:
    """The op's bf16 GEMM input, emulated exactly: bf16(fp32(x*gamma)) (deferred) or
    bf16(fp32(fp32(x*rms)*gamma)) given the op's fp32 rms (legacy); bf16=False: the fp32
    product unrounded (the Q8_0 head's g). float64 [gbs, H], pad lanes 0."""
    x, g, real, _ = _prep(x, gamma_, hidden_actual, interleaved)
    x32, g32 = _fp32(x), _fp32(g)
    if rms is not None:
        x32 = x32 * _fp32(rms)[:, None]
    with np.errstate(invalid="ignore", over="ignore"):
        a = x32 * g32
    a = (a.astype(BF16) if bf16 else a).astype(np.float64)
    return np.where(real, a, 0.0)


def gemm_input_split(x, gamma_, *, hidden_actual=None, interleaved=True):
    """The op's two bf16 GEMM inputs of head_input "bf16x2", emulated exactly: a_hi =
    bf16(g), a_lo = bf16(fp32(g - a_hi)) (0 where a_hi is inf), g = fp32(x*gamma).
    float64 ([gbs, H], [gbs, H])."""
    x, g, real, _ = _prep(x, gamma_, hidden_actual, interleaved)
    xg = _fp32(x) * _fp32(g)
    hi = xg.astype(BF16).astype(np.float32)
    with np.errstate(invalid="ignore"):
        lo = np.where(np.isinf(hi), np.float32(0), xg - hi).astype(BF16).astype(np.float64)
    return np.where(real, hi.astype(np.float64), 0.0), np.where(real, lo, 0.0)


def _daz(x: np.ndarray) -> np.ndarray:
    """float64 bf16 values -> the same with subnormals read as signed zeros (exact)."""
    return daz(x.astype(np.float32)).astype(np.float64)


def gemm_range(a_lo, a_hi, w, *, gemm: SumDecl):
    """Range of the declared GEMM sum over h for interval inputs (bf16 values): the exact
    sum's range +- gemm.bound() * sum|terms| + gemm.underflow() (plus the float64
    matmul's own error), fp32 outward. A sum declared with flush reads its inputs with
    DAZ (monotone, so the interval ends stay ends)."""
    w = as_np(w)
    h = w.shape[0]
    if gemm.flush:
        a_lo, a_hi, w = _daz(a_lo), _daz(a_hi), _daz(w)
    wp, wn = np.maximum(w, 0.0), np.minimum(w, 0.0)
    lo = a_lo @ wp + a_hi @ wn  # each term at its smallest
    hi = a_hi @ wp + a_lo @ wn
    mag = np.maximum(np.abs(a_lo), np.abs(a_hi)) @ np.abs(w)
    slack = (gemm.bound() + gamma(h, U["fp64"])) * mag + gemm.underflow()
    return _down(lo - slack, np.float32), _up(hi + slack, np.float32)


def logits_range(x, gamma_, w, *, eps, decl: Decl, hidden_actual=None, interleaved=True, deferred_rms=True):
    """fp32 [gbs, V] (lo, hi) that the op's logits must lie in (module docstring).
    decl: the tail's declaration (tail.tail_decl(H, deferred_rms, gemm_order, exchange,
    head_input)); its sums "ssq" and "gemm" set the two sums' ranges (the GEMM's with its
    declared flush); a rounding point "a_lo:bf16" (head_input "bf16x2") makes the GEMM two
    (a_hi and a_lo, each the declared sum) added in fp32; no "a:bf16" point (the Q8_0
    head) makes the GEMM's input the unrounded fp32(x*gamma). w: [H, V] values or a Q8_0
    head (V, H) (head_values)."""
    w = head_values(w)
    r_lo, r_hi = rms_range(x, eps=eps, ssq=decl.sum("ssq"), hidden_actual=hidden_actual, interleaved=interleaved)
    kw = dict(hidden_actual=hidden_actual, interleaved=interleaved)
    gemm = decl.sum("gemm")
    if deferred_rms and "a_lo:bf16" in decl.rounding_points:  # head_input "bf16x2"
        a_hi, a_lo = gemm_input_split(x, gamma_, **kw)
        lo1, hi1 = gemm_range(a_hi, a_hi, w, gemm=gemm)
        lo2, hi2 = gemm_range(a_lo, a_lo, w, gemm=gemm)
        lo, hi = _round_range(lo1 + lo2, hi1 + hi2, U["fp32"], np.float32)  # acc_hi + acc_lo
        cands = [lo * r_lo[:, None], lo * r_hi[:, None], hi * r_lo[:, None], hi * r_hi[:, None]]
        return _round_range(np.minimum.reduce(cands), np.maximum.reduce(cands), U["fp32"], np.float32)
    if deferred_rms:
        a = gemm_input(x, gamma_, bf16="a:bf16" in decl.rounding_points, **kw)
        lo, hi = gemm_range(a, a, w, gemm=gemm)
        cands = [lo * r_lo[:, None], lo * r_hi[:, None], hi * r_lo[:, None], hi * r_hi[:, None]]
        return _round_range(np.minimum.reduce(cands), np.maximum.reduce(cands), U["fp32"], np.float32)
    a1 = gemm_input(x, gamma_, rms=r_lo, **kw)
    a2 = gemm_input(x, gamma_, rms=r_hi, **kw)
    return gemm_range(np.minimum(a1, a2), np.maximum(a1, a2), w, gemm=gemm)


def mirror_range(lo, hi):
    """The bf16 mirror of logits in [lo, hi]: rounded outward to bf16."""
    return _down(lo, BF16), _up(hi, BF16)


# ---------------------------------------------------------------------------------------
# the full-row mass in its declared order (row_mass, rows_tail's S and log-normalizer)
# ---------------------------------------------------------------------------------------
def sum64_emulation(terms: np.ndarray, lanes: int = 256) -> np.ndarray:
    """[R, N] float64 -> [R]: `lanes` float64 lane chains (lane t holds t, t + lanes, ...,
    added in pass order from +0.0), then a halving tree (lane t += lane t + lanes/2, ...),
    one numpy add at a time. lanes=256 is the declared sum64; another count is a planted
    variant."""
    r, n = terms.shape
    p = -(-n // lanes)
    x = np.zeros((r, p * lanes))
    x[:, :n] = terms
    acc = np.zeros((r, lanes))
    for i in range(p):
        acc = acc + x[:, i * lanes:(i + 1) * lanes]
    w = lanes
    while w > 1:
        w //= 2
        acc = acc[:, :w] + acc[:, w:2 * w]
    return acc[:, 0]


def mass_emulation(rows, scale, *, lanes: int = 256):
    """(m, S, nz) [R] of row_mass by its declaration, emulated: z = fl64(row / scale),
    m = max z, e = exp64(z - m) (z == m -> exactly 1), S = sum64_emulation(e, lanes),
    nz = #{e > 0}. rows [R, V] and scale [R] (float64-exact values, NaN-free)."""
    z = as_np(rows) / as_np(scale)[:, None]  # [R, V]
    m = z.max(axis=1)
    d = np.where(z == m[:, None], 0.0, z - m[:, None])
    e = exp64(torch.from_numpy(d)).numpy()
    return m, sum64_emulation(e, lanes), (e > 0).sum(axis=1)


def logprob_emulation(rows_bf16, tokens, *, lanes: int = 256) -> np.ndarray:
    """[R] fp32: the raw logprob fp32(fl64(v_tok - lse1)), lse1 = fl64(vmax + log64(S1)) with
    S1 the full row's mass at T = 1 (mass_emulation). On rows whose S1 - 1 < 2^-28 and
    vmax in [1, 2) the logprob of the max token is exactly -(lse1 - 1): S1's last bit shows."""
    r64 = as_np(rows_bf16)
    m, s, _ = mass_emulation(r64, np.ones(r64.shape[0]), lanes=lanes)
    lse1 = m + log64(torch.from_numpy(s)).numpy()
    tok = np.asarray(tokens, dtype=np.int64)
    return (r64[np.arange(r64.shape[0]), tok] - lse1).astype(np.float32)
