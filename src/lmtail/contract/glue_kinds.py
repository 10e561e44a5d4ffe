"""Contract kinds of the glue ops (norms.py, router.py) on the harness's Kind / Control /
Case / Verdict types: each kind's declaration (from next to the op), its float64 check
(reference/glue.py ranges computed FROM that declaration), the data of each gate, the
declared-order emulation, and the planted controls that must go red.

    kind              op                    outputs checked   declaration
    glue.add_rms_h    norms.add_rms         h                 norms.add_rms_decl(H, order)
    glue.add_rms_y    norms.add_rms         y                 norms.add_rms_decl(H, order)
    glue.moe_*_h|y    norms.moe_add_rms     h | y             norms.moe_add_rms_decl(H, S, n_shared, order)
    glue.rms_parts_*  norms.rms_parts       y                 norms.rms_parts_decl(P, rounding, order)
    glue.router_topk  router.router_topk    ids, weights      router.router_topk_decl(k, K)
    glue.embed_rows   norms.embed_rows      rows (exact)      norms.embed_rows_decl()

Gate data: shapes (odd ones too; the widest marked slow, left out with --fast), random
(several seeds and orders), special values, adversarial (terms exact in fp32 in any order,
one past fp16), and "bytes" (small shapes for the byte gates). Every case's data carries
the op's inputs (and "order" where the op takes one); margins are in range widths.

Shape legend: T rows, H width (Nemotron 2,688), S = 8 slots (R = 6 routed + 2 shared),
G parts of P, K = 2 logit slices, E = 128 experts, k = 6 chosen.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..glue import norms, router
from ..numerics import exp64, fma32
from ..orders import contiguous, placebo, strided
from ..reference import glue as ref
from .harness import Case, Control, Kind, Verdict

H_NEMO = 2688
ORDER = norms.DEFAULT_ORDER


# =======================================================================================
# data helpers
# =======================================================================================
def _bf(a) -> torch.Tensor:
    return torch.from_numpy(ref.bf16_array(a)).to(torch.bfloat16)


def _f32(a) -> torch.Tensor:
    return torch.from_numpy(np.asarray(a, np.float32).copy())


def _np(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.float32).numpy().astype(np.float64)


def _hidden(rng, t: int, h: int, scale: float = 1.0) -> np.ndarray:
    """Residual-stream-like rows: N(0, scale) with a few outlier columns (x20)."""
    a = rng.standard_normal((t, h)) * scale
    cols = rng.choice(h, size=max(1, h // 500), replace=False)
    a[:, cols] *= 20
    return a


def _gamma(rng, h: int, fp32: bool = False) -> torch.Tensor:
    g = 1.0 + 0.25 * rng.standard_normal(h)
    return _f32(g) if fp32 else _bf(g)


def _moe_weights(rng, t: int, r: int = 6, total: float = 2.5) -> np.ndarray:
    """Sigmoid scores of r chosen experts normalized to sum `total` (Nemotron: 6, 2.5)."""
    s = 1.0 / (1.0 + np.exp(-1.5 * rng.standard_normal((t, r))))
    return (s / s.sum(1, keepdims=True) * total).astype(np.float32)


def _verdict(res) -> Verdict:
    ok, margin, detail = res
    return Verdict(bool(ok), None if margin is None else float(margin), detail)


# =======================================================================================
# add_rms kinds
# =======================================================================================
def _add_run(d):
    h, y = norms.add_rms(d["x"], d["residual"], d["gamma"], eps=d["eps"], order=d["order"])
    return {"h": h, "y": y}


def _add_decl(d):
    return norms.add_rms_decl(d["x"].shape[-1], order=d["order"])


def _add_check_h(d, out, run, decl):
    h = ref.add_h_ref(_np(d["x"]), _np(d["residual"]))
    return _verdict(ref.compare("h", _np(out["h"]), h, h))


def _add_check_y(d, out, run, decl):
    h = ref.add_h_ref(_np(d["x"]), _np(d["residual"]))
    lo, hi, free = ref.norm_range(h, h, _np(d["gamma"]), ssq=decl.sum("ssq"), eps=d["eps"])
    return _verdict(ref.compare("y", _np(out["y"]), lo, hi, free=free))


def _add_emulate(d):
    h, y = ref.emu_add_rms(_np(d["x"]), _np(d["residual"]), _np(d["gamma"]), eps=d["eps"], order=d["order"])
    return {"h": _bf(h), "y": _bf(y)}


def _add_case(label, x, res, gamma, order=ORDER, eps=1e-5, slow=False):
    return {"label": label, "x": _bf(x), "residual": _bf(res), "gamma": gamma, "eps": eps,
            "order": order, "slow": slow}


def _add_data(gate: int) -> list:
    if gate == 1:
        out = []
        for i, (t, h) in enumerate([(16, H_NEMO), (300, H_NEMO), (1, H_NEMO), (3, 2687), (5, 1), (2, 100)]):
            rng = np.random.default_rng(100 + i)
            out.append(_add_case(f"{t}x{h}", _hidden(rng, t, h), _hidden(rng, t, h, 0.5), _gamma(rng, h)))
        return out
    if gate == 2:
        out = []
        for seed in range(4):
            rng = np.random.default_rng(seed)
            order = [ORDER, contiguous(256), strided(128), placebo(ORDER)][seed]
            out.append(_add_case(f"seed{seed} 16x{H_NEMO} {order.name}", _hidden(rng, 16, H_NEMO, 3.0),
                                 _hidden(rng, 16, H_NEMO, 1.0), _gamma(rng, H_NEMO, fp32=seed % 2 == 1), order))
        return out
    if gate == 3:
        return [_add_case("specials", *_special_rows(np.random.default_rng(7), 64), _special_gamma(64))]
    return [_add_case("fp16-overflow", *_adversarial_rows(np.random.default_rng(8), 4, H_NEMO),
                      _bf(np.ones(H_NEMO)))]


def _special_rows(rng, h: int):
    """(x, residual) rows, each exercising one special value; defined results in norms.py."""
    x = rng.standard_normal((12, h))
    r = rng.standard_normal((12, h)) * 0.5
    x[0, 3] = np.nan  # h NaN at one lane -> y row NaN
    x[1, 5] = np.inf  # h inf -> y NaN at the lane, +-0 elsewhere
    x[2, 6] = -np.inf
    x[3, 1], r[3, 1] = np.inf, -np.inf  # inf + -inf = NaN
    x[4], r[4] = 0.0, 0.0  # zero row -> inv = 1/sqrt(eps), y = 0
    x[5], r[5] = -0.0, 0.0  # -0 + 0 = +0
    x[6], r[6] = x[6] * 1e-30, 0.0  # tiny: squares ~1e-60 underflow in fp32
    x[7], r[7] = x[7] * 1e-39, 0.0  # bf16 subnormals
    x[8], r[8] = x[8] * 1e30, 0.0  # huge: squares overflow fp32 -> inv 0, y 0
    x[9, 0], r[9, 0] = 1e-40, 0.0  # one subnormal lane in a normal row
    x[10], r[10] = 3e38, 3e38  # h overflows bf16 -> inf everywhere -> y NaN
    x[11], r[11] = x[11] * 1e-20, 0.0  # squares just above underflow
    return x, r


def _special_gamma(h: int) -> torch.Tensor:
    g = np.linspace(-2, 2, h)
    g[0] = 0.0
    return _bf(g)


def _adversarial_rows(rng, t: int, h: int):
    """h values in {0, +-1, +-2, +-4} and lane 0 = 2**17 - 130560 = 512 (512**2 = 2**18 >
    fp16's 65504): every square and partial sum is exact in fp32 in any order."""
    x = rng.choice([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0], size=(t, h))
    r = np.zeros((t, h))
    x[:, 0], r[:, 0] = 2.0**17, -130560.0
    return x, r


def _add_byte_data() -> list:
    rng = np.random.default_rng(11)
    out = [_add_case(f"3x70 {o.name}", _hidden(rng, 3, 70), _hidden(rng, 3, 70), _gamma(rng, 70), o)
           for o in (strided(32), contiguous(32), placebo(strided(32)))]
    out.append(_add_case("2x300 strided(256)", _hidden(rng, 2, 300), _hidden(rng, 2, 300),
                         _gamma(rng, 300, fp32=True)))
    x, r = _special_rows(rng, 40)
    out.append(_add_case("specials 12x40", x, r, _special_gamma(40), strided(32)))
    return out


def _add_kind(which: str) -> Kind:
    return _kind(f"add_rms_{which}", "add_rms", which, _add_decl, _add_run,
                 _add_check_h if which == "h" else _add_check_y, _add_data, _add_emulate, _add_byte_data)


# =======================================================================================
# moe_add_rms kinds
# =======================================================================================
N_SLOTS, N_SHARED = 8, 2


def _moe_run(d):
    h, y = norms.moe_add_rms(d["x"], d["slots"], d["weights"], d["gamma"], eps=d["eps"],
                             n_shared=d["n_shared"], order=d["order"])
    return {"h": h, "y": y}


def _moe_decl(d):
    return norms.moe_add_rms_decl(d["x"].shape[-1], n_slots=d["slots"].shape[0], n_shared=d["n_shared"],
                                  order=d["order"])


def _moe_h_range(d, decl):
    return ref.moe_h_range(_np(d["x"]), _np(d["slots"]), _np(d["weights"]), n_shared=d["n_shared"],
                           combine=decl.sum("combine"))


def _moe_check_h(d, out, run, decl):
    lo, hi, free = _moe_h_range(d, decl)
    return _verdict(ref.compare("h", _np(out["h"]), lo, hi, free=free))


def _moe_check_y(d, out, run, decl):
    h_lo, h_hi, free_h = _moe_h_range(d, decl)
    lo, hi, free = ref.norm_range(h_lo, h_hi, _np(d["gamma"]), ssq=decl.sum("ssq"), eps=d["eps"])
    free = free | free_h.any(-1, keepdims=True)
    return _verdict(ref.compare("y", _np(out["y"]), lo, hi, free=free))


def _moe_emulate(d):
    h, y = ref.emu_moe_add_rms(_np(d["x"]), _np(d["slots"]), _np(d["weights"]), _np(d["gamma"]),
                               eps=d["eps"], n_shared=d["n_shared"], order=d["order"])
    return {"h": _bf(h), "y": _bf(y)}


def _moe_case(label, x, slots, w, gamma, slot_dtype, order=ORDER, n_shared=N_SHARED, slow=False):
    sl = _bf(slots) if slot_dtype == "bf16" else _f32(slots)
    return {"label": label, "x": _bf(x), "slots": sl, "weights": _f32(w), "gamma": gamma, "eps": 1e-5,
            "n_shared": n_shared, "order": order, "slow": slow}


def _moe_random(rng, t, h, slot_dtype, label, order=ORDER, slow=False):
    return _moe_case(label, _hidden(rng, t, h), rng.standard_normal((N_SLOTS, t, h)) * 0.5,
                     _moe_weights(rng, t), _gamma(rng, h), slot_dtype, order, slow=slow)


def _moe_data(slot_dtype: str):
    def data(gate: int) -> list:
        if gate == 1:
            shapes = [(16, H_NEMO, False), (300, H_NEMO, True), (1, H_NEMO, False), (3, 2687, False),
                      (4, 1, False)]
            return [_moe_random(np.random.default_rng(200 + i), t, h, slot_dtype, f"{t}x{h}", slow=slow)
                    for i, (t, h, slow) in enumerate(shapes)] + [_moe_planted(slot_dtype)]
        if gate == 2:
            return [_moe_random(np.random.default_rng(seed), 16, H_NEMO, slot_dtype,
                                f"seed{seed} 16x{H_NEMO}") for seed in range(3)]
        if gate == 3:
            return [_moe_specials(slot_dtype)]
        return [_moe_adversarial(slot_dtype)]
    return data


def _moe_planted(slot_dtype: str) -> dict:
    """16 x 2,688 random rows with double-rounding probes planted in lanes 0-63: the fp32
    combine sits just off a bf16 midpoint of h, so bf16(x + c32) != bf16(x + bf16(c))."""
    rng = np.random.default_rng(31)
    d = _moe_random(rng, 16, H_NEMO, slot_dtype, "16x2688 planted double-rounding probes")
    x = d["x"].to(torch.float32).numpy().copy()
    sl = d["slots"].to(torch.float32).numpy().copy()
    w = d["weights"].numpy().copy()
    # routed weights 1, 0.5, 0.5, 0.25, 0.125, 0.125 (sum 2.5), slot 0 = 1 + 2**-7 (bf16)
    w[:] = np.array([1.0, 0.5, 0.5, 0.25, 0.125, 0.125], np.float32)
    lanes = slice(0, 64)
    sl[:, :, lanes] = 0.0
    sl[0, :, lanes] = 1.0 + 2.0**-7  # routed chain = 1 + 2**-7
    sl[6, :, lanes] = 2.0**-9 + 2.0**-13  # shared: c32 = 1 + 2**-7 + 2**-9 + 2**-13
    x[:, lanes] = 1.0  # x + c32 = 2 + 2**-7 + ...: above h's midpoint 2 + 2**-7;
    # c = bf16(c32) = 1 + 2**-7 -> x + c = 2 + 2**-7 exactly, a tie -> h = 2.0
    d["x"], d["weights"] = _bf(x), _f32(w)
    d["slots"] = _bf(sl) if slot_dtype == "bf16" else _f32(sl)
    return d


def _moe_specials(slot_dtype: str) -> dict:
    rng = np.random.default_rng(41)
    t, h = 8, 48
    x = rng.standard_normal((t, h))
    sl = rng.standard_normal((N_SLOTS, t, h)) * 0.5
    w = _moe_weights(rng, t)
    sl[0, 0, 3] = np.nan  # NaN slot -> h NaN -> y row NaN
    sl[1, 1, 4] = np.inf  # inf routed term -> h inf -> y NaN at lane, 0 elsewhere
    sl[2, 2, 5] = np.inf
    w[2, 2] = 0.0  # inf * 0 weight = NaN
    sl[6, 3, 6], sl[7, 3, 6] = np.inf, -np.inf  # shared inf - inf = NaN
    x[4], sl[:, 4] = 0.0, 0.0  # zero row
    w[5] = 0.0  # zero weights: c = shared only
    x[6], sl[:, 6] = x[6] * 1e-39, sl[:, 6] * 1e-39  # subnormal bf16 values
    x[7], sl[:, 7] = x[7] * 1e-30, sl[:, 7] * 1e-30  # tiny: squares underflow
    return _moe_case("specials 8x48", x, sl, w, _special_gamma(h), slot_dtype, strided(32))


def _moe_adversarial(slot_dtype: str) -> dict:
    """Slot terms exact in fp32 in any order: weights 1, .5, .5, .25, .125, .125 (sum 2.5),
    slots in {0, +-1, +-2, +-4}; lane 0 of routed slot 0 = 2**17 (a term past fp16's 65504);
    x there = -130560, so h = bf16(x + bf16(131072 + small)) stays moderate."""
    rng = np.random.default_rng(51)
    t, h = 4, H_NEMO
    sl = rng.choice([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0], size=(N_SLOTS, t, h))
    w = np.broadcast_to(np.array([1.0, 0.5, 0.5, 0.25, 0.125, 0.125], np.float32), (t, 6))
    x = rng.choice([0.0, 1.0, -1.0, 2.0, -2.0], size=(t, h))
    sl[0, :, 0], x[:, 0] = 2.0**17, -130560.0
    return _moe_case("fp16-overflow 4x2688", x, sl, w, _bf(np.ones(h)), slot_dtype)


def _moe_byte_data(slot_dtype: str):
    def data() -> list:
        rng = np.random.default_rng(61)
        out = [_moe_random(rng, 2, 40, slot_dtype, f"2x40 {o.name}", o)
               for o in (strided(32), contiguous(32))]
        d = _moe_random(rng, 2, 40, slot_dtype, "2x40 shared-association probes", strided(32))
        x = d["x"].to(torch.float32).numpy().copy()
        sl = d["slots"].to(torch.float32).numpy().copy()
        w = d["weights"].numpy().copy()
        # lanes 0-7: routed = 1 + 2**-8, shared 3*2**-25 and -2**-25: r + (s0 + s1) =
        # 1 + 2**-8 + 2**-24 rounds to 1 + 2**-8 (c = 1.0), (r + s0) + s1 to 1 + 2**-8 + 2**-23
        w[:, 0], w[:, 1:] = 1.0 + 2.0**-8, 0.0
        sl[:, :, :8] = 0.0
        sl[0, :, :8], sl[6, :, :8], sl[7, :, :8] = 1.0, 3 * 2.0**-25, -(2.0**-25)
        x[:, :8] = 0.0
        d["x"], d["weights"] = _bf(x), _f32(w)
        d["slots"] = _bf(sl) if slot_dtype == "bf16" else _f32(sl)
        out.append(d)
        sp = _moe_specials(slot_dtype)
        sp["label"] = "specials 8x48"
        out.append(sp)
        return out
    return data


def _moe_kind(which: str, slot_dtype: str) -> Kind:
    return _kind(f"moe_{slot_dtype}_{which}", "moe_add_rms", which, _moe_decl, _moe_run,
                 _moe_check_h if which == "h" else _moe_check_y, _moe_data(slot_dtype), _moe_emulate,
                 _moe_byte_data(slot_dtype), about=f"{slot_dtype} slots")


# =======================================================================================
# rms_parts kinds
# =======================================================================================
def _parts_run(d):
    return {"y": norms.rms_parts(d["x"], d["gamma"], part=d["part"], rounding=d["rounding"],
                                 eps=d["eps"], order=d["order"])}


def _parts_decl(d):
    return norms.rms_parts_decl(d["part"], rounding=d["rounding"], order=d["order"])


def _parts_check(d, out, run, decl):
    x = _np(d["x"])
    p = d["part"]
    xg = x.reshape(*x.shape[:-1], -1, p)  # [T, G, P]
    g = _np(d["gamma"]).reshape(-1, p)
    lo, hi, free = ref.norm_range(xg, xg, g, ssq=decl.sum("ssq"), eps=d["eps"], rounding=d["rounding"])
    return _verdict(ref.compare("y", _np(out["y"]), lo.reshape(x.shape), hi.reshape(x.shape),
                                free=free.reshape(x.shape)))


def _parts_emulate(d):
    return {"y": _bf(ref.emu_rms_parts(_np(d["x"]), _np(d["gamma"]), part=d["part"], rounding=d["rounding"],
                                       eps=d["eps"], order=d["order"]))}


def _parts_case(label, x, gamma, part, rounding, order=ORDER, slow=False):
    return {"label": label, "x": _bf(x), "gamma": gamma, "part": part, "rounding": rounding, "eps": 1e-5,
            "order": order, "slow": slow}


def _parts_data(rounding: str):
    nominal = [(32, 2, 2688), (2, 2, 2688)] if rounding == "once" else [(128, 8, 512), (2400, 8, 512)]

    def data(gate: int) -> list:
        if gate == 1:
            shapes = nominal + [(1, 2, 2688), (3, 3, 97), (300, 8, 64), (2, 5, 1)]
            return [_parts_case(f"{t}x({g}x{p})", _hidden(np.random.default_rng(300 + i), t, g * p),
                                _gamma(np.random.default_rng(400 + i), g * p), p, rounding, slow=t > 1000)
                    for i, (t, g, p) in enumerate(shapes)]
        if gate == 2:
            t, g, p = nominal[0]
            return [_parts_case(f"seed{seed} {min(t, 32)}x({g}x{p})",
                                _hidden(np.random.default_rng(seed), min(t, 32), g * p, 2.0),
                                _gamma(np.random.default_rng(50 + seed), g * p, fp32=seed == 1), p, rounding)
                    for seed in range(3)]
        if gate == 3:
            x, _ = _special_rows(np.random.default_rng(9), 2 * 32)
            return [_parts_case("specials 12x(2x32)", x, _special_gamma(64), 32, rounding, strided(32))]
        x, r = _adversarial_rows(np.random.default_rng(10), 4, 2 * 512)
        x[:, 512] = 512.0  # the second part gets its own past-fp16 square
        return [_parts_case("fp16-overflow 4x(2x512)", x + r, _bf(np.ones(1024)), 512, rounding)]
    return data


def _parts_byte_data(rounding: str):
    def data() -> list:
        rng = np.random.default_rng(71)
        out = [_parts_case(f"3x(2x40) {o.name}", _hidden(rng, 3, 80), _gamma(rng, 80), 40, rounding, o)
               for o in (strided(32), contiguous(32))]
        out.append(_parts_case("2x(4x24) fp32 gamma", _hidden(rng, 2, 96), _gamma(rng, 96, fp32=True), 24,
                               rounding, strided(32)))
        x, _ = _special_rows(rng, 64)
        out.append(_parts_case("specials 12x(2x32)", x, _special_gamma(64), 32, rounding, strided(32)))
        return out
    return data


def _parts_kind(rounding: str) -> Kind:
    return _kind(f"rms_parts_{rounding}_y", "rms_parts", "y", _parts_decl, _parts_run, _parts_check,
                 _parts_data(rounding), _parts_emulate, _parts_byte_data(rounding), about=f"rounding={rounding!r}")


# =======================================================================================
# router kind
# =======================================================================================
N_EXPERTS, TOP_K = 128, 6


def _router_run(d):
    ids, w = router.router_topk(d["slices"], k=d["k"], bias=d["bias"], scale=d["scale"])
    return {"ids": ids, "weights": w}


def _router_decl(d):
    return router.router_topk_decl(d["k"], n_slices=d["slices"].shape[0])


def _router_check(d, out, run, decl):
    b = None if d["bias"] is None else _np(d["bias"])
    return _verdict(ref.router_check(_np(d["slices"]), b, d["k"], d["scale"], out["ids"].numpy(),
                                     _np(out["weights"]), decl=decl))


def _router_emulate(d):
    b = None if d["bias"] is None else d["bias"].numpy()
    ids, w = ref.emu_router_topk(d["slices"].numpy(), d["k"], bias=b, scale=d["scale"])
    return {"ids": torch.from_numpy(ids), "weights": _f32(w)}


def _router_case(label, slices, bias=None, k=TOP_K, scale=2.5):
    return {"label": label, "slices": _f32(slices), "bias": None if bias is None else _f32(bias), "k": k,
            "scale": scale}


def _router_random(rng, t, e=N_EXPERTS, label="", bias=False):
    sl = np.stack([rng.standard_normal((t, e)) * 2.0, rng.standard_normal((t, e)) * 0.5])
    b = rng.standard_normal(e) * 0.1 if bias else None
    return _router_case(label or f"{t}x{e}", sl, b)


def underflow_case() -> dict:
    """Three rows whose logits are two slices of -50 each. Every sigmoid underflows to 0;
    the ids are 0..5 (all tie) and the weights 0, not NaN."""
    return _router_case("all-underflow 3 rows", np.full((2, 3, N_EXPERTS), -50.0))


def _router_specials() -> dict:
    rng = np.random.default_rng(81)
    sl = np.stack([rng.standard_normal((8, N_EXPERTS)), np.zeros((8, N_EXPERTS))])
    sl[0, 0, :3] = np.nan  # NaN experts rank last
    sl[0, 1, 10:20] = np.inf  # s = 1: ten tied at the top -> ids 10..15
    sl[0, 2, :] = -np.inf  # every s = 0: ids 0..5, weights 0
    sl[0, 3, :] = 0.7  # all tied -> ids 0..5, equal weights 2.5/6
    sl[0, 4, ::2] = 3.0  # 64 tied -> the lowest even ids
    sl[0, 5, :] = np.nan
    sl[0, 5, 100] = 1.0  # one non-NaN expert; the other 5 picks are NaN -> NaN weights
    sl[0, 6, :], sl[1, 6, :] = -50.0, -50.0  # underflow
    sl[0, 7, :], sl[1, 7, :] = 1e-30, -1e-30  # logits cancel to 0: all tied at 0.5
    return _router_case("specials 8x128", sl)


def _router_data(gate: int) -> list:
    if gate == 1:
        return [_router_random(np.random.default_rng(500 + t), t) for t in (1, 3, 300)] + [
            _router_random(np.random.default_rng(509), 5, 7, "5x7")]
    if gate == 2:
        return [_router_random(np.random.default_rng(s), 64, label=f"seed{s} 64x128" + (" bias" if s % 2 else ""),
                               bias=s % 2 == 1) for s in range(4)]
    if gate == 3:
        return [underflow_case(), _router_specials()]
    rng = np.random.default_rng(91)
    big = rng.choice([-1.0, 1.0], size=(16, N_EXPERTS)) * (65536.0 + rng.integers(0, 64, (16, N_EXPERTS)) * 64)
    small = rng.integers(-16, 17, (16, N_EXPERTS)) / 8.0
    return [_router_case("fp16-overflow slices 16x128", np.stack([big, small - big]))]


def _router_byte_data() -> list:
    rng = np.random.default_rng(95)
    return [_router_random(rng, 3, 40, "3x40"), _router_random(rng, 4, 16, "4x16 bias", bias=True),
            underflow_case(), _router_specials()]




# =======================================================================================
# embed_rows kind (a copy: checked for exact equality)
# =======================================================================================
def _embed_data(gate: int) -> list:
    rng = np.random.default_rng(600 + gate)
    tab = rng.standard_normal((50, 70)) * (1e-39 if gate == 3 else 1.0)
    if gate == 3:
        tab[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    if gate == 4:
        tab[:, 0] = 2.0**17
    ids = np.array([0, 49, 7, 7, 0] + list(rng.integers(0, 50, 295)))
    return [{"label": f"gate{gate} 300 ids of 50x70", "ids": torch.from_numpy(ids), "table": _bf(tab)}]


def _embed_check(d, out, run, decl):
    want = d["table"][d["ids"]]
    ok = torch.equal(out["rows"].view(torch.int16), want.view(torch.int16))
    return Verdict(ok, None, "rows byte-equal to table[ids]" if ok else "rows differ from table[ids]")


# =======================================================================================
# the kinds
# =======================================================================================
ROW_DIMS = {  # op -> {input: row axis} (the batch gate cuts these)
    "add_rms": {"x": 0, "residual": 0},
    "moe_add_rms": {"x": 0, "slots": 1, "weights": 0},
    "rms_parts": {"x": 0},
    "router_topk": {"slices": 1},
    "embed_rows": {"ids": 0},
}


def _take_rows(data, idx, *, dims):
    """data with the row axis of each named tensor (dims: name -> axis) cut to idx."""
    out = dict(data)
    for name, axis in dims.items():
        t = data.get(name)
        if t is not None:
            out[name] = t.index_select(axis, torch.tensor(list(idx), dtype=torch.long))
    return out


def _cases(data, gate: int, fast: bool) -> list:
    return [Case(d["label"], d) for d in data(gate) if not (fast and d.get("slow"))]


def _kind(name, op, outputs, decl, run, check, data, emulate, byte_data, about="") -> Kind:
    """A glue Kind: data(gate 1..4) -> [data dict with "label" (and "slow")]; byte_data()
    -> the byte gates' data dicts."""
    gens = {g: partial(_cases, data, i) for i, g in enumerate(("shapes", "random", "special", "adversarial"), 1)}
    gens["bytes"] = lambda fast: [Case(d["label"], d) for d in byte_data()]
    return Kind(f"glue.{name}", decl, run, check, gens, take_rows=partial(_take_rows, dims=ROW_DIMS[op]),
                emulate=emulate, group="glue", about=f"{op} -> {outputs}" + (f", {about}" if about else ""))


def glue_kinds() -> list[Kind]:
    """Every glue kind (module docstring)."""
    return [_add_kind("h"), _add_kind("y"), *(_moe_kind(w, s) for s in ("bf16", "f32") for w in ("h", "y")),
            _parts_kind("once"), _parts_kind("mlx"),
            _kind("router_topk", "router_topk", "ids, weights", _router_decl, _router_run, _router_check,
                  _router_data, _router_emulate, _router_byte_data),
            _kind("embed_rows", "embed_rows", "rows", lambda d: norms.embed_rows_decl(),
                  lambda d: {"rows": norms.embed_rows(d["ids"], d["table"])}, _embed_check, _embed_data,
                  lambda d: {"rows": _bf(_np(d["table"])[d["ids"].numpy()])}, lambda: _embed_data(1))]


# =======================================================================================
# planted controls: each must be RED at its gate
# =======================================================================================
def _moe_variant(d, *, keep_f32=False, shared_in_chain=False, fp16=False):
    sl = d["slots"].to(torch.float32)
    w = d["weights"]
    r = sl.shape[0] - d["n_shared"]
    if fp16:
        acc = torch.zeros(sl.shape[1:], dtype=torch.float16)
        for i in range(r):
            acc = acc + (w[:, i : i + 1] * sl[i]).to(torch.float16)
        for i in range(r, sl.shape[0]):
            acc = acc + sl[i].to(torch.float16)
        acc = acc.to(torch.float32)
    else:
        acc = torch.zeros(sl.shape[1:], dtype=torch.float32)
        for i in range(r):
            acc = fma32(w[:, i : i + 1], sl[i], acc)
        if shared_in_chain:
            for i in range(r, sl.shape[0]):
                acc = acc + sl[i]
        elif d["n_shared"]:
            sh = sl[r]
            for i in range(r + 1, sl.shape[0]):
                sh = sh + sl[i]
            acc = acc + sh
    c = acc if keep_f32 else acc.to(torch.bfloat16).to(torch.float32)
    h = (d["x"].to(torch.float32) + c).to(torch.bfloat16)
    h32 = h.to(torch.float32)
    inv = norms.inv_rms(h32, eps=d["eps"], order=d["order"])
    return {"h": h, "y": ((h32 * inv[:, None]) * d["gamma"].to(torch.float32)).to(torch.bfloat16)}


def _add_fp16_squares(d):
    h = (d["x"].to(torch.float32) + d["residual"].to(torch.float32)).to(torch.bfloat16)
    h32 = h.to(torch.float32)
    ssq = (h32 * h32).to(torch.float16).sum(-1, dtype=torch.float16).to(torch.float32)
    n = h32.shape[-1]
    inv = 1.0 / torch.sqrt(ssq / n + torch.tensor(d["eps"], dtype=torch.float32))
    return {"h": h, "y": ((h32 * inv[..., None]) * d["gamma"].to(torch.float32)).to(torch.bfloat16)}


def _add_no_eps(d):
    h, y = norms.add_rms(d["x"], d["residual"], d["gamma"], eps=0.0, order=d["order"])
    return {"h": h, "y": y}


def _parts_swapped(d):
    other = "mlx" if d["rounding"] == "once" else "once"
    return {"y": norms.rms_parts(d["x"], d["gamma"], part=d["part"], rounding=other, eps=d["eps"], order=d["order"])}


def _router_variant(d, *, guard=True, ties_high=False):
    sl = d["slices"]
    logit = sl[0]
    for i in range(1, sl.shape[0]):
        logit = logit + sl[i]
    ex = exp64(-logit.double()).to(torch.float32)
    s = torch.ones_like(ex) / (torch.ones_like(ex) + ex)
    key = s if d["bias"] is None else s + d["bias"]
    e = key.shape[-1]
    skey = router.selection_keys(key)
    if ties_high:  # ties to the HIGHER id: flip the id digit
        skey = skey - (e - 1 - 2 * torch.arange(e))
    ids = torch.topk(skey, d["k"], dim=-1).indices
    ss = s.gather(1, ids)
    tot = ss[:, 0]
    for j in range(1, d["k"]):
        tot = tot + ss[:, j]
    den = tot + torch.full_like(tot, router.GUARD) if guard else tot
    return {"ids": ids, "weights": (ss / den[:, None]) * torch.full_like(ss, d["scale"])}


def glue_controls() -> list[Control]:
    """The planted wrong variants, each red at its planted gate."""
    c = lambda name, kind, gate, what, run: Control(f"glue.{name}", f"glue.{kind}", gate, what, run)  # noqa: E731
    return [
        c("moe_keep_f32", "moe_bf16_h", "shapes", "combine kept in fp32 before the add (no bf16 rounding of c)",
          lambda d: _moe_variant(d, keep_f32=True)),
        c("moe_keep_f32_fp32_slots", "moe_f32_h", "shapes", "the same with fp32 slots",
          lambda d: _moe_variant(d, keep_f32=True)),
        c("moe_shared_in_chain", "moe_f32_h", "emulate", "shared slots added into the routed chain: (r+s0)+s1",
          lambda d: _moe_variant(d, shared_in_chain=True)),
        c("moe_fp16_combine", "moe_bf16_h", "adversarial", "combine accumulated in fp16 (inf past 65504)",
          lambda d: _moe_variant(d, fp16=True)),
        c("add_rms_fp16_squares", "add_rms_y", "adversarial", "sum of squares accumulated in fp16 (inf)",
          _add_fp16_squares),
        c("add_rms_no_eps", "add_rms_y", "special", "eps dropped: a zero row gives 0 * inf = NaN", _add_no_eps),
        c("rms_parts_once_as_mlx", "rms_parts_once_y", "emulate", "'once' computed with MLX's double rounding",
          _parts_swapped),
        c("rms_parts_mlx_as_once", "rms_parts_mlx_y", "emulate", "'mlx' computed rounding once", _parts_swapped),
        c("router_no_guard", "router_topk", "special", "no +1e-20: all-underflow rows give 0/0 = NaN",
          lambda d: _router_variant(d, guard=False)),
        c("router_ties_high", "router_topk", "special", "ties to the higher expert id",
          lambda d: _router_variant(d, ties_high=True)),
        c("embed_rows_off_by_one", "embed_rows", "random", "row ids + 1 (clamped): the neighbouring rows",
          lambda d: {"rows": norms.embed_rows((d["ids"] + 1).clamp(max=d["table"].shape[0] - 1), d["table"])}),
        Control("glue.add_rms_ssq_declared_exact", "glue.add_rms_y", "random",
                "the real op, its sum of squares declared exact (depth 0)", decl=_exact_ssq_decl),
    ]


def _exact_ssq_decl(d):
    """Control: add_rms's declaration with its ssq declared depth 0 (no rounding at all)."""
    decl = _add_decl(d)
    return replace(decl, sums=tuple(replace(s, depth=0) for s in decl.sums))
