"""The one backend dispatch of lmtail's kernels: a per-op table of backend rows.

A `Backend` row is a name, the device its kernel reads (None: any, e.g. a torch spelling),
an availability predicate (compiled library built, CPU features present: `kernels.cpu`), and
`run`, the op's unchecked entry for that backend (the op has validated its arguments once at
its public boundary). `Dispatch(op, rows)` resolves `backend=` in one place:

  backend=None  the first available row, in the table's order, whose device matches the
                tensors': a FIXED preference order (widest vector ISA first), not a
                measurement; every row gives the same bytes, so the choice is speed only.
  backend=name  that row, or ValueError naming the available ones.

`threads(threads, work=, min_work=)` resolves `threads=` the same way for every op: None ->
torch.get_num_threads(), fewer when the work would give a thread less than min_work.

A device backend (CUDA, Triton) is one more row per op, with device="cuda" and its own
`run`: nothing here assumes host pointers or a CPU (only the CPU rows' `run` does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from lmtail.checks import check_threads


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
    """The backend table of one op (module docstring)."""

    def __init__(self, op: str, rows: Sequence[Backend]):
        names = [r.name for r in rows]
        assert len(set(names)) == len(names), f"{op}: duplicate backend names {names}"
        self.op, self.rows = op, tuple(rows)

    def names(self, device: str = "cpu", *, emulated: bool = False) -> tuple[str, ...]:
        """The available backends for tensors on `device`, in preference order; with
        emulated=True the available emulated rows ("emu-<isa>") too, after them."""
        rows = [r for r in self.rows if r.device in (None, device) and r.available()]
        return (tuple(r.name for r in rows if not r.emulated)
                + (tuple(r.name for r in rows if r.emulated) if emulated else ()))

    def pick(self, backend: str | None, device: str = "cpu", *, what: str = "") -> Backend:
        """The row `backend` names (None: the first available); ValueError "backend must be
        one of (...)<what>; got ..." when it is not available for `device`."""
        have = self.names(device)
        if backend is None and have:
            name = have[0]
        elif backend in have or backend in self.names(device, emulated=True):
            name = backend
        else:
            raise ValueError(f"backend must be one of {have}{what}; got {backend!r}")
        return next(r for r in self.rows if r.name == name)


def threads(threads: int | None, *, work: int | None = None, min_work: int = 1) -> int:
    """The worker count for one call: `threads` (an int >= 1, else ValueError), or for None
    torch.get_num_threads() capped at work // min_work (at least 1). Bytes never depend on it."""
    check_threads(threads)
    if threads is not None:
        return int(threads)
    n = torch.get_num_threads()
    return max(1, min(n, work // min_work)) if work is not None else n
