"""`lmtail` command line: demo, generate, contract.

Each subcommand lives in its own module with a `main(argv) -> int`; this file only routes.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("lmtail.demo", "the main demo (a real model end to end; --synthetic for the GPT-OSS-shaped tail)"),
    "generate": ("lmtail.model.generate", "generate text with SmolLM2-135M on lmtail's ops"),
    "contract": ("lmtail.contract.cli", "run the numerics contract: kinds x gates, planted controls"),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<10} {desc}" for name, (_, desc) in COMMANDS.items())
    return f"usage: lmtail <command> [options]\n\ncommands:\n{rows}\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"lmtail: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    mod = importlib.import_module(COMMANDS[cmd][0])
    return int(mod.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
