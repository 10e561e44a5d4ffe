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
(never forked), so `fn` and `args` must be picklable (a module-level function).
Under torchrun, skip this helper: call dist.init_process_group(backend) (env:// init)
in the script, see docs/exchange.md.

Shape legend: none (processes, not tensors).
"""
from __future__ import annotations

import os
import pickle
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait as wait_ready

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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


def _child(fn, rank, nprocs, backend, port, args, pg_timeout_s, threads, conn):
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
    threads: torch.set_num_threads in each rank (default: leave torch's choice)."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be an int >= 1; got {nprocs!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0; got {timeout_s}")
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, nprocs, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))  # port 0: the OS picks a free one
    procs, conns = [], {}
    for rank in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, daemon=True,
                        args=(fn, rank, nprocs, backend, store.port, tuple(args),
                              timeout_s if pg_timeout_s is None else pg_timeout_s, threads, send_end))
        p.start()
        send_end.close()
        procs.append(p)
        conns[recv_end] = rank
    results, failures = {}, {0: None}
    try:
        results, failures = _collect(procs, conns, timeout_s, grace_s)
    finally:
        settle = time.monotonic() + (0.0 if failures else 10.0)  # let healthy ranks tear down
        for p in procs:
            p.join(max(0.0, settle - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(2)
                if p.is_alive():
                    p.kill()
            p.join()
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
                msg = ("err", "exit", f"process exited with code {procs[rank].exitcode} "
                       "without reporting", "", None)
            if msg[0] == "ok":
                results[rank] = msg[1]
                continue
            failures[rank] = RankFailure(rank, msg[1], msg[2], msg[3], msg[4])
            deadline = min(deadline, time.monotonic() + grace_s)
    for r in range(len(procs)):
        if r not in results and r not in failures:
            failures[r] = RankFailure(r, "timeout", "still running at the deadline; terminated", "")
    return results, failures
