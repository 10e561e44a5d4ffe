"""The op registry (lmtail.ops): one record per op, and the contract walks it.

Every contract kind is reachable from exactly one record, every record has at least one
kind, a float64 reference under lmtail.reference, a test file and a benchmark file that
exist, a function and declaration that resolve and a backend list; the contract's walk
refuses a kind or control no record names. Each check has a planted break that it catches.
"""
from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from lmtail import ops
from lmtail.numerics import Decl

ROOT = Path(__file__).resolve().parents[1]


def registry_problems(records) -> list[str]:
    """What is wrong with a list of OpSpec records (empty: nothing)."""
    bad, seen = [], {}
    for spec in records:
        if not spec.kinds:
            bad.append(f"{spec.name}: no contract kind")
        for k in spec.kinds:
            if k in seen:
                bad.append(f"kind {k} in both {seen[k]} and {spec.name}")
            seen[k] = spec.name
        for what, rel in (("test", spec.test), ("bench", spec.bench)):
            if not (ROOT / rel).is_file():
                bad.append(f"{spec.name}: {what} file {rel} missing")
        if not spec.ref.startswith("lmtail.reference."):
            bad.append(f"{spec.name}: reference {spec.ref} is not under lmtail.reference")
        if spec.decl is None:
            bad.append(f"{spec.name}: no declaration")
    if len({s.name for s in records}) != len(records):
        bad.append("two records share a name")
    return bad


def test_every_record_is_complete():
    assert registry_problems(ops.OPS) == []
    assert len(ops.OPS) >= 19


def test_planted_registry_breaks_are_caught():
    add = ops.op("add_rms")
    broken = [replace(add, kinds=()), replace(ops.op("exp32"), test="tests/test_nothing.py"),
              replace(ops.op("attend"), ref="lmtail.model.body:attend"), replace(ops.op("silu_mul"), decl=None)]
    got = registry_problems(broken)
    assert any("add_rms: no contract kind" in b for b in got)
    assert any("tests/test_nothing.py missing" in b for b in got)
    assert any("not under lmtail.reference" in b for b in got)
    assert any("silu_mul: no declaration" in b for b in got)
    assert any("in both" in b for b in registry_problems([add, replace(add, name="add_rms.copy")]))


@pytest.mark.parametrize("spec", ops.OPS, ids=[s.name for s in ops.OPS])
def test_record_resolves(spec):
    """The function, declaration and reference resolve; the backends are named strings."""
    assert callable(spec.function()) and not spec.fn.rpartition(":")[2].startswith("_")
    assert callable(spec.reference())
    assert callable(spec.declaration())
    names = spec.backends()
    assert names and all(isinstance(n, str) for n in names), names


def test_every_kind_and_control_comes_from_exactly_one_record():
    """The contract's kind list is the registry's: every kind the kind modules build is
    named by exactly one record, and every control sits on a kind of its own record."""
    from lmtail.contract import walk

    kinds, ctls = walk()
    named = [k for s in ops.OPS for k in s.kinds]
    assert sorted(named) == sorted(kinds) and len(set(named)) == len(named)
    assert len({c.name for c in ctls}) == len(ctls) and all(c.kind in kinds for c in ctls)
    order = [ops.OPS.index(ops.owner_of_kind(c.kind)) for c in ctls]
    assert order == sorted(order), "controls come in record order, each with its kind's op"


def test_walk_refuses_an_unnamed_or_unknown_kind(monkeypatch):
    """Planted: a record dropped (its kinds become orphans), a kind that no module builds,
    a control planted in a kind no record names."""
    from lmtail.contract import walk

    real = ops.OPS
    monkeypatch.setattr(ops, "OPS", tuple(s for s in real if s.name != "exp32"))
    with pytest.raises(ValueError, match=r"no op record names kinds \['body.exp32'\]"):
        walk()
    monkeypatch.setattr(ops, "OPS", tuple(replace(s, kinds=s.kinds + ("body.nope",)) if s.name == "exp32" else s
                                          for s in real))
    with pytest.raises(ValueError, match=r"names contract kind 'body.nope', which no kind module builds"):
        walk()
    from lmtail.contract import body_kinds

    real_controls = body_kinds.body_controls
    orphan = lambda: real_controls() + [replace(real_controls()[0], name="body.orphan", kind="body.gone")]  # noqa: E731
    monkeypatch.setattr(ops, "OPS", real)
    monkeypatch.setattr(body_kinds, "body_controls", orphan)
    with pytest.raises(ValueError, match=r"the kinds of controls \['body.orphan'\]"):
        walk()


def test_exact_topk_declares_no_rounding():
    """exact_topk is exact (comparisons of integer keys): its declaration has no sum and
    says so; the contract kind checks against this same declaration."""
    from lmtail.contract import registry
    from lmtail.tail.topk import exact_topk_decl

    d = ops.op("exact_topk").declaration()()
    assert d == exact_topk_decl() and d.sums == () and d.rounding_points[0].startswith("none")
    kinds, _ = registry(kinds="tail.topk.exact")
    assert kinds["tail.topk.exact"].decl({}) == d


def test_declarations_name_their_op():
    """Each record's declaration function returns a Decl (called with the arguments its
    contract kind uses on that kind's first random case)."""
    from lmtail.contract import registry

    kinds, _ = registry()
    for spec in ops.OPS:
        kind = kinds[spec.kinds[0]]
        data = kind.gens["random"](True)[0].data
        assert isinstance(kind.decl(data), Decl), spec.name


def test_ops_module_imports_nothing_of_lmtail():
    """Cheap to import and no cycle: lmtail/ops.py's imports are the standard library's
    (records name modules by string, resolved on use). Planted: an import of an op is seen."""
    def lmtail_imports(text):
        out = []
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("lmtail")):
                out.append(node.module or ".")
            elif isinstance(node, ast.Import):
                out += [a.name for a in node.names if a.name.startswith("lmtail")]
        return out

    text = (ROOT / "src/lmtail/ops.py").read_text()
    assert lmtail_imports(text) == []
    assert lmtail_imports(text + "\nfrom .norms import add_rms\n") == ["norms"]


def test_lookup_errors_name_the_registered_ops():
    with pytest.raises(KeyError, match=r"no op 'nope'; registered: \['decode_tail.logits'"):
        ops.op("nope")
    with pytest.raises(KeyError, match=r"no op record names contract kind 'x.y'"):
        ops.owner_of_kind("x.y")
