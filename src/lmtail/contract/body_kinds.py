"""Contract kinds of the SmolLM2 body's declared ops (model/body.py) and their planted controls.

    kind               op                     outputs      range from (declaration)
    body.exp32         body.exp32             y            EXP32_ULP ulp of float64 exp (exp32_decl)
    body.silu_mul      body.silu_mul          y            SILU_ULP ulp of float64 silu(g)*u (silu_mul_decl)
    body.silu_mul_bf16 body.silu_mul_bf16     y (bf16)     exactly bf16(silu_mul) (the op it fuses)
    body.rope_table    body.rope_table        cos, sin     ROPE_ULP ulp of libm float64 (rope_decl)
    body.apply_rope    body.apply_rope        y            rope_decl's last rounding point: 2u(1+u)
    body.rope_qkv      body.rope_qkv          q, kc, vc    exactly apply_rope + the cache writes
    body.attend        body.attend            out          attend_decl's sums (dot, den, acc) + exp32
    body.add_rms_rows  body.add_rms_rows      h, y         norms.add_rms_decl(H, strided(lanes))
    body.add_rms_rows32 body.add_rms_rows32   h, y (fp32)  body.add_rms32_decl(H, strided(lanes)): h exact

The emulate gate compares the op (its default backend: the C kernels where built) with an
emulation of its declared order: the op's "torch" spelling for exp32 / silu / attention,
reference.model.rope_emulation (an independent numpy spelling of rope_decl) for the rope
table, numpy fp32 for apply_rope, reference.glue.emu_add_rms for the fused norm rows and
reference.glue.emu_add_rms32 for their fp32 sibling (norm_range32 its float64 range).
Controls restate the op with ONE defect (`*_variant(data, defect)`; defect=None is the op
byte for byte, which tests/test_contract.py asserts) or plant a shallower declaration.

Shape legend: R rows, N elements, M rows of a linear, F FFN width, P positions, hd head
dim (64), B rows, T new tokens, nh / nkv query / KV heads, S_cap cache slots, H width.
"""
from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from ..glue import norms
from ..model import body
from ..numerics import Decl, fma32, sqrt_rn32
from ..orders import strided
from ..reference import glue as gref
from ..reference import model as mref
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth

F32 = torch.float32


def _verdict(res) -> Verdict:
    ok, margin, detail = res
    return Verdict(bool(ok), None if margin is None or not math.isfinite(margin) else float(margin), detail)


def _rows(data, idx, *, names):
    """data with the leading (row) axis of each named tensor cut to idx (the batch gate)."""
    sel = torch.tensor(list(idx), dtype=torch.long)
    return dict(data, **{n: data[n].index_select(0, sel) for n in names})


def _slow(fast, cases):
    return [c for c in cases if not (fast and c.data.get("slow"))]


# =======================================================================================
# exp32
# =======================================================================================
def exp32_variant(data, defect=None) -> dict:
    """exp32 restated from exp32_decl with body's constants (defect None: the op's bytes):
    "coef_ulp" fp32(1/2!) one ulp up; "libm" torch.exp (within the ulp bound, not the order)."""
    x = data["x"]
    if defect == "libm":
        return {"y": torch.exp(x)}
    f = partial(torch.tensor, dtype=F32)
    coef = list(body.EXP_C)
    if defect == "coef_ulp":
        coef[2] = np.nextafter(coef[2], np.float32(1))
    xc = torch.where(torch.isnan(x), f(0.0), x.clamp(float(body.X_LO), float(body.X_HI)))
    n = (xc * f(float(body.LOG2E)) + f(float(body.RND))) - f(float(body.RND))
    r = fma32(-n, f(float(body.LN2_LO)), fma32(-n, f(float(body.LN2_HI)), xc))
    p = torch.full_like(x, float(coef[7]))
    for c in reversed(coef[:7]):
        p = fma32(p, r, f(float(c)))
    y = p * ((n.to(torch.int32) + 127) << 23).view(F32)
    y = torch.where(x < float(body.X_LO), f(0.0), torch.where(x > float(body.X_HI), f(math.inf), y))
    return {"y": torch.where(torch.isnan(x), f(math.nan), y)}


def _exp32_check(data, out, run, decl) -> Verdict:
    """In [-86, 88]: within EXP32_ULP ulp of float64 exp; above: +inf; below: +0 (bits);
    NaN -> NaN."""
    x, y = data["x"], out["y"]
    lo, hi = (t.numpy() for t in mref.ulp_range(mref.exp_ref(x), body.EXP32_ULP))
    xn = x.double().numpy()
    lo = np.where(xn > 88, np.inf, np.where(xn < -86, 0.0, lo))
    hi = np.where(xn > 88, np.inf, np.where(xn < -86, 0.0, hi))
    lo, hi = np.where(np.isnan(xn), np.nan, lo), np.where(np.isnan(xn), np.nan, hi)
    under = (x < -86) & (y.view(torch.int32) != 0)
    if under.any():
        return Verdict(False, None, f"exp32 of x < -86 must be +0.0; got {y[under][0].item()!r}")
    return _verdict(gref.compare("y", y.double().numpy(), lo, hi))


def _exp32_data(r, n, seed, scale=30.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(r, n // 2, generator=g) * scale, torch.rand(r, n - n // 2, generator=g) * 174 - 86], 1)
    return {"x": x}


def _exp32_gens():
    specials = torch.tensor([[0.0, -0.0, 88.0, 88.01, -86.0, -86.01, 1e-30, -1e-40, 1e-45, 100.0, -100.0,
                              math.inf, -math.inf, math.nan]])
    ln2 = math.log(2)
    edges = torch.tensor([[(k + 0.5) * ln2 for k in range(-124, 127)]], dtype=torch.float64)
    edges = torch.cat([edges, edges.nextafter(torch.tensor(-math.inf, dtype=torch.float64))]).float()
    return {
        "shapes": lambda fast: [Case(f"{r}x{n}", _exp32_data(r, n, 10 + i)) for i, (r, n) in
                                enumerate([(1, 1), (3, 17), (64, 1000), (2, 4097)])],
        "random": lambda fast: [Case(f"seed {s} scale {sc}", _exp32_data(16, 2000, s, sc))
                                for s, sc in enumerate((30.0, 1.0, 60.0, 1e-3)[:2 if fast else 4])],
        "special": lambda fast: [Case("0, -0, the range edges, tiny, huge, +-inf, NaN", {"x": specials}),
                                 Case("float64 x -> ValueError", {"x": specials.double()},
                                      raises=r"x must be torch.float32")],
        "adversarial": lambda fast: [Case("range-reduction ties (k + 1/2) ln2 and their neighbours", {"x": edges})],
    }


def _exp32_kind() -> Kind:
    return Kind("body.exp32", lambda d: body.exp32_decl(), lambda d: {"y": body.exp32(d["x"])}, _exp32_check,
                _exp32_gens(), take_rows=partial(_rows, names=("x",)),
                emulate=lambda d: {"y": body.exp32(d["x"], backend="torch")}, group="body",
                about="exp32 -> y, EXP32_ULP ulp of float64 exp")


# =======================================================================================
# silu_mul (and its bf16 fusion)
# =======================================================================================
def silu_variant(data, defect=None) -> dict:
    """silu_mul restated: fl32(fl32(g / fl32(1 + exp32(-g))) * u); defect "recip":
    g * fl32(1 / fl32(1 + e)) (the sigmoid first: another rounding order)."""
    gu = data["gu"]
    f = gu.shape[1] // 2
    g, u = gu[:, :f], gu[:, f:]
    d = 1.0 + body.exp32(-g)
    s = g * (1.0 / d) if defect == "recip" else g / d
    s = torch.where(g == -math.inf, torch.tensor(-0.0), s)
    return {"y": s * u}


def _silu_check(data, out, run, decl) -> Verdict:
    """Within SILU_ULP ulp (+ one subnormal spacing) of float64 silu(g)*u; 0 also allowed
    where g < -87 (exp32(-g) overflows to inf: s = -0); silu(-inf) = -0, NaN -> NaN."""
    gu = data["gu"]
    f = gu.shape[1] // 2
    g = gu[:, :f]
    lo, hi = (t.numpy() for t in mref.silu_range(g, gu[:, f:], body.SILU_ULP))
    gn = g.double().numpy()
    deep = gn < -87
    lo, hi = np.where(deep, np.minimum(lo, 0.0), lo), np.where(deep, np.maximum(hi, 0.0), hi)
    return _verdict(gref.compare("y", out["y"].double().numpy(), lo, hi))


def _gu(m, f, seed, scale=6.0):
    g = torch.Generator().manual_seed(seed)
    return {"gu": torch.cat([torch.randn(m, f, generator=g) * scale, torch.randn(m, f, generator=g) * 3], 1)}


def _silu_gens():
    sp = torch.tensor([0.0, -0.0, 88.0, -88.5, -90.0, 1e-30, -1e-40, 30.0, -30.0, math.nan])
    gate = sp[None].repeat(3, 1)
    special = {"gu": torch.cat([gate, torch.randn(3, sp.numel(), generator=torch.Generator().manual_seed(1))], 1)}
    inf = {"gu": torch.tensor([[-math.inf, math.inf, 2.0, 3.0]])}

    def _inf_expect(d, out, run, decl):
        y = out["y"][0]
        ok = y[0].item() == 0 and math.copysign(1, y[0].item()) < 0 and y[1].item() == math.inf
        return Verdict(ok, None, f"silu(-inf) * 2 = {y[0].item()!r} (want -0.0), silu(inf) * 3 = {y[1].item()!r}")
    return {
        "shapes": lambda fast: [Case(f"{m}x{f}", _gu(m, f, 20 + i)) for i, (m, f) in
                                enumerate([(1, 1), (5, 37), (64, 1536), (3, 4097)])],
        "random": lambda fast: [Case(f"seed {s} scale {sc}", _gu(32, 500, s, sc))
                                for s, sc in enumerate((6.0, 20.0, 1.0, 50.0)[:2 if fast else 4])],
        "special": lambda fast: [Case("0, -0, exp32's edges, tiny, +-30, NaN gates", special),
                                 Case("silu(-inf) = -0, silu(inf) * u = inf", inf, expect=_inf_expect),
                                 Case("odd width -> ValueError", {"gu": torch.zeros(3, 5)},
                                      raises=r"gu must be \[M, 2F\]; got shape \(3, 5\)")],
        "adversarial": lambda fast: [Case("gates where 1 + e rounds: |g| near 17, near 0", _adv_gu())],
    }


def _adv_gu():
    g = torch.cat([torch.linspace(-17.5, -16.0, 400), torch.linspace(16.0, 17.5, 400), torch.linspace(-1e-3, 1e-3, 400)])
    return {"gu": torch.cat([g, torch.ones_like(g) * 3.0])[None].reshape(1, -1)}


def _silu_kind() -> Kind:
    return Kind("body.silu_mul", lambda d: body.silu_mul_decl(), lambda d: {"y": body.silu_mul(d["gu"])},
                _silu_check, _silu_gens(), take_rows=partial(_rows, names=("gu",)),
                emulate=lambda d: {"y": body.silu_mul(d["gu"], backend="torch")}, group="body",
                about="silu_mul -> y, SILU_ULP ulp of float64 silu(g)*u")


def _exact_to(emulate):
    """A check that is the op's definition: the bytes of `emulate` (NaN matches NaN)."""
    def check(data, out, run, decl) -> Verdict:
        d = diff_outputs(out, emulate(data), nan_equal=True)
        return Verdict(not d, None, d or "bytes of the op it fuses")
    return check


def _silu_bf16_emulate(d):
    return {"y": body.silu_mul(d["gu"]).to(torch.bfloat16)}


def _silu_bf16_kind() -> Kind:
    gens = _silu_gens()
    gens["special"] = lambda fast: [Case("0, -0, exp32's edges, NaN gates", {"gu": torch.cat(
        [torch.tensor([[0.0, -0.0, 88.0, -90.0, 1e-30, math.nan]]), torch.ones(1, 6)], 1)})]
    return Kind("body.silu_mul_bf16", lambda d: body.silu_mul_decl(), lambda d: {"y": body.silu_mul_bf16(d["gu"])},
                _exact_to(_silu_bf16_emulate), gens, take_rows=partial(_rows, names=("gu",)),
                emulate=_silu_bf16_emulate, group="body", about="silu_mul_bf16 -> y == bf16(silu_mul)")


# =======================================================================================
# rope: the table and the rotation
# =======================================================================================
def rope_variant(data, defect=None) -> dict:
    """rope_table with one defect: "theta_fp32" (theta = p * inv_freq in fp32, then libm
    cos / sin: far off at large angles), "one_ulp" (sin[P-1, 0] one ulp up: still within
    the 1-ulp bound; libm's float64 cos / sin would agree with the table to the bit)."""
    n, hd, base = data["n"], data["hd"], data["base"]
    cos, sin = body.rope_table(n, hd, base)
    if defect == "theta_fp32":
        i = torch.arange(hd // 2, dtype=torch.float64)
        inv = torch.pow(torch.tensor(float(base), dtype=torch.float64), -2.0 * i / hd).float()
        theta = (torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]).double()
        return {"cos": torch.cos(theta).float(), "sin": torch.sin(theta).float()}
    if defect == "one_ulp":
        sin = sin.clone()
        sin[-1, 0] = torch.nextafter(sin[-1, 0], torch.tensor(math.inf))
    return {"cos": cos, "sin": sin}


def _rope_check(data, out, run, decl) -> Verdict:
    rc, rs = mref.rope_ref(data["n"], data["hd"], data["base"])
    worst, detail = math.inf, ""
    for name, want in (("cos", rc), ("sin", rs)):
        lo, hi = (t.numpy() for t in mref.ulp_range(want, body.ROPE_ULP))
        ok, m, detail = gref.compare(name, out[name].double().numpy(), lo, hi)
        if not ok:
            return _verdict((ok, m, detail))
        worst = min(worst, m)
    return _verdict((True, worst, detail))


def _rope_case(label, n, hd, base, slow=False):
    return Case(label, {"n": n, "hd": hd, "base": base, "slow": slow})


def _rope_table_kind() -> Kind:
    gens = {
        "shapes": lambda fast: _slow(fast, [_rope_case(f"P={n} hd={hd} base={b:g}", n, hd, b, n > 2048)
                                            for n, hd, b in ((1, 2, 1e4), (300, 64, 1e4), (17, 8, 10.0),
                                                             (2048, 64, 1e5), (8192, 64, 1e5))]),
        "random": lambda fast: [_rope_case(f"P=512 base={b:g}", 512, 64, b)
                                for b in (1e4, 5e5, 1234.5)[:2 if fast else 3]],
        "special": lambda fast: [Case("P = 1: cos 1, sin 0 exactly", {"n": 1, "hd": 64, "base": 1e4},
                                      expect=_rope_p1)],
        "adversarial": lambda fast: [_rope_case("positions to 8191 (theta ~ 8191: the 3-part reduction)", 8192, 64, 1e5)],
    }
    return Kind("body.rope_table", lambda d: body.rope_decl(),
                lambda d: dict(zip(("cos", "sin"), body.rope_table(d["n"], d["hd"], d["base"]))), _rope_check, gens,
                emulate=lambda d: dict(zip(("cos", "sin"), mref.rope_emulation(d["n"], d["hd"], d["base"]))),
                group="body", about="rope_table -> cos, sin, ROPE_ULP ulp of libm float64")


def _rope_p1(d, out, run, decl) -> Verdict:
    ok = bool((out["cos"] == 1).all()) and bool((out["sin"].view(torch.int32) == 0).all())
    return Verdict(ok, None, "cos 1, sin +0" if ok else f"cos {out['cos']}, sin {out['sin']}")


def apply_rope_variant(data, defect=None) -> dict:
    """apply_rope restated; "fma": each pair with one fused multiply-add (one rounding
    fewer); "halves": HF's rotate_half pairing (i, i + hd/2) instead of adjacent pairs."""
    x, c, s = data["x"], data["cos"], data["sin"]
    if defect == "halves":
        h = x.shape[-1] // 2
        xe, xo = x[..., :h], x[..., h:]
        return {"y": torch.cat((xe * c - xo * s, xe * s + xo * c), -1)}
    xe, xo = x[..., 0::2], x[..., 1::2]
    if defect == "fma":
        ye, yo = fma32(xe, c.expand_as(xe), -(xo * s)), fma32(xe, s.expand_as(xe), xo * c)
    else:
        ye, yo = xe * c - xo * s, xe * s + xo * c
    return {"y": torch.stack((ye, yo), -1).flatten(-2)}


def _apply_emulate(data) -> dict:
    """numpy fp32, one rounding per product and per sum (rope_decl's last point)."""
    x, c, s = data["x"].numpy(), data["cos"].numpy(), data["sin"].numpy()
    xe, xo = x[..., 0::2], x[..., 1::2]
    y = np.stack((xe * c - xo * s, xe * s + xo * c), -1).reshape(x.shape)
    return {"y": torch.from_numpy(y.astype(np.float32))}


def _apply_check(data, out, run, decl) -> Verdict:
    lo, hi = mref.rope_apply_range(data["x"], data["cos"], data["sin"])
    return _verdict(gref.compare("y", out["y"].double().numpy(), lo.numpy(), hi.numpy()))


def _apply_data(b, t, n, seed, *, p0=0, scale=2.0, base=1e5):
    g = torch.Generator().manual_seed(seed)
    cos, sin = body.rope_table(p0 + t, 64, base)
    return {"x": torch.randn(b, t, n, 64, generator=g) * scale, "cos": cos[p0:p0 + t, None], "sin": sin[p0:p0 + t, None]}


def _apply_kind() -> Kind:
    sp = _apply_data(1, 4, 2, 7)
    x = sp["x"].clone()
    x[0, 0, 0, :6] = torch.tensor([0.0, -0.0, 1e-40, -1e-45, 3e38, -3e38])
    gens = {
        "shapes": lambda fast: [Case(f"{b}x{t}x{n}", _apply_data(b, t, n, 30 + i)) for i, (b, t, n) in
                                enumerate([(1, 1, 1), (3, 7, 9), (2, 33, 3)])],
        "random": lambda fast: [Case(f"seed {s}", _apply_data(4, 16, 9, s, p0=100 * s, scale=10.0 ** (s - 1)))
                                for s in range(2 if fast else 4)],
        "special": lambda fast: [Case("zeros, subnormals, near fp32 max", dict(sp, x=x))],
        "adversarial": lambda fast: [Case("positions 8000.. (large angles)", _apply_data(2, 64, 3, 9, p0=8000))],
    }
    return Kind("body.apply_rope", lambda d: body.rope_decl(),
                lambda d: {"y": body.apply_rope(d["x"], d["cos"], d["sin"])}, _apply_check, gens,
                take_rows=partial(_rows, names=("x",)), emulate=_apply_emulate, group="body",
                about="apply_rope -> y, two fp32 roundings per pair element")


def _qkv_data(b, t, nh, nkv, seed, *, s0=3, cap=16):
    g = torch.Generator().manual_seed(seed)
    cos, sin = body.rope_table(64, 64, 1e5)
    return {"qkv": torch.randn(b * t, (nh + 2 * nkv) * 64, generator=g), "cos": cos, "sin": sin,
            "pos": torch.randint(0, 64, (b, t), generator=g), "s0": s0, "nh": nh, "nkv": nkv,
            "cap": s0 + t + cap}


def _qkv_run(d) -> dict:
    b, t = d["pos"].shape
    kc = torch.zeros(b, d["nkv"], 64, d["cap"])  # [B, nkv, hd, S_cap]
    vc = torch.zeros(b, d["nkv"], d["cap"], 64)  # [B, nkv, S_cap, hd]
    q = body.rope_qkv(d["qkv"], d["cos"], d["sin"], d["pos"], kc, vc, s0=d["s0"], nh=d["nh"])
    return {"q": q, "kc": kc, "vc": vc}


def _qkv_emulate(d) -> dict:
    """apply_rope on the q and k slices, k transposed into the key cache, v copied."""
    b, t = d["pos"].shape
    nh, nkv, s0 = d["nh"], d["nkv"], d["s0"]
    qd, kvd = nh * 64, nkv * 64
    cos, sin = d["cos"][d["pos"]][:, :, None], d["sin"][d["pos"]][:, :, None]  # [B, T, 1, hd/2]
    q = body.apply_rope(d["qkv"][:, :qd].reshape(b, t, nh, 64), cos, sin)
    k = body.apply_rope(d["qkv"][:, qd:qd + kvd].reshape(b, t, nkv, 64), cos, sin)
    kc = torch.zeros(b, nkv, 64, d["cap"])
    vc = torch.zeros(b, nkv, d["cap"], 64)
    kc[:, :, :, s0:s0 + t] = k.permute(0, 2, 3, 1)
    vc[:, :, s0:s0 + t] = d["qkv"][:, qd + kvd:].reshape(b, t, nkv, 64).transpose(1, 2)
    return {"q": q.contiguous(), "kc": kc, "vc": vc}


def _qkv_rows(data, idx):
    idx = list(idx)
    t = data["pos"].shape[1]
    rows = [i * t + j for i in idx for j in range(t)]
    return dict(data, pos=data["pos"][idx], qkv=data["qkv"][rows])


def _qkv_kind() -> Kind:
    gens = {"shapes": lambda fast: [Case(f"B={b} T={t} nh={nh} nkv={nkv}", _qkv_data(b, t, nh, nkv, 40 + i))
                                    for i, (b, t, nh, nkv) in enumerate([(1, 1, 1, 1), (3, 5, 9, 3), (2, 9, 4, 2)])],
            "random": lambda fast: [Case(f"seed {s}", _qkv_data(4, 6, 9, 3, s)) for s in range(2)]}
    return Kind("body.rope_qkv", lambda d: body.rope_decl(), _qkv_run, _exact_to(_qkv_emulate), gens,
                take_rows=_qkv_rows, emulate=_qkv_emulate, group="body",
                about="rope_qkv -> q, kc, vc == apply_rope + cache writes")


# =======================================================================================
# attention
# =======================================================================================
def _n_keys(d) -> int:
    return max(1, d["s0"] + d["q"].shape[1] - int(d["pad"].min()))


def _attend_decl(d) -> Decl:
    return body.attend_decl(_n_keys(d))


def _attend_run(d) -> dict:
    return {"out": body.attend(d["q"], d["kt"], d["v"], d["pad"], s0=d["s0"], scale=d["scale"])}


def _attend_check(d, out, run, decl) -> Verdict:
    lo, hi = mref.attend_range(d["q"], d["kt"], d["v"], d["pad"], s0=d["s0"], scale=d["scale"], dot=decl.sum("dot"),
                               den=decl.sum("den"), acc=decl.sum("acc"), exp_ulp=body.EXP32_ULP)
    return _verdict(gref.compare("out", out["out"].double().numpy(), lo.numpy(), hi.numpy()))


def attend_variant(d, defect=None) -> dict:
    """attend_decl restated per query (fma32 chains, exp32; defect None: the op's bytes);
    "den_reversed": the denominator summed from the last key to the first."""
    q, kt, v, pad, s0 = d["q"], d["kt"], d["v"], d["pad"], d["s0"]
    B, T, nh, hd = q.shape
    g = nh // kt.shape[1]
    sc = torch.tensor(d["scale"], dtype=F32)
    out = torch.zeros_like(q)
    for b in range(B):
        base = int(pad[b])
        for t in range(T):
            n = s0 + t - base + 1
            if n <= 0:
                continue
            k = kt[b, :, :, base:base + n]  # [nkv, hd, n]
            vv = v[b, :, base:base + n]  # [nkv, n, hd]
            qq = q[b, t].reshape(kt.shape[1], g, hd)  # [nkv, g, hd]
            dot = torch.zeros(kt.shape[1], g, n)
            for i in range(hd):
                dot = fma32(qq[:, :, i:i + 1], k[:, None, i, :], dot)
            s = dot * sc
            e = body.exp32(s - s.amax(-1, keepdim=True))  # [nkv, g, n]
            den, acc = torch.zeros(kt.shape[1], g), torch.zeros(kt.shape[1], g, hd)
            for j in (range(n - 1, -1, -1) if defect == "den_reversed" else range(n)):
                den = den + e[..., j]
            for j in range(n):
                acc = fma32(e[..., j:j + 1], vv[:, None, j, :], acc)
            out[b, t] = (acc / den[..., None]).reshape(nh, hd)
    return {"out": out}


def _att_data(B, T, nh, nkv, s0, pad, seed, *, qscale=2.0):
    g = torch.Generator().manual_seed(seed)
    cap = s0 + T + body.SLACK
    return {"q": torch.randn(B, T, nh, 64, generator=g) * qscale, "kt": torch.randn(B, nkv, 64, cap, generator=g),
            "v": torch.randn(B, nkv, cap, 64, generator=g), "pad": torch.tensor(pad, dtype=torch.int64),
            "s0": s0, "scale": 0.125}


def _att_rounding(n=200):
    """One query over n keys, scores exact: key 0 scores 0 (e = 1), keys 1.. score
    ln(0.45 * 2^-23) (e = t just under half an ulp of 1): den = 1 + t + t ... rounds DOWN at
    every add, acc = 1 + 1.2t + ... rounds UP (v = 1 at key 0, 1.2 at the others): out errs by
    ~1.8 n u, inside the declared gamma_n (den) + gamma_n (acc) but past half of it."""
    cap = n + body.SLACK
    q = torch.zeros(1, 1, 1, 64)
    q[0, 0, 0, 0] = 1.0
    kt = torch.zeros(1, 1, 64, cap)
    kt[0, 0, 0, 1:n] = 8.0 * math.log(0.45 * 2.0**-23)  # score = 0.125 * k
    v = torch.full((1, 1, cap, 64), 1.2)
    v[0, 0, 0] = 1.0
    return {"q": q, "kt": kt, "v": v, "pad": torch.zeros(1, dtype=torch.int64), "s0": n - 1, "scale": 0.125}


def _pad_queries_zero(d, out, run, decl) -> Verdict:
    o = out["out"]
    ok = bool((o[1, :3].view(torch.int32) == 0).all())
    return Verdict(ok, None, "pad queries +0.0") if not ok else _attend_check(d, out, run, decl)


def _attend_gens():
    pad_case = _att_data(2, 5, 2, 1, 0, (0, 3), 5)
    bad = _att_data(2, 3, 2, 1, 2, (0, 1), 6)
    return {
        "shapes": lambda fast: [Case(f"B={B} T={T} nh={nh} nkv={nkv} s0={s0}", _att_data(B, T, nh, nkv, s0, pad, 50 + i))
                                for i, (B, T, nh, nkv, s0, pad) in enumerate(
                                    [(1, 1, 1, 1, 0, (0,)), (3, 7, 9, 3, 5, (0, 4, 2)), (2, 1, 4, 2, 40, (0, 17))])],
        "random": lambda fast: [Case(f"seed {s} |q| {qs}", _att_data(2, 4, 6, 3, 20, (0, 5), s, qscale=qs))
                                for s, qs in enumerate((2.0, 10.0, 0.1)[:2 if fast else 3])],
        "special": lambda fast: [Case("left pad 3: the first 3 queries of row 1 are pads (+0)", pad_case,
                                      expect=_pad_queries_zero),
                                 Case("pad of the wrong length -> ValueError",
                                      dict(bad, pad=torch.zeros(3, dtype=torch.int64)),
                                      raises=r"pad must be \[B\] = \[2\] int64")],
        "adversarial": lambda fast: [Case("den rounds down and acc up at every add (200 keys)", _att_rounding())],
    }


def _attend_kind() -> Kind:
    return Kind("body.attend", _attend_decl, _attend_run, _attend_check, _attend_gens(),
                take_rows=partial(_rows, names=("q", "kt", "v", "pad")),
                emulate=lambda d: {"out": body.attend(d["q"], d["kt"], d["v"], d["pad"], s0=d["s0"], scale=d["scale"],
                                                      backend="torch")},
                group="body", about="attend -> out, ranges from attend_decl's sums and EXP32_ULP")


# =======================================================================================
# add_rms_rows (the fused residual add + RMSNorm of the model loop)
# =======================================================================================
LANES = 256  # the lanes of the model's norm order (norms.DEFAULT_ORDER = strided(256))


def _arr_run(d, lanes=None) -> dict:
    h, y = body.add_rms_rows(d["x"], d["residual"], d["gamma"], eps=d["eps"], lanes=lanes or d["lanes"])
    return {"h": h, "y": y}


def _arr_decl(d) -> Decl:
    return norms.add_rms_decl(d["x"].shape[1], order=strided(d["lanes"]))


def _np64(t):
    return t.to(F32).numpy().astype(np.float64)


def _arr_check(d, out, run, decl) -> Verdict:
    h = gref.add_h_ref(_np64(d["x"].to(torch.bfloat16)), _np64(d["residual"]))
    ok, m, det = gref.compare("h", _np64(out["h"]), h, h)
    if not ok:
        return _verdict((ok, m, det))
    lo, hi, free = gref.norm_range(h, h, _np64(d["gamma"]), ssq=decl.sum("ssq"), eps=d["eps"])
    return _verdict(gref.compare("y", _np64(out["y"]), lo, hi, free=free))


def _arr_emulate(d) -> dict:
    h, y = gref.emu_add_rms(_np64(d["x"].to(torch.bfloat16)), _np64(d["residual"]), _np64(d["gamma"]), eps=d["eps"],
                            order=strided(d["lanes"]))
    return {"h": torch.from_numpy(gref.bf16_array(h)).to(torch.bfloat16),
            "y": torch.from_numpy(gref.bf16_array(y)).to(torch.bfloat16)}


def _arr_data(n, h, seed, *, scale=1.0, lanes=LANES, xdtype=F32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * scale * torch.logspace(-2, 2, n)[:, None]
    return {"x": x.to(xdtype), "residual": torch.randn(n, h, generator=g).to(torch.bfloat16),
            "gamma": (1 + 0.25 * torch.randn(h, generator=g)).to(torch.bfloat16).float(), "eps": 1e-5, "lanes": lanes}


def _arr_gens():
    sp = _arr_data(4, 96, 3)
    x = sp["x"].clone()
    x[0, 5], x[1, 7], x[3] = math.inf, 1e-41, 0.0
    return {
        "shapes": lambda fast: [Case(f"{n}x{h} lanes {ln}", _arr_data(n, h, 60 + i, lanes=ln)) for i, (n, h, ln) in
                                enumerate([(1, 1, 256), (9, 33, 32), (5, 576, 256), (3, 700, 256)])],
        "random": lambda fast: [Case(f"seed {s}", _arr_data(6, 576, s, xdtype=(F32, torch.bfloat16)[s % 2]))
                                for s in range(2 if fast else 4)],
        "special": lambda fast: [Case("an inf lane, a subnormal, a zero row", dict(sp, x=x))],
        "adversarial": lambda fast: [Case("576 lanes of +-16 (squares exact), eps 0", _arr_exact())],
        "bytes": lambda fast: [Case("4x576", _arr_data(4, 576, 77)),
                               Case("1x576, gamma on bf16 boundaries", _arr_boundary())],
    }


def _arr_boundary(h=576):
    """One row (residual 0) whose declared inv (strided(256), emulated) differs from strided(128)'s,
    and an fp32 gamma that puts fl32(fl32(h * inv) * gamma) one fp32 ulp off a bf16
    midpoint in every lane (the sign alternating): one ulp of inv flips y's bf16 bytes."""
    for seed in range(100, 200):
        d = dict(_arr_data(1, h, seed), residual=torch.zeros(1, h, dtype=torch.bfloat16))  # h = bf16(x)
        h32 = d["x"].to(torch.bfloat16).float().numpy()[0].astype(np.float64)
        inv = gref.emu_inv_rms(h32, n=h, eps=d["eps"], lanes=LANES, vec=1)
        if inv != gref.emu_inv_rms(h32, n=h, eps=d["eps"], lanes=128, vec=1):
            break
    t = (h32 * np.float64(inv)).astype(np.float32)  # fl32(h * inv)
    g0 = d["gamma"].numpy()
    bits = (t.astype(np.float64) * g0).astype(np.float32).view(np.int32)
    mid = ((bits & ~np.int32(0xFFFF)) | np.int32(0x8000)) + np.where(np.arange(h) % 2 == 0, 1, -1).astype(np.int32)
    target = mid.view(np.float32).astype(np.float64)
    gam = g0.copy()
    for i in np.nonzero(t)[0]:  # the fp32 gamma whose product with t lands on the target
        best = np.float32(target[i] / t[i])
        cands = best + np.arange(-4, 5, dtype=np.float32) * np.spacing(best)
        gam[i] = cands[np.argmin(np.abs((np.float64(t[i]) * cands.astype(np.float64)).astype(np.float32) - target[i]))]
    return dict(d, gamma=torch.from_numpy(gam))


def _arr_exact():
    g = torch.Generator().manual_seed(9)
    x = torch.where(torch.rand(4, 576, generator=g) < 0.5, -16.0, 16.0)
    return {"x": x, "residual": torch.zeros(4, 576, dtype=torch.bfloat16), "gamma": torch.ones(576), "eps": 0.0,
            "lanes": LANES}


def _arr_kind() -> Kind:
    return Kind("body.add_rms_rows", _arr_decl, _arr_run, _arr_check, _arr_gens(),
                take_rows=partial(_rows, names=("x", "residual")), emulate=_arr_emulate, group="body",
                about="add_rms_rows -> h, y, norms.add_rms_decl(H, strided(lanes))")


# =======================================================================================
# add_rms_rows32 (the q32 body's fp32 residual add + RMSNorm)
# =======================================================================================
def _a32_run(d) -> dict:
    h, y = body.add_rms_rows32(d["x"], d["residual"], d["gamma"], eps=d["eps"], lanes=d["lanes"])
    return {"h": h, "y": y}


def _a32_decl(d) -> Decl:
    return body.add_rms32_decl(d["x"].shape[1], order=strided(d["lanes"]))


def _a32_res(d):
    return None if d["residual"] is None else d["residual"].numpy()


def _a32_check(d, out, run, decl) -> Verdict:
    """h: exactly fl32(x + residual); y: within the float64 range of the declared chain."""
    h = gref.add_h32_ref(d["x"].numpy(), _a32_res(d))
    ok, m, det = gref.compare("h", _np64(out["h"]), h, h)
    if not ok:
        return _verdict((ok, m, det))
    lo, hi, free = gref.norm_range32(h, d["gamma"].numpy().astype(np.float64), ssq=decl.sum("ssq"), eps=d["eps"])
    return _verdict(gref.compare("y", _np64(out["y"]), lo, hi, free=free))


def _a32_emulate(d) -> dict:
    h, y = gref.emu_add_rms32(d["x"].numpy(), _a32_res(d), d["gamma"].numpy(), eps=d["eps"],
                              order=strided(d["lanes"]))
    return {"h": torch.from_numpy(h), "y": torch.from_numpy(y)}


def add_rms32_variant(d, defect=None) -> dict:
    """add_rms_rows32 restated in torch (defect None: the op's bytes): "lanes_128" the sum in
    128 lane chains; "h_bf16" h rounded to bf16; "sequential" ssq one fma chain in element
    order; "gamma_first" y = fl32(fl32(h * gamma) * inv)."""
    x, gam = d["x"], d["gamma"]
    h = x + (torch.zeros((), dtype=F32) if d["residual"] is None else d["residual"])  # [N, H]
    if defect == "h_bf16":
        h = h.to(torch.bfloat16).float()
    if defect == "sequential":
        ssq = torch.zeros(h.shape[0])  # [N]
        for j in range(h.shape[1]):
            ssq = fma32(h[:, j], h[:, j], ssq)
        r = sqrt_rn32(ssq / torch.full_like(ssq, float(h.shape[1])) + torch.full_like(ssq, d["eps"]))
        inv = torch.ones_like(r) / r
    else:
        inv = norms.inv_rms(h, eps=d["eps"], order=strided(128 if defect == "lanes_128" else d["lanes"]))
    if defect == "gamma_first":
        return {"h": h, "y": (h * gam) * inv[:, None]}
    return {"h": h, "y": (h * inv[:, None]) * gam}


def _a32_data(n, h, seed, *, scale=1.0, lanes=LANES, residual=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * scale * torch.logspace(-2, 2, n)[:, None]  # [N, H]
    r = torch.randn(n, h, generator=g) * scale if residual else None
    return {"x": x, "residual": r, "gamma": 1 + 0.25 * torch.randn(h, generator=g), "eps": 1e-5, "lanes": lanes}


def _a32_rows(d, idx):
    return _rows(d, idx, names=("x",) if d["residual"] is None else ("x", "residual"))


def _a32_special(residual=True):
    """An inf lane, a subnormal row, a zero row, a NaN lane, a -0 row, a row of 1e30 (its
    squares overflow: inv = 0)."""
    d = _a32_data(6, 97, 3, residual=residual)
    x = d["x"].clone()
    x[0, 5], x[1], x[2], x[3, 7], x[4], x[5] = math.inf, 1e-41, 0.0, math.nan, -0.0, 1e30
    if residual:
        d["residual"][1:3], d["residual"][4:] = 0.0, -0.0
    return dict(d, x=x)


def _a32_exact():
    """576 lanes of +-16, eps 0: every square and ssq exact, inv = 1/16, y = fl32(h/16 * gamma)."""
    g = torch.Generator().manual_seed(9)
    x = torch.where(torch.rand(4, 576, generator=g) < 0.5, -16.0, 16.0)
    return {"x": x, "residual": None, "gamma": 1 + 0.25 * torch.randn(576, generator=g), "eps": 0.0,
            "lanes": LANES}


def _a32_halfulp(h=576):
    """Per row one +-1.0 and H-1 elements whose squares are 0.45 of half an ulp of 1: the lane
    chain holding 1.0 drops each later square, and the butterfly adds of the other lanes'
    totals onto ~1 round: ssq 2.4 ulps of 1 below its exact value (rows 0, 2; declared: 7.5)."""
    c = math.sqrt(0.45 * 2.0**-24)
    x = torch.full((3, h), c)
    x[0, 0], x[1, 255], x[2, h - 1] = 1.0, 1.0, -1.0
    x[1] *= torch.where(torch.arange(h) % 2 == 0, 1.0, -1.0)
    return {"x": x, "residual": None, "gamma": torch.ones(h), "eps": 1e-5, "lanes": LANES}


def _a32_gens():
    return {
        "shapes": lambda fast: [Case(f"{n}x{h} lanes {ln}{'' if r else ' no residual'}",
                                     _a32_data(n, h, 80 + i, lanes=ln, residual=r)) for i, (n, h, ln, r) in
                                enumerate([(1, 1, 256, True), (9, 33, 32, True), (5, 576, 256, False),
                                           (3, 701, 256, True), (2, 1537, 32, False)])],
        "random": lambda fast: [Case(f"seed {s} scale {sc}", _a32_data(6, 576, s, scale=sc, residual=s % 2 == 0))
                                for s, sc in enumerate((1.0, 1.0, 1e-3, 1e3)[:2 if fast else 4])],
        "special": lambda fast: [Case("inf lane, subnormal / zero / -0 / 1e30 rows, NaN lane", _a32_special()),
                                 Case("the same, residual None", _a32_special(False))],
        "adversarial": lambda fast: [Case("576 lanes of +-16 (squares exact), eps 0", _a32_exact()),
                                     Case("1.0 among squares of 0.45 half-ulp (every fma rounds)", _a32_halfulp())],
        "bytes": lambda fast: [Case("4x576 lanes 256", _a32_data(4, 576, 77)),
                               Case("3x97 lanes 32 no residual", _a32_data(3, 97, 78, lanes=32, residual=False)),
                               Case("6x97 special rows", _a32_special())],
    }


def _a32_kind() -> Kind:
    return Kind("body.add_rms_rows32", _a32_decl, _a32_run, _a32_check, _a32_gens(), take_rows=_a32_rows,
                emulate=_a32_emulate, group="body",
                about="add_rms_rows32 -> h, y (fp32), body.add_rms32_decl(H, strided(lanes))")


# =======================================================================================
# the kinds and the controls
# =======================================================================================
def body_kinds() -> list[Kind]:
    """Every body kind (module docstring)."""
    return [_exp32_kind(), _silu_kind(), _silu_bf16_kind(), _rope_table_kind(), _apply_kind(), _qkv_kind(),
            _attend_kind(), _arr_kind(), _a32_kind()]


def _qkv_no_rope_k(d) -> dict:
    out = _qkv_emulate(d)
    b, t = d["pos"].shape
    qd, kvd = d["nh"] * 64, d["nkv"] * 64
    k = d["qkv"][:, qd:qd + kvd].reshape(b, t, d["nkv"], 64)
    out["kc"][:, :, :, d["s0"]:d["s0"] + t] = k.permute(0, 2, 3, 1)
    return out


def _silu_bf16_up_rounded(d) -> dict:
    f = d["gu"].shape[1] // 2
    s = body.silu_mul(torch.cat([d["gu"][:, :f], torch.ones_like(d["gu"][:, f:])], 1))  # silu(g) * 1
    return {"y": (s.to(torch.bfloat16).float() * d["gu"][:, f:].to(torch.bfloat16).float()).to(torch.bfloat16)}


def body_controls() -> list[Control]:
    """The planted wrong variants, each red at its planted gate."""
    return [
        Control("body.exp32.coef_one_ulp", "body.exp32", "emulate", "exp32 with fp32(1/2!) one ulp up",
                partial(exp32_variant, defect="coef_ulp")),
        Control("body.exp32.libm", "body.exp32", "emulate", "torch.exp (libm: in the bound, not the declared order)",
                partial(exp32_variant, defect="libm")),
        Control("body.silu.recip_first", "body.silu_mul", "emulate",
                "s = g * fl32(1 / (1 + e)): another rounding order",
                partial(silu_variant, defect="recip")),
        Control("body.silu_bf16.up_in_bf16", "body.silu_mul_bf16", "random", "bf16(silu(g)) * bf16(u): two roundings",
                _silu_bf16_up_rounded),
        Control("body.rope.theta_fp32", "body.rope_table", "adversarial", "theta = p * inv_freq rounded to fp32",
                partial(rope_variant, defect="theta_fp32")),
        Control("body.rope.one_ulp", "body.rope_table", "emulate", "sin[P-1, 0] one ulp up (in the bound)",
                partial(rope_variant, defect="one_ulp")),
        Control("body.apply_rope.fma", "body.apply_rope", "emulate", "each rotated element by one fma",
                partial(apply_rope_variant, defect="fma")),
        Control("body.apply_rope.halves", "body.apply_rope", "random", "rotate_half pairing (i, i + hd/2)",
                partial(apply_rope_variant, defect="halves")),
        Control("body.rope_qkv.k_unroped", "body.rope_qkv", "random", "keys cached before rope", _qkv_no_rope_k),
        Control("body.attend.den_reversed", "body.attend", "emulate", "softmax denominator summed last key first",
                partial(attend_variant, defect="den_reversed")),
        Control("body.attend.decl_half_depth", "body.attend", "adversarial",
                "the real op, its sums declared half as deep", decl=half_depth(_attend_decl)),
        Control("body.add_rms_rows.lanes_128", "body.add_rms_rows", "emulate", "128 lane chains posing as 256",
                partial(_arr_run, lanes=128)),
        Control("body.add_rms_rows32.lanes_128", "body.add_rms_rows32", "emulate", "128 lane chains posing as 256",
                partial(add_rms32_variant, defect="lanes_128")),
        Control("body.add_rms_rows32.h_bf16", "body.add_rms_rows32", "random",
                "h rounded to bf16 (the bf16 stream's h)", partial(add_rms32_variant, defect="h_bf16")),
        Control("body.add_rms_rows32.sequential", "body.add_rms_rows32", "emulate",
                "ssq as one sequential fma chain", partial(add_rms32_variant, defect="sequential")),
        Control("body.add_rms_rows32.gamma_first", "body.add_rms_rows32", "emulate",
                "y = fl32(fl32(h * gamma) * inv): the products swapped",
                partial(add_rms32_variant, defect="gamma_first")),
    ]
