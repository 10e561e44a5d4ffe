"""The AMX path's VNNI tiles of a plain weight (gemm_amx32.c vnni_tile_512, AVX-512BW) are
the bytes of pack_weight's layout for the same columns: pairs of rows interleaved, DAZ on
every element, zeros past H and past the tile's columns. Runs natively on any AVX-512BW CPU
(the AMX GEMM itself runs natively on AMX CPUs and emulated elsewhere: tests/test_emulated.py).
Planted: an expectation without DAZ, and one a column off, each differ on these inputs."""
from __future__ import annotations

import pytest
import torch

from lmtail.kernels import cpu
from lmtail.kernels.gemm import bf16 as gemm

pytestmark = pytest.mark.skipif(not cpu.has("avx512f", "avx512bw", "avx512vl"),
                                reason=cpu.missing("avx512f", "avx512bw", "avx512vl"))


def tile(w: torch.Tensor, c0: int, nc: int) -> torch.Tensor:
    """vnni_tile_512's output [Kp/2, 64] int16 for columns c0..c0+nc of w [H, V] bf16."""
    H, V = w.shape
    kp = 32 * -(-H // 32)
    out = torch.full((kp // 2, 64), 0x5555, dtype=torch.int16)  # garbage: every byte written
    rc = gemm._amx32_library().lmtail_amx32_vnni_tile(w.data_ptr(), V, H, c0, nc, out.data_ptr())
    assert rc == 0
    return out


def expected(w: torch.Tensor, c0: int, nc: int) -> torch.Tensor:
    """pack_weight's columns c0..c0+31 (zero past nc) as [Kp/2, 64] int16."""
    packed = gemm.pack_weight(w).data.view(torch.int16)  # [Kp/2, 2 Vp]
    cols = packed[:, 2 * c0:2 * c0 + 64].clone()
    cols[:, 2 * nc:] = 0
    return cols


def weight(H: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(H, V, generator=g) * 0.1).to(torch.bfloat16)
    bits = w.view(torch.int16)
    bits[::3, ::5] = 0x0001  # the smallest positive subnormal
    bits[1::7, 2::3] = -0x7FFF  # 0x8001: a negative subnormal
    w[1, 2], w[-1, -1] = float("nan"), float("-inf")
    return w


@pytest.mark.parametrize("H, V, seed", [(64, 77, 0), (100, 64, 1), (33, 40, 2), (2880, 96, 3)])
def test_vnni_tile_equals_pack_weight_columns(H, V, seed):
    w = weight(H, V, seed)
    for c0 in range(0, V, 32):
        nc = min(32, V - c0)
        assert torch.equal(tile(w, c0, nc), expected(w, c0, nc)), (c0, nc)


def test_planted_expectations_differ():
    w = weight(64, 77, 5)
    got = tile(w, 32, 32)
    raw = w.view(torch.int16)
    undaz = torch.stack([raw[0::2, 32:64], raw[1::2, 32:64]], dim=-1).reshape(32, 64)
    assert not torch.equal(got, undaz), "the inputs have subnormals: DAZ must show"
    assert not torch.equal(got, expected(w, 33, 32)), "a column off must show"
    assert torch.equal(got, expected(w, 32, 32))
