"""The continuous-batching engine: one thread owns the model and runs the decode loop;
requests join the running batch after their own prefill and leave when done.

    submit(Job) / submit_group([Job] sharing one prompt: a request's n choices)
      --queue (bounded: QueueFull past max_batch + max_queue jobs)--> engine thread:
      loop (bounded by nothing but close()):
        start: the waiting groups, in order, while the batch has room for all their rows
               (active rows + rows being prefilled <= max_batch): each has ONE one-row
               cache for its prompt (shared by its jobs: prefilled once; made by submit
               on the caller's thread, sized for prompt + max_tokens: it never grows;
               a prefix shared with a recent prompt is copied, not prefilled)
        chunk: while rows decode, the prefilling group with the fewest positions left
               has one chunk of its prompt ride in the next step's body call (its
               positions as extra step_rows rows on views of its cache; echo jobs also
               get those positions' teacher-forced logprobs), sized by its Chunker to
               add about prefill_share x the median decode period (the time a stream
               waits between tokens), so a long prompt does not stall the streams
               beside it; after RIDE_RUN such steps one step is plain (the medians
               stay current); with no row decoding, every prefilling group runs a
               PREFILL_CHUNK-position llama.forward chunk.
               A group whose prompt is done joins the batch, its cache copied for each
               job after the first (the same bytes: attention reads only filled slots)
        step:  one decode_tail over the active rows' hidden states (row-invariant), each
               row's u drawn from its own seed at its own position; tokens appended,
               finished rows leave; then batch.step_rows (per-row caches) for the rest
               (ranks = N > 1: that decode_tail runs vocab-parallel over N spawned gloo
               ranks, serve/ranks.py, with the same bytes; the body stays here)

A row's tokens and logprobs are therefore the bytes of the same request served alone,
whatever joins, leaves or fails around it (tests/test_serve.py: bit for bit, with joins
and leaves, against llama.forward + decode_tail on one row; failures: isolation below),
and however its prompt was cut into chunks (the body is cache-invariant: a position's
bytes do not depend on how the positions before it were split into forward calls,
model.body.attend's declared order; tests/test_serve_n.py: chunked == one-shot prefill
then decode, bit for bit). Events go to the job's `sink`
(called on the engine thread; the HTTP layer hands them to its event loop):
Prompt (echo logprobs), Token (one generated token, its text delta), Done, Failed.

Isolation: whatever fails for one row fails that row alone. A step whose batched tail
or body call raises is rerun row by row (both are row-invariant, so a row's bytes alone
are its bytes in the batch); the rows that raise alone get Failed (status 500, the
error's words) and leave, the others go on unchanged. A cache whose body call raised is
set back to its length before the call (its slot is written again next time). Admission
(prefill) failures fail their own job only. tests/test_serve_hardening.py plants a row
that raises in the tail and one that raises in the body: batchmates equal their solo runs.

Capacity: at most max_batch + max_queue jobs in flight (waiting, being prefilled or
decoding); submit() beyond is QueueFull (HTTP 429). The batch never holds more than
max_batch rows: a group starts its prefill only when its rows fit beside the active
rows and the groups already prefilling.

Processors: a job's `processors` (logit_bias, presence / frequency / repetition
penalties) become its row's processors.LogitProcessing at every step, from its prompt and
the counts of the tokens IT generated (Row.counts), handed to decode_tail's seam (on
every rank with ranks = N); rows without them pass None, so their bytes are unchanged.
Grammars: a job's `grammar` (serve.grammar.GrammarState, a response_format JSON mode)
gives its row's allowed-token mask each step (LogitProcessing(allowed=...) at the tail's
logits-processor seam: the other lanes -inf) and is advanced with the sampled token;
rows without one pass None, so their bytes are unchanged.

Seeds: every job carries one (the HTTP layer picks one from os.urandom for a request
without): the draw for the token at position p is numerics.draw_u(seed, p), p =
len(prompt) + tokens generated so far, as in lmtail generate.

Shape legend: R active rows, H hidden, V vocab, k candidates, P prompt positions.
"""
from __future__ import annotations

import collections
import gc
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..model.gguf_loader import ModelBundle
from ..kernels.model.step import StepBuffers, StepShape
from ..model.generate import default_head_input, default_ops, head_weight, step_config, step_head
from ..model.llama import Q32_BODY, KVCache, Ops, forward
from ..tail.processors import Processors
from ..tail.sampler import SamplingParams, greedy_rows, sampling_tensor
from ..tail.config import TailConfig
from ..tail.compose import decode_tail
from . import batch
from .grammar import advance_row, with_masks

PREFILL_CHUNK = 256  # prompt positions per forward call at most (cache-invariant: no byte depends on it)
PREFILL_SHARE = 0.5  # a prefill chunk beside decoding rows adds about this share of a decode period
PERIODS = 5  # decode periods (and plain body calls) kept: their medians size the prefill chunks
TOUCH_IDLE = 3.0  # submit: a long prompt's cache pages are made memory at 1 / (1 + this) of a core
TOUCH_PACED = 512  # ... when it has more positions than this and rows are decoding
FIRST_CHUNK = 2  # a group's first chunk beside decoding rows (then Chunker adapts it)
COST_GAIN = 0.1  # Chunker: the weight of the last chunk in its cost per position
RIDE_RUN = 4  # decode steps in a row that carry a chunk; the next one is plain (fresh medians)
SCORE_ROWS = 64  # positions per teacher-forced tail call
PREFIXES = 4  # recent prompts whose caches a new prompt may copy its common prefix from
PREFIX_MAX = 2048  # a prompt longer than this is not kept as a prefix (it would hold its memory)
REUSE_MIN = 8  # a common prefix shorter than this is prefilled anyway
_log = logging.getLogger("uvicorn.error")  # the server's log (a plain logger when run without uvicorn)


class QueueFull(RuntimeError):
    """submit() found max_queue jobs already waiting."""


class Closed(RuntimeError):
    """submit() after close()."""


# ---------------------------------------------------------------------------------------
# jobs and events
# ---------------------------------------------------------------------------------------
@dataclass
class Job:
    """One request as the engine sees it (validated by the HTTP layer).

    prompt_ids: the prompt's token ids (>= 1); params: SamplingParams with `seed` set;
    max_tokens >= 0 (0: only the echo logprobs); stop: strings that end the text (not
    included); logprobs: None (none) or n >= 0 alternatives per token; echo_logprobs:
    report the prompt's teacher-forced logprobs; processors: the request's logit_bias and
    penalties (None: none), applied at the tail's logits-processor seam each step from its
    prompt and its own generated tokens; sink(event) on the engine thread; grammar: a
    serve.grammar.GrammarState (response_format JSON modes) or None: each step masks the
    row's logits to the tokens it allows and advances it with the token."""

    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    sink: Callable
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    echo_logprobs: bool = False
    processors: Processors | None = None
    grammar: object = None  # serve.grammar.GrammarState | None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.monotonic)
    cache: KVCache | None = field(default=None, repr=False)  # its group's prompt cache (submit_group makes it)

    def cancel(self) -> None:
        """Ask the engine to drop this job at its next step (frees its slot)."""
        self.cancelled.set()


@dataclass(frozen=True)
class Prompt:
    """Teacher-forced logprobs of prompt tokens 1..P-1 (token 0 has none)."""

    logprobs: list[float]  # [P - 1] fp32 values
    top: list[list[tuple[int, float]]] | None  # [P - 1] x n (id, logprob), with logprobs=n


@dataclass(frozen=True)
class Token:
    """One generated token: id, its logprob (fp32 value), top alternatives, and the text
    that became visible with it (may be "": held back for a stop string or a partial
    UTF-8 character)."""

    id: int
    logprob: float
    top: list[tuple[int, float]] | None
    text: str
    special: bool  # a stop token (end of turn / text): no text of its own


@dataclass(frozen=True)
class Done:
    """The job finished: finish_reason "stop" (a stop token or string) or "length"."""

    finish_reason: str
    completion_tokens: int
    text: str  # the full completion text (stop string excluded)


@dataclass(frozen=True)
class Failed:
    """The job was dropped: cancelled (status 499), engine closed (503), or an error of
    its own (500); message: the words the client gets."""

    message: str
    status: int = 500


# ---------------------------------------------------------------------------------------
# logprobs of other tokens (the sampler's declared numerics)
# ---------------------------------------------------------------------------------------
def values_logprobs(values: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """fp32(v - lse1) for values [R, n] (bf16 mirror or fp32 candidates, widened exactly)
    and lse [R] float64 (decode_tail's TailOutput.lse): the sampler's logprob of a token
    whose value is v. Returns [R, n] fp32."""
    return (values.double() - lse[:, None]).to(torch.float32)


# ---------------------------------------------------------------------------------------
# text: incremental decode with stop strings
# ---------------------------------------------------------------------------------------
class TextTracker:
    """The visible completion text of a growing id list: special ids contribute no text;
    text is held back while it ends in a partial UTF-8 character (U+FFFD) or in a prefix
    of a stop string; a stop string ends the text before it."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.tok, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = ""

    def feed(self, token_id: int) -> tuple[str, bool]:
        """(new visible text, stop string hit) after appending token_id."""
        self.ids.append(token_id)
        text = self.tok.decode(self.ids)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                return self._advance(text[:at]), True
        hold = 1 if text.endswith("\ufffd") else 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        return self._advance(text[:len(text) - hold]), False

    def flush(self) -> str:
        """The rest of the text (at the end of a job that did not hit a stop string)."""
        return self._advance(self.tok.decode(self.ids))

    def _advance(self, visible: str) -> str:
        if len(visible) <= len(self.sent) or not visible.startswith(self.sent):
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta


# ---------------------------------------------------------------------------------------
# one active row
# ---------------------------------------------------------------------------------------
@dataclass
class Row:
    """An active request: its one-row cache (grown as needed), the hidden state the next
    tail step reads, its text so far, and how many tokens it has generated."""

    job: Job
    cache: KVCache
    x: torch.Tensor  # [H] fp32: the hidden state the next tail step reads
    text: TextTracker
    generated: int = 0
    counts: dict = field(default_factory=dict)  # {token id: times generated} (the penalties' counts)
    _prompt: tuple | None = field(default=None, repr=False)

    def processing(self):
        """This step's processors.LogitProcessing of the row, or None."""
        q = self.job.processors
        if q is None:
            return None
        if self._prompt is None:  # once: the prompt as the tuple every step's LogitProcessing shares
            self._prompt = tuple(self.job.prompt_ids)
        return q.at(self._prompt, self.counts)

    @property
    def position(self) -> int:
        """The position of the token the next step emits."""
        return len(self.job.prompt_ids) + self.generated


class Engine:
    """Owns `bundle` on one thread (start()); submit() jobs from any thread.

    max_batch: active rows at most; max_queue: jobs in flight beyond max_batch at most
    (QueueFull past max_batch + max_queue jobs waiting, prefilling or decoding);
    k: the tail's candidate count (top_k must be <= k; the same k for every request, so a
    request's bytes never depend on its neighbours' top_k); body: "batched"
    (batch.step_rows, the default) or "rows" (llama.forward per row: the reference);
    ops: the body, q32 or declared (None: generate.default_ops(), the q32 body: the file's
    own blocks on an fp32 stream); exchange, head_input: the tail's (config.EXCHANGES,
    config.TAIL_HEAD_INPUTS; exchange None: TailConfig's, head_input None:
    generate.default_head_input(ops), "fp32" = the file's Q8_0 head for q32); ranks: N > 1 runs the
    sampling step's tail vocab-parallel over N gloo ranks (serve.ranks.RankTail, spawned
    here, stopped by close(); N must divide V, and 256 with exchange "candidates"), with
    every token and logprob bit of ranks = 1; top logprobs, echo scoring and the prompt's
    logprobs stay on this process's full head (the same bytes); rank_timeout_s bounds the
    ranks' start and each of their collectives. prefill_share: a prefill chunk beside
    decoding rows takes about this share of the median decode period (Chunker; no byte
    depends on it)."""

    def __init__(self, bundle: ModelBundle, *, max_batch: int = 16, max_queue: int = 64, k: int = 256,
                 body: str = "batched", ops: Ops | None = None, exchange: str = TailConfig.exchange,
                 head_input: str | None = None, ranks: int = 1, rank_timeout_s: float = 120.0,
                 prefill_share: float = PREFILL_SHARE, prefixes: int = PREFIXES):
        if max_batch < 1 or max_queue < 0:
            raise ValueError(f"max_batch must be >= 1 and max_queue >= 0; got {max_batch}, {max_queue}")
        if body not in ("batched", "rows"):
            raise ValueError(f"body must be 'batched' or 'rows'; got {body!r}")
        if not 1 <= k <= bundle.config.vocab:
            raise ValueError(f"k must be in [1, {bundle.config.vocab}]; got {k}")
        self.ops = default_ops() if ops is None else ops
        if self.ops.body not in batch.ROWS_BODIES:
            raise ValueError(f"ops.body must be one of {batch.ROWS_BODIES}; got {self.ops.body!r}")
        head_input = default_head_input(self.ops) if head_input is None else head_input
        # the tail's options, built (and checked) once: every step, rank and score call passes it
        self.tail_config = step_config(bundle, k=k, exchange=exchange, head_input=head_input)
        self.bundle, self.max_batch, self.max_queue, self.k, self.body = bundle, max_batch, max_queue, k, body
        self.head = step_head(head_weight(bundle, head_input), True)  # the full head, its fastest layout
        self._scratch = None  # the q32 native rows step's buffers (kernels.model.step.StepBuffers), kept across steps
        if not isinstance(ranks, int) or ranks < 1 or bundle.config.vocab % ranks:
            raise ValueError(f"ranks must be an int >= 1 dividing the vocab {bundle.config.vocab}; got {ranks!r}")
        self.ranks = ranks
        self._ranks = None  # serve.ranks.RankTail with ranks > 1 (the sampling step's tail)
        if ranks > 1:
            from .ranks import RankTail

            self._ranks = RankTail(bundle, ranks, config=self.tail_config, timeout_s=rank_timeout_s)
        if not 0 < prefill_share <= 4:
            raise ValueError(f"prefill_share must be in (0, 4]; got {prefill_share!r}")
        self.prefill_share = prefill_share
        if not isinstance(prefixes, int) or prefixes < 0:
            raise ValueError(f"prefixes must be an int >= 0; got {prefixes!r}")
        # (prompt ids, its cache) of recent prompts (engine thread only): slots [0, P) of a
        # cache never change after its prefill (rows only append), so a new prompt may copy
        # the slots of its longest common prefix instead of prefilling them (Prefill.alloc)
        self._prefixes: collections.deque[tuple[tuple[int, ...], KVCache]] = collections.deque(maxlen=prefixes)
        self._pending: collections.deque[list[Job]] = collections.deque()  # groups waiting
        self._rows: list[Row] = []
        self._prefills: list[Prefill] = []  # groups being prefilled (oldest first)
        self._periods: collections.deque[float] = collections.deque(maxlen=PERIODS)  # see _note_period
        self._last_step: float | None = None  # perf_counter() at the last decode step's start
        self._bodies: collections.deque[float] = collections.deque(maxlen=PERIODS)  # plain body calls (s)
        self._ride: tuple[Prefill, int] | None = None  # a chunk to run inside the next body call
        self._rode: tuple | None = None  # (Prefill, h [c, H], t1, seconds over a plain body call) of the last
        self._rode_last = False  # the last decode step carried a chunk (its period is not a plain one)
        self._rides = 0  # decode steps in a row with a chunk (riding or alone); RIDE_RUN: the next is plain
        self._cost: float | None = None  # the last chunk's Chunker.cost (s per position): primes a new group's
        self._cv = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None
        self.steps = 0  # decode steps run (a counter for /health and the tests)
        self.max_rows_seen = 0

    # ---- the public side ----------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> "Engine":
        """Start the engine thread (once). The objects alive now (the model, the tokenizer,
        the imported modules) are collected once and then frozen (gc.freeze: the process's
        collector never scans them again), so a full collection while serving walks only
        what serving made: a few ms, not the ~100 ms pause, holding the GIL, of one over
        every object here."""
        if self._thread is not None:
            raise RuntimeError("the engine is already started")
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name="lmtail-engine", daemon=True)
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        """Queue a job (Closed after close(); QueueFull when max_batch + max_queue jobs are
        in flight: waiting, being prefilled or decoding)."""
        self.submit_group([job])

    def submit_group(self, jobs: list[Job]) -> None:
        """Queue jobs that share one prompt (a request's n choices): prefilled once, they
        join the batch together. ValueError for 0 or more than max_batch jobs or jobs
        whose prompt_ids / echo differ; Closed, QueueFull (counting every job) as submit."""
        _check_group(jobs, self.max_batch)
        cfg = self.bundle.config
        if jobs[0].cache is None and len(jobs[0].prompt_ids) < cfg.context_length:  # else the prefill fails it
            # the group's cache, its prompt's pages made memory here (the caller's thread), not on the engine's
            # a long prompt beside decoding rows: its faults paced (TOUCH_IDLE), so the rows' steps keep both cores
            n = len(jobs[0].prompt_ids)
            idle = TOUCH_IDLE if self._rows and n > TOUCH_PACED else 0.0
            jobs[0].cache = batch.touch(batch.row_cache(cfg, _capacity(cfg, jobs)), n, idle=idle)
        with self._cv:
            if self._closing:
                raise Closed("the engine is shutting down")
            n = self._in_flight()
            if n + len(jobs) > self.max_batch + self.max_queue:
                raise QueueFull(f"{n} requests are already in flight (at most {self.max_batch} decoding + "
                                f"{self.max_queue} waiting)" + (f"; {len(jobs)} more asked" if len(jobs) > 1 else ""))
            self._pending.append(list(jobs))
            self._cv.notify()

    def _waiting(self) -> int:
        """Jobs queued or being prefilled (under _cv)."""
        return sum(len(g) for g in self._pending) + sum(len(p.jobs) for p in self._prefills)

    def _in_flight(self) -> int:
        return self._waiting() + len(self._rows)

    def load(self) -> dict:
        """{"active": rows decoding, "waiting": jobs queued or being prefilled, "steps":
        decode steps so far}."""
        with self._cv:
            return {"active": len(self._rows), "waiting": self._waiting(), "steps": self.steps}

    def close(self, timeout: float = 10.0) -> bool:
        """Stop: waiting and active jobs get Failed("server shutting down", 503) (from the
        engine thread, or here when that thread is not running); the thread is joined for
        at most `timeout` s. True when it ended."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        t_end = time.monotonic() + timeout
        ended = True
        if self._thread is not None:
            self._thread.join(timeout)
            ended = not self._thread.is_alive()
        if ended:  # the thread never ran, or ended before it saw _closing: no job may wait forever
            with self._cv:
                left = self._drop_all()
            for job in left:
                _emit(job, Failed("server shutting down", 503))
        if self._ranks is not None:  # after the thread: no step is using them any more (when it ended)
            ended = self._ranks.close(max(1.0, t_end - time.monotonic())) and ended
        return ended

    def rank_pids(self) -> list[int]:
        """The pids of this engine's rank processes still running ([] with ranks = 1)."""
        return [] if self._ranks is None else self._ranks.alive()

    # ---- the engine thread ----------------------------------------------------------------
    def _drop_all(self) -> list[Job]:
        """Empty the queue, the prefills and the batch (under _cv); returns their jobs."""
        left = [j for g in self._pending for j in g] + [j for p in self._prefills for j in p.jobs] \
            + [r.job for r in self._rows]
        self._pending.clear()
        self._prefills = []
        self._rows = []
        return left

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._pending or self._prefills or self._rows or self._closing):
                    self._cv.wait()
                if self._closing:
                    dropped = self._drop_all()
                    break
                groups = []
                while self._pending and len(self._pending[0]) <= self.room() - sum(len(g) for g in groups):
                    groups.append(self._pending.popleft())
                self._prefills += [Prefill(g) for g in groups]  # caches allocated at their first chunk
            chunked = self._prefill_some() and self._ride is None  # a chunk ran alone just now
            if self._rows:
                self._note_period(time.perf_counter(), chunked or self._rode_last)
                try:
                    self.step()
                except Exception as e:  # a bug outside the per-row guards: fail the rows, keep serving
                    rows, self._rows = self._rows, []
                    for r in rows:
                        _emit(r.job, _failure(e))
                self._finish_ride()
            else:
                self._last_step = None  # no stream waits: the next period starts afresh
        for job in dropped:
            _emit(job, Failed("server shutting down", 503))

    def room(self) -> int:
        """Rows that may start their prefill now: max_batch - active rows - rows being
        prefilled (each joins the batch when its prompt is done)."""
        return self.max_batch - len(self._rows) - sum(len(p.jobs) for p in self._prefills)

    def admit(self, job: Job) -> None:
        """Prefill job alone (whole, in PREFILL_CHUNK chunks); emit its echo logprobs; join
        the batch (or finish). Public so tests can drive a schedule without the thread
        (which runs the same Prefill chunk by chunk, interleaved with decode steps)."""
        self.admit_group([job])

    def admit_group(self, jobs: list[Job], chunk: int = PREFILL_CHUNK) -> None:
        """admit for a group sharing one prompt (submit_group's rule), in chunks of at
        most `chunk` positions: one prefill, then every job joins."""
        _check_group(jobs, len(jobs))
        pre = Prefill(list(jobs))
        while not self._advance_prefill(pre, chunk):
            pass

    def _prefill_some(self) -> bool:
        """The engine thread's prefill move. No row decoding: one PREFILL_CHUNK chunk of
        every prefilling group (oldest first). Rows decoding (and a decode period
        measured): one chunk of the group with the fewest positions left (ties: the
        oldest), sized to take prefill_share x the median decode period (Chunker), except
        after RIDE_RUN such steps in a row: then none, so the next step is plain (its body
        call and period keep the medians the budgets are read from current). True when a
        chunk ran beside decoding rows."""
        if not self._prefills or (self._rows and not self._periods):
            self._rides = 0
            return False
        if not self._rows:
            for pre in list(self._prefills):
                self._prefill_chunk(pre, None)
            self._rides = 0
            return False
        if self._rides >= RIDE_RUN:
            self._rides = 0
            return False
        self._rides += 1
        pre = min(self._prefills, key=lambda p: p.left())  # min keeps the first of equals
        budget = self.prefill_share * statistics.median(self._periods)
        if pre.chunker.cost is None and self._cost is not None:  # its first chunk: the last group's cost
            pre.chunker.prime(self._cost, budget)
        self._prefill_chunk(pre, budget)
        return True

    def _note_period(self, now: float, chunked: bool) -> None:
        """A decode step starts at `now`: the time since the last one is a decode period
        (what a stream sees between tokens) when no prefill chunk ran between them or
        inside the last step (`chunked`); the last PERIODS of those are kept."""
        if self._last_step is not None and not chunked:
            self._periods.append(now - self._last_step)
        self._last_step = now

    def _prefill_chunk(self, pre: "Prefill", budget: float | None) -> None:
        """One chunk of prefilling group `pre` (sized by its Chunker for `budget` seconds;
        None: PREFILL_CHUNK); a group that finishes or fails leaves _prefills. With a
        budget (rows decoding) and the batched body, the chunk rides in the next decode
        step's body call (_body: one weight pass for the rows and the chunk's positions;
        no byte changes, Prefill.ride) unless the group runs alone (pre.solo) or all its
        jobs are cancelled; the budget is then the time the chunk adds to that call."""
        size = PREFILL_CHUNK if budget is None else pre.chunker.next
        if budget is not None and self.body == "batched" and not pre.solo \
                and not all(j.cancelled.is_set() for j in pre.jobs):
            self._ride = (pre, size)
            return
        t0 = time.perf_counter()
        finished = self._advance_prefill(pre, size)
        if budget is not None:
            pre.chunker.note(size, time.perf_counter() - t0, budget)
            self._cost = pre.chunker.cost
        if finished:
            with self._cv:
                self._prefills.remove(pre)

    def _finish_ride(self) -> None:
        """After a step: the chunk that rode in its body call (if any) is taken by its
        group (echo logprobs; the group joins when its prompt is done, failing its jobs on
        an error) and its Chunker told the time it added; a planned ride that found no
        body call (every row left at the tail) is dropped (planned again next loop)."""
        rode, self._rode, self._ride = self._rode, None, None
        self._rode_last = rode is not None
        if rode is None:
            return
        pre, h, t1, extra = rode
        pre.chunker.note(h.shape[0], extra, self.prefill_share * statistics.median(self._periods))
        self._cost = pre.chunker.cost
        finished = True
        try:
            if pre.took(self, h, t1):
                self._join(pre)
            else:
                finished = False
        except Exception as e:
            for j in pre.jobs:
                _emit(j, _failure(e))
        if finished:
            with self._cv:
                self._prefills.remove(pre)

    def _advance_prefill(self, pre: "Prefill", size: int) -> bool:
        """Prefill the next `size` prompt positions of `pre` (failing its jobs on an error,
        dropping it when every job is cancelled); when the prompt is done its jobs join.
        True when pre is finished (joined, failed or dropped)."""
        if all(j.cancelled.is_set() for j in pre.jobs):
            for j in pre.jobs:
                _emit(j, Failed("cancelled", 499))
            return True
        try:
            if pre.step(self, size):
                self._join(pre)
                return True
        except Exception as e:
            for j in pre.jobs:
                _emit(j, _failure(e))
            return True
        return False

    def _join(self, pre: "Prefill") -> None:
        """A prefilled group's jobs: echo logprobs, then each joins the batch on its own
        copy of the prompt's cache (the first job on the cache itself), or finishes
        (max_tokens 0)."""
        rows = []
        if self._prefixes.maxlen and pre.ids.shape[1] <= PREFIX_MAX:  # its slots [0, P) are final now
            key = tuple(pre.jobs[0].prompt_ids)
            kept = [e for e in self._prefixes if e[0] != key]
            self._prefixes.clear()
            self._prefixes.extend(kept + [(key, pre.cache)])
        prompt = pre.prompt()
        for i, job in enumerate(pre.jobs):
            if prompt is not None:
                _emit(job, prompt)
            if job.max_tokens == 0:
                _emit(job, Done("length", 0, ""))
                continue
            cache = pre.cache if i == 0 else batch.copy_cache(self.bundle.config, pre.cache)
            rows.append(Row(job=job, cache=cache, x=pre.x.clone(), text=TextTracker(self.bundle.tokenizer, job.stop)))
        with self._cv:
            self._rows += rows
            self.max_rows_seen = max(self.max_rows_seen, len(self._rows))

    def step(self) -> None:
        """One tail step over the active rows, then one body step for those still active
        (the engine thread's second move). A row that fails fails alone (module docstring)."""
        rows = [r for r in self._rows if not r.job.cancelled.is_set()]
        for r in self._rows:
            if r.job.cancelled.is_set():
                _emit(r.job, Failed("cancelled", 499))
        if not rows:
            with self._cv:
                self._rows = []
            return
        sampled = self._isolated(rows, self._sample)
        keep = []
        for r, (tid, lp, top) in sampled:
            try:
                advance_row(r.job.grammar, tid)
                if self._emit_token(r, tid, lp, top):
                    keep.append((r, tid))
            except Exception as e:
                _emit(r.job, _failure(e))
        self.steps += 1
        kept = [r for r, _ in keep]
        if keep:
            tokens = dict((id(r), t) for r, t in keep)
            kept = [r for r, _ in self._isolated(kept, lambda rs: self._advance(rs, [tokens[id(r)] for r in rs]))]
        with self._cv:
            self._rows = kept

    def _isolated(self, rows: list[Row], fn) -> list[tuple[Row, object]]:
        """fn(rows) -> one result per row, as [(row, result)]; when the batched call raises,
        fn([row]) for each row alone: a row that raises alone gets Failed (500) and is left
        out, the others keep their results (fn is row-invariant: the same bytes)."""
        if not rows:
            return []
        try:
            return list(zip(rows, fn(rows)))
        except Exception as e:
            if len(rows) == 1:
                _emit(rows[0].job, _failure(e))
                return []
            _log.warning("lmtail engine: a %d-row step raised %s: %s; rerunning its rows one by one",
                         len(rows), type(e).__name__, e)
        out = []
        for r in rows:
            try:
                out.append((r, fn([r])[0]))
            except Exception as e:
                _emit(r.job, _failure(e))
        return out

    def _sample(self, rows: list[Row]) -> list[tuple[int, float, list | None]]:
        """The tail step over rows: per row (token id, logprob, top alternatives or None)."""
        x = torch.stack([r.x for r in rows])  # [R, H]
        sp = self.step_params(rows)  # [R, 5]
        want = [r.job.logprobs is not None and r.job.logprobs > 0 for r in rows]
        proc = with_masks([r.processing() for r in rows], [r.job.grammar for r in rows])
        if proc is None or all(p is None for p in proc):  # no row has processors: the plain call
            out, top_out, lse = self._tail(x, sp, want)
        else:
            out, top_out, lse = self._tail(x, sp, want, proc)
        res, w = [], 0
        for i, r in enumerate(rows):
            top = None
            if want[i]:
                n = r.job.logprobs
                vals = values_logprobs(top_out.topk_values[w:w + 1, :n], lse[w:w + 1])[0]  # [n]
                top = list(zip(top_out.topk_indices[w, :n].tolist(), vals.tolist()))
                if r.job.grammar is not None:  # the lanes its grammar masked (-inf) are no alternatives
                    top = [(i, v) for i, v in top if v != float("-inf")]
                w += 1
            res.append((int(out.tokens[i]), float(out.logprobs[i]), top))
        return res

    def _emit_token(self, r: Row, tid: int, lp: float, top) -> bool:
        """Row r's token event (and Done when it finishes); True when it goes on."""
        r.generated += 1
        r.counts[tid] = r.counts.get(tid, 0) + 1
        special = tid in self.bundle.tokenizer.stop_ids
        delta, hit = ("", False) if special else r.text.feed(tid)
        finish = "stop" if special or hit else ("length" if r.generated >= r.job.max_tokens else None)
        if finish is not None and not hit:
            delta += r.text.flush()
        _emit(r.job, Token(tid, lp, top, delta, special))
        if finish is not None:
            _emit(r.job, Done(finish, r.generated, r.text.sent))
            return False
        return True

    def _advance(self, rows: list[Row], tokens: list[int]) -> list[None]:
        """The body step for rows fed `tokens`; on an error every cache is set back to its
        length before the call (then re-raised)."""
        lengths = [r.cache.length for r in rows]
        try:
            self._body(rows, torch.tensor(tokens, dtype=torch.int64))
        except Exception:
            for r, n in zip(rows, lengths):
                r.cache.length = n
            raise
        return [None] * len(rows)

    def _tail(self, x: torch.Tensor, sp: torch.Tensor, want: list[bool], processing=None):
        """The sampling step's tail over x [R, H], sp [R, 5] (processing: None or R entries
        of processors.LogitProcessing | None, decode_tail's): (out with tokens / logprobs
        [R], top_out with topk_values / topk_indices of the `want` rows in order (or None),
        their lse1 [R_want] float64 (or None)).

        ranks = 1: one decode_tail call over all rows (self.tail_config; lse1 is its
        TailOutput.lse). ranks > 1: tokens and logprobs from the ranks (RankTail.tail: the
        single-rank bytes); the want rows' top alternatives and lse1 from a local full-head
        decode_tail over those rows only (row-invariant: the same bytes as inside the
        all-row call), whose tokens must equal the ranks' (checked: RuntimeError otherwise)."""
        mask = torch.tensor(want, dtype=torch.bool)  # [R]
        if self._ranks is None:
            out = decode_tail(x, self.bundle.final_norm, self.head, config=self.tail_config, sampling_params=sp,
                              processing=processing)
            if not any(want):
                return out, None, None
            return out, _Top(out.topk_values[mask], out.topk_indices[mask]), out.lse[mask]  # lse [R_want]
        out = self._ranks.tail(x, sp) if processing is None else self._ranks.tail(x, sp, processing)
        if not any(want):
            return out, None, None
        loc = decode_tail(x[mask].contiguous(), self.bundle.final_norm, self.head, config=self.tail_config,
                          sampling_params=sp[mask].contiguous(),
                          processing=None if processing is None else [p for p, w in zip(processing, want) if w])
        if not torch.equal(loc.tokens, out.tokens[mask]):
            raise RuntimeError("the ranks' tokens differ from the local tail's on the same rows (a bug)")
        return out, _Top(loc.topk_values, loc.topk_indices), loc.lse

    def step_params(self, rows: list[Row]) -> torch.Tensor:
        """[R, 5] fp32 sampling rows: each row's params, u drawn at ITS OWN position."""
        return sampling_tensor([r.job.params for r in rows], positions=[r.position for r in rows])

    def _grow(self, rows: list[Row]) -> None:
        """Each row's cache has a free slot for this step: it does (Prefill.alloc sizes a
        group's caches for prompt + max_tokens), so batch.grow copies nothing here; it is
        kept as the rule's guard."""
        cfg = self.bundle.config
        for r in rows:
            r.cache = batch.grow(cfg, r.cache, r.cache.length + 1)

    def _body(self, rows: list[Row], tokens: torch.Tensor) -> None:
        """Feed each row's new token through the body; row.x becomes its next hidden state.
        A chunk planned to ride (_ride, taken by the first call of the step only) joins the
        batched call as rows after these (Prefill.ride); its hidden states and the time it
        added over the median plain call go to _rode for _finish_ride. When that call
        raises, the group is marked to run alone (its cache's length never moved)."""
        self._grow(rows)
        ride, self._ride = self._ride, None
        if self.body == "batched":
            if self._scratch is None and self.ops.body == Q32_BODY:
                c = self.bundle.config
                self._scratch = StepBuffers(StepShape(L=c.n_layers, H=c.hidden, nh=c.n_heads, nkv=c.n_kv_heads, F=c.ffn))
            caches, views = [r.cache for r in rows], []
            if ride is not None:
                views, ptoks = ride[0].ride(self, ride[1])
                tokens = torch.cat([tokens, ptoks])
            t0 = time.perf_counter()
            try:
                h = batch.step_rows(self.bundle, tokens, caches + views, self.ops, scratch=self._scratch)  # [R + c, H]
            except Exception:
                if ride is not None:
                    ride[0].solo = True
                raise
            took = time.perf_counter() - t0
            if ride is None:
                self._bodies.append(took)
            else:
                extra = took - (statistics.median(self._bodies) if self._bodies else 0.0)
                self._rode = (ride[0], h[len(rows):], ride[0].done + len(views), extra)
                h = h[:len(rows)]
        else:
            h = torch.cat([forward(self.bundle, tokens[i, None, None], r.cache, ops=self.ops)[0][0]
                           for i, r in enumerate(rows)])  # [R, H]
        for i, r in enumerate(rows):
            r.x = h[i].contiguous()


class Chunker:
    """A prefill's chunk size for a time budget, from its measured cost per position: after
    each chunk, cost (seconds per position) moves COST_GAIN of the way to the chunk's
    seconds / size (an average over the last few chunks: one step's time is noisy on a
    shared box, and a chunk's cost grows slowly with the positions before it, attention);
    the next chunk is the most positions whose predicted cost fits the budget, at most a
    quarter (+ 1) more than the last chunk, between 1 and PREFILL_CHUNK positions. Its own
    per group; a group's first chunk is FIRST_CHUNK positions, or, once any group has
    ridden, what the last measured cost fits (prime: a short prompt beside decoding rows
    goes in one or two chunks, not 2, 3, 4, 6 ...). No byte depends on it (cache-invariant
    body)."""

    def __init__(self, first: int = FIRST_CHUNK):
        self.next = first  # the next chunk's positions
        self.cost: float | None = None  # seconds per position (None: no chunk measured yet)

    def prime(self, cost: float, b: float) -> None:
        """Before this group's first chunk: start from `cost` (seconds per position, the
        engine's last measured, Engine._cost) instead of FIRST_CHUNK, the next chunk the
        most positions it fits in `b` seconds (at least 1, at most PREFILL_CHUNK). A cost
        of 0 or less (noise: chunks that seemed to take no time) primes nothing."""
        if cost <= 0:
            return
        self.cost = cost
        self.next = max(1, min(PREFILL_CHUNK, int(b / cost)))

    def note(self, size: int, seconds: float, b: float) -> None:
        """A chunk of `size` positions took `seconds` against a budget of `b` seconds."""
        per = max(seconds, 0.0) / size
        self.cost = per if self.cost is None else self.cost + COST_GAIN * (per - self.cost)
        fit = PREFILL_CHUNK if self.cost <= 0 else int(b / self.cost)
        self.next = max(1, min(PREFILL_CHUNK, fit, size + size // 4 + 1))


class Prefill:
    """A group of jobs sharing one prompt, prefilled chunk by chunk into ONE one-row
    cache (allocated at the first chunk: room for the prompt and the first job's first
    slots past it); echo logprobs of each chunk's positions as they come (score_positions
    is row-invariant: the same bytes as one call over the whole prompt)."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.ids = torch.tensor([jobs[0].prompt_ids], dtype=torch.int64)  # [1, P]
        self.done = 0  # prompt positions in the cache
        self.cache: KVCache | None = None
        self.x: torch.Tensor | None = None  # [H] the last position's hidden state (when done)
        j = jobs[0]
        self.echo_n = j.logprobs if j.echo_logprobs else None
        self.lps: list[float] = []
        self.tops: list | None = [] if self.echo_n else None
        self.chunker = Chunker()
        self.solo = False  # its chunks run alone (a decode step it rode in raised)
        self.reused = 0  # prompt positions copied from a recent prompt's cache (alloc)

    def alloc(self, engine: "Engine") -> None:
        """The prompt's cache, at the first chunk: room for the prompt and every slot its
        jobs may decode into (batch.row_cache: memory only as slots are written), so no
        row of the group grows its cache on the step path. Without echo, the slots of the
        longest prefix it shares with a recent prompt (engine._prefixes; at least
        REUSE_MIN positions, at most P - 1: the last position's hidden state is needed)
        are copied from that prompt's cache and not prefilled: the same bits, since a
        position's key / value bytes depend only on the tokens up to it
        (model.body.attend's declared order; cache-invariant, as Chunker's chunks)."""
        if self.cache is not None:
            return
        cfg, made = engine.bundle.config, self.jobs[0].cache
        self.cache = made if made is not None else batch.row_cache(cfg, _capacity(cfg, self.jobs))
        self.jobs[0].cache = None  # the Prefill (then the first row) holds it from here
        if self.echo_n is not None:  # echo scores every position from its hidden state: prefill them all
            return
        ids, m, src = self.jobs[0].prompt_ids, 0, None
        for key, cache in engine._prefixes:
            n = len(os.path.commonprefix([key, tuple(ids)]))  # the longest common prefix of the two
            if n > m:
                m, src = n, cache
        m = min(m, len(ids) - 1)
        if m >= REUSE_MIN:
            for k, v, sk, sv in zip(self.cache.k, self.cache.v, src.k, src.v):
                k[..., :m] = sk[..., :m]  # [1, nkv, hd, m]
                v[:, :, :m] = sv[:, :, :m]  # [1, nkv, m, hd]
            self.cache.length = self.done = m
            self.reused = m

    def step(self, engine: "Engine", size: int) -> bool:
        """llama.forward over the next `size` positions; True when the prompt is done."""
        self.alloc(engine)
        t1 = min(self.done + size, self.ids.shape[1])
        h, _ = forward(engine.bundle, self.ids[:, self.done:t1], self.cache, ops=engine.ops)  # [1, c, H]
        return self.took(engine, h[0], t1)

    def ride(self, engine: "Engine", size: int) -> tuple[list[KVCache], torch.Tensor]:
        """The next `size` positions as rows of a decode step's body call (batch.step_rows):
        one view of the prompt's cache per position (the same tensors, length = the
        position: step_rows writes each row's key / value, then attends over the slots
        before it, row by row in order, so position p sees p - 1 written just before it:
        llama.forward's bytes, the body being cache-invariant). Returns (views, their
        tokens [c] int64); the cache's own length moves in took()."""
        self.alloc(engine)
        t1 = min(self.done + size, self.ids.shape[1])
        views = [KVCache(k=self.cache.k, v=self.cache.v, pad=self.cache.pad, length=p) for p in range(self.done, t1)]
        return views, self.ids[0, self.done:t1]

    def took(self, engine: "Engine", h: torch.Tensor, t1: int) -> bool:
        """Positions done..t1-1 are in the cache with hidden states h [c, H]: their echo
        logprobs; True when the prompt is done (x: its last hidden state)."""
        t0, P = self.done, self.ids.shape[1]
        self.done = self.cache.length = t1
        s1 = min(t1, P - 1)  # positions t0..s1-1 score the tokens after them (the last has none)
        if self.echo_n is not None and s1 > t0:
            lps, top = score_positions(engine.bundle, h[:s1 - t0], self.ids[0, t0 + 1:s1 + 1],
                                       n=self.echo_n, config=engine.tail_config)
            self.lps += lps
            if self.tops is not None:
                self.tops += top
        if t1 < P:
            return False
        self.x = h[-1].contiguous()
        return True

    def left(self) -> int:
        """Prompt positions not prefilled yet."""
        return self.ids.shape[1] - self.done

    def prompt(self) -> Prompt | None:
        """The echo logprobs event (None without echo)."""
        return None if self.echo_n is None else Prompt(self.lps, self.tops)


def _capacity(cfg, jobs: list[Job]) -> int:
    """The slots a group's cache needs: its prompt and the most tokens a job may decode
    (at least 1), at most the context length."""
    return min(cfg.context_length, len(jobs[0].prompt_ids) + max(max(j.max_tokens for j in jobs), 1))


def _check_group(jobs: list[Job], most: int) -> None:
    """ValueError unless 1..most jobs share prompt_ids and their echo settings."""
    if not 1 <= len(jobs) <= most:
        raise ValueError(f"jobs must be 1 to {most} (max_batch) jobs; got {len(jobs)}")
    j0 = jobs[0]
    for j in jobs[1:]:
        if (j.prompt_ids, j.echo_logprobs, j.logprobs if j.echo_logprobs else None) != \
                (j0.prompt_ids, j0.echo_logprobs, j0.logprobs if j0.echo_logprobs else None):
            raise ValueError("jobs of a group must share prompt_ids and echo_logprobs (with its logprobs); got jobs "
                             "that differ")


@dataclass(frozen=True)
class _Top:
    """The top alternatives of the rows that asked for them, in row order."""

    topk_values: torch.Tensor  # [R_want, k] fp32 (candidates) or bf16 (mirror)
    topk_indices: torch.Tensor  # [R_want, k] int64


def _failure(e: Exception) -> Failed:
    """The Failed event of a job whose own step raised e (status 500)."""
    return Failed(f"engine error: {type(e).__name__}: {e}", 500)


def _emit(job: Job, event) -> None:
    try:
        job.sink(event)
    except Exception:  # a sink that fails (its client is gone) must not stop the engine
        job.cancel()


def score_positions(bundle: ModelBundle, h: torch.Tensor, targets: torch.Tensor, *, n: int | None,
                    config: TailConfig) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """Teacher-forced logprobs: row p of h [P', H] (the hidden state at position p) scores
    targets[p] (the token at p + 1), by the tail's norm + head GEMM (decode_tail on greedy
    rows) and the sampler's declared logprob fp32(v - lse1) (lse1: TailOutput.lse): the
    bytes decode_tail reports when it emits that token from that hidden state with the
    options of `config` (the step's: generate.step_config; its eps, exchange, head_input
    and GEMM order apply; k becomes max(n, 1) and the logits are returned). n: top
    alternatives per position (None: none). Returns ([P'] floats, [P'] x n (id, logprob) or None)."""
    cfg = replace(config, k=n or 1, emit_logits=True)
    head = head_weight(bundle, cfg.head_input)
    lps: list[float] = []
    tops: list[list[tuple[int, float]]] | None = [] if n else None
    for p0 in range(0, h.shape[0], SCORE_ROWS):
        hb = h[p0:p0 + SCORE_ROWS].contiguous()  # [c, H]
        # greedy rows: lse1 (TailOutput.lse) comes with a sampled call
        out = decode_tail(hb, bundle.final_norm, head, config=cfg, sampling_params=greedy_rows(hb.shape[0]))
        lse = out.lse  # [c] float64
        decided = out.logits if cfg.exchange == "candidates" else out.logits.to(torch.bfloat16)  # what decisions see
        v = decided.gather(1, targets[p0:p0 + SCORE_ROWS, None])  # [c, 1]
        lps += values_logprobs(v, lse)[:, 0].tolist()
        if n:
            tv = values_logprobs(out.topk_values[:, :n], lse)  # [c, n]
            tops += [list(zip(ids, vals)) for ids, vals in zip(out.topk_indices[:, :n].tolist(), tv.tolist())]
    return lps, tops
