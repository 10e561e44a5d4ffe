"""The sampler's edge rules on every pass that decides a row, each with a planted wrong
variant shown to go red.

Passes (PASSES): "torch" (sampler.sample_rows on exact_topk's candidates, the float64
reference order), "fused:<row>" (kernels.tail.rows_tail's C kernel, every row of its Dispatch
table, the emulated ones included), "candidates:c" (the candidates exchange's C sampler,
kernels.tail.shard_partials.sample_candidates, asserted not to decline) and "candidates:torch"
(sampler.plan_on over candidates.MergedStats). The C passes run lmtail_kernels.h's one copy
of the candidate steps; tools/mutate.py's "sampling_h.*" mutants edit that copy (and the
per-pass answers to "a lane past k ties the threshold") and are killed by this file.

Rules: min_p = 1.0 with a tied maximum keeps both tied tokens; the top-p crossing token is
kept; top_k > k caps at k and flags truncated; threshold ties past the k-th candidate flag
truncated; greedy is the lowest id among equal maxima; u just below 1 draws the last kept
slot. Each rule is a check(decide) over a `decide(rows, sp, k) -> (tokens, truncated)`; the
planted variants are the torch pass with one step written wrong.

Shape legend: R rows, V vocab, k candidates.
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

from conftest import bits

from lmtail.tail import candidates
from lmtail.kernels import _cc
from lmtail.kernels.tail import rows_tail as rt
from lmtail.kernels.tail.rowmass import shifted_exp_rows, sum64_rows
from lmtail.kernels.tail.sampling import COL, SAMPLING_COLUMNS, SAMPLING_RECORD, sampling_records
from lmtail.tail.sampler import FullRowStats, decide, draw, plan_on, sample_rows
from lmtail.tail.topk import exact_topk

V, K = 64, 8
U_MAX = float(np.nextafter(np.float32(1.0), np.float32(0.0)))  # 0.99999994: the largest fp32 u below 1


def params(rows: list[dict]) -> torch.Tensor:
    """[R, 5] fp32 from {column: value} dicts (defaults: top-k off, top_p 1, T 1, u 0.5, min_p 0)."""
    base = {"top_k": 0.0, "top_p": 1.0, "temperature": 1.0, "u": 0.5, "min_p": 0.0}
    return torch.tensor([[{**base, **r}[c] for c in SAMPLING_COLUMNS] for r in rows], dtype=torch.float32)


def row(fill: float, at: dict[int, float]) -> list[float]:
    """[V] values (bf16-exact): `fill` everywhere, at[id] at the ids given."""
    out = [fill] * V
    for i, x in at.items():
        out[i] = x
    return out


# ---------------------------------------------------------------------------------------
# the passes
# ---------------------------------------------------------------------------------------
def torch_pass(rows, sp, k, plant=None):
    """(tokens [R], truncated [R], logprobs [R]) of the torch sampler; plant(plan, vals, ids,
    rows, sp, k) -> (plan, pos or None) edits one step (a planted wrong variant)."""
    vals, ids, _ = exact_topk(rows, k=k)
    if plant is None:
        tok, lp, tr = sample_rows(vals, ids, rows, sp)
        return tok, tr, lp
    plan = plan_on(vals, sp, FullRowStats(rows.double(), k))
    plan, pos = plant(plan, vals, ids, rows, sp, k)
    if pos is None:
        tok, lp, tr = decide(plan, vals, ids)
        return tok, tr, lp
    return ids.gather(1, pos[:, None])[:, 0], plan["truncated"], None


def fused_pass(name):
    def run(rows, sp, k):
        f = rt.rows_tail_fused(rows, k=k, sampling_params=sp, backend=name)
        assert not bool(f.undecided.any()), f"{name}: a row was left to the reference"
        return f.tokens, f.truncated, f.logprobs
    return run


def merged(rows, sp, k):
    logits = rows.float()  # [R, V] bf16-exact fp32 logits: the candidates exchange's input
    return candidates.merge(candidates.shard_partials(logits, col0=0, v=rows.shape[1], k=k, nan_fold=False, sp=sp),
                            k=k)


def candidates_c(rows, sp, k):
    mg = merged(rows, sp, k)
    got = candidates.kernel.sample_candidates(mg.values, mg.ids, sp, mg.stats, mg.outside, mg.has_outside,
                                              nan_fold=False)
    assert got is not None, "the candidates C sampler declined"
    tok, lp, tr = got
    return tok, tr, lp


def candidates_torch(rows, sp, k):
    mg = merged(rows, sp, k)
    plan = plan_on(mg.values, sp, candidates.MergedStats(mg, sp, False), terms=shifted_exp_rows, total=sum64_rows)
    tok, lp, tr = decide(plan, mg.values, mg.ids)
    return tok, tr, lp


def _passes() -> dict:
    out = {"torch": torch_pass}
    out.update({f"fused:{n}": fused_pass(n) for n in rt.ROWS_TAIL.names(emulated=True)})
    if candidates.kernel._c_library() is not None:
        out["candidates:c"] = candidates_c
    out["candidates:torch"] = candidates_torch
    return out


PASSES = _passes()


def decider(name):
    """decide(rows list [R][V], sp, k) -> (tokens list, truncated list) on pass `name`."""
    def decide_(rows, sp, k=K):
        tok, tr, _ = PASSES[name](torch.tensor(rows).to(torch.bfloat16), sp, k)
        return tok.tolist(), tr.tolist()
    return decide_


def planted(plant):
    def decide_(rows, sp, k=K):
        tok, tr, _ = torch_pass(torch.tensor(rows).to(torch.bfloat16), sp, k, plant)
        return tok.tolist(), tr.tolist()
    return decide_


# ---------------------------------------------------------------------------------------
# the rules (each an assertion over a decide function)
# ---------------------------------------------------------------------------------------
def check_min_p_one_keeps_tied_maximum(decide_):
    """min_p = 1: p >= 1.0 * p[0] keeps both tokens of a tied maximum (ids 3 and 7), so u
    past the middle draws the second."""
    r = row(-1.0, {3: 2.0, 7: 2.0, 20: 1.0, 40: 0.5})
    us = (0.25, 0.49, 0.75, U_MAX)
    tok, _ = decide_([r] * len(us), params([{"min_p": 1.0, "u": u} for u in us]))
    assert tok == [3, 3, 7, 7], tok


def check_top_p_crossing_token_kept(decide_):
    """Probabilities ~0.4986, 0.2507, 0.2507 over the top-3 (ids 5, 2, 9; ids 2 and 9 tied):
    top_p = 0.6: the mass before id 2 is 0.4986 < 0.6, so id 2 (the crossing token) is kept
    and id 9 is not; u = 0.9 draws id 2 (cdf 0.665, 1 over the kept), u = 0.6 id 5."""
    r = row(-3.0, {5: 0.75, 2: 0.0625, 9: 0.0625})
    sp = params([{"top_k": 3.0, "top_p": 0.6, "u": 0.9}, {"top_k": 3.0, "top_p": 0.6, "u": U_MAX},
                 {"top_k": 3.0, "top_p": 0.6, "u": 0.6}])
    tok, tr = decide_([r] * 3, sp)
    assert tok == [2, 2, 5] and tr == [False] * 3, (tok, tr)


def check_top_k_above_k_caps_and_flags(decide_):
    """top_k = 9, 50, 2**40, 1e30 (> k = 8) keep the same set as top_k = k and draw the same
    tokens; only they are flagged truncated (the values are distinct: no tie past k). The
    candidates hold ~86% of the mass, so a top_k read as "off" would normalize over the row
    and, at top_p = 0.5, neither keep the same set nor flag the row."""
    r = [2.0 - 0.25 * i for i in range(V)]  # strictly descending, bf16-exact
    tks = (8.0, 9.0, 50.0, 2.0**40, 1e30)
    for u in (0.3, 0.7, U_MAX):
        for top_p in (1.0, 0.5):
            tok, tr = decide_([r] * len(tks), params([{"top_k": t, "top_p": top_p, "u": u} for t in tks]))
            assert tok == [tok[0]] * len(tks) and tr == [False, True, True, True, True], (u, top_p, tok, tr)


def check_threshold_ties_past_k_flag(decide_):
    """k = 4. Row 0: 3.0 then twenty 1.0s: top_k = 4 (threshold 1.0 at slot 3) and top_k = 2
    (threshold 1.0 at slot 1) tie lanes past the candidates: truncated. Row 1: the ties end
    inside the candidates (ids 1, 2 at 1.0, the rest lower): not truncated."""
    tied = row(-2.0, {0: 3.0, **{i: 1.0 for i in range(1, 21)}})
    inside = row(-2.0, {0: 3.0, 1: 1.0, 2: 1.0, 3: 0.5})
    tok, tr = decide_([tied, tied, inside, inside], params([{"top_k": 4.0}, {"top_k": 2.0}, {"top_k": 2.0},
                                                          {"top_k": 3.0}]), k=4)
    assert tr == [True, True, False, False], (tok, tr)


def check_greedy_lowest_id_among_equal_maxima(decide_):
    """The maximum 5.0 at ids 31, 9, 5, 4: greedy rows (T = 0 and fp32 9e-6 < 1e-5) draw id 4
    at any u, never truncated; a sampled row rides along (the C samplers then run)."""
    r = row(-1.0, {31: 5.0, 9: 5.0, 5: 5.0, 4: 5.0, 50: 4.0})
    sp = params([{"temperature": 0.0, "u": U_MAX}, {"temperature": 9e-6, "u": 0.9},
                 {"temperature": 0.0, "top_k": 2.0, "u": 0.9}, {"temperature": 1.0, "u": 0.1}])
    tok, tr = decide_([r] * 4, sp)
    assert tok[:3] == [4, 4, 4] and tr[:3] == [False] * 3, (tok, tr)


def check_u_below_one_draws_last_kept(decide_):
    """Four ~0.25 tokens (ids 10..13 at 2.0, the rest far below). top_p = 0.5 keeps ids 10,
    11, 12 (12 crosses); min_p = 0.5 over 2.0, 2.0, 1.5 keeps ids 10, 11, 12 of a second row;
    u = 0.99999994 draws the last kept slot (id 12), never a dropped one."""
    quad = row(-20.0, {10: 2.0, 11: 2.0, 12: 2.0, 13: 2.0})
    steps = row(-20.0, {10: 2.0, 11: 2.0, 12: 1.5, 13: 1.0, 14: 1.0})
    sp = params([{"top_p": 0.5, "u": U_MAX}, {"min_p": 0.5, "u": U_MAX}, {"top_k": 3.0, "min_p": 0.5, "u": U_MAX}])
    tok, _ = decide_([quad, steps, steps], sp)
    assert tok == [12, 12, 12], tok


RULES = {
    "min_p_one_keeps_tied_maximum": check_min_p_one_keeps_tied_maximum,
    "top_p_crossing_token_kept": check_top_p_crossing_token_kept,
    "top_k_above_k_caps_and_flags": check_top_k_above_k_caps_and_flags,
    "threshold_ties_past_k_flag": check_threshold_ties_past_k_flag,
    "greedy_lowest_id_among_equal_maxima": check_greedy_lowest_id_among_equal_maxima,
    "u_below_one_draws_last_kept": check_u_below_one_draws_last_kept,
}


# ---------------------------------------------------------------------------------------
# the planted wrong variants: the torch pass with one step written wrong
# ---------------------------------------------------------------------------------------
def _min_p_strict(plan, vals, ids, rows, sp, k):
    p = plan["p"]
    keep = plan["keep"] & (p > sampling_records_tensor(sp, "min_p")[:, None] * p[:, :1])
    keep[:, 0] = True
    return dict(plan, keep=keep), None


def _top_p_drops_crossing(plan, vals, ids, rows, sp, k):
    keep = plan["keep"] & (plan["running"] < sampling_records_tensor(sp, "top_p")[:, None])
    keep[:, 0] = True
    return dict(plan, keep=keep), None


def _top_k_capped_before_flag(plan, vals, ids, rows, sp, k):
    capped = sp.clone()
    capped[:, COL.top_k] = capped[:, COL.top_k].clamp(max=k)  # the cap applied before the flag reads top_k
    return plan_on(vals, capped, FullRowStats(rows.double(), k)), None


class _NoTiesPastK(FullRowStats):
    def ties_past_k(self, thr, in_k):
        return torch.zeros(thr.shape[0], dtype=torch.bool)


def _ties_past_k_ignored(plan, vals, ids, rows, sp, k):
    return plan_on(vals, sp, _NoTiesPastK(rows.double(), k)), None


def _greedy_highest_id(plan, vals, ids, rows, sp, k):
    last_tied = (vals.double() == vals.double()[:, :1]).sum(dim=1) - 1  # the last slot equal to slot 0
    return plan, torch.where(plan["greedy"], last_tied, draw(plan))


def _draw_over_all_candidates(plan, vals, ids, rows, sp, k):
    c = plan["running"]
    pos = (c / c[:, -1:] <= plan["u"][:, None]).sum(dim=1).clamp(max=k - 1)  # no kept mask, all k's mass
    return plan, torch.where(plan["greedy"], torch.zeros_like(pos), pos)


def sampling_records_tensor(sp, name):
    return torch.from_numpy(np.ascontiguousarray(sampling_records(sp)[name]))


PLANTS = {
    "min_p_one_keeps_tied_maximum": _min_p_strict,
    "top_p_crossing_token_kept": _top_p_drops_crossing,
    "top_k_above_k_caps_and_flags": _top_k_capped_before_flag,
    "threshold_ties_past_k_flag": _ties_past_k_ignored,
    "greedy_lowest_id_among_equal_maxima": _greedy_highest_id,
    "u_below_one_draws_last_kept": _draw_over_all_candidates,
}


# ---------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pass_name", sorted(PASSES))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_rule_holds_on_every_pass(rule, pass_name):
    RULES[rule](decider(pass_name))


@pytest.mark.parametrize("rule", sorted(RULES))
def test_planted_variant_goes_red(rule):
    RULES[rule](decider("torch"))
    with pytest.raises(AssertionError):
        RULES[rule](planted(PLANTS[rule]))


def test_the_c_passes_are_all_here():
    """Every C pass the machine can run is in PASSES (a fused row missing would leave its
    kernel untested here): the Dispatch table's rows, emulated ones included."""
    want = {f"fused:{n}" for n in rt.ROWS_TAIL.names(emulated=True)}
    assert want <= set(PASSES) and ("fused:c" in PASSES) == (rt._c_library() is not None)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_passes_agree_bitwise_on_random_rows(seed):
    """Random bf16 rows with ties and random parameters: every fused row's tokens, truncated
    and logprobs are the torch pass's bytes; the candidates passes agree with each other
    (their logprobs come from the merged fp32 partials) and on tokens / truncated with torch."""
    g = torch.Generator().manual_seed(90 + seed)
    r = 9
    rows = (torch.randint(-6, 7, (r, V), generator=g).float() * 0.25).to(torch.bfloat16)  # ties galore
    rows[:, 0] = 3.0  # a nonzero maximum (a zero one is left to the reference)
    pick = lambda xs: xs[int(torch.randint(0, len(xs), (1,), generator=g))]  # noqa: E731
    sp = params([{"top_k": float(pick(range(-1, 12))), "top_p": float(torch.rand(1, generator=g)) * 0.9 + 0.1,
                  "temperature": pick([0.0, 0.5, 1.0, 1.7]), "u": float(torch.rand(1, generator=g)),
                  "min_p": pick([0.0, 0.2, 1.0])} for _ in range(r)])
    want = torch_pass(rows, sp, K)
    for name, run in PASSES.items():
        got = run(rows, sp, K)
        assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), name
        if name.startswith("fused:"):
            assert torch.equal(bits(got[2]), bits(want[2])), name
    if "candidates:c" in PASSES:
        a, b = candidates_c(rows, sp, K), candidates_torch(rows, sp, K)
        assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------
# the schema: one record, the same in Python and C
# ---------------------------------------------------------------------------------------
def test_record_layout_is_the_c_struct():
    """SAMPLING_RECORD is lmtail_sampling field for field: names in COL order, int64 top_k,
    float64 rest, 40 bytes without padding (the C struct's natural layout on x86-64)."""
    assert SAMPLING_COLUMNS == ("top_k", "top_p", "temperature", "u", "min_p")
    assert [getattr(COL, c) for c in SAMPLING_COLUMNS] == [0, 1, 2, 3, 4]
    assert SAMPLING_RECORD.names == SAMPLING_COLUMNS and SAMPLING_RECORD.itemsize == 40
    assert [SAMPLING_RECORD.fields[c][1] for c in SAMPLING_COLUMNS] == [0, 8, 16, 24, 32]
    assert SAMPLING_RECORD["top_k"] == np.int64 and all(SAMPLING_RECORD[c] == np.float64 for c in SAMPLING_COLUMNS[1:])
    text = _cc.HEADER.read_text()
    assert "typedef struct {\n    int64_t top_k;\n    double top_p, temperature, u, min_p;\n} lmtail_sampling;" in text


def test_records_widen_and_default_like_the_sampler():
    """[R, 3] / [R, 4] / [R, 5]: u = 0.5 and min_p = 0 where absent; top_k clamped to
    [-1, 2**62] then truncated (1e30 caps, never wraps to off); the rest widened exactly.
    Planted: a clamp after the int64 conversion wraps 1e30 negative."""
    sp5 = torch.tensor([[1e30, 0.9, 0.7, 0.25, 0.1], [-5.0, 1.0, 0.0, 0.0, 1.0], [3.0, 0.3, 1e-6, U_MAX, 0.0]])
    rec = sampling_records(sp5)
    assert rec["top_k"].tolist() == [2**62, -1, 3]
    for c in SAMPLING_COLUMNS[1:]:
        assert np.array_equal(rec[c], sp5[:, getattr(COL, c)].double().numpy())
    r3, r4 = sampling_records(sp5[:, :3]), sampling_records(sp5[:, :4])
    assert r3["u"].tolist() == [0.5] * 3 and r3["min_p"].tolist() == [0.0] * 3
    assert r4["u"].tolist() == rec["u"].tolist() and r4["min_p"].tolist() == [0.0] * 3
    wrapped = sp5[:, 0].double().to(torch.int64).clamp(min=-1, max=2**62)  # planted: convert, then clamp
    assert wrapped.tolist() != rec["top_k"].tolist()


@pytest.mark.parametrize("pass_name", sorted(PASSES))
def test_greedy_rows_u_is_unused_on_every_pass(pass_name):
    """sampler.greedy_rows' u (DEFAULT_U) is never read: greedy rows with u = 0, 0.5, 0.99999994
    or any other give the same tokens, logprobs and flags, byte for byte, on every pass (so a
    padding row spelled with another u, as the benchmarks once did, decided the same bytes).
    Planted (the comparison can fail): sampled rows' tokens do change with u on the same rows."""
    from lmtail.tail.sampler import greedy_rows

    g = torch.Generator().manual_seed(7)
    rows = (torch.randn(4, V, generator=g) * 2).to(torch.bfloat16)  # [4, V]
    outs = []
    for u in (0.0, 0.5, U_MAX, 0.123):
        sp = greedy_rows(4)
        sp[:, COL.u] = u
        outs.append(PASSES[pass_name](rows, sp, K))
    for o in outs[1:]:
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(outs[0], o)), pass_name
    tok_lo = PASSES[pass_name](rows, params([{"u": 0.0}] * 4), K)[0]
    tok_hi = PASSES[pass_name](rows, params([{"u": U_MAX}] * 4), K)[0]
    assert not torch.equal(tok_lo, tok_hi)  # sampled rows do read u
