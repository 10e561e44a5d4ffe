"""body.c's 16-lane rows (exp32, silu_mul, add_rms_rows32, rope_qkv) against the portable C,
the AVX2 rows, the emulated build and the torch spellings, bit for bit: widths that are not
a multiple of 16 (the masked tail lanes), NaN / inf / subnormal inputs, several seeds, the
aliasing the native step relies on; each comparison shown to go red on a planted variant
that handles the tail lanes by another formula.

Shape legend: n elements, M rows, F FFN width, N rows of a norm, H hidden, B rows, T tokens,
nh / nkv query / KV heads, S cache slots, P positions.
"""

import ctypes
import math

import pytest
import torch
from conftest import bits

from lmtail.glue.norms import inv_rms
from lmtail.kernels.model import body as kbody
from lmtail.model import body as decl
from lmtail.numerics import fma32, sqrt_rn32
from lmtail.orders import lane_totals, strided

pytestmark = pytest.mark.skipif(not kbody.available(), reason="body.c is not built")

SIZES = (1, 7, 15, 16, 17, 31, 33, 100, 577, 1537)
SPECIALS = (math.nan, math.inf, -math.inf, 1e-41, -1e-41, -0.0, 0.0, 88.0, 88.01, -86.0, -86.01, 1e-45)


def rows(table) -> tuple[str, ...]:
    """Every row of `table` that runs here, emulated ones included."""
    return table.names(emulated=True)


def isas() -> list[tuple[str, bool]]:
    """kernels.model.body's (isa, emulated) pairs this machine runs (the emulated build needs SIMDe)."""
    out = [("c", False), ("avx2", False), ("avx512", False)]
    if kbody._emulated() is not None:
        out += [("c", True), ("avx2", True), ("avx512", True)]
    return out


def data(g: torch.Generator, shape, scale: float) -> torch.Tensor:
    """Random fp32 with the special values planted at random places (the tails included)."""
    x = torch.randn(*shape, generator=g) * scale
    flat = x.view(-1)
    where = torch.randint(0, flat.numel(), (min(len(SPECIALS), flat.numel()),), generator=g)
    flat[where] = torch.tensor(SPECIALS[:len(where)])
    flat[-1] = SPECIALS[int(torch.randint(0, len(SPECIALS), (1,), generator=g))]  # the last tail lane
    return x


def all_equal(outs: dict) -> list[str]:
    """Names whose bits differ from the first entry's (an empty list: all equal)."""
    (_, first), *rest = outs.items()
    return [k for k, o in rest if not torch.equal(bits(o), bits(first))]


def tail_by(x: torch.Tensor, y: torch.Tensor, f, width: int = 16) -> torch.Tensor:
    """Planted: y with its last n % width entries of each row replaced by f(x) there (a tail
    handled by another formula); unchanged when n % width == 0."""
    n = x.shape[-1]
    t = n % width
    if not t:
        return y
    y = y.clone()
    y[..., n - t:] = f(x[..., n - t:])
    return y


# ---------------------------------------------------------------------------------------
# exp32, silu_mul: every table row
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exp32_every_row_equal(seed):
    """exp32's rows (c, avx2, avx512, emu-avx512, torch) equal bit for bit at every width.
    Planted: the tail lanes by libm's expf (torch.exp) go red."""
    g = torch.Generator().manual_seed(100 + seed)
    red = 0
    for n in SIZES:
        x = data(g, (n,), 30.0)
        outs = {b: decl.exp32(x, backend=b) for b in rows(decl.EXP32)}
        assert {"c", "avx512"} <= set(outs) and all_equal(outs) == [], (n, all_equal(outs))
        red += not torch.equal(bits(tail_by(x, outs["c"], torch.exp)), bits(outs["c"]))
    assert red >= 2  # the planted tail formula is caught at some widths of every seed


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_silu_mul_every_row_equal(seed):
    """silu_mul's rows equal bit for bit, M rows of odd F (each row's tail masked). Planted:
    the tail lanes as g * sigmoid(g) * u (torch's sigmoid) go red."""
    g = torch.Generator().manual_seed(200 + seed)
    red = 0
    for n in SIZES:
        gu = data(g, (3, 2 * n), 8.0)
        outs = {b: decl.silu_mul(gu, backend=b) for b in rows(decl.SILU_MUL)}
        assert {"c", "avx512"} <= set(outs) and all_equal(outs) == [], (n, all_equal(outs))
        plant = outs["c"].clone()
        t = n % 16
        if t:
            gt, ut = gu[:, n - t:n], gu[:, 2 * n - t:]
            plant[:, n - t:] = gt * torch.sigmoid(gt) * ut
        red += not torch.equal(bits(plant), bits(outs["c"]))
    assert red >= 2


# ---------------------------------------------------------------------------------------
# add_rms_rows32
# ---------------------------------------------------------------------------------------
def canon(t: torch.Tensor) -> torch.Tensor:
    """Every NaN as one pattern (the torch spelling does not declare NaN payloads)."""
    return torch.where(torch.isnan(t), torch.tensor(float("nan")), t)


def norm32_torch(x, r, gamma, lanes: int):
    """add_rms_rows32's declared order in torch (norms.inv_rms is the strided(lanes) sum)."""
    h = x + (torch.zeros(()) if r is None else r)
    return h, (h * inv_rms(h, eps=1e-5, order=strided(lanes))[:, None]) * gamma


def norm32_tail_sequential(x, r, gamma, lanes: int):
    """Planted: the lanes past the last multiple of 16 summed into one chain (lane 0 of the
    last chunk) instead of their own lanes."""
    h = x + (torch.zeros(()) if r is None else r)
    H = h.shape[1]
    t = H % 16
    hs = h.clone()
    if t:
        hs[:, H - t:] = 0
        hs[:, H - t] = (h[:, H - t:] ** 2).sum(1).sqrt()
    return h, (h * inv_rms(hs, eps=1e-5, order=strided(lanes))[:, None]) * gamma


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_add_rms_rows32_every_isa_equal(seed):
    """add_rms_rows32 at every cap (c, avx2 = portable, avx512), native and emulated, equals
    the torch spelling bit for bit: widths around 16 and the lane counts, lanes 32 / 256 / 1024,
    residual or none, inf / NaN / subnormal rows. Planted: a tail summed in one chain goes red."""
    g = torch.Generator().manual_seed(300 + seed)
    red = 0
    for H in (1, 15, 17, 33, 100, 576, 1000, 1537):
        x, r, gam = data(g, (4, H), 2.0), torch.randn(4, H, generator=g), torch.randn(H, generator=g)
        x[1] = 1e-41  # a subnormal row
        for lanes in (32, 256, 1024):
            for res in (r, None):
                want = norm32_torch(x, res, gam, lanes)
                for isa, emu in isas():
                    got = kbody.add_rms_rows32(x, res, gam, 1e-5, lanes, isa, emulated=emu)
                    assert all(torch.equal(bits(canon(a)), bits(canon(b))) for a, b in zip(got, want)), \
                        (H, lanes, isa, emu)
            bad = norm32_tail_sequential(x, r, gam, lanes)[1]
            red += not torch.equal(bits(canon(bad[2:])), bits(canon(want[1][2:])))
    assert red >= 4


@pytest.mark.parametrize("lanes", [32, 256])
def test_add_rms_rows32_tail_chains(lanes):
    """Rows whose sum of squares is decided in the last chunk's masked lanes: only lane 0
    of the first chunk (a) and of the tail chunk (b) are nonzero, so ssq = fma(b, b, a*a),
    one rounding short of a*a + b*b. Every cap equals the torch spelling; planted: the tail
    lane as an unfused multiply and add goes red."""
    g = torch.Generator().manual_seed(11)
    for H in (lanes + 5, 2 * lanes + 17):
        t0 = H - H % lanes  # the tail chunk's first element
        x = torch.zeros(256, H)
        x[:, 0], x[:, t0] = torch.randn(256, generator=g), torch.randn(256, generator=g)
        gam = torch.randn(H, generator=g)
        want = norm32_torch(x, None, gam, lanes)
        for isa, emu in isas():
            got = kbody.add_rms_rows32(x, None, gam, 1e-5, lanes, isa, emulated=emu)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)), (H, isa, emu)
        a, b = x[:, :1], x[:, t0:t0 + 1]
        good, bad = torch.zeros(256, lanes), torch.zeros(256, lanes)  # lane sums
        good[:, :1] = fma32(b, b, a * a)
        bad[:, :1] = a * a + b * b  # planted: the unfused tail
        invs = [inv_of(lane_totals(acc, strided(lanes)), H) for acc in (good, bad)]
        assert torch.equal(bits(invs[0]), bits(inv_rms(x, eps=1e-5, order=strided(lanes))))
        assert not torch.equal(bits(invs[1]), bits(invs[0]))


def inv_of(ssq: torch.Tensor, H: int) -> torch.Tensor:
    """fl32(1 / sqrt(fl32(fl32(ssq / H) + eps))) (eps 1e-5), IEEE ops in fp32 (torch's own
    fp32 sqrt is not correctly rounded on every path: numerics.sqrt_rn32)."""
    d = ssq / torch.full_like(ssq, float(H)) + torch.full_like(ssq, 1e-5)
    return torch.ones_like(d) / sqrt_rn32(d)


def test_add_rms_rows32_aliasing():
    """The native step's calls: h written over x (the first norm) and over r (every other),
    at every cap: the same bytes as separate buffers."""
    g = torch.Generator().manual_seed(7)
    lib = kbody.native_library()
    N, H = 3, 577
    x, r, gam = torch.randn(N, H, generator=g), torch.randn(N, H, generator=g), torch.randn(H, generator=g)
    want = norm32_torch(x, r, gam, 256)
    want0 = norm32_torch(x, None, gam, 256)
    for isa in ("c", "avx512"):
        cap = kbody.ISA_CAP[isa]
        hr, y = r.clone(), torch.empty(N, H)
        assert lib.lmtail_add_rms_rows32(x.data_ptr(), H, hr.data_ptr(), gam.data_ptr(), N, H, ctypes.c_float(1e-5),
                                         256, hr.data_ptr(), y.data_ptr(), cap) == 0
        assert torch.equal(bits(hr), bits(want[0])) and torch.equal(bits(y), bits(want[1])), isa
        hx, y = x.clone(), torch.empty(N, H)
        assert lib.lmtail_add_rms_rows32(hx.data_ptr(), H, None, gam.data_ptr(), N, H, ctypes.c_float(1e-5),
                                         256, hx.data_ptr(), y.data_ptr(), cap) == 0
        assert torch.equal(bits(hx), bits(want0[0])) and torch.equal(bits(y), bits(want0[1])), isa
        assert lib.lmtail_add_rms_rows32(x.data_ptr(), H, None, gam.data_ptr(), N, H, ctypes.c_float(1e-5),
                                         48, hx.data_ptr(), y.data_ptr(), cap) == -3


# ---------------------------------------------------------------------------------------
# rope_qkv
# ---------------------------------------------------------------------------------------
def rope_torch(qkv, cos_t, sin_t, pos, nh: int, nkv: int, S: int, s0: int):
    """rope_qkv in torch (apply_rope on the slices, the cache writes): q, kc, vc."""
    B, T = pos.shape
    qd, kvd = nh * 64, nkv * 64
    cos, sin = cos_t[pos][:, :, None], sin_t[pos][:, :, None]  # [B, T, 1, 32]
    q = decl.apply_rope(qkv[:, :qd].reshape(B, T, nh, 64), cos, sin)
    k = decl.apply_rope(qkv[:, qd:qd + kvd].reshape(B, T, nkv, 64), cos, sin)
    kc, vc = torch.zeros(B, nkv, 64, S), torch.zeros(B, nkv, S, 64)
    kc[:, :, :, s0:s0 + T] = k.permute(0, 2, 3, 1)
    vc[:, :, s0:s0 + T] = qkv[:, qd + kvd:].reshape(B, T, nkv, 64).transpose(1, 2)
    return q.contiguous(), kc, vc


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rope_qkv_every_isa_equal(seed):
    """rope_qkv at every cap, native and emulated, equals the torch spelling bit for bit (q,
    the transposed key cache, the values): NaN / inf / subnormal entries, odd B, T, heads.
    Planted: the last 16 pairs of each head by one fma (fl32(e c - o s) unrounded product) go red."""
    g = torch.Generator().manual_seed(400 + seed)
    cos_t, sin_t = decl.rope_table(300, 64, 10000.0)
    for B, T, nh, nkv in ((1, 1, 9, 3), (3, 2, 4, 2), (2, 5, 3, 1)):
        S, s0 = 40, 7
        qkv = data(g, (B * T, (nh + 2 * nkv) * 64), 4.0)
        pos = torch.randint(0, 300, (B, T), generator=g)
        want = rope_torch(qkv, cos_t, sin_t, pos, nh, nkv, S, s0)
        for isa, emu in isas():
            kc, vc = torch.zeros(B, nkv, 64, S), torch.zeros(B, nkv, S, 64)
            q = kbody.rope_qkv(qkv, cos_t, sin_t, pos, kc, vc, s0, nh, isa, emulated=emu)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip((q, kc, vc), want)), (B, T, isa, emu)
    # planted: the upper 16 pairs of each q head as fl32(fma(e, c, -fl32(o s)))
    q = want[0].view(B * T, nh, 32, 2)
    e, o = qkv[:, :nh * 64].reshape(B * T, nh, 32, 2).unbind(-1)
    c, s = cos_t[pos].reshape(B * T, 1, 32), sin_t[pos].reshape(B * T, 1, 32)
    fused = (e.double() * c.double() - (o * s).double()).float()
    bad = q[..., 0].clone()
    bad[..., 16:] = fused[..., 16:]
    assert not torch.equal(bits(bad), bits(q[..., 0]))
