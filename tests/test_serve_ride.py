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

import collections
import random
import statistics
import time

import pytest
import torch

from test_serve import K, Collect, bits, bundle, chat_ids, solo  # noqa: F401

from lmtail.model.llama import KVCache
from lmtail.tail.sampler import SamplingParams
from lmtail.serve import batch as batch_mod
from lmtail.serve import engine as engine_mod
from lmtail.serve.engine import Chunker, Done, Engine, Job, Prompt, Prefill, Token


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


# ---------------------------------------------------------------------------------------
# chunk sizing: the Chunker's budget, and the plain steps that keep its medians current
# ---------------------------------------------------------------------------------------
class MultiplicativeChunker:
    """PLANTED: the sizing before the cost estimate: grow by a quarter (+ 1) after a chunk
    under 3/4 of the budget, shrink in proportion after one over it (one noisy step's time
    decides the next chunk)."""

    def __init__(self, first: int = engine_mod.FIRST_CHUNK):
        self.next = first

    def note(self, size, seconds, b):
        if seconds > b:
            self.next = max(1, min(size - 1, int(size * b / seconds)))
        elif seconds < 0.75 * b:
            self.next = min(engine_mod.PREFILL_CHUNK, size + size // 4 + 1)
        else:
            self.next = size


def chunk_times(chunker, seed: int, *, budget=16e-3, noise=8e-3, positions=2048) -> list[float]:
    """A 2,048-position prompt sized by `chunker`: a chunk of c positions at position p
    truly adds c x (2.5 ms + 2 us x its mean position) (the linears plus attention over the
    keys before it); the chunker is told that plus Gaussian noise of `noise` s (one step's
    time against a median plain step on a shared box). Returns each chunk's true time over
    the budget."""
    rng, pos, out = random.Random(seed), 0, []
    while pos < positions:
        size = chunker.next
        true = size * (2.5e-3 + 2e-6 * (pos + size / 2))
        chunker.note(size, true + rng.gauss(0.0, noise), budget)
        out.append(true / budget)
        pos += size
    return out


@pytest.mark.parametrize("seed", range(5))
def test_chunker_fits_the_budget_under_noise(seed):
    """Chunks whose measured time is noisy (sd half the budget): on average they take 60%
    to 100% of the budget, and no chunk takes more than 1.6x it. Planted: the
    multiplicative sizing passes the mean but overshoots past 1.6x (1.85x-2.4x here)."""
    got = chunk_times(Chunker(), seed)
    assert 0.6 <= statistics.mean(got) <= 1.0 and max(got) <= 1.6, (statistics.mean(got), max(got))
    planted = chunk_times(MultiplicativeChunker(), seed)
    assert max(planted) > 1.6


def test_chunker_bounds():
    """1 <= next <= PREFILL_CHUNK; at most a quarter (+ 1) above the last chunk; a chunk
    that took no time (noise below a median) grows it, one over budget shrinks it."""
    c = Chunker()
    assert c.next == engine_mod.FIRST_CHUNK and c.cost is None
    c.note(2, -0.01, 0.016)
    assert c.next == 3 and c.cost == 0.0
    for _ in range(40):
        c.note(c.next, 0.0, 0.016)
    assert c.next == engine_mod.PREFILL_CHUNK
    c = Chunker(first=8)
    c.note(8, 1.0, 0.016)
    assert c.next == 1 and c.cost == 1.0 / 8


class RidesAlways(Engine):
    """PLANTED: every decode step beside a prefill carries a chunk (no plain step): the
    medians the budgets are read from stop moving while a long prompt is prefilled."""

    def _prefill_some(self):
        self._rides = 0
        return super()._prefill_some()


@pytest.mark.parametrize("cls", [Engine, RidesAlways])
def test_plain_steps_keep_the_medians_current(bundle, cls):
    """Two rows decode while a prompt rides in chunks of 3: at most RIDE_RUN steps in a
    row carry a chunk, then one plain step; those steps' body calls and periods reach the
    medians (_bodies, _periods) while the prompt is prefilled. Planted: no plain step
    (no new sample while prefilling) goes red. Bytes: as any riding schedule (above)."""
    engine = cls(bundle, max_batch=4, k=K)
    for text in ("Count to thirty.", "Name some birds."):
        engine.admit(Job(prompt_ids=chat_ids(bundle, text), params=SamplingParams(temperature=0.0), max_tokens=60,
                         sink=Collect()))
    for _ in range(3):  # plain steps: a decode period is known
        engine._note_period(time.perf_counter(), False)
        engine.step()
    pre = Prefill([long_job(bundle, Collect())])
    engine._prefills.append(pre)
    engine._bodies, engine._periods = Counting(engine._bodies), Counting(engine._periods)
    rode = []
    for _ in range(30):
        pre.chunker.next = 3
        chunked = engine._prefill_some() and engine._ride is None
        rode.append(engine._ride is not None)
        engine._note_period(time.perf_counter(), chunked or engine._rode_last)
        engine.step()
        engine._finish_ride()
    assert pre in engine._prefills  # still prefilling: every sample below came while it was
    runs = "".join("r" if r else "." for r in rode).split(".")
    if cls is Engine:
        assert max(len(r) for r in runs) == engine_mod.RIDE_RUN and rode.count(False) >= 5
        assert engine._bodies.appends >= 5 and engine._periods.appends >= 5
    else:
        # only the period of the last plain step before the prompt
        assert all(rode) and engine._bodies.appends == 0 and engine._periods.appends <= 1


class Counting(collections.deque):
    """A deque (the same maxlen) that counts its appends."""

    def __init__(self, d: collections.deque):
        super().__init__(d, maxlen=d.maxlen)
        self.appends = 0

    def append(self, x):
        self.appends += 1
        super().append(x)


# ---------------------------------------------------------------------------------------
# a long prompt's cache pages: made memory on the submitting thread, paced beside decoding rows
# ---------------------------------------------------------------------------------------
def paced_sleeps(touch, bundle, monkeypatch, idle: float) -> list[float]:
    """touch(a 600-slot row_cache, 600, idle=idle) with batch's time.sleep recorded: the
    sleeps it asked for (the cache must read 0.0 everywhere after, bit view)."""
    slept = []
    monkeypatch.setattr(batch_mod.time, "sleep", slept.append)
    c = touch(batch_mod.row_cache(bundle.config, 600), 600, idle=idle)
    monkeypatch.undo()
    assert not any(torch.any(t.view(torch.int32)) for t in c.k + c.v)
    return slept


def touch_ignoring_idle(cache, slots, *, idle=0.0):
    """PLANTED: every page made memory at once, whatever idle says."""
    return batch_mod.touch(cache, slots)


def test_touch_paces_its_page_faults(bundle, monkeypatch):
    """touch with idle > 0 sleeps after every layer (idle x that layer's time: > 0); with
    idle 0 it never sleeps; idle < 0 is a ValueError. Planted: a touch that ignores idle
    never sleeps."""
    got = paced_sleeps(batch_mod.touch, bundle, monkeypatch, 3.0)
    assert len(got) == bundle.config.n_layers and all(s > 0 for s in got)
    assert paced_sleeps(batch_mod.touch, bundle, monkeypatch, 0.0) == []
    assert paced_sleeps(touch_ignoring_idle, bundle, monkeypatch, 3.0) == []
    with pytest.raises(ValueError, match="idle must be >= 0; got -1"):
        batch_mod.touch(batch_mod.row_cache(bundle.config, 8), 8, idle=-1)


def test_submit_paces_only_long_prompts_beside_rows(bundle, monkeypatch):
    """Engine.submit_group touches a prompt's pages with idle TOUCH_IDLE only when rows
    are decoding and the prompt has more than TOUCH_PACED positions; else at once."""
    asked = []
    real = batch_mod.touch
    monkeypatch.setattr(batch_mod, "touch", lambda c, n, *, idle=0.0: asked.append((n, idle)) or real(c, n))
    engine = Engine(bundle, max_batch=4, k=K)
    long_ids = list(range(1000, 1000 + engine_mod.TOUCH_PACED + 1))
    engine.submit(Job(prompt_ids=long_ids, params=SamplingParams(temperature=0.0), max_tokens=1, sink=Collect()))
    engine.admit(Job(prompt_ids=chat_ids(bundle, "Hi."), params=SamplingParams(temperature=0.0), max_tokens=4,
                     sink=Collect()))
    assert engine._rows
    engine.submit(Job(prompt_ids=long_ids, params=SamplingParams(temperature=0.0), max_tokens=1, sink=Collect()))
    engine.submit(Job(prompt_ids=long_ids[:-1], params=SamplingParams(temperature=0.0), max_tokens=1, sink=Collect()))
    assert asked == [(len(long_ids), 0.0), (len(long_ids), engine_mod.TOUCH_IDLE), (len(long_ids) - 1, 0.0)]
    engine.close(1)


def test_chunker_prime():
    """prime(cost, b): the most positions cost fits in b (1 .. PREFILL_CHUNK); a cost <= 0
    primes nothing (FIRST_CHUNK stays)."""
    c = Chunker()
    c.prime(0.002, 0.015)
    assert c.next == 7 and c.cost == 0.002
    c.prime(1.0, 0.015)
    assert c.next == 1
    c.prime(1e-9, 0.015)
    assert c.next == engine_mod.PREFILL_CHUNK
    c = Chunker()
    c.prime(0.0, 0.015)
    c.prime(-1.0, 0.015)
    assert c.next == engine_mod.FIRST_CHUNK and c.cost is None


class Unprimed(Engine):
    """PLANTED: every group starts at FIRST_CHUNK positions, whatever was measured before."""

    def _prefill_some(self):
        self._cost = None
        return super()._prefill_some()


@pytest.mark.parametrize("cls", [Engine, Unprimed])
def test_a_new_group_starts_from_the_last_cost(bundle, cls):
    """A row decodes; a first prompt rides to its end (its Chunker measures a cost per
    position); a second prompt's first chunk is primed from that cost with the budget:
    budget / cost positions (here > FIRST_CHUNK: the budget is large), and both prompts'
    bytes are unchanged (the second equals the job alone). Planted: unprimed, the first
    chunk is FIRST_CHUNK."""
    engine = cls(bundle, max_batch=4, k=K)
    engine.admit(Job(prompt_ids=chat_ids(bundle, "Count to thirty."), params=SamplingParams(temperature=0.0),
                     max_tokens=200, sink=Collect()))
    engine._periods.extend([1.0] * 5)  # a 1 s period: a 0.5 s budget, far above a position's cost
    first_sizes = []
    for text in ("Name some birds.", "Name some trees, please."):
        s = Collect()
        pre = Prefill([Job(prompt_ids=chat_ids(bundle, text), params=SamplingParams(temperature=0.0), max_tokens=3,
                           sink=s)])
        engine._prefills.append(pre)
        first = None
        for _ in range(80):
            if pre in engine._prefills:
                engine._rides = 0
                engine._prefill_some()
                first = first or (engine._ride and engine._ride[1])
            engine.step()
            engine._finish_ride()
            if s.events and isinstance(s.events[-1], Done):
                break
        first_sizes.append(first)
        assert s.result() == solo(bundle, chat_ids(bundle, text), SamplingParams(temperature=0.0), 3)
    assert first_sizes[0] == engine_mod.FIRST_CHUNK
    if cls is Engine:
        assert first_sizes[1] > engine_mod.FIRST_CHUNK
    else:
        assert first_sizes[1] == engine_mod.FIRST_CHUNK
