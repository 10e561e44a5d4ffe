"""The combined load test in small (lmtail.benchmarks.bench_clients, issue 30's target 1):
concurrent mixed clients (the real `openai` client) beside planted failing requests, clients
that disconnect and a longer prompt arriving mid-run; every good answer byte-equal to its
solo run, every failing one its own error, nothing lost, the server idle after.

The comparator is shown byte-sensitive first (a logprob one ulp off, a token id changed, a
choice seed dropped all differ), so a green run means equal bytes. The full run (16 clients,
a 2,000-token prompt, two rounds) is `python -m lmtail.benchmarks.bench_clients`.
"""
from __future__ import annotations

import json
import struct

import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")
pytest.importorskip("httpx")

from test_serve import bundle  # noqa: E402,F401

from lmtail.benchmarks import bench_clients as bc  # noqa: E402
from lmtail.serve.app import create_app  # noqa: E402
from lmtail.serve.cli import ThreadServer  # noqa: E402

ANSWER = {"choices": [{"index": 0, "finish_reason": "length", "seed": 5, "token_ids": [7, 8],
                       "message": {"content": "ab"},
                       "logprobs": {"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}}],
          "usage": {"completion_tokens": 2}}


def _next_float32(x: float) -> float:
    """The fp32 value one ulp above x (x an fp32 value)."""
    (i,) = struct.unpack("<i", struct.pack("<f", x))
    return struct.unpack("<f", struct.pack("<i", i + (1 if x >= 0 else -1)))[0]


def test_canonical_is_byte_sensitive():
    """One ulp of one logprob, one token id or the choice's seed changes the canonical
    text; a stream's chunks fold into the same text as the whole answer."""
    base = bc.canonical([ANSWER])
    ulp = json.loads(json.dumps(ANSWER))
    lp = ulp["choices"][0]["logprobs"]["content"][0]
    lp["logprob"] = _next_float32(lp["logprob"])
    tid = json.loads(json.dumps(ANSWER))
    tid["choices"][0]["token_ids"][1] = 9
    seedless = json.loads(json.dumps(ANSWER))
    del seedless["choices"][0]["seed"]
    assert len({base, bc.canonical([ulp]), bc.canonical([tid]), bc.canonical([seedless])}) == 4
    assert bc.canonical([seedless]) == bc.canonical([ANSWER], seeded=False)
    c = ANSWER["choices"][0]
    chunks = [{"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [7], "finish_reason": None,
                            "logprobs": c["logprobs"], "seed": 5}]},
              {"choices": [{"index": 0, "delta": {"content": "b"}, "token_ids": [8], "finish_reason": None,
                            "logprobs": None}]},
              {"choices": [{"index": 0, "delta": {}, "finish_reason": "length", "logprobs": None}]},
              {"choices": [], "usage": ANSWER["usage"]}]
    assert bc.canonical(chunks) == base


def test_judge_rules():
    """A 4xx must be shaped and name the request's own field; the planted failure must be a
    500 or an error event with its words; a transport error is lost."""
    bad = bc.Req("b", "chat", {}, expect="4xx:top_p")
    assert bc.judge(bad, "error", "400 shaped top_p words", {}) == "own-error"
    assert bc.judge(bad, "error", "400 shaped seed words", {}) == "wrong-error"
    assert bc.judge(bad, "error", "400 UNSHAPED top_p words", {}) == "wrong-error"
    assert bc.judge(bad, "error", "500 shaped top_p words", {}) == "wrong-error"
    poison = bc.Req("p", "chat", {}, expect="fail")
    assert bc.judge(poison, "stream-error", "engine error: RuntimeError: planted body failure", {}) == "own-error"
    assert bc.judge(poison, "error", "500 shaped None engine error: planted body failure", {}) == "own-error"
    assert bc.judge(poison, "error", "503 shaped None server shutting down", {}) == "wrong-error"
    good = bc.Req("g", "chat", {})
    assert bc.judge(good, "ok", "x", {"g": "x"}) == "same"
    assert bc.judge(good, "ok", "y", {"g": "x"}) == "differs"
    assert bc.judge(good, "transport", "timeout", {"g": "x"}) == "lost"


def test_mixed_clients_equal_solo_with_failures_and_disconnects(bundle):
    """8 clients over 10 good requests (greedy, seeded top-p / top-k / min-p, stops,
    logprobs, n = 2, streams), 4 bad fields (400 naming the field), the planted mid-decode
    failure (500 with its words), a stream and a plain request that disconnect, and a
    200-token prompt arriving mid-run: all good answers equal solo, the rest as expected,
    nothing lost, the engine idle after."""
    engine = bc.planted_engine(bundle, max_batch=16, max_queue=64, k=256)
    srv = ThreadServer(create_app(engine, model_name=bc.MODEL)).start()
    lines = []
    try:
        counts = bc.run_load(f"http://127.0.0.1:{srv.port}", clients=8, max_tokens=4, long_tokens=200,
                             long_after_s=0.3, rounds=1, seed=1, budget_s=120, out=lines.append, pick=10)
    finally:
        assert srv.stop(30) and engine.close(10)
    assert counts["good"] == 11 and counts["same"] == 11, lines
    assert counts["failing"] == 5 and counts["own_error"] == 5, lines
    assert counts["disconnects"] == 2 and counts["disconnected"] == 2, lines
    assert counts["lost"] == 0 and counts["idle_after"]["active"] == 0 and counts["idle_after"]["waiting"] == 0
