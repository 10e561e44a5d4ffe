"""`lmtail demo`: the model demo (SmolLM2-135M end to end, lmtail.demo.model) or, with
--synthetic, the GPT-OSS-shaped tail alone (lmtail.demo.synthetic). Both certify the tail's
decisions with the one certifier, lmtail.contract.certify.certify_tail.

    lmtail demo [--max-new-tokens N] [--ranks N] [--threads N]
    lmtail demo --synthetic [--gbs N] [--seed N] [--vocab V]

Shape legend: none (a command).
"""
from __future__ import annotations

import argparse
import sys

from .model import certify_generation, run_model_demo
from .synthetic import K, V, run_synthetic_demo

__all__ = ["configure", "run", "run_model_demo", "run_synthetic_demo", "certify_generation"]

_MODEL_OPTS = {"max_new_tokens": 32, "ranks": 4, "threads": 1}
_SYNTHETIC_OPTS = {"gbs": 8, "seed": 0, "vocab": V}


def configure(parser: argparse.ArgumentParser) -> None:
    """The `lmtail demo` options, added to `parser` (each option belongs to one of the demos;
    its default is applied in run, so giving it to the other demo is an error)."""
    parser.description = ("SmolLM2-135M end to end on lmtail's ops, on 1 and N ranks, certified "
                          "against float64 (--synthetic: the GPT-OSS-shaped tail alone, no model file)")
    parser.add_argument("--synthetic", action="store_true",
                        help="run the synthetic GPT-OSS-shaped tail demo instead of the model demo")
    m = parser.add_argument_group("model demo")
    m.add_argument("--max-new-tokens", type=int, default=None, help="tokens per request (default 32)")
    m.add_argument("--ranks", type=int, default=None, help="vocab-parallel ranks of run E (default 4)")
    m.add_argument("--threads", type=int, default=None, help="torch threads of every run and rank (default 1)")
    s = parser.add_argument_group("synthetic demo (with --synthetic)")
    s.add_argument("--gbs", type=int, default=None, help="rows in the batch (default 8)")
    s.add_argument("--seed", type=int, default=None, help="seed of the random problem (default 0)")
    s.add_argument("--vocab", type=int, default=None,
                   help=f"vocab shard width, >= {K} (default {V}, GPT-OSS's shard at VTP 8)")


def _options(args: argparse.Namespace, mine: dict, other: dict, what: str) -> dict | None:
    wrong = [k for k in other if getattr(args, k) is not None]
    if wrong:
        flags = ", ".join("--" + k.replace("_", "-") for k in wrong)
        print(f"lmtail demo: {flags} not accepted by the {what} demo", file=sys.stderr)
        return None
    return {k: d if getattr(args, k) is None else getattr(args, k) for k, d in mine.items()}


def run(args: argparse.Namespace) -> int:
    """Run the demo `args` selects; its exit status (2 for options of the other demo)."""
    if args.synthetic:
        kw = _options(args, _SYNTHETIC_OPTS, _MODEL_OPTS, "synthetic")
        if kw is not None and (kw["vocab"] < K or kw["gbs"] < 1):
            print(f"lmtail demo: expected --vocab >= {K} and --gbs >= 1, got --vocab {kw['vocab']} "
                  f"--gbs {kw['gbs']}", file=sys.stderr)
            return 2
        return 2 if kw is None else run_synthetic_demo(**kw)
    kw = _options(args, _MODEL_OPTS, _SYNTHETIC_OPTS, "model")
    return 2 if kw is None else run_model_demo(**kw)
