"""`lmtail <command>`: one argparse parser with a subcommand per module.

Each command's module exposes three functions:
    configure(parser)   adds its options to its subparser
    check(args)         ValueError naming the flag (expected vs got) for anything run cannot
                        take; cheap: it may import, never load a model, compile or spawn
    run(args) -> int    the command itself; its exit status
This file maps names to modules and imports only the module of the command being run, so a
bad flag is reported before anything heavy is imported or done.

Every error is one line on stderr, `lmtail <command>: error: <message>`, exit status 2:
argparse's own (unknown option, bad value; argparse raises SystemExit(2)) and check's
(main returns 2).

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
    "generate": ("lmtail.model.generate_cli", "generate text with SmolLM2-135M on lmtail's ops"),
    "contract": ("lmtail.contract.cli", "run the numerics contract: kinds x gates, planted controls"),
    "bench": ("lmtail.benchmarks", "run the benchmark suite (A-B-B-A paired ratios, arms checked first)"),
    "receipt": ("lmtail.receipts.receipt", "the receipt: SmolLM2 over public texts, tail arms vs float64, paired"),
    "ab": ("lmtail.receipts.ab", "a paired, alternating A/B of two commands"),
    "doctor": ("lmtail.doctor", "this CPU, the compiler, and every op's backends: verified / failed / chosen, timed"),
    "serve": ("lmtail.serve.cli", "an OpenAI-compatible server (continuous batching; each response "
              "byte-equal to the same request served alone)"),
}


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line errors: `<prog>: error: <message> (`<prog> --help` lists the
    options)` on stderr, SystemExit(2) (argparse's default prints the whole usage first). A subcommand's parser refuses the
    arguments it does not know itself, so the error names that subcommand."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (`{self.prog} --help` lists the options)\n")

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def one_line(message: str) -> str:
    """message with its line breaks joined by '; '."""
    return "; ".join(part.strip() for part in str(message).splitlines() if part.strip())


def command_of(argv: Sequence[str]) -> str | None:
    """The command argv names: its first argument not starting with '-' (the top-level
    parser has no option taking a value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `lmtail` parser. Every command is listed; only `command`'s module is imported and
    configured (None: none, e.g. for `lmtail --help`), its subparser's defaults carrying
    `check` and `run`."""
    parser = CommandParser(prog="lmtail", description="lmtail: the LLM decode sampling tail "
                           "with declared numerics, certified against float64.")
    sub = parser.add_subparsers(dest="command", metavar="<command>", required=True, parser_class=CommandParser)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if command == name:
            mod = importlib.import_module(module)
            mod.configure(p)
            p.set_defaults(check=mod.check, run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]), check it, run the command; its exit status. A bad
    command or option exits 2 (SystemExit from argparse); a value check refuses returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(command_of(argv)).parse_args(argv)
    try:
        args.check(args)
    except ValueError as e:
        print(f"lmtail {args.command}: error: {one_line(e)}", file=sys.stderr)
        return 2
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
