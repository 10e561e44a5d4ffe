"""Backends verify themselves before they are trusted; the fastest verified one is chosen.

Every backend of an op gives the same bytes by declaration, but a hardware path (AMX,
AVX512-BF16, AVX-512, AVX2) may be written where it could not run, and a fault in it would
kill the user's process. So the first time an op's table (`_backend.Dispatch`) would run a
backend on a machine, this module checks the table in a CHILD process:

    parent: Dispatch.pick -> record(table) -> cache file? -> yes: read it
                                           -> no: (file lock) child: python -m lmtail.kernels._verify
    child:  for each hardware row: "begin" -> probe cases, bit views vs the "c" row -> "verified" / "differs"
            for each shape class (rows 1 / 2-16 / more): time every verified row and the
            trusted rows ("c", "torch") on the probe's representative case -> "time"
            (one JSON line per event on stdout, flushed)
    parent: a child killed by a signal or hung names the row it had begun: that row is
            "failed", and a new child goes on with the rest; then the record is written.

The record (`Record`) holds each row's status (reference / verified / failed with its
reason), the measured seconds per class and the chosen (fastest verified) row per class.
It is cached as JSON next to the compiled kernels (`_cc` cache dir, verdicts/), keyed by
the op, the bytes of its kernel sources (Dispatch.probe's sources=), the CPU probe's and
every header, the Python module defining the table,
the compiler's version line, the CPU's model name and feature bits. A failed row is never
used on that machine; `Dispatch.pick` warns once per process, naming it and the row used.

The probe of a table (`@TABLE.probe`, next to its op) is `probe(rows, seed) -> call`, where
call(name) runs the op on backend `name` over inputs built once from (rows, seed) (random
values and the format's edge values: NaN, inf, subnormals where the op takes them) and
returns its output tensors; seed -1 is the timing case. A table whose op takes its weight
in more than one layout (gemm_bf16: plain or packed once at load) lists them in
`Dispatch.layouts`; its probe then takes layout= for the timing case, and each layout gets
its own timings and choice ("1/packed", ...).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lmtail.kernels import _cc

TRUSTED = ("c", "torch", "numba")  # the declared orders' plain emulations: never checked
UNTIMED = ("numba",)  # a cross-check, run only when named: never chosen
REFERENCE = "c"
CLASSES = {"1": 1, "16": 8, "many": 64}  # shape class -> the rows its timing case has
CHECK_CASES = ((1, 0), (3, 1), (17, 2), (2, 3))  # (rows, seed) of the bitwise check
CHILD_TIMEOUT_S = 300
TIME_BUDGET_S = 0.25  # per row and class: repeat the timed call while under this


def time_key(cls: str, layout: str = "plain") -> str:
    """The key of a shape class's timings and choice: "1", or "1/packed" for a table timed
    on another weight layout too (Dispatch.layouts)."""
    return cls if layout == "plain" else f"{cls}/{layout}"


def row_class(rows: int | None) -> str:
    """The shape class of a call with `rows` rows: "1", "16" (2..16) or "many"; None -> "1"."""
    if rows is None or rows <= 1:
        return "1"
    return "16" if rows <= 16 else "many"


@dataclass(frozen=True)
class Record:
    """One op's verdicts on this machine (module docstring)."""

    op: str
    status: dict = field(default_factory=dict)   # name -> "reference" | "verified" | "failed"
    reason: dict = field(default_factory=dict)   # name -> why it failed
    times: dict = field(default_factory=dict)    # class -> {name: seconds}
    chosen: dict = field(default_factory=dict)   # class -> name
    path: str = ""                               # the cache file

    def failed(self) -> dict:
        return {n: self.reason.get(n, "") for n, s in self.status.items() if s == "failed"}


# ---------------------------------------------------------------------------------------
# the cache
# ---------------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(table) -> str:
    """A hash of what a verdict depends on (module docstring)."""
    from lmtail.kernels import cpu  # the probe's bits (cpu imports _cc only)

    kernels = Path(_cc.__file__).parent
    h = hashlib.sha256()
    own = [kernels / s for s in getattr(table, "sources", ())] or list(kernels.rglob("*.c"))
    for p in sorted({*own, kernels / "cpu.c", *(h for h in kernels.rglob("*.h") if "_prebuilt" not in h.parts)}):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    mod = sys.modules.get(table.module or "")
    if mod is not None and getattr(mod, "__file__", None):
        h.update(Path(mod.__file__).read_bytes())
    h.update(repr((table.op, _cc.compiler_line(), _cc.FLAGS, cpu_model(), sorted(cpu.features()),
                   platform.machine())).encode())
    return h.hexdigest()[:16]


def cache_file(table, cache_dir: Path | None = None) -> Path:
    root = Path(cache_dir) if cache_dir is not None else _cc.cache_dir()
    slug = "".join(ch if ch.isalnum() else "_" for ch in table.op)
    return root / "verdicts" / f"{slug}-{cache_key(table)}.json"


def _load(path: Path) -> Record | None:
    try:
        d = json.loads(path.read_text())
        return Record(op=d["op"], status=d["status"], reason=d["reason"], times=d["times"],
                      chosen=d["chosen"], path=str(path))
    except (OSError, ValueError, KeyError):
        return None


def _store(path: Path, rec: Record) -> None:
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"op": rec.op, "status": rec.status, "reason": rec.reason,
                               "times": rec.times, "chosen": rec.chosen}, indent=1))
    os.replace(tmp, path)


def record(table, *, cache_dir: Path | None = None, threads: int | None = None) -> Record:
    """The table's verdicts on this machine: read from the cache, or made by child
    processes (under a file lock, so concurrent ranks check once) and cached."""
    path = cache_file(table, cache_dir)
    rec = _load(path)
    if rec is not None:
        return rec
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rec = _load(path)
        if rec is None:
            rec = _verify_in_children(table, threads=threads)
            _store(path, rec)
            rec = Record(**{**rec.__dict__, "path": str(path)})
    return rec


# ---------------------------------------------------------------------------------------
# the parent: children until every row has a verdict
# ---------------------------------------------------------------------------------------
def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def _run_child(table, check: list[str], timed: list[str], threads: int) -> tuple[list[dict], str]:
    """One child's events and, when it did not finish, why (signal, exit code, timeout)."""
    cmd = [sys.executable, "-m", "lmtail.kernels._verify", table.module, table.op,
           "--threads", str(threads), "--check", *check, "--time", *timed]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                             env=_child_env())
        out, rc, why = res.stdout, res.returncode, ""
        if rc < 0:
            why = f"killed by {signal.Signals(-rc).name}"
        elif rc != 0:
            tail = (res.stderr.strip().splitlines() or ["?"])[-1]
            why = f"exit code {rc}: {tail}"
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        why = f"no answer in {CHILD_TIMEOUT_S} s"
    events = []
    for line in out.splitlines():
        with contextlib.suppress(ValueError):
            events.append(json.loads(line))
    return events, why


def _verify_in_children(table, *, threads: int | None) -> Record:
    import torch

    threads = threads or torch.get_num_threads()
    names = table.names("cpu")
    status = {n: "reference" for n in names if n in TRUSTED}
    reason: dict = {}
    keys = [time_key(c, lay) for lay in table.layouts for c in CLASSES]
    times: dict = {k: {} for k in keys}
    pending = [n for n in names if n not in TRUSTED]
    timed_done: set = set()
    for _ in range(len(names) + 2):  # each failed child removes one row
        timed = [n for n in names if n in TRUSTED or status.get(n) == "verified" or n in pending]
        timed = [n for n in timed if n not in timed_done and n not in UNTIMED]
        if not pending and not timed:
            break
        events, why = _run_child(table, pending, timed, threads)
        begun = None
        for ev in events:
            if "begin" in ev:
                begun = ev
            elif "verified" in ev:
                status[ev["verified"]] = "verified"
                pending.remove(ev["verified"])
                begun = None
            elif "differs" in ev:
                status[ev["differs"]] = "failed"
                reason[ev["differs"]] = f"differs from {REFERENCE!r}: {ev['detail']}"
                pending.remove(ev["differs"])
                begun = None
            elif "time" in ev:
                times[ev["class"]][ev["time"]] = ev["s"]
                begun = None
            elif "timed" in ev:
                timed_done.add(ev["timed"])
        if not why:
            break
        culprit = begun["begin"] if begun else None
        if culprit is None or culprit in TRUSTED:  # the child failed outside a hardware row
            for n in pending:
                status[n], reason[n] = "failed", f"the check could not run: {why}"
            pending = []
            if culprit is None:
                break
            timed_done.add(culprit)
            continue
        status[culprit] = "failed"
        where = "while checked" if begun.get("phase") == "check" else "while timed"
        reason[culprit] = f"{why} {where}"
        if culprit in pending:
            pending.remove(culprit)
        timed_done.add(culprit)
    for n in pending:
        status[n], reason[n] = "failed", "no verdict"
    ok = {n for n, s in status.items() if s in ("verified", "reference")}
    chosen = {}
    for c in keys:
        got = {n: t for n, t in times[c].items() if n in ok}
        chosen[c] = min(got, key=lambda n: (got[n], names.index(n))) if got else (
            next((n for n in names if n in ok and n not in UNTIMED), ""))
    return Record(op=table.op, status=status, reason=reason, times=times, chosen=chosen)


# ---------------------------------------------------------------------------------------
# the child
# ---------------------------------------------------------------------------------------
def _emit(**ev) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def _bits(x):
    """The bytes of a tensor / tuple of tensors (None stays None), for a bit-for-bit compare."""
    import torch

    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    if isinstance(x, (tuple, list)):
        return tuple(_bits(y) for y in x)
    if hasattr(x, "__dataclass_fields__"):
        return tuple(_bits(getattr(x, f)) for f in x.__dataclass_fields__)
    return x


def _find_table(module: str, op: str):
    """The table named `op` among `module`'s names (a Dispatch, or a dict of them)."""
    mod = importlib.import_module(module)
    for v in vars(mod).values():
        tables = v.values() if isinstance(v, dict) else (v,)
        for t in tables:
            if hasattr(t, "probe_fn") and getattr(t, "op", None) == op:
                return t
    raise SystemExit(f"no table {op!r} in {module}")


def _time_one(call, name: str, best: float) -> float:
    """The fastest of a few timed calls; inf for a row whose warm call took 30x `best`."""
    t0 = time.perf_counter()
    call(name)  # warm: first-use costs are not the steady state
    if time.perf_counter() - t0 > 30 * best:
        return float("inf")
    fastest, spent = float("inf"), 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        call(name)
        dt = time.perf_counter() - t0
        fastest, spent = min(fastest, dt), spent + dt
        if spent > TIME_BUDGET_S:
            break
    return fastest


def child_main(argv: list[str]) -> int:
    """Check the rows of --check against "c" bit for bit, then time the rows of --time that
    did not differ, one JSON event a line (module docstring)."""
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="python -m lmtail.kernels._verify")
    ap.add_argument("module")
    ap.add_argument("op")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", nargs="*", default=[])
    ap.add_argument("--time", nargs="*", default=[])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    table = _find_table(args.module, args.op)
    table.verifying = True  # this process is the check: pick() takes rows as they are
    cases = [table.probe_fn(rows, seed) for rows, seed in CHECK_CASES]
    want = [_bits(call(REFERENCE)) for call in cases]
    differs = set()
    for name in args.check:
        _emit(begin=name, phase="check")
        bad = next((i for i, call in enumerate(cases) if _bits(call(name)) != want[i]), None)
        if bad is None:
            _emit(verified=name)
        else:
            differs.add(name)
            _emit(differs=name, detail="case rows={} seed={}".format(*CHECK_CASES[bad]))
    timed = [n for n in args.time if n not in differs]
    for layout in table.layouts:
        for cls, rows in CLASSES.items():
            key = time_key(cls, layout)
            call = table.probe_fn(rows, -1) if layout == "plain" else table.probe_fn(rows, -1, layout=layout)
            best = float("inf")
            for name in timed:
                _emit(begin=name, phase="time", **{"class": key})
                t = _time_one(call, name, best)
                best = min(best, t)
                _emit(time=name, s=t, **{"class": key})
    for name in timed:
        _emit(timed=name)
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
