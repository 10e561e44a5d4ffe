"""The combined load test: 16 concurrent mixed clients against `lmtail serve`, with planted
failing requests, clients that disconnect and a long prompt arriving mid-run; every other
response must be byte-equal to the same request served alone.

    python -m lmtail.benchmarks.bench_clients [--clients 16] [--rounds 1] [--long-tokens 2000]
        [--quick] [--budget-s 600]

The server runs as a child process on 127.0.0.1 (an ephemeral port, --max-batch 16,
--max-queue 64, the default body), the engine with one planted hook: a row whose
temperature is POISON_T (0.777) raises in the body step after it ran (its cache written,
its length advanced), the failure isolation must contain (serve/engine.py "Isolation").
The clients are the real `openai` client (max_retries 0), threads of this process:

  1. solo: every GOOD request is sent alone, one after another (streams as streams), and
     its answer kept in a canonical form (per choice: text, token ids, every logprob and
     top alternative as JSON text, finish_reason; usage) - bytes, not a tolerance.
  2. mixed: --clients threads take the shuffled list of GOOD requests (greedy; seeded
     top-p / top-k / min-p; stop strings; logprobs with alternatives; n = 2;
     logit_bias; presence / frequency / repetition penalties; response_format json_object
     and json_schema; chat and completions, streamed and not), BAD ones (fields that must
     be a 4xx in OpenAI's shape naming the field), POISON ones (the planted mid-decode
     failure, plain: a 500, stream: an error event), disconnects (a stream closed after a
     few chunks; a plain request whose client times out), with staggered starts; the
     --long-tokens prompt (token ids, a completion) is sent --long-after-s into the run.

Printed: good responses byte-equal to solo / good; failing requests answered with their own
error / failing; disconnects and the server idle after them (/health: active 0, waiting 0);
lost requests (no answer, a transport error, or an answer of the wrong kind). Exit 1 when
a count is not perfect. Every loop is bounded (request counts, max_tokens, timeouts,
--budget-s).

Shape legend: none (counts and wall-clock numbers).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass

POISON_T = 0.777  # the temperature of a planted failing row (the child server's hook)
MODEL = "m"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@dataclass(frozen=True)
class Req:
    """One request: kind "chat" | "completions", its body (openai keyword args: extra_body
    for the non-OpenAI fields), stream, and what it must get: "same" (byte-equal to its
    solo run), "4xx:<param>" (a 4xx in OpenAI's shape naming param), "fail" (the planted
    mid-decode failure: 500 / an error event), "drop-stream" / "drop-plain" (the client
    disconnects)."""

    name: str
    kind: str
    body: dict
    stream: bool = False
    expect: str = "same"


def _chat(content: str, **kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def _cmpl(prompt, **kw) -> dict:
    return {"model": MODEL, "prompt": prompt, **kw}


def good_requests(max_tokens: int) -> list[Req]:
    """The mixed requests whose answers must equal their solo runs."""
    m = max_tokens
    out = [
        Req("greedy", "chat", _chat("Why is the sky blue?", max_tokens=m, temperature=0)),
        Req("greedy-stream", "chat", _chat("Name three rivers.", max_tokens=m, temperature=0), True),
        Req("top-p", "chat", _chat("Write a haiku.", max_tokens=m, temperature=0.9, top_p=0.8, seed=11)),
        Req("top-k", "chat", _chat("Tell me a joke.", max_tokens=m, temperature=1.0, seed=12,
                                   extra_body={"top_k": 20}), True),
        Req("min-p", "chat", _chat("Describe a cat.", max_tokens=m, temperature=1.1, seed=13,
                                   extra_body={"min_p": 0.1})),
        Req("stop", "chat", _chat("Count to twenty.", max_tokens=m, temperature=0, stop=[",", "5"]), True),
        Req("logprobs", "chat", _chat("What is 2+2?", max_tokens=m, temperature=0.7, seed=14, logprobs=True,
                                      top_logprobs=5)),
        Req("logprobs-stream", "chat", _chat("Say hello in French.", max_tokens=m, temperature=0.7, seed=15,
                                             logprobs=True, top_logprobs=3), True),
        Req("n2", "chat", _chat("Pick a color.", max_tokens=m, temperature=1.0, seed=16, n=2)),
        Req("n2-stream", "completions", _cmpl("Once upon a time", max_tokens=m, temperature=0.8, seed=17, n=2), True),
        Req("logit-bias", "chat", _chat("Say yes or no.", max_tokens=m, temperature=0,
                                        logit_bias={"28": -100, "30": 5})),
        Req("penalties", "chat", _chat("List some fruits.", max_tokens=m, temperature=0.8, seed=18,
                                       presence_penalty=0.5, frequency_penalty=0.7), True),
        Req("repetition", "completions", _cmpl("The the the the", max_tokens=m, temperature=0,
                                               extra_body={"repetition_penalty": 1.3})),
        Req("json-object", "chat", _chat("Give me a person as JSON.", max_tokens=m, temperature=0.6, seed=19,
                                         response_format={"type": "json_object"})),
        Req("json-schema", "chat", _chat("A person, JSON.", max_tokens=m, temperature=0,
                                         response_format={"type": "json_schema", "json_schema": {
                                             "name": "p", "schema": SCHEMA}}), True),
        Req("cmpl-echo", "completions", _cmpl("def add(a, b):", max_tokens=m, temperature=0.5, seed=20,
                                              echo=True, logprobs=2)),
        Req("cmpl-stream", "completions", _cmpl("1, 2, 3,", max_tokens=m, temperature=0, logprobs=1), True),
        Req("cmpl-ids", "completions", _cmpl([504, 3458, 314, 253], max_tokens=m, temperature=0.9, top_p=0.95,
                                             seed=21)),
    ]
    return out + [Req(f"{r.name}#2", r.kind, r.body, r.stream) for r in out[:6]]  # repeats: same bytes twice


def long_request(tokens: int) -> Req:
    """A --long-tokens prompt of fixed in-vocabulary token ids (a completion, 4 tokens)."""
    ids = [1000 + (i * 7919) % 40000 for i in range(tokens)]
    return Req("long-prompt", "completions", _cmpl(ids, max_tokens=4, temperature=0, logprobs=2))


def failing_requests(max_tokens: int) -> list[Req]:
    """Bad fields (4xx naming the field), planted mid-decode failures, disconnects."""
    m = max_tokens
    return [
        Req("bad-top-p", "chat", _chat("x", top_p=1.5), expect="4xx:top_p"),
        Req("bad-top-p-fp32", "chat", _chat("x", top_p=1e-50), expect="4xx:top_p"),
        Req("bad-logit-bias", "chat", _chat("x", logit_bias={"abc": 1}), expect="4xx:logit_bias"),
        Req("bad-seed", "completions", _cmpl("x", seed=2 ** 70), expect="4xx:seed"),
        Req("bad-n", "chat", _chat("x", n=1000), expect="4xx:n"),
        Req("bad-format", "chat", _chat("x", response_format={"type": "grammar"}), expect="4xx:response_format"),
        Req("bad-field", "chat", _chat("x", extra_body={"frobnicate": 1}), expect="4xx:frobnicate"),
        Req("bad-max-tokens", "completions", _cmpl("x", max_tokens=-1), expect="4xx:max_tokens"),
        Req("poison-plain", "chat", _chat("Tell me more.", max_tokens=m, temperature=POISON_T, seed=9),
            expect="fail"),
        Req("poison-stream", "chat", _chat("Tell me more.", max_tokens=m, temperature=POISON_T, seed=10), True,
            expect="fail"),
        Req("drop-stream", "chat", _chat("Write a long story.", max_tokens=1500, temperature=0), True,
            expect="drop-stream"),
        Req("drop-stream-2", "completions", _cmpl("Chapter one.", max_tokens=1500, temperature=0.9, seed=3), True,
            expect="drop-stream"),
        Req("drop-plain", "chat", _chat("Write a long essay.", max_tokens=1500, temperature=0),
            expect="drop-plain"),
        Req("drop-plain-2", "completions", _cmpl("Long ago,", max_tokens=1500, temperature=0.7, seed=4),
            expect="drop-plain"),
    ]


# ---------------------------------------------------------------------------------------
# canonical answers
# ---------------------------------------------------------------------------------------
def _merge_choice(acc: dict, c: dict) -> None:
    """Fold one choice object (a whole response's, or a stream chunk's) into acc: text
    concatenated, token ids and logprob entries appended, finish_reason the last set."""
    if c.get("finish_reason") is not None:
        acc["finish_reason"] = c["finish_reason"]
    text = (c.get("message") or c.get("delta") or {}).get("content") if "text" not in c else c["text"]
    acc["text"] = acc.get("text", "") + (text or "")
    acc.setdefault("token_ids", []).extend(c.get("token_ids") or [])
    lp = c.get("logprobs")
    if lp:
        got = acc.setdefault("logprobs", {})
        for key, vals in lp.items():
            if isinstance(vals, list):
                got.setdefault(key, []).extend(vals)
    if c.get("seed") is not None:
        acc["seed"] = c["seed"]


def canonical(parts: list[dict], seeded: bool = True) -> str:
    """One response (or the chunks of one stream) as JSON text: choices by index (the
    merged fields above) and usage; ids and timestamps left out. Equal text = equal bytes
    of every token id, text and logprob (JSON floats round-trip the fp32 values). seeded
    False: the choices' seeds are left out (a request without `seed` gets a random one)."""
    choices: dict[int, dict] = {}
    usage = None
    for p in parts:
        for c in p.get("choices") or []:
            _merge_choice(choices.setdefault(c["index"], {}), c)
        usage = p.get("usage") or usage
    if not seeded:
        for c in choices.values():
            c.pop("seed", None)
    return json.dumps({"choices": [choices[i] for i in sorted(choices)], "usage": usage}, sort_keys=True)


# ---------------------------------------------------------------------------------------
# one request with the openai client
# ---------------------------------------------------------------------------------------
def send(client, r: Req) -> tuple[str, str]:
    """Run request r; returns (outcome, detail): ("ok", canonical answer), ("error", "<status>
    <type> <param> <message>") for an API error in OpenAI's shape, ("stream-error", message)
    for an error event in a stream, ("dropped", how many chunks were read), ("transport",
    what went wrong)."""
    import openai

    api = client.chat.completions if r.kind == "chat" else client.completions
    body = dict(r.body)
    if r.expect == "drop-plain":
        client = client.with_options(timeout=1.5)  # the client gives up: the socket closes mid-request
        api = client.chat.completions if r.kind == "chat" else client.completions
    seeded = "seed" in body
    try:
        if not r.stream:
            return "ok", canonical([api.create(**body).model_dump()], seeded)
        parts = []
        with api.create(stream=True, **body) as stream:
            for ch in stream:
                parts.append(ch.model_dump())
                if r.expect == "drop-stream" and len(parts) >= 4:
                    stream.close()  # the socket closes mid-stream
                    stream._iterator.close()  # and the client's generators end here, not at a later gc
                    return "dropped", str(len(parts))
        return "ok", canonical(parts, seeded)
    except openai.APIStatusError as e:
        err = (e.body or {}) if isinstance(e.body, dict) else {}
        err = err.get("error", err)
        shaped = isinstance(err, dict) and set(err) >= {"message", "type", "param", "code"}
        return "error", f"{e.status_code} {'shaped' if shaped else 'UNSHAPED'} {err.get('param')} {err.get('message')}"
    except openai.APITimeoutError:
        return ("dropped", "timeout") if r.expect == "drop-plain" else ("transport", "timeout")
    except openai.APIError as e:  # an error event inside a stream
        return "stream-error", str(e.message if hasattr(e, "message") else e)
    except Exception as e:  # noqa: BLE001 - counted as lost
        return "transport", f"{type(e).__name__}: {e}"


def judge(r: Req, outcome: str, detail: str, solo: dict[str, str]) -> str:
    """"same", "differs", "own-error", "wrong-error", "disconnected" or "lost" for one answer."""
    if outcome == "transport":
        return "lost"
    if r.expect == "same":
        return "lost" if outcome != "ok" else ("same" if detail == solo[r.name] else "differs")
    if r.expect.startswith("4xx:"):
        if outcome != "error":
            return "lost" if outcome != "ok" else "wrong-error"
        status, shaped, param = detail.split(" ", 3)[:3]
        return "own-error" if 400 <= int(status) < 500 and shaped == "shaped" and param == r.expect[4:] \
            else "wrong-error"
    if r.expect == "fail":
        ok = (outcome == "error" and detail.startswith("500 shaped") or outcome == "stream-error") \
            and "planted" in detail
        return "own-error" if ok else "wrong-error"
    return "disconnected" if outcome == "dropped" else "wrong-error"


# ---------------------------------------------------------------------------------------
# the server (a child process) and the run
# ---------------------------------------------------------------------------------------
def planted_engine(bundle, **kw):
    """An Engine (serve.engine) whose body raises after it ran on any call that holds a
    POISON_T row: the planted mid-decode failure (the server's isolation reruns the step
    row by row; that row alone fails)."""
    from lmtail.serve.engine import Engine

    class Planted(Engine):
        def _body(self, rows, tokens):
            super()._body(rows, tokens)
            if any(r.job.params.temperature == POISON_T for r in rows):
                raise RuntimeError("planted body failure")

    return Planted(bundle, **kw)


def serve(max_batch: int, max_queue: int) -> int:
    """Child mode: planted_engine served on 127.0.0.1 (ephemeral port, printed as `PORT n`)
    until stdin closes."""
    from lmtail.model.gguf_loader import load_model
    from lmtail.serve.app import create_app
    from lmtail.serve.cli import ThreadServer

    engine = planted_engine(load_model(), max_batch=max_batch, max_queue=max_queue)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    print(f"PORT {srv.port}", flush=True)
    sys.stdin.read()  # the parent closes it (or dies)
    srv.stop(10)
    engine.close(10)
    return 0


def start_server(max_batch: int, max_queue: int) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([sys.executable, "-m", "lmtail.benchmarks.bench_clients", "--serve",
                          "--max-batch", str(max_batch), "--max-queue", str(max_queue)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("PORT "):
        p.kill()
        raise RuntimeError(f"the server did not start (got {line!r})")
    return p, f"http://127.0.0.1:{int(line.split()[1])}"


def idle_after(url: str, within_s: float) -> dict:
    """/health once it shows no active or waiting job (or at within_s)."""
    import httpx

    t_end = time.monotonic() + within_s
    while True:
        h = httpx.get(url + "/health", timeout=10).json()
        if (h["active"] == 0 and h["waiting"] == 0) or time.monotonic() > t_end:
            return h
        time.sleep(0.1)


def mixed(url: str, good: list[Req], bad: list[Req], long: Req | None, *, clients: int, long_after_s: float,
          seed: int, budget_s: float) -> list[tuple[Req, str, str]]:
    """The concurrent phase: clients threads over the shuffled requests (staggered starts,
    0-150 ms), the long prompt after long_after_s; returns (request, outcome, detail)."""
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=budget_s)
    reqs = good + bad
    random.Random(seed).shuffle(reqs)
    delays = [random.Random(seed + i).uniform(0, 0.15) for i in range(len(reqs))]

    def one(i, r):
        time.sleep(delays[i] if r is not long else long_after_s)
        return r, *send(c, r)

    with cf.ThreadPoolExecutor(clients + (long is not None)) as ex:
        futs = [ex.submit(one, i, r) for i, r in enumerate(reqs)]
        if long is not None:
            futs.append(ex.submit(one, 0, long))
        return [f.result(timeout=budget_s + 30) for f in futs]


def run_load(url: str, *, clients: int, max_tokens: int, long_tokens: int, long_after_s: float, rounds: int,
             seed: int, budget_s: float, out=print, pick: int | None = None) -> dict:
    """Solo answers first, then `rounds` mixed phases; prints and returns the counts.
    pick: the first `pick` good requests and every 2nd failing one only (a short run)."""
    import httpx  # noqa: F401 - imported before any client thread runs (idle_after uses it)
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=budget_s)
    good, bad = good_requests(max_tokens), failing_requests(max_tokens)
    if pick is not None:
        good, bad = good[:pick], bad[::2]
    long = long_request(long_tokens) if long_tokens else None
    solo, t0 = {}, time.perf_counter()
    for r in ([long] if long else []) + good:  # the long prompt first: no recent prompt shares its prefix later
        outcome, detail = send(c, r)
        if outcome != "ok":
            raise RuntimeError(f"solo run of {r.name} failed: {outcome} {detail}")
        solo[r.name] = detail
    out(f"solo: {len(solo)} requests one at a time in {time.perf_counter() - t0:.1f} s")
    tally: dict[str, int] = {}
    bad_names = []
    for k in range(rounds):
        t0 = time.perf_counter()
        res = mixed(url, good, bad, long, clients=clients, long_after_s=long_after_s, seed=seed + k,
                    budget_s=budget_s)
        for r, outcome, detail in res:
            v = judge(r, outcome, detail, solo)
            tally[v] = tally.get(v, 0) + 1
            if v in ("differs", "wrong-error", "lost"):
                bad_names.append(f"{r.name}: {v} ({outcome} {detail[:160]})")
        out(f"round {k + 1}: {len(res)} requests from {clients} clients in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    health = idle_after(url, 10)  # a disconnected row left running would hold its 1,500 tokens (~20 s+)
    out(f"server idle {time.perf_counter() - t0:.2f} s after the last answer")
    n_good = rounds * (len(good) + (long is not None))
    n_fail = rounds * sum(r.expect in ("fail",) or r.expect.startswith("4xx") for r in bad)
    n_drop = rounds * sum(r.expect.startswith("drop") for r in bad)
    counts = {"same": tally.get("same", 0), "good": n_good, "own_error": tally.get("own-error", 0),
              "failing": n_fail, "disconnected": tally.get("disconnected", 0), "disconnects": n_drop,
              "lost": tally.get("lost", 0), "differs": tally.get("differs", 0),
              "wrong_error": tally.get("wrong-error", 0), "idle_after": health}
    out(f"byte-equal to solo: {counts['same']} / {n_good}"
        f" (long prompt of {long_tokens} tokens included: {'yes' if long else 'no'})")
    out(f"failing requests answered with their own error: {counts['own_error']} / {n_fail}")
    out(f"disconnects: {counts['disconnected']} / {n_drop}; server after the run: active {health['active']}, "
        f"waiting {health['waiting']}")
    out(f"lost requests: {counts['lost']}; differing: {counts['differs']}; wrong errors: {counts['wrong_error']}")
    for line in bad_names:
        out(f"  {line}")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="mixed phases after the solo runs")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--long-tokens", type=int, default=2000, help="the long prompt's tokens (0: none)")
    ap.add_argument("--long-after-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0, help="the shuffle's seed")
    ap.add_argument("--budget-s", type=float, default=300.0, help="a request's timeout")
    ap.add_argument("--url", default=None, help="a running server with the planted hook (default: start one)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 clients, 8 tokens, a 300-token prompt")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--max-queue", type=int, default=64)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.max_batch, args.max_queue)
    if args.quick:
        args.clients, args.max_tokens, args.long_tokens = 8, 8, 300
    proc, url = (None, args.url) if args.url else start_server(args.max_batch, args.max_queue)
    try:
        counts = run_load(url, clients=args.clients, max_tokens=args.max_tokens, long_tokens=args.long_tokens,
                          long_after_s=args.long_after_s, rounds=args.rounds, seed=args.seed,
                          budget_s=args.budget_s)
    finally:
        if proc is not None:
            proc.stdin.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    perfect = counts["same"] == counts["good"] and counts["own_error"] == counts["failing"] \
        and counts["disconnected"] == counts["disconnects"] and counts["lost"] == 0 \
        and counts["idle_after"]["active"] == 0 and counts["idle_after"]["waiting"] == 0
    return 0 if perfect else 1


if __name__ == "__main__":
    sys.exit(main())
