"""Declared summation orders for row reductions (sum of squares, dot products).

An order is the exact sequence of fp32 roundings a GPU block of T threads would perform,
written down so that the CPU reproduces it bit for bit with vectorized tensor arithmetic:

    row [..., N]  --pad with zeros to P*T*vec-->  [..., P, T, vec]
        lane t holds elements {(p*T + t)*vec + j : p < P, j < vec}
        1. per lane: fp32 fma chain over (p, j) in increasing element order, from +0.0
        2. per 32-lane group: xor butterfly, offsets 16, 8, 4, 2, 1 (placebo: 1, 2, 4, 8, 16)
        3. the T/32 group totals added in group order (g = 0, 1, ...)

    strided(T)    vec = 1: lane t holds t, t+T, t+2T, ...   (coalesced scalar loads)
    contiguous(T) vec = 8: lane t holds 8 adjacent elements per pass (16-byte bf16 loads)

Zero padding is exact (fma(0, 0, acc) == acc), so N need not be a multiple of T*vec.
Depth (the most roundings any term goes through): P*vec + 5 + (T/32 - 1).

Shape legend: [..., N] input rows, [..., T] lanes, [...] totals.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .kernels.glue import fmachain



@dataclass(frozen=True)
class Order:
    """A declared reduction order (see module docstring)."""

    kind: str  # "strided" | "contiguous"
    lanes: int = 256  # T, a multiple of 32
    vec: int = 1  # elements a lane holds per pass
    reverse_butterfly: bool = False  # the placebo: same depth, another order

    def __post_init__(self):
        if self.kind not in ("strided", "contiguous"):
            raise ValueError(f"order kind must be 'strided' or 'contiguous'; got {self.kind!r}")
        if self.lanes < 32 or self.lanes % 32:
            raise ValueError(f"order lanes must be a positive multiple of 32; got {self.lanes}")
        if self.vec < 1:
            raise ValueError(f"order vec must be >= 1; got {self.vec}")

    @property
    def name(self) -> str:
        base = f"{self.kind}({self.lanes})"
        return base + ("+placebo" if self.reverse_butterfly else "")

    def chain_len(self, n: int) -> int:
        """Steps of each lane's fma chain for a row of n elements."""
        per_pass = self.lanes * self.vec
        return -(-n // per_pass) * self.vec

    def depth(self, n: int) -> int:
        """Most roundings any term of an n-element sum goes through."""
        return self.chain_len(n) + len(fmachain.BUTTERFLY) + (self.lanes // 32 - 1)

    def describe(self, n: int) -> str:
        fold = "1,2,4,8,16" if self.reverse_butterfly else "16,8,4,2,1"
        return (f"{self.name}: fp32 fma chain of {self.chain_len(n)} per lane "
                f"({self.vec} adjacent element(s) a pass), xor butterfly {fold} over 32 lanes, "
                f"{self.lanes // 32} lane groups added in order; depth {self.depth(n)}")


def strided(lanes: int = 256) -> Order:
    return Order("strided", lanes, 1)


def contiguous(lanes: int = 256) -> Order:
    return Order("contiguous", lanes, 8)


def placebo(order: Order) -> Order:
    """The same order with the butterfly folded in reverse: a yardstick for 'noise'."""
    return replace(order, reverse_butterfly=not order.reverse_butterfly)


def lane_totals(lanes: torch.Tensor, order: Order) -> torch.Tensor:
    """Steps 2-3: butterfly within each 32-lane group, then groups added in order.
    lanes [..., T] fp32 -> [...] fp32."""
    assert lanes.shape[-1] == order.lanes
    return fmachain.lane_fold(lanes, reverse=order.reverse_butterfly)


def available_backends() -> tuple[str, ...]:
    """Backends of fma_sum / sum_squares (kernels.glue.fmachain's), fastest first; same bytes."""
    return fmachain.available_backends()


def fma_sum(a: torch.Tensor, b: torch.Tensor, order: Order, *, backend: str | None = None,
            threads: int | None = None) -> torch.Tensor:
    """sum_i a[..., i] * b[..., i] in the declared order, fp32 in, fp32 out.

    a, b: [..., N] (widened to fp32; b broadcastable to a). Each lane's chain is
    acc = fma(a_i, b_i, acc) rounded once per step (exact fp32 fma), then `lane_totals`.
    Row-independent by construction: a row's result never depends on other rows.
    backend / threads: as kernels.glue.fmachain.fma_sum_rows (all backends give the same bits;
    NaN payloads not declared).
    """
    a = a.to(torch.float32)
    b = torch.broadcast_to(b.to(torch.float32), a.shape)
    return fmachain.fma_sum_rows(a, b, lanes=order.lanes, vec=order.vec,
                                 reverse=order.reverse_butterfly, backend=backend, threads=threads)


def sum_squares(x: torch.Tensor, order: Order, *, backend: str | None = None,
                threads: int | None = None) -> torch.Tensor:
    """ssq = sum x_i * x_i over the last dim, in the declared order. [..., N] -> [...]."""
    x = x.to(torch.float32)
    return fma_sum(x, x, order, backend=backend, threads=threads)
