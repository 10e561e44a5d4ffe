"""Property-based fuzzing of the public entry points (hypothesis).

Every generated case is either valid (and must succeed), or carries exactly one planted
defect (and must raise the documented type: TypeError for a non-tensor where a tensor is
required, ValueError otherwise, with a message naming the argument), or carries special
values whose result the docs define. On success the outputs must hold the contract:
    decode_tail   logits inside the float64 ranges of reference.tail (from tail_decl),
                  top-k == the exact top-k of the bf16 mirror (reference.tail.topk_ref),
                  greedy rows take candidate 0, tokens among the candidates, logprobs ==
                  the float64 full-row log-softmax (reference.contract.logprob_ref) to
                  fp32 rounding; byte gates: a row alone == the row in its batch, a
                  16-bit or strided hidden == its fp32 contiguous copy;
    glue ops      bytes == the scalar emulations of reference.glue (emu_*), a row alone ==
                  in its batch, a strided input == its contiguous copy;
    router_topk   reference.glue.router_check against the float64 ranges;
    embed_rows    an exact copy; layout maps: every row owned exactly once;
    sampling_tensor  the fp32 tensor it returns passes the tail's own parameter check.
No input is ever mutated, on either path.

Profiles: "fuzz_default" (few examples, derandomized, no deadline: ~30 s for the file)
runs in the default suite; "fuzz_long" (many examples, random) runs the same properties
behind @pytest.mark.slow: `pytest -m slow tests/test_fuzz.py`.

Shape legend: B rows, H hidden, V vocab, k candidates, T rows of a glue op, S slots,
K logit slices, E experts.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
import re
import sys

import numpy as np
import pytest
import torch
from conftest import bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmtail.reference import glue as gref
from lmtail.reference import tail as tref
from lmtail.reference.contract import logprob_ref, sample_decision, sampler_slack


from lmtail import SamplingParams, add_rms, compose_hops, decode_tail, embed_rows, moe_add_rms, owned_row_block, owned_rows, rms_parts, router_topk, sampling_tensor
from lmtail.glue.router import router_topk_decl
from lmtail.tail.sampler import validate_params
from lmtail.tail.compose import tail_decl

settings.register_profile("fuzz_default", max_examples=25, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("fuzz_long", max_examples=400, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST = settings(settings.get_profile("fuzz_default"))
LONG = settings(settings.get_profile("fuzz_long"))
BF, F32 = torch.bfloat16, torch.float32
META = torch.device("meta")


# ---------------------------------------------------------------------------------------
# shared helpers
# ---------------------------------------------------------------------------------------


def same(a, b) -> bool:
    """Bitwise equality (NaN payloads included) of tensors or None."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def same_nan_aware(out: torch.Tensor, ref: np.ndarray) -> bool:
    """out's values == ref's (float32 holding bf16 values): bitwise where numbers, NaN where NaN."""
    o = out.to(F32).numpy()
    nan = np.isnan(ref)
    return bool((np.isnan(o) == nan).all() and (o[~nan].view(np.int32) == ref[~nan].astype(np.float32).view(np.int32)).all())


def snapshot(*objs):
    return [o.clone() if isinstance(o, torch.Tensor) and o.device.type != "meta" else o for o in objs]


def unchanged(before, objs) -> bool:
    """Every tensor input (meta tensors have no data) keeps its bytes."""
    return all(not isinstance(b, torch.Tensor) or b.device.type == "meta" or same(b, o)
               for b, o in zip(before, objs))


def expect_error(call, exc, name: str, before, objs, *, also=()):
    """call() must raise exc (exactly that family) with `name` in its message; inputs unchanged.
    also: other (name, exception) pairs the case may report first (a second, data defect)."""
    with pytest.raises((ValueError, TypeError)) as ei:
        call()
    for alt, alt_exc in also:
        if isinstance(ei.value, alt_exc) and re.search(rf"\b{alt}\b", str(ei.value)):
            assert unchanged(before, objs), "an input was mutated on the error path"
            return
    assert isinstance(ei.value, exc) and not (exc is ValueError and isinstance(ei.value, TypeError)), \
        f"expected {exc.__name__} naming {name!r}; got {type(ei.value).__name__}: {ei.value}"
    assert re.search(rf"\b{name}\b", str(ei.value)), f"the message must name {name!r}; got: {ei.value}"
    assert unchanged(before, objs), "an input was mutated on the error path"


def kwarg_names(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def special_values(draw, t: torch.Tensor, *, allow_nan=True) -> torch.Tensor:
    """Plant a few specials (0, -0, subnormal, tiny, big, +-inf, NaN) in t (a copy)."""
    t = t.clone()
    n = t.numel()
    if n == 0:
        return t
    pool = [0.0, -0.0, 1e-40, -3e-39, 1e-20, 3e4, -2e4]
    if allow_nan:
        pool += [math.inf, -math.inf, math.nan]
    for _ in range(draw(st.integers(0, 3))):
        t.view(-1)[draw(st.integers(0, n - 1))] = draw(st.sampled_from(pool))
    return t


# =======================================================================================
# decode_tail
# =======================================================================================
TAIL_DEFECTS = ("k", "eps", "hidden_actual", "sampling_params", "dtype_hidden", "dtype_gamma", "dtype_weight",
                "shape_gamma", "shape_weight", "weight_1d", "hidden_1d", "strided_weight", "nontensor_hidden",
                "nontensor_gamma", "nontensor_weight", "nontensor_sp", "meta_hidden", "meta_gamma",
                "meta_weight", "meta_sp")


@st.composite
def tail_cases(draw):
    b = draw(st.integers(1, 5))
    h = draw(st.sampled_from([1, 3, 4, 8, 17, 32, 40]))
    v = draw(st.sampled_from([1, 2, 7, 33, 64]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([1.0, 1e-3, 30.0]))
    x = torch.randn(b, h, generator=g) * scale
    gamma = torch.rand(h, generator=g) + 0.25
    w = (torch.randn(h, v, generator=g) * 0.3).to(BF)
    interleaved = draw(st.booleans())
    if interleaved and h % 4 == 0:
        h_u = h - 4 * draw(st.integers(0, h // 4 - 1))
    elif not interleaved:
        h_u = draw(st.integers(1, h))
    else:
        h_u = h
    k = draw(st.integers(1, v))
    cols = draw(st.sampled_from([None, 3, 4, 5]))
    sp = None
    if cols is not None:
        rows = []
        for _ in range(b):
            rows.append([draw(st.sampled_from([-1.0, 0.0, 1.0, 2.0, float(k), float(k + 1), 1e9, 2.0**63])),
                         draw(st.sampled_from([1.0, 0.95, 0.5, 0.1, 1e-6])),
                         draw(st.sampled_from([0.0, 1e-6, 0.3, 1.0, 2.5])),
                         draw(st.sampled_from([0.0, 0.5, 0.25, 0.75, 0.99999994])),
                         draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))][:cols])
        sp = torch.tensor(rows, dtype=F32).reshape(b, cols)
    case = dict(x=x, gamma=gamma, w=w, sp=sp, hidden_dtype=draw(st.sampled_from([F32, F32, torch.float16, BF])),
                strided=draw(st.booleans()), gamma_2d=draw(st.booleans()),
                kw=dict(k=k, eps=draw(st.sampled_from([1e-5, 1e-6, 0.1, 0.0])), hidden_actual=h_u if h_u != h or
                        draw(st.booleans()) else None, zero_interleaved_pad=interleaved,
                        deferred_rms=draw(st.booleans()), nan_fold=draw(st.booleans())),
                defect=draw(st.sampled_from((None,) * 20 + TAIL_DEFECTS)), special=draw(st.integers(0, 5)) == 0)
    if case["special"]:
        case["x"] = special_values(draw, x)
    case["bad"] = _tail_defect_value(draw, case)
    return case


def _tail_defect_value(draw, c):
    d, (_, h), v = c["defect"], c["x"].shape, c["w"].shape[1]
    if d is None:
        return None
    return {
        "k": lambda: draw(st.sampled_from([0, v + 1, -3, 2.0, True, None, "3"])),
        "eps": lambda: draw(st.sampled_from([-1e-5, math.inf, math.nan, 1e39, True, None, "1e-5"])),
        "hidden_actual": lambda: draw(st.sampled_from([0, h + 1, 1.5, float(h), True, "1"])),
        "sampling_params": lambda: draw(st.sampled_from([(0, math.inf), (0, math.nan), (0, 1.5), (1, 0.0),
                                                         (1, 1.5), (2, -1.0), (2, math.inf), (3, 1.0),
                                                         (3, -0.1), (4, 1.5)])),
        "shape_gamma": lambda: h + 1,
        "shape_weight": lambda: h + 1,
    }.get(d, lambda: None)()


def _apply_defect(c):
    """(x, gamma, w, sp, kw, expected exception, name the message must hold) for the case."""
    x, gamma, w, sp, kw = c["x"], c["gamma"], c["w"], c["sp"], dict(c["kw"])
    d, bad = c["defect"], c["bad"]
    exc, name = ValueError, None
    if d is None:
        return x, gamma, w, sp, kw, None, None
    if d in ("k", "eps", "hidden_actual"):
        kw[d], name = bad, d
    elif d == "sampling_params":
        col, val = bad
        cols = 5 if sp is None else sp.shape[1]
        base = torch.tensor([[0.0, 1.0, 1.0, 0.5, 0.0]] * x.shape[0], dtype=F32)[:, :max(cols, col + 1)]
        if sp is not None and sp.shape[1] > col:
            base = sp.clone()
        base[-1, col] = val
        sp, name = base, "sampling_params"
    elif d == "dtype_hidden":
        x, name = x.double(), "hidden_states"
    elif d == "dtype_gamma":
        gamma, name = gamma.half(), "gamma"
    elif d == "dtype_weight":
        w, name = w.float(), "lm_head_weight_t"
    elif d == "shape_gamma":
        gamma, name = torch.ones(bad), "gamma"
    elif d == "shape_weight":
        w, name = torch.zeros(bad, w.shape[1], dtype=BF), "lm_head_weight_t"
    elif d == "weight_1d":
        w, name = w[:, 0].contiguous(), "lm_head_weight_t"
    elif d == "hidden_1d":
        x, name = x[0].clone(), "hidden_states"
    elif d == "strided_weight":
        if w.shape[1] == 1 or w.shape[0] == 1:
            return x, gamma, w, sp, kw, None, None  # every 2-D view of a vector is contiguous
        w, name = w.t().contiguous().t(), "lm_head_weight_t"
    elif d.startswith("nontensor_"):
        exc = TypeError
        which = d.split("_", 1)[1]
        if which == "hidden":
            x, name = x.numpy(), "hidden_states"
        elif which == "gamma":
            gamma, name = gamma.tolist(), "gamma"
        elif which == "weight":
            w, name = None, "lm_head_weight_t"
        else:
            sp, name = [[0.0, 1.0, 1.0]] * x.shape[0], "sampling_params"
    elif d.startswith("meta_"):
        which = d.split("_", 1)[1]
        if which == "hidden":
            x, name = x.to(META), "hidden_states"
        elif which == "gamma":
            gamma, name = gamma.to(META), "gamma"
        elif which == "weight":
            w, name = w.to(META), "lm_head_weight_t"
        else:
            sp = (sp if sp is not None else torch.zeros(x.shape[0], 3)).to(META)
            name = "sampling_params"
    return x, gamma, w, sp, kw, exc, name


def _call_tail(x, gamma, w, sp, kw):
    """The mirror exchange unless the case names one: this fuzz checks the outputs against
    bf16-mirror references (the candidates exchange against its float64 emulation:
    tests/test_candidates.py and the contract kind tail.exchange.candidates)."""
    return decode_tail(x, gamma, w, sampling_params=sp, **{"exchange": "mirror", **kw})


def _prepared(c):
    """The hidden states as the case passes them (dtype, strides) and its fp32 contiguous twin."""
    x = c["x"].to(c["hidden_dtype"])
    twin = x.to(F32)
    if c["strided"] and x.dim() == 2:
        x = x.t().contiguous().t()  # the same values, column-major strides
    return x, twin


def check_tail(c):
    x, gamma, w, sp, kw, exc, name = _apply_defect(c)
    if c["defect"] is not None and name is None:
        return
    if exc is not None and name is not None:
        before = snapshot(x, gamma, w, sp)
        also = (("eps", ValueError),) if kw.get("eps") == 0 else ()  # eps=0 may meet an all-zero row first
        expect_error(lambda: _call_tail(x, gamma, w, sp, kw), exc, name, before, (x, gamma, w, sp), also=also)
        return
    xp, twin = _prepared(c)
    g = gamma.reshape(1, -1) if c["gamma_2d"] else gamma
    before = snapshot(xp, g, w, sp)
    h = twin.shape[1]
    real = torch.from_numpy(tref.real_lanes(h, h if kw["hidden_actual"] is None else kw["hidden_actual"],
                                            kw["zero_interleaved_pad"]))  # [H] pad lanes are zeroed
    rows_bad = (~torch.isfinite(twin) & real).any(dim=1)  # a non-finite real lane makes the row NaN
    underflow = ((twin * twin) == 0) | ~real  # fp32 squares that add nothing to the ssq
    zero_rows = underflow.all(dim=1) if kw["eps"] == 0 else torch.zeros(len(twin), dtype=torch.bool)
    if bool(zero_rows.any()) or (bool(rows_bad.any()) and sp is not None):
        _check_tail_undefined_rows(xp, g, w, sp, kw, rows_bad, zero_rows, before)
        return
    if bool(rows_bad.any()):
        _check_tail_nan_rows_without_sampling(xp, g, w, twin, gamma, kw, rows_bad, before)
        return
    out = _call_tail(xp, g, w, sp, kw)
    assert unchanged(before, (xp, g, w, sp)), "decode_tail mutated an input"
    _check_tail_contract(twin, gamma, w, sp, kw, out)
    ref = _call_tail(twin, gamma, w, sp, kw)  # 16-bit / strided hidden == the fp32 copy
    for f in ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
        assert same(getattr(out, f), getattr(ref, f)), f"{f}: {c['hidden_dtype']} strided={c['strided']} differs"
    i = len(twin) - 1  # byte gate: the last row alone
    solo = _call_tail(twin[i:i + 1], gamma, w, None if sp is None else sp[i:i + 1], kw)
    for f in ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
        a, b = getattr(solo, f), getattr(out, f)
        assert same(a, None if b is None else b[i:i + 1]), f"{f}: row {i} alone differs from in batch"


def _check_tail_nan_rows_without_sampling(x, g, w, twin, gamma, kw, rows_bad, before):
    """No sampling: a row with a non-finite real lane has all-NaN logits (defined), and the
    other rows are exactly what they are without it (row independence)."""
    out = _call_tail(x, g, w, None, kw)
    assert unchanged(before, (x, g, w, None)), "decode_tail mutated an input"
    assert bool(torch.isnan(out.logits[rows_bad]).all()), "a non-finite input row's logits are not all NaN"
    good = ~rows_bad
    if bool(good.any()):
        clean = _call_tail(twin[good], gamma, w, None, kw)
        assert same(out.logits[good], clean.logits), "a NaN row changed the other rows' logits"
        assert same(out.topk_indices[good], clean.topk_indices), "a NaN row changed the other rows' top-k"


def _check_tail_undefined_rows(x, g, w, sp, kw, rows_bad, zero_rows, before):
    """A row the op cannot define (NaN/inf input, or eps=0 and an all-zero row): an error
    naming the rows (eps for the zero rows) before or after the work, never silent output."""
    with pytest.raises(ValueError) as ei:
        _call_tail(x, g, w, sp, kw)
    msg = str(ei.value)
    if bool(zero_rows.any()) and not bool(rows_bad.any()):
        assert "eps" in msg, msg
    else:
        assert "NaN" in msg or "eps" in msg, msg
    assert unchanged(before, (x, g, w, sp)), "decode_tail mutated an input on the error path"


def _logits_range(x, gamma, w, kw):
    decl = tail_decl(x.shape[1], kw["deferred_rms"])
    args = dict(eps=kw["eps"], hidden_actual=kw["hidden_actual"], interleaved=kw["zero_interleaved_pad"],
                deferred_rms=kw["deferred_rms"])
    if "decl" in kwarg_names(tref.logits_range):
        args["decl"] = decl
    return tref.logits_range(x.numpy(), gamma.numpy(), w, **args)


def _check_tail_contract(x, gamma, w, sp, kw, out):
    lo, hi = _logits_range(x, gamma, w, kw)
    lg = out.logits.double().numpy()
    inside = (lg >= lo) & (lg <= hi)
    assert inside.all(), f"logits outside the float64 range at {np.argwhere(~inside)[:3].tolist()}"
    mirror = out.logits.to(BF)
    rv, ri = tref.topk_ref(mirror, kw["k"], nan_fold=True)
    assert np.array_equal(out.topk_indices.numpy(), ri), "top-k ids differ from the exact top-k"
    assert np.array_equal(out.topk_values.double().numpy(), rv), "top-k values differ from the exact top-k"
    if sp is None:
        assert out.tokens is None and out.logprobs is None
        return
    tok = out.tokens.numpy()
    assert (out.topk_indices.numpy() == tok[:, None]).any(axis=1).all(), "a token outside the candidates"
    greedy = sp[:, 2].numpy() < 1e-5
    assert (tok[greedy] == ri[greedy, 0]).all(), "a greedy row did not take candidate 0"
    spn = np.pad(sp.double().numpy(), ((0, 0), (0, 5 - sp.shape[1])))
    if sp.shape[1] < 4:
        spn[:, 3] = 0.5
    m64 = mirror.double().numpy()
    for r in range(len(tok)):  # the float64 sampler on the row's own bf16 values
        tk, tp, t, u, mp = spn[r]
        dec = sample_decision(m64[r], np.zeros(m64.shape[1]), top_k=tk, top_p=tp, temperature=t, u=u, min_p=mp,
                              k=kw["k"], slack=sampler_slack(m64.shape[1], kw["k"]))
        if dec["certified"]:
            assert bool(out.truncated[r]) == dec["truncated"], f"row {r}: truncated flag vs float64"
            assert not dec["comparable"] or tok[r] == dec["token"], f"row {r}: token {tok[r]} vs float64 {dec['token']}"
    for r in range(len(tok)):
        ref = np.float32(logprob_ref(mirror[r])[tok[r]])
        got = np.float32(out.logprobs[r].item())
        assert abs(float(got) - float(ref)) <= 2 * float(np.spacing(abs(ref))) + 1e-30, \
            f"row {r}: logprob {got} vs float64 {ref}"
    assert out.truncated.dtype == torch.bool and out.truncated.shape == (len(tok),)


@given(tail_cases())
@settings(FAST, max_examples=80)
def test_fuzz_decode_tail(case):
    check_tail(case)


def fixed_tail_case(**change):
    """One valid, sampled case (for the planted variants below)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, 8, generator=g)
    sp = torch.tensor([[0, 0.9, 0.8, 0.3, 0.0], [2, 1.0, 0.0, 0.5, 0.0], [0, 1.0, 1.3, 0.7, 0.05]], dtype=F32)
    case = dict(x=x, gamma=torch.rand(8, generator=g) + 0.5, w=(torch.randn(8, 33, generator=g) * 0.3).to(BF),
                sp=sp, hidden_dtype=F32, strided=False, gamma_2d=False,
                kw=dict(k=4, eps=1e-5, hidden_actual=None, zero_interleaved_pad=True, deferred_rms=True,
                        nan_fold=False), defect=None, special=False, bad=None)
    case.update(change)
    return case


REAL_TAIL, REAL_ADD_RMS = decode_tail, add_rms  # what the planted variants wrap


def _planted_logits(scale_row0):
    def tail(x, gamma, w, **kw):
        out = REAL_TAIL(x, gamma, w, **kw)
        lg = out.logits.clone()
        lg[0] = lg[0] * scale_row0
        return dataclasses.replace(out, logits=lg)
    return tail


def _planted_batch_dependent(x, gamma, w, **kw):
    """The last row's logits nudged by one ulp when it shares the batch: a batch-dependent op."""
    out = REAL_TAIL(x, gamma, w, **kw)
    if x.shape[0] == 1:
        return out
    lg = out.logits.clone()
    lg.view(torch.int32)[-1, 0] += 1
    return dataclasses.replace(out, logits=lg)


def _planted_last_candidate(x, gamma, w, **kw):
    """Every row draws its last candidate: a sampler that ignores u and the masses."""
    out = REAL_TAIL(x, gamma, w, **kw)
    return dataclasses.replace(out, tokens=out.topk_indices[:, -1].clone())


def _planted_wrong_type(x, gamma, w, **kw):
    try:
        return REAL_TAIL(x, gamma, w, **kw)
    except ValueError as e:
        raise TypeError(str(e)) from None


@pytest.mark.parametrize("planted,case,why", [
    (_planted_logits(1.01), fixed_tail_case(), "logits outside the float64 range"),
    (_planted_batch_dependent, fixed_tail_case(), "alone differs from in batch"),
    (_planted_last_candidate, fixed_tail_case(), "vs float64|candidate 0"),
    (_planted_wrong_type, fixed_tail_case(defect="k", bad=0), "expected ValueError"),
])
def test_fuzz_tail_property_goes_red(monkeypatch, planted, case, why):
    """The tail property catches a wrong range, a batch-dependent row, a wrong draw, the
    wrong error type."""
    check_tail(case)  # the real op passes the same case
    monkeypatch.setattr(sys.modules[__name__], "decode_tail", planted)
    with pytest.raises(AssertionError, match=why):
        check_tail(case)


@pytest.mark.slow
@given(tail_cases())
@LONG
def test_fuzz_decode_tail_long(case):
    check_tail(case)


# =======================================================================================
# glue ops: add_rms, moe_add_rms, rms_parts, embed_rows
# =======================================================================================
GLUE_DEFECTS = ("eps", "gamma_len", "gamma_np", "x_list", "meta_x", "dtype_x", "residual_shape")


@st.composite
def glue_cases(draw):
    t = draw(st.integers(0, 3))
    h = draw(st.sampled_from([1, 3, 8, 17, 40]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, generator=g) * draw(st.sampled_from([1.0, 1e-3, 50.0]))).to(BF)
    res = (torch.randn(t, h, generator=g)).to(BF)
    if draw(st.integers(0, 4)) == 0:
        x = special_values(draw, x)
    gamma = (torch.rand(h, generator=g) + 0.5).to(draw(st.sampled_from([F32, BF])))
    divisors = [p for p in range(1, h + 1) if h % p == 0]
    return dict(x=x, res=res, gamma=gamma, eps=draw(st.sampled_from([1e-5, 1e-6, 0.25])),
                part=draw(st.sampled_from(divisors)), rounding=draw(st.sampled_from(["once", "mlx"])),
                s=draw(st.integers(1, 4)), n_shared=None, slot_dtype=draw(st.sampled_from([F32, BF])),
                seed=seed, strided=draw(st.booleans()),
                defect=draw(st.sampled_from((None,) * 7 + GLUE_DEFECTS)))


def _glue_defect(c, x, res, gamma, eps):
    d = c["defect"]
    if d == "eps":
        return x, res, gamma, 1e39, ValueError, "eps"
    if d == "gamma_len":
        return x, res, torch.ones(x.shape[-1] + 1), eps, ValueError, "gamma"
    if d == "gamma_np":
        return x, res, gamma.float().numpy(), eps, TypeError, "gamma"
    if d == "x_list":
        return x.tolist(), res, gamma, eps, TypeError, "x"
    if d == "meta_x":
        return x.to(META), res, gamma, eps, ValueError, "x"
    if d == "dtype_x":
        return x.float(), res, gamma, eps, ValueError, "x"
    return x, res[:, :-1] if res.shape[-1] > 1 else res[:0, :], gamma, eps, ValueError, "residual"


def _strided(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t() if t.dim() == 2 else t


def check_add_rms(c):
    x, res, gamma, eps = c["x"], c["res"], c["gamma"], c["eps"]
    if c["defect"] is not None:
        bx, br, bg, be, exc, name = _glue_defect(c, x, res, gamma, eps)
        if name == "residual" and br.shape == bx.shape:
            return
        before = snapshot(bx, br, bg)
        expect_error(lambda: add_rms(bx, br, bg, eps=be), exc, name, before, (bx, br, bg))
        return
    xs = _strided(x) if c["strided"] else x
    before = snapshot(xs, res, gamma)
    h, y = add_rms(xs, res, gamma, eps=eps)
    assert unchanged(before, (xs, res, gamma)), "add_rms mutated an input"
    from lmtail.glue.norms import DEFAULT_ORDER

    eh, ey = gref.emu_add_rms(x.float().numpy(), res.float().numpy(), gamma.float().numpy(), eps=eps,
                              order=DEFAULT_ORDER)
    assert same_nan_aware(h, eh.reshape(h.shape)) and same_nan_aware(y, ey.reshape(y.shape)), \
        "add_rms bytes differ from the scalar emulation"
    if len(x) > 1:
        h1, y1 = add_rms(x[-1:], res[-1:], gamma, eps=eps)
        assert same(h1, h[-1:]) and same(y1, y[-1:]), "add_rms: a row alone differs from in batch"


def check_rms_parts(c):
    x, gamma, eps, part, rounding = c["x"], c["gamma"], c["eps"], c["part"], c["rounding"]
    if c["defect"] in ("eps", "gamma_np", "meta_x", "x_list"):
        bx, _, bg, be, exc, name = _glue_defect(c, x, c["res"], gamma, eps)
        before = snapshot(bx, bg)
        expect_error(lambda: rms_parts(bx, bg, part=part, rounding=rounding, eps=be), exc, name, before, (bx, bg))
        return
    xs = _strided(x) if c["strided"] else x
    before = snapshot(xs, gamma)
    y = rms_parts(xs, gamma, part=part, rounding=rounding, eps=eps)
    assert unchanged(before, (xs, gamma))
    from lmtail.glue.norms import DEFAULT_ORDER

    ey = gref.emu_rms_parts(x.float().numpy().reshape(-1, x.shape[-1]), gamma.float().numpy(), part=part,
                            rounding=rounding, eps=eps, order=DEFAULT_ORDER)
    assert same_nan_aware(y, ey.reshape(y.shape)), "rms_parts bytes differ from the scalar emulation"


def check_moe(c):
    x, gamma, eps, s = c["x"], c["gamma"], c["eps"], c["s"]
    t, h = x.shape
    g = torch.Generator().manual_seed(c["seed"] + 1)
    n_shared = c["seed"] % (s + 1)
    slots = torch.randn(s, t, h, generator=g).to(c["slot_dtype"])
    wts = torch.rand(t, s - n_shared, generator=g) * 0.5
    if c["defect"] in ("eps", "gamma_np", "x_list", "meta_x"):
        bx, _, bg, be, exc, name = _glue_defect(c, x, c["res"], gamma, eps)
        before = snapshot(bx, slots, wts, bg)
        expect_error(lambda: moe_add_rms(bx, slots, wts, bg, eps=be, n_shared=n_shared), exc, name, before,
                     (bx, slots, wts, bg))
        return
    before = snapshot(x, slots, wts, gamma)
    hh, y = moe_add_rms(x, slots, wts, gamma, eps=eps, n_shared=n_shared)
    assert unchanged(before, (x, slots, wts, gamma))
    from lmtail.glue.norms import DEFAULT_ORDER

    eh, ey = gref.emu_moe_add_rms(x.float().numpy(), slots.float().numpy(), wts.numpy(), gamma.float().numpy(),
                                  eps=eps, n_shared=n_shared, order=DEFAULT_ORDER)
    assert same_nan_aware(hh, eh.reshape(hh.shape)) and same_nan_aware(y, ey.reshape(y.shape)), \
        "moe_add_rms bytes differ from the scalar emulation"


@given(glue_cases())
@FAST
def test_fuzz_add_rms(case):
    check_add_rms(case)


@given(glue_cases())
@FAST
def test_fuzz_rms_parts(case):
    check_rms_parts(case)


@given(glue_cases())
@FAST
def test_fuzz_moe_add_rms(case):
    check_moe(case)


def test_fuzz_glue_property_goes_red(monkeypatch):
    """A planted add_rms whose y is one bf16 ulp off at one lane fails the emulation check."""
    g = torch.Generator().manual_seed(3)
    case = dict(x=torch.randn(2, 8, generator=g).to(BF), res=torch.randn(2, 8, generator=g).to(BF),
                gamma=torch.rand(8, generator=g) + 0.5, eps=1e-5, strided=False, defect=None)
    check_add_rms(case)

    def planted(x, res, gamma, **kw):
        h, y = REAL_ADD_RMS(x, res, gamma, **kw)
        y = y.clone()
        y.view(torch.int16)[0, 3] += 1
        return h, y

    monkeypatch.setattr(sys.modules[__name__], "add_rms", planted)
    with pytest.raises(AssertionError, match="emulation"):
        check_add_rms(case)


@pytest.mark.slow
@given(glue_cases())
@LONG
def test_fuzz_glue_long(case):
    check_add_rms(case)
    check_rms_parts(case)
    check_moe(case)


@given(st.integers(0, 9), st.integers(1, 6), st.lists(st.integers(-2, 10), max_size=6),
       st.sampled_from([torch.int64, torch.int32, torch.int16, torch.float32, torch.bool]))
@FAST
def test_fuzz_embed_rows(v, h, ids, dtype):
    table = torch.arange(v * h, dtype=F32).reshape(v, h).to(BF)
    t = torch.tensor(ids, dtype=torch.int64).to(dtype)
    before = snapshot(t, table)
    if dtype in (torch.float32, torch.bool):
        expect_error(lambda: embed_rows(t, table), ValueError, "ids", before, (t, table))
    elif any(i < 0 or i >= v for i in ids):
        expect_error(lambda: embed_rows(t, table), ValueError, "ids", before, (t, table))
    else:
        out = embed_rows(t, table)
        assert same(out, table[torch.tensor(ids, dtype=torch.int64)].reshape(len(ids), h))
        assert unchanged(before, (t, table))


# =======================================================================================
# router_topk
# =======================================================================================
@st.composite
def router_cases(draw):
    n_k, t, e = draw(st.integers(1, 3)), draw(st.integers(0, 4)), draw(st.integers(1, 9))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sl = torch.randn(n_k, t, e, generator=g) * draw(st.sampled_from([1.0, 8.0, 100.0]))
    if draw(st.booleans()):
        sl = special_values(draw, sl)
    bias = (torch.randn(e, generator=g) * 0.1) if draw(st.booleans()) else None
    return dict(sl=sl, bias=bias, k=draw(st.integers(1, e)), scale=draw(st.sampled_from([1.0, 2.5])),
                defect=draw(st.sampled_from([None, None, None, "k", "scale", "bias", "list"])), e=e)


def check_router(c):
    sl, bias, k, scale = c["sl"], c["bias"], c["k"], c["scale"]
    before = snapshot(sl, bias)
    if c["defect"] == "k":
        expect_error(lambda: router_topk(sl, k=c["e"] + 1), ValueError, "k", before, (sl, bias))
        return
    if c["defect"] == "scale":
        expect_error(lambda: router_topk(sl, k=k, scale=1e39), ValueError, "scale", before, (sl, bias))
        return
    if c["defect"] == "bias":
        expect_error(lambda: router_topk(sl, k=k, bias=torch.zeros(c["e"] + 1)), ValueError, "bias", before, (sl, bias))
        return
    if c["defect"] == "list":
        expect_error(lambda: router_topk(sl.tolist(), k=k), TypeError, "logit_slices", before, (sl, bias))
        return
    ids, w = router_topk(sl, k=k, bias=bias, scale=scale)
    assert unchanged(before, (sl, bias))
    assert ids.shape == (sl.shape[1], k) and w.dtype == F32
    kw = dict(decl=router_topk_decl(k, n_slices=sl.shape[0])) if "decl" in kwarg_names(gref.router_check) else {}
    ok, _, det = gref.router_check(sl.numpy(), None if bias is None else bias.numpy(), k, scale, ids.numpy(),
                                   w.numpy().astype(np.float64), **kw)
    assert ok, det


@given(router_cases())
@FAST
def test_fuzz_router_topk(case):
    check_router(case)


# =======================================================================================
# sampling_tensor and the layout maps
# =======================================================================================
FIELD_VALUES = dict(top_k=[0, -1, 3, 2.5, math.inf, 2**70, True], top_p=[1.0, 0.5, 0.0, 1.5, math.nan],
                    temperature=[0.0, 0.7, -1.0, math.inf], min_p=[0.0, 0.1, 1.0, 1.5],
                    u=[None, 0.0, 0.5, 0.99999994, 0.99999999, 1.0, -0.25])


REQUESTS = st.lists(st.fixed_dictionaries({f: st.sampled_from(v) for f, v in FIELD_VALUES.items()}),
                    min_size=1, max_size=4)
LAYOUTS = (st.sampled_from([1, 2, 3, 4, 6, 8]), st.integers(0, 48),
           st.sampled_from([None, (2,), (2, 2), (2, 4), (4, 2), (3, 2), (2, 2, 2), (8,)]), st.integers(0, 4))


@given(REQUESTS)
@FAST
def test_fuzz_sampling_tensor(reqs):
    check_sampling_tensor(reqs)


def check_sampling_tensor(reqs):
    params = [SamplingParams(**r) for r in reqs]
    try:
        sp = sampling_tensor(params)
    except ValueError as e:
        assert "request" in str(e) and any(f in str(e) for f in FIELD_VALUES), str(e)
        return
    assert sp.dtype == F32 and sp.shape == (len(params), 5)
    validate_params(sp, len(params))  # what it returns, the tail takes
    for r, p in zip(sp.tolist(), params):
        want = [p.top_k, p.top_p, p.temperature, 0.5 if p.u is None else p.u, p.min_p]
        assert r == [float(np.float32(v)) for v in want], (r, p)


@given(*LAYOUTS)
@FAST
def test_fuzz_layout_maps(vtp, gbs, hops, groups):
    check_layout(vtp, gbs, hops, groups)


@pytest.mark.slow
@given(router_cases(), REQUESTS, *LAYOUTS)
@LONG
def test_fuzz_router_sampling_layout_long(case, reqs, vtp, gbs, hops, groups):
    check_router(case)
    check_sampling_tensor(reqs)
    check_layout(vtp, gbs, hops, groups)


def check_layout(vtp, gbs, hops, groups):
    try:
        owners = [owned_rows(r, vtp, gbs, hops, groups) for r in range(vtp)]
    except ValueError as e:
        assert any(n in str(e) for n in ("vtp", "gbs", "hop", "batch_groups")), str(e)
        return
    flat = sorted(r for o in owners for r in o)
    assert flat == list(range(gbs)), "every row owned exactly once"
    meshes = compose_hops(vtp, hops)
    for mesh in meshes:
        assert sorted(r for grp in mesh for r in grp) == list(range(vtp))
    if groups == 1:
        for r in range(vtp):
            start, n = owned_row_block(r, vtp, gbs, hops)
            assert owners[r] == list(range(start, start + n))
