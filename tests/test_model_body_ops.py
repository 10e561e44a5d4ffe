"""The declared body's pieces (exp32, silu_mul, rope, attend): every backend equal and accurate
against float64, threads, cache slots, errors, each bit for bit with a planted variant."""

import math

import numpy as np
import pytest
import torch
from conftest import bits, native_or_emulated

from lmtail.kernels import cpu
from lmtail.model import body as decl
from lmtail.reference import model as ref



# ---------------------------------------------------------------------------------------
# the declared body's pieces: exp32, silu_mul, rope, attend (model/body.py) vs float64
# ---------------------------------------------------------------------------------------

BACKENDS = decl.available_backends()


def test_body_backends_present():
    """Which backends this machine compares (each test below runs all of them)."""
    assert BACKENDS[-1] == "torch"
    if "c" not in BACKENDS:
        pytest.skip("no C compiler: only the torch emulation of the body kernels runs here")
    assert ("avx2" in BACKENDS) == cpu.has("avx2", "fma")
    if "avx512" not in BACKENDS:  # the avx512 micro-kernels run emulated (tests/test_emulated.py too)
        assert need_vector("avx512") == "emu-avx512"


def ulps(got: torch.Tensor, want64: torch.Tensor) -> torch.Tensor:
    """|got - want| in units of the fp32 spacing at want (fp32 got, float64 want)."""
    w32 = want64.float().abs()
    spacing = (torch.nextafter(w32, torch.tensor(math.inf)) - w32).double()
    return (got.double() - want64).abs() / spacing


def specials():
    return torch.tensor([0.0, -0.0, 88.0, 88.01, -86.0, -86.01, 1e-30, -1e-40, 1e-45, 100.0, -100.0,
                         math.inf, -math.inf, math.nan])


def exp32_degree5(x):
    """Planted: the same range reduction with the polynomial cut at degree 5."""
    n = torch.round(x * float(decl.LOG2E))
    r = x.double() - n.double() * math.log(2)
    p = sum(r ** k / math.factorial(k) for k in range(6))
    return (p * torch.exp2(n.double())).float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exp32_backends_equal_and_accurate(seed):
    """exp32: C == torch emulation bitwise (random, wide range, special values); within
    EXP32_ULP of float64 exp on [-86, 88]; the declared edges (inf, +0, NaN). Planted: a
    degree-5 polynomial breaks the bound."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(20000, generator=g) * 30, torch.rand(20000, generator=g) * 174 - 86, specials()])
    outs = [decl.exp32(x, backend=b) for b in BACKENDS]
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
    y, ok = outs[0], (x >= -86) & (x <= 88)
    assert float(ulps(y[ok], ref.exp_ref(x[ok])).max()) <= decl.EXP32_ULP
    assert (y[x > 88] == math.inf).all() and (bits(y[x < -86]) == 0).all() and torch.isnan(y[x.isnan()]).all()
    assert (bits(y[x.isnan()]) == 0x7FC00000).all()
    assert float(ulps(exp32_degree5(x[ok]), ref.exp_ref(x[ok])).max()) > decl.EXP32_ULP


@pytest.mark.parametrize("seed", [0, 1])
def test_silu_mul_backends_equal_and_accurate(seed):
    """silu_mul on [gate | up]: C == torch bitwise, within SILU_ULP of float64 where the
    result is normal, silu(-inf) = -0, silu(+inf) * u = inf, NaN stays NaN. Planted:
    sigmoid(-g) in place of sigmoid(g) is far off."""
    g = torch.Generator().manual_seed(seed)
    gate = torch.cat([torch.randn(40, 37, generator=g) * 6, specials()[None, :].expand(40, -1)], 1)
    up = torch.randn(40, gate.shape[1], generator=g) * 3
    gu = torch.cat([gate, up], 1)  # [40, 2F]
    outs = [decl.silu_mul(gu, backend=b) for b in BACKENDS]
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
    y = outs[0]
    want = ref.silu_mul_ref(gate, up)
    normal = torch.isfinite(gate) & (want.abs() > 2.0 ** -126)
    assert float(ulps(y[normal], want[normal]).max()) <= decl.SILU_ULP
    assert torch.isnan(y[gate.isnan()]).all() and (y[gate == -math.inf] == 0).all()
    bad = gate / (1.0 + decl.exp32(gate)) * up
    assert float(ulps(bad[normal], want[normal]).max()) > 1e3
    with pytest.raises(ValueError, match=r"gu must be \[M, 2F\]; got shape \(3, 5\)"):
        decl.silu_mul(torch.zeros(3, 5))
    with pytest.raises(TypeError, match=r"gu must be a torch.Tensor; got list"):
        decl.silu_mul([1.0])


def rope_two_part(n_positions, head_dim, base):
    """Planted: the rope range reduction with pi/2 in one part only (no P2, P3 terms)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    theta = torch.arange(n_positions, dtype=torch.float64)[:, None] * torch.exp(-2.0 * i / head_dim * math.log(base))
    k = torch.round(theta * (2 / math.pi))
    r = theta - k * float(np.float32(math.pi / 2))
    q = k.to(torch.int64) % 4
    c, s = torch.cos(r), torch.sin(r)
    return torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s))).float()


def test_rope_table_accurate():
    """rope_table (float64 basic ops, one fp32 rounding) is within ROPE_ULP of libm's
    float64 cos/sin for 2048 positions (and positions 8000..8191); two bases. Planted:
    a one-part pi/2 reduction is off by far more at large angles."""
    for base, n in ((1e5, 2048), (1e4, 300)):
        cos, sin = decl.rope_table(n, 64, base)
        rc, rs = ref.rope_ref(n, 64, base)
        assert cos.dtype == torch.float32 and tuple(cos.shape) == (n, 32)
        for got, want in ((cos, rc), (sin, rs)):
            assert float(ulps(got, want).max()) <= decl.ROPE_ULP
    cos, _ = decl.rope_table(8192, 64, 1e5)
    rc, _ = ref.rope_ref(8192, 64, 1e5)
    assert float(ulps(cos[8000:], rc[8000:]).max()) <= decl.ROPE_ULP
    assert float(ulps(rope_two_part(8192, 64, 1e5)[8000:], rc[8000:]).max()) > 100


def attend_case(seed, B=3, T=7, nh=9, nkv=3, cap=20, s0=5, pad=(0, 4, 2)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, nh, 64, generator=g) * 2
    kt = torch.randn(B, nkv, 64, cap + decl.SLACK, generator=g)
    v = torch.randn(B, nkv, cap + decl.SLACK, 64, generator=g)
    return q, kt, v, torch.tensor(pad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attend_backends_threads_and_reference(seed):
    """attend: avx512, avx2 and portable C (1, 2, 3 threads) == torch emulation bitwise; within 2e-6 of float64
    softmax attention (relative to max |v|: fp32 chains of depth <= 64 and <= 32 keys);
    pad queries give +0."""
    q, kt, v, pad = attend_case(seed)
    outs = [decl.attend(q, kt, v, pad, s0=5, scale=0.125, backend=b, threads=t)
            for b in BACKENDS for t in ((1, 2, 3) if b != "torch" else (1,))]
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
    want = ref.attend_ref(q, kt, v, pad, s0=5, scale=0.125)
    assert float((outs[0].double() - want).abs().max()) < 2e-6 * float(v.abs().max())
    assert (bits(outs[0][1, :0]) == 0).all()  # row 1: pad 4, s0 5: every query real here
    o2 = decl.attend(q, kt, v, torch.tensor([0, 9, 2]), s0=5, scale=0.125)
    assert (bits(o2[1, :4]) == 0).all() and not (bits(o2[1, 4:]) == 0).all()


VECTOR_NEEDS = {"avx512": ("avx512f",), "avx2": ("avx2", "fma")}  # attention micro-kernels


def need_vector(backend):
    """`backend`, or its emulated row where this CPU lacks it (else skip, naming why)."""
    return native_or_emulated(decl.ATTEND, backend, cpu.missing(*VECTOR_NEEDS[backend]) or "no C compiler")


@pytest.mark.parametrize("backend", ["avx512", "avx2"])
@pytest.mark.parametrize("T", [7, 29])
@pytest.mark.parametrize("seed", [0, 1])
def test_attend_vector_softmax_extremes(seed, T, backend):
    """The vector softmax (vector max and exp32) == the portable C bitwise over up to 100 + T
    keys (full and partial 16- / 8-lane blocks; T = 29: the multi-position kernels too) with
    wide score ranges (exp underflow to +0, e = 1 ties at the max), an inf key and a NaN key
    (NaN where the C gives NaN)."""
    backend = need_vector(backend)
    g = torch.Generator().manual_seed(seed)
    B, S = 2, 100 + T + 64
    q = torch.randn(B, T, 9, 64, generator=g) * torch.tensor([0.1, 30.0]).repeat(T)[None, :T, None, None]
    kt = torch.randn(B, 3, 64, S, generator=g) * 3
    v = torch.randn(B, 3, S, 64, generator=g)
    kt[0, 1, 5, 40] = math.inf
    kt[1, 2, 7, 17] = math.nan
    pad = torch.tensor([0, 3])
    a = decl.attend(q.contiguous(), kt, v, pad, s0=100, scale=0.125, backend=backend)
    c = decl.attend(q.contiguous(), kt, v, pad, s0=100, scale=0.125, backend="c")
    nan = c.isnan()
    assert nan.any() and torch.equal(a.isnan(), nan) and torch.equal(bits(a)[~nan], bits(c)[~nan])


@pytest.mark.parametrize("backend", ["avx512", "avx2"])
@pytest.mark.parametrize("nh, nkv", [(9, 3), (8, 2), (6, 3), (4, 4), (10, 2)])
def test_attend_vector_multi_position(nh, nkv, backend):
    """The multi-position kernels (a unit's adjacent positions sharing each key and value
    block; g = nh / nkv heads per KV head in groups of up to 3) == the portable C bitwise, 1
    and 2 threads: T = 45 (whole units and a short last one), pads 0..6 (a unit's key count
    of every residue mod 8) and 17 (a unit across the first real query), q scaled by 40 for
    some positions (exp32 clamps at -86), an inf and a NaN key in the slots some queries
    read, NaN in the slots no query reads. And == the torch emulation on one row."""
    backend = need_vector(backend)
    g = torch.Generator().manual_seed(nh * 10 + nkv)
    B, T, s0 = 8, 45, 11
    S = s0 + T + 64
    q = torch.randn(B, T, nh, 64, generator=g) * torch.tensor([1.0, 40.0, 0.01])[torch.arange(T) % 3][None, :, None, None]
    kt = torch.randn(B, nkv, 64, S, generator=g)
    v = torch.randn(B, nkv, S, 64, generator=g)
    kt[7, 0, 3, 30] = math.inf
    v[7, nkv - 1, 50] = math.nan  # row 7's key 33: read by its positions >= 33 only
    kt[:, :, :, s0 + T:] = math.nan  # never-written slots: never enter a sum
    v[:, :, s0 + T:] = math.nan
    pad = torch.tensor([0, 1, 2, 3, 4, 5, 6, 17])  # row 7: positions -6 .. 38
    q = q.contiguous()
    c = decl.attend(q, kt, v, pad, s0=s0, scale=0.125, backend="c", threads=1)
    for threads in (1, 2):
        a = decl.attend(q, kt, v, pad, s0=s0, scale=0.125, backend=backend, threads=threads)
        assert torch.equal(bits(a), bits(c))
    assert c.isnan().any() and not c[:7].isnan().any() and (bits(c[7, :6]) == 0).all()
    t = decl.attend(q[1:2].contiguous(), kt[1:2].contiguous(), v[1:2].contiguous(), pad[1:2], s0=s0, scale=0.125,
                    backend="torch")
    assert torch.equal(bits(t), bits(c[1:2]))


def reversed_den_attend(q, kt, v, pad, *, s0, scale, backend=None, threads=None):
    """Planted: the declared attention with the keys summed in reverse position order
    (a split-K / reverse-scan decode kernel)."""
    out = torch.zeros_like(q)
    B, T, nh, _ = q.shape
    g = nh // kt.shape[1]
    for b in range(B):
        for t in range(T):
            p = s0 + t - int(pad[b])
            if p < 0:
                continue
            for h in range(nh):
                k = kt[b, h // g, :, int(pad[b]):int(pad[b]) + p + 1]  # [hd, n]
                s = (q[b, t, h] @ k) * scale
                e = decl.exp32(s - s.max())
                acc, den = torch.zeros(64), torch.zeros(())
                for j in reversed(range(p + 1)):
                    den = den + e[j]
                    acc = acc + e[j] * v[b, h // g, int(pad[b]) + j]
                out[b, t, h] = acc / den
    return out


def test_attend_cache_and_slot_invariant():
    """One query's bytes: all T queries at once == one query per call (the cache path),
    and the slots after the last written one (future tokens, slack) may hold anything,
    NaN included: they never enter a sum. Planted: reverse-order sums differ."""
    q, kt, v, pad = attend_case(7)
    full = decl.attend(q, kt, v, pad, s0=5, scale=0.125)
    steps = torch.cat([decl.attend(q[:, t:t + 1].contiguous(), kt, v, pad, s0=5 + t, scale=0.125)
                       for t in range(q.shape[1])], 1)
    assert torch.equal(bits(steps), bits(full))
    kn, vn = kt.clone(), v.clone()
    kn[..., 12:] = math.nan  # slots >= s0 + T = 12 are never written here
    vn[:, :, 12:] = math.nan
    assert torch.equal(bits(decl.attend(q, kn, vn, pad, s0=5, scale=0.125)), bits(full))
    bad = reversed_den_attend(q, kt, v, pad, s0=5, scale=0.125)
    assert not torch.equal(bits(bad), bits(full))


def test_attend_errors():
    q, kt, v, pad = attend_case(0)
    with pytest.raises(ValueError, match=r"pad must be \[B\] = \[3\] int64; got \(2,\)"):
        decl.attend(q, kt, v, torch.tensor([0, 1]), s0=5, scale=0.125)
    with pytest.raises(ValueError, match=r"need pad >= 0 and s0 \+ T \+ 64 <= S_cap = 84; got pad min 0, s0 \+ T = 27"):
        decl.attend(q, kt, v, pad, s0=20, scale=0.125)
    with pytest.raises(ValueError, match=r"q must be torch.float32; got torch.float64"):
        decl.attend(q.double(), kt, v, pad, s0=5, scale=0.125)
    with pytest.raises(ValueError, match=r"expected q \[B, T, nh, 64\]"):
        decl.attend(q[..., :32].contiguous(), kt, v, pad, s0=5, scale=0.125)
    with pytest.raises(ValueError, match=r"backend must be one of .*; got 'cuda'"):
        decl.attend(q, kt, v, pad, s0=5, scale=0.125, backend="cuda")
    with pytest.raises(ValueError, match=r"threads must be a positive int or None; got 0"):
        decl.attend(q, kt, v, pad, s0=5, scale=0.125, threads=0)


def test_body_decls():
    """The declared depths: dot 64, den and acc = the query's key count."""
    d = decl.attend_decl(100)
    assert [(s.name, s.dtype, s.depth) for s in d.sums] == [("dot", "fp32", 64), ("den", "fp32", 100), ("acc", "fp32", 100)]
    assert decl.exp32_decl().op == "exp32" and decl.silu_mul_decl().sums == ()
