"""Where do the streams' gaps come from while a long prompt is prefilled? The engine's own
decode steps, in-process (no HTTP, no client on the cores), step by step.

    .venv/bin/python -m lmtail.benchmarks.bench_prefill_steps [--share 0.5] [--prompt-tokens 2048]
        [--control-s 0] [--log]

One serve.engine.Engine (max_batch 8, the default body) runs on its thread; 4 greedy rows
("Count from 1 to 1000, ...": they do not stop early) decode; after 60 tokens each, a
--prompt-tokens prompt (fixed token ids, max_tokens 1) is submitted (--control-s S > 0:
none; the window is S seconds: the box's own noise and the rows' growing contexts, as a
control). Printed: the rows' gaps (token times stamped at the sink, on the engine
thread) before the prompt and while it is prefilled (median, p90, p99, worst, worst /
median before), the submit call's time (the cache's page faults), and, while it is
prefilled, the decode steps' periods (one step's start to the next) split into steps that
carried a chunk and plain ones (Engine's RIDE_RUN): the ratio of their medians is what the
chunks add to a stream's gap, measured side by side on the same box at the same time.
--log prints every step (start time from the prompt's arrival, period, step and body
times, the chunk's first position and size, the time it added over the median plain body
call). Every loop is bounded (tokens, timeouts).

Shape legend: none (wall-clock numbers).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time


def quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[int(q * (len(ys) - 1))]


def run(share: float, prompt_tokens: int, control_s: float, log: bool) -> None:
    from lmtail.model.gguf_loader import load_model
    from lmtail.serve.engine import Engine, Job, Token
    from lmtail.tail.sampler import SamplingParams

    class Logged(Engine):
        """The engine with each decode step's times recorded (the same schedule and bytes)."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.log, self._tb = [], None

        def step(self):
            t0, ride = time.perf_counter(), self._ride
            super().step()
            self.log.append({"t0": t0, "t1": time.perf_counter(), "body": self._tb,
                             "ride": None if ride is None else (ride[0].done, ride[1]),
                             "extra": None if self._rode is None else self._rode[3]})

        def _body(self, rows, tokens):
            t = time.perf_counter()
            super()._body(rows, tokens)
            self._tb = time.perf_counter() - t

    class Sink:
        def __init__(self):
            self.t, self.done = [], threading.Event()

        def __call__(self, ev):
            if isinstance(ev, Token):
                self.t.append(time.perf_counter())
            else:
                self.done.set()

    bundle = load_model()
    eng = Logged(bundle, max_batch=8, prefill_share=share)
    sinks = [Sink() for _ in range(4)]
    ids = bundle.tokenizer.encode("Count from 1 to 1000, separated by commas: 1, 2, 3,")
    jobs = [Job(prompt_ids=ids, params=SamplingParams(temperature=0.0), max_tokens=4000, sink=s) for s in sinks]
    long_sink = Sink()
    eng.start()
    try:
        for j in jobs:
            eng.submit(j)
        t_end = time.monotonic() + 120
        while min(len(s.t) for s in sinks) < 60 and time.monotonic() < t_end:
            time.sleep(0.01)
        t_in = time.perf_counter()
        if control_s <= 0:
            long_ids = [1000 + (i * 7919 + 13) % 40000 for i in range(prompt_tokens)]
            eng.submit(Job(prompt_ids=long_ids, params=SamplingParams(temperature=0.0), max_tokens=1, sink=long_sink))
        t_sub = time.perf_counter() - t_in
        if control_s > 0:
            time.sleep(control_s)
        else:
            long_sink.done.wait(600)
        t_out = time.perf_counter()
    finally:
        for j in jobs:
            j.cancel()
        eng.close(10)
    report(eng.log, sinks, t_in, t_out, t_sub, share, control_s, log)


def report(steps, sinks, t_in, t_out, t_sub, share, control_s, log) -> None:
    before = [b - a for s in sinks for a, b in zip(s.t, s.t[1:]) if b < t_in]
    during = [b - a for s in sinks for a, b in zip(s.t, s.t[1:]) if b > t_in and a < t_out]
    med = statistics.median(before)
    what = f"control {control_s:.0f} s" if control_s > 0 else "prompt"
    print(f"{what} share {share}: gaps before median {1e3 * med:.1f} p90 {1e3 * quantile(before, .9):.1f} worst "
          f"{1e3 * max(before):.1f} ms; during median {1e3 * statistics.median(during):.1f} p90 "
          f"{1e3 * quantile(during, .9):.1f} p99 {1e3 * quantile(during, .99):.1f} worst {1e3 * max(during):.1f} ms "
          f"({len(during)} gaps): worst / median before {max(during) / med:.2f}; window {t_out - t_in:.2f} s"
          + ("" if control_s > 0 else f"; submit {1e3 * t_sub:.0f} ms"), flush=True)
    win = [e for e in steps if t_in < e["t0"] < t_out]
    periods = [(b["t0"] - a["t0"], a["ride"] is not None) for a, b in zip(win, win[1:])]
    plain = [p for p, rode in periods if not rode]
    rode = [p for p, r in periods if r]
    if plain and rode:
        print(f"  steps while prefilling: plain {len(plain)}, median {1e3 * statistics.median(plain):.1f} p90 "
              f"{1e3 * quantile(plain, .9):.1f} worst {1e3 * max(plain):.1f} ms; with a chunk {len(rode)}, median "
              f"{1e3 * statistics.median(rode):.1f} p90 {1e3 * quantile(rode, .9):.1f} worst {1e3 * max(rode):.1f} ms; "
              f"medians' ratio {statistics.median(rode) / statistics.median(plain):.2f}", flush=True)
    if log:
        for a, b in zip(steps, steps[1:] + [None]):
            per = "" if b is None else f"{1e3 * (b['t0'] - a['t0']):6.1f}"
            extra = "" if a["extra"] is None else f"{1e3 * a['extra']:.1f}"
            print(f"{1e3 * (a['t0'] - t_in):9.1f} period {per} step {1e3 * (a['t1'] - a['t0']):6.1f} body "
                  f"{1e3 * (a['body'] or 0):6.1f} chunk {a['ride']} extra {extra}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--share", type=float, default=0.5, help="the engine's prefill_share")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--control-s", type=float, default=0.0, help="> 0: no prompt, a window this long (control)")
    ap.add_argument("--log", action="store_true", help="print every decode step")
    args = ap.parse_args(argv)
    run(args.share, args.prompt_tokens, args.control_s, args.log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
