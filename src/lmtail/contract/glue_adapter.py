"""The glue ops' kinds and controls (lmtail.glue_kinds) wrapped as contract Kinds.

glue_kinds.GlueKind                         contract Kind
  run(data) -> {out}                          run
  decl (a Decl)                               decl(data) -> that Decl
  check(data, out) -> (ok, margin, detail)    check(data, out, run) -> Verdict (margin in
                                              output-dtype steps from the nearer range end:
                                              margin_unit "steps")
  data(1..4) -> [dict with "label", "slow"]   gens shapes/random/special/adversarial (slow
                                              cases only outside --fast)
  emulate(data), byte_data()                  the emulate gate (bytes vs the declared-order
                                              emulation) on byte_data
  -                                           take_rows (by op): the batch gate; threads and
                                              repeat as for every kind
glue_kinds.Control(gate "gate1".."gate4" | "bytes") -> Control(planted shapes..adversarial
| emulate), kind names prefixed "glue.".

Shape legend: T rows (tokens), H width, S slots, K logit slices, E experts.
"""
from __future__ import annotations

import importlib
from functools import partial

import torch

from .harness import Case, Control, Kind, Verdict

GATE_OF = {"gate1": "shapes", "gate2": "random", "gate3": "special", "gate4": "adversarial", "bytes": "emulate"}


def _rows(data, idx, *, dims):
    """data with the row axis of each named tensor (dims: name -> axis) cut to idx."""
    out = dict(data)
    for name, axis in dims.items():
        t = data.get(name)
        if t is not None:
            out[name] = t.index_select(axis, torch.tensor(list(idx), dtype=torch.long))
    return out


ROW_DIMS = {  # op -> {input: row axis}
    "norms.add_rms": {"x": 0, "residual": 0},
    "norms.moe_add_rms": {"x": 0, "slots": 1, "weights": 0},
    "norms.rms_parts": {"x": 0},
    "router.router_topk": {"slices": 1},
    "norms.embed_rows": {"ids": 0},
}


def _check(gk, data, out, run) -> Verdict:
    ok, margin, detail = gk.check(data, out)
    return Verdict(bool(ok), None if margin is None else float(margin), detail)


def _gen(gk, gate, fast):
    return [Case(d.get("label", f"{gk.name} {gate}"), d) for d in gk.data(gate) if not (fast and d.get("slow"))]


def _bytes(gk, fast):
    return [Case(d.get("label", gk.name), d) for d in gk.byte_data()]


def adapt_kind(gk) -> Kind:
    gens = {name: partial(_gen, gk, i) for i, name in enumerate(("shapes", "random", "special", "adversarial"), 1)}
    gens["bytes"] = partial(_bytes, gk)
    dims = ROW_DIMS.get(gk.op)
    return Kind(f"glue.{gk.name}", lambda d, _g=gk: _g.decl, gk.run, partial(_check, gk), gens,
                take_rows=None if dims is None else partial(_rows, dims=dims), emulate=gk.emulate,
                group="glue", about=f"{gk.op} -> {', '.join(gk.outputs)}", margin_unit="steps")


def adapt_control(c) -> Control:
    return Control(f"glue.{c.name}", f"glue.{c.kind}", GATE_OF.get(c.gate, c.gate), c.why, c.run)


def _module():
    """lmtail.glue_kinds, or None while it does not exist (any other import error raises:
    a broken glue module must show, not vanish from the table)."""
    try:
        return importlib.import_module("lmtail.glue_kinds")
    except ModuleNotFoundError as e:
        if e.name == "lmtail.glue_kinds":
            return None
        raise


def glue_kinds() -> list[Kind]:
    """The glue engineer's kinds, adapted ([] while lmtail.glue_kinds does not exist)."""
    gk = _module()
    return [] if gk is None else [adapt_kind(k) for k in gk.KINDS.values()]


def glue_controls() -> list[Control]:
    gk = _module()
    return [] if gk is None else [adapt_control(c) for c in gk.CONTROLS]
