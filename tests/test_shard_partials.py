"""kernels.tail.shard_partials: every backend ("avx512", "avx2", "c") is bitwise equal to the
"torch" backend (the declared ops) on keys, chunk mass and NaN counts, for any thread count.

Every comparison is on bit views (float64 as int64). Planted wrong variants are source
mutations of shard_partials.c, compiled on the fly; each must make the same comparison fail.
"""
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import native_or_emulated

from lmtail.kernels import cpu
from lmtail.kernels.tail import shard_partials as SP

C_BACKENDS = ("avx512", "avx2", "c")
FIELDS = ("keys", "mass", "nans")
SCALES = (0.0, 1.0, 0.7, 2.0, 1e-3)  # 0.0: no T pass; 2.0: a power of two (product path)
INF, NAN = float("inf"), float("nan")


def bounds_of(v: int, vtp: int, rank: int) -> tuple[torch.Tensor, int, int]:
    """Rank `rank`'s slice of the 256 global chunks floor(j * v / 256) of a vocabulary v cut
    into vtp shards: (local bounds [c + 1], col0, V_s)."""
    b = torch.arange(257, dtype=torch.int64) * v // 256
    c = 256 // vtp
    lb = b[rank * c:(rank + 1) * c + 1]
    return lb - lb[0], int(lb[0]), int(lb[-1] - lb[0])


def edge_rows(n: int, vs: int, gen: torch.Generator, *, nan: bool) -> torch.Tensor:
    """[n, vs] fp32 rows cycling through the kinds the kernel must not get wrong."""
    x = torch.empty(n, vs)
    for i in range(n):
        kind = i % 8
        if kind == 0:  # many distinct values
            x[i] = torch.randn(vs, generator=gen) * 4
        elif kind == 1:  # ties galore, with +-0
            x[i] = torch.randint(-3, 4, (vs,), generator=gen).float()
            x[i, torch.rand(vs, generator=gen) < 0.3] = -0.0
        elif kind == 2:  # +-inf, subnormals, huge values
            x[i] = torch.randn(vs, generator=gen)
            pick = torch.randint(0, 6, (vs,), generator=gen)
            x[i][pick == 0] = INF
            x[i][pick == 1] = -INF
            x[i][pick == 2] = 1e-42
            x[i][pick == 3] = -3e-45
            x[i][pick == 4] = -3.0e38
        elif kind == 3:  # all -inf
            x[i] = -INF
        elif kind == 4:  # max 0 reached by +0 and -0 (every other lane negative)
            x[i] = -torch.rand(vs, generator=gen) - 0.5
            x[i, ::3] = 0.0
            x[i, 1::3] = -0.0
        elif kind == 5:  # -inf with a few finite lanes (chunks of -inf lanes only)
            x[i] = -INF
            x[i, torch.randint(0, vs, (max(1, vs // 50),), generator=gen)] = 2.5
        elif kind == 6:  # subnormals only, both signs
            x[i] = torch.randint(-200, 200, (vs,), generator=gen).float() * 1e-45
        else:  # wide spread: terms underflow (d < -745) and the split 2**n product
            x[i] = torch.randn(vs, generator=gen) * 400
    if nan:  # NaN lanes, both signs, several per row in rows 0, 1, 2
        for i in range(min(n, 3)):
            idx = torch.randint(0, vs, (max(1, vs // 40),), generator=gen)
            x[i, idx] = NAN
            x[i, idx[::2]] = -NAN
        x.view(torch.int32)[0, 0] = 0x7F800001  # a signalling NaN pattern
    return x


def run(x, bounds, col0, *, k1, nan_fold, scale_t, with_mass=True, backend, threads=None):
    return SP.shard_partials(x, col0=col0, k1=k1, nan_fold=nan_fold, bounds=bounds, scale_t=scale_t,
                             with_mass=with_mass, backend=backend, threads=threads)


def bit_diff(out, ref) -> list[str]:
    """The fields whose bits differ (float64 compared as int64)."""
    bad = []
    for name, got, want in zip(FIELDS, out, ref):
        if got is None or want is None:
            if (got is None) != (want is None):
                bad.append(f"{name}: None vs not")
            continue
        if got.dtype != want.dtype or got.shape != want.shape:
            bad.append(f"{name}: {got.dtype}{tuple(got.shape)} vs {want.dtype}{tuple(want.shape)}")
        elif not torch.equal(got.view(torch.int64) if got.dtype == torch.float64 else got,
                             want.view(torch.int64) if want.dtype == torch.float64 else want):
            bad.append(name)
    return bad


def backend_or_skip(backend):
    """`backend`, or its emulated row where this CPU lacks it (else skip, naming why)."""
    need = {"avx512": ("avx512f",), "avx2": ("avx2",)}.get(backend, ())
    return native_or_emulated(SP.SHARD_PARTIALS, backend, cpu.missing(*need) or "no C compiler")


def scales(n, gen):
    return torch.tensor(SCALES, dtype=torch.float64)[torch.randint(0, len(SCALES), (n,), generator=gen)]


def assert_equal_all_threads(backend, x, bounds, col0, *, k1, nan_fold, scale_t, with_mass=True):
    ref = run(x, bounds, col0, k1=k1, nan_fold=nan_fold, scale_t=scale_t, with_mass=with_mass,
              backend="torch")
    for threads in sorted({1, 2, max(1, x.shape[0])}):
        out = run(x, bounds, col0, k1=k1, nan_fold=nan_fold, scale_t=scale_t, with_mass=with_mass,
                  backend=backend, threads=threads)
        bad = bit_diff(out, ref)
        assert not bad, (f"{backend} threads={threads} V_s={x.shape[1]} k1={k1} "
                         f"nan_fold={nan_fold}: {bad}")


# ---------------------------------------------------------------------------------------
# every backend == torch
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", C_BACKENDS)
@pytest.mark.parametrize("vs", [1, 7, 255, 257, 1000, pytest.param(4099, marks=pytest.mark.slow)])
def test_backend_equals_torch(backend, vs):
    backend = backend_or_skip(backend)
    for seed in range(3):
        gen = torch.Generator().manual_seed(1000 * vs + seed)
        n = 8
        for vtp, nan_fold in ((1, True), (8, False), (2, True)):
            rank = seed % vtp
            bounds, col0, _ = bounds_of(vs * vtp, vtp, rank)
            x = edge_rows(n, vs, gen, nan=nan_fold or seed == 1)
            for k1 in (1, 5, 257):  # 257 > V_s for the small shards: pad keys
                assert_equal_all_threads(backend, x, bounds, col0, k1=k1, nan_fold=nan_fold,
                                         scale_t=scales(n, gen))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_narrow_chunks_widths_zero_and_one(backend):
    """V = 104 over 8 ranks: each rank's 32 chunks are 0 or 1 lanes wide."""
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(5)
    for rank in range(8):
        bounds, col0, vs = bounds_of(104, 8, rank)
        widths = (bounds[1:] - bounds[:-1]).tolist()
        assert vs == 13 and set(widths) == {0, 1}
        for nan_fold in (True, False):
            x = edge_rows(8, vs, gen, nan=nan_fold)
            assert_equal_all_threads(backend, x, bounds, col0, k1=5, nan_fold=nan_fold,
                                     scale_t=scales(8, gen))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_wide_and_uneven_chunks(backend):
    """Hand-cut bounds: chunks wider than 256 lanes starting off a multiple of 256, empty ones."""
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(6)
    bounds = torch.tensor([0, 0, 3, 700, 700, 1999, 2000, 4099], dtype=torch.int64)
    x = edge_rows(8, 4099, gen, nan=True)
    for nan_fold in (True, False):
        assert_equal_all_threads(backend, x, bounds, 3 << 20, k1=300, nan_fold=nan_fold,
                                 scale_t=scales(8, gen))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_vector_block_edge_widths(backend):
    """Chunk widths around the vector paths' blocks (AVX2: 16 lanes, AVX-512: 32) and the
    256 chains: 1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 255, 256, 257, 288, 300; and
    around the AVX-512 halving tree's powers of two (the chains it reads past act are +0.0)."""
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(8)
    widths = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 255, 256, 257, 288, 300,
              2, 3, 5, 7, 8, 9, 65, 97, 127, 128, 129, 193]  # and around the halving tree's powers of two
    bounds = torch.tensor([0] + np.cumsum(widths).tolist(), dtype=torch.int64)
    x = edge_rows(6, int(bounds[-1]), gen, nan=True)
    for nan_fold in (True, False):
        assert_equal_all_threads(backend, x, bounds, 0, k1=40, nan_fold=nan_fold, scale_t=scales(6, gen))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_signed_zero_max_rows(backend):
    """A chunk max of 0 reached by both +0 and -0: row_mass leaves such rows to torch; the
    kernel decides them itself (m + 0.0, and S does not see the sign) and must agree."""
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(7)
    x = -torch.rand(6, 2000, generator=gen) - 1.0
    x[:, ::2] = 0.0
    x[:, 1::2] = -0.0
    x[3, :] = -0.0  # -0 only
    x[4, :1000] = -0.0  # one sign per chunk: +-0 chunks meet only across chunks
    x[4, 1000:] = 0.0
    bounds = torch.tensor([0, 1, 2, 500, 1001, 2000], dtype=torch.int64)
    st = torch.tensor([1.0, 0.7, 2.0, 1e-3, 0.0, 0.7], dtype=torch.float64)
    assert_equal_all_threads(backend, x, bounds, 0, k1=9, nan_fold=False, scale_t=st)
    m = run(x, bounds, 0, k1=9, nan_fold=False, scale_t=st, backend=backend)[1]
    assert not torch.signbit(m[:, :, 0]).any() and not torch.signbit(m[:, :, 2]).any(), "m + 0.0"


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_keys_only_and_scale_none(backend):
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(8)
    x = edge_rows(8, 1000, gen, nan=True)
    bounds, col0, _ = bounds_of(8000, 8, 3)
    for nan_fold in (True, False):
        ref = SP.shard_partials(x, col0=col0, k1=17, nan_fold=nan_fold, bounds=bounds, scale_t=None,
                                with_mass=False, backend="torch")
        out = SP.shard_partials(x, col0=col0, k1=17, nan_fold=nan_fold, bounds=bounds, scale_t=None,
                                with_mass=False, backend=backend)
        assert out[1] is None and out[2] is None
        assert not bit_diff(out, ref)
        assert_equal_all_threads(backend, x, bounds, col0, k1=17, nan_fold=nan_fold,
                                 scale_t=torch.zeros(8, dtype=torch.float64))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_bad_scales_go_to_torch(backend):
    """T scales the kernel does not take (inf, NaN, negative) are decided by torch: same bits."""
    backend = backend_or_skip(backend)
    gen = torch.Generator().manual_seed(9)
    x = edge_rows(8, 300, gen, nan=False)
    st = torch.tensor([INF, NAN, -0.7, 1.0, -INF, 0.0, 5e-324, 1e300], dtype=torch.float64)
    assert_equal_all_threads(backend, x, torch.tensor([0, 100, 300]), 0, k1=7, nan_fold=True, scale_t=st)


def test_default_backend_is_the_first_available():
    names = SP.available_backends()
    assert names[-1] == "torch"
    assert list(names) == [b for b in (*C_BACKENDS, "torch") if b in names]


# ---------------------------------------------------------------------------------------
# planted wrong variants (source mutations of shard_partials.c) must go red
# ---------------------------------------------------------------------------------------
PLANTS = {  # name -> source edits (old, new), each old text found exactly once
    # keys: -0 keyed as the pattern 0x80000000 (mono -1) instead of +0
    "keys_ignore_neg_zero": (("if (b == INT32_MIN) b = 0; /* -0 -> +0 */", ""),),
    # keys: ties to the higher id
    "keys_ties_to_higher_id": (("(uint64_t)(0xFFFFFFFFu - (uint32_t)id)", "(uint64_t)(uint32_t)id"),),
    # the filter's threshold from the (k1-1)-th key: a later lane equal to the k1-th is dropped
    "filter_drops_equal": (("select_top(P->buf, P->n, P->k);\n    P->n = P->k;",
                            "select_top(P->buf, P->n, P->k - 1);\n    P->n = P->k;"),
                           ("P->buf[P->k - 1] >> 32", "P->buf[P->k - 2] >> 32")),
    # mass: 128 lane chains instead of 256 (a lane's chain by its shard column instead of
    # its chunk position would be no wrong variant: that only rotates the chain labels by
    # lo mod 256, and the halving tree's pairing t, t + h is invariant under rotation)
    "chunk_128_chains": (("acc[(v - lo) % LANES] +=", "acc[(v - lo) % (LANES / 2)] +="),),
    # mass: T pass max not divided by the scale
    "t_max_unscaled": (("const double m = inv != 0.0 ? m1 * inv : m1 / s;", "const double m = m1;"),),
    # mass: a chunk of -inf lanes only gets S = 0 instead of its lane count
    "neg_inf_chunk_S_zero": (("m == NEG_INF ? (double)w", "m == NEG_INF ? 0.0"),),
    # NaN count: a flag per chunk instead of a count
    "nan_flag_not_count": (("if (v != v) ++cnt;", "if (v != v) cnt = 1;"),),
}


@pytest.fixture(scope="module")
def planted_libs(tmp_path_factory):
    if "c" not in SP.available_backends():
        pytest.skip("no C compiler: the planted variants are C source mutations")
    from lmtail.kernels._cc import bind, load_c_library

    src = Path(SP.__file__).with_name("shard_partials.c").read_text()
    paths = {}
    for name, edits in PLANTS.items():
        text = src
        for old, new in edits:
            assert text.count(old) == 1, f"plant {name}: {old!r} is not in shard_partials.c once"
            text = text.replace(old, new)
        path = tmp_path_factory.mktemp(name) / "shard_partials.c"
        path.write_text(text)
        paths[name] = path
    with ThreadPoolExecutor(max_workers=4) as pool:  # the compiler runs outside the GIL
        libs = dict(zip(paths, pool.map(load_c_library, paths.values())))
    return {name: bind(lib, SP.SIGNATURES) for name, lib in libs.items()}


def plant_case():
    """Rows and bounds that every plant's property shows on (the plain C backend)."""
    gen = torch.Generator().manual_seed(12)
    vs = 3000
    x = torch.randn(8, vs, generator=gen) * 3
    x[0] = -torch.rand(vs, generator=gen) - 1.0  # -0 among the top keys
    x[0, 100:140] = -0.0
    x[1] = torch.randint(-3, 4, (vs,), generator=gen).float()  # ties at the threshold
    x[2] = -1.0  # k1 - 1 early maxima, then one more lane equal to them and a runner-up
    x[2, :8] = 10.0
    x[2, 2000] = 10.0
    x[2, 2500] = 7.0
    x[3, :] = -INF  # -inf-only chunks
    x[4, 10:20] = NAN  # NaN lanes (folded)
    x[5, 1500:1510] = NAN
    bounds = torch.tensor([0, 700, 1400, 1999, 3000], dtype=torch.int64)  # wide, off 256
    st = torch.tensor([0.7, 0.7, 0.7, 0.7, 0.7, 0.0, 2.0, 0.7], dtype=torch.float64)
    return x, bounds, st


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_variants_go_red(plant, planted_libs, monkeypatch):
    x, bounds, st = plant_case()
    kw = dict(k1=9, nan_fold=True, scale_t=st)
    ref = run(x, bounds, 64, backend="torch", **kw)
    assert not bit_diff(run(x, bounds, 64, backend="c", **kw), ref)
    monkeypatch.setattr(SP, "_c_library", lambda: planted_libs[plant])
    red = bit_diff(run(x, bounds, 64, backend="c", threads=1, **kw), ref)
    assert red, f"planted variant {plant} passed the bitwise comparison"


# ---------------------------------------------------------------------------------------
# scale_rows: decode_tail's deferred fp32(acc * rms) in one C thread
# ---------------------------------------------------------------------------------------
def scale_case(seed: int, n: int = 5, v: int = 1003):
    """acc [n, v] with subnormals, +-0, +-inf, NaNs (payloads too) and overflowing
    products; rms [n] with a zero, an inf and subnormal-producing scales."""
    gen = torch.Generator().manual_seed(seed)
    acc = torch.randn(n, v, generator=gen) * torch.exp2(torch.randint(-140, 120, (n, v), generator=gen).float())
    acc[0, :7] = torch.tensor([0.0, -0.0, INF, -INF, NAN, 1e-45, -3e-39])
    acc.view(torch.int32)[1, 5] = 0x7F800001  # a signalling NaN payload: quieted, kept
    acc.view(torch.int32)[1, 6] = -0x0040_0001  # a negative NaN with payload
    rms = torch.tensor([0.37, 0.0, INF, 3e-30, 2.0 ** 100])[:n]
    return acc, rms


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scale_rows_equals_torch_bitwise(seed):
    """C == `acc * rms[:, None]` bit for bit (NaN payloads, overflow, subnormals included);
    a NaN rms falls back to the torch op. Planted: the NaNs stored canonical (payloads lost)
    must go red."""
    acc, rms = scale_case(seed)
    want = acc * rms[:, None]
    got = SP.scale_rows(acc.clone(), rms)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    rms_nan = rms.clone()
    rms_nan[2] = NAN
    assert torch.equal(SP.scale_rows(acc.clone(), rms_nan).view(torch.int32),
                       (acc * rms_nan[:, None]).view(torch.int32))
    planted = got.clone()
    planted[torch.isnan(planted)] = NAN  # canonical NaN: the payloads are lost
    assert not torch.equal(planted.view(torch.int32), want.view(torch.int32))
