"""The emulated builds: every hardware path of every C kernel, compiled once more against
SIMDe with lmtail_emulate.h's exact VDPBF16PS and AMX tile models (kernels/_cc.py's emulated
variant, the "emu-<isa>" backend rows), is bit-equal to the plain-C path on the format's
edge values, on any x86-64 CPU with AVX2 + FMA + F16C. Run here even where the CPU has the
ISA: that proves the emulated build exact, so an AVX2-only CI box's emulated runs mean what
native runs mean.

Shape legend: a [M, H] bf16 / fp32, w [H, V] bf16 (GEMM), wq [N, K] Q8_0 / Q4_1 blocks,
rows [R, V] (tails). Small shapes that cover the tails: M = 1, 4, 33; H = 64, 100;
V = 77, 1024. Byte equality on bit views, never allclose.

Edge values: bf16 / fp32 subnormals, +-0, +-inf, NaN where the op accepts them; products
around fp32's smallest normal (FTZ / DAZ decide there); Q8_0 / Q4_1 blocks whose fp16 d and
m are subnormal (compared with the torch emulation, whose fp16 -> fp32 is torch's own, so a
C half_to_f32 that mis-scaled subnormals goes red).
Planted: the AMX model aborts on a bad tile config (palette 0, rows 17; in a child process:
it aborts as the hardware faults), and a VDPBF16PS model with the even pair first goes red.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import same_bits

from lmtail.kernels import _cc, cpu
from lmtail.kernels.model import body as kbody
from lmtail.kernels.glue import fmachain as FC
from lmtail.kernels.gemm import bf16 as G
from lmtail.kernels.quant import gemm_q as Q
from lmtail.kernels.tail import rowmass as RM
from lmtail.kernels.tail import rows_tail as RT
from lmtail.kernels.tail import shard_partials as SP
from lmtail.model import body as decl
from lmtail.orders import Order, contiguous, strided

KERNELS = Path(_cc.__file__).parent
pytestmark = pytest.mark.skipif(not cpu.emulation_runs() or "c" not in G.GEMM["amx32"].names(),
                                reason="no emulated builds here: SIMDe (pip install cmeel-simde), a "
                                       "C compiler and a CPU with AVX2, FMA, F16C are needed")


def emulated(table) -> tuple[str, ...]:
    return tuple(n for n in table.names(emulated=True) if n.startswith("emu-"))


# ---------------------------------------------------------------------------------------
# data: edge values
# ---------------------------------------------------------------------------------------
def sprinkle(x: torch.Tensor, gen, *, p=0.04, nonfinite=True) -> torch.Tensor:
    """x (bf16 or fp32) with a fraction p of lanes each made a subnormal, a signed zero, and
    (nonfinite) +-inf and NaN (rarer: p / 8)."""
    x = x.clone()
    flat = x.view(-1)
    ib = flat.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)
    mbits = 7 if x.dtype == torch.bfloat16 else 23
    sign = torch.tensor(-(2 ** (15 if x.dtype == torch.bfloat16 else 31)), dtype=ib.dtype)
    r = torch.rand(flat.numel(), generator=gen)
    sub = torch.randint(1, 2**mbits, (flat.numel(),), generator=gen).to(ib.dtype)
    neg = torch.rand(flat.numel(), generator=gen) < 0.5
    sub = torch.where(neg, sub | sign, sub)
    ib[:] = torch.where(r < p, sub, ib)
    zero = (r >= p) & (r < 2 * p)
    flat[zero] = torch.where(neg, -0.0, 0.0).to(x.dtype)[zero]
    if nonfinite:
        q = p / 8
        flat[(r >= 2 * p) & (r < 2 * p + q)] = float("inf")
        flat[(r >= 2 * p + q) & (r < 2 * p + 2 * q)] = float("-inf")
        flat[(r >= 2 * p + 2 * q) & (r < 2 * p + 3 * q)] = float("nan")
    return x


def gemm_data(M, H, V, seed, kind):
    """a [M, H], w [H, V] bf16. kind "special": subnormals, zeros, a few inf / NaN (in the
    last rows and columns only, so most results stay finite); "underflow": products around
    2^-126, where DAZ / FTZ decide."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, H, generator=g)
    w = torch.randn(H, V, generator=g) * 0.05
    if kind == "underflow":
        return (a * 2.0**-62).bfloat16(), (w * 2.0**-60).bfloat16()
    a, w = sprinkle(a.bfloat16(), g, nonfinite=False), sprinkle(w.bfloat16(), g, nonfinite=False)
    a[-1, :2] = torch.tensor([float("nan"), float("inf")])  # the last row: NaN results
    w[2, -1], w[5, -2] = float("-inf"), float("nan")  # the last two columns: inf / NaN
    return a, w


GEMM_SHAPES = [(1, 64, 1024), (1, 100, 77), (4, 100, 1024), (33, 100, 77), (33, 64, 1024)]


# ---------------------------------------------------------------------------------------
# the GEMMs: chain, amx32, dp32
# ---------------------------------------------------------------------------------------
def test_every_hardware_path_has_an_emulated_row():
    """The tables list an emulated row for each hardware path (never chosen by default)."""
    want = {"chain": {"emu-avx512"}, "amx32": {"emu-amx", "emu-avx512", "emu-avx2"},
            "dp32": {"emu-avx512bf16", "emu-avx512"}}
    for order, names in want.items():
        assert set(emulated(G.GEMM[order])) == names, order
        assert not G.GEMM[order].pick(None).name.startswith("emu-")
        assert not set(G.available_backends(order)) & names
    for table in (Q.GEMM_Q, RT.ROWS_TAIL, SP.SHARD_PARTIALS, RM.ROW_MASS, RM.TERMS, FC.FMA_SUM,
                  FC.MOE_ROUTED, decl.EXP32, decl.SILU_MUL, decl.ATTEND):
        assert emulated(table) == ("emu-avx512",), table.op


@pytest.mark.parametrize("order", G.ORDERS)
@pytest.mark.parametrize("kind", ["special", "underflow"])
def test_gemm_emulated_rows_equal_c(order, kind):
    """Every emulated GEMM row == "c" bit for bit: plain and packed weight, 1 and 2 threads."""
    names = emulated(G.GEMM[order])
    flushed = set()
    for i, (M, H, V) in enumerate(GEMM_SHAPES):
        a, w = gemm_data(M, H, V, i, kind)
        want = G.gemm_bf16(a, w, order=order, backend="c")
        ws = (w,) if order == "chain" else (w, G.pack_weight(w))
        for b in names:
            for ww in ws:
                for t in (1, 2):
                    got = G.gemm_bf16(a, ww, order=order, backend=b, threads=t)
                    assert same_bits(got, want), (order, kind, b, (M, H, V), t, type(ww).__name__)
        bits = want.view(torch.int32)
        flushed |= {int(b) for b in bits[(bits == 0) | (bits == -2**31)].unique()}
        if kind == "special" and M > 1:
            assert bool(torch.isnan(want).any() and torch.isfinite(want).any())
    if kind == "underflow" and order != "chain":  # FTZ decided some: zeros of both signs
        assert flushed == {0, -2**31}
    if kind == "underflow" and order == "chain":  # IEEE: subnormal results, kept
        assert bool((((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)).any())


# ---------------------------------------------------------------------------------------
# gemm_q: Q8_0 / Q4_1 blocks with subnormal fp16 d and m
# ---------------------------------------------------------------------------------------
def _halves(n, gen):
    """n fp16 bit patterns: a third subnormal (either sign), some zeros, the rest normal."""
    kind = torch.randint(0, 6, (n,), generator=gen)
    sub = torch.randint(1, 0x400, (n,), generator=gen)
    normal = torch.randint(0x2000, 0x3400, (n,), generator=gen)  # ~ 2^-7 .. 0.25
    h = torch.where(kind < 2, sub, normal)
    h = torch.where(kind == 2, torch.zeros_like(h), h)
    h = torch.where(torch.rand(n, generator=gen) < 0.5, h | 0x8000, h)
    return h.to(torch.int16).view(torch.uint8).view(n, 2)


def quant_weight(fmt, N, K, seed):
    g = torch.Generator().manual_seed(seed)
    nb = K // Q.QK
    blocks = torch.randint(0, 256, (N * nb, Q.BLOCK_BYTES[fmt]), generator=g, dtype=torch.int64).to(torch.uint8)
    blocks[:, 0:2] = _halves(N * nb, g)  # d
    if fmt == "Q4_1":
        blocks[:, 2:4] = _halves(N * nb, g)  # m
    return Q.QuantWeight(fmt, (N, K), blocks.reshape(N, nb * Q.BLOCK_BYTES[fmt]).contiguous())


@pytest.mark.parametrize("fmt", Q.FORMATS)
def test_gemm_q_subnormal_scales_every_backend(fmt):
    """Every gemm_q backend (native and emulated) == the torch emulation, bit for bit, on
    blocks whose fp16 d (and Q4_1's m) are subnormal: a C half_to_f32 that scaled a subnormal
    by half would go red here."""
    names = Q.GEMM_Q.names(emulated=True)
    assert "emu-avx512" in names
    for i, (M, N, K) in enumerate([(1, 77, 64), (4, 9, 96), (33, 77, 64), (1, 5, 32)]):
        w = quant_weight(fmt, N, K, i)
        g = torch.Generator().manual_seed(100 + i)
        a = sprinkle(torch.randn(M, K, generator=g), g, nonfinite=False)
        want = Q.gemm_q(a, w, backend="torch")
        d = w.data.view(N, -1, Q.BLOCK_BYTES[fmt])[..., 0:2].contiguous().view(torch.float16).float()
        assert bool(((d != 0) & (d.abs() < 2.0**-14)).any())  # subnormal scales are there
        for b in names:
            for t in (1, 2):
                assert same_bits(Q.gemm_q(a, w, backend=b, threads=t), want), (fmt, b, (M, N, K), t)


def test_gemm_q_planted_half_scale_goes_red():
    """The check above can fail: a weight whose subnormal d is halved gives other bytes."""
    w = quant_weight("Q8_0", 77, 64, 0)
    a = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    d = w.data.view(77, -1, 34)[..., 0:2].contiguous().view(torch.int16)
    sub = (d & 0x7C00) == 0
    halved = torch.where(sub, (d & -0x8000) | ((d & 0x3FF) >> 1), d)
    data = w.data.clone().view(77, -1, 34)
    data[..., 0:2] = halved.view(torch.uint8).view(77, -1, 2)
    planted = Q.QuantWeight("Q8_0", (77, 64), data.reshape(77, -1).contiguous())
    assert not same_bits(Q.gemm_q(a, planted, backend="c"), Q.gemm_q(a, w, backend="torch"))


# ---------------------------------------------------------------------------------------
# the tails: rows_tail, shard_partials, row_mass, shifted_exp_terms
# ---------------------------------------------------------------------------------------
SP_TABLE = [(50, 0.9, 0.8, 0.37, 0.0), (0, 0.95, 1.0, 0.5, 0.0), (1, 1.0, 1.0, 0.0, 0.0),
            (0, 1.0, 0.5, 0.1, 0.05), (7, 0.8, 1e-5, 0.3, 0.0), (0, 0.9, 0.0, 0.9, 0.0)]


def tail_rows(R, V, seed):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(R, V, generator=g) * 3).bfloat16()
    rows[0] = sprinkle(rows[0:1], g, p=0.05)[0]  # inf, NaN, subnormal, zeros
    rows[1] = sprinkle(rows[1:2], g, p=0.1, nonfinite=False)[0]
    if R > 2:
        rows[2, : V // 2] = 1.0  # ties
    sp = torch.tensor([SP_TABLE[(seed + i) % len(SP_TABLE)] for i in range(R)], dtype=torch.float32)
    return rows, sp


def fields(out) -> dict:
    return {f: getattr(out, f) for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated",
                                         "undecided")}


@pytest.mark.parametrize("V", [77, 1024])
def test_rows_tail_emulated_equals_c(V):
    for seed, (R, k) in enumerate([(4, 1), (5, 32)]):
        rows, sp = tail_rows(R, V, seed)
        for nan_fold in (False, True):
            want = fields(RT.rows_tail_fused(rows, k=k, sampling_params=sp, nan_fold=nan_fold, backend="c"))
            for t in (1, 2):
                got = fields(RT.rows_tail_fused(rows, k=k, sampling_params=sp, nan_fold=nan_fold,
                                                backend="emu-avx512", threads=t))
                for f, x in want.items():
                    assert same_bits(got[f], x), (V, seed, nan_fold, t, f)


@pytest.mark.parametrize("V", [77, 1024])
def test_shard_partials_emulated_equals_c(V):
    g = torch.Generator().manual_seed(V)
    x = sprinkle(torch.randn(5, V, generator=g) * 4, g, p=0.03)
    x[3] = float("-inf")
    bounds = torch.tensor([0, V // 3, V // 3, V], dtype=torch.int64)
    scale_t = torch.tensor([1.0, 0.7, 0.0, 2.5, 1.3], dtype=torch.float64)
    for nan_fold in (False, True):
        for k1 in (1, 17):
            want = SP.shard_partials(x, col0=5, k1=k1, nan_fold=nan_fold, bounds=bounds, scale_t=scale_t,
                                     with_mass=True, backend="c")
            for t in (1, 2):
                got = SP.shard_partials(x, col0=5, k1=k1, nan_fold=nan_fold, bounds=bounds, scale_t=scale_t,
                                        with_mass=True, backend="emu-avx512", threads=t)
                for u, v in zip(got, want):
                    assert same_bits(u, v), (V, nan_fold, k1, t)


@pytest.mark.parametrize("V", [77, 1024])
def test_row_mass_and_terms_emulated_equal_c(V):
    g = torch.Generator().manual_seed(V)
    row = torch.randn(4, V, generator=g, dtype=torch.float64) * 30
    row[0, ::7] = float("-inf")
    row[1, ::5] = 2.0**-1060  # subnormal float64
    row[2, 3] = float("inf")
    row[3, 1::9] = float("nan")
    scale = torch.tensor([1.0, 0.5, 3.0, 1.0], dtype=torch.float64)
    want = RM.row_mass(row, scale, backend="c")
    for t in (1, 2):
        got = RM.row_mass(row, scale, backend="emu-avx512", threads=t)
        assert all(same_bits(u, v) for u, v in zip(got, want)), t
    z = torch.cat([-row[1].abs(), torch.tensor([-745.5, -746.0, -744.9, -1e300, 0.0, -(2.0**-1060)],
                                                dtype=torch.float64)])  # z <= m = 0
    assert same_bits(RM.shifted_exp_terms(z, 0.0, backend="emu-avx512"), RM.shifted_exp_terms(z, 0.0, backend="c"))


# ---------------------------------------------------------------------------------------
# fma chains, the body's exp32 / silu_mul / attention
# ---------------------------------------------------------------------------------------
def canon(x: torch.Tensor) -> torch.Tensor:
    """Bits with every NaN as 0x7FC00000 (the fma chains do not declare NaN payloads)."""
    return torch.where(torch.isnan(x), torch.tensor(float("nan")), x)


def test_fmachain_emulated_equals_c():
    g = torch.Generator().manual_seed(5)
    for n in (77, 1024):
        a = sprinkle(torch.randn(6, n, generator=g), g, p=0.03, nonfinite=False)
        a[:2] = sprinkle(a[:2], g, p=0.004)  # inf / NaN in two rows: the others stay finite
        b = sprinkle(torch.randn(6, n, generator=g), g, p=0.03, nonfinite=False)
        for o in (strided(32), contiguous(256), Order("contiguous", 64, 3)):
            want = FC.fma_sum_rows(a, b, lanes=o.lanes, vec=o.vec, reverse=o.reverse_butterfly, backend="c")
            for t in (1, 2):
                got = FC.fma_sum_rows(a, b, lanes=o.lanes, vec=o.vec, reverse=o.reverse_butterfly,
                                      backend="emu-avx512", threads=t)
                assert same_bits(canon(got), canon(want)), (n, o, t)
            assert bool(torch.isfinite(want[2:]).all()), (n, o)
    slots = sprinkle(torch.randn(5, 4, 100, generator=g), g, p=0.03)
    w = sprinkle(torch.randn(4, 5, generator=g), g, p=0.05, nonfinite=False)
    for src in (slots, slots.bfloat16()):
        assert same_bits(canon(FC.moe_routed(src, w, nslots=5, backend="emu-avx512")),
                         canon(FC.moe_routed(src, w, nslots=5, backend="c")))


def test_body_emulated_equals_c():
    g = torch.Generator().manual_seed(6)
    x = sprinkle(torch.randn(4, 77, generator=g) * 40, g, p=0.03)
    x[0, :4] = torch.tensor([88.5, -86.5, 88.0, -86.0])
    assert same_bits(decl.exp32(x, backend="emu-avx512"), decl.exp32(x, backend="c"))
    gu = sprinkle(torch.randn(5, 2 * 77, generator=g) * 8, g, p=0.03)
    assert same_bits(decl.silu_mul(gu, backend="emu-avx512"), decl.silu_mul(gu, backend="c"))
    assert same_bits(kbody.silu_mul_bf16(gu, emulated=True), kbody.silu_mul_bf16(gu))
    q = torch.randn(3, 7, 9, 64, generator=g) * 2
    kt = torch.randn(3, 3, 64, 20 + decl.SLACK, generator=g)
    v = sprinkle(torch.randn(3, 3, 20 + decl.SLACK, 64, generator=g), g, p=0.02, nonfinite=False)
    pad = torch.tensor([0, 4, 2])
    want = decl.attend(q, kt, v, pad, s0=5, scale=0.125, backend="c", threads=1)
    for t in (1, 2):
        assert same_bits(decl.attend(q, kt, v, pad, s0=5, scale=0.125, backend="emu-avx512", threads=t), want)


# ---------------------------------------------------------------------------------------
# the build itself: native 256-bit fmas, no libm, no AVX-512 instruction outside the clones
# ---------------------------------------------------------------------------------------
@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the code with")
@pytest.mark.parametrize("source", ["gemm/gemm_amx32.c", "gemm/gemm_dp32.c", "gemm/gemm_chain.c", "quant/gemm_q.c",
                                    "glue/fmachain.c", "model/body.c"])
def test_emulated_code_uses_native_avx2_fmas_and_no_libm(source):
    """SIMDe's portable fallbacks (an fma spelled a*b + c, libm's fmaf) never reach the
    emulated build: its fmas are vfmadd instructions; no call to fma / fmaf / any libm
    routine; and no zmm or mask register outside the target_clones' x86-64-v4 clones
    (ifunc-picked only on AVX-512 CPUs), so it runs on AVX2-only CPUs."""
    cc, version = _cc._compiler()
    lib = _cc.library_path(KERNELS / source, cc, version, emulated=True)
    _cc.load_c_library(KERNELS / source, emulated=True)
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "vfmadd" in asm
    fn, wide = "", []
    for ln in asm.splitlines():
        if ln.endswith(">:"):
            fn = ln.split("<", 1)[1][:-2]
        elif re.search(r"%zmm|%k[0-7]\b", ln) and "arch_x86_64_v4" not in fn:
            wide.append(fn)
        if "call" in ln:
            for libm in ("<fma@", "<fmaf@", "<exp@", "<expf@", "<log@", "<nearbyint", "<rint", "<round"):
                assert libm not in ln, (source, fn, ln.strip())
    assert not wide, sorted(set(wide))


# ---------------------------------------------------------------------------------------
# planted: the AMX model's config checks, VDPBF16PS's order
# ---------------------------------------------------------------------------------------
AMX_CONFIG_PROGRAM = r"""
#include "lmtail_kernels.h"
int main(int argc, char **argv) {
    uint8_t cfg[64] = {0};
    cfg[0] = 1;
    for (int t = 0; t < 8; ++t) { cfg[16 + 2 * t] = 64; cfg[48 + t] = 16; }
    if (argc > 2) cfg[atoi(argv[1])] = (uint8_t)atoi(argv[2]);
    _tile_loadconfig(cfg);
    _tile_zero(0);
    _tile_release();
    puts("configured");
    return 0;
}
"""


@pytest.fixture(scope="module")
def amx_config_program(tmp_path_factory):
    src = tmp_path_factory.mktemp("amxcfg") / "amxcfg.c"
    src.write_text(AMX_CONFIG_PROGRAM)
    exe = src.with_suffix("")
    cc, _ = _cc._compiler()
    extra, _ = _cc._variant(src, True)
    flags = [f for f in _cc.FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([cc, *flags, *extra, f"-I{KERNELS}", str(src), "-o", str(exe), "-lm"], check=True,
                   capture_output=True, timeout=300)
    return exe


@pytest.mark.parametrize("byte, value, field", [
    (None, None, None), (0, 0, "palette_id = 0"), (48, 17, "rows[0] = 17"), (16, 65, "colsb[0] = 65"),
    (18, 62, "colsb[1] = 62"), (5, 1, "reserved byte 5 = 1"), (56, 16, "rows[8] = 16"),
])
def test_amx_model_rejects_a_bad_config(amx_config_program, byte, value, field):
    """LDTILECFG on a bad config: the model aborts with one line naming the field (where the
    CPU raises #GP); the declared config loads. In a child process: it aborts."""
    args = [] if byte is None else [str(byte), str(value)]
    res = subprocess.run([str(amx_config_program), *args], capture_output=True, text=True, timeout=60)
    if field is None:
        assert res.returncode == 0 and res.stdout.strip() == "configured", res.stderr
        return
    assert res.returncode != 0 and "configured" not in res.stdout
    assert res.stderr.count("\n") == 1 and "ldtilecfg" in res.stderr and field in res.stderr, res.stderr


def test_planted_dpbf16_even_first_goes_red(tmp_path):
    """A VDPBF16PS model with the even pair first (the order the probe rules out) gives other
    bytes than "c" through the emulated avx512bf16 path; the shipped model gives the same."""
    hdr = (KERNELS / "lmtail_emulate.h").read_text()
    odd = "const float t = fma_ftz(lmtail_emu_bf16(a[2 * i + 1]), lmtail_emu_bf16(b[2 * i + 1]),"
    even = "dst[i] = fma_ftz(lmtail_emu_bf16(a[2 * i]), lmtail_emu_bf16(b[2 * i]), t);"
    assert hdr.count(odd) == 1 and hdr.count(even) == 1, "the dpbf16 model changed: update this plant"
    planted = (hdr.replace(odd, odd.replace("2 * i + 1", "2 * i"))
                  .replace(even, even.replace("[2 * i]", "[2 * i + 1]")))
    for name in ("gemm/gemm_dp32.c", "lmtail_kernels.h"):
        shutil.copy(KERNELS / name, tmp_path / Path(name).name)
    (tmp_path / "lmtail_emulate.h").write_text(planted)
    lib = _cc.bind(_cc.load_c_library(tmp_path / "gemm_dp32.c", emulated=True), G._DP32_SIGS)
    run = G._amx32_c(3, "planted", lambda: lib, "lmtail_dp32_gemm", "dp32")
    g = torch.Generator().manual_seed(8)
    a, w = torch.randn(4, 100, generator=g).bfloat16(), torch.randn(100, 77, generator=g).bfloat16()
    want = G.gemm_bf16(a, w, order="dp32", backend="c")
    assert same_bits(G.gemm_bf16(a, w, order="dp32", backend="emu-avx512bf16"), want)
    got = torch.empty(4, 77)
    run(a, w, got, 1)
    assert not same_bits(got, want)


# ---------------------------------------------------------------------------------------
# without SIMDe: no emulated row, no error
# ---------------------------------------------------------------------------------------
def test_without_simde_the_emulated_rows_are_unavailable(monkeypatch):
    monkeypatch.setattr(_cc, "simde_include", lambda: None)
    assert not cpu.emulation_runs()
    for order in G.ORDERS:
        assert not emulated(G.GEMM[order])
        assert G.GEMM[order].names(emulated=True) == G.GEMM[order].names()
    with pytest.raises(ValueError, match="backend must be one of"):
        G.gemm_bf16(torch.ones(1, 32).bfloat16(), torch.ones(32, 8).bfloat16(), order="amx32", backend="emu-amx")
    with pytest.raises(RuntimeError, match="no SIMDe"):
        _cc.library_path(KERNELS / "tail" / "rowmass.c", "gcc", "v1", emulated=True)


def test_the_variant_is_in_the_cache_key(tmp_path):
    """The emulated build has its own library file, keyed by lmtail_emulate.h's bytes too."""
    src = KERNELS / "tail" / "rowmass.c"
    native = _cc.library_path(src, "gcc", "v1")
    emu = _cc.library_path(src, "gcc", "v1", emulated=True)
    assert native != emu and emu.name.startswith("rowmass-emu-")
    shutil.copy(src, tmp_path / "rowmass.c")
    (tmp_path / "lmtail_emulate.h").write_text((KERNELS / "lmtail_emulate.h").read_text() + "\n/* changed */\n")
    assert _cc.library_path(tmp_path / "rowmass.c", "gcc", "v1", emulated=True) != emu
    assert _cc.library_path(tmp_path / "rowmass.c", "gcc", "v1") == native
