"""The numerics contract: kinds x gates, planted controls, token certification.

    from lmtail.contract import registry, run_contract, certify_tail
    kinds, controls = registry()                  # walked from lmtail.ops.OPS: every op's kinds
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
    patterns or substrings; None: all) and the controls planted in those kinds, in the
    order of lmtail.ops.OPS (each record names its kinds; its controls are those planted in
    them; see `walk`)."""
    all_kinds, ctls = walk()
    names = select(all_kinds, kinds)
    chosen = {n: all_kinds[n] for n in names}
    return chosen, [c for c in ctls if c.kind in chosen]


def walk():
    """Every kind and control, walked from the op registry: ({name: Kind}, [Control]) in
    record order (an op's controls are the ones planted in its kinds; each control names its
    kind once, in its kind module). ValueError if a record names a kind no module builds,
    or a kind module builds a kind (or a control on a kind) no record names."""
    from ..ops import OPS
    from .body_kinds import body_controls, body_kinds
    from .exchange_kinds import exchange_controls, exchange_kinds
    from .gemm_kinds import gemm_controls, gemm_kinds
    from .glue_kinds import glue_controls, glue_kinds
    from .head_kinds import head_controls, head_kinds
    from .processor_kinds import processor_controls, processor_kinds
    from .quant_kinds import quant_controls, quant_kinds
    from .tail_kinds import RankRuns, tail_controls, tail_kinds

    ranks = RankRuns()  # shared: the ownership control reuses the decode kind's rank runs
    built = {k.name: k for k in tail_kinds(ranks) + exchange_kinds() + gemm_kinds() + quant_kinds() + glue_kinds()
             + body_kinds() + head_kinds() + processor_kinds()}
    built_ctl = {c.name: c for c in tail_controls(ranks) + exchange_controls() + gemm_controls() + quant_controls()
                 + glue_controls() + body_controls() + head_controls() + processor_controls()}
    kinds, ctls = {}, []
    for spec in OPS:
        for name in spec.kinds:
            if name not in built:
                raise ValueError(f"op {spec.name!r} names contract kind {name!r}, which no kind module builds")
            kinds[name] = built.pop(name)
        for c in list(built_ctl.values()):  # the op's controls: those planted in its kinds
            if c.kind in spec.kinds:
                ctls.append(built_ctl.pop(c.name))
    if built or built_ctl:
        raise ValueError(f"no op record names kinds {sorted(built)}"
                         + (f" / the kinds of controls {sorted(built_ctl)}" if built_ctl else ""))
    return kinds, ctls


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


__all__ = ["Config", "Control", "Kind", "certify_tail", "format_certificate", "registry", "run_contract", "walk"]
