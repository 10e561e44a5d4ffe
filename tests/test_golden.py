"""Golden bytes: every op's outputs on fixed seeded inputs, pinned by the sha256 of their
bit views, and inputs placed on bf16 rounding boundaries so a one-ulp fp32 change in a
declared order flips a bf16 output.

No golden digest depends on an op's order constant (the boundary tests build their inputs
from a literal strided(256) and the independent scalar emulation): the goldens were taken
from the ops as declared (the tail: ssq in strided(256), the GEMM in both declared orders,
named explicitly: "chain" (the sequential fp32 chain) and "amx32" (AMX's block order, the
default); the norms: strided(256); the router: slice order, sum in the returned order), so
a change of any declared order, rounding point or tie rule changes a digest. A changed
digest is either a bug or a change of declaration, and then the golden moves with the
declaration on purpose (print the new digests with `python tests/test_golden.py`).

Inputs come from numpy's default_rng (stable across versions and machines) and are
exactly representable in their dtypes. Digests cover dtype, shape and every bit
(int16/int32/int64 views), NaN payloads included.

Shape legend: T rows, H width, S slots, K slices, E experts, V vocab, R rows, k chosen.
"""
from __future__ import annotations

import functools
import hashlib
import sys

import numpy as np
import pytest
import torch

from lmtail.norms import add_rms, moe_add_rms, rms_parts
from lmtail.orders import strided
from lmtail.reference.glue import emu_inv_rms
from lmtail.router import router_topk
from lmtail.tail import decode_tail, rows_tail
from lmtail.topk import exact_topk

_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


def digest(*tensors: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of the dtypes, shapes and bit patterns of tensors."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous()
        v = t.view(_VIEW[t.dtype]) if t.dtype in _VIEW else t
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(v.numpy().tobytes())
    return h.hexdigest()[:16]


def _bf16(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16)


def _f32(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32).copy())


# ---------------------------------------------------------------------------------------
# fixed inputs and the ops' outputs
# ---------------------------------------------------------------------------------------
def _tail_inputs(seed: int = 0, gbs: int = 7, h: int = 600, v: int = 300):
    """Hidden rows with two x20 lanes, gamma ~ 1 +- 0.3 (fp32), w ~ N(0, 1/H) (bf16)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((gbs, h))
    x[:, [7, h // 2 + 11]] *= 20
    gamma = 1 + 0.3 * rng.standard_normal(h)
    w = rng.standard_normal((h, v)) / np.sqrt(h)
    return _f32(x), _f32(gamma), _bf16(w)


def _sp(rows) -> torch.Tensor:
    """[R, 5] fp32 (top_k, top_p, temperature, u, min_p)."""
    return torch.tensor(rows, dtype=torch.float32)


SP = _sp([[0, 1, 0, 0.5, 0], [0, 1, 1, 0.3, 0], [40, 0.9, 0.7, 0.8, 0], [5, 1, 1.5, 0.05, 0],
          [0, 0.5, 1, 0.99, 0.05], [16, 0.95, 0.3, 0.6, 0],
          [0, 1, 2e-5, 0.9, 0]])  # T = 2e-5: samples (just above the greedy threshold 1e-5)


def outputs() -> dict:
    """{name: digest} of every op on its fixed inputs."""
    out = {}
    x, gamma, w = _tail_inputs()
    for order in ("chain", "amx32"):  # the chain's digests keep their names from before amx32
        for deferred in (True, False):
            t = decode_tail(x, gamma, w, k=16, sampling_params=SP, deferred_rms=deferred, eps=1e-5,
                            hidden_actual=600, zero_interleaved_pad=False, gemm_order=order)
            tag = ("" if order == "chain" else "amx32.") + ("deferred" if deferred else "legacy")
            out[f"decode_tail.{tag}.logits"] = digest(t.logits)
            out[f"decode_tail.{tag}.topk"] = digest(t.topk_values, t.topk_indices)
            out[f"decode_tail.{tag}.tokens_logprobs"] = digest(t.tokens, t.logprobs, t.truncated)
    # many rows, H = 640 (fp32 ssq chains of 3 per lane): a one-ulp ssq change moves the
    # fp32 logits of a good share of 1,024 rows
    xm, gm, wm = _tail_inputs(seed=9, gbs=1024, h=640, v=8)
    out["decode_tail.1024_rows.logits"] = digest(decode_tail(xm, gm, wm, k=1, hidden_actual=640,
                                                             zero_interleaved_pad=False, gemm_order="chain").logits)
    rng = np.random.default_rng(1)
    xs, res = _bf16(rng.standard_normal((5, 700)) * 2), _bf16(rng.standard_normal((5, 700)))
    g = _bf16(1 + 0.25 * rng.standard_normal(700))
    out["add_rms"] = digest(*add_rms(xs, res, g, eps=1e-5))
    slots = _bf16(rng.standard_normal((8, 5, 700)) * 0.5)
    wts = _f32(rng.uniform(0.1, 0.9, (5, 6)))
    out["moe_add_rms.bf16_slots"] = digest(*moe_add_rms(xs, slots, wts, g, eps=1e-5, n_shared=2))
    out["moe_add_rms.fp32_slots"] = digest(*moe_add_rms(xs, slots.float() * 1.001, wts, g, eps=1e-5, n_shared=2))
    xp = _bf16(rng.standard_normal((4, 1024)) * 3)
    gp = _bf16(1 + 0.25 * rng.standard_normal(1024))
    for rounding in ("once", "mlx"):
        out[f"rms_parts.{rounding}"] = digest(rms_parts(xp, gp, part=512, rounding=rounding, eps=1e-5))
    sl = np.stack([rng.standard_normal((7, 128)) * 2, rng.standard_normal((7, 128)) * 0.5])
    sl[:, 5, :] = 0.25  # every expert tied: ids 0..5
    sl[0, 6, ::3] = 4.0  # 43 tied at the top: the lowest ids
    sl = _f32(sl)
    ids, wr = router_topk(sl, k=6, scale=2.5)
    out["router_topk"] = digest(ids, wr)
    ids, wr = router_topk(sl, k=6, bias=_f32(rng.standard_normal(128) * 0.1), scale=2.5)
    out["router_topk.bias"] = digest(ids, wr)
    rows = _bf16(rng.standard_normal((5, 3000)) * 2)  # bf16 ties are common at V = 3000
    vals, idx = exact_topk(rows, k=64, chunk=512)[:2]
    out["exact_topk"] = digest(vals, idx)
    srows, ssp = _sampler_rows()
    t = rows_tail(srows, k=32, sampling_params=ssp)
    out["rows_tail.sampler"] = digest(*(_field(t, f) for f in ("tokens", "logprobs", "truncated")))
    return out


def _field(out, name):
    return out[name] if isinstance(out, dict) else getattr(out, name)


def _sampler_rows():
    """bf16 rows [8, 500] with a tied top pair (ids 40 and 41) and params at the edges:
    greedy, temperatures just above the greedy threshold (they sample the tie), top-p and
    min-p cuts, top_k > k (truncated)."""
    rng = np.random.default_rng(3)
    rows = rng.standard_normal((8, 500)) * 2
    rows[:, 40] = rows[:, 41] = rows.max(1) + 1
    sp = _sp([[0, 1, 0, 0.9, 0], [0, 1, 2e-5, 0.9, 0], [0, 1, 5e-4, 0.3, 0], [2, 1, 1, 0.75, 0],
              [0, 0.6, 0.8, 0.5, 0], [0, 1, 1.3, 0.7, 0.05], [40, 1, 1, 0.2, 0], [8, 0.9, 0.5, 0.99, 0]])
    return _bf16(rows), sp


GOLDEN = {  # taken at the commit before this file was added (x86-64, the default backends)
    "decode_tail.deferred.logits": "202fc4584755e659",
    "decode_tail.deferred.topk": "f9f84dff47cc2a6a",
    "decode_tail.deferred.tokens_logprobs": "cd188a5d15bfbdff",
    "decode_tail.legacy.logits": "4f4d8635c1b6d5b9",
    "decode_tail.legacy.topk": "472f83b964af9fa7",
    "decode_tail.legacy.tokens_logprobs": "ba56b2453b0d862a",
    # gemm_order="amx32" (taken when it became the default; the top-k sets and the legacy
    # tokens happen to equal the chain's here, the logits do not)
    "decode_tail.amx32.deferred.logits": "91e9750f2b5fc035",
    "decode_tail.amx32.deferred.topk": "f9f84dff47cc2a6a",
    "decode_tail.amx32.deferred.tokens_logprobs": "737023d5261c5065",
    "decode_tail.amx32.legacy.logits": "e36120bb35ae5358",
    "decode_tail.amx32.legacy.topk": "472f83b964af9fa7",
    "decode_tail.amx32.legacy.tokens_logprobs": "ba56b2453b0d862a",
    "decode_tail.1024_rows.logits": "fdb62d06355c960d",
    "add_rms": "a096ae926f8c763e",
    "moe_add_rms.bf16_slots": "9ce44c60f05ad62b",
    "moe_add_rms.fp32_slots": "969a26da93efc906",
    "rms_parts.once": "570309675a1d0676",
    "rms_parts.mlx": "ef9389eed8832442",
    "router_topk": "90ab04ccf369fd06",
    "router_topk.bias": "0de9bfa328799314",
    "exact_topk": "4f1bfef0011e1a09",
    "rows_tail.sampler": "50feb05c0376f391",
}


@pytest.fixture(scope="module")
def got():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return outputs()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_bytes(got, name):
    assert got[name] == GOLDEN[name], f"{name}: digest {got[name]}, golden {GOLDEN[name]}"


def test_every_output_has_a_golden(got):
    assert sorted(got) == sorted(GOLDEN)


def test_digest_sees_one_bit():
    """Planted: one flipped low bit of one fp32 logit (or one id) changes the digest."""
    x, gamma, w = _tail_inputs(gbs=2, h=64, v=40)
    t = decode_tail(x, gamma, w, k=4, hidden_actual=64, zero_interleaved_pad=False)
    bits = t.logits.view(torch.int32).clone()
    bits[1, 17] ^= 1
    assert digest(bits.view(torch.float32)) != digest(t.logits)
    assert digest(t.topk_indices) != digest(t.topk_indices.flip(-1))


# ---------------------------------------------------------------------------------------
# bf16 rounding boundaries: y = bf16(fl32(t * gamma)) placed one fp32 ulp off a midpoint
# ---------------------------------------------------------------------------------------
def _boundary_gamma(t32: np.ndarray, rng) -> np.ndarray:
    """fp32 gamma [H] near 1 with fl32(t * gamma) one fp32 ulp above (even lanes) or below
    (odd lanes) a bf16 midpoint, where t = fl32(h * inv) of the declared inv."""
    g0 = (1 + 0.25 * rng.standard_normal(t32.size)).astype(np.float32)
    p = (t32.astype(np.float64) * g0).astype(np.float32)
    bits = p.view(np.int32)
    mid = ((bits & ~np.int32(0xFFFF)) | np.int32(0x8000)).view(np.float32)  # the midpoint above p's bf16
    step = np.where(np.arange(t32.size) % 2 == 0, 1, -1).astype(np.int32)
    target = (mid.view(np.int32) + step).view(np.float32)  # sign-magnitude: +1 is one ulp larger |.|
    with np.errstate(divide="ignore", invalid="ignore"):
        best = np.where(t32 != 0, target.astype(np.float64) / t32, g0).astype(np.float32)
    for lane in np.nonzero(t32)[0]:  # the fp32 gamma whose product lands on the target
        cands = best[lane] + np.arange(-4, 5) * np.spacing(best[lane])
        prods = (np.float64(t32[lane]) * cands.astype(np.float32)).astype(np.float32)
        best[lane] = cands[np.argmin(np.abs(prods.astype(np.float64) - target[lane]))]
    return best


@functools.lru_cache(maxsize=None)
def _boundary_case(h: int = 512, rows: int = 16):
    """x (bf16), residual = 0, so h = x; the declared inv of each row emulated in the
    declared order strided(256) (reference scalar loop); gamma placed on boundaries."""
    rng = np.random.default_rng(5)
    x = _bf16(rng.standard_normal((rows, h)))
    h32 = x.float().numpy()
    inv = np.array([emu_inv_rms(r, n=h, eps=1e-5, lanes=256, vec=1) for r in h32], np.float32)
    t = (h32 * inv[:, None]).astype(np.float32)  # [T, H] fp32 (one rounding: exact product in float64)
    gamma = np.stack([_boundary_gamma(t[i], rng) for i in range(rows)])  # one gamma per row
    return x, inv, t, gamma


def _y_from(t32: np.ndarray, gamma: np.ndarray) -> torch.Tensor:
    return _f32((t32.astype(np.float64) * gamma).astype(np.float32)).to(torch.bfloat16)


def test_boundary_inputs_pin_the_declared_order():
    """add_rms in its default order on boundary inputs: y is exactly
    bf16(fl32(fl32(h * inv) * gamma)) with inv emulated in the declared strided(256), and a
    one-ulp change of inv (a planted variant) flips many of its lanes."""
    x, inv, t, gamma = _boundary_case()
    zero = torch.zeros_like(x)
    ys = torch.stack([add_rms(x[i:i + 1], zero[i:i + 1], _f32(gamma[i]), eps=1e-5)[1][0]
                      for i in range(x.shape[0])])  # [T, H]
    want = _y_from(t, gamma)
    assert torch.equal(ys.view(torch.int16), want.view(torch.int16))
    for direction in (np.inf, -np.inf):  # planted: inv one fp32 ulp up / down
        inv1 = np.nextafter(inv, np.float32(direction))
        t1 = (x.float().numpy() * inv1[:, None]).astype(np.float32)
        flipped = (_y_from(t1, gamma).view(torch.int16) != want.view(torch.int16)).sum().item()
        assert flipped >= 0.1 * want.numel(), (direction, flipped)


def test_tail_legacy_boundary_inputs():
    """decode_tail(deferred_rms=False) with W = I (so the logits ARE the bf16 GEMM input a)
    and gamma placed so fl32(fl32(x * rms) * gamma) sits one ulp off a bf16 midpoint, with
    rms emulated in the declared order strided(256) and the declared rounding chain: a is
    exactly bf16 of that, and a one-ulp change of rms (planted) flips many lanes."""
    h = 256
    rng = np.random.default_rng(11)
    x = _f32(rng.standard_normal((4, h)) * 3)
    rms = np.array([emu_inv_rms(r, n=h, eps=1e-5, lanes=256, vec=1) for r in x.numpy()], np.float32)
    t = (x.numpy().astype(np.float64) * rms[:, None]).astype(np.float32)  # fl32(x * rms)
    gamma = np.stack([_boundary_gamma(t[i], rng) for i in range(4)])
    eye = torch.eye(h).to(torch.bfloat16)
    got = torch.cat([decode_tail(x[i:i + 1], _f32(gamma[i]), eye, k=1, deferred_rms=False, eps=1e-5,
                                 hidden_actual=h, zero_interleaved_pad=False).logits for i in range(4)])
    want = _y_from(t, gamma)
    assert torch.equal(got.to(torch.bfloat16).view(torch.int16), want.view(torch.int16))
    assert torch.equal(got, want.float())  # the identity GEMM is exact
    for direction in (np.inf, -np.inf):
        t1 = (x.numpy().astype(np.float64) * np.nextafter(rms, np.float32(direction))[:, None]).astype(np.float32)
        flipped = int((_y_from(t1, gamma).view(torch.int16) != want.view(torch.int16)).sum())
        assert flipped >= 0.1 * want.numel(), (direction, flipped)


def test_boundary_inputs_see_another_order():
    """The same boundary inputs run in other orders (contiguous(256), the placebo butterfly,
    strided(128)): y differs in exactly the rows whose inv differs by an ulp, so a one-ulp
    change of the declared order cannot hide behind the bf16 rounding."""
    from lmtail.norms import inv_rms
    from lmtail.orders import contiguous, placebo

    x, inv, t, gamma = _boundary_case()
    want = _y_from(t, gamma).view(torch.int16)
    zero = torch.zeros_like(x)
    seen = 0
    for order in (contiguous(256), placebo(strided(256)), strided(128)):
        ys = torch.stack([add_rms(x[i:i + 1], zero[i:i + 1], _f32(gamma[i]), eps=1e-5, order=order)[1][0]
                          for i in range(x.shape[0])])
        inv_rows = inv_rms(x.float(), eps=1e-5, order=order).view(torch.int32) != _f32(inv).view(torch.int32)
        y_rows = (ys.view(torch.int16) != want).any(-1)
        assert torch.equal(y_rows, inv_rows), order.name
        seen += int(inv_rows.sum())
    assert seen >= 2  # the orders do differ on these rows (else this test proves nothing)


if __name__ == "__main__":
    torch.set_num_threads(1)
    for k, v in outputs().items():
        print(f'    "{k}": "{v}",')
    sys.exit(0)
