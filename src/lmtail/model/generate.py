"""Batched generation with SmolLM2 on lmtail's ops, on 1 or N vocab-parallel ranks: the
requests, the decode loop and generate(). Sharing the model with the ranks is
lmtail.model.ranks; the `lmtail generate` command is lmtail.model.generate_cli.

One step (every rank runs the same body; only the tail's head is split by vocab):

    ids [B, P] --forward (llama.py, ops = lmtail_ops(): every residual add + RMSNorm is
                 lmtail.glue.norms.add_rms, bf16 residual stream)--> h [B, P, H]
    loop: h_last [B, H] fp32 --tail (decode_tail: final RMSNorm -> bf16 head GEMM ->
          exact top-k -> sampler)--> tokens [B] --forward (T = 1)--> h [B, 1, H]

Batching: prompts are LEFT-padded (with the pad id) to the longest prompt; the KV cache
records each row's pad so a row's positions start at 0 at its first real token and pad
slots are never attended to. All rows decode in lock step; a row that has emitted a stop
token (<|im_end|> or <|endoftext|>) keeps running but its later tokens are dropped.

Requests: each row carries its own sampler.SamplingParams (top_k, top_p, temperature,
min_p, seed | u); greedy and sampled rows mix in one batch. Row b's token at position
p = len(prompt_b) + step draws u = numerics.draw_u(seed_b, p) (a fixed `u` if the request
gives one instead, else 0.5), so the draw depends on the request only, never on the batch,
the rank count or the thread count.

Ranks (ranks = N > 1): lmtail.launch spawns N gloo ranks (each with the caller's torch
thread count, so every rank's body computes the same bytes as the caller's would). The
model reaches them as shared-memory buffers (lmtail.model.ranks: one fp32 buffer holding
every body weight, one bf16 buffer of the declared body's linears, one bf16 head), mapped,
not copied. Each rank (rank_decode):
  * runs the forward on ALL B rows (the body is replicated);
  * runs the rank step of lmtail.model.ranks (pad_step, rank_step, gathered_rows; the
    server's ranks run the same): pads the step's hidden states with zero rows to gbs =
    ceil(B / N) * N (decode_tail's layout needs N | gbs; dummy rows are greedy,
    row-independent, and dropped); calls the tail with its vocab shard
    lm_head_weight_t[:, r*V_s:(r+1)*V_s] (V_s = V/N), the sampling rows it owns
    (layout.owned_rows(r, N, gbs)) and group = the world: decode_tail's vocab-parallel
    path; all-gathers (token, logprob bits, truncated, top-k ids) of the owned rows, so
    every rank feeds the same next tokens to its body.
The exchange moves bytes only, so the tokens equal the single-rank tail's on the same
hidden states, bitwise; and the bodies are the same computation, so the text is the same
for every N. Rank 0's on_step calls are forwarded to the caller through a queue.

Processors: generate(processors=[processors.Processors | None] * B) (logit_bias, presence /
frequency / repetition penalties): each step, row b's LogitProcessing is built from its
prompt and the tokens it has generated so far and handed to the tail as processing= (on
every rank: each edits its own vocab shard; lmtail.tail.processors).

The tail seam: `tail_fn(hidden_states [gbs, H] fp32, gamma [H] fp32, lm_head_weight_t
(the head of config.head_input: [H, V_s] bf16, or the [V_s, H] Q8_0 QuantWeight for
"fp32"), *, config: TailConfig, sampling_params [R, 5] fp32[, group])` returning an object
with `.tokens [R] int64`, `.logprobs [R] fp32`, `.topk_indices [R, k] int64`, `.truncated
[R] bool` (the calling convention of lmtail.tail.compose.decode_tail, the default; config is
step_config's, built once per generate() call; with ranks > 1 it is also given group= and
must be picklable).

Shape legend: B rows (requests), P padded prompt length, H hidden, V vocab, V_s = V / N
vocab shard, gbs = B rounded up to a multiple of N, R = gbs / N owned rows, k candidates,
S decode steps.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from ..numerics import draw_u
from ..tail.processors import Processors
from ..tail.sampler import COL, DEFAULT_U, SAMPLING_COLUMNS, SamplingParams, sampling_tensor, seed_int64
from ..tail.config import TailConfig
from ..tail.exchange import DEFAULT_TIMEOUT_S
from ..kernels.gemm.bf16 import weight_for
from ..tail.compose import decode_tail, head_shard
from .gguf_loader import ModelBundle
from .llama import FP32_STREAM_BODIES, Q32_BODY, Ops, forward, lmtail_ops, new_cache, prefill
from .ranks import gathered_rows, pack_bundle, pad_step, rank_step, run_ranks, unpack_bundle

__all__ = ["Generation", "TailTrace", "StepOut", "DEFAULT_TAIL", "generate", "check_request", "request_params",
           "step_params", "encode_prompts", "local_step", "group_step", "decode_loop", "rank_decode",
           "pack_bundle", "unpack_bundle", "DEFAULT_BODY", "default_ops", "default_head_input", "head_weight",
           "weights_needed", "step_config", "DecodeJob"]

DEFAULT_TAIL = decode_tail  # generate()'s tail, called with step_config's TailConfig (emit_logits=False)
DEFAULT_BODY = Q32_BODY  # generate()'s body: the file's own blocks on an fp32 stream, the Q8_0 head


def default_ops() -> Ops:
    """generate()'s body when ops is None: llama.lmtail_ops(body="q32") (docs/model.md: the
    file's own weights, no activation rounded below fp32, the fastest body and the closest to
    the fp32 reference)."""
    return lmtail_ops(body=DEFAULT_BODY)


def default_head_input(ops: Ops) -> str:
    """The tail's head input that goes with a body: "fp32" (the file's Q8_0 head) for the bodies
    on an fp32 stream (q32, bq32), TailConfig's "bf16" (the bf16 head) for the others."""
    return "fp32" if ops.body in FP32_STREAM_BODIES else TailConfig.head_input


def step_config(bundle: ModelBundle, *, k: int, head_input: str,
                exchange: str = TailConfig.exchange) -> TailConfig:
    """The TailConfig of a decode step (generate's and the server's, built once): the model's
    eps, k candidates, exchange and head_input (checked by TailConfig: ValueError naming
    the field), no logits returned (emit_logits=False), every other option at its default."""
    return TailConfig(eps=bundle.config.eps, k=k, emit_logits=False, exchange=exchange, head_input=head_input)


def weights_needed(body: str, head_input: str | None) -> str:
    """What load_model(weights=...) must build for this body and head input: "file" (the
    file's own blocks only) when a body on an fp32 stream (q32, bq32) runs with the Q8_0 head
    (head_input None or "fp32"), else "all"."""
    return "file" if body in FP32_STREAM_BODIES and head_input in (None, "fp32") else "all"


def head_weight(bundle: ModelBundle, head_input: str):
    """The full-vocab head the tail reads for `head_input`: bundle.head_q (Q8_0 QuantWeight
    [V, H]) for "fp32", else bundle.lm_head_weight_t ([H, V] bf16; ValueError on a
    load_model(weights="file") bundle, which has none)."""
    if head_input == "fp32":
        return bundle.head_q
    if bundle.lm_head_weight_t is None:
        raise ValueError(f"head_input={head_input!r} needs the bf16 head of load_model(weights='all'); this "
                         f"bundle was loaded with weights={bundle.weights!r} (use head_input='fp32')")
    return bundle.lm_head_weight_t


# ---------------------------------------------------------------------------------------
# results
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TailTrace:
    """What the tail saw and decided at every step (generate(record=True)), for
    certification against float64 (lmtail.demo.model.certify_generation). Step s, row b."""

    hidden: torch.Tensor  # [S, B, H] fp32, the tail's input (pre-final-norm hidden)
    params: torch.Tensor  # [S, B, 5] fp32 (top_k, top_p, temperature, u, min_p)
    tokens: torch.Tensor  # [S, B] int64
    topk_indices: torch.Tensor  # [S, B, k] int64
    truncated: torch.Tensor  # [S, B] bool
    active: torch.Tensor  # [S, B] bool, row b had not stopped before step s
    exchange: str = TailConfig.exchange  # the tail's exchange (what its decisions were made on)
    head_input: str = TailConfig.head_input  # the tail's GEMM activation ("bf16" | "bf16x2" | "fp32": the Q8_0 head)


@dataclass(frozen=True)
class Generation:
    """What generate() returns; per-row tuples in prompt order."""

    prompt_ids: tuple[tuple[int, ...], ...]
    token_ids: tuple[tuple[int, ...], ...]  # generated ids, the stop token included if hit
    logprobs: tuple[tuple[float, ...], ...]  # raw logprob of each generated id
    texts: tuple[str, ...]  # decoded generations (special tokens skipped)
    finished: tuple[bool, ...]  # True where a stop token was emitted
    prefill_s: float  # rank 0's prefill time
    decode_s: float  # rank 0's decode time (all steps, tail included)
    decode_steps: int
    ranks: int = 1
    wall_s: float = 0.0  # the whole call (with ranks > 1: spawn, model sharing, teardown)
    trace: TailTrace | None = None


# ---------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------
def check_request(i: int, p: SamplingParams) -> None:
    """ValueError naming request i unless p is a valid SamplingParams: the tail's own rules
    (sampler.sampling_tensor) on its fp32 values, so nothing that passes here fails inside a
    decode step (u=0.99999999 is 1.0 in fp32)."""
    try:
        sampling_tensor([p], positions=[0])
    except ValueError as e:
        raise ValueError(f"request {i}: {str(e).removeprefix('request 0: ')}") from None


def request_params(n: int, *, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=0) -> list[SamplingParams]:
    """n SamplingParams from generate's scalar form (seed: one int or one per request)."""
    seeds = [seed] * n if isinstance(seed, int) else list(seed)
    if len(seeds) != n:
        raise ValueError(f"seed must be an int or one per prompt ({n}); got {len(seeds)}")
    return [SamplingParams(top_k=int(top_k) if int(top_k) == top_k else top_k, top_p=top_p,
                           temperature=temperature, min_p=min_p, seed=s) for s in seeds]


def step_params(params: list[SamplingParams], positions: np.ndarray) -> torch.Tensor:
    """[B, 5] fp32 (top_k, top_p, temperature, u, min_p) for the tokens at `positions` [B]:
    u = draw_u(seed_b, p_b) for seeded requests, the request's u, else 0.5 (vectorized)."""
    seeded = np.array([p.seed is not None for p in params])  # [B]
    seeds = np.array([seed_int64(p.seed) if p.seed is not None else 0 for p in params], dtype=np.int64)
    fixed = np.array([DEFAULT_U if p.u is None else p.u for p in params], dtype=np.float32)
    u = np.where(seeded, draw_u(seeds, positions), fixed)  # [B] fp32
    rows = [[0.0 if c == "u" else float(getattr(p, c)) for c in SAMPLING_COLUMNS] for p in params]
    base = torch.tensor(rows, dtype=torch.float32)  # [B, 5], the columns are SamplingParams' fields
    base[:, COL.u] = torch.from_numpy(u.astype(np.float32))
    return base


def encode_prompts(bundle: ModelBundle, prompts: list[str], *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt; chat=True wraps each as one user turn of the chat template."""
    tok = bundle.tokenizer
    return [tok.encode(tok.chat_prompt(p) if chat else p) for p in prompts]


# ---------------------------------------------------------------------------------------
# the decode loop (shared by the single-rank call and every rank of a group)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepOut:
    """One tail step over all B rows (every rank holds all of it)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32
    topk_indices: torch.Tensor | None  # [B, k] int64
    truncated: torch.Tensor | None  # [B] bool


def step_head(w, pack: bool):
    """The head a decode reads every step: a bf16 [H, V_s] head in this machine's fastest
    layout for decode_tail's default order (kernels.gemm.bf16.weight_for: packed once here when
    that is faster; the same bytes) when `pack`, else w as it is (a QuantWeight always)."""
    if pack and isinstance(w, torch.Tensor):
        return weight_for(w, order=TailConfig.gemm_order, rows=1)
    return w


def local_step(tail_fn, bundle: ModelBundle, config: TailConfig, pack: bool = False):
    """tail_step(h [B, H], sp [B, 5], processing=None) -> StepOut on one rank (the full head
    of config.head_input; pack: the default tail, which takes the head in any layout:
    step_head). processing: None or B entries (processors.LogitProcessing | None), handed
    to tail_fn as processing= (only when given)."""
    head = step_head(head_weight(bundle, config.head_input), pack)

    def step(h, sp, processing=None):
        extra = {} if processing is None else {"processing": processing}
        res = tail_fn(h, bundle.final_norm, head, config=config, sampling_params=sp, **extra)
        return StepOut(res.tokens, res.logprobs, getattr(res, "topk_indices", None),
                       getattr(res, "truncated", None))

    return step


def group_step(tail_fn, bundle: ModelBundle, config: TailConfig, rank: int, n: int, pack: bool = False):
    """tail_step for rank `rank` of an n-rank world (module docstring, "Ranks"): the rank
    step of lmtail.model.ranks (zero-row padding to gbs, the tail on this rank's vocab shard
    of the head for config.head_input with the owned rows' params, one all-gather after).
    processing (None or B entries) is padded with None to gbs (every rank passes all gbs
    rows: each edits its own shard's lanes)."""
    import torch.distributed as dist

    w = step_head(head_shard(head_weight(bundle, config.head_input), rank, n), pack)

    def step(h, sp, processing=None):
        xp, spp = pad_step(h, sp, n)
        extra = {} if processing is None else {"processing": list(processing) + [None] * (xp.shape[0] - h.shape[0])}

        def tail(xp, sp_owned):
            return tail_fn(xp, bundle.final_norm, w, config=config, sampling_params=sp_owned,
                           group=dist.group.WORLD, **extra)

        got = gathered_rows(rank_step(tail, xp, spp, rank=rank, n=n, values=False, timeout=DEFAULT_TIMEOUT_S),
                            h.shape[0])
        return StepOut(got.tokens, got.logprobs, got.topk_indices, got.truncated)

    return step


def decode_loop(bundle: ModelBundle, ids: list[list[int]], params: list[SamplingParams], *,
                max_new_tokens: int, ops: Ops, tail_step, on_step=None, record=False,
                on_prefill=None, processors: list[Processors | None] | None = None) -> Generation:
    """Prefill the left-padded batch (in chunks; on_prefill(done, P) after each), then one
    tail step + one forward per token. processors (None or one per row): each step's
    LogitProcessing per row from its prompt and the tokens it has generated so far
    (a stopped row's later tokens are not counted: they are dropped)."""
    cfg, tok, b_n = bundle.config, bundle.tokenizer, len(ids)
    lens = np.array([len(x) for x in ids], dtype=np.int64)  # [B]
    p_len = int(lens.max())
    batch = torch.tensor([[tok.pad_id] * (p_len - len(x)) + x for x in ids], dtype=torch.int64)  # [B, P]
    cache = new_cache(cfg, pad=torch.from_numpy(p_len - lens), capacity=p_len + max_new_tokens)
    out_ids, out_lp, done = [[] for _ in range(b_n)], [[] for _ in range(b_n)], [False] * b_n
    trace = []
    t0 = time.perf_counter()
    x = prefill(bundle, batch, cache, ops=ops, on_progress=on_prefill).contiguous()  # [B, H]
    t1 = time.perf_counter()
    step = 0
    counts = [{} for _ in range(b_n)]  # per row: {token id: times generated}
    while True:
        sp = step_params(params, lens + step)  # [B, 5]
        active = torch.tensor([not d for d in done])
        proc = None if processors is None else [None if q is None else q.at(ids[b], counts[b])
                                                  for b, q in enumerate(processors)]
        res = tail_step(x, sp) if proc is None else tail_step(x, sp, proc)
        if record:
            trace.append((x, sp, res.tokens, res.topk_indices, res.truncated, active))
        new = res.tokens.tolist()
        for b in range(b_n):
            if not done[b]:
                counts[b][new[b]] = counts[b].get(new[b], 0) + 1
                out_ids[b].append(new[b])
                out_lp[b].append(float(res.logprobs[b]))
                done[b] = new[b] in tok.stop_ids
        step += 1
        if on_step is not None:
            on_step(step, new, list(done))
        if all(done) or step == max_new_tokens:
            break
        h, _ = forward(bundle, res.tokens[:, None].to(torch.int64), cache, ops=ops)  # [B, 1, H]
        x = h[:, -1].contiguous()  # [B, H]
    t2 = time.perf_counter()
    tr = None
    if record:
        tr = TailTrace(*(torch.stack([s[j] for s in trace]) for j in range(6)))
    return Generation(
        prompt_ids=tuple(tuple(x) for x in ids), token_ids=tuple(tuple(x) for x in out_ids),
        logprobs=tuple(tuple(x) for x in out_lp), texts=tuple(tok.decode(x) for x in out_ids),
        finished=tuple(done), prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=step, trace=tr)

@dataclass(frozen=True)
class DecodeJob:
    """What every rank of generate(ranks=n) decodes with, besides the prompts (picklable)."""

    tail_fn: Callable  # the tail seam (module docstring)
    config: TailConfig  # its options (step_config)
    ops: Ops  # the body
    max_new_tokens: int
    record: bool  # keep a TailTrace
    pack: bool  # the head in step_head's layout (the default tail)
    processors: tuple | None = None  # one processors.Processors | None per prompt, or None


def rank_decode(bundle: ModelBundle, rank: int, n: int, ids, params, job: DecodeJob, *, on_step=None) -> Generation:
    """One rank of generate(ranks=n): the decode loop on this rank's tail step (group_step);
    run by lmtail.model.ranks.run_ranks in each spawned rank."""
    step = group_step(job.tail_fn, bundle, job.config, rank, n, job.pack)
    return decode_loop(bundle, ids, params, max_new_tokens=job.max_new_tokens, ops=job.ops,
                       tail_step=step, on_step=on_step, record=job.record, processors=job.processors)


# ---------------------------------------------------------------------------------------
# the public entry point
# ---------------------------------------------------------------------------------------
def generate(bundle: ModelBundle, prompts: list[str], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | list[int] = 0, params: list[SamplingParams] | None = None,
             ranks: int = 1, k: int = 256, chat: bool = True, tail_fn: Callable | None = None,
             ops: Ops | None = None, on_step: Callable | None = None, record: bool = False,
             timeout_s: float = 600.0, on_prefill: Callable | None = None,
             exchange: str | None = None, head_input: str | None = None,
             processors: list[Processors | None] | None = None) -> Generation:
    """Generate up to max_new_tokens for each prompt (module docstring).

    Sampling: the scalars (temperature < 1e-5 is greedy; top_k <= 0 disables; seed one int
    or one per prompt) apply to every request, unless `params` gives one SamplingParams per
    prompt. ranks: vocab-parallel ranks (N must divide V = 49152); the same tokens for
    every N. k: candidates asked of the tail (raised to the largest top_k). tail_fn None:
    decode_tail(emit_logits=False); ops None: default_ops(), the q32 body (the file's own
    blocks on an fp32 stream; llama.lmtail_ops() is the declared bf16 body). on_step(step, tokens [B] list[int], done [B] list[bool]) after
    every step (streaming); on_prefill(done, P) after each prefill chunk (ranks = 1 only).
    record: keep a TailTrace for certification. timeout_s bounds a ranks > 1 run (the
    ranks are terminated after it). exchange, head_input: the default tail's exchange and
    GEMM activation (config.EXCHANGES, config.TAIL_HEAD_INPUTS; None: TailConfig's exchange
    and default_head_input(ops): "fp32", the file's Q8_0 head, for the q32 body, else "bf16");
    only without tail_fn (a tail_fn gets the head of default_head_input(ops)). The tail's
    options are one TailConfig (step_config), built once here and passed to every step.
    processors: None, or one processors.Processors (or None) per prompt: logit_bias and the
    presence / frequency / repetition penalties, applied at the tail's logits-processor seam
    each step (lmtail.tail.processors; a tail_fn then gets processing=); not with record (the
    certification covers the unprocessed tail).
    """
    t0 = time.perf_counter()
    if not prompts or not isinstance(prompts, (list, tuple)) or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of str; got {prompts!r:.80}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not isinstance(ranks, int) or ranks < 1 or bundle.config.vocab % ranks:
        raise ValueError(f"ranks must be an int >= 1 dividing the vocab {bundle.config.vocab}; got {ranks}")
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")
    b_n, cfg = len(prompts), bundle.config
    if params is None:
        params = request_params(b_n, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    elif len(params) != b_n:
        raise ValueError(f"params must hold one SamplingParams per prompt ({b_n}); got {len(params)}")
    for i, p in enumerate(params):
        check_request(i, p)
    if processors is not None:
        if not isinstance(processors, (list, tuple)) or len(processors) != b_n:
            raise ValueError(f"processors must be None or one Processors (or None) per prompt ({b_n}); got "
                             f"{processors!r:.80}")
        for i, q in enumerate(processors):
            if q is not None:
                if not isinstance(q, Processors):
                    raise ValueError(f"processors[{i}] must be a Processors or None; got {type(q).__name__}")
                q.check(cfg.vocab, f"processors[{i}]")
        if record:
            raise ValueError("record=True certifies the unprocessed tail; got processors as well")
        processors = None if all(q is None or q.neutral for q in processors) else list(processors)
    k = min(max([k] + [int(p.top_k) for p in params]), cfg.vocab)  # decode_tail needs 1 <= k <= V
    ids = encode_prompts(bundle, list(prompts), chat=chat)
    lens = [len(x) for x in ids]
    if min(lens) < 1 or max(lens) + max_new_tokens > cfg.context_length:
        raise ValueError(f"prompt lengths must be >= 1 and + max_new_tokens <= {cfg.context_length}; "
                         f"got {lens} + {max_new_tokens}")
    for name, val in (("exchange", exchange), ("head_input", head_input)):
        if val is not None and tail_fn is not None:
            raise ValueError(f"{name} applies to the default tail only; got {name}={val!r} with tail_fn given")
    ops = default_ops() if ops is None else ops
    config = step_config(bundle, k=k, exchange=TailConfig.exchange if exchange is None else exchange,
                         head_input=default_head_input(ops) if head_input is None else head_input)
    pack = tail_fn is None  # decode_tail takes a packed head; a given tail_fn gets it plain
    tail_fn = DEFAULT_TAIL if tail_fn is None else tail_fn
    if ranks == 1:
        gen = decode_loop(bundle, ids, params, max_new_tokens=max_new_tokens, ops=ops,
                          tail_step=local_step(tail_fn, bundle, config, pack), on_step=on_step,
                          record=record, on_prefill=on_prefill, processors=processors)
    else:
        job = DecodeJob(tail_fn=tail_fn, config=config, ops=ops, max_new_tokens=max_new_tokens, record=record,
                        pack=pack, processors=processors)
        gens = run_ranks(rank_decode, bundle, (ids, params, job), ranks=ranks, on_step=on_step,
                         timeout_s=timeout_s)
        assert all(g.token_ids == gens[0].token_ids for g in gens), "ranks decoded different tokens"
        gen = gens[0]
    trace = None if gen.trace is None else replace(gen.trace, exchange=config.exchange, head_input=config.head_input)
    return replace(gen, ranks=ranks, wall_s=time.perf_counter() - t0, trace=trace)
