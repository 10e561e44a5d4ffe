"""Every bad flag of issue 21, each in its own process running `python -m lmtail.cli`: exit
status 2, exactly one line on stderr starting `lmtail <cmd>: error:` and naming the flag, no
traceback, and no heavy work first (no model load, contract run, rank spawn, benchmark or A/B
round): each run takes under 3 s (on a machine where `import lmtail` takes 1.5 s; a loaded
machine's slower import scales the bound by the same ratio).

The processes are forked from one driver that has imported lmtail once; each child then
runs the module as __main__ (runpy, argv set), exactly what `python -m lmtail.cli ARGS` runs
after the interpreter's start. So the 3 s bound times the command's own work (its module's
import and its checks), not the shared interpreter + torch start, which on a loaded 2-core box
alone can take longer; tests/test_cli.py runs the real console entry cold."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

LIMIT_S = 3.0  # per command, on a machine where `import lmtail` takes IDLE_IMPORT_S or less
IDLE_IMPORT_S = 1.5  # a loaded machine (the driver's import slower than this) scales LIMIT_S by the ratio

DRIVER = r"""
import io, json, os, runpy, sys, time
t0 = time.perf_counter()
import lmtail  # the shared start: interpreter, torch, the package (not lmtail.cli: runpy runs it)
print(json.dumps({"import_s": time.perf_counter() - t0}), flush=True)
cases = json.loads(sys.argv[1])
for argv in cases:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: `python -m lmtail.cli *argv`
        os.dup2(out_w, 1); os.dup2(err_w, 2)
        sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), write_through=True)
        sys.argv = ["lmtail", *argv]
        code = 0
        try:
            runpy.run_module("lmtail.cli", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(out_w); os.close(err_w)
    with os.fdopen(out_r, "rb") as fo, os.fdopen(err_r, "rb") as fe:
        stdout, stderr = fo.read(), fe.read()  # small outputs: reading one after the other is safe
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"argv": argv, "rc": os.waitstatus_to_exitcode(status), "wall": time.perf_counter() - t0,
                      "stdout": stdout.decode(errors="replace"), "stderr": stderr.decode(errors="replace")}),
          flush=True)
"""


def cases(tmp: Path, busy_port: int) -> list[tuple[list[str], str]]:
    """(argv, a substring the error line must contain) for each bad flag (busy_port: a port a
    socket of the test listens on)."""
    a_file = tmp / "a_file"
    a_file.write_text("not a folder\n")
    (tmp / "broken_arms.py").write_text("raise RuntimeError('this arm module is broken')\n")
    return [
        (["demo", "--ranks", "0"], "--ranks: expected a power of two in [1, 256]"),
        (["demo", "--max-new-tokens", "0"], "--max-new-tokens: expected in [1, 8191]"),
        (["demo", "--threads", "-1"], "--threads: expected >= 0 (0: torch's default), got -1"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["contract", "--ranks", "3"], "--ranks: expected one of 0, 2, 4, 8"),
        (["contract", "--ranks", "-1"], "--ranks: expected one of 0, 2, 4, 8"),
        (["contract", "--json", "/nonexistent_lmtail_dir/c.json"], "--json: the folder '/nonexistent_lmtail_dir'"),
        (["receipt", "--arms", "nosuch"], "--arms: unknown arm 'nosuch'"),
        (["receipt", "--compare", "bad"], "--compare must be ARM:BASE[:PLACEBO]; got 'bad'"),
        (["receipt", "--compare", "chain:nosuch"], "--compare: unknown arm 'nosuch'"),
        (["receipt", "--texts", "0"], "--texts: expected an int >= 1, got 0"),
        (["receipt", "--model", str(tmp / "missing.gguf")], "--model: no GGUF file at"),
        (["receipt", "--out", str(a_file / "receipt")], "--out: cannot write"),
        # permission bits pass for root on a read-only mount: the check writes, it does not infer
        (["receipt", "--out", "/proc/lmtail_receipt"], "--out: cannot write '/proc/lmtail_receipt'"),
        (["generate", "--prompt", "hi", "--body", "quant", "--ranks", "2"], "--body: the quant body runs on 1 rank"),
        (["contract", "--json", "/proc/lmtail_c.json"], "--json: cannot write '/proc/lmtail_c.json'"),
        (["receipt", "--arm-module", "no_such_arm_module_xyz"], "--arm-module: cannot import 'no_such_arm_module_xyz'"),
        (["receipt", "--arm-module", "broken_arms"], "RuntimeError: this arm module is broken"),
        (["ab", "--a", "true", "--b", "true", "--rounds", "0"], "--rounds: expected an int >= 1, got 0"),
        (["ab", "--a", "exit 7", "--b", "true", "--warmup", "0", "--rounds", "1", "--repeat", "1"],
         "arm A command 'exit 7' exited 7"),
        (["bench", "--dir", "/nonexistent_lmtail_dir"], "--dir: expected a folder of bench_<name>.py scripts"),
        (["bench", "--dir", str(tmp)], "--dir: no bench_<name>.py script in"),
        (["generate", "--prompt", "", "--raw"], "--prompt: with --raw every prompt must be non-empty"),
        (["generate", "--prompt", "hi", "--ranks", "5"], "--ranks: expected a power of two in [1, 256]"),
        (["generate", "--prompt", "hi", "--ranks", "5", "--exchange", "mirror"],
         "--ranks: expected an int >= 1 dividing the vocab 49152, got 5"),
        # issue 32: the candidates exchange's ranks refused up front (it was 3 spawned ranks dying)
        (["generate", "--prompt", "Hi", "--ranks", "3"], "--ranks: expected a power of two in [1, 256] (the "
         "candidates exchange: dividing the vocab 49152 and its 256 mass chunks; --exchange mirror"),
        (["demo", "--ranks", "3"], "--ranks: expected a power of two in [1, 256] (the candidates exchange"),
        # issue 32: demo and generate take the same ranges for the flags they share
        (["generate", "--prompt", "hi", "--threads", "-1"], "--threads: expected >= 0 (0: torch's default), got -1"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "8192"], "--max-new-tokens: expected in [1, 8191]"),
        (["demo", "--max-new-tokens", "8192"], "--max-new-tokens: expected in [1, 8191]"),
        (["demo", "--synthetic", "--seed", str(2**64)], "--seed: expected in [0, 2**64 - 1]"),
        (["generate", "--prompt", "hi", "--seed", str(2**64)], "--seed: expected in [0, 2**64 - 1]"),
        # issue 32: a busy port is refused before the model loads (it was ~12 s, then uvicorn's errno 98)
        (["serve", "--port", str(busy_port)], f"--port: 127.0.0.1:{busy_port} is in use"),
        (["generate", "--prompt", "hi", "--exchange", "bf16"], "argument --exchange: invalid choice: 'bf16'"),
        (["generate", "--prompt", "hi", "--head-input", "fp16"], "argument --head-input: invalid choice: 'fp16'"),
        (["serve", "--exchange", "all"], "argument --exchange: invalid choice: 'all'"),
        (["serve", "--ranks", "3"], "--ranks must be a power of two in [1, 256]"),
    ]


def run_forked(argvs: list[list[str]], cwd: Path) -> tuple[list[dict], float]:
    """({argv, rc, wall, stdout, stderr} of `python -m lmtail.cli *argv` for each argv (DRIVER),
    the time bound: LIMIT_S, scaled up by the load the driver's own `import lmtail` saw)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(cwd), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(argvs)], capture_output=True, text=True,
                       timeout=600, cwd=cwd, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    first, *rest = [json.loads(line) for line in r.stdout.splitlines()]
    return rest, LIMIT_S * max(1.0, first["import_s"] / IDLE_IMPORT_S)


def problems(argv: list[str], needle: str, r: dict, bound: float = LIMIT_S) -> list[str]:
    """What is wrong with a bad flag's run (empty: exit 2, one line naming it, fast)."""
    lines = r["stderr"].splitlines()
    prefix = f"lmtail {argv[0]}: error: "
    return [what for what, broken in [
        (f"exit {r['rc']}", r["rc"] != 2),
        (f"{len(lines)} stderr lines", len(lines) != 1),
        (f"no {prefix!r}", not (lines and lines[0].startswith(prefix))),
        (f"no {needle!r}", not (lines and needle in lines[0])),
        ("a traceback", "Traceback" in r["stderr"] + r["stdout"]),
        (f"{r['wall']:.1f} s > {bound:.1f} s", r["wall"] > bound),
    ] if broken]


def test_every_bad_flag_is_one_line_exit_2_before_any_work(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        todo = cases(tmp_path, busy.getsockname()[1])
        got, bound = run_forked([argv for argv, _ in todo], tmp_path)
    assert len(got) == len(todo)
    bad = [f"lmtail {' '.join(argv)}: {', '.join(found)}; stderr: {r['stderr'][-400:]!r}"
           for (argv, needle), r in zip(todo, got) if (found := problems(argv, needle, r, bound))]
    assert not bad, "\n".join(bad)


PLANTED = """
import time
import lmtail.demo as demo

def run(args):  # planted: the checks moved into run, after its work
    time.sleep(0.5)  # the 'heavy work'
    raise ValueError(f"--ranks: expected an int >= 1, got {args.ranks}")

demo.check = lambda args: None
demo.run = run
"""


def test_a_check_that_comes_too_late_is_caught(tmp_path):
    """Planted: `lmtail demo` with its checks moved into run, after its work: the flag error
    surfaces as a traceback and the criteria go red (exit 1, a traceback, several lines, over
    the time bound)."""
    (tmp_path / "sitecustomize.py").write_text(PLANTED)  # the driver's interpreter runs it at start
    (r,), _ = run_forked([["demo", "--ranks", "0"]], tmp_path)
    found = problems(["demo"], "--ranks: expected", r, bound=0.4)
    assert {"exit 1", "a traceback"} <= set(found), (found, r)
    assert any(f.endswith("stderr lines") for f in found) and any(" s > " in f for f in found), found
