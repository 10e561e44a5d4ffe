"""Does a long prompt stall the streams beside it? `lmtail serve`'s inter-token gaps before
and while a 2,048-token prompt is prefilled, chunked (the engine's schedule) vs whole.

    .venv/bin/python -m lmtail.benchmarks.bench_prefill_gaps [--streams 4] [--prompt-tokens 2048]
        [--rounds 1] [--quick]

Two servers run as child processes on 127.0.0.1 (ephemeral ports, --max-batch 8, the
default body): arm "chunked" is the engine as shipped (chunked prefill interleaved with
decode steps, serve.engine.Chunker); arm "whole" is the same engine prefilling each
prompt in one go (PREFILL_CHUNK chunks back to back: the schedule before chunking).
Arms alternate A B B A per round (the machine is shared and noisy). In each run
--streams greedy streaming completions ("Count ...": they do not stop early) decode; after
--warm-s seconds a --prompt-tokens prompt (fixed token ids, max_tokens 1) is sent; the
streams are closed --tail-s after its answer. Per arm: the streams' median gap before
the injection, the worst gap while it was prefilled (injection to answer) and their
ratio (target: <= 2), and the long prompt's time to its answer. Gaps are the times
between SSE token chunks at the client. Every loop is bounded (tokens, timeouts).

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


def serve(arm: str, max_batch: int) -> int:
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
    engine = cls(load_model(), max_batch=max_batch, max_queue=16)
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


def one_run(url: str, streams: int, prompt_ids: list[int], warm_s: float, tail_s: float) -> dict:
    """Streams, then the long prompt after warm_s; returns the gaps' numbers."""
    import httpx

    stop, times = threading.Event(), [[] for _ in range(streams)]
    threads = [threading.Thread(target=stream_times, args=(url, 4000, stop, t)) for t in times]
    for t in threads:
        t.start()
    time.sleep(warm_s)
    t_in = time.perf_counter()
    with httpx.Client(timeout=300) as h:
        r = h.post(url + "/v1/completions", json={"model": "m", "prompt": prompt_ids, "max_tokens": 1})
    t_out = time.perf_counter()
    r.raise_for_status()
    time.sleep(tail_s)
    stop.set()
    for t in threads:
        t.join(60)
    before = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b < t_in and a > t_in - warm_s / 2]
    during = [b - a for ts in times for a, b in zip(ts, ts[1:]) if b > t_in and a < t_out]
    med = statistics.median(before)
    return {"median_before_ms": 1e3 * med, "worst_before_ms": 1e3 * max(before),
            "median_during_ms": 1e3 * statistics.median(during), "worst_during_ms": 1e3 * max(during),
            "ratio": max(during) / med, "prompt_s": t_out - t_in}


def start(arm: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, __file__, "--serve", arm, "--max-batch", str(max_batch)],
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
    ap.add_argument("--quick", action="store_true", help="a smoke run: 2 streams, a 256-token prompt, one A B")
    ap.add_argument("--serve", choices=("chunked", "whole"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve, args.max_batch)
    if args.quick:
        args.streams, args.prompt_tokens, args.warm_s, args.tail_s = 2, 256, 1.5, 0.5
    def prompt_ids(run: int) -> list[int]:  # fixed, in the vocab; its first token differs per run, so the
        return [1000 + (i * 7919 + 13 * run) % 40000 for i in range(args.prompt_tokens)]  # no prefix to reuse
    servers = {arm: start(arm, args.max_batch) for arm in ("chunked", "whole")}
    try:
        order = ["chunked", "whole"] if args.quick else ["chunked", "whole", "whole", "chunked"] * args.rounds
        for run, arm in enumerate(order):
            r = one_run(servers[arm][1], args.streams, prompt_ids(run), args.warm_s, args.tail_s)
            print(f"{arm:8s} streams {args.streams} prompt {args.prompt_tokens}: median gap before "
                  f"{r['median_before_ms']:.1f} ms (worst {r['worst_before_ms']:.1f}), while prefilling median "
                  f"{r['median_during_ms']:.1f} worst {r['worst_during_ms']:.1f} ms: worst / median before "
                  f"{r['ratio']:.2f}; prompt answered in {r['prompt_s']:.2f} s", flush=True)
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
