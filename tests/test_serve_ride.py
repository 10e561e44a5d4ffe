"""lmtail serve: a prompt's chunks riding in the decode step's body call (serve.engine:
Prefill.ride, Engine._body, _finish_ride). The chunk's positions are rows of the step's
batch.step_rows call, each on a view of the prompt's cache at its own position; the rows
decoding and the prompt (its echo logprobs with top alternatives, then its tokens) get the
bytes they get alone, whatever the chunk sizes (1 .. 41 positions, several seeds).
Planted: views that all sit at the chunk's first position (the positions do not see each
other) differ; a step whose fused call raises fails no job and sends the group's next
chunks alone (pre.solo), still with the same bytes.

Shape legend: P prompt positions.
"""
from __future__ import annotations

import random

import pytest
import torch

from test_serve import K, Collect, bits, bundle, chat_ids, solo  # noqa: F401

from lmtail.model.llama import KVCache
from lmtail.tail.sampler import SamplingParams
from lmtail.serve import batch as batch_mod
from lmtail.serve.engine import Done, Engine, Job, Prompt, Prefill, Token


def events_bytes(sink) -> list:
    out = []
    for e in sink.events:
        if isinstance(e, Prompt):
            out.append(([bits(v) for v in e.logprobs], [[(i, bits(v)) for i, v in t] for t in e.top]))
        elif isinstance(e, Token):
            out.append((e.id, bits(e.logprob), [(i, bits(v)) for i, v in e.top or []]))
        else:
            out.append(e)
    return out


def long_job(bundle, sink) -> Job:
    text = " ".join(f"Item {i}: a line about rivers and town {i * 3}." for i in range(14))
    return Job(prompt_ids=bundle.tokenizer.encode(text), params=SamplingParams(temperature=0.8, seed=5),
               max_tokens=4, sink=sink, logprobs=2, echo_logprobs=True)


def alone(bundle) -> list:
    """The long job admitted alone (whole prompt), then stepped to its end."""
    s = Collect()
    engine = Engine(bundle, max_batch=2, k=K)
    engine.admit(long_job(bundle, s))
    for _ in range(10):
        if s.events and isinstance(s.events[-1], Done):
            break
        engine.step()
    return events_bytes(s)


class ViewsAtFirst(Prefill):
    """PLANTED: every view of a chunk at the chunk's first position."""

    def ride(self, engine, size):
        views, toks = super().ride(engine, size)
        return [KVCache(k=v.k, v=v.v, pad=v.pad, length=self.done) for v in views], toks


class FusedFails(Prefill):
    """PLANTED: the first fused call that carries this prompt raises (one of its views
    has no free slot: step_rows refuses the call before it runs)."""

    failed = False

    def ride(self, engine, size):
        views, toks = super().ride(engine, size)
        if not self.failed:
            self.failed = True
            views[-1] = KVCache(k=views[-1].k, v=views[-1].v, pad=views[-1].pad, length=self.cache.capacity)
        return views, toks


def ride_schedule(bundle, seed: int, *, engine_cls=Engine, prefill_cls=Prefill):
    """Two rows decode (a greedy one, a sampled one with logprobs); the long job's prompt
    rides in their steps in chunks of random sizes. Returns (the rows' sinks, the long
    job's sink, chunks that rode, the engine)."""
    engine = engine_cls(bundle, max_batch=4, k=K)
    engine._periods.append(1.0)  # a decode period is known: chunks may ride
    rows = [Collect(), Collect()]
    engine.admit(Job(prompt_ids=chat_ids(bundle, "Count to thirty."), params=SamplingParams(temperature=0.0),
                     max_tokens=40, sink=rows[0]))
    engine.admit(Job(prompt_ids=chat_ids(bundle, "Name some birds."), params=SamplingParams(temperature=0.9, seed=7),
                     max_tokens=40, sink=rows[1], logprobs=3))
    s = Collect()
    pre = prefill_cls([long_job(bundle, s)])
    engine._prefills.append(pre)
    rng, rode = random.Random(seed), 0
    for _ in range(60):
        if pre in engine._prefills:
            pre.chunker.next = rng.choice([1, 2, 3, 7, 16, 41])
            engine._prefill_chunk(pre, 1.0)
            rode += engine._ride is not None
        engine.step()
        engine._finish_ride()
        if not engine._rows:
            break
    return rows, s, rode, engine


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_riding_chunks_change_no_byte(bundle, seed):
    """Rows decoding beside a prompt that rides in their steps: every row's tokens and
    logprob bits equal its solo run; the prompt's echo logprobs (top-2), tokens and
    logprobs equal the same job alone; its chunks really rode (several)."""
    rows, s, rode, _ = ride_schedule(bundle, seed)
    assert rode >= 3
    assert events_bytes(s) == alone(bundle)
    assert rows[0].result() == solo(bundle, chat_ids(bundle, "Count to thirty."), SamplingParams(temperature=0.0), 40)
    assert rows[1].result() == solo(bundle, chat_ids(bundle, "Name some birds."),
                                    SamplingParams(temperature=0.9, seed=7), 40)


def test_planted_views_at_one_position_differ(bundle):
    _, s, rode, _ = ride_schedule(bundle, 0, prefill_cls=ViewsAtFirst)
    assert rode >= 3 and events_bytes(s) != alone(bundle)


def test_fused_failure_sends_the_chunks_alone(bundle):
    """The first fused call raises: the rows are rerun one by one (isolation), no job
    fails, the group's later chunks run alone (pre.solo), and every byte is unchanged."""
    rows, s, rode, engine = ride_schedule(bundle, 0, prefill_cls=FusedFails)
    assert rode == 1
    assert events_bytes(s) == alone(bundle)
    assert rows[0].result() == solo(bundle, chat_ids(bundle, "Count to thirty."), SamplingParams(temperature=0.0), 40)
    assert all(isinstance(r.events[-1], Done) for r in rows)


# ---------------------------------------------------------------------------------------
# prefix reuse: a new prompt copies the slots it shares with a recent one
# ---------------------------------------------------------------------------------------
class ShiftedCopy(Engine):
    """PLANTED: the kept prefix caches hold each slot's key / value one slot early (a copy
    off by one position)."""

    def _join(self, pre):
        super()._join(pre)
        key, cache = self._prefixes.pop()
        bad = batch_mod.copy_cache(self.bundle.config, cache)
        for k, v in zip(bad.k, bad.v):
            k[..., :-1] = k[..., 1:].clone()
            v[:, :, :-1] = v[:, :, 1:].clone()
        self._prefixes.append((key, bad))


def run_alone(engine, bundle, text: str, params, n: int, logprobs=None):
    s = Collect()
    engine.admit(Job(prompt_ids=chat_ids(bundle, text), params=params, max_tokens=n, sink=s, logprobs=logprobs))
    for _ in range(n):
        if s.events and not isinstance(s.events[-1], (Token, Prompt)):
            break
        engine.step()
    assert isinstance(s.events[-1], Done), s.events[-1]
    return events_bytes(s)


@pytest.mark.parametrize("cls", [Engine, ShiftedCopy])
def test_prefix_reuse_changes_no_byte(bundle, cls):
    """Chat prompts share the template's system prefix: the second and third requests
    copy it (and more) from the first's cache; their tokens, logprobs and top-3 equal the
    same requests on an engine without prefixes (prefixes=0). Planted: a prefix copied
    one slot off differs."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, seed=4),
              SamplingParams(temperature=0.7, seed=5)]
    texts = ["Why is the sky blue?", "Why is the sea blue?", "Why is the sky blue? Explain."]
    plain = Engine(bundle, max_batch=2, k=K, prefixes=0)
    want = [run_alone(plain, bundle, t, p, 6, 3) for t, p in zip(texts, params)]
    engine = cls(bundle, max_batch=2, k=K)
    reused = []
    got = []
    for t, p in zip(texts, params):
        got.append(run_alone(engine, bundle, t, p, 6, 3))
        reused.append(len(engine._prefixes))
    assert not plain._prefixes and reused == [1, 2, 3]
    if cls is Engine:
        assert got == want
    else:
        assert got[0] == want[0] and got[1:] != want[1:]


def test_prefix_reuse_copies_what_is_shared(bundle):
    """Prefill.alloc copies min(common prefix, P - 1) positions (at least REUSE_MIN), none
    for echo jobs; the cache's slots up to there equal the source's bit for bit."""
    engine = Engine(bundle, max_batch=2, k=K)
    run_alone(engine, bundle, "Why is the sky blue?", SamplingParams(temperature=0.0), 2)
    a = chat_ids(bundle, "Why is the sky blue?")
    same = Prefill([Job(prompt_ids=a, params=SamplingParams(), max_tokens=1, sink=Collect())])
    same.alloc(engine)
    assert same.reused == len(a) - 1 and same.done == same.cache.length == len(a) - 1
    src = engine._prefixes[-1][1]
    m = same.reused
    assert all(torch.equal(x[..., :m], y[..., :m]) for x, y in zip(same.cache.k, src.k))
    b = chat_ids(bundle, "Name a bird.")
    other = Prefill([Job(prompt_ids=b, params=SamplingParams(), max_tokens=1, sink=Collect())])
    other.alloc(engine)
    common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert other.reused == common >= 8
    echo = Prefill([Job(prompt_ids=a, params=SamplingParams(), max_tokens=1, sink=Collect(), logprobs=1,
                        echo_logprobs=True)])
    echo.alloc(engine)
    assert echo.reused == 0 and echo.done == 0
