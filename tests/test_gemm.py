"""gemm_bf16_chain: bit-equal to the declared fp32 fma chain, and byte-invariant.

Shape legend: a [M, H] bf16, w [H, V] bf16 (C-contiguous), out [M, V] fp32.
Each property is a `check_*` function run on the kernel (must hold) and on a planted wrong
variant (must be caught). Byte equality is compared on int32 views, never allclose.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch

from lmtail.kernels import gemm as G
from lmtail.kernels.gemm import gemm_bf16_chain, gemm_bf16_chain_reference
from lmtail.numerics import U, gamma

BACKENDS = G.available_backends()
SEEDS = (0, 1, 2)


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def _bits16(vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def rand_data(M, H, V, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    a = _bf16(torch.randn(M, H, generator=g) * scale)  # [M, H]
    w = _bf16(torch.randn(H, V, generator=g) * 0.05 * scale)  # [H, V]
    return a, w


# bf16 bit patterns: NaN, +-inf, +-0, subnormals, tiny normal, huge, 2**-75, 2**64
SPECIALS = [0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x0080,
            0x7F7F, 0xFF7F, 0x1A00, 0x5F80, 0x9A00]


def special_data(M, H, V, seed, p=0.02):
    """Random data with a fraction p of a's and w's entries replaced by special values."""
    a, w = rand_data(M, H, V, seed)
    g = torch.Generator().manual_seed(seed + 100)
    spec = _bits16(SPECIALS)
    for t in (a, w):
        hit = torch.rand(t.shape, generator=g) < p
        pick = torch.randint(len(SPECIALS), t.shape, generator=g)
        t[hit] = spec[pick[hit]]
    return a, w


def underflow_data(M, H, V, seed):
    """Products in fp32's subnormal range, where an fma and a mul+add round differently."""
    a, w = rand_data(M, H, V, seed)
    return _bf16(a.float() * 2.0**-70), _bf16(w.float() * 2.0**-70)


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.view(torch.int32), y.view(torch.int32))


def backend_impl(backend):
    def impl(a, w):
        out = torch.empty(a.shape[0], w.shape[1], dtype=torch.float32)
        G._run(a, w, out, backend)
        return out
    return impl


# ---------------------------------------------------------------------------------------
# planted wrong variants
# ---------------------------------------------------------------------------------------
def torch_fp32_matmul(a, w):
    return a.float() @ w.float()


def blocked8(a, w):
    """Sums of 8 consecutive h (each in order), the block sums chained: pairwise-ish."""
    a32, w32 = a.double(), w.double()
    acc = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32)
    for h0 in range(0, a.shape[1], 8):
        part = torch.zeros_like(acc)
        for h in range(h0, min(h0 + 8, a.shape[1])):
            part = (part.double() + a32[:, h:h + 1] * w32[h:h + 1]).float()
        acc = acc + part
    return acc


def mul_add(a, w):
    """acc = fl32(acc + fl32(a*w)): two roundings (equal to the fma unless underflow)."""
    a32, w32 = a.float(), w.float()
    acc = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float32)
    for h in range(a.shape[1]):
        acc = acc + a32[:, h:h + 1] * w32[h:h + 1]
    return acc


def batch_variant(a, w):
    """The right chain for up to 4 rows, blocked sums for bigger batches."""
    return gemm_bf16_chain(a, w) if a.shape[0] <= 4 else blocked8(a, w)


def width_variant(a, w):
    """The right chain on narrow shards, blocked sums on wide ones."""
    return gemm_bf16_chain(a, w) if w.shape[1] <= 256 else blocked8(a, w)


def thread_variant(a, w):
    return gemm_bf16_chain(a, w) if torch.get_num_threads() == 1 else blocked8(a, w)


def bf16_output(a, w):
    return gemm_bf16_chain(a, w).bfloat16().float()


# ---------------------------------------------------------------------------------------
# property checks (each returns True when the property holds)
# ---------------------------------------------------------------------------------------
def check_matches_reference(impl, a, w, ref=None) -> bool:
    return same_bytes(impl(a, w), gemm_bf16_chain_reference(a, w) if ref is None else ref)


def check_batch_invariant(impl, a, w, Ms=(1, 2, 3, 4, 7, 8, 64, 128)) -> bool:
    full = impl(a, w)  # [M, V]
    perm = torch.randperm(a.shape[0], generator=torch.Generator().manual_seed(5))
    ok = same_bytes(impl(a[perm], w), full[perm])
    for m in Ms:
        m = min(m, a.shape[0])
        ok &= same_bytes(impl(a[:m], w), full[:m])
        ok &= same_bytes(impl(a[m - 1:m], w), full[m - 1:m])  # solo
    return ok


def check_thread_invariant(impl, a, w) -> bool:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = impl(a, w)
        torch.set_num_threads(2)
        two = impl(a, w)
    finally:
        torch.set_num_threads(before)
    return same_bytes(one, two)


def check_slice_invariant(impl, a, w, cuts=((0, 1), (3, 70), (5, 600), (255, 257))) -> bool:
    full = impl(a, w)
    ok = True
    for c0, c1 in cuts:
        c1 = min(c1, w.shape[1])
        ok &= same_bytes(impl(a, w[:, c0:c1].contiguous()), full[:, c0:c1])
    return ok


def check_fp64_bound(impl, a, w) -> bool:
    """|out - exact| <= gamma_fp32(H) * sum_h |a w| (+ the float64 reference's own error).
    Data must stay in fp32's normal range (no underflow term)."""
    a64, w64 = a.double().numpy(), w.double().numpy()
    H = a.shape[1]
    ref64 = a64 @ w64  # [M, V] float64
    mag = np.abs(a64) @ np.abs(w64)  # [M, V] sum_h |a w|
    bound = (gamma(H, U["fp32"]) + 2 * gamma(H, U["fp64"])) * mag
    return bool(np.all(np.abs(impl(a, w).double().numpy() - ref64) <= bound))


# ---------------------------------------------------------------------------------------
# bit-equality with the declared chain
# ---------------------------------------------------------------------------------------
# (M, H, V, seeds): 1 and 300 rows, widths not multiples of 8; H past the C kernel's
# h block (128) and V past its column tile (256) with tails; M <= 6 and M > 6 take
# different register-tile paths in the C kernel.
SHAPES = [(1, 37, 1001, SEEDS), (300, 37, 131, (0,)), (5, 300, 1001, (0,)),
          (13, 300, 529, SEEDS), (7, 1, 17, SEEDS), (64, 129, 64, SEEDS),
          (6, 257, 65, SEEDS), (2, 8, 300, SEEDS)]
_REFS: dict = {}


def cached_case(maker, M, H, V, seed):
    """(a, w, reference) for one data case, the reference computed once per session."""
    key = (maker.__name__, M, H, V, seed)
    if key not in _REFS:
        a, w = maker(M, H, V, seed)
        _REFS[key] = (a, w, gemm_bf16_chain_reference(a, w))
    return _REFS[key]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference_random(backend, shape):
    *mhv, seeds = shape
    for seed in seeds:
        a, w, ref = cached_case(rand_data, *mhv, seed)
        assert check_matches_reference(backend_impl(backend), a, w, ref), (mhv, seed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(9, 37, 1001, SEEDS), (300, 37, 130, (0,)),
                                   (4, 260, 333, SEEDS)])
def test_matches_reference_special_values(backend, shape):
    *shape, seeds = shape
    for seed in seeds:
        a, w, ref = cached_case(special_data, *shape, seed)
        out = backend_impl(backend)(a, w)
        assert same_bytes(out, ref), (backend, shape, seed)
        nan = torch.isnan(ref)
        assert 0 < nan.sum() < nan.numel()  # the data really mixes NaN and numbers
        assert bool((ref.view(torch.int32)[nan] == 0x7FC00000).all())  # canonical NaN
        assert bool(torch.isinf(ref).any())


@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_reference_underflow(backend):
    for seed in SEEDS:
        a, w, ref = cached_case(underflow_data, 7, 300, 200, seed)
        assert check_matches_reference(backend_impl(backend), a, w, ref)


def _u32(x: torch.Tensor) -> int:
    return x.view(torch.int32).item() & 0xFFFFFFFF


def _step_case(a_vals, w_vals):
    a = torch.tensor([a_vals], dtype=torch.float32).bfloat16()  # [1, H]
    w = torch.tensor(w_vals, dtype=torch.float32).bfloat16()[:, None]  # [H, 1]
    return a, w


# (a's, w's, expected result bits): hand-computed fma chains
HAND_CASES = [
    # 2**-149 then + 2**-150: exact 1.5 * 2**-149, a tie -> even 2**-148 (mul+add: 2**-149)
    ([2.0**-75, 2.0**-75], [2.0**-74, 2.0**-75], 0x00000002),
    # 1.5 * 2**127 - 2**128 = -2**126, finite (mul+add: -inf)
    ([2.0**64, 2.0**64], [1.5 * 2.0**63, -(2.0**64)], 0xFE800000),
    # +0 + (-1 * 0) = +0 (IEEE: the sum of opposite zeros is +0 in round-to-nearest)
    ([-1.0], [0.0], 0x00000000),
    # +0 + exact -2**-200 rounds to -0 (mul+add: +0)
    ([-(2.0**-100)], [2.0**-100], 0x80000000),
    # inf * 0 = NaN, canonical
    ([math.inf, 1.0], [0.0, 1.0], 0x7FC00000),
    # inf - inf = NaN
    ([math.inf, math.inf], [1.0, -1.0], 0x7FC00000),
    # subnormal * normal, exact
    ([1.0e-39], [4.0], None),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(HAND_CASES)))
def test_hand_computed_chains(backend, case):
    a_vals, w_vals, want = HAND_CASES[case]
    a, w = _step_case(a_vals, w_vals)
    got = _u32(backend_impl(backend)(a, w))
    if want is None:  # exact by construction: the float64 product, which fits in fp32
        want = _u32(torch.tensor([a.double().item() * w.double().item()]).float())
    assert got == want == _u32(gemm_bf16_chain_reference(a, w)), (hex(got), hex(want))


def test_hand_cases_separate_fma_from_mul_add():
    """The first two hand cases are exactly where a mul+add chain goes wrong."""
    for a_vals, w_vals, want in HAND_CASES[:2]:
        a, w = _step_case(a_vals, w_vals)
        assert _u32(mul_add(a, w)) != want


def test_reference_is_the_float64_emulation():
    """The float64 chain rounded to fp32 each step equals the fma chain: the product is
    exact in float64 and the double rounding is innocuous here (docs/gemm.md)."""
    for maker in (rand_data, special_data, underflow_data):
        a, w = maker(5, 40, 300, 3)
        a64, w64 = a.double().numpy(), w.double().numpy()
        acc = np.zeros((5, 300), np.float32)
        with np.errstate(all="ignore"):
            for h in range(40):
                acc = (acc.astype(np.float64) + a64[:, h:h + 1] * w64[h:h + 1]).astype(
                    np.float32)
        acc[np.isnan(acc)] = np.float32(np.nan)
        ref = gemm_bf16_chain_reference(a, w).numpy()
        assert np.array_equal(acc.view(np.uint32), ref.view(np.uint32))


# ---------------------------------------------------------------------------------------
# invariance: batch, threads, repeats, column slices, row blocks
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariant(backend):
    for seed in SEEDS[:2]:
        a, w = special_data(128, 300, 300, seed, p=0.002)
        assert check_batch_invariant(backend_impl(backend), a, w)


def test_thread_invariant():
    a, w = rand_data(13, 300, 1001, 0)
    assert check_thread_invariant(gemm_bf16_chain, a, w)
    assert check_thread_invariant(gemm_bf16_chain, a[:3], w)


def test_thread_invariant_numba_backend():
    a, w = rand_data(13, 100, 700, 1)
    impl = backend_impl("numba")
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = impl(a, w)
        numba.set_num_threads(min(2, numba.config.NUMBA_NUM_THREADS))
        two = impl(a, w)
    finally:
        numba.set_num_threads(before)
    assert same_bytes(one, two)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeatable(backend):
    a, w = special_data(64, 200, 600, 4, p=0.002)
    impl = backend_impl(backend)
    first = impl(a, w)
    assert all(same_bytes(impl(a, w), first) for _ in range(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_column_slice_invariant(backend):
    a, w = rand_data(9, 150, 700, 2)
    assert check_slice_invariant(backend_impl(backend), a, w)


def test_row_blocks_into_preallocated_out():
    a, w = rand_data(20, 140, 300, 3)
    full = gemm_bf16_chain(a, w)
    blocks = torch.full((20, 300), 7.0)
    for r0, r1 in ((0, 3), (3, 11), (11, 20)):
        got = gemm_bf16_chain(a[r0:r1], w, out=blocks[r0:r1])
        assert got.data_ptr() == blocks[r0:r1].data_ptr()
    assert same_bytes(blocks, full)
    wide = torch.full((20, 310), 7.0)  # row stride 310 > V: the pad columns stay untouched
    gemm_bf16_chain(a, w, out=wide[:, 4:304])
    assert same_bytes(wide[:, 4:304].contiguous(), full)
    assert bool((wide[:, :4] == 7).all() and (wide[:, 304:] == 7).all())


def test_strided_activations():
    a, w = rand_data(10, 64, 100, 4)
    at = a.t().contiguous().t()  # same values, column-major
    assert same_bytes(gemm_bf16_chain(at, w), gemm_bf16_chain(a, w))


def test_flush_denormal_caller_cannot_change_bits():
    """The C kernel sets IEEE MXCSR in every worker, whatever the caller's FTZ/DAZ."""
    if BACKENDS[0] == "numba":
        pytest.skip("only the C kernel pins MXCSR")
    a, w = underflow_data(9, 100, 300, 5)
    want = gemm_bf16_chain(a, w)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = gemm_bf16_chain(a, w)
    finally:
        torch.set_flush_denormal(False)
    assert same_bytes(got, want)
    assert bool((want.view(torch.int32).abs() < 0x00800000).any())  # subnormal results


def test_numba_fallback_when_c_kernel_unavailable(monkeypatch):
    a, w = special_data(7, 50, 130, 6)
    monkeypatch.setattr(G, "_c_library", lambda: None)
    assert G.available_backends() == ("numba",)
    assert same_bytes(gemm_bf16_chain(a, w), gemm_bf16_chain_reference(a, w))


def test_empty_and_zero_depth():
    a, w = rand_data(3, 0, 5, 0)
    out = gemm_bf16_chain(a, w)
    assert out.shape == (3, 5) and bool((out.view(torch.int32) == 0).all())
    assert gemm_bf16_chain(*rand_data(0, 4, 5, 0)).shape == (0, 5)
    assert gemm_bf16_chain(*rand_data(2, 4, 0, 0)).shape == (2, 0)


# ---------------------------------------------------------------------------------------
# float64 error bound
# ---------------------------------------------------------------------------------------
def test_fp64_bound():
    for seed in SEEDS:
        a, w = rand_data(17, 2880, 130, seed)
        assert check_fp64_bound(gemm_bf16_chain, a, w)


# ---------------------------------------------------------------------------------------
# planted controls: every check above must catch a wrong implementation
# ---------------------------------------------------------------------------------------
def test_planted_torch_matmul_is_caught():
    """MKL's sgemm blocks h at this depth (at H of a few hundred it happens to run the
    same sequential fma chain, so the depth matters for this control)."""
    a, w = rand_data(8, 2880, 64, 0)
    assert check_matches_reference(gemm_bf16_chain, a, w)
    assert not check_matches_reference(torch_fp32_matmul, a, w)


def test_planted_blocked_sum_is_caught():
    a, w = rand_data(7, 300, 200, 0)
    assert not check_matches_reference(blocked8, a, w)


def test_planted_mul_add_is_caught_on_underflow_only():
    a, w = rand_data(7, 300, 200, 0)
    assert check_matches_reference(mul_add, a, w)  # in the normal range it is the same
    a, w = underflow_data(7, 300, 200, 0)
    assert not check_matches_reference(mul_add, a, w)


def test_planted_batch_variant_is_caught():
    a, w = rand_data(128, 300, 100, 1)
    assert not check_batch_invariant(batch_variant, a, w)


def test_planted_width_variant_is_caught():
    a, w = rand_data(9, 150, 700, 2)
    assert not check_slice_invariant(width_variant, a, w)


def test_planted_thread_variant_is_caught():
    a, w = rand_data(13, 300, 200, 0)
    assert not check_thread_invariant(thread_variant, a, w)


def test_planted_bf16_output_breaks_the_bound():
    a, w = rand_data(17, 2880, 130, 0)
    assert not check_fp64_bound(bf16_output, a, w)


# ---------------------------------------------------------------------------------------
# validation at the boundary
# ---------------------------------------------------------------------------------------
def test_declaration():
    d = G.gemm_decl(2880)
    assert d.sums[0].dtype == "fp32" and d.sums[0].depth == 2880


BAD = [
    (lambda a, w: (a.float(), w), "a must be torch.bfloat16; got torch.float32"),
    (lambda a, w: (a, w.half()), "w must be torch.bfloat16; got torch.float16"),
    (lambda a, w: (a[0], w), r"a must be 2-D \[M, H\]; got shape \(8,\)"),
    (lambda a, w: (a, w[None]), r"w must be 2-D \[H, V\]; got shape \(1, 8, 5\)"),
    (lambda a, w: (a[:, :7], w), r"H mismatch: a is \[M, H\] = \(3, 7\) but w is"),
    (lambda a, w: (a, w.t().contiguous().t()), r"w must be C-contiguous \[H, V\]; got"),
    (lambda a, w: (a.float().numpy(), w), "a must be a torch.Tensor"),
]


@pytest.mark.parametrize("fn", [gemm_bf16_chain, gemm_bf16_chain_reference])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs(fn, case):
    make, msg = BAD[case]
    a, w = rand_data(3, 8, 5, 0)
    with pytest.raises(ValueError, match=msg):
        fn(*make(a, w))


@pytest.mark.parametrize("out, msg", [
    (torch.zeros(3, 5, dtype=torch.float64),
     "out must be a torch.float32 tensor; got torch.float64"),
    (torch.zeros(3, 6), r"out must be \[M, V\] = \(3, 5\); got \(3, 6\)"),
    (torch.zeros(5, 3).t(), r"out must have unit column stride and row stride >= V = 5"),
])
def test_bad_out_writes_nothing(out, msg):
    a, w = rand_data(3, 8, 5, 0)
    before = out.clone()
    with pytest.raises(ValueError, match=msg):
        gemm_bf16_chain(a, w, out=out)
    assert torch.equal(out, before)
    sentinel = torch.full((3, 5), 7.0)
    with pytest.raises(ValueError, match="a must be torch.bfloat16"):
        gemm_bf16_chain(a.float(), w, out=sentinel)
    assert bool((sentinel == 7).all())
