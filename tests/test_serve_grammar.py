"""response_format JSON modes in `lmtail serve` (serve.grammar, llguidance): the mask is
the grammar's exact token set (bit views against a brute-force reference over the whole
vocabulary; planted wrong masks go red); json_object / json_schema rows decode to JSON
that parses / validates, greedy and seeded, and finish with "stop"; a grammar row leaves
its batchmates' bytes equal to their solo runs, and is itself the same alone or batched;
an engine that drops the mask goes red; over HTTP, a bad schema is a 400 naming
response_format and a stream adds up to the non-streamed response. --ranks 2 equals
--ranks 1 with grammar rows (@pytest.mark.slow: ~13 s, it spawns the ranks).

Shape legend: V vocab.
"""
from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("starlette")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from test_serve import K, MODEL, REQUESTS, Collect, bits, chat_ids, solo  # noqa: E402

from lmtail.tail.sampler import SamplingParams  # noqa: E402
from lmtail.serve import protocol  # noqa: E402
from lmtail.serve.app import create_app  # noqa: E402
from lmtail.serve.cli import ThreadServer  # noqa: E402
from lmtail.serve.engine import Done, Engine, Failed, Job, Token  # noqa: E402
from lmtail.serve.grammar import Grammars, bits_to_mask, with_masks  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
AS_OBJECT = {"type": "json_object"}
ASK = "Give the name and age of a person as JSON."


@pytest.fixture(scope="module")
def grammars(bundle):
    return Grammars(bundle.tokenizer, bundle.config.vocab)


def mask_bits(mask: torch.Tensor) -> bytes:
    """The mask's bytes (one uint8 per lane): what the equality tests compare."""
    return mask.view(torch.uint8).numpy().tobytes()


# ---------------------------------------------------------------------------------------
# the mask, exactly
# ---------------------------------------------------------------------------------------
def word_reference(bitmask: bytes, vocab: int) -> torch.Tensor:
    """[V] bool: bit t % 32 of the little-endian 32-bit word t // 32, one lane at a time."""
    words = [int.from_bytes(bitmask[4 * w:4 * w + 4], "little") for w in range(len(bitmask) // 4)]
    return torch.tensor([bool((words[t // 32] >> (t % 32)) & 1) for t in range(vocab)], dtype=torch.bool)


def bits_big_endian(bitmask: bytes, vocab: int) -> torch.Tensor:
    """PLANTED: the bits read most-significant first."""
    return torch.from_numpy(np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8))[:vocab].astype(np.bool_))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bits_to_mask_equals_word_reference(seed):
    rng = random.Random(seed)
    for vocab in (1, 31, 32, 33, 1000, 4099):
        n = -(-vocab // 32) + rng.randint(0, 1)  # whole words; sometimes one spare word, as llguidance's
        bm = bytes(rng.getrandbits(8) for _ in range(4 * n))
        want = mask_bits(word_reference(bm, vocab))
        assert mask_bits(bits_to_mask(bm, vocab)) == want
        if vocab >= 1000:  # random bytes: some byte's bits are no palindrome
            assert mask_bits(bits_big_endian(bm, vocab)) != want  # PLANTED goes red
    with pytest.raises(ValueError, match=r"bitmask must hold >= 33 bits; got 32"):
        bits_to_mask(b"\xff" * 4, 33)


def prefix_reference(tok, vocab: int, words: list[bytes]) -> torch.Tensor:
    """[V] bool, brute force over the vocabulary: the text tokens whose bytes are a
    non-empty prefix of one of `words` (special tokens never: they carry no text)."""
    out = torch.zeros(vocab, dtype=torch.bool)
    for t in range(tok.vocab_size):
        if t in tok.special_ids:
            continue
        b = protocol.token_bytes(tok, t)
        out[t] = bool(b) and any(w.startswith(b) for w in words)
    return out


def test_enum_mask_equals_brute_force_and_ends_in_stop_ids(bundle, grammars):
    """{"enum": ["yes", "no"]}: at the start the allowed tokens are exactly those whose bytes
    prefix '"yes"' or '"no"'; after '"' those prefixing 'yes"' / 'no"'; after the whole
    '"yes"' only the stop ids. A planted mask with one allowed lane dropped goes red."""
    tok, vocab = bundle.tokenizer, bundle.config.vocab
    fmt = {"type": "json_schema", "json_schema": {"name": "yn", "schema": {"enum": ["yes", "no"]}}}
    st = grammars.compile(fmt).start()
    m0 = st.allowed()
    want0 = prefix_reference(tok, vocab, [b'"yes"', b'"no"'])
    assert m0.shape == (vocab,) and m0.dtype == torch.bool
    assert mask_bits(m0) == mask_bits(want0) and int(want0.sum()) >= 1  # '"' alone: no '"y' / '"n' token
    planted = m0.clone()
    planted[int(m0.nonzero()[0])] = False  # PLANTED: one allowed lane dropped
    assert mask_bits(planted) != mask_bits(want0)
    quote = tok.encode('"')
    assert len(quote) == 1
    st.advance(quote[0])
    want1 = prefix_reference(tok, vocab, [b'yes"', b'no"'])
    assert mask_bits(st.allowed()) == mask_bits(want1) and int(want1.sum()) >= 4  # y, ye, yes, n, no, ...
    for t in tok.encode('yes"'):
        st.advance(t)
    stops = torch.zeros(vocab, dtype=torch.bool)
    stops[sorted(tok.stop_ids)] = True
    assert mask_bits(st.allowed()) == mask_bits(stops)
    with pytest.raises(RuntimeError, match="refused token"):
        st.advance(quote[0])


def test_with_masks_keeps_other_rows(bundle, grammars):
    """Rows without a grammar keep their entry (None stays None); no grammar row: the
    processing list is returned as given."""
    st = grammars.compile(AS_OBJECT).start()
    assert with_masks(None, [None, None]) is None
    got = with_masks(None, [None, st, None])
    assert got[0] is None and got[2] is None and mask_bits(got[1].allowed) == mask_bits(st.allowed())


# ---------------------------------------------------------------------------------------
# the engine
# ---------------------------------------------------------------------------------------
GRAMMAR_ROWS = [  # (prompt, response_format, params, max_tokens)
    (ASK, AS_OBJECT, SamplingParams(temperature=0.0, seed=1), 40),
    (ASK, AS_OBJECT, SamplingParams(temperature=0.8, top_p=0.9, seed=7), 40),
    (ASK, AS_SCHEMA, SamplingParams(temperature=0.0, seed=1), 40),
    (ASK, AS_SCHEMA, SamplingParams(temperature=1.0, top_k=40, seed=3), 40),
]


def run_engine(engine, bundle, grammars, rows, plain=()):
    """Admit the grammar rows and the plain (prompt, params, max_tokens) rows in one batch,
    step until all are done; returns (grammar sinks, plain sinks)."""
    gs, ps = [Collect() for _ in rows], [Collect() for _ in plain]
    for (p, fmt, sp, n), s in zip(rows, gs):
        engine.admit(Job(prompt_ids=chat_ids(bundle, p), params=sp, max_tokens=n, sink=s,
                         grammar=grammars.compile(fmt).start()))
    for (p, sp, n), s in zip(plain, ps):
        engine.admit(Job(prompt_ids=chat_ids(bundle, p), params=sp, max_tokens=n, sink=s))
    for _ in range(80):
        if all(s.done for s in gs + ps):
            break
        engine.step()
    assert all(s.done for s in gs + ps)
    return gs, ps


def check_person(obj) -> None:
    assert isinstance(obj, dict) and {"name", "age"} <= set(obj), obj
    assert isinstance(obj["name"], str) and isinstance(obj["age"], int) and not isinstance(obj["age"], bool), obj


def test_engine_grammar_rows_give_json_and_leave_batchmates_bytes(bundle, grammars):
    """Four grammar rows (json_object / json_schema, greedy / seeded) beside two plain
    requests in one batch: each grammar row ends "stop" on a stop id with text that is a
    JSON object (the schema's: name a string, age an integer), every token inside its
    mask; the plain rows' ids and logprob bits equal their solo runs; each grammar row's
    bytes equal its own run alone."""
    engine = Engine(bundle, max_batch=8, k=K)
    plain = [(p, sp, n) for p, sp, n, _ in REQUESTS[:2]]
    gs, ps = run_engine(engine, bundle, grammars, GRAMMAR_ROWS, plain)
    assert engine.max_rows_seen == 6
    for s, (_, fmt, _, _) in zip(gs, GRAMMAR_ROWS):
        done = s.events[-1]
        assert isinstance(done, Done) and done.finish_reason == "stop", done
        toks = [e for e in s.events if isinstance(e, Token)]
        assert toks[-1].id in bundle.tokenizer.stop_ids and all(not t.special for t in toks[:-1])
        obj = json.loads(done.text)
        assert isinstance(obj, dict)
        if fmt is AS_SCHEMA:
            check_person(obj)
    for s, (p, sp, n) in zip(ps, plain):
        assert isinstance(s.events[-1], Done) and s.result() == solo(bundle, chat_ids(bundle, p), sp, n)
    for s, row in zip(gs, GRAMMAR_ROWS):
        alone, _ = run_engine(Engine(bundle, max_batch=1, k=K), bundle, grammars, [row])
        assert alone[0].result() == s.result()


def test_schema_validates_with_jsonschema(bundle, grammars):
    """The schema rows' JSON validates against PERSON by an independent validator."""
    jsonschema_rs = pytest.importorskip("jsonschema_rs")
    gs, _ = run_engine(Engine(bundle, max_batch=4, k=K), bundle, grammars, GRAMMAR_ROWS[2:])
    for s in gs:
        obj = json.loads(s.events[-1].text)
        assert jsonschema_rs.is_valid(PERSON, obj), obj
        assert not jsonschema_rs.is_valid(PERSON, {"name": obj["name"]})  # the validator can say no


def test_mirror_exchange_grammar_rows(bundle, grammars):
    """exchange "mirror" (decisions on the bf16 mirror): the mask holds there too (-inf stays
    -inf in bf16): JSON out, ending "stop"; each row the same batched or alone."""
    rows = GRAMMAR_ROWS[2:]  # the schema rows (greedy, seeded)
    gs, _ = run_engine(Engine(bundle, max_batch=4, k=K, exchange="mirror"), bundle, grammars, rows,
                       [(p, sp, n) for p, sp, n, _ in REQUESTS[:1]])
    for s, row in zip(gs, rows):
        assert s.events[-1].finish_reason == "stop" and isinstance(json.loads(s.events[-1].text), dict)
        alone, _ = run_engine(Engine(bundle, max_batch=1, k=K, exchange="mirror"), bundle, grammars, [row])
        assert alone[0].result() == s.result()


class MaskDropped(Engine):
    """PLANTED: the step drops the grammar rows' processing (no mask on the logits)."""

    def _tail(self, x, sp, want, processing=None):
        return super()._tail(x, sp, want)


def test_planted_engine_without_mask_goes_red(bundle, grammars):
    """Without the mask the model's own greedy tokens leave the grammar: the row fails
    alone (500, the grammar refused a token) instead of returning JSON; its batchmate
    still equals its solo run."""
    plain = [(p, sp, n) for p, sp, n, _ in REQUESTS[:1]]
    gs, ps = run_engine(MaskDropped(bundle, max_batch=4, k=K), bundle, grammars, [GRAMMAR_ROWS[2]], plain)
    ev = gs[0].events[-1]
    assert isinstance(ev, Failed) and ev.status == 500 and "grammar refused token" in ev.message, ev
    p, sp, n = plain[0]
    assert isinstance(ps[0].events[-1], Done) and ps[0].result() == solo(bundle, chat_ids(bundle, p), sp, n)


# ---------------------------------------------------------------------------------------
# admission
# ---------------------------------------------------------------------------------------
def chat_body(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": ASK}], **kw}


BAD_FORMATS = [  # (response_format, param, words)
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "response_format",
     "invalid or not supported"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}},
     "response_format", "Unimplemented keys"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}}, "response_format",
     "supported: {\"type\": \"text\"}, {\"type\": \"json_object\"}"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}},
     "response_format", "regex"),
    ({"type": "json_schema"}, "response_format", "keys ['json_schema', 'type']"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema", "schema a JSON object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "response_format.json_schema.strict",
     "a boolean"),
    ({"type": "json_object", "schema": {}}, "response_format", "keys ['type']"),
    ({"type": "regex", "regex": "a+"}, "response_format", "not supported yet"),
    ({"type": 3}, "response_format", "an object"),
]


@pytest.mark.parametrize("fmt,param,words", BAD_FORMATS, ids=range(len(BAD_FORMATS)))
def test_bad_response_format_names_it(bundle, grammars, fmt, param, words):
    with pytest.raises(protocol.ApiError) as e:
        protocol.parse("chat", chat_body(response_format=fmt), tokenizer=bundle.tokenizer, model=MODEL,
                       context=bundle.config.context_length, k=K, grammars=grammars)
    body = e.value.body()["error"]
    assert (e.value.status, body["param"]) == (400, param) and words in body["message"], body


def test_schema_with_a_huge_integer_is_400(bundle, grammars):
    """A schema holding an integer literal past protocol.MAX_INT_DIGITS (loads keeps it as
    text) is refused naming response_format, not a 500."""
    raw = ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
           '"json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "maxLength": %s}}}}'
           % (MODEL, "9" * 60)).encode()
    with pytest.raises(protocol.ApiError) as e:
        protocol.parse("chat", protocol.loads(raw), tokenizer=bundle.tokenizer, model=MODEL,
                       context=bundle.config.context_length, k=K, grammars=grammars)
    assert (e.value.status, e.value.param) == (400, "response_format"), e.value.body()


def test_parse_json_modes(bundle, grammars):
    """text is no grammar; the JSON modes compile; without a compiler they are not supported."""
    kw = dict(tokenizer=bundle.tokenizer, model=MODEL, context=bundle.config.context_length, k=K)
    assert protocol.parse("chat", chat_body(response_format={"type": "text"}), grammars=grammars, **kw).grammar is None
    for fmt in (AS_OBJECT, AS_SCHEMA):
        assert protocol.parse("completions", {"model": MODEL, "prompt": "x", "response_format": fmt},
                              grammars=grammars, **kw).grammar is not None
    with pytest.raises(protocol.ApiError, match="not supported yet"):
        protocol.parse("chat", chat_body(response_format=AS_OBJECT), **kw)


# ---------------------------------------------------------------------------------------
# over HTTP
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(bundle):
    engine = Engine(bundle, max_batch=8, max_queue=8, k=K)
    app = create_app(engine, model_name=MODEL)
    srv = ThreadServer(app).start()
    srv.app = app
    yield srv
    assert srv.stop(30)
    assert engine.close(10)


def test_http_json_modes_stream_equals_whole_and_bad_schema_is_400(server):
    """The openai client: json_schema (seeded, top logprobs) and json_object (greedy)
    answers parse; a stream adds up to the non-streamed answer (text, ids, logprobs,
    finish); top logprobs hold no masked (-inf) lane; a bad schema is a 400 in OpenAI's
    shape naming response_format."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40, temperature=0.9, seed=5,
              response_format=AS_SCHEMA, logprobs=True, top_logprobs=3)
    whole = c.chat.completions.create(**kw).choices[0]
    check_person(json.loads(whole.message.content))
    assert whole.finish_reason == "stop"
    tops = [a.logprob for x in whole.logprobs.content for a in x.top_logprobs]
    assert tops and all(np.isfinite(tops))
    first = whole.logprobs.content[0]  # PERSON allows one first token, '{"': forced, logprob 0, no alternative
    assert (first.token, first.logprob, len(first.top_logprobs)) == ('{"', 0.0, 1)
    text, ids, lps, fin = "", [], [], None
    for ch in c.chat.completions.create(stream=True, **kw):
        for d in ch.choices:
            text += d.delta.content or ""
            ids += (d.model_extra or {}).get("token_ids") or []
            lps += [bits(x.logprob) for x in (d.logprobs.content if d.logprobs else [])]
            fin = d.finish_reason or fin
    assert (text, ids, lps, fin) == (whole.message.content, whole.model_extra["token_ids"],
                                     [bits(x.logprob) for x in whole.logprobs.content], whole.finish_reason)
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=40,
                                  temperature=0.0, response_format=AS_OBJECT)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "not": {}}}}
    with httpx.Client(timeout=60) as h:
        resp = h.post(f"http://127.0.0.1:{server.port}/v1/chat/completions", json=chat_body(response_format=bad))
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["param"] == "response_format" and set(err) == {
        "message", "type", "param", "code"} and "json_object" in err["message"], resp.text


@pytest.mark.slow
def test_engine_ranks2_grammar_rows_equal_ranks1(bundle, grammars):
    """--ranks 2: grammar rows beside a plain one give the bytes of ranks = 1 (the mask
    applied per rank on its own vocab shard, or the step on the full head)."""
    plain = [(p, sp, n) for p, sp, n, _ in REQUESTS[1:2]]
    rows = GRAMMAR_ROWS[1:3]
    want_g, want_p = run_engine(Engine(bundle, max_batch=4, k=K), bundle, grammars, rows, plain)
    engine = Engine(bundle, max_batch=4, k=K, ranks=2)
    try:
        got_g, got_p = run_engine(engine, bundle, grammars, rows, plain)
    finally:
        assert engine.close(30)
    assert [s.result() for s in got_g + got_p] == [s.result() for s in want_g + want_p]
    assert all(isinstance(s.events[-1], Done) for s in got_g + got_p)


def on_event_loop() -> bool:
    """True when called on a thread running an asyncio event loop."""
    try:
        asyncio.get_running_loop()
        return True
    except RuntimeError:
        return False


def test_http_schema_compiles_off_the_event_loop(server, monkeypatch):
    """The server compiles a request's schema on a worker thread, never on its event loop
    (the detector says True when called on a loop: shown first)."""
    async def probe():
        return on_event_loop()

    assert asyncio.run(probe()) is True and on_event_loop() is False
    grammars = server.app.state.lmtail.grammars
    seen = []
    real = type(grammars).compile

    def compile_and_record(self, fmt):
        seen.append(on_event_loop())
        return real(self, fmt)

    monkeypatch.setattr(type(grammars), "compile", compile_and_record)
    with httpx.Client(timeout=60) as h:
        r = h.post(f"http://127.0.0.1:{server.port}/v1/chat/completions",
                   json=chat_body(response_format=AS_OBJECT, max_tokens=2, temperature=0.0))
    assert r.status_code == 200 and seen == [False], (r.text, seen)
