"""numerics: exact fma emulation, basic-op exp/log, draws, gamma."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import same_bits
from lmtail.numerics import bf16_round, draw_u, exp64, fma32, gamma, log64


def round32_exact(fr: Fraction) -> np.float32:
    """Correct rounding of an exact rational to fp32 (ties to even), the slow way."""
    f = np.float32(float(fr))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - fr), int(np.array(c).view(np.int32)) & 1))


@pytest.mark.parametrize("seed", [0, 1])
def test_fma32_is_correctly_rounded_on_random_data(seed):
    g = torch.Generator().manual_seed(seed)
    a, b, c = (torch.randn(400, generator=g) * s for s in (1.0, 3.0, 1e-3))
    r = fma32(a, b, c)
    for i in range(400):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        assert np.float32(r[i].item()) == round32_exact(exact)


def test_fma32_breaks_float64_midpoints_by_the_lost_bits():
    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24 is an fp32 midpoint; +-2^-80 decides the rounding
    a = torch.tensor([1 + 2**-12] * 3)
    c = torch.tensor([2**-80, -(2**-80), 0.0])
    got = [v.item() for v in fma32(a, a, c)]
    assert got == [1 + 2**-11 + 2**-23, 1 + 2**-11, 1 + 2**-11]
    # planted: the double rounding through float64 gets the first case wrong
    naive = (a.double() * a.double() + c.double()).float()
    assert naive[0].item() != got[0]


def test_fma32_specials_and_subnormals():
    inf, nan = math.inf, math.nan
    r = fma32(torch.tensor([inf, 0.0, 1e-30, 2.0]), torch.tensor([1.0, inf, 1e-15, 3.0]), torch.tensor([1.0, 1.0, 0.0, nan]))
    assert r[0].item() == inf and math.isnan(r[1].item()) and math.isnan(r[3].item())
    assert r[2].item() == float(round32_exact(Fraction(float(np.float32(1e-30))) * Fraction(float(np.float32(1e-15)))))


def test_exp64_log64_accuracy_and_specials():
    x = torch.linspace(-700, 700, 20001, dtype=torch.float64)
    assert ((exp64(x) - torch.exp(x)) / torch.exp(x)).abs().max() < 4e-16
    y = torch.exp(torch.linspace(-700, 700, 20001, dtype=torch.float64))
    assert (log64(y) - torch.log(y)).abs().max() < 1e-15 * 700
    e = exp64(torch.tensor([-math.inf, math.inf, math.nan, -800.0, 0.0], dtype=torch.float64))
    assert e[0] == 0 and e[1] == math.inf and math.isnan(e[2]) and e[3] == 0 and e[4] == 1
    lg = log64(torch.tensor([0.0, 1.0, math.inf, -1.0], dtype=torch.float64))
    assert lg[0] == -math.inf and lg[1] == 0 and lg[2] == math.inf and math.isnan(lg[3])


def test_exp64_bits_do_not_depend_on_the_batch():
    x = torch.linspace(-745, 30, 50001, dtype=torch.float64)  # both 2**n branches
    whole = exp64(x)
    parts = torch.cat([exp64(x[:7]), exp64(x[7:30001]), exp64(x[30001:])])
    assert torch.equal(whole.view(torch.int64), parts.view(torch.int64))


def test_draws_are_in_range_and_uniform_ish():
    u = draw_u(np.arange(20000), 3)
    assert u.dtype == np.float32 and (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.01
    assert (u * 2**24 == np.round(u * 2**24)).all()  # 24-bit grid: exact in fp32
    assert draw_u(5, 1) != draw_u(5, 2) and draw_u(5, 1) != draw_u(6, 1)


def test_gamma_and_bf16_round():
    assert gamma(10, 2**-24) == pytest.approx(10 * 2**-24, rel=1e-6)
    assert gamma(2**24, 2**-24) == math.inf
    assert bf16_round(torch.tensor([1 + 2**-8])).item() == 1.0  # tie to even
    assert bf16_round(torch.tensor([1 + 3 * 2**-8])).item() == 1 + 2**-6


def _rounded_to_nearest(r: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """[N] bool: fp32 r is the fp32 nearest to sqrt(d): the midpoints to r's neighbours
    bracket sqrt(d) (squares of 25-bit midpoints are exact in float64)."""
    inf = torch.full_like(r, math.inf)
    r64, d64 = r.double(), d.double()
    up = torch.nextafter(r, inf).double()
    down = torch.nextafter(r, -inf).double()
    return (((r64 + down) / 2) ** 2 <= d64) & (d64 <= ((r64 + up) / 2) ** 2)


def test_sqrt_rn32_is_correctly_rounded():
    from lmtail.numerics import sqrt_rn32
    g = torch.Generator().manual_seed(0)
    d = torch.rand(200000, generator=g) * 100
    r = sqrt_rn32(d)
    assert _rounded_to_nearest(r, d).all()
    # planted: d * rsqrt(d) (two fp32 roundings) misses on some inputs; one ulp up on one
    # element is caught on its own
    assert not _rounded_to_nearest(d * torch.rsqrt(d), d).all()
    nudged = r.clone()
    nudged[123] = torch.nextafter(nudged[123], torch.tensor(math.inf))
    assert int((~_rounded_to_nearest(nudged, d)).sum()) == 1
    s = sqrt_rn32(torch.tensor([0.0, -0.0, math.inf, -1.0, math.nan, 1e-45]))
    assert s[0].item() == 0 and math.copysign(1, s[1].item()) == -1 and s[2].item() == math.inf
    assert math.isnan(s[3].item()) and math.isnan(s[4].item()) and s[5].item() == float(np.float32(math.sqrt(float(np.float32(1e-45)))))


def test_exp64_empty():
    assert exp64(torch.zeros(0, dtype=torch.float64)).numel() == 0


def test_sum_decl_underflow_slack_follows_flush_and_roundings():
    """SumDecl.underflow(): 2 * roundings * (smallest normal under flush, else half the
    subnormal spacing); roundings default to the depth. Planted: the flush flag is read
    (the same sum without it is 2^24 times smaller)."""
    from lmtail.numerics import SumDecl

    amx = SumDecl("gemm", "fp32", 107, "amx32", flush=True, roundings=34 * 90)
    assert amx.underflow() == 2 * 3060 * 2.0**-126
    assert SumDecl("gemm", "fp32", 2880, "chain").underflow() == 2 * 2880 * 2.0**-150
    ieee = SumDecl("gemm", "fp32", 107, "amx32", roundings=34 * 90)
    assert amx.underflow() == ieee.underflow() * 2.0**24
    assert SumDecl("s", "fp16", 4, "x", flush=True).underflow() == 2 * 4 * 2.0**-14
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=rf"roundings must be an int >= 0 or None; got {bad}"):
            SumDecl("s", "fp32", 1, "x", roundings=bad)


def test_bits_tell_what_equality_does_not():
    """The shared bit views (tests/conftest.py). Planted: values == says equal, the bit views do not (-0.0 vs +0.0, NaN payloads)."""
    z = torch.tensor([0.0, -0.0])
    assert z[0] == z[1] and not same_bits(z[:1], z[1:])
    n = torch.tensor([0x7FC00000, 0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert not same_bits(n[:1], n[1:]) and same_bits(n, n.clone())
    assert not same_bits(z.to(torch.bfloat16), z.to(torch.float16)) and same_bits(None, None)
