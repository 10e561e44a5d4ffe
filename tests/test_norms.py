"""norms.py: the float64 checks of the norm kinds seeing one ulp, their declarations, the
defined special values, errors, and the invariances (the norm kinds' gates and controls
run once, in tests/test_contract.py).

Shape legend: T rows, H width, S slots, P part width.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import bits, same_bits
from lmtail.contract import glue_kinds as gk
from lmtail.glue.norms import add_rms, embed_rows, inv_rms, moe_add_rms, rms_parts, sqrt_rn32
from lmtail.orders import contiguous, placebo, strided, sum_squares
from lmtail.reference import glue as ref

KINDS = {k.name.removeprefix("glue."): k for k in gk.glue_kinds()}
CONTROLS = {c.name.removeprefix("glue."): c for c in gk.glue_controls()}


def _check(kind, d, out):
    """The kind's float64 check against its own declaration."""
    return kind.check(d, out, kind.run, kind.decl(d))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)  # the properties hold for any data; a seed keeps failures reproducible


# ---------------------------------------------------------------------------------------
# the float64 checks can fail
# ---------------------------------------------------------------------------------------
def test_keep_f32_red_at_shapes_on_random_data():
    """The fp32-combine control goes red on plain random rows too, not only on the probes."""
    ctl = CONTROLS["moe_keep_f32"]
    kind = KINDS["moe_bf16_h"]
    d = kind.gens["shapes"](True)[0].data
    assert "planted" not in d["label"]
    v = _check(kind, d, ctl.run(d))
    assert not v.ok and v.margin < 0 and "outside float64's" in v.detail


@pytest.mark.parametrize("name,out", [("add_rms_y", "y"), ("moe_f32_h", "h"), ("rms_parts_mlx_y", "y")])
def test_check_sees_one_ulp(name, out):
    """Planted: one output element moved by one bf16 step must fail the float64 check."""
    kind = KINDS[name]
    d = kind.gens["random"](True)[0].data
    res = kind.run(d)
    assert _check(kind, d, res).ok
    bad = dict(res)
    moved = bits(bad[out]).clone()
    moved.view(-1)[5] += 1
    bad[out] = moved.view(torch.bfloat16)
    v = _check(kind, d, bad)
    assert not v.ok and v.margin < 0


def test_declarations_follow_the_data():
    """Each kind's declaration is computed from its data: width, slots and order."""
    d = KINDS["moe_bf16_y"].gens["random"](True)[0].data  # 16 x 2,688, 8 slots (2 shared), strided(256)
    assert [(s.name, s.dtype, s.depth) for s in KINDS["moe_bf16_y"].decl(d).sums] == [
        ("combine", "fp32", 7), ("ssq", "fp32", 11 + 5 + 7)]
    d = KINDS["rms_parts_mlx_y"].gens["random"](True)[0].data  # parts of 512
    assert KINDS["rms_parts_mlx_y"].decl(d).sum("ssq").depth == 2 + 5 + 7
    d = KINDS["add_rms_y"].gens["random"](True)[1].data  # contiguous(256): 2 passes of 8
    assert KINDS["add_rms_y"].decl(d).sum("ssq").depth == 16 + 5 + 7


# ---------------------------------------------------------------------------------------
# defined special values (the docstrings' promises, spelled out)
# ---------------------------------------------------------------------------------------
def _rows(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32).to(torch.bfloat16)


def test_add_rms_special_values():
    x = _rows([float("nan"), 1, 2, 3], [float("inf"), 1, -2, 3], [0, 0, 0, 0], [1e30, 1e30, 1, 1],
              [float("inf"), 0, 0, 0], [1e-39, -1e-39, 0, 1e-39])
    r = _rows([0, 0, 0, 0], [0, 0, 0, 0], [-0.0, -0.0, 0, 0], [0, 0, 0, 0],
              [float("-inf"), 0, 0, 0], [0, 0, 0, 0])
    g = torch.tensor([1.0, -1.0, 2.0, 0.5])
    h, y = add_rms(x, r, g)
    y = y.float()
    assert torch.isnan(h[0, 0]) and torch.isnan(y[0]).all()  # NaN poisons the row's y
    assert torch.isnan(y[1, 0]) and (y[1, 1:] == 0).all()  # inf: NaN at the lane, 0 elsewhere
    assert torch.signbit(y[1, 1]) and torch.signbit(y[1, 2]) and not torch.signbit(y[1, 3])  # sign(h*g)
    assert (y[2] == 0).all() and not torch.signbit(h.float()[2, 0])  # 0 + -0 = +0
    assert (y[3] == 0).all()  # squares overflow fp32: inv = 0
    assert torch.isnan(h[4, 0]) and torch.isnan(y[4]).all()  # inf - inf
    inv0 = inv_rms(torch.zeros(1, 4))
    assert inv0.item() == np.float32(1) / np.sqrt(np.float32(1e-5))  # zero row: 1/sqrt(eps32)
    assert torch.isfinite(y[5]).all() and (y[5].abs() < 1e-30).all()  # subnormals: the formula


def test_add_rms_signed_zero_h():
    x = _rows([-0.0, -0.0, 0.0])
    r = _rows([-0.0, 0.0, -0.0])
    h, _ = add_rms(x, r, torch.ones(3))
    assert torch.signbit(h.float()).tolist() == [[True, False, False]]


def test_moe_special_values():
    t, hw = 3, 8
    x = torch.zeros(t, hw, dtype=torch.bfloat16)
    slots = torch.zeros(4, t, hw)
    w = torch.ones(t, 2)
    slots[0, 0, 0] = float("nan")
    slots[1, 1, 1] = float("inf")
    w[1, 1] = 0.0  # inf * 0 weight
    slots[2, 2, 2], slots[3, 2, 2] = float("inf"), float("-inf")  # shared inf - inf
    h, y = moe_add_rms(x, slots, w, torch.ones(hw), n_shared=2)
    assert torch.isnan(h[0, 0]) and torch.isnan(h[1, 1]) and torch.isnan(h[2, 2])
    assert torch.isnan(y.float()).all()


def test_parts_nan_stays_in_its_part():
    x = torch.randn(2, 64).to(torch.bfloat16)
    x[0, 3] = float("nan")
    for rounding in ("once", "mlx"):
        y = rms_parts(x, torch.ones(64), part=32, rounding=rounding).float()
        assert torch.isnan(y[0, :32]).all() and torch.isfinite(y[0, 32:]).all() and torch.isfinite(y[1]).all()


# ---------------------------------------------------------------------------------------
# op-level properties
# ---------------------------------------------------------------------------------------
def test_batch_invariance():
    """A row's bytes do not depend on the rows around it (add_rms h, y and inv_rms's fp32
    inv). Planted: a batch-dependent order (contiguous when T > 1) is caught by the same
    comparison on inv (bf16 y hides most one-ulp fp32 differences)."""
    g = torch.randn(576).to(torch.bfloat16)
    x, r = torch.randn(300, 576).to(torch.bfloat16), torch.randn(300, 576).to(torch.bfloat16)
    h, y = add_rms(x, r, g)
    for i in (0, 7, 299):
        hs, ys = add_rms(x[i : i + 1], r[i : i + 1], g)
        assert same_bits(hs, h[i : i + 1]) and same_bits(ys, y[i : i + 1])
    h32 = h.float()

    def bad(hh):
        return inv_rms(hh, order=contiguous(256) if hh.shape[0] > 1 else strided(256))

    for op, want in ((inv_rms, True), (bad, False)):
        together = op(h32)
        same = all(same_bits(op(h32[i : i + 1]), together[i : i + 1]) for i in range(300))
        assert same == want


def test_rms_parts_whole_row_equals_add_rms():
    x = torch.randn(5, 300).to(torch.bfloat16)
    g = torch.randn(300).to(torch.bfloat16)
    _, y = add_rms(x, torch.zeros_like(x), g)
    assert same_bits(rms_parts(x, g, part=300, rounding="once"), y)


def test_moe_slot_dtypes_and_gamma_widening_agree():
    """bf16 slots and the same values as fp32 give the same bytes; bf16 gamma equals the
    same values in fp32 (widening is exact)."""
    rng = np.random.default_rng(3)
    x = torch.from_numpy(ref.bf16_array(rng.standard_normal((4, 100)))).to(torch.bfloat16)
    sl = torch.from_numpy(ref.bf16_array(rng.standard_normal((8, 4, 100)))).to(torch.bfloat16)
    w = torch.from_numpy(gk._moe_weights(rng, 4))
    g = torch.randn(100).to(torch.bfloat16)
    a = moe_add_rms(x, sl, w, g)
    b = moe_add_rms(x, sl.float(), w, g.float())
    assert same_bits(a.h, b.h) and same_bits(a.y, b.y)


def test_moe_n_shared_edges_match_emulation():
    rng = np.random.default_rng(4)
    x = ref.bf16_array(rng.standard_normal((2, 24)))
    sl = rng.standard_normal((3, 2, 24)).astype(np.float32)
    g = np.ones(24, np.float32)
    for n_shared in (0, 3):
        w = rng.uniform(0, 1, (2, 3 - n_shared)).astype(np.float32)
        h, y = moe_add_rms(torch.from_numpy(x).to(torch.bfloat16), torch.from_numpy(sl), torch.from_numpy(w),
                           torch.from_numpy(g), n_shared=n_shared, order=strided(32))
        eh, ey = ref.emu_moe_add_rms(x, sl, w, g, eps=1e-5, n_shared=n_shared, order=strided(32))
        assert np.array_equal(h.float().numpy(), eh) and np.array_equal(y.float().numpy(), ey)


def _inv_mismatches(fn, h: torch.Tensor, n: int) -> int:
    got = fn(h).numpy().view(np.int32)
    want = np.array([ref.emu_inv_rms(row, n=n, eps=1e-6, lanes=32, vec=1) for row in h.numpy()], np.float32)
    return int((got != want.view(np.int32)).sum())


def test_inv_rms_matches_emulation_with_n():
    """400 rows: every inv bit-equal to the scalar emulation (IEEE div and sqrt). Planted:
    the chain ending in a correctly rounded rsqrt (one rounding, not sqrt's then 1/r's)."""
    h = torch.from_numpy(np.random.default_rng(12).standard_normal((400, 40)).astype(np.float32))
    assert _inv_mismatches(lambda x: inv_rms(x, eps=1e-6, order=strided(32), n=32), h, 32) == 0

    def rsqrt_variant(x):
        d = sum_squares(x, strided(32)) / torch.full((x.shape[0],), 32.0) + torch.full((x.shape[0],), 1e-6)
        return (1.0 / torch.sqrt(d.double())).to(torch.float32)

    assert _inv_mismatches(rsqrt_variant, h, 32) > 0


def test_sqrt_rn32_is_correctly_rounded():
    x = torch.cat([torch.rand(200000) * 4, torch.rand(20000) * 1e-38, torch.randn(20000).abs() * 1e30,
                   torch.tensor([0.0, -0.0, math.inf, 1e-45, 3.4028234663852886e38])])
    want = torch.from_numpy(np.sqrt(x.double().numpy()).astype(np.float32))  # hardware sqrtpd, then RNE
    assert same_bits(sqrt_rn32(x), want)
    assert torch.signbit(sqrt_rn32(torch.tensor([-0.0]))).item()
    assert torch.isnan(sqrt_rn32(torch.tensor([-1.0, math.nan]))).all()


def test_orders_change_bytes_not_correctness():
    """Another declared order (or the placebo) gives other inv bytes on some rows, and the
    op still passes the float64 check: same precision, another order."""
    kind = KINDS["add_rms_y"]
    d = kind.gens["random"](True)[0].data
    h32 = kind.run(d)["h"].float()
    base = inv_rms(h32)
    for order in (contiguous(256), placebo(strided(256))):
        dd = dict(d, order=order)
        assert _check(kind, dd, kind.run(dd)).ok
        assert not same_bits(inv_rms(h32, order=order), base)


def test_empty_rows_and_leading_dims():
    e = torch.zeros(0, 8, dtype=torch.bfloat16)
    assert [t.shape for t in add_rms(e, e, torch.ones(8))] == [(0, 8), (0, 8)]
    assert moe_add_rms(e, torch.zeros(3, 0, 8), torch.zeros(0, 1), torch.ones(8)).y.shape == (0, 8)
    assert rms_parts(e, torch.ones(8), part=4).shape == (0, 8)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    h, y = add_rms(x, x, torch.ones(40))
    assert same_bits(y[1], add_rms(x[1], x[1], torch.ones(40)).y)
    assert same_bits(rms_parts(x, torch.ones(40), part=8)[1], rms_parts(x[1], torch.ones(40), part=8))


def test_thread_count_invariance():
    x = torch.randn(64, 2688).to(torch.bfloat16)
    g = torch.randn(2688).to(torch.bfloat16)
    sl = torch.randn(8, 64, 2688)
    w = torch.rand(64, 6)
    n0 = torch.get_num_threads()
    outs = []
    for n in (1, 2):
        torch.set_num_threads(n)
        outs.append((*add_rms(x, x, g), *moe_add_rms(x, sl, w, g), rms_parts(x, g, part=1344, rounding="mlx")))
    torch.set_num_threads(n0)
    assert all(same_bits(a, b) for a, b in zip(*outs))


def test_embed_rows_copies_exactly():
    tab = torch.randn(10, 7).to(torch.bfloat16)
    tab[3, 0] = float("nan")
    ids = torch.tensor([3, 0, 9, 3], dtype=torch.int32)
    out = embed_rows(ids, tab)
    assert torch.equal(out.view(torch.int16), tab.view(torch.int16)[ids.long()])
    assert embed_rows(torch.zeros(0, dtype=torch.int64), tab).shape == (0, 7)


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
B = torch.bfloat16
X = torch.zeros(2, 8, dtype=B)


@pytest.mark.parametrize("call,match", [
    (lambda: embed_rows(torch.tensor([0, 10]), torch.zeros(10, 4, dtype=B)), r"ids\[1\] = 10 is out of range \[0, V=10\)"),
    (lambda: embed_rows(torch.tensor([-1]), torch.zeros(10, 4, dtype=B)), r"ids\[0\] = -1"),
    (lambda: embed_rows(torch.tensor([0.0]), torch.zeros(10, 4, dtype=B)), "ids must be an integer tensor"),
    (lambda: embed_rows(torch.tensor([[0]]), torch.zeros(10, 4, dtype=B)), r"ids must be \[T\]; got \(1, 1\)"),
    (lambda: embed_rows(torch.tensor([0]), torch.zeros(10, 4)), "table must be bf16"),
    (lambda: add_rms(X.float(), X, torch.ones(8)), "x must be bf16"),
    (lambda: add_rms(X, X[:1], torch.ones(8)), r"residual must be \(2, 8\) like x; got \(1, 8\)"),
    (lambda: add_rms(X, X, torch.ones(7)), r"gamma must be \[H=8\] or \[1, H\]; got \(7,\)"),
    (lambda: add_rms(X, X, torch.ones(8), eps=math.inf), "eps must be a finite number >= 0; got inf"),
    (lambda: add_rms(X, X, torch.ones(8), backend="cuda"), "backend must be one of"),
    (lambda: rms_parts(X, torch.ones(8), part=4, threads=0), "threads must be a positive int or None; got 0"),
    (lambda: add_rms(X, X, torch.ones(8, dtype=torch.float64)), "gamma must be bf16 or fp32"),
    (lambda: add_rms(X, X, torch.ones(8), eps=-1.0), "eps must be a finite number >= 0"),
    (lambda: add_rms(X, X, torch.ones(8), eps=math.nan), "eps must be a finite number >= 0"),
    (lambda: add_rms(X, X, torch.ones(8), order="strided"), "order must be an orders.Order"),
    (lambda: add_rms(torch.zeros(2, 0, dtype=B), torch.zeros(2, 0, dtype=B), torch.ones(0)), "H >= 1"),
    (lambda: moe_add_rms(X, torch.zeros(8, 3, 8), torch.ones(2, 6), torch.ones(8)), r"slots must be \[S, T=2, H=8\]"),
    (lambda: moe_add_rms(X, torch.zeros(8, 2, 8, dtype=torch.float16), torch.ones(2, 6), torch.ones(8)), "slots must be bf16 or fp32"),
    (lambda: moe_add_rms(X, torch.zeros(8, 2, 8), torch.ones(2, 8), torch.ones(8)), r"weights must be \[T, S - n_shared\] = \[2, 6\]; got \(2, 8\)"),
    (lambda: moe_add_rms(X, torch.zeros(8, 2, 8), torch.ones(2, 6, dtype=B), torch.ones(8)), "weights must be fp32"),
    (lambda: moe_add_rms(X, torch.zeros(8, 2, 8), torch.ones(2, 6), torch.ones(8), n_shared=9), r"n_shared must be an int in \[0, S=8\]"),
    (lambda: moe_add_rms(X[0], torch.zeros(8, 2, 8), torch.ones(2, 6), torch.ones(8)), r"x must be \[T, H\]"),
    (lambda: rms_parts(X, torch.ones(8), part=3), "part must be a positive int dividing H=8; got 3"),
    (lambda: rms_parts(X, torch.ones(8), part=4, rounding="twice"), "rounding must be 'once' or 'mlx'"),
    (lambda: inv_rms(X), "h32 must be an fp32 tensor"),
    (lambda: inv_rms(torch.ones(2, 8), n=0), r"n must be an int in \[1, 2\*\*24\)"),
])
def test_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()
