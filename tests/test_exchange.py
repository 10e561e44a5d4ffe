"""The vocab-parallel tail (lmtail.tail.compose over lmtail.tail.exchange) on gloo ranks spawned by lmtail.launch.

One 8-rank job runs every configuration: VTP=8 over the world and VTP=4, 2, 1 over
subgroups of it (so the whole-world and the sub-parent paths are both exercised), every
valid hop layout in {(VTP,), (2, VTP/2), (2, 2, 2)} plus (4, 2), and G in {1, 2, 4}.
The per-rank outputs come back to this process, are gathered into global rows with
layout.owned_rows, and must be bitwise the single-rank decode_tail's. Planted wrong
ownership maps must make the same gather red. Failure jobs (a rank raises / dies /
hangs) must end every rank with a clear error within the exchange timeout.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import bits, gather_rows as gather
from lmtail.tail.exchange import ExchangeError, exchange_rows, hop_groups
from lmtail.launch import LaunchError, launch
from lmtail.tail.layout import owned_row_block, owned_rows
from lmtail.tail.compose import decode_tail

WORLD, GBS, H, H_U, V, K = 8, 32, 48, 40, 104, 5  # V_s = 13 at VTP = 8 (not a multiple of 8)
FIELDS = ("topk_values", "topk_indices", "tokens", "logprobs", "truncated", "lse")


# ---------------------------------------------------------------------------------------
# global inputs and the cases (built identically here and in every rank)
# ---------------------------------------------------------------------------------------
def global_inputs(seed, gbs=GBS, sp_cols=5, hidden_dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(gbs, H, generator=g) * 2).to(hidden_dtype)
    gamma = torch.rand(H, generator=g) + 0.5
    w = (torch.randn(H, V, generator=g) * 0.2).to(torch.bfloat16)
    pick = lambda vals: torch.tensor(vals)[torch.randint(0, len(vals), (gbs,), generator=g)]
    sp = torch.stack([pick([-1.0, 0.0, 1.0, 3.0, K, K + 2]), pick([1.0, 0.9, 0.5, 0.2]),
                      pick([0.0, 0.7, 1.0, 1.3]), torch.rand(gbs, generator=g) * 0.999,
                      pick([0.0, 0.1])], 1).to(torch.float32)
    return x, gamma, w, (None if sp_cols is None else sp[:, :sp_cols].contiguous())


def make_cases():
    layouts = []
    for vtp, hopss in ((8, [(8,), (2, 4), (4, 2), (2, 2, 2)]), (4, [(4,), (2, 2)]), (2, [(2,), (2, 1)]), (1, [(1,)])):
        for hops in hopss:
            for g in ((1, 2, 4) if len(hops) == 1 else (1,)):
                layouts.append((vtp, hops, g))
    variants = [dict(), dict(sp_cols=3), dict(hidden_dtype=torch.bfloat16), dict(deferred_rms=False),
                dict(sp_cols=None, nan_fold=True), dict(debug_taps=True, sp_cols=4), dict(emit_logits=False)]
    cases = []
    for i, (vtp, hops, g) in enumerate(layouts):
        case = dict(vtp=vtp, hops=hops, G=g, seed=i, gbs=GBS, fence=False, hopgroups=False)
        case.update(variants[i % len(variants)])
        cases.append(case)
        if i % 3 == 0:  # the same call fenced: must give the same bytes
            cases.append(dict(case, fence=True))
    cases += [dict(vtp=8, hops=(8,), G=1, seed=90, gbs=8, fence=False, hopgroups=False),  # R = 1
              dict(vtp=4, hops=(2, 2), G=1, seed=91, gbs=24, fence=False, hopgroups=True),  # R = 6
              dict(vtp=2, hops=(2,), G=2, seed=92, gbs=300, fence=True, hopgroups=True),  # R = 150
              dict(vtp=2, hops=(2,), G=1, seed=93, gbs=16, fence=False, hopgroups=False, gemm_order="dp32"),
              dict(vtp=8, hops=(2, 4), G=1, seed=94, gbs=GBS, fence=False, hopgroups=False, gemm_order="dp32")]
    return cases


def case_inputs(case):
    return global_inputs(case["seed"], case["gbs"], case.get("sp_cols", 5), case.get("hidden_dtype", torch.float32))


def tail_kw(case):
    return dict(k=K, hidden_actual=H_U, deferred_rms=case.get("deferred_rms", True),
                nan_fold=case.get("nan_fold", False), debug_taps=case.get("debug_taps", False),
                emit_logits=case.get("emit_logits", True),
                **({"gemm_order": case["gemm_order"]} if "gemm_order" in case else {}))


# ---------------------------------------------------------------------------------------
# the 8-rank job
# ---------------------------------------------------------------------------------------
def _parents(rank):
    parents = {WORLD: dist.group.WORLD}
    for vtp in (4, 2, 1):  # every rank creates every parent, in the same order
        made = [dist.new_group(list(range(b, b + vtp))) for b in range(0, WORLD, vtp)]
        parents[vtp] = made[rank // vtp]
    return parents


def _shard(w, r, vtp):
    vs = w.shape[1] // vtp
    return w[:, r * vs:(r + 1) * vs].contiguous()


def _errors_on_every_rank(rank):
    """Disagreeing inputs: every rank must raise ValueError (no hang); returns messages."""
    x, gamma, w, sp = global_inputs(7)
    rows = owned_rows(rank, WORLD, GBS)
    base = dict(k=K, hidden_actual=H_U, group=dist.group.WORLD, timeout=60)
    msgs = {}
    plans = {
        "k": lambda: dict(k=6 if rank == 0 else K),
        "checksum": lambda: dict(hidden_states=x.clone().index_fill_(1, torch.tensor([0]), 1.0) if rank == 3 else x),
        "nan": lambda: dict(sampling_params=sp[rows].clone().fill_(float("nan")) if rank == 5 else sp[rows]),
        "V_s": lambda: dict(lm_head_weight_t=_shard(w, rank, WORLD)[:, :12 if rank == 1 else 13].contiguous()),
        "hops": lambda: dict(hops=(2, 4) if rank == 2 else (8,)),
        "dtype": lambda: dict(hidden_states=x.to(torch.bfloat16) if rank == 6 else x),
        "gbs": lambda: dict(hidden_states=x[:16] if rank == 4 else x, sampling_params=None),
        "H": lambda: dict(hidden_states=x[:, :44], gamma=gamma[:44],
                          lm_head_weight_t=_shard(w, rank, WORLD)[:44].contiguous()) if rank == 7 else {},
        # the same inputs everywhere: the norm's own pass refuses row 3 on every rank, before the exchange
        "eps0": lambda: dict(eps=0.0, hidden_states=x.clone().index_fill_(0, torch.tensor([3]), 0.0)),
    }
    for name, plan in plans.items():
        kw = dict(base, hidden_states=x, gamma=gamma, lm_head_weight_t=_shard(w, rank, WORLD),
                  sampling_params=sp[rows])
        kw.update(plan())
        try:
            decode_tail(**kw)
            msgs[name] = None
        except ValueError as e:
            msgs[name] = str(e)
    # bad layouts: ValueError BEFORE any collective - only rank 0 calls, the others do not
    bad = {}
    if rank == 0:
        for name, lay in {"product": dict(hops=(2, 2)), "G": dict(batch_groups=3),
                          "G_hops": dict(hops=(2, 4), batch_groups=2), "zero": dict(hops=(8, 0))}.items():
            try:
                decode_tail(x, gamma, _shard(w, 0, WORLD), sampling_params=sp[rows], **dict(base, **lay))
                bad[name] = None
            except ValueError as e:
                bad[name] = str(e)
    dist.monitored_barrier(timeout=timedelta(seconds=60))  # all ranks still in step
    return msgs, bad


def _synthetic(rank, parents):
    """exchange_rows on a matrix full of special values: bytes must move untouched (bf16
    slabs, as the tail sends, and fp32 ones: the transport has no dtype of its own)."""
    out = {}
    for dt in (torch.bfloat16, torch.float32):
        full = _special_matrix().to(dt)
        for vtp, hops, g in ((8, (2, 2, 2), 1), (8, (8,), 4), (4, (2, 2), 1), (2, (2,), 2)):
            p = parents[vtp]
            vs = V // vtp
            pr = p.rank()
            recv = exchange_rows(lambda s: full[s, pr * vs:(pr + 1) * vs], gbs=GBS, group=p, hops=hops,
                                 batch_groups=g, timeout=60)
            out[(dt, vtp, hops, g)] = (pr, recv)
    return out


def _special_matrix():
    g = torch.Generator().manual_seed(5)
    full = torch.randn(GBS, V, generator=g) * 100
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, -3e-39, 3e38])
    n = full.view(-1)[::7].numel()
    full.view(-1)[::7] = specials[torch.arange(n) % len(specials)]
    return full


def _invariance_job(rank, cases):
    parents = _parents(rank)
    errors = _errors_on_every_rank(rank)
    cached = [hop_groups(parents[8], (2, 4), timeout=60).groups[t] is hop_groups(parents[8], (2, 4)).groups[t]
              for t in range(2)]
    outs = []
    for case in cases:
        p = parents[case["vtp"]]
        pr = p.rank()
        x, gamma, w, sp = case_inputs(case)
        rows = owned_rows(pr, case["vtp"], case["gbs"], case["hops"], case["G"])
        group = hop_groups(p, case["hops"], timeout=60) if case["hopgroups"] else p
        o = decode_tail(x, gamma, _shard(w, pr, case["vtp"]), sampling_params=None if sp is None else sp[rows],
                        group=group, hops=None if case["hopgroups"] else case["hops"],
                        batch_groups=case["G"], fence=case["fence"], timeout=60, **tail_kw(case))
        outs.append((pr, o))
    return dict(errors=errors, cached=cached, outs=outs, synthetic=_synthetic(rank, parents))


@pytest.fixture(scope="module")
def run():
    cases = make_cases()
    t0 = time.monotonic()
    res = launch(_invariance_job, WORLD, args=(cases,), timeout_s=240, threads=1)
    return dict(cases=cases, res=res, wall=time.monotonic() - t0)


# ---------------------------------------------------------------------------------------
# gathering per-rank outputs into global rows, and the byte comparison
# ---------------------------------------------------------------------------------------
def assert_gathered_equal(outs, maps, ref, gbs):
    """outs {rank: TailOutput}; every field gathered through maps must equal ref bitwise."""
    for f in FIELDS:
        want = getattr(ref, f)
        if want is None:
            assert all(getattr(o, f) is None for o in outs.values()), f
            continue
        got = gather({r: getattr(o, f) for r, o in outs.items()}, maps, gbs)
        assert torch.equal(bits(got), bits(want)), f"{f} differs from the single-rank tail"
    if ref.taps is not None:
        for key, want in ref.taps.items():
            if not isinstance(want, torch.Tensor):
                assert all(o.taps[key] == want for o in outs.values()), f"tap {key}"
                continue
            got = gather({r: o.taps[key] for r, o in outs.items()}, maps, gbs)
            assert torch.equal(bits(got), bits(want)), f"tap {key}"


def groups_of(run, case_index):
    """The per-rank outputs of one case, split by parent group: [{parent rank: output}]."""
    case = run["cases"][case_index]
    vtp = case["vtp"]
    return [{run["res"][gr]["outs"][case_index][0]: run["res"][gr]["outs"][case_index][1]
             for gr in range(b, b + vtp)} for b in range(0, WORLD, vtp)]


_REFS = {}


def reference(case):
    """The single-rank decode_tail on the case's global inputs (memoized per case)."""
    key = repr(sorted(case.items()))
    if key not in _REFS:
        _REFS[key] = _reference(case)
    return _REFS[key]


def _reference(case):
    x, gamma, w, sp = case_inputs(case)
    return decode_tail(x, gamma, w, sampling_params=sp, **dict(tail_kw(case), emit_logits=True))


# ---------------------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------------------
def test_every_layout_is_bitwise_the_single_rank_tail(run):
    seen = set()
    for i, case in enumerate(run["cases"]):
        ref = reference(case)
        vtp, gbs = case["vtp"], case["gbs"]
        maps = {r: owned_rows(r, vtp, gbs, case["hops"], case["G"]) for r in range(vtp)}
        for outs in groups_of(run, i):
            assert_gathered_equal(outs, maps, ref, gbs)
            for r, o in outs.items():  # the pre-collective fp32 shard
                if case.get("emit_logits", True):
                    vs = V // vtp
                    assert torch.equal(bits(o.logits), bits(ref.logits[:, r * vs:(r + 1) * vs])), (case, r)
                else:
                    assert o.logits is None
        seen.add((vtp, case["hops"], case["G"], case["fence"]))
    assert {(v, g) for v, _, g, _ in seen} >= {(v, g) for v in (1, 2, 4, 8) for g in (1, 2, 4)}
    assert {h for _, h, _, _ in seen} >= {(8,), (2, 4), (2, 2, 2), (4,), (2, 2), (2,), (2, 1), (1,)}
    assert any(c["fence"] for c in run["cases"])


def test_fence_cannot_change_outputs(run):
    cases = run["cases"]
    pairs = [(i, j) for i, a in enumerate(cases) for j, b in enumerate(cases)
             if a["fence"] is False and b["fence"] is True and dict(a, fence=True) == b]
    assert len(pairs) >= 5
    for i, j in pairs:
        for plain, fenced in zip(groups_of(run, i), groups_of(run, j)):
            for r in plain:
                for f in FIELDS + ("logits",):
                    a, b = getattr(plain[r], f), getattr(fenced[r], f)
                    assert (a is None and b is None) or torch.equal(bits(a), bits(b)), (cases[i], f)


def _off_by_one(maps, gbs):
    return {r: [(x + 1) % gbs for x in m] for r, m in maps.items()}


def _hops_reversed(case):
    """The row blocks of the hops composed in reverse order."""
    blocks = [owned_row_block(r, case["vtp"], case["gbs"], case["hops"][::-1]) for r in range(case["vtp"])]
    return {r: list(range(s, s + n)) for r, (s, n) in enumerate(blocks)}


def _group_inner(case):
    """The batch group as the inner digit: the contiguous block map (wrong for G > 1)."""
    vtp, gbs = case["vtp"], case["gbs"]
    return {r: list(range(r * gbs // vtp, (r + 1) * gbs // vtp)) for r in range(vtp)}


def test_planted_wrong_ownership_maps_are_caught(run):
    """Every planted map that differs from owned_rows must make the same gather red."""
    caught = {"off_by_one": 0, "hops_reversed": 0, "group_inner": 0}
    for i, case in enumerate(run["cases"]):
        ref = reference(case)
        maps = {r: owned_rows(r, case["vtp"], case["gbs"], case["hops"], case["G"]) for r in range(case["vtp"])}
        outs = groups_of(run, i)[0]
        assert_gathered_equal(outs, maps, ref, case["gbs"])  # the true map passes
        planted = {"off_by_one": _off_by_one(maps, case["gbs"]), "hops_reversed": _hops_reversed(case),
                   "group_inner": _group_inner(case)}
        for name, wrong in planted.items():
            if wrong == maps:  # e.g. hops (2, 1) reversed, or G = 1: the same map, nothing to catch
                continue
            with pytest.raises(AssertionError, match="differs"):
                assert_gathered_equal(outs, wrong, ref, case["gbs"])
            caught[name] += 1
    assert caught["off_by_one"] == len(run["cases"]) and min(caught.values()) >= 5, caught


def test_synthetic_exchange_moves_bytes_untouched(run):
    for gr in range(WORLD):
        for (dt, vtp, hops, g), (pr, recv) in run["res"][gr]["synthetic"].items():
            want = _special_matrix().to(dt)  # [gbs, V]
            assert bool(torch.isnan(want).any() and torch.isinf(want).any())
            view = torch.int16 if dt == torch.bfloat16 else torch.int32
            rows = owned_rows(pr, vtp, GBS, hops, g)
            assert recv.dtype == dt and torch.equal(recv.view(view), want[rows].view(view)), (dt, vtp, hops, g, gr)


def test_hop_groups_are_cached(run):
    assert all(all(r["cached"]) for r in run["res"])


# ---------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------
EXPECT = {
    "k": r"inputs disagree .*k: \[6, 5, 5, 5, 5, 5, 5, 5\]",
    "checksum": r"inputs disagree .*hidden_states checksum",
    "V_s": r"inputs disagree .*V_s: \[13, 12, 13,",
    "hops": r"inputs disagree .*hops: \[\(8,\), \(8,\), \(2, 4\), \(8,\)",
    "dtype": r"inputs disagree .*hidden dtype: \[1, 1, 1, 1, 1, 1, 3, 1\]",
    "gbs": r"inputs disagree .*gbs: \[32, 32, 32, 32, 16, 32",
    "H": r"inputs disagree .*H: \[48, 48, 48, 48, 48, 48, 48, 44\]",
    "eps0": r"^eps=0.0 \(0 in fp32\) leaves hidden_states row\(s\) \[3\] undefined",
}


def test_disagreeing_inputs_raise_on_every_rank(run):
    for gr in range(WORLD):
        msgs, _ = run["res"][gr]["errors"]
        for name, pat in EXPECT.items():
            assert msgs[name] is not None and re.search(pat, msgs[name]), (gr, name, msgs[name])
        if gr == 5:
            assert re.match(r"sampling_params row 0: has NaN", msgs["nan"]), msgs["nan"]
        else:
            assert re.search(r"rank\(s\) 5 rejected its inputs: sampling_params row 0: has NaN", msgs["nan"])


def test_bad_layouts_raise_before_any_collective(run):
    """Only rank 0 made these calls; had any issued a collective, the job would have hung."""
    _, bad = run["res"][0]["errors"]
    assert re.search(r"hop sizes must multiply to vtp=8; got hops=\(2, 2\)", bad["product"])
    assert re.search(r"batch_groups must divide R = gbs/vtp = 4; got batch_groups=3", bad["G"])
    assert re.search(r"batch_groups > 1 needs a single hop", bad["G_hops"])
    assert re.search(r"every hop size must be an int >= 1", bad["zero"])


def test_no_process_group_is_a_value_error():
    x, gamma, w, sp = global_inputs(0)
    with pytest.raises(ValueError, match="needs an initialized torch.distributed process group"):
        decode_tail(x, gamma, w, k=K, hidden_actual=H_U, hops=(1,))


def _failing_job(rank, mode):
    x, gamma, w, sp = global_inputs(3, gbs=6)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("planted failure on rank 1")
        if mode == "die":
            os._exit(7)
        time.sleep(60)  # hang
    t0 = time.monotonic()
    try:
        decode_tail(x, gamma, _shard(w, rank, 2), k=K, hidden_actual=H_U, group=dist.group.WORLD, timeout=3)
    finally:
        print(f"rank {rank} gave up after {time.monotonic() - t0:.1f} s", flush=True)


@pytest.mark.parametrize("mode, first", [("raise", "RuntimeError"), ("die", "exit"), ("hang", "timeout")])
def test_a_failing_rank_fails_the_others_within_the_timeout(mode, first):
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as ei:
        launch(_failing_job, 2, args=(mode,), timeout_s=120, grace_s=2, threads=1)
    wall = time.monotonic() - t0
    f = ei.value.failures
    assert set(f) == {0, 1}
    assert f[1].exc_type == first
    if mode == "raise":
        assert "planted failure on rank 1" in f[1].message and "_failing_job" in f[1].traceback
        assert isinstance(ei.value.__cause__, RuntimeError) and "rank 1 failed: RuntimeError" in str(ei.value)
    if mode == "die":
        assert "exited with code 7" in f[1].message
    assert f[0].exc_type == "ExchangeError" and isinstance(f[0].exception, ExchangeError), f[0]
    assert re.search(r"rank 0: input signature all-gather over group ranks \[0, 1\] failed or "
                     r"timed out \(timeout 3 s\): a peer rank failed, died or is hanging", f[0].message)
    assert wall < 45, wall  # never waited for the 60 s sleeper nor the 120 s deadline


def test_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs must be an int >= 1; got 0"):
        launch(_failing_job, 0)
    with pytest.raises(ValueError, match="timeout_s must be > 0; got 0"):
        launch(_failing_job, 1, timeout_s=0)


# ---------------------------------------------------------------------------------------
# the torchrun example in docs/exchange.md runs as written
# ---------------------------------------------------------------------------------------
def test_docs_torchrun_example(tmp_path):
    doc = (Path(__file__).resolve().parents[1] / "docs" / "exchange.md").read_text()
    code = re.search(r"```python\n# torchrun_example.py\n(.*?)```", doc, re.S).group(1)
    script = tmp_path / "torchrun_example.py"
    script.write_text(code)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "torchrun example OK: 2 ranks, tokens bitwise equal to one rank" in p.stdout


def test_readme_shows_the_tested_torchrun_example():
    root = Path(__file__).resolve().parents[1]
    pick = lambda text: re.search(r"```python\n# torchrun_example.py\n(.*?)```", text, re.S).group(1)
    assert pick((root / "README.md").read_text()) == pick((root / "docs" / "exchange.md").read_text())
