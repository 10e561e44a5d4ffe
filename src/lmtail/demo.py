"""`lmtail demo`: the real model end to end (lmtail.model.demo); `--synthetic` routes to the
GPT-OSS-shaped tail alone (lmtail.demo_synthetic)."""
from __future__ import annotations


def main(argv=None) -> int:
    argv = list(argv or [])
    if "--synthetic" in argv:
        from . import demo_synthetic

        argv.remove("--synthetic")
        return demo_synthetic.main(argv)
    from .model import demo as model_demo

    return model_demo.main(argv)
