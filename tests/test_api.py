"""The public API at `import lmtail` and its one set of conventions; no import cycles.

Conventions (README "API"): tensors positional, options keyword-only (`k` always a
keyword); gamma [H] or [1, H], fp32 or bf16, widened exactly; eps a finite number >= 0
(default 1e-5) everywhere; multi-output ops return a NamedTuple (fixed fields) or the
frozen TailOutput (optional fields); a non-tensor where a tensor is required is a
TypeError, every other bad argument a ValueError naming it. Each checker here has a
planted wrong variant proving it can go red.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

import lmtail

PUBLIC = ("decode_tail", "TailOutput", "TailConfig", "SamplingParams", "sampling_tensor",
          "embed_rows", "add_rms", "moe_add_rms", "rms_parts", "router_topk", "compose_hops",
          "owned_row_block", "owned_rows", "launch")
HOME = {"decode_tail": "lmtail.tail.compose", "TailOutput": "lmtail.tail.compose", "TailConfig": "lmtail.tail.config",
        "SamplingParams": "lmtail.tail.sampler", "sampling_tensor": "lmtail.tail.sampler",
        "embed_rows": "lmtail.glue.norms", "add_rms": "lmtail.glue.norms", "moe_add_rms": "lmtail.glue.norms",
        "rms_parts": "lmtail.glue.norms", "router_topk": "lmtail.glue.router", "compose_hops": "lmtail.tail.layout",
        "owned_row_block": "lmtail.tail.layout", "owned_rows": "lmtail.tail.layout", "launch": "lmtail.launch"}
# tensor ops: how many leading tensor arguments each takes (positional), the rest keyword-only
TENSOR_OPS = {"decode_tail": 3, "embed_rows": 2, "add_rms": 3, "moe_add_rms": 4, "rms_parts": 2,
              "router_topk": 1}
SRC = Path(__file__).resolve().parents[1] / "src"


def test_public_names_come_from_their_modules():
    import importlib

    for name in PUBLIC:
        obj = getattr(lmtail, name)
        assert obj is getattr(importlib.import_module(HOME[name]), name), name
    assert set(PUBLIC) <= set(lmtail.__all__)
    importlib.import_module("lmtail.launch")  # importing the submodule must not rebind the name

    assert callable(lmtail.launch) and lmtail.launch.__name__ == "launch"


# ---------------------------------------------------------------------------------------
# signatures
# ---------------------------------------------------------------------------------------
def signature_violations(fn, n_tensors: int) -> list[str]:
    """Breaks of the argument convention: the first n_tensors parameters positional, every
    other one keyword-only, no *args/**kwargs, eps defaulting to 1e-5 where present."""
    bad = []
    params = list(inspect.signature(fn).parameters.values())
    for i, p in enumerate(params):
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            bad.append(f"{p.name}: *args/**kwargs hide arguments")
        elif i < n_tensors and p.kind != p.POSITIONAL_OR_KEYWORD:
            bad.append(f"{p.name}: a tensor must be positional")
        elif i >= n_tensors and p.kind != p.KEYWORD_ONLY:
            bad.append(f"{p.name}: an option must be keyword-only")
    if "eps" in inspect.signature(fn).parameters and inspect.signature(fn).parameters["eps"].default != 1e-5:
        bad.append("eps: default must be 1e-5")
    return bad


@pytest.mark.parametrize("name", sorted(TENSOR_OPS))
def test_signatures_follow_the_convention(name):
    assert signature_violations(getattr(lmtail, name), TENSOR_OPS[name]) == []


def test_planted_signature_breaks_are_caught():
    def k_positional(x, k, *, eps=1e-5):
        return x

    def hidden_kwargs(x, *, k=1, **kw):
        return x

    def other_eps(x, *, eps=1e-6):
        return x

    assert signature_violations(k_positional, 1) == ["k: an option must be keyword-only"]
    assert signature_violations(hidden_kwargs, 1) == ["kw: *args/**kwargs hide arguments"]
    assert signature_violations(other_eps, 1) == ["eps: default must be 1e-5"]


def test_timeout_is_visible_in_decode_tail():
    assert inspect.signature(lmtail.decode_tail).parameters["timeout"].kind == inspect.Parameter.KEYWORD_ONLY


# ---------------------------------------------------------------------------------------
# dtypes, eps, errors and result types, the same on every op with a gamma
# ---------------------------------------------------------------------------------------
H = 64


def _gamma_calls(gamma, eps=1e-5):
    """op name -> a call of that op with this gamma and eps (one fixed set of inputs)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, H, generator=g).to(torch.bfloat16)
    slots = torch.randn(4, 3, H, generator=g)
    w = torch.rand(3, 2, generator=g)
    xt = torch.randn(3, H, generator=g)
    wt = (torch.randn(H, 50, generator=g) * 0.2).to(torch.bfloat16)
    return {
        "add_rms": lambda: lmtail.add_rms(x, x, gamma, eps=eps),
        "moe_add_rms": lambda: lmtail.moe_add_rms(x, slots, w, gamma, eps=eps, n_shared=2),
        "rms_parts": lambda: lmtail.rms_parts(x, gamma, part=16, eps=eps),
        "decode_tail": lambda: lmtail.decode_tail(xt, gamma, wt, eps=eps, k=4),
    }


def _bytes(out):
    ts = [out] if isinstance(out, torch.Tensor) else [
        t for t in (out if isinstance(out, tuple) else dataclasses.astuple(out)) if isinstance(t, torch.Tensor)]
    return [t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.uint8) for t in ts]


def test_gamma_fp32_or_bf16_and_h_or_1h_everywhere():
    """A bf16 gamma gives the bytes of its exact fp32 widening, [1, H] those of [H], on
    every op. Planted: a gamma one bf16 ulp away gives other bytes on every op."""
    g16 = (1 + 0.1 * torch.randn(H, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    want = {n: _bytes(c()) for n, c in _gamma_calls(g16.float()).items()}
    off = (g16.view(torch.int16) + 1).view(torch.bfloat16)
    for gamma in (g16, g16.reshape(1, H), g16.float().reshape(1, H)):
        for n, c in _gamma_calls(gamma).items():
            assert all(torch.equal(a, b) for a, b in zip(_bytes(c()), want[n])), n
    for n, c in _gamma_calls(off).items():
        assert not all(torch.equal(a, b) for a, b in zip(_bytes(c()), want[n])), n


@pytest.mark.parametrize("eps", [float("inf"), float("nan"), -1e-6, True, "1e-5"])
def test_eps_range_is_the_same_everywhere(eps):
    g = torch.ones(H)
    for n, c in _gamma_calls(g, eps=eps).items():
        with pytest.raises(ValueError, match=r"eps must be a finite number >= 0"):
            c()


def test_non_tensor_gamma_is_a_type_error_everywhere():
    for n, c in _gamma_calls([1.0] * H).items():
        with pytest.raises(TypeError, match=r"gamma must be a torch.Tensor"):
            c()


def test_multi_output_results_are_typed():
    """add_rms / moe_add_rms -> NormResult(h, y); router_topk -> Routing(ids, weights);
    owned_row_block -> RowBlock; decode_tail -> TailOutput: one family, frozen dataclasses
    that unpack in field order or read by field name, and refuse assignment."""
    def names(obj):
        return tuple(f.name for f in dataclasses.fields(obj))

    g = torch.ones(H)
    calls = _gamma_calls(g)
    for name in ("add_rms", "moe_add_rms"):
        out = calls[name]()
        assert isinstance(out, lmtail.NormResult) and names(out) == ("h", "y")
        h, y = out
        assert h is out.h and y is out.y
        with pytest.raises(dataclasses.FrozenInstanceError):
            out.h = None
    r = lmtail.router_topk(torch.randn(1, 3, 8), k=2)
    assert isinstance(r, lmtail.Routing) and names(r) == ("ids", "weights")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.ids = None
    blk = lmtail.owned_row_block(1, 2, 4)
    assert blk == lmtail.RowBlock(2, 2) and tuple(blk) == (2, 2)
    t = calls["decode_tail"]()
    assert isinstance(t, lmtail.TailOutput) and dataclasses.is_dataclass(t)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.tokens = None


# ---------------------------------------------------------------------------------------
# the op registry (lmtail.ops): every public op has a record
# ---------------------------------------------------------------------------------------
# public functions of lmtail.model.body that are not ops (helpers of ops that are)
BODY_HELPERS = {"available_backends", "cos_sin64", "attend_threads"}


def public_ops() -> dict[str, object]:
    """name -> function of every public op: the tensor ops at `import lmtail`, the tail's
    stages and kernels, and every public function of lmtail.model.body (found, not
    listed: a new body op must be registered) other than declarations and BODY_HELPERS."""
    from lmtail.tail import compose as tail
    from lmtail.kernels.gemm.bf16 import gemm_bf16
    from lmtail.kernels.tail.rowmass import row_mass
    from lmtail.model import body
    from lmtail.tail.topk import exact_topk

    out = {n: getattr(lmtail, n) for n in TENSOR_OPS}
    out.update(rows_tail=tail.rows_tail, row_mass=row_mass, gemm_bf16=gemm_bf16, exact_topk=exact_topk)
    for n, fn in vars(body).items():
        if (inspect.isfunction(fn) and fn.__module__ == body.__name__ and not n.startswith("_")
                and not n.endswith("_decl") and n not in BODY_HELPERS):
            out[f"body.{n}"] = fn
    return out


def unregistered(public: dict[str, object], records) -> list[str]:
    """The public ops no record's function is."""
    have = {id(spec.function()) for spec in records}
    return sorted(n for n, fn in public.items() if id(fn) not in have)


def test_every_public_op_is_registered():
    from lmtail import ops

    public = public_ops()
    assert len(public) >= 17 and "body.attend" in public and "add_rms" in public
    assert unregistered(public, ops.OPS) == []
    assert unregistered(public, [s for s in ops.OPS if s.name not in ("add_rms", "attend")]) == ["add_rms", "body.attend"]


# ---------------------------------------------------------------------------------------
# no import cycles
# ---------------------------------------------------------------------------------------
def import_graph(sources: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    """{module: (source text, is_package)} -> {module: modules it imports}, every import
    statement anywhere in the file (module level and inside functions: a lazy import is
    still an edge), relative and absolute, restricted to the given modules."""
    graph = {m: set() for m in sources}
    for mod, (text, is_pkg) in sources.items():
        pkg = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(text)):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
            for t in targets:
                while t and t not in sources:  # `import a.b.c` of a name inside a module
                    t = t.rpartition(".")[0]
                if t and t != mod:
                    graph[mod].add(t)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None (iterative DFS, three colours)."""
    colour = dict.fromkeys(graph, 0)
    for start in sorted(graph):
        if colour[start]:
            continue
        stack, path = [(start, iter(sorted(graph[start])))], [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour[nxt] == 1:
                return path[path.index(nxt):] + [nxt]
            elif colour[nxt] == 0:
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def lmtail_sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for p in sorted((SRC / "lmtail").rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (p.read_text(), is_pkg)
    return out


def test_no_import_cycles():
    """lmtail's import graph (every import, lazy ones included) is acyclic, except that a
    package's __init__ may re-export its own submodules (they never import it back)."""
    graph = import_graph(lmtail_sources())
    assert len(graph) > 20 and "lmtail.kernels.tail.rowmass" in graph["lmtail.tail.sampler"]
    assert find_cycle(graph) is None, find_cycle(graph)


def test_planted_import_cycles_are_caught():
    """A lazy import back (the sampler <-> kernel shape) and a relative one are found."""
    lazy = {"p": ("", True), "p.sampler": ("from .kern import mass\n", False),
            "p.kern": ("def mass():\n    from p.sampler import ref\n", False)}
    assert find_cycle(import_graph(lazy)) == ["p.kern", "p.sampler", "p.kern"]
    rel = {"p": ("", True), "p.sub": ("", True), "p.sub.a": ("from .. import b\n", False),
           "p.b": ("import p.sub.a\n", False)}
    assert find_cycle(import_graph(rel)) == ["p.b", "p.sub.a", "p.b"]
    flat = {"p": ("", True), "p.a": ("from . import b\n", False), "p.b": ("import torch\n", False)}
    assert find_cycle(import_graph(flat)) is None
