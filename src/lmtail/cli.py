"""`lmtail <command>`: one argparse parser with a subcommand per module.

Each command's module exposes `configure(parser)` (adds its options to its subparser) and
`run(args) -> int` (the exit status). This file only maps names to modules. A command whose
module is not in this checkout is still listed; invoking it says so and exits 2.

Shape legend: none (a command line).
"""
from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("lmtail.demo", "the demo: SmolLM2-135M end to end (--synthetic: the GPT-OSS-shaped tail)"),
    "generate": ("lmtail.model.generate", "generate text with SmolLM2-135M on lmtail's ops"),
    "contract": ("lmtail.contract.cli", "run the numerics contract: kinds x gates, planted controls"),
    "bench": ("lmtail.bench", "run the benchmark suite (A-B-B-A paired ratios, arms checked first)"),
    "receipt": ("lmtail.receipts.receipt", "the receipt: SmolLM2 over public texts, tail arms vs float64, paired"),
    "ab": ("lmtail.receipts.ab", "a paired, alternating A/B of two commands"),
}


def _missing(module: str, err: ModuleNotFoundError) -> bool:
    """True when `err` says `module` itself (or a package above it) is absent, not one of
    its imports."""
    return err.name is not None and (module == err.name or module.startswith(err.name + "."))


def _unavailable(why: str):
    def run(args: argparse.Namespace) -> int:
        print(f"lmtail {args.command}: not available in this checkout ({why})", file=sys.stderr)
        return 2
    return run


def _broken(err: Exception):
    def run(args: argparse.Namespace) -> int:
        raise err
    return run


def _placeholder(sub, name: str, help_: str, note: str, run) -> None:
    p = sub.add_parser(name, help=f"{help_} [{note}]", description=note)
    p.set_defaults(run=run, placeholder=True)  # takes any arguments: it only reports


def build_parser() -> argparse.ArgumentParser:
    """The `lmtail` parser; each subparser's defaults carry `run`, the command's entry. A
    command whose module is absent runs as a message + exit 2; one whose module fails to
    import re-raises that error when invoked (the other commands still work)."""
    parser = argparse.ArgumentParser(prog="lmtail", description="lmtail: the LLM decode sampling tail "
                                     "with declared numerics, certified against float64.")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True)
    for name, (module, help_) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if not _missing(module, e):
                _placeholder(sub, name, help_, f"import of {module} failed: {e}", _broken(e))
                continue
            note = f"not available: module {module} not found"
            _placeholder(sub, name, help_, note, _unavailable(f"module {module} not found"))
            continue
        except Exception as e:  # a module with a bug: only its own command fails
            _placeholder(sub, name, help_, f"import of {module} failed: {e!r}", _broken(e))
            continue
        p = sub.add_parser(name, help=help_)
        mod.configure(p)
        p.set_defaults(run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]) and run the command; its exit status (argparse
    exits 2 on a bad command or option)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    if extra and not getattr(args, "placeholder", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
