"""orders.py against an independent slow emulation (reference/glue.emu_fma_sum: Python loops
over np.float32 scalars, fma exact via fractions.Fraction), bit for bit.

Shape legend: [rows, N] inputs, N the reduced width.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lmtail.numerics import U, fma32, gamma
from lmtail.kernels.glue.fmachain import products_exact
from lmtail.orders import Order, contiguous, fma_sum, lane_totals, placebo, strided, sum_squares
from lmtail.reference.glue import bf16_array, emu_fma_sum, fma_f32

ORDERS = [strided(32), contiguous(32), strided(64), contiguous(64), placebo(strided(64)),
          placebo(contiguous(32))]


def _emulate_rows(a: np.ndarray, b: np.ndarray, order: Order) -> np.ndarray:
    return np.array([emu_fma_sum(ra, rb, lanes=order.lanes, vec=order.vec,
                                 reverse_butterfly=order.reverse_butterfly) for ra, rb in zip(a, b)], np.float32)


def mismatches(impl, a: np.ndarray, b: np.ndarray, order: Order) -> int:
    """Rows where impl(a, b, order) differs bitwise from the declared-order emulation
    (NaN sign and payload are not part of any contract: every NaN compares as one)."""
    got = impl(torch.from_numpy(a), torch.from_numpy(b), order).numpy()
    want = _emulate_rows(a, b, order)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    return int((~same).sum())


def _data(kind: str, rows: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, n)) * np.exp(rng.uniform(-8, 8, (rows, n)))).astype(np.float32)
    b = rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "bf16_squares":  # bf16 values: products exact in fp32 (the fast path)
        a = bf16_array(a)
        return a, a
    if kind == "fp32_squares":  # full fp32 mantissas: the exact-fma path
        return a, a
    if kind == "specials":
        a = bf16_array(a)
        a[0, 0] = np.nan
        a[1, min(2, n - 1)] = np.inf
        a[2, :] = 0.0
        a[3, :] = -0.0
        a[4, :] = 1e-40  # subnormal, squares underflow (forces the exact-fma path)
        a[5, :] = 3e38  # squares overflow
        a[6, n // 2] = -np.inf
        b = a.copy()
        b[7, 0] = 0.0
        a[7, 0] = np.inf  # inf * 0 = NaN
        return a, b
    return a, b  # "dot": general products


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o.name)
@pytest.mark.parametrize("n", [1, 7, 33, 100, 300])
@pytest.mark.parametrize("kind", ["bf16_squares", "fp32_squares", "dot"])
def test_fma_sum_matches_emulation(order, n, kind):
    a, b = _data(kind, 3, n, seed=n * 7 + len(kind))
    assert mismatches(fma_sum, a, b, order) == 0


@pytest.mark.parametrize("order", [strided(32), contiguous(32)], ids=lambda o: o.name)
def test_specials_match_emulation(order):
    a, b = _data("specials", 8, 45, seed=3)
    assert mismatches(fma_sum, a, b, order) == 0
    got = sum_squares(torch.from_numpy(a), order).numpy()
    assert np.isnan(got[0]) and got[1] == np.inf and got[5] == np.inf and got[6] == np.inf
    assert got[2] == 0 and got[3] == 0 and not np.signbit(got[3]) and got[4] == 0
    assert torch.isnan(fma_sum(torch.from_numpy(a), torch.from_numpy(b), order)[7]).item()  # inf * 0


def test_fast_path_guard():
    """The fp32-add shortcut (fma(a, a, acc) == a*a + acc) is taken only when every square is
    exact: bf16 values with zeros -> taken; squares in fp32's subnormal range -> not taken,
    and forcing it there gives other bits than the exact-fma emulation (planted)."""
    rng = np.random.default_rng(17)
    z = bf16_array(rng.standard_normal((4, 300)))
    z[:, ::7] = 0.0
    zt = torch.from_numpy(z)
    assert products_exact(zt, zt, zt * zt)
    assert mismatches(fma_sum, z, z, strided(32)) == 0
    tiny = bf16_array(rng.uniform(1, 2, (4, 300)) * 2.0**-70)  # squares ~2**-140: subnormal
    tt = torch.from_numpy(tiny)
    assert not products_exact(tt, tt, tt * tt)
    assert mismatches(fma_sum, tiny, tiny, strided(32)) == 0

    def forced_add(x, y, o):
        acc = torch.zeros(x.shape[0], o.lanes)
        for i in range(0, x.shape[-1], o.lanes):
            c = torch.nn.functional.pad((x * y)[:, i : i + o.lanes], (0, max(0, i + o.lanes - x.shape[-1])))
            acc = acc + c
        return lane_totals(acc, o)

    assert mismatches(forced_add, z, z, strided(32)) == 0
    assert mismatches(forced_add, tiny, tiny, strided(32)) > 0
    wide = rng.standard_normal((2, 50)).astype(np.float32)  # 24-bit significands
    wt = torch.from_numpy(wide)
    assert not products_exact(wt, wt, wt * wt)


def test_default_width_orders_match_emulation():
    """The shipped default, strided(256), and contiguous(256) at a width past one pass."""
    a, _ = _data("bf16_squares", 2, 600, seed=5)
    f, _ = _data("fp32_squares", 1, 2100, seed=6)
    for order in (strided(256), contiguous(256), placebo(strided(256))):
        assert mismatches(fma_sum, a, a, order) == 0
        assert mismatches(fma_sum, f, f, order) == 0


def test_wrong_order_is_caught():
    """Planted: an implementation that sums in another order (the placebo, or contiguous for
    strided) must fail the bitwise check, while the declared one passes."""
    a, _ = _data("fp32_squares", 6, 300, seed=9)
    o = strided(32)
    assert mismatches(fma_sum, a, a, o) == 0
    assert mismatches(lambda x, y, _o: fma_sum(x, y, placebo(o)), a, a, o) > 0
    assert mismatches(lambda x, y, _o: fma_sum(x, y, contiguous(32)), a, a, o) > 0
    assert mismatches(lambda x, y, _o: (x.double() * y.double()).sum(-1).float(), a, a, o) > 0


def test_orders_differ_on_some_data():
    """The placebo and the two kinds are genuinely different orders (same precision)."""
    a = torch.from_numpy(_data("fp32_squares", 64, 2688, seed=11)[0])
    s = sum_squares(a, strided(256)).view(torch.int32)
    assert not torch.equal(s, sum_squares(a, placebo(strided(256))).view(torch.int32))
    assert not torch.equal(s, sum_squares(a, contiguous(256)).view(torch.int32))


def test_fma_emulation_is_exact():
    """fma_f32 rounds once: a case where float64 double rounding gives the wrong fp32."""
    a, b, c = np.float32(1 + 2**-15), np.float32(1 - 2**-15), np.float32(2**24 + 2)
    naive = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    assert naive == 2**24 + 4  # 2**24 + 3 - 2**-30 rounds to the tie 2**24 + 3 in float64
    assert fma_f32(a, b, c) == 2**24 + 2
    t = lambda v: torch.tensor([v], dtype=torch.float32)
    assert fma32(t(a), t(b), t(c)).item() == 2**24 + 2
    assert fma_f32(np.float32(-0.0), np.float32(1.0), np.float32(-0.0)) == 0
    assert np.signbit(fma_f32(np.float32(-0.0), np.float32(1.0), np.float32(-0.0)))
    assert np.isnan(fma_f32(np.float32(np.inf), np.float32(0.0), np.float32(1.0)))
    assert fma_f32(np.float32(2**-75), np.float32(2**-75), np.float32(0.0)) == 0  # underflow
    assert fma_f32(np.float32(2**-70), np.float32(2**-79), np.float32(0.0)) == np.float32(2**-149)
    assert fma_f32(np.float32(3e38), np.float32(2.0), np.float32(-3e38)) == np.float32(3e38)


def test_depth_and_describe():
    assert strided(256).depth(2688) == 11 + 5 + 7
    assert contiguous(256).depth(2688) == 16 + 5 + 7
    assert strided(32).depth(1) == 1 + 5
    assert "depth 23" in strided(256).describe(2688) and "16,8,4,2,1" in strided(256).describe(2688)
    assert "1,2,4,8,16" in placebo(strided(256)).describe(2688)


def test_depth_bounds_the_error():
    """|fl(sum) - exact| <= gamma(depth, u32) * sum|terms| on random rows; a declared depth
    one short of the chain is violated by some row (planted)."""
    a = _data("fp32_squares", 400, 700, seed=13)[0]
    got = sum_squares(torch.from_numpy(a), strided(32)).numpy().astype(np.float64)
    exact = np.array([math.fsum(float(v) ** 2 for v in row) for row in a.astype(np.float64)])
    depth = strided(32).depth(700)
    err = np.abs(got - exact) / exact
    assert (err <= gamma(depth, U["fp32"])).all()
    assert err.max() > U["fp32"]  # the rows do round: the bound is exercised


def test_lane_totals_fold():
    """Lane group totals: all 32 lanes of a butterfly agree, so lane 0 is the total."""
    lanes = torch.randn(5, 64)
    tot = lane_totals(lanes, strided(64)).numpy()
    for r in range(5):
        want = []
        for g in range(2):
            v = [np.float32(x) for x in lanes[r, 32 * g: 32 * g + 32].numpy()]
            for off in (16, 8, 4, 2, 1):
                v = [np.float32(v[i] + v[i ^ off]) for i in range(32)]
            assert len({float(x) for x in v}) == 1
            want.append(v[0])
        assert tot[r] == np.float32(want[0] + want[1])


@pytest.mark.parametrize("bad,match", [
    (lambda: Order("tree"), "strided' or 'contiguous'"),
    (lambda: Order("strided", 48), "multiple of 32"),
    (lambda: Order("strided", 32, 0), "vec must be >= 1"),
])
def test_order_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()
