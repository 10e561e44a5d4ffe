"""What a SmolLM2 decode step spends outside the kernels: Python glue, argument checks,
torch allocations and views, ctypes marshalling.

One row, T = 1, the declared body (`llama.lmtail_ops()`, amx32 GEMMs) after a short prefill,
on one thread (so every kernel runs on the calling thread). Every C entry point of lmtail's
compiled kernels (each `lmtail_*` function of a loaded library) is wrapped in a timer;
outside = step time - time inside those calls. Times are the calling thread's CPU time
(time.thread_time), so other processes on a busy machine do not inflate them; wall times
are printed too. The wrapper itself costs two clock reads per call, counted outside (so the
figure is an upper bound; the call count is printed to size it).

    .venv/bin/python -m lmtail.benchmarks.bench_overhead [--steps 64] [--rounds 5] [--threads 1]

Runs on any lmtail tree (it finds the libraries by walking the loaded ctypes objects), so
the same script measures a tree before and after a change.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import time

import torch

from lmtail.model import llama
from lmtail.model.gguf_loader import load_model


class _Timed:
    """A ctypes function pointer that adds its wall time to a shared counter."""

    def __init__(self, fn, acc):
        self.fn, self.acc = fn, acc

    def __call__(self, *args):
        t = time.thread_time()
        try:
            return self.fn(*args)
        finally:
            self.acc[0] += time.thread_time() - t
            self.acc[1] += 1


def wrap_kernels(acc) -> int:
    """Wrap every bound `lmtail_*` function of every loaded lmtail library; returns how many."""
    n = 0
    for obj in gc.get_objects():
        if isinstance(obj, ctypes.CDLL) and "lmtail" in str(getattr(obj, "_name", "")):
            for name, fn in list(vars(obj).items()):
                if name.startswith("lmtail_") and not isinstance(fn, _Timed):
                    setattr(obj, name, _Timed(fn, acc))
                    n += 1
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    bundle = load_model()
    ops = llama.lmtail_ops()
    prompt = 16
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64),
                            capacity=prompt + args.steps * (args.rounds + 1))
    llama.prefill(bundle, torch.arange(100, 100 + prompt)[None], cache, ops=ops)  # [1, P]
    nxt = torch.full((1, 1), 500, dtype=torch.int64)
    for _ in range(args.steps):  # warm-up: every library loaded and every entry bound
        llama.forward(bundle, nxt, cache, ops=ops)
    acc = [0.0, 0]
    wrapped = wrap_kernels(acc)
    totals, outside, walls, calls = [], [], [], 0
    for _ in range(args.rounds):
        acc[0], acc[1] = 0.0, 0
        w, t = time.perf_counter(), time.thread_time()
        for _ in range(args.steps):
            llama.forward(bundle, nxt, cache, ops=ops)
        dt, dw = time.thread_time() - t, time.perf_counter() - w
        totals.append(dt / args.steps)
        walls.append(dw / args.steps)
        outside.append((dt - acc[0]) / args.steps)
        calls = acc[1] // args.steps
    print(f"decode step, 1 row, threads={args.threads}: {wrapped} kernel entry points wrapped, "
          f"{calls} kernel calls per step")
    print(f"  step   median {1e3 * statistics.median(totals):.3f} ms CPU "
          f"(wall {1e3 * statistics.median(walls):.3f} ms)")
    print(f"  outside kernels median {1e3 * statistics.median(outside):.3f} ms "
          f"(min {1e3 * min(outside):.3f} ms) per step")


if __name__ == "__main__":
    main()
