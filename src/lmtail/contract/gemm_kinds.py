"""The bf16 GEMM's contract kinds and planted controls: one kind per declared order.

Kinds, each run through gates 1-4 and the byte gates:
  gemm.amx32   gemm_bf16(order="amx32"): inside reference.gemm.gemm_range of
               gemm_decl(H, "amx32") (DAZ inputs, FTZ slack, depth 16 + 1 + ceil(H/32)),
               and the bytes of reference.gemm.gemm_amx32_emulation (emulate gate; the
               special values and the FTZ data case by case)
  gemm.chain   the same for order="chain" (depth H, gradual underflow) and
               reference.gemm.gemm_chain_emulation
  gemm.dp32    the same for order="dp32" (VDPBF16PS's order: DAZ inputs, FTZ slack, depth
               32 + ceil(H/32)) and reference.gemm.gemm_dp32_emulation

Data dicts ("gemm data"): a [M, H] bf16, w [H, V] bf16, order (one of kernels.gemm.bf16.ORDERS).
Controls swap the op (another order, a wrong emulation variant, a bf16-rounded output)
or the declaration (half the depth); each must go red at its planted gate.

Checks take (data, out, run, decl): the range comes from decl (the harness passes the
kind's declaration unless a control replaces it).

Shape legend: M rows, H the summed axis, V columns; NB = ceil(H/32).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..kernels.gemm.bf16 import ORDERS, TAIL_ORDERS, gemm_bf16, gemm_decl
from ..numerics import Decl
from ..reference.gemm import (gemm_amx32_emulation, gemm_chain_emulation, gemm_dp32_emulation,
                              gemm_range)
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth, range_verdict

# bf16 bit patterns: NaN, +-inf, +-0, subnormals, the smallest normal, +-max, 2^-75, 2^64
SPECIALS = (0x7FC0, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F7F, 0xFF7F,
            0x1A00, 0x5F80, 0x9A00)


# ---------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------
def gemm_data(m, h, v, seed, *, order, scale=1.0, specials=0.0, shift=(0, 0)):
    """a ~ N(0, scale), w ~ N(0, 0.05 scale) in bf16, times 2^shift[0] and 2^shift[1]; a
    fraction `specials` of the entries of each replaced by SPECIALS."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, h, generator=g) * scale * 2.0 ** shift[0]).to(torch.bfloat16)  # [M, H]
    w = (torch.randn(h, v, generator=g) * 0.05 * scale * 2.0 ** shift[1]).to(torch.bfloat16)  # [H, V]
    if specials:
        spec = torch.tensor(SPECIALS, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        for t in (a, w):
            hit = torch.rand(t.shape, generator=g) < specials
            t[hit] = spec[torch.randint(len(SPECIALS), t.shape, generator=g)[hit]]
    return dict(a=a, w=w, order=order)


def take_rows(data, idx):
    return dict(data, a=data["a"][list(idx)])


def decl_of(data) -> Decl:
    return gemm_decl(data["w"].shape[0], data["order"])


shallow_decl = half_depth(decl_of)  # control: the GEMM's sum declared half as deep as it runs


# ---------------------------------------------------------------------------------------
# the op, its emulation and its float64 check
# ---------------------------------------------------------------------------------------
def run_gemm(data) -> dict:
    return {"out": gemm_bf16(data["a"], data["w"], order=data["order"])}


def emulate_gemm(data) -> dict:
    """The declared order, one rounding at a time (reference.gemm)."""
    emu = {"chain": gemm_chain_emulation, "amx32": gemm_amx32_emulation,
           "dp32": gemm_dp32_emulation}[data["order"]]
    return {"out": emu(data["a"], data["w"])}


def check_gemm(data, out, run, decl) -> Verdict:
    """Every element inside reference.gemm.gemm_range(a, w, decl); NaN only where the range
    is unbounded (a NaN or inf in its row of a or column of w, or possible overflow)."""
    y = out["out"]
    if y.dtype != torch.float32 or tuple(y.shape) != (data["a"].shape[0], data["w"].shape[1]):
        return Verdict(False, None, f"out must be fp32 [M, V]; got {y.dtype} {tuple(y.shape)}")
    lo, hi = gemm_range(data["a"], data["w"], decl)
    return range_verdict(y, lo, hi)


def _bytes_and_range(data, out, run, decl) -> Verdict:
    """A special value's defined result: the declared emulation's bytes (any NaN matches
    any NaN) and inside the range."""
    d = diff_outputs(out, emulate_gemm(data), nan_equal=True)
    if d:
        return Verdict(False, None, f"not the declared {data['order']} bytes: {d}")
    return check_gemm(data, out, run, decl)


def bf16_output(data) -> dict:
    """Control: the right order, its output rounded to bf16."""
    return {"out": run_gemm(data)["out"].bfloat16().float()}


def other_order(data) -> dict:
    """Control: the other declared order posing as this one."""
    return {"out": gemm_bf16(data["a"], data["w"], order=next(o for o in TAIL_ORDERS if o != data["order"]))}


def order_as(order: str, data) -> dict:
    """Control: gemm_bf16 in `order` posing as data["order"]."""
    return {"out": gemm_bf16(data["a"], data["w"], order=order)}


def dp32_variant(data, **defect) -> dict:
    """Control: reference.gemm.gemm_dp32_emulation with one planted switch."""
    with np.errstate(all="ignore"):  # acc_ieee / ftz=False: plain numpy adds that may overflow
        return {"out": gemm_dp32_emulation(data["a"], data["w"], **defect)}


def amx32_variant(data, **defect) -> dict:
    """Control: reference.gemm.gemm_amx32_emulation with one planted switch."""
    with np.errstate(all="ignore"):  # ftz=False: plain numpy adds that may overflow
        return {"out": gemm_amx32_emulation(data["a"], data["w"], **defect)}


# ---------------------------------------------------------------------------------------
# the generators
# ---------------------------------------------------------------------------------------
SHAPES = [(1, 32, 531), (7, 61, 133), (16, 576, 75), (300, 64, 21), (3, 2880, 24), (5, 1, 7), (2, 3072, 17)]


def gemm_shapes(fast, *, order):
    return [Case(f"{m}x{h} @ {h}x{v}", gemm_data(m, h, v, 600 + i, order=order))
            for i, (m, h, v) in enumerate(SHAPES)]


def gemm_random(fast, *, order):
    scales = (1.0, 1e-3, 40.0, 1.0, 0.1, 3.0)
    return [Case(f"seed {s} scale {scales[s]} H={h}", gemm_data(8, h, 100, s, order=order, scale=scales[s]))
            for s, h in zip(range(2 if fast else 6), (256, 2880, 61, 576, 1000, 32))]


def gemm_special(fast, *, order):
    """Special values with their defined bytes; underflow data (FTZ decides in amx32,
    gradual underflow in the chain); the defined errors."""
    exact = partial(Case, expect=_bytes_and_range)
    cases = [exact("NaN, +-inf, +-0, subnormals, +-max, 2^-75, 2^64 (2% of entries)",
                   gemm_data(9, 61, 101, 7, order=order, specials=0.02)),
             exact("special values at H = 576 (5%)", gemm_data(4, 576, 40, 8, order=order, specials=0.05)),
             exact("products and partial sums around 2^-126", gemm_data(6, 260, 33, 9, order=order, shift=(-62, -60))),
             exact("products in the subnormal range", gemm_data(6, 100, 33, 10, order=order, shift=(-70, -70)))]
    cases.append(exact("signed zeros: a -0 block sum flushed, then -0 lane chains and pad lanes (H = 66)",
                       _signed_zero_lanes(order)))
    d = gemm_data(2, 16, 8, 12, order=order)
    cases += [Case("fp32 a -> ValueError", dict(d, a=d["a"].float()), raises=r"a must be torch.bfloat16"),
              Case("H mismatch -> ValueError", dict(d, a=d["a"][:, :15].contiguous()), raises=r"H mismatch"),
              Case("strided w -> ValueError", dict(d, w=d["w"].t().contiguous().t()), raises=r"w must be C-contiguous"),
              Case("unknown order -> ValueError", dict(d, order="tree"), raises=r"order must be one of")]
    return cases


def _signed_zero_lanes(order):
    """One output, H = 66 (amx32: 3 blocks, the last with 30 pad lanes). Block 1's sum
    -2^-126 - 2^-133 meets acc = 2^-126: -2^-133, flushed to -0; block 2's lane chains
    are -0 (tiny negative products flushed) until the +0 * +0 pad lanes make them +0, so
    the result is +0 (skipping the pad lanes gives -0)."""
    lanes = {0: (2.0**-63, 2.0**-63), 32: (-(2.0**-62), 2.0**-62), 33: (1.5 * 2.0**-62, 2.0**-63),
             35: (-(2.0**-66), 2.0**-67), 64: (-(2.0**-70), 2.0**-70), 65: (-(2.0**-70), 2.0**-70)}
    a, w = torch.zeros(1, 66), torch.zeros(66, 1)
    for k, (x, y) in lanes.items():
        a[0, k], w[k, 0] = x, y
    return dict(a=a.bfloat16(), w=w.bfloat16(), order=order)


def _ties_back_to_one(order, h=2880, v=3):
    """1 + (H-1) 2^-24 (a = w = 2^-12 past lane 0): every chain step is a tie back to 1
    (the chain loses (H-1) u, inside its own range, outside amx32's), while amx32's block
    sums keep the small terms (exact here)."""
    a = torch.full((1, h), 2.0**-12).bfloat16()
    w = torch.full((h, v), 2.0**-12).bfloat16()
    a[0, 0], w[0] = 1.0, 1.0
    return dict(a=a, w=w, order=order)


def _at_bound(order, v=5):
    """Data whose `order` errs close to its declared bound (half the depth is too narrow):
      chain (H = 256): w[0] = 1, w[1:] = 5*2^-26: every add rounds up by 3/8 ulp of 1;
      amx32 (H = 64, NB = 2): w[0] = 1, the other 15 even lanes of block 0 and lane 32
        2^-24: 16 = 14 + NB adds, each a tie back to 1, against the declared 19 u;
      dp32 (H = 64, NB = 2): w[1] = 1 (the first lane of the chain), the other 31 lanes of
        block 0 2^-24: 31 fmas, each a tie back to 1, against the declared 34 u."""
    h = 256 if order == "chain" else 64
    if order == "chain":
        w = torch.full((h, v), 5 * 2.0**-26)
    elif order == "dp32":
        w = torch.where(torch.arange(h)[:, None].expand(h, v) < 32, 2.0**-24, 0.0)
        w[1] = 1.0
        return dict(a=torch.ones(2, h).bfloat16(), w=w.bfloat16(), order=order)
    else:
        lane = torch.arange(h)[:, None].expand(h, v)
        w = torch.where(((lane < 32) & (lane % 2 == 0)) | (lane % 32 == 0), 2.0**-24, 0.0)
    w[0] = 1.0
    return dict(a=torch.ones(2, h).bfloat16(), w=w.bfloat16(), order=order)


def gemm_adversarial(fast, *, order):
    return [Case("1 + 2879 * 2^-24: the chain's steps tie back to 1", _ties_back_to_one(order)),
            Case(f"{order} at its declared bound (every add rounds the same way)", _at_bound(order))]


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def _kind(order: str) -> Kind:
    gens = {"shapes": gemm_shapes, "random": gemm_random, "special": gemm_special, "adversarial": gemm_adversarial}
    return Kind(f"gemm.{order}", decl_of, run_gemm, check_gemm, {g: partial(f, order=order) for g, f in gens.items()},
                take_rows=take_rows, emulate=emulate_gemm, group="gemm",
                about=f"gemm_bf16(order={order!r}) in its float64 range and its emulation's bytes")


def gemm_kinds() -> list[Kind]:
    return [_kind(o) for o in ORDERS]


def gemm_controls() -> list[Control]:
    return [
        Control("gemm.amx32.chain_bytes", "gemm.amx32", "emulate", "the sequential chain posing as amx32", other_order),
        Control("gemm.amx32.chain_range", "gemm.amx32", "adversarial",
                "the sequential chain posing as amx32: 1 + 2879 * 2^-24 loses 2879 u", other_order),
        Control("gemm.amx32.pair_last", "gemm.amx32", "emulate", "acc = (acc + e) + o instead of acc + (e + o)",
                partial(amx32_variant, lane_pair_last=True)),
        Control("gemm.amx32.no_ftz", "gemm.amx32", "special", "no FTZ, no DAZ (IEEE gradual underflow)",
                partial(amx32_variant, ftz=False)),
        Control("gemm.amx32.pad_skipped", "gemm.amx32", "special", "lanes past H skipped instead of +0 * +0",
                partial(amx32_variant, pad_lanes=False)),
        Control("gemm.amx32.bf16_output", "gemm.amx32", "random", "the result rounded to bf16", bf16_output),
        Control("gemm.amx32.decl_half_depth", "gemm.amx32", "adversarial",
                "the real op, its sum declared half as deep as it runs", decl=shallow_decl),
        Control("gemm.chain.amx32_bytes", "gemm.chain", "emulate", "the amx32 order posing as the chain", other_order),
        Control("gemm.chain.bf16_output", "gemm.chain", "random", "the result rounded to bf16", bf16_output),
        Control("gemm.chain.decl_half_depth", "gemm.chain", "adversarial",
                "the real op, its sum declared half as deep as it runs", decl=shallow_decl),
        Control("gemm.dp32.even_first", "gemm.dp32", "emulate", "each pair's even lane before its odd lane",
                partial(dp32_variant, even_first=True)),
        Control("gemm.dp32.acc_not_daz", "gemm.dp32", "special",
                "the accumulators t and acc read without DAZ and kept subnormal (no FTZ on them)",
                partial(dp32_variant, acc_ieee=True)),
        Control("gemm.dp32.one_chain", "gemm.dp32", "emulate", "no block partial: one fma chain over every lane",
                partial(dp32_variant, single_chain=True)),
        Control("gemm.dp32.amx32_bytes", "gemm.dp32", "emulate", "the amx32 order posing as dp32",
                partial(order_as, "amx32")),
        Control("gemm.dp32.chain_bytes", "gemm.dp32", "emulate", "the sequential chain posing as dp32",
                partial(order_as, "chain")),
        Control("gemm.dp32.chain_range", "gemm.dp32", "adversarial",
                "the sequential chain posing as dp32: 1 + 2879 * 2^-24 loses 2879 u", partial(order_as, "chain")),
        Control("gemm.dp32.bf16_output", "gemm.dp32", "random", "the result rounded to bf16", bf16_output),
        Control("gemm.dp32.decl_half_depth", "gemm.dp32", "adversarial",
                "the real op, its sum declared half as deep as it runs", decl=shallow_decl),
    ]


__all__ = ["gemm_kinds", "gemm_controls", "gemm_data", "run_gemm", "emulate_gemm", "check_gemm"]
