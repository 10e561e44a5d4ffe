"""Golden bytes: every op's outputs on fixed seeded inputs, pinned by the sha256 of their
bit views, and inputs placed on bf16 rounding boundaries so a one-ulp fp32 change in a
declared order flips a bf16 output.

No golden digest depends on an op's order constant (the boundary tests build their inputs
from a literal strided(256) and the independent scalar emulation): the goldens were taken
from the ops as declared (the tail: ssq in strided(256), the GEMM in each declared order,
named explicitly: "chain" (the sequential fp32 chain), "amx32" (AMX's block order, the
default) and "dp32" (VDPBF16PS's order); the norms: strided(256); the router: slice order,
sum in the returned order), so a change of any declared order, rounding point or tie rule
changes a digest. A changed digest is either a bug or a change of declaration, and then
the golden moves with the declaration on purpose (print the new digests with `python tests/test_golden.py`).

Inputs come from numpy's default_rng (stable across versions and machines) and are
exactly representable in their dtypes. Digests cover dtype, shape and every bit
(int16/int32/int64 views), NaN payloads included.

Shape legend: T rows, H width, S slots, K slices, E experts, V vocab, R rows, k chosen.
"""
from __future__ import annotations

import functools
import hashlib
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lmtail.kernels.tail import rows_tail as fused
from lmtail.kernels.gemm.bf16 import gemm_bf16
from lmtail.kernels.quant.gemm_q import QuantWeight, gemm_q
from lmtail.kernels.tail.rowmass import row_mass
from lmtail.kernels.tail.rows_tail import rows_tail_decl
from lmtail.model import body
from lmtail.numerics import log64, log64_constants
from lmtail.glue.norms import add_rms, moe_add_rms, rms_parts
from lmtail.orders import strided
from lmtail.reference.glue import emu_inv_rms
from lmtail.glue.router import router_topk
from lmtail.tail.compose import decode_tail, rows_tail
from lmtail.tail.topk import exact_topk

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
    for order in ("chain", "amx32", "dp32"):  # the chain's digests keep their names from before amx32
        for deferred in (True, False):
            t = decode_tail(x, gamma, w, k=16, sampling_params=SP, deferred_rms=deferred, eps=1e-5,
                            hidden_actual=600, zero_interleaved_pad=False, gemm_order=order, exchange="mirror")
            tag = ("" if order == "chain" else f"{order}.") + ("deferred" if deferred else "legacy")
            out[f"decode_tail.{tag}.logits"] = digest(t.logits)
            out[f"decode_tail.{tag}.topk"] = digest(t.topk_values, t.topk_indices)
            out[f"decode_tail.{tag}.tokens_logprobs"] = digest(t.tokens, t.logprobs, t.truncated)
    # the candidates exchange (the default): fp32 top-k, the merged masses, the sampler on them;
    # head_input="bf16x2": the split activation's logits
    t = decode_tail(x, gamma, w, k=16, sampling_params=SP, eps=1e-5, hidden_actual=600, zero_interleaved_pad=False,
                    exchange="candidates", debug_taps=True)
    out["decode_tail.candidates.topk"] = digest(t.topk_values, t.topk_indices, t.taps["outside"])
    out["decode_tail.candidates.mass"] = digest(*(t.taps[f] for f in ("m1", "S1", "mT", "ST")))
    out["decode_tail.candidates.tokens_logprobs"] = digest(t.tokens, t.logprobs, t.truncated)
    out["decode_tail.bf16x2.logits"] = digest(decode_tail(x, gamma, w, k=1, eps=1e-5, hidden_actual=600,
                                                          zero_interleaved_pad=False, head_input="bf16x2").logits)
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
    out.update(body_outputs())
    return out


def _readout_rows(r=8, v=1024):
    """Greedy rows whose logprob is -(lse1 - 1) to the bit (S1 - 1 < 2^-28, vmax = 1):
    they pin the fused kernel's float64 mass (tests/test_contract.py explains)."""
    rng = np.random.default_rng(4)
    rows = np.full((r, v), -np.inf)
    for i in range(r):
        top = int(rng.integers(0, 256))
        rows[i, top] = 1.0
        lanes = np.concatenate([top + 128 * np.arange(1, v // 128), rng.integers(0, v, 24)]) % v
        rows[i, lanes[lanes != top]] = 1.0 - rng.uniform(22, 26, lanes[lanes != top].size)
    return _bf16(rows)


def body_outputs() -> dict:
    """{name: digest} of the model body's declared ops (and the full-row mass) on fixed inputs."""
    out = {}
    rng = np.random.default_rng(20)
    x = _f32(np.concatenate([rng.standard_normal(3000) * 30, rng.uniform(-86, 88, 3000),
                             [0.0, -0.0, 88.0, 88.01, -86.0, -86.01, 1e-30, -1e-40, 100.0, -100.0, np.inf, -np.inf]]))
    out["body.exp32"] = digest(body.exp32(x))
    gu = _f32(np.concatenate([rng.standard_normal((16, 300)) * 6, rng.standard_normal((16, 300)) * 3], 1))
    out["body.silu_mul"] = digest(body.silu_mul(gu))
    out["body.silu_mul_bf16"] = digest(body.silu_mul_bf16(gu))
    out["body.rope_table.8192x64.1e5"] = digest(*body.rope_table(8192, 64, 1e5))
    out["body.rope_table.300x64.1e4"] = digest(*body.rope_table(300, 64, 1e4))
    cos, sin = body.rope_table(8192, 64, 1e5)
    xr = _f32(rng.standard_normal((2, 16, 3, 64)) * 2)
    out["body.apply_rope"] = digest(body.apply_rope(xr, cos[8000:8016, None], sin[8000:8016, None]))
    q, kt = _f32(rng.standard_normal((3, 7, 9, 64)) * 2), _f32(rng.standard_normal((3, 3, 64, 5 + 7 + 64)))
    v = _f32(rng.standard_normal((3, 3, 5 + 7 + 64, 64)))
    out["body.attend"] = digest(body.attend(q, kt, v, torch.tensor([0, 4, 2]), s0=5, scale=0.125))
    xa, ra = _f32(rng.standard_normal((9, 576)) * 3), _bf16(rng.standard_normal((9, 576)))
    ga = _bf16(1 + 0.25 * rng.standard_normal(576)).float()
    out["body.add_rms_rows"] = digest(*body.add_rms_rows(xa, ra, ga, eps=1e-5, lanes=256))
    rows = _readout_rows()
    t = rows_tail(rows, k=4, sampling_params=_sp([[0, 1, 0, 0.5, 0]] * rows.shape[0]))
    out["rows_tail.readout_logprobs"] = digest(t.tokens, t.logprobs)
    mrows = _bf16(rng.standard_normal((6, 3000)) * 4).double()
    out["row_mass"] = digest(*row_mass(mrows, torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5], dtype=torch.float64)))
    # [8, 1000] N(0, 2): many terms near the max with |r| ~ ln2/2, where exp64's high
    # coefficients show in S1's last bits (the per-lane vector exp64)
    wide = _bf16(np.random.default_rng(7).standard_normal((8, 1000)) * 2)
    out["rows_tail.debug_mass"] = digest(_fused_mass(rows), _fused_mass(wide))
    out.update(quant_outputs())
    out.update(dp32_outputs())
    return out


def _fused_mass(rows) -> torch.Tensor:
    """[R, 3] float64 S1, lse1, nz at T = 1: the fused kernel's own (debug_mass export), or
    where it is not built row_mass's torch backend (bit-equal: tests/test_rows_tail.py)."""
    r = rows.shape[0]
    if fused.available_backends():
        sp = _sp([[0, 1, 0.7, 0.5, 0]] * r)
        return fused.rows_tail_fused(rows, k=1, sampling_params=sp, debug_mass=True).debug_mass
    m, s, nz = row_mass(rows.double(), torch.ones(r, dtype=torch.float64), backend="torch")
    return torch.stack([s, m + log64(s), nz.double()], 1)


def _quant_weight(fmt: str, n: int, k: int, rng) -> QuantWeight:
    """A weight [N, K] written byte by byte (no quantizer): Q8_0 d in [2^-9, 2^-6], q any
    int8; Q4_1 d the same, m in [-2^-3, 0], any nibbles."""
    nb = n * k // 32
    d = rng.uniform(2.0**-9, 2.0**-6, (nb, 1)).astype(np.float16).view(np.uint8)  # [NB, 2]
    if fmt == "Q8_0":
        blocks = np.concatenate([d, rng.integers(-127, 128, (nb, 32)).astype(np.int8).view(np.uint8)], 1)
    else:
        m = (-rng.uniform(0, 2.0**-3, (nb, 1))).astype(np.float16).view(np.uint8)
        blocks = np.concatenate([d, m, rng.integers(0, 256, (nb, 16)).astype(np.uint8)], 1)
    return QuantWeight(fmt, (n, k), torch.from_numpy(np.ascontiguousarray(blocks).reshape(n, -1)))


def quant_outputs() -> dict:
    """gemm_q's output bits per format on fixed activations (with subnormal and zero lanes)."""
    rng = np.random.default_rng(30)
    a = rng.standard_normal((5, 256)) * 2
    a[1, ::5], a[2, :64] = 0.0, rng.standard_normal(64) * 2.0**-130  # zeros; subnormal products
    a = _f32(a)
    return {f"gemm_q.{f.lower()}": digest(gemm_q(a, _quant_weight(f, 37, 256, rng))) for f in ("Q8_0", "Q4_1")}


def dp32_outputs() -> dict:
    """gemm_bf16(order="dp32")'s output bits on fixed data: random (H = 2880, 61), special
    values (NaN, +-inf, subnormals), products around 2^-126 (FTZ decides)."""
    rng = np.random.default_rng(31)
    a, w = _bf16(rng.standard_normal((7, 2880))), _bf16(rng.standard_normal((2880, 45)) * 0.05)
    s_a, s_w = _bf16(rng.standard_normal((5, 61))), _bf16(rng.standard_normal((61, 33)))
    s_a.view(torch.int16)[0, ::7], s_w.view(torch.int16)[::5, 3] = 0x7F80, 0x0041  # +inf; subnormals
    s_a.view(torch.int16)[2, 4], s_w[6, ::2] = 0x7FC1, 0.0  # a NaN; zeros (inf * 0)
    u_a, u_w = _bf16(rng.standard_normal((4, 260)) * 2.0**-62), _bf16(rng.standard_normal((260, 17)) * 2.0**-62)
    return {"gemm_bf16.dp32": digest(*(gemm_bf16(x, y, order="dp32")
                                       for x, y in ((a, w), (s_a, s_w), (u_a, u_w))))}


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
    # gemm_order="dp32" (taken when the tail took it; the top-k sets and tokens equal
    # amx32's here, the logits do not)
    "decode_tail.dp32.deferred.logits": "81dea2ed901c9b15",
    "decode_tail.dp32.deferred.topk": "f9f84dff47cc2a6a",
    "decode_tail.dp32.deferred.tokens_logprobs": "737023d5261c5065",
    "decode_tail.dp32.legacy.logits": "b37858a028033ba6",
    "decode_tail.dp32.legacy.topk": "472f83b964af9fa7",
    "decode_tail.dp32.legacy.tokens_logprobs": "ba56b2453b0d862a",
    # exchange="candidates" (the default since it was added) and head_input="bf16x2"
    "decode_tail.candidates.topk": "b461bb8cd0acf10d",
    "decode_tail.candidates.mass": "94b5935bc081961b",
    "decode_tail.candidates.tokens_logprobs": "c86052c1ab458d30",
    "decode_tail.bf16x2.logits": "4d7c0b4c961d01bd",
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
    # the model body's declared ops and the full-row mass (taken when they became contract
    # kinds; the same digests on the C and the torch backends)
    "body.exp32": "a374cac05ed750e6",
    "body.silu_mul": "d2be4dc4354e7d3b",
    "body.silu_mul_bf16": "dd6ac062a3b5f0a7",
    "body.rope_table.8192x64.1e5": "c50d9edce73d6147",
    "body.rope_table.300x64.1e4": "f846404faf0f5dd5",
    "body.apply_rope": "ba37b512a441f316",
    "body.attend": "b7cf1ae02628f7d9",
    "body.add_rms_rows": "c5f8676fa7c6e428",
    "rows_tail.readout_logprobs": "593971a4dfd0503b",
    "row_mass": "664e40841945e17f",
    # the fused kernel's own float64 S1, lse1, nz (debug_mass export; row_mass's torch
    # backend gives the same bytes) and gemm_q per format (taken when they were added)
    "rows_tail.debug_mass": "fc7fbad86a5f50d0",
    "gemm_q.q8_0": "b168dd617048f98d",
    "gemm_q.q4_1": "ef5a24bd48eb256c",
    # gemm_bf16 in the dp32 order (taken when it was added; the avx2 and c backends and
    # reference.gemm.gemm_dp32_emulation give the same bytes)
    "gemm_bf16.dp32": "afbe51fe2a8c88d6",
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


def test_rope_table_bytes_are_pinned():
    """Planted: one entry of the rope table one ulp off (inside the declared ROPE_ULP bound,
    so no range check sees it) changes the pinned digest."""
    cos, sin = body.rope_table(8192, 64, 1e5)
    assert digest(cos, sin) == GOLDEN["body.rope_table.8192x64.1e5"]
    bad = sin.clone()
    bad[4321, 7] = torch.nextafter(bad[4321, 7], torch.tensor(math.inf))
    assert digest(cos, bad) != GOLDEN["body.rope_table.8192x64.1e5"]


# ---------------------------------------------------------------------------------------
# C constants against their Python declarations (the C files found by what they define)
# ---------------------------------------------------------------------------------------
SRC = Path(__file__).resolve().parents[1] / "src"


def c_source(defines: str) -> str:
    """The text of the one C file under src/ that defines `defines` (a function name), with
    the headers of its own folder it includes (e.g. model/exp32.h) after it."""
    hits = [p for p in SRC.rglob("*.c") if re.search(rf"\b{re.escape(defines)}\s*\(", p.read_text())]
    assert len(hits) == 1, f"{defines} is defined in {hits}"
    text = hits[0].read_text()
    local = [hits[0].parent / n for n in re.findall(r'#include "([^"/]+)"', text)]
    return "\n".join([text] + [h.read_text() for h in local if h.is_file() and h.parent != SRC / "lmtail" / "kernels"])


def exp32_constants(text: str) -> dict:
    """{name: value} of exp32's constants as a C file spells them (hex or decimal floats)."""
    num = r"(-?(?:0x[0-9a-fA-F.]+p[-+]?\d+|\d+\.\d*))f"
    val = lambda t: float.fromhex(t) if "0x" in t else float(t)  # noqa: E731
    out = {n: val(m) for n, m in re.findall(rf"\b(LOG2E|RND|LN2_HI|LN2_LO|X_HI|X_LO)\s*=\s*{num}", text)}
    body_ = re.search(r"static const float C\[8\]\s*=\s*\{([^}]*)\}", text).group(1)
    out["C"] = tuple(val(t) for t in re.findall(num, body_))
    return out


def exp32_mismatches(text: str) -> list[str]:
    c = exp32_constants(text)
    py = {n: float(getattr(body, n)) for n in ("LOG2E", "RND", "LN2_HI", "LN2_LO", "X_HI", "X_LO")}
    py["C"] = tuple(float(v) for v in body.EXP_C)
    return [f"{n}: C {c.get(n)!r}, Python {v!r}" for n, v in py.items() if c.get(n) != v]


def test_c_exp32_constants_equal_the_python_declaration():
    """The exp32 C kernel's constants are body.py's, bit for bit (body.c is not compared
    with the Python spelling by any output test where a one-ulp drift would show). Planted:
    C[5] one ulp up is reported."""
    text = c_source("lmtail_exp32")
    assert exp32_mismatches(text) == []
    drift = text.replace("0x1.111112p-7f", "0x1.111114p-7f", 1)
    assert drift != text and exp32_mismatches(drift) == [f"C: C {exp32_constants(drift)['C']!r}, "
                                                         f"Python {tuple(float(v) for v in body.EXP_C)!r}"]


def lane_mismatches(text: str) -> list[str]:
    """The C file's sum64 lane count against rows_tail_decl's declared depth of S."""
    m = re.search(r"\bLANES\s*=\s*(\d+)", text)
    for inc in ([] if m else re.findall(r'#include\s+"([^"]+)"', text)):  # or in a header it includes
        m = m or re.search(r"\bLANES\s*=\s*(\d+)", next(SRC.rglob(inc)).read_text())
    lanes = int(m.group(1))
    return [f"V={v}: C depth {-(-v // lanes) + 8}, declared {rows_tail_decl(v, 1).sum('S (full row)').depth}"
            for v in (1, 255, 257, 4097, 201088)
            if -(-v // lanes) + 8 != rows_tail_decl(v, 1).sum("S (full row)").depth]


def test_c_mass_lanes_equal_the_declaration():
    """rows_tail.c and rowmass.c sum the full-row mass in the lane count whose depth
    rows_tail_decl declares. Planted: LANES = 128 is reported."""
    for fn in ("lmtail_rows_tail", "lmtail_row_mass"):
        text = c_source(fn)
        assert lane_mismatches(text) == [], fn
        assert lane_mismatches(re.sub(r"LANES\s*=\s*256", "LANES = 128", text))


def log64_mismatches(text: str) -> list[str]:
    """rows_tail.c's log64 constants as its source spells them (LOG_L[16]: SQRT2 a decimal
    double, then the series as "1.0 / k") against numerics.log64_constants(), bit for bit."""
    m = re.search(r"LOG_L\[16\]\s*=\s*\{\s*([0-9.eE+-]+),([^}]*)\}", text)
    got = (float(m.group(1)), *(1.0 / int(k) for k in re.findall(r"1\.0\s*/\s*(\d+)", m.group(2))))
    want = log64_constants()
    return [] if np.array_equal(np.array(got).view(np.int64), np.array(want).view(np.int64)) \
        else [f"C {got!r}, Python {want!r}"]


def test_c_log64_constants_equal_the_python_declaration():
    """The fused kernel's log64 (its lse1) holds its own SQRT2 and series: they are
    numerics.log64's, bit for bit (a last-term or last-digit drift changes almost no
    output, so the source is compared; tests/test_rows_tail.py compares the compiled
    values). Planted: 1/29 -> 1/31 and SQRT2's last digit are reported."""
    text = c_source("lmtail_rows_tail")
    assert log64_mismatches(text) == []
    for old, new in (("1.0 / 29}", "1.0 / 31}"), ("{1.4142135623730951,", "{1.4142135623730950,")):
        assert old in text and log64_mismatches(text.replace(old, new, 1)), new


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
    ys = torch.stack([add_rms(x[i:i + 1], zero[i:i + 1], _f32(gamma[i]), eps=1e-5).y[0]
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
    from lmtail.glue.norms import inv_rms
    from lmtail.orders import contiguous, placebo

    x, inv, t, gamma = _boundary_case()
    want = _y_from(t, gamma).view(torch.int16)
    zero = torch.zeros_like(x)
    seen = 0
    for order in (contiguous(256), placebo(strided(256)), strided(128)):
        ys = torch.stack([add_rms(x[i:i + 1], zero[i:i + 1], _f32(gamma[i]), eps=1e-5, order=order).y[0]
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
