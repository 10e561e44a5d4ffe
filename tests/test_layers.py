"""The house as drawn in tools/whiteboard.json, held against the code.

The whiteboard names the parts of src/lmtail (each a few files or folders; a file belongs to the
part with the longest path that covers it), the arrows between parts that the code has, and the
pairs that must NEVER be (a reference importing the op it checks, a kernel binding importing an
op above it, the model importing the server...). This test reads every module's imports from its
AST (top-level and lazy ones inside functions; in a module that calls import_module, every string
literal that names a module of the tree, as cli.py's command table does)
and holds them to the drawing:

  * every module is on exactly one part;
  * every part-to-part import is a drawn arrow (an undrawn one is a new dependency: draw it or
    remove it), and every drawn arrow exists (a stale drawing is red too);
  * no never-pair is reachable, directly or through the drawn arrows.

Planted: an extra import edge, a module on no part and a stale arrow each go red.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
WHITEBOARD = ROOT / "tools" / "whiteboard.json"


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The lmtail modules `path` imports anywhere in its body (resolved to modules of the tree:
    `from pkg import name` counts pkg.name where that is a module, else pkg)."""
    mod = module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: set[str] = set()
    tree = ast.parse(path.read_text())
    dynamic = any(isinstance(n, ast.Call) and getattr(n.func, "attr", getattr(n.func, "id", "")) == "import_module"
                  for n in ast.walk(tree))

    def add(target: str, names=()):
        for n in names:
            if f"{target}.{n}" in modules:
                found.add(f"{target}.{n}")
                continue
            found.add(target)
        if not names:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "lmtail":
                add(target, [a.name for a in node.names])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lmtail":
                    add(a.name)
        elif dynamic and isinstance(node, ast.Constant) and node.value in modules:
            add(node.value)
    return {m for m in found if m in modules and m != mod}


def module_graph() -> dict[str, tuple[Path, set[str]]]:
    files = sorted(p for p in (SRC / "lmtail").rglob("*.py") if "__pycache__" not in p.parts)
    modules = {module_name(p) for p in files}
    return {module_name(p): (p, imported_modules(p, modules)) for p in files}


def part_of(path: Path, parts: dict) -> str | None:
    rel = path.relative_to(ROOT).as_posix()
    best = None
    for name, spec in parts.items():
        for p in spec["is"]:
            if (rel == p or (p.endswith("/") and rel.startswith(p))) and (best is None or len(p) > len(best[1])):
                best = (name, p)
    return best and best[0]


def verdicts(board: dict, graph: dict[str, tuple[Path, set[str]]]) -> list[str]:
    """Every way the code and the drawing differ, one line each ([] = they agree)."""
    parts, bad = board["parts"], []
    where = {m: part_of(p, parts) for m, (p, _) in graph.items()}
    bad += [f"on no part: {graph[m][0].relative_to(ROOT)}" for m, w in where.items() if w is None]
    found: dict[tuple[str, str], str] = {}
    for m, (_, deps) in graph.items():
        for d in deps:
            a, b = where[m], where[d]
            if a and b and a != b:
                found.setdefault((a, b), f"{m} -> {d}")
    drawn = {(a[0], a[1]) for a in board["arrows"]}
    bad += [f"undrawn arrow {a} -> {b} ({found[a, b]})" for a, b in sorted(set(found) - drawn)]
    bad += [f"arrow not found {a} -> {b}" for a, b in sorted(drawn - set(found))]
    reach = {p: {b for a, b in found if a == p} for p in parts}
    changed = True
    while changed:  # transitive closure over the arrows the code has
        changed = False
        for p in reach:
            more = set().union(*(reach[q] for q in reach[p])) - reach[p]
            if more:
                reach[p] |= more
                changed = True
    bad += [f"NEVER {a} -> {b} broken: {why}" for a, b, why in board["never"] if b in reach[a]]
    return bad


@pytest.fixture(scope="module")
def board():
    return json.loads(WHITEBOARD.read_text())


@pytest.fixture(scope="module")
def graph():
    return module_graph()


def test_the_code_is_the_drawing(board, graph):
    assert verdicts(board, graph) == []
    assert board["never"], "the drawing says what must never be"


def test_planted_extra_import_goes_red(board, graph):
    """A binding importing the tail (kernels -> ops) and a reference importing its op."""
    planted = dict(graph)
    path, deps = planted["lmtail.kernels.tail.rows_tail"]
    planted["lmtail.kernels.tail.rows_tail"] = (path, deps | {"lmtail.tail.sampler"})
    path, deps = planted["lmtail.reference.tail"]
    planted["lmtail.reference.tail"] = (path, deps | {"lmtail.tail.compose"})
    got = verdicts(board, planted)
    assert any(v.startswith("undrawn arrow Kernels -> Ops") for v in got), got
    assert any(v.startswith("NEVER Kernels -> Ops") for v in got), got
    assert any(v.startswith("NEVER Reference -> Ops") for v in got), got


def test_planted_stale_drawing_goes_red(board, graph):
    """A module on no part, an arrow the code does not have, a lazy import the AST must see."""
    stale = dict(board, parts={k: v for k, v in board["parts"].items() if k != "Registry"},
                 arrows=[a for a in board["arrows"] if a[0] != "Certify" or a[1] != "Registry"] + [["Core", "Api"]],
                 never=[n for n in board["never"] if n[0] != "Registry"])
    got = verdicts(stale, graph)
    assert "on no part: src/lmtail/ops.py" in got and "arrow not found Core -> Api" in got, got
    commands = imported_modules(SRC / "lmtail" / "cli.py", set(graph))  # the command table's strings
    assert {"lmtail.serve.cli", "lmtail.benchmarks", "lmtail.contract.cli"} <= commands, sorted(commands)
