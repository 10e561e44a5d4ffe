"""`lmtail ab --a CMD --b CMD [--rounds N]`: a paired, alternating A/B of two commands.

Round r runs A then B when r is even, B then A when odd (A B B A A B ...), each in a fresh
process (CMD's argv, or `sh -c CMD` when it has shell syntax), after `--warmup` unrecorded A, B runs. With `--repeat K` a round
runs its pair K times (A B A B ... or B A B A ...) and keeps, per arm and metric, the best
of its K runs: a loaded scheduler only ever ADDS delay to a run (on this 2-core machine
shared by many jobs, 2-50 ms on a 0.2 s sleep, in 4 ms ticks), so the best of K is the
least disturbed run. Every run is timed from outside (metric `wall_s`); when its last
non-empty stdout line is a JSON object, its numeric entries are metrics too. Per metric,
over the rounds:
    ratio_r  = B_r / A_r                                the paired per-round ratio
    level    |ratio_r - 1| <= tol                       (a stated tolerance, DEFAULT_TOL = 2%)
    B wins   ratio_r < 1 - tol when lower is better (ratio_r > 1 + tol when higher is)
    sign p   two-sided sign test of B wins vs A wins (level rounds dropped)
    verdict  "B faster" / "B slower" when sign p < alpha and the median ratio is past the
             tolerance on the same side; "level" when the median ratio is within the
             tolerance and sign p >= alpha; otherwise "no verdict".
Lower is better for every metric except those named by --higher-better (and names
ending in "per_s", "tok_s" or "throughput").

Shape legend: none (command lines and per-round lists).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

from ..checks import writable_file

HIGHER_SUFFIXES = ("per_s", "tok_s", "throughput")
DEFAULT_TOL = 0.02  # a paired ratio within 2% of 1 counts as level (neither arm wins the round)


@dataclass(frozen=True)
class MetricAB:
    """One metric's paired A/B summary (see module docstring)."""

    name: str
    higher_better: bool
    a: tuple[float, ...]  # per round
    b: tuple[float, ...]
    ratios: tuple[float, ...]  # B / A per round
    median_ratio: float
    b_wins: int
    a_wins: int
    level: int
    sign_p: float
    verdict: str


def argv_of(cmd: str) -> list[str]:
    """The command's argv: split directly when it has no shell syntax and names a program
    on PATH (one exec fewer per run, less startup noise), else `sh -c cmd`."""
    if any(c in cmd for c in "|&;<>()$`\\\"'*?[]#~=%{}\n"):
        return ["sh", "-c", cmd]
    argv = shlex.split(cmd)
    return argv if argv and shutil.which(argv[0]) else ["sh", "-c", cmd]  # builtins go to sh


class CommandFailed(RuntimeError):
    """An arm's command exited non-zero: which arm, the command, its exit status and the
    last line it wrote to stderr."""

    def __init__(self, arm: str, cmd: str, status: int, stderr: str):
        last = next((ln.strip() for ln in reversed(stderr.splitlines()) if ln.strip()), "")
        super().__init__(f"arm {arm} command {cmd!r} exited {status}" + (f" (stderr: {last[-300:]})" if last else ""))
        self.arm, self.cmd, self.status, self.stderr = arm, cmd, status, stderr


def run_once(cmd: str, *, timeout: float | None = None, arm: str = "") -> dict[str, float]:
    """Run cmd in a fresh process: {"wall_s": seconds, **the JSON metrics of its last
    non-empty stdout line}. CommandFailed (naming `arm`, the command and its exit status)
    when it exits non-zero."""
    argv = argv_of(cmd)
    t0 = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise CommandFailed(arm, cmd, r.returncode, r.stderr)
    out = {"wall_s": wall}
    lines = [ln for ln in r.stdout.splitlines() if ln.strip()]
    if lines:
        try:
            obj = json.loads(lines[-1])
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            out.update({k: float(v) for k, v in obj.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "wall_s"})
    return out


def schedule(rounds: int) -> list[tuple[str, str]]:
    """The run order per round: ("a", "b") on even rounds, ("b", "a") on odd ones."""
    return [("a", "b") if r % 2 == 0 else ("b", "a") for r in range(rounds)]


def summarize(name: str, a: list[float], b: list[float], *, tol: float, alpha: float,
              higher_better: bool) -> MetricAB:
    """MetricAB of paired per-round values a, b (same length >= 1)."""
    from .stats import sign_test  # scipy: imported on first use, so `lmtail ab`'s flag checks stay light

    ratios = [y / x if x else math.inf for x, y in zip(a, b)]
    level = sum(abs(r - 1) <= tol for r in ratios)
    up = sum(r > 1 + tol for r in ratios)
    down = sum(r < 1 - tol for r in ratios)
    b_wins, a_wins = (up, down) if higher_better else (down, up)
    med = statistics.median(ratios)
    p = sign_test(b_wins, a_wins)
    b_better = med > 1 + tol if higher_better else med < 1 - tol
    b_worse = med < 1 - tol if higher_better else med > 1 + tol
    if p < alpha and b_wins > a_wins and b_better:
        verdict = "B faster"
    elif p < alpha and a_wins > b_wins and b_worse:
        verdict = "B slower"
    elif abs(med - 1) <= tol and p >= alpha:
        verdict = "level"
    else:
        verdict = "no verdict"
    return MetricAB(name, higher_better, tuple(a), tuple(b), tuple(ratios), med, b_wins, a_wins, level, p, verdict)


def best_of(runs: list[dict[str, float]], higher: Callable[[str], bool]) -> dict[str, float]:
    """Per metric present in every run: the max (higher is better) or min of the runs."""
    names = [m for m in runs[0] if all(m in r for r in runs)]
    return {m: (max if higher(m) else min)(r[m] for r in runs) for m in names}


def ab(cmd_a: str, cmd_b: str, *, rounds: int = 12, repeat: int = 3, warmup: int = 1, tol: float = DEFAULT_TOL,
       alpha: float = 0.05, higher_better: tuple[str, ...] = (), timeout: float | None = None,
       progress=None) -> list[MetricAB]:
    """Run the A/B (module docstring) and summarize every metric both arms printed."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1; got {rounds}")
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1; got {repeat}")
    if not 0 <= tol < 1:
        raise ValueError(f"tol must be in [0, 1); got {tol}")
    cmds = {"a": cmd_a, "b": cmd_b}
    for _ in range(warmup):
        for k in ("a", "b"):
            run_once(cmds[k], timeout=timeout, arm=k.upper())
    def higher(m: str) -> bool:
        return m in higher_better or m.endswith(HIGHER_SUFFIXES)

    got = {"a": [], "b": []}
    for r, order in enumerate(schedule(rounds)):
        runs = {"a": [], "b": []}
        for _ in range(repeat):
            for k in order:
                runs[k].append(run_once(cmds[k], timeout=timeout, arm=k.upper()))
        for k in runs:
            got[k].append(best_of(runs[k], higher))
        if progress:
            progress(r)
    names = [m for m in got["a"][0] if all(m in x for x in got["a"] + got["b"])]
    return [summarize(m, [x[m] for x in got["a"]], [x[m] for x in got["b"]], tol=tol, alpha=alpha,
                      higher_better=higher(m)) for m in names]


def format_ab(results: list[MetricAB], *, cmd_a: str, cmd_b: str, tol: float, repeat: int = 1) -> str:
    """Markdown table of an A/B."""
    n = len(results[0].ratios) if results else 0
    lines = [f"A: `{cmd_a}`  ", f"B: `{cmd_b}`  ",
             f"{n} rounds, alternating A B B A, a fresh process per run, best of {repeat} runs per arm "
             f"and round; level = within ±{100 * tol:g}%; sign p: two-sided sign test of the won rounds", "",
             "| metric | A median | B median | paired median B/A | B wins | A wins | level | sign p | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in results:
        lines.append(f"| {m.name} ({'higher' if m.higher_better else 'lower'} is better) | "
                     f"{statistics.median(m.a):.4g} | {statistics.median(m.b):.4g} | "
                     f"{100 * (m.median_ratio - 1):+.2f}% | {m.b_wins} | {m.a_wins} | {m.level} | "
                     f"{m.sign_p:.3g} | **{m.verdict}** |")
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    """The `lmtail ab` options, added to `parser`."""
    parser.description = __doc__.split("\n\n")[0]
    parser.add_argument("--a", required=True, metavar="CMD", help="arm A's shell command (the base)")
    parser.add_argument("--b", required=True, metavar="CMD", help="arm B's shell command")
    parser.add_argument("--rounds", type=int, default=12, help="paired rounds (default 12)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each arm per round; the round keeps each arm's best (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="unrecorded A, B runs first (default 1)")
    parser.add_argument("--tol", type=float, default=DEFAULT_TOL,
                        help=f"level tolerance on a ratio (default {DEFAULT_TOL})")
    parser.add_argument("--alpha", type=float, default=0.05, help="sign-test level (default 0.05)")
    parser.add_argument("--higher-better", action="append", default=[], metavar="METRIC",
                        help="a metric where higher is better (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the per-round values as JSON")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag (expected vs got) for anything ab cannot take, before any
    command runs."""
    rules = [("--rounds", args.rounds, args.rounds >= 1, "an int >= 1"),
             ("--repeat", args.repeat, args.repeat >= 1, "an int >= 1"),
             ("--warmup", args.warmup, args.warmup >= 0, "an int >= 0"),
             ("--tol", args.tol, 0 <= args.tol < 1, "in [0, 1)"),
             ("--alpha", args.alpha, 0 < args.alpha < 1, "in (0, 1)"),
             ("--a", repr(args.a), bool(args.a.strip()), "a command"),
             ("--b", repr(args.b), bool(args.b.strip()), "a command")]
    for flag, value, ok, expected in rules:
        if not ok:
            raise ValueError(f"{flag}: expected {expected}, got {value}")
    if args.json is not None:
        writable_file("--json", args.json)


def run(args: argparse.Namespace) -> int:
    """Run the A/B, print its table (and write --json); 2 with one line when an arm's command
    fails (naming the arm, the command and its exit status)."""
    try:
        res = ab(args.a, args.b, rounds=args.rounds, repeat=args.repeat, warmup=args.warmup, tol=args.tol,
                 alpha=args.alpha, higher_better=tuple(args.higher_better),
                 progress=lambda r: print(f"round {r + 1}/{args.rounds}", file=sys.stderr))
    except CommandFailed as e:
        print(f"lmtail ab: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(format_ab(res, cmd_a=args.a, cmd_b=args.b, tol=args.tol, repeat=args.repeat))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"a": args.a, "b": args.b, "tol": args.tol, "alpha": args.alpha, "repeat": args.repeat,
                       "metrics": [dataclasses.asdict(m) for m in res]}, f, indent=1)
    return 0
