"""`lmtail contract`: every kind through its gates, every planted control, one table.

    lmtail contract [--kinds PATTERN] [--json PATH] [--fast] [--ranks N] [--decl]

Exit code 0 only if every gate of every selected kind passes AND every control is red at
its planted gate (a control that passes means the harness is broken). --fast is the
test-suite subset (docs/contract.md); the full run adds seeds, slow shapes, every gate for
every control and the ranks gate (N = 4 gloo ranks by default; 0 skips it, 2 runs VTP 2
only, 8 adds VTP 8: the world sizes lmtail.contract.tail_kinds.rank_layouts lays out).
configure / check / run: the protocol of lmtail.cli.

Shape legend: none (a report).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

from ..checks import writable_file
from .harness import GATES, Config, fmt_margin

RANKS = (0, 2, 4, 8)  # --ranks: 0 skips the ranks gate; the others are the worlds rank_layouts supports


def configure(p: argparse.ArgumentParser) -> None:
    """The `lmtail contract` options, added to `p`."""
    p.description = __doc__.split("\n\n")[0]
    p.add_argument("--kinds", default=None, help="comma-separated fnmatch patterns or substrings (default: all)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the full results as JSON")
    p.add_argument("--fast", action="store_true", help="the test-suite subset (well under a minute)")
    p.add_argument("--ranks", type=int, default=None,
                   help=f"world size of the ranks gate, one of {', '.join(map(str, RANKS))} "
                        "(default 4; with --fast 0: skip it)")
    p.add_argument("--decl", action="store_true", help="print each kind's declaration")
    p.add_argument("--list", action="store_true",
                   help="print the count and names of the kinds and controls (--kinds filters), run nothing")


def _cell(g):
    if g is None or g.ok is None:
        return "[dim]-[/dim]"
    return "[green]pass[/green]" if g.ok else "[bold red]FAIL[/bold red]"


def kinds_table(results, gates):
    from rich.table import Table

    t = Table(title="numerics contract: kinds x gates", title_justify="left")
    t.add_column("kind", no_wrap=True)
    for g in gates:
        t.add_column(g, justify="center")
    t.add_column("worst margin", justify="right")
    t.add_column("cases", justify="right")
    t.add_column("s", justify="right")
    for r in results:
        unit = r.unit if r.margin is not None else ""
        t.add_row(r.kind, *[_cell(r.gates.get(g)) for g in gates], f"{fmt_margin(r.margin)} {unit}".strip(),
                  str(sum(g.cases for g in r.gates.values())), f"{sum(g.seconds for g in r.gates.values()):.1f}")
    return t


def controls_table(results):
    from rich.table import Table

    t = Table(title="planted controls (each must be RED at its planted gate)", title_justify="left")
    for c in ("control", "kind", "planted", "result", "red gates", "what"):
        t.add_column(c, no_wrap=c in ("control", "kind", "planted", "result"))
    for r in results:
        c = r.control
        if r.red_as_planted:
            res = "[green]RED as planted[/green]"
        elif r.red_gates:
            res = "[bold red]red elsewhere[/bold red]"
        else:
            res = "[bold red]PASSED (harness broken)[/bold red]"
        t.add_row(c.name, c.kind, c.planted, res, ", ".join(r.red_gates) or "-", c.what)
    return t


def failures(kind_results, ctl_results):
    lines = []
    for r in kind_results:
        for g in r.gates.values():
            if g.ok is False:
                lines.append(f"FAIL {r.kind} / {g.gate}: {g.detail}")
    for r in ctl_results:
        if not r.red_as_planted:
            lines.append(f"CONTROL {r.control.name} not red at {r.control.planted} (red: {r.red_gates or 'none'})")
    return lines


def to_json(out, cfg, seconds) -> dict:
    def gate(g):
        m = g.margin
        return {"ok": g.ok, "cases": g.cases, "margin": None if m is None or not math.isfinite(m) else m,
                "detail": g.detail, "counts": g.counts, "seconds": round(g.seconds, 3)}

    return {
        "config": {"fast": cfg.fast, "ranks": cfg.ranks, "threads": list(cfg.threads)}, "seconds": round(seconds, 1),
        "kinds": [{"kind": r.kind, "group": r.group, "ok": r.ok, "worst_margin": r.margin, "unit": r.unit,
                   "decl": None if r.decl is None else {"op": r.decl.op, "rounding_points": list(r.decl.rounding_points),
                                                        "sums": [s.__dict__ for s in r.decl.sums]},
                   "gates": {n: gate(g) for n, g in r.gates.items()}} for r in out["kinds"]],
        "controls": [{"control": r.control.name, "kind": r.control.kind, "planted": r.control.planted,
                      "what": r.control.what, "red_as_planted": r.red_as_planted, "red_gates": r.red_gates,
                      "gates": {n: gate(g) for n, g in r.gates.items()}} for r in out["controls"]],
    }


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag for anything run cannot take: --ranks outside RANKS, a
    --json path that cannot be written (before the run, not after it)."""
    if args.ranks is not None and args.ranks not in RANKS:
        raise ValueError(f"--ranks: expected one of {', '.join(map(str, RANKS))} (0 skips the ranks gate), "
                         f"got {args.ranks}")
    if args.json is not None:
        writable_file("--json", args.json)


def main(argv=None) -> int:
    """`lmtail contract` on argv: parse, check (one line and exit 2 on a bad flag), run."""
    p = argparse.ArgumentParser(prog="lmtail contract")
    configure(p)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check(args)
    except ValueError as e:
        print(f"lmtail contract: error: {e}", file=sys.stderr)
        return 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Run the contract as `args` selects, print the tables; exit code as the module says
    (2 with one line when --kinds matches no kind, before anything runs)."""
    from rich.console import Console

    from . import registry, run_contract

    ranks = args.ranks if args.ranks is not None else (0 if args.fast else 4)
    cfg = Config(fast=args.fast, ranks=ranks)
    kinds, ctls = registry(kinds=args.kinds)
    if not kinds:
        print(f"lmtail contract: error: --kinds: no kind matches {args.kinds!r}", file=sys.stderr)
        return 2
    if args.list:
        print(f"{len(kinds)} kinds, {len(ctls)} planted controls")
        print("kinds: " + ", ".join(kinds))
        print("controls: " + ", ".join(c.name for c in ctls))
        return 0
    con = Console()
    if not con.is_terminal:
        con = Console(width=220)  # a log or a pipe: keep each table row on one line
    t0 = time.perf_counter()
    with con.status("running the contract") as status:
        out = run_contract(cfg, kinds=args.kinds, progress=lambda n: status.update(f"contract: {n}"))
    secs = time.perf_counter() - t0
    gates = [g for g in GATES if any(g in r.gates for r in out["kinds"])]
    con.print(kinds_table(out["kinds"], gates))
    con.print(controls_table(out["controls"]))
    if args.decl:
        for r in out["kinds"]:
            if r.decl is not None:
                sums = "; ".join(f"{s.name}: {s.dtype} depth {s.depth}, {s.order}" for s in r.decl.sums) or "none"
                con.print(f"[bold]{r.kind}[/bold] rounding: {', '.join(r.decl.rounding_points)}\n  sums: {sums}")
    bad = failures(out["kinds"], out["controls"])
    for line in bad:
        con.print(line, style="red", markup=False)
    n_gates = sum(len(r.gates) for r in out["kinds"])
    n_pass = sum(g.ok is True for r in out["kinds"] for g in r.gates.values())
    n_red = sum(r.red_as_planted for r in out["controls"])
    near = sum(g.counts.get("near_ties", 0) for r in out["kinds"] for g in r.gates.values())
    con.print(f"{len(out['kinds'])} kinds, {n_pass}/{n_gates} gates pass; {n_red}/{len(out['controls'])} controls "
              f"red as planted; {near} near-ties counted; {secs:.0f} s ({'fast' if cfg.fast else 'full'}, "
              f"ranks gate {'off' if cfg.ranks < 2 else f'{cfg.ranks} ranks'})", markup=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(out, cfg, secs), f, indent=1, default=str)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
