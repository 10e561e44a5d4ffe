"""`lmtail demo`: for now the synthetic GPT-OSS-shaped tail (see demo_synthetic)."""
from __future__ import annotations

from . import demo_synthetic


def main(argv=None) -> int:
    argv = list(argv or [])
    if "--synthetic" in argv:
        argv.remove("--synthetic")
    return demo_synthetic.main(argv)
