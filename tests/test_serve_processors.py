"""lmtail serve with logit_bias and penalties: the fields parse into Processors, each row
gets its LogitProcessing per step from its own prompt and tokens, and a request's bytes
stay its solo run's whatever runs beside it.

In-process engine (driven step by step, as tests/test_serve.py does): logit_bias {id:
100} emits that id at every step; greedy penalised rows emit the argmax of the float64
reference's processed logits at every step (and differ from the plain run); processed and
plain requests joining and leaving one batch each equal their solo runs (library only:
prefill + decode_tail(processing=...)); Engine(ranks=2) == Engine(ranks=1). PLANTED: an
engine that counts every token twice goes red. Over HTTP (the openai client): logit_bias
reaches the tail; bad values are 400s naming the field.

Shape legend: R rows, H hidden, V vocab.
"""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from conftest import fbits as bits  # noqa: E402
from lmtail.model.generate import default_head_input, default_ops, head_weight  # noqa: E402
from lmtail.model.llama import forward, new_cache, prefill  # noqa: E402
from lmtail.tail.processors import LogitProcessing, Processors  # noqa: E402
from lmtail.reference.processors import processed_logits  # noqa: E402
from lmtail.tail.sampler import SamplingParams, sampling_tensor  # noqa: E402
from lmtail.serve import protocol  # noqa: E402
from lmtail.serve.app import create_app  # noqa: E402
from lmtail.serve.cli import ThreadServer  # noqa: E402
from lmtail.serve.engine import Done, Engine, Failed, Job, Token  # noqa: E402
from lmtail.tail.compose import decode_tail  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
K = 256


def chat_ids(bundle, text):
    return bundle.tokenizer.encode(bundle.tokenizer.chat_prompt(text))


def solo(bundle, ids, params: SamplingParams, max_tokens: int, proc: Processors | None):
    """The request alone, from the library: prefill + decode_tail(processing=[row's
    LogitProcessing]) per step -> (token ids, logprob bits)."""
    ops, cfg = default_ops(), bundle.config
    hi = default_head_input(ops)
    cache = new_cache(cfg, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids) + max_tokens)
    h = prefill(bundle, torch.tensor([ids]), cache, ops=ops)  # [1, H]
    toks, lps, counts = [], [], {}
    for step in range(max_tokens):
        sp = sampling_tensor([params], positions=[len(ids) + step])
        lp = None if proc is None else [proc.at(ids, counts)]
        out = decode_tail(h, bundle.final_norm, head_weight(bundle, hi), eps=cfg.eps, k=K, sampling_params=sp,
                          emit_logits=False, head_input=hi, processing=lp)
        t = int(out.tokens[0])
        toks.append(t)
        lps.append(bits(float(out.logprobs[0])))
        counts[t] = counts.get(t, 0) + 1
        if t in bundle.tokenizer.stop_ids:
            break
        h = forward(bundle, out.tokens[:, None], cache, ops=ops)[0][:, -1]
    return toks, lps


def greedy_reference(bundle, ids, max_tokens: int, proc: Processors):
    """Greedy decoding where each step's token is the first argmax of the float64
    reference's processing of the tail's plain fp32 logits (exchange "candidates":
    decisions on fp32 logits)."""
    ops, cfg = default_ops(), bundle.config
    hi = default_head_input(ops)
    cache = new_cache(cfg, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids) + max_tokens)
    h = prefill(bundle, torch.tensor([ids]), cache, ops=ops)
    toks, counts = [], {}
    for _ in range(max_tokens):
        out = decode_tail(h, bundle.final_norm, head_weight(bundle, hi), eps=cfg.eps, k=1, head_input=hi,
                          emit_logits=True)
        lg = processed_logits(out.logits, [proc.at(ids, counts)])  # [1, V]
        t = int(torch.argmax(lg[0]))  # the first maximum: ties to the lower id
        toks.append(t)
        counts[t] = counts.get(t, 0) + 1
        if t in bundle.tokenizer.stop_ids:
            break
        h = forward(bundle, torch.tensor([[t]]), cache, ops=ops)[0][:, -1]
    return toks


class Collect:
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


REP = Processors(repetition_penalty=1.8, frequency_penalty=0.7, presence_penalty=0.4)
REQUESTS = [  # (prompt, params, max_tokens, joins at step, processors)
    ("Repeat the word cat five times.", SamplingParams(temperature=0.0, seed=1), 10, 0, REP),
    ("Name three fruits.", SamplingParams(temperature=0.9, top_p=0.9, seed=11), 6, 0, None),
    ("Say hello.", SamplingParams(temperature=0.8, top_k=20, seed=5), 5, 1, Processors(logit_bias=((28, 100.0),))),
    ("Count to five.", SamplingParams(temperature=0.0, seed=2), 6, 2, None),
    ("Write a haiku about rain.", SamplingParams(temperature=1.1, min_p=0.05, seed=12), 7, 2,
     Processors(frequency_penalty=-1.5, logit_bias=((30, -100.0), (1000, 5.5)), repetition_penalty=0.8)),
]


def drive(engine, bundle, requests):
    sinks = [Collect() for _ in requests]
    jobs = [Job(prompt_ids=chat_ids(bundle, p), params=sp, max_tokens=n, sink=s, processors=q)
            for (p, sp, n, _, q), s in zip(requests, sinks)]
    for step in range(64):
        for job, r in zip(jobs, requests):
            if r[3] == step:
                engine.admit(job)
        if all(s.done for s in sinks):
            break
        engine.step()
    assert all(isinstance(s.events[-1], Done) for s in sinks), [s.events[-1] for s in sinks]
    return sinks


@pytest.fixture(scope="module")
def batch_run(bundle):
    engine = Engine(bundle, max_batch=8, k=K)
    sinks = drive(engine, bundle, REQUESTS)
    assert engine.max_rows_seen >= 4
    return sinks


def test_logit_bias_100_emits_that_token(bundle, batch_run):
    toks, _ = batch_run[2].result()
    assert toks == [28] * 5


def test_greedy_penalties_follow_the_float64_reference(bundle, batch_run):
    ids = chat_ids(bundle, REQUESTS[0][0])
    toks, _ = batch_run[0].result()
    assert toks == greedy_reference(bundle, ids, 10, REP)
    plain, _ = solo(bundle, ids, REQUESTS[0][1], 10, None)
    assert toks != plain  # the penalties changed the text


def test_batch_rows_equal_solo_with_and_without_processing(bundle, batch_run):
    for (p, sp, n, _, q), s in zip(REQUESTS, batch_run):
        assert s.result() == solo(bundle, chat_ids(bundle, p), sp, n, q), p


class DoubleCountEngine(Engine):
    """PLANTED: every generated token counted twice."""

    def _emit_token(self, r, tid, lp, top):
        r.counts[tid] = r.counts.get(tid, 0) + 1
        return super()._emit_token(r, tid, lp, top)


def test_planted_double_count_is_caught(bundle, batch_run):
    sinks = drive(DoubleCountEngine(bundle, max_batch=8, k=K), bundle, REQUESTS[:1])
    assert sinks[0].result() != batch_run[0].result()


def test_ranks2_equal_ranks1_with_processing(bundle, batch_run):
    engine = Engine(bundle, max_batch=8, k=K, ranks=2)
    try:
        got = drive(engine, bundle, REQUESTS)
    finally:
        assert engine.close(10)
    assert [s.result() for s in got] == [s.result() for s in batch_run]


# ---------------------------------------------------------------------------------------
# the fields (no server) and over HTTP
# ---------------------------------------------------------------------------------------
def parse(bundle, **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return protocol.parse("chat", json.loads(json.dumps(body)), tokenizer=bundle.tokenizer, model=MODEL,
                          context=bundle.config.context_length, k=K)


def test_fields_parse_into_processors(bundle):
    r = parse(bundle, logit_bias={"7": 3, "5": -100}, presence_penalty=-2, frequency_penalty=1.5,
              repetition_penalty=1.2)
    assert r.processors == Processors(logit_bias=((5, -100.0), (7, 3.0)), presence_penalty=-2.0,
                                      frequency_penalty=1.5, repetition_penalty=1.2)
    assert parse(bundle, logit_bias={}, presence_penalty=0, repetition_penalty=1).processors is None
    p = r.processors.at(r.prompt_ids, {9: 2})
    assert isinstance(p, LogitProcessing) and p.prompt_ids == tuple(r.prompt_ids)


BAD = [
    (dict(logit_bias={"abc": 1}), "logit_bias", "keys are token ids"),
    (dict(logit_bias={"49152": 1}), "logit_bias", r"token ids in \[0, 49152\)"),
    (dict(logit_bias={"5": 101}), "logit_bias[5]", r"a number in \[-100, 100\]"),
    (dict(logit_bias={"5": "x"}), "logit_bias[5]", r"a number in \[-100, 100\]"),
    (dict(logit_bias={"5": 1, "05": 2}), "logit_bias", "each token id once"),
    (dict(presence_penalty=2.01), "presence_penalty", r"a number in \[-2, 2\]"),
    (dict(frequency_penalty=-3), "frequency_penalty", r"a number in \[-2, 2\]"),
    (dict(repetition_penalty=0), "repetition_penalty", "a finite number > 0"),
    (dict(repetition_penalty=1e-50), "repetition_penalty", "0.0 in fp32"),
    (dict(repetition_penalty=1e39), "repetition_penalty", "inf in fp32"),
]


@pytest.mark.parametrize("fields,param,words", BAD)
def test_bad_fields_name_themselves(bundle, fields, param, words):
    with pytest.raises(protocol.ApiError, match=words) as e:
        parse(bundle, **fields)
    assert (e.value.status, e.value.body()["error"]["param"]) == (400, param)


def test_http_logit_bias_and_penalties(bundle):
    engine = Engine(bundle, max_batch=4, max_queue=8, k=K)
    srv = ThreadServer(create_app(engine, model_name=MODEL)).start()
    try:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0, timeout=120)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                      max_tokens=4, temperature=0.7, seed=3, logit_bias={"28": 100})
        assert r.choices[0].model_extra["token_ids"] == [28] * 4
        msg = "Repeat the word cat five times."
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}], max_tokens=10,
                                      temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4,
                                      extra_body={"repetition_penalty": 1.8})
        assert r.choices[0].model_extra["token_ids"] == greedy_reference(bundle, chat_ids(bundle, msg), 10, REP)
        with pytest.raises(openai.BadRequestError, match="presence_penalty"):
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], presence_penalty=3)
    finally:
        assert srv.stop(30) and engine.close(10)


# ---------------------------------------------------------------------------------------
# the model-level decode: generate(processors=...)
# ---------------------------------------------------------------------------------------
def test_generate_with_processors_on_1_and_2_ranks(bundle):
    """generate(processors=[...]) (chat prompts): the penalised greedy row == the float64
    reference's greedy decode, the plain row == generate without processors, and ranks=2
    gives every token of ranks=1."""
    from lmtail.model.generate import generate

    prompts = [REQUESTS[0][0], REQUESTS[3][0]]
    params = [SamplingParams(temperature=0.0, seed=1), SamplingParams(temperature=0.9, top_p=0.9, seed=4)]
    one = generate(bundle, prompts, params=params, processors=[REP, None], max_new_tokens=10)
    assert list(one.token_ids[0]) == greedy_reference(bundle, chat_ids(bundle, prompts[0]), 10, REP)
    plain = generate(bundle, prompts[1:], params=params[1:], max_new_tokens=10)
    assert one.token_ids[1] == plain.token_ids[0] and one.logprobs[1] == plain.logprobs[0]
    two = generate(bundle, prompts, params=params, processors=[REP, None], max_new_tokens=10, ranks=2)
    assert two.token_ids == one.token_ids and two.logprobs == one.logprobs
    with pytest.raises(ValueError, match=r"processors\[0\].frequency_penalty must be a number in \[-2, 2\]"):
        generate(bundle, prompts[:1], processors=[Processors(frequency_penalty=9)], max_new_tokens=2)
    with pytest.raises(ValueError, match="record=True certifies the unprocessed tail"):
        generate(bundle, prompts[:1], processors=[REP], max_new_tokens=2, record=True)


@pytest.mark.slow
def test_http_ranks2_concurrent_equals_ranks1_alone(bundle):
    """Over HTTP: requests with logit_bias / penalties and plain ones sent concurrently to
    a --ranks 2 server == each sent alone to a ranks 1 server (ids, logprobs)."""
    import concurrent.futures as cf

    specs = [dict(messages=[{"role": "user", "content": "Repeat the word cat five times."}], max_tokens=8,
                  temperature=0.0, frequency_penalty=0.7, presence_penalty=0.4, extra_body={"repetition_penalty": 1.8}),
             dict(messages=[{"role": "user", "content": "Name three fruits."}], max_tokens=6, temperature=0.9,
                  seed=11),
             dict(messages=[{"role": "user", "content": "Say hello."}], max_tokens=5, temperature=0.8, seed=5,
                  logit_bias={"28": 100}),
             dict(messages=[{"role": "user", "content": "Write a haiku."}], max_tokens=7, temperature=1.1, seed=12,
                  frequency_penalty=-1.5, logit_bias={"30": -100, "1000": 5.5})]

    def call(c, kw):
        r = c.chat.completions.create(model=MODEL, logprobs=True, **kw)
        return r.choices[0].model_extra["token_ids"], [x.logprob for x in r.choices[0].logprobs.content]

    def serve(ranks):
        engine = Engine(bundle, max_batch=8, max_queue=16, k=K, ranks=ranks)
        return engine, ThreadServer(create_app(engine, model_name=MODEL)).start()

    def client(srv):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{srv.port}/v1", api_key="none", max_retries=0, timeout=120)

    engine, srv = serve(1)
    try:
        alone = [call(client(srv), s) for s in specs]
    finally:
        assert srv.stop(30) and engine.close(10)
    engine, srv = serve(2)
    try:
        with cf.ThreadPoolExecutor(len(specs)) as ex:
            together = list(ex.map(lambda s: call(client(srv), s), specs))
    finally:
        assert srv.stop(30) and engine.close(10)
    assert together == alone
    assert alone[2][0] == [28] * 5
