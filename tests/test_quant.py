"""gemm_q over GGUF Q8_0 / Q4_1 blocks: the format's exact values, the declared lanes32 order
bit for bit on every backend, any thread count or batch, and inside the float64 range.

Shape legend: a [M, K] fp32, w QuantWeight (N, K) (K a multiple of 32), out [M, N] fp32.
Byte equality is compared on int32 views, never allclose. Each property is also run on a
planted wrong variant (nibbles swapped, m added as its own rounded step, 16 or 64 lanes,
flushed subnormals), which must be told apart.
"""
from __future__ import annotations

import functools
from fractions import Fraction

import gguf
import numpy as np
import pytest
import torch
from conftest import native_or_emulated, same_bits, stand_ins

from lmtail.kernels import cpu
from lmtail.kernels.quant import gemm_q as Q
from lmtail.kernels.quant.gemm_q import QuantWeight, dequantize, gemm_q, gemm_q_decl, lanes_emulation
from lmtail.numerics import fma32
from lmtail.reference.gemm import in_range
from lmtail.reference.quant import dequantize_f64, gemm_q_f64, gemm_q_range

BACKENDS = Q.available_backends()
# the C backends, and the emulated rows of the vector paths this CPU lacks (SIMDe)
C_BACKENDS = tuple(b for b in BACKENDS if b != "torch") + stand_ins(Q.GEMM_Q)
SEEDS = (0, 1, 2)
ISA_NEEDS = {"avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"), "avx2": ("avx2", "fma"), "c": ()}




def rand_weight(N, K, fmt, seed, scale=0.05) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantWeight.quantize(torch.randn(N, K, generator=g) * scale, fmt)


def rand_a(M, K, seed, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000)
    return torch.randn(M, K, generator=g) * scale


@functools.lru_cache(maxsize=None)
def smollm2_tensors() -> dict:
    from lmtail.model.gguf_loader import ModelFileMissing, locate_gguf

    try:
        reader = gguf.GGUFReader(locate_gguf())
    except ModelFileMissing as e:
        pytest.skip(str(e))
    return {t.name: t for t in reader.tensors}


# ---------------------------------------------------------------------------------------
# planted wrong variants
# ---------------------------------------------------------------------------------------
def dequantize_nibbles_swapped(w: QuantWeight) -> torch.Tensor:
    """Q4_1 with weight j in the HIGH nibble of qs[j] (the wrong order)."""
    N, K = w.shape
    blk = w.data.view(N, K // 32, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).float()
    qs = blk[..., 4:]
    q = torch.cat((qs >> 4, qs & 15), dim=-1).float()
    return (d * q + m).reshape(N, K)


def emulation_m_split(a: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """Q4_1 with m as its own rounded step: l[j] = fma(a, m, fma(a, d*q, l[j])), then the
    declared tree (the block algebra's rounding, not the format's value)."""
    N, K = w.shape
    blk = w.data.view(N, K // 32, 20)
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    m = blk[..., 2:4].contiguous().view(torch.float16).float()
    qs = blk[..., 4:]
    dq = (d * torch.cat((qs & 15, qs >> 4), dim=-1).float()).reshape(1, N, K // 32, 32)
    mm = m.expand(N, K // 32, 32).reshape(1, N, K // 32, 32)
    a3 = a.reshape(a.shape[0], 1, K // 32, 32)
    acc = torch.zeros(a.shape[0], N, 32)
    for b in range(K // 32):
        acc = fma32(a3[:, :, b], mm[:, :, b], fma32(a3[:, :, b], dq[:, :, b], acc))
    for h in (16, 8, 4, 2, 1):
        acc = acc[..., :h] + acc[..., h:2 * h]
    return acc[..., 0]


# ---------------------------------------------------------------------------------------
# the values: equal to gguf.quants' dequantization, on SmolLM2's real tensors
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight",
                                  "token_embd.weight"])
def test_dequantize_equals_gguf_on_smollm2(name):
    t = smollm2_tensors()[name]
    w = QuantWeight.from_gguf(t)
    assert w.fmt == t.tensor_type.name and w.shape == (int(t.shape[1]), int(t.shape[0]))
    want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)  # numpy fp32 [N, K]
    got = dequantize(w)
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))
    assert np.array_equal(dequantize_f64(w), want.astype(np.float64))  # the reference's values
    if w.fmt == "Q4_1":  # planted: the other nibble order is told apart
        assert not np.array_equal(dequantize_nibbles_swapped(w).numpy(), want)


def test_q4_1_value_is_one_rounding_of_d_q_plus_m():
    """A Q4_1 value is fl32(d*q + m): exact d*q, one rounding (checked against Fractions)."""
    w = rand_weight(8, 64, "Q4_1", 3, scale=3.0)
    blk = w.data.view(8, 2, 20).numpy()
    vals = dequantize(w).reshape(8, 2, 32).numpy()
    for n, b, j in [(0, 0, 0), (3, 1, 17), (7, 1, 31), (5, 0, 15), (2, 1, 16)]:
        d = Fraction(float(blk[n, b, 0:2].view(np.float16)[0]))
        m = Fraction(float(blk[n, b, 2:4].view(np.float16)[0]))
        qs = int(blk[n, b, 4 + j % 16])
        q = qs & 15 if j < 16 else qs >> 4
        assert vals[n, b, j] == round_fp32(d * q + m)


# ---------------------------------------------------------------------------------------
# the declared order: the emulation against exact arithmetic, one rounding at a time
# ---------------------------------------------------------------------------------------
def round_fp32(x: Fraction) -> np.float32:
    """The fp32 nearest to x, ties to even (x a nonzero finite rational in fp32's range)."""
    c = np.float32(float(x))
    cands = [np.nextafter(c, np.float32(-np.inf)), c, np.nextafter(c, np.float32(np.inf))]
    return min(cands, key=lambda v: (abs(Fraction(float(v)) - x), int(np.float32(v).view(np.int32)) & 1))


def fma_exact(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if x == 0:  # an exact zero: -0 only from (-0) + (-0)
        neg = np.signbit(a) != np.signbit(b) and np.signbit(c)
        return np.float32(-0.0) if neg else np.float32(0.0)
    return round_fp32(x)


def lanes32_scalar(a: np.ndarray, wv: np.ndarray) -> np.ndarray:
    """The declaration read literally: [M, K] x [N, K] fp32 -> [M, N] fp32, scalar steps."""
    M, K = a.shape
    out = np.zeros((M, wv.shape[0]), np.float32)
    for m in range(M):
        for n in range(wv.shape[0]):
            lane = [np.float32(0.0)] * 32
            for b in range(K // 32):
                for j in range(32):
                    lane[j] = fma_exact(a[m, 32 * b + j], wv[n, 32 * b + j], lane[j])
            for h in (16, 8, 4, 2, 1):
                for j in range(h):
                    lane[j] = np.float32(lane[j] + lane[j + h])
            out[m, n] = lane[0]
    return out


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_emulation_is_the_declared_order(fmt):
    w = rand_weight(3, 96, fmt, 4)
    a = rand_a(2, 96, 4)
    want = lanes32_scalar(a.numpy(), dequantize(w).numpy())
    assert same_bits(lanes_emulation(a, dequantize(w)), torch.from_numpy(want))
    assert not same_bits(lanes_emulation(a, dequantize(w), lanes=16), torch.from_numpy(want))


# ---------------------------------------------------------------------------------------
# every backend, every thread count, bit-equal to the emulation
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["avx512", "avx2", "c"])
def test_backend_available_or_skipped_with_reason(backend):
    reason = cpu.missing(*ISA_NEEDS[backend]) or "no C compiler (the torch emulation runs)"
    backend = native_or_emulated(Q.GEMM_Q, backend, reason)  # "emu-avx512" where the CPU lacks it
    assert backend in C_BACKENDS


# Every AVX2 blocking path (gemm_q.c's rows_cols_avx2 / lanes path), odd N, K = 32 x odd:
# M = 1 direct; 2 pair; 3, 4 half blocks (K <= 768 or not); 5..16 with K <= 768 quarter blocks
# of 5..8 rows (+ half or pair remainders); 5..7 with K > 768 half + pair; M >= 17, or 8..16
# with K > 768, the lanes path.
SHAPES = [(1, 401, 608), (3, 401, 608), (7, 129, 96), (4, 33, 1536), (17, 65, 224), (2, 1, 32),
          (67, 53, 96), (10, 301, 736), (6, 211, 1184), (9, 37, 160), (11, 45, 800), (5, 31, 352),
          (12, 9, 64), (8, 7, 32), (6, 13, 224), (13, 21, 96), (16, 11, 736)]


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("seed", SEEDS)
def test_backends_bit_equal_to_emulation(fmt, seed):
    for M, N, K in SHAPES:  # odd M and N; K = 32 * odd: not a multiple of 256
        w, a = rand_weight(N, K, fmt, seed), rand_a(M, K, seed)
        want = lanes_emulation(a, dequantize(w))
        assert same_bits(gemm_q(a, w, backend="torch"), want)
        for be in C_BACKENDS:
            for th in (1, 2, 3):  # N * K = 243,808 for the first two shapes: 3 threads work
                assert same_bits(gemm_q(a, w, backend=be, threads=th), want), (M, N, K, be, th)


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_planted_variants_are_told_apart(fmt):
    M, N, K = 3, 41, 192
    w, a = rand_weight(N, K, fmt, 7), rand_a(M, K, 7)
    got = gemm_q(a, w)
    assert same_bits(got, lanes_emulation(a, dequantize(w)))
    for lanes in (16, 64):
        assert not same_bits(got, lanes_emulation(a, dequantize(w), lanes=lanes)), lanes
    if fmt == "Q4_1":
        assert not same_bits(got, lanes_emulation(a, dequantize_nibbles_swapped(w)))
        assert not same_bits(got, emulation_m_split(a, w))


# The lanes path (gemm_q.c's lanes_unit): quads of rows (M not a multiple of 4: zero rows
# that are never stored), tiles of 24 columns (N not a multiple of 8 or 24: zero columns past
# the unit), units of 24..96 columns over 1..3 threads (the copy of a shared by the threads),
# K = 576 and 1536 (the SmolLM2 linears), 32 x odd and 32 (one block); M = 8..16 with K > 768
# and 17 at the edges of the path.
LANES_SHAPES = [(12, 23, 1536), (17, 49, 576), (33, 200, 1536), (255, 37, 576), (257, 73, 1536),
                (8, 25, 1536), (11, 30, 800), (19, 48, 96), (64, 97, 576), (21, 193, 1536),
                (18, 5, 32)]


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_lanes_path_bit_equal_to_plain_c(fmt):
    """Every vector backend == the plain C backend (each element's fma chains and tree in
    scalar code) bit for bit on the lanes path's shapes, on 1, 2 and 3 threads, with NaN,
    inf, zeros of both signs and subnormals among the activations; out's columns past N are
    not written."""
    if "c" not in C_BACKENDS:
        pytest.skip("no C compiler: only the torch emulation runs")
    vector = [be for be in C_BACKENDS if be != "c"]
    if not vector:
        pytest.skip("no vector backend on this CPU: the lanes path does not run")
    for i, (M, N, K) in enumerate(LANES_SHAPES):
        w = rand_weight(N, K, fmt, 20 + i)
        a = special_a(M, K + 7, 20 + i)[:, :K]  # lda = K + 7
        want = gemm_q(a, w, backend="c", threads=1)
        for be in vector:
            for th in (1, 2, 3):
                buf = torch.full((M, N + 5), 7.0)
                gemm_q(a, w, out=buf[:, :N], backend=be, threads=th)
                assert same_bits(buf[:, :N], want), (M, N, K, be, th)
                assert bool((buf[:, N:] == 7).all()), (M, N, K, be, th)
    M, N, K = LANES_SHAPES[0]  # the C backend itself: the declared order
    w, a = rand_weight(N, K, fmt, 20), special_a(M, K + 7, 20)[:, :K]
    assert same_bits(gemm_q(a, w, backend="c"), lanes_emulation(a, dequantize(w)))


def _gemm_q_cat(a, ws, backend, threads):
    """gemm_q.c's lmtail_gemm_q_cat (the native step's q|k|v and gate|up call) on the
    weights ws of one format and K: out [M, sum N_i], the outputs side by side."""
    import ctypes
    M, K = a.shape
    out = torch.full((M, sum(w.shape[0] for w in ws)), 7.0)
    ptrs = (ctypes.c_void_p * len(ws))(*(w.data.data_ptr() for w in ws))
    ns = (ctypes.c_int64 * len(ws))(*(w.shape[0] for w in ws))
    rc = Q.native_library().lmtail_gemm_q_cat(a.data_ptr(), K, ptrs, ns, len(ws), Q.FMT_CODE[ws[0].fmt], K,
                                        out.data_ptr(), out.shape[1], M, threads, Q.ISA[backend])
    assert rc == 0, rc
    return out


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_cat_equals_one_call_per_weight(fmt):
    """lmtail_gemm_q_cat over 1..3 weights (widths that put unit edges inside a weight and
    on a seam, e.g. 576 | 192 | 192 as q|k|v) == gemm_q of each weight, its columns side by
    side, bit for bit, on every C backend, every blocking path (M = 1, 2, 5, 8, 17, 40) and
    1, 2, 3 threads. Planted: the weights in another order must differ."""
    if not C_BACKENDS:
        pytest.skip("no C compiler: the native step does not run")
    sets = [(576, 192, 192), (37, 5), (8,), (200, 1, 63)]
    for i, widths in enumerate(sets):
        K = 576 if i == 0 else 96
        ws = [rand_weight(n, K, fmt, 40 + 3 * i + s) for s, n in enumerate(widths)]
        for M in (1, 2, 5, 8, 17, 40):
            a = special_a(M, K, 50 + M)
            want = torch.cat([gemm_q(a, w, backend="c", threads=1) for w in ws], dim=1)
            for be in C_BACKENDS:
                for th in (1, 2, 3):
                    assert same_bits(_gemm_q_cat(a, ws, be, th), want), (widths, M, be, th)
            if len(ws) > 1:  # finite activations (a NaN in a row makes every column NaN)
                a = rand_a(M, K, 60 + M)
                want = torch.cat([gemm_q(a, w, backend="c", threads=1) for w in ws], dim=1)
                assert same_bits(_gemm_q_cat(a, ws, C_BACKENDS[0], 2), want), (widths, M)
                assert not same_bits(_gemm_q_cat(a, ws[::-1], C_BACKENDS[0], 2), want), (widths, M)


def test_rows_do_not_depend_on_the_batch():
    """Row m's bytes alone == in a batch of 1 .. 8, 11, 12, 13, 15, 16, 17, 100, 255, 512 (the
    blocking paths) == with the rows reversed, on 1, 2 and 3 threads."""
    for fmt in Q.FORMATS:
        w = rand_weight(401, 576, fmt, 8)
        a = rand_a(512, 576, 8)
        full = gemm_q(a, w, threads=1)
        for M in (1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 15, 16, 17, 100, 255):  # each path
            assert same_bits(gemm_q(a[:M], w), full[:M]), M
        for th in (2, 3):
            assert same_bits(gemm_q(a, w, threads=th), full), th
        assert same_bits(gemm_q(a.flip(0), w), full.flip(0))
        assert same_bits(gemm_q(a[5:6], w), full[5:6])


def test_out_and_strided_inputs():
    w = rand_weight(45, 128, "Q4_1", 9)
    a = rand_a(6, 128, 9)
    want = gemm_q(a, w)
    buf = torch.full((6, 50), 7.0)
    res = gemm_q(a, w, out=buf[:, 2:47])
    assert res.data_ptr() == buf[:, 2:47].data_ptr() and same_bits(buf[:, 2:47], want)
    assert bool((buf[:, :2] == 7).all() and (buf[:, 47:] == 7).all())
    at = a.t().contiguous().t()  # column-major: same values
    assert same_bits(gemm_q(at, w), want)
    assert gemm_q(a[:0], w).shape == (0, 45)


# ---------------------------------------------------------------------------------------
# specials: NaN, inf, subnormals (IEEE gradual underflow, MXCSR pinned)
# ---------------------------------------------------------------------------------------
def special_a(M, K, seed) -> torch.Tensor:
    a = rand_a(M, K, seed)
    g = torch.Generator().manual_seed(seed + 5)
    spec = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -3e-39, 3e38])
    hit = torch.rand(a.shape, generator=g) < 0.02
    return torch.where(hit, spec[torch.randint(len(spec), a.shape, generator=g)], a)


def tiny_a(M, K, seed) -> torch.Tensor:
    """Activations near 2^-130: products and sums are subnormal fp32."""
    return rand_a(M, K, seed, scale=2.0**-126)


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_specials_and_subnormals_bit_equal(fmt):
    w = rand_weight(37, 192, fmt, 10)
    strided = tiny_a(3, 992, 12)[:, :192]  # lda = 992: the half-block path's row stride
    for a in (special_a(9, 192, 10), special_a(4, 192, 11), tiny_a(5, 192, 10), strided):
        want = lanes_emulation(a, dequantize(w))
        for be in C_BACKENDS:
            got = gemm_q(a, w, backend=be)
            assert same_bits(got, want), be
        nan = torch.isnan(want)
        assert bool((want[nan].view(torch.int32) == 0x7FC00000).all())
    sub = want.view(torch.int32).abs()
    assert bool(((sub > 0) & (sub < 0x00800000)).any())  # subnormal results are kept
    daz = torch.where(a.abs() < 2.0**-126, torch.zeros_like(a), a)  # planted: DAZ reads
    assert not same_bits(lanes_emulation(daz, dequantize(w)), want)


def test_caller_flush_denormal_cannot_change_bits():
    """The C kernel pins MXCSR to 0x1F80 in every worker, whatever the caller's FTZ/DAZ."""
    if not C_BACKENDS:
        pytest.skip("no C compiler: only the torch emulation runs")
    w, a = rand_weight(201, 1024, "Q4_1", 11), tiny_a(3, 1024, 11)
    want = {be: gemm_q(a, w, backend=be, threads=2) for be in C_BACKENDS}
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        got = {be: gemm_q(a, w, backend=be, threads=2) for be in C_BACKENDS}
    finally:
        torch.set_flush_denormal(False)
    for be in C_BACKENDS:
        assert same_bits(got[be], want[be]), be


# ---------------------------------------------------------------------------------------
# float64: inside the range the declaration allows
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_inside_declared_float64_range(fmt):
    for seed in SEEDS:
        w, a = rand_weight(129, 1536, fmt, seed), rand_a(5, 1536, seed)
        decl = gemm_q_decl(1536, fmt)
        lo, hi = gemm_q_range(a, w, decl)
        out = gemm_q(a, w)
        assert in_range(out, lo, hi).all()
        assert np.abs(out.double().numpy() - gemm_q_f64(a, w)).max() < 1e-4
        if fmt == "Q4_1":  # planted: the swapped nibbles land far outside
            bad = lanes_emulation(a, dequantize_nibbles_swapped(w))
            assert not in_range(bad, lo, hi).all()
    a = special_a(4, 1536, 3)
    assert in_range(gemm_q(a, w), *gemm_q_range(a, w, decl)).all()


def test_declaration():
    d = gemm_q_decl(576, "Q4_1")
    s = d.sum("gemm")
    assert s.dtype == "fp32" and s.depth == 18 + 5 and not s.flush and s.roundings == 32 * 18 + 31
    assert any("one rounding" in r for r in d.rounding_points)
    assert gemm_q_decl(576, "Q8_0").op != d.op


def test_smollm2_real_weights():
    """q (Q4_1) and a slice of the tied head (Q8_0, whole rows) bit-equal to the emulation
    and in range."""
    T = smollm2_tensors()
    wq = QuantWeight.from_gguf(T["blk.3.attn_q.weight"])
    head = QuantWeight.from_gguf(T["token_embd.weight"])
    head = QuantWeight("Q8_0", (257, 576), head.data[1000:1257])
    a = rand_a(3, 576, 12)
    for w in (wq, head):
        out = gemm_q(a, w, threads=2)
        assert same_bits(out, lanes_emulation(a, dequantize(w)))
        assert in_range(out, *gemm_q_range(a, w, gemm_q_decl(576, w.fmt))).all()


# ---------------------------------------------------------------------------------------
# the boundary
# ---------------------------------------------------------------------------------------
def test_validation_errors():
    w = rand_weight(5, 64, "Q8_0", 13)
    a = rand_a(2, 64, 13)
    with pytest.raises(ValueError, match=r"a must be a 2-D torch.float32 \[M, K\]; got torch.float64"):
        gemm_q(a.double(), w)
    with pytest.raises(ValueError, match=r"K mismatch"):
        gemm_q(rand_a(2, 96, 0), w)
    with pytest.raises(ValueError, match=r"w must be a QuantWeight; got Tensor"):
        gemm_q(a, torch.zeros(5, 64))
    with pytest.raises(ValueError,
                       match=r"out must be a torch.float32 \[M, N\] = \[2, 5\]; got torch.float32 \[5, 2\]"):
        gemm_q(a, w, out=torch.empty(5, 2))
    with pytest.raises(ValueError, match=r"out must have unit column stride"):
        gemm_q(a, w, out=torch.empty(5, 2).t())
    with pytest.raises(ValueError, match=r"backend must be one of .*; got 'cuda'"):
        gemm_q(a, w, backend="cuda")
    with pytest.raises(ValueError, match=r"threads must be a positive int or None; got 0"):
        gemm_q(a, w, threads=0)
    with pytest.raises(TypeError, match=r"a must be a torch.Tensor"):
        gemm_q(a.numpy(), w)
    with pytest.raises(ValueError, match=r"fmt must be one of \('Q8_0', 'Q4_1'\); got 'Q4_0'"):
        gemm_q_decl(64, "Q4_0")
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 32; got 48"):
        gemm_q_decl(48, "Q8_0")


def test_quant_weight_errors():
    data = torch.zeros(4, 2 * 20, dtype=torch.uint8)
    assert QuantWeight("Q4_1", (4, 64), data).nbytes == 160
    with pytest.raises(ValueError, match=r"QuantWeight.fmt must be one of"):
        QuantWeight("F16", (4, 64), data)
    with pytest.raises(ValueError, match=r"QuantWeight.shape must be \(N, K\) .*; got \(4, 60\)"):
        QuantWeight("Q4_1", (4, 60), data)
    with pytest.raises(ValueError, match=r"QuantWeight.data must be a contiguous uint8 \[4, 68\] for Q8_0"):
        QuantWeight("Q8_0", (4, 64), data)
    with pytest.raises(ValueError, match=r"QuantWeight.data must be a contiguous uint8 \[4, 40\]"):
        QuantWeight("Q4_1", (4, 64), torch.zeros(40, 4, dtype=torch.uint8).t())
    with pytest.raises(ValueError, match=r"tensor must be a gguf ReaderTensor of type"):
        QuantWeight.from_gguf(smollm2_tensors()["blk.0.attn_norm.weight"])
    with pytest.raises(ValueError, match=r"w must be a float \[N, K\]"):
        QuantWeight.quantize(torch.zeros(3, 40), "Q8_0")


def test_torch_fallback_without_c_kernel(monkeypatch):
    monkeypatch.setattr(Q, "native_library", lambda: None)
    assert Q.available_backends() == ("torch",)
    w, a = rand_weight(9, 64, "Q4_1", 14), rand_a(2, 64, 14)
    assert same_bits(gemm_q(a, w), lanes_emulation(a, dequantize(w)))


# ---------------------------------------------------------------------------------------
# the format's edge values: blocks whose fp16 d and m are subnormal (exact: mant * 2^-24)
# ---------------------------------------------------------------------------------------
SUB_HALVES = [0x0001, 0x8001, 0x03FF, 0x83FF, 0x0200, 0x0155, 0x8000, 0x0000, 0x0400, 0x8400]


def subnormal_weight(N, K, fmt, seed) -> QuantWeight:
    """rand_weight with the fp16 d (and m, Q4_1) of about half the blocks replaced by subnormal
    halves (smallest and largest, both signs, zeros, the smallest normals beside them), and
    rows 0 and 1 made of such blocks only (their results are then tiny, so a wrong subnormal
    scale cannot hide under the other blocks' rounding)."""
    w = rand_weight(N, K, fmt, seed)
    g = torch.Generator().manual_seed(seed + 77)
    blk = w.data.clone().view(N, K // 32, Q.BLOCK_BYTES[fmt])  # [N, NB, BS]
    pick = torch.tensor(SUB_HALVES, dtype=torch.int32)
    sub = torch.rand(N, K // 32, generator=g) < 0.5
    sub[:2] = True
    for off in ((0, 2) if fmt == "Q4_1" else (0,)):
        half = pick[torch.randint(len(SUB_HALVES), (N, K // 32), generator=g)]
        rnd = torch.randint(1, 0x400, (N, K // 32), generator=g) | (torch.randint(2, (N, K // 32), generator=g) << 15)
        half = torch.where(torch.rand(N, K // 32, generator=g) < 0.5, half, rnd)  # any subnormal, both signs
        for byte in (0, 1):
            val = ((half >> (8 * byte)) & 0xFF).to(torch.uint8)
            blk[..., off + byte] = torch.where(sub, val, blk[..., off + byte])
    return QuantWeight(fmt, (N, K), blk.reshape(N, -1).contiguous())


def dequantize_subnormal_halved(w: QuantWeight) -> torch.Tensor:
    """Planted: a half_to_f32 that scales every subnormal d and m by one half too much."""
    N, K = w.shape
    blk = w.data.view(N, K // 32, Q.BLOCK_BYTES[w.fmt])

    def half(off):
        h = blk[..., off:off + 2].contiguous().view(torch.int16)
        v = h.view(torch.float16).float()
        return torch.where((h & 0x7C00) == 0, v * 0.5, v)
    d, _, q = Q._fields(w)
    d = half(0)
    if w.fmt == "Q8_0":
        return (d * q).reshape(N, K)
    return (d * q + half(2)).reshape(N, K)


def test_subnormal_halves_are_exact():
    """dequantize reads a subnormal fp16 d / m as mant * 2^-24 exactly (== gguf's values and
    float64's), and the planted halving changes the values."""
    for fmt in Q.FORMATS:
        w = subnormal_weight(7, 96, fmt, 30)
        N, K = w.shape
        blk = w.data.view(N, K // 32, Q.BLOCK_BYTES[fmt]).numpy()
        h = blk[..., 0:2].copy().view(np.uint16)[..., 0]
        sub = (h & 0x7C00) == 0
        assert sub.mean() > 0.4 and sub[:2].all()
        want_d = np.where(h & 0x8000, -1.0, 1.0) * (h & 0x3FF) * 2.0**-24
        assert np.array_equal(blk[..., 0:2].copy().view(np.float16)[..., 0][sub].astype(np.float64), want_d[sub])
        got = dequantize(w)
        want = gguf.quants.dequantize(w.data.numpy(), gguf.GGMLQuantizationType[fmt]).reshape(N, K)
        assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32)), fmt
        assert np.array_equal(dequantize_f64(w), want.astype(np.float64)), fmt
        assert not same_bits(dequantize_subnormal_halved(w), got), fmt


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_subnormal_scales_bit_equal_on_every_path(fmt):
    """Blocks with subnormal fp16 d and m: every C backend == the emulation on the format's
    values, on each blocking path (M = 1; 2..16 the rows passes; 17 and 40 the lanes path; K
    576 and 1536) and 1..3 threads. Planted: the halved subnormals give other bytes."""
    for i, (M, N, K) in enumerate([(1, 67, 576), (3, 33, 576), (8, 21, 1536), (16, 19, 576),
                                   (17, 25, 576), (40, 27, 1536), (5, 9, 96)]):
        w, a = subnormal_weight(N, K, fmt, 31 + i), rand_a(M, K, 31 + i)
        want = lanes_emulation(a, dequantize(w))
        for be in C_BACKENDS:
            for th in (1, 2, 3):
                assert same_bits(gemm_q(a, w, backend=be, threads=th), want), (M, N, K, be, th)
        wrong = lanes_emulation(a, dequantize_subnormal_halved(w))
        assert not same_bits(wrong[:, :2], want[:, :2]), (M, N, K)  # the all-subnormal rows


# ---------------------------------------------------------------------------------------
# the avx512 Q4_1 table T[q] = fl32(d*q + m): planted tables built another way
# ---------------------------------------------------------------------------------------
def dequantize_table_by_adds(w: QuantWeight) -> torch.Tensor:
    """Planted: T[0] = m, T[q] = fl32(T[q-1] + d) (the table by running additions)."""
    N, K = w.shape
    d, m, q = Q._fields(w)  # [N, NB, 1], [N, NB, 1], [N, NB, 32]
    tab = [m]
    for _ in range(15):
        tab.append(tab[-1] + d)
    tab = torch.cat(tab, dim=-1)  # [N, NB, 16]
    return torch.gather(tab, -1, q.long()).reshape(N, K)


def dequantize_table_toward_zero(w: QuantWeight) -> torch.Tensor:
    """Planted: T[q] = d*q + m rounded toward zero (not to nearest)."""
    N, K = w.shape
    d, m, q = Q._fields(w)
    x = d.double() * q.double() + m.double()  # exact
    f = x.float()
    over = f.double().abs() > x.abs()
    f = torch.where(over, torch.nextafter(f, torch.zeros_like(f)), f)
    return f.reshape(N, K)


def rounding_q4_1_weight(N, K, seed) -> QuantWeight:
    """Q4_1 blocks where fl32(d*q + m) rounds: m's exponent 10..14 above d's (d*q + m then
    needs more than fp32's 24 bits; quantized weights rarely do: their d*q + m is mostly exact),
    random mantissas, both signs of m; random nibbles."""
    g = torch.Generator().manual_seed(seed)
    nb = K // 32
    ed = torch.randint(5, 16, (N, nb), generator=g)
    em = ed + torch.randint(10, 15, (N, nb), generator=g)
    d = (ed << 10) | torch.randint(0, 0x400, (N, nb), generator=g)
    m = (em << 10) | torch.randint(0, 0x400, (N, nb), generator=g) | (torch.randint(2, (N, nb), generator=g) << 15)
    blk = torch.zeros(N, nb, 20, dtype=torch.uint8)
    for off, h in ((0, d), (2, m)):
        blk[..., off], blk[..., off + 1] = (h & 0xFF).to(torch.uint8), ((h >> 8) & 0xFF).to(torch.uint8)
    blk[..., 4:] = torch.randint(0, 256, (N, nb, 16), generator=g).to(torch.uint8)
    return QuantWeight("Q4_1", (N, K), blk.reshape(N, -1).contiguous())


def test_q4_1_table_planted_variants_are_told_apart():
    """The avx512 kernel's table values are the declared fl32(d*q + m) (one rounding, to
    nearest): on blocks where that rounding happens, on the rows passes (M = 1, 4, 16) and
    the lanes path (M = 17), every backend == the declared emulation, and tables built by
    running additions or rounded toward zero, or with the nibbles swapped, each differ."""
    w = rounding_q4_1_weight(53, 576, 33)
    exact = dequantize_f64(w)  # the values from the exact d*q + m, rounded once
    assert np.array_equal(dequantize(w).double().numpy(), exact)
    for M in (1, 4, 16, 17):
        a = rand_a(M, 576, 33 + M)
        want = lanes_emulation(a, dequantize(w))
        for be in C_BACKENDS:
            assert same_bits(gemm_q(a, w, backend=be), want), (M, be)
        for wrong in (dequantize_table_by_adds, dequantize_table_toward_zero, dequantize_nibbles_swapped):
            assert not same_bits(lanes_emulation(a, wrong(w)), want), (M, wrong.__name__)
    assert not same_bits(dequantize_table_by_adds(w), dequantize(w))
    assert not same_bits(dequantize_table_toward_zero(w), dequantize(w))
