"""The decode tail's contract kinds and planted controls (docs/contract.md).

Kinds (op x variant x dtype), each run through gates 1-4 and the byte gates:
  tail.logits.deferred.fp32   decode_tail logits, deferred_rms=True, fp32 hidden
  tail.logits.legacy.fp32     deferred_rms=False: a = bf16((x*rms)*gamma)
  tail.logits.deferred.fp16   fp16 hidden: in range AND the bytes of the widened fp32 run
  tail.logits.deferred.bf16   bf16 hidden: the same
  tail.logits.*.fp32.chain    deferred and legacy with gemm_order="chain" (the others run
                              TailConfig's default order, amx32)
  tail.logits.*.fp32.dp32     deferred and legacy with gemm_order="dp32"
  tail.mirror.bf16            the bf16 mirror: top-k of decode_tail == exact top-k of
                              bf16(its own fp32 logits), values and ids
  tail.topk.exact             exact_topk == reference.tail.topk_ref, exactly
  tail.sampler                rows_tail's tokens/truncated/logprobs vs the float64 sampler
                              (reference.contract.sample_decision); near-ties counted; the
                              emulate gate also compares the fused kernel's own float64 S1,
                              lse1 and nz (its debug_mass export) with the declared mass
                              (reference.tail.mass_emulation) bit for bit
  tail.decode                 decode_tail end to end; tokens certified against the float64
                              ideal logits (certify.certify_tail); the ranks gate runs here

Data dicts ("tail data"): x [gbs, H] fp32|fp16|bf16, gamma [H] fp32, w [H, V] bf16, eps,
h_u, interleaved, deferred, gemm_order (absent: TailConfig's default) (+ k, sp [R, 5] fp32,
nan_fold for the mirror/decode kinds);
"rows data": rows [R, V] bf16, k, chunk, nan_fold (+ sp, exact for the sampler).

Controls are the same bodies as the real ops with ONE defect each (`logits_variant`,
`sampler_variant`, ...; defect=None reproduces the real op byte for byte, which the tests
assert), so a red control shows the gate sees that defect and nothing else; one control
keeps the real op and plants a declaration shallower than the code runs (`shallow_decl`).

Checks take (data, out, run, decl): the ranges come from decl (the harness passes
decl(data), the kind's declaration unless a control replaces it).

Shape legend: gbs rows, H hidden (padded), H_u real hidden, V vocab, R rows, k candidates.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..tail.config import TailConfig
from ..kernels.gemm.bf16 import TAIL_ORDERS as GEMM_ORDERS
from ..kernels.gemm.bf16 import gemm_bf16
from ..kernels.tail.rowmass import row_mass
from ..kernels.tail.rows_tail import available_backends as fused_backends
from ..kernels.tail.rows_tail import rows_tail_decl, rows_tail_fused
from ..numerics import Decl, U, log64, sqrt_rn32
from ..orders import sum_squares
from ..reference.contract import decl_slack, logprob_ref, range_margin, sample_decision
from ..reference.gemm import gemm_amx32_emulation, gemm_chain_emulation, gemm_dp32_emulation
from ..reference.tail import as_np, logits_range, logprob_emulation, mass_emulation, mirror_range, sum64_emulation, topk_ref
from ..tail.sampler import draw, sampling_plan, validate_params
from ..tail.compose import SSQ_ORDER, decode_tail, pad_mask, rows_tail, tail_decl, validate_tail_inputs
from ..tail.topk import exact_topk, exact_topk_decl, row_keys, split_keys
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth

# ---------------------------------------------------------------------------------------
# tail data
# ---------------------------------------------------------------------------------------
SHAPES = [  # (gbs, H, H_u, V, interleaved): 1 row, 300 rows, odd widths, both pad styles
    (1, 64, 64, 100, False), (300, 61, 61, 37, False), (7, 96, 88, 129, True),
    (5, 257, 250, 33, False), (3, 3072, 2880, 64, True), (2, 1, 1, 5, False),
    (4, 520, 513, 24, False), (2, 8, 4, 9, True)]


def tail_data(gbs, h, h_u, v, interleaved, seed, *, scale=1.0, dtype=torch.float32,
              deferred=True, eps=1e-5, k=None, sp=None):
    """Real-looking tail inputs: N(0, scale) hidden with two massive-activation lanes
    (x20), garbage in the pad lanes (x100: they must be ignored), gamma ~ 1 +- 0.3,
    w ~ N(0, 1/H) in bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g) * scale  # [gbs, H]
    x[:, torch.randint(0, h, (2,), generator=g)] *= 20.0
    real = pad_mask(h, h_u, interleaved)
    x = torch.where(real, x, 100.0 * torch.randn(gbs, h, generator=g))
    gamma = 1 + 0.3 * torch.randn(h, generator=g)
    w = (torch.randn(h, v, generator=g) / math.sqrt(h)).to(torch.bfloat16)
    d = dict(x=x.to(dtype), gamma=gamma, w=w, eps=eps, h_u=h_u, interleaved=interleaved,
             deferred=deferred)
    if k is not None:
        d.update(k=min(k, v), nan_fold=False)
    if sp is not None:
        d["sp"] = sp
    return d


def tail_rows(data, idx):
    """The same problem on a subset of rows (the batch gate)."""
    out = dict(data, x=data["x"][list(idx)])
    if "sp" in data:
        out["sp"] = data["sp"][list(idx)]
    return out


def gemm_order_of(data) -> str:
    """The GEMM order a tail case runs in (TailConfig's default when the data names none)."""
    return data.get("gemm_order", TailConfig.gemm_order)


def tail_decl_of(data) -> Decl:
    """The mirror exchange's declaration (these kinds check the mirror path; the candidates
    exchange has its own kind in exchange_kinds)."""
    return tail_decl(data["w"].shape[0], data.get("deferred", True), gemm_order_of(data), "mirror")


shallow_decl = half_depth(tail_decl_of)  # control: every sum of the tail's declaration half as deep


def _tail_kw(data):
    return dict(eps=data["eps"], hidden_actual=data["h_u"], zero_interleaved_pad=data["interleaved"],
                deferred_rms=data["deferred"], gemm_order=gemm_order_of(data), exchange="mirror")


# ---------------------------------------------------------------------------------------
# the real ops and their float64 checks
# ---------------------------------------------------------------------------------------
def run_logits(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=1, **_tail_kw(data))
    return {"logits": out.logits}


def _nonfinite_rows(data) -> np.ndarray:
    """[gbs] bool: rows with NaN or inf in a real lane (their logits are defined as NaN)."""
    x = as_np(data["x"])
    real = pad_mask(x.shape[1], data["h_u"], data["interleaved"]).numpy()
    return ~np.isfinite(np.where(real, x, 0.0)).all(axis=1)


def logits_verdict(data, logits, decl: Decl) -> Verdict:
    """Finite rows: inside reference.tail.logits_range of `decl` (margin in range widths); rows with
    NaN/inf in a real lane: all NaN (ssq = inf or NaN -> rms 0 or NaN -> NaN * ...)."""
    y = as_np(logits)
    bad = _nonfinite_rows(data)
    if bad.any() and not np.isnan(y[bad]).all():
        r = int(np.nonzero(bad & ~np.isnan(y).all(axis=1))[0][0])
        return Verdict(False, None, f"row {r} has a non-finite input but logits not all NaN")
    ok_rows = ~bad
    if not ok_rows.any():
        return Verdict(True, None, "all rows non-finite: NaN as defined")
    lo, hi = logits_range(data["x"][torch.from_numpy(ok_rows)], data["gamma"], data["w"], eps=data["eps"],
                          decl=decl, hidden_actual=data["h_u"], interleaved=data["interleaved"],
                          deferred_rms=data["deferred"])
    inside, m = range_margin(y[ok_rows], lo, hi)
    if not inside.all():
        r, c = (int(i) for i in np.argwhere(~inside)[0])
        row = int(np.nonzero(ok_rows)[0][r])
        return Verdict(False, float(m.min()), f"logits[{row},{c}] = {float(y[row, c])!r} outside "
                       f"[{float(lo[r, c])!r}, {float(hi[r, c])!r}]")
    return Verdict(True, float(m.min()), f"{inside.size} elements inside")


def check_logits(data, out, run, decl) -> Verdict:
    """The float64 range; for 16-bit hidden also the widened fp32 run's bytes (a 16-bit
    hidden is defined as its exact fp32 widening)."""
    v = logits_verdict(data, out["logits"], decl)
    if v.ok and data["x"].dtype != torch.float32:
        d = diff_outputs(out, run(dict(data, x=data["x"].float())))
        if d:
            return Verdict(False, v.margin, f"{data['x'].dtype} input vs widened fp32: {d}")
    return v


def run_mirror(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=data["k"], nan_fold=data["nan_fold"],
                      **_tail_kw(data))
    return {"logits": out.logits, "topk_values": out.topk_values, "topk_indices": out.topk_indices}


def topk_verdict(rows_bf16, vals, ids, k, nan_fold) -> Verdict:
    """Exact: ids == topk_ref's and values == the row's bf16 values there (NaN == NaN)."""
    if vals.dtype != torch.bfloat16:
        return Verdict(False, None, f"topk_values must be bf16; got {vals.dtype}")
    rv, ri = topk_ref(rows_bf16, k, nan_fold=nan_fold)
    gi, gv = ids.numpy(), as_np(vals)
    same_v = (gv == rv) | (np.isnan(gv) & np.isnan(rv))
    if gi.shape != ri.shape or not (gi == ri).all() or not same_v.all():
        bad = np.argwhere((gi != ri) | ~same_v)[0] if gi.shape == ri.shape else (0, 0)
        r, j = (int(i) for i in bad)
        return Verdict(False, None, f"row {r} slot {j}: id {gi[r, j]} value {float(gv[r, j])!r}, "
                       f"exact top-k has id {ri[r, j]} value {float(rv[r, j])!r}")
    return Verdict(True, None, f"{gi.size} candidates exact")


def check_mirror(data, out, run, decl) -> Verdict:
    """logits in range; the top-k is the exact top-k of the bf16 mirror of those logits
    (so the collective carried bf16(logits)), and each value lies in mirror_range."""
    v = logits_verdict(data, out["logits"], decl)
    if not v.ok:
        return v
    mirror = out["logits"].to(torch.bfloat16)
    t = topk_verdict(mirror, out["topk_values"], out["topk_indices"], data["k"], data["nan_fold"])
    if not t.ok:
        return Verdict(False, v.margin, "mirror: " + t.detail)
    fin = ~_nonfinite_rows(data)
    if fin.any():
        lo, hi = logits_range(data["x"][torch.from_numpy(fin)], data["gamma"], data["w"], eps=data["eps"],
                              decl=decl, hidden_actual=data["h_u"], interleaved=data["interleaved"],
                              deferred_rms=data["deferred"])
        mlo, mhi = mirror_range(lo, hi)
        ids = out["topk_indices"].numpy()[fin]
        inside, _ = range_margin(as_np(out["topk_values"])[fin], np.take_along_axis(mlo, ids, 1),
                                 np.take_along_axis(mhi, ids, 1))
        if not inside.all():
            return Verdict(False, v.margin, "a top-k value is outside the mirror's bf16 range")
    return Verdict(True, v.margin, f"{v.detail}; top-k of the bf16 mirror exact")


# ---------------------------------------------------------------------------------------
# the tail logits with one planted defect (controls); defect=None is the real op
# ---------------------------------------------------------------------------------------
_EMULATIONS = {"chain": gemm_chain_emulation, "amx32": gemm_amx32_emulation, "dp32": gemm_dp32_emulation}
assert set(_EMULATIONS) == set(GEMM_ORDERS), "every tail order needs its emulation"


def _gemm_variant(a, w, defect, order):
    """[gbs, H] bf16 @ [H, V] bf16 -> fp32, in the declared `order` or a planted wrong one."""
    if defect == "fp16_accum":  # the chain kept in fp16: partial sums past 65504 are inf
        acc = torch.zeros(a.shape[0], w.shape[1], dtype=torch.float16)
        a32, w32 = a.float(), w.float()
        for h in range(a.shape[1]):
            acc = (acc.float() + a32[:, h:h + 1] * w32[h]).to(torch.float16)
        return acc.float()
    if defect == "splitk_threads":  # split-K over the thread count, partials added after
        parts = torch.tensor_split(torch.arange(a.shape[1]), torch.get_num_threads())
        acc = gemm_bf16(a[:, parts[0]].contiguous(), w[parts[0]].contiguous(), order=order)
        for p in parts[1:]:
            acc = acc + gemm_bf16(a[:, p].contiguous(), w[p].contiguous(), order=order)
        return acc
    if defect == "shuffled_order":  # a fresh summation order every call (atomics)
        perm = torch.randperm(a.shape[1], generator=torch.Generator().manual_seed(
            int.from_bytes(os.urandom(4), "little")))
        return gemm_bf16(a[:, perm].contiguous(), w[perm].contiguous(), order=order)
    if defect == "other_order":  # the other declared order posing as this one
        return gemm_bf16(a, w, order=next(o for o in GEMM_ORDERS if o != order))
    if defect == "amx32_order":  # amx32, the nearest order, posing as this one
        return gemm_bf16(a, w, order="amx32")
    if defect == "emulate":  # not a defect: the declared order, one exact rounding a step
        return _EMULATIONS[order](a, w)
    return gemm_bf16(a, w, order=order)


def emulate_logits(data) -> dict:
    """The declared order emulated step by step (the chain: numerics.fma32 over h; amx32,
    dp32: reference.gemm.gemm_amx32_emulation, gemm_dp32_emulation), for the emulate gate: the op's logits must be
    these bytes."""
    return logits_variant(data, defect="emulate")


def logits_variant(data, defect=None) -> dict:
    """shard_logits (tail.py) restated step by step with one defect (module docstring)."""
    x, g, w = data["x"], data["gamma"].reshape(-1), data["w"]
    order = gemm_order_of(data)
    validate_tail_inputs(x, data["gamma"], w, None, TailConfig(eps=data["eps"], hidden_actual=data["h_u"],
                                                               zero_interleaved_pad=data["interleaved"], k=1,
                                                               gemm_order=order),
                         vocab_size=w.shape[1])
    h, h_u, deferred = x.shape[1], data["h_u"], data["deferred"]
    real = pad_mask(h, h_u, data["interleaved"])  # [H]
    if defect == "fp16_narrowed" and x.dtype == torch.float16:
        x = (x * g.to(torch.float16)).float() / g  # x*gamma taken in fp16 (then undone)
    x = x.to(torch.float32)
    if defect != "pad_not_zeroed":
        x = torch.where(real, x, torch.zeros((), dtype=torch.float32))
    ssq = sum_squares(x, SSQ_ORDER)  # [gbs]
    if defect == "row_mixing":  # a neighbour row leaks into this row's statistic
        ssq = ssq + torch.roll(ssq, -1) * 2.0**-12
    n = torch.tensor(float(h if defect == "mean_over_H" else h_u), dtype=torch.float32)
    t = ssq / n
    if defect != "eps_dropped":
        t = t + torch.tensor(data["eps"], dtype=torch.float32)
    rms = torch.tensor(1.0, dtype=torch.float32) / sqrt_rn32(t)  # [gbs]
    if deferred or defect == "rms_after_round":
        a = (x * g).to(torch.bfloat16)
    else:
        a = ((x * rms[:, None]) * g).to(torch.bfloat16)
    if defect != "pad_not_zeroed":
        a = torch.where(real, a, torch.zeros((), dtype=torch.bfloat16))  # [gbs, H]
    acc = _gemm_variant(a, w, defect, order)  # [gbs, V]
    return {"logits": acc * rms[:, None] if deferred or defect == "rms_after_round" else acc}


def mirror_variant(data, defect=None) -> dict:
    """run_mirror restated; defect "mirror_skipped": the fp32 logits are carried and
    ranked (ties by id in fp32), values rounded to bf16 only at the end."""
    if defect is None:
        return run_mirror(data)
    logits = logits_variant(data)["logits"]  # [gbs, V]
    ids = torch.sort(-logits, dim=1, stable=True).indices[:, :data["k"]]
    return {"logits": logits, "topk_values": logits.gather(1, ids).to(torch.bfloat16), "topk_indices": ids}


# ---------------------------------------------------------------------------------------
# special values and adversarial data for the tail logits
# ---------------------------------------------------------------------------------------
def _zero_logits(data, out, run, decl) -> Verdict:
    y = out["logits"]
    ok = bool((y == 0).all())
    return Verdict(ok, None, "logits all 0 as defined" if ok else f"expected all 0; got {y.flatten()[:4].tolist()}")


def _rows_independent(rows):
    """Expect: the other rows' bytes equal their solo runs, then the kind's check."""
    def expect(data, out, run, decl, *, check):
        others = [i for i in range(data["x"].shape[0]) if i not in rows]
        d = diff_outputs(run(tail_rows(data, others)), {k: v[others] for k, v in out.items()})
        if d:
            return Verdict(False, None, f"rows {others} changed by the special row: {d}")
        return check(data, out, run, decl)
    return expect


def _pad_ignored(data, out, run, decl, *, check) -> Verdict:
    real = pad_mask(data["x"].shape[1], data["h_u"], data["interleaved"])
    clean = dict(data, x=torch.where(real, data["x"], torch.zeros((), dtype=data["x"].dtype)))
    d = diff_outputs(out, run(clean))
    return Verdict(False, None, f"pad lane NaN/inf reached the outputs: {d}") if d else check(data, out, run, decl)


def tail_special(fast, *, dtype=torch.float32, deferred=True, k=None, check=check_logits):
    """Gate 3 for the logits kinds: each special value with its defined result or error."""
    mk = partial(tail_data, dtype=dtype, deferred=deferred, k=k)
    cases = []
    for label, val in (("NaN lane", math.nan), ("+inf lane", math.inf), ("-inf lane", -math.inf)):
        d = mk(4, 64, 60, 50, False, 11)
        x = d["x"].clone()
        x[1, 3] = val
        if k is not None:
            d["nan_fold"] = True  # the NaN row's top-k is defined only with the fold
        cases.append(Case(f"{label} -> that row NaN, others unchanged", dict(d, x=x),
                          expect=partial(_rows_independent([1]), check=check)))
    for label, val in (("zeros", 0.0), ("-0.0", -0.0)):
        d = mk(3, 64, 64, 40, False, 12)
        cases.append(Case(f"{label} -> logits 0 (rms = 1/sqrt(eps))", dict(d, x=torch.full_like(d["x"], val)),
                          expect=_zero_logits))
    d = mk(3, 64, 64, 40, False, 13)
    sign = torch.sign(torch.randn(d["x"].shape, generator=torch.Generator().manual_seed(13)))
    mags = ((("tiny 1e-30 (squares underflow: rms = 1/sqrt(eps))", 1e-30), ("subnormal 2^-128", 2.0**-128),
             ("huge 1e19 (ssq overflows: rms = 0)", 1e19)) if dtype != torch.float16 else
            (("fp16 subnormal 2^-24", 2.0**-24), ("fp16 near max 6e4", 6e4)))
    for label, mag in mags:
        cases.append(Case(label, dict(d, x=(sign * mag).to(dtype)), expect=_zero_logits if mag == 1e19 else None))
    d = mk(4, 96, 88, 33, True, 14)
    x = d["x"].clone()
    real = pad_mask(96, 88, True)
    x[:, ~real] = torch.tensor([math.nan, math.inf, -math.inf, 1e4]).to(dtype).repeat(2)
    cases.append(Case("NaN/inf in pad lanes -> ignored", dict(d, x=x), expect=partial(_pad_ignored, check=check)))
    cases.extend(tail_errors(mk(2, 16, 16, 8, False, 15)))
    return cases


def tail_errors(d):
    """Defined errors: ValueError with expected-vs-got, nothing computed."""
    return [Case("eps < 0 -> ValueError", dict(d, eps=-1e-5), raises=r"eps must be .*>= 0"),
            Case("eps NaN -> ValueError", dict(d, eps=math.nan), raises=r"eps must be .*>= 0"),
            Case("int hidden -> ValueError", dict(d, x=d["x"].to(torch.int32)), raises=r"hidden_states must be float32"),
            Case("fp32 weight -> ValueError", dict(d, w=d["w"].float()), raises=r"lm_head_weight_t must be bfloat16"),
            Case("H_u > H -> ValueError", dict(d, h_u=d["x"].shape[1] + 1), raises=r"hidden_actual must be (an int )?in"),
            Case("1-D hidden -> ValueError", dict(d, x=d["x"][0]), raises=r"hidden_states must be \[gbs, H\]")]


def _exact_logits(data, out, run, decl, *, check) -> Verdict:
    """Gate 4: every partial sum is exact in fp32 in any order and rms = 1 or 1/16 exactly,
    so the logits must equal the exact sum itself, and lie in range."""
    v = check(data, out, run, decl)
    want = np.asarray(data["exact"], dtype=np.float64)
    got = as_np(out["logits"])
    if not np.array_equal(got, want):
        r, c = (int(i) for i in np.argwhere(got != want)[0])
        return Verdict(False, v.margin, f"logits[{r},{c}] = {float(got[r, c])!r}; the exact sum is {float(want[r, c])!r}")
    return v


def tail_adversarial(fast, *, dtype=torch.float32, deferred=True, k=None, check=check_logits,
                     gemm_order=TailConfig.gemm_order):
    """Gate 4: powers of two, one product 2^17 (> fp16's 65504) and rows of +-16 whose
    squares sum to 65536; eps = 0 so rms is a power of two; pad lanes hold 1e4 garbage;
    and GEMM data that errs near the declared bound of `gemm_order`."""
    cases = []
    for seed, (h, h_u) in enumerate([(256, 256), (256, 240)]):
        g = torch.Generator().manual_seed(40 + seed)
        sgn = lambda *s: torch.where(torch.rand(*s, generator=g) < 0.5, -1.0, 1.0)  # noqa: E731
        x = sgn(4, h)  # rows 0, 1: +-1 (ssq = H_u, rms = 1); rows 2, 3: +-16 (ssq = 65536 H_u/256)
        x[2:] *= 16.0
        gam = 2.0 ** torch.randint(-1, 2, (h,), generator=g).float()  # {1/2, 1, 2}
        w = sgn(h, 24) * 2.0 ** torch.randint(-4, 5, (h, 24), generator=g).float()
        w[0] = 2.0**17 * sgn(24)  # the FIRST product is past fp16's range in every column
        real = pad_mask(h, h_u, False)
        x = torch.where(real, x, torch.full_like(x, 1e4))
        xr = torch.where(real, x, torch.zeros_like(x))
        rms = 1.0 / torch.sqrt((xr * xr).sum(1, keepdim=True) / h_u)  # exact powers of two
        a = (xr * rms * gam) if not deferred else (xr * gam)
        exact = (a.double() @ w.double()) * (rms.double() if deferred else 1.0)
        d = dict(x=x.to(dtype), gamma=gam, w=w.to(torch.bfloat16), eps=0.0, h_u=h_u, interleaved=False,
                 deferred=deferred, exact=exact.numpy(), gemm_order=gemm_order)
        if k is not None:
            d.update(k=min(k, 24), nan_fold=False)
        cases.append(Case(f"powers of two, H={h} H_u={h_u}, product 2^17", d,
                          expect=partial(_exact_logits, check=check)))
    what = {"chain": "GEMM chain rounding up at every add (3/4 of the declared bound)",
            "amx32": "amx32 GEMM: lane chain and block adds tie back to 1 (78 of the declared 81 u)",
            "dp32": "dp32 GEMM: lane chain and block adds tie back to 1 (94 of the declared 96 u)"}[gemm_order]
    cases.append(Case(what, _gemm_at_bound(dtype=dtype, deferred=deferred, k=k, order=gemm_order)))
    return cases


def _gemm_at_bound(*, dtype, deferred, k, order, v=24):
    """a = 1 in every lane (x = 1, gamma = 1, eps = 0: rms is exactly 1) and w built so the
    GEMM of `order` errs close to its declared bound gamma(depth, u32) * sum|terms|:
      chain: w[0] = 1, w[1:] = 5*2^-26 (5/8 of an ulp of 1): every add rounds UP by 3/8
        ulp, 3/4 of gamma(H);
      amx32 (H = 2048, NB = 64): w[0] = 1, the other 15 even lanes of block 0 and lane 0
        of every later block 2^-24 (half an ulp of 1), the rest 0: each of those 14 + NB
        adds is a tie back to 1, (14 + NB) u against the declared (17 + NB) u (a short H
        would leave the gap to half the depth inside the rms range's own slack).
      dp32 (H = 2048, NB = 64): w[0] = 1, the other 31 lanes of block 0 and lane 0 of every
        later block 2^-24: block 0's one chain (odd lane first: lane 1 exact, then lane 0's
        1 + 2^-24 and 30 more) ties back to 1 31 times, the NB - 1 block adds once each,
        (30 + NB) u against the declared (32 + NB) u.
    The op is inside its declared range; a declaration of half the depth is too narrow."""
    h = 256 if order == "chain" else 2048
    lane = torch.arange(h)
    if order == "chain":
        w = torch.full((h, v), 5 * 2.0**-26)
    elif order == "amx32":
        w = torch.zeros(h, v)
        w[((lane < 32) & (lane % 2 == 0)) | (lane % 32 == 0)] = 2.0**-24
    else:
        assert order == "dp32", order
        w = torch.zeros(h, v)
        w[(lane < 32) | (lane % 32 == 0)] = 2.0**-24
    w[0] = 1.0
    d = dict(x=torch.ones(2, h).to(dtype), gamma=torch.ones(h), w=w.to(torch.bfloat16), eps=0.0, h_u=h,
             interleaved=False, deferred=deferred, gemm_order=order)
    if k is not None:
        d.update(k=min(k, v), nan_fold=False)
    return d


def tail_shapes(fast, *, dtype=torch.float32, deferred=True, k=None):
    return [Case(f"{gbs}x{h} (H_u={hu}{', interleaved' if il else ''}) V={v}",
                 tail_data(gbs, h, hu, v, il, 100 + i, dtype=dtype, deferred=deferred, k=k))
            for i, (gbs, h, hu, v, il) in enumerate(SHAPES)]


def tail_random(fast, *, dtype=torch.float32, deferred=True, k=None, v=512):
    seeds = range(2 if fast else 6)
    scales = (1.0, 1e-2, 30.0, 1.0, 3.0, 0.1)
    return [Case(f"seed {s} scale {scales[s]}", tail_data(8, 256, 240, v, True, s, scale=scales[s],
                                                           dtype=dtype, deferred=deferred, k=k))
            for s in seeds]


# ---------------------------------------------------------------------------------------
# exact top-k
# ---------------------------------------------------------------------------------------
def rows_data(r, v, seed, *, k, chunk=512, scale=2.0, nan_fold=False):
    """bf16 rows [R, V] ~ N(0, scale) (bf16 ties are common at V = 1000s)."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(r, v, generator=g) * scale).to(torch.bfloat16)
    return dict(rows=rows, k=min(k, v), chunk=chunk, nan_fold=nan_fold)


def take_rows_rows(data, idx):
    out = dict(data, rows=data["rows"][list(idx)])
    if "sp" in data:
        out["sp"] = data["sp"][list(idx)]
    return out


def run_topk(data) -> dict:
    v, i, _ = exact_topk(data["rows"], k=data["k"], nan_fold=data["nan_fold"], chunk=data["chunk"])
    return {"topk_values": v, "topk_indices": i}


def check_topk(data, out, run, decl) -> Verdict:
    return topk_verdict(data["rows"], out["topk_values"], out["topk_indices"], data["k"], data["nan_fold"])


def topk_variant(data, defect=None) -> dict:
    """exact_topk with one defect: "ties_higher_id" (equal values ranked by the higher id)
    or "stage1_short" (stage 1 keeps only k/2 keys per chunk: not exact when more than
    k/2 winners share a chunk)."""
    rows, k, nf, chunk = data["rows"], data["k"], data["nan_fold"], data["chunk"]
    if defect == "ties_higher_id":
        v, i, _ = exact_topk(rows.flip(-1), k=k, nan_fold=nf, chunk=chunk)
        return {"topk_values": v, "topk_indices": rows.shape[1] - 1 - i}
    if defect == "stage1_short":
        r, n_v = rows.shape
        if not 1 <= k <= n_v:
            raise ValueError(f"k must be in [1, V={n_v}]; got {k}")
        n = -(-n_v // chunk)
        keys = torch.cat([row_keys(rows, nan_fold=nf), torch.zeros(r, n * chunk - n_v, dtype=torch.int64)], 1)
        s1 = torch.topk(keys.view(r, n, chunk), max(1, min(k, chunk) // 2), dim=-1).values
        cand = s1.reshape(r, -1)
        cand = torch.cat([cand, torch.zeros(r, max(0, k - cand.shape[1]), dtype=torch.int64)], 1)
        v, i = split_keys(torch.topk(cand, k, dim=-1).values)
        return {"topk_values": v, "topk_indices": i}
    return run_topk(data)


def _topk_no_crash(data, out, run, decl) -> Verdict:
    r, k = data["rows"].shape[0], data["k"]
    ok = tuple(out["topk_indices"].shape) == (r, k) and bool(((out["topk_indices"] >= 0) &
                                                               (out["topk_indices"] < data["rows"].shape[1])).all())
    return Verdict(ok, None, "NaN without the fold: unspecified but no crash, ids in range" if ok else
                   "NaN without the fold: bad shape or ids")


def topk_shapes(fast):
    table = [(1, 1, 1, 4096), (300, 37, 5, 8), (3, 4097, 256, 4096), (2, 10000, 256, 4096),
             (5, 129, 129, 16), (4, 1000, 1, 64), (2, 61, 60, 7)]
    return [Case(f"{r}x{v} k={k} chunk={c}", rows_data(r, v, 200 + i, k=k, chunk=c))
            for i, (r, v, k, c) in enumerate(table)]


def topk_random(fast):
    return [Case(f"seed {s}", rows_data(16, 3000, s, k=64, scale=(2.0, 0.01, 300.0, 1.0)[s % 4]))
            for s in range(2 if fast else 6)]


def topk_special(fast):
    d = rows_data(6, 300, 7, k=20, chunk=64, nan_fold=True)
    rows = d["rows"].float()
    rows[0, [0, 5, 77]] = math.nan  # NaN below every number (fold)
    rows[1] = math.nan  # an all-NaN row: ids 0..k-1
    rows[2, [3, 9, 200]] = math.inf  # +inf ties by id
    rows[2, [4, 8]] = -math.inf
    rows[3] = -math.inf  # all -inf: ids 0..k-1, never a pad lane
    rows[4] = torch.where(torch.arange(300) % 2 == 0, 0.0, -0.0)  # +-0 tie by id
    rows[5] = torch.randn(300, generator=torch.Generator().manual_seed(5)).sign() * 2.0**-130  # subnormal
    cases = [Case("NaN (folded), +-inf, all -inf, +-0, subnormal", dict(d, rows=rows.to(torch.bfloat16)))]
    nf = dict(d, rows=rows.to(torch.bfloat16), nan_fold=False)
    cases.append(Case("NaN without the fold: unspecified, no crash", nf, expect=_topk_no_crash))
    cases += [Case("k = 0 -> ValueError", dict(d, k=0), raises=r"k must be in \[1, V=300\]"),
              Case("k > V -> ValueError", dict(d, k=301), raises=r"k must be in \[1, V=300\]"),
              Case("chunk = 0 -> ValueError", dict(d, chunk=0), raises=r"chunk must be >= 1")]
    return cases


def topk_adversarial(fast):
    v, c = 1000, 128
    eq = torch.full((2, v), 1.5)  # all ties: ids 0..k-1
    one = torch.randn(1, v, generator=torch.Generator().manual_seed(9)) - 10
    one[0, 3 * c - 20:4 * c] = torch.linspace(5, 6, 20 + c)  # every winner in chunks 2-3
    one[0, c - 1] = one[0, c] = 7.0  # a tie straddling a chunk boundary
    asc = torch.arange(v, dtype=torch.float32)[None] / 8  # winners at the end, ties of 8
    rows = torch.cat([eq, one, asc]).to(torch.bfloat16)
    return [Case("ties everywhere, winners in one chunk, ties across chunk edges", dict(rows=rows, k=64, chunk=c, nan_fold=False)),
            Case("k = V with a padded last chunk", dict(rows=rows, k=v, chunk=c, nan_fold=False))]


# ---------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------
def random_params(r, seed, k) -> torch.Tensor:
    """[R, 5] fp32 (top_k, top_p, temperature, u, min_p): a mix of every sampling option."""
    g = torch.Generator().manual_seed(1000 + seed)
    pick = lambda vals: torch.tensor(vals)[torch.randint(0, len(vals), (r,), generator=g)]  # noqa: E731
    return torch.stack([pick([0.0, 1.0, 5.0, 40.0, float(k), float(k + 7)]),
                        pick([1.0, 0.95, 0.8, 0.5, 0.1]), pick([1.0, 0.7, 1.5, 0.0, 0.05]),
                        torch.rand(r, generator=g) * (1 - 2.0**-24), pick([0.0, 0.0, 0.05])], 1).float()


def sampler_data(r, v, seed, *, k, scale=2.0):
    d = rows_data(r, v, seed, k=k, scale=scale)
    d["sp"] = random_params(r, seed, d["k"])
    return d


def run_sampler(data) -> dict:
    """rows_tail's tokens, logprobs, truncated flags, and (where the fused C kernel is built)
    "mass" [R, 3] float64: the kernel's own S1, lse1, nz per row (rows_tail_fused's
    debug_mass export; NaN on rows it leaves undecided)."""
    out = rows_tail(data["rows"], k=data["k"], sampling_params=data["sp"], nan_fold=data["nan_fold"])
    return with_fused_mass(data, {"tokens": out.tokens, "logprobs": out.logprobs, "truncated": out.truncated})


def with_fused_mass(data, res: dict) -> dict:
    """res plus "mass" [R, 3] float64 (S1, lse1, nz per row, NaN on undecided rows) from
    rows_tail_fused(debug_mass=True), where the fused C kernel is built; res as is where not."""
    if fused_backends():
        res = dict(res, mass=rows_tail_fused(data["rows"], k=data["k"], sampling_params=data["sp"],
                                             nan_fold=data["nan_fold"], debug_mass=True).debug_mass)
    return res


def sampler_variant(data, defect=None) -> dict:
    """rows_tail's sampler restated with one defect: "topp_drops_crossing" (keep iff the
    mass INCLUDING the candidate is < top_p) or "greedy_1e-3" (T < 1e-3 taken as greedy);
    the fused kernel's exported mass as run_sampler has it (no defect touches it)."""
    rows, k, sp, nf = data["rows"], data["k"], data["sp"], data["nan_fold"]
    validate_params(sp, rows.shape[0])
    vals, ids, _ = exact_topk(rows, k=k, nan_fold=nf)
    plan = sampling_plan(vals, rows, sp, nan_fold=nf)
    top_p = sp[:, 1].double()[:, None]
    if defect == "topp_drops_crossing":
        keep = plan["keep"] & ((plan["running"] < top_p) | (top_p >= 1))
        keep[:, 0] = True
        plan = dict(plan, keep=keep)
    if defect == "greedy_1e-3":
        plan = dict(plan, greedy=sp[:, 2].double() < 1e-3)
    pos = draw(plan)[:, None]
    v_tok = vals.double().gather(1, pos)[:, 0]
    return with_fused_mass(data, {"tokens": ids.gather(1, pos)[:, 0], "truncated": plan["truncated"],
                                  "logprobs": (v_tok - plan["lse1"]).to(torch.float32)})


def sampler_verdict(rows_bf16, sp, k, nan_fold, out, *, exact=False, decl: Decl | None = None) -> Verdict:
    """Per row, the float64 decision on the row's own bf16 values (delta = 0): on a
    certified row the truncated flag must be the defined one and, where the exact token can be
    drawn from k candidates (`comparable`), the token must match; near-ties (a mass within
    the float64 slack of a threshold) are counted; the logprob must be within
    slack*(1 + |lse| + |lp|) + u32 of the float64 log_softmax at its token."""
    r64 = as_np(rows_bf16)
    if nan_fold:
        r64 = np.where(np.isnan(r64), -np.inf, r64)
    n_v = r64.shape[1]
    slack = 0.0 if exact else decl_slack(decl or rows_tail_decl(n_v, k), n_v, k)
    spn = sp.double().numpy()
    spn = np.pad(spn, ((0, 0), (0, 5 - spn.shape[1])), constant_values=0.0)
    if sp.shape[1] < 4:
        spn[:, 3] = 0.5
    tok, lp, tr = out["tokens"].numpy(), out["logprobs"].double().numpy(), out["truncated"].numpy()
    counts = dict(certified=0, matched=0, near_ties=0, truncated=0)
    worst, fail = math.inf, ""
    for i in range(r64.shape[0]):
        tk, tp, t, u, mp = spn[i]
        dec = sample_decision(r64[i], np.zeros(n_v), top_k=tk, top_p=tp, temperature=t, u=u,
                              min_p=mp, k=k, slack=slack)
        if not dec["certified"]:
            counts["near_ties"] += 1
            continue
        counts["truncated"] += dec["truncated"]
        if bool(tr[i]) != dec["truncated"] and not fail:
            fail = (f"row {i} {spn[i].tolist()}: truncated flag {bool(tr[i])}, defined {dec['truncated']} "
                    f"(k={k}, {dec['n_filter']} filtered, {dec['n_keep']} kept)")
        if not dec["comparable"]:
            continue
        counts["certified"] += 1
        if tok[i] != dec["token"] and not fail:
            fail = (f"row {i} {spn[i].tolist()}: token {tok[i]}, float64 gives {dec['token']} "
                    f"(slot {dec['slot']} of {dec['n_keep']} kept)")
        else:
            counts["matched"] += 1
        ref = logprob_ref(r64[i])[tok[i]]
        if not (lp[i] == ref or np.isnan(ref) and np.isnan(lp[i])):
            lse = abs(r64[i].max()) + abs(ref)
            err = slack * (1 + lse + abs(ref)) + U["fp32"] * (abs(ref) + 1e-300) * 1.0001
            inside, m = range_margin(lp[i], ref - err, ref + err)
            worst = min(worst, float(m))
            if not inside and not fail:
                fail = f"row {i}: logprob {lp[i]!r} vs float64 {ref!r} (bound {err:.3g})"
    detail = fail or (f"{counts['matched']}/{counts['certified']} certified rows match, "
                      f"{counts['near_ties']} near-ties, {counts['truncated']} truncated")
    return Verdict(not fail, None if worst == math.inf else worst, detail, counts)


def check_sampler(data, out, run, decl) -> Verdict:
    return sampler_verdict(data["rows"], data["sp"], data["k"], data["nan_fold"], out,
                           exact=bool(data.get("exact", False)), decl=decl)


def _sp(rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(len(rows), 5)


def _tokens_are(want):
    def expect(data, out, run, decl):
        got = out["tokens"].tolist()
        return Verdict(got == list(want), None, f"tokens {got}" + ("" if got == list(want) else f", defined {list(want)}"))
    return expect


def sampler_shapes(fast):
    table = [(1, 5, 5), (300, 37, 8), (7, 1000, 64), (3, 4097, 256), (2, 61, 61)]
    return [Case(f"{r}x{v} k={k}", sampler_data(r, v, 300 + i, k=k)) for i, (r, v, k) in enumerate(table)]


def sampler_random(fast):
    return [Case(f"seed {s}", sampler_data(64, 1000, s, k=64, scale=(2.0, 0.5, 8.0, 1.0, 4.0, 2.0)[s]))
            for s in range(2 if fast else 6)]


def sampler_special(fast):
    t_above = float(np.nextafter(np.float32(1e-5), np.float32(1)))
    d = rows_data(7, 100, 17, k=16)
    rows = d["rows"].float()
    rows[:, 40] = rows[:, 41] = rows.max() + 1  # a tied top two (ids 40, 41)
    sp = _sp([[0, 1, 0, 0.9, 0], [0, 1, np.float32(1e-5), 0.9, 0], [2, 1, t_above, 0.75, 0],
              [2, 1, 5e-4, 0.75, 0], [5, 1, 1, 0, 0], [5, 1, 1, 1 - 2.0**-24, 0], [20, 1, 1, 0.5, 0]])
    cases = [Case("T = 0, fp32(1e-5) greedy; T just above 1e-5 and 5e-4 sample the tie; u = 0, "
                  "u = 1-2^-24; top_k > k flagged", dict(d, rows=rows.to(torch.bfloat16), sp=sp))]
    inf_row = torch.full((2, 16), 1.0)
    inf_row[:, [3, 7]] = math.inf
    cases.append(Case("two +inf lanes split the mass: u = 0.25 -> id 3, u = 0.75 -> id 7",
                      dict(rows=inf_row.to(torch.bfloat16), k=16, chunk=512, nan_fold=False,
                           sp=_sp([[0, 1, 1, 0.25, 0], [0, 1, 1, 0.75, 0]])), expect=_tokens_are([3, 7])))
    cases.append(Case("all -inf row: uniform, u = 0.3 -> id 2; u = 0.99 -> id 7",
                      dict(rows=torch.full((2, 8), -math.inf).to(torch.bfloat16), k=8, chunk=512, nan_fold=False,
                           sp=_sp([[0, 1, 1, 0.3, 0], [0, 1, 1, 0.99, 0]])), expect=_tokens_are([2, 7])))
    nrows = rows_data(3, 64, 18, k=64)["rows"].float()
    nrows[:, [0, 4]] = math.nan
    cases.append(Case("NaN lanes (folded) never chosen", dict(rows=nrows.to(torch.bfloat16), k=64, chunk=512, nan_fold=True,
                                                           sp=_sp([[0, 1, 0, 0.5, 0], [0, 1, 1, 0.5, 0], [3, 0.9, 0.7, 0.2, 0]]))))
    base = dict(rows=rows[:1].to(torch.bfloat16), k=16, chunk=512, nan_fold=False)
    for label, row, match in (("NaN param", [0, math.nan, 1, 0.5, 0], "has NaN"),
                              ("top_p = 0", [0, 0, 1, 0.5, 0], r"top_p must be in \(0, 1\]"),
                              ("top_p > 1", [0, 1.5, 1, 0.5, 0], r"top_p must be in \(0, 1\]"),
                              ("T < 0", [0, 1, -1, 0.5, 0], "temperature must be >= 0"),
                              ("u = 1", [0, 1, 1, 1.0, 0], r"u must be in \[0, 1\)"),
                              ("top_k = 2.5", [2.5, 1, 1, 0.5, 0], "top_k must be a whole number")):
        cases.append(Case(f"{label} -> ValueError naming row 0", dict(base, sp=_sp([row])), raises=rf"row 0: {match}"))
    return cases


def sampler_adversarial(fast):
    """Exact dyadic decisions: 4 equal maxima (ids 2, 5, 9, 11), the rest -inf, so every
    p is 1/4 and every mass and cdf is exact; top_p and u sit ON the boundaries."""
    row = torch.full((16,), -math.inf)
    row[[2, 5, 9, 11]] = 3.0
    sp = _sp([[0, 0.5, 1, 0.5, 0], [0, 0.5, 1, 0.4999, 0], [2, 1, 1, 0.75, 0], [0, 0.75, 1, 0.0, 0],
              [0, 0.25, 1, 0.9, 0], [0, 1, 0.5, 0.9, 1.0], [0, 1, 1, 0.5, 0], [0, 1, 1, 0.25, 0]])
    rows = row.repeat(sp.shape[0], 1).to(torch.bfloat16)
    return [Case("top_p and u exactly on mass boundaries, ties at the top-k threshold",
                 dict(rows=rows, k=16, chunk=512, nan_fold=False, sp=sp, exact=True))]


def readout_rows(r=8, v=1024, seed=0) -> torch.Tensor:
    """bf16 rows [R, V] whose raw logprob shows the full-row mass S1's last bit: vmax = 1
    at one id, ~30 lanes at 1 - U(22, 26) (terms ~2^-33, several in the max's lane chain
    mod 256 and mod 128), the rest -inf. S1 - 1 < 2^-28, so lse1 - 1 = log64(S1) is exact
    in fp32 and the greedy token's logprob is -(lse1 - 1) to the bit: a wrong lane count
    or exp term in the fused kernel's mass changes it."""
    rng = np.random.default_rng(seed)
    rows = np.full((r, v), -np.inf)
    for i in range(r):
        top = int(rng.integers(0, 256))
        rows[i, top] = 1.0
        lanes = np.concatenate([top + 128 * np.arange(1, v // 128), rng.integers(0, v, 24)]) % v
        lanes = lanes[lanes != top]
        rows[i, lanes] = 1.0 - rng.uniform(22, 26, lanes.size)
    return torch.from_numpy(rows.astype(np.float32)).to(torch.bfloat16)


def sampler_bytes(fast):
    """The byte gates' sampler inputs: random rows, and greedy readout rows (S1's bits)."""
    rows = readout_rows()
    sp = _sp([[0, 1, 0, 0.5, 0]] * rows.shape[0])
    return [Case("seed 0", sampler_data(64, 1000, 0, k=64)),
            Case("readout rows: logprob = -(lse1 - 1) exactly", dict(rows=rows, k=4, chunk=512, nan_fold=False, sp=sp))]


def emulate_sampler(data, *, lanes=256) -> dict:
    """The reference path's tokens and truncated flags, and the raw logprob emulated from
    the declared mass (reference.tail.logprob_emulation: sum64 in `lanes` chains)."""
    out = rows_tail(data["rows"], k=data["k"], sampling_params=data["sp"], nan_fold=data["nan_fold"], path="reference")
    lp = logprob_emulation(data["rows"], out.tokens.numpy(), lanes=lanes)
    res = {"tokens": out.tokens, "logprobs": torch.from_numpy(lp), "truncated": out.truncated}
    if fused_backends():
        res["mass"] = mass_rows_emulation(data["rows"], data["nan_fold"], lanes=lanes)
    return res


def mass_rows_emulation(rows_bf16, nan_fold: bool, *, lanes=256) -> torch.Tensor:
    """[R, 3] float64 (S1, lse1, nz) by the declaration: reference.tail.mass_emulation at
    T = 1 (sum64 in `lanes` chains), lse1 = fl64(vmax + log64(S1)); NaN on rows the declared
    mass leaves undefined (a NaN lane without nan_fold, no finite maximum). The fused
    kernel's debug_mass export must equal it bit for bit (the emulate gate)."""
    r64 = as_np(rows_bf16)  # [R, V]
    nan_row = np.isnan(r64).any(axis=1)
    r64 = np.where(np.isnan(r64), -np.inf, r64)  # nan_fold: a NaN lane counts as -inf
    with np.errstate(invalid="ignore"):
        m, s, nz = mass_emulation(r64, np.ones(r64.shape[0]), lanes=lanes)
    lse1 = m + log64(torch.from_numpy(s)).numpy()
    res = torch.from_numpy(np.stack([s, lse1, nz.astype(np.float64)], axis=1))  # [R, 3]
    res[torch.from_numpy((nan_row & (not nan_fold)) | ~np.isfinite(m))] = float("nan")
    return res


def sampler_mass_lanes_128(data) -> dict:
    """Control: the op with its full-row mass summed in 128 lane chains (the logprob and
    the exported mass)."""
    out, emu = run_sampler(data), emulate_sampler(data, lanes=128)
    return dict(out, **{n: emu[n] for n in ("logprobs", "mass") if n in emu})


# ---------------------------------------------------------------------------------------
# row_mass: the full-row max, mass and massive-lane count (the sampler's normalizer)
# ---------------------------------------------------------------------------------------
def row_mass_decl(data) -> Decl:
    """row_mass's one sum is rows_tail_decl's "S (full row)" (single-sourced)."""
    return Decl("row_mass", ("z = fl64(row / scale)", "m = max z", "e = exp64(z - m) (z == m -> 1)", "S = sum64(e)"),
                (rows_tail_decl(data["row"].shape[1], 1).sum("S (full row)"),))


def run_row_mass(data) -> dict:
    m, s, nz = row_mass(data["row"], data["scale"])
    return {"m": m, "S": s, "nz": nz}


def emulate_row_mass(data, *, lanes=256, exp=None) -> dict:
    """(m, S, nz) by the declaration (reference.tail.mass_emulation); lanes / exp: planted
    variants (another lane count, another exp for the terms)."""
    if exp is not None:  # control: another exp for the terms
        z = data["row"] / data["scale"][:, None]
        m = z.max(1).values
        e = torch.where(z == m[:, None], torch.ones_like(z), exp(z - m[:, None]))
        return {"m": m, "S": torch.from_numpy(sum64_emulation(e.numpy(), lanes)), "nz": (e > 0).sum(1)}
    m, s, nz = mass_emulation(data["row"], data["scale"], lanes=lanes)
    return {"m": torch.from_numpy(m), "S": torch.from_numpy(s), "nz": torch.from_numpy(nz).to(torch.int64)}


def check_row_mass(data, out, run, decl) -> Verdict:
    """m = max(row / scale) exactly; S within (bound(S) + 2^-50) * S* of the float64
    S* = sum exp(z - m) (libm; exp64's < 2 ulp per term); nz = #{z - m > -745}."""
    z = as_np(data["row"]) / as_np(data["scale"])[:, None]
    m = z.max(axis=1)
    got_m = out["m"].numpy()
    if not np.array_equal(got_m, m):
        return Verdict(False, None, f"m = {got_m.tolist()}, max(row/scale) = {m.tolist()}")
    with np.errstate(invalid="ignore"):
        d = np.where(z == m[:, None], 0.0, z - m[:, None])
    exact = np.exp(d).sum(axis=1)
    b = decl.sum("S (full row)").bound() + 2.0**-50
    inside, mg = range_margin(out["S"].numpy(), exact * (1 - b), exact * (1 + b))
    if not inside.all():
        r = int(np.nonzero(~inside)[0][0])
        return Verdict(False, float(mg.min()), f"S[{r}] = {float(out['S'][r])!r} outside +-{b:.3g} of {exact[r]!r}")
    nz = (d > -745).sum(axis=1)
    if not np.array_equal(out["nz"].numpy(), nz):
        return Verdict(False, float(mg.min()), f"nz = {out['nz'].tolist()}, lanes with mass = {nz.tolist()}")
    return Verdict(True, float(mg.min()), f"{len(exact)} rows: m exact, S in range, nz exact")


def mass_data(r, v, seed, *, scale=2.0, temps=(1.0,)):
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(r, v, generator=g) * scale).to(torch.bfloat16).double()
    t = torch.tensor(temps, dtype=torch.float32).double()
    return {"row": row, "scale": t[torch.arange(r) % len(temps)]}


def _mass_specials(fast):
    row = torch.randn(5, 300, generator=torch.Generator().manual_seed(3)).double()
    row[0, 7] = math.inf  # +inf max: z == m -> 1, the rest 0
    row[1] = -math.inf  # all -inf: every lane z == m -> S = V
    row[2, :150] = -1000.0  # terms below exp64's floor: no mass
    row[3] = 5.0  # all tied: S = V exactly
    row[4, ::2] = -720.0  # subnormal terms
    return [Case("+inf lane, all -inf, floor-deep lanes, all tied, subnormal terms",
                 {"row": row, "scale": torch.ones(5, dtype=torch.float64)}),
            Case("float32 row -> ValueError", {"row": row.float(), "scale": torch.ones(5, dtype=torch.float64)},
                 raises=r"row must be torch.float64")]


def mass_kind() -> Kind:
    gens = {"shapes": lambda fast: [Case(f"{r}x{v}", mass_data(r, v, 70 + i)) for i, (r, v) in
                                    enumerate([(1, 1), (3, 255), (2, 257), (4, 4097), (2, 49155)])],
            "random": lambda fast: [Case(f"seed {s}", mass_data(8, 3000, s, scale=(2.0, 20.0, 0.1)[s], temps=(1.0, 0.7, 1.3)))
                                    for s in range(2 if fast else 3)],
            "special": _mass_specials,
            "adversarial": lambda fast: [Case("readout rows (terms ~2^-33 beside a 1)",
                                              {"row": readout_rows().double(), "scale": torch.ones(8, dtype=torch.float64)})]}
    return Kind("tail.row_mass", row_mass_decl, run_row_mass, check_row_mass, gens,
                take_rows=lambda d, idx: dict(d, row=d["row"][list(idx)], scale=d["scale"][list(idx)]),
                emulate=emulate_row_mass, about="row_mass -> m, S, nz; S in rows_tail_decl's sum64 range")


# ---------------------------------------------------------------------------------------
# decode_tail end to end (certified tokens; the ranks gate)
# ---------------------------------------------------------------------------------------
def decode_data(gbs, h, h_u, v, interleaved, seed, *, k=32, scale=1.0):
    return tail_data(gbs, h, h_u, v, interleaved, seed, scale=scale, k=k, sp=random_params(gbs, seed, min(k, v)))


def run_decode(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=data["k"], sampling_params=data["sp"],
                      nan_fold=data["nan_fold"], **_tail_kw(data))
    return {f: getattr(out, f) for f in ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")}


def check_decode(data, out, run, decl) -> Verdict:
    """mirror check (range + exact top-k of bf16(logits)) + the sampler on its own mirror
    rows (exact float64 decisions) + certification against the float64 ideal logits."""
    from .certify import certify_tail

    v = check_mirror(data, out, run, decl)
    if not v.ok:
        return v
    s = sampler_verdict(out["logits"].to(torch.bfloat16), data["sp"], data["k"], data["nan_fold"], out)
    if not s.ok:
        return Verdict(False, v.margin, "sampler on the mirror: " + s.detail)
    c = certify_tail(data["x"], data["gamma"], data["w"], out, sampling_params=data["sp"], eps=data["eps"],
                     hidden_actual=data["h_u"], interleaved=data["interleaved"], deferred_rms=data["deferred"],
                     k=data["k"], decl=decl)
    counts = {"certified": c["certified"], "near_ties": c["near_ties"], "truncated": c["truncated"]}
    if c["mismatched"]:
        return Verdict(False, v.margin, f"certified decision differs from float64: {c['mismatches'][0]}", counts)
    return Verdict(True, v.margin, f"{v.detail}; certified {c['matched']}/{c['certified']} match, "
                   f"{c['near_ties']} near-ties", counts)


def decode_shapes(fast):
    return [Case(f"{gbs}x{h} (H_u={hu}) V={v}", decode_data(gbs, h, hu, v, il, 500 + i))
            for i, (gbs, h, hu, v, il) in enumerate(SHAPES) if gbs * v <= 20000]


def decode_random(fast):
    return [Case(f"seed {s}", decode_data(8, 256, 240, 1024, True, s, scale=(1.0, 3.0, 0.3, 1.0)[s % 4]))
            for s in range(2 if fast else 4)]


def decode_temperature_ignored(data) -> dict:
    """Control: the sampler runs at T = 1 whatever the request says (greedy kept)."""
    sp = data["sp"].clone()
    sp[:, 2] = torch.where(sp[:, 2] >= 1e-5, torch.ones_like(sp[:, 2]), sp[:, 2])
    return run_decode(dict(data, sp=sp))


# ---------------------------------------------------------------------------------------
# the ranks gate: decode_tail over 2, 4 (or 8) gloo ranks vs one rank
# ---------------------------------------------------------------------------------------
def rank_layouts(world: int):
    """(label, vtp, hops, batch_groups, fence) run inside one launch of `world` ranks
    (vtp < world: on subgroups of consecutive ranks)."""
    out = [("vtp2", 2, (2,), 1, False), ("vtp2 G=2", 2, (2,), 2, False)]
    if world >= 4:
        out += [("vtp4", 4, (4,), 1, False), ("vtp4 hops=(2,2)", 4, (2, 2), 1, False),
                ("vtp4 G=2 fence", 4, (4,), 2, True)]
    if world >= 8:
        out += [("vtp8", 8, (8,), 1, False), ("vtp8 hops=(2,4)", 8, (2, 4), 1, False),
                ("vtp8 hops=(2,2,2)", 8, (2, 2, 2), 1, False)]
    return [lay for lay in out if lay[1] <= world]


def _rank_fn(rank, data, world):
    """Runs in a spawned rank: every layout, on subgroups when vtp < world. Returns
    [(label, rank-in-group, owned rows, outputs)] for the ranks of group 0."""
    import torch.distributed as dist

    from ..tail.layout import owned_rows

    torch.set_num_threads(1)
    res, made = [], {}
    for label, vtp, hops, g, fence in rank_layouts(world):
        if vtp not in made:  # every rank creates every group, in the same order
            made[vtp] = [dist.new_group(list(range(s, s + vtp))) for s in range(0, world, vtp)]
        grp, sub = made[vtp][rank // vtp], rank % vtp
        rows = owned_rows(sub, vtp, data["x"].shape[0], hops, g)
        vs = data["w"].shape[1] // vtp
        out = decode_tail(data["x"], data["gamma"], data["w"][:, sub * vs:(sub + 1) * vs].contiguous(),
                          k=data["k"], sampling_params=data["sp"][rows], nan_fold=data["nan_fold"], group=grp,
                          hops=hops, batch_groups=g, fence=fence, **_tail_kw(data))
        if rank < vtp:
            res.append((label, sub, rows, {f: getattr(out, f) for f in
                                           ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")}))
    return res


def assemble(per_rank, gbs, *, shift=0):
    """Global-row outputs from the ranks' owned rows (shift != 0: the ownership map off by
    that many rows, a planted control); logits: the column shards in rank order."""
    by_label = {}
    for label, sub, rows, out in per_rank:
        by_label.setdefault(label, []).append((sub, rows, out))
    result = []
    for label, parts in by_label.items():
        parts.sort(key=lambda p: p[0])
        glob = {"logits": torch.cat([p[2]["logits"] for p in parts], 1)}
        for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
            t = parts[0][2][f]
            full = torch.empty((gbs,) + tuple(t.shape[1:]), dtype=t.dtype)
            for _, rows, out in parts:
                full[[(r + shift) % gbs for r in rows]] = out[f]
            glob[f] = full
        result.append((label, glob))
    return result


class RankRuns:
    """launch() once per problem and world size; both the kind and its ownership control
    read the same rank outputs (the control differs only in how it assembles them)."""

    def __init__(self):
        self._cache = {}

    def per_rank(self, data, world):
        from ..launch import launch

        key = (world, data["x"].numpy().tobytes(), data["sp"].numpy().tobytes())
        if key not in self._cache:
            res = launch(_rank_fn, world, args=(data, world), timeout_s=300.0, threads=1)
            self._cache[key] = [item for rank_res in res for item in rank_res]
        return self._cache[key]

    def gate(self, data, world, run, *, shift=0):
        return assemble(self.per_rank(data, world), data["x"].shape[0], shift=shift)


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def in_order(gen, order):
    """The cases of generator `gen` with the tail's GEMM in `order` (data["gemm_order"])."""
    return lambda fast: [replace(c, data=dict(c.data, gemm_order=order)) for c in gen(fast)]


def _logits_kind(name, *, dtype, deferred, about, order=TailConfig.gemm_order):
    kw = dict(dtype=dtype, deferred=deferred)
    gens = {"shapes": partial(tail_shapes, **kw), "random": partial(tail_random, **kw),
            "special": partial(tail_special, **kw), "adversarial": partial(tail_adversarial, gemm_order=order, **kw)}
    return Kind(name, tail_decl_of, run_logits, check_logits, {g: in_order(f, order) for g, f in gens.items()},
                take_rows=tail_rows, emulate=emulate_logits, about=about)


def _mirror_decl(data) -> Decl:
    d = tail_decl_of(data)
    return Decl("decode_tail mirror + exact_topk", d.rounding_points + ("top-k: exact, no rounding",), d.sums)


def _sampler_decl(data) -> Decl:
    """The sampler's declaration is the op's own: kernels.tail.rows_tail.rows_tail_decl(V, k)."""
    return rows_tail_decl(data["rows"].shape[1], data["k"])


def tail_kinds(ranks: RankRuns | None = None) -> list[Kind]:
    ranks = ranks or RankRuns()
    mirror_kw = dict(k=64, check=check_mirror)
    return [
        _logits_kind("tail.logits.deferred.fp32", dtype=torch.float32, deferred=True,
                     about="decode_tail logits, deferred rms, fp32 hidden"),
        _logits_kind("tail.logits.legacy.fp32", dtype=torch.float32, deferred=False,
                     about="decode_tail logits, a = bf16((x*rms)*gamma)"),
        _logits_kind("tail.logits.deferred.fp16", dtype=torch.float16, deferred=True,
                     about="fp16 hidden: in range and the widened fp32 run's bytes"),
        _logits_kind("tail.logits.deferred.bf16", dtype=torch.bfloat16, deferred=True,
                     about="bf16 hidden: in range and the widened fp32 run's bytes"),
        _logits_kind("tail.logits.deferred.fp32.chain", dtype=torch.float32, deferred=True, order="chain",
                     about="decode_tail logits, deferred rms, gemm_order='chain'"),
        _logits_kind("tail.logits.legacy.fp32.chain", dtype=torch.float32, deferred=False, order="chain",
                     about="decode_tail logits, legacy rms, gemm_order='chain'"),
        _logits_kind("tail.logits.deferred.fp32.dp32", dtype=torch.float32, deferred=True, order="dp32",
                     about="decode_tail logits, deferred rms, gemm_order='dp32'"),
        _logits_kind("tail.logits.legacy.fp32.dp32", dtype=torch.float32, deferred=False, order="dp32",
                     about="decode_tail logits, legacy rms, gemm_order='dp32'"),
        Kind("tail.mirror.bf16", _mirror_decl, run_mirror, check_mirror,
             {"shapes": partial(tail_shapes, k=64), "random": partial(tail_random, k=64, v=4096),
              "special": partial(tail_special, **mirror_kw), "adversarial": partial(tail_adversarial, **mirror_kw)},
             take_rows=tail_rows, about="top-k of decode_tail == exact top-k of bf16(its logits)"),
        Kind("tail.topk.exact", lambda d: exact_topk_decl(), run_topk, check_topk,
             {"shapes": topk_shapes, "random": topk_random, "special": topk_special, "adversarial": topk_adversarial},
             take_rows=take_rows_rows, about="== topk_ref exactly (ties to the lower id)"),
        Kind("tail.sampler", _sampler_decl, run_sampler, check_sampler,
             {"shapes": sampler_shapes, "random": sampler_random, "special": sampler_special,
              "adversarial": sampler_adversarial, "bytes": sampler_bytes},
             take_rows=take_rows_rows, emulate=emulate_sampler,
             about="tokens vs the float64 sampler where the margin is clear; logprob bytes vs the declared mass"),
        mass_kind(),
        Kind("tail.decode", tail_decl_of, run_decode, check_decode,
             {"shapes": decode_shapes, "random": decode_random}, take_rows=tail_rows, ranks=ranks.gate,
             about="decode_tail end to end; tokens certified against float64 ideal logits"),
    ]


def tail_controls(ranks: RankRuns | None = None) -> list[Control]:
    ranks = ranks or RankRuns()
    lv = lambda defect: partial(logits_variant, defect=defect)  # noqa: E731
    d32 = "tail.logits.deferred.fp32"
    return [
        Control("tail.fp16_accum", d32, "adversarial", "GEMM chain accumulated in fp16", lv("fp16_accum")),
        Control("tail.gemm_other_order", d32, "emulate", "the chain GEMM posing as amx32", lv("other_order")),
        Control("tail.chain.gemm_other_order", f"{d32}.chain", "emulate", "the amx32 GEMM posing as the chain",
                lv("other_order")),
        Control("tail.chain.legacy_other_order", "tail.logits.legacy.fp32.chain", "emulate",
                "legacy kind: the amx32 GEMM posing as the chain", lv("other_order")),
        Control("tail.chain.decl_half_depth", f"{d32}.chain", "adversarial",
                "the real op in the chain order, its sums declared half as deep", decl=shallow_decl),
        Control("tail.dp32.gemm_amx32_order", f"{d32}.dp32", "emulate", "the amx32 GEMM posing as dp32",
                lv("amx32_order")),
        Control("tail.dp32.legacy_amx32_order", "tail.logits.legacy.fp32.dp32", "emulate",
                "legacy kind: the amx32 GEMM posing as dp32", lv("amx32_order")),
        Control("tail.dp32.decl_half_depth", f"{d32}.dp32", "adversarial",
                "the real op in the dp32 order, its sums declared half as deep", decl=shallow_decl),
        Control("tail.decl_half_depth", d32, "adversarial",
                "the real op, its sums declared half as deep as it runs them", decl=shallow_decl),
        Control("tail.eps_dropped", d32, "special", "rms = 1/sqrt(ssq/H_u), no eps", lv("eps_dropped")),
        Control("tail.mean_over_H", d32, "shapes", "ssq divided by H instead of H_u", lv("mean_over_H")),
        Control("tail.pad_not_zeroed", d32, "shapes", "pad lanes enter ssq and the GEMM", lv("pad_not_zeroed")),
        Control("tail.row_mixing", d32, "batch", "ssq += 2^-12 * the next row's ssq", lv("row_mixing")),
        Control("tail.splitk_threads", d32, "threads", "GEMM split-K over the thread count", lv("splitk_threads")),
        Control("tail.shuffled_order", d32, "repeat", "GEMM summed in a fresh order each call", lv("shuffled_order")),
        Control("tail.rms_after_round", "tail.logits.legacy.fp32", "random",
                "legacy kind computed the deferred way (rms after the bf16 rounding)", lv("rms_after_round")),
        Control("tail.fp16_narrowed", "tail.logits.deferred.fp16", "random",
                "fp16 hidden multiplied by gamma in fp16 before widening", lv("fp16_narrowed")),
        Control("tail.mirror_skipped", "tail.mirror.bf16", "random",
                "fp32 logits carried and ranked instead of the bf16 mirror", partial(mirror_variant, defect="mirror_skipped")),
        Control("tail.ties_higher_id", "tail.topk.exact", "random", "equal values ranked by the higher id",
                partial(topk_variant, defect="ties_higher_id")),
        Control("tail.stage1_short", "tail.topk.exact", "adversarial", "stage 1 keeps k/2 per chunk",
                partial(topk_variant, defect="stage1_short")),
        Control("tail.topp_drops_crossing", "tail.sampler", "adversarial",
                "top-p keeps mass-including-i < top_p (drops the crossing token)",
                partial(sampler_variant, defect="topp_drops_crossing")),
        Control("tail.greedy_1e-3", "tail.sampler", "special", "temperature < 1e-3 treated as greedy",
                partial(sampler_variant, defect="greedy_1e-3")),
        Control("tail.sampler.mass_lanes_128", "tail.sampler", "emulate",
                "the full-row mass in 128 lane chains (the logprob shows it)", sampler_mass_lanes_128),
        Control("tail.row_mass.lanes_128", "tail.row_mass", "emulate", "sum64 in 128 lane chains",
                partial(emulate_row_mass, lanes=128)),
        Control("tail.row_mass.exp_libm", "tail.row_mass", "emulate", "the terms by libm exp (in range, not the order)",
                partial(emulate_row_mass, exp=torch.exp)),
        Control("tail.temperature_ignored", "tail.decode", "random", "the sampler always runs at T = 1",
                decode_temperature_ignored),
        Control("tail.ownership_off_by_one", "tail.decode", "ranks", "rank outputs assembled one row off",
                ranks=partial(ranks.gate, shift=1)),
    ]
