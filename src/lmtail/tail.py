"""The decode sampling tail: final RMSNorm -> lm_head GEMM -> exact top-k -> sampler.

    hidden [gbs, H] fp32|fp16|bf16 --widen (exact)--> x [gbs, H] fp32, pad lanes := 0
      ssq  = sum_squares(x, strided(256))                      fp32, declared order
      rms  = 1 / sqrt(ssq / H_u + eps)                         fp32, IEEE div, sqrt_rn32
      deferred_rms=True : a = bf16(fp32(x * gamma));  logits = fp32(gemm(a, W) * rms)
      deferred_rms=False: a = bf16(fp32(fp32(x * rms) * gamma));  logits = gemm(a, W)
        gemm = kernels.gemm_bf16_chain: per element an fp32 chain over h = 0..H-1
      mirror = bf16(logits)                                    [gbs, V_s]  (what a collective carries)
    mirror rows [R, V] --exact_topk--> candidates [R, k] --sample_rows--> tokens [R]

Numerics declared (see docs/numerics.md for the float64 bounds):
  ssq: fp32 fma chains, strided(256) over the H padded lanes (pad lanes are exact zeros),
       depth ceil(H/256) + 5 + 7.
  gemm: fp32 fma chain, sequential over h = 0..H-1, depth H (docs/gemm.md).
  rounding points: x*gamma (fp32), a (bf16), ssq/H_u, +eps, sqrt, 1/s (fp32 each),
       acc*rms (fp32), mirror (bf16).
Every step is row-independent, so a row's bytes never depend on the batch it is in.

Shape legend: gbs global batch rows, H hidden (padded), H_u real hidden, V_s vocab shard,
V full vocab, R rows this rank owns (= gbs on one rank), k candidates.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels.gemm import gemm_bf16_chain
from .numerics import Decl, SumDecl, sqrt_rn32
from .orders import strided, sum_squares
from .sampler import sample_rows, validate_params
from .topk import exact_topk

SSQ_ORDER = strided(256)
TOPK_CHUNK = 4096


@dataclass(frozen=True)
class TailOutput:
    """What decode_tail returns; fields not asked for are None."""

    topk_values: torch.Tensor  # [R, k] bf16, descending
    topk_indices: torch.Tensor  # [R, k] int64 global vocab ids
    logits: torch.Tensor | None = None  # [gbs, V_s] fp32 pre-collective
    tokens: torch.Tensor | None = None  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] fp32, raw log_softmax over the full row
    truncated: torch.Tensor | None = None  # [R] bool
    taps: dict | None = None


def tail_decl(h: int, deferred_rms: bool = True) -> Decl:
    """The declared numerics of the tail's norm + GEMM for hidden width h."""
    pts = (("x*gamma:fp32", "a:bf16", "ssq/H_u:fp32", "+eps:fp32", "sqrt:fp32", "1/s:fp32",
            "acc*rms:fp32", "mirror:bf16") if deferred_rms else
           ("ssq/H_u:fp32", "+eps:fp32", "sqrt:fp32", "1/s:fp32", "x*rms:fp32",
            "(x*rms)*gamma:fp32", "a:bf16", "mirror:bf16"))
    return Decl(
        op="decode_tail" + ("" if deferred_rms else "[legacy]"),
        rounding_points=pts,
        sums=(SumDecl("ssq", "fp32", SSQ_ORDER.depth(h), SSQ_ORDER.describe(h)),
              SumDecl("gemm", "fp32", h, "fp32 fma chain, sequential over h = 0..H-1 per output element")),
    )


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
def pad_mask(h: int, h_u: int, interleaved: bool) -> torch.Tensor:
    """[H] bool: True on real lanes. interleaved: 4 groups of H/4, each ending in
    (H-H_u)/4 pad lanes (GPT-OSS mxfp4); else the pad is the tail [H_u:]."""
    lane = torch.arange(h)
    if not interleaved or h == h_u:
        return lane < h_u
    g = h // 4
    return (lane % g) < (g - (h - h_u) // 4)


def validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, *, eps, hidden_actual,
                         zero_interleaved_pad, k, sampling_params, vocab_size, rows=None):
    """ValueError with expected-vs-got for anything decode_tail cannot take."""
    x, w = hidden_states, lm_head_weight_t
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"hidden_states must be [gbs, H]; got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"hidden_states must be float32, float16 or bfloat16; got {x.dtype}")
    gbs, h = x.shape
    if gbs < 1 or h < 1:
        raise ValueError(f"hidden_states must be non-empty [gbs, H]; got {tuple(x.shape)}")
    if not isinstance(gamma, torch.Tensor) or tuple(gamma.shape) not in ((h,), (1, h)):
        raise ValueError(f"gamma must be [H={h}] or [1, H]; got {tuple(getattr(gamma, 'shape', ()))}")
    if gamma.dtype != torch.float32:
        raise ValueError(f"gamma must be float32; got {gamma.dtype}")
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.shape[0] != h:
        raise ValueError(f"lm_head_weight_t must be [H={h}, V_s]; got {tuple(getattr(w, 'shape', ()))}")
    if w.dtype != torch.bfloat16:
        raise ValueError(f"lm_head_weight_t must be bfloat16; got {w.dtype}")
    if not w.is_contiguous():
        raise ValueError("lm_head_weight_t must be C-contiguous (pass the transposed weight, "
                         "e.g. w.t().contiguous()); got a strided view")
    h_u = h if hidden_actual is None else hidden_actual
    if not 1 <= h_u <= h:
        raise ValueError(f"hidden_actual must be in [1, H={h}]; got {hidden_actual}")
    if zero_interleaved_pad and h_u != h and (h % 4 or (h - h_u) % 4):
        raise ValueError(f"interleaved padding needs H and H - H_u divisible by 4; got H={h}, H_u={h_u}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0; got {eps}")
    if not 1 <= k <= vocab_size:
        raise ValueError(f"k must be in [1, V={vocab_size}]; got {k}")
    if sampling_params is not None:
        validate_params(sampling_params, gbs if rows is None else rows)
    return gbs, h, h_u


# ---------------------------------------------------------------------------------------
# the two halves: shard logits (before any collective) and the owned rows' tail
# ---------------------------------------------------------------------------------------
def shard_logits(hidden_states, gamma, lm_head_weight_t, *, eps=1e-5, hidden_actual=None,
                 zero_interleaved_pad=True, deferred_rms=True, rows=slice(None)) -> torch.Tensor:
    """Norm + GEMM + scale for a row block: [rows, H] -> [rows, V_s] fp32 (declared order
    in the module docstring). Row-independent: a block alone equals the same rows sliced
    from the full call, byte for byte. Inputs are assumed validated."""
    h = hidden_states.shape[1]
    h_u = h if hidden_actual is None else hidden_actual
    real = pad_mask(h, h_u, zero_interleaved_pad)  # [H]
    g = gamma.reshape(h)
    x = hidden_states[rows].to(torch.float32)  # [gbs, H], exact widen
    x = torch.where(real, x, torch.zeros((), dtype=torch.float32))
    ssq = sum_squares(x, SSQ_ORDER)  # [gbs]
    s = sqrt_rn32(ssq / torch.tensor(float(h_u), dtype=torch.float32)
                  + torch.tensor(eps, dtype=torch.float32))
    rms = torch.tensor(1.0, dtype=torch.float32) / s  # [gbs]
    if deferred_rms:
        a = (x * g).to(torch.bfloat16)
    else:
        a = ((x * rms[:, None]) * g).to(torch.bfloat16)
    a = torch.where(real, a, torch.zeros((), dtype=torch.bfloat16))  # [gbs, H]
    acc = gemm_bf16_chain(a, lm_head_weight_t)  # [gbs, V_s]
    return acc * rms[:, None] if deferred_rms else acc


def rows_tail(rows_bf16, *, k, sampling_params=None, nan_fold=False, debug_taps=False,
              chunk=TOPK_CHUNK) -> dict:
    """Top-k and the sampler on full-vocab bf16 rows [R, V] (column j = vocab id j).
    Returns topk_values [R, k] bf16, topk_indices [R, k] int64, and with sampling_params
    tokens [R] int64, logprobs [R] fp32, truncated [R] bool; taps when debug_taps."""
    vals, ids, taps = exact_topk(rows_bf16, k, nan_fold=nan_fold, chunk=chunk, debug_taps=debug_taps)
    out = {"topk_values": vals, "topk_indices": ids, "taps": taps}
    if sampling_params is not None:
        tok, lp, tr = sample_rows(vals, ids, rows_bf16, sampling_params, nan_fold=nan_fold)
        out.update(tokens=tok, logprobs=lp, truncated=tr)
    return out


def decode_tail(hidden_states, gamma, lm_head_weight_t, *, eps=1e-5, hidden_actual=None,
                zero_interleaved_pad=True, k=256, sampling_params=None, group=None, hops=None,
                batch_groups=1, fence=False, emit_logits=True, debug_taps=False,
                deferred_rms=True, nan_fold=False, **parallel_kw) -> TailOutput:
    """The decode sampling tail (SPEC 1-3). One rank unless `group` or `hops` is given, in
    which case the vocab-parallel path (lmtail.exchange) runs with ONE all-to-all per hop.

    hidden_states [gbs, H] fp32/fp16/bf16 (16-bit is widened exactly: the same bytes as a
    pre-widened fp32 copy); gamma [H] or [1, H] fp32; lm_head_weight_t [H, V_s] bf16
    C-contiguous (this rank's vocab shard); sampling_params [R, 3|4|5] fp32 for the rows
    this rank owns (top_k, top_p, temperature[, u[, min_p]]).
    Returns TailOutput; numerics in the module docstring. Deterministic: the outputs of a
    row depend only on that row's inputs (any batch, thread count, rank layout).
    """
    if group is not None or hops is not None:
        from .exchange import decode_tail_parallel

        return decode_tail_parallel(
            hidden_states, gamma, lm_head_weight_t, eps=eps, hidden_actual=hidden_actual,
            zero_interleaved_pad=zero_interleaved_pad, k=k, sampling_params=sampling_params,
            group=group, hops=hops, batch_groups=batch_groups, fence=fence,
            emit_logits=emit_logits, debug_taps=debug_taps, deferred_rms=deferred_rms,
            nan_fold=nan_fold, **parallel_kw)
    if batch_groups != 1 or fence:
        raise ValueError(f"batch_groups and fence need a process group; got batch_groups={batch_groups}, fence={fence}")
    if parallel_kw:
        raise ValueError(f"unexpected keyword arguments: {sorted(parallel_kw)}")
    validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, eps=eps, hidden_actual=hidden_actual,
                         zero_interleaved_pad=zero_interleaved_pad, k=k, sampling_params=sampling_params,
                         vocab_size=lm_head_weight_t.shape[1])
    logits = shard_logits(hidden_states, gamma, lm_head_weight_t, eps=eps, hidden_actual=hidden_actual,
                          zero_interleaved_pad=zero_interleaved_pad, deferred_rms=deferred_rms)
    mirror = logits.to(torch.bfloat16)  # [gbs, V]
    out = rows_tail(mirror, k=k, sampling_params=sampling_params, nan_fold=nan_fold, debug_taps=debug_taps)
    return TailOutput(logits=logits if emit_logits else None, **out)
