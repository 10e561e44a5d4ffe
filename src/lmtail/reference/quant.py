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
