"""TEMPORARY (delete at the merge with branch `proc`): the logits-processor seam agreed
with branch proc (lmtail.processors.LogitProcessing, decode_tail(..., processing=)) as
far as serve.grammar needs it, until those exist on this branch.

    LogitProcessing      the seam's dataclass (the same fields and defaults)
    decode_tail_processing(hidden, gamma, head, *, processing, **tail options)
                         decode_tail on one rank with each row's `allowed` applied to its
                         fp32 logits (False lanes := -inf) after the head GEMM and before the
                         candidates / mirror tail; only `allowed` is honoured here (any other
                         non-default field: ValueError)

At the merge: serve.grammar imports LogitProcessing from ..processors, and the engine's
_tail calls decode_tail(..., processing=processing) where it calls
decode_tail_processing; then this file goes.

Shape legend: gbs rows, H hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from .. import candidates
from ..config import TailConfig
from ..tail import (_owned_candidates, _owned_tail, head_shard_width, logits_from, normed_rows,
                    validate_tail_inputs)


@dataclass(frozen=True)
class LogitProcessing:
    """One row's logits processors for one decode step (the seam's fields)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_counts: tuple[tuple[int, int], ...] = ()
    prompt_ids: tuple[int, ...] = ()
    allowed: torch.Tensor | None = None  # [V] bool over the FULL vocab; False -> -inf


def decode_tail_processing(hidden_states, gamma, head, *, processing, eps: float, k: int, sampling_params,
                           emit_logits: bool, debug_taps: bool, exchange: str, head_input: str):
    """decode_tail's one-rank path (the same norm, GEMM and tail calls) with each row's
    allowed mask applied to its fp32 logits [gbs, V] (masked_fill -inf) before the tail."""
    cfg = TailConfig(eps=eps, k=k, emit_logits=emit_logits, debug_taps=debug_taps, exchange=exchange,
                     head_input=head_input)
    validate_tail_inputs(hidden_states, gamma, head, sampling_params, cfg, vocab_size=head_shard_width(head))
    a, rms = normed_rows(hidden_states, gamma, cfg)
    logits = logits_from(a, rms, head, cfg)  # [gbs, V] fp32
    for i, p in enumerate(processing):
        if p is None:
            continue
        extra = [f.name for f in fields(p) if f.name != "allowed" and getattr(p, f.name) != f.default]
        if extra:
            raise ValueError(f"the grammar shim applies only `allowed`; got {extra}")
        if p.allowed is not None:
            logits[i].masked_fill_(~p.allowed, float("-inf"))
    if cfg.exchange == "candidates":
        v = logits.shape[1]
        part = candidates.shard_partials(logits, col0=0, v=v, k=cfg.k, nan_fold=cfg.nan_fold, sp=sampling_params)
        return _owned_candidates(candidates.merge(part, k=cfg.k), sampling_params, cfg, logits, v)
    return _owned_tail(logits.to(torch.bfloat16), sampling_params, cfg, logits)
