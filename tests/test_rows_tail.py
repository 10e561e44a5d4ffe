"""lmtail.tail.compose.rows_tail: path "fused" (the kernels.tail.rows_tail C kernel) is bitwise equal to
path "reference" on every kernel backend and thread count.

The reference is the declared path exact_topk + sample_rows, spelled out here and also
checked against rows_tail(path="reference"). Every comparison is on bit views. Planted
wrong variants are source mutations of rows_tail.c, compiled on the fly; each must make
the same comparison fail.
"""
import struct
from pathlib import Path

import pytest
import torch
from conftest import native_or_emulated, stand_ins

from lmtail import numerics
from lmtail.kernels import cpu
from lmtail.kernels.tail import rowmass as RM
from lmtail.kernels.tail import rows_tail as rt
from lmtail.kernels.tail.rows_tail import available_backends, rows_tail_fused
from lmtail.tail.sampler import GREEDY_TEMPERATURE, sample_rows
from lmtail.tail.compose import rows_tail
from lmtail.tail.topk import exact_topk

KERNEL_BACKENDS = ("avx512", "avx2", "c")
FIELDS = ("topk_values", "topk_indices", "tokens", "logprobs", "truncated")
_INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.int64: torch.int64,
        torch.bool: torch.uint8}


def reference(rows, k, sp=None, nan_fold=False):
    """The declared reference path, spelled out (what rows_tail(path="reference") runs):
    exact_topk, then sample_rows."""
    vals, ids, _ = exact_topk(rows, k=k, nan_fold=nan_fold)
    out = {"topk_values": vals, "topk_indices": ids}
    if sp is not None:
        out["tokens"], out["logprobs"], out["truncated"] = sample_rows(vals, ids, rows, sp, nan_fold=nan_fold)
    return out


def bit_diff(out, ref) -> list[str]:
    """Names of the fields whose bits differ (empty: bitwise equal); out a TailOutput or a
    dict, ref a dict."""
    bad = []
    for f, want in ref.items():
        got = out[f] if isinstance(out, dict) else getattr(out, f)
        if got.dtype != want.dtype or got.shape != want.shape:
            bad.append(f"{f}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
        elif not torch.equal(got.view(_INT[got.dtype]) if got.dtype != torch.bool else got,
                             want.view(_INT[want.dtype]) if want.dtype != torch.bool else want):
            bad.append(f)
    return bad


def backend_or_skip(backend):
    """`backend`, or its emulated row where this CPU lacks it (else skip, naming why)."""
    need = {"avx512": ("avx512f", "avx512bw"), "avx2": ("avx2",)}.get(backend, ())
    why = "no C compiler" if available_backends() == () else cpu.missing(*need)
    return native_or_emulated(rt.ROWS_TAIL, backend, why)


def assert_all_paths_equal(rows, k, sp=None, nan_fold=False):
    ref = reference(rows, k, sp, nan_fold)
    bad = bit_diff(rows_tail(rows, k=k, sampling_params=sp, nan_fold=nan_fold, path="reference"), ref)
    assert not bad, f"path reference V={rows.shape[1]} k={k}: {bad}"
    for backend in available_backends() + stand_ins(rt.ROWS_TAIL):  # + emulated rows of what the CPU lacks
        for threads in (1, 2):
            out = rows_tail(rows, k=k, sampling_params=sp, nan_fold=nan_fold, path="fused",
                            backend=backend, threads=threads)
            bad = bit_diff(out, ref)
            assert not bad, f"{backend} threads={threads} V={rows.shape[1]} k={k}: {bad}"


def params(r, gen, *, cols=5):
    """[r, cols] fp32 sampling params covering the sampler's edge cases, cycling."""
    table = [  # top_k, top_p, T, u, min_p
        (50, 0.9, 0.8, 0.37, 0.0), (0, 0.95, 1.0, 0.5, 0.0), (0, 0.5, 0.7, 0.99999994, 0.0),
        (1, 1.0, 1.0, 0.0, 0.0), (10**6, 0.9, 1.3, 0.2, 0.0), (3, 1e-6, 2.0, 0.8, 0.0),
        (0, 1.0, 1.0, 0.6, 0.0), (0, 1.0, 0.5, 0.1, 0.05), (7, 0.8, 1e-5, 0.3, 0.0),
        (7, 0.8, 9e-6, 0.3, 0.0), (0, 0.9, 0.0, 0.9, 0.0), (20, 1.0, 1.0, 0.75, 0.2),
        (-3, 0.99, 1.5, 0.45, 0.0), (5, 0.3, 1e-3, 0.65, 0.0), (0, 0.999, 0.25, 0.999, 0.01),
    ]
    idx = torch.randint(len(table), (r,), generator=gen)
    return torch.tensor([table[i][:cols] for i in idx.tolist()], dtype=torch.float32)


def random_rows(r, v, gen, scale=3.0):
    return (torch.randn(r, v, generator=gen) * scale).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# random rows of many widths
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("v,k", [(1, 1), (2, 2), (7, 3), (31, 31), (33, 32), (255, 64),
                                 (257, 256), (1000, 256), (4097, 300), (9001, 1), (20011, 256)])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_rows_bitwise_equal(v, k, seed):
    gen = torch.Generator().manual_seed(1000 * v + seed)
    rows = random_rows(5, v, gen, scale=(1.0, 4.0)[seed])
    assert_all_paths_equal(rows, k)
    assert_all_paths_equal(rows, k, params(5, gen))
    assert_all_paths_equal(rows, k, params(5, gen, cols=3), nan_fold=True)


def test_ascending_and_descending_rows_churn_the_pool():
    v = 6000  # every lane beats the running threshold (ascending) or none does (descending)
    up = torch.arange(v, dtype=torch.float32) / 64.0
    rows = torch.stack([up, -up, up.flip(0), torch.remainder(up * 37, 11)]).to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for k in (1, 17, 256):
        assert_all_paths_equal(rows, k, params(4, gen))


def test_lookup_table_pass_and_direct_pass():
    """The full-row mass runs from a per-pattern table when the row's value range holds
    fewer than V/2 bf16 patterns (narrow rows here: [1, 2) has 128), else lane by lane
    (wide rows, V small); both must give the reference's bits, at T = 1 and at T != 1."""
    gen = torch.Generator().manual_seed(13)
    narrow = (1.0 + torch.rand(6, 40000, generator=gen)).to(torch.bfloat16)  # 2 * 16.5k < V for +inf, NaN, subnormal rows
    narrow[1, ::9] = float("-inf")
    narrow[2, 4::17] = float("inf")
    narrow[3, 7::5] = float("nan")
    narrow[4] = -narrow[4]
    narrow[5, 3::4] = 3.0 * 2.0**-128
    wide = random_rows(6, 700, gen, scale=40.0)
    for rows in (narrow, wide):
        sp = params(6, gen)
        sp[::2, 0] = 0  # top-k off: the second full-row pass at T
        sp[::2, 2] = torch.tensor([0.7, 1.0, 2.5])
        assert_all_paths_equal(rows, 256, sp, nan_fold=True)


# ---------------------------------------------------------------------------------------
# ties, special values
# ---------------------------------------------------------------------------------------
def test_all_equal_rows_tie_everywhere():
    gen = torch.Generator().manual_seed(4)
    rows = torch.stack([torch.full((777,), x) for x in (1.5, -2.0, 0.0, 65280.0)]).to(torch.bfloat16)
    for k in (1, 5, 256, 777):
        assert_all_paths_equal(rows, k, params(4, gen))


def test_few_distinct_values_threshold_ties():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randint(-3, 4, (6, 3000), generator=gen).to(torch.bfloat16) * 0.5
    for k in (10, 256, 1000):
        assert_all_paths_equal(rows, k, params(6, gen))
        sp = params(6, gen)
        sp[:, 0] = k  # top_k == k: the tie run continues past the k-th candidate
        assert_all_paths_equal(rows, k, sp)


def special_rows(gen, v=1100):
    base = random_rows(9, v, gen).float()
    ninf, pinf, nan = float("-inf"), float("inf"), float("nan")
    base[0, ::7] = pinf
    base[1, ::3] = ninf
    base[2] = ninf
    base[3, 5::11] = nan
    base[4] = nan
    base[4, 17] = 1.0
    base[5] = -base[5].abs()
    base[5, ::13] = -0.0
    base[5, 1::13] = 0.0  # zero max reached by +0.0 and -0.0
    base[6] = torch.randint(-3, 3, (v,), generator=gen).float() * 2.0**-130  # subnormals
    base[7, ::2] = -0.0
    base[8, 3::5] = pinf
    base[8, 4::5] = nan
    return base.to(torch.bfloat16)


@pytest.mark.parametrize("nan_fold", [False, True])
def test_special_values(nan_fold):
    gen = torch.Generator().manual_seed(6)
    rows = special_rows(gen)
    if nan_fold:
        sp = params(rows.shape[0], gen)
    else:  # NaN rows without the fold: top-k only (the sampler needs NaN-free rows)
        sp = None
    for k in (1, 100, 256):
        assert_all_paths_equal(rows, k, sp, nan_fold=nan_fold)
    if not nan_fold:  # and the sampler on them anyway: the reference decides those rows
        sp = params(rows.shape[0], gen)
        assert_all_paths_equal(rows, 100, sp)
        if available_backends():  # the kernel hands exactly those rows back
            got = rows_tail_fused(rows, k=100, sampling_params=sp).undecided
            has_nan = torch.isnan(rows.float()).any(dim=1)
            assert bool(got[has_nan].all()) and not bool(got[[0, 1, 2, 6]].any()), got


def test_signed_nan_payloads_fold_and_order():
    bits = torch.tensor([[0x7FC1, 0xFFC1, 0x7F81, 0xFFFF, 0x3F80, 0xFF80, 0x7F80, 0x8000,
                          0x0000, 0x0001, 0x8001, 0x7FFF]], dtype=torch.int32)
    rows = bits.to(torch.int16).view(torch.bfloat16).repeat(3, 9)
    for nan_fold in (False, True):
        for k in (1, 6, 12, 108):
            assert_all_paths_equal(rows, k, nan_fold=nan_fold)


def test_large_temperature_underflow_and_tiny_max():
    gen = torch.Generator().manual_seed(7)
    rows = -random_rows(4, 500, gen).float().abs() - 1.0
    rows[1] = rows[1] * 2.0**-120
    rows[2, 9] = 2.0**-133  # a subnormal maximum
    rows = rows.to(torch.bfloat16)
    sp = torch.tensor([[0, 0.9, 1e30, 0.5, 0.0], [0, 0.9, 3e38, 0.4, 0.0],
                       [0, 1.0, 1e-4, 0.5, 0.0], [4, 0.9, 1e35, 0.7, 0.0]], dtype=torch.float32)
    assert_all_paths_equal(rows, 64, sp)


# ---------------------------------------------------------------------------------------
# layout, thread counts, batch independence
# ---------------------------------------------------------------------------------------
def test_strided_rows_and_row_independence():
    gen = torch.Generator().manual_seed(8)
    full = random_rows(6, 3000, gen)
    rows = full[:, 100:2900]  # a strided view
    sp = params(6, gen)
    assert_all_paths_equal(rows, 128, sp)
    whole = rows_tail(rows, k=128, sampling_params=sp)
    for i in (0, 5):  # a row's bytes do not depend on the batch it is in
        solo = rows_tail(rows[i:i + 1], k=128, sampling_params=sp[i:i + 1], threads=2)
        assert not bit_diff(solo, {f: getattr(whole, f)[i:i + 1] for f in FIELDS})


def test_many_threads_and_empty_batch():
    gen = torch.Generator().manual_seed(9)
    rows = random_rows(9, 2049, gen)
    sp = params(9, gen)
    ref = reference(rows, 200, sp)
    for threads in (3, 8, 64):
        assert not bit_diff(rows_tail(rows, k=200, sampling_params=sp, threads=threads), ref)
    for path in ("fused", "reference"):
        empty = rows_tail(rows[:0], k=3, sampling_params=sp[:0], path=path)
        assert empty.topk_values.shape == (0, 3) and empty.tokens.shape == (0,), path


def test_debug_taps_are_the_reference_taps():
    gen = torch.Generator().manual_seed(10)
    rows = random_rows(2, 9000, gen)
    want = exact_topk(rows, k=64, debug_taps=True)[2]
    for path in ("fused", "reference"):
        out = rows_tail(rows, k=64, debug_taps=True, path=path)
        assert set(out.taps) == set(want), path
        for name, t in want.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(out.taps[name].view(_INT[t.dtype]), t.view(_INT[t.dtype])), (path, name)
    assert rows_tail(rows, k=64).taps is None


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_each_kernel_backend_is_listed_or_skipped_with_reason(backend):
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(11)
    rows = random_rows(3, 5000, gen)
    sp = params(3, gen)
    out = rows_tail(rows, k=256, sampling_params=sp, backend=backend)
    assert not bit_diff(out, reference(rows, 256, sp))
    fused = rows_tail_fused(rows, k=256, sampling_params=sp, backend=backend)  # the kernel itself
    assert not bit_diff({f: getattr(fused, f) for f in FIELDS}, reference(rows, 256, sp))
    assert not bool(fused.undecided.any())


# ---------------------------------------------------------------------------------------
# planted wrong variants (source mutations) must go red
# ---------------------------------------------------------------------------------------
PLANTS = {  # name -> source edits (old, new), each old text found exactly once
    # the running threshold taken from the (k-1)-th key: a later lane equal to it is dropped
    "filter_drops_equal": (("select_top(P->buf, P->n, P->k);", "select_top(P->buf, P->n, P->k - 1);"),
                           ("P->buf[P->k - 1] >> 32", "P->buf[P->k - 2] >> 32")),
    # in the shared sampler steps (lmtail_kernels.h, inlined in place of its #include)
    "sampler_threshold_drops_ties": (("acc[j % 256] + (v[j] >= thr ? e[j] : 0.0)",
                                      "acc[j % 256] + (v[j] > thr ? e[j] : 0.0)"),),
    "ties_to_higher_id": (("(uint64_t)(0xFFFFFFFFu - (uint32_t)v)", "(uint64_t)(uint32_t)v"),),
}


@pytest.fixture(scope="module")
def planted_libs(tmp_path_factory):
    if "c" not in available_backends():
        pytest.skip("no C compiler: the planted variants are C source mutations")
    from lmtail.kernels._cc import HEADER, bind, load_c_library

    src = Path(rt.__file__).with_name("rows_tail.c").read_text()
    header = HEADER.read_text()
    src = src.replace('#include "lmtail_kernels.h"', header, 1)  # a plant may edit the shared steps
    libs = {}
    for name, edits in PLANTS.items():
        text = src
        for old, new in edits:
            assert text.count(old) == 1, f"plant {name}: {old!r} is gone from rows_tail.c (+ its header)"
            text = text.replace(old, new)
        path = tmp_path_factory.mktemp(name) / "rows_tail.c"
        path.write_text(text)
        libs[name] = bind(load_c_library(path), rt.SIGNATURES)
    return libs


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_variants_go_red(plant, planted_libs, monkeypatch):
    gen = torch.Generator().manual_seed(12)
    rows = torch.randint(-4, 5, (6, 4000), generator=gen).to(torch.bfloat16)  # ties galore
    rows[1] = rows[1] * 0.25 + torch.arange(4000).to(torch.bfloat16) * 2.0**-6
    rows[2:4] = random_rows(2, 4000, gen)  # many distinct values
    rows[4:] = -1.0  # k-1 early maxima, then one more lane equal to them and a runner-up
    rows[4:, :255] = 10.0
    rows[4:, 2000] = 10.0
    rows[4:, 3000] = 7.0
    sp = params(6, gen)
    sp[:, 0] = 20  # top-k on: the threshold's ties decide the kept set
    sp[:, 2] = 1.0
    ref = reference(rows, 256, sp)
    assert not bit_diff(rows_tail(rows, k=256, sampling_params=sp, backend="c"), ref)
    monkeypatch.setattr(rt, "_c_library", lambda: planted_libs[plant])
    red = bit_diff(rows_tail(rows, k=256, sampling_params=sp, backend="c"), ref)
    assert red, f"planted variant {plant} passed the bitwise comparison"


# ---------------------------------------------------------------------------------------
# no C compiler: "fused" is the reference path
# ---------------------------------------------------------------------------------------
def test_without_the_kernel_fused_runs_the_reference(monkeypatch):
    gen = torch.Generator().manual_seed(14)
    rows = random_rows(4, 3000, gen)
    sp = params(4, gen)
    monkeypatch.setattr(rt, "_c_library", lambda: None)
    assert available_backends() == ()
    assert not bit_diff(rows_tail(rows, k=100, sampling_params=sp), reference(rows, 100, sp))
    with pytest.raises(RuntimeError, match="C kernel is unavailable"):
        rows_tail_fused(rows, k=100)
    with pytest.raises(ValueError, match="backend applies to path 'fused' with a built kernel"):
        rows_tail(rows, k=100, backend="c")


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    rows = torch.zeros(2, 10, dtype=torch.bfloat16)
    bad = torch.tensor([[1, 0.5, 1.0], [1, 1.5, 1.0]], dtype=torch.float32)
    for path in ("fused", "reference"):
        with pytest.raises(TypeError, match="rows_bf16 must be a torch.Tensor"):
            rows_tail([[0.0] * 10], k=1, path=path)
        with pytest.raises(ValueError, match="rows_bf16 must be a 2-D bfloat16"):
            rows_tail(rows.float(), k=1, path=path)
        with pytest.raises(ValueError, match="rows_bf16 must be a 2-D bfloat16"):
            rows_tail(rows[0], k=1, path=path)
        for k in (0, 11, 2.0, True):
            with pytest.raises(ValueError, match=r"k must be an int in \[1, V=10\]"):
                rows_tail(rows, k=k, path=path)
        with pytest.raises(ValueError, match="threads must be a positive int"):
            rows_tail(rows, k=1, threads=0, path=path)
        with pytest.raises(ValueError, match="nan_fold must be a bool"):
            rows_tail(rows, k=1, nan_fold=1, path=path)
        with pytest.raises(ValueError, match="debug_taps must be a bool"):
            rows_tail(rows, k=1, debug_taps=None, path=path)
        with pytest.raises(ValueError, match="chunk must be an int >= 1"):
            rows_tail(rows, k=1, chunk=0, path=path)
        with pytest.raises(ValueError, match="sampling_params row 1"):
            rows_tail(rows, k=1, sampling_params=bad, path=path)
        with pytest.raises(ValueError, match="sampling_params must be"):
            rows_tail(rows, k=1, sampling_params=bad[:1], path=path)
    with pytest.raises(ValueError, match=r"path must be one of \('fused', 'reference'\); got 'fast'"):
        rows_tail(rows, k=1, path="fast")
    with pytest.raises(ValueError, match="backend applies to path 'fused'"):
        rows_tail(rows, k=1, path="reference", backend="c")
    if available_backends():
        with pytest.raises(ValueError, match="backend must be one of"):
            rows_tail(rows, k=1, backend="amx")
        with pytest.raises(ValueError, match="backend must be one of"):
            rows_tail_fused(rows, k=1, backend="torch")
        with pytest.raises(ValueError, match=r"sampling_params must be a float32 tensor \[R=2"):
            rows_tail_fused(rows, k=1, sampling_params=bad.double())
        with pytest.raises(TypeError, match="sampling_params must be a torch.Tensor"):
            rows_tail_fused(rows, k=1, sampling_params=[[1, 0.5, 1.0]] * 2)


# ---------------------------------------------------------------------------------------
# the fused kernel's float64 normalizer and log-normalizer vs row_mass (debug export), and
# the constants rows_tail.c holds vs numerics / the sampler
# ---------------------------------------------------------------------------------------
def f64_bits(xs) -> list[int]:
    return [struct.unpack("<q", struct.pack("<d", float(x)))[0] for x in xs]


def _rows(seed: int, r: int, v: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v, generator=g) * torch.linspace(0.5, 12.0, r)[:, None]  # [R, V]
    x[0, :: 7] = -60.0  # terms deep in the tail
    x[-1, v // 2] = 40.0  # one dominant lane: most terms underflow or are subnormal
    if seed % 2:  # few distinct values: the kernel's pattern-table pass
        x[1:] = torch.round(x[1:] * 4) / 4
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("backend", ["avx512", "avx2", "c"])
@pytest.mark.parametrize("seed, r, v", [(0, 5, 1), (1, 4, 255), (2, 6, 257), (3, 3, 4099), (4, 2, 50001),
                                         (5, 3, 50001)])
def test_debug_mass_equals_row_mass_bitwise(backend, seed, r, v):
    """Per sampled row, the kernel's S at T = 1 is row_mass's S, its nz row_mass's nz, and its
    lse1 is vmax + log64(S), bit for bit (odd V: partial passes of the 256 lane chains; both
    the per-lane pass and the pattern-table pass, which rows of few values pick). The
    reference is row_mass's "torch" backend (numerics.exp64 and sum64 as torch ops), which
    shares no code with the C kernels; every row_mass backend must agree with it too."""
    backend = backend_or_skip(backend)
    rows = _rows(seed, r, v)
    sp = torch.tensor([[0.0, 1.0, 0.7, 0.5, 0.0]] * r, dtype=torch.float32)  # sampled, top-k off
    out = rt.rows_tail_fused(rows, k=1, sampling_params=sp, backend=backend, debug_mass=True)
    assert not out.undecided.any()
    m, S, nz = RM.row_mass(rows.double(), torch.ones(r, dtype=torch.float64), backend="torch")
    for b in RM.available_backends():
        assert f64_bits(RM.row_mass(rows.double(), torch.ones(r, dtype=torch.float64), backend=b)[1]) == f64_bits(S), b
    assert f64_bits(out.debug_mass[:, 0]) == f64_bits(S)
    assert out.debug_mass[:, 2].tolist() == nz.double().tolist()
    lse1 = m + numerics.log64(S)  # [R]
    assert f64_bits(out.debug_mass[:, 1]) == f64_bits(lse1)
    assert torch.equal(out.logprobs, (out.topk_values[:, 0].double() - lse1).float())


def test_debug_mass_boundary():
    rows = _rows(0, 2, 300)
    with pytest.raises(ValueError, match="debug_mass=True needs sampling_params"):
        rt.rows_tail_fused(rows, k=3, debug_mass=True)
    with pytest.raises(ValueError, match="debug_mass must be a bool; got 1"):
        rt.rows_tail_fused(rows, k=3, debug_mass=1)
    assert rt.rows_tail_fused(rows, k=3).debug_mass is None


def test_rows_tail_c_constants_equal_numerics_and_sampler():
    if not rt.available_backends():
        pytest.skip("no C compiler: rows_tail.c was not built")
    got = rt.c_constants().tolist()
    assert f64_bits(got[:1]) == f64_bits([GREEDY_TEMPERATURE])
    assert f64_bits(got[1:]) == f64_bits(numerics.log64_constants())
