"""gemm_bq: the order "bq32" over GGUF Q8_0 / Q4_1 weights, every path bit-equal to the model.

Every available path ("c", "avx2", "avx512", and the emulated "emu-avx512" / "emu-amx": the AMX
code run through lmtail_emulate.h's tile model) equals reference.quant.gemm_bq_emulation (the
declaration modelled one rounding at a time, FTZ/DAZ explicit) on bit views: odd shapes, seeds,
special values, 1 / 2 threads, a row alone or in a batch. The split's bytes equal the model's
bit-level split on every path; one block of Q8_0 with d = 1 equals the amx32 order on the
parts (an independent model); planted wrong variants go red; the results lie inside the
declared float64 range; the public boundary raises ValueError naming the argument.

Shape legend: M rows, K summed axis (32 NB), N output columns; a [M, K] fp32; out [M, N].
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtail.kernels import cpu
from lmtail.kernels.quant import gemm_bq as bq
from lmtail.kernels.quant.gemm_q import BLOCK_BYTES, FORMATS, QuantWeight
from lmtail.reference import quant as rq
from lmtail.reference.gemm import gemm_amx32_emulation

pytestmark = pytest.mark.skipif(bq.native_library() is None, reason="gemm_bq's C kernel could not be built")
PATHS = bq.GEMM_BQ.names(emulated=True)
SHAPES = [(1, 37, 32), (3, 16, 96), (16, 50, 576), (17, 33, 2880), (4, 7, 1568)]  # (M, N, K)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int32)


def data(m, n, k, seed, fmt, *, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * scale
    w = QuantWeight.quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    return a, w


def specials(a: torch.Tensor, w: QuantWeight, seed: int):
    """NaN, +-inf, +-0, fp32 subnormals and tiny normals in a; fp16-subnormal d (and m) and an
    inf d in w (bytes written directly)."""
    g = torch.Generator().manual_seed(seed)
    a = a.clone()
    spec = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -3e-39, 1.5e-38, 2e-36])
    hit = torch.rand(a.shape, generator=g) < 0.03
    a = torch.where(hit, spec[torch.randint(len(spec), a.shape, generator=g)], a)
    a[-1] *= 2.0**-100  # a row whose parts p1, p2 underflow
    N, K = w.shape
    blk = w.data.clone().view(N, K // 32, BLOCK_BYTES[w.fmt])  # [N, NB, BS]
    blk[0, 0, 0:2] = torch.tensor([1, 0x80], dtype=torch.uint8)  # d = -2^-24 (fp16 subnormal)
    blk[1 % N, -1, 0:2] = torch.tensor([0xFF, 0x03], dtype=torch.uint8)  # the largest fp16 subnormal
    blk[2 % N, 0, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # d = +inf
    if w.fmt == "Q4_1":
        blk[3 % N, 0, 2:4] = torch.tensor([7, 0x83], dtype=torch.uint8)  # m: fp16 subnormal
    return a, QuantWeight(w.fmt, w.shape, blk.reshape(w.data.shape))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_path_equals_the_model(fmt, shape):
    for seed in (1, 2, 3):
        a, w = data(*shape, seed=100 * seed + shape[2], fmt=fmt)
        want = bits(rq.gemm_bq_emulation(a.numpy(), w))
        wp = bq.pack_bq(w)
        for name in PATHS:
            assert torch.equal(bits(bq.gemm_bq(a, wp, backend=name, threads=1)), want), (name, seed)


@pytest.mark.parametrize("fmt", FORMATS)
def test_special_values_on_every_path(fmt):
    for seed, (m, n, k) in enumerate([(5, 21, 96), (17, 18, 320)]):
        a, w = specials(*data(m, n, k, 40 + seed, fmt), seed)
        want = bits(rq.gemm_bq_emulation(a.numpy(), w))
        wp = bq.pack_bq(w)
        assert torch.isnan(rq.gemm_bq_emulation(a.numpy(), w)).any()
        for name in PATHS:
            assert torch.equal(bits(bq.gemm_bq(a, wp, backend=name, threads=2)), want), (name, seed)


def test_tiny_products_flush_as_declared():
    """Activations near 2^-124 (parts p1, p2 flushed, scale steps at the FTZ edge): every path
    == the model, and the model flushes results whose exact value is a nonzero subnormal."""
    for fmt in FORMATS:
        a, w = data(4, 19, 256, 7, fmt, scale=2.0**-124)
        want = rq.gemm_bq_emulation(a.numpy(), w)
        wp = bq.pack_bq(w)
        for name in PATHS:
            assert torch.equal(bits(bq.gemm_bq(a, wp, backend=name)), bits(want)), name
        exact = rq.gemm_bq_f64(a.numpy(), w)
        assert ((want.numpy() == 0) & (np.abs(exact) > 2.0**-140)).sum() > 3


def test_the_split_is_exact_and_the_same_on_every_path():
    g = torch.Generator().manual_seed(5)
    a = torch.randn(6, 128, generator=g) * torch.tensor(10.0) ** torch.randint(-40, 38, (6, 128), generator=g)
    a, _ = specials(a, QuantWeight.quantize(torch.zeros(16, 128), "Q8_0"), 5)
    want = rq.bq_split(a.numpy())  # [3, M, K]
    for name in PATHS:
        parts, s = bq.bq_split(a, backend=name)
        assert np.array_equal(parts.numpy().transpose(1, 0, 2).view(np.uint32), want.view(np.uint32)), name
        assert np.array_equal(s.numpy().view(np.uint32), rq.bq_row_sums(a.numpy()).view(np.uint32)), name
    # exact: the three parts add up to a wherever a and its parts are normal
    a64, p64 = a.double().numpy(), want.astype(np.float64)
    ok = np.isfinite(a64) & (np.abs(a64) > 2.0**-100)
    assert np.array_equal(p64.sum(axis=0)[ok], a64[ok])
    # planted: a 2-part split loses a's low bits
    two = rq.bq_split(a.numpy(), 2).astype(np.float64).sum(axis=0)
    assert (two[ok] != a64[ok]).sum() > ok.sum() // 2


def test_one_block_is_amx32_on_the_parts():
    """Independent model: for K = 32, Q8_0 with d = 1, bq32's c = amx32's acc over 96 lanes
    [p0 | p1 | p2] x [q; q; q] (three 32-lane blocks, acc = acc + (e + o)), and y = fma(1, c, 0)."""
    g = torch.Generator().manual_seed(9)
    a = torch.randn(5, 32, generator=g) * 3
    q = torch.randint(-127, 128, (11, 32), generator=g, dtype=torch.int8)
    blk = torch.cat((torch.tensor([0x00, 0x3C], dtype=torch.uint8).expand(11, 2), q.view(torch.uint8)), dim=1)
    w = QuantWeight("Q8_0", (11, 32), blk.contiguous())
    p = rq.bq_split(a.numpy())  # [3, M, 32]
    parts = torch.from_numpy(np.concatenate(list(p), axis=1)).to(torch.bfloat16)  # exact: bf16 values
    want = gemm_amx32_emulation(parts, q.float().t().repeat(3, 1).to(torch.bfloat16))
    got = bq.gemm_bq(a, bq.pack_bq(w), backend="c")
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(rq.gemm_bq_emulation(a.numpy(), w)), bits(want))


@pytest.mark.parametrize("fmt", FORMATS)
def test_planted_variants_go_red(fmt):
    a, w = data(6, 40, 576, 11, fmt)
    got = bits(bq.gemm_bq(a, bq.pack_bq(w)))
    assert torch.equal(got, bits(rq.gemm_bq_emulation(a.numpy(), w)))
    for defect in (dict(parts=2), dict(pair_sum_last=True), dict(d_rounded=True)):
        assert (bits(rq.gemm_bq_emulation(a.numpy(), w, **defect)) != got).sum() > 20, defect


@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_and_rows_do_not_change_a_byte(fmt):
    a, w = data(33, 70, 320, 21, fmt)
    wp = bq.pack_bq(w)
    for name in PATHS:
        full = bits(bq.gemm_bq(a, wp, backend=name, threads=1))
        assert torch.equal(bits(bq.gemm_bq(a, wp, backend=name, threads=2)), full), name
        for r0, r1 in ((0, 1), (5, 6), (3, 20), (16, 33), (0, 17)):
            assert torch.equal(bits(bq.gemm_bq(a[r0:r1], wp, backend=name, threads=2)), full[r0:r1]), (name, r0, r1)
        assert torch.equal(bits(bq.gemm_bq(a.flip(0), wp, backend=name)), full.flip(0)), name
    out = torch.full((33, 80), 7.0)
    bq.gemm_bq(a, wp, out=out[:, 5:75])
    assert torch.equal(bits(out[:, 5:75]), full) and (out[:, :5] == 7).all() and (out[:, 75:] == 7).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_inside_the_declared_float64_range(fmt):
    """Faithfulness: |bq32 - exact float64 dot| <= gamma(depth) sum|terms| + the flush terms
    (reference.quant.gemm_bq_range over the declaration); the worst ratio to sum|a w| is far
    inside gamma(depth). Planted: a 2-part split leaves the range on activations whose p2 is
    as large as it gets (every mantissa bit set) over positive weights."""
    for seed, (m, n, k) in enumerate([(8, 64, 576), (4, 48, 1536), (3, 20, 2880)]):
        a, w = data(m, n, k, 60 + seed, fmt)
        decl = bq.gemm_bq_decl(k, fmt)
        lo, hi = rq.gemm_bq_range(a.numpy(), w, decl)
        y = bq.gemm_bq(a, bq.pack_bq(w)).double().numpy()
        assert ((y >= lo) & (y <= hi)).all()
        exact = rq.gemm_bq_f64(a.numpy(), w)
        mag = np.abs(a.double().numpy()) @ np.abs(rq.bq_values_f64(w)).T
        ratio = (np.abs(y - exact) / mag).max()
        assert ratio < decl.sum("gemm").bound() / 4, ratio
    a = torch.full((2, 576), 2 - 2.0**-23) * 2.0 ** torch.randint(-3, 3, (2, 576)).float()
    w = QuantWeight.quantize(torch.rand(5, 576) + 0.1, fmt)
    lo, hi = rq.gemm_bq_range(a.numpy(), w, bq.gemm_bq_decl(576, fmt))
    y = bq.gemm_bq(a, bq.pack_bq(w)).double().numpy()
    two = rq.gemm_bq_emulation(a.numpy(), w, parts=2).double().numpy()
    assert ((y >= lo) & (y <= hi)).all() and not ((two >= lo) & (two <= hi)).any()


def test_declaration_depths_and_a_shallower_one_is_too_narrow():
    assert bq.gemm_bq_decl(576, "Q8_0").sum("gemm").depth == 20 + 18
    assert bq.gemm_bq_decl(576, "Q4_1").sum("gemm").depth == 20 + 36
    assert bq.gemm_bq_decl(64, "Q4_1").sum("gemm").roundings == 206 * 2
    assert bq.gemm_bq_decl(64, "Q8_0").sum("gemm").flush


def test_pack_layout_and_memory():
    for fmt in FORMATS:
        a, w = data(1, 37, 96, 3, fmt)
        p = bq.pack_bq(w)
        d, m, q = rq.bq_fields(w)
        qt = p.q.float().numpy()  # [Ng, NB, 16, 32]
        for n, b, k in ((0, 0, 0), (17, 2, 31), (36, 1, 6), (20, 0, 13)):
            assert qt[n // 16, b, k // 2, 2 * (n % 16) + k % 2] == q[n, b, k]
            assert p.d[n // 16, b, n % 16].item() == d[n, b]
            if fmt == "Q4_1":
                assert p.m[n // 16, b, n % 16].item() == m[n, b]
        assert (qt[2, :, :, 2 * 5:] == 0).all() and (p.d[2, :, 5:] == 0).all()  # columns past N
        per_weight = 2 + 4 / 32 + (4 / 32 if fmt == "Q4_1" else 0)
        assert p.nbytes == 48 * 96 * per_weight


def test_amx_is_offered_only_with_the_cpu_and_os_permission():
    assert ("amx" in bq.available_backends()) == cpu.has("avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_bf16")
    assert "emu-amx" not in bq.available_backends()
    assert bq.GEMM_BQ.pick(None, rows=16).name in bq.available_backends()


@pytest.mark.skipif(shutil.which("gcc") is None, reason="no gcc to compile with")
def test_every_ldtilecfg_reads_the_whole_declared_config(tmp_path):
    import test_amx_config as tc

    asm = tc.assemble(Path(bq.__file__).with_name("gemm_bq.c"), tmp_path)
    assert len(tc.ldtilecfg_operands(asm)) >= 1
    assert tc.config_problems(asm) == []
    assert re.search(r"tdpbf16ps", asm)


def test_errors_name_the_argument():
    a, w = data(2, 16, 64, 1, "Q4_1")
    wp = bq.pack_bq(w)
    with pytest.raises(ValueError, match=r"a must be a 2-D torch.float32"):
        bq.gemm_bq(a.double(), wp)
    with pytest.raises(ValueError, match=r"K mismatch"):
        bq.gemm_bq(torch.zeros(2, 32), wp)
    with pytest.raises(ValueError, match=r"w must be a BqPacked \(pack_bq"):
        bq.gemm_bq(a, w)
    with pytest.raises(ValueError, match=r"out must be a torch.float32 \[M, N\]"):
        bq.gemm_bq(a, wp, out=torch.zeros(2, 15))
    with pytest.raises(ValueError, match=r"backend must be one of"):
        bq.gemm_bq(a, wp, backend="gpu")
    with pytest.raises(ValueError, match=r"threads must be"):
        bq.gemm_bq(a, wp, threads=0)
    with pytest.raises(ValueError, match=r"w must be a QuantWeight"):
        bq.pack_bq(torch.zeros(16, 64))
    with pytest.raises(ValueError, match=r"BqPacked.q must be a contiguous CPU torch.bfloat16"):
        bq.BqPacked("Q4_1", (16, 64), wp.q[:, :1].contiguous(), wp.d, wp.m)
    with pytest.raises(ValueError, match=r"BqPacked.m must be None for Q8_0"):
        bq.BqPacked("Q8_0", (16, 64), wp.q, wp.d, wp.m)
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 32"):
        bq.gemm_bq_decl(48, "Q8_0")
    with pytest.raises(ValueError, match=r"fmt must be one of"):
        bq.gemm_bq_decl(64, "Q4_0")
    out = torch.full((2, 16), 3.0)
    with pytest.raises(ValueError, match=r"K mismatch"):
        bq.gemm_bq(torch.zeros(2, 32), wp, out=out)
    assert (out == 3).all()  # bad input writes nothing


def test_contract_variants_without_defect_are_the_real_op():
    """gemm_bq's contract kind: the emulation and its control body with no switch planted give
    the op's bytes in both formats, the bound data's weights are the values it states, and the
    range comes from gemm_bq_decl (a half-depth declaration is narrower)."""
    from lmtail.contract import harness
    from lmtail.contract import quant_kinds as qk

    for fmt in FORMATS:
        d = qk.quant_data(5, 96, 9, 3, fmt=fmt)
        real = qk.run_gemm_bq(d)
        assert not harness.diff_outputs(qk.emulate_gemm_bq(d), real)
        assert not harness.diff_outputs(qk.bq_variant(d), real)
        assert harness.diff_outputs(qk.bq_variant(d, parts=2), real)
        assert qk.bq_decl_of(d) == bq.gemm_bq_decl(96, fmt)
        assert qk.bq_shallow_decl(d).sum("gemm").depth == bq.gemm_bq_decl(96, fmt).sum("gemm").depth // 2
        w = qk.bq_at_bound(fmt, nb=2)["w"]
        assert np.array_equal(rq.bq_values_f64(w), np.full((3, 64), 1.0 if fmt == "Q8_0" else 2.0))
