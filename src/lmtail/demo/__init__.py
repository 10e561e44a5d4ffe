"""`lmtail demo`: the model demo (SmolLM2-135M end to end, lmtail.demo.model) or, with
--synthetic, the GPT-OSS-shaped tail alone (lmtail.demo.synthetic). Both certify the tail's
decisions with the one certifier, lmtail.contract.certify.certify_tail.

    lmtail demo [--max-new-tokens N] [--ranks N] [--threads N]
    lmtail demo --synthetic [--gbs N] [--seed N] [--vocab V]

This module is the command only (configure / check / run); it imports the demos in run, so
a bad flag is refused before torch or the model is loaded. --threads, --max-new-tokens and
--ranks take what `lmtail generate` takes (its shared_rules; run E's exchange is candidates).

Shape legend: none (a command).
"""
from __future__ import annotations

import argparse

from ..flags import SEED_LIMIT, SMOLLM2_CONTEXT, ranks_words, refuse, shared_rules

__all__ = ["configure", "check", "run"]

SYNTHETIC_K = 256  # lmtail.demo.synthetic.K (the tail's candidates): the narrowest --vocab
SYNTHETIC_V = 25136  # lmtail.demo.synthetic.V (GPT-OSS's vocab shard at VTP 8): --vocab's default
_MODEL_OPTS = {"max_new_tokens": 32, "ranks": 4, "threads": 1}
_SYNTHETIC_OPTS = {"gbs": 8, "seed": 0, "vocab": SYNTHETIC_V}


def configure(parser: argparse.ArgumentParser) -> None:
    """The `lmtail demo` options, added to `parser` (each option belongs to one of the demos;
    its default is applied in run, so giving it to the other demo is an error)."""
    parser.description = ("SmolLM2-135M end to end on lmtail's ops, on 1 and N ranks, certified "
                          "against float64 (--synthetic: the GPT-OSS-shaped tail alone, no model file)")
    parser.add_argument("--synthetic", action="store_true",
                        help="run the synthetic GPT-OSS-shaped tail demo instead of the model demo")
    m = parser.add_argument_group("model demo")
    m.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per request at most, in [1, {SMOLLM2_CONTEXT - 1}] (default 32)")
    m.add_argument("--ranks", type=int, default=None,
                   help="vocab-parallel ranks of run E (the candidates exchange): "
                        f"{ranks_words('candidates', mirror_hint=False)} (default 4)")
    m.add_argument("--threads", type=int, default=None,
                   help="torch threads of every run and rank, 0: torch's default (default 1)")
    s = parser.add_argument_group("synthetic demo (with --synthetic)")
    s.add_argument("--gbs", type=int, default=None, help="rows in the batch (default 8)")
    s.add_argument("--seed", type=int, default=None, help="seed of the random problem, in [0, 2**64 - 1] (default 0)")
    s.add_argument("--vocab", type=int, default=None,
                   help=f"vocab shard width, >= {SYNTHETIC_K} (default {SYNTHETIC_V}, GPT-OSS's shard at VTP 8)")


def options(args: argparse.Namespace) -> dict:
    """The keyword arguments of the demo args selects, defaults filled in. ValueError for an
    option of the other demo or a value the demo cannot take (the flag named, expected vs got)."""
    mine, other, what = ((_SYNTHETIC_OPTS, _MODEL_OPTS, "synthetic") if args.synthetic else
                         (_MODEL_OPTS, _SYNTHETIC_OPTS, "model"))
    wrong = [k for k in other if getattr(args, k) is not None]
    if wrong:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in wrong)} not accepted by the {what} demo")
    kw = {k: d if getattr(args, k) is None else getattr(args, k) for k, d in mine.items()}
    if args.synthetic:
        refuse([("--vocab", kw["vocab"], kw["vocab"] >= SYNTHETIC_K, f">= {SYNTHETIC_K}"),
                ("--gbs", kw["gbs"], kw["gbs"] >= 1, ">= 1"),
                ("--seed", kw["seed"], 0 <= kw["seed"] < SEED_LIMIT, "in [0, 2**64 - 1]")])
    else:  # generate's rules for the flags both take; run E uses the candidates exchange
        refuse(shared_rules(threads=kw["threads"], max_new_tokens=kw["max_new_tokens"], ranks=kw["ranks"],
                            exchange="candidates", mirror_hint=False))
    return kw


def check(args: argparse.Namespace) -> None:
    """ValueError for anything run cannot take (options)."""
    options(args)


def run(args: argparse.Namespace) -> int:
    """Run the demo `args` selects; its exit status (0: every check held)."""
    kw = options(args)
    if args.synthetic:
        from .synthetic import run_synthetic_demo
        return run_synthetic_demo(**kw)
    from .model import run_model_demo
    return run_model_demo(**kw)
