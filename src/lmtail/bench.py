"""Paired A-B-B-A timing and the agreement checks that gate it (the benchmarks' library; the
`lmtail bench` command and the benchmark scripts are lmtail.benchmarks).

    abba(arms, base=..., check=...)   -> ABBAResult   one case: arms timed side by side
    format_table({case: ABBAResult})  -> str          a markdown table of several cases
    assert_bitwise(a, b)                              equal bit views, else AssertionError
    assert_within(got, ref, atol=, rtol=)             within a stated float64 tolerance
    check_bitwise                                     `check=` callable built on assert_bitwise

Protocol of `abba`. Every arm is called once, untimed, and each non-base arm's output is
handed to `check(name, out, base_out)`, which raises when the arm disagrees with the base;
nothing is timed unless every arm agreed. Then come `rounds` timed rounds; round r calls the
arms in their given order when r is even and in reverse order when r is odd (A B, B A, A B,
...), so drift in machine load hits every arm alike. Each arm's time in a round is the time
of `number` back-to-back calls, divided by `number`, as `timer` measures it (wall_time, i.e.
time.perf_counter, unless given; a collective benchmark times the slowest rank). Per arm:
`ratio` = median over rounds of time[arm][r] / time[base][r] (the paired ratio, < 1 means the
arm is faster), `wins` = rounds with time[arm][r] < time[base][r], `median_s` = median of its
own times. Timing numbers are machine-load dependent; the ratios are the result to quote.

This module depends on the standard library and torch only (nothing else of lmtail).
"""
from __future__ import annotations

import dataclasses
import statistics
import struct
import time
from collections.abc import Callable, Mapping

import torch

__all__ = [
    "ABBAResult", "abba", "wall_time", "format_table", "assert_bitwise", "assert_within", "check_bitwise",
]

Check = Callable[[str, object, object], None]


@dataclasses.dataclass(frozen=True)
class ABBAResult:
    """Times of one A-B-B-A case. `names` keeps the arms' given order; `base` is the arm the
    ratios divide by (its own ratio is 1.0 and its wins 0)."""

    names: tuple[str, ...]
    times: dict[str, list[float]]   # seconds per call, one entry per round
    ratio: dict[str, float]         # median over rounds of times[arm][r] / times[base][r]
    wins: dict[str, int]            # rounds where the arm was faster than the base
    rounds: int
    median_s: dict[str, float]      # median of times[arm]
    base: str = ""


def _validate(arms, base, rounds, warmup, number, check) -> Check | None:
    if not isinstance(arms, Mapping) or len(arms) < 1:
        raise ValueError(f"arms: expected a non-empty mapping name -> callable, got {arms!r}")
    bad = [n for n, f in arms.items() if not callable(f)]
    if bad:
        raise ValueError(f"arms: expected callables, got non-callable arm(s) {bad}")
    if base not in arms:
        raise ValueError(f"base: expected one of {list(arms)}, got {base!r}")
    for name, v, lo in (("rounds", rounds, 1), ("warmup", warmup, 1), ("number", number, 1)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name}: expected an int >= {lo}, got {v!r}")
    if check is None:
        raise ValueError("check: expected a callable check(name, out, base_out) or "
                         "'skip:<reason>', got None (arms must be shown to agree before timing)")
    if isinstance(check, str):
        if not check.startswith("skip:") or not check[len("skip:"):].strip():
            raise ValueError(f"check: expected 'skip:<reason>' with a non-empty reason, got {check!r}")
        return None
    if not callable(check):
        raise ValueError(f"check: expected a callable or 'skip:<reason>', got {check!r}")
    return check


def _run_checks(arms, base, check: Check | None) -> None:
    outs = {name: f() for name, f in arms.items()}   # the first untimed call of every arm
    if check is None:
        return
    for name in arms:
        if name == base:
            continue
        try:
            check(name, outs[name], outs[base])
        except Exception as e:
            e.add_note(f"abba: arm {name!r} disagrees with base {base!r}; nothing was timed")
            raise


def wall_time(fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes on this process's clock (time.perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def abba(arms: Mapping[str, Callable[[], object]], *, base: str, rounds: int = 5,
         warmup: int = 1, check: Check | str | None = None, number: int = 1,
         timer: Callable[[Callable[[], object]], float] = wall_time) -> ABBAResult:
    """Time `arms` side by side in alternating order after checking they agree.

    arms: name -> zero-argument callable (the work to time; its return value is what `check`
        sees). base: the arm every ratio divides by. rounds: timed rounds (>= 1). warmup:
        untimed calls per arm before timing (>= 1; the first one's outputs are checked).
        check: `check(name, out, base_out)` raising when an arm disagrees with the base
        (e.g. `check_bitwise`), or the string 'skip:<reason>' to time unchecked arms; None
        is refused. number: calls per arm per round (their mean time is the round's time).
        timer: seconds a given zero-argument callable takes (default wall_time); a
        collective benchmark passes one that barriers, calls and takes the max over ranks
        (every rank then runs the same abba in lockstep, checks included).
    Raises ValueError for a bad argument, and whatever `check` raises (before any timing).
    """
    check_fn = _validate(arms, base, rounds, warmup, number, check)
    names = tuple(arms)
    _run_checks(arms, base, check_fn)
    for _ in range(warmup - 1):
        for name in names:
            arms[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            f = arms[name]
            times[name].append(timer(f if number == 1 else lambda f=f: [f() for _ in range(number)]) / number)
    tb = times[base]
    ratio = {n: statistics.median(t / b for t, b in zip(times[n], tb)) for n in names}
    wins = {n: sum(t < b for t, b in zip(times[n], tb)) for n in names}
    median_s = {n: statistics.median(times[n]) for n in names}
    return ABBAResult(names=names, times=times, ratio=ratio, wins=wins, rounds=rounds,
                      median_s=median_s, base=base)


def _fmt_time(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"


def format_table(results: Mapping[str, ABBAResult], title: str = "A-B-B-A paired timings") -> str:
    """Markdown: a `### title` line, then one row per (case, arm): the arm's median time, its
    median paired ratio to the case's base (< 1 = faster than base) and rounds it won."""
    lines = [f"### {title}", "",
             "| case | arm | median | ratio vs base | rounds won |",
             "|---|---|---:|---:|---:|"]
    for case, res in results.items():
        for name in res.names:
            is_base = name == res.base
            ratio = "1 (base)" if is_base else f"{res.ratio[name]:.3f}"
            won = "-" if is_base else f"{res.wins[name]}/{res.rounds}"
            lines.append(f"| {case} | {name} | {_fmt_time(res.median_s[name])} | {ratio} | {won} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- agreement checks

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (bit patterns, NaN payloads and
    the sign of zero included)."""
    if t.dtype == torch.bool:
        return t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.dtype.is_floating_point:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    ne = _bits(a) != _bits(b)
    idx = tuple(int(i) for i in ne.nonzero()[0])
    return (f"{int(ne.sum())} of {ne.numel()} elements differ; first at index {idx}: "
            f"{a[idx].item()!r} vs {b[idx].item()!r}")


def _assert_bitwise_at(a, b, path: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise AssertionError(f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}")
        if a.dtype != b.dtype or a.shape != b.shape:
            raise AssertionError(f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}")
        a, b = a.detach().cpu(), b.detach().cpu()
        if not torch.equal(_bits(a), _bits(b)):
            raise AssertionError(f"{path}: {_first_diff(a, b)}")
        return
    if type(a) is not type(b):
        raise AssertionError(f"{path}: {type(a).__name__} vs {type(b).__name__}")
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            _assert_bitwise_at(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, Mapping):
        if list(a) != list(b):
            raise AssertionError(f"{path}: keys {list(a)} vs {list(b)}")
        for k in a:
            _assert_bitwise_at(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (tuple, list)):
        if len(a) != len(b):
            raise AssertionError(f"{path}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_bitwise_at(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            raise AssertionError(f"{path}: {a!r} vs {b!r}")
    elif a != b:
        raise AssertionError(f"{path}: {a!r} vs {b!r}")


def assert_bitwise(a, b, *, what: str = "value") -> None:
    """Raise AssertionError unless `a` and `b` are bit-identical: tensors (any dtype, any
    device) compare dtype, shape and integer bit views (so -0.0 != 0.0 and NaN payloads
    count); tuples, lists, dicts and dataclasses compare element by element; Python floats
    by their IEEE bits; anything else by ==. The message names the first differing path."""
    _assert_bitwise_at(a, b, what)


def check_bitwise(name: str, out, base_out) -> None:
    """An `abba(check=...)` callable: arm `name`'s output must be bit-identical to the base's."""
    assert_bitwise(out, base_out, what=f"arm {name!r}")


def assert_within(got: torch.Tensor, ref: torch.Tensor, *, atol: float | torch.Tensor, rtol: float,
                  what: str = "value") -> None:
    """Raise AssertionError unless |got - ref| <= atol + rtol * |ref| elementwise, computed in
    float64, with NaN exactly where `ref` has NaN and infinities equal to ref's. atol is a
    number or a tensor broadcastable to ref (a per-element error bound). For arms that are
    not bound to lmtail's bytes (peers, e.g. torch), checked against a float64 reference."""
    if not (isinstance(got, torch.Tensor) and isinstance(ref, torch.Tensor)):
        raise TypeError(f"{what}: expected tensors, got {type(got).__name__} and {type(ref).__name__}")
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {list(got.shape)} vs reference {list(ref.shape)}")
    g, r = got.detach().cpu().double(), ref.detach().cpu().double()
    if not torch.equal(g.isnan(), r.isnan()):
        raise AssertionError(f"{what}: NaN positions differ from the reference")
    inf = r.isinf() | g.isinf()
    if not torch.equal(g[inf], r[inf]):
        raise AssertionError(f"{what}: infinities differ from the reference")
    fin = ~(r.isnan() | inf)
    tol = torch.as_tensor(atol, dtype=torch.float64).expand(r.shape)[fin]
    err = (g[fin] - r[fin]).abs()
    lim = tol + rtol * r[fin].abs()
    if err.numel() and bool((err > lim).any()):
        worst = int((err - lim).argmax())
        atol_s = f"{atol:g}" if isinstance(atol, (int, float)) else "(per element)"
        raise AssertionError(f"{what}: error {err[worst].item():.3g} exceeds atol={atol_s} + "
                             f"rtol={rtol:g}*|ref| (= {lim[worst].item():.3g}) in "
                             f"{int((err > lim).sum())} of {err.numel()} elements")
