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

from .kernels.gemm import DEFAULT_ORDER

EXCHANGES = ("mirror", "candidates")  # TailConfig.exchange
HEAD_INPUTS = ("bf16", "bf16x2")  # a bf16 head's activations (what generate / serve pass today)
TAIL_HEAD_INPUTS = HEAD_INPUTS + ("fp32",)  # TailConfig.head_input: + the Q8_0 head's ("fp32")


@dataclass(frozen=True)
class TailConfig:
    """Options of one decode-tail call.

    Every field with its default:
    eps (1e-5): added to ssq / H_u (finite, >= 0; rounded to fp32 once).
    hidden_actual (None: H): H_u, the real lanes.
    zero_interleaved_pad (True): pad lanes are the last (H-H_u)/4 of each of 4 groups
        (True) or the tail [H_u:] (False).
    k (256): top-k candidates per row, 1 <= k <= V (V = V_s x ranks); a k above V is a
        ValueError that says so, never clamped (a shard narrower than 256 needs k <= V).
    deferred_rms (True): logits = fp32(gemm(bf16(x*gamma)) * rms) (True) or
        gemm(bf16((x*rms)*gamma)) (False).
    nan_fold (False): NaN lanes rank below -inf in top-k and carry no mass in the sampler.
    emit_logits (True): return the fp32 shard logits [gbs, V_s].
    debug_taps (False): return top-k stage taps.
    gemm_order: the lm_head GEMM's declared order, one of kernels.gemm.TAIL_ORDERS: "amx32"
        (AMX's block order, FTZ/DAZ), "chain" (the sequential fp32 chain) or "dp32"
        (VDPBF16PS's order: per 32-lane block an odd-then-even fma chain, FTZ/DAZ); default
        kernels.gemm.DEFAULT_ORDER ("amx32"), the one default of every GEMM in lmtail.
    tail_path ("fused"): how the owned rows' top-k + sampler run, one of tail.TAIL_PATHS:
        "fused" (the one-pass C kernel kernels.rows_tail) or "reference"
        (topk.exact_topk + sampler.sample_rows); the same bytes either way (mirror only).
    exchange ("mirror"): what crosses the all-to-all and what the decisions are made on,
        one of EXCHANGES: "mirror" (the bf16 mirror of every logit; top-k and the sampler
        on bf16 values) or "candidates" (each shard's exact fp32 top-(k+1) and its chunk
        mass partials, lmtail.candidates: decisions on fp32 logits; VTP must divide 256).
        Either way the bytes do not depend on VTP, hops or batch groups.
    head_input ("bf16"): the lm_head GEMM's activation, one of TAIL_HEAD_INPUTS: "bf16" (a =
        bf16(x*gamma), one GEMM row per row) or "bf16x2" (a = a_hi + a_lo, a_hi =
        bf16(x*gamma), a_lo = bf16(x*gamma - a_hi): two GEMM rows per row in one GEMM call,
        logits = fp32(fp32(acc_hi + acc_lo) * rms); the activation carries 16 significant
        bits instead of 8; needs deferred_rms) or "fp32" (the Q8_0 head: lm_head_weight_t
        is a kernels.quant.QuantWeight "Q8_0" (V_s, H), the GGUF rows of this vocab shard;
        g = fp32(x*gamma) goes into kernels.quant.gemm_q unrounded, acc in gemm_q's
        declared order "lanes32", logits = fp32(acc * rms)). The rule is explicit, both
        ways, checked by tail.validate_tail_inputs (ValueError naming the argument): a
        QuantWeight head needs head_input="fp32", fmt "Q8_0", K = H (so H % 32 == 0),
        deferred_rms=True and gemm_order at its default (it does not apply to gemm_q: a
        non-default one is refused, never ignored); head_input="fp32" needs a QuantWeight.
    """

    eps: float = 1e-5
    hidden_actual: int | None = None
    zero_interleaved_pad: bool = True
    k: int = 256
    deferred_rms: bool = True
    nan_fold: bool = False
    emit_logits: bool = True
    debug_taps: bool = False
    gemm_order: str = DEFAULT_ORDER
    tail_path: str = "fused"
    exchange: str = "candidates"
    head_input: str = "bf16"
