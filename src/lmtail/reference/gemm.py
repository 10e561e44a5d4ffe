"""References for the bf16 GEMM: float64, and obvious emulations of its three declared orders.

Shape legend:
  M  rows of activations;  H  summed axis;  V  columns;  NB = ceil(H/32) 32-lane blocks
  a  [M, H] bf16;  w  [H, V] bf16;  results [M, V] (fp32 emulations, float64 ranges)

Both emulations step through the declared order one rounding at a time with an exact fp32
fma (`numerics.fma32` for the chain; `fma_rn` and the FTZ rule of `fma_ftz` for amx32) and
fp32 additions, vectorized over the elements (and, for amx32, over the independent 32-lane
blocks); they never use a kernel. tests/test_gemm.py checks amx32's against exact rational
arithmetic.
  chain  : acc = +0; acc = fma(a[m,h], w[h,v], acc) for h = 0..H-1; IEEE subnormals.
  amx32  : per 32-lane block (lanes past H are +0 * +0), e and o = fma chains from +0 over
           the even and odd lanes, then acc = acc + (e + o), blocks in order from acc = +0;
           inputs read with DAZ, every fma and add flushed with FTZ (tininess after rounding).
  dp32   : per 32-lane block, t = one fma chain from +0 over the lane pairs j = 0..15, the
           odd lane 2j+1 then the even lane 2j, then acc = acc + t, blocks in order from
           acc = +0; DAZ / FTZ as amx32 (VDPBF16PS per fp32 lane).
All store a NaN as 0x7FC00000.
"""
from __future__ import annotations


import numpy as np
import torch

from lmtail.numerics import U, Decl, fma32, gamma

FLT_MIN = 2.0**-126
_SCALE = 2.0**64  # moves a tiny exact value into fp32's normal range, exactly


# ---------------------------------------------------------------------------------------
# fp32 steps with DAZ / FTZ
# ---------------------------------------------------------------------------------------
def daz(x: np.ndarray) -> np.ndarray:
    """fp32 -> fp32: a subnormal becomes the zero of its sign (denormals-are-zero)."""
    tiny = (x != 0) & (np.abs(x) < FLT_MIN)
    return np.where(tiny, np.copysign(np.float32(0), x), x).astype(np.float32)


def fma_rn(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """IEEE fp32 fma, rounded once (gradual underflow), for a bf16-valued a or b:
    fl32(fl64(a*b + c)). The product has at most 16 significant bits and is exact in
    float64; the double rounding is innocuous for a 16-bit product plus a 24-bit addend
    (docs/gemm.md: the exact sum is a float64 unless the smaller term lies below 2^-6 ulp
    of the result, and then both roundings return the larger term)."""
    with np.errstate(all="ignore"):
        return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def fma_ftz(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """fp32 fma rounded once, then flushed to the zero of its sign when tiny AFTER rounding:
    when the exact a*b + c, rounded to 24 bits with an unbounded exponent, is below 2^-126.
    a, b: bf16 values, c: fp32; none subnormal (fp32 arrays, broadcastable).

    r = fma_rn(a, b, c) is the IEEE result (gradual underflow). |r| > 2^-126 is never tiny;
    0 < |r| <= 2^-126 may be (|r| = 2^-126 can come from an exact value just below it):
    there the same fma on a and c scaled by 2^64 (exact: such a tiny non-zero exact value
    needs |c| < 2^-109 and |a*b| < 2^-110, so |a| < 2^16) rounds x * 2^64 in the normal
    range, i.e. with an unbounded exponent, and decides. r = +-0 stays (its sign is x's).
    """
    r = fma_rn(a, b, c)
    near = (r != 0) & (np.abs(r) <= FLT_MIN)
    if near.any():
        zero = np.zeros_like(r)
        with np.errstate(all="ignore"):
            a_s = np.where(near, a * np.float32(_SCALE), zero)
            c_s = np.where(near, c * np.float32(_SCALE), zero)
        unbounded = fma_rn(a_s, np.where(near, b, zero), c_s)
        tiny = near & (np.abs(unbounded) < FLT_MIN * _SCALE)
        r = np.where(tiny, np.copysign(zero, r), r)
    return r


def add_ftz(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """fp32 x + y rounded once, then FTZ. x, y are fp32 and never subnormal (results of
    FTZ steps), so the exact sum is a multiple of 2^-149 and is tiny iff the rounded sum is
    below 2^-126."""
    with np.errstate(all="ignore"):
        r = x + y
    return np.where(np.abs(r) < FLT_MIN, np.copysign(np.float32(0), r), r)


def _canon(x: np.ndarray) -> torch.Tensor:
    x = np.where(np.isnan(x), np.float32(np.nan), x).astype(np.float32)
    return torch.from_numpy(x)


# ---------------------------------------------------------------------------------------
# the two declared orders, emulated
# ---------------------------------------------------------------------------------------
def gemm_chain_emulation(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The order "chain": [M, H] bf16 x [H, V] bf16 -> [M, V] fp32, one fma32 per h."""
    a32, w32 = a.float(), w.float()  # exact widening
    acc = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32)  # [M, V]
    for h in range(a.shape[1]):
        acc = fma32(a32[:, h:h + 1], w32[h:h + 1, :], acc)  # [M, 1] * [1, V] + [M, V]
    return _canon(acc.numpy())


def gemm_amx32_emulation(a: torch.Tensor, w: torch.Tensor, *, lane_pair_last: bool = False,
                         ftz: bool = True, pad_lanes: bool = True) -> torch.Tensor:
    """The order "amx32": [M, H] bf16 x [H, V] bf16 -> [M, V] fp32.

    The keyword switches only plant wrong variants for tests (defaults = the declaration):
    lane_pair_last=True adds acc = (acc + e) + o; ftz=False keeps subnormals (no FTZ, no
    DAZ); pad_lanes=False skips the +0 * +0 lanes past H.
    """
    M, H = a.shape
    V = w.shape[1]
    nb = -(-H // 32)
    kp = 32 * nb if pad_lanes else H
    step = fma_ftz if ftz else fma_rn
    add = add_ftz if ftz else (lambda x, y: x + y)
    rd = daz if ftz else (lambda x: x)
    a32 = np.zeros((M, 32 * nb), np.float32)  # [M, Kp], +0 past H
    a32[:, :H] = rd(a.float().numpy())
    w32 = np.zeros((32 * nb, V), np.float32)  # [Kp, V]
    w32[:H] = rd(w.float().numpy())
    ab = a32.reshape(M, nb, 32).transpose(1, 0, 2)  # [NB, M, 32]
    wb = w32.reshape(nb, 32, V)  # [NB, 32, V]
    e = np.zeros((nb, M, V), np.float32)  # [NB, M, V]: the blocks' chains run side by side
    o = np.zeros((nb, M, V), np.float32)
    lane0 = (np.arange(nb) * 32).reshape(nb, 1, 1)
    for i in range(0, 32, 2):
        e = np.where(lane0 + i < kp, step(ab[:, :, i:i + 1], wb[:, i:i + 1, :], e), e)
        o = np.where(lane0 + i + 1 < kp, step(ab[:, :, i + 1:i + 2], wb[:, i + 1:i + 2, :], o), o)
    acc = np.zeros((M, V), np.float32)  # [M, V], +0
    for b in range(nb):
        acc = add(add(acc, e[b]), o[b]) if lane_pair_last else add(acc, add(e[b], o[b]))
    return _canon(acc)


def _blocks(a: torch.Tensor, w: torch.Tensor, rd) -> tuple[np.ndarray, np.ndarray, int]:
    """a, w widened (rd: DAZ or identity), +0 past H, cut in 32-lane blocks:
    ab [NB, M, 32], wb [NB, 32, V], NB."""
    M, H = a.shape
    nb = -(-H // 32)
    a32 = np.zeros((M, 32 * nb), np.float32)  # [M, Kp], +0 past H
    a32[:, :H] = rd(a.float().numpy())
    w32 = np.zeros((32 * nb, w.shape[1]), np.float32)  # [Kp, V]
    w32[:H] = rd(w.float().numpy())
    return a32.reshape(M, nb, 32).transpose(1, 0, 2), w32.reshape(nb, 32, w.shape[1]), nb


def gemm_dp32_emulation(a: torch.Tensor, w: torch.Tensor, *, even_first: bool = False,
                        acc_ieee: bool = False, single_chain: bool = False,
                        ftz: bool = True) -> torch.Tensor:
    """The order "dp32": [M, H] bf16 x [H, V] bf16 -> [M, V] fp32.

    The keyword switches only plant wrong variants for tests (defaults = the declaration):
    even_first=True runs each pair's even lane before its odd lane; acc_ieee=True reads the
    accumulators t and acc as IEEE values and keeps their subnormal results (inputs still
    DAZ; "accumulator not DAZ" alone is the declaration itself, since t and acc are FTZ
    results and never subnormal); single_chain=True runs one chain t over every lane pair
    of every block (no block partial, no acc); ftz=False keeps subnormals everywhere.
    """
    M, V = a.shape[0], w.shape[1]
    ieee = acc_ieee or not ftz
    step = fma_rn if ieee else fma_ftz
    add = (lambda x, y: x + y) if ieee else add_ftz
    ab, wb, nb = _blocks(a, w, daz if ftz else (lambda x: x))
    first, second = (0, 1) if even_first else (1, 0)
    if single_chain:
        t = np.zeros((M, V), np.float32)  # [M, V]
        for b in range(nb):
            for i in range(0, 32, 2):
                for d in (first, second):
                    t = step(ab[b, :, i + d:i + d + 1], wb[b, i + d:i + d + 1, :], t)
        return _canon(t)
    t = np.zeros((nb, M, V), np.float32)  # [NB, M, V]: the blocks' chains run side by side
    for i in range(0, 32, 2):
        for d in (first, second):
            t = step(ab[:, :, i + d:i + d + 1], wb[:, i + d:i + d + 1, :], t)
    acc = np.zeros((M, V), np.float32)  # [M, V], +0
    for b in range(nb):
        acc = add(acc, t[b])
    return _canon(acc)


# ---------------------------------------------------------------------------------------
# float64
# ---------------------------------------------------------------------------------------
def gemm_f64(a: torch.Tensor, w: torch.Tensor) -> np.ndarray:
    """The exact-as-float64 product a @ w: float64 [M, V] (bf16 widened exactly)."""
    return a.double().numpy() @ w.double().numpy()


def gemm_range(a: torch.Tensor, w: torch.Tensor, decl: Decl) -> tuple[np.ndarray, np.ndarray]:
    """float64 [M, V] (lo, hi) that a correct result of the declared op must lie in.

    With S = sum_h a w and mag = sum_h |a w| (inputs DAZ'd where the sum declares flush)
    and d = the depth of the declared sum "gemm" (the most roundings any one product goes
    through):
        |out - S| <= gamma_fp32(d) * mag + 2 n eta + (float64 slack)
    2 n eta = the sum's underflow(): n = roundings per element (chain: H; amx32: 34 NB;
    dp32: 33 NB),
    eta = the absolute error one underflowing rounding can add (gradual: 2^-150; FTZ:
    2^-126). Elements whose row of a or column of w holds a NaN or inf, or that could
    overflow, get (-inf, +inf).
    """
    gsum = decl.sum("gemm")
    H = a.shape[1]
    a32, w32 = a.float().numpy(), w.float().numpy()
    if gsum.flush:
        a32, w32 = daz(a32), daz(w32)
    a64, w64 = a32.astype(np.float64), w32.astype(np.float64)
    fin_a, fin_w = np.isfinite(a64), np.isfinite(w64)
    a64, w64 = np.where(fin_a, a64, 0.0), np.where(fin_w, w64, 0.0)
    s = a64 @ w64  # [M, V]
    mag = np.abs(a64) @ np.abs(w64)  # [M, V]
    rel = gsum.bound()  # gamma(depth, u) of the declared sum
    slack = (rel + 2 * gamma(H, U["fp64"])) * mag * (1 + 2.0**-40) + gsum.underflow()
    lo, hi = s - slack, s + slack
    bad = ~(fin_a.all(axis=1)[:, None] & fin_w.all(axis=0)[None, :])
    bad |= mag * (1 + rel) >= float(np.finfo(np.float32).max)
    return np.where(bad, -np.inf, lo), np.where(bad, np.inf, hi)


def in_range(out: torch.Tensor, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """bool [M, V]: out inside [lo, hi]; a NaN only where the range is unbounded."""
    x = out.double().numpy()
    free = np.isneginf(lo) & np.isposinf(hi)
    with np.errstate(invalid="ignore"):
        return free | ((x >= lo) & (x <= hi))
