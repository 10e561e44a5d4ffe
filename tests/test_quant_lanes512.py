"""gemm_q's AVX-512 lanes path (gemm_q.c's lanes_unit_512, M >= 16 on the avx512 backend):
the declared lanes32 order bit for bit against the plain C backend and the torch emulation.
Shape legend: a [M, K] fp32, w QuantWeight (N, K) (K a multiple of 32), out [M, N] fp32.

The path's own edges: quads of rows (M not a multiple of 4: zero rows never stored), tiles of
48 columns in groups of 16 (N not a multiple of 16 or 48: zero columns past the unit, masked
stores), units of 1..4 tiles over 1..3 threads (each tile prefetching the next 48 columns'
rows, past the unit's end too), the panel dequantized across 16 columns (fp16 d and m
subnormal, Q4_1 values that round), the boundary M = 15 (rows passes) / 16 (this path), and
lmtail_gemm_q_cat's columns from several weights inside one group of 16.
Byte equality on int32 views. Planted: the blocks summed in reverse, 16 lanes, a panel whose
columns are swapped inside a group of 16: each must differ.
"""
from __future__ import annotations

import pytest
import torch

from conftest import same_bits
from lmtail.kernels.quant import gemm_q as Q
from lmtail.kernels.quant.gemm_q import dequantize, gemm_q, lanes_emulation
from test_quant import (_gemm_q_cat, rand_a, rand_weight, rounding_q4_1_weight, special_a,
                        subnormal_weight)

LANES512 = "avx512" in Q.available_backends()
EMULATED = "emu-avx512" in Q.GEMM_Q.names(emulated=True)
SEEDS = (0, 1, 2)
# (M, N, K): M = 16 (the decode batch), 17..67 odd, 64; N odd, below one group, between
# groups and tiles, several units; K = 32 (one block), 32 x odd, 576 and 1536.
SHAPES = [(16, 577, 576), (16, 49, 1536), (17, 47, 32), (19, 1, 96), (23, 15, 576), (31, 97, 800),
          (33, 193, 224), (64, 50, 576), (67, 211, 160), (16, 16, 96), (20, 48, 1536)]


def need_avx512():
    if not LANES512:
        pytest.skip("this CPU has no avx512 backend: the emulated test below covers the path")


def reversed_blocks_emulation(a: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """Planted: lanes32 with the blocks summed last to first (each lane's chain reversed)."""
    K = a.shape[1]
    idx = torch.arange(K).view(K // 32, 32).flip(0).reshape(-1)
    return lanes_emulation(a[:, idx], wv[:, idx])


def swapped_columns_emulation(a: torch.Tensor, wv: torch.Tensor) -> torch.Tensor:
    """Planted: columns 0 and 1 of every group of 16 exchanged (a panel transposed wrongly)."""
    N = wv.shape[0]
    idx = torch.arange(N)
    for g in range(0, N - 1, 16):
        idx[g], idx[g + 1] = g + 1, g
    return lanes_emulation(a, wv[idx])


@pytest.mark.parametrize("fmt", Q.FORMATS)
@pytest.mark.parametrize("seed", SEEDS)
def test_lanes512_bit_equal_to_plain_c(fmt, seed):
    """avx512 == c == the torch emulation on the path's shapes, threads 1..3, with NaN, inf,
    signed zeros and subnormals among the activations, lda = K + 7; out's columns past N are
    not written."""
    need_avx512()
    for i, (M, N, K) in enumerate(SHAPES):
        w = rand_weight(N, K, fmt, 100 * seed + i)
        a = special_a(M, K + 7, 100 * seed + i)[:, :K]
        want = gemm_q(a, w, backend="c", threads=1)
        if i < 4:  # the C backend on the small shapes: the declared order itself
            assert same_bits(want, lanes_emulation(a, dequantize(w))), (M, N, K)
        for th in (1, 2, 3):
            buf = torch.full((M, N + 5), 7.0)
            gemm_q(a, w, out=buf[:, :N], backend="avx512", threads=th)
            assert same_bits(buf[:, :N], want), (M, N, K, th)
            assert bool((buf[:, N:] == 7).all()), (M, N, K, th)


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_lanes512_format_edges(fmt):
    """Subnormal fp16 d and m (the panel's vcvtph2ps across 16 columns) and, Q4_1, values
    fl32(d*q + m) that round: avx512 == the emulation at M = 16 and 21, threads 1 and 2."""
    need_avx512()
    weights = [subnormal_weight(53, 576, fmt, 7)]
    if fmt == "Q4_1":
        weights.append(rounding_q4_1_weight(53, 576, 8))
    for w in weights:
        for M in (16, 21):
            a = rand_a(M, 576, M)
            want = lanes_emulation(a, dequantize(w))
            for th in (1, 2):
                assert same_bits(gemm_q(a, w, backend="avx512", threads=th), want), (M, th)


def test_lanes512_boundary_and_batch_invariance():
    """A row's bytes do not depend on M across the switch to the path (M = 15 rows passes,
    16 and 40 this path) nor on the other rows."""
    need_avx512()
    for fmt in Q.FORMATS:
        w = rand_weight(131, 576, fmt, 3)
        a = rand_a(40, 576, 3)
        full = gemm_q(a, w, backend="avx512")
        for M in (1, 15, 16, 17):
            assert same_bits(gemm_q(a[:M], w, backend="avx512"), full[:M]), (fmt, M)
        assert same_bits(gemm_q(a[13:29], w, backend="avx512"), full[13:29]), fmt


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_lanes512_cat_columns_of_several_weights(fmt):
    """lmtail_gemm_q_cat at M = 16 over 3 weights of 5, 27 and 40 rows (a group of 16
    columns takes rows of two weights) == one gemm_q call per weight, threads 1..3."""
    need_avx512()
    ws = [rand_weight(n, 576, fmt, 40 + n) for n in (5, 27, 40)]
    a = rand_a(16, 576, 4)
    want = torch.cat([gemm_q(a, w, backend="c") for w in ws], dim=1)
    for th in (1, 2, 3):
        assert same_bits(_gemm_q_cat(a, ws, "avx512", th), want), th


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_lanes512_planted_variants_are_told_apart(fmt):
    """The path's output equals the declared order and differs from the planted ones."""
    M, N, K = 16, 48, 576
    w, a = rand_weight(N, K, fmt, 9), rand_a(M, K, 9)
    want = lanes_emulation(a, dequantize(w))
    if LANES512:
        assert same_bits(gemm_q(a, w, backend="avx512"), want)
    wv = dequantize(w)
    assert not same_bits(reversed_blocks_emulation(a, wv), want)
    assert not same_bits(lanes_emulation(a, wv, lanes=16), want)
    assert not same_bits(swapped_columns_emulation(a, wv), want)


@pytest.mark.skipif(not EMULATED, reason="no SIMDe: the emulated avx512 build is not there")
@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_lanes512_emulated_build_bit_equal(fmt):
    """The SIMDe build of the path (what an AVX2-only machine tests in its place) == the
    plain C backend on small shapes of the path, threads 1 and 2."""
    for i, (M, N, K) in enumerate([(16, 49, 96), (19, 17, 160), (16, 33, 32)]):
        w, a = subnormal_weight(N, K, fmt, 60 + i), special_a(M, K, 60 + i)
        want = gemm_q(a, w, backend="c")
        for th in (1, 2):
            assert same_bits(gemm_q(a, w, backend="emu-avx512", threads=th), want), (M, N, K, th)
