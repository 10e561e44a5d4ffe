"""Contract kind and planted controls for the Q8_0 head: decode_tail with lm_head_weight_t a
kernels.quant.gemm_q.QuantWeight "Q8_0" (V_s, H) and head_input="fp32".

Kind:
  tail.head.q8_0   decode_tail(head_input="fp32", exchange="candidates", debug_taps=True) on
    one rank, W the GGUF rows (V, H) in Q8_0 blocks. Every case is judged as the candidates
    exchange kind judges its own (exchange_kinds.check_exchange), with the Q8_0 head's
    declaration tail_decl(H, True, default order, "candidates", "fp32") + candidates_decl(V):
    (a) the logits inside reference.tail.logits_range over the exact dequantized weights
        (reference.quant.dequantize_f64): g = fp32(x*gamma) unrounded, gemm_q's sum
        (fp32, depth H/32 + 5, gradual underflow), acc*rms in fp32;
    (b) top-k, taps and logprobs bit-equal to candidates_emulation of the op's own logits;
    (c) VTP 2, 4, 8 in one process (each rank's head QuantWeight.rows(r V_s, (r+1) V_s),
        its shard logits, partials, packed, merged) == the one-rank bytes, every field;
    (d) certification against float64 (certify_tail(head_input="fp32"): the ideal logits
        over the exact dequantized head).
  Its emulate gate: every output == `head_variant(defect="emulate")`, the op restated with
  the norm in its declared order, g = fp32(x*gamma) (pad lanes 0), acc =
  reference.quant.gemm_q_emulation(g, W) (lanes32, one rounding at a time), logits =
  fp32(acc * rms), then the candidates pipeline (exchange_kinds.outputs_from_shards).
  2 real gloo ranks == 1 rank is tests/test_tail_q8.py's (spawned, like test_candidates).

Controls (`head_variant` with ONE defect, or the real op under a wrong declaration), each
red at its planted gate: the activation rounded to bf16 before gemm_q ("a_bf16", random:
outside the fp32 range); every block's d rounded to bf16 ("d_bf16", random: not the
checkpoint's values); 16 lane chains ("lanes_16", emulate); each rank's head rows taken
strided r::VTP instead of the block r V_s.. ("shard_strided", random: gate (c)); the real
op under the bf16-activation declaration ("plain_decl", random) and with its sums declared
half as deep ("decl_half_depth", adversarial: lane 0 at its declared bound).

Data ("q8 data"): the exchange kind's (x, gamma, eps, h_u, interleaved, deferred, k,
nan_fold, sp [R, 5] | None) with w a QuantWeight Q8_0 (V, H) and head_input "fp32".

Shape legend: gbs rows (R = gbs: one rank), H hidden (padded, a multiple of 32), H_u real
hidden, V vocab, V_s = V / VTP, NB = H / 32, k candidates.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from ..kernels.quant.gemm_q import QuantWeight, gemm_q
from ..numerics import sqrt_rn32
from ..orders import sum_squares
from ..reference.quant import gemm_q_emulation
from ..tail.compose import SSQ_ORDER, pad_mask, validate_tail_inputs
from . import exchange_kinds as ex
from . import logits_kinds as lk
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth

KIND = "tail.head.q8_0"


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def q8_head(v, h, seed, *, scale=None) -> QuantWeight:
    """A Q8_0 head (V, H): N(0, 1/H) (or N(0, scale)) quantized by ggml's reference quantizer."""
    g = torch.Generator().manual_seed(seed)
    return QuantWeight.quantize(torch.randn(v, h, generator=g) * (scale or 1 / math.sqrt(h)), "Q8_0")


def q8_data(gbs, h, h_u, v, interleaved, seed, *, k=16, scale=1.0, sampled=True):
    """tail_kinds.tail_data's x, gamma (pad lanes of x hold 100 N(0, 1)) with a Q8_0 head."""
    d = lk.tail_data(gbs, h, h_u, 8, interleaved, seed, scale=scale, k=k)
    k = min(k, v)
    return dict(d, w=q8_head(v, h, seed + 1), k=k, nan_fold=False, head_input="fp32",
                sp=ex.exchange_params(gbs, seed, k) if sampled else None)


def _d_to_bf16(w: QuantWeight) -> QuantWeight:
    """Control data: every block's scale d rounded to bf16 (8 significant bits, not fp16's 11)."""
    blk = w.data.view(w.shape[0], -1, 34).clone()  # [V, NB, 34]
    d = blk[..., 0:2].contiguous().view(torch.float16).float()
    d16 = d.to(torch.bfloat16).float().to(torch.float16)  # exact: a bf16 value in fp16's range
    blk[..., 0:2] = d16.view(torch.uint8).reshape(blk[..., 0:2].shape)
    return QuantWeight("Q8_0", w.shape, blk.reshape(w.data.shape))


# ---------------------------------------------------------------------------------------
# the op restated (emulation and controls)
# ---------------------------------------------------------------------------------------
def _norm(data):
    """(g [gbs, H] fp32 = fp32(x*gamma) with pad lanes 0, rms [gbs] fp32), the declared norm."""
    x, g = data["x"], data["gamma"].reshape(-1).to(torch.float32)
    h, h_u = x.shape[1], data["h_u"]
    real = pad_mask(h, h_u, data["interleaved"])  # [H]
    zero = torch.zeros((), dtype=torch.float32)
    x = torch.where(real, x.to(torch.float32), zero)
    ssq = sum_squares(x, SSQ_ORDER)  # [gbs]
    t = ssq / torch.tensor(float(h_u), dtype=torch.float32) + torch.tensor(data["eps"], dtype=torch.float32)
    rms = torch.tensor(1.0, dtype=torch.float32) / sqrt_rn32(t)  # [gbs]
    return torch.where(real, x * g, zero), rms


def head_variant(data, defect=None) -> dict:
    """decode_tail with the Q8_0 head restated (module docstring) over data["vtp"] (default
    1) shards, with one defect: "emulate" (not a defect: gemm_q by
    reference.quant.gemm_q_emulation), "lanes_16" (the emulation with 16 lane chains),
    "a_bf16" (g rounded to bf16 before gemm_q), "d_bf16" (every d rounded to bf16),
    "shard_strided" (rank r's rows r::VTP instead of r V_s .. (r+1) V_s). defect=None
    gives the real op's bytes."""
    w, vtp = data["w"], data.get("vtp", 1)
    validate_tail_inputs(data["x"], data["gamma"], w, data["sp"], ex.tail_config(data), vocab_size=w.shape[0])
    g, rms = _norm(data)
    if defect == "a_bf16":
        g = g.to(torch.bfloat16).to(torch.float32)
    if defect == "d_bf16":
        w = _d_to_bf16(w)
    vs = w.shape[0] // vtp
    shards = []
    for r in range(vtp):
        wr = (QuantWeight(w.fmt, (vs, w.shape[1]), w.data[r::vtp].contiguous()) if defect == "shard_strided"
              else w.rows(r * vs, (r + 1) * vs))
        if defect in ("emulate", "lanes_16"):
            acc = gemm_q_emulation(g, wr, lanes=16 if defect == "lanes_16" else 32)
        else:
            acc = gemm_q(g, wr)  # [gbs, V_s]
        shards.append(acc * rms[:, None])
    return ex.outputs_from_shards(data, shards)


# ---------------------------------------------------------------------------------------
# judgements
# ---------------------------------------------------------------------------------------
def check_head(data, out, run, decl) -> Verdict:
    """Finite inputs: exchange_kinds.check_exchange ((a)-(d), module docstring). A row with a
    NaN/inf real lane: its logits all NaN (logits_verdict), then (b) and (c)."""
    if lk.nonfinite_rows(data).any():
        r = lk.logits_verdict(data, out["logits"], decl)
        return r if not r.ok else ex.check_exchange_values(data, out, run, decl)
    return ex.check_exchange(data, out, run, decl)


def _same_as(data_fn, what):
    """expect: the op's bytes equal its own run on data_fn(data) (every field), and check_head."""
    def expect(data, out, run, decl):
        d = diff_outputs(out, {f: t for f, t in run(data_fn(data)).items() if t is not None})
        if d:
            return Verdict(False, None, f"{what}: {d}")
        v = check_head(data, out, run, decl)
        return Verdict(v.ok, v.margin, f"{what}; {v.detail}", v.counts)
    return expect


def _emulated(data, out, run, decl) -> Verdict:
    """expect: every output == head_variant(defect="emulate") (any NaN == any NaN), and check_head."""
    d = diff_outputs(out, {f: t for f, t in head_variant(data, "emulate").items() if t is not None}, nan_equal=True)
    if d:
        return Verdict(False, None, f"vs the lanes32 emulation: {d}")
    return check_head(data, out, run, decl)


# ---------------------------------------------------------------------------------------
# generators
# ---------------------------------------------------------------------------------------
SHAPES = [  # (gbs, H, H_u, V, interleaved, k): 1 row, 300 rows, pad lanes both ways, V odd, k = V
    (1, 32, 32, 100, False, 16), (13, 64, 61, 37, False, 37), (7, 96, 88, 129, True, 16),
    (5, 288, 250, 104, False, 9), (3, 576, 576, 1000, False, 32), (2, 32, 4, 9, True, 4),
    (300, 64, 64, 40, False, 8)]


def head_shapes(fast):
    return [Case(f"{gbs}x{h} (H_u={hu}) V={v} k={k}", q8_data(gbs, h, hu, v, il, 800 + i, k=k))
            for i, (gbs, h, hu, v, il, k) in enumerate(SHAPES)]


def head_random(fast):
    """SmolLM2's H = 576 (NB = 18), V = 1000 (VTP 2, 4, 8 divide it), H_u = 560 interleaved."""
    scales = (1.0, 3.0, 0.3, 30.0)
    return [Case(f"seed {s} scale {scales[s]} H=576 V=1000", q8_data(8, 576, 560, 1000, True, 810 + s, scale=scales[s]))
            for s in range(2 if fast else 4)]


def _special_blocks(data):
    """W with every 3rd block d = 0 (+-0 products) and q = -128 / +127 in lanes 0 / 1 of every block."""
    w = data["w"]
    blk = w.data.view(w.shape[0], -1, 34).clone()
    blk[:, 0::3, 0:2] = 0
    blk[:, :, 2] = 0x80  # q = -128
    blk[:, :, 3] = 0x7F  # q = +127
    return dict(data, w=QuantWeight("Q8_0", w.shape, blk.reshape(w.data.shape)))


def _pad_inf(data):
    x = data["x"].clone()
    real = pad_mask(x.shape[1], data["h_u"], data["interleaved"])
    x[:, ~real] = torch.inf
    return dict(data, x=x)


def _pad_zero(data):
    real = pad_mask(data["x"].shape[1], data["h_u"], data["interleaved"])
    return dict(data, x=torch.where(real, data["x"], torch.zeros(())))


def _nonfinite(data):
    x = data["x"].clone()
    x[1, 5], x[3, 0] = float("nan"), -torch.inf
    return dict(data, x=x, sp=None)


def head_special(fast):
    d = q8_data(6, 64, 64, 104, False, 820, k=8)
    tiny = q8_data(4, 96, 96, 40, False, 821, k=5, scale=2.0**-130)  # g subnormal: gradual underflow
    pad = q8_data(5, 96, 80, 64, True, 822, k=6)
    bf16_w = lk.tail_data(2, 64, 64, 40, False, 823)["w"]  # [H, V] bf16
    q41 = QuantWeight.quantize(torch.randn(40, 64) * 0.05, "Q4_1")
    return [
        Case("d = 0 blocks, q = -128 and +127 in every block", _special_blocks(d), expect=_emulated),
        Case("x ~ 2^-130: g and the products subnormal (no FTZ/DAZ)", tiny, expect=_emulated),
        Case("NaN / -inf in real lanes: those rows' logits all NaN", _nonfinite(d), expect=_emulated),
        Case("+inf in every pad lane == pad lanes zero", _pad_inf(pad), expect=_same_as(_pad_zero, "pad ignored")),
        Case("Q4_1 head -> ValueError", dict(d, w=q41), raises=r"QuantWeight head must be fmt 'Q8_0'; got 'Q4_1'"),
        Case("K != H -> ValueError", dict(d, w=q8_head(104, 96, 1)), raises=r"\(V_s, K=H=64\); got \(104, 96\)"),
        Case("head_input 'bf16' with a Q8_0 head -> ValueError", dict(d, head_input="bf16"),
             raises=r"head_input must be 'fp32' with a Q8_0 head.*got 'bf16'"),
        Case("head_input 'fp32' with a bf16 tensor -> ValueError", dict(d, w=bf16_w),
             raises=r"head_input='fp32' needs a kernels.quant.gemm_q.QuantWeight Q8_0 head"),
        Case("gemm_order 'chain' with a Q8_0 head -> ValueError", dict(d, gemm_order="chain"),
             raises=r"gemm_order must be the default 'amx32' with a Q8_0 head.*got 'chain'"),
        Case("deferred_rms=False -> ValueError", dict(d, deferred=False),
             raises=r"head_input='fp32' needs deferred_rms=True"),
    ]


def at_bound(nb=128, v=24, gbs=2):
    """Lane 0 of every output at its declared bound: x = 1 at lane 0, 5 * 2^-26 at lanes 32b
    (b >= 1), 0 elsewhere, gamma 1, every weight exactly 1.0 (d = 1, q = 1): each of lane
    0's NB - 1 steps rounds up by 3/8 ulp of 1, ~0.75 (NB - 1) u against the declared
    gamma(NB + 5) u; half the depth (plus the rms range) is too narrow."""
    h = 32 * nb
    x = torch.zeros(gbs, h)
    x[:, 0::32] = 5 * 2.0**-26
    x[:, 0] = 1.0
    one = np.float16(1.0).tobytes() + bytes([1] * 32)
    data = torch.frombuffer(bytearray(one * (v * nb)), dtype=torch.uint8).reshape(v, -1).clone()
    return dict(x=x, gamma=torch.ones(h), w=QuantWeight("Q8_0", (v, h), data), eps=1e-5, h_u=h, interleaved=False,
                deferred=True, k=4, nan_fold=False, head_input="fp32", sp=None)


def _ties(gbs=8, h=64, v=1000, k=16, seed=830):
    """The head holds 6 distinct rows: every logit ties, at the top-k threshold and past slot k."""
    d = q8_data(gbs, h, h, v, False, seed, k=k)
    w = d["w"]
    pick = torch.randint(0, 6, (v,), generator=torch.Generator().manual_seed(seed))
    return dict(d, w=QuantWeight("Q8_0", w.shape, w.data[pick].contiguous()))


def head_adversarial(fast):
    return [Case("lane 0 at its declared bound (H = 4096, NB = 128, unit weights)", at_bound()),
            Case("ties everywhere (6 distinct head rows), V=1000 k=16", _ties())]


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def plain_decl_of(data):
    """Control: the Q8_0 op checked against the bf16-activation declaration (a:bf16, gemm_bf16's sum)."""
    return ex.exchange_decl_of(dict(data, head_input="bf16"))


def head_kinds() -> list[Kind]:
    gens = {"shapes": head_shapes, "random": head_random, "special": head_special, "adversarial": head_adversarial}
    return [Kind(KIND, ex.exchange_decl_of, ex.run_exchange, check_head, gens, take_rows=lk.tail_rows,
                 emulate=partial(head_variant, defect="emulate"),
                 about="decode_tail with a Q8_0 head (head_input='fp32'): gemm_q lanes32 on fp32(x*gamma), "
                       "in range, == emulation, VTP-invariant, certified")]


def head_controls() -> list[Control]:
    hv = lambda defect: partial(head_variant, defect=defect)  # noqa: E731
    return [
        Control("tail.q8_0.a_bf16", KIND, "random", "the activation rounded to bf16 before gemm_q", hv("a_bf16")),
        Control("tail.q8_0.d_bf16", KIND, "random", "every block's d rounded to bf16 (not the checkpoint's values)",
                hv("d_bf16")),
        Control("tail.q8_0.lanes_16", KIND, "emulate", "gemm_q in 16 lane chains instead of 32", hv("lanes_16")),
        Control("tail.q8_0.shard_strided", KIND, "random", "rank r's head rows r::VTP, not the block r*V_s..",
                hv("shard_strided")),
        Control("tail.q8_0.plain_decl", KIND, "random", "the real op under the bf16-activation declaration",
                decl=plain_decl_of),
        Control("tail.q8_0.decl_half_depth", KIND, "adversarial", "the real op, its sums declared half as deep",
                decl=half_depth(ex.exchange_decl_of)),
    ]


__all__ = ["head_kinds", "head_controls", "head_variant", "q8_data", "q8_head", "at_bound", "KIND"]
