"""The decode sampling tail, composed: final RMSNorm -> lm_head GEMM -> exchange -> top-k -> sampler.

    hidden [gbs, H] fp32|fp16|bf16 --widen (exact)--> x [gbs, H] fp32, pad lanes := 0
      ssq  = sum_squares(x, strided(256))                      fp32, declared order
      rms  = 1 / sqrt(ssq / H_u + eps)                         fp32, IEEE div, sqrt_rn32
      deferred_rms=True : a = bf16(fp32(x * gamma));  logits = fp32(gemm(a, W) * rms)
      deferred_rms=False: a = bf16(fp32(fp32(x * rms) * gamma));  logits = gemm(a, W)
      head_input="bf16x2" (deferred): a_hi = bf16(g), a_lo = bf16(fp32(g - a_hi)) (0 where a_hi is inf),
               g = fp32(x * gamma);
               acc = fp32(gemm(a_hi, W) + gemm(a_lo, W)) (one GEMM over the 2 gbs rows); logits = fp32(acc * rms)
      head_input="fp32" (deferred; W a kernels.quant.gemm_q.QuantWeight "Q8_0" (V_s, H), the GGUF rows):
               g = fp32(x * gamma) (pad lanes 0, no activation rounding); acc = gemm_q(g, W) in the
               declared order "lanes32" (docs/quant.md: the exact values fp32(d) * q, 32 lane fma
               chains per block, halving tree, IEEE, no FTZ/DAZ); logits = fp32(acc * rms)
      processing (decode_tail(processing=...), rows with a LogitProcessing only; lmtail.tail.processors):
        logits = processors(logits), on each rank's own shard lanes, before any exchange:
        repetition, frequency, presence, logit_bias (fp32 rounding after each), then the
        allowed mask (-inf); rows without processing keep the GEMM's bytes
        gemm = kernels.gemm.bf16.gemm_bf16(order=gemm_order): "amx32" (default) per element
               32-lane blocks of even/odd fp32 fma chains, FTZ/DAZ; "chain" one chain over h;
               "dp32" per 32-lane block one odd-then-even fma chain, FTZ/DAZ
    exchange "candidates" (default; lmtail.tail.candidates):
      per row and shard: exact fp32 top-(k+1) keys + 256 global-chunk mass partials
      one rank : the same partials over the full row; the wire (pack / unpack) is the
                 identity on every byte an output reads there, so it is skipped
      VTP ranks: exchange.exchange_rows moves the packed partials ([gbs, B] bytes) into
                 [R, VTP*B]; the owner merges them --> candidates [R, k] fp32, the sampler
                 (sampler.plan_on) on fp32 values --> tokens [R]
    exchange "mirror":
      mirror = bf16(logits)                                    [gbs, V_s]
      one rank : mirror is already [R, V] (R = gbs, V = V_s)
      VTP ranks: exchange.exchange_rows moves the mirror's bytes into [R, V] owned rows
      owned rows [R, V] --rows_tail--> candidates [R, k] bf16, tokens [R]
        tail_path "fused" (default): kernels.tail.rows_tail.rows_tail_fused, one pass per row
        tail_path "reference": topk.exact_topk --> sampler.sample_rows (the same bytes)

This module is the one place the tail is composed, for one rank or many: `decode_tail`
validates once (`validate_tail_inputs`, the tail's one boundary check; the eps = 0 rule
rides on the norm's own sum of squares in `normed_rows`), then runs the unchecked halves
`normed_rows` + `logits_from` (norm + GEMM + scale; `shard_logits` for a row block) and
`rows_tail_unchecked` (top-k + sampler) around the transport. The public `rows_tail`
checks its own arguments, then runs the same unchecked code. The exchange moves bytes
only, so every output is bitwise the single-rank call's on the same global inputs, for
any VTP, hops and batch groups.

Numerics declared (`tail_decl`; docs/numerics.md has the float64 bounds):
  ssq: fp32 fma chains, strided(256) over the H padded lanes (pad lanes are exact zeros),
       depth ceil(H/256) + 5 + 7.
  gemm: kernels.gemm.bf16.gemm_bf16 in TailConfig.gemm_order (docs/gemm.md). "amx32" (the
        default): per output, 32-lane blocks in order, each an even and an odd fp32 fma
        chain of 16 from +0, acc = acc + (e + o); subnormal inputs read as 0 (DAZ), tiny
        results flushed (FTZ); depth 16 + 1 + ceil(H/32). "chain": one fp32 fma chain,
        sequential over h = 0..H-1, IEEE subnormals, depth H. "dp32": per output, 32-lane
        blocks in order, each one fp32 fma chain from +0 over the lane pairs (odd lane, then
        even), acc = acc + t, FTZ/DAZ as amx32; depth 32 + ceil(H/32).
  rounding points: x*gamma (fp32), a (bf16), ssq/H_u, +eps, sqrt, 1/s (fp32 each),
       acc*rms (fp32), [processors: one fp32 point per step, processors.processors_decl],
       mirror (bf16).
  Q8_0 head (head_input "fp32"): no a:bf16 point; the gemm sum is
       kernels.quant.gemm_q.gemm_q_decl(H, "Q8_0")'s (fp32, depth H/32 + 5, flush=False).
Every step is row-independent, so a row's bytes never depend on the batch it is in.

Shape legend: gbs global batch rows, H hidden (padded), H_u real hidden, V_s vocab shard,
V full vocab, R rows this rank owns (= gbs on one rank), k candidates.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass, fields, replace

import torch

from . import candidates, exchange
from ..checks import gamma32, is_int, nan_policy, need, need_tensor, undefined_rows
from . import config as config_mod
from .config import TAIL_PATHS, TailConfig, resolve
from ..kernels.gemm.bf16 import PackedWeight, gemm_bf16, gemm_decl
from ..kernels.quant.gemm_q import QuantWeight, gemm_q, gemm_q_decl
from ..kernels.tail import rows_tail as rows_kernel
from ..kernels.tail import shard_partials as sp_kernel
from .layout import owned_rows, validate_layout
from ..numerics import Decl, SumDecl, sqrt_rn32
from ..orders import strided, sum_squares
from .processors import apply_plans, plan_processing, processors_decl
from .sampler import decide, sampling_plan, validate_params
from .topk import exact_topk

SSQ_ORDER = strided(256)
TOPK_CHUNK = 4096
DEFAULT_TIMEOUT_S = exchange.DEFAULT_TIMEOUT_S


@dataclass(frozen=True)
class TailOutput:
    """What decode_tail (and rows_tail) return; fields not asked for are None."""

    topk_values: torch.Tensor  # [R, k] descending: fp32 (exchange "candidates") or bf16 ("mirror")
    topk_indices: torch.Tensor  # [R, k] int64 global vocab ids
    logits: torch.Tensor | None = None  # [gbs, V_s] fp32 pre-collective, after processing
    tokens: torch.Tensor | None = None  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] fp32, raw log_softmax over the full row
    truncated: torch.Tensor | None = None  # [R] bool
    # [R] float64 with sampling_params: lse1, the T = 1 log-sum-exp of the full row the
    # decisions see (fp32 logits: "candidates"; their bf16 mirror: "mirror"), so that
    # logprobs = fp32(v_tok - lse) and any candidate's logprob is fp32(v - lse)
    lse: torch.Tensor | None = None
    taps: dict | None = None


def tail_decl(h: int, deferred_rms: bool = True, gemm_order: str = TailConfig.gemm_order,
              exchange: str = TailConfig.exchange, head_input: str = TailConfig.head_input,
              processing: bool = False) -> Decl:
    """The declared numerics of the tail's norm + GEMM for hidden width h (the GEMM's sum
    is kernels.gemm.bf16.gemm_decl(h, gemm_order)'s; the default order is TailConfig's). With
    exchange "mirror" the decisions see the bf16 mirror (rounding point "mirror:bf16");
    with "candidates" they see the fp32 logits (no mirror rounding point). head_input
    "bf16x2" adds the rounding points a_lo:bf16 and acc_hi+acc_lo:fp32 (each GEMM has the
    gemm sum's declaration). head_input "fp32" (the Q8_0 head, deferred only): no a:bf16
    point (the GEMM reads g = fp32(x*gamma) itself), the weight's values exact
    ("W:Q8_0 exact"), and the gemm sum is kernels.quant.gemm_q.gemm_q_decl(h, "Q8_0")'s (h a
    multiple of 32; gemm_order does not apply). processing (default False): the rows with a
    LogitProcessing: the seam's rounding points (processors.processors_decl, prefixed
    "processors:") come right after acc*rms, before the mirror and the exchange."""
    q8 = head_input == "fp32"
    split = ("a_lo:bf16", "acc_hi+acc_lo:fp32") if head_input == "bf16x2" else ()
    act = ("x*gamma:fp32", "W:Q8_0 exact") if q8 else ("x*gamma:fp32", "a:bf16")
    pts = (act + split + ("ssq/H_u:fp32", "+eps:fp32", "sqrt:fp32", "1/s:fp32",
                          "acc*rms:fp32") if deferred_rms else
           ("ssq/H_u:fp32", "+eps:fp32", "sqrt:fp32", "1/s:fp32", "x*rms:fp32",
            "(x*rms)*gamma:fp32", "a:bf16"))
    gemm = gemm_q_decl(h, "Q8_0").sum("gemm") if q8 else gemm_decl(h, gemm_order).sum("gemm")
    if processing:
        pts = pts + tuple(f"processors:{p}" for p in processors_decl().rounding_points)
    return Decl(
        op="decode_tail" + ("" if deferred_rms else "[legacy]") + ("" if exchange == "mirror" else f"[{exchange}]")
        + {"bf16": "", "fp32": "[q8_0]"}.get(head_input, f"[{head_input}]"),
        rounding_points=pts + (("mirror:bf16",) if exchange == "mirror" else ()),
        sums=(SumDecl("ssq", "fp32", SSQ_ORDER.depth(h), SSQ_ORDER.describe(h)),
              gemm),
    )


# ---------------------------------------------------------------------------------------
# validation: the tail's one boundary check
# ---------------------------------------------------------------------------------------
def pad_mask(h: int, h_u: int, interleaved: bool) -> torch.Tensor:
    """[H] bool: True on real lanes. interleaved: 4 groups of H/4, each ending in
    (H-H_u)/4 pad lanes (GPT-OSS mxfp4); else the pad is the tail [H_u:]."""
    lane = torch.arange(h)
    if not interleaved or h == h_u:
        return lane < h_u
    g = h // 4
    return (lane % g) < (g - (h - h_u) // 4)


def validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, sampling_params,
                         config: TailConfig, *, vocab_size: int, rows: int | None = None) -> None:
    """The tail's one boundary check: ValueError (TypeError for a non-tensor) with
    expected-vs-got for anything the tail cannot take with these tensors (config's fields
    on their own were checked when it was made: TailConfig). vocab_size: V (the bound of k);
    rows: R, the sampling_params rows (default gbs). The one input rule it cannot decide
    without the norm's own pass (eps = 0 with a row whose real lanes square to 0) is
    checked by that pass (`normed_rows`), before the GEMM and any collective."""
    x, w, cfg = hidden_states, lm_head_weight_t, config
    if not isinstance(cfg, TailConfig):
        raise ValueError(f"config must be a TailConfig; got {type(cfg).__name__}")
    if not (isinstance(x, torch.Tensor) and x.device.type == "cpu"):  # checks' words, built only on failure
        need_tensor("hidden_states", x, "[gbs, H]")
    if not (x.dim() == 2):
        raise ValueError(f"hidden_states must be [gbs, H]; got {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"hidden_states must be float32, float16 or bfloat16; got {x.dtype}")
    gbs, h = x.shape
    if not (gbs >= 1 and h >= 1):
        raise ValueError(f"hidden_states must be non-empty [gbs, H]; got {tuple(x.shape)}")
    g_h = gamma.shape[-1] if isinstance(gamma, torch.Tensor) and gamma.dim() in (1, 2) else None
    w_h = (w.shape[1] if isinstance(w, QuantWeight) else w.shape[0]) if len(getattr(w, "shape", ())) == 2 else None
    if g_h is not None and g_h == w_h != h:  # gamma and the head agree on H: x is the odd one
        raise ValueError(f"hidden_states must be [gbs, H={g_h}] (gamma {tuple(gamma.shape)} and lm_head_weight_t "
                         f"{tuple(w.shape)} agree on H={g_h}); got {tuple(x.shape)}")
    if not (isinstance(gamma, torch.Tensor) and gamma.device.type == "cpu"
            and gamma.dtype in (torch.bfloat16, torch.float32) and tuple(gamma.shape) in ((h,), (1, h))):
        gamma32(gamma, h)  # raises with its words
    if isinstance(w, QuantWeight):
        if not (w.fmt == "Q8_0"):
            raise ValueError(f"lm_head_weight_t: a QuantWeight head must be fmt 'Q8_0'; got {w.fmt!r}")
        if not (w.shape[1] == h):
            raise ValueError(f"lm_head_weight_t: a Q8_0 head must be (V_s, K=H={h}); got {w.shape} (K={w.shape[1]})")
        if not (w.shape[0] >= 1):
            raise ValueError(f"lm_head_weight_t: a Q8_0 head needs V_s >= 1 rows; got {w.shape}")
    elif isinstance(w, PackedWeight):
        if not (w.H == h):
            raise ValueError(f"lm_head_weight_t: a PackedWeight head must be [H={h}, V_s]; got {w.shape}")
        if cfg.gemm_order not in ("amx32", "dp32"):
            raise ValueError(f"gemm_order must be 'amx32' or 'dp32' with a PackedWeight head; got {cfg.gemm_order!r}")
    else:
        if not (isinstance(w, torch.Tensor) and w.device.type == "cpu"):
            need_tensor("lm_head_weight_t", w, f"[H={h}, V_s] bf16 or a kernels.quant.gemm_q.QuantWeight Q8_0 (V_s, H={h})")
        if not (w.dim() == 2 and w.shape[0] == h):
            raise ValueError(f"lm_head_weight_t must be [H={h}, V_s]; got {tuple(w.shape)}")
        if not (w.dtype == torch.bfloat16):
            raise ValueError(f"lm_head_weight_t must be bfloat16; got {w.dtype}")
        if not w.is_contiguous():
            raise ValueError("lm_head_weight_t must be C-contiguous (pass the transposed weight, "
                             "e.g. w.t().contiguous()); got a strided view")
    h_u = h if cfg.hidden_actual is None else cfg.hidden_actual
    if not (is_int(h_u) and 1 <= h_u <= h):
        raise ValueError(f"hidden_actual must be an int in [1, H={h}]; got {cfg.hidden_actual!r}")
    if cfg.zero_interleaved_pad and h_u != h and (h % 4 or (h - h_u) % 4):
        raise ValueError(f"hidden_actual: interleaved padding needs H and H - H_u divisible by 4; got H={h}, H_u={h_u}")
    if not (vocab_size < 1 << 32):
        raise ValueError(f"V must be < 2**32 (vocab ids are 32-bit in the top-k keys); got {vocab_size}")
    if not (is_int(cfg.k) and 1 <= cfg.k <= vocab_size):
        raise ValueError(f"k must be an int in [1, V={vocab_size}]; got {cfg.k!r}" + (
            " (k candidates per row cannot exceed the vocabulary width V = V_s x ranks, and k is "
            f"never clamped: pass k=min(256, V), here k<={vocab_size})"
            if is_int(cfg.k) and cfg.k > vocab_size else ""))
    _check_head_kind(w, h, cfg)
    if sampling_params is not None:
        validate_params(sampling_params, gbs if rows is None else rows)


def _check_head_kind(w, h: int, cfg: TailConfig) -> None:
    """The head's storage and the options that go with it (fields already in their sets):
    a QuantWeight (Q8_0) head needs head_input "fp32" and the default gemm_order; "fp32"
    needs a QuantWeight."""
    if not isinstance(w, QuantWeight):
        if cfg.head_input == "fp32":
            got = "a PackedWeight" if isinstance(w, PackedWeight) else f"a {w.dtype} tensor"
            raise ValueError("head_input='fp32' needs a kernels.quant.gemm_q.QuantWeight Q8_0 head "
                             f"(V_s, H={h}) as lm_head_weight_t; got {got}")
        return
    if cfg.head_input != "fp32":
        raise ValueError("head_input must be 'fp32' with a Q8_0 head (the GEMM reads fp32(x*gamma), "
                         f"unrounded); got {cfg.head_input!r}")
    if cfg.gemm_order != TailConfig.gemm_order:
        raise ValueError(f"gemm_order must be the default {TailConfig.gemm_order!r} with a Q8_0 head (its sum is "
                         f"gemm_q's declared order lanes32, not a gemm_bf16 order); got {cfg.gemm_order!r}")


def head_shard_width(w) -> int:
    """V_s of a head shard: [H, V_s] bf16 tensor or PackedWeight -> V_s (its last dim);
    QuantWeight (V_s, H) -> V_s."""
    return w.shape[0] if isinstance(w, QuantWeight) else w.shape[-1]


def head_shard(w, r: int, vtp: int):
    """Rank r's shard of a full-vocab head (V % vtp == 0): [H, V] bf16 -> columns
    [H, V_s] (contiguous); QuantWeight (V, H) -> rows r*V_s:(r+1)*V_s (a view, no copy)."""
    if isinstance(w, PackedWeight):
        raise ValueError("head_shard takes the plain [H, V] head (pack each shard after "
                         "sharding: kernels.gemm.bf16.weight_for); got a PackedWeight")
    vs = head_shard_width(w) // vtp
    if isinstance(w, QuantWeight):
        return w.rows(r * vs, (r + 1) * vs)
    return w[:, r * vs:(r + 1) * vs].contiguous()


# ---------------------------------------------------------------------------------------
# the two halves: shard logits (before any collective) and the owned rows' tail
# ---------------------------------------------------------------------------------------
def normed_rows(hidden_states, gamma, config: TailConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm half of `shard_logits` for every row: (a [gbs, H] bf16, rms [gbs] fp32),
    a the GEMM's input (pad lanes 0; head_input "fp32": g = fp32(x*gamma) [gbs, H] fp32),
    rms the 1/sqrt scale (module docstring). Inputs validated. With fp32(eps) = 0, a row
    whose real lanes square to 0 (no rms) is a ValueError naming it, raised here, before
    the GEMM: this pass is the tail's only sum of squares. With deferred_rms the pass is
    one C call (kernels.tail.shard_partials.tail_norm, the same bytes; the torch ops below where
    it declines: no compiled kernel, or a NaN on a real lane)."""
    cfg = config
    h = hidden_states.shape[1]
    h_u = h if cfg.hidden_actual is None else cfg.hidden_actual
    if cfg.deferred_rms:
        fast = _normed_rows_c(hidden_states, gamma, cfg, h, h_u)
        if fast is not None:
            return fast
    real = pad_mask(h, h_u, cfg.zero_interleaved_pad)  # [H]
    g = gamma.reshape(h).to(torch.float32)  # [H], exact widening
    x = hidden_states.to(torch.float32)  # [gbs, H], exact widen
    if h_u != h:  # else every lane is real
        x = torch.where(real, x, torch.zeros((), dtype=torch.float32))
    ssq = sum_squares(x, SSQ_ORDER)  # [gbs]
    m = ssq / torch.tensor(float(h_u), dtype=torch.float32)  # [gbs]
    undefined_rows(m, cfg.eps, "hidden_states")  # m == 0 with eps32 = 0: 1/sqrt(0)
    s = sqrt_rn32(m + torch.tensor(cfg.eps, dtype=torch.float32))
    rms = torch.tensor(1.0, dtype=torch.float32) / s  # [gbs]
    if cfg.deferred_rms:
        return _deferred_input(x * g, None if h_u == h else real, cfg.head_input), rms
    a = ((x * rms[:, None]) * g).to(torch.bfloat16)
    if h_u != h:
        a = torch.where(real, a, torch.zeros((), dtype=torch.bfloat16))  # [gbs, H]
    return a, rms  # [gbs, H], [gbs]


def _deferred_input(xg, real, head_input: str) -> torch.Tensor:
    """The head GEMM's input from xg = fp32(x * gamma) [gbs, H] (deferred rms): "fp32" xg
    itself (the Q8_0 head reads it unrounded), "bf16" bf16(xg), "bf16x2" [gbs, 2, H] (hi =
    bf16(xg), lo = bf16(fp32(xg - hi)), lo 0 beside an inf hi); pad lanes (real [H] False;
    None: every lane real) +0."""
    if head_input == "fp32":
        a = xg
    elif head_input == "bf16x2":
        hi = xg.to(torch.bfloat16)
        lo = torch.where(torch.isinf(hi), torch.zeros((), dtype=torch.float32),
                         xg - hi.to(torch.float32)).to(torch.bfloat16)  # exact in fp32; 0 beside an inf
        a = torch.stack([hi, lo], dim=1)  # [gbs, 2, H]
    else:
        a = xg.to(torch.bfloat16)  # [gbs, H]
    if real is not None:
        a = torch.where(real, a, torch.zeros((), dtype=a.dtype))
    return a


def _normed_rows_c(hidden_states, gamma, cfg: TailConfig, h: int, h_u: int):
    """normed_rows (deferred rms) with its norm in one C pass (kernels.tail.shard_partials.tail_norm:
    the same ssq order, roundings and pad lanes; the head input's bf16 roundings are
    _deferred_input's torch ops), or None where the torch ops decide (no compiled kernel, a NaN on a real lane)."""
    real = None if h_u == h else pad_mask(h, h_u, cfg.zero_interleaved_pad)  # [H] | None
    got = sp_kernel.tail_norm(hidden_states.to(torch.float32), gamma.reshape(h).to(torch.float32), real,
                              h_u, cfg.eps)
    if got is None:
        return None
    xg, m, rms = got  # [gbs, H] fp32 x*gamma (pad lanes +0), [gbs] ssq/H_u, [gbs] 1/sqrt
    if ctypes.c_float(cfg.eps).value == 0:  # fp32(eps) = 0: a zero row has no rms
        undefined_rows(m, cfg.eps, "hidden_states")
    return _deferred_input(xg, real, cfg.head_input), rms


def logits_from(a, rms, lm_head_weight_t, config: TailConfig) -> torch.Tensor:
    """The GEMM half of `shard_logits`: a [n, H] bf16 ([n, 2, H] with head_input "bf16x2";
    [n, H] fp32 with "fp32" and a QuantWeight head), rms [n] fp32 (from normed_rows, any
    row block of them) -> [n, V_s] fp32."""
    if isinstance(lm_head_weight_t, QuantWeight):  # Q8_0 head: gemm_q, lanes32
        acc = gemm_q(a, lm_head_weight_t)  # [n, V_s] fp32
    elif a.dim() == 3:  # bf16x2: one GEMM over the 2n rows (a_hi, a_lo of each row, adjacent)
        n, _, h = a.shape
        acc2 = gemm_bf16(a.reshape(2 * n, h), lm_head_weight_t, order=config.gemm_order)  # [2n, V_s]
        acc2 = acc2.view(n, 2, -1)
        acc = acc2[:, 0] + acc2[:, 1]  # [n, V_s] fp32
    else:
        acc = gemm_bf16(a, lm_head_weight_t, order=config.gemm_order)  # [n, V_s] fp32
    return sp_kernel.scale_rows(acc, rms) if config.deferred_rms else acc  # fp32(acc * rms)


def shard_logits(hidden_states, gamma, lm_head_weight_t, *, config: TailConfig = TailConfig(),
                 rows: slice = slice(None)) -> torch.Tensor:
    """Norm + GEMM + scale for a row block: [rows, H] -> [rows, V_s] fp32 (declared order
    in the module docstring): logits_from(*normed_rows(hidden_states[rows], ...)).
    Row-independent: a block alone equals the same rows sliced from the full call, byte
    for byte. Inputs are assumed validated (fp32(eps) = 0 with a zero row: ValueError)."""
    a, rms = normed_rows(hidden_states[rows], gamma, config)
    return logits_from(a, rms, lm_head_weight_t, config)


def rows_tail(rows_bf16, *, k: int, sampling_params=None, nan_fold: bool = False,
              debug_taps: bool = False, path: str = "fused", backend: str | None = None,
              threads: int | None = None, chunk: int = TOPK_CHUNK) -> TailOutput:
    """Exact top-k and the sampler on full-vocab bf16 rows [R, V] (column j = vocab id j).

    rows_bf16 [R, V] bf16 CPU; 1 <= k <= V; sampling_params (default None: top-k only)
    or [R, 3|4|5] fp32 (sampler.validate_params; [R, 3] draws u = 0.5). Defaults:
    nan_fold=False, debug_taps=False, path="fused", backend=None, threads=None,
    chunk=TOPK_CHUNK (4096, exact_topk's stage-1 width). Returns TailOutput with topk_values [R, k] bf16 (descending,
    ties to the lower id), topk_indices [R, k] int64, and with sampling_params tokens [R]
    int64, logprobs [R] fp32, truncated [R] bool, lse [R] float64 (the sampler's lse1);
    taps (exact_topk's staged taps, chunk wide) when debug_taps; logits None. Semantics and numerics: lmtail.tail.topk and
    lmtail.tail.sampler (declared: kernels.tail.rows_tail.rows_tail_decl).
    path "reference": topk.exact_topk + sampler.sample_rows, the declared reference.
    path "fused" (default): kernels.tail.rows_tail.rows_tail_fused, one pass per row, the same
    bytes; the rows it leaves undecided (a NaN lane without nan_fold, a zero row maximum)
    go through sampler.sample_rows on its candidates. Without a C compiler "fused" runs
    the reference (the kernel loader warns once).
    backend: one of kernels.tail.rows_tail.available_backends() (None: the kernel's first
    choice; only with path "fused"); threads: the kernel's worker threads (None: torch.get_num_threads()).
    No byte depends on path, backend, threads or the batch.
    Raises TypeError for a non-tensor, ValueError naming the argument for a bad one.
    """
    need(path in TAIL_PATHS, f"path must be one of {TAIL_PATHS}; got {path!r}")
    rows_kernel.check_arguments(rows_bf16, k=k, nan_fold=nan_fold, threads=threads)
    need(isinstance(debug_taps, bool), f"debug_taps must be a bool; got {debug_taps!r}")
    need(is_int(chunk) and chunk >= 1, f"chunk must be an int >= 1; got {chunk!r}")
    fused = path == "fused" and bool(rows_kernel.available_backends())
    need(backend is None or fused, f"backend applies to path 'fused' with a built kernel; got "
                                   f"backend={backend!r} with path={path!r}")
    if sampling_params is not None:
        validate_params(sampling_params, rows_bf16.shape[0])
    return rows_tail_unchecked(rows_bf16, k=k, sampling_params=sampling_params, nan_fold=nan_fold,
                               debug_taps=debug_taps, path=path, backend=backend, threads=threads,
                               chunk=chunk)


def rows_tail_unchecked(rows_bf16, *, k, sampling_params, nan_fold, debug_taps, path="fused",
                        backend=None, threads=None, chunk=TOPK_CHUNK, nan_policy=False) -> TailOutput:
    """`rows_tail` on arguments the caller has validated (decode_tail's boundary check or
    rows_tail's): the same bytes, no checks of its own. nan_policy (decode_tail's, with
    sampling_params): `check_nan_rows` before any row is sampled; the fused path reads
    it off the kernel's outputs (a NaN lane without nan_fold leaves its row undecided;
    with nan_fold an all-NaN row's first candidate is NaN), so only those rows are scanned."""
    if path != "fused" or not rows_kernel.available_backends():
        if nan_policy and sampling_params is not None:
            check_nan_rows(rows_bf16, nan_fold=nan_fold)
        return _rows_tail_reference(rows_bf16, k, sampling_params, nan_fold, debug_taps, chunk)
    f = rows_kernel.rows_tail_fused(rows_bf16, k=k, sampling_params=sampling_params, nan_fold=nan_fold,
                                    backend=backend, threads=threads, debug_mass=sampling_params is not None)
    taps = exact_topk(rows_bf16, k=k, nan_fold=nan_fold, chunk=chunk, debug_taps=True)[2] if debug_taps else None
    if sampling_params is None:
        return TailOutput(topk_values=f.topk_values, topk_indices=f.topk_indices, taps=taps)
    if nan_policy:
        suspects = torch.isnan(f.topk_values[:, 0]) | f.undecided  # [R]: every row holding a NaN is here
        if bool(suspects.any()):
            check_nan_rows(rows_bf16, nan_fold=nan_fold, only=torch.nonzero(suspects)[:, 0])
    lse = f.debug_mass[:, 1].contiguous()  # [R] the kernel's lse1 (NaN on undecided rows)
    left = torch.nonzero(f.undecided)[:, 0]  # [n] rows the reference sampler decides
    if left.numel():
        plan = sampling_plan(f.topk_values[left], rows_bf16[left], sampling_params[left], nan_fold=nan_fold)
        f.tokens[left], f.logprobs[left], f.truncated[left] = decide(plan, f.topk_values[left], f.topk_indices[left])
        lse[left] = plan["lse1"]
    return TailOutput(topk_values=f.topk_values, topk_indices=f.topk_indices, tokens=f.tokens,
                      logprobs=f.logprobs, truncated=f.truncated, lse=lse, taps=taps)


def _rows_tail_reference(rows_bf16, k, sampling_params, nan_fold, debug_taps, chunk) -> TailOutput:
    """rows_tail's declared reference path: exact_topk, then sample_rows."""
    vals, ids, taps = exact_topk(rows_bf16, k=k, nan_fold=nan_fold, chunk=chunk, debug_taps=debug_taps)
    if sampling_params is None:
        return TailOutput(topk_values=vals, topk_indices=ids, taps=taps)
    plan = sampling_plan(vals, rows_bf16, sampling_params, nan_fold=nan_fold)  # sampler.sample_rows' steps
    tok, lp, tr = decide(plan, vals, ids)
    return TailOutput(topk_values=vals, topk_indices=ids, tokens=tok, logprobs=lp, truncated=tr,
                      lse=plan["lse1"], taps=taps)


def check_nan_rows(rows_bf16: torch.Tensor, *, nan_fold: bool, only: torch.Tensor | None = None) -> None:
    """The sampler's NaN policy on rows [R, V] bf16: a row holding NaN is a ValueError
    naming the rows unless nan_fold (then its NaN lanes carry no mass); a row of NaN only
    has no distribution at all and is a ValueError either way. Never a silent change of a
    row's sampling mode. only: [n] int64 row indices to scan (the others are known
    NaN-free); None scans every row."""
    nan = torch.isnan(rows_bf16 if only is None else rows_bf16[only])  # [R | n, V]
    ids = torch.arange(rows_bf16.shape[0]) if only is None else only  # [R | n]
    nan_policy(ids, nan.any(dim=1), nan.all(dim=1), nan_fold=nan_fold)


def owned_candidates(merged, sampling_params, cfg: TailConfig, logits, v: int) -> TailOutput:
    """The owned rows' tail on merged candidates (lmtail.tail.candidates): fp32 top-k, and with
    sampling_params the NaN policy from the NaN counts, then the sampler on fp32 values.
    taps (debug_taps): the merged row statistics (outside value, masses, NaN counts)."""
    lg = logits if cfg.emit_logits else None
    taps = None
    if cfg.debug_taps:
        taps = {"outside": merged.outside, "has_outside": merged.has_outside, "nans": merged.nans}
        if merged.mass is not None:
            taps.update(zip(("m1", "S1", "mT", "ST"), merged.mass))
    if sampling_params is None:
        return TailOutput(topk_values=merged.values, topk_indices=merged.ids, logits=lg, taps=taps)
    candidates.check_nans(merged.nans, v=v, nan_fold=cfg.nan_fold)
    tok, lp, tr = candidates.sample_merged(merged, sampling_params, nan_fold=cfg.nan_fold)
    lse = candidates.MergedStats(merged, sampling_params, cfg.nan_fold).lse1()  # [R] the lse1 lp used
    return TailOutput(topk_values=merged.values, topk_indices=merged.ids, logits=lg, tokens=tok,
                      logprobs=lp, truncated=tr, lse=lse, taps=taps)


def owned_tail(rows_bf16, sampling_params, cfg: TailConfig, logits) -> TailOutput:
    """The owned rows' tail: rows_tail with the sampler's NaN policy (check_nan_rows)."""
    out = rows_tail_unchecked(rows_bf16, k=cfg.k, sampling_params=sampling_params, nan_fold=cfg.nan_fold,
                              debug_taps=cfg.debug_taps, path=cfg.tail_path, nan_policy=True)
    return replace(out, logits=logits if cfg.emit_logits else None)


# ---------------------------------------------------------------------------------------
# the public entry point
# ---------------------------------------------------------------------------------------
def decode_tail(hidden_states, gamma, lm_head_weight_t, *, eps: float = 1e-5,
                hidden_actual: int | None = None, zero_interleaved_pad: bool = True, k: int = 256,
                sampling_params=None, processing=None, group=None, hops=None, batch_groups: int = 1,
                fence: bool = False, emit_logits: bool = True, debug_taps: bool = False,
                deferred_rms: bool = True, nan_fold: bool = False, gemm_order: str = TailConfig.gemm_order,
                tail_path: str = TailConfig.tail_path, exchange: str = TailConfig.exchange,
                head_input: str = TailConfig.head_input,
                timeout: float = DEFAULT_TIMEOUT_S, config: TailConfig | None = None) -> TailOutput:
    """The decode sampling tail. One rank unless `group` or `hops` is given, in which case
    it is collective over the vocab-parallel group with ONE all-to-all per hop.

    hidden_states [gbs, H] fp32/fp16/bf16 (16-bit is widened exactly: the same bytes as a
    pre-widened fp32 copy), the same on every rank; gamma [H] or [1, H] fp32 or bf16
    (widened exactly); lm_head_weight_t [H, V_s] bf16 C-contiguous: this rank's shard of
    the transposed lm_head weight (the one name for it across lmtail's public API; from a
    model's [V, H] weight: w[r*V_s:(r+1)*V_s].t().contiguous()), or a
    kernels.quant.gemm_q.QuantWeight "Q8_0" of shape (V_s, H) (the GGUF head's rows r*V_s..,
    `QuantWeight.rows(r*V_s, (r+1)*V_s)`; needs head_input="fp32", H % 32 == 0 and the
    default gemm_order), or a kernels.gemm.bf16.PackedWeight of the [H, V_s] shard (gemm_order
    "amx32" / "dp32": the layout AMX and VDPBF16PS read, made once at load;
    kernels.gemm.bf16.weight_for packs when that is faster on this machine; the same bytes);
    rank r of `group` holds vocab ids r*V_s ..;
    sampling_params (default None: no sampling, so tokens/logprobs/truncated are None)
    [R, 3|4|5] fp32 for the rows this rank owns, in layout.owned_rows(r, VTP, gbs, hops,
    batch_groups) order: (top_k, top_p, temperature[, u[, min_p]]), best built with
    sampler.sampling_tensor (which refuses a sampled request without seed or u, and seeds
    without positions); a [R, 3] tensor draws u = 0.5 on every row, every step.
    processing (default None: none): the logits-processor seam (lmtail.tail.processors), a
    sequence of gbs entries in GLOBAL row order (the same on every rank), each a
    processors.LogitProcessing or None; applied to the fp32 shard logits right after
    the GEMM (after acc*rms) and before the exchange, each rank editing only its own
    shard's lanes, so every output is the single-rank call's on the processed logits.
    Rows without processing (None or all fields neutral) keep their bytes. Logprobs and
    top-k are those of the processed logits (what the sampler decides on); the returned
    logits are the processed ones too.
    Options (the fields of TailConfig, documented there) and their defaults: eps=1e-5,
    hidden_actual=None (H), zero_interleaved_pad=True, k=256 (k must be <= V = V_s x ranks:
    a ValueError saying so otherwise, never a clamp), deferred_rms=True, nan_fold=False,
    emit_logits=True, debug_taps=False, gemm_order=TailConfig.gemm_order ("amx32"),
    tail_path="fused" (mirror only), exchange="candidates" (decisions on the fp32 logits;
    "mirror": on their bf16 mirror), head_input="bf16" ("bf16x2": the head GEMM's
    activation in two bf16 rows; "fp32": fp32(x*gamma) unrounded into gemm_q, the Q8_0
    head's); or pass `config=TailConfig(...)` and leave them at their defaults (a TailConfig
    field without a keyword here is set through config only). The keywords build one
    TailConfig (config.resolve), which checks them.
    Layout: group (default None: one rank; a ProcessGroup or an exchange.HopGroups),
    hops (default None: one hop of size VTP), batch_groups G (default 1: G overlapped
    single-hop all-to-alls), fence (default False: a zero all-reduce per hop first;
    outputs unchanged), timeout (default 120 s: what any one collective may take before
    exchange.ExchangeError).
    Returns TailOutput: logits [gbs, V_s] fp32 (this rank's shard, if emit_logits; after
    processing, i.e. the values the exchange and the decisions saw);
    topk_values [R, k] (fp32 with exchange "candidates", bf16 with "mirror"), topk_indices
    [R, k] int64 global ids, tokens/logprobs/truncated [R] and lse [R] float64 (with
    sampling_params: the T = 1 log-sum-exp of the full row the decisions see, logprobs =
    fp32(v_tok - lse)), taps
    (debug_taps: the mirror's staged top-k taps; the candidates exchange's merged row
    statistics outside, has_outside, nans and, with sampling_params, m1, S1, mT, ST). Numerics in the module
    docstring. Deterministic: a row's outputs depend only on that row's inputs (any batch,
    thread count, rank layout). Inputs are validated once, here: bad inputs raise
    ValueError (TypeError for a non-tensor) on every rank of the group, before any byte
    moves; so does eps = 0 with a row whose real lanes square to 0 (no rms). NaN policy
    (docs/errors.md), with sampling_params: a NaN in an owned row's logits is a
    ValueError naming the rows unless nan_fold (then NaN lanes carry no mass); an all-NaN
    row is a ValueError either way.
    """
    keywords = {n: v for n, v in locals().items() if n in _OPTION_NAMES}  # the TailConfig fields given
    if group is not None or hops is not None:  # a bad option is then refused on every rank (the signature)
        return _decode_tail_ranks(hidden_states, gamma, lm_head_weight_t, sampling_params,
                                  functools.partial(resolve, config, keywords), group=group, hops=hops,
                                  batch_groups=batch_groups, fence=fence, timeout=timeout,
                                  processing=processing)
    cfg = resolve(config, keywords)
    need(batch_groups == 1 and not fence, "batch_groups and fence need a process group; got "
                                          f"batch_groups={batch_groups}, fence={fence}")
    if not isinstance(lm_head_weight_t, (QuantWeight, PackedWeight)):
        need_tensor("lm_head_weight_t", lm_head_weight_t, "[H, V_s] bf16 or a kernels.quant.gemm_q.QuantWeight Q8_0")
    validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, sampling_params, cfg,
                         vocab_size=head_shard_width(lm_head_weight_t))
    plans = None if processing is None else plan_processing(
        processing, rows=hidden_states.shape[0], vocab_size=head_shard_width(lm_head_weight_t))
    a, rms = normed_rows(hidden_states, gamma, cfg)  # [gbs, H] bf16, [gbs] fp32
    logits = logits_from(a, rms, lm_head_weight_t, cfg)  # [gbs, V]
    if plans is not None:
        apply_plans(logits, plans, v0=0)  # the seam: in place, the listed lanes and masks only
    if cfg.exchange == "candidates":
        v = logits.shape[1]
        part = candidates.shard_partials(logits, col0=0, v=v, k=cfg.k, nan_fold=cfg.nan_fold, sp=sampling_params)
        # one rank: the ranks' wire (candidates.pack -> unpack, vtp=1) is the identity on every
        # byte a returned output reads (tests/test_candidates.py proves it), so it is skipped
        return owned_candidates(candidates.merge(part, k=cfg.k), sampling_params, cfg, logits, v)
    return owned_tail(logits.to(torch.bfloat16), sampling_params, cfg, logits)


_OPTION_NAMES = frozenset(f.name for f in fields(TailConfig))  # decode_tail's keywords that are TailConfig's


# ---------------------------------------------------------------------------------------
# many ranks: agree on the inputs, then shard logits -> exchange -> owned rows' tail
# ---------------------------------------------------------------------------------------
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


HEAD_FORMAT_CODES = {"bf16": 0, "Q8_0": 1}  # the head's storage ([H, V_s] bf16 or a QuantWeight Q8_0) -> its code

TAIL_SIGNATURE = (("gbs", "H", "V_s", "head format") + config_mod.SIGNED  # TailConfig's fields but the rank-local ones
                  + ("hidden dtype", "gamma dtype", "sampling_params columns", "batch_groups", "fence", "hops",
                     "hidden_states checksum", "gamma checksum", "processing checksum"))


def tail_signature(hidden_states, gamma, lm_head_weight_t, sampling_params, cfg: TailConfig, *, hops,
                   batch_groups, fence, processing=None) -> list[tuple[int, object]]:
    """(int64, shown value) per TAIL_SIGNATURE field: everything the ranks must agree on
    (the options as config.signature gives them: a choice by its OPTION_CODES code).
    Inputs validated."""
    hidden = hidden_states
    gbs, h = hidden.shape
    hops = tuple(hops)
    sig = {"gbs": gbs, "H": h, "V_s": head_shard_width(lm_head_weight_t),
           "head format": HEAD_FORMAT_CODES[lm_head_weight_t.fmt if isinstance(lm_head_weight_t, QuantWeight)
                                            else "bf16"],
           "hidden dtype": _DTYPES[hidden.dtype], "gamma dtype": _DTYPES[gamma.dtype],
           **config_mod.signature(cfg, h),
           "sampling_params columns": 0 if sampling_params is None else sampling_params.shape[1],
           "batch_groups": batch_groups, "fence": int(fence),
           "hops": (exchange.bytes_digest(repr(hops).encode()), hops),
           "hidden_states checksum": exchange.tensor_digest(hidden),
           "gamma checksum": exchange.tensor_digest(gamma),
           "processing checksum": processing_digest(processing)}
    return [sig[n] if isinstance(sig[n], tuple) else (int(sig[n]), int(sig[n])) for n in TAIL_SIGNATURE]


def processing_digest(processing) -> int:
    """crc32 of a validated processing list's fields (0 for None): what the ranks compare."""
    if processing is None:
        return 0
    parts = []
    for p in processing:
        if p is None:
            parts.append(b"-")
            continue
        parts.append(repr((p.logit_bias, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                           p.output_counts, p.prompt_ids)).encode())
        parts.append(b"." if p.allowed is None else p.allowed.numpy().tobytes())
    return exchange.bytes_digest(b"|".join(parts))


def _decode_tail_ranks(hidden_states, gamma, lm_head_weight_t, sampling_params, options, *, group,
                       hops, batch_groups, fence, timeout, processing=None) -> TailOutput:
    """decode_tail over a group; options() -> the call's TailConfig (config.resolve)."""
    hg = group if isinstance(group, exchange.HopGroups) else None
    parent = exchange.parent_group(hg.parent if hg else group)
    vtp = parent.size()
    if hg is not None and hops is not None and tuple(hops) != hg.hops:
        raise ValueError(f"hops must match the HopGroups given as group ({hg.hops}); got {tuple(hops)}")
    hops = hg.hops if hg else hops
    layout_hops = validate_layout(vtp, vtp * batch_groups, hops, batch_groups)  # gbs-free checks
    shapes_ok = isinstance(hidden_states, torch.Tensor) and hidden_states.dim() == 2 and (
        isinstance(lm_head_weight_t, QuantWeight) or isinstance(lm_head_weight_t, torch.Tensor)
        and lm_head_weight_t.dim() == 2)
    gbs = hidden_states.shape[0] if shapes_ok else None
    if gbs:
        validate_layout(vtp, gbs, layout_hops, batch_groups)  # raises before any collective
    try:
        cfg, bad_option = options(), None
    except ValueError as e:  # refused on every rank below, via the signature
        cfg, bad_option = None, e
    if isinstance(cfg, TailConfig) and cfg.exchange == "candidates":
        candidates.check_vtp(vtp)
    local_error, sig, normed, plans = None, None, None, None
    try:  # a rank's bad inputs become a ValueError on every rank (via the signature)
        if bad_option is not None:
            raise bad_option
        validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, sampling_params, cfg,
                             vocab_size=head_shard_width(lm_head_weight_t) * vtp if shapes_ok else 1,
                             rows=gbs // vtp if gbs else None)
        if processing is not None:
            plans = plan_processing(processing, rows=gbs, vocab_size=head_shard_width(lm_head_weight_t) * vtp)
        normed = normed_rows(hidden_states, gamma, cfg)  # [gbs, H] bf16, [gbs]; eps=0 check
        sig = tail_signature(hidden_states, gamma, lm_head_weight_t, sampling_params, cfg,
                             hops=layout_hops, batch_groups=batch_groups, fence=fence, processing=processing)
    except (ValueError, TypeError) as e:
        local_error, sig = e, None  # sig None: this rank rejected its inputs
    exchange.agree(parent, TAIL_SIGNATURE, sig, local_error, what="decode_tail", timeout=timeout)
    a, rms = normed
    if cfg.exchange == "candidates":
        return _candidates_ranks(a, rms, lm_head_weight_t, sampling_params, cfg, group=hg or parent, parent=parent,
                                 hops=layout_hops, batch_groups=batch_groups, fence=fence, timeout=timeout,
                                 plans=plans)

    kept = []  # the fp32 shard logits of each row block, in row order
    v0 = parent.rank() * head_shard_width(lm_head_weight_t)  # this rank's first vocab id

    def mirror_block(rows: slice) -> torch.Tensor:
        lg = logits_from(a[rows], rms[rows], lm_head_weight_t, cfg)  # [n, V_s]
        if plans is not None:
            apply_plans(lg, plans[rows], v0=v0)  # the seam, on this shard's lanes
        kept.append(lg)
        return lg.to(torch.bfloat16)  # the mirror the collective carries

    recv = exchange.exchange_rows(mirror_block, gbs=gbs, group=hg or parent, hops=layout_hops,
                                  batch_groups=batch_groups, fence=fence, timeout=timeout)
    assert recv.shape == (gbs // vtp, head_shard_width(lm_head_weight_t) * vtp), "received [R, V]"
    logits = kept[0] if len(kept) == 1 else torch.cat(kept, dim=0)  # [gbs, V_s]
    return owned_tail(recv, sampling_params, cfg, logits)


def _candidates_ranks(a, rms, lm_head_weight_t, sampling_params, cfg, *, group, parent, hops, batch_groups,
                      fence, timeout, plans=None) -> TailOutput:
    """exchange="candidates" over VTP ranks (inputs agreed): every rank learns every row's
    sampling params (one all-gather), sends each row's shard partials (candidates module),
    and merges the partials of the rows it owns."""
    gbs, vtp, vs = a.shape[0], parent.size(), head_shard_width(lm_head_weight_t)
    v, me = vs * vtp, parent.rank()
    sp_all = None
    if sampling_params is not None:  # [gbs, P] in global row order
        got = exchange.gather_rows(sampling_params, group=parent, timeout=timeout)
        sp_all = torch.empty((gbs, sampling_params.shape[1]), dtype=torch.float32)
        for r, rows in enumerate(got):
            sp_all[owned_rows(r, vtp, gbs, hops, batch_groups)] = rows
    kept = []  # the fp32 shard logits of each row block, in row order

    def partials_block(rows: slice) -> torch.Tensor:
        lg = logits_from(a[rows], rms[rows], lm_head_weight_t, cfg)  # [n, V_s]
        if plans is not None:
            apply_plans(lg, plans[rows], v0=me * vs)  # the seam, on this shard's lanes
        kept.append(lg)
        part = candidates.shard_partials(lg, col0=me * vs, v=v, k=cfg.k, nan_fold=cfg.nan_fold,
                                         sp=None if sp_all is None else sp_all[rows])
        return candidates.pack(part)  # [n, B] bytes

    recv = exchange.exchange_rows(partials_block, gbs=gbs, group=group, hops=hops, batch_groups=batch_groups,
                                  fence=fence, timeout=timeout)  # [R, VTP*B]
    part = candidates.unpack(recv, vtp=vtp, k=cfg.k, sp=sampling_params)
    logits = kept[0] if len(kept) == 1 else torch.cat(kept, dim=0)  # [gbs, V_s]
    return owned_candidates(candidates.merge(part, k=cfg.k), sampling_params, cfg, logits, v)
