"""gemm_dp32.c's VDPBF16PS path for M > 6 rows on a packed weight and M > 32 on a plain one
(dpb_*: 64-column tiles, chunks of 512 lanes, row tiles of 3 with the block sums kept in
registers, the next chunk prefetched for packed weights with few row tiles): bit-equal to
reference.gemm.gemm_dp32_emulation on odd shapes (M not a multiple of 3, H not a multiple
of 32 or 256, V cutting a 64-column tile), several seeds, NaN / inf / subnormal inputs, both
layouts, 1..3 threads; a planted wrong order (even lane first) is told apart on each shape.

Shape legend: a [M, H] bf16, w [H, V] bf16 (C-contiguous), out [M, V] fp32. Byte equality
on int32 views. Runs on the instruction where the CPU has AVX512-BF16, else on the emulated
build ("emu-avx512bf16"), and skips only without both.
"""
from __future__ import annotations

import pytest
from conftest import native_or_emulated, same_bits
from test_dp32 import NO_BF16, rand_data, special_data, underflow_data

from lmtail.kernels.gemm import bf16 as G
from lmtail.kernels.gemm.bf16 import gemm_bf16, pack_weight
from lmtail.reference import gemm as R

# (M, H, V): 7..128 rows (3k, 3k+1, 3k+2), H = 61 (one masked block), 257 / 300 (one
# partial chunk), 600 / 1100 (a second / third chunk that is partial); V cutting a tile, one
# tile, several tiles
DPB_SHAPES = [(7, 61, 65), (8, 300, 129), (10, 257, 64), (33, 600, 200), (34, 61, 1),
              (47, 1100, 130), (128, 257, 70)]


@pytest.mark.parametrize("shape", DPB_SHAPES)
def test_dpb_matches_emulation(shape):
    bf16 = native_or_emulated(G.GEMM["dp32"], "avx512bf16", NO_BF16)
    for seed, maker in ((0, rand_data), (1, rand_data), (2, special_data), (3, underflow_data)):
        a, w = maker(*shape, 80 + seed)
        want = R.gemm_dp32_emulation(a, w)
        for ww in (w, pack_weight(w)):
            for t in (1, 2, 3):
                got = gemm_bf16(a, ww, order="dp32", backend=bf16, threads=t)
                assert same_bits(got, want), (shape, seed, t, type(ww).__name__)
    assert not same_bits(R.gemm_dp32_emulation(a, w, even_first=True), want), shape


def test_dpb_rows_do_not_depend_on_the_batch():
    """A row's bytes are the same alone (M <= 6: the other paths), in a batch of 20 (packed:
    dpb; plain: dp_strip) and of 40 (both dpb), with the row in each row-tile position."""
    bf16 = native_or_emulated(G.GEMM["dp32"], "avx512bf16", NO_BF16)
    a, w = special_data(40, 300, 150, 90, p=0.01)
    for ww in (w, pack_weight(w)):
        full = gemm_bf16(a, ww, order="dp32", backend=bf16)
        assert same_bits(full, R.gemm_dp32_emulation(a, w))
        for m0, m1 in ((0, 1), (5, 8), (0, 20), (17, 37), (13, 40)):
            assert same_bits(gemm_bf16(a[m0:m1], ww, order="dp32", backend=bf16), full[m0:m1]), (m0, m1)
