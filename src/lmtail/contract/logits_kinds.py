"""The decode tail's logits and bf16-mirror kinds' pieces: their data, runs, float64 checks,
planted variants and case generators (the registry in tail_kinds.py names the kinds).

Data dicts ("tail data"): x [gbs, H] fp32|fp16|bf16, gamma [H] fp32, w [H, V] bf16, eps,
h_u, interleaved, deferred, gemm_order (absent: TailConfig's default) (+ k, sp [R, 5] fp32,
nan_fold for the mirror/decode kinds). Checks take (data, out, run, decl).

Shape legend: gbs rows, H hidden (padded), H_u real hidden, V vocab, R rows, k candidates.
"""
from __future__ import annotations

import math
import os
from functools import partial

import numpy as np
import torch

from ..kernels.gemm.bf16 import TAIL_ORDERS as GEMM_ORDERS
from ..kernels.gemm.bf16 import gemm_bf16
from ..numerics import Decl, sqrt_rn32
from ..orders import sum_squares
from ..reference.contract import range_margin
from ..reference.gemm import gemm_amx32_emulation, gemm_chain_emulation, gemm_dp32_emulation
from ..reference.tail import as_np, logits_range, mirror_range, topk_ref
from ..tail.compose import SSQ_ORDER, decode_tail, pad_mask, tail_decl, validate_tail_inputs
from ..tail.config import TailConfig
from .harness import Case, Verdict, diff_outputs, half_depth

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


def tail_kw(data):
    return dict(eps=data["eps"], hidden_actual=data["h_u"], zero_interleaved_pad=data["interleaved"],
                deferred_rms=data["deferred"], gemm_order=gemm_order_of(data), exchange="mirror")


# ---------------------------------------------------------------------------------------
# the real ops and their float64 checks
# ---------------------------------------------------------------------------------------
def run_logits(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=1, **tail_kw(data))
    return {"logits": out.logits}


def nonfinite_rows(data) -> np.ndarray:
    """[gbs] bool: rows with NaN or inf in a real lane (their logits are defined as NaN)."""
    x = as_np(data["x"])
    real = pad_mask(x.shape[1], data["h_u"], data["interleaved"]).numpy()
    return ~np.isfinite(np.where(real, x, 0.0)).all(axis=1)


def logits_verdict(data, logits, decl: Decl) -> Verdict:
    """Finite rows: inside reference.tail.logits_range of `decl` (margin in range widths); rows with
    NaN/inf in a real lane: all NaN (ssq = inf or NaN -> rms 0 or NaN -> NaN * ...)."""
    y = as_np(logits)
    bad = nonfinite_rows(data)
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
                      **tail_kw(data))
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
    fin = ~nonfinite_rows(data)
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
EMULATIONS = {"chain": gemm_chain_emulation, "amx32": gemm_amx32_emulation, "dp32": gemm_dp32_emulation}
assert set(EMULATIONS) == set(GEMM_ORDERS), "every tail order needs its emulation"


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
        return EMULATIONS[order](a, w)
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
    cases.append(Case(what, gemm_at_bound(dtype=dtype, deferred=deferred, k=k, order=gemm_order)))
    return cases


def gemm_at_bound(*, dtype, deferred, k, order, v=24):
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
