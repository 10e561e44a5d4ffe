"""The decode tail's options as one frozen value: what every rank must agree on.

TailConfig travels unchanged from `decode_tail` to its two halves (shard logits, owned
rows) on one rank or many; the vocab-parallel path all-gathers it (as part of the input
signature) so that ranks with different options raise instead of computing different
answers. Validation of the fields against the tensors lives in `lmtail.tail`
(`validate_tail_inputs`), the one boundary check of the tail.

Shape legend: H hidden (padded), H_u = hidden_actual real lanes, k candidates.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TailConfig:
    """Options of one decode-tail call.

    eps: added to ssq / H_u (finite, >= 0; rounded to fp32 once).
    hidden_actual: H_u, the real lanes (None: H).
    zero_interleaved_pad: pad lanes are the last (H-H_u)/4 of each of 4 groups (True) or
        the tail [H_u:] (False).
    k: top-k candidates per row, 1 <= k <= V.
    deferred_rms: logits = fp32(gemm(bf16(x*gamma)) * rms) (True) or
        gemm(bf16((x*rms)*gamma)) (False).
    nan_fold: NaN lanes rank below -inf in top-k and carry no mass in the sampler.
    emit_logits: return the fp32 shard logits [gbs, V_s].
    debug_taps: return top-k stage taps.
    gemm_order: the lm_head GEMM's declared order, one of kernels.gemm.ORDERS: "amx32"
        (AMX's block order, FTZ/DAZ; the default) or "chain" (the sequential fp32 chain).
    tail_path: how the owned rows' top-k + sampler run, one of tail.TAIL_PATHS: "fused"
        (the default: the one-pass C kernel kernels.rows_tail) or "reference"
        (topk.exact_topk + sampler.sample_rows); the same bytes either way.
    """

    eps: float = 1e-5
    hidden_actual: int | None = None
    zero_interleaved_pad: bool = True
    k: int = 256
    deferred_rms: bool = True
    nan_fold: bool = False
    emit_logits: bool = True
    debug_taps: bool = False
    gemm_order: str = "amx32"
    tail_path: str = "fused"
