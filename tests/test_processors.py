"""The logits-processor seam (lmtail.tail.processors) and decode_tail(processing=...).

The op's bytes == the float64 reference's fp32 roundings (reference/processors.py, dense,
lane by lane) on bit views: random inputs over several seeds, odd V, NaN / inf / -0 /
subnormal logits, ids at the shard edges; any split of the vocabulary into shards (v0)
gives the one-shard bytes; rows without processing keep every bit (no arithmetic touches
them, NaN payloads included). Planted wrong variants (steps swapped, bias twice, the mask
not applied past shard 0, repetition over the output only) must go red against the same
reference. In decode_tail: the seam sits right after the GEMM's fp32 logits and before
either exchange (a run with processing == a run without it whose GEMM output is replaced
by the reference-processed logits, every output); processed rows beside plain rows leave
the plain rows' bytes alone; 2 gloo ranks == 1 rank. Every boundary error names its field.

Shape legend: n rows, V vocab, V_s shard, H hidden, k candidates.
"""
from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import bits, same_bits
from lmtail.tail import processors as P
from lmtail.tail import compose as tail_mod
from lmtail.launch import launch
from lmtail.tail.processors import LogitProcessing, Processors, apply_processing, plan_processing
from lmtail.reference.processors import processed_logits
from lmtail.tail.compose import decode_tail, head_shard

ROOT = Path(__file__).resolve().parents[1]
NAN_PAYLOAD = torch.tensor([0x7FC0BEEF], dtype=torch.int32).view(torch.float32)[0]  # a quiet NaN, odd payload


# ---------------------------------------------------------------------------------------
# random problems
# ---------------------------------------------------------------------------------------
def rand_logits(n: int, v: int, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4  # [n, V]
    if specials and v >= 8:
        x[0, 0], x[0, v - 1] = float("nan"), float("inf")
        x[n - 1, 1], x[n - 1, v - 2] = -0.0, -float("inf")
        x[n // 2, 2], x[n // 2, 3] = 1e-40, -3e-39  # subnormals
        x[n // 2, v // 2] = NAN_PAYLOAD
    return x


def rand_processing(n: int, v: int, seed: int, *, mask=True, edges=()) -> list:
    """n entries: None, neutral, and random mixes of every processor; `edges`: ids every
    non-None row lists (shard edges)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(None)
            continue
        if kind == 1:
            out.append(LogitProcessing())  # neutral: bytes unchanged
            continue
        ids = np.unique(np.concatenate([rng.integers(0, v, size=rng.integers(1, 12)), np.array(edges, int)]))
        ids = ids[(ids >= 0) & (ids < v)]
        cnt_ids = rng.permutation(ids)[: max(1, len(ids) // 2)]
        bias_ids = rng.permutation(ids)[: max(1, len(ids) // 2)]
        allowed = None
        if mask and kind == 4:
            allowed = torch.from_numpy(rng.random(v) < 0.6)
            allowed[int(ids[0])] = True
        out.append(LogitProcessing(
            logit_bias=tuple((int(j), float(rng.uniform(-100, 100))) for j in bias_ids),
            presence_penalty=float(rng.uniform(-2, 2)) if kind != 3 else 0.0,
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.choice([0.5, 1.0, 1.3, 1.7, 2.9])) if kind != 2 else 1.0,
            output_counts=tuple((int(j), int(rng.integers(1, 9))) for j in cnt_ids),
            prompt_ids=tuple(int(j) for j in rng.integers(0, v, size=rng.integers(0, 20))),
            allowed=allowed))
    return out


def shards(x: torch.Tensor, proc, cuts) -> torch.Tensor:
    """The op applied shard by shard (cuts: the shard boundaries), concatenated."""
    v = x.shape[1]
    edges = [0, *cuts, v]
    return torch.cat([apply_processing(x[:, a:b].contiguous(), proc, v0=a, vocab_size=v)
                      for a, b in zip(edges[:-1], edges[1:])], dim=1)


# ---------------------------------------------------------------------------------------
# the op against the float64 reference
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("v", [1, 7, 101, 1000, 4099])
def test_op_equals_float64_reference_bitwise(seed, v):
    n = 10
    x = rand_logits(n, v, seed)
    proc = rand_processing(n, v, seed, edges=(0, v - 1, v // 2, v // 2 - 1))
    got = apply_processing(x, proc)
    want = processed_logits(x, proc)
    assert same_bits(got, want)
    assert same_bits(x, rand_logits(n, v, seed)), "the input was written"
    changed = ~(bits(got) == bits(x)).all(dim=1)  # [n]
    assert not changed[[i for i, p in enumerate(proc) if p is None or p.neutral]].any()
    if v >= 101:
        assert changed.sum() >= 4  # the processors did act


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("v,cuts", [(101, (50,)), (101, (51,)), (1000, (500,)), (999, (333, 666)),
                                    (4099, (1, 4098)), (12, (3, 6, 9))])
def test_any_shard_split_equals_one_shard(seed, v, cuts):
    """Vocab-parallel: each shard edits its own lanes; the concatenation is the one-shard
    result, ids listed at every shard's first and last lane."""
    x = rand_logits(6, v, seed)
    edges = tuple(c + d for c in (0, *cuts) for d in (-1, 0)) + (v - 1,)
    proc = rand_processing(6, v, seed + 10, edges=tuple(e for e in edges if 0 <= e < v))
    assert same_bits(shards(x, proc, cuts), apply_processing(x, proc))


def test_special_values_follow_the_declared_rules():
    """NaN stays NaN through 1-4 and the mask makes it -inf; inf / r = inf; -inf * r =
    -inf; -0 * r = -0 (not > 0); bias on inf stays inf; +0 with l > 0 false -> l * r."""
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 2.0, -2.0, 1e-45]])
    p = LogitProcessing(repetition_penalty=2.0, prompt_ids=tuple(range(8)), logit_bias=((1, -5.0),),
                        allowed=torch.tensor([False] + [True] * 7))
    got = apply_processing(x, [p])
    want = torch.tensor([[-float("inf"), float("inf"), -float("inf"), -0.0, 0.0, 1.0, -4.0, 0.0]])
    assert same_bits(got, want), got
    assert same_bits(got, processed_logits(x, [p]))


def test_neutral_rows_keep_every_bit_and_no_dense_pass():
    """A row with processing None / all-neutral fields keeps its NaN payload; a processed
    row's unlisted lanes too (the op touches only listed lanes and masks)."""
    x = torch.full((3, 50), NAN_PAYLOAD.item())
    x[:, 7] = 1.5
    got = apply_processing(x, [None, LogitProcessing(), LogitProcessing(logit_bias=((7, 1.0),))])
    assert same_bits(got[:2], x[:2])
    assert same_bits(got[2, :7], x[2, :7]) and same_bits(got[2, 8:], x[2, 8:]) and got[2, 7] == 2.5
    assert plan_processing([None, LogitProcessing()], rows=2, vocab_size=50) is None  # nothing to run


def test_order_is_repetition_frequency_presence_bias_mask():
    """One lane through every step: l = 3, r = 2 -> 1.5; f = 0.5, c = 3 -> 0; p = 1 -> -1;
    b = 0.25 -> -0.75 (any other order gives another value)."""
    x = torch.tensor([[3.0, 3.0]])
    p = LogitProcessing(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=1.0,
                        output_counts=((0, 3),), logit_bias=((0, 0.25),))
    assert apply_processing(x, [p])[0, 0].item() == -0.75 and apply_processing(x, [p])[0, 1].item() == 3.0


# ---------------------------------------------------------------------------------------
# planted wrong variants: each must differ from the reference
# ---------------------------------------------------------------------------------------
def _planted(kind):
    def edit(flat, idx, rep, r, freq, f, c, pres, p, hb, b):
        g = flat[idx]
        if kind == "bias_first":
            g = np.where(hb, g + b, g)
        g = np.where(rep, np.where(g > 0, g / r, g * r), g)
        g = np.where(freq, g - f * c, g)
        g = np.where(pres, g - p, g)
        if kind != "bias_first":
            g = np.where(hb, g + b, g)
        if kind == "bias_twice":
            g = np.where(hb, g + b, g)
        flat[idx] = g
    return edit


@pytest.mark.parametrize("planted", ["bias_first", "bias_twice", "mask_rank0_only", "repetition_output_only"])
def test_planted_wrong_variants_go_red(monkeypatch, planted):
    v = 1000
    x = rand_logits(10, v, 3)
    proc = rand_processing(10, v, 3, edges=(0, 499, 500, 999))
    if planted in ("bias_first", "bias_twice"):
        monkeypatch.setattr(P, "_edit", _planted(planted))
    elif planted == "mask_rank0_only":
        real = P.apply_plans

        def no_mask_past_0(logits, plans, *, v0):
            if v0 > 0:
                plans = [None if pl is None else P.RowPlan(**{**pl.__dict__, "allowed": None}) for pl in plans]
            return real(logits, plans, v0=v0)
        monkeypatch.setattr(P, "apply_plans", no_mask_past_0)
    else:
        real_plan = P.plan_row

        def output_only(p, v, name="processing"):
            pl = real_plan(p, v, name)
            return pl if pl is None or not pl.rep_ids.size else P.RowPlan(
                **{**pl.__dict__, "rep_ids": np.setdiff1d(pl.rep_ids, np.setdiff1d(p.prompt_ids, pl.cnt_ids))})
        monkeypatch.setattr(P, "plan_row", output_only)
    got = shards(x, proc, (500,)) if planted == "mask_rank0_only" else apply_processing(x, proc)
    assert not same_bits(got, processed_logits(x, proc))


# ---------------------------------------------------------------------------------------
# boundary errors, each naming its field
# ---------------------------------------------------------------------------------------
ERRORS = [
    (dict(logit_bias=((10, 1.0),)), r"processing\[0\].logit_bias must hold token ids in \[0, V=10\); got 10"),
    (dict(logit_bias=((-1, 1.0),)), r"logit_bias must hold token ids in \[0, V=10\); got -1"),
    (dict(logit_bias=((1.5, 1.0),)), r"logit_bias must hold int token ids; got 1.5"),
    (dict(logit_bias=((1, 1.0), (1, 2.0))), r"logit_bias must list each token id once; got id 1 twice"),
    (dict(logit_bias=((1, float("nan")),)), r"logit_bias must map ids to numbers finite in fp32; got nan"),
    (dict(logit_bias=((1, 1e39),)), r"logit_bias must map ids to numbers finite in fp32; got 1e\+39"),
    (dict(logit_bias=(1, 2)), r"logit_bias must be a tuple of \(token id, value\) pairs"),
    (dict(presence_penalty=2.5), r"processing\[0\].presence_penalty must be a number in \[-2, 2\]; got 2.5"),
    (dict(frequency_penalty=-2.01), r"frequency_penalty must be a number in \[-2, 2\]; got -2.01"),
    (dict(frequency_penalty=float("nan")), r"frequency_penalty must be a number in \[-2, 2\]; got nan"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0 \(in fp32 too\); got 0.0"),
    (dict(repetition_penalty=float("inf")), r"repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=1e-50), r"repetition_penalty must .*got 1e-50, which is 0.0 in fp32"),
    (dict(repetition_penalty=True), r"repetition_penalty must be a finite number > 0 .*got True"),
    (dict(output_counts=((3, 0),)), r"output_counts must map ids to int counts in \[1, 2\*\*24\); got 0"),
    (dict(output_counts=((3, 1 << 24),)), r"output_counts must map ids to int counts in \[1, 2\*\*24\)"),
    (dict(output_counts=((12, 1),)), r"output_counts must hold token ids in \[0, V=10\); got 12"),
    (dict(prompt_ids=(1, 2, 99)), r"prompt_ids must hold token ids in \[0, V=10\); got 99"),
    (dict(prompt_ids=[1.0]), r"prompt_ids must hold int token ids; got 1.0"),
    (dict(allowed=torch.ones(9, dtype=torch.bool)), r"allowed must be a CPU \[V=10\] bool tensor; got \(9,\)"),
    (dict(allowed=torch.ones(10)), r"allowed must be a CPU \[V=10\] bool tensor; got \(10,\) torch.float32"),
    (dict(allowed=torch.zeros(10, dtype=torch.bool)), r"allowed must allow at least one token; got none"),
]


@pytest.mark.parametrize("fields,match", ERRORS)
def test_bad_processing_names_the_field(fields, match):
    x = torch.zeros(1, 10)
    with pytest.raises(ValueError, match=match):
        apply_processing(x, [LogitProcessing(**fields)])


def test_bad_processing_lists_and_logits():
    x = torch.zeros(2, 10)
    with pytest.raises(ValueError, match=r"processing must hold one entry per row \(2\); got 1"):
        apply_processing(x, [None])
    with pytest.raises(ValueError, match=r"processing\[1\] must be a LogitProcessing or None; got dict"):
        apply_processing(x, [None, {}])
    with pytest.raises(ValueError, match="processing must be None or a sequence of 2 entries"):
        apply_processing(x, LogitProcessing())
    with pytest.raises(ValueError, match=r"logits must be a \[n, V_s\] float32 tensor; got \(2, 10\) torch.float64"):
        apply_processing(x.double(), None)
    with pytest.raises(ValueError, match=r"v0 must be an int with 0 <= v0 and v0 \+ V_s <= V=15"):
        apply_processing(x, None, v0=6, vocab_size=15)


# ---------------------------------------------------------------------------------------
# decode_tail: the seam's place, batch independence, ranks
# ---------------------------------------------------------------------------------------
H, V, K = 64, 509, 16


def tail_problem(gbs: int, seed: int, v: int = V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, H, generator=g) * 2
    gamma = torch.rand(H, generator=g) + 0.5
    w = (torch.randn(H, v, generator=g) * 0.3).to(torch.bfloat16)
    sp = torch.stack([torch.tensor([0.0, 5.0, 0.0, 40.0])[torch.arange(gbs) % 4],
                      torch.tensor([1.0, 0.9, 0.7, 1.0])[torch.arange(gbs) % 4],
                      torch.tensor([0.0, 0.8, 1.0, 1.3])[torch.arange(gbs) % 4],
                      torch.rand(gbs, generator=g) * 0.999, torch.zeros(gbs)], 1)
    return x, gamma, w, sp


FIELDS = ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")


def same_out(a, b, rows=slice(None)):
    return all(same_bits(getattr(a, f), getattr(b, f)[rows]) for f in FIELDS)


@pytest.mark.parametrize("exchange", ["candidates", "mirror"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seam_sits_between_the_gemm_and_the_exchange(monkeypatch, exchange, seed):
    """decode_tail(processing=P) == decode_tail whose GEMM logits are replaced by the
    reference-processed ones, every output bit (logits emitted after processing)."""
    x, gamma, w, sp = tail_problem(12, seed)
    proc = rand_processing(12, V, seed, edges=(0, V - 1))
    got = decode_tail(x, gamma, w, k=K, sampling_params=sp, processing=proc, exchange=exchange)
    real = tail_mod.logits_from
    monkeypatch.setattr(tail_mod, "logits_from", lambda *a: processed_logits(real(*a), proc))
    want = decode_tail(x, gamma, w, k=K, sampling_params=sp, exchange=exchange)
    assert same_out(got, want)
    masked = [i for i, p in enumerate(proc) if p is not None and p.allowed is not None]
    assert masked and all(bool(proc[i].allowed[got.tokens[i]]) for i in masked)  # the mask holds


@pytest.mark.parametrize("exchange", ["candidates", "mirror"])
def test_plain_rows_beside_processed_rows_keep_their_bytes(exchange):
    """Rows without processing: the bytes of the call without processing (any batch); a
    processed row alone == the same row in the batch; processing None == all None."""
    x, gamma, w, sp = tail_problem(10, 7)
    proc = rand_processing(10, V, 7)
    plain = decode_tail(x, gamma, w, k=K, sampling_params=sp, exchange=exchange)
    mixed = decode_tail(x, gamma, w, k=K, sampling_params=sp, exchange=exchange, processing=proc)
    none_rows = [i for i, p in enumerate(proc) if p is None or p.neutral]
    assert same_out(decode_tail(x[none_rows], gamma, w, k=K, sampling_params=sp[none_rows], exchange=exchange),
                    mixed, none_rows)
    assert same_out(plain, decode_tail(x, gamma, w, k=K, sampling_params=sp, exchange=exchange,
                                       processing=[None] * 10))
    for i in (2, 4):
        solo = decode_tail(x[i:i + 1], gamma, w, k=K, sampling_params=sp[i:i + 1], exchange=exchange,
                           processing=[proc[i]])
        assert same_out(solo, mixed, slice(i, i + 1))
    assert not same_out(plain, mixed)


def test_logit_bias_100_wins_greedy_and_sampled():
    x, gamma, w, sp = tail_problem(4, 3)
    proc = [LogitProcessing(logit_bias=((123, 100.0),))] * 4
    out = decode_tail(x, gamma, w, k=K, sampling_params=sp, processing=proc)
    assert out.tokens.tolist() == [123] * 4


def test_decode_tail_refuses_bad_processing_before_any_work(monkeypatch):
    x, gamma, w, sp = tail_problem(2, 0)
    monkeypatch.setattr(tail_mod, "logits_from", lambda *a: pytest.fail("the GEMM ran"))
    with pytest.raises(ValueError, match=r"processing\[1\].logit_bias must hold token ids in \[0, V=509\); got 509"):
        decode_tail(x, gamma, w, k=K, processing=[None, LogitProcessing(logit_bias=((V, 1.0),))])
    with pytest.raises(ValueError, match=r"processing must hold one entry per row \(2\); got 3"):
        decode_tail(x, gamma, w, k=K, processing=[None] * 3)


def test_tail_declaration_names_the_seam():
    d = tail_mod.tail_decl(64, processing=True)
    pts = d.rounding_points
    assert pts.index("acc*rms:fp32") < pts.index("processors:l+b:fp32 (logit_bias)")
    assert tail_mod.tail_decl(64).rounding_points == tuple(p for p in pts if not p.startswith("processors:"))


def _ranks_job(rank: int, cases):
    import torch.distributed as dist

    outs = []
    for seed, exchange in cases:
        x, gamma, w, sp = tail_problem(8, seed, 512)
        proc = rand_processing(8, 512, seed, edges=(0, 255, 256, 511))
        from lmtail.tail.layout import owned_rows

        rows = owned_rows(rank, 2, 8)
        o = decode_tail(x, gamma, head_shard(w, rank, 2), k=K, sampling_params=sp[rows], processing=proc,
                        exchange=exchange, group=dist.group.WORLD)
        outs.append((rows, {f: getattr(o, f) for f in FIELDS}))
    x, gamma, w, sp = tail_problem(8, 0, 512)  # the ranks disagree on one row's processing
    proc = [None] * 7 + [LogitProcessing(logit_bias=((5, 1.0 + rank),))]
    try:
        decode_tail(x, gamma, head_shard(w, rank, 2), k=K, processing=proc, group=dist.group.WORLD)
        outs.append("no error")
    except ValueError as e:
        outs.append(str(e))
    return outs


def test_two_ranks_equal_one_rank():
    """decode_tail(processing=...) vocab-parallel over 2 gloo ranks (both exchanges, ids
    at the shard edges, masks): every owned row's outputs == the single-rank call's, and
    each rank's logits are its shard of the single-rank processed logits. Ranks given
    different processing raise a ValueError naming it on every rank."""
    cases = [(0, "candidates"), (1, "mirror"), (2, "candidates")]
    res = launch(_ranks_job, 2, args=(cases,), timeout_s=240, threads=1)
    for c, (seed, exchange) in enumerate(cases):
        x, gamma, w, sp = tail_problem(8, seed, 512)
        proc = rand_processing(8, 512, seed, edges=(0, 255, 256, 511))
        one = decode_tail(x, gamma, w, k=K, sampling_params=sp, processing=proc, exchange=exchange)
        for rank in range(2):
            assert "processing checksum" in res[rank][-1], res[rank][-1]  # refused on every rank
            rows, o = res[rank][c]
            assert same_bits(o["logits"], one.logits[:, rank * 256:(rank + 1) * 256]), (seed, rank)
            for f in FIELDS[1:]:
                assert same_bits(o[f], getattr(one, f)[rows]), (seed, exchange, rank, f)


# ---------------------------------------------------------------------------------------
# Processors (a request's static fields) and the reference's independence
# ---------------------------------------------------------------------------------------
def test_processors_expand_per_step():
    q = Processors(logit_bias=((3, 2.0),), frequency_penalty=0.5, repetition_penalty=1.2)
    p = q.at([5, 6, 5], {9: 2, 3: 1})
    assert p.output_counts == ((3, 1), (9, 2)) and p.prompt_ids == (5, 6, 5) and p.logit_bias == ((3, 2.0),)
    assert Processors(logit_bias=((3, 2.0),)).at([5], {9: 1}).output_counts == ()  # no penalty: no counts
    assert Processors().at([1], {}) is None and Processors().neutral
    mask = torch.ones(100, dtype=torch.bool)
    assert Processors().at([1], {}, mask).allowed is mask and q.at([1], {}, mask).allowed is mask
    with pytest.raises(ValueError, match=r"processors\[2\].presence_penalty must be a number in \[-2, 2\]"):
        Processors(presence_penalty=3).check(100, "processors[2]")


def test_reference_does_not_import_the_op():
    tree = ast.parse((ROOT / "src/lmtail/reference/processors.py").read_text())
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not any("processors" in m or m.startswith(("..", "lmtail")) for m in mods), mods


def test_declaration_lists_one_fp32_point_per_step():
    d = P.processors_decl()
    assert d.sums == () and sum(":fp32" in p for p in d.rounding_points) == 5
    assert not math.isnan(P._f32(1e39)) and P._f32(1e39) == math.inf


@pytest.mark.parametrize("exchange", ["candidates", "mirror"])
def test_a_mask_narrower_than_k_samples_only_allowed_ids(exchange):
    """allowed holds 3 ids (< k = 16): sampled rows (top_k off, top_p 1) draw among them
    with finite logprobs; -inf fills the rest of the candidates; the emitted logits are the
    plain ones on the 3 lanes (bit for bit) and -inf elsewhere."""
    x, gamma, w, _ = tail_problem(6, 5)
    ok = torch.zeros(V, dtype=torch.bool)
    ok[[3, 250, V - 1]] = True
    sp = torch.tensor([[0.0, 1.0, 1.0, u, 0.0] for u in (0.01, 0.2, 0.4, 0.6, 0.8, 0.99)])
    out = decode_tail(x, gamma, w, k=K, sampling_params=sp, processing=[LogitProcessing(allowed=ok)] * 6,
                      exchange=exchange)
    assert set(out.tokens.tolist()) <= {3, 250, V - 1} and torch.isfinite(out.logprobs).all()
    assert torch.isinf(out.topk_values[:, 3:].float()).all()
    assert set(out.topk_indices[0, :3].tolist()) == {3, 250, V - 1}
    plain = decode_tail(x, gamma, w, k=K, exchange=exchange).logits
    assert same_bits(out.logits[:, ok], plain[:, ok]) and bool((out.logits[:, ~ok] == -math.inf).all())


def test_contract_variant_without_defect_is_the_real_op():
    """The contract's planted controls are the dense variant with one defect: without a
    defect it gives the op's bytes (so each control is red for its defect alone)."""
    from lmtail.contract import processor_kinds as pk

    for d in pk._data(2) + pk._specials() + [pk._adversarial()]:
        assert same_bits(pk._variant(d)["logits"], pk._run(d)["logits"]), d["label"]
