"""`lmtail doctor`: one screen of the CPU, the compiler, the cache and every op's backends
(status, time per shape class, the classes each is chosen for); --json for a bug report."""
from __future__ import annotations

import json

from lmtail import cli, doctor

STATUSES = {"reference", "verified", "failed", "unavailable", "emulated", "unchecked", "not timed"}


def test_doctor_json_lists_every_op_and_a_chosen_row_per_class(capsys):
    assert cli.main(["doctor", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert {"cpu", "features", "compiler", "cache", "torch", "threads"} <= set(rep["machine"])
    ops = {o["op"]: o for o in rep["ops"]}
    assert set(ops) == {t.op for t in doctor.tables()}
    for op in ops.values():
        assert {b["status"] for b in op["backends"]} <= STATUSES, op
        chosen = [c for b in op["backends"] for c in b["chosen"]]
        assert sorted(c for c in chosen if "/" not in c) == ["1", "16", "many"], op["op"]
        assert all(b["status"] in ("reference", "verified") for b in op["backends"] if b["chosen"])


def test_doctor_screen_names_a_failed_row_and_why():
    rep = {"machine": {"date": "d", "cpu": "Some CPU", "machine": "x86_64", "features": ["avx2"],
                       "compiler": "gcc 12", "kernels": "compiled here", "torch": "2.13", "threads": 2, "python": "3.11", "cache": "/c"},
           "ops": [{"op": "gemm_bf16 amx32", "cache": "", "backends": [
               {"name": "amx", "status": "failed", "reason": "killed by SIGSEGV while checked",
                "times": {}, "chosen": []},
               {"name": "avx512", "status": "verified", "reason": "", "times": {"1": 0.002, "16": 0.004, "many": 0.02,
                                                                               "1/packed": 0.003},
                "chosen": ["1", "16", "many", "1/packed"]},
               {"name": "emu-amx", "status": "emulated", "reason": "", "times": {}, "chosen": []},
               {"name": "emu-avx512", "status": "emulated", "reason": "", "times": {}, "chosen": []}]}]}
    text = doctor.render(rep)
    lines = text.splitlines()
    assert any(ln.startswith("gemm_bf16 amx32") and " amx " in ln and "failed" in ln for ln in lines)
    assert "^ killed by SIGSEGV while checked" in text
    assert any("avx512" in ln and "2 ms" in ln and "1 row, 2-16 rows, >16 rows, 1 row packed" in ln for ln in lines)
    assert any("packed w" in ln and "3 ms" in ln for ln in lines)
    assert "1 backend(s) failed their check and are not used: gemm_bf16 amx32 amx" in text
    assert any(ln.split()[:3] == ["emulated", "emu-amx,", "emu-avx512"] for ln in lines)
    assert len(lines) <= 60


def test_recheck_makes_the_record_anew(monkeypatch):
    """--recheck drops a table's cached record; the next record() asks the children again."""
    from lmtail.kernels import _verify

    table = next(t for t in doctor.tables() if t.checked())
    before = table.record()
    calls = []
    real = _verify._verify_in_children
    monkeypatch.setattr(_verify, "_verify_in_children", lambda t, **k: calls.append(t.op) or real(t, **k))
    doctor.recheck(table)
    assert table.record().status == before.status and calls == [table.op]
