"""lmtail serve under what real clients and deployments do (issue 30).

Isolation: a row that fails mid-decode (planted in the tail, in the body, or bad sampling
values that bypass the HTTP checks) fails alone with its own error; its batchmates' bytes
equal their solo runs (a planted engine without isolation goes red). Admission: sampling
values are checked in the fp32 / int64 terms the kernels read (top_p 1e-50 is 0.0 in fp32).
Errors: every bad input a 4xx in OpenAI's shape naming the field (seed out of int64, lone
surrogates, deep nesting, 5,000-digit integers, the fields clients send that are not
supported yet); no-op values of those fields accepted. The event loop: parsing and
tokenizing off it (/health within 50 ms while a large body is parsed; planted: parsing on
the loop goes red), a body limit (413). A plain request whose client disconnects is
cancelled. Graceful shutdown: in-flight requests finish within the grace, the rest get 503
JSON / an SSE error event and [DONE]. The rules of issue 30's item 8, each pinned with the
variant that breaks it. The SIGTERM-in-a-subprocess run is @pytest.mark.slow.

Shape legend: H hidden.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
import signal
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import K, MODEL, REQUESTS, Collect, bundle, chat_ids, drive, serve_process, solo  # noqa: E402,F401

from lmtail.tail.sampler import SamplingParams, sampling_tensor  # noqa: E402
from lmtail.serve import app as app_mod  # noqa: E402
from lmtail.serve import protocol  # noqa: E402
from lmtail.serve.app import create_app  # noqa: E402
from lmtail.serve.cli import ThreadServer  # noqa: E402
from lmtail.serve.engine import Done, Engine, Failed, Job, QueueFull, TextTracker, Token  # noqa: E402


def chat_body(content="hi", **kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


def parse_raw(bundle, kind, raw: bytes, k=K):
    """protocol.loads + parse as the server runs them."""
    return protocol.parse(kind, protocol.loads(raw), tokenizer=bundle.tokenizer, model=MODEL,
                          context=bundle.config.context_length, k=k,
                          max_token_bytes=protocol.max_token_bytes(bundle.tokenizer))


# ---------------------------------------------------------------------------------------
# admission: every bad value a 400 naming its field, in the kernels' terms
# ---------------------------------------------------------------------------------------
HUGE = "9" * 5000
BAD_RAW = [  # (kind, raw JSON body, status, param, words in the message)
    ("chat", json.dumps(chat_body(seed=1 << 63)), 400, "seed", "integer in"),
    ("chat", json.dumps(chat_body(seed=-(1 << 63) - 1)), 400, "seed", "integer in"),
    ("chat", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "seed": %s}' % (MODEL, HUGE),
     400, "seed", "an integer of 5000 digits"),
    ("completions", '{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (MODEL, HUGE), 400, "max_tokens",
     "5000 digits"),
    ("completions", '{"model": "%s", "prompt": [1, %s]}' % (MODEL, HUGE), 400, "prompt", "token ids"),
    ("chat", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800b"}]}' % MODEL, 400,
     "messages[0].content", "lone surrogate"),
    ("completions", '{"model": "%s", "prompt": "\\udfff"}' % MODEL, 400, "prompt", "lone surrogate"),
    ("chat", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}' % MODEL,
     400, "stop", "lone surrogate"),
    ("chat", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}' % MODEL,
     400, "\\ud800", "Unrecognized"),
    ("chat", json.dumps(chat_body(top_p=1e-50)), 400, "top_p", "0.0 in fp32"),
    ("chat", json.dumps(chat_body(n=2)), 400, "n", "in [1, 1]"),  # parse's default max_n
    ("chat", json.dumps(chat_body(n=0)), 400, "n", ">= 1"),
    ("chat", json.dumps(chat_body(logit_bias={"50256": -100})), 400, "logit_bias", "token ids in [0, 49152)"),
    ("chat", json.dumps(chat_body(logit_bias=[1])), 400, "logit_bias", "an object"),
    ("chat", json.dumps(chat_body(presence_penalty=2.5)), 400, "presence_penalty", "[-2, 2]"),
    ("chat", json.dumps(chat_body(frequency_penalty=-2.5)), 400, "frequency_penalty", "[-2, 2]"),
    ("chat", json.dumps(chat_body(frequency_penalty=3)), 400, "frequency_penalty", "[-2, 2]"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "repetition_penalty": 0}), 400,
     "repetition_penalty", "a finite number > 0"),
    ("chat", json.dumps(chat_body(response_format={"type": "json_object"})), 400, "response_format",
     "not supported yet"),
    ("chat", json.dumps(chat_body(tools=[{"type": "function", "function": {"name": "f"}}])), 400, "tools",
     "not supported yet"),
    ("chat", json.dumps(chat_body(tool_choice="auto")), 400, "tool_choice", "not supported yet"),
    ("chat", json.dumps(chat_body(store="yes")), 400, "store", "a boolean"),
    ("completions", json.dumps({"model": MODEL, "prompt": "x", "tools": []}), 400, "tools", "Unrecognized"),
]


@pytest.mark.parametrize("kind,raw,status,param,words", BAD_RAW, ids=range(len(BAD_RAW)))
def test_bad_values_name_their_field(bundle, kind, raw, status, param, words):
    with pytest.raises(protocol.ApiError) as e:
        parse_raw(bundle, kind, raw.encode())
    body = e.value.body()["error"]
    assert (e.value.status, body["param"]) == (status, param), body
    assert words in body["message"], body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    json.dumps(body).encode("utf-8")  # the body has a UTF-8 form (JSONResponse renders it so)


def test_bodies_json_refuses(bundle):
    """Deep nesting, invalid UTF-8, malformed JSON: ApiError 400 from loads, not a crash."""
    for raw, words in [(b"[" * 100_000, "nested too deeply"), (b'{"a": "\xff"}', "valid JSON"),
                       (b"{not json", "valid JSON"), (b'{"prompt": "x"', "valid JSON")]:
        with pytest.raises(protocol.ApiError, match=words) as e:
            protocol.loads(raw)
        assert e.value.status == 400
    assert protocol.loads(b"[" * 500 + b"]" * 500) is not None  # nesting within the limit decodes


def test_top_p_checked_in_fp32(bundle):
    """top_p 1e-50 passes a float64 (0, 1] check but is 0.0 in fp32, which the tail refuses
    mid-decode (the planted admission in Python floats would admit it: sampling_tensor then
    raises); the smallest fp32 subnormal is admitted."""
    with pytest.raises(ValueError, match="top_p must be in"):  # what the decode step would meet
        sampling_tensor([SamplingParams(top_p=1e-50, seed=1)], positions=[5])
    assert 0 < 1e-50 <= 1  # the planted (float64) rule admits it
    r = parse_raw(bundle, "chat", json.dumps(chat_body(top_p=1.5e-45, seed=3)).encode())
    assert r.params.top_p == 1.5e-45
    sampling_tensor([r.params], positions=[len(r.prompt_ids)])  # and the tail takes it


def test_seed_is_int64_with_the_kernels_bits(bundle):
    """seed -1 is served as the uint64 2**64 - 1 (the same 64 bits draw_u reads) and reported
    back as given; 2**63 - 1 and -2**63 too; outside int64 is a 400 (above)."""
    for seed, u64 in [(-1, (1 << 64) - 1), (-(1 << 63), 1 << 63), ((1 << 63) - 1, (1 << 63) - 1)]:
        r = parse_raw(bundle, "chat", json.dumps(chat_body(seed=seed)).encode())
        assert (r.seed, r.params.seed) == (seed, u64)


def test_noop_values_of_client_fields_accepted(bundle):
    """store, metadata, logit_bias {}, penalties 0 / 1, response_format text, tools [],
    tool_choice none, n 1 change nothing; the developer role is the system role."""
    plain = parse_raw(bundle, "chat", json.dumps(chat_body(seed=1)).encode())
    extras = dict(store=True, metadata={"k": "v"}, logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                  repetition_penalty=1, response_format={"type": "text"}, tools=[], tool_choice="none",
                  parallel_tool_calls=False, n=1, user="u")
    r = parse_raw(bundle, "chat", json.dumps(chat_body(seed=1, **extras)).encode())
    assert (r.prompt_ids, r.params, r.max_tokens) == (plain.prompt_ids, plain.params, plain.max_tokens)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    sys_r = parse_raw(bundle, "chat", json.dumps({"model": MODEL, "messages": msgs, "seed": 1}).encode())
    msgs[0]["role"] = "developer"
    dev_r = parse_raw(bundle, "chat", json.dumps({"model": MODEL, "messages": msgs, "seed": 1}).encode())
    assert dev_r.prompt_ids == sys_r.prompt_ids != plain.prompt_ids


def test_cli_max_body_bytes_rule():
    import argparse

    from lmtail.serve import cli

    ap = argparse.ArgumentParser()
    cli.configure(ap)
    assert ap.parse_args([]).max_body_bytes == app_mod.DEFAULT_MAX_BODY == 1 << 20
    cli.check(ap.parse_args(["--max-body-bytes", "1"]))
    with pytest.raises(ValueError, match=r"^--max-body-bytes must be >= 1; got 0$"):
        cli.check(ap.parse_args(["--max-body-bytes", "0"]))
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1; got 0"):
        create_app(FakeEngine(None), model_name=MODEL, max_body_bytes=0)


# ---------------------------------------------------------------------------------------
# issue 30 item 8: each rule with the variant that flips it
# ---------------------------------------------------------------------------------------
def test_top_k_equal_k_accepted_k_plus_1_refused(bundle):
    for k in (8, K):
        assert parse_raw(bundle, "chat", json.dumps(chat_body(top_k=k)).encode(), k=k).params.top_k == k
        with pytest.raises(protocol.ApiError, match=rf"top_k must be an integer in \[0, {k}\]") as e:
            parse_raw(bundle, "chat", json.dumps(chat_body(top_k=k + 1)).encode(), k=k)
        assert e.value.param == "top_k"


def test_prompt_of_context_length_refused_one_less_served(bundle):
    """Token-id prompts of context and context - 1 tokens: 400 naming the prompt / admitted
    with room for exactly one token (max_tokens defaults to it; 2 is a 400)."""
    ctx = bundle.config.context_length
    with pytest.raises(protocol.ApiError, match=f"shorter than the context .{ctx} tokens.; got {ctx} tokens") as e:
        parse_raw(bundle, "completions", json.dumps({"model": MODEL, "prompt": [7] * ctx}).encode())
    assert e.value.param == "prompt"
    r = parse_raw(bundle, "completions", json.dumps({"model": MODEL, "prompt": [7] * (ctx - 1)}).encode())
    assert (len(r.prompt_ids), r.max_tokens) == (ctx - 1, 1)
    with pytest.raises(protocol.ApiError) as e:
        parse_raw(bundle, "completions", json.dumps({"model": MODEL, "prompt": [7] * (ctx - 1),
                                                     "max_tokens": 2}).encode())
    assert e.value.param == "max_tokens"


class NoEncode:
    """A tokenizer that refuses to tokenize (the size pre-check must answer first)."""

    def __init__(self, tok):
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text):
        raise AssertionError(f"tokenized {len(text)} characters")

    @property
    def backend(self):
        return self

    def encode_batch(self, texts, **kw):
        raise AssertionError(f"tokenized {len(texts[0])} characters")


def test_encode_off_the_gil_equals_the_tokenizers(bundle):
    """protocol.encode (the backend's batch call) gives ChatTokenizer.encode's ids."""
    tok = bundle.tokenizer
    for text in ["Hello world.", JP, "  spaces\tand\nlines  ", "<|im_start|>user\nhi<|im_end|>", "a" * 5000,
                 tok.apply_chat_template([{"role": "user", "content": "Why?"}])]:
        assert protocol.encode(tok, text) == tok.encode(text), text[:40]


def test_long_text_prompt_refused_by_size_before_tokenizing(bundle):
    """A text prompt larger than max_token_bytes * (context - 1) bytes is refused naming the
    prompt without tokenizing it (a tokenizer that raises proves it); just below, it is
    tokenized (the planted tokenizer trips)."""
    tok, ctx = bundle.tokenizer, bundle.config.context_length
    lmax = protocol.max_token_bytes(tok)
    assert lmax == 81  # SmolLM2's longest token (docs/serve.md)
    limit = lmax * (ctx - 1)
    for kind, body in [("completions", {"model": MODEL, "prompt": "a" * (limit + 1)}),
                       ("chat", chat_body("a" * limit))]:
        with pytest.raises(protocol.ApiError, match="UTF-8 bytes, at least") as e:
            protocol.parse(kind, body, tokenizer=NoEncode(tok), model=MODEL, context=ctx, k=K, max_token_bytes=lmax)
        assert e.value.param == ("prompt" if kind == "completions" else "messages")
    with pytest.raises(AssertionError, match="tokenized"):
        protocol.parse("completions", {"model": MODEL, "prompt": "a" * limit}, tokenizer=NoEncode(tok), model=MODEL,
                       context=ctx, k=K, max_token_bytes=lmax)


JP = "漢字のテスト"


class NoHoldTracker(TextTracker):
    """PLANTED: no hold-back of a partial UTF-8 character."""

    def feed(self, token_id):
        self.ids.append(token_id)
        return self._advance(self.tok.decode(self.ids)), False


def test_stream_text_never_emits_replacement_char(bundle):
    """漢字のテスト with the real tokenizer: characters span tokens; the deltas never hold
    U+FFFD and add up to the text; the planted tracker without hold-back emits U+FFFD."""
    ids = bundle.tokenizer.encode(JP)
    assert len(ids) > len(JP)  # some characters do span tokens
    for cls, clean in [(TextTracker, True), (NoHoldTracker, False)]:
        tr = cls(bundle.tokenizer, ())
        deltas = [tr.feed(t)[0] for t in ids]
        assert all("\ufffd" not in d for d in deltas) == clean
    tr = TextTracker(bundle.tokenizer, ())
    assert "".join(tr.feed(t)[0] for t in ids) == JP


class ScriptedEngine(Engine):
    """The tail replaced by a script: row r emits script[r.generated] (logprob 0)."""

    script: list[int] = []

    def _sample(self, rows):
        return [(self.script[r.generated], 0.0, None) for r in rows]


def test_stream_over_http_never_emits_replacement_char(bundle):
    """The same rule through the engine and SSE: a scripted engine emits 漢字のテスト's ids; the
    chat stream's content deltas hold no U+FFFD and join to the text."""
    engine = ScriptedEngine(bundle, max_batch=2, k=K)
    engine.script = bundle.tokenizer.encode(JP)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0, timeout=60)
        deltas = [ch.choices[0].delta.content for ch in c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True, max_tokens=len(engine.script))
            if ch.choices and ch.choices[0].delta.content]
    finally:
        assert srv.stop(30) and engine.close(10)
    assert "".join(deltas) == JP and not any("\ufffd" in d for d in deltas), deltas


class CountingEngine(Engine):
    """Records the row count of every step."""

    def step(self):
        self.sizes = getattr(self, "sizes", []) + [len(self._rows)]
        super().step()


class OneMoreEngine(CountingEngine):
    """PLANTED: admits one row more than max_batch."""

    def room(self):
        return self.max_batch + 1 - len(self._rows)


def run_jobs(engine, jobs, timeout=60):
    """Start engine, submit jobs, wait for all to end; returns their sinks."""
    engine.start()
    try:
        for j in jobs:
            engine.submit(j)
        t_end = time.monotonic() + timeout
        while not all(j.sink.done for j in jobs):
            assert time.monotonic() < t_end, "jobs did not end"
            time.sleep(0.02)
    finally:
        assert engine.close(10)
    return [j.sink for j in jobs]


def test_batch_never_exceeds_max_batch(bundle):
    """6 jobs on max_batch 2: every step has at most 2 rows (and some has 2); the planted
    engine that admits one more (and forgets the rows being prefilled) shows 3 or more
    (how many depends on how its prefills and steps interleave)."""
    for cls in (CountingEngine, OneMoreEngine):
        engine = cls(bundle, max_batch=2, max_queue=8, k=K)
        jobs = [Job(prompt_ids=[1, 2, 3 + i], params=SamplingParams(temperature=0.0), max_tokens=3, sink=Collect())
                for i in range(6)]
        sinks = run_jobs(engine, jobs)
        assert all(isinstance(s.events[-1], Done) for s in sinks)
        assert max(engine.sizes) == engine.max_rows_seen, engine.sizes
        assert (max(engine.sizes) == 2) if cls is CountingEngine else (max(engine.sizes) >= 3), engine.sizes


def test_capacity_is_max_batch_plus_max_queue(bundle):
    """A burst: max_batch + max_queue jobs are taken (16 + 64 = 80), the next is QueueFull,
    whatever the engine thread has moved (here: not started, nothing moved)."""
    engine = Engine(bundle, max_batch=16, max_queue=64, k=K)
    job = Job(prompt_ids=[1], params=SamplingParams(temperature=0.0), max_tokens=1, sink=Collect())
    for _ in range(80):
        engine.submit(job)
    with pytest.raises(QueueFull, match="80 requests are already in flight"):
        engine.submit(job)
    assert engine.close(1)


class Parked(Engine):
    """An engine whose thread never runs: every job accepted stays in flight until close()
    (which must then fail them itself)."""

    def start(self):
        self._thread = threading.Thread(target=lambda: None)
        self._thread.start()
        return self


def test_http_burst_admits_max_batch_plus_max_queue(bundle):
    """110 concurrent plain requests on --max-batch 16 --max-queue 64 with nothing finishing:
    exactly 80 are taken, 30 get 429 (OpenAI's shape); closing the engine answers the 80
    with 503 (none lost)."""
    engine = Parked(bundle, max_batch=16, max_queue=64, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    try:
        with cf.ThreadPoolExecutor(110) as ex, httpx.Client(timeout=60, limits=httpx.Limits(max_connections=120)) as h:
            futs = [ex.submit(h.post, base(srv) + "/v1/completions", json=body) for _ in range(110)]
            t_end = time.monotonic() + 30
            while sum(f.done() for f in futs) < 30 or engine.load()["waiting"] < 80:
                assert time.monotonic() < t_end, (sum(f.done() for f in futs), engine.load())
                time.sleep(0.05)
            assert engine.load()["waiting"] == 80
            engine.close(5)
            codes = [f.result(timeout=30).status_code for f in futs]
    finally:
        assert srv.stop(30)
    print(f"\nburst of 110: {codes.count(503)} taken (then 503 at close), {codes.count(429)} x 429")
    assert (codes.count(429), codes.count(503)) == (30, 80)


# ---------------------------------------------------------------------------------------
# isolation: a row that fails mid-decode fails alone
# ---------------------------------------------------------------------------------------
POISON_T = 0.777  # the temperature that marks a planted failing row


class TailFails(Engine):
    """PLANTED: the tail raises on any call that holds a POISON_T row."""

    def _tail(self, x, sp, want):
        if bool((sp[:, 2] == torch.tensor(POISON_T, dtype=torch.float32)).any()):
            raise RuntimeError("planted tail failure")
        return super()._tail(x, sp, want)


class BodyFails(Engine):
    """PLANTED: the body raises on any call that holds a POISON_T row, after it ran (every
    row's cache written and its length advanced: the step must set them back)."""

    def _body(self, rows, tokens):
        super()._body(rows, tokens)
        if any(r.job.params.temperature == POISON_T for r in rows):
            raise RuntimeError("planted body failure")


class NotIsolated(TailFails):
    """PLANTED: the old rule, a failing step fails every row in it."""

    def _isolated(self, rows, fn):
        try:
            return list(zip(rows, fn(rows)))
        except Exception as e:
            for r in rows:
                r.job.sink(Failed(str(e)))
            return []


POISONS = [  # (params, joins at step, error words): bad fp32 sampling values, and the planted marks
    (SamplingParams(top_p=1e-50, seed=5), 1, "top_p must be in"),
    (SamplingParams(temperature=POISON_T, seed=6), 0, "planted"),
    (SamplingParams(temperature=POISON_T, seed=7), 3, "planted"),
]


def drive_with_poison(engine, bundle):
    """REQUESTS plus POISONS on one schedule (test_serve.drive); returns (good sinks, poison sinks)."""
    requests = list(REQUESTS) + [("Tell me more.", sp, 6, at) for sp, at, _ in POISONS]
    _, sinks = drive(engine, bundle, requests)
    return sinks[:len(REQUESTS)], sinks[len(REQUESTS):]


@pytest.fixture(scope="module")
def solos(bundle):
    return [solo(bundle, chat_ids(bundle, p), sp, n) for p, sp, n, _ in REQUESTS]


@pytest.mark.parametrize("cls", [TailFails, BodyFails])
def test_failing_row_fails_alone(bundle, solos, cls):
    """Rows that fail in the tail (fp32-invalid top_p; a planted tail error) or in the body
    (planted) get their own Failed (500, their words); every batchmate's ids and logprob
    bits equal its solo run; the steps really mixed them."""
    engine = cls(bundle, max_batch=8, k=K)
    good, bad_ = drive_with_poison(engine, bundle)
    assert engine.max_rows_seen >= 5
    for s, want in zip(good, solos):
        assert isinstance(s.events[-1], Done) and s.result() == want
    planted = "planted tail failure" if cls is TailFails else "planted body failure"
    for s, (_, _, words) in zip(bad_, POISONS):
        ev = s.events[-1]
        assert isinstance(ev, Failed) and ev.status == 500, ev
        assert (planted if words == "planted" else words) in ev.message, ev.message


def test_planted_engine_without_isolation_goes_red(bundle, solos):
    engine = NotIsolated(bundle, max_batch=8, k=K)
    good, _ = drive_with_poison(engine, bundle)
    assert sum(isinstance(s.events[-1], Failed) for s in good) >= 3


# ---------------------------------------------------------------------------------------
# over HTTP
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(bundle):
    engine = BodyFails(bundle, max_batch=8, max_queue=32, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL, max_body_bytes=200_000)).start()
    yield srv, engine
    assert srv.stop(30)
    assert engine.close(10)


def base(srv):
    return f"http://127.0.0.1:{srv.port}"


def client(srv):
    return openai.OpenAI(base_url=base(srv) + "/v1", api_key="none", max_retries=0, timeout=120)


def shape(r, status, param=None):
    """r is `status` with OpenAI's error shape (param named when given)."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


def test_http_every_error_in_openai_shape(server):
    srv, _ = server
    u = base(srv)
    with httpx.Client(timeout=60) as h:
        post = lambda path, raw: h.post(u + path, content=raw, headers={"content-type": "application/json"})  # noqa
        shape(post("/v1/chat/completions", b"[" * 100_000), 400)
        shape(post("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
                   % MODEL.encode()), 400, "messages[0].content")
        shape(post("/v1/completions", b'{"model": "%s", "prompt": "x", "seed": %s}' % (MODEL.encode(), HUGE.encode())),
              400, "seed")
        shape(post("/v1/completions", json.dumps({"model": MODEL, "prompt": "x", "seed": 1 << 64}).encode()), 400,
              "seed")
        shape(post("/v1/chat/completions", json.dumps(chat_body(n=9)).encode()), 400, "n")  # > max_batch 8
        for field, value in [("response_format", {"type": "regex", "regex": "a+"}), ("tools", [{"type": "function"}])]:
            err = shape(post("/v1/chat/completions", json.dumps(chat_body(**{field: value})).encode()), 400, field)
            assert "not supported yet" in err["message"]
        shape(post("/v1/chat/completions", json.dumps(chat_body(top_p=1e-50)).encode()), 400, "top_p")
        shape(h.get(u + "/v1/completions"), 405)
        shape(h.get(u + "/nothing"), 404)
        r = h.post(u + "/v1/chat/completions", json=chat_body("Say hi.", seed=-1, max_tokens=3, store=True,
                                                               logit_bias={}, temperature=0.9))
        assert r.status_code == 200 and r.json()["seed"] == -1, r.text
        doc = h.get(u + "/openapi.json").json()
        assert set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions", "/health", "/v1/models"}
        props = set(doc["components"]["schemas"]["ChatRequest"]["properties"]) | \
            set(doc["components"]["schemas"]["CompletionRequest"]["properties"])
        assert props == set(protocol.FIELDS)


def test_http_unexpected_error_is_openai_shaped_500(server, monkeypatch):
    srv, _ = server

    def boom(*a, **kw):
        raise KeyError("planted")

    monkeypatch.setattr(app_mod, "parse", boom)
    err = shape(httpx.post(base(srv) + "/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=30), 500)
    assert err["type"] == "server_error" and "KeyError" in err["message"]


def test_http_body_limit_413(server):
    """A body past max_body_bytes: 413 in OpenAI's shape, from Content-Length or while
    reading a chunked body."""
    srv, _ = server
    big = json.dumps({"model": MODEL, "prompt": "a" * 250_000}).encode()
    with httpx.Client(timeout=60) as h:
        err = shape(h.post(base(srv) + "/v1/completions", content=big,
                           headers={"content-type": "application/json"}), 413)
        assert "at most 200000 bytes" in err["message"]

        def chunks():
            for i in range(0, len(big), 16384):
                yield big[i:i + 16384]

        shape(h.post(base(srv) + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
              413)


def test_http_failing_request_fails_alone(bundle, server):
    """Concurrent requests beside one that fails mid-decode (the planted body failure): the
    failing plain request gets 500 in OpenAI's shape, the failing stream an error event and
    [DONE]; the others equal their solo runs."""
    srv, engine = server
    good = [chat_body("Why is the sky blue?", max_tokens=8, temperature=0.0),
            chat_body("Name a fruit.", max_tokens=6, temperature=0.9, top_p=0.9, seed=3)]
    poison = chat_body("Tell me more.", max_tokens=8, temperature=POISON_T, seed=9)
    u = base(srv) + "/v1/chat/completions"

    def plain(body):
        r = httpx.post(u, json=body, timeout=120)
        return r.status_code, r.json()

    def stream(body):
        with httpx.stream("POST", u, json={**body, "stream": True}, timeout=120) as r:
            return [x for x in r.iter_lines() if x]

    alone = [plain(b)[1]["choices"][0]["token_ids"] for b in good]
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [ex.submit(plain, b) for b in good] + [ex.submit(plain, poison), ex.submit(stream, poison)]
        res = [f.result(timeout=180) for f in futs]
    assert [r[1]["choices"][0]["token_ids"] for r in res[:2]] == alone
    status, body = res[2]
    assert status == 500 and "planted body failure" in body["error"]["message"]
    lines = res[3]
    assert lines[-1] == "data: [DONE]" and "planted body failure" in json.loads(lines[-2][6:])["error"]["message"]


def test_http_plain_request_cancelled_on_disconnect(server):
    """A plain (non-streaming) request for 400 tokens whose client closes the socket: its row
    leaves the batch within a second or two, long before 400 steps."""
    srv, engine = server
    body = json.dumps(chat_body("Write a long story.", max_tokens=400, temperature=0.0)).encode()
    steps0 = engine.steps
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        t_end = time.monotonic() + 30
        while engine.load()["active"] == 0:
            assert time.monotonic() < t_end
            time.sleep(0.05)
        time.sleep(0.5)
    t0 = time.monotonic()
    while engine.load()["active"] and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert engine.load()["active"] == 0 and time.monotonic() - t0 < 3
    assert engine.steps - steps0 < 200


class FakeEngine:
    """The engine's HTTP-facing surface on the real bundle: each job ends at once (one
    token, Done) after the check a decode step makes first, the sampler's rules on the
    job's fp32 rows (Failed 500 if they refuse it: what admission must prevent). For the
    HTTP layer's own tests (no model time); .jobs counts the jobs submitted."""

    max_batch = 1  # n = 1 only (submit, no submit_group)

    def __init__(self, bundle, k=K):
        self.bundle, self.k, self.started, self.jobs = bundle, k, False, 0

    def start(self):
        self.started = True

    def submit(self, job):
        self.jobs += 1
        n = len(job.prompt_ids)
        try:
            sampling_tensor([job.params] * 2, positions=[n, n + max(job.max_tokens - 1, 0)])
        except ValueError as e:
            job.sink(Failed(f"engine error: {e}", 500))
            return
        job.sink(Token(12, -0.5, None, "x", False))
        job.sink(Done("length", 1, "x"))

    def load(self):
        return {"active": 0, "waiting": 0, "steps": 0}

    def close(self, timeout=10.0):
        return True


def health_latencies(srv, during):
    """/health round-trip times (s) from the moment `during()` starts on another thread until
    it ends (at least 3 probes)."""
    with cf.ThreadPoolExecutor(1) as ex, httpx.Client(timeout=30) as h:
        h.get(base(srv) + "/health")  # the connection is open before the clock starts
        fut = ex.submit(during)
        lat = []
        while not fut.done() or len(lat) < 3:
            t0 = time.perf_counter()
            assert h.get(base(srv) + "/health").status_code == 200
            lat.append(time.perf_counter() - t0)
            time.sleep(0.005)
        fut.result()
    return lat


def test_health_answers_within_50ms_while_a_large_body_is_parsed(bundle, monkeypatch):
    """A ~580 KB prompt (under the size bound: it is tokenized, ~0.5-1 s): /health keeps
    answering all along, 95% of the probes within 50 ms and every one within 250 ms (the
    2 shared cores see load averages of 8: the OS may not run the loop's thread at once);
    PLANTED: the same parse on the event loop stalls a probe past 250 ms."""
    engine = FakeEngine(bundle)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    rng = random.Random(0)  # distinct words: the tokenizer's word cache does not shortcut them
    prompt = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz漢字") for _ in range(rng.randint(2, 9)))
                      for _ in range(80_000))
    assert len(prompt.encode()) < protocol.max_token_bytes(bundle.tokenizer) * 8191  # not refused by its size
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def big():
        r = httpx.post(base(srv) + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # too many tokens, once tokenized

    try:
        lat = health_latencies(srv, big)
        lat = sorted(lat)
        p95 = lat[int(0.95 * (len(lat) - 1))]
        print(f"\n/health while a {len(prompt.encode())}-byte prompt is parsed: {len(lat)} probes, median "
              f"{lat[len(lat) // 2] * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms, max {lat[-1] * 1000:.1f} ms")
        assert len(lat) >= 10 and p95 < 0.05 and lat[-1] < 0.25, [round(x * 1000, 1) for x in lat]

        async def inline(fn, *a):  # PLANTED: parsing on the event loop
            return fn(*a)

        monkeypatch.setattr(app_mod.asyncio, "to_thread", inline)
        lat = health_latencies(srv, big)
        monkeypatch.undo()
        assert max(lat) > 0.25, [round(x * 1000, 1) for x in lat]
    finally:
        monkeypatch.undo()
        assert srv.stop(30)


# ---------------------------------------------------------------------------------------
# graceful shutdown
# ---------------------------------------------------------------------------------------
def test_graceful_shutdown_in_process(bundle):
    """begin_shutdown (what SIGTERM calls) with a 1.5 s grace: a short request in flight
    finishes (200), a long plain one gets 503 JSON, a long stream an error event and
    [DONE], a new request 503; the engine ends."""
    engine = Engine(bundle, max_batch=8, k=K)
    app = create_app(engine, model_name=MODEL, shutdown_timeout=1.5)
    srv = ThreadServer(app).start()
    u = base(srv) + "/v1/chat/completions"
    long_ = chat_body("Write a long story.", max_tokens=2000, temperature=0.0)

    def stream():
        with httpx.stream("POST", u, json={**long_, "stream": True}, timeout=60) as r:
            return [x for x in r.iter_lines() if x]

    try:
        with cf.ThreadPoolExecutor(3) as ex:
            futs = [ex.submit(httpx.post, u, json=long_, timeout=60), ex.submit(stream)]
            t_end = time.monotonic() + 30
            while engine.load()["active"] < 2:
                assert time.monotonic() < t_end
                time.sleep(0.05)
            short = ex.submit(httpx.post, u, json=chat_body("Hi", max_tokens=3, temperature=0.0), timeout=60)
            time.sleep(0.3)
            app.state.lmtail.begin_shutdown_threadsafe()
            time.sleep(0.2)
            shape(httpx.post(u, json=chat_body("late", max_tokens=2), timeout=30), 503)
            plain, lines = futs[0].result(timeout=30), futs[1].result(timeout=30)
            assert short.result(timeout=30).status_code == 200
        err = shape(plain, 503)
        assert "shutting down" in err["message"]
        assert lines[-1] == "data: [DONE]" and "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        assert len(lines) > 3  # it streamed tokens before the grace ended
    finally:
        assert srv.stop(30)
        assert engine.close(10)


@pytest.mark.slow
def test_sigterm_subprocess_503_done_and_exit_0():
    """`python -m lmtail.serve --shutdown-timeout 2` on 127.0.0.1: SIGTERM while a long
    plain request and a long stream run: 503 JSON, an SSE error event + [DONE], exit 0,
    all within a bound."""
    proc, u = serve_process("--shutdown-timeout", "2")
    try:
        body = chat_body("Write a long story.", max_tokens=3000, temperature=0.0)
        with cf.ThreadPoolExecutor(2) as ex:
            plain = ex.submit(httpx.post, u + "/v1/chat/completions", json=body, timeout=60)
            with httpx.stream("POST", u + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
                it = r.iter_lines()
                next(it)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                lines = [x for x in it if x]
            err = shape(plain.result(timeout=30), 503)
        assert "shutting down" in err["message"]
        assert lines[-1] == "data: [DONE]" and "shutting down" in lines[-2]
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 15
        log = proc.stdout.read().decode()
        assert "lmtail engine closed" in log, log[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


# ---------------------------------------------------------------------------------------
# fuzz: schemathesis from the server's own /openapi.json
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("examples", [30, pytest.param(500, marks=pytest.mark.slow)])
def test_schemathesis_fuzz_from_openapi(bundle, examples):
    """schemathesis reads /openapi.json from the running server and sends positive and
    negative cases to both generation endpoints (`examples` per operation and mode,
    derandomized: a bounded run): no server error, every status and content type the
    document declares, every error body in OpenAI's shape, negative data refused with a
    4xx, every request answered (no hang: 10 s client timeout; each 200 came from a
    submitted job)."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                                   response_schema_conformance, status_code_conformance)

    engine = FakeEngine(bundle)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
              negative_data_rejection]
    seen: dict = {}
    try:
        schema = schemathesis.openapi.from_url(base(srv) + "/openapi.json")
        ops = [r.ok() for r in schema.get_all_operations()]
        assert {op.label for op in ops} >= {"POST /v1/chat/completions", "POST /v1/completions"}
        for op in ops:
            modes = [schemathesis.GenerationMode.POSITIVE]
            if op.method.upper() == "POST":
                modes.append(schemathesis.GenerationMode.NEGATIVE)
            for mode in modes:
                @given(case=op.as_strategy(generation_mode=mode))
                @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                          suppress_health_check=list(HealthCheck))
                def run(case):
                    r = case.call(base_url=base(srv), timeout=10)
                    key = (op.label, mode.value, r.status_code)
                    seen[key] = seen.get(key, 0) + 1
                    case.validate_response(r, checks=checks)

                run()
    finally:
        assert srv.stop(30)
    total = sum(seen.values())
    ok = sum(n for (label, _, st), n in seen.items() if st == 200 and label.startswith("POST"))
    print(f"\nschemathesis: {total} cases, {ok} x 200, statuses "
          f"{sorted(set(st for _, _, st in seen))}, 0 server errors; {engine.jobs} jobs submitted")
    assert not any(st >= 500 for _, _, st in seen)
    assert ok >= examples // 2 and engine.jobs >= ok  # the positive cases reach the engine


@pytest.mark.slow
def test_http_prompt_of_context_minus_one_is_served(bundle):
    """Over HTTP on the real engine: a token-id prompt of context - 1 tokens is served (one
    token, finish "length"; ~2-3 min of prefill on 2 cores), context tokens is a 400 naming
    the prompt."""
    ctx = bundle.config.context_length
    ids = (bundle.tokenizer.encode("The quick brown fox jumps over the lazy dog. ") * 1000)[:ctx]
    engine = Engine(bundle, max_batch=2, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    try:
        with httpx.Client(timeout=600) as h:
            shape(h.post(base(srv) + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}), 400,
                  "prompt")
            r = h.post(base(srv) + "/v1/completions", json={"model": MODEL, "prompt": ids[:-1], "temperature": 0})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert (len(ch["token_ids"]), ch["finish_reason"], r.json()["usage"]["prompt_tokens"]) == (1, "length", ctx - 1)
    finally:
        assert srv.stop(30)
        assert engine.close(10)


@pytest.mark.slow
def test_load_16_clients_with_failures_disconnects_and_a_long_prompt(bundle):
    """16 concurrent clients, shuffled with staggered starts: mixed requests (test_serve's
    load mix), planted failing ones (plain and streamed, failing in the body mid-decode),
    streams whose clients leave after two chunks, and a ~600-token prompt. Every other
    response equals the same request sent alone afterwards (text, ids, logprobs, finish);
    each failing one gets its own 500 / error event and [DONE]. Prints the counts."""
    from test_serve import _load_spec, call

    engine = BodyFails(bundle, max_batch=16, max_queue=64, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    u = base(srv) + "/v1/chat/completions"
    long_text = "Summarize this: " + " ".join(f"item {i} is {i * 7 % 13}." for i in range(100))
    work = [("good", _load_spec(i)) for i in range(80)]
    work.append(("good", ("chat", dict(messages=[{"role": "user", "content": long_text}], max_tokens=4,
                                       temperature=0.5, seed=77))))
    work += [("poison", {"stream": i % 2 == 1, "seed": 500 + i}) for i in range(10)]
    work += [("leave", i) for i in range(8)]
    rng = random.Random(3)
    order = list(range(len(work)))
    rng.shuffle(order)
    c = openai.OpenAI(base_url=base(srv) + "/v1", api_key="none", max_retries=0, timeout=300)

    def run(j):
        time.sleep(rng.random() * 0.5)
        kind, spec = work[j]
        if kind == "good":
            return call(c, spec)
        if kind == "poison":
            body = chat_body("Tell me more.", max_tokens=8, temperature=POISON_T, seed=spec["seed"])
            if not spec["stream"]:
                r = httpx.post(u, json=body, timeout=300)
                return r.status_code, r.json()["error"]["message"]
            with httpx.stream("POST", u, json={**body, "stream": True}, timeout=300) as r:
                lines = [x for x in r.iter_lines() if x]
            return lines[-1], json.loads(lines[-2][6:])["error"]["message"]
        with httpx.stream("POST", u, json=chat_body("Write a long story.", max_tokens=300, stream=True,
                                                     temperature=0.0), timeout=300) as r:
            it = r.iter_lines()
            return [next(it) for _ in range(4)] and "left"

    t0 = time.monotonic()
    try:
        with cf.ThreadPoolExecutor(16) as ex:
            got = dict(zip(order, ex.map(run, order)))
        t_conc = time.monotonic() - t0
        alone = {j: call(c, spec) for j, (kind, spec) in enumerate(work) if kind == "good"}
        t_end = time.monotonic() + 30
        while engine.load()["active"] and time.monotonic() < t_end:
            time.sleep(0.1)
        idle = engine.load()["active"] == 0
    finally:
        assert srv.stop(30) and engine.close(10)
    good = [j for j in alone]
    equal = sum(got[j] == alone[j] for j in good)
    poison = [j for j, (k, _) in enumerate(work) if k == "poison"]
    own = sum(got[j][0] in (500, "data: [DONE]") and "planted body failure" in got[j][1] for j in poison)
    left = sum(got[j] == "left" for j, (k, _) in enumerate(work) if k == "leave")
    n_long = len(bundle.tokenizer.encode(bundle.tokenizer.apply_chat_template([{"role": "user", "content": long_text}])))
    print(f"\nload with failures: {len(work)} requests, 16 clients, {t_conc:.1f} s; {equal}/{len(good)} byte-equal "
          f"to solo (incl. a {n_long}-token prompt); {own}/{len(poison)} planted failures answered with their own "
          f"error; {left}/8 clients left mid-stream; engine idle after: {idle}; max rows in a step "
          f"{engine.max_rows_seen}")
    assert equal == len(good) and own == len(poison) and left == 8 and idle
