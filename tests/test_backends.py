"""Backends verify themselves before they are trusted, and the fastest verified one is chosen
(kernels._verify, kernels._backend.Dispatch.pick).

Planted tables (a module written to tmp_path, so the checking child can import it): a row
that faults (SIGSEGV), one that gives other bits, one that hangs, a slow and a fast right
one. Each wrong row is caught at first use with one warning, never used, refused by name
with its reason, and the answer keeps the right bytes; the verdicts are cached and read
back without a child. Then every real table of this machine: each hardware row available
here verifies, and every probe's reference runs.
"""
from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch

from lmtail.kernels import _backend, _verify
from lmtail.kernels.glue import fmachain
from lmtail.kernels.gemm import bf16 as gemm
from lmtail.kernels.quant import gemm_q as quant
from lmtail.kernels.tail import rowmass, rows_tail, shard_partials
from lmtail.model import body

PLANTED = '''
import ctypes, time
import torch
from lmtail.kernels import _backend

def right(x):
    return x * 3.0

def fault(x):
    ctypes.string_at(0)  # SIGSEGV, as a kernel reading a bad address

def wrong(x):
    y = x * 3.0
    y.view(torch.int32)[-1] ^= 1  # the last bit of the last element
    return y

def hang(x):
    time.sleep(3600)

def slow(x):
    time.sleep(0.002 * x.shape[0])
    return x * 3.0

def make(op, rows, cache_dir):
    table = _backend.Dispatch(op, [_backend.Backend(n, f) for n, f in rows], cache_dir=cache_dir)

    @table.probe
    def probe(rows, seed):
        x = torch.arange(rows * 5, dtype=torch.float32).reshape(rows, 5) + seed
        return lambda name: table.pick(name).run(x)
    return table

CACHE = {cache!r}
FAULTY = make("planted faulty", [("fault", fault), ("wrong", wrong), ("fast", right), ("c", right)], CACHE)
SPEED = make("planted speed", [("slow", slow), ("fast2", right), ("c", slow)], CACHE)
HANG = make("planted hang", [("hang", hang), ("c", right)], CACHE)
'''


@pytest.fixture
def planted(tmp_path, monkeypatch):
    name = f"lmtail_planted_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PLANTED.format(cache=str(tmp_path / "cache")))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_faulting_and_wrong_rows_are_caught_once_and_never_used(planted):
    table = planted.FAULTY
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        row = table.pick(None, rows=3)
        again = table.pick(None, rows=1)
    assert row.name in ("fast", "c") and again.name in ("fast", "c")
    assert torch.equal(row.run(x).view(torch.int32), (x * 3.0).view(torch.int32))
    msgs = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1, msgs
    assert "'fault' (killed by SIGSEGV while checked)" in msgs[0]
    assert "'wrong' (differs from 'c'" in msgs[0] and f"using {row.name!r} instead" in msgs[0]
    rec = table.record()
    assert rec.status == {"c": "reference", "fast": "verified", "fault": "failed", "wrong": "failed"}
    for bad in ("fault", "wrong"):
        with pytest.raises(ValueError, match=f"backend '{bad}' of planted faulty failed its check"):
            table.pick(bad)
    assert table.pick("fast").name == "fast"


def test_verdicts_are_cached_and_read_without_a_child(planted, monkeypatch):
    first = planted.FAULTY.record()
    cached = json.loads(open(first.path).read())
    assert cached["status"]["fault"] == "failed"
    fresh = planted.make("planted faulty", [(r.name, r.run) for r in planted.FAULTY.rows],
                         planted.CACHE)

    def no_child(*a, **k):
        raise AssertionError("a cached verdict started a child")
    monkeypatch.setattr(_verify, "_run_child", no_child)
    assert fresh.record().status == first.status
    with pytest.warns(RuntimeWarning, match="'fault' .* failed its check"):  # once per table
        assert fresh.pick(None).name == planted.FAULTY.pick(None).name


def test_the_fastest_verified_row_is_chosen_and_backend_still_forces(planted):
    table = planted.SPEED
    rec = table.record()
    assert rec.status == {"slow": "verified", "fast2": "verified", "c": "reference"}
    assert set(rec.times) == {"1", "16", "many"} and all(len(t) == 3 for t in rec.times.values())
    assert rec.chosen == {"1": "fast2", "16": "fast2", "many": "fast2"}
    assert table.pick(None, rows=40).name == "fast2"
    assert table.pick("slow").name == "slow"  # forced: verified, so allowed


def test_a_hanging_row_is_failed_after_the_timeout(planted, monkeypatch):
    monkeypatch.setattr(_verify, "CHILD_TIMEOUT_S", 10)
    # the child names the row it began (on a loaded box the timeout may come before the
    # child even starts its check: then every unchecked row fails, which is also safe)
    with pytest.warns(RuntimeWarning, match=r"'hang' \((no answer in 10 s while checked|"
                                            r"the check could not run: no answer in 10 s)\)"):
        assert planted.HANG.pick(None).name == "c"
    assert planted.HANG.record().status["hang"] == "failed"


def test_planted_wrong_child_verdict_is_not_trusted(planted, monkeypatch):
    """A check that cannot run at all (the reference raises) fails every hardware row: the
    planted probe bug is caught, not trusted."""
    table = planted.make("planted broken probe", [("fast", planted.right), ("c", planted.right)],
                         planted.CACHE)
    table.probe(lambda rows, seed: (_ for _ in ()).throw(RuntimeError("probe bug")))
    table.module = planted.__name__
    rec = _verify._verify_in_children(table, threads=1)
    assert rec.status["fast"] == "failed" and "could not run" in rec.reason["fast"]


@pytest.mark.parametrize("rows, cls", [(None, "1"), (1, "1"), (2, "16"), (16, "16"), (17, "many")])
def test_row_class(rows, cls):
    assert _verify.row_class(rows) == cls


TABLES = [*gemm.GEMM.values(), quant.GEMM_Q, rows_tail.ROWS_TAIL, rowmass.ROW_MASS, rowmass.TERMS,
          shard_partials.SHARD_PARTIALS, fmachain.FMA_SUM, fmachain.MOE_ROUTED, body.EXP32,
          body.SILU_MUL, body.SILU_MUL_BF16, body.ATTEND]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.op)
def test_every_hardware_row_here_verifies(table):
    """On this machine's real tables (the cache next to the kernels): no hardware row that
    this CPU runs fails its check, and the chosen row of each class is a verified one."""
    assert table.probe_fn is not None, f"{table.op} has no probe"
    if not table.checked():
        pytest.skip(f"{table.op}: no hardware row on this CPU (only the emulations run)")
    rec = table.record()
    assert rec.failed() == {}
    assert all(rec.status[n] in ("verified", "reference") for n in rec.chosen.values())


@pytest.mark.parametrize("order", ["amx32", "dp32"])
def test_weight_for_packs_exactly_when_the_record_says_packed_is_faster(order, monkeypatch):
    """weight_for follows the record's timings (a planted record each way), and gemm_bf16's
    bytes are the same on the weight it returns."""
    table = gemm.GEMM[order]
    if not table.checked():
        pytest.skip("no hardware row: weight_for keeps the plain layout")
    w = (torch.randn(64, 40) * 0.1).to(torch.bfloat16)
    a = torch.randn(3, 64).to(torch.bfloat16)
    real = table.record()
    for packed_faster in (True, False):
        fast, slow = {"c": 1e-3}, {"c": 2e-3}
        times = {"1": slow if packed_faster else fast, "1/packed": fast if packed_faster else slow}
        monkeypatch.setattr(table, "_record", _verify.Record(op=real.op, status=real.status, times=times,
                                                               chosen=real.chosen))
        got = gemm.weight_for(w, order=order, rows=1)
        assert isinstance(got, gemm.PackedWeight) is packed_faster
        assert torch.equal(gemm.gemm_bf16(a, got, order=order).view(torch.int32),
                           gemm.gemm_bf16(a, w, order=order).view(torch.int32))


def test_every_table_names_existing_sources_and_its_key_follows_only_them(tmp_path, monkeypatch):
    """Each table's verdict keys on its own kernel sources: they exist; an edit of another
    kernel leaves the key as it is (one kernel's change re-checks only its ops), an edit of
    its own source or of the shared header changes it."""
    import shutil

    kernels = _verify.Path(_verify._cc.__file__).parent
    for t in TABLES:
        assert t.sources and all((kernels / s).exists() for s in t.sources), t.op
    copy = tmp_path / "kernels"
    shutil.copytree(kernels, copy, ignore=shutil.ignore_patterns("*.py", "__pycache__", "_prebuilt"))
    monkeypatch.setattr(_verify._cc, "__file__", str(copy / "_cc.py"))
    table = quant.GEMM_Q
    key = _verify.cache_key(table)
    (copy / "tail" / "rows_tail.c").write_text((copy / "tail" / "rows_tail.c").read_text() + "\n/* edit */\n")
    assert _verify.cache_key(table) == key
    for edited in ("quant/gemm_q.c", "lmtail_kernels.h"):
        (copy / edited).write_text((copy / edited).read_text() + "\n/* edit */\n")
        assert _verify.cache_key(table) != key, edited
        key = _verify.cache_key(table)
