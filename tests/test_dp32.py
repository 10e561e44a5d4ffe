"""gemm_bf16(order="dp32"): VDPBF16PS's order (per 32-lane block one fma chain t from +0
over the lane pairs, odd lane then even, acc = acc + t; DAZ inputs, FTZ results): every
backend bit-equal to reference.gemm.gemm_dp32_emulation, the emulation equal to exact
rational arithmetic, byte invariance, the declared float64 range, and planted wrong orders
told apart.

Shape legend: a [M, H] bf16, w [H, V] bf16 (C-contiguous), out [M, V] fp32.
Byte equality is compared on int32 views, never allclose. Where this CPU lacks AVX512-BF16
(or AVX-512) the VDPBF16PS (and AVX-512) tests run the emulated build ("emu-<isa>": SIMDe
and lmtail_emulate.h's exact VDPBF16PS model); they skip only without SIMDe.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from conftest import native_or_emulated, same_bits, stand_ins

from lmtail.kernels import cpu
from lmtail.kernels.gemm import bf16 as G
from lmtail.kernels.gemm.bf16 import gemm_bf16, pack_weight
from lmtail.reference import gemm as R

DP32 = G.available_backends("dp32")
EMULATIONS = tuple(b for b in DP32 if b != "avx512bf16")
# the bitwise equality tests also run the emulated rows of the vector paths this CPU lacks
EQUAL = EMULATIONS + tuple(b for b in stand_ins(G.GEMM["dp32"]) if b != "emu-avx512bf16")
NO_BF16 = (cpu.missing("avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq")
           + " (VDPBF16PS; ../shared/probes/dpbf16_order_probe.c measures its order there)")
T = 2.0**-126  # fp32's smallest normal


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def rand_data(M, H, V, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(M, H, generator=g) * scale).bfloat16()  # [M, H]
    w = (torch.randn(H, V, generator=g) * 0.05 * scale).bfloat16()  # [H, V]
    return a, w


# bf16 bit patterns: NaN, +-inf, +-0, subnormals, tiny normal, huge, 2**-75, 2**64
SPECIALS = [0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x0040, 0x0080,
            0x7F7F, 0xFF7F, 0x1A00, 0x5F80, 0x9A00]


def special_data(M, H, V, seed, p=0.02):
    """Random data with a fraction p of a's and w's entries replaced by special values."""
    a, w = rand_data(M, H, V, seed)
    g = torch.Generator().manual_seed(seed + 100)
    spec = torch.tensor(SPECIALS, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for t in (a, w):
        hit = torch.rand(t.shape, generator=g) < p
        pick = torch.randint(len(SPECIALS), t.shape, generator=g)
        t[hit] = spec[pick[hit]]
    return a, w


def underflow_data(M, H, V, seed):
    """Products and partial sums around fp32's smallest normal, where FTZ decides."""
    a, w = rand_data(M, H, V, seed)
    return (a.float() * 2.0**-62).bfloat16(), (w.float() * 2.0**-60).bfloat16()


_REFS: dict = {}


def case(maker, M, H, V, seed):
    key = (maker.__name__, M, H, V, seed)
    if key not in _REFS:
        a, w = maker(M, H, V, seed)
        _REFS[key] = (a, w, R.gemm_dp32_emulation(a, w))
    return _REFS[key]


# M in {1, 7, 16, 300} x H in {32, 61, 576, 2880}; V odd (wider for few rows)
SHAPES = [(m, h, {1: 531, 7: 133, 16: 75, 300: 21}[m]) for m in (1, 7, 16, 300)
          for h in (32, 61, 576, 2880)]


# ---------------------------------------------------------------------------------------
# every backend == the emulation
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
def test_backends_match_emulation(shape):
    """avx512 / avx2 / c == the emulation, plain and packed weight, one seed per shape."""
    a, w, ref = case(rand_data, *shape, sum(shape) % 7)
    pw = pack_weight(w)
    for b in EQUAL:
        if b == "c" and shape[0] * shape[1] * shape[2] > 3e6:
            continue  # the plain C path is checked on the smaller shapes (it is slow)
        assert same_bits(gemm_bf16(a, w, order="dp32", backend=b), ref), (b, shape)
        assert same_bits(gemm_bf16(a, pw, order="dp32", backend=b), ref), (b, shape, "packed")


@pytest.mark.parametrize("maker", [special_data, underflow_data])
@pytest.mark.parametrize("shape", [(9, 61, 101), (4, 260, 333), (16, 576, 51)])
def test_special_values(maker, shape):
    """NaN, +-inf, +-0, subnormal inputs and results, overflow: every path, both layouts."""
    for seed in (0, 1):
        a, w, ref = case(maker, *shape, seed)
        for b in EQUAL:
            for ww in (w, pack_weight(w)):
                assert same_bits(gemm_bf16(a, ww, order="dp32", backend=b), ref), (b, seed)
        bits = ref.view(torch.int32)
        if maker is special_data:
            nan = torch.isnan(ref)
            assert 0 < nan.sum() < nan.numel() and bool((bits[nan] == 0x7FC00000).all())
            assert bool(torch.isinf(ref).any())
        else:  # flushed results of both signs, no subnormal result
            assert bool((bits == 0).any() and (bits == -2**31).any())
            assert not bool((((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)).any())


def test_vdpbf16ps_matches_emulation():
    """The VDPBF16PS kernel == the emulation, byte for byte (random, special, underflow):
    the instruction where the CPU has it, else lmtail_emulate.h's exact model of it
    ("emu-avx512bf16", the same kernel source through SIMDe)."""
    bf16 = native_or_emulated(G.GEMM["dp32"], "avx512bf16", NO_BF16)
    for maker, shape in ((rand_data, (300, 2880, 75)), (rand_data, (7, 61, 531)),
                         (special_data, (9, 61, 101)), (underflow_data, (16, 576, 51))):
        a, w = maker(*shape, 0)
        want = R.gemm_dp32_emulation(a, w)
        for ww in (w, pack_weight(w)):
            for t in (1, 3):
                got = gemm_bf16(a, ww, order="dp32", backend=bf16, threads=t)
                assert same_bits(got, want), (shape, t)


# gemm_dp32.c's VDPBF16PS paths (dp_strip): M <= 2 one row tile (strips of 192 / 96 columns,
# tiles of 960), 3..6 one tile of 64-column strips, M > 6 row tiles of 3..6 over a pair panel
# built once per strip and chunk of 128 lanes (dp_panel); H not a multiple of 32 or 128 (the
# masked chunk), V cutting a strip, a group or a tile; both layouts; 1..3 threads.
VDP_SHAPES = [(1, 61, 961), (1, 288, 193), (2, 130, 97), (2, 32, 1000), (3, 200, 65), (6, 96, 130),
              (7, 61, 33), (8, 257, 200), (13, 130, 64), (33, 160, 95), (40, 32, 17), (1, 33, 1),
              (9, 576, 1001), (1, 576, 2000)]


def _swap_halves(out: torch.Tensor) -> torch.Tensor:
    """Planted lane map: each 32-column group's two 16-lane halves swapped (V a multiple of 32)."""
    M, V = out.shape
    return out.reshape(M, V // 32, 2, 16).flip(2).reshape(M, V)


def test_vdpbf16ps_blocking_paths():
    """Every VDPBF16PS blocking path == the emulation, both layouts, 1..3 threads; special
    values on two shapes. Planted: a lane map with the halves of a group swapped differs."""
    if "avx512bf16" not in DP32:
        pytest.skip(NO_BF16)
    for i, shape in enumerate(VDP_SHAPES):
        maker = special_data if i % 4 == 3 else rand_data
        a, w = maker(*shape, 60 + i)
        want = R.gemm_dp32_emulation(a, w)
        for ww in (w, pack_weight(w)):
            for t in (1, 2, 3):
                got = gemm_bf16(a, ww, order="dp32", backend="avx512bf16", threads=t)
                assert same_bits(got, want), (shape, t, isinstance(ww, torch.Tensor))
    a, w = rand_data(3, 64, 64, 70)
    want = R.gemm_dp32_emulation(a, w)
    assert not same_bits(_swap_halves(want), want)


# ---------------------------------------------------------------------------------------
# invariance: threads, rows, column split, repeats
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", EMULATIONS)
def test_thread_row_column_invariant(backend):
    a, w = special_data(64, 576, 1001, 3, p=0.002)
    if backend == "c":
        a = a[:5]
    full = gemm_bf16(a, w, order="dp32", backend=backend, threads=1)
    assert same_bits(full[:3], R.gemm_dp32_emulation(a[:3], w))
    for t in (2, 3):
        assert same_bits(gemm_bf16(a, w, order="dp32", backend=backend, threads=t), full), t
        assert same_bits(gemm_bf16(a, pack_weight(w), order="dp32", backend=backend, threads=t), full)
    for m0, m1 in ((0, 1), (1, 4), (3, 5)):  # a row's bytes do not depend on the other rows
        assert same_bits(gemm_bf16(a[m0:m1], w, order="dp32", backend=backend), full[m0:m1])
    for c0, c1 in ((0, 1), (3, 70), (255, 257), (500, 1001)):  # nor on the column split
        part = gemm_bf16(a, w[:, c0:c1].contiguous(), order="dp32", backend=backend, threads=2)
        assert same_bits(part, full[:, c0:c1]), (c0, c1)
    assert same_bits(gemm_bf16(a, w, order="dp32", backend=backend, threads=3), full)  # repeat


def test_row_blocks_into_preallocated_out():
    a, w = rand_data(9, 61, 133, 4)
    out = torch.full((9, 140), 7.0)[:, :133]
    for r0, r1 in ((0, 4), (4, 9)):
        gemm_bf16(a[r0:r1], w, order="dp32", out=out[r0:r1])
    assert same_bits(out.contiguous(), R.gemm_dp32_emulation(a, w))


def test_planted_thread_variant_is_caught():
    """The invariance check can fail: a result that depends on the thread count."""
    a, w = rand_data(4, 576, 1001, 5)
    full = gemm_bf16(a, w, order="dp32", threads=1)
    wrong = gemm_bf16(a, w, order="amx32", threads=3)  # a different order posing as 3 threads
    assert not same_bits(wrong, full)


# ---------------------------------------------------------------------------------------
# hand cases: (name, H, {lane: (a, w)}, expected bits)
# ---------------------------------------------------------------------------------------
HAND = [
    # pair 0: the odd lane first: t = fma(2^64, -2^64, +0) overflows to -inf (the even lane
    # first keeps 1.5*2^127 - 2^128 = -2^126 finite)
    ("odd lane first", 2, {0: (2.0**64, 1.5 * 2.0**63), 1: (2.0**64, -(2.0**64))}, 0xFF800000),
    # block 0: t = 1; block 1: t = 2^-24 + 2^-24 = 2^-23 exactly; acc = 1 + 2^-23 (one chain
    # over both blocks rounds 1 + 2^-24 back to 1 twice)
    ("block partial", 64, {1: (1.0, 1.0), 33: (2.0**-12, 2.0**-12), 35: (2.0**-12, 2.0**-12)},
     0x3F800001),
    # one chain over the pairs: t = 1 (lane 1), 1 + 2^-24 -> 1 (lane 0), -> 1 (lane 2); amx32's
    # even chain keeps 2^-24 + 2^-24 and gives 1 + 2^-23
    ("one chain per block", 3, {1: (1.0, 1.0), 0: (2.0**-12, 2.0**-12), 2: (2.0**-12, 2.0**-12)},
     0x3F800000),
    # t = 2^-126 then + (-2^-127) = 2^-127, tiny: flushed to +0 (an IEEE accumulator keeps it)
    ("accumulator FTZ", 2, {1: (2.0**-63, 2.0**-63), 0: (-(2.0**-64), 2.0**-63)}, 0x00000000),
    # x = 2^-126 - 1.5*2^-151 is tiny after rounding -> +0
    ("ftz after rounding", 2, {1: (2.0**-63, 2.0**-63), 0: (-1.5 * 2.0**-75, 2.0**-76)}, 0x00000000),
    # a subnormal input is read as zero (IEEE would give 4e-39)
    ("daz", 1, {0: (1.0e-39, 4.0)}, 0x00000000),
    ("inf * 0 -> canonical NaN", 2, {0: (math.inf, 0.0), 1: (1.0, 1.0)}, 0x7FC00000),
]


def _lanes_case(H, lanes):
    a, w = torch.zeros(1, H), torch.zeros(H, 1)
    for k, (x, y) in lanes.items():
        a[0, k], w[k, 0] = x, y
    return a.bfloat16(), w.bfloat16()


def _u32(x: torch.Tensor) -> int:
    return int(x.view(torch.int32).flatten()[0]) & 0xFFFFFFFF


@pytest.mark.parametrize("hand", HAND, ids=[c[0] for c in HAND])
def test_hand_cases(hand):
    _, H, lanes, want = hand
    a, w = _lanes_case(H, lanes)
    assert _u32(R.gemm_dp32_emulation(a, w)) == want
    for b in DP32:
        for ww in (w, pack_weight(w)):
            assert _u32(gemm_bf16(a, ww, order="dp32", backend=b)) == want, b


# the planted wrong orders: each must get a hand case wrong and differ on random data
VARIANTS = {
    "even then odd": lambda a, w: R.gemm_dp32_emulation(a, w, even_first=True),
    "accumulator not DAZ (IEEE t, acc)": lambda a, w: R.gemm_dp32_emulation(a, w, acc_ieee=True),
    "no block partial (one chain)": lambda a, w: R.gemm_dp32_emulation(a, w, single_chain=True),
    "no FTZ/DAZ": lambda a, w: R.gemm_dp32_emulation(a, w, ftz=False),
    "amx32": lambda a, w: gemm_bf16(a, w, order="amx32"),
    "chain": lambda a, w: gemm_bf16(a, w, order="chain"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hand_cases_tell_the_wrong_orders_apart(name):
    fn = VARIANTS[name]
    wrong = [c[0] for c in HAND if _u32(fn(*_lanes_case(c[1], c[2]))) != c[3]]
    assert wrong, name


@pytest.mark.parametrize("name", ["even then odd", "no block partial (one chain)", "amx32", "chain"])
def test_wrong_orders_differ_on_random_data(name):
    a, w, ref = case(rand_data, 7, 576, 133, 1)
    assert not same_bits(VARIANTS[name](a, w), ref)


def test_accumulator_daz_alone_is_the_declaration():
    """t and acc are FTZ results, never subnormal: reading them without DAZ changes nothing,
    so the distinguishable control keeps them IEEE (no FTZ on t and acc either)."""
    a, w, ref = case(underflow_data, 16, 576, 51, 0)
    assert not same_bits(R.gemm_dp32_emulation(a, w, acc_ieee=True), ref)
    assert not bool(((ref.view(torch.int32) & 0x7F800000) == 0).logical_and(
        (ref.view(torch.int32) & 0x7FFFFF) != 0).any())


# ---------------------------------------------------------------------------------------
# the emulation against exact rational arithmetic
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


def _neg(x: float) -> bool:
    return math.copysign(1.0, x) < 0


def _dp32_rational(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """dp32 on Python Fractions: scalar loops, exact sums, one rounding per step."""
    def rd(v):
        return 0.0 * math.copysign(1.0, v) if abs(v) < T else v
    A, W = a.float().tolist(), w.float().tolist()
    M, H, V = a.shape[0], a.shape[1], w.shape[1]
    out = torch.zeros(M, V)
    for m in range(M):
        for v in range(V):
            acc = 0.0
            for b in range(0, H, 32):
                t = 0.0
                for k in [b + 2 * j + d for j in range(16) for d in (1, 0)]:
                    x, y = (rd(A[m][k]), rd(W[k][v])) if k < H else (0.0, 0.0)
                    zs = -1.0 if (_neg(x) != _neg(y)) and _neg(t) else 1.0
                    t = _round_ftz(Fraction(x) * Fraction(y) + Fraction(t), zs)
                zs = -1.0 if _neg(acc) and _neg(t) else 1.0
                acc = _round_ftz(Fraction(acc) + Fraction(t), zs)
            out[m, v] = acc
    return out


def test_emulation_is_exact_rational_arithmetic():
    for maker in (rand_data, underflow_data):
        a, w = maker(2, 45, 3, 7)
        a.view(torch.int16)[0, 3] = 0x0041  # a subnormal input
        assert same_bits(R.gemm_dp32_emulation(a, w), _dp32_rational(a, w)), maker.__name__


# ---------------------------------------------------------------------------------------
# the declaration and its float64 range
# ---------------------------------------------------------------------------------------
def test_declaration():
    for H, nb in ((1, 1), (32, 1), (61, 2), (2880, 90)):
        d = G.gemm_decl(H, "dp32")
        s = d.sum("gemm")
        assert (d.op, s.depth, s.flush, s.roundings, s.dtype) == ("gemm_bf16_dp32", 32 + nb, True, 33 * nb, "fp32")


def test_results_inside_the_declared_range():
    decl = G.gemm_decl(2880, "dp32")
    for seed in (0, 1):
        a, w = rand_data(17, 2880, 130, seed)
        lo, hi = R.gemm_range(a, w, decl)
        out = gemm_bf16(a, w, order="dp32")
        assert R.in_range(out, lo, hi).all()
        assert not R.in_range(out.bfloat16().float(), lo, hi).all()  # planted: bf16 output
    for maker in (special_data, underflow_data):
        a, w, ref = case(maker, 9, 61, 101, 0)
        assert R.in_range(ref, *R.gemm_range(a, w, G.gemm_decl(61, "dp32"))).all()


# ---------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, msg", [
    (dict(order="dp16"), r"order must be one of \('chain', 'amx32', 'dp32'\); got 'dp16'"),
    (dict(order="dp32", backend="amx"), r"backend must be one of .* for order='dp32' .* got 'amx'"),
    (dict(order="dp32", threads=0), "threads must be an int >= 1 or None; got 0"),
])
def test_bad_options_write_nothing(kw, msg):
    a, w = rand_data(3, 8, 5, 0)
    out = torch.full((3, 5), 7.0)
    with pytest.raises(ValueError, match=msg):
        gemm_bf16(a, w, out=out, **kw)
    assert bool((out == 7).all())


def test_c_entry_with_no_rows_writes_nothing():
    """lmtail_dp32_gemm with M = 0 returns 0 on every C backend and writes nothing (without
    the entry's check the VDPBF16PS path looped on an empty row tile and the AVX2 decode
    path called a null entry)."""
    lib = G._dp32_library()
    if lib is None:
        pytest.skip("no C compiler: dp32 has no backend")
    a, w = rand_data(1, 64, 40, 0)
    out = torch.full((1, 40), 7.0)
    for isa, name in ((3, "avx512bf16"), (2, "avx512"), (1, "avx2"), (0, "c")):
        if name not in DP32:
            continue
        rc = lib.lmtail_dp32_gemm(a.data_ptr(), 64, w.data_ptr(), 40, 0, out.data_ptr(), 0, 64, 40, 40, 2, isa)
        assert rc == 0 and bool((out == 7).all()), name
