"""lmtail's benchmark suite, shipped in the package, and the `lmtail bench` command.

Every bench_<name>.py in this folder is one benchmark: a script that checks its arms agree and
then times them A-B-B-A with lmtail.bench.abba, printing markdown tables. They ship inside the
wheel (this is a package), so `lmtail bench` finds them in an installed lmtail as in a checkout;
this folder is their one home (the checkout's benchmarks/ holds only peers/, the peer engines'
set-up). One script alone: `python -m lmtail.benchmarks.bench_<name> ARGS`.

    lmtail bench [--only NAME ...] [--quick] [--list] [--markdown] [--dir DIR]

--markdown prints each benchmark's output under a heading and a stamp saying where the figures
came from (machine_stamp: CPU model and the ISA flags the kernels dispatch on, torch threads,
torch version, date) and "run `make bench` for your machine's". configure / check / run: the
protocol of lmtail.cli (check imports no torch).

Shape legend: none (scripts and their output).
"""
from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
from pathlib import Path

__all__ = ["QUICK_ARGS", "ISA_FLAGS", "default_bench_dir", "find_benchmarks", "cpu_info", "machine_stamp",
           "configure", "check", "run"]

# `--quick` passes each script its smoke-run arguments: "--quick" unless listed here (scripts
# whose own flags give a short run).
QUICK_ARGS: dict[str, tuple[str, ...]] = {
    "body_ops": ("--rounds", "2", "--number", "20"),
    "memory": ("--tokens", "2"),
    "model": ("--rows", "2", "--steps", "2", "--rounds", "2"),
    "overhead": ("--steps", "4", "--rounds", "2"),
    "prefill_steps": ("--prompt-tokens", "256"),
    "serve": ("--clients", "1", "--requests-per-client", "1", "--max-tokens", "4"),
}
# /proc/cpuinfo flags the kernels dispatch on (present or absent, both are stamped)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")


def default_bench_dir() -> Path:
    """This package's folder: where the shipped bench_<name>.py scripts are."""
    return Path(__file__).resolve().parent


def find_benchmarks(bench_dir: Path) -> dict[str, Path]:
    """name -> script for every bench_<name>.py in bench_dir, sorted by name."""
    return {p.stem[len("bench_"):]: p for p in sorted(Path(bench_dir).glob("bench_*.py"))}


def cpu_info(cpuinfo: str | None = None) -> tuple[str, dict[str, bool]]:
    """(CPU model name, {flag: present} for ISA_FLAGS) from /proc/cpuinfo's text (read
    here when None); elsewhere platform.processor() and no flags."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    model = fields.get("model name") or platform.processor() or platform.machine() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    return model, ({f: f in flags for f in ISA_FLAGS} if flags else {})


def machine_stamp(*, threads: int, torch_version: str, when: datetime.datetime | None = None,
                  cpuinfo: str | None = None) -> str:
    """One markdown line saying where figures came from: CPU model, ISA flags present and
    absent, torch threads, torch version, UTC date; then "run `make bench` for your machine's"."""
    model, flags = cpu_info(cpuinfo)
    have = " ".join(f for f, on in flags.items() if on) or "none of them"
    lack = " ".join(f for f, on in flags.items() if not on) or "none"
    isa = f"ISA flags: {have} (absent: {lack})" if flags else "ISA flags: unknown (no /proc/cpuinfo)"
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return (f"_Measured on {model}; {isa}; {threads} torch threads (a script's --threads sets its own); "
            f"torch {torch_version}; {when:%Y-%m-%d} (UTC). These are this machine's figures: "
            f"run `make bench` for your machine's (`lmtail bench --markdown` where lmtail is installed)._")


def configure(parser: argparse.ArgumentParser) -> None:
    """The `lmtail bench` options, added to `parser`."""
    parser.description = ("Run lmtail's benchmark suite (every bench_<name>.py shipped in lmtail.benchmarks): "
                          "each times its arms A-B-B-A in one process after checking they agree, and "
                          "prints a table of median paired ratios and rounds won.")
    names = ", ".join(find_benchmarks(default_bench_dir())) or "none found"
    parser.add_argument("--only", action="append", metavar="NAME",
                        help=f"run only this benchmark (repeatable); here: {names}")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes and few rounds (a smoke run; ratios are not meaningful)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--markdown", action="store_true",
                        help="print each benchmark's tables under a heading stamped with the machine "
                             "(CPU, ISA flags, threads, torch, date)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="folder holding the bench_<name>.py scripts (default: the ones lmtail ships)")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag: a --dir that is not a folder or holds no bench_<name>.py,
    an --only name that is not a benchmark there."""
    d = args.dir or default_bench_dir()
    if not Path(d).is_dir():
        raise ValueError(f"--dir: expected a folder of bench_<name>.py scripts, got {str(d)!r} (no such folder)")
    found = find_benchmarks(d)
    if not found:
        raise ValueError(f"--dir: no bench_<name>.py script in {str(d)!r}")
    unknown = [n for n in args.only or () if n not in found]
    if unknown:
        raise ValueError(f"--only: expected one of {sorted(found)}, got {unknown}")


def run(args: argparse.Namespace) -> int:
    """Run the selected benchmark scripts one after another with this interpreter (flags
    checked by check); 0 when all succeeded, 1 when one failed."""
    found = find_benchmarks(args.dir or default_bench_dir())
    names = args.only or list(found)
    if args.list:
        for name in names:
            print(f"{name:<12} {found[name]}")
        return 0
    stamp = None
    if args.markdown:
        import torch

        stamp = machine_stamp(threads=torch.get_num_threads(), torch_version=torch.__version__)
    failed = []
    for name in names:
        extra = QUICK_ARGS.get(name, ("--quick",)) if args.quick else ()
        command = f"{found[name].name} {' '.join(extra)}".rstrip()
        if stamp is None:
            print(f"== lmtail bench {name}: {command}", flush=True)
        else:
            print(f"### {name}\n\n{stamp}\n\n`lmtail bench --only {name}` runs `{command}`:\n", flush=True)
        rc = subprocess.run([sys.executable, str(found[name]), *extra], check=False).returncode
        if rc != 0:
            print(f"lmtail bench: {name} exited {rc}", file=sys.stderr)
            failed.append(name)
    if failed:
        print(f"lmtail bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
