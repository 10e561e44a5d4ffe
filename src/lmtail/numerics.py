"""Rounding primitives, error bounds and the declarations every op makes.

Everything here is built from IEEE basic operations (+, -, *, /, sqrt, casts), which
torch and numpy round correctly on every machine, so the bits are the same everywhere.
Transcendentals (exp, log) are spelled out as range reduction + polynomial in float64
for the same reason: library exp/log may take a SIMD path or a scalar path depending
on where an element sits in a tensor, and that would leak batch shape into the bytes.

Shape legend: any shape; functions are elementwise unless they say otherwise.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

# Unit roundoffs (half an ulp of 1.0) of the formats lmtail sums in.
U = {"fp64": 2.0**-53, "fp32": 2.0**-24, "bf16": 2.0**-8, "fp16": 2.0**-11}
# (smallest normal, subnormal spacing) of each format
TINY = {"fp64": (2.0**-1022, 2.0**-1074), "fp32": (2.0**-126, 2.0**-149), "bf16": (2.0**-126, 2.0**-133),
        "fp16": (2.0**-14, 2.0**-24)}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n*u / (1 - n*u): the relative bound of an n-deep sum."""
    if n * u >= 1:
        return math.inf
    return n * u / (1 - n * u)


# ---------------------------------------------------------------------------------------
# declarations: what every op says about its rounding points and its sums
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SumDecl:
    """One declared sum: its accumulation dtype, its depth (max rounded adds any one
    result goes through) and its order in words.

    The float64 range of the sum is computed from this declaration alone: every result
    lies within `bound()` = gamma(depth, U[dtype]) times the sum of |terms| of the exact
    sum (Higham), so a declaration shallower or wider than the code makes that range too
    narrow for the op's output."""

    name: str
    dtype: str  # a key of U: "fp32" | "fp64" | "bf16" | "fp16"
    depth: int
    order: str
    # flush: inputs of the terms read with DAZ (a subnormal is the zero of its sign) and
    # every rounding followed by FTZ (a result tiny after rounding becomes a signed zero);
    # False: IEEE gradual underflow
    flush: bool = False
    roundings: int | None = None  # rounding steps per result in all (None: depth)

    def __post_init__(self):
        if self.dtype not in U:
            raise ValueError(f"sum {self.name!r}: dtype must be one of {sorted(U)}; got {self.dtype!r}")
        if not isinstance(self.depth, int) or self.depth < 0:
            raise ValueError(f"sum {self.name!r}: depth must be an int >= 0; got {self.depth!r}")
        if self.roundings is not None and (not isinstance(self.roundings, int) or self.roundings < 0):
            raise ValueError(f"sum {self.name!r}: roundings must be an int >= 0 or None; got {self.roundings!r}")

    @property
    def u(self) -> float:
        """The unit roundoff of the accumulation dtype."""
        return U[self.dtype]

    def bound(self) -> float:
        """gamma(depth, u): the relative bound of the declared sum (vs sum of |terms|)."""
        return gamma(self.depth, self.u)

    def underflow(self) -> float:
        """The absolute error underflow can add to one result, on top of bound():
        2 * roundings * eta. One rounding drops at most eta: the smallest normal of dtype
        under flush (a flushed result is below it), else half the subnormal spacing
        (gradual underflow); the later roundings scale that by at most 1 + bound() < 2."""
        normal, spacing = TINY[self.dtype]
        n = self.depth if self.roundings is None else self.roundings
        return 2 * n * (normal if self.flush else spacing / 2)


@dataclass(frozen=True)
class Decl:
    """The numerics of one op variant: its rounding points in order and its sums."""

    op: str
    rounding_points: tuple[str, ...]
    sums: tuple[SumDecl, ...]

    def sum(self, name: str) -> SumDecl:
        """The declared sum called `name` (KeyError naming the declared ones if absent)."""
        for s in self.sums:
            if s.name == name:
                return s
        raise KeyError(f"{self.op} declares no sum {name!r}; it declares {[s.name for s in self.sums]}")


# ---------------------------------------------------------------------------------------
# bf16
# ---------------------------------------------------------------------------------------
def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest bf16 (ties to even), returned widened to fp32 (exact)."""
    return x.to(torch.bfloat16).to(torch.float32)


# ---------------------------------------------------------------------------------------
# exact fp32 fma, emulated in float64
# ---------------------------------------------------------------------------------------
def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fused multiply-add, rounded once: round32(a*b + c), bit-exact.

    a, b, c are fp32 tensors (broadcastable). a*b is exact in float64 (24+24 < 53 bits).
    s = fl64(p + c) with its exact error e (TwoSum), so a*b + c = s + e exactly. Rounding
    is monotone and every fp32 midpoint is a float64, so round32(s) is the answer unless s
    sits exactly on a midpoint with e != 0; then the tie breaks toward the sign of e.
    """
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    e = (p - (s - bb)) + (cd - bb)  # TwoSum error, exact
    r = s.float()
    rd = r.double()
    inf = torch.full_like(r, math.inf)
    nb = torch.nextafter(r, torch.where(s > rd, inf, -inf))  # fp32 neighbour on s's side
    at_mid = (s != rd) & (s == (rd + nb.double()) * 0.5) & (e != 0)
    above = torch.where(rd > s, r, nb)
    below = torch.where(rd < s, r, nb)
    r = torch.where(at_mid, torch.where(e > 0, above, below), r)
    return r


# ---------------------------------------------------------------------------------------
# correctly rounded fp32 sqrt
# ---------------------------------------------------------------------------------------
def sqrt_rn32(d: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 sqrt, correctly rounded (fp32 [...] -> fp32 [...]).

    torch's fp32 sqrt is not correctly rounded on every CPU path (the AVX512 build here is
    one ulp off on ~0.6% of inputs), so: r = fp32(sqrt64(d)), then one exact correction step.
    The midpoints m between r and its fp32 neighbours have 25 significant bits, so m*m is
    exact in float64 and `m*m < d` decides the rounding exactly. sqrt(-0) = -0, sqrt(inf) =
    inf, NaN and negatives -> NaN.
    """
    d64 = d.double()
    r = torch.sqrt(d64).to(torch.float32)
    inf = torch.full_like(r, math.inf)
    up, down = torch.nextafter(r, inf), torch.nextafter(r, -inf)
    mid_hi = (r.double() + up.double()) * 0.5
    mid_lo = (r.double() + down.double()) * 0.5
    r = torch.where(mid_hi * mid_hi < d64, up, r)
    return torch.where((mid_lo * mid_lo > d64) & (r > 0), down, r)


# ---------------------------------------------------------------------------------------
# exp / log in float64 from basic ops only
# ---------------------------------------------------------------------------------------
_LN2_HI = 6.93147180369123816490e-01  # fdlibm split of ln 2: hi has trailing zeros
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
# Taylor coefficients 1/k! for k = 0..13 (|r| <= ln2/2: truncation < 2e-17 relative)
_EXP_C = [1.0 / math.factorial(k) for k in range(14)]


def exp64_constants() -> tuple[float, ...]:
    """exp64's 17 float64 constants in the order the C kernels take them (their K[17]):
    INV_LN2, LN2_HI, LN2_LO, then the Horner coefficients C[0..13] = 1/k!. The one source:
    kernels.tail.rowmass and kernels.tail.rows_tail hand exactly these to C (no C file holds its own)."""
    return (_INV_LN2, _LN2_HI, _LN2_LO, *_EXP_C)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """2**n for integer-valued float64 n in [-1022, 1023], built from the exponent bits."""
    return ((n.to(torch.int64) + 1023) << 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float64 from basic ops: x = n ln2 + r, exp(r) by a degree-13 Horner
    polynomial, times 2**n (split in two factors so results down to 2**-1074 are exact
    scalings). Error < 2 ulp of float64. exp(-inf) = 0, exp(+inf) = inf, NaN -> NaN.
    Arguments below -745 give 0, above 709.7 give inf."""
    x = x.double()
    xc = x.clamp(-746.0, 710.0)
    n = torch.round(xc * _INV_LN2)
    r = (xc - n * _LN2_HI).sub_(n * _LN2_LO)
    p = r * _EXP_C[13]
    for c in reversed(_EXP_C[1:13]):  # Horner, in place: the same ops, less memory traffic
        p.add_(c).mul_(r)
    p.add_(_EXP_C[0])
    if n.numel() == 0 or n.min() >= -1022:  # p * 2**n in one product: the same single rounding as below
        y = p.mul_(_pow2(n))
    else:  # 2**n is subnormal: split so the first product is exact, the second rounds once
        n1 = torch.floor(n * 0.5)
        n2 = n.sub_(n1)
        y = p.mul_(_pow2(n1.clamp_(-1022, 1023))).mul_(_pow2(n2.clamp_(-1022, 1023)))
    y = torch.where(x < -745.0, torch.zeros_like(y), y)
    y = torch.where(x > 709.78, torch.full_like(y, math.inf), y)
    return torch.where(torch.isnan(x), x, y)


_SQRT2 = math.sqrt(2.0)  # log64's mantissa split
_LOG_C = tuple(1.0 / (2 * i + 1) for i in range(15))  # log64's atanh series: 1/1, 1/3, ..., 1/29


def log64_constants() -> tuple[float, ...]:
    """log64's 16 float64 constants: SQRT2, then the series coefficients 1/(2i+1), i = 0..14
    (kernels/tail/rows_tail.c holds its own copy; a test compares the two bit for bit)."""
    return (_SQRT2, *_LOG_C)


def log64(x: torch.Tensor) -> torch.Tensor:
    """log(x) in float64 from basic ops, for x > 0 finite (the sums the sampler takes
    logs of are >= 1). x = m * 2**e with m in [sqrt(1/2), sqrt(2)); log(m) = 2 atanh(s),
    s = (m-1)/(m+1), by its odd series to s**29 (|s| < 0.172: truncation < 1e-22).
    log(0) = -inf, log(inf) = inf, log(<0) and NaN -> NaN."""
    x = x.double()
    bits = x.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & ((1 << 52) - 1)) | (1023 << 52)).view(torch.float64)  # [1, 2)
    big = m > _SQRT2
    m = torch.where(big, m * 0.5, m)
    e = torch.where(big, e + 1, e).double()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = torch.full_like(s, _LOG_C[14])
    for i in range(13, -1, -1):  # 1/27, 1/25, ..., 1/1
        p = p * s2 + _LOG_C[i]
    y = 2.0 * s * p + e * _LN2_LO + e * _LN2_HI
    ok = (x > 0) & torch.isfinite(x) & (x >= 2.2250738585072014e-308)
    y = torch.where(ok, y, torch.full_like(y, math.nan))
    y = torch.where(x == 0, torch.full_like(y, -math.inf), y)
    y = torch.where(x == math.inf, torch.full_like(y, math.inf), y)
    return y


# ---------------------------------------------------------------------------------------
# counter-based draws: u from (seed, position), the same bits on any machine
# ---------------------------------------------------------------------------------------
def _splitmix64(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


DEFAULT_U = 0.5  # the draw of a sampled row given neither a seed nor u (sampler, rows_tail)


def draw_u(seed, position) -> np.ndarray:
    """u in [0, 1) from a per-request seed and a decode position: SplitMix64 applied to
    splitmix64(seed) + position (mod 2**64), top 24 bits / 2**24. Exact in fp32.
    Vectorized over arrays of seeds and positions (broadcast); returns float32."""
    s = np.asarray(seed, dtype=np.int64).astype(np.uint64)
    p = np.asarray(position, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        z = _splitmix64(_splitmix64(s) + p)
    return ((z >> np.uint64(40)).astype(np.float64) / float(1 << 24)).astype(np.float32)
