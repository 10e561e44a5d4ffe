"""gemm_bf16 in both declared orders ("chain": one fp32 fma chain; "amx32": AMX's block order):
every backend bit-equal to its reference emulation, and byte-invariant.

Shape legend: a [M, H] bf16, w [H, V] bf16 (C-contiguous), out [M, V] fp32.
Each property is a `check_*` function run on the kernel (must hold) and on a planted wrong
variant (must be caught). Byte equality is compared on int32 views, never allclose.
"""
from __future__ import annotations

import math
import os
import time
from fractions import Fraction

import numba
import numpy as np
import pytest
import torch
from conftest import native_or_emulated, same_bits, stand_ins

from lmtail.kernels import cpu
from lmtail.kernels.gemm import bf16 as G
from lmtail.kernels.gemm.bf16 import gemm_bf16, pack_weight
from lmtail.numerics import U, gamma
from lmtail.reference import gemm as R
from lmtail.reference.gemm import gemm_chain_emulation

# this CPU's backends, and the emulated rows of the ones it lacks (SIMDe: the same source)
BACKENDS = G.available_backends("chain") + stand_ins(G.GEMM["chain"])
SEEDS = (0, 1, 2)


def gemm_bf16_chain(a, w, **kw):
    """gemm_bf16 in the chain order (the tests' shorthand; the library has no alias)."""
    return gemm_bf16(a, w, order="chain", **kw)


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
    return same_bits(impl(a, w), gemm_chain_emulation(a, w) if ref is None else ref)


def check_batch_invariant(impl, a, w, Ms=(1, 2, 3, 4, 7, 8, 64, 128)) -> bool:
    full = impl(a, w)  # [M, V]
    perm = torch.randperm(a.shape[0], generator=torch.Generator().manual_seed(5))
    ok = same_bits(impl(a[perm], w), full[perm])
    for m in Ms:
        m = min(m, a.shape[0])
        ok &= same_bits(impl(a[:m], w), full[:m])
        ok &= same_bits(impl(a[m - 1:m], w), full[m - 1:m])  # solo
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
    return same_bits(one, two)


def check_slice_invariant(impl, a, w, cuts=((0, 1), (3, 70), (5, 600), (255, 257))) -> bool:
    full = impl(a, w)
    ok = True
    for c0, c1 in cuts:
        c1 = min(c1, w.shape[1])
        ok &= same_bits(impl(a, w[:, c0:c1].contiguous()), full[:, c0:c1])
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
        _REFS[key] = (a, w, gemm_chain_emulation(a, w))
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
        assert same_bits(out, ref), (backend, shape, seed)
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
    assert got == want == _u32(gemm_chain_emulation(a, w)), (hex(got), hex(want))


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
        ref = gemm_chain_emulation(a, w).numpy()
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
    assert same_bits(one, two)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeatable(backend):
    a, w = special_data(64, 200, 600, 4, p=0.002)
    impl = backend_impl(backend)
    first = impl(a, w)
    assert all(same_bits(impl(a, w), first) for _ in range(3))


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
    assert same_bits(blocks, full)
    wide = torch.full((20, 310), 7.0)  # row stride 310 > V: the pad columns stay untouched
    gemm_bf16_chain(a, w, out=wide[:, 4:304])
    assert same_bits(wide[:, 4:304].contiguous(), full)
    assert bool((wide[:, :4] == 7).all() and (wide[:, 304:] == 7).all())


def test_strided_activations():
    a, w = rand_data(10, 64, 100, 4)
    at = a.t().contiguous().t()  # same values, column-major
    assert same_bits(gemm_bf16_chain(at, w), gemm_bf16_chain(a, w))


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
    assert same_bits(got, want)
    assert bool((want.view(torch.int32).abs() < 0x00800000).any())  # subnormal results


def test_numba_fallback_when_c_kernel_unavailable(monkeypatch):
    a, w = special_data(7, 50, 130, 6)
    monkeypatch.setattr(G, "_c_library", lambda: None)
    assert G.available_backends("chain") == ("numba",)
    assert same_bits(gemm_bf16_chain(a, w), gemm_chain_emulation(a, w))


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
    d = G.gemm_decl(2880, "chain")
    assert d.sums[0].dtype == "fp32" and d.sums[0].depth == 2880
    assert G.DEFAULT_ORDER == "amx32" and G.gemm_decl(2880) == G.gemm_decl(2880, "amx32")
    assert G.gemm_decl(2880, "amx32").sum("gemm").depth == 16 + 1 + 90
    assert G.gemm_decl(61, "amx32").sum("gemm").depth == 16 + 1 + 2


BAD = [
    (lambda a, w: (a.float(), w), "a must be torch.bfloat16; got torch.float32"),
    (lambda a, w: (a, w.half()), "w must be torch.bfloat16; got torch.float16"),
    (lambda a, w: (a[0], w), r"a must be 2-D \[M, H\]; got shape \(8,\)"),
    (lambda a, w: (a, w[None]), r"w must be 2-D \[H, V\]; got shape \(1, 8, 5\)"),
    (lambda a, w: (a[:, :7], w), r"H mismatch: a is \[M, H\] = \(3, 7\) but w is"),
    (lambda a, w: (a, w.t().contiguous().t()), r"w must be C-contiguous \[H, V\]; got"),
]


@pytest.mark.parametrize("fn", [gemm_bf16_chain])
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_inputs(fn, case):
    make, msg = BAD[case]
    a, w = rand_data(3, 8, 5, 0)
    with pytest.raises(ValueError, match=msg):
        fn(*make(a, w))


@pytest.mark.parametrize("fn", [gemm_bf16_chain])
def test_non_tensor_is_a_type_error(fn):
    a, w = rand_data(3, 8, 5, 0)
    with pytest.raises(TypeError, match="a must be a torch.Tensor"):
        fn(a.float().numpy(), w)


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


# =======================================================================================
# order "amx32": per 32-lane block, even and odd fma chains from +0, acc = acc + (e + o);
# DAZ inputs, FTZ results. Every backend == the reference emulation == AMX, byte for byte.
# =======================================================================================


AMX32 = G.available_backends("amx32")
EMULATIONS = tuple(b for b in AMX32 if b != "amx")
# the bitwise equality tests also run the emulated rows of the vector paths this CPU lacks
EQUAL32 = EMULATIONS + tuple(b for b in stand_ins(G.GEMM["amx32"]) if b != "emu-amx")
NO_AMX = (cpu.missing("amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq")
          + " (amx_bf16: cpuid AMX-BF16/AMX-TILE and the OS's XTILEDATA permission)")


def amx32_impl(backend, packed=False, threads=None):
    def impl(a, w):
        return gemm_bf16(a, pack_weight(w) if packed else w, order="amx32", backend=backend,
                         threads=threads)
    return impl


def amx32_ref(a, w):
    return R.gemm_amx32_emulation(a, w)


def underflow_data_ftz(M, H, V, seed):
    """Products and partial sums around fp32's smallest normal, where FTZ decides."""
    a, w = rand_data(M, H, V, seed)
    return _bf16(a.float() * 2.0**-62), _bf16(w.float() * 2.0**-60)


# M in {1, 7, 16, 300} x H in {32, 2880, 3072, 61, 576}; V never a multiple of 16 (wider
# for few rows: several 256-column tiles; narrow for 300 rows to keep the reference fast)
AMX32_SHAPES = [(m, h, {1: 531, 7: 133, 16: 75, 300: 21}[m])
                for m in (1, 7, 16, 300) for h in (32, 2880, 3072, 61, 576)]
_AMX32_REFS: dict = {}


def amx32_case(maker, M, H, V, seed):
    key = (maker.__name__, M, H, V, seed)
    if key not in _AMX32_REFS:
        a, w = maker(M, H, V, seed)
        _AMX32_REFS[key] = (a, w, amx32_ref(a, w))
    return _AMX32_REFS[key]


@pytest.mark.parametrize("shape", AMX32_SHAPES)
def test_amx32_backends_match_reference(shape):
    """avx512 == avx2 == c == reference (plain and packed weight), one seed per shape."""
    a, w, ref = amx32_case(rand_data, *shape, sum(shape) % 7)
    pw = pack_weight(w)
    for b in EQUAL32:
        if b == "c" and shape[0] * shape[1] * shape[2] > 3e6:
            continue  # the plain C path is checked on the smaller shapes (it is slow)
        assert same_bits(gemm_bf16(a, w, order="amx32", backend=b), ref), (b, shape)
        assert same_bits(gemm_bf16(a, pw, order="amx32", backend=b), ref), (b, shape, "packed")


@pytest.mark.parametrize("maker", [special_data, underflow_data_ftz])
@pytest.mark.parametrize("shape", [(9, 61, 101), (4, 260, 333), (16, 576, 50)])
def test_amx32_special_values(maker, shape):
    """NaN, +-inf, +-0, subnormal inputs and results, overflow: every path, both layouts."""
    for seed in (0, 1):
        a, w, ref = amx32_case(maker, *shape, seed)
        for b in EQUAL32:
            for ww in (w, pack_weight(w)):
                assert same_bits(gemm_bf16(a, ww, order="amx32", backend=b), ref), (b, seed)
        bits = ref.view(torch.int32)
        if maker is special_data:
            nan = torch.isnan(ref)
            assert 0 < nan.sum() < nan.numel() and bool((bits[nan] == 0x7FC00000).all())
            assert bool(torch.isinf(ref).any())
        else:  # flushed results of both signs, and results at the smallest normal
            assert bool((bits == 0).any() and (bits == -2**31).any())
            assert bool(((bits & 0x7FFFFFFF) == 0x00800000).any() or
                        ((bits & 0x7FFFFFFF) < 0x00900000).any())
            assert not bool((((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)).any())


def test_amx_matches_emulation():
    """The AMX tile kernel == the emulation, byte for byte (random and special data): the
    tile instructions where the CPU has them, else lmtail_emulate.h's tile model ("emu-amx":
    the kernel's tiling, VNNI copies and tails, with the instruction's order and checks)."""
    amx = native_or_emulated(G.GEMM["amx32"], "amx", NO_AMX)
    for maker, shape in ((rand_data, (300, 2880, 75)), (rand_data, (7, 61, 531)),
                         (rand_data, (16, 3072, 33)), (special_data, (9, 61, 101)),
                         (underflow_data_ftz, (16, 576, 50))):
        a, w = maker(*shape, 0)
        want = gemm_bf16(a, w, order="amx32", backend=EMULATIONS[0])
        assert same_bits(gemm_bf16(a, w, order="amx32", backend=amx), want), shape
        assert same_bits(gemm_bf16(a, pack_weight(w), order="amx32", backend=amx), want)


# ---------------------------------------------------------------------------------------
# hand-computed cases: (H, {lane: (a, w)}, expected bits, what a wrong model gives)
# ---------------------------------------------------------------------------------------
T = 2.0**-126
AMX32_HAND = [
    # x = 2^-126 - 1.5*2^-151 is tiny after rounding -> +0 (flushing only subnormal IEEE
    # results would keep 2^-126)
    ("ftz after rounding, flushed", 3, {0: (2.0**-63, 2.0**-63), 2: (-1.5 * 2.0**-75, 2.0**-76)},
     0x00000000),
    # x = 2^-126 - 2^-152 rounds to 2^-126 with an unbounded exponent: not tiny (tininess
    # before rounding would flush it)
    ("ftz after rounding, kept", 3, {0: (2.0**-63, 2.0**-63), 2: (-(2.0**-76), 2.0**-76)},
     0x00800000),
    # a subnormal input is read as zero (the chain would give 4e-39)
    ("daz", 1, {0: (1.0e-39, 4.0)}, 0x00000000),
    # block 1: s = -2^-126 - 2^-133, acc = 2^-126 + s = -2^-133 is flushed to -0
    ("ftz of the block add, signed", 36,
     {0: (2.0**-63, 2.0**-63), 32: (-(2.0**-62), 2.0**-62), 33: (1.5 * 2.0**-62, 2.0**-63),
      35: (-(2.0**-66), 2.0**-67)}, 0x80000000),
    # ... then block 2: e = o = -0 (flushed tiny products); the +0 * +0 pad lanes make them
    # +0, and acc = -0 + +0 = +0 (skipping the pad lanes would give -0)
    ("pad lanes are +0 products", 66,
     {0: (2.0**-63, 2.0**-63), 32: (-(2.0**-62), 2.0**-62), 33: (1.5 * 2.0**-62, 2.0**-63),
      35: (-(2.0**-66), 2.0**-67), 64: (-(2.0**-70), 2.0**-70), 65: (-(2.0**-70), 2.0**-70)},
     0x00000000),
    # the even and odd sums meet once per block: acc = 1 + (2^-24 + 2^-24) = 1 + 2^-23
    # ((acc + e) + o would round twice to 1)
    ("acc + (e + o)", 34, {0: (1.0, 1.0), 32: (2.0**-12, 2.0**-12), 33: (2.0**-12, 2.0**-12)},
     0x3F800001),
    # in one lane chain the fma keeps -2^126 finite; split over even and odd it overflows
    ("fma within a lane chain", 3, {0: (2.0**64, 1.5 * 2.0**63), 2: (2.0**64, -(2.0**64))},
     0xFE800000),
    ("even and odd chains overflow apart", 2, {0: (2.0**64, 1.5 * 2.0**63), 1: (2.0**64, -(2.0**64))},
     0xFF800000),
    ("inf * 0 -> canonical NaN", 2, {0: (math.inf, 0.0), 1: (1.0, 1.0)}, 0x7FC00000),
    ("NaN payload -> canonical NaN", 1, {0: (float("nan"), 1.0)}, 0x7FC00000),
]


def _lanes_case(H, lanes):
    a = torch.zeros(1, H)
    w = torch.zeros(H, 1)
    for k, (x, y) in lanes.items():
        a[0, k], w[k, 0] = x, y
    a, w = a.bfloat16(), w.bfloat16()
    if any(x != x for x, _ in lanes.values()):  # a NaN with a payload: bf16 0x7FC1
        a.view(torch.int16)[torch.isnan(a)] = 0x7FC1
    return a, w


@pytest.mark.parametrize("case", AMX32_HAND, ids=[c[0] for c in AMX32_HAND])
def test_amx32_hand_cases(case):
    _, H, lanes, want = case
    a, w = _lanes_case(H, lanes)
    assert all(float(a[0, k]) * float(w[k, 0]) == x * y for k, (x, y) in lanes.items()
               if min(abs(x), abs(y)) >= T and max(abs(x), abs(y)) < math.inf)  # exact in bf16
    assert _u32(amx32_ref(a, w)) == want
    for b in AMX32:
        for ww in (w, pack_weight(w)):
            assert _u32(gemm_bf16(a, ww, order="amx32", backend=b)) == want, b


def test_amx32_hand_cases_tell_the_wrong_models_apart():
    """Each planted variant of the reference gets at least one hand case wrong."""
    variants = {"chain": lambda a, w: R.gemm_chain_emulation(a, w),
                "no FTZ/DAZ": lambda a, w: R.gemm_amx32_emulation(a, w, ftz=False),
                "(acc + e) + o": lambda a, w: R.gemm_amx32_emulation(a, w, lane_pair_last=True),
                "no pad lanes": lambda a, w: R.gemm_amx32_emulation(a, w, pad_lanes=False)}
    for name, fn in variants.items():
        wrong = [c[0] for c in AMX32_HAND if _u32(fn(*_lanes_case(c[1], c[2]))) != c[3]]
        assert wrong, name


# ---------------------------------------------------------------------------------------
# the reference against exact rational arithmetic
# ---------------------------------------------------------------------------------------
def _round_ftz(x: Fraction, zero_sign: float) -> float:
    """x rounded to fp32 (24 bits, exponent unbounded, ties to even); below 2^-126 the zero
    of x's sign (zero_sign when x == 0). No overflow in the data used here."""
    if x == 0:
        return math.copysign(0.0, zero_sign)
    y = abs(x)
    e = y.numerator.bit_length() - y.denominator.bit_length()
    while Fraction(2)**e > y:
        e -= 1
    while Fraction(2)**(e + 1) <= y:
        e += 1
    q = y / Fraction(2)**(e - 23)  # in [2^23, 2^24)
    n = math.floor(q)
    if q - n > Fraction(1, 2) or (q - n == Fraction(1, 2) and n % 2):
        n += 1
    r = float(n * Fraction(2)**(e - 23))
    return math.copysign(0.0 if r < T else r, float(x.numerator))


def _amx32_rational(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """amx32 on Python Fractions: scalar loops, exact sums, one rounding per step."""
    def rd(v):
        return 0.0 * math.copysign(1.0, v) if abs(v) < T else v
    A, W = a.float().tolist(), w.float().tolist()
    M, H, V = a.shape[0], a.shape[1], w.shape[1]
    out = torch.zeros(M, V)
    for m in range(M):
        for v in range(V):
            acc = 0.0
            for b in range(0, H, 32):
                chains = []
                for lane0 in (0, 1):
                    s = 0.0
                    for k in range(b + lane0, b + 32, 2):
                        x, y = (rd(A[m][k]), rd(W[k][v])) if k < H else (0.0, 0.0)
                        p = Fraction(x) * Fraction(y)
                        zs = -1.0 if math.copysign(1, x) * math.copysign(1, y) < 0 and \
                            math.copysign(1, s) < 0 else 1.0
                        s = _round_ftz(p + Fraction(s), zs)
                    chains.append(s)
                e, o = chains
                zs = -1.0 if math.copysign(1, e) < 0 and math.copysign(1, o) < 0 else 1.0
                t = _round_ftz(Fraction(e) + Fraction(o), zs)
                zs = -1.0 if math.copysign(1, acc) < 0 and math.copysign(1, t) < 0 else 1.0
                acc = _round_ftz(Fraction(acc) + Fraction(t), zs)
            out[m, v] = acc
    return out


def test_amx32_reference_is_exact_rational_arithmetic():
    for maker in (rand_data, underflow_data_ftz):
        a, w = maker(2, 45, 3, 7)
        a.view(torch.int16)[0, 3] = 0x0041  # a subnormal input
        assert same_bits(amx32_ref(a, w), _amx32_rational(a, w)), maker.__name__


# ---------------------------------------------------------------------------------------
# invariance: batch, threads, layout, repeats, column slices, row blocks, MXCSR
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", EMULATIONS)
def test_amx32_batch_thread_layout_invariant(backend):
    a, w = special_data(128, 300, 300, 3, p=0.002)
    assert check_batch_invariant(amx32_impl(backend), a, w)
    assert check_thread_invariant(amx32_impl(backend), a, w)
    assert check_slice_invariant(amx32_impl(backend), a[:9], w)
    one = amx32_impl(backend, threads=1)(a, w)
    assert same_bits(amx32_impl(backend, packed=True, threads=2)(a, w), one)
    assert all(same_bits(amx32_impl(backend, threads=2)(a, w), one) for _ in range(2))


def test_amx32_many_rows_few_columns_split_rows_over_threads():
    """V = 192 is one column tile: the rows are split across threads; same bytes."""
    a, w = rand_data(300, 576, 192, 4)
    for b in EMULATIONS:
        one = amx32_impl(b, threads=1)(a, w)
        assert same_bits(amx32_impl(b, threads=2)(a, w), one), b
    assert same_bits(one, amx32_ref(a, w))


def test_amx32_few_rows_split_columns_over_threads():
    """M <= 6 gives each thread at least 2^17 weight elements: 576 x 576 at M = 1 runs as
    two column halves of 288, 576 x 577 as 320 + 257, 1536 x 290 on three threads as
    128 + 128 + 34 columns; every thread count, both layouts, special values (NaN, inf,
    subnormals) give the reference's bytes."""
    for M, H, V, seed in ((1, 576, 576, 1), (4, 576, 577, 2), (6, 1536, 290, 3)):
        a, w = special_data(M, H, V, seed, p=0.002)
        ref = amx32_ref(a, w)
        for b in EMULATIONS:
            for threads in (1, 2, 3):
                for ww in (w, pack_weight(w)):
                    got = gemm_bf16(a, ww, order="amx32", backend=b, threads=threads)
                    assert same_bits(got, ref), (M, H, V, b, threads)


def test_amx32_thread_pool_concurrent_callers():
    """Two Python threads calling at once (the GIL is released): one call holds the pool,
    the other runs on threads of its own; every result has the reference's bytes."""
    import threading

    a, w = rand_data(2, 576, 960, 5)
    ref = amx32_ref(a, w)
    bad = []

    def loop():
        for _ in range(30):
            for b in EMULATIONS:
                if not same_bits(gemm_bf16(a, w, order="amx32", backend=b, threads=2), ref):
                    bad.append(b)

    ts = [threading.Thread(target=loop) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in ts) and not bad, bad


@pytest.mark.skipif(not hasattr(os, "fork"), reason="this platform has no os.fork")
def test_amx32_thread_pool_after_fork():
    """The pool belongs to its process: a forked child starts with no helper, starts its
    own on its first 2-thread call and gets the parent's bytes (no hang on a copied lock)."""
    a, w = rand_data(1, 576, 640, 9)
    lib = G._amx32_library()
    want = gemm_bf16(a, w, order="amx32", backend=EMULATIONS[0], threads=2)
    assert lib.lmtail_amx32_pool_helpers() >= 1  # a 2-thread call made a helper
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report b"1" for "no helper, then one, right bytes"
        try:
            before = lib.lmtail_amx32_pool_helpers()
            got = gemm_bf16(a, w, order="amx32", backend=EMULATIONS[0], threads=2)
            ok = before == 0 and lib.lmtail_amx32_pool_helpers() == 1 and same_bits(got, want)
            os.write(wfd, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(wfd)
    deadline = time.monotonic() + 60
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung in gemm_bf16")
        time.sleep(0.01)
    got = os.read(rfd, 1)
    os.close(rfd)
    assert got == b"1"


def test_amx32_wide_tiles_for_few_rows():
    """M <= 6 reads w in tiles of up to 4096 columns on one thread (fewer when that leaves
    < 4 tiles), and in equal 32-column multiples of at most 1024 on several: tile edges,
    thread counts and both layouts give the reference's bytes. w (Kp * V >= 2^22) is large
    enough that threads=2 really runs two threads."""
    for M, V in ((1, 40001), (5, 17000)):
        a, w = rand_data(M, 128, V, M)
        ref = amx32_ref(a, w)
        for b in EMULATIONS:
            for threads in (1, 2):
                for ww in (w, pack_weight(w)):
                    got = gemm_bf16(a, ww, order="amx32", backend=b, threads=threads)
                    assert same_bits(got, ref), (M, V, b, threads)


@pytest.mark.parametrize("M", range(1, 7))
def test_amx32_streamed_strips_every_row_count(M):
    """M <= 4 on a plain w streams strips of 128 (M = 1) or 64 columns (AVX-512; AVX2: 32 or
    16 per 2-row group) over the whole blocks, then a masked pass over the partial block and
    the last columns; M = 5, 6 take the masked path throughout. V = 359 has strips of each
    width plus 7 columns, H = 77 a partial block, H = 96 none; random and
    special values (NaN, inf, +-0, subnormals, flushed results); threads=2 is capped to one
    thread at this size (Kp * V < 2^17), so it must give the same bytes too."""
    for maker, H in ((rand_data, 96), (special_data, 77), (underflow_data_ftz, 96)):
        a, w, ref = amx32_case(maker, M, H, 359, M)
        for b in EMULATIONS:
            for threads in (1, 2):
                got = gemm_bf16(a, w, order="amx32", backend=b, threads=threads)
                assert same_bits(got, ref), (maker.__name__, M, H, b, threads)


def test_amx32_row_blocks_and_strides():
    a, w = rand_data(20, 140, 300, 3)
    full = gemm_bf16(a, w, order="amx32")
    wide = torch.full((20, 310), 7.0)
    for r0, r1 in ((0, 3), (3, 11), (11, 20)):
        gemm_bf16(a[r0:r1], w, order="amx32", out=wide[r0:r1, 4:304])
    assert same_bits(wide[:, 4:304].contiguous(), full)
    assert bool((wide[:, :4] == 7).all() and (wide[:, 304:] == 7).all())
    assert same_bits(gemm_bf16(a.t().contiguous().t(), w, order="amx32"), full)


def test_amx32_caller_flush_denormal_cannot_change_bits():
    a, w = underflow_data_ftz(9, 100, 300, 5)
    want = {b: gemm_bf16(a, w, order="amx32", backend=b) for b in EMULATIONS}
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = {b: gemm_bf16(a, w, order="amx32", backend=b) for b in EMULATIONS}
    finally:
        torch.set_flush_denormal(False)
    assert all(same_bits(got[b], want[b]) for b in EMULATIONS)


def test_amx32_empty_and_zero_depth():
    out = gemm_bf16(*rand_data(3, 0, 5, 0), order="amx32")
    assert out.shape == (3, 5) and bool((out.view(torch.int32) == 0).all())
    assert gemm_bf16(*rand_data(0, 4, 5, 0), order="amx32").shape == (0, 5)
    assert gemm_bf16(*rand_data(2, 4, 0, 0), order="amx32").shape == (2, 0)


def test_pack_weight_layout():
    w = rand_data(1, 61, 45, 0)[1]
    pw = pack_weight(w)
    assert pw.shape == (61, 45) and tuple(pw.data.shape) == (32, 128)
    d = pw.data.view(torch.int16)
    assert torch.equal(d[:, 0:90:2][:30], w.view(torch.int16)[0:60:2])  # even lanes
    assert torch.equal(d[:, 1:90:2][:30], w.view(torch.int16)[1:60:2])  # odd lanes
    assert bool((d[:, 90:] == 0).all() and (d[31, 1::2] == 0).all())  # padding is +0


# ---------------------------------------------------------------------------------------
# planted wrong variants and the float64 range
# ---------------------------------------------------------------------------------------
def test_amx32_planted_variants_are_caught():
    a, w, ref = amx32_case(rand_data, 7, 2880, 133, 2880 % 7 + 7 + 133 - 140)
    assert same_bits(gemm_bf16(a, w, order="amx32"), ref)
    assert not same_bits(gemm_bf16(a, w, order="chain"), ref)  # the sequential chain
    assert not same_bits(R.gemm_amx32_emulation(a, w, lane_pair_last=True), ref)
    a, w, ref = amx32_case(underflow_data_ftz, 9, 61, 101, 0)
    assert not same_bits(R.gemm_amx32_emulation(a, w, ftz=False), ref)  # no FTZ / DAZ


def _adversarial_chain_data():
    """1 + 2879 * 2^-24: every chain step is a tie that rounds back to 1 (the chain loses
    1.7e-4), while amx32's block sums keep the small terms (exact here)."""
    a = torch.full((1, 2880), 2.0**-12).bfloat16()
    w = torch.full((2880, 3), 2.0**-12).bfloat16()
    a[0, 0], w[0] = 1.0, 1.0
    return a, w


def test_amx32_range_from_the_declared_depth():
    amx, chain = G.gemm_decl(2880, "amx32"), G.gemm_decl(2880, "chain")
    for seed in SEEDS:
        a, w = rand_data(17, 2880, 130, seed)
        lo, hi = R.gemm_range(a, w, amx)
        assert R.in_range(gemm_bf16(a, w, order="amx32"), lo, hi).all()
        assert not R.in_range(gemm_bf16(a, w, order="amx32").bfloat16().float(), lo, hi).all()
    a, w = special_data(9, 61, 101, 0)
    assert R.in_range(gemm_bf16(a, w, order="amx32"), *R.gemm_range(a, w, G.gemm_decl(61, "amx32"))).all()
    a, w = _adversarial_chain_data()
    out_c, out_a = gemm_bf16(a, w, order="chain"), gemm_bf16(a, w, order="amx32")
    assert R.in_range(out_c, *R.gemm_range(a, w, chain)).all()  # inside its own range
    assert not R.in_range(out_c, *R.gemm_range(a, w, amx)).any()  # outside amx32's
    assert R.in_range(out_a, *R.gemm_range(a, w, amx)).all()
    exact = R.gemm_f64(a, w)[0, 0]
    assert abs(float(out_a[0, 0]) - exact) * 100 < abs(float(out_c[0, 0]) - exact)


# ---------------------------------------------------------------------------------------
# validation of the options
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(order="pairwise"), r"order must be one of \('chain', 'amx32', 'dp32'\); got 'pairwise'"),
    (dict(order="amx32", backend="cuda"), r"backend must be one of .* got 'cuda'"),
    (dict(order="chain", backend="avx2"), r"backend must be one of .* order='chain'"),
    (dict(order="amx32", threads=0), "threads must be an int >= 1 or None; got 0"),
    (dict(order="amx32", threads=1.5), "threads must be an int >= 1 or None; got 1.5"),
])
def test_amx32_bad_options_write_nothing(kw, msg):
    a, w = rand_data(3, 8, 5, 0)
    out = torch.full((3, 5), 7.0)
    with pytest.raises(ValueError, match=msg):
        gemm_bf16(a, w, out=out, **kw)
    assert bool((out == 7).all())


def test_packed_weight_needs_amx32_and_matching_h():
    a, w = rand_data(3, 8, 5, 0)
    with pytest.raises(ValueError, match="a PackedWeight needs order='amx32' or 'dp32'; got order='chain'"):
        gemm_bf16(a, pack_weight(w), order="chain")
    with pytest.raises(ValueError, match=r"H mismatch: a is \[M, H\] = \(3, 7\)"):
        gemm_bf16(a[:, :7], pack_weight(w), order="amx32")
    with pytest.raises(ValueError, match="w must be torch.bfloat16; got torch.float32"):
        pack_weight(w.float())
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        pack_weight([1, 2])
    with pytest.raises(ValueError, match=r"PackedWeight.data must be .* \(16, 64\) for H=8, V=5"):
        G.PackedWeight(data=torch.zeros(4, 64, dtype=torch.bfloat16), H=8, V=5)
