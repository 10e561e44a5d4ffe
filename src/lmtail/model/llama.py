"""SmolLM2 (llama) forward with a KV cache: prefill, then decode; five bodies, one seam.

Block structure, written so that every "residual add + RMSNorm" is ONE call of the seam
`add_rms(x, residual, gamma, eps=eps) -> (h, y)`, h = x + residual, y = rmsnorm(h) * gamma:

    h, y = add_rms(embed[ids], 0, attn_norm[0])           # layer 0: nothing to add yet
    for l in 0..L-1:
        h, y = add_rms(attention_l(y), h, ffn_norm[l])
        h, y = add_rms(mlp_l(y), h, attn_norm[l+1] | final_norm)
    return h, y          # h: pre-final-norm hidden (decode_tail's input); y: final-normed

Bodies (Ops.body); "quant" is the declared body with every linear on kernels.quant.gemm_q.gemm_q
over the GGUF's own Q4_1 blocks (gguf_loader.quant_linears; its bf16 input widened exactly to
fp32, see linear_q), every other rounding point the declared body's:
  "declared" (lmtail_ops(), the default of generation): every step has a declared order,
      so a row's bytes are the same on every CPU, thread count and batch by construction:
      linears on kernels.gemm.bf16.gemm_bf16 (order "amx32" by default) with the bf16 weights
      of bundle.linears16 (q|k|v and gate|up fused); rope from body.rope_table (float64
      basic ops); attention by body.attend (per query, keys in position order); silu by
      body.silu_mul (exp32); every add_rms is lmtail.glue.norms.add_rms on bf16 rows (the
      residual stream is bf16). Its loop runs on fused glue with the same bytes as the
      plain seam (tested): kernels.model.body.add_rms_rows when Ops.fused_norm_lanes names the
      strided order of add_rms_bf16 (lmtail_ops sets it), kernels.model.body.rope_qkv (split +
      rope + cache write in one C pass), kernels.model.body.silu_mul_bf16, and bundle.packed16
      (the linears in the amx32 load layout). Arguments are validated once per forward;
      the per-layer calls go to the kernels' unchecked entries (backend rows and thread
      counts resolved once per forward, `DeclaredKernels`).
  "q32" / "bq32": the file's own blocks on an fp32 stream (no activation rounded below fp32),
      linears by gemm_q (lanes32) or gemm_bq (bq32, AMX's tile order, weights packed at load);
      Ops' docstring.
  "fp32" (FP32_OPS, the receipts' reference): fp32 weights; linear_rows runs every GEMM in
      blocks of exactly 16 rows so MKL always sees one shape (a tested property of the BLAS,
      not a declared order); attend below with tree_sum; rope by libm per position; silu by
      exp64. bf16_ops(fn) puts a bf16 add_rms into this body.

Rope (GGUF layout): the converter permuted the rows of attn_q / attn_k so that rope rotates
ADJACENT pairs (x[2i], x[2i+1]) of each 64-wide head by angle pos * base**(-2i/hd), i < hd/2.
GQA: query head j reads KV head j // (nh/nkv).

Batching: rows are LEFT-padded to a common prompt length. `KVCache.pad[b]` is the number
of pad slots before row b's first real token; slot s of row b has position s - pad[b].
Attention reads row b's slot pad_b + j as key j, so pad slots never reach a real query
(declared body: a pad query's output is +0; fp32 body: it sees position 0 only).
The cache stores keys transposed [B, nkv, hd, S] (what body.attend streams) and values
[B, nkv, S, hd], both with SLACK extra slots.

Shape legend: B rows, T new tokens this call, S cache slots used (<= S_cap capacity),
H hidden, nh / nkv query / KV heads, g = nh // nkv, hd head dim, F FFN, V vocab,
qd = nh*hd, kvd = nkv*hd.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as Fn

from ..kernels.model import body as kbody
from ..kernels.gemm import bf16 as gemm_mod
from ..kernels.quant import gemm_bq as bq_mod
from ..kernels.quant import gemm_q as quant_mod
from ..kernels.model import step as kstep
from ..glue.norms import DEFAULT_ORDER, add_rms
from ..numerics import exp64
from ..orders import Order
from . import body as decl
from .body import SLACK
from .gguf_loader import LayerWeights, Linears16, LlamaConfig, ModelBundle, Packed16, QuantLinears, quant_linears


# ---------------------------------------------------------------------------------------
# the add_rms seam
# ---------------------------------------------------------------------------------------
def add_rms_fp32(x, residual, gamma, *, eps):
    """h = x + residual (fp32); y = h * (1 / sqrt(mean(h*h) + eps)) * gamma (fp32).

    x, residual [..., H] fp32; gamma [H] fp32. mean by torch's fp32 sum (BLAS order)
    divided by H; IEEE sqrt and division. Returns (h, y), both [..., H] fp32."""
    h = x + residual
    inv = 1.0 / torch.sqrt((h * h).sum(-1, keepdim=True) / h.shape[-1] + eps)  # [..., 1]
    return h, h * inv * gamma


BODIES = ("fp32", "declared", "quant", "q32", "bq32")
QUANT_BODY = "quant"  # the declared body with gemm_q linears on the GGUF's own Q4_1 / Q8_0 blocks
Q32_BODY = "q32"  # the file's own blocks (gemm_q) on an fp32 stream: no activation rounding
BQ32_BODY = "bq32"  # the q32 body with every linear on gemm_bq (order bq32: AMX's tile order), weights packed at load
FP32_STREAM_BODIES = (Q32_BODY, BQ32_BODY)  # the file's own blocks on an fp32 stream: the Q8_0 head goes with them


@dataclass(frozen=True)
class Ops:
    """The pluggable parts of the forward.

    add_rms(x, residual, gamma, *, eps) -> (h, y) on fp32 tensors [..., H] (the fp32 body);
    add_rms_bf16(x, residual, gamma, *, eps) -> (h, y) on bf16 tensors [N, H] (the declared
    body keeps its residual stream in bf16 and calls this directly);
    body: "fp32" (fp32 weights, BLAS in 16-row blocks, tree attention, libm rope: the
    receipts' reference) or "declared" (every linear on gemm_bf16 with bf16 weights in the
    declared `gemm_order`, attention / rope / silu by model.body's declared orders) or
    "quant" (the declared body with every linear on kernels.quant.gemm_q.gemm_q over the GGUF's
    own Q4_1 / Q8_0 blocks, its bf16 input widened exactly to fp32; gemm_order unused);
    gemm_order: the order of gemm_bf16 for the declared body (kernels.gemm.bf16.BODY_ORDERS:
    "amx32" or "chain");
    fused_norm_lanes: None, or T when add_rms_bf16 IS lmtail.glue.norms.add_rms in the plain
    order strided(T) (the caller's statement; lmtail_ops sets it): the declared body then
    runs kernels.model.body.add_rms_rows, the same bytes in one C pass per row;
    "q32": the GGUF's own blocks through gemm_q on an fp32 stream (fp32 residual, norms by
    model.body.add_rms_rows32 in the order strided(fused_norm_lanes), fp32 attention and silu
    outputs straight into the next linear: no activation is rounded below fp32);
    native_step (q32 only): run the layer loop as ONE kernels.model.step call when its C libraries
    are built (the same bytes as the python loop, tested), else the python loop;
    "bq32": the q32 body's python layer loop with every linear on kernels.quant.gemm_bq.gemm_bq
    (the order bq32, which AMX's TDPBF16PS computes; weights packed once by bq_linears), the
    same norms, rope, attention and silu; its bytes are the same on every gemm_bq path."""

    add_rms: Callable
    body: str = "fp32"
    gemm_order: str = gemm_mod.DEFAULT_ORDER
    add_rms_bf16: Callable | None = None
    fused_norm_lanes: int | None = None
    native_step: bool = True

    def __post_init__(self):
        if self.body not in BODIES:
            raise ValueError(f"body must be one of {BODIES}; got {self.body!r}")
        if self.gemm_order not in gemm_mod.BODY_ORDERS:
            raise ValueError(f"gemm_order must be {' or '.join(map(repr, gemm_mod.BODY_ORDERS))}; "
                             f"got {self.gemm_order!r}")
        if self.body in ("declared", "quant") and self.add_rms_bf16 is None:
            raise ValueError(f"the {self.body} body needs add_rms_bf16 (a bf16 add_rms); got None")
        lanes = self.fused_norm_lanes
        if lanes is not None and not (isinstance(lanes, int) and lanes >= 32 and lanes % 32 == 0):
            raise ValueError(f"fused_norm_lanes must be None or a positive multiple of 32; got {lanes!r}")
        if self.body in FP32_STREAM_BODIES and (lanes is None or lanes > decl.NORM32_MAX_LANES):
            raise ValueError(f"the {self.body} body needs fused_norm_lanes (its norm's strided order) in "
                             f"[32, {decl.NORM32_MAX_LANES}]; got {lanes!r}")


FP32_OPS = Ops(add_rms=add_rms_fp32)


def _bf16_add_rms(add_rms_bf16, x, residual, gamma, *, eps, **kwargs):
    """The body of bf16_ops's add_rms (module level, so Ops stay picklable for ranks)."""
    lead = x.shape[:-1]
    xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [N, H]
    rb = residual.expand_as(x).reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [N, H]
    h, y = add_rms_bf16(xb, rb, gamma, eps=eps, **kwargs)
    return h.float().reshape(*lead, -1), y.float().reshape(*lead, -1)


def bf16_ops(add_rms_bf16: Callable, **kwargs) -> Ops:
    """Ops whose add_rms is lmtail's bf16 op `add_rms_bf16(x, residual, gamma, *, eps, **kwargs)`.

    x and residual are rounded to bf16 (so the residual stream becomes bf16, as in a bf16
    engine), gamma is passed as fp32 [H] (this model's norm weights are exact in bf16, so
    a bf16-gamma op may cast it losslessly), and h, y come back widened to fp32 (exact).
    Picklable when add_rms_bf16 and kwargs are (the vocab-parallel ranks need that)."""
    return Ops(add_rms=functools.partial(_bf16_add_rms, add_rms_bf16, **kwargs))


def lmtail_ops(order: Order = DEFAULT_ORDER, *, body: str = "declared",
               gemm_order: str = gemm_mod.DEFAULT_ORDER) -> Ops:
    """The forward on lmtail.glue.norms.add_rms (bf16 residual stream, declared ssq `order`,
    default strided(256)): every residual add + RMSNorm of the body is lmtail's op; with
    body="declared" (the default) every other step is declared too (see Ops). A plain
    strided order sets Ops.fused_norm_lanes (the fused kernel gives add_rms's bytes)."""
    plain = isinstance(order, Order) and order.kind == "strided" and order.vec == 1 and not order.reverse_butterfly
    return Ops(add_rms=functools.partial(_bf16_add_rms, add_rms, order=order), body=body, gemm_order=gemm_order,
               add_rms_bf16=functools.partial(add_rms, order=order), fused_norm_lanes=order.lanes if plain else None)


# ---------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Per-layer keys/values (post-rope) for B left-padded rows; mutable decode state.
    Keys are stored transposed (slot contiguous, what the declared attention streams);
    both carry SLACK slots past the capacity (never written: whole 64-key blocks read)."""

    k: list[torch.Tensor]  # L x [B, nkv, hd, S_cap + SLACK] fp32
    v: list[torch.Tensor]  # L x [B, nkv, S_cap + SLACK, hd] fp32
    pad: torch.Tensor  # [B] int64, left pad slots of each row
    length: int = 0  # slots filled so far (S)
    scratch: object = None  # the q32 body's native-step buffers (kernels.model.step.StepBuffers), made on first use

    @property
    def capacity(self) -> int:
        return self.v[0].shape[2] - SLACK


def new_cache(cfg: LlamaConfig, *, pad: torch.Tensor, capacity: int) -> KVCache:
    """An empty cache for len(pad) rows and `capacity` slots (pad included)."""
    if pad.dim() != 1 or pad.dtype != torch.int64:
        raise ValueError(f"pad must be [B] int64; got {tuple(pad.shape)} {pad.dtype}")
    if capacity < 1 or capacity > cfg.context_length or int(pad.max()) >= capacity:
        raise ValueError(f"capacity must be in (max pad, {cfg.context_length}]; got {capacity} "
                         f"with max pad {int(pad.max())}")
    b, nkv, hd, s = pad.shape[0], cfg.n_kv_heads, cfg.head_dim, capacity + SLACK
    return KVCache(k=[torch.zeros(b, nkv, hd, s) for _ in range(cfg.n_layers)],
                   v=[torch.zeros(b, nkv, s, hd) for _ in range(cfg.n_layers)], pad=pad.clone())


# ---------------------------------------------------------------------------------------
# row-invariant linear
# ---------------------------------------------------------------------------------------
ROW_BLOCK = 16


def linear_rows(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y @ w.T computed in blocks of exactly ROW_BLOCK rows (the last block zero-padded).

    y [..., in] fp32, w [out, in] fp32 -> [..., out] fp32. The BLAS picks its kernel (and
    so each output's summation order) by the row count M: a 1-row product, a 5-row one
    and a 40-row one round differently (measured: M = 1, 2..15 and >= 16 are three
    families on this MKL). Feeding it only M = ROW_BLOCK makes a row's bytes independent
    of how many rows share the call and of its position among them: solo == in-batch.
    That is a tested property of the BLAS at a fixed shape (tests/test_model_forward.py), not a
    declared order."""
    lead, n_in = y.shape[:-1], y.shape[-1]
    x = y.reshape(-1, n_in)  # [N, in]
    n = x.shape[0]
    pad = (-n) % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, n_in)])  # [N + pad, in]
    out = torch.cat([Fn.linear(x[i:i + ROW_BLOCK], w) for i in range(0, n + pad, ROW_BLOCK)])
    return out[:n].reshape(*lead, w.shape[0])


# ---------------------------------------------------------------------------------------
# rope, attention, mlp
# ---------------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, *, head_dim: int, base: float):
    """cos, sin [B, 1, T, hd/2] fp32 of angle pos * base**(-2i/hd), i < hd/2.

    Per distinct position, in Python floats (float64, libm pow / cos / sin one value at a
    time), rounded once to fp32: a position's values never depend on the tensor around it
    (torch's vectorized cos may round a lane differently from its scalar tail)."""
    inv_freq = [base ** (-2.0 * i / head_dim) for i in range(head_dim // 2)]
    uniq, where = torch.unique(positions, return_inverse=True)  # [U], [B, T]
    ang = [[float(p) * f for f in inv_freq] for p in uniq.tolist()]  # U x hd/2
    cos = torch.tensor([[math.cos(a) for a in row] for row in ang], dtype=torch.float64).float()  # [U, hd/2]
    sin = torch.tensor([[math.sin(a) for a in row] for row in ang], dtype=torch.float64).float()
    return cos[where][:, None], sin[where][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, n, T, hd] by (cos, sin) [B, 1, T, hd/2]."""
    xe, xo = x[..., 0::2], x[..., 1::2]  # [B, n, T, hd/2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a declared order: zero-pad to the next power of two n, then
    halve: x[..., i] += x[..., i + n/2] until one element is left. [..., N] -> [...], fp32.

    Only elementwise adds, so an element's result never depends on the tensor's other dims.
    Trailing zeros are exact no-ops (x + 0 = x): a row whose last entries are +0 sums the
    same as the row without them, whatever power of two it is padded to."""
    n = x.shape[-1]
    m = 1 << max(n - 1, 0).bit_length()
    if m != n:
        x = Fn.pad(x, (0, m - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


ATTN_CHUNK = 32  # queries per chunk (bounds the [.., T, S, hd] product tensors; no effect on values)


def attend(q, keys, vals_t, allowed, scale):
    """softmax(q k^T * scale) v over position-ordered keys, row-invariant by construction.

    q [B, nkv, g, T, hd]; keys [B, nkv, S, hd], key j = position j; vals_t [B, nkv, hd, S2]
    the values transposed and zero-padded to S2 = the power of two >= S; allowed
    [B, 1, 1, T, S] bool (j <= the query's position, so masked keys are a suffix).
      score = tree_sum over hd of fp32 products q*k, times scale (a power of two: exact)
      e     = fp32(exp64(score - max))  (masked: exp(-inf) = +0),  den = tree_sum over S of e
      out   = tree_sum over S2 of fp32(fp32(e / den) * v)  (+0.0 added: a masked -0 becomes +0)
    A query's masked keys and the batch's extra slots are trailing +0 terms, so its output
    is the same bytes alone or in any batch. Returns [B, nkv, g, T, hd] fp32."""
    score = tree_sum(q[:, :, :, :, None, :] * keys[:, :, None, None, :, :]) * scale  # [B, nkv, g, T, S]
    score = score.masked_fill(~allowed, float("-inf"))
    e = exp64(score - score.amax(-1, keepdim=True)).float()  # [B, nkv, g, T, S]
    p = Fn.pad(e / tree_sum(e)[..., None], (0, vals_t.shape[-1] - e.shape[-1]))  # [B, nkv, g, T, S2]
    prod = p[..., None, :] * vals_t[:, :, None, None, :, :]  # [B, nkv, g, T, hd, S2]
    return tree_sum(prod.add_(0.0))


def attention(y, lw: LayerWeights, cfg: LlamaConfig, kc, vc, *, s0, cos, sin, pad, qpos):
    """Causal GQA self-attention of y [B, T, H] at slots s0..s0+T-1 (the fp32 body); writes
    kc [B, nkv, hd, S_cap'] / vc [B, nkv, S_cap', hd] in place. pad [B] left pad slots per row;
    qpos [B, T] int64 query positions (< 0: a pad
    query, which sees position 0 only: junk, but finite and invisible to real rows).
    The cache is read in POSITION order (row b's slot pad_b + j is its position j), so a row's
    keys line up the same way alone and in a left-padded batch (see attend). Returns [B, T, H]."""
    B, T, _ = y.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = linear_rows(y, lw.wq).view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
    k = linear_rows(y, lw.wk).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    v = linear_rows(y, lw.wv).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    kc[:, :, :, s0:s0 + T] = apply_rope(k, cos, sin).transpose(-1, -2)
    vc[:, :, s0:s0 + T] = v
    S = s0 + T
    j = torch.arange(S)  # [S] positions
    slot = (j[None, :] + pad[:, None]).clamp(max=S - 1)  # [B, S]; past the row's end: masked anyway
    idx = slot[:, None, :, None].expand(B, nkv, S, hd)
    keys = kc[:, :, :, :S].transpose(-1, -2).gather(2, idx)  # [B, nkv, S, hd]
    vals = vc[:, :, :S].gather(2, idx)  # [B, nkv, S, hd]
    allowed = (j[None, None, :] <= qpos.clamp(min=0)[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
    q = apply_rope(q, cos, sin).view(B, nkv, nh // nkv, T, hd)  # [B, nkv, g, T, hd]
    vals_t = Fn.pad(vals.transpose(-1, -2), (0, (1 << (S - 1).bit_length()) - S))  # [B, nkv, hd, S2]
    out = torch.cat([attend(q[:, :, :, t:t + ATTN_CHUNK], keys, vals_t, allowed[..., t:t + ATTN_CHUNK, :],
                            hd ** -0.5) for t in range(0, T, ATTN_CHUNK)], dim=3)  # [B, nkv, g, T, hd]
    out = out.reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)  # [B, T, H]
    return linear_rows(out, lw.wo)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = fp32(x / (1 + exp64(-x))), in float64 from basic ops: elementwise
    by construction (torch's vectorized silu rounds its scalar-tail lanes differently)."""
    x64 = x.double()
    return (x64 / (1.0 + exp64(-x64))).float()


def mlp(y, lw: LayerWeights):
    """SwiGLU: w_down(silu(w_gate y) * w_up y); y [B, T, H] -> [B, T, H]."""
    return linear_rows(silu(linear_rows(y, lw.w_gate)) * linear_rows(y, lw.w_up), lw.w_down)


# ---------------------------------------------------------------------------------------
# the declared body: bf16-weight GEMMs in a declared order, declared attention/rope/silu
# ---------------------------------------------------------------------------------------
def linear16(y: torch.Tensor, w: torch.Tensor, *, order: str, row=None, threads: int | None = None) -> torch.Tensor:
    """y @ w by lmtail's GEMM in the declared `order`: y [N, in] bf16 (fp32 is rounded
    once to bf16), w [in, out] bf16 (a Linears16 weight, or its Packed16 PackedWeight for
    order "amx32": the same bytes) -> [N, out] fp32. row, threads: the GEMM backend row
    (kernels.gemm.bf16.GEMM[order]) and worker count the forward resolved once; then the
    unchecked entry runs (None: the public gemm_bf16, which validates).
    Row-invariant by declaration (each output element's sum never sees other rows)."""
    a = y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)
    if row is None:
        return gemm_mod.gemm_bf16(a, w, order=order)
    return gemm_mod.gemm_unchecked(a, w, row, threads)


def linear_q(y: torch.Tensor, ws: tuple, *, row, threads: int) -> torch.Tensor:
    """The quant body's linear: y [N, in] bf16 (fp32 is rounded once to bf16: the same
    input as linear16's) widened exactly to fp32, then linear_q32."""
    return linear_q32((y if y.dtype == torch.bfloat16 else y.to(torch.bfloat16)).float(), ws, row=row,
                      threads=threads)


def linear_q32(a: torch.Tensor, ws: tuple, *, row, threads: int) -> torch.Tensor:
    """a [N, in] fp32 (as it is: no rounding) times each weight of `ws` ([out_i, in]) by
    gemm_q's declared lanes32 order (QuantWeights, a quant.GEMM_Q row) or gemm_bq's bq32
    (BqPackeds, a gemm_bq.GEMM_BQ row: the bq32 body), outputs side by side by columns ->
    [N, sum out_i] fp32. row, threads: the backend row and worker count the forward resolved
    once (its unchecked entry; the weights were checked at load, a's shape per forward).
    Row-invariant by either declaration."""
    out = torch.empty(a.shape[0], sum(w.shape[0] for w in ws), dtype=torch.float32)  # [N, sum out_i]
    c0 = 0
    for w in ws:
        assert w.shape[1] == a.shape[1]  # the loop's widths match the checked-at-load weights
        if a.shape[0]:
            row.run(a, w, out[:, c0:c0 + w.shape[0]], threads)  # a column slice: unit column stride
        c0 += w.shape[0]
    return out


def attend_unchecked(q, kc, vc, pad, *, s0: int, scale: float, row, threads: int) -> torch.Tensor:
    """body.attend on validated tensors: the backend row (body.ATTEND) and worker count the
    forward resolved once."""
    return row.run(q, kc, vc, pad, s0, scale, threads)


@dataclass(frozen=True)
class DeclaredKernels:
    """What the declared body calls per layer, resolved once per forward: the linear (the
    GEMM row and threads bound into linear16), the attention row and threads, the norm,
    rope and silu entries."""

    linear: Callable  # (y, w) -> y @ w [N, out] fp32
    attend_row: object
    attend_threads: int
    norm: Callable  # (x, residual, gamma32) -> (h, y) bf16 [N, H]
    rope_qkv: Callable
    silu_mul_bf16: Callable


def declared_kernels(ops: Ops, eps: float, B: int, T: int, nh: int, s0: int) -> DeclaredKernels:
    """The per-forward kernel choices of the declared body (each table's fastest verified row,
    kernels._backend): C entries when body.c was built, else the ops' torch spellings."""
    c = kbody.available()
    return DeclaredKernels(
        linear=functools.partial(linear16, order=ops.gemm_order, row=gemm_mod.GEMM[ops.gemm_order].pick(None),
                                 threads=torch.get_num_threads()),
        attend_row=decl.ATTEND.pick(None),
        attend_threads=decl.attend_threads(None, B, T, nh, s0), norm=norm_fn(ops, eps),
        rope_qkv=kbody.rope_qkv if c else
        (lambda qkv, cos_t, sin_t, pos, kc, vc, s0, nh: decl.rope_qkv(qkv, cos_t, sin_t, pos, kc, vc, s0=s0, nh=nh)),
        silu_mul_bf16=decl.silu_mul_bf16)


def attention_declared(y, l16: Linears16 | Packed16 | QuantLinears, cfg: LlamaConfig, kc, vc, *, s0, cos_t,
                       sin_t, pos, pad, kern: DeclaredKernels):
    """Causal GQA self-attention of y [B*T, H] bf16 at slots s0..s0+T-1 (the declared body):
    one fused q|k|v GEMM, rope_qkv (declared rope; keys/values written into
    kc [B, nkv, hd, S_cap'] / vc [B, nkv, S_cap', hd]), attend (declared order), the o
    GEMM. cos_t, sin_t [ctx, hd/2] fp32 rope tables, pos [B, T] int64 (>= 0).
    Returns [B*T, H] fp32."""
    nh, hd = cfg.n_heads, cfg.head_dim
    B, T = pos.shape
    lin = kern.linear
    qkv = lin(y, l16.w_qkv)  # [B*T, qd + 2 kvd]
    q = kern.rope_qkv(qkv, cos_t, sin_t, pos, kc, vc, s0, nh)  # [B, T, nh, hd]
    a = attend_unchecked(q, kc, vc, pad, s0=s0, scale=1.0 / math.sqrt(hd), row=kern.attend_row,
                         threads=kern.attend_threads)  # [B, T, nh, hd]
    return lin(a.view(B * T, nh * hd), l16.w_o)


def mlp_declared(y, l16: Linears16 | Packed16 | QuantLinears, *, kern: DeclaredKernels):
    """SwiGLU on the declared body: fused gate|up GEMM, silu_mul rounded to bf16 (the down
    GEMM's input), down GEMM. y [N, H] bf16 -> [N, H] fp32."""
    lin = kern.linear
    return lin(kern.silu_mul_bf16(lin(y, l16.w_gu)), l16.w_down)


def norm_fn(ops: Ops, eps: float):
    """norm(x, residual, gamma32) -> (h, y) bf16 [N, H]: x [N, H] fp32 (rounded once to bf16)
    or bf16, residual [N, H] bf16: the fused C kernel when ops.fused_norm_lanes is set and
    body.c was built, else ops.add_rms_bf16."""
    lanes = ops.fused_norm_lanes
    if lanes is not None and kbody.available():
        return lambda x, r, g: kbody.add_rms_rows(x, r, g, eps, lanes)
    if lanes is not None:
        return lambda x, r, g: tuple(decl.add_rms_rows(x, r, g, eps=eps, lanes=lanes))
    return lambda x, r, g: tuple(ops.add_rms_bf16(x.to(torch.bfloat16), r, g, eps=eps))


def _quant_kernels(kern: DeclaredKernels, bundle: ModelBundle) -> tuple[DeclaredKernels, tuple[QuantLinears, ...]]:
    """The quant body's kernels (the declared body's, with linear_q as the linear) and
    weights (quant_linears(bundle), whose shapes load checked against the config)."""
    qlin = quant_linears(bundle)
    lin = functools.partial(linear_q, row=quant_mod.GEMM_Q.pick(None), threads=torch.get_num_threads())
    return dataclasses.replace(kern, linear=lin), qlin


def _body_declared(bundle: ModelBundle, ids, cache: KVCache, ops: Ops, qpos, s0):
    cfg, layers = bundle.config, bundle.layers
    if ops.body == "declared" and len(bundle.linears16) != cfg.n_layers:
        raise ValueError("the declared body needs bundle.linears16 (load_model builds it)")
    cos_t, sin_t = decl.rope_table(cfg.context_length, cfg.head_dim, cfg.rope_base)  # [ctx, hd/2]
    pos = qpos.clamp(min=0).contiguous()  # [B, T], < capacity <= context_length (forward checked)
    assert pos.numel() == 0 or int(pos.max()) < cos_t.shape[0]  # rope_qkv indexes the tables by it
    B, T = ids.shape
    kern = declared_kernels(ops, cfg.eps, B, T, cfg.n_heads, s0)
    gammas = [lw.attn_norm.float().contiguous() for lw in layers] + [bundle.final_norm.float().contiguous()]
    ffn_gammas = [lw.ffn_norm.float().contiguous() for lw in layers]
    x = bundle.embed[ids.reshape(-1)]  # [B*T, H] fp32, rounded once to bf16 by the first norm
    h, y = kern.norm(x, torch.zeros(x.shape, dtype=torch.bfloat16), gammas[0])  # bf16 residual stream
    weights = bundle.packed16 if ops.gemm_order == "amx32" and bundle.packed16 else bundle.linears16
    if ops.body == "quant":
        kern, weights = _quant_kernels(kern, bundle)
    for i, l16 in enumerate(weights):
        a = attention_declared(y, l16, cfg, cache.k[i], cache.v[i], s0=s0, cos_t=cos_t, sin_t=sin_t,
                               pos=pos, pad=cache.pad, kern=kern)  # [B*T, H] fp32
        h, y = kern.norm(a, h, ffn_gammas[i])
        h, y = kern.norm(mlp_declared(y, l16, kern=kern), h, gammas[i + 1])
    return h.float().view(B, T, -1), y.float().view(B, T, -1)


# ---------------------------------------------------------------------------------------
# the q32 body: the file's own blocks on an fp32 stream, one native call per forward
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=4)
def q32_model(bundle: ModelBundle, lanes: int, gemm_backend: str, attend_backend: str):
    """kernels.model.step.Q32Model of this bundle, built once per (bundle, lanes, backends) and
    cached: the weights are quant_linears(bundle) (the file's memory map), the gammas the
    bundle's norms widened to contiguous fp32."""
    cfg = bundle.config
    an = [lw.attn_norm.float().contiguous() for lw in bundle.layers]
    fn_ = [lw.ffn_norm.float().contiguous() for lw in bundle.layers]
    fin = bundle.final_norm.float().contiguous()
    cos_t, sin_t = decl.rope_table(cfg.context_length, cfg.head_dim, cfg.rope_base)  # [ctx, hd/2]
    lins = [(*q.w_qkv, *q.w_o, *q.w_gu, *q.w_down) for q in quant_linears(bundle)]
    shape = kstep.StepShape(L=cfg.n_layers, H=cfg.hidden, nh=cfg.n_heads, nkv=cfg.n_kv_heads, F=cfg.ffn)
    return kstep.Q32Model(shape, lins, an, fn_, fin, cos_t, sin_t, lanes=lanes, eps=cfg.eps,
                          scale=1.0 / math.sqrt(cfg.head_dim), gemm_backend=gemm_backend,
                          attend_backend=attend_backend, body_backend=decl.SILU_MUL.pick(None, rows=1).name)


def embed_rows(bundle: ModelBundle, ids: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ids [N] int64 from the file's own token_embd blocks
    (bundle.embed_q), dequantized exactly (Q8_0: fp32(d) * q): [N, H] fp32, the same values
    as bundle.embed's rows, read without the fp32 copy."""
    w = bundle.embed_q
    return quant_mod.dequantize(quant_mod.QuantWeight(w.fmt, (ids.shape[0], w.shape[1]), w.data[ids])).reshape(
        ids.shape[0], w.shape[1])


def _q32_layers(bundle: ModelBundle, x, cache: KVCache, ops: Ops, pos, s0, kern: DeclaredKernels, lins=None):
    """The q32 body's layer loop in python (kernels.model.step.run_q32 is the same calls in C):
    x [N, H] fp32 embedding rows -> (h, y) [N, H] fp32. lins: the layers' weights for
    kern.linear (None: quant_linears(bundle); the bq32 body passes bq_linears(bundle))."""
    cfg, lanes = bundle.config, ops.fused_norm_lanes
    B, T = pos.shape
    nh, hd = cfg.n_heads, cfg.head_dim

    def norm(a, r, lw_gamma):
        return decl.add_rms_rows32(a, r, lw_gamma.float().contiguous(), eps=cfg.eps, lanes=lanes)

    cos_t, sin_t = decl.rope_table(cfg.context_length, cfg.head_dim, cfg.rope_base)  # [ctx, hd/2]
    silu = kbody.silu_mul if kbody.available() else decl.silu_mul
    layers = bundle.layers
    h, y = norm(x, None, layers[0].attn_norm)
    for i, q in enumerate(quant_linears(bundle) if lins is None else lins):
        qkv = kern.linear(y, q.w_qkv)  # [N, qd + 2 kvd]
        qr = kern.rope_qkv(qkv, cos_t, sin_t, pos, cache.k[i], cache.v[i], s0, nh)  # [B, T, nh, hd]
        att = attend_unchecked(qr, cache.k[i], cache.v[i], cache.pad, s0=s0, scale=1.0 / math.sqrt(hd),
                               row=kern.attend_row, threads=kern.attend_threads)  # [B, T, nh, hd]
        h, y = norm(kern.linear(att.view(B * T, nh * hd), q.w_o), h, layers[i].ffn_norm)
        s = silu(kern.linear(y, q.w_gu))  # [N, F] fp32
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else bundle.final_norm
        h, y = norm(kern.linear(s, q.w_down), h, nxt)
    return h, y


def _body_q32(bundle: ModelBundle, ids, cache: KVCache, ops: Ops, qpos, s0):
    cfg = bundle.config
    pos = qpos.clamp(min=0).contiguous()  # [B, T]
    assert pos.numel() == 0 or int(pos.max()) < cfg.context_length  # rope_qkv indexes the tables by it
    B, T = ids.shape
    x = embed_rows(bundle, ids.reshape(-1))  # [N, H] fp32, a fresh tensor (the native step writes h into it)
    threads = torch.get_num_threads()
    # the rows' shape class picks each kernel's row (a batch of 16 decode rows: the "16" class)
    gemm_row, attend_row = quant_mod.GEMM_Q.pick(None, rows=B * T), decl.ATTEND.pick(None, rows=B * T)
    attend_threads = decl.attend_threads(None, B, T, cfg.n_heads, s0)
    if ops.native_step and kstep.available(gemm_row.name, attend_row.name):
        model = q32_model(bundle, ops.fused_norm_lanes, gemm_row.name, attend_row.name)
        if cache.scratch is None:
            cache.scratch = kstep.StepBuffers(model.shape)
        h, y = kstep.run_q32(model, cache.scratch, x, cache.k, cache.v, pos, cache.pad, s0=s0,
                             gemm_threads=threads, attend_threads=attend_threads)
    else:
        kern = dataclasses.replace(declared_kernels(ops, cfg.eps, B, T, cfg.n_heads, s0),
                                   linear=functools.partial(linear_q32, row=gemm_row, threads=threads))
        h, y = _q32_layers(bundle, x, cache, ops, pos, s0, kern)
    return h.view(B, T, -1), y.view(B, T, -1)


# ---------------------------------------------------------------------------------------
# the bq32 body: the q32 body's loop, every linear on gemm_bq over the file's blocks packed at load
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BqLinears:
    """One block's linears for the bq32 body: quant_linears' QuantWeights packed by
    kernels.quant.gemm_bq.pack_bq (the same fields and column order)."""

    w_qkv: tuple[bq_mod.BqPacked, ...]
    w_o: tuple[bq_mod.BqPacked, ...]
    w_gu: tuple[bq_mod.BqPacked, ...]
    w_down: tuple[bq_mod.BqPacked, ...]


@functools.lru_cache(maxsize=2)
def bq_linears(bundle: ModelBundle) -> tuple[BqLinears, ...]:
    """quant_linears(bundle) packed once per bundle for gemm_bq (SmolLM2: 2.25 B per Q4_1
    weight, 228 MiB for the 30 blocks; lmtail_bq_pack, ~0.3 s)."""
    return tuple(BqLinears(*(tuple(bq_mod.pack_bq(w) for w in getattr(q, f.name)) for f in dataclasses.fields(q)))
                 for q in quant_linears(bundle))


def bq_gemm_row(rows: int):
    """gemm_bq's backend row for a forward of `rows` rows (the fastest verified one; tests
    replace this function to run the body on another path: the bytes are the same)."""
    return bq_mod.GEMM_BQ.pick(None, rows=rows)


def _body_bq32(bundle: ModelBundle, ids, cache: KVCache, ops: Ops, qpos, s0):
    cfg = bundle.config
    pos = qpos.clamp(min=0).contiguous()  # [B, T]
    assert pos.numel() == 0 or int(pos.max()) < cfg.context_length  # rope_qkv indexes the tables by it
    B, T = ids.shape
    x = embed_rows(bundle, ids.reshape(-1))  # [N, H] fp32
    lin = functools.partial(linear_q32, row=bq_gemm_row(B * T), threads=torch.get_num_threads())
    kern = dataclasses.replace(declared_kernels(ops, cfg.eps, B, T, cfg.n_heads, s0), linear=lin)
    h, y = _q32_layers(bundle, x, cache, ops, pos, s0, kern, lins=bq_linears(bundle))
    return h.view(B, T, -1), y.view(B, T, -1)


def _body_fp32(bundle: ModelBundle, ids, cache: KVCache, ops: Ops, qpos, s0):
    cfg, layers, eps = bundle.config, bundle.layers, bundle.config.eps
    cos, sin = rope_cos_sin(qpos.clamp(min=0), head_dim=cfg.head_dim, base=cfg.rope_base)
    x = bundle.embed[ids]  # [B, T, H]
    h, y = ops.add_rms(x, torch.zeros_like(x), layers[0].attn_norm, eps=eps)
    for i, lw in enumerate(layers):
        a = attention(y, lw, cfg, cache.k[i], cache.v[i], s0=s0, cos=cos, sin=sin, pad=cache.pad, qpos=qpos)
        h, y = ops.add_rms(a, h, lw.ffn_norm, eps=eps)
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else bundle.final_norm
        h, y = ops.add_rms(mlp(y, lw), h, nxt, eps=eps)
    return h, y


# ---------------------------------------------------------------------------------------
# forward
# ---------------------------------------------------------------------------------------
def forward(bundle: ModelBundle, ids: torch.Tensor, cache: KVCache, *, ops: Ops = FP32_OPS):
    """Run T new tokens per row through the model, appending them to `cache`.

    ids [B, T] int64 occupy slots cache.length .. cache.length+T-1 (a prefill is the first
    call with T = padded prompt length; a decode step is T = 1). Returns (h, y):
    h [B, T, H] fp32 the pre-final-norm hidden states (what decode_tail normalizes itself),
    y [B, T, H] fp32 = rmsnorm(h) * final_norm (for teacher-forced fp32 logits)."""
    cfg = bundle.config
    if ids.dim() != 2 or ids.dtype != torch.int64:
        raise ValueError(f"ids must be [B, T] int64; got {tuple(ids.shape)} {ids.dtype}")
    B, T = ids.shape
    if B != cache.pad.shape[0]:
        raise ValueError(f"ids must have the cache's {cache.pad.shape[0]} rows; got {B}")
    s0 = cache.length
    if s0 + T > cache.capacity:
        raise ValueError(f"cache holds {cache.capacity} slots; {s0} used + {T} new overflow it")
    if int(ids.min()) < 0 or int(ids.max()) >= cfg.vocab:
        raise ValueError(f"ids must be in [0, {cfg.vocab}); got [{int(ids.min())}, {int(ids.max())}]")
    if ops.body not in FP32_STREAM_BODIES and bundle.weights != "all":
        raise ValueError(f"the {ops.body} body needs load_model(weights='all'); this bundle was loaded "
                         f"with weights={bundle.weights!r} (only the q32 body runs on it)")
    qpos = torch.arange(s0, s0 + T)[None, :] - cache.pad[:, None]  # [B, T] (< 0: pad queries)
    run = {"fp32": _body_fp32, Q32_BODY: _body_q32, BQ32_BODY: _body_bq32}.get(ops.body, _body_declared)  # "quant": declared on gemm_q
    h, y = run(bundle, ids, cache, ops, qpos, s0)
    cache.length = s0 + T
    return h, y


PREFILL_CHUNK = 256  # prompt tokens per forward call in prefill (bounds activation memory)


def prefill(bundle: ModelBundle, ids: torch.Tensor, cache: KVCache, *, ops: Ops = FP32_OPS,
            chunk: int = PREFILL_CHUNK, on_progress: Callable | None = None) -> torch.Tensor:
    """forward() over ids [B, P] in chunks of `chunk` positions; returns h [B, H] fp32 of the
    last position. Both bodies are cache-invariant (a position's bytes do not depend on how
    the tokens before it were split into calls), so this is the same bytes as one call.
    on_progress(done, P) after each chunk (a progress display for long prompts)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    P = ids.shape[1]
    h = None
    for t0 in range(0, P, chunk):
        h, _ = forward(bundle, ids[:, t0:t0 + chunk], cache, ops=ops)  # [B, c, H]
        if on_progress is not None:
            on_progress(min(t0 + chunk, P), P)
    if h is None:
        raise ValueError(f"ids must hold at least one position; got shape {tuple(ids.shape)}")
    return h[:, -1]


def logits_fp32(bundle: ModelBundle, y: torch.Tensor) -> torch.Tensor:
    """fp32 logits y @ embed.T (the fp32 dequantized tied head, not its bf16 copy);
    y [..., H] final-normed -> [..., V]. For teacher-forced receipts, not for decode."""
    return y @ bundle.embed.T


def teacher_forced_nll(bundle: ModelBundle, ids, *, ops: Ops = FP32_OPS) -> torch.Tensor:
    """Per-token negative log-likelihood [T-1] float64 (nats) of ids[1:] given their prefixes.

    ids: one sequence (list or [T] int64 tensor), T >= 2, no BOS added. One prefill of all
    T tokens; logits_fp32 widened to float64, log_softmax in float64."""
    ids = torch.as_tensor(ids, dtype=torch.int64)
    if ids.dim() != 1 or ids.shape[0] < 2:
        raise ValueError(f"ids must be one sequence of >= 2 tokens; got shape {tuple(ids.shape)}")
    cache = new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=ids.shape[0])
    _, y = forward(bundle, ids[None], cache, ops=ops)  # [1, T, H]
    logp = logits_fp32(bundle, y[0, :-1]).double().log_softmax(-1)  # [T-1, V]
    return -logp.gather(-1, ids[1:, None])[:, 0]
