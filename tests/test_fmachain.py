"""kernels/fmachain: every C backend against the "torch" backend, bit for bit (int32 views).

fma_sum_rows (the "torch" backend itself checked against the float64-free scalar
emulation reference/glue.emu_fma_sum here and in test_orders.py) and moe_routed; every
available C backend, several thread counts. NaN sign and
payload are not declared (test_orders.py: every NaN compares as one), so NaN lanes are
mapped to one canonical pattern on both sides before the bitwise compare; a NaN on one
side only is still a mismatch. Shape legend: R rows, N width, S slots, T tokens, H width.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import stand_ins

from lmtail.kernels.glue import fmachain
from lmtail.glue.norms import add_rms, inv_rms, moe_add_rms, rms_parts
from lmtail.numerics import fma32
from lmtail.orders import (Order, contiguous, fma_sum, lane_totals, placebo,
                           strided, sum_squares)
from lmtail.reference.glue import bf16_array, emu_fma_sum

# the C ones, and the emulated rows of the vector paths this CPU lacks (SIMDe)
BACKENDS = tuple(b for b in fmachain.available_backends() if b != "torch") + stand_ins(fmachain.FMA_SUM)
pytestmark = pytest.mark.skipif(not BACKENDS, reason="fmachain C kernel unavailable (no C compiler)")
ORDERS = [strided(32), contiguous(32), strided(256), contiguous(256), placebo(strided(64)),
          placebo(contiguous(96)), Order("contiguous", 64, 3)]


def bits(x: torch.Tensor) -> torch.Tensor:
    """int32 view with every NaN as 0x7FC00000 (NaN payloads are not declared)."""
    x = x.contiguous()
    return torch.where(torch.isnan(x), torch.tensor(0x7FC00000, dtype=torch.int32), x.view(torch.int32))


def kernel(backend: str, threads: int | None = None):
    def impl(a, b, order):
        return fmachain.fma_sum_rows(a, b, lanes=order.lanes, vec=order.vec,
                                     reverse=order.reverse_butterfly, threads=threads, backend=backend)
    return impl


def _fma_sum_torch(a, b, order: Order) -> torch.Tensor:
    """The "torch" backend of fma_sum_rows."""
    return fmachain.fma_sum_rows(a, b, lanes=order.lanes, vec=order.vec,
                                 reverse=order.reverse_butterfly, backend="torch")


def _moe_routed_torch(slots, w, r):
    """The "torch" backend of moe_routed."""
    return fmachain.moe_routed(slots, w, nslots=r, backend="torch")


def mismatches(impl, a: torch.Tensor, b: torch.Tensor, order: Order) -> int:
    """Rows where impl(a, b, order) differs bitwise from the torch reference."""
    got, want = impl(a, b, order), _fma_sum_torch(a, b, order)
    assert got.shape == want.shape and got.dtype == torch.float32
    return int((bits(got) != bits(want)).sum())


def _data(kind: str, rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((rows, n)) * np.exp(rng.uniform(-8, 8, (rows, n)))).astype(np.float32)
    b = rng.standard_normal((rows, n)).astype(np.float32)
    if kind == "bf16_squares":  # products exact in fp32 (the torch fast path)
        a = bf16_array(a)
        b = a
    elif kind == "fp32_squares":
        b = a
    elif kind == "specials":
        a = bf16_array(a)
        b = a.copy()
        k = rows
        a[0 % k, 0] = np.nan
        a[1 % k, min(2, n - 1)] = np.inf
        a[2 % k] = -0.0
        b[3 % k] = 1e-30  # a * 1e-30 underflows: subnormal products, lost bits
        a[4 % k] = 1e-40  # subnormal inputs
        a[5 % k] = 3e38  # products overflow
        a[6 % k, n // 2] = -np.inf
        b[7 % k, 0], a[7 % k, 0] = 0.0, np.inf  # inf * 0 = NaN
        a[8 % k], b[8 % k] = 1e-30, -1e-30  # every product rounds to -0.0
        a[9 % k, ::3] = np.inf  # inf - inf = NaN when signs mix
        a[9 % k, 1::3] = -np.inf
    return torch.from_numpy(a), torch.from_numpy(b)


# ---------------------------------------------------------------------------------------
# fma_sum_rows: C backends == the torch backend
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: o.name + f"v{o.vec}")
@pytest.mark.parametrize("rows,n", [(1, 1), (1, 7), (3, 97), (300, 97), (2, 2688), (300, 2687)])
@pytest.mark.parametrize("kind", ["dot", "fp32_squares", "bf16_squares", "specials"])
def test_fma_sum_matches_torch(order, rows, n, kind):
    a, b = _data(kind, rows, n, seed=rows * 31 + n + len(kind))
    for backend in BACKENDS:
        assert mismatches(kernel(backend), a, b, order) == 0, backend


def test_specials_are_where_declared():
    """The specials rows give the values IEEE fixes (not only the reference's bits)."""
    a, b = _data("specials", 10, 63, seed=1)
    for backend in BACKENDS:
        got = kernel(backend)(a, b, strided(32))
        assert torch.isnan(got[[0, 7, 9]]).all() and torch.isinf(got[1])  # b != a on row 1
        assert got[2] == 0 and not torch.signbit(got[2])
        # row 8: every lane's chain is -0.0, but lane 31 pads its second pass: +0.0 wins
        assert got[8] == 0 and not torch.signbit(got[8])
        neg = torch.full((1, 64), 1e-30)
        allneg = kernel(backend)(neg, -neg, strided(32))  # 2 full passes, no padding
        assert allneg.item() == 0 and torch.signbit(allneg).item()  # -0.0 kept


def test_torch_reference_matches_scalar_emulation():
    """The reference path itself, against reference/glue.emu_fma_sum (small: the
    emulation is a Python loop)."""
    for kind in ("dot", "specials"):
        a, b = _data(kind, 10, 45, seed=4)
        for order in (strided(32), placebo(contiguous(32))):
            with np.errstate(over="ignore", invalid="ignore"):  # inf rows: IEEE, on purpose
                want = [emu_fma_sum(ra, rb, lanes=order.lanes, vec=order.vec,
                                    reverse_butterfly=order.reverse_butterfly)
                        for ra, rb in zip(a.numpy(), b.numpy())]
            want = torch.from_numpy(np.array(want, np.float32))
            assert torch.equal(bits(_fma_sum_torch(a, b, order)), bits(want))
            assert torch.equal(bits(fma_sum(a, b, order)), bits(want))


def test_threads_batch_and_layout_do_not_change_bits():
    a, b = _data("dot", 300, 2687, seed=7)
    order = contiguous(256)
    for backend in BACKENDS:
        ref = bits(kernel(backend, threads=1)(a, b, order))
        for t in (2, 3, 7):
            assert torch.equal(bits(kernel(backend, threads=t)(a, b, order)), ref)
        for k in (0, 151, 299):  # a row alone == that row in the batch
            assert torch.equal(bits(kernel(backend)(a[k:k + 1], b[k:k + 1], order)), ref[k:k + 1])
        at = a.t().contiguous().t()  # column-major: a copy inside, same bits
        assert torch.equal(bits(kernel(backend)(at, b, order)), ref)
        a3, b3 = a[:300].reshape(3, 100, 2687), b[:300].reshape(3, 100, 2687)
        assert torch.equal(bits(kernel(backend)(a3, b3, order)).reshape(300), ref)
        g = b[0]  # [N] broadcast over rows (stride-0 rows in the kernel)
        assert mismatches(lambda x, y, o: kernel(backend)(x, g, o), a, g.expand_as(a), order) == 0


def test_backends_agree_and_sum_squares_dispatches():
    a, _ = _data("fp32_squares", 64, 2688, seed=11)
    outs = [bits(kernel(bk)(a, a, strided(256))) for bk in BACKENDS]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.equal(bits(sum_squares(a, strided(256))), outs[0])
    assert torch.equal(bits(sum_squares(a.to(torch.bfloat16), strided(256))),
                       bits(_fma_sum_torch(*(2 * [a.to(torch.bfloat16).float()]), strided(256))))


def test_empty_shapes():
    for backend in BACKENDS:
        z = kernel(backend)(torch.zeros(0, 5), torch.zeros(0, 5), strided(32))
        assert z.shape == (0,)
        e = kernel(backend)(torch.zeros(3, 0), torch.zeros(3, 0), strided(32))
        assert torch.equal(bits(e), bits(_fma_sum_torch(torch.zeros(3, 0), torch.zeros(3, 0), strided(32))))


# ---------------------------------------------------------------------------------------
# planted wrong variants: the bitwise check must go red
# ---------------------------------------------------------------------------------------
def _chain(a, b, order, step, pad: bool):
    """A torch chain in the order's element order with a given step (for planted variants)."""
    t, v, n = order.lanes, order.vec, a.shape[-1]
    per = t * v
    np_ = -(-n // per) * per
    pa = torch.nn.functional.pad(a, (0, np_ - n)).reshape(a.shape[0], -1, t, v)
    pb = torch.nn.functional.pad(b, (0, np_ - n)).reshape(a.shape[0], -1, t, v)
    idx = torch.arange(np_).reshape(-1, t, v)
    acc = torch.zeros(a.shape[0], t)
    for p in range(pa.shape[1]):
        for j in range(v):
            new = step(pa[:, p, :, j], pb[:, p, :, j], acc)
            acc = new if pad else torch.where(idx[p, :, j] < n, new, acc)
    return lane_totals(acc, order)


def test_planted_variants_are_caught():
    o = strided(32)
    fp32, _ = _data("fp32_squares", 8, 300, seed=9)
    bf, _ = _data("bf16_squares", 8, 300, seed=9)
    right = lambda x, y, od: _chain(x, y, od, fma32, pad=True)  # noqa: E731
    mul_add = lambda x, y, od: _chain(x, y, od, lambda p, q, c: c + p * q, pad=True)  # noqa: E731
    no_pad = lambda x, y, od: _chain(x, y, od, fma32, pad=False)  # noqa: E731
    assert mismatches(right, fp32, fp32, o) == 0  # the harness agrees with a right chain
    assert mismatches(mul_add, bf, bf, o) == 0  # exact products: mul-then-add is an fma
    assert mismatches(mul_add, fp32, fp32, o) > 0  # planted: rounded products
    neg = torch.full((1, 63), 1e-30)
    assert mismatches(no_pad, neg, -neg, o) > 0  # planted: skipping fma(0, 0, -0.0)
    for backend in BACKENDS:
        k = kernel(backend)
        assert mismatches(lambda x, y, od: k(x, y, placebo(od)), fp32, fp32, o) > 0  # butterfly
        assert mismatches(lambda x, y, od: k(x, y, contiguous(32)), fp32, fp32, o) > 0  # order
        assert mismatches(lambda x, y, od: k(x, y, strided(64)), fp32, fp32, o) > 0  # lanes


# ---------------------------------------------------------------------------------------
# moe_routed: C backends == the torch backend
# ---------------------------------------------------------------------------------------
def _moe_data(s: int, t: int, h: int, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    slots = (torch.randn(s, t, h, generator=g) * torch.exp(torch.randn(s, t, h, generator=g) * 3))
    w = torch.rand(t, s, generator=g)
    slots[0, 0, : min(3, h)] = torch.tensor([float("nan"), float("inf"), 1e-40])[: min(3, h)]
    w[min(1, t - 1), 0] = 0.0  # a zero weight on an inf below -> NaN when t == 1
    if h > 4:
        slots[:, -1, 4] = 1e-38  # products underflow into subnormals
        w[-1, :] = 1e-3
    return slots.to(dtype), w


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("s,t,h", [(8, 1, 1), (8, 3, 97), (6, 300, 7), (8, 16, 2688), (1, 2, 2687)])
def test_moe_routed_matches_torch(dtype, s, t, h):
    slots, w = _moe_data(s, t, h, seed=s * t + h, dtype=dtype)
    for r in sorted({0, 1, s - 2 if s > 2 else s, s}):
        want = bits(_moe_routed_torch(slots, w[:, :r], r))
        for backend in BACKENDS:
            for threads in (1, 3):
                got = fmachain.moe_routed(slots, w[:, :r], nslots=r, threads=threads, backend=backend)
                assert torch.equal(bits(got), want), (backend, threads, r)


def test_moe_planted_mul_add_is_caught():
    slots, w = _moe_data(8, 4, 300, seed=3, dtype=torch.float32)
    want = bits(_moe_routed_torch(slots, w, 8))
    acc = torch.zeros(4, 300)
    for i in range(8):
        acc = acc + w[:, i : i + 1] * slots[i]  # planted: rounded product, then add
    assert not torch.equal(bits(acc), want)
    assert torch.equal(bits(fmachain.moe_routed(slots, w, nslots=8)), want)


def test_norms_bits_on_every_backend():
    """moe_add_rms / add_rms / rms_parts / inv_rms give the same bytes on every backend (the
    C kernels and the torch one); planted: the placebo order on the torch backend differs
    (seen in inv_rms's fp32 bits; the bf16 outputs round most one-ulp slips away)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 2688, generator=g).to(torch.bfloat16)
    gamma = torch.randn(2688, generator=g).to(torch.bfloat16)
    w = torch.rand(5, 6, generator=g)

    def outs(backend, order=contiguous(256)):
        res = []
        for dt in (torch.float32, torch.bfloat16):
            sl = torch.randn(8, 5, 2688, generator=torch.Generator().manual_seed(6)).to(dt)
            res += list(moe_add_rms(x, sl, w, gamma, order=order, backend=backend, threads=2))
        res += list(add_rms(x, x, gamma, order=order, backend=backend))
        res.append(rms_parts(x, gamma, part=128, order=order, backend=backend))
        inv = inv_rms(torch.randn(64, 2688, generator=torch.Generator().manual_seed(7)), order=order,
                      backend=backend)
        return [r.view(torch.int16) for r in res] + [inv.view(torch.int32)]

    want = outs("torch")
    for backend in BACKENDS:
        assert all(torch.equal(p, q) for p, q in zip(outs(backend), want)), backend
    assert not all(torch.equal(p, q) for p, q in zip(outs("torch", placebo(contiguous(256))), want))


# ---------------------------------------------------------------------------------------
# errors (ValueError at the boundary, nothing computed)
# ---------------------------------------------------------------------------------------
A = torch.zeros(2, 5)


@pytest.mark.parametrize("call,match", [
    (lambda: fmachain.fma_sum_rows(A.double(), A, lanes=32, vec=1, reverse=False), "a must be an fp32 tensor"),
    (lambda: fmachain.fma_sum_rows(A, A.half(), lanes=32, vec=1, reverse=False), "b must be an fp32 tensor"),
    (lambda: fmachain.fma_sum_rows(torch.tensor(1.0), A, lanes=32, vec=1, reverse=False), "at least 1 dim"),
    (lambda: fmachain.fma_sum_rows(A, A, lanes=48, vec=1, reverse=False), "lanes must be a positive multiple of 32"),
    (lambda: fmachain.fma_sum_rows(A, A, lanes=32, vec=0, reverse=False), "vec must be an int >= 1"),
    (lambda: fmachain.fma_sum_rows(A, A, lanes=32, vec=1, reverse=False, threads=0), "threads must be a positive int"),
    (lambda: fmachain.fma_sum_rows(A, A, lanes=32, vec=1, reverse=False, backend="cuda"), "backend must be one of"),
    (lambda: fmachain.moe_routed(A, A, nslots=1), r"slots must be an fp32 or bf16 tensor \[S, T, H\]"),
    (lambda: fmachain.moe_routed(torch.zeros(3, 2, 5), torch.zeros(3, 3), nslots=1), r"weights must be .*\[T=2"),
    (lambda: fmachain.moe_routed(torch.zeros(3, 2, 5), torch.zeros(2, 2), nslots=3), r"nslots must be an int in \[0, min\(S=3, W=2\)\]"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
