"""The numerics contract harness: every kind passes its gates, every planted control is red
where planted, a harness with its check (or its byte comparison) disabled lets a control
through, the controls are the real ops plus one defect, and certification both certifies
and catches. Runs the --fast subset (docs/contract.md)."""
import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from lmtail.contract import certify_tail, registry
from lmtail.contract import cli as contract_cli
from lmtail.contract import harness
from lmtail.contract import logits_kinds as lk
from lmtail.contract import sampler_kinds as sk
from lmtail.contract import tail_kinds as tk
from lmtail.contract.harness import Case, Config, Control, Verdict, run_control, run_gates, run_kind
from lmtail.kernels.gemm.bf16 import gemm_bf16
from lmtail.reference.contract import range_margin, sample_decision
from lmtail.reference.tail import sampler_ref
from lmtail.tail.compose import decode_tail

FAST = Config(fast=True)
KINDS, CONTROLS = registry()  # one registry: the ranks gate and its control share one launch


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", list(KINDS))
def test_kind_passes_every_gate(name):
    res = run_kind(KINDS[name], FAST)
    bad = {g: r.detail for g, r in res.gates.items() if r.ok is False}
    assert not bad, f"{name}: {bad}"
    assert {"shapes", "random", "threads", "repeat"} <= set(res.gates)


@pytest.mark.parametrize("ctl", CONTROLS, ids=[c.name for c in CONTROLS])
def test_control_is_red_where_planted(ctl):
    res = run_control(ctl, KINDS, FAST)
    assert res.red_as_planted, f"{ctl.name} passed gate {ctl.planted}: {res.gates}"


def test_every_body_kind_has_a_control():
    body = [n for n in KINDS if n.startswith("body.")]
    assert len(body) >= 8
    for name in body:
        assert any(c.kind == name for c in CONTROLS), name
    assert {"emulate", "adversarial", "random"} <= {c.planted for c in CONTROLS if c.name.startswith("body.")}


def test_every_tail_kind_has_a_control_and_there_are_enough():
    tail_ctl = [c for c in CONTROLS if c.name.startswith("tail.")]
    assert len(tail_ctl) >= 8
    planted = {c.planted for c in tail_ctl}
    assert {"shapes", "random", "special", "adversarial", "batch", "threads", "repeat", "ranks"} <= planted
    for name in KINDS:
        if name.startswith("tail.") and not name.startswith("tail.logits.deferred.bf16"):
            assert any(c.kind == name for c in CONTROLS), name


# ---------------------------------------------------------------------------------------
# the harness can fail: disable its check or its byte comparison and a control gets through
# ---------------------------------------------------------------------------------------
def _blind(kind):
    """The same kind with every float64 check and case expectation replaced by 'ok'."""
    ok = lambda data, out, run, decl: Verdict(True, None, "check disabled")  # noqa: E731
    strip = lambda gen: lambda fast: [replace(c, expect=None) for c in gen(fast)]  # noqa: E731
    return replace(kind, check=ok, gens={g: strip(f) for g, f in kind.gens.items()})


@pytest.mark.parametrize("ctl_name", ["tail.mean_over_H", "tail.ties_higher_id", "tail.topp_drops_crossing",
                                      "tail.decl_half_depth", "tail.chain.decl_half_depth", "tail.dp32.decl_half_depth",
                                      "gemm.amx32.chain_range",
                                      "gemm.amx32.decl_half_depth", "glue.moe_keep_f32", "glue.router_no_guard",
                                      "body.attend.decl_half_depth", "body.rope.theta_fp32", "body.apply_rope.halves"])
def test_disabled_check_lets_the_control_pass(ctl_name):
    ctl = next(c for c in CONTROLS if c.name == ctl_name)
    kinds = dict(KINDS, **{ctl.kind: _blind(KINDS[ctl.kind])})
    assert not run_control(ctl, kinds, FAST).red_as_planted
    assert run_control(ctl, KINDS, FAST).red_as_planted


def test_disabled_byte_comparison_lets_row_mixing_pass(monkeypatch):
    ctl = next(c for c in CONTROLS if c.name == "tail.row_mixing")
    assert run_control(ctl, KINDS, FAST).red_as_planted
    monkeypatch.setattr(harness, "same_bytes", lambda a, b: True)
    monkeypatch.setattr(harness, "_bits_eq", lambda a, b: torch.ones(a.shape, dtype=torch.bool))
    assert not run_control(ctl, KINDS, FAST).red_as_planted


def test_a_passing_control_makes_the_cli_exit_nonzero(monkeypatch, tmp_path, capsys):
    """A 'control' that is the real op passes every gate: the harness must call it out."""
    import lmtail.contract as contract

    kind = KINDS["tail.topk.exact"]
    fake = Control("fake.real_op", kind.name, "random", "the real op posing as a control", kind.run)
    monkeypatch.setattr(contract, "registry", lambda kinds=None: ({kind.name: kind}, [fake]))
    path = tmp_path / "c.json"
    assert contract_cli.main(["--fast", "--json", str(path)]) == 1
    assert "PASSED (harness broken)" in capsys.readouterr().out
    rep = json.loads(path.read_text())
    assert rep["controls"][0]["red_as_planted"] is False and rep["kinds"][0]["ok"] is True


def test_cli_green_run_and_unknown_pattern(tmp_path, capsys):
    path = tmp_path / "c.json"
    assert contract_cli.main(["--fast", "--kinds", "tail.topk.exact", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "RED as planted" in out and "tail.ties_higher_id" in out
    rep = json.loads(path.read_text())
    assert [k["kind"] for k in rep["kinds"]] == ["tail.topk.exact"]
    assert all(c["red_as_planted"] for c in rep["controls"]) and len(rep["controls"]) == 2
    assert contract_cli.main(["--fast", "--kinds", "no.such.kind"]) == 2


# ---------------------------------------------------------------------------------------
# controls are the real ops plus exactly one defect
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,deferred", [(torch.float32, True), (torch.float32, False), (torch.float16, True),
                                            (torch.bfloat16, True)])
def test_logits_variant_without_defect_is_the_real_op(dtype, deferred):
    for case in lk.tail_shapes(True, dtype=dtype, deferred=deferred)[:5]:
        d = case.data
        assert harness.same_bytes(lk.logits_variant(d)["logits"], lk.run_logits(d)["logits"]), case.label
    d = lk.tail_random(True, dtype=dtype, deferred=deferred)[0].data
    assert harness.same_bytes(lk.emulate_logits(d)["logits"], lk.run_logits(d)["logits"])


@pytest.mark.parametrize("deferred", [True, False])
def test_dp32_logits_variant_and_emulation_are_the_real_op(deferred):
    """In gemm_order="dp32" the control body with no defect and the emulate gate's emulation
    (reference.gemm.gemm_dp32_emulation) give decode_tail's bytes; planted: the amx32 GEMM
    (the dp32 controls' defect) does not."""
    for case in tk.in_order(lk.tail_random, "dp32")(True)[:2]:
        d = dict(case.data, deferred=deferred)
        real = lk.run_logits(d)["logits"]
        assert harness.same_bytes(lk.logits_variant(d)["logits"], real), case.label
        assert harness.same_bytes(lk.emulate_logits(d)["logits"], real), case.label
        assert not harness.same_bytes(lk.logits_variant(d, defect="amx32_order")["logits"], real), case.label


def test_other_variants_without_defect_are_the_real_ops():
    d = sk.sampler_random(True)[0].data
    assert not harness.diff_outputs(sk.sampler_variant(d), sk.run_sampler(d))
    d = sk.topk_random(True)[0].data
    assert not harness.diff_outputs(sk.topk_variant(d), sk.run_topk(d))
    d = lk.tail_random(True, k=64, v=4096)[0].data
    assert not harness.diff_outputs(lk.mirror_variant(d), lk.run_mirror(d))


def test_body_variants_without_defect_are_the_real_ops():
    """The body controls restate the op: with no defect they give its bytes (so a red body
    control is its one defect)."""
    from lmtail.contract import body_kinds as bk

    for name, variant in (("body.exp32", bk.exp32_variant), ("body.silu_mul", bk.silu_variant),
                          ("body.rope_table", bk.rope_variant), ("body.apply_rope", bk.apply_rope_variant),
                          ("body.attend", bk.attend_variant), ("body.add_rms_rows32", bk.add_rms32_variant)):
        kind = KINDS[name]
        for case in kind.gens["shapes"](True)[:3] + kind.gens["random"](True)[:1]:
            d = harness.diff_outputs(variant(case.data), kind.run(case.data), nan_equal=True)
            assert not d, (name, case.label, d)


def test_body_kinds_take_their_ranges_from_the_declarations():
    """Single-sourced: the sampler's declaration is rows_tail_decl, row_mass's sum is its
    "S (full row)", the rope kinds use rope_decl, attention's depths follow the keys, the fp32
    norm's sum of squares is the bf16 norm's (add_rms_decl's)."""
    from lmtail.kernels.tail.rows_tail import rows_tail_decl
    from lmtail.model import body
    from lmtail.glue.norms import add_rms_decl
    from lmtail.orders import strided

    d = KINDS["tail.sampler"].gens["random"](True)[0].data
    assert KINDS["tail.sampler"].decl(d) == rows_tail_decl(d["rows"].shape[1], d["k"])
    m = KINDS["tail.row_mass"].gens["random"](True)[0].data
    assert KINDS["tail.row_mass"].decl(m).sums == (rows_tail_decl(m["row"].shape[1], 1).sum("S (full row)"),)
    for name in ("body.rope_table", "body.apply_rope", "body.rope_qkv"):
        assert KINDS[name].decl(KINDS[name].gens["random"](True)[0].data) == body.rope_decl()
    d = KINDS["body.add_rms_rows32"].gens["shapes"](True)[1].data  # 9x33, lanes 32
    assert KINDS["body.add_rms_rows32"].decl(d).sums == add_rms_decl(33, order=strided(32)).sums
    adv = KINDS["body.attend"].gens["adversarial"](True)[0].data
    assert KINDS["body.attend"].decl(adv).sum("den").depth == 200


def test_fused_mass_matches_row_mass_through_the_logprob():
    """The fused kernel's float64 S1 and lse1 never leave it, but on readout rows (S1 - 1 <
    2^-28, vmax = 1) the greedy token's logprob is -(lse1 - 1) exactly: it must equal the
    value from rowmass.row_mass's S (the same declared sum64), and a 128-lane sum (planted)
    gives other bytes on most rows."""
    from lmtail.kernels.tail.rowmass import row_mass
    from lmtail.numerics import log64
    from lmtail.reference.tail import logprob_emulation
    from lmtail.tail.compose import rows_tail

    rows = sk.readout_rows()
    sp = torch.tensor([[0, 1, 0, 0.5, 0]] * rows.shape[0], dtype=torch.float32)
    out = rows_tail(rows, k=4, sampling_params=sp)
    m, s, _ = row_mass(rows.double(), torch.ones(rows.shape[0], dtype=torch.float64))
    want = (rows.double()[torch.arange(rows.shape[0]), out.tokens] - (m + log64(s))).float()
    assert torch.equal(out.logprobs.view(torch.int32), want.view(torch.int32))
    assert ((s - 1) < 2.0**-28).all() and (s > 1).all()
    other = torch.from_numpy(logprob_emulation(rows, out.tokens.numpy(), lanes=128))
    assert int((other.view(torch.int32) != out.logprobs.view(torch.int32)).sum()) >= 3


def test_sampler_emulate_gate_compares_the_fused_kernels_own_mass():
    """The fused kernel's float64 S1, lse1, nz (rows_tail_fused's debug_mass export) are
    outputs of the tail.sampler kind, equal bit for bit to the declared mass emulation on
    every byte-gate case; planted: one ulp of one row's S1 or lse1, and the mass in 128
    lane chains, are each seen by the emulate gate's comparison."""
    from lmtail.kernels.tail.rows_tail import available_backends

    if not available_backends():
        pytest.skip("the fused C kernel is not built (no C compiler): no mass to export")
    for case in sk.sampler_bytes(True):
        got, want = sk.run_sampler(case.data), sk.emulate_sampler(case.data)
        assert got["mass"].shape == (case.data["rows"].shape[0], 3) and not got["mass"].isnan().any()
        assert harness.diff_outputs(got, want, nan_equal=True) == "", case.label
        for col in (0, 1):
            bad = got["mass"].clone()
            bad[-1, col] = float(np.nextafter(bad[-1, col].item(), np.inf))
            assert harness.diff_outputs(dict(got, mass=bad), want, nan_equal=True).startswith("mass differs")
    rows = sk.readout_rows()
    m128 = sk.mass_rows_emulation(rows, False, lanes=128)
    assert int((m128[:, 0] != sk.mass_rows_emulation(rows, False)[:, 0]).sum()) >= 3


def test_gemm_variants_without_defect_are_the_real_op():
    """The gemm kinds' emulation and the amx32 control body with no switch planted give the
    op's bytes (so a red control is its one defect), in both orders."""
    from lmtail.contract import gemm_kinds as gk

    for order in ("amx32", "chain"):
        for case in gk.gemm_random(True, order=order) + gk.gemm_special(True, order=order)[:3]:
            d = case.data
            assert not harness.diff_outputs(gk.emulate_gemm(d), gk.run_gemm(d), nan_equal=True), (order, case.label)
            if order == "amx32":
                assert not harness.diff_outputs(gk.amx32_variant(d), gk.run_gemm(d), nan_equal=True), case.label


def test_quant_variants_without_defect_are_the_real_op():
    """gemm_q's kind: the emulation (and its control body with no switch planted) gives the
    op's bytes in both formats, the nibble-swap control is the real op on Q8_0 (it plants
    only in Q4_1), the adversarial weight is exactly 1.0 everywhere, and the range comes from
    gemm_q_decl (a half-depth declaration is narrower)."""
    from lmtail.contract import quant_kinds as qk
    from lmtail.kernels.quant.gemm_q import dequantize, gemm_q_decl

    for fmt in qk.FORMATS:
        d = qk.quant_data(5, 96, 9, 3, fmt=fmt)
        real = qk.run_gemm_q(d)
        assert not harness.diff_outputs(qk.emulate_gemm_q(d), real)
        assert not harness.diff_outputs(qk.emulation_variant(d), real)
        assert bool(harness.diff_outputs(qk.nibbles_swapped(d), real)) == (fmt == "Q4_1")
        assert KINDS["gemm_q.lanes32"].decl(d) == gemm_q_decl(96, fmt)
        assert qk.shallow_decl(d).sum("gemm").depth == gemm_q_decl(96, fmt).sum("gemm").depth // 2
        assert torch.equal(dequantize(qk.unit_weight(3, 64, fmt)), torch.ones(3, 64))


def test_near_bound_data_follows_the_gemm_order():
    """The half-depth declaration is caught only by data built for the kind's own order: the
    chain's round-up data run in amx32 stays inside amx32's halved range (planted: an
    order-blind adversarial gate would let the amx32 control through), amx32's own data does not."""
    kw = dict(dtype=torch.float32, deferred=True, k=None)
    for order in ("amx32", "dp32"):
        for built_for, caught in (("chain", False), (order, True)):
            d = dict(lk.gemm_at_bound(order=built_for, **kw), gemm_order=order)
            out = lk.run_logits(d)
            assert lk.check_logits(d, out, lk.run_logits, lk.tail_decl_of(d)).ok
            assert lk.check_logits(d, out, lk.run_logits, lk.shallow_decl(d)).ok is not caught, (order, built_for)


def test_dp32_near_bound_data_errs_as_documented():
    """gemm_at_bound(order="dp32"): the dp32 GEMM of a = 1 loses exactly (30 + NB) u = 94 u
    of the declared depth 32 + NB = 96 (H = 2048); planted: amx32 on the same data loses
    fewer (its even/odd chains split block 0's lanes), so the data is dp32's own."""
    d = lk.gemm_at_bound(order="dp32", dtype=torch.float32, deferred=True, k=None)
    a = torch.ones(1, 2048, dtype=torch.bfloat16)
    exact = d["w"].double()[:, 0].sum()
    lost = lambda order: float((exact - gemm_bf16(a, d["w"], order=order)[0, 0].double()) / 2.0**-24)  # noqa: E731
    assert lost("dp32") == 94.0 and lk.tail_decl_of(d).sum("gemm").depth == 96
    assert lost("amx32") < 94.0


def test_wrong_declaration_control_keeps_the_real_op():
    """The half-depth control changes only the declaration: the op and data are the kind's,
    the full declaration passes the same gate, and the halved one is what goes red."""
    ctl = next(c for c in CONTROLS if c.name == "tail.decl_half_depth")
    kind = KINDS[ctl.kind]
    assert ctl.run is None and ctl.ranks is None and ctl.decl is not None
    d = kind.gens["random"](True)[0].data
    full, half = kind.decl(d), ctl.decl(d)
    assert [s.depth // 2 for s in full.sums] == [s.depth for s in half.sums]
    assert run_gates(kind, FAST, only=["adversarial"])["adversarial"].ok
    red = run_gates(kind, FAST, decl=ctl.decl, only=["adversarial"])["adversarial"]
    assert red.ok is False and "outside" in red.detail


def test_glue_kinds_take_their_declaration_from_the_data():
    """No glue depth is pinned to one width: the declared ssq depth follows H and the order."""
    kind = KINDS["glue.add_rms_y"]
    d = kind.gens["shapes"](True)[0].data  # 16 x 2,688
    assert kind.decl(d).sum("ssq").depth == 11 + 5 + 7
    narrow = kind.gens["shapes"](True)[-1].data  # 2 x 100
    assert narrow["x"].shape[1] == 100 and kind.decl(narrow).sum("ssq").depth == 1 + 5 + 7


def test_references_never_import_the_ops_they_check():
    """reference/*.py import only numerics and each other: a reference that imported an op
    (or its order constant) would move with the code it is meant to pin."""
    import ast
    from pathlib import Path

    import lmtail.reference

    ops = ("tail", "sampler", "topk", "norms", "router", "kernels", "exchange", "orders", "layout", "contract")
    for path in Path(lmtail.reference.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                mod = ("." * node.level) + (node.module or "")
                top = mod.removeprefix("..").removeprefix("lmtail.").split(".")[0] if mod.startswith(("..", "lmtail")) else ""
                assert top not in ops, f"{path.name} imports {mod}"


def test_decode_ranks_gate_passes_on_two_ranks():
    kind = KINDS["tail.decode"]
    res = run_gates(kind, Config(fast=True, ranks=2), only=["ranks"])["ranks"]
    assert res.ok and res.cases == 2, res.detail  # vtp2 and vtp2 G=2, bytes equal to one rank


# ---------------------------------------------------------------------------------------
# the float64 pieces
# ---------------------------------------------------------------------------------------
def test_range_margin_definition():
    y = np.array([1.5, 1.0, 2.0, 2.5, 0.0, 3.0, np.nan, np.inf])
    lo = np.array([1.0, 1.0, 1.0, 1.0, 0.0, 3.0, 0.0, 0.0])
    hi = np.array([2.0, 2.0, 2.0, 2.0, 0.0, 3.0, 1.0, 1.0])
    inside, m = range_margin(y, lo, hi)
    assert inside.tolist() == [True, True, True, False, True, True, False, False]
    assert m[:6].tolist() == [0.5, 0.0, 0.0, -0.5, 0.5, 0.5] and m[6] == m[7] == -math.inf
    _, m2 = range_margin(np.array([0.1]), np.array([0.0]), np.array([0.0]))
    assert m2[0] == -math.inf


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_decision_agrees_with_sampler_ref(seed):
    """Our margin-aware float64 sampler gives reference.tail.sampler_ref's token on every row it
    certifies (delta = 0, no truncation: top_k in 1..V)."""
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(40, 300, generator=g) * 2).to(torch.bfloat16)
    sp = sk.random_params(40, seed, 300)
    sp[:, 0] = torch.where(sp[:, 0] > 0, sp[:, 0], torch.full_like(sp[:, 0], 300.0)).clamp(max=300)
    checked = 0
    for i in range(40):
        tkk, tp, t, u, mp = sp[i].double().tolist()
        dec = sample_decision(rows[i].double().numpy(), np.zeros(300), top_k=tkk, top_p=tp, temperature=t,
                              u=u, min_p=mp, k=300, slack=1e-12)
        want = sampler_ref(rows[i], top_k=int(tkk), top_p=tp, temperature=t, u=u, min_p=mp)
        if dec["certified"]:
            assert dec["token"] == want["token"], (i, sp[i].tolist())
            checked += 1
    assert checked >= 35


def test_sample_decision_counts_a_near_tie_instead_of_guessing():
    r = np.array([2.0, 1.0, 0.5])
    u_on_boundary = math.exp(2.0) / (math.exp(2.0) + math.exp(1.0) + math.exp(0.5))
    dec = sample_decision(r, np.full(3, 1e-3), top_k=0, top_p=1, temperature=1.0, u=u_on_boundary, k=3, slack=1e-12)
    assert not dec["certified"] and "slot" in dec["why"]
    far = sample_decision(r, np.full(3, 1e-3), top_k=0, top_p=1, temperature=1.0, u=0.1, k=3, slack=1e-12)
    assert far["certified"] and far["token"] == 0 and far["margin"] > 1


# ---------------------------------------------------------------------------------------
# certification
# ---------------------------------------------------------------------------------------
def _problem(seed=0, gbs=12, h=64, v=500):
    d = tk.decode_data(gbs, h, h, v, False, seed, k=16)
    sp = d["sp"].clone()
    sp[:, 0] = torch.where(sp[:, 0] <= 0, torch.full_like(sp[:, 0], 10.0), sp[:, 0]).clamp(max=16)
    return d["x"], d["gamma"], d["w"], sp


def _cert(x, gamma, w, out, sp):
    return certify_tail(x, gamma, w, out, sampling_params=sp, hidden_actual=x.shape[1], interleaved=False, k=16)


def test_certify_tail_certifies_the_dp32_tail():
    """gemm_order="dp32": decode_tail's tokens are certified against float64 with the bound
    from tail_decl(H, True, "dp32"); planted: a wrong token on a certified row is caught."""
    x, gamma, w, sp = _problem(seed=3)
    out = decode_tail(x, gamma, w, k=16, sampling_params=sp, zero_interleaved_pad=False, gemm_order="dp32")
    c = certify_tail(x, gamma, w, out, sampling_params=sp, hidden_actual=x.shape[1], interleaved=False, k=16,
                     gemm_order="dp32")
    assert c["ok"] and c["certified"] >= 15 and c["matched"] == c["certified"], c
    row = next(i for i in range(12) if i not in c["near_tie_rows"]["sample"])
    bad_tok = out.tokens.clone()
    bad_tok[row] = out.topk_indices[row, -1]
    c2 = certify_tail(x, gamma, w, dict(topk_indices=out.topk_indices, tokens=bad_tok, truncated=out.truncated),
                      sampling_params=sp, hidden_actual=x.shape[1], interleaved=False, k=16, gemm_order="dp32")
    assert not c2["ok"] and c2["mismatched"] >= 1


def test_certify_tail_certifies_and_catches_a_wrong_token():
    x, gamma, w, sp = _problem()
    out = decode_tail(x, gamma, w, k=16, sampling_params=sp, zero_interleaved_pad=False)
    c = _cert(x, gamma, w, out, sp)
    assert c["ok"] and c["certified"] >= 15 and c["matched"] == c["certified"] and c["near_ties"] > 0, c
    assert c["decisions"]["argmax"]["certified"] + c["decisions"]["argmax"]["near_ties"] == 12
    row = next(i for i in range(12) if i not in c["near_tie_rows"]["sample"])
    bad_tok = out.tokens.clone()
    bad_tok[row] = out.topk_indices[row, -1]  # the 16th candidate: not the sampled one
    bad = dict(topk_indices=out.topk_indices, tokens=bad_tok, truncated=out.truncated)
    c2 = _cert(x, gamma, w, bad, sp)
    assert not c2["ok"] and c2["mismatched"] >= 1 and f"row {row} sample" in c2["mismatches"][0]
    ids = out.topk_indices.clone()
    ids[0] = ids[0].flip(0)
    ids[0, 0] = (ids[0, 0] + 1) % 500 if ids[0, 0] + 1 not in ids[0] else ids[0, 1]
    assert not _cert(x, gamma, w, dict(topk_indices=ids, tokens=out.tokens, truncated=out.truncated), sp)["ok"]


def test_certify_counts_an_exact_tie_as_a_near_tie():
    x, gamma, w, sp = _problem(1, gbs=3)
    logits = decode_tail(x, gamma, w, k=16, zero_interleaved_pad=False).logits
    best = int(logits[0].argmax())
    w = w.clone()
    w[:, best + 1 if best + 1 < 500 else best - 1] = w[:, best]  # two identical columns: a true tie
    sp[:, 2] = 0.0  # greedy: the sampled slot is the argmax
    out = decode_tail(x, gamma, w, k=16, sampling_params=sp, zero_interleaved_pad=False)
    c = _cert(x, gamma, w, out, sp)
    assert 0 in c["near_tie_rows"]["argmax"] and 0 in c["near_tie_rows"]["sample"]
    assert c["ok"] and c["near_ties"] >= 2


def test_certify_rejects_outputs_it_cannot_read():
    x, gamma, w, sp = _problem(2, gbs=4)
    with pytest.raises(ValueError, match=r"out must carry topk_indices"):
        certify_tail(x, gamma, w, {"tokens": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"out must hold every row of hidden"):
        certify_tail(x, gamma, w, {"topk_indices": torch.zeros(2, 16, dtype=torch.int64)})


def test_special_case_expectations_are_live():
    """The special gate's own expectations fail on wrong outputs (not only the range)."""
    kind = KINDS["tail.logits.deferred.fp32"]
    cases = {c.label.split(" ->")[0]: c for c in kind.gens["special"](True)}
    zero = cases["zeros"]
    out = kind.run(zero.data)
    decl = kind.decl(zero.data)
    assert zero.expect(zero.data, out, kind.run, decl).ok
    assert not zero.expect(zero.data, {"logits": out["logits"] + 1e-30}, kind.run, decl).ok
    err = Case("no error", cases["eps < 0"].data, raises="eps must be >= 0")
    assert not harness.run_case(kind, err, lambda d: {"logits": torch.zeros(1)}).ok


def test_contract_list_counts_from_the_registry(capsys):
    """`lmtail contract --list` prints the registry's counts (the README's prose points at it
    instead of a number that goes stale)."""
    from lmtail import cli
    from lmtail.contract import registry

    kinds, ctls = registry(kinds=None)
    assert cli.main(["contract", "--list"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == f"{len(kinds)} kinds, {len(ctls)} planted controls"
