"""float64/NumPy reference of the candidates exchange's row statistics, on FULL rows.

`candidates_emulation` computes, from a row's whole fp32 logits, what the owner of the
row holds after the candidates exchange merged every rank's partials (lmtail.tail.candidates,
its module docstring is the declaration emulated here): the exact fp32 top-k with the
largest lane outside it, and the row masses combined from 256 global chunk partials in
chunk order. The chunk bounds floor(j * V / 256) depend on V alone, so these numbers are
the same for every VTP dividing 256: one full-row computation is the reference for any
rank layout. This module never imports lmtail.tail.candidates nor lmtail.kernels.tail.shard_partials
(the code it checks); it uses lmtail.numerics.exp64 (the declared exp) and the sum64 /
row-mass emulations of lmtail.reference.tail.

Numerics emulated (float64 from the exactly widened fp32 lanes, NaN -> -inf when folded):
  chunk j of lanes [b_j, b_{j+1}) at scale s: (m_j, S_j) = mass_emulation (z = fl64(v / s),
    m_j = max z, S_j = sum64(exp64(z - m_j)), z == m_j -> exactly 1), then m_j := m_j + 0.0;
    an empty chunk is (-inf, 0), a chunk of -inf lanes only is (-inf, its lane count).
  row: m = max_j m_j (+0.0); t_j = fl64(S_j * exp64(m_j - m)) (m_j == m -> factor exactly
    1); S = sum64_emulation over the 256 terms t_j in chunk order (combine_order permutes
    them: a planted variant).
  top-k: lanes ordered by fp32 value descending (-0 == +0), ties to the lower id; with
    nan_fold every NaN sits below -inf (all equal, so by id) and reads back as the
    canonical NaN 0x7FC00000; without it a NaN orders by its bit pattern as the
    declared mono32 key does (a positive NaN above +inf, a negative one below -inf).

Shape legend: R rows, V vocab (full row), k candidates, C = 256 chunks.
"""
from __future__ import annotations

import numpy as np
import torch

from ..numerics import exp64
from .tail import mass_emulation, sum64_emulation

MASS_CHUNKS = 256  # the declared global chunk count (lmtail.tail.candidates.MASS_CHUNKS)
CANONICAL_NAN = 0x7FC00000


def declared_bounds(v: int) -> np.ndarray:
    """[C + 1] int64: chunk j is vocab ids [b[j], b[j+1]), b[j] = floor(j * v / C)."""
    return np.arange(MASS_CHUNKS + 1, dtype=np.int64) * v // MASS_CHUNKS


def _fp32(logits) -> np.ndarray:
    if isinstance(logits, torch.Tensor):
        logits = logits.detach().contiguous().numpy()
    a = np.ascontiguousarray(logits)
    assert a.dtype == np.float32 and a.ndim == 2, "logits must be [R, V] float32"
    return a


def _order_key(x32: np.ndarray, nan_fold: bool) -> np.ndarray:
    """[R, V] int64 whose descending order is the lanes' declared order (ids break ties)."""
    b = x32.view(np.int32).astype(np.int64)
    b = np.where(b == -(1 << 31), 0, b)  # -0 -> +0: the same value as +0
    key = np.where(b < 0, b ^ 0x7FFFFFFF, b)  # sign-magnitude -> two's complement order
    if nan_fold:
        key = np.where(np.isnan(x32), -(1 << 31), key)  # below -inf's key (-2**31 + 0x800000 - 1)
    return key


def _topk(x32: np.ndarray, k1: int, nan_fold: bool):
    """(values [R, k1] float32, ids [R, k1] int64, present [R, k1] bool) in declared order;
    slots past V are (-inf, -1, False)."""
    r, v = x32.shape
    key = _order_key(x32, nan_fold)
    ids = np.arange(v)
    vals = np.full((r, k1), -np.inf, dtype=np.float32)
    out_i = np.full((r, k1), -1, dtype=np.int64)
    n = min(k1, v)
    for i in range(r):
        order = np.lexsort((ids, -key[i]))[:n]  # value descending, then id ascending
        row = x32[i, order].copy()
        row[row == 0] = 0.0  # -0 -> +0
        if nan_fold:
            nan = np.isnan(row)
            row.view(np.int32)[nan] = CANONICAL_NAN
        vals[i, :n] = row
        out_i[i, :n] = order
    present = np.zeros((r, k1), dtype=bool)
    present[:, :n] = True
    return vals, out_i, present


def _chunk_mass(row64: np.ndarray, scale: np.ndarray, bounds: np.ndarray):
    """(m, S) [R, C'] float64 of the chunks [bounds[j], bounds[j+1]) of row64 [R, V] at
    scale [R] (module docstring)."""
    r = row64.shape[0]
    c = bounds.size - 1
    m = np.full((r, c), -np.inf)
    s = np.zeros((r, c))
    for j in range(c):
        lo, hi = int(bounds[j]), int(bounds[j + 1])
        if hi == lo:
            continue  # empty: (-inf, 0)
        with np.errstate(invalid="ignore"):  # inf - inf where z == m: replaced by 0
            mj, sj, _ = mass_emulation(row64[:, lo:hi], scale)
        mj = mj + 0.0
        m[:, j] = mj
        s[:, j] = np.where(mj == -np.inf, float(hi - lo), sj)
    return m, s


def _combine(m: np.ndarray, s: np.ndarray, order: np.ndarray):
    """(m, S) [R] from chunk partials [R, C] (module docstring)."""
    top = m.max(axis=1) + 0.0
    with np.errstate(invalid="ignore"):
        d = np.where(m == top[:, None], 0.0, m - top[:, None])
    f = exp64(torch.from_numpy(np.ascontiguousarray(d))).numpy()
    t = s * f
    return top, sum64_emulation(np.ascontiguousarray(t[:, order]))


def candidates_emulation(logits, *, k: int, nan_fold: bool = False, temperatures=None, bounds=None,
                         combine_order=None) -> dict:
    """The owner's merged row statistics of the candidates exchange, from full rows.

    logits [R, V] float32 (numpy or torch); k >= 1 candidates; nan_fold: NaN lanes fold to
    -inf (mass) and below -inf (order); temperatures [R] float64 or None: rows with
    T != 0 get the T pass (z = v / T; the kernel's scale_t), the others have mT = ST = 0;
    bounds [C' + 1] int64 chunk bounds over [0, V] (None: the declared floor(j V / 256));
    combine_order: a permutation of the C' chunk terms for the row sum (None: chunk order;
    another is a planted variant).
    Returns numpy arrays: values [R, k] float32 (descending, ties to the lower id, -0 ->
    +0, folded NaN -> canonical NaN, -inf past V), ids [R, k] int64 (-1 past V), outside
    [R] float32 (the (k+1)-th lane, -inf if V <= k), has_outside [R] bool, m1, S1, mT, ST
    [R] float64, nans [R] int64 (NaN lanes). Masses of rows with NaN and nan_fold=False
    are unspecified (the op raises before it uses them).
    """
    x32 = _fp32(logits)
    r, v = x32.shape
    k = int(k)
    assert k >= 1, "k must be >= 1"
    vals, ids, present = _topk(x32, k + 1, nan_fold)
    row64 = x32.astype(np.float64)
    nan = np.isnan(row64)
    if nan_fold:
        row64 = np.where(nan, -np.inf, row64)
    else:  # undefined for the op: any finite stand-in keeps the emulation quiet
        row64 = np.where(nan, 0.0, row64)
    b = declared_bounds(v) if bounds is None else np.asarray(bounds, dtype=np.int64)
    assert b[0] == 0 and b[-1] == v and np.all(np.diff(b) >= 0), "bounds must cover [0, V] in order"
    order = np.arange(b.size - 1) if combine_order is None else np.asarray(combine_order, dtype=np.int64)
    assert np.array_equal(np.sort(order), np.arange(b.size - 1)), "combine_order must be a permutation"
    m, s = _chunk_mass(row64, np.ones(r), b)
    m1, s1 = _combine(m, s, order)
    mt, st = np.zeros(r), np.zeros(r)
    if temperatures is not None:
        t = np.asarray(temperatures, dtype=np.float64).reshape(r)
        rows = np.nonzero(t != 0)[0]
        if rows.size:
            m, s = _chunk_mass(row64[rows], t[rows], b)
            mt[rows], st[rows] = _combine(m, s, order)
    return {"values": vals[:, :k], "ids": ids[:, :k], "outside": vals[:, k], "has_outside": present[:, k],
            "m1": m1, "S1": s1, "mT": mt, "ST": st, "nans": nan.sum(axis=1).astype(np.int64)}
