"""The one backend dispatch of lmtail's kernels: a per-op table of backend rows.

A `Backend` row is a name, the device its kernel reads (None: any, e.g. a torch spelling),
an availability predicate (compiled library built, CPU features present: `kernels.cpu`), and
`run`, the op's unchecked entry for that backend (the op has validated its arguments once at
its public boundary). `Dispatch(op, rows)` resolves `backend=` in one place:

  backend=None  the FASTEST VERIFIED row for the call's shape class (rows 1 / 2-16 / more):
                the first time a table would run on a machine, `_verify` checks each
                hardware row against the "c" row bit for bit in a child process and times
                every row that passed (and "c", "torch") on the table's probe; the verdicts
                and the choice are cached per CPU, kernel sources and compiler. Every row
                gives the same bytes, so the choice is speed only. A row that faulted or
                differed is never used: one RuntimeWarning names it and the row used instead.
                Without a probe (or with no hardware row available): the first available row
                in the table's order.
  backend=name  that row, or ValueError naming the available ones (and the reason, for a
                row that failed its check on this machine).

`threads(threads, work=, min_work=)` resolves `threads=` the same way for every op: None ->
torch.get_num_threads(), fewer when the work would give a thread less than min_work.

A device backend (CUDA, Triton) is one more row per op, with device="cpu" replaced by its
own and its own `run`: nothing here assumes host pointers or a CPU (only the CPU rows' `run`
does); only CPU rows are verified and timed here.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lmtail.checks import check_threads
from lmtail.kernels import _verify


def _always() -> bool:
    return True


@dataclass(frozen=True)
class Backend:
    """One backend of one op: `run(*args, **kwargs)` computes it on `device` (None: any)."""

    name: str
    run: Callable
    available: Callable[[], bool] = _always
    device: str | None = "cpu"
    # an emulated build of a hardware path (SIMDe / the AMX tile model, "emu-<isa>"): the
    # same source and bytes, run on a CPU without the ISA; for tests and `lmtail doctor`
    # only, never chosen by backend=None nor listed by names()
    emulated: bool = False


class Dispatch:
    """The backend table of one op (module docstring). `cache_dir`: where verdicts are
    cached (None: next to the compiled kernels)."""

    def __init__(self, op: str, rows: Sequence[Backend], *, cache_dir=None):
        names = [r.name for r in rows]
        assert len(set(names)) == len(names), f"{op}: duplicate backend names {names}"
        self.op, self.rows, self.cache_dir = op, tuple(rows), cache_dir
        self.probe_fn: Callable | None = None  # probe(rows, seed) -> call(name) (_verify)
        self.module: str | None = None          # where the probe (and the table) live
        self.verifying = False                  # True in _verify's child: rows as they are
        self.layouts: tuple[str, ...] = ("plain",)  # weight layouts timed (_verify)
        self.sources: tuple[str, ...] = ()          # the kernel sources its verdict keys on
        self._record: _verify.Record | None = None
        self._warned = False

    def probe(self, fn: Callable | None = None, *, layouts: tuple[str, ...] = ("plain",),
              sources: tuple[str, ...] = ()):
        """Register the table's probe (a decorator; `_verify` module docstring); layouts:
        the weight layouts the op takes, each timed (the probe then takes layout=);
        sources: the kernels/*.c its rows run (the verdict is redone when they change;
        () : every kernel source)."""
        def register(f: Callable) -> Callable:
            self.probe_fn, self.module, self.layouts = f, f.__module__, tuple(layouts)
            self.sources = tuple(sources)
            return f
        return register if fn is None else register(fn)

    def names(self, device: str = "cpu", *, emulated: bool = False) -> tuple[str, ...]:
        """The available backends for tensors on `device`, in the table's order; with
        emulated=True the available emulated rows ("emu-<isa>") too, after them. A row that
        failed its check on this machine is still listed (pick refuses it)."""
        rows = [r for r in self.rows if r.device in (None, device) and r.available()]
        return (tuple(r.name for r in rows if not r.emulated)
                + (tuple(r.name for r in rows if r.emulated) if emulated else ()))

    def checked(self) -> bool:
        """True when pick consults verdicts: a probe, not the check itself, and a hardware
        row available on this CPU."""
        return self._checked(self.names("cpu"))

    def _checked(self, have: tuple[str, ...]) -> bool:
        """checked() on the CPU rows `have` the caller already listed (pick's hot path)."""
        return (self.probe_fn is not None and not self.verifying
                and any(n not in _verify.TRUSTED for n in have))

    def record(self) -> _verify.Record:
        """This machine's verdicts for the table (cached on disk; made once, in children)."""
        if self._record is None:
            self._record = _verify.record(self, cache_dir=self.cache_dir)
        return self._record

    def pick(self, backend: str | None, device: str = "cpu", *, what: str = "",
             rows: int | None = None, layout: str = "plain") -> Backend:
        """The row `backend` names (None: the fastest verified row for `rows` rows and the
        weight `layout`, module docstring); ValueError "backend must be one of (...)<what>; got ..." when it is not
        available for `device`, or names a row that failed its check here."""
        have = self.names(device)
        if backend is not None and backend not in have and backend not in self.names(device, emulated=True):
            raise ValueError(f"backend must be one of {have}{what}; got {backend!r}")
        if backend is None and not have:
            raise ValueError(f"backend must be one of {have}{what}; got {backend!r}")
        if device != "cpu" or not self._checked(have):
            name = backend if backend is not None else have[0]
            return next(r for r in self.rows if r.name == name)
        rec = self.record()
        failed = rec.failed()
        if backend is not None:
            if backend in failed:
                ok = tuple(n for n in have if n not in failed)
                raise ValueError(f"backend {backend!r} of {self.op} failed its check on this "
                                 f"machine ({failed[backend]}); use one of {ok}")
            return next(r for r in self.rows if r.name == backend)
        name = rec.chosen.get(_verify.time_key(_verify.row_class(rows), layout))
        if name not in have or name in failed:
            name = next(n for n in have if n not in failed)
        if failed and not self._warned:
            self._warned = True
            bad = "; ".join(f"{n!r} ({why})" for n, why in failed.items())
            warnings.warn(f"lmtail {self.op}: backend {bad} failed its check on this CPU and is "
                          f"not used; using {name!r} instead (`lmtail doctor` shows the record)",
                          RuntimeWarning, stacklevel=3)
        return next(r for r in self.rows if r.name == name)


def threads(threads: int | None, *, work: int | None = None, min_work: int = 1) -> int:
    """The worker count for one call: `threads` (an int >= 1, else ValueError), or for None
    torch.get_num_threads() capped at work // min_work (at least 1). Bytes never depend on it."""
    check_threads(threads)
    if threads is not None:
        return int(threads)
    n = torch.get_num_threads()
    return max(1, min(n, work // min_work)) if work is not None else n
