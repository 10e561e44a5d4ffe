"""gemm_q's contract kind and planted controls: the GEMM over GGUF Q8_0 / Q4_1 weights.

Kinds, run through gates 1-4 and the byte gates:
  gemm_q.lanes32   kernels.quant.gemm_q.gemm_q(a, w): inside reference.quant.gemm_q_range of
                   gemm_q_decl(K, fmt) (32 fp32 lane chains, depth NB + 5, gradual
                   underflow), and the bytes of reference.quant.gemm_q_emulation (emulate
                   gate; the special values case by case)
  gemm_bq.bq32     kernels.quant.gemm_bq.gemm_bq(a, pack_bq(w)): inside
                   reference.quant.gemm_bq_range of gemm_bq_decl(K, fmt) (3 exact bf16 parts x
                   the block's integers, FTZ/DAZ, depth 20 + NB or 20 + 2 NB), and the bytes of
                   reference.quant.gemm_bq_emulation

Data dicts ("quant data"): a [M, K] fp32, w a kernels.quant.gemm_q.QuantWeight (N, K) made by its
quantizer from a random float tensor (or, for the adversarial cases, its bytes written
directly), fmt (w.fmt). Every gate holds both formats.
Controls swap the op (Q4_1's nibbles read high first; m added as a separately rounded fma;
16 lane chains instead of 32; bq32 with a 2-part split, c = (c + e) + o, or d*c rounded before
its add) or the declaration (half the depth); each must go red at its planted gate.

Shape legend: M rows, K the summed axis (a multiple of 32), NB = K/32, N output columns.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..kernels.quant.gemm_bq import gemm_bq, gemm_bq_decl, pack_bq
from ..kernels.quant.gemm_q import FORMATS, QuantWeight, gemm_q, gemm_q_decl
from ..numerics import Decl
from ..reference.quant import gemm_bq_emulation, gemm_bq_range, gemm_q_emulation, gemm_q_range
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth, range_verdict


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def quant_data(m, k, n, seed, *, fmt, scale=1.0, specials=0.0):
    """a ~ N(0, scale) fp32 [M, K]; w = QuantWeight.quantize(N(0, 0.05) [N, K], fmt); a
    fraction `specials` of a's entries NaN, +-inf, +-0, subnormal or near fp32's max."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * scale  # [M, K]
    w = QuantWeight.quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
    if specials:
        spec = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45, -3e-39, 3e38])
        hit = torch.rand(a.shape, generator=g) < specials
        a = torch.where(hit, spec[torch.randint(len(spec), a.shape, generator=g)], a)
    return dict(a=a, w=w, fmt=fmt)


def take_rows(data, idx):
    return dict(data, a=data["a"][list(idx)])


def decl_of(data) -> Decl:
    return gemm_q_decl(data["a"].shape[1], data["fmt"])


shallow_decl = half_depth(decl_of)  # control: gemm_q's sum declared half as deep as it runs


def unit_weight(n, k, fmt) -> QuantWeight:
    """Every value exactly 1.0, bytes written directly: Q8_0 d = 1, q = 1; Q4_1 d = 1, m = 0,
    every nibble 1."""
    one = np.float16(1.0).tobytes()
    block = (one + bytes([1] * 32)) if fmt == "Q8_0" else (one + np.float16(0.0).tobytes() + bytes([0x11] * 16))
    data = torch.frombuffer(bytearray(block * (n * k // 32)), dtype=torch.uint8).reshape(n, -1).clone()
    return QuantWeight(fmt, (n, k), data)


# ---------------------------------------------------------------------------------------
# the op, its emulation and its float64 check
# ---------------------------------------------------------------------------------------
def run_gemm_q(data) -> dict:
    return {"out": gemm_q(data["a"], data["w"])}


def emulate_gemm_q(data) -> dict:
    """The declared order, one rounding at a time (reference.quant.gemm_q_emulation)."""
    return {"out": gemm_q_emulation(data["a"], data["w"])}


def check_gemm_q(data, out, run, decl) -> Verdict:
    """Every element inside reference.quant.gemm_q_range(a, w, decl); NaN only where the
    range is unbounded (a NaN or inf in its row of a or of w, or possible overflow)."""
    y = out["out"]
    want = (data["a"].shape[0], data["w"].shape[0])
    if y.dtype != torch.float32 or tuple(y.shape) != want:
        return Verdict(False, None, f"out must be fp32 [M, N] = {list(want)}; got {y.dtype} {tuple(y.shape)}")
    lo, hi = gemm_q_range(data["a"].numpy(), data["w"], decl)
    return range_verdict(y, lo, hi)


def _bytes_and_range(data, out, run, decl) -> Verdict:
    """A special value's defined result: the emulation's bytes (any NaN matches any NaN)
    and inside the range."""
    d = diff_outputs(out, emulate_gemm_q(data), nan_equal=True)
    if d:
        return Verdict(False, None, f"not the declared lanes32 bytes: {d}")
    return check_gemm_q(data, out, run, decl)


def nibbles_swapped(data) -> dict:
    """Control: the real kernel on Q4_1 bytes whose nibbles are read high first (weight j
    from qs[j] >> 4); Q8_0 unchanged."""
    w = data["w"]
    if w.fmt != "Q4_1":
        return run_gemm_q(data)
    blk = w.data.view(w.shape[0], -1, 20).clone()  # [N, NB, 20]
    qs = blk[..., 4:]
    blk[..., 4:] = (qs << 4) | (qs >> 4)
    return {"out": gemm_q(data["a"], QuantWeight(w.fmt, w.shape, blk.reshape(w.data.shape)))}


def emulation_variant(data, **defect) -> dict:
    """Control: reference.quant.gemm_q_emulation with one planted switch."""
    return {"out": gemm_q_emulation(data["a"], data["w"], **defect)}


# ---------------------------------------------------------------------------------------
# the generators
# ---------------------------------------------------------------------------------------
SHAPES = [(1, 32, 7), (3, 64, 33), (5, 256, 17), (16, 96, 40), (2, 1024, 9)]


def quant_shapes(fast):
    return [Case(f"{f} {m}x{k} @ ({n}, {k})", quant_data(m, k, n, 700 + i, fmt=f))
            for f in FORMATS for i, (m, k, n) in enumerate(SHAPES)]


def quant_random(fast):
    scales = (1.0, 1e-3, 40.0, 0.1)
    return [Case(f"{f} seed {s} scale {scales[s]} K={k}", quant_data(8, k, 48, 710 + s, fmt=f, scale=scales[s]))
            for f in FORMATS for s, k in zip(range(2 if fast else 4), (256, 576, 64, 1536))]


def quant_special(fast):
    """Special values in a with their defined bytes; subnormal products and sums (gradual
    underflow); the defined errors."""
    exact = partial(Case, expect=_bytes_and_range)
    cases = []
    for f in FORMATS:
        cases += [exact(f"{f}: NaN, +-inf, +-0, subnormals, 3e38 in a (2%)",
                        quant_data(9, 96, 21, 720, fmt=f, specials=0.02)),
                  exact(f"{f}: products and sums near 2^-130 (subnormal)",
                        quant_data(4, 128, 13, 721, fmt=f, scale=2.0**-126))]
    d = quant_data(2, 32, 4, 722, fmt="Q8_0")
    cases += [Case("fp64 a -> ValueError", dict(d, a=d["a"].double()), raises=r"a must be a 2-D torch.float32"),
              Case("K mismatch -> ValueError", dict(d, a=torch.zeros(2, 64)), raises=r"K mismatch"),
              Case("w not a QuantWeight -> ValueError", dict(d, w=torch.zeros(4, 32)),
                   raises=r"w must be a QuantWeight")]
    return cases


def _at_bound(fmt, nb=64, n=3):
    """Lane 0 of every output: a = 1 at k = 0, then 5*2^-26 at k = 32b (b >= 1), every
    weight 1.0: each of lane 0's NB - 1 steps rounds up by 3/8 ulp of 1 (0.75 u), so the
    error is ~0.75 (NB - 1) u of mag ~1 against the declared gamma(NB + 5) (half the depth
    is too narrow)."""
    k = 32 * nb
    a = torch.zeros(2, k)
    a[:, 0::32] = 5 * 2.0**-26
    a[:, 0] = 1.0
    return dict(a=a, w=unit_weight(n, k, fmt), fmt=fmt)


def quant_adversarial(fast):
    return [Case(f"{f}: lane 0 at its declared bound (every add rounds up)", _at_bound(f)) for f in FORMATS]


# ---------------------------------------------------------------------------------------
# gemm_bq (the order bq32): the same data, its own op, emulation, range and bound data
# ---------------------------------------------------------------------------------------
def bq_decl_of(data) -> Decl:
    return gemm_bq_decl(data["a"].shape[1], data["fmt"])


bq_shallow_decl = half_depth(bq_decl_of)  # control: bq32's sum declared half as deep as it runs


def run_gemm_bq(data) -> dict:
    return {"out": gemm_bq(data["a"], pack_bq(data["w"]))}


def emulate_gemm_bq(data) -> dict:
    """The declared order bq32, one rounding at a time (reference.quant.gemm_bq_emulation)."""
    return {"out": gemm_bq_emulation(data["a"].numpy(), data["w"])}


def check_gemm_bq(data, out, run, decl) -> Verdict:
    """Every element inside reference.quant.gemm_bq_range(a, w, decl); NaN only where the
    range is unbounded."""
    y = out["out"]
    want = (data["a"].shape[0], data["w"].shape[0])
    if y.dtype != torch.float32 or tuple(y.shape) != want:
        return Verdict(False, None, f"out must be fp32 [M, N] = {list(want)}; got {y.dtype} {tuple(y.shape)}")
    lo, hi = gemm_bq_range(data["a"].numpy(), data["w"], decl)
    return range_verdict(y, lo, hi)


def _bq_bytes_and_range(data, out, run, decl) -> Verdict:
    d = diff_outputs(out, emulate_gemm_bq(data), nan_equal=True)
    if d:
        return Verdict(False, None, f"not the declared bq32 bytes: {d}")
    return check_gemm_bq(data, out, run, decl)


def bq_variant(data, **defect) -> dict:
    """Control: reference.quant.gemm_bq_emulation with one planted switch."""
    return {"out": gemm_bq_emulation(data["a"].numpy(), data["w"], **defect)}


def bq_special(fast):
    """Special values in a with their defined bytes; activations at the FTZ edge; the errors."""
    exact = partial(Case, expect=_bq_bytes_and_range)
    cases = []
    for f in FORMATS:
        cases += [exact(f"{f}: NaN, +-inf, +-0, subnormals, 3e38 in a (2%)",
                        quant_data(9, 96, 21, 730, fmt=f, specials=0.02)),
                  exact(f"{f}: activations near 2^-124 (parts and results flushed)",
                        quant_data(4, 128, 13, 731, fmt=f, scale=2.0**-124))]
    d = quant_data(2, 32, 4, 732, fmt="Q8_0")
    cases += [Case("fp64 a -> ValueError", dict(d, a=d["a"].double()), raises=r"a must be a 2-D torch.float32"),
              Case("K mismatch -> ValueError", dict(d, a=torch.zeros(2, 64)), raises=r"K mismatch")]
    return cases


def bq_at_bound(fmt, nb=64, n=3):
    """Lane 0 of every block: a = 1 (Q4_1: 1/2) in block 0, then 5*2^-26, weights d = 1, q = 1
    (Q4_1: m = 1 too, so s = c): each y step after block 0 adds 0.625 ulp of 1 and rounds up
    by 3/8 ulp (0.75 u): (NB - 1) steps (Q4_1: 2 (NB - 1)) against the declared depth 20 + NB
    (20 + 2 NB); half the depth is too narrow."""
    k = 32 * nb
    a = torch.zeros(2, k)
    a[:, 0::32] = 5 * 2.0**-26
    a[:, 0] = 1.0 if fmt == "Q8_0" else 0.5
    if fmt == "Q8_0":
        return dict(a=a, w=unit_weight(n, k, fmt), fmt=fmt)
    one = np.float16(1.0).tobytes()
    block = one + one + bytes([0x11] * 16)  # d = 1, m = 1, every q = 1
    data = torch.frombuffer(bytearray(block * (n * k // 32)), dtype=torch.uint8).reshape(n, -1).clone()
    return dict(a=a, w=QuantWeight(fmt, (n, k), data), fmt=fmt)


def bq_adversarial(fast):
    return [Case(f"{f}: y at its declared bound (every scale step rounds up)", bq_at_bound(f)) for f in FORMATS]


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def quant_kinds() -> list[Kind]:
    gens = {"shapes": quant_shapes, "random": quant_random, "special": quant_special,
            "adversarial": quant_adversarial}
    bq_gens = dict(gens, special=bq_special, adversarial=bq_adversarial)
    return [Kind("gemm_q.lanes32", decl_of, run_gemm_q, check_gemm_q, gens, take_rows=take_rows,
                 emulate=emulate_gemm_q, group="gemm",
                 about="gemm_q (Q8_0, Q4_1) in its float64 range and its emulation's bytes"),
            Kind("gemm_bq.bq32", bq_decl_of, run_gemm_bq, check_gemm_bq, bq_gens, take_rows=take_rows,
                 emulate=emulate_gemm_bq, group="gemm",
                 about="gemm_bq (Q8_0, Q4_1; bq32) in its float64 range and its model's bytes")]


def quant_controls() -> list[Control]:
    return [
        Control("gemm_q.nibbles_swapped", "gemm_q.lanes32", "random",
                "Q4_1 weights read high nibble first (the byte's nibbles swapped)", nibbles_swapped),
        Control("gemm_q.m_separate", "gemm_q.lanes32", "emulate",
                "Q4_1: m added as its own rounded fma after a * (d*q)", partial(emulation_variant, m_separate=True)),
        Control("gemm_q.lanes_16", "gemm_q.lanes32", "emulate", "16 lane chains instead of 32",
                partial(emulation_variant, lanes=16)),
        Control("gemm_q.decl_half_depth", "gemm_q.lanes32", "adversarial",
                "the real op, its sum declared half as deep as it runs", decl=shallow_decl),
        Control("gemm_bq.two_parts", "gemm_bq.bq32", "emulate", "a 2-part split (p2 dropped)",
                partial(bq_variant, parts=2)),
        Control("gemm_bq.pair_sum_last", "gemm_bq.bq32", "emulate", "c = (c + e) + o instead of c + (e + o)",
                partial(bq_variant, pair_sum_last=True)),
        Control("gemm_bq.d_rounded", "gemm_bq.bq32", "emulate", "y = y + fl32(d*c): the scale's product rounded",
                partial(bq_variant, d_rounded=True)),
        Control("gemm_bq.decl_half_depth", "gemm_bq.bq32", "adversarial",
                "the real op, its sum declared half as deep as it runs", decl=bq_shallow_decl),
    ]


__all__ = ["quant_kinds", "quant_controls", "quant_data", "run_gemm_q", "emulate_gemm_q", "check_gemm_q",
           "run_gemm_bq", "emulate_gemm_bq", "check_gemm_bq"]
