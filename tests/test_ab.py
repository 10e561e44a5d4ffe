"""`lmtail ab`: the alternating schedule, the per-metric summary on known rounds, and two
live runs on this noisy machine: a planted 5% slowdown must be called slower at 12 rounds
and an A/A comparison level (each would go red on the other's verdict)."""
from __future__ import annotations

import json
import statistics
import sys

import pytest

from lmtail.receipts import ab


def test_schedule_alternates_abba():
    assert ab.schedule(4) == [("a", "b"), ("b", "a"), ("a", "b"), ("b", "a")]
    flat = [k for pair in ab.schedule(12) for k in pair]
    assert flat[:8] == list("abbaabba")


def test_summarize_known_rounds():
    a = [1.0] * 12
    b = [1.05] * 9 + [1.005, 0.9, 0.95]  # 9 slower, 1 level, 2 faster
    m = ab.summarize("wall_s", a, b, tol=0.01, alpha=0.05, higher_better=False)
    assert (m.a_wins, m.b_wins, m.level) == (9, 2, 1)
    assert m.median_ratio == pytest.approx(1.05)
    assert m.sign_p == pytest.approx(2 * sum(__import__("math").comb(11, k) for k in range(3)) / 2**11)
    assert m.verdict == "no verdict"  # p = 0.065: not enough rounds agree
    m2 = ab.summarize("wall_s", a, [1.05] * 11 + [0.9], tol=0.01, alpha=0.05, higher_better=False)
    assert m2.verdict == "B slower" and m2.sign_p < 0.05
    tput = ab.summarize("tok_per_s", a, [1.05] * 12, tol=0.01, alpha=0.05, higher_better=True)
    assert tput.verdict == "B faster" and tput.b_wins == 12
    lvl = ab.summarize("wall_s", a, [1.0, 1.004, 0.996] * 4, tol=0.01, alpha=0.05, higher_better=False)
    assert lvl.verdict == "level" and lvl.level == 12


def test_run_once_reads_last_json_line():
    cmd = f"{sys.executable} -c \"print('noise'); print('{{\\\"tok_per_s\\\": 12.5, \\\"ok\\\": true}}')\""
    got = ab.run_once(cmd)
    assert got["tok_per_s"] == 12.5 and "ok" not in got and got["wall_s"] > 0
    with pytest.raises(RuntimeError, match="exited 3"):
        ab.run_once("exit 3")
    with pytest.raises(ValueError, match="rounds must be >= 1; got 0"):
        ab.ab("true", "true", rounds=0)
    with pytest.raises(ValueError, match="repeat must be >= 1; got 0"):
        ab.ab("true", "true", repeat=0)


def test_best_of_picks_the_least_disturbed_run():
    runs = [{"wall_s": 0.25, "tok_per_s": 90.0}, {"wall_s": 0.21, "tok_per_s": 99.0}, {"wall_s": 0.3}]
    assert ab.best_of(runs, lambda m: m.endswith("per_s")) == {"wall_s": 0.21}
    assert ab.best_of(runs[:2], lambda m: m.endswith("per_s")) == {"wall_s": 0.21, "tok_per_s": 99.0}


def verdict(cmd_a: str, cmd_b: str) -> ab.MetricAB:
    (m,) = ab.ab(cmd_a, cmd_b, rounds=12, repeat=3, warmup=1, tol=ab.DEFAULT_TOL)
    return m


@pytest.mark.slow  # 15 s of subprocess sleeps (statistical power): `make test-all`
def test_planted_five_percent_slowdown_is_called_slower():
    m = verdict("sleep 0.2", "sleep 0.21")
    assert m.verdict == "B slower", (m.verdict, m.ratios)
    assert m.median_ratio > 1.02


@pytest.mark.slow  # 15 s of subprocess sleeps: `make test-all`
def test_a_a_is_level():
    m = verdict("sleep 0.2", "sleep 0.2")
    assert m.verdict == "level", (m.verdict, m.ratios)
    assert abs(statistics.median(m.ratios) - 1) <= ab.DEFAULT_TOL


def test_cli_table_and_json(tmp_path, capsys):
    import argparse

    p = argparse.ArgumentParser()
    ab.configure(p)
    out = tmp_path / "ab.json"
    args = p.parse_args(["--a", "true", "--b", "true", "--rounds", "2", "--repeat", "1", "--warmup", "0",
                         "--json", str(out)])
    assert ab.run(args) == 0
    text = capsys.readouterr().out
    assert "| wall_s (lower is better) |" in text and "paired median B/A" in text
    rec = json.loads(out.read_text())
    assert rec["metrics"][0]["name"] == "wall_s" and len(rec["metrics"][0]["ratios"]) == 2
