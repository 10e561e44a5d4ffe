"""Certify a generation's tail decisions against a float64 tail on the same hidden states.

generate(record=True) keeps, for every step, the hidden states the tail was given and
what it decided (TailTrace). This module replays those steps through
lmtail.contract.certify.certify_tail (SPEC 7, token certification):

    rows    = the (step, request) pairs that were still active (the row's tokens count)
    ref     = float64 ideal logits of those hidden states (reference.tail.logits_ref)
    delta   = the declared bound on |bf16 mirror of any conforming tail - ref|
    decided : argmax (top-1 id), top-k (the k-candidate set), sample (the emitted token
              under the row's top_k / top_p / temperature / u / min_p; for a greedy row
              the argmax again)

A decision whose float64 margin exceeds the bound is CERTIFIED and must equal the tail's
(a mismatch is a failure); the rest are near-ties, counted, never hidden. Greedy and
sampled requests are certified separately so the demo can report each.

This certifies the tail on the body's hidden states; the body itself (torch fp32 GEMMs,
lmtail add_rms) is model plumbing, outside the float64 claim.

Shape legend: S steps, B requests, N = active (step, request) rows, H hidden, V vocab,
k candidates.
"""
from __future__ import annotations

import torch

from ..contract.certify import certify_tail
from ..sampler import GREEDY_TEMPERATURE as GREEDY_T
from .generate import Generation
from .gguf_loader import ModelBundle


def certify_generation(bundle: ModelBundle, gen: Generation, *, rows: str = "all") -> dict:
    """certify_tail over the active (step, request) rows of gen.trace.

    rows: "all", "greedy" (temperature < 1e-5) or "sampled". Returns certify_tail's dict
    (rows, certified, matched, mismatched, near_ties, decisions {argmax, topk, sample},
    near_tie_rows, worst_margin, mismatches, ok) plus `where` [(step, request)] naming
    each certified row index. ValueError if gen has no trace."""
    tr = gen.trace
    if tr is None:
        raise ValueError("gen has no trace: call generate(..., record=True)")
    if rows not in ("all", "greedy", "sampled"):
        raise ValueError(f"rows must be 'all', 'greedy' or 'sampled'; got {rows!r}")
    mask = tr.active.clone()  # [S, B]
    greedy = tr.params[..., 2] < GREEDY_T  # [S, B]
    if rows == "greedy":
        mask &= greedy
    elif rows == "sampled":
        mask &= ~greedy
    where = [tuple(x) for x in torch.nonzero(mask).tolist()]
    if not where:
        return dict(rows=0, certified=0, matched=0, mismatched=0, near_ties=0, truncated=0,
                    decisions={d: dict(certified=0, matched=0, near_ties=0) for d in ("argmax", "topk", "sample")},
                    near_tie_rows={}, worst_margin={}, mismatches=[], ok=True, where=[])
    out = dict(topk_indices=tr.topk_indices[mask], tokens=tr.tokens[mask], truncated=tr.truncated[mask])
    cert = certify_tail(tr.hidden[mask], bundle.final_norm, bundle.lm_head_weight_t, out,
                        sampling_params=tr.params[mask], eps=bundle.config.eps)
    return {**cert, "where": where}
