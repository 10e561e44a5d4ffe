"""The contract harness: kinds x gates, planted controls, and the result table.

    Kind (op x variant x dtype)                      Control (a deliberately wrong variant)
      decl(data) -> numerics.Decl                      kind: the kind it impersonates
      run(data) -> {name: tensor}                      run / ranks: replaces the kind's op
      check(data, out, run, decl) -> Verdict           decl: replaces the kind's declaration
                 (float64, ranges FROM decl)           planted: the gate that must go red
      gens[gate](fast) -> [Case]  (gates 1-4; "bytes": the byte gates' inputs)
      take_rows(data, idx) -> data   (batch gate)
      ranks(data, nranks, run) -> [(layout, out)] (ranks gate)

The declaration is an input of every check: the harness evaluates decl(case.data) and
hands it to the check, which computes its float64 ranges from the declared sums (dtype ->
unit roundoff, depth -> gamma(depth)). A control may plant a wrong declaration instead of
a wrong op; a declaration shallower than the code runs must go red.

    run_kind:    every gate of the kind with the kind's own op  -> KindResult (all pass?)
    run_control: the same gates with the control's op           -> ControlResult (red where
                 planted? a control that passes everywhere means the harness is broken)

Gates (docs/contract.md):
  1 shapes, 2 random, 3 special, 4 adversarial: every Case is run and judged by its own
    `expect(data, out, run, decl)` or else the kind's float64 `check`; a Case with `raises`
    must raise a ValueError matching it. Cases a kind marks slow are left out with --fast.
  emulate: the op's bytes == a slow emulation of the declared order (where the kind has one;
    any NaN matches any NaN here: NaN payloads are no part of the contract);
  batch: rows solo, in blocks (2, 4, 8 rows at several offsets) and reversed vs together;
  ranks: every rank layout the kind's `ranks` runs vs the single-rank run;
  threads: torch.set_num_threads 1 vs 2 vs 3; repeat: three runs. All four byte gates
  compare bit patterns (integer views), never values.

A gate passes when every case does. The worst margin of a kind is the smallest margin any
of its checks reported, for every kind in one unit: range widths
(reference.contract.range_margin: 1/2 the centre, 0 an end, negative outside).

Shape legend: R rows of a case (the leading dim of every row output).
"""
from __future__ import annotations

import math
import re
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Sequence

import numpy as np
import torch

from ..numerics import Decl
from ..reference.contract import range_margin
from ..reference.gemm import in_range

DATA_GATES = ("shapes", "random", "special", "adversarial")
BYTE_GATES = ("emulate", "batch", "ranks", "threads", "repeat")
GATES = DATA_GATES + BYTE_GATES


@dataclass(frozen=True)
class Verdict:
    """One judgement: ok, the worst margin seen (None: an exact check, no range), a detail
    line (the first failure, or a summary), and counters (e.g. near_ties) to report."""

    ok: bool
    margin: float | None = None
    detail: str = ""
    counts: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    """One input of a data gate. expect(data, out, run, decl) -> Verdict replaces the
    kind's check (special values with their own defined result); raises: the op must raise
    a ValueError whose message matches this regex (a defined error)."""

    label: str
    data: Mapping
    expect: Callable | None = None
    raises: str | None = None


@dataclass(frozen=True)
class Kind:
    """One op x variant x dtype under contract (module docstring)."""

    name: str
    decl: Callable[[Mapping], Decl]
    run: Callable[[Mapping], dict]
    check: Callable[[Mapping, dict, Callable], Verdict]
    gens: Mapping[str, Callable[[bool], list]]
    take_rows: Callable[[Mapping, Sequence[int]], Mapping] | None = None
    ranks: Callable | None = None
    emulate: Callable[[Mapping], dict] | None = None
    group: str = "tail"
    about: str = ""


@dataclass(frozen=True)
class Control:
    """A planted wrong variant of `kind`: `run` (and/or `ranks`) replaces the kind's op, or
    `decl` (data -> Decl) its declaration; it must come out red at gate `planted` (it may
    be red elsewhere too)."""

    name: str
    kind: str
    planted: str
    what: str
    run: Callable | None = None
    ranks: Callable | None = None
    decl: Callable[[Mapping], Decl] | None = None


@dataclass
class GateResult:
    gate: str
    ok: bool | None  # None: not applicable / not run
    cases: int = 0
    margin: float | None = None
    detail: str = ""
    counts: dict = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class KindResult:
    kind: str
    group: str
    decl: Decl | None
    gates: dict
    unit: str = "width"  # every margin is in range widths

    @property
    def ok(self) -> bool:
        return all(g.ok is not False for g in self.gates.values())

    @property
    def margin(self) -> float | None:
        ms = [g.margin for g in self.gates.values() if g.margin is not None]
        return min(ms) if ms else None


@dataclass
class ControlResult:
    control: Control
    gates: dict

    @property
    def red_gates(self) -> list[str]:
        return [n for n, g in self.gates.items() if g.ok is False]

    @property
    def red_as_planted(self) -> bool:
        g = self.gates.get(self.control.planted)
        return g is not None and g.ok is False


@dataclass(frozen=True)
class Config:
    """fast: the test-suite subset of each generator, one case per byte gate, and controls
    run through their planted gate only; ranks: world size for the ranks gate (0 skips it);
    threads: the counts the threads gate compares; base_threads: torch's thread count for
    everything else (1: the numbers do not depend on it, and a busy 2-core box runs one
    thread per process far faster than two)."""

    fast: bool = True
    ranks: int = 0
    threads: tuple[int, ...] = (1, 2, 3)
    base_threads: int = 1


# ---------------------------------------------------------------------------------------
# byte comparison
# ---------------------------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
             torch.float16: torch.int16}


def half_depth(decl_fn: Callable) -> Callable:
    """The planted "declared half as deep" control: data -> decl_fn(data) with every sum's
    depth halved (the op itself unchanged), so the ranges computed from it are too narrow."""
    def decl(data) -> Decl:
        d = decl_fn(data)
        return replace(d, sums=tuple(replace(s, depth=s.depth // 2) for s in d.sums))
    return decl


def same_bytes(a, b) -> bool:
    """Bitwise equality of two tensors (dtype, shape and every bit); None == None."""
    if a is None or b is None:
        return a is None and b is None
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    v = _INT_VIEW.get(a.dtype)
    a, b = a.contiguous(), b.contiguous()
    return torch.equal(a.view(v), b.view(v)) if v is not None else torch.equal(a, b)


def range_verdict(y: torch.Tensor, lo: np.ndarray, hi: np.ndarray) -> Verdict:
    """Every element of y inside [lo, hi] (reference.gemm.in_range: NaN only where the
    range is unbounded): the first one outside named, else the least margin over the
    bounded elements (None when every range is unbounded)."""
    ok = in_range(y, lo, hi)
    bounded = np.isfinite(lo) & np.isfinite(hi)
    if not ok.all():
        r, c = (int(i) for i in np.argwhere(~ok)[0])
        return Verdict(False, None, f"out[{r},{c}] = {float(y[r, c])!r} outside [{lo[r, c]!r}, {hi[r, c]!r}] "
                       f"({int((~ok).sum())} of {ok.size})")
    if not bounded.any():
        return Verdict(True, None, f"{ok.size} elements, every range unbounded")
    _, m = range_margin(y.double().numpy()[bounded], lo[bounded], hi[bounded])
    return Verdict(True, float(m.min()), f"{int(bounded.sum())} bounded elements inside")


def diff_outputs(got: dict, want: dict, rows=None, *, nan_equal=False) -> str:
    """'' if every output of `want` is byte-equal in `got` (rows: the rows of want to
    compare against got's rows in order), else a one-line description of the first miss.
    nan_equal: any NaN matches any NaN (payload and sign are not compared)."""
    for name, w in want.items():
        if not isinstance(w, torch.Tensor):
            continue
        g = got.get(name)
        if rows is not None:
            w = w[list(rows)]
        if g is None or not same_bytes(g, w):
            where = ""
            if g is not None and g.shape == w.shape and g.dtype == w.dtype:
                neq = ~_bits_eq(g, w)
                if nan_equal and g.is_floating_point():
                    neq &= ~(torch.isnan(g) & torch.isnan(w))
                if not neq.any():
                    continue
                idx = tuple(int(i) for i in torch.nonzero(neq)[0]) if neq.any() else ()
                where = f" first at {idx}: {_fmt(g[idx])} vs {_fmt(w[idx])}" if idx else ""
            return f"{name} differs{where}"
    return ""


def _bits_eq(a, b):
    v = _INT_VIEW.get(a.dtype)
    return (a.contiguous().view(v) == b.contiguous().view(v)) if v is not None else (a == b)


def _fmt(t) -> str:
    x = t.item() if t.numel() == 1 else t.tolist()
    return repr(x)


# ---------------------------------------------------------------------------------------
# data gates
# ---------------------------------------------------------------------------------------
def run_case(kind: Kind, case: Case, run: Callable, decl: Callable | None = None) -> Verdict:
    """Run one case and judge it against decl(case.data) (default: the kind's declaration);
    an exception other than the expected error is a fail."""
    if case.raises is not None:
        try:
            run(case.data)
        except ValueError as e:
            if re.search(case.raises, str(e)):
                return Verdict(True, None, f"raised ValueError: {e}")
            return Verdict(False, None, f"ValueError {str(e)!r} does not match {case.raises!r}")
        except Exception as e:  # noqa: BLE001 - report anything else as a failure
            return Verdict(False, None, f"raised {type(e).__name__}: {e} (expected ValueError)")
        return Verdict(False, None, f"no error (expected ValueError matching {case.raises!r})")
    try:
        out = run(case.data)
        judge = case.expect or kind.check
        return judge(case.data, out, run, (decl or kind.decl)(case.data))
    except Exception as e:  # noqa: BLE001
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return Verdict(False, None, f"raised {type(e).__name__}: {e} ({tb.filename.split('/')[-1]}:{tb.lineno})")


def _merge(res: GateResult, label: str, v: Verdict) -> None:
    res.cases += 1
    if v.margin is not None:
        res.margin = v.margin if res.margin is None else min(res.margin, v.margin)
    for k, n in v.counts.items():
        res.counts[k] = res.counts.get(k, 0) + n
    if not v.ok and res.ok is not False:
        res.ok = False
        res.detail = f"[{label}] {v.detail}"


def data_gate(kind: Kind, gate: str, run: Callable, cfg: Config, decl: Callable | None = None) -> GateResult:
    res = GateResult(gate, True)
    for case in kind.gens[gate](cfg.fast):
        _merge(res, case.label, run_case(kind, case, run, decl))
    return res


# ---------------------------------------------------------------------------------------
# byte gates
# ---------------------------------------------------------------------------------------
def _byte_data(kind: Kind, cfg: Config, *, all_cases=False):
    """The byte gates' inputs: the kind's "bytes" generator, else its random cases (fast:
    only the first, unless all_cases)."""
    gen = kind.gens.get("bytes") or kind.gens["random"]
    cases = [c for c in gen(cfg.fast) if c.raises is None and c.expect is None]
    return cases[:1] if cfg.fast and not all_cases else cases


def _batch_subsets(n: int) -> list[list[int]]:
    subs = [[i] for i in range(min(n, 8))] + [[n - 1]]
    for size in (2, 3, 4, 8):
        for start in (0, 1, n - size):
            if 0 <= start and start + size <= n:
                subs.append(list(range(start, start + size)))
    subs.append(list(range(n))[::-1])
    return [s for i, s in enumerate(subs) if s not in subs[:i]]


def batch_gate(kind: Kind, run: Callable, cfg: Config) -> GateResult:
    """Each row's outputs solo, in blocks and in reversed order == the same rows together."""
    res = GateResult("batch", True)
    for case in _byte_data(kind, cfg):
        full = run(case.data)
        n = next(t.shape[0] for t in full.values() if isinstance(t, torch.Tensor))
        for rows in _batch_subsets(n):
            got = run(kind.take_rows(case.data, rows))
            d = diff_outputs(got, full, rows)
            _merge(res, f"{case.label} rows {rows[:4]}{'...' if len(rows) > 4 else ''}",
                   Verdict(not d, None, d))
    return res


def emulate_gate(kind: Kind, run: Callable, cfg: Config) -> GateResult:
    """The op's outputs == the declared-order emulation's, bit for bit."""
    res = GateResult("emulate", True)
    for case in _byte_data(kind, cfg, all_cases=True):
        d = diff_outputs(run(case.data), kind.emulate(case.data), nan_equal=True)
        _merge(res, case.label, Verdict(not d, None, d))
    return res


def threads_gate(kind: Kind, run: Callable, cfg: Config) -> GateResult:
    res = GateResult("threads", True)
    before = torch.get_num_threads()
    try:
        for case in _byte_data(kind, cfg):
            outs = []
            for t in cfg.threads:
                torch.set_num_threads(t)
                outs.append(run(case.data))
            for t, o in zip(cfg.threads[1:], outs[1:]):
                d = diff_outputs(o, outs[0])
                _merge(res, f"{case.label} {t} vs {cfg.threads[0]} threads", Verdict(not d, None, d))
    finally:
        torch.set_num_threads(before)
    return res


def repeat_gate(kind: Kind, run: Callable, cfg: Config) -> GateResult:
    res = GateResult("repeat", True)
    for case in _byte_data(kind, cfg):
        first = run(case.data)
        for i in (1, 2):
            d = diff_outputs(run(case.data), first)
            _merge(res, f"{case.label} run {i + 1} vs 1", Verdict(not d, None, d))
    return res


def ranks_gate(kind: Kind, run: Callable, ranks: Callable, cfg: Config) -> GateResult:
    res = GateResult("ranks", True)
    for case in _byte_data(kind, cfg)[:1]:
        solo = run(case.data)
        for layout, out in ranks(case.data, cfg.ranks, run):
            d = diff_outputs(out, solo)
            _merge(res, f"{case.label} {layout}", Verdict(not d, None, d))
    return res


# ---------------------------------------------------------------------------------------
# running kinds and controls
# ---------------------------------------------------------------------------------------
def applicable(kind: Kind, cfg: Config) -> list[str]:
    gates = [g for g in DATA_GATES if g in kind.gens]
    if kind.emulate is not None:
        gates.append("emulate")
    if kind.take_rows is not None:
        gates.append("batch")
    if kind.ranks is not None and cfg.ranks > 1:
        gates.append("ranks")
    return gates + ["threads", "repeat"]


def run_gates(kind: Kind, cfg: Config, *, run=None, ranks=None, decl=None, only=None) -> dict:
    """{gate: GateResult} for every applicable gate (or those in `only`), on
    cfg.base_threads threads (restored after); run, ranks, decl replace the kind's."""
    before = torch.get_num_threads()
    torch.set_num_threads(cfg.base_threads)
    try:
        return _run_gates(kind, cfg, run or kind.run, ranks or kind.ranks, decl or kind.decl, only)
    finally:
        torch.set_num_threads(before)


def _run_gates(kind, cfg, run, ranks, decl, only) -> dict:
    out = {}
    for gate in applicable(kind, cfg):
        if only is not None and gate not in only:
            continue
        t0 = time.perf_counter()
        try:
            if gate in DATA_GATES:
                res = data_gate(kind, gate, run, cfg, decl)
            elif gate == "emulate":
                res = emulate_gate(kind, run, cfg)
            elif gate == "batch":
                res = batch_gate(kind, run, cfg)
            elif gate == "ranks":
                res = ranks_gate(kind, run, ranks, cfg)
            elif gate == "threads":
                res = threads_gate(kind, run, cfg)
            else:
                res = repeat_gate(kind, run, cfg)
        except Exception as e:  # noqa: BLE001 - a gate that cannot run is a failed gate
            res = GateResult(gate, False, detail=f"gate raised {type(e).__name__}: {e}")
        res.seconds = time.perf_counter() - t0
        out[gate] = res
    return out


def run_kind(kind: Kind, cfg: Config) -> KindResult:
    gens = kind.gens.get("random") or next(iter(kind.gens.values()))
    try:
        decl = kind.decl(gens(True)[0].data)
    except Exception:  # noqa: BLE001 - a missing declaration shows as None in the table
        decl = None
    return KindResult(kind.name, kind.group, decl, run_gates(kind, cfg))


def run_control(ctl: Control, kinds: Mapping[str, Kind], cfg: Config) -> ControlResult:
    """The control's op through its kind's gates (fast: the planted gate only; the ranks
    gate only when planted there: it spawns processes). Red as planted iff gate `planted`
    fails."""
    kind = kinds[ctl.kind]
    if ctl.planted == "ranks" and cfg.ranks < 2:
        cfg = replace(cfg, ranks=2 if cfg.fast else 4)
    if ctl.planted == "ranks" or cfg.fast:
        only = [ctl.planted]
    else:
        only = [g for g in applicable(kind, cfg) if g != "ranks"]
    return ControlResult(ctl, run_gates(kind, cfg, run=ctl.run, ranks=ctl.ranks, decl=ctl.decl, only=only))


def select(names, pattern: str | None) -> list[str]:
    """Names matching a comma-separated list of fnmatch patterns (all when None)."""
    from fnmatch import fnmatch

    if not pattern:
        return list(names)
    pats = [p.strip() for p in pattern.split(",") if p.strip()]
    return [n for n in names if any(fnmatch(n, p) or p in n for p in pats)]


def fmt_margin(m: float | None) -> str:
    if m is None:
        return "exact"
    if m == -math.inf:
        return "-inf"
    return f"{m:.3g}"
