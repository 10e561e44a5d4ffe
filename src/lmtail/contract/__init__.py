"""The numerics contract: kinds x gates, planted controls, token certification.

    from lmtail.contract import registry, run_contract, certify_tail
    kinds, controls = registry()                  # the tail's kinds, the GEMM's and the glue ops'
    report = run_contract(Config(fast=True))      # {"kinds": [KindResult], "controls": [...]}
    certify_tail(hidden, gamma, w, tail_output, sampling_params=sp)   # the demo's receipt

`lmtail contract [--kinds PATTERN] [--json PATH] [--fast]` prints the table (cli.py).
docs/contract.md derives every range and defines the gates and the margin.
"""
from __future__ import annotations

from .certify import certify_tail, format_certificate
from .harness import Config, Control, Kind, run_control, run_kind, select


def registry(*, kinds: str | None = None):
    """({name: Kind}, [Control]) for the kinds matching `kinds` (comma-separated fnmatch
    patterns or substrings; None: all) and the controls planted in those kinds."""
    from .gemm_kinds import gemm_controls, gemm_kinds
    from .glue_kinds import glue_controls, glue_kinds
    from .tail_kinds import RankRuns, tail_controls, tail_kinds

    ranks = RankRuns()  # shared: the ownership control reuses the decode kind's rank runs
    all_kinds = {k.name: k for k in tail_kinds(ranks) + gemm_kinds() + glue_kinds()}
    names = select(all_kinds, kinds)
    chosen = {n: all_kinds[n] for n in names}
    ctls = [c for c in tail_controls(ranks) + gemm_controls() + glue_controls() if c.kind in chosen]
    return chosen, ctls


def run_contract(cfg: Config, *, kinds: str | None = None, progress=None) -> dict:
    """Run every selected kind through its gates and every control through its kind's.
    progress(kind_or_control_name) is called before each. Returns {"kinds": [KindResult],
    "controls": [ControlResult]}."""
    chosen, ctls = registry(kinds=kinds)
    out = {"kinds": [], "controls": []}
    for kind in chosen.values():
        if progress:
            progress(kind.name)
        out["kinds"].append(run_kind(kind, cfg))
    for ctl in ctls:
        if progress:
            progress(ctl.name)
        out["controls"].append(run_control(ctl, chosen, cfg))
    return out


__all__ = ["Config", "Control", "Kind", "certify_tail", "format_certificate", "registry", "run_contract"]
