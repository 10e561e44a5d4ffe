"""The `lmtail` command line: every subcommand's help names its options, bad input exits 2
with a message, a missing command module says so, and the synthetic demo prints its
checks (and fails them when a planted tail breaks them)."""
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
                 "--seed", "--ranks", "--raw", "--threads"],
    "contract": ["--kinds", "--json", "--fast", "--ranks", "--decl"],
    "bench": ["--only", "--quick", "--list", "--dir"],
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
    module = cli.COMMANDS[name][0]
    try:
        opts = _module_options(module)
    except ModuleNotFoundError:
        assert f"not available: module {module} not found" in out
        return
    assert set(EXPECTED_OPTIONS.get(name, [])) <= set(opts), name
    for opt in opts:
        assert opt in out, (name, opt)


@pytest.mark.parametrize("argv, message", [
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--quick=3"], "ignored explicit argument"),
    (["contract", "--ranks", "four"], "invalid int value: 'four'"),
    (["nosuchcommand"], "invalid choice: 'nosuchcommand'"),
    ([], "the following arguments are required: <command>"),
])
def test_bad_input_exits_2_with_a_message(capsys, argv, message):
    with pytest.raises(SystemExit) as ei:
        cli.main(argv)
    assert ei.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--synthetic", "--ranks", "2"], "--ranks not accepted by the synthetic demo"),
    (["demo", "--gbs", "2", "--seed", "1"], "--gbs, --seed not accepted by the model demo"),
    (["demo", "--synthetic", "--vocab", "100"], "expected --vocab >= 256 and --gbs >= 1, got --vocab 100"),
])
def test_demo_refuses_the_other_demos_options(capsys, argv, message):
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_installed_entry_point_exit_codes():
    """A real process: the console script's module exits 2 on a bad flag, 0 on --help."""
    run = [sys.executable, "-m", "lmtail.cli"]
    bad = subprocess.run(run + ["demo", "--bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unrecognized arguments: --bogus" in bad.stderr
    ok = subprocess.run(run + ["bench", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "--only" in ok.stdout


# ---------------------------------------------------------------- missing / broken modules

def test_missing_command_module_says_so_and_exits_2(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "later", ("lmtail.no_such_module", "arrives later"))
    assert cli.main(["later", "--any", "flags"]) == 2
    assert ("lmtail later: not available in this checkout (module lmtail.no_such_module not found)"
            in capsys.readouterr().err)
    assert "[not available: module lmtail.no_such_module not found]" in " ".join(_help(capsys).split())


def test_broken_command_module_fails_only_its_own_command(monkeypatch, tmp_path, capsys):
    """A module that exists but imports something missing is a bug, not 'not available':
    invoking it re-raises; the other commands still parse."""
    (tmp_path / "lmtail_cli_broken_mod.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS, "broken", ("lmtail_cli_broken_mod", "has a bug"))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        cli.main(["broken"])
    assert "--only" in _help(capsys, "bench")


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
    assert "--only: expected one of ['bad', 'ok'], got ['helper']" in capfd.readouterr().err


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
