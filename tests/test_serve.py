"""lmtail serve: continuous batching gives every request the bytes of its solo run.

In-process: the engine driven step by step (requests joining and leaving) against a solo
reference built from the library alone (llama.prefill / llama.forward on one row +
decode_tail), token ids and logprob bits; a planted batch-dependent draw must go red.
Over HTTP: a real uvicorn server on 127.0.0.1 (ephemeral port) and the real `openai`
client; concurrent mixed requests vs their solo runs; echo scoring vs generation
logprobs; bad inputs with their status codes; a disconnecting client frees its slot.
The long load test and the SIGTERM test are @pytest.mark.slow.

Shape legend: R rows, H hidden.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import fbits as bits  # noqa: E402
from lmtail.model.generate import default_head_input, default_ops, head_weight, step_config  # noqa: E402
from lmtail.model.gguf_loader import ModelFileMissing, load_model  # noqa: E402
from lmtail.model.llama import forward, lmtail_ops, new_cache, prefill  # noqa: E402
from lmtail.tail.sampler import SamplingParams, sampling_tensor  # noqa: E402
from lmtail.serve import protocol  # noqa: E402
from lmtail.serve.app import create_app  # noqa: E402
from lmtail.serve.batch import grow, row_cache, step_rows  # noqa: E402
from lmtail.serve.cli import ThreadServer  # noqa: E402
from lmtail.serve.engine import Done, Engine, Failed, Job, Prompt, QueueFull, TextTracker, Token, score_positions
from lmtail.tail.compose import decode_tail  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
K = 256


@pytest.fixture(scope="module")
def bundle():
    try:
        return load_model()
    except ModelFileMissing as e:
        pytest.skip(str(e))


def solo(bundle, ids, params: SamplingParams, max_tokens: int, ops=None):
    """The request served alone, from the library only (generate's default body and head:
    the q32 body, the Q8_0 head with head_input "fp32"; or `ops`' body with its head):
    (token ids, logprob bits)."""
    ops, cfg = default_ops() if ops is None else ops, bundle.config
    hi = default_head_input(ops)
    cache = new_cache(cfg, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids) + max_tokens)
    h = prefill(bundle, torch.tensor([ids]), cache, ops=ops)  # [1, H]
    toks, lps = [], []
    for step in range(max_tokens):
        sp = sampling_tensor([params], positions=[len(ids) + step])
        out = decode_tail(h, bundle.final_norm, head_weight(bundle, hi), eps=cfg.eps, k=K, sampling_params=sp,
                          emit_logits=False, head_input=hi)
        toks.append(int(out.tokens[0]))
        lps.append(bits(float(out.logprobs[0])))
        if toks[-1] in bundle.tokenizer.stop_ids:
            break
        h = forward(bundle, out.tokens[:, None], cache, ops=ops)[0][:, -1]
    return toks, lps


class Collect:
    """A job sink that keeps the events."""

    def __init__(self):
        self.events = []

    def __call__(self, ev):
        self.events.append(ev)

    def result(self):
        toks = [e for e in self.events if isinstance(e, Token)]
        return [t.id for t in toks], [bits(t.logprob) for t in toks]

    @property
    def done(self):
        return bool(self.events) and isinstance(self.events[-1], (Done, Failed))


def chat_ids(bundle, text):
    return bundle.tokenizer.encode(bundle.tokenizer.chat_prompt(text))


REQUESTS = [  # (prompt, params, max_tokens, joins at step)
    ("Why is the sky blue?", SamplingParams(temperature=0.0, seed=1), 7, 0),
    ("Name three fruits.", SamplingParams(temperature=0.9, top_p=0.9, seed=11), 3, 0),
    ("Write a haiku about rain.", SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=12), 5, 1),
    ("What is 2+2?", SamplingParams(temperature=0.0, seed=2), 2, 3),
    ("Say hello in French.", SamplingParams(temperature=1.2, top_k=8, seed=13), 3, 3),
]


def drive(engine: Engine, bundle, requests):
    """Run the schedule: request i is admitted before step `joins`; steps until all done."""
    sinks = [Collect() for _ in requests]
    jobs = [Job(prompt_ids=chat_ids(bundle, p), params=sp, max_tokens=n, sink=s)
            for (p, sp, n, _), s in zip(requests, sinks)]
    for step in range(64):
        for job, (_, _, _, at) in zip(jobs, requests):
            if at == step:
                engine.admit(job)
        if all(s.done for s in sinks):
            break
        engine.step()
    assert all(s.done for s in sinks)
    return jobs, sinks


def test_batch_step_equals_forward_per_row(bundle):
    """batch.step_rows on rows of different lengths == llama.forward on each row, bitwise."""
    ops = lmtail_ops()
    mine, ref, toks = [], [], []
    for i, p in enumerate(["Hi", "Why is the sky blue?", "Count to five."]):
        ids = chat_ids(bundle, p)
        a, b = row_cache(bundle.config, len(ids) + 1 + i), row_cache(bundle.config, len(ids) + 8)
        prefill(bundle, torch.tensor([ids]), a, ops=ops)
        prefill(bundle, torch.tensor([ids]), b, ops=ops)
        mine.append(a), ref.append(b), toks.append(ids[-1])
    t = torch.tensor(toks)
    for s in range(3):
        mine = [grow(bundle.config, c, c.length + 1) for c in mine]  # rows 0, 1 grow on the way
        h = step_rows(bundle, t, mine, ops)  # [R, H]
        want = torch.cat([forward(bundle, t[r, None, None], ref[r], ops=ops)[0][0] for r in range(3)])
        assert torch.equal(h.view(torch.int32), want.view(torch.int32)), f"step {s}"
        t = (t * 31 + 7) % bundle.config.vocab
    full = row_cache(bundle.config, 1)
    full.length = 1
    with pytest.raises(ValueError, match="free slot"):
        step_rows(bundle, t[:1], [full], ops)
    with pytest.raises(ValueError, match="tokens must be"):
        step_rows(bundle, t, mine[:2], ops)


def test_engine_join_leave_bytes_equal_solo(bundle):
    """Rows join at steps 0, 2, 4 and leave at different steps: each row's ids and logprob
    bits equal its solo run."""
    engine = Engine(bundle, max_batch=8, k=K)
    _, sinks = drive(engine, bundle, REQUESTS)
    assert engine.max_rows_seen >= 4
    for (p, sp, n, _), s in zip(REQUESTS, sinks):
        assert s.result() == solo(bundle, chat_ids(bundle, p), sp, n), p
        assert isinstance(s.events[-1], Done)


def test_engine_bq32_body_bytes_equal_solo(bundle):
    """The server's bq32 body (`lmtail serve --body bq32`: each linear once for all rows on
    gemm_bq): rows joining and leaving == each alone on the bq32 body; planted: the q32 body's
    solo runs (another declared order) differ somewhere."""
    ops = lmtail_ops(body="bq32")
    engine = Engine(bundle, max_batch=8, k=K, ops=ops)
    _, sinks = drive(engine, bundle, REQUESTS)
    assert engine.max_rows_seen >= 4
    got = [s.result() for s in sinks]
    assert got == [solo(bundle, chat_ids(bundle, p), sp, n, ops=ops) for p, sp, n, _ in REQUESTS]
    assert got != [solo(bundle, chat_ids(bundle, p), sp, n) for p, sp, n, _ in REQUESTS]


class GlobalStepEngine(Engine):
    """PLANTED: draws u at the batch's step count instead of the row's own position."""

    def step_params(self, rows):
        return sampling_tensor([r.job.params for r in rows], positions=[self.steps] * len(rows))


def test_planted_batch_dependent_draw_is_caught(bundle):
    engine = GlobalStepEngine(bundle, max_batch=8, k=K)
    reqs = REQUESTS[1:3]
    _, sinks = drive(engine, bundle, reqs)
    diff = [s.result() != solo(bundle, chat_ids(bundle, p), sp, n) for (p, sp, n, _), s in zip(reqs, sinks)]
    assert any(diff)


def test_score_positions_equal_generation_logprobs(bundle):
    """Teacher-forced logprobs of a generated continuation (one prefill of prompt +
    continuation) are the logprob bits the engine reported while generating it."""
    ids = chat_ids(bundle, "Name three colors.")
    sp = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    toks, lps = solo(bundle, ids, sp, 8)
    full = ids + toks
    cache = row_cache(bundle.config, len(full))
    h, _ = forward(bundle, torch.tensor([full]), cache, ops=default_ops())  # [1, P, H]
    got, top = score_positions(bundle, h[0, len(ids) - 1:-1], torch.tensor(toks), n=3,
                               config=step_config(bundle, k=K, head_input="fp32"))
    assert [bits(x) for x in got] == lps
    assert all(len(t) == 3 and t[0][1] >= t[1][1] >= t[2][1] for t in top)


def test_text_tracker_stop_strings(bundle):
    tok = bundle.tokenizer
    ids = tok.encode("Hello world. Bye now.")
    tr = TextTracker(tok, ("d. B",))
    out, hit = "", False
    for t in ids:
        d, hit = tr.feed(t)
        out += d
        if hit:
            break
    assert hit and out == "Hello worl"
    tr = TextTracker(tok, ("zzz",))
    out = "".join(tr.feed(t)[0] for t in ids) + tr.flush()
    assert out == "Hello world. Bye now."


def test_queue_full_and_closed(bundle):
    """At most max_batch + max_queue jobs in flight: the next is QueueFull."""
    engine = Engine(bundle, max_batch=1, max_queue=1)
    job = Job(prompt_ids=[1, 2], params=SamplingParams(seed=1), max_tokens=1, sink=Collect())
    engine.submit(job)
    engine.submit(job)
    with pytest.raises(QueueFull, match="2 requests are already in flight"):
        engine.submit(job)
    assert engine.close(1.0)
    with pytest.raises(ValueError, match="body must be"):
        Engine(bundle, body="fast")


# ---------------------------------------------------------------------------------------
# request validation (no server)
# ---------------------------------------------------------------------------------------
BAD = [  # (kind, body changes, status, param)
    ("chat", {"max_tokens": -1}, 400, "max_tokens"),
    ("chat", {"top_p": 1.5}, 400, "top_p"),
    ("chat", {"temperature": -0.1}, 400, "temperature"),
    ("chat", {"temperature": True}, 400, "temperature"),
    ("chat", {"top_k": K + 1}, 400, "top_k"),
    ("chat", {"min_p": 2}, 400, "min_p"),
    ("chat", {"n": 2}, 400, "n"),
    ("chat", {"seed": 1 << 64}, 400, "seed"),
    ("chat", {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {"frobnicate": 1}, 400, "frobnicate"),
    ("chat", {"echo": True}, 400, "echo"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0]"),
    ("chat", {"top_logprobs": 3}, 400, "top_logprobs"),
    ("chat", {"max_tokens": 9000}, 400, "max_tokens"),
    ("chat", {"model": "gpt-4"}, 404, "model"),
    ("chat", {"presence_penalty": 2.5}, 400, "presence_penalty"),
    ("completions", {"prompt": "x " * 9000}, 400, "prompt"),
    ("completions", {"max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"logprobs": 50}, 400, "logprobs"),
    ("completions", {"prompt": [1, 99999999]}, 400, "prompt"),
]


@pytest.mark.parametrize("kind,change,status,param", BAD)
def test_bad_requests_name_the_field(bundle, kind, change, status, param):
    base = ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]} if kind == "chat"
            else {"model": MODEL, "prompt": "hi"})
    with pytest.raises(protocol.ApiError) as e:
        protocol.parse(kind, {**base, **change}, tokenizer=bundle.tokenizer, model=MODEL,
                       context=bundle.config.context_length, k=K)
    assert (e.value.status, e.value.param) == (status, param)
    assert e.value.body()["error"]["param"] == param


def test_good_request_defaults(bundle):
    r = protocol.parse("completions", {"model": MODEL, "prompt": [5, 6, 7], "echo": True, "max_tokens": 0,
                                       "logprobs": 1}, tokenizer=bundle.tokenizer, model=MODEL, context=8192, k=K)
    assert (r.prompt_ids, r.max_tokens, r.logprobs, r.echo) == ([5, 6, 7], 0, 1, True)
    r = protocol.parse("chat", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                       tokenizer=bundle.tokenizer, model=MODEL, context=8192, k=K)
    assert r.params.seed is not None and r.params.temperature == 1.0 and r.max_tokens == 8192 - len(r.prompt_ids)


# ---------------------------------------------------------------------------------------
# over HTTP: a real server, the real openai client
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(bundle):
    engine = Engine(bundle, max_batch=8, max_queue=32, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    yield srv, engine
    assert srv.stop(30)
    assert engine.close(10)


def client(srv, **kw):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0,
                         timeout=120, **kw)


def call(c, spec):
    """One request of a mixed spec -> (text, token ids, logprobs as floats, finish)."""
    kind, kw = spec
    if kind == "chat_stream":
        text, ids, lps, fin = "", [], [], None
        for ch in c.chat.completions.create(model=MODEL, stream=True, logprobs=True, **kw):
            if not ch.choices:
                continue
            d = ch.choices[0]
            text += d.delta.content or ""
            ids += (d.model_extra or {}).get("token_ids") or []
            lps += [x.logprob for x in (d.logprobs.content if d.logprobs else [])]
            fin = d.finish_reason or fin
        return text, ids, lps, fin
    if kind == "chat":
        r = c.chat.completions.create(model=MODEL, logprobs=True, top_logprobs=2, **kw)
        ch = r.choices[0]
        lps = [x.logprob for x in ch.logprobs.content]
        return ch.message.content, ch.model_extra["token_ids"], lps, ch.finish_reason
    r = c.completions.create(model=MODEL, logprobs=1, **kw)
    ch = r.choices[0]
    return ch.text, ch.model_extra["token_ids"], ch.logprobs.token_logprobs, ch.finish_reason


MIXED = [
    ("chat_stream", dict(messages=[{"role": "user", "content": "Why is the sky blue?"}], max_tokens=12,
                         temperature=0.0)),
    ("chat", dict(messages=[{"role": "user", "content": "Tell me a joke."}], max_tokens=10, temperature=0.9,
                  top_p=0.9, seed=7)),
    ("completions", dict(prompt="The three primary colors are", max_tokens=9, temperature=0.8, seed=9, stop=["."],
                         extra_body={"top_k": 20, "min_p": 0.05})),
    ("chat_stream", dict(messages=[{"role": "user", "content": "List two animals."}], max_tokens=8,
                         temperature=1.0, seed=3, stop=["\n"])),
]


def test_http_concurrent_equals_solo(bundle, server):
    srv, engine = server
    c = client(srv)
    alone = [call(c, spec) for spec in MIXED]  # one at a time: each served alone
    steps0 = engine.steps
    with cf.ThreadPoolExecutor(len(MIXED)) as ex:
        together = list(ex.map(lambda s: call(c, s), MIXED))
    assert together == alone
    assert engine.steps - steps0 < sum(len(a[1]) for a in alone)  # they really shared steps
    # anchored to the library's solo run, not only to the server's
    ids = chat_ids(bundle, "Why is the sky blue?")
    toks, lps = solo(bundle, ids, SamplingParams(temperature=0.0, seed=0), 12)
    assert alone[0][1] == toks and [bits(x) for x in alone[0][2]] == lps[:len(alone[0][2])]
    assert alone[0][3] == "length" and alone[2][3] in ("stop", "length")


def test_http_echo_scores_equal_generation_logprobs(bundle, server):
    """Score a served completion with echo + logprobs + max_tokens 0: the teacher-forced
    logprobs of the generated tokens are the generation's, bit for bit."""
    srv, _ = server
    c = client(srv)
    r = c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=21,
                             logprobs=0)
    gen_ids, gen_lp = r.choices[0].model_extra["token_ids"], r.choices[0].logprobs.token_logprobs
    prompt_ids = bundle.tokenizer.encode("Once upon a time")
    s = c.completions.create(model=MODEL, prompt=prompt_ids + gen_ids, max_tokens=0, echo=True, logprobs=0)
    lp = s.choices[0].logprobs.token_logprobs
    assert lp[0] is None and len(lp) == len(prompt_ids) + len(gen_ids)
    n = len(gen_lp)  # a stop token, if any, has no logprob entry
    assert [bits(x) for x in lp[len(prompt_ids):len(prompt_ids) + n]] == [bits(x) for x in gen_lp]
    assert s.usage.completion_tokens == 0 and s.choices[0].finish_reason == "length"


def test_http_stream_equals_whole_completions_echo(server):
    """A streamed echo completion (prompt text, prompt logprobs, one chunk per token) adds up
    to the non-streamed one: text, logprobs, token ids, usage."""
    srv, _ = server
    c = client(srv)
    kw = dict(model=MODEL, prompt="Roses are red,", max_tokens=5, temperature=0.9, seed=4, echo=True, logprobs=1)
    whole = c.completions.create(**kw).choices[0]
    text, lps, ids, fin, usage = "", [], [], None, None
    for ch in c.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = ch.usage or usage
        for d in ch.choices:
            text += d.text
            lps += d.logprobs.token_logprobs if d.logprobs else []
            ids += (d.model_extra or {}).get("token_ids") or []
            fin = d.finish_reason or fin
    assert (text, lps, ids, fin) == (whole.text, whole.logprobs.token_logprobs, whole.model_extra["token_ids"],
                                     whole.finish_reason)
    assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(lps) - len(ids) + (fin == "stop")


def test_http_bad_inputs_status_codes(server):
    srv, _ = server
    base = f"http://127.0.0.1:{srv.port}"
    with httpx.Client(timeout=30) as h:
        r = h.post(base + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
        r = h.post(base + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "top_p": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
        r = h.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": -3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = h.post(base + "/v1/completions", json={"model": MODEL, "prompt": "x", "bogus": 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"
        assert h.get(base + "/v1/nothing").status_code == 404
        assert h.get(base + "/v1/models").json()["data"][0]["id"] == MODEL
        assert h.get(base + "/health").json()["status"] == "ok"
    with pytest.raises(openai.BadRequestError) as e:
        client(srv).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=1.5)
    assert e.value.body["param"] == "top_p"


def test_http_queue_full_is_429(bundle):
    """max_batch 1, max_queue 0: a second request while one is in flight is 429."""
    engine = Engine(bundle, max_batch=1, max_queue=0)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 60,
            "stream": True, "temperature": 0}
    try:
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", f"http://127.0.0.1:{srv.port}/v1/chat/completions", json=body) as r:
                next(r.iter_lines())
                assert engine.load()["active"] + engine.load()["waiting"] == 1
                with pytest.raises(openai.RateLimitError) as e:
                    client(srv).completions.create(model=MODEL, prompt="x", max_tokens=1)
                assert e.value.body["code"] == "rate_limit_exceeded"
    finally:
        assert srv.stop(30) and engine.close(10)


def test_http_disconnect_frees_slot(bundle, server):
    """A streaming client that leaves after two chunks: its row is dropped (the engine goes
    idle long before its max_tokens), and a request running beside it keeps its bytes."""
    srv, engine = server
    spec = MIXED[1]
    alone = call(client(srv), spec)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 400,
            "stream": True, "temperature": 0.0}
    with cf.ThreadPoolExecutor(1) as ex:
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", f"http://127.0.0.1:{srv.port}/v1/chat/completions", json=body) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
                assert any(x.startswith("data: {") for x in got)
                fut = ex.submit(call, client(srv), spec)
                time.sleep(0.5)
        assert fut.result(timeout=120) == alone
    t_end = time.monotonic() + 30
    while engine.load()["active"] and time.monotonic() < t_end:
        time.sleep(0.1)
    assert engine.load() == {**engine.load(), "active": 0, "waiting": 0}


# ---------------------------------------------------------------------------------------
# slow: load and SIGTERM
# ---------------------------------------------------------------------------------------
def _load_spec(i: int):
    """Request i of the load test: mixed kinds, sampling and lengths (deterministic)."""
    kinds = ["chat_stream", "chat", "completions"]
    temp = [0.0, 0.7, 1.0, 1.3][i % 4]
    kw = dict(max_tokens=2 + (i * 5) % 7, temperature=temp, seed=1000 + i)
    if kinds[i % 3] == "completions":
        kw |= dict(prompt=f"Fact number {i}:", extra_body={"top_k": [0, 5, 50][i % 3], "min_p": [0, 0.02][i % 2]})
    else:
        kw |= dict(messages=[{"role": "user", "content": f"Say something about the number {i}."}],
                   top_p=[1.0, 0.9][i % 2])
    return kinds[i % 3], kw


@pytest.mark.slow
def test_load_16_clients_every_response_equals_solo(bundle):
    """16 concurrent clients on a --max-batch 16 server, N requests (bounded count and time),
    each compared with its solo run (the same request sent alone afterwards); prints the
    counts."""
    engine = Engine(bundle, max_batch=16, max_queue=64, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    n, clients, budget_s = 320, 16, 1800
    specs = [_load_spec(i) for i in range(n)]
    c = client(srv)
    t0 = time.monotonic()
    try:
        with cf.ThreadPoolExecutor(clients) as ex:
            together = list(ex.map(lambda s: call(c, s), specs))
        t_conc = time.monotonic() - t0
        alone = {}
        for i, s in enumerate(specs):
            assert time.monotonic() - t0 < budget_s, f"over the {budget_s} s budget after {i} solo runs"
            alone[i] = call(c, s)
    finally:
        assert srv.stop(30) and engine.close(10)
    equal = sum(together[i] == alone[i] for i in range(n))
    tokens = sum(len(a[1]) for a in together)
    print(f"\nload: {n} requests, {clients} clients, {equal}/{n} byte-equal to solo, {tokens} tokens in "
          f"{t_conc:.1f} s concurrent; max rows in a step {engine.max_rows_seen}")
    assert equal == n


def serve_process(*flags: str):
    """`python -m lmtail.serve --port <free> *flags` on 127.0.0.1, waited for /health (180 s
    at most). Returns (proc, base URL); the caller ends it."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "lmtail.serve", "--port", str(port), *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 180
    while time.monotonic() < t_end and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    return proc, base


@pytest.mark.slow
def test_sigterm_stops_within_bound(tmp_path):
    import signal

    proc, base = serve_process("--shutdown-timeout", "3")
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 2000,
                "stream": True, "temperature": 0}  # greedy: runs past the grace period (no early stop token)
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", base + "/v1/chat/completions", json=body) as r:
                it = r.iter_lines()
                next(it)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                lines = [x for x in it if x]
                # 2000 tokens cannot finish in the grace period: an error event, then [DONE]
                assert not any('"finish_reason": "length"' in x for x in lines)
                assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2], lines[-3:]
        assert proc.wait(timeout=30) == 0  # the signal is handled (docs/serve.md), not re-raised
        assert time.monotonic() - t0 < 20
        log = proc.stdout.read().decode()
        assert "lmtail engine closed" in log and "Finished server process" in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------
# --ranks N: the sampling step's tail vocab-parallel over N gloo ranks (serve/ranks.py)
# ---------------------------------------------------------------------------------------
def children(pid: int) -> set[int]:
    """Live (not zombie) processes whose parent is `pid`, from /proc."""
    import os

    out = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                st = f.read()
        except OSError:
            continue
        state, ppid = st.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out.add(int(d))
    return out


def children_alive(pids: set[int]) -> set[int]:
    """The pids of `pids` that are still running (not gone, not zombies)."""
    alive = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.add(p)
        except OSError:
            pass
    return alive


RANK_REQUESTS = [  # (prompt, params, max_tokens, joins at step, logprobs, echo)
    ("Why is the sky blue?", SamplingParams(temperature=0.0, seed=1), 6, 0, None, False),
    ("Name three fruits.", SamplingParams(temperature=0.9, top_p=0.9, seed=11), 3, 0, 3, False),
    ("Write a haiku about rain.", SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=12), 5, 1, None, True),
    ("What is 2+2?", SamplingParams(temperature=0.0, seed=2), 2, 2, 2, True),
    ("Say hello in French.", SamplingParams(temperature=1.2, top_k=8, seed=13), 4, 2, None, False),
]


def rank_events(engine: Engine, bundle, requests=RANK_REQUESTS):
    """Each request's events as comparable bytes: (kind, id, logprob bits, top (id, bits)...)."""
    sinks = [Collect() for _ in requests]
    jobs = [Job(prompt_ids=chat_ids(bundle, p), params=sp, max_tokens=n, sink=s, logprobs=lp, echo_logprobs=echo)
            for (p, sp, n, _, lp, echo), s in zip(requests, sinks)]
    for step in range(64):
        for job, r in zip(jobs, requests):
            if r[3] == step:
                engine.admit(job)
        if all(s.done for s in sinks):
            break
        engine.step()
    assert all(isinstance(s.events[-1], Done) for s in sinks), [s.events[-1] for s in sinks]

    def enc(e):
        if isinstance(e, Token):
            return ("tok", e.id, bits(e.logprob), e.text, [(i, bits(v)) for i, v in (e.top or [])])
        if isinstance(e, Prompt):
            return ("prompt", [bits(v) for v in e.logprobs], [[(i, bits(v)) for i, v in t] for t in (e.top or [])])
        return ("done", e.finish_reason, e.completion_tokens, e.text)

    return [[enc(e) for e in s.events] for s in sinks]


def test_engine_ranks2_bytes_equal_ranks1_and_close_leaves_no_rank(bundle):
    """Engine(ranks=2) on a join/leave schedule of greedy, seeded sampled, top_k / top_p /
    min_p rows (odd and even row counts: padded steps), with top logprobs and echo scoring:
    every event byte-equal to Engine(ranks=1). PLANTED: the ranks' rows gathered in the
    wrong order must go red. close() leaves no rank process (/proc)."""
    import os

    want = rank_events(Engine(bundle, max_batch=8, k=K), bundle)
    before = children(os.getpid())
    engine = Engine(bundle, max_batch=8, k=K, ranks=2)
    pids = set(engine.rank_pids())
    try:
        assert len(pids) == 1 and pids <= children(os.getpid()) - before
        got = rank_events(engine, bundle)
        assert engine.max_rows_seen >= 4
        assert got == want
        real = engine._ranks.tail

        def flipped(x, sp):  # PLANTED: rows come back reversed (a wrong gather order)
            out = real(x, sp)
            return type(out)(*(t.flip(0) for t in (out.tokens, out.logprobs, out.truncated, out.topk_indices,
                                                   out.topk_values)))

        engine._ranks.tail = flipped
        plain = [RANK_REQUESTS[0], RANK_REQUESTS[4][:3] + (0, None, False)]  # no top logprobs: no local check
        assert rank_events(engine, bundle, plain) != rank_events(Engine(bundle, max_batch=8, k=K), bundle, plain)
        x = torch.randn(2, bundle.config.hidden, generator=torch.Generator().manual_seed(0))  # [2, H]
        sp = sampling_tensor([SamplingParams(temperature=0.0)] * 2)
        with pytest.raises(RuntimeError, match="ranks' tokens differ"):  # top logprobs: the local check trips
            engine._tail(x, sp, [True, True])
        engine._ranks.tail = real
    finally:
        assert engine.close(10)
    assert engine.rank_pids() == [] and not (pids & children(os.getpid()))
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_cli_ranks_rule(bundle):
    """--ranks must divide 49152 and 256: 3, 5, 0, 512 refused naming the flag; 1, 2, 4, 256
    pass; Engine refuses 3 (candidates: 256 mass chunks) and 5 (the vocab)."""
    import argparse

    from lmtail.serve import cli

    ap = argparse.ArgumentParser()
    cli.configure(ap)
    for n in (1, 2, 4, 256):
        cli.check(ap.parse_args(["--ranks", str(n)]))
    for n in (3, 5, 0, 512):
        with pytest.raises(ValueError, match=rf"^--ranks must be .*; got {n}$"):
            cli.check(ap.parse_args(["--ranks", str(n)]))
    with pytest.raises(ValueError, match="VTP dividing 256"):  # the engine: before any rank is spawned
        Engine(bundle, ranks=3)
    with pytest.raises(ValueError, match="ranks must be an int >= 1 dividing the vocab"):
        Engine(bundle, ranks=5)


@pytest.mark.slow
def test_http_ranks2_concurrent_equals_ranks1(bundle, server):
    """Over HTTP: MIXED sent concurrently to a ranks=2 server == each sent alone to the
    ranks=1 server (text, ids, logprobs, finish reasons)."""
    srv1, _ = server
    alone = [call(client(srv1), spec) for spec in MIXED]
    engine = Engine(bundle, max_batch=8, max_queue=32, k=K, ranks=2)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    try:
        c = client(srv)
        with cf.ThreadPoolExecutor(len(MIXED)) as ex:
            together = list(ex.map(lambda s: call(c, s), MIXED))
    finally:
        assert srv.stop(30) and engine.close(10)
    assert together == alone
    assert engine.rank_pids() == []


@pytest.mark.slow
def test_sigterm_ranks2_leaves_no_rank(tmp_path):
    """`python -m lmtail.serve --ranks 2`: serves a request, then SIGTERM ends it and every
    process it started (its children in /proc) is gone."""
    import signal

    proc, base = serve_process("--ranks", "2", "--shutdown-timeout", "3")
    try:
        kids = children(proc.pid)
        ranks = {p for p in kids if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()}
        assert len(ranks) == 1, kids
        body = {"model": MODEL, "prompt": "Tell me", "max_tokens": 4, "temperature": 0.8, "seed": 3}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 20
        assert not children_alive(ranks), ranks
        # the rank at once; the rest (multiprocessing's resource tracker, which exits on its
        # pipe's EOF) within a few seconds
        t_end = time.monotonic() + 10
        while (left := kids & children_alive(kids)) and time.monotonic() < t_end:
            time.sleep(0.2)
        assert not left, left
        log = proc.stdout.read().decode()
        assert "lmtail engine closed" in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
