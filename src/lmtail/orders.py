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

from .numerics import fma32

_BUTTERFLY = (16, 8, 4, 2, 1)


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
        return self.chain_len(n) + len(_BUTTERFLY) + (self.lanes // 32 - 1)

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
    t = lanes.shape[-1]
    assert t == order.lanes
    g = lanes.reshape(*lanes.shape[:-1], t // 32, 32)  # [..., T/32, 32]
    # After xor step `off` every lane i holds g_i + g_(i^off) (fp32 + commutes bitwise), so
    # lane 0's butterfly is a fold: offsets 16..1 add the two halves, 1..16 adjacent pairs.
    for _ in _BUTTERFLY:
        if order.reverse_butterfly:
            g = g[..., 0::2] + g[..., 1::2]
        else:
            half = g.shape[-1] // 2
            g = g[..., :half] + g[..., half:]
    total = g[..., 0, 0]
    for k in range(1, t // 32):
        total = total + g[..., k, 0]
    return total


def _products_exact(a: torch.Tensor, b: torch.Tensor, prod: torch.Tensor) -> bool:
    """True when fma(a_i, b_i, acc) == prod_i + acc for every element (prod = fp32 a*b).

    Cheap sufficient test: a and b are bf16 values (8-bit significands: low 16 bits zero),
    every product is finite and either a normal fp32 (then its 16 significant bits are
    exact) or an exact zero with a zero factor. Otherwise: compare against float64.
    """
    if not prod.numel():
        return True
    square = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    m = prod if square else prod.abs()  # a square is >= 0 or NaN
    lo, hi = torch.aminmax(m)
    bits = a.view(torch.int32) if square else a.view(torch.int32) | b.view(torch.int32)
    if bool(hi <= 3.4028234663852886e38) and int((bits & 0xFFFF).amax()) == 0:
        if bool(lo >= 2.0**-126):
            return True
        factor_zeros = m.numel() - int(torch.count_nonzero(a if square else torch.minimum(a.abs(), b.abs())))
        if int(torch.count_nonzero(m < 2.0**-126)) == factor_zeros:  # the small ones are exact zeros
            return True
    return bool(((prod.double() == a.double() * b.double()) | torch.isnan(prod)).all())


def _passes(z: torch.Tensor, t: int, v: int):
    """[..., N] -> the P passes [..., T, vec] of the order (views; only the last is padded)."""
    n, tv = z.shape[-1], t * v
    for i in range(0, n, tv):
        c = z[..., i : i + tv]
        if c.shape[-1] < tv:
            c = torch.nn.functional.pad(c, (0, tv - c.shape[-1]))
        yield c.reshape(*c.shape[:-1], t, v)


def fma_sum(a: torch.Tensor, b: torch.Tensor, order: Order) -> torch.Tensor:
    """sum_i a[..., i] * b[..., i] in the declared order, fp32 in, fp32 out.

    a, b: [..., N] fp32 (b broadcastable to a). Each lane's chain is acc = fma(a_i, b_i, acc)
    rounded once per step (exact fp32 fma), then `lane_totals`. Row-independent by
    construction: a row's result never depends on other rows. Runs the C kernel
    (kernels/fmachain.c, correctly rounded fmaf) when it is built and the inputs are on the
    CPU, else `_fma_sum_torch`, the reference: the same bits (NaN payloads not declared).
    """
    a = a.to(torch.float32)
    b = torch.broadcast_to(b.to(torch.float32), a.shape)
    from .kernels import fmachain  # lazy: the kernel module is optional

    if a.dim() >= 1 and a.device.type == "cpu" and fmachain.available_backends():
        return fmachain.fma_sum_rows(a, b, lanes=order.lanes, vec=order.vec,
                                     reverse=order.reverse_butterfly)
    return _fma_sum_torch(a, b, order)


def _fma_sum_torch(a: torch.Tensor, b: torch.Tensor, order: Order) -> torch.Tensor:
    """fma_sum's torch reference: fma32 (an exact fp32 fma emulated in float64) per step,
    vectorized over rows and lanes. When every product is exact in fp32 (squares of bf16
    values) the fma is one fp32 add of the product: same bits."""
    a = a.to(torch.float32)
    b = torch.broadcast_to(b.to(torch.float32), a.shape)
    prod = a * b  # [..., N] fp32 products
    t, v = order.lanes, order.vec
    acc = torch.zeros(a.shape[:-1] + (t,), dtype=torch.float32)  # [..., T]
    if _products_exact(a, b, prod):  # zero padding: 0*0 = +0 adds like fma(0, 0, acc)
        for pp in _passes(prod, t, v):
            for j in range(v):
                acc = acc + pp[..., j]
    else:
        for pa, pb in zip(_passes(a, t, v), _passes(b, t, v)):
            for j in range(v):
                acc = fma32(pa[..., j], pb[..., j], acc)
    return lane_totals(acc, order)


def sum_squares(x: torch.Tensor, order: Order) -> torch.Tensor:
    """ssq = sum x_i * x_i over the last dim, in the declared order. [..., N] -> [...]."""
    x = x.to(torch.float32)
    return fma_sum(x, x, order)
