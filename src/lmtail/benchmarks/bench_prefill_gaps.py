"""Does a long prompt stall the streams beside it? `lmtail serve`'s inter-token gaps before
and while a 2,048-token prompt is prefilled, chunked (the engine's schedule) vs whole.

    .venv/bin/python -m lmtail.benchmarks.bench_prefill_gaps [--streams 4] [--prompt-tokens 2048]
        [--rounds 1] [--arms chunked,whole | chunked,control] [--prefill-share S] [--quick]

Two servers run as child processes on 127.0.0.1 (ephemeral ports, --max-batch 8, the
default body): arm "chunked" is the engine as shipped (chunked prefill interleaved with
decode steps, serve.engine.Chunker); arm "whole" is the same engine prefilling each
prompt in one go (PREFILL_CHUNK chunks back to back: the schedule before chunking).
Arm "control" (--arms chunked,control) is the chunked server with no long prompt: its
"while prefilling" window is as long as the last chunked run's prefill (--hold-s before
any), so its worst gap is the box's own noise over as many gaps. Arms alternate A B B A
per round (the machine is shared and noisy). In each run
--streams greedy streaming completions ("Count ...": they do not stop early) decode; after
--warm-s seconds a --prompt-tokens prompt (fixed token ids, max_tokens 1) is sent; the
streams are closed --tail-s after its answer. Per arm: the streams' median gap before
the injection, the gaps while it was prefilled (injection to answer: median, p90, p99,
worst), the worst over the median before (target: <= 2), and the long prompt's time to
its answer. Gaps are the times
between SSE token chunks at the client; the client shares the 2 cores, so chunks may reach
it in pairs (gaps near 0 and near 2 periods), which can halve the median: the mean gap
before (its window over its tokens) is printed too, with the worst over it. Every loop is bounded (tokens, timeouts).

Shape legend: none (wall-clock numbers).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

STREAM_PROMPT = "Count from 1 to 1000, separated by commas: 1, 2, 3,"


def serve(arm: str, max_batch: int, share: float | None) -> int:
    """Child mode: serve the arm's engine on 127.0.0.1 (ephemeral port, printed as `PORT n`)
    until stdin closes."""
    from lmtail.model.gguf_loader import load_model
    from lmtail.serve.app import create_app
    from lmtail.serve.cli import ThreadServer
    from lmtail.serve.engine import Engine

    class Whole(Engine):
        """Each prompt prefilled in one go (no decode step between its chunks)."""

        def _prefill_some(self):
            for pre in list(self._prefills):
                while pre in self._prefills:
                    self._prefill_chunk(pre, None)

    cls = {"chunked": Engine, "whole": Whole}[arm]
    kw = {} if share is None else {"prefill_share": share}
    engine = cls(load_model(), max_batch=max_batch, max_queue=16, **kw)
    srv = ThreadServer(create_app(engine, model_name="m")).start()
    print(f"PORT {srv.port}", flush=True)
    sys.stdin.read()  # the parent closes it (or dies)
    srv.stop(10)
    engine.close(10)
    return 0


def stream_times(url: str, max_tokens: int, stop: threading.Event, out: list) -> None:
    """One greedy streaming completion; appends the arrival time of each token chunk."""
    import httpx

    body = {"model": "m", "prompt": STREAM_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.Client(timeout=120) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                out.append(time.perf_counter())
            if stop.is_set():
                break


def quantile(xs: list[float], q: float) -> float:
    """The q-quantile of xs (nearest rank below)."""
    ys = sorted(xs)
    return ys[int(q * (len(ys) - 1))]


def one_run(url: str, streams: int, prompt_ids: list[int] | None, warm_s: float, tail_s: float,
            hold_s: float) -> dict:
    """Streams, then the long prompt after warm_s (None: the control, no prompt: the
    window is hold_s long); returns the gaps' numbers."""
    import httpx

    stop, times = threading.Event(), [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream_times, args=(url, 4000, stop, t)) for t in times]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    t_in = time.perf_counter()
    if prompt_ids is None:
        time.sleep(hold_s)
    else:
        with httpx.Client(timeout=300) as h:
            r = h.post(url + "/v1/completions", json={"model": "m", "prompt": prompt_ids, "max_tokens": 1})
        r.raise_for_status()
    t_out = time.perf_counter()
    time.sleep(tail_s)
    stop.set()
    for t in threads:
        t.join(60)
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < t_in and a > t_in - warm_s / 2]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t_in and a < t_out]
    med, mean = statistics.median(before), statistics.mean(before)
    return {"median_before_ms": 1e3 * med, "mean_before_ms": 1e3 * mean, "ratio_mean": max(during) / mean, "worst_before_ms": 1e3 * max(before),
            "median_during_ms": 1e3 * statistics.median(during), "worst_during_ms": 1e3 * max(during),
            "p90_during_ms": 1e3 * quantile(during, 0.9), "p99_during_ms": 1e3 * quantile(during, 0.99),
            "gaps": len(during), "ratio": max(during) / med, "prompt_s": t_out - t_in}


def start(arm: str, max_batch: int, share: float | None) -> tuple[subprocess.Popen, str]:
    extra = [] if share is None else ["--prefill-share", str(share)]
    p = subprocess.Popen([sys.executable, __file__, "--serve", arm, "--max-batch", str(max_batch), *extra],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("PORT "):
        p.kill()
        raise RuntimeError(f"the {arm} server did not start (got {line!r})")
    return p, f"http://127.0.0.1:{int(line.split()[1])}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1, help="A B B A rounds")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--tail-s", type=float, default=1.0)
    ap.add_argument("--arms", default="chunked,whole",
                    help="two of chunked, whole, control (the chunked server, no long prompt: the box's own noise)")
    ap.add_argument("--hold-s", type=float, default=30.0,
                    help="the control's window when no chunked run came before it (else that run's prompt time)")
    ap.add_argument("--prefill-share", type=float, default=None,
                    help="the servers' Engine prefill_share (default: the engine's, serve.engine.PREFILL_SHARE)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 streams, a 256-token prompt, one A B")
    ap.add_argument("--serve", choices=("chunked", "whole"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.max_batch, args.prefill_share)
    if args.quick:
        args.streams, args.prompt_tokens, args.warm_s, args.tail_s = 2, 256, 1.5, 0.5
    def prompt_ids(run: int) -> list[int]:  # fixed, in the vocab; its first token differs per run, so the
        return [1000 + (i * 7919 + 13 * run) % 40000 for i in range(args.prompt_tokens)]  # no prefix to reuse
    arms = args.arms.split(",")
    if len(arms) != 2 or not set(arms) <= {"chunked", "whole", "control"}:
        ap.error(f"--arms must be two of chunked, whole, control; got {args.arms!r}")
    kinds = {arm: "chunked" if arm == "control" else arm for arm in arms}  # control: the chunked server
    servers = {kind: start(kind, args.max_batch, args.prefill_share) for kind in set(kinds.values())}
    hold_s = args.hold_s
    try:
        order = arms if args.quick else [arms[0], arms[1], arms[1], arms[0]] * args.rounds
        for run, arm in enumerate(order):
            ids = None if arm == "control" else prompt_ids(run)
            r = one_run(servers[kinds[arm]][1], args.streams, ids, args.warm_s, args.tail_s, hold_s)
            if arm == "chunked":
                hold_s = r["prompt_s"]  # the control's window: as long as the last chunked prefill took
            what = "no prompt" if ids is None else f"prompt {args.prompt_tokens}"
            print(f"{arm:8s} streams {args.streams} {what}: median gap before "
                  f"{r['median_before_ms']:.1f} ms (mean {r['mean_before_ms']:.1f}, worst {r['worst_before_ms']:.1f}), "
                  f"while prefilling median "
                  f"{r['median_during_ms']:.1f} p90 {r['p90_during_ms']:.1f} p99 {r['p99_during_ms']:.1f} worst "
                  f"{r['worst_during_ms']:.1f} ms ({r['gaps']} gaps): worst / median before "
                  f"{r['ratio']:.2f} (/ mean before {r['ratio_mean']:.2f}); prompt answered in {r['prompt_s']:.2f} s",
                  flush=True)
    finally:
        for p, _ in servers.values():
            p.stdin.close()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
