"""float64 references for the SmolLM2 body's declared pieces (model/body.py): exp, silu,
rope cos/sin, causal GQA attention. Obvious formulas in float64 (libm is fine here: these
are the yardsticks the declared fp32 versions are measured against, not a declared path).

Shape legend: B rows, T new tokens, nh / nkv query / KV heads, hd head dim, P positions,
n keys of a query.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..numerics import SumDecl, exp64, log64


def exp_ref(x: torch.Tensor) -> torch.Tensor:
    """exp(x) in float64 (x widened exactly)."""
    return torch.exp(x.double())


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(g) * u = g * u / (1 + exp(-g)) in float64; [..., F] -> [..., F] float64."""
    g = gate.double()
    return g / (1.0 + torch.exp(-g)) * up.double()


def rope_ref(n_positions: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd/2] float64 of p * base**(-2i/hd), one position and pair at a time
    (Python floats: math.pow, math.cos, math.sin)."""
    inv = [math.pow(base, -2.0 * i / head_dim) for i in range(head_dim // 2)]
    cos = [[math.cos(p * f) for f in inv] for p in range(n_positions)]
    sin = [[math.sin(p * f) for f in inv] for p in range(n_positions)]
    return torch.tensor(cos, dtype=torch.float64), torch.tensor(sin, dtype=torch.float64)


def attend_ref(q: torch.Tensor, kt: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, *, s0: int,
               scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in float64, one query at a time over keys 0..p.

    q [B, T, nh, hd], kt [B, nkv, hd, S_cap] (keys transposed), v [B, nkv, S_cap, hd];
    key j of row b is slot pad[b] + j; query t has position p = s0 + t - pad[b] (p < 0:
    output 0). Query head h reads KV head h // (nh / nkv). Returns [B, T, nh, hd] float64."""
    B, T, nh, hd = q.shape
    g = nh // kt.shape[1]
    out = torch.zeros(B, T, nh, hd, dtype=torch.float64)
    for b in range(B):
        base = int(pad[b])
        for t in range(T):
            p = s0 + t - base
            if p < 0:
                continue
            for h in range(nh):
                k = kt[b, h // g, :, base:base + p + 1].double()  # [hd, n]
                s = (q[b, t, h].double() @ k) * scale  # [n]
                w = torch.softmax(s, 0)
                out[b, t, h] = w @ v[b, h // g, base:base + p + 1].double()
    return out


# ---------------------------------------------------------------------------------------
# ranges from the declarations (the contract's body kinds)
# ---------------------------------------------------------------------------------------
U32 = 2.0**-24  # fp32 unit roundoff
TINY32 = 2.0**-149  # fp32 subnormal spacing


def spacing32(want: torch.Tensor) -> torch.Tensor:
    """The fp32 spacing above |fp32(want)| (float64 [...]; 2^-149 at zero): one ulp."""
    w32 = want.float().abs()
    return (torch.nextafter(w32, torch.tensor(math.inf)) - w32).double()


def ulp_range(want: torch.Tensor, n_ulp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[want - n ulp, want + n ulp] (float64), the range of a result declared within n_ulp
    ulp of the exact float64 value `want`."""
    w = want.double()
    d = n_ulp * spacing32(w)
    return w - d, w + d


def silu_range(gate: torch.Tensor, up: torch.Tensor, n_ulp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(g) * u within n_ulp ulp plus one subnormal spacing (a tiny product rounds
    absolutely); float64 [..., F]."""
    lo, hi = ulp_range(silu_mul_ref(gate, up), n_ulp)
    return lo - TINY32, hi + TINY32


# fdlibm's pi/2 in three 33-bit parts and the Taylor coefficients rope_decl names (spelled
# here again, not imported: the emulation must not move with the op's constants)
_PIO2 = (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21)
_INVPIO2 = 6.36619772367581382433e-01


def rope_emulation(n_positions: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd/2] fp32 by rope_decl's rounding points, one float64 numpy op at a time:
    inv_freq = exp64(log64(base) * (-2i / hd)), theta = p * inv_freq, k = round(theta 2/pi),
    r = ((theta - k P1) - k P2) - k P3, Taylor Horner in r^2 (sin to r^17, cos to r^18:
    s = s r^2 + c, two roundings a step), quadrant by k mod 4, one rounding to fp32."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    lb = log64(torch.tensor(float(base), dtype=torch.float64)).item()
    inv = exp64(torch.from_numpy(lb * (-2.0 * i / head_dim))).numpy()  # [hd/2]
    theta = np.arange(n_positions, dtype=np.float64)[:, None] * inv[None, :]  # [P, hd/2]
    k = np.round(theta * _INVPIO2)
    r = ((theta - k * _PIO2[0]) - k * _PIO2[1]) - k * _PIO2[2]
    r2 = r * r
    s = np.full_like(r, (-1) ** 8 / math.factorial(17))
    for j in range(7, -1, -1):
        s = s * r2 + (-1) ** j / math.factorial(2 * j + 1)
    s = s * r
    c = np.full_like(r, (-1) ** 9 / math.factorial(18))
    for j in range(8, -1, -1):
        c = c * r2 + (-1) ** j / math.factorial(2 * j)
    q = k.astype(np.int64) % 4
    cos = np.select([q == 0, q == 1, q == 2], [c, -s, -c], s)
    sin = np.select([q == 0, q == 1, q == 2], [s, c, -s], -c)
    return torch.from_numpy(cos.astype(np.float32)), torch.from_numpy(sin.astype(np.float32))


def rope_apply_range(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The range of apply_rope's (fl32(fl32(xe c) - fl32(xo s)), fl32(fl32(xe s) + fl32(xo c)))
    for the given fp32 table entries (exact inputs): each pair within 2u(1 + u) of the
    float64 value relative to the sum of |products|, plus 3 subnormal spacings. x [..., hd],
    cos, sin broadcastable to [..., hd/2]; returns lo, hi float64 [..., hd] (pairs interleaved)."""
    xe, xo = x[..., 0::2].double(), x[..., 1::2].double()
    c, s = cos.double(), sin.double()
    ye, yo = xe * c - xo * s, xe * s + xo * c
    ee = (2 * U32 * (1 + U32)) * ((xe * c).abs() + (xo * s).abs()) + 3 * TINY32
    eo = (2 * U32 * (1 + U32)) * ((xe * s).abs() + (xo * c).abs()) + 3 * TINY32
    lo = torch.stack((ye - ee, yo - eo), -1).flatten(-2)
    hi = torch.stack((ye + ee, yo + eo), -1).flatten(-2)
    return lo, hi


def attend_range(q, kt, v, pad, *, s0: int, scale: float, dot: SumDecl, den: SumDecl, acc: SumDecl,
                 exp_ulp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 range [lo, hi] [B, T, nh, hd] of attend's output from its declared sums
    (dot, den, acc: gamma(depth, u) each) and exp32's declared accuracy (exp_ulp ulp), per
    query (a pad query: exactly +0). Derivation: the scores s_j err by
    delta_j = scale (gamma_dot + hd 2^-53) sum_d |q_d k_jd| + u |s_j| (+ tiny); the max m is
    common to every key and cancels in the softmax, the subtraction adds u |s_j - m|, exp32 a
    factor (1 +- rho), rho = exp_ulp 2^-23: key weights w_j = exp(s_j - s_max) scaled by
    factors in [L, U], which moves the weighted mean by at most (U/L - 1) * sum w|v - mean|/W;
    then den errs by gamma_den relatively, acc by gamma_acc * sum e|v| (<= U/L * the mean of
    |v| times den), the division by u. Keys under exp32's floor (+0) add n * 5e-38 max|v|."""
    B, T, nh, hd = q.shape
    g = nh // kt.shape[1]
    rho = exp_ulp * 2.0**-23
    lo = torch.zeros(B, T, nh, hd, dtype=torch.float64)
    hi = torch.zeros(B, T, nh, hd, dtype=torch.float64)
    for b in range(B):
        base = int(pad[b])
        for t in range(T):
            p = s0 + t - base
            if p < 0:
                continue
            for h in range(nh):
                kk = kt[b, h // g, :, base:base + p + 1].double()  # [hd, n]
                vv = v[b, h // g, base:base + p + 1].double()  # [n, hd]
                prod = q[b, t, h].double()[:, None] * kk  # [hd, n] (exact)
                s = prod.sum(0) * scale  # [n]
                delta = (scale * (dot.bound() + hd * 2.0**-53) * prod.abs().sum(0) + U32 * s.abs() * (1 + U32)
                         + scale * dot.underflow() + TINY32)
                a = delta + U32 * ((s.max() - s) + 2 * delta.max())
                w = torch.exp(s - s.max())  # [n]
                mean = (w[:, None] * vv).sum(0) / w.sum()  # [hd]
                mad = (w[:, None] * (vv - mean).abs()).sum(0) / w.sum()
                ratio = float((torch.exp(a) * (1 + rho)).max() / (torch.exp(-a) * (1 - rho)).min())
                mabs = ratio * (w[:, None] * vv.abs()).sum(0) / w.sum()
                gd, ga = den.bound(), acc.bound()
                err = ((ratio - 1) * mad + mabs * gd / (1 - gd) + (ga * mabs + acc.underflow()) / (1 - gd)
                       + vv.shape[0] * 5e-38 * float(vv.abs().max()))
                err = err + U32 * (mean.abs() + err) + TINY32
                lo[b, t, h], hi[b, t, h] = mean - err, mean + err
    return lo, hi
