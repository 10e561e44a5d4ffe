"""`python -m lmtail.serve [options]`: the same as `lmtail serve`."""
from .cli import main

raise SystemExit(main())
