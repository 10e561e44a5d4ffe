"""`lmtail <command>`: one argparse parser with a subcommand per module.

Each command's module exposes three functions:
    configure(parser)   adds its options to its subparser
    check(args)         ValueError naming the flag (expected vs got) for anything run cannot
                        take; cheap: it may import, never load a model, compile or spawn
    run(args) -> int    the command itself; its exit status
This file maps names to modules and imports only the module of the command being run, so a
bad flag is reported before anything heavy is imported or done.

Every error is one line on stderr, `lmtail <command>: error: <message>`, exit status 2:
argparse's own (unknown option, bad value; argparse raises SystemExit(2)), check's, and a
missing extra (a package the command's run imports that a base install lacks, found with
importlib.util.find_spec after the flags are checked and before run; the line names the
`pip install 'lmtail[<extra>]'` that brings it; main returns 2). A ModuleNotFoundError of an
extra's package raised later anyway (importing the command's module, or inside run) is
reported in the same one line.

`--help` of every command shows each option's default (HelpFormatter).

Shape legend: none (a command line).
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
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


# an extra's package -> the extra that installs it (pyproject.toml's optional-dependencies)
EXTRA_OF = {"gguf": "model", "tokenizers": "model", "rich": "model", "scipy": "receipts",
            "starlette": "serve", "uvicorn": "serve", "matplotlib": "plots", "numba": "numba"}
# what each command's run imports beyond the base install: (the extra to name, packages);
# "demo --synthetic" is the demo with --synthetic (the tail alone: no model file, no tokenizer)
NEEDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "generate": ("model", ("gguf", "tokenizers", "rich")),
    "demo": ("model", ("gguf", "tokenizers", "rich")),
    "demo --synthetic": ("model", ("rich",)),
    "contract": ("contract", ("rich",)),
    "receipt": ("model,receipts", ("gguf", "tokenizers", "rich", "scipy")),
    "ab": ("receipts", ("scipy",)),
    "serve": ("serve", ("gguf", "tokenizers", "starlette", "uvicorn")),
}


def importable(name: str) -> bool:
    """Whether the top-level package `name` can be found (importlib.util.find_spec: not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def missing_extra(command: str, args: argparse.Namespace | None = None) -> str | None:
    """The one-line message naming the packages `command` (as args selects it) needs that are not
    installed and the extra that installs them; None when nothing is missing."""
    what = "demo --synthetic" if command == "demo" and getattr(args, "synthetic", False) else command
    if what not in NEEDS:
        return None
    extra, packages = NEEDS[what]
    missing = [p for p in packages if not importable(p)]
    if not missing:
        return None
    return (f"{', '.join(missing)} not installed (`lmtail {what}` needs {'it' if len(missing) == 1 else 'them'}): "
            f"pip install 'lmtail[{extra}]'")


def extra_line(e: ModuleNotFoundError, command: str) -> str | None:
    """The one line for an extra's package that failed to import (None: not an extra's): every
    package the command needs that is missing when NEEDS lists this one, else this one."""
    top = (e.name or "").split(".")[0]
    if top not in EXTRA_OF:
        return None
    if command in NEEDS and top in NEEDS[command][1]:
        return missing_extra(command) or f"{top} cannot be imported: pip install 'lmtail[{NEEDS[command][0]}]'"
    return f"{top} not installed (`lmtail {command}` needs it): pip install 'lmtail[{EXTRA_OF[top]}]'"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, each option's help ending in `(default: X)` unless it names its
    default itself ("default: ..." / "default X") or has none worth showing (None, a flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if shows_default(action) and not re.search(r"\bdefault[: ]", text):
            text += " (default: %(default)s)"
        return text


def shows_default(action: argparse.Action) -> bool:
    """An option whose default means something to show (not None, not a flag's False; 0 is shown)."""
    d = action.default
    return bool(action.option_strings) and not (d is None or d is False or d is argparse.SUPPRESS)


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
        p = sub.add_parser(name, help=help_, formatter_class=HelpFormatter)
        if command == name:
            mod = importlib.import_module(module)
            mod.configure(p)
            for action in p._actions:  # argparse prints no line for an option without help
                if action.help is None and shows_default(action):
                    action.help = "(default: %(default)s)"
            p.set_defaults(check=mod.check, run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse argv (default sys.argv[1:]), check it, run the command; its exit status. A bad
    command or option exits 2 (SystemExit from argparse); a value check refuses returns 2."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = command_of(argv)
    try:
        args = build_parser(command).parse_args(argv)
    except ModuleNotFoundError as e:  # the command's module imports an extra at its top
        return fail(command, extra_line(e, command), e)
    try:
        args.check(args)
    except ValueError as e:
        return fail(command, one_line(e))
    message = missing_extra(command, args)
    if message is not None:
        return fail(command, message)
    try:
        return int(args.run(args) or 0)
    except ModuleNotFoundError as e:  # an extra imported in run that NEEDS does not list
        return fail(command, extra_line(e, command), e)


def fail(command: str, message: str | None, error: BaseException | None = None) -> int:
    """Print `lmtail <command>: error: <message>` and return 2; re-raise `error` if there is no
    message (a ModuleNotFoundError that is no extra's)."""
    if message is None:
        raise error
    print(f"lmtail {command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
