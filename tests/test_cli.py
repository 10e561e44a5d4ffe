"""The `lmtail` command line: every subcommand's help names its options, bad input exits 2
with one line naming the subcommand, only the invoked command's module is imported, and the
synthetic demo prints its checks (and fails them when a planted tail breaks them). Each bad
flag of issue 21 in a real process: tests/test_cli_errors.py."""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from lmtail import cli
from lmtail.demo import synthetic

EXPECTED_OPTIONS = {
    "demo": ["--synthetic", "--max-new-tokens", "--ranks", "--threads", "--gbs", "--seed", "--vocab"],
    "generate": ["--prompt", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p",
                 "--seed", "--ranks", "--raw", "--threads", "--body"],
    "contract": ["--kinds", "--json", "--fast", "--ranks", "--decl"],
    "bench": ["--only", "--quick", "--list", "--markdown", "--dir"],
}
SMALL_DEMO = ["demo", "--synthetic", "--gbs", "2", "--vocab", "2048"]


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as ei:
        cli.main([*argv, "--help"])
    assert ei.value.code == 0
    return capsys.readouterr().out


def _module_options(module: str) -> list[str]:
    p = argparse.ArgumentParser()
    importlib.import_module(module).configure(p)
    return [s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


def test_top_level_help_lists_every_command(capsys):
    out = _help(capsys)
    for name in cli.COMMANDS:
        assert f"    {name} " in out, name


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_subcommand_help_names_its_options(capsys, name):
    out = _help(capsys, name)
    assert out.startswith(f"usage: lmtail {name}")
    opts = _module_options(cli.COMMANDS[name][0])
    assert set(EXPECTED_OPTIONS.get(name, [])) <= set(opts), name
    for opt in opts:
        assert opt in out, (name, opt)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--bogus"], "lmtail demo: error: unrecognized arguments: --bogus"),
    (["demo", "--synthetic", "extra"], "lmtail demo: error: unrecognized arguments: extra"),
    (["bench", "--quick=3"], "lmtail bench: error: argument --quick: ignored explicit argument '3'"),
    (["contract", "--ranks", "four"], "lmtail contract: error: argument --ranks: invalid int value: 'four'"),
    (["generate"], "lmtail generate: error: the following arguments are required: --prompt"),
    (["nosuchcommand"], "lmtail: error: argument <command>: invalid choice: 'nosuchcommand'"),
    ([], "lmtail: error: the following arguments are required: <command>"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
    """argparse's errors: one line naming the (sub)command, no usage dump, exit 2."""
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--synthetic", "--ranks", "2"], "--ranks not accepted by the synthetic demo"),
    (["demo", "--gbs", "2", "--seed", "1"], "--gbs, --seed not accepted by the model demo"),
    (["demo", "--synthetic", "--vocab", "100"], "--vocab: expected >= 256, got 100"),
    (["demo", "--synthetic", "--gbs", "0"], "--gbs: expected >= 1, got 0"),
    (["demo", "--ranks", "5"], "--ranks: expected a power of two in [1, 256] (the candidates exchange: dividing "
                               "the vocab 49152 and its 256 mass chunks), got 5"),
])
def test_demo_refuses_bad_options(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == f"lmtail demo: error: {message}\n", err


def test_demo_constants_match_the_demos():
    """The light command module's copies of the demos' shapes (it imports no torch)."""
    import lmtail.demo as demo

    assert (demo.SYNTHETIC_K, demo.SYNTHETIC_V) == (synthetic.K, synthetic.V)


def test_installed_entry_point_exit_codes():
    """A real process: the console script's module exits 2 on a bad flag, 0 on --help."""
    run = [sys.executable, "-m", "lmtail.cli"]
    bad = subprocess.run(run + ["demo", "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    ok = subprocess.run(run + ["bench", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "--only" in ok.stdout


# ---------------------------------------------------------------- only the invoked command is imported

def test_only_the_invoked_commands_module_is_imported(monkeypatch, tmp_path, capsys):
    """Planted: a command whose module fails on import. Every other command (and the top-level
    help) still works, so none of them imported it; invoking it raises its import error."""
    (tmp_path / "lmtail_cli_tripwire.py").write_text("raise ImportError('tripwire: imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "tripwire", ("lmtail_cli_tripwire", "imports nothing good"))
    assert "    tripwire " in _help(capsys)
    assert "--only" in _help(capsys, "bench")
    assert cli.main(["demo", "--ranks", "0"]) == 2
    with pytest.raises(ImportError, match="tripwire: imported"):
        cli.main(["tripwire"])


def test_check_runs_before_run(monkeypatch, capsys):
    """A command's check refuses before its run is called (the tripwire run never fires)."""
    import lmtail.demo as demo

    monkeypatch.setattr(demo, "run", lambda args: pytest.fail("run called after a refused check"))
    assert cli.main(["demo", "--threads", "-1"]) == 2
    assert capsys.readouterr().err == "lmtail demo: error: --threads: expected >= 0 (0: torch's default), got -1\n"


# ---------------------------------------------------------------- lmtail bench

def _bench_dir(tmp_path: Path) -> Path:
    (tmp_path / "bench_ok.py").write_text("import sys; print('ok ran', sys.argv[1:])\n")
    (tmp_path / "bench_bad.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "helper.py").write_text("raise SystemExit('not a benchmark')\n")
    return tmp_path


def test_bench_runs_each_script_and_reports_failures(tmp_path, capfd):
    d = str(_bench_dir(tmp_path))
    assert cli.main(["bench", "--dir", d, "--list"]) == 0
    listed = capfd.readouterr().out.split()
    assert listed[0::2] == ["bad", "ok"]
    assert cli.main(["bench", "--dir", d, "--only", "ok", "--quick"]) == 0
    assert "ok ran ['--quick']" in capfd.readouterr().out
    assert cli.main(["bench", "--dir", d]) == 1
    out, err = capfd.readouterr()
    assert "ok ran []" in out and "lmtail bench: bad exited 3" in err and "failed: bad" in err
    assert cli.main(["bench", "--dir", d, "--only", "helper"]) == 2
    assert capfd.readouterr().err == "lmtail bench: error: --only: expected one of ['bad', 'ok'], got ['helper']\n"


# ---------------------------------------------------------------- the synthetic demo

def test_synthetic_demo_prints_its_checks(capsys):
    assert cli.main(SMALL_DEMO) == 0
    out = capsys.readouterr().out
    assert "synthetic GPT-OSS shape: gbs=2, H=3072 (H_u=2880, interleaved pad), V=2048, k=256" in out
    assert "tokens, logprobs: IDENTICAL" in out and "ALL CHECKS PASS" in out
    for decision in ("emitted token", "argmax", "top-256 set"):
        assert decision in out


def test_synthetic_demo_fails_on_a_batch_dependent_tail(capsys, monkeypatch):
    """Planted: a tail whose logits depend on the batch size breaks solo == batch."""
    real = synthetic.tail

    def batch_dependent(x, gamma, w, sp):
        out = real(x, gamma, w, sp)
        if x.shape[0] > 1:
            return out
        return dataclasses.replace(out, logits=torch.nextafter(out.logits, torch.tensor(float("inf"))))

    monkeypatch.setattr(synthetic, "tail", batch_dependent)
    assert cli.main(SMALL_DEMO) == 1
    out = capsys.readouterr().out
    assert "tokens, logprobs: DIFFERENT" in out and "CHECKS FAILED" in out


def test_synthetic_demo_fails_on_a_wrong_certified_token(capsys, monkeypatch):
    """Planted: a tail that emits the runner-up fails the certified argmax rows."""
    real = synthetic.tail

    def runner_up(x, gamma, w, sp):
        out = real(x, gamma, w, sp)
        return dataclasses.replace(out, topk_indices=out.topk_indices[:, [1, 0, *range(2, out.topk_indices.shape[1])]])

    monkeypatch.setattr(synthetic, "tail", runner_up)
    assert cli.main(SMALL_DEMO) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "CHECKS FAILED" in out


@pytest.mark.slow
def test_synthetic_demo_default_shape_passes(capsys):
    assert cli.main(["demo", "--synthetic"]) == 0
    assert "IDENTICAL" in capsys.readouterr().out


def test_module_docstring_usage_names_real_options():
    """The usage lines in lmtail.demo's docstring name options the parser has."""
    import lmtail.demo as demo

    usage = textwrap.dedent(demo.__doc__)
    for opt in EXPECTED_OPTIONS["demo"]:
        assert opt in usage, opt


def test_contract_ranks_are_the_worlds_the_harness_lays_out():
    """`lmtail contract --ranks` accepts exactly the world sizes whose every rank layout tiles
    the world (rank_layouts: each VTP group of consecutive ranks divides it); 0 skips the gate.
    Planted: a world of 3 or 6 does not tile (VTP 2 / 4 groups would name ranks past the end)."""
    from lmtail.contract.cli import RANKS
    from lmtail.contract.tail_kinds import rank_layouts

    def tiles(world):
        lays = rank_layouts(world)
        return bool(lays) and all(world % vtp == 0 for _, vtp, *_ in lays)

    assert RANKS[0] == 0 and all(tiles(w) for w in RANKS[1:])
    assert [w for w in range(1, 9) if tiles(w)] == list(RANKS[1:])  # exactly these up to 8
    assert not tiles(3) and not tiles(6)
