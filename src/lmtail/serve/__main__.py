"""`python -m lmtail.serve [options]`: the same as `lmtail serve` (the top-level CLI's parser,
checks and one-line errors)."""
import sys

from ..cli import main

raise SystemExit(main(["serve", *sys.argv[1:]]))
