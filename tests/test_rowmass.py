"""row_mass: every C backend gives the same (m, S, nz) bits as its "torch" backend (the
declared float64 ops as torch tensor ops).

Shape legend: row [R, V] float64, scale [R] float64, m and S [R] float64, nz [R] int64.
Each property is a `check_*` function run on the kernel's backends (must hold) and on
planted wrong variants (must be caught). Bits are compared on int64 views, never allclose.
Note: S >= 1 (the max lane adds exactly 1), so exps below 2**-53 are absorbed into S;
rows with subnormal-range exps test the 2**n path choice on the normal lanes next to them.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import struct

import pytest
import torch
from conftest import stand_ins

from lmtail import numerics
from lmtail.kernels.tail import rowmass as RM
from lmtail.kernels.tail.rowmass import row_mass, shifted_exp, shifted_exp_terms, sum64
from lmtail.numerics import exp64

# the C backends, and the emulated rows of the vector paths this CPU lacks (SIMDe)
C_BACKENDS = tuple(b for b in RM.available_backends() if b != "torch") + stand_ins(RM.ROW_MASS)


def torch_ref(row, scale):
    """The "torch" backend: the declared float64 ops as torch tensor ops."""
    return row_mass(row, scale, backend="torch")
SEEDS = (0, 1, 2)
INF = math.inf


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int64)


def same_bits(a, b) -> bool:
    """Equal-length tuples of tensors, equal dtype, shape and bits."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and x.shape == y.shape and torch.equal(bits(x), bits(y))
        for x, y in zip(a, b))


def backend_impl(backend, threads=None):
    return lambda row, scale: row_mass(row, scale, backend=backend, threads=threads)


def all_impls():
    return [backend_impl(b) for b in C_BACKENDS]


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def rand_rows(R, V, seed, spread):
    """Logits N(0, spread^2) (half of the cases widened from bf16: ties, the real input),
    and scales: 1.0, powers of two (the kernel's multiply path) and random temperatures."""
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(R, V, generator=g, dtype=torch.float64) * spread  # [R, V]
    if seed % 2:
        row = row.bfloat16().double()
    pick = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3, 0.05, 2.0**-7, 3.9])
    scale = pick[torch.randint(len(pick), (R,), generator=g)].double()  # [R]
    scale[::3] = torch.rand(scale[::3].shape, generator=g, dtype=torch.float64) * 2 + 1e-5
    return row, scale


def tie_values() -> torch.Tensor:
    """x in [-746, 0) with fl(x * INV_LN2) exactly k + 0.5: exp64's round sees a tie."""
    out = []
    for k in range(-1076, 0):
        x = (k + 0.5) / numerics._INV_LN2
        for step in range(-3, 4):
            y = x
            for _ in range(abs(step)):
                y = math.nextafter(y, math.copysign(INF, step))
            if y * numerics._INV_LN2 == k + 0.5 and y >= -746:
                out.append(y)
                break
    return torch.tensor(out, dtype=torch.float64)


def tie_rows():
    """Rows [0, tie, tie, ...] (m = 0, so z - m = tie): S >= 1 hides a 1-ulp change in a
    term below about 2**-10 unless thousands of copies add it up, hence 4096 lanes."""
    t = tie_values()
    t = t[t > -60]  # [n] ties whose term is not entirely absorbed
    row = t[:, None].repeat(1, 4096)  # [n, 4096]
    row[:, 0] = 0.0
    return row, torch.ones(len(t), dtype=torch.float64)


def special_rows():
    """(row, scale) cases: +-inf lanes, all -inf, exps in the subnormal range and around
    the exp64 cut-offs, overflow in z and in z - m, huge and tiny scales, subnormal z."""
    g = torch.Generator().manual_seed(7)
    V = 1001
    base = torch.randn(6, V, generator=g, dtype=torch.float64) * 3  # [6, V]
    cases = []
    r = base.clone()
    r[0, [3, 500]] = INF  # two +inf lanes share the mass
    r[1, :] = -INF  # all -inf: uniform
    r[2, ::2] = -INF  # -inf mixed
    r[3, 10] = INF
    r[3, 11] = -INF
    r[4, :] = 2.5  # all equal
    r[5, -1] = INF  # +inf in the last (tail) lane
    cases.append((r, torch.tensor([1.0, 1.0, 0.7, 3.0, 0.3, 1.0], dtype=torch.float64)))
    # z - m in the subnormal-exp range (about -708 .. -746) next to normal lanes: the
    # reference takes its split 2**n path for the whole tensor
    d = -700 - 47 * torch.rand(4, V, generator=g, dtype=torch.float64)  # [4, V]
    d[:, 0] = 0.0
    d[0, 1:9] = torch.tensor([-745.0, -745.0000000000001, -744.9999999999999, -746.0,
                              -708.3964185322641, -708.4, -709.78, -709.0895657128241])
    d[1, 1::2] = -3 * torch.rand(V // 2, generator=g, dtype=torch.float64)
    d[2] = d[2] * 0.5  # no subnormal exps: the reference's single-product path
    cases.append((d, torch.ones(4, dtype=torch.float64)))
    cases.append((d * 2.0 + 1e300, torch.tensor([2.0, 0.5, 1.3, 2.0**-20], dtype=torch.float64)))
    # overflow: z = inf from finite / tiny; z - m = -inf from finite - finite
    o = torch.tensor([[1e308, -1e308, 1.0, 0.0], [-1e308, 1e308, 5.0, -5.0],
                      [1e300, 2e300, -1e300, 0.0]], dtype=torch.float64)
    cases.append((o, torch.tensor([1.0, 0.5, 1e-10], dtype=torch.float64)))
    # huge scales (z tiny, possibly subnormal), tiny scales, subnormal inputs
    h = base[:3].clone()
    h[2] = torch.randn(V, generator=g, dtype=torch.float64) * 1e-310
    cases.append((h, torch.tensor([1e300, 2.0**1000, 1.0], dtype=torch.float64)))
    cases.append((h, torch.tensor([1e-300, 2.0**-1022, 2.0**-60], dtype=torch.float64)))
    return cases


def reference_left_rows():
    """Rows the kernel hands to the reference: NaN lanes (no fold), inf/inf, 0/0, a zero
    max reached by both +0.0 and -0.0 (the sign torch's max picks is not declared)."""
    r = torch.randn(6, 37, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    r[0, 5] = math.nan
    r[1, :] = math.nan
    r[2, 4] = INF
    r[3, :] = -r[3].abs()
    r[3, 7], r[3, 20] = -0.0, 0.0
    r[4, :] = torch.where(r[4] > 0, -0.0, r[4])  # max -0.0 of one sign only: not left
    scale = torch.tensor([1.0, 0.7, INF, 1.0, 2.0, 0.0], dtype=torch.float64)
    r[5, :3] = torch.tensor([0.0, -1.0, 2.0])  # 0/0 = NaN, -1/0 = -inf, 2/0 = inf
    return r, scale


# ---------------------------------------------------------------------------------------
# planted wrong variants (each a (row, scale) -> (m, S, nz) like the reference)
# ---------------------------------------------------------------------------------------
def _mass(row, scale, *, zfn, expfn, sumfn, nzfn=lambda z, e: (e > 0).sum(dim=1)):
    z = zfn(row, scale)  # [R, V]
    m = z.max(dim=1).values  # [R]
    d = torch.where(z == m[:, None], torch.zeros_like(z), z - m[:, None])
    e = expfn(d)  # [R, V]
    return m, sumfn(e), nzfn(z, e)


def _div(row, scale):
    return row / scale[:, None]


def _recip_mul(row, scale):
    return row * (1.0 / scale)[:, None]


def _seq_sum(e):
    acc = torch.zeros(e.shape[0], dtype=torch.float64)
    for v in range(e.shape[1]):
        acc = acc + e[:, v]
    return acc


def declared_pieces(row, scale):
    return _mass(row, scale, zfn=_div, expfn=exp64, sumfn=sum64)


def libm_exp(row, scale):
    return _mass(row, scale, zfn=_div, expfn=torch.exp, sumfn=sum64)


def sequential_sum(row, scale):
    return _mass(row, scale, zfn=_div, expfn=exp64, sumfn=_seq_sum)


def torch_sum(row, scale):
    return _mass(row, scale, zfn=_div, expfn=exp64, sumfn=lambda e: e.sum(dim=1))


def reciprocal_multiply(row, scale):
    return _mass(row, scale, zfn=_recip_mul, expfn=exp64, sumfn=sum64)


def nz_finite_lanes(row, scale):
    """nz counting the finite lanes instead of the lanes whose exp is > 0."""
    return _mass(row, scale, zfn=_div, expfn=exp64, sumfn=sum64,
                 nzfn=lambda z, e: torch.isfinite(z).sum(dim=1))


class _TorchHalfAway:
    """torch with round() rounding ties away from zero (C's round(), not nearbyint)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def round(t):
        return torch.sign(t) * torch.floor(t.abs() + 0.5)


def half_away_exp(monkeypatch):
    def impl(row, scale):
        with monkeypatch.context() as mp:
            mp.setattr(numerics, "torch", _TorchHalfAway())
            return torch_ref(row, scale)
    return impl


# ---------------------------------------------------------------------------------------
# property checks (each returns True when the property holds)
# ---------------------------------------------------------------------------------------
def check_matches_reference(impl, row, scale, ref=None) -> bool:
    return same_bits(impl(row, scale), torch_ref(row, scale) if ref is None else ref)


@functools.lru_cache(maxsize=None)
def cached_case(R, V, seed, spread):
    """(row, scale, reference) for one random case, the reference computed once."""
    row, scale = rand_rows(R, V, seed, spread)
    return row, scale, torch_ref(row, scale)


def check_thread_invariant(backend, row, scale) -> bool:
    one = row_mass(row, scale, backend=backend, threads=1)
    return all(same_bits(row_mass(row, scale, backend=backend, threads=t), one)
               for t in (2, 3))


def check_row_invariant(impl, row, scale) -> bool:
    """Each row alone, and the rows permuted, give the full call's bits."""
    full = impl(row, scale)
    perm = torch.randperm(row.shape[0], generator=torch.Generator().manual_seed(1))
    ok = same_bits(impl(row[perm], scale[perm]), tuple(t[perm] for t in full))
    for i in {0, row.shape[0] // 2, row.shape[0] - 1}:
        ok &= same_bits(impl(row[i:i + 1], scale[i:i + 1]), tuple(t[i:i + 1] for t in full))
    return ok


# ---------------------------------------------------------------------------------------
# tests: bit equality with the reference
# ---------------------------------------------------------------------------------------
def test_variant_builder_is_the_reference():
    row, scale = rand_rows(5, 1001, 0, 10.0)
    assert same_bits(declared_pieces(row, scale), torch_ref(row, scale))


def test_has_c_backends():
    assert C_BACKENDS, "the C kernel did not build"
    assert RM.exp64_constants().tolist() == list(numerics.exp64_constants())


@pytest.mark.parametrize("backend", C_BACKENDS)
@pytest.mark.parametrize("spread", (1.0, 10.0, 100.0, 1000.0))
@pytest.mark.parametrize("R,V", [(1, 1), (3, 7), (1, 1001), (300, 7), (3, 25136),
                                 (2, 256), (2, 257), (9, 515)])
def test_random_rows_match_reference(backend, spread, R, V):
    for seed in SEEDS:
        row, scale, ref = cached_case(R, V, seed, spread)
        assert check_matches_reference(backend_impl(backend), row, scale, ref), (seed, R, V)


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_300_rows_wide(backend):
    row, scale = rand_rows(300, 1001, 4, 30.0)
    assert check_matches_reference(backend_impl(backend), row, scale)


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_special_rows_match_reference(backend):
    for i, (row, scale) in enumerate(special_rows()):
        assert check_matches_reference(backend_impl(backend), row, scale), i


def test_special_rows_take_both_2n_paths_of_the_reference():
    """The reference picks single-product vs split per tensor: the data reaches both."""
    d = special_rows()[1][0]
    n_min = lambda x: torch.round(x.clamp(-746, 710) * numerics._INV_LN2).min()  # noqa
    assert n_min(d) < -1022 and n_min(d[2:3]) >= -1022
    impl = backend_impl(C_BACKENDS[0])
    assert same_bits(impl(d[2:3], torch.ones(1, dtype=torch.float64)),
                     torch_ref(d[2:3], torch.ones(1, dtype=torch.float64)))


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_rows_left_to_reference_match(backend):
    row, scale = reference_left_rows()
    assert check_matches_reference(backend_impl(backend), row, scale)
    m, S, _ = row_mass(row, scale, backend=backend)
    assert torch.isnan(S[[0, 1, 2, 5]]).all() and bits(m[4:5]).item() == bits(
        torch.tensor([-0.0], dtype=torch.float64)).item()


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_rounding_ties_to_even(backend, monkeypatch):
    """exp64 rounds n = round(x / ln2) half-to-even (torch.round); the kernel's nearbyint /
    roundscale must too. The tie rows are sensitive: rounding ties away is caught."""
    row, scale = tie_rows()
    assert check_matches_reference(backend_impl(backend), row, scale)
    assert not check_matches_reference(half_away_exp(monkeypatch), row, scale)


def test_libm_nearbyint_rounds_half_even():
    libm = ctypes.CDLL(ctypes.util.find_library("m"))
    libm.nearbyint.restype, libm.nearbyint.argtypes = ctypes.c_double, [ctypes.c_double]
    xs = [0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -1074.5, -1075.5, 1023.5]
    got = torch.tensor([libm.nearbyint(x) for x in xs], dtype=torch.float64)
    assert same_bits((got,), (torch.round(torch.tensor(xs, dtype=torch.float64)),))


# ---------------------------------------------------------------------------------------
# tests: the per-lane terms (S >= 1 hides terms below 2**-53; the hook shows them)
# ---------------------------------------------------------------------------------------
def term_cases():
    """(z, m): z - m random over [-760, 0], every exp64 tie, the cut-offs, -inf, z == m;
    one case with only normal terms (the reference's single-product 2**n path)."""
    g = torch.Generator().manual_seed(11)
    d = -760 * torch.rand(20001, generator=g, dtype=torch.float64)  # [n]
    edges = torch.tensor([0.0, -0.0, -INF, -745.0, -745.0000000000001, -744.9999999999999,
                          -746.0, -746.5, -708.3964185322641, -708.4, -709.0895657128241,
                          -709.78, -1e-300, -5e-324, -1e300], dtype=torch.float64)
    d = torch.cat([d, tie_values(), edges])
    normal = d[d > -700]
    return [(d, 0.0), (d + 3.25, 3.25), (normal, 0.0), (d[:13], 0.0), (-d[:20] * 1e-3, 1.0)]


def reference_terms(z, m):
    return shifted_exp(z[None], torch.tensor([m], dtype=torch.float64))[0]


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_terms_match_exp64_bit_for_bit(backend):
    for i, (z, m) in enumerate(term_cases()):
        assert same_bits((shifted_exp_terms(z, m, backend=backend),), (reference_terms(z, m),)), i


def test_planted_term_variants_are_caught(monkeypatch):
    z, m = term_cases()[0]
    want = reference_terms(z, m)
    tiny = 2.2250738585072014e-308
    ftz = torch.where(want < tiny, torch.zeros_like(want), want)  # flush subnormal terms
    libm = torch.exp(z - m)
    with monkeypatch.context() as mp:
        mp.setattr(numerics, "torch", _TorchHalfAway())
        away = reference_terms(z, m)
    for bad in (ftz, libm, away):
        assert not same_bits((bad,), (want,))


# ---------------------------------------------------------------------------------------
# tests: invariance
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", C_BACKENDS)
def test_thread_count_cannot_change_bits(backend):
    row, scale = rand_rows(37, 1001, 2, 10.0)
    assert check_thread_invariant(backend, row, scale)
    assert check_matches_reference(backend_impl(backend, threads=2), row, scale)


@pytest.mark.parametrize("backend", C_BACKENDS)
def test_rows_are_independent(backend):
    row, scale = rand_rows(19, 300, 1, 10.0)
    assert check_row_invariant(backend_impl(backend), row, scale)


def test_backends_agree_and_default_is_fastest():
    row, scale = rand_rows(7, 2000, 3, 100.0)
    outs = [row_mass(row, scale, backend=b) for b in RM.available_backends()]
    assert all(same_bits(o, outs[0]) for o in outs)
    assert same_bits(row_mass(row, scale), outs[0])


def test_caller_flush_to_zero_cannot_reach_the_bits():
    """The workers pin MXCSR (FTZ/DAZ off): a caller flushing subnormals gets the same
    bits. Planted: the reference under FTZ/DAZ differs (the data has subnormal z)."""
    row = torch.tensor([[3e-310, -1.0, 1e-309], [-5e-324, -2.0, -1e-320]], dtype=torch.float64)
    scale = torch.tensor([1.0, 0.5], dtype=torch.float64)
    want = torch_ref(row, scale)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    try:
        flushed = torch_ref(row, scale)
        got = [row_mass(row, scale, backend=b) for b in C_BACKENDS]
    finally:
        torch.set_flush_denormal(False)
    assert not same_bits(flushed, want)
    assert all(same_bits(g, want) for g in got)


def test_noncontiguous_row_and_fp32_scale():
    row, scale = rand_rows(6, 600, 0, 10.0)
    view = row.t().contiguous().t()  # same values, column-major strides
    s32 = scale.float()
    assert check_matches_reference(all_impls()[0], view, s32)
    assert check_matches_reference(all_impls()[0], row[:, 1:400], scale)


def test_empty_batch():
    out = row_mass(torch.zeros(0, 5, dtype=torch.float64),
                        torch.zeros(0, dtype=torch.float64))
    assert [t.shape for t in out] == [(0,)] * 3


# ---------------------------------------------------------------------------------------
# planted wrong variants are caught
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", [libm_exp, sequential_sum, torch_sum, reciprocal_multiply])
def test_planted_variants_are_caught(variant):
    row, scale = rand_rows(8, 4096, 0, 3.0)  # terms of one size: a 1-ulp slip shows in S
    assert not check_matches_reference(variant, row, scale)


def test_planted_nz_variant_is_caught():
    """Lanes with exps below 2**-1075 carry no mass: counted by nz only if > 0."""
    row, scale = special_rows()[1]
    assert check_matches_reference(all_impls()[0], row, scale)
    assert not check_matches_reference(nz_finite_lanes, row, scale)


def test_planted_thread_and_row_variants_are_caught():
    row, scale = rand_rows(19, 1001, 1, 10.0)

    def batch_variant(r, s):  # the kernel for one row, a wrong sum for batches
        return row_mass(r, s) if r.shape[0] == 1 else sequential_sum(r, s)

    assert not check_row_invariant(batch_variant, row, scale)

    def thread_variant(r, s, threads):
        return row_mass(r, s) if threads == 1 else torch_sum(r, s)

    one = thread_variant(row, scale, 1)
    assert not all(same_bits(thread_variant(row, scale, t), one) for t in (2, 3))


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("row,scale,kw,match", [
    (torch.zeros(3, dtype=torch.float64), torch.ones(3), {},
     r"2-D torch.Tensor \[R, V\]; got \(3,\)"),
    (torch.zeros(2, 3), torch.ones(2), {}, "float64; got torch.float32"),
    (torch.zeros(2, 0, dtype=torch.float64), torch.ones(2), {}, r"V >= 1 .* got shape \(2, 0\)"),
    (torch.zeros(2, 3, dtype=torch.float64), torch.ones(3), {}, r"\[R\] = \(2,\); got \(3,\)"),
    (torch.zeros(2, 3, dtype=torch.float64), torch.ones(2, dtype=torch.int64), {},
     "floating tensor; got torch.int64"),
    (torch.zeros(2, 3, dtype=torch.float64), torch.ones(2), {"threads": 0},
     "positive int or None; got 0"),
    (torch.zeros(2, 3, dtype=torch.float64), torch.ones(2), {"backend": "cuda"},
     "backend must be one of .*; got 'cuda'"),
])
def test_bad_inputs_raise(row, scale, kw, match):
    with pytest.raises(ValueError, match=match):
        row_mass(row, scale, **kw)


def f64_bits(xs) -> list[int]:
    return [struct.unpack("<q", struct.pack("<d", float(x)))[0] for x in xs]


def test_exp64_constants_handed_to_c_are_numerics():
    """The packer hands C numerics' exp64 constants (public accessor), in K[17]'s order, and
    they are the fdlibm split of ln 2 and 1/k!."""
    k = RM.exp64_constants()
    assert f64_bits(k) == f64_bits(numerics.exp64_constants())
    assert f64_bits(k[:3]) == f64_bits([1.44269504088896338700e00, 6.93147180369123816490e-01,
                                        1.90821492927058770002e-10])
    assert f64_bits(k[3:]) == f64_bits([1.0 / math.factorial(i) for i in range(14)])
