"""Issue 32's command-line cases (the bad flags themselves are in tests/test_cli_errors.py):

  * a base install (no extras): every command that needs an extra says so in one line naming
    `pip install 'lmtail[<extra>]'`, exit 2, before any work (it was a ModuleNotFoundError
    traceback); run in real processes whose imports of the extras' packages fail;
  * `--help` of every command shows each option's default;
  * `lmtail generate` says when a row stopped at --max-new-tokens, and which seed a sampled run
    used: a random one when --seed is not given (it was always 0, silently), which --seed
    then repeats; a greedy run prints no seed;
  * the --ranks rule of generate / demo is the library's own (candidates.check_vtp).

The tests drive the CLI (subprocesses, or lmtail.cli.main in-process), so against a tree
without these fixes they fail on the behaviour, not on an import."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmtail import cli

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_cli_errors import problems, run_forked  # noqa: E402  (the forked one-line checker)

BLOCK = """
import sys
BLOCKED = {"gguf", "tokenizers", "rich", "scipy", "starlette", "uvicorn", "matplotlib", "numba"}

class NotInstalled:  # a base install: the extras' packages cannot be found
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
"""

BASE_INSTALL = [  # (argv, the line's end), issue 32 item 2
    (["generate", "--prompt", "Hi"], "gguf, tokenizers, rich not installed (`lmtail generate` needs them): "
                                     "pip install 'lmtail[model]'"),
    (["demo"], "gguf, tokenizers, rich not installed (`lmtail demo` needs them): pip install 'lmtail[model]'"),
    (["demo", "--synthetic"], "rich not installed (`lmtail demo --synthetic` needs it): pip install 'lmtail[model]'"),
    (["contract", "--fast"], "rich not installed (`lmtail contract` needs it): pip install 'lmtail[contract]'"),
    (["receipt", "--quick"], "not installed (`lmtail receipt` needs them): pip install 'lmtail[model,receipts]'"),
    (["ab", "--a", "true", "--b", "true"],
     "scipy not installed (`lmtail ab` needs it): pip install 'lmtail[receipts]'"),
    (["serve"], "gguf, tokenizers, starlette, uvicorn not installed (`lmtail serve` needs them): "
                "pip install 'lmtail[serve]'"),
]


def test_base_install_names_the_extra_in_one_line(tmp_path):
    (tmp_path / "sitecustomize.py").write_text(BLOCK)
    got, bound = run_forked([argv for argv, _ in BASE_INSTALL], tmp_path)
    bad = [f"lmtail {' '.join(argv)}: {', '.join(found)}; stderr: {r['stderr'][-300:]!r}"
           for (argv, needle), r in zip(BASE_INSTALL, got) if (found := problems(argv, needle, r, bound))]
    assert not bad, "\n".join(bad)


def test_an_installed_extra_is_not_refused(tmp_path):
    """The other side: only what is missing is named (rich present: the synthetic demo passes
    the check and runs; planted: blocking rich alone makes it refuse)."""
    (tmp_path / "sitecustomize.py").write_text(BLOCK.replace('"rich", ', ""))
    (r,), _ = run_forked([["demo", "--synthetic", "--gbs", "1", "--vocab", "512"]], tmp_path)
    assert r["rc"] == 0 and "lmtail demo: error" not in r["stderr"], r["stderr"][-500:]
    (tmp_path / "sitecustomize.py").write_text(BLOCK.replace("BLOCKED = {", 'BLOCKED = {"rich"} or {'))
    (r,), _ = run_forked([["demo", "--synthetic", "--gbs", "1", "--vocab", "512"]], tmp_path)
    assert r["rc"] == 2 and "rich not installed" in r["stderr"], r["stderr"][-500:]


# ---------------------------------------------------------------- --help shows the defaults

def option_blocks(help_text: str) -> dict[str, str]:
    """--option -> its lines of `--help` (up to the next option)."""
    blocks, current = {}, None
    for line in help_text.splitlines():
        m = re.match(r"  (-\w, )?(--[\w-]+)", line)
        if m:
            current = m.group(2)
            blocks[current] = ""
        if current:
            blocks[current] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("name", list(cli.COMMANDS))
def test_help_shows_every_default(capsys, name):
    """Every option whose default is a value (not None, not a flag's False) names it in --help."""
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    blocks = option_blocks(capsys.readouterr().out)
    p = argparse.ArgumentParser()
    importlib.import_module(cli.COMMANDS[name][0]).configure(p)
    want = {a.option_strings[-1]: a.default for a in p._actions if a.option_strings
            and a.default is not None and a.default is not False and a.default != argparse.SUPPRESS}
    missing = {opt: d for opt, d in want.items() if not re.search(r"\bdefault\b", blocks.get(opt, ""))}
    assert not missing, f"lmtail {name} --help shows no default for {missing}"
    if name == "generate":
        assert "(default: 64)" in blocks["--max-new-tokens"] and "(default: 0)" in blocks["--threads"]


# ---------------------------------------------------------------- generate: the token limit, the seed

@pytest.fixture(scope="module")
def model_ready():
    from lmtail.model.gguf_loader import ModelFileMissing, locate_gguf

    try:
        locate_gguf()
    except ModelFileMissing as e:
        pytest.skip(str(e))


def generate(capsys, *argv) -> tuple[str, str]:
    """(stdout, stderr) of `lmtail generate ARGV`, in-process (the model loads once)."""
    threads = torch.get_num_threads()
    try:
        assert cli.main(["generate", "--threads", "1", *argv]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr()
    return out.out, out.err


def test_generate_says_it_stopped_at_the_token_limit(capsys, model_ready):
    out, err = generate(capsys, "--prompt", "Write a long story about the sea.", "--max-new-tokens", "4")
    assert "stopped at the token limit in row 0 (--max-new-tokens 4" in err, err
    assert "seed" not in err  # greedy: no draw, no seed line


def test_generate_prints_and_repeats_a_random_seed(capsys, model_ready):
    """A sampled run without --seed draws a seed and prints it; two such runs differ in seed;
    --seed with the printed one gives the same text again."""
    argv = ["--prompt", "Tell me a joke.", "--max-new-tokens", "6", "--temperature", "1.0"]
    runs = [generate(capsys, *argv) for _ in range(2)]
    seeds = [re.search(r"^seed (\d+) \(sampled", err, re.M) for _, err in runs]
    assert all(seeds), [err for _, err in runs]
    assert seeds[0].group(1) != seeds[1].group(1)  # 1 in 2**31 to collide
    again, err = generate(capsys, *argv, "--seed", seeds[0].group(1))
    assert again == runs[0][0] and f"seed {seeds[0].group(1)} (sampled" in err


def test_limit_note_rows():
    from lmtail.model.generate_cli import limit_note

    assert limit_note((True, True), 8) is None
    assert limit_note((False,), 8).startswith("stopped at the token limit in row 0 (--max-new-tokens 8;")
    assert limit_note((False, True, False), 5).startswith("stopped at the token limit in rows 0, 2 (")


# ---------------------------------------------------------------- the --ranks rule is the library's

def test_ranks_rule_is_the_candidates_exchanges():
    from lmtail.tail.candidates import check_vtp
    from lmtail.flags import SMOLLM2_VOCAB, ranks_ok

    def library_takes(r):
        try:
            check_vtp(r)
            return SMOLLM2_VOCAB % r == 0
        except ValueError:
            return False

    for r in range(1, 600):
        assert ranks_ok(r, "candidates") == library_takes(r), r
        assert ranks_ok(r, "mirror") == (SMOLLM2_VOCAB % r == 0), r
    assert [r for r in range(1, 600) if ranks_ok(r, "candidates")] == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_generate_ranks_3_with_mirror_passes_the_check():
    """The rule follows --exchange: 3 ranks divide the vocab, so the mirror exchange takes them."""
    from lmtail.model import generate_cli

    p = argparse.ArgumentParser()
    generate_cli.configure(p)
    generate_cli.check(p.parse_args(["--prompt", "hi", "--ranks", "3", "--exchange", "mirror"]))
    with pytest.raises(ValueError, match=r"--ranks: expected a power of two in \[1, 256\].*, got 3"):
        generate_cli.check(p.parse_args(["--prompt", "hi", "--ranks", "3"]))


def test_sampled_is_the_tails_rule():
    """generate prints a seed exactly when the tail samples: float64(fp32(T)) >= 1e-5 (the rule of
    reference/contract.py and rows_tail.c); fp32(1e-5) itself is just below it: greedy."""
    import numpy as np

    from lmtail.flags import fp32_sampled
    from lmtail.reference.contract import GREEDY_T

    t = np.float32(GREEDY_T)
    for temp in [0.0, 1e-6, float(t), float(np.nextafter(t, np.float32(1))), 1e-5, 2e-5, 0.7, 1.0, 1e300]:
        assert fp32_sampled(temp) == (float(np.float32(min(temp, 3e38))) >= GREEDY_T), temp
    assert not fp32_sampled(1e-5) and fp32_sampled(1e300)


def test_demo_max_new_tokens_past_the_context_is_one_line(capsys, model_ready):
    """The demo's prompts + --max-new-tokens must fit the context: refused from the file's tokenizer,
    before the full load and any run."""
    threads = torch.get_num_threads()
    try:
        assert cli.main(["demo", "--max-new-tokens", "8191"]) == 2
    finally:
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert re.fullmatch(r"lmtail demo: error: --max-new-tokens: expected at most \d+ \(the longest demo prompt "
                        r"is \d+ tokens of the 8192-token context\), got 8191\n", err), err


def test_port_free_leaves_the_port_bindable():
    """The busy-port check binds and closes a test socket: a free port stays free for uvicorn
    right after (SO_REUSEADDR as uvicorn binds), a listening one is refused, port 0 always passes."""
    import socket

    from lmtail.serve.cli import port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    port_free("127.0.0.1", port)
    with socket.socket() as again:
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", port))
        again.listen()
        with pytest.raises(ValueError, match=rf"^--port: 127.0.0.1:{port} is in use \(another server listens there\)"):
            port_free("127.0.0.1", port)
    port_free("127.0.0.1", 0)
