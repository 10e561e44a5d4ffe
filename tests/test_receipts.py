"""Receipts: the stats against known cases (each with a planted wrong variant that the same
assertion rejects), the arms against decode_tail, and a tiny end-to-end receipt whose
report numbers are recomputed here independently."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import bits
from scipy import stats as sp
from scipy.special import log_softmax

from lmtail.reference.tail import logits_ref
from lmtail.receipts import stats
from lmtail.receipts.arms import TailInputs, default_arms
from lmtail.receipts.engine import Comparison, ReceiptSpec
from lmtail.receipts.receipt import make_receipt, parse_comparison, select_arms
from lmtail.receipts.texts import CANDIDATES, Passage, find_texts, read_text




# ---------------------------------------------------------------------------------------
# stats, known cases
# ---------------------------------------------------------------------------------------
def hits_with(a_only_miss: int, b_only_miss: int, both_miss: int, both_hit: int):
    a = [False] * a_only_miss + [True] * b_only_miss + [False] * both_miss + [True] * both_hit
    b = [True] * a_only_miss + [False] * b_only_miss + [False] * both_miss + [True] * both_hit
    return np.array(a), np.array(b)


def mcnemar_counting_concordant(hit_a, hit_b):  # planted: counts rows both arms miss as discordant
    a_miss, b_miss = int((~hit_a).sum()), int((~hit_b).sum())
    return sp.binomtest(a_miss, a_miss + b_miss, 0.5).pvalue


def test_mcnemar_by_hand():
    a, b = hits_with(1, 9, 5, 85)
    m = stats.mcnemar_exact(a, b)
    by_hand = 2 * (math.comb(10, 0) + math.comb(10, 1)) / 2**10  # 22/1024: 1 of 10 discordant
    assert (m.a_only_miss, m.b_only_miss) == (1, 9)
    assert m.p == pytest.approx(by_hand, rel=1e-12)
    assert mcnemar_counting_concordant(a, b) != pytest.approx(by_hand, rel=1e-3)  # the test can go red
    assert stats.mcnemar_exact(*hits_with(0, 0, 3, 7)).p == 1.0  # no discordant pair
    assert stats.mcnemar_exact(*hits_with(4, 4, 0, 0)).p == pytest.approx(1.0)


def test_paired_se_known():
    # one row per cluster: the textbook paired se s / sqrt(n)
    d = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    p = stats.paired_mean_se(d, np.arange(5))
    assert (p.mean, p.n, p.clusters) == (3.0, 5, 5)
    assert p.se == pytest.approx(math.sqrt(0.5), rel=1e-12)
    assert p.p == pytest.approx(2 * sp.t.sf(3.0 / math.sqrt(0.5), 4), rel=1e-12)
    # two clusters of two: se^2 = 2/1 * ((-2)^2 + 2^2) / 4^2 = 1, wider than the naive sqrt(1/3)
    d2, c2 = np.array([1.0, 1.0, 3.0, 3.0]), np.array([0, 0, 1, 1])
    assert stats.paired_mean_se(d2, c2).se == pytest.approx(1.0, rel=1e-12)
    naive = np.std(d2, ddof=1) / math.sqrt(4)  # planted: ignores the clusters
    assert naive != pytest.approx(1.0, rel=1e-3)
    z = stats.paired_mean_se(np.zeros(6), np.arange(6) // 2)
    assert (z.mean, z.se, z.p) == (0.0, 0.0, 1.0)
    assert math.isnan(stats.paired_mean_se(d, np.zeros(5)).se)  # one cluster: no se


def test_cluster_ids_blocks_never_span_groups():
    assert stats.cluster_ids([0, 0, 0, 1, 1, 1, 1], 2).tolist() == [0, 0, 1, 2, 2, 3, 3]
    assert stats.cluster_ids(["a", "a", "b"], 8).tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="block must be >= 1; got 0"):
        stats.cluster_ids([0], 0)


def bonferroni(p):  # planted: no step-down
    return np.minimum(1.0, np.asarray(p) * len(p))


def test_holm_known_set():
    p = [0.01, 0.04, 0.03, 0.005]
    want = [0.03, 0.06, 0.06, 0.02]  # sorted .005*4, .01*3, .03*2, max(.04*1, .06)
    assert np.allclose(stats.holm(p), want, rtol=0, atol=1e-15)
    assert not np.allclose(bonferroni(p), want, rtol=0, atol=1e-3)
    got = stats.holm([0.2, float("nan"), 0.01])  # nan is not a test: m = 2
    assert math.isnan(got[1]) and np.allclose(got[[0, 2]], [0.2, 0.02])


def test_sign_test_known():
    assert stats.sign_test(0, 12) == pytest.approx(2 / 2**12, rel=1e-12)
    assert stats.sign_test(2, 10) == pytest.approx(2 * sum(math.comb(12, k) for k in range(3)) / 2**12)
    assert stats.sign_test(0, 0) == 1.0


def synthetic(seed: int, n_pass: int = 6, rows: int = 48):
    """Per-row rel-L2 of a base arm with a strong per-passage effect and a smooth drift
    within the passage (correlated rows), a placebo (base + symmetric noise) and a worse arm."""
    g = np.random.default_rng(seed)
    pas = np.repeat(np.arange(n_pass), rows)
    level = 1 + 0.3 * g.standard_normal(n_pass)
    drift = np.concatenate([np.cumsum(g.standard_normal(rows)) * 0.02 for _ in range(n_pass)])
    base = 1e-3 * (level[pas] + drift)
    noise = 1e-6 * g.standard_normal(pas.shape[0])
    placebo = base + noise
    worse = base + np.abs(1e-6 * g.standard_normal(pas.shape[0])) + 3e-6
    return pas, base, placebo, worse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_placebo_verdicts(seed):
    pas, base, placebo, worse = synthetic(seed)
    cl = stats.cluster_ids(pas, 8)
    hit = np.ones(pas.shape[0], dtype=bool)
    mc = stats.mcnemar_exact(hit, hit)
    plac = {"rel_l2": stats.paired_mean_se(placebo - base, cl)}
    v_p, _ = stats.judge({"rel_l2": stats.paired_mean_se(placebo - base, cl)}, None, mc, [])
    v_w, why = stats.judge({"rel_l2": stats.paired_mean_se(worse - base, cl)}, plac, mc, [])
    v_b, _ = stats.judge({"rel_l2": stats.paired_mean_se(base - worse, cl)}, plac, mc, [])
    assert v_p == "within noise"
    assert v_w == "worse beyond noise" and why and why[0].startswith("rel_l2")
    assert v_b == "better beyond noise"
    # a shift smaller than the placebo's movement is within noise even when past 2 se
    big_placebo = {"rel_l2": stats.Paired(mean=5e-6, se=1e-6, n=1, clusters=9, p=0.0)}
    assert stats.judge({"rel_l2": stats.paired_mean_se(worse - base, cl)}, big_placebo, mc, [])[0] == "within noise"


def test_verdict_mcnemar_and_holm_classes():
    null = {"rel_l2": stats.Paired(0.0, 1.0, 10, 10, 1.0)}
    worse_mc = stats.mcnemar_exact(*hits_with(0, 12, 0, 100))  # the arm (b) misses 12 rows alone
    assert stats.judge(null, None, worse_mc, [])[0] == "worse beyond noise"
    better_mc = stats.mcnemar_exact(*hits_with(12, 0, 0, 100))
    assert stats.judge(null, None, better_mc, [])[0] == "better beyond noise"
    even = stats.mcnemar_exact(*hits_with(3, 3, 0, 100))
    cls = [("decode", "kl", stats.Paired(1e-3, 1e-4, 20, 5, 1e-4), 4e-4)]
    assert stats.judge(null, None, even, cls)[0] == "worse beyond noise"
    assert stats.judge(null, None, even, [(c, m, p, 0.2) for c, m, p, _ in cls])[0] == "within noise"


# ---------------------------------------------------------------------------------------
# arms
# ---------------------------------------------------------------------------------------
def tiny_inputs(seed: int, n: int = 5, h: int = 96, v: int = 200):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * 3
    x[0, :7] = 0.0
    gamma = (torch.rand(h, generator=g) + 0.5).bfloat16().float()
    w = (torch.randn(h, v, generator=g) * 0.05).bfloat16().contiguous()
    return TailInputs(x, gamma, w, 1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_arm_is_decode_tail_bytes(seed):
    from lmtail.tail.compose import decode_tail

    inp = tiny_inputs(seed)
    reg = default_arms()
    want = decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1,
                       gemm_order="chain").logits
    assert torch.equal(bits(reg.get("chain").fn(inp)), bits(want))
    default = decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1).logits
    assert torch.equal(bits(reg.get("amx32").fn(inp)), bits(default))  # the tail's default order
    legacy = decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1,
                         deferred_rms=False, gemm_order="chain").logits
    assert torch.equal(bits(reg.get("legacy").fn(inp)), bits(legacy))
    assert not torch.equal(bits(reg.get("legacy").fn(inp)), bits(want))  # the two forms do differ


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16x2_arm_is_decode_tail_bf16x2_bytes(seed):
    from lmtail.tail.compose import decode_tail

    inp = tiny_inputs(seed)
    reg = default_arms()
    want = decode_tail(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, zero_interleaved_pad=False, k=1,
                       head_input="bf16x2").logits
    got = reg.get("bf16x2").fn(inp)
    assert torch.equal(bits(got), bits(want))
    assert not torch.equal(bits(got), bits(reg.get("amx32").fn(inp)))  # planted: the one-row activation differs


def test_placebo_is_a_reorder_not_a_change():
    inp = tiny_inputs(3, n=8, h=576, v=300)
    reg = default_arms()
    chain, plac = reg.get("chain").fn(inp), reg.get("placebo").fn(inp)
    assert not torch.equal(bits(chain), bits(plac))  # another order rounds differently ...
    ref = torch.from_numpy(logits_ref(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, interleaved=False))
    for got in (chain, plac):  # ... but both sit at the same fp32-chain distance from float64
        rel = ((got.double() - ref).norm(dim=1) / ref.norm(dim=1)).max().item()
        assert rel < 0.02
    assert (plac.double() - chain.double()).abs().max().item() < 1e-4 * ref.abs().max().item()


def test_registry_and_availability():
    reg = default_arms()
    assert {"chain", "amx32", "legacy", "contiguous", "placebo", "placebo_norm", "torch"} <= set(reg.names())
    why = reg.get("amx32").available()
    assert why is None or isinstance(why, str) and why
    with pytest.raises(ValueError, match="arm 'chain' is already registered"):
        reg.register(reg.get("chain"))
    with pytest.raises(ValueError, match="unknown arm 'nope'"):
        reg.get("nope")
    with pytest.raises(TypeError, match="register takes an Arm"):
        reg.register("chain")
    with pytest.raises(ValueError, match="--compare must be ARM:BASE"):
        parse_comparison("chain")
    with pytest.raises(ValueError, match="names arm 'x'"):
        ReceiptSpec(arms=("chain",), comparisons=(Comparison("x", "chain"),))


def test_texts_present_with_sha256():
    found = find_texts(6)
    if len(found) < 6:
        pytest.skip(f"this machine has {len(found)} of the public texts a receipt reads (Debian's files)")
    assert len(found) == 6
    text, digest = read_text(found[0][1])
    assert len(digest) == 64 and len(text) > 1000
    gz = [p for _, p in find_texts(len([c for c in CANDIDATES if c.resolve().is_file()])) if p.suffix == ".gz"]
    if gz:  # man pages / changelogs come back decompressed
        assert not read_text(gz[0])[0].startswith("\x1f\x8b")
    with pytest.raises(ValueError, match="need 99 public texts"):
        find_texts(99)
    with pytest.raises(ValueError, match="count must be >= 1; got 0"):
        find_texts(0)


# ---------------------------------------------------------------------------------------
# a tiny end-to-end receipt (synthetic hidden states, no model load)
# ---------------------------------------------------------------------------------------
H, V = 64, 384


def fake_hidden(bundle, ids, spec):
    """Deterministic hidden states from the ids (a stand-in for the model forward)."""
    g = torch.Generator().manual_seed(int(sum(ids[:8])))
    n = spec.rows
    h = torch.randn(n, H, generator=g) * (1 + torch.arange(n)[:, None] % 3)
    kinds = ["prompt"] * (n - spec.decode_rows) + ["decode"] * spec.decode_rows
    targets = np.asarray(ids[spec.prefix + 1: spec.prefix + n + 1])
    return h, h, targets, kinds


@pytest.fixture(scope="module")
def tiny_receipt(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    embed = torch.randn(V, H, generator=g) * 0.3
    bundle = SimpleNamespace(final_norm=(torch.rand(H, generator=g) + 0.5), embed=embed,
                             lm_head_weight_t=embed.bfloat16().t().contiguous(), config=SimpleNamespace(eps=1e-5))
    rng = np.random.default_rng(3)
    passages = [Passage(f"p{i}", f"/synthetic/{i}", "0" * 64, tuple(int(t) for t in rng.integers(0, V, 40)))
                for i in range(3)]
    reg = default_arms()
    comps = [Comparison("legacy", "chain", "placebo"), Comparison("torch", "chain", "placebo"),
             Comparison("contiguous", "chain", "placebo_norm")]
    arms, comps, status = select_arms(reg, ("chain", "legacy", "contiguous", "placebo", "placebo_norm", "torch"),
                                      comps)
    spec = ReceiptSpec(arms=arms, comparisons=comps, prefix=4, rows=24, decode_rows=8, block=4)
    out = tmp_path_factory.mktemp("receipt")
    an = make_receipt(bundle, passages, spec, reg, out, {"command": "test"}, arm_status=status, hidden=fake_hidden)
    return SimpleNamespace(bundle=bundle, passages=passages, spec=spec, out=out, an=an, reg=reg)


def recompute(t, arm: str, passage: int):
    """Independent per-row numbers for one passage: (rel_l2, hit, kl, nll) from scratch."""
    h, _, targets, _ = fake_hidden(t.bundle, t.passages[passage].ids, t.spec)
    ref = logits_ref(h, t.bundle.final_norm, t.bundle.lm_head_weight_t, eps=1e-5, interleaved=False)
    z = t.reg.get(arm).fn(TailInputs(h, t.bundle.final_norm, t.bundle.lm_head_weight_t, 1e-5)).double().numpy()
    rel = np.sqrt(((z - ref) ** 2).sum(1)) / np.sqrt((ref ** 2).sum(1))
    lr, lz = log_softmax(ref, axis=1), log_softmax(z, axis=1)
    kl = (np.exp(lr) * (lr - lz)).sum(1)
    nll = -lz[np.arange(len(targets)), targets]
    return rel, z.argmax(1) == ref.argmax(1), kl, nll


def test_receipt_numbers_recomputed(tiny_receipt):
    t = tiny_receipt
    rec = json.loads((t.out / "receipt.json").read_text())
    rows = {a: [recompute(t, a, i) for i in range(3)] for a in ("chain", "legacy")}
    for a in ("chain", "legacy"):
        for i, p in enumerate(t.passages):
            s = rec["analysis"]["summary"][a][p.name]
            rel, hit, kl, nll = rows[a][i]
            assert s["rel_l2"] == pytest.approx(rel.mean(), rel=1e-9)
            assert s["argmax_agree"] == pytest.approx(hit.mean(), abs=1e-12)
            assert s["kl"] == pytest.approx(kl.mean(), rel=1e-6)
            assert s["nll"] == pytest.approx(nll.mean(), rel=1e-9)
        allrel = np.concatenate([r[0] for r in rows[a]])
        assert rec["analysis"]["summary"][a]["all"]["rel_l2"] == pytest.approx(allrel.mean(), rel=1e-9)
    comp = rec["analysis"]["comparisons"][0]
    assert (comp["arm"], comp["base"], comp["placebo"]) == ("legacy", "chain", "placebo")
    d = np.concatenate([rows["legacy"][i][0] - rows["chain"][i][0] for i in range(3)])
    cl = stats.cluster_ids(np.repeat(np.arange(3), 24), 4)
    want = stats.paired_mean_se(d, cl)
    assert comp["overall"]["rel_l2"]["mean"] == pytest.approx(want.mean, rel=1e-9)
    assert comp["overall"]["rel_l2"]["se"] == pytest.approx(want.se, rel=1e-9)
    hb = np.concatenate([rows["chain"][i][1] for i in range(3)])
    ha = np.concatenate([rows["legacy"][i][1] for i in range(3)])
    assert comp["mcnemar"]["b_only_miss"] == int((hb & ~ha).sum())
    assert comp["mcnemar"]["a_only_miss"] == int((~hb & ha).sum())
    classes = {c[0] for c in comp["classes"]}
    assert classes == {"p0", "p1", "p2", "prompt", "decode"}
    assert comp["verdict"] in ("within noise", "worse beyond noise", "better beyond noise")


def test_receipt_report_and_plots(tiny_receipt):
    t = tiny_receipt
    md = (t.out / "receipt.md").read_text()
    for needle in ("## What ran", "mean rel-L2 of the logits", "argmax agreement", "KL(ref ‖ arm)",
                   "worst column", "Paired comparisons, placebo beside each", "McNemar", "Holm",
                   "Teacher-forced NLL", "legacy vs chain", "paired_rel_l2.png", "nll.png",
                   "within a passage"):
        assert needle in md, needle
    for png in ("paired_rel_l2.png", "nll.png"):
        assert (t.out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rec1 = (t.out / "receipt.json").read_bytes()
    an2 = make_receipt(t.bundle, t.passages, t.spec, t.reg, t.out / "again", {"command": "test"},
                       arm_status={}, hidden=fake_hidden)
    assert an2["rows"] == 72
    again = json.loads((t.out / "again" / "receipt.json").read_text())
    assert again["analysis"] == json.loads(rec1)["analysis"]  # deterministic given its arguments


CERT_KEYS = {"certified", "matched", "mismatched", "near_ties", "worst_margin"}


def test_certification_section(tiny_receipt):
    from lmtail.receipts.engine import CERT_DECLS

    t = tiny_receipt
    md = (t.out / "receipt.md").read_text()
    for needle in ("## Certified decisions vs float64", "argmax certified", "top-256 set certified", "near-ties",
                   "worst margin"):
        assert needle in md, needle
    assert "MISMATCH" not in md and "CONTRACT FAILURE" not in md
    cert = json.loads((t.out / "receipt.json").read_text())["analysis"]["certification"]
    assert set(cert) == {"k", "rows", "declarations"} and cert["k"] == 256 and cert["rows"] == 72
    assert [(d["exchange"], d["head_input"]) for d in cert["declarations"]] == list(CERT_DECLS)
    for d in cert["declarations"]:
        assert set(d) == {"exchange", "head_input", "decl", "argmax", "topk", "near_tie_rows", "mismatches", "ok"}
        for dec in ("argmax", "topk"):
            s = d[dec]
            assert set(s) == CERT_KEYS
            assert s["certified"] + s["near_ties"] == 72
            assert s["matched"] == s["certified"] and s["mismatched"] == 0
        assert d["ok"] and d["mismatches"] == []
        assert len(d["near_tie_rows"]) == min(20, d["argmax"]["near_ties"])
        assert all(set(r) == {"passage", "position", "kind"} for r in d["near_tie_rows"])
    assert cert["declarations"][0]["argmax"]["certified"] > 0  # the section certifies something


def test_ideal_bounds_is_ideal_bound_per_declaration():
    """ref once and one logits_range per mirror-free declaration give ideal_bound's bytes."""
    from lmtail.receipts.engine import CERT_DECLS, ideal_bounds
    from lmtail.reference.contract import ideal_bound
    from lmtail.tail.compose import tail_decl

    inp = tiny_inputs(4, n=6, h=64, v=300)
    decls = [tail_decl(64, True, exchange=ex, head_input=hi) for ex, hi in CERT_DECLS]
    ref, deltas = ideal_bounds(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, decls=decls, col_chunk=128)
    for d, delta in zip(decls, deltas):
        r1, d1 = ideal_bound(inp.hidden, inp.gamma, inp.weight, eps=inp.eps, decl=d, interleaved=False)
        assert np.array_equal(r1.view(np.int64), ref.view(np.int64))
        assert np.array_equal(d1.view(np.int64), delta.view(np.int64))
    # planted: the three declarations' bounds do differ (sharing one delta would be wrong)
    assert not np.array_equal(deltas[0], deltas[1]) and not np.array_equal(deltas[1], deltas[2])


def test_planted_wrong_op_is_a_certification_mismatch(tiny_receipt, tmp_path):
    """An op whose argmax is shifted by one column: every certified argmax mismatches."""
    from lmtail.receipts.engine import tail_topk

    t = tiny_receipt

    def shifted(h, gamma, w, eps, **kw):
        ids = tail_topk(h, gamma, w, eps, **kw).clone()
        ids[:, 0] = (ids[:, 0] + 1) % w.shape[1]
        return ids

    an = make_receipt(t.bundle, t.passages, t.spec, t.reg, tmp_path, {"command": "test"}, arm_status={},
                      hidden=fake_hidden, cert_op=shifted)
    for d in an["certification"]["declarations"]:
        a = d["argmax"]
        assert a["certified"] > 0 and a["matched"] == 0 and a["mismatched"] == a["certified"]
        assert not d["ok"]
        m = d["mismatches"][0]
        assert m["decision"] == "argmax" and m["passage"] in {p.name for p in t.passages}
    md = (tmp_path / "receipt.md").read_text()
    assert "CONTRACT FAILURE" in md and "**MISMATCH**" in md


@pytest.mark.slow
def test_quick_receipt_on_smollm2(tmp_path):
    from lmtail.cli import main

    assert main(["receipt", "--quick", "--out", str(tmp_path), "--hf", "off", "--no-progress"]) == 0
    rec = json.loads((tmp_path / "receipt.json").read_text())
    assert len(rec["texts"]) >= 6 and all(len(x["sha256"]) == 64 for x in rec["texts"])
    s = rec["analysis"]["summary"]["chain"]["all"]
    assert 0 < s["rel_l2"] < 0.05 and s["argmax_agree"] > 0.9


def test_spec_errors_name_the_argument():
    arms = ("chain",)
    with pytest.raises(ValueError, match="prefix must be >= 1; got 0"):
        ReceiptSpec(arms=arms, comparisons=(), prefix=0)
    with pytest.raises(ValueError, match=r"decode_rows must be in \[0, rows=8\]; got 9"):
        ReceiptSpec(arms=arms, comparisons=(), rows=8, decode_rows=9)
    with pytest.raises(ValueError, match="block must be >= 1; got 0"):
        ReceiptSpec(arms=arms, comparisons=(), block=0)
    with pytest.raises(ValueError, match="base must be one of the arms"):
        ReceiptSpec(arms=arms, comparisons=(), base="legacy")


def test_unavailable_arm_is_listed_and_its_comparisons_dropped(tmp_path):
    from lmtail.receipts import hf
    from lmtail.receipts.arms import Arm

    reg = default_arms()
    reg.register(Arm("future", reg.get("chain").fn, "an order not built yet", lambda: "not built here"))
    arms, comps, status = select_arms(reg, ("chain", "future", "placebo"),
                                      [Comparison("future", "chain", "placebo"), Comparison("placebo", "chain")])
    assert arms == ("chain", "placebo")
    assert comps == (Comparison("placebo", "chain"),)
    assert status["future"][1] == "not available: not built here"
    assert status["future vs chain"][1].startswith("skipped")
    assert hf.status(tmp_path / "no-python").startswith("no interpreter at")  # the HF arm skips cleanly


def test_builtin_arm_names_match_the_registry():
    """`lmtail receipt` checks arm names without importing torch, against BUILTIN_ARMS: the
    names default_arms() registers, in order."""
    from lmtail.receipts.receipt import BUILTIN_ARMS, DEFAULT_ARMS

    assert default_arms().names() == BUILTIN_ARMS and set(DEFAULT_ARMS) <= set(BUILTIN_ARMS)
