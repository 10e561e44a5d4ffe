"""Run a function on N torch.distributed ranks in fresh local processes, with a wall clock.

    launch(fn, 4)                       parent: TCPStore server on a free localhost port
      |-- spawn rank 0..3 ------------>  child r: init_process_group(store, r, 4)
      |                                            result = fn(r, *args)
      |                                            barrier; destroy_process_group
      |<-- pickled ("ok", result) or ("err", type, message, traceback) over a pipe
      v
    [result_0, ..., result_3]   or LaunchError naming each failing rank with its traceback

Bounded: the whole run may take `timeout_s`; after the first rank fails the others get
`grace_s` to report (they normally fail fast: a dead peer resets their connections, a
hanging one trips the exchange timeout) and are then terminated. Children are spawned
(never forked), so `fn` and `args` must be picklable: fn a module-level function of a module
the ranks can import (a lambda, a nested function or a function of an interactive
`__main__` is a ValueError saying so, before any rank starts); a script that calls launch
needs an `if __name__ == "__main__":` guard (each rank re-imports it).
Ranks never outlive the launcher (launch's docstring: PR_SET_PDEATHSIG in each rank, a
SIGTERM handler in the caller while the ranks run).
Under torchrun, skip this helper: call dist.init_process_group(backend) (env:// init)
in the script, see docs/exchange.md.

Shape legend: none (processes, not tensors).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_ready

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .checks import check_positive, check_threads, is_finite_real, is_int, need


@dataclass(frozen=True)
class RankFailure:
    """What one rank reported (or what happened to it)."""

    rank: int
    exc_type: str  # e.g. "ValueError"; "exit" (died silently), "timeout" (terminated)
    message: str
    traceback: str
    exception: BaseException | None = field(default=None, compare=False, repr=False)  # if picklable


class LaunchError(RuntimeError):
    """One or more ranks failed or ran out of time; `failures` maps rank -> RankFailure,
    in the order they were observed (the first is usually the root cause)."""

    def __init__(self, message: str, failures: dict[int, RankFailure]):
        super().__init__(message)
        self.failures = failures


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_processes(procs, *, settle_s: float) -> bool:
    """Join processes for up to settle_s seconds in all, then terminate (2 s) and kill what is
    left; every process is joined on return. True if all had exited within settle_s."""
    t_end = time.monotonic() + settle_s
    for p in procs:
        p.join(max(0.0, t_end - time.monotonic()))
    clean = all(not p.is_alive() for p in procs)
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
            if p.is_alive():
                p.kill()
        p.join()
    return clean


def die_with_parent(parent_pid: int) -> None:
    """Bind this rank's life to its launcher's: on Linux the kernel SIGKILLs it when the
    launching process dies, however that dies (prctl PR_SET_PDEATHSIG); and if the
    launcher is already gone (it died before the prctl), exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _child(fn, rank, nprocs, backend, port, args, pg_timeout_s, threads, conn, parent_pid):
    die_with_parent(parent_pid)
    ok = False
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        td = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, nprocs, False, timeout=td)
        dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs, timeout=td)
        result = fn(rank, *args)
        payload = pickle.dumps(("ok", result))
        ok = True
    except BaseException as e:  # report everything, including SystemExit / KeyboardInterrupt
        try:
            exc = pickle.loads(pickle.dumps(e))
        except Exception:
            exc = None
        payload = pickle.dumps(("err", type(e).__name__, str(e), traceback.format_exc(), exc))
    conn.send_bytes(payload)
    conn.close()
    if ok:  # nobody leaves while a peer may still be reading its bytes
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0 if ok else 1)  # skip interpreter teardown (a failed collective may linger)


def launch(fn, nprocs: int, *, backend: str = "gloo", args=(), timeout_s: float = 120.0,
           grace_s: float = 10.0, pg_timeout_s: float | None = None, threads: int | None = None):
    """Run fn(rank, *args) on ranks 0..nprocs-1 of a fresh process group; return the
    per-rank return values as a list (rank order). Raises LaunchError (with every
    failing rank's exception type, message and traceback, the first observed first)
    if any rank raises or dies, or if the run exceeds timeout_s (ranks still running
    are terminated). pg_timeout_s: the process group's own timeout (default timeout_s);
    threads: torch.set_num_threads in each rank (default: leave torch's choice).
    Lifetime: no rank outlives the caller. On Linux each rank asks the kernel to SIGKILL
    it when the launching process dies (PR_SET_PDEATHSIG: SIGKILL, SIGTERM, a crash);
    SIGTERM of the caller's main thread (default handler) raises SystemExit(143) there, so
    the ranks are terminated and joined before it exits; Ctrl-C (KeyboardInterrupt) too.
    Bad arguments are a ValueError before any process starts."""
    _check_launch(fn, nprocs, backend, args, timeout_s, grace_s, pg_timeout_s, threads)
    with _sigterm_as_exit():
        return _launch(fn, nprocs, backend, tuple(args), timeout_s, grace_s, pg_timeout_s, threads)


def _check_launch(fn, nprocs, backend, args, timeout_s, grace_s, pg_timeout_s, threads) -> None:
    """ValueError (expected vs got) for anything launch cannot take, before any process starts."""
    need(callable(fn), f"fn must be callable; got {type(fn).__name__}")
    _check_spawnable(fn)
    need(is_int(nprocs) and nprocs >= 1, f"nprocs must be an int >= 1; got {nprocs!r}")
    need(isinstance(backend, str), f"backend must be a str (e.g. 'gloo'); got {backend!r}")
    need(isinstance(args, (tuple, list)), f"args must be a tuple; got {type(args).__name__}")
    need(is_finite_real(timeout_s) and timeout_s > 0,
         f"timeout_s must be > 0; got {timeout_s!r} (a finite number of seconds)")
    need(is_finite_real(grace_s) and grace_s >= 0,
         f"grace_s must be a finite number >= 0; got {grace_s!r}")
    if pg_timeout_s is not None:
        check_positive("pg_timeout_s", pg_timeout_s)
    check_threads(threads)


def _check_spawnable(fn) -> None:
    """ValueError saying why, unless a spawned rank can receive fn: pickle must be able to
    write it (a lambda or a function defined inside another cannot be), and a function of
    `__main__` needs a main script the rank can re-import (not `python -c`, stdin or an
    interactive session). Pickling a module-level function writes only its name."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        pickle.dumps(fn)
    except Exception as e:  # PicklingError, AttributeError, TypeError: all mean "cannot reach a rank"
        raise ValueError(f"fn must be picklable (a function defined at module level of an importable module: "
                         f"the ranks are spawned processes); got {name!r}, which cannot be pickled "
                         f"({type(e).__name__}: {e})") from None
    module = getattr(fn, "__module__", None)
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    if module == "__main__" and main_file is None:
        raise ValueError(f"fn must be importable by the spawned ranks; got {name!r} defined in __main__ of "
                         "an interactive session, `python -c` or stdin, which a rank cannot re-import "
                         "(define it in a module or a script file with an `if __name__ == \"__main__\":` guard)")


@contextlib.contextmanager
def _sigterm_as_exit():
    """While the ranks run, SIGTERM (a supervisor, `timeout`, a container stop) raises
    SystemExit(143) in the main thread, so launch's cleanup terminates the ranks before
    the process goes. Only when SIGTERM has its default action and this is the main thread;
    the previous handler is restored after."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def on_term(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _launch(fn, nprocs, backend, args, timeout_s, grace_s, pg_timeout_s, threads):
    """launch's body (arguments checked): spawn, collect, tear down."""
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, nprocs, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))  # port 0: the OS picks a free one
    procs, conns = [], {}
    for rank in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, daemon=True,
                        args=(fn, rank, nprocs, backend, store.port, args,
                              timeout_s if pg_timeout_s is None else pg_timeout_s, threads, send_end,
                              os.getpid()))
        p.start()
        send_end.close()
        procs.append(p)
        conns[recv_end] = rank
    results, failures = {}, {0: None}
    try:
        results, failures = _collect(procs, conns, timeout_s, grace_s)
    finally:
        stop_processes(procs, settle_s=0.0 if failures else 10.0)  # let healthy ranks tear down
        del store
    if failures:
        first = next(iter(failures.values()))
        msg = "\n".join(f"rank {f.rank} failed: {f.exc_type}: {f.message}\n{f.traceback}"
                        for f in failures.values())
        raise LaunchError(f"{len(failures)} of {nprocs} ranks failed (first: rank {first.rank}, "
                          f"{first.exc_type}: {first.message})\n{msg}", failures) \
            from first.exception
    return [results[r] for r in range(nprocs)]


def _collect(procs, conns, timeout_s, grace_s):
    """Read each rank's report until all are in, the deadline passes, or grace_s after
    the first failure. A rank that dies without reporting shows up as EOF on its pipe.
    Returns (results {rank: value}, failures {rank: RankFailure}, in observed order)."""
    deadline = time.monotonic() + timeout_s
    results, failures = {}, {}
    while conns:
        now = time.monotonic()
        if now >= deadline:
            break
        for conn in wait_ready(list(conns), timeout=deadline - now):
            rank = conns.pop(conn)
            try:
                msg = pickle.loads(conn.recv_bytes())
            except EOFError:
                procs[rank].join(5)
                msg = ("err", "exit", f"process exited with code {procs[rank].exitcode} without "
                       "reporting (it died before fn ran or could report: e.g. fn or args could not be "
                       "unpickled in the rank, or a script calling launch without an `if __name__ == "
                       "\"__main__\":` guard; the rank's stderr says which)", "", None)
            if msg[0] == "ok":
                results[rank] = msg[1]
                continue
            failures[rank] = RankFailure(rank, msg[1], msg[2], msg[3], msg[4])
            deadline = min(deadline, time.monotonic() + grace_s)
    for r in range(len(procs)):
        if r not in results and r not in failures:
            failures[r] = RankFailure(r, "timeout", "still running at the deadline; terminated", "")
    return results, failures
