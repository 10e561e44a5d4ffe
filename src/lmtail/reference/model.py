"""float64 references for the SmolLM2 body's declared pieces (model/body.py): exp, silu,
rope cos/sin, causal GQA attention. Obvious formulas in float64 (libm is fine here: these
are the yardsticks the declared fp32 versions are measured against, not a declared path).

Shape legend: B rows, T new tokens, nh / nkv query / KV heads, hd head dim, P positions,
n keys of a query.
"""
from __future__ import annotations

import math

import torch


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
