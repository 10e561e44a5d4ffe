"""SmolLM2 (llama) forward in torch fp32 with a KV cache: prefill, then decode.

Block structure, written so that every "residual add + RMSNorm" is ONE call of the seam
`ops.add_rms(x, residual, gamma, eps=eps) -> (h, y)`, h = x + residual, y = rmsnorm(h) * gamma:

    h, y = add_rms(embed[ids], 0, attn_norm[0])           # layer 0: nothing to add yet
    for l in 0..L-1:
        h, y = add_rms(attention_l(y), h, ffn_norm[l])
        h, y = add_rms(mlp_l(y), h, attn_norm[l+1] | final_norm)
    return h, y          # h: pre-final-norm hidden (decode_tail's input); y: final-normed

The default seam FP32_OPS is plain fp32 (below; the teacher-forced receipts use it).
`bf16_ops(fn)` adapts a bf16 `add_rms` (h = bf16(x + residual), y = bf16(h * inv_rms(h) *
gamma)) to this fp32 body; `lmtail_ops()` = `bf16_ops(lmtail.norms.add_rms, order=strided(256))`
is the body on lmtail's own op, the default of generation (model/generate.py).

Rope (GGUF layout): the converter permuted the rows of attn_q / attn_k so that rope rotates
ADJACENT pairs (x[2i], x[2i+1]) of each 64-wide head by angle pos * base**(-2i/hd), i < hd/2.
(HF checkpoints rotate halves (x[i], x[i+hd/2]); the two are the same model after the permute.)
Angles and cos/sin are computed in float64 (Python floats) per position, rounded once to fp32.

GQA: query head j reads KV head j // (nh/nkv).

Batching: rows are LEFT-padded to a common prompt length. `KVCache.pad[b]` is the number
of pad slots before row b's first real token; slot s of row b has position s - pad[b].
Attention reads the cache in position order (row b's slot pad_b + j is key j), so pad
slots never reach a real query; a pad query sees position 0 only (junk, but finite, so it
can't poison real rows through 0 * NaN).

Row invariance (a row's bytes do not depend on the batch it is in, its place in it, the
padding, or whether its tokens came in one prefill or one decode step at a time):
  * linear_rows: every GEMM runs in blocks of exactly 16 rows (zero-padded), so the BLAS
    always sees the same shape and picks the same kernel (tested property of torch's MKL
    sgemm at 1 and 2 threads, not a declared order);
  * attend: scores, softmax sums and the value sum use tree_sum (zero-pad to a power of
    two, halve), elementwise ops only; a query's masked keys are trailing +0 terms, which
    tree_sum ignores exactly; exp is numerics.exp64 (basic ops);
  * add_rms (lmtail's, or the fp32 seam), rope (libm per position), silu (exp64) and
    the embedding are per element or per row.
So solo == in-batch and cached == recomputed, bitwise (tests/test_model.py). The sums'
orders other than the tree are the BLAS's: this is model plumbing, not a declared op.

Shape legend: B rows, T new tokens this call, S cache slots used (<= S_cap capacity),
H hidden, nh / nkv query / KV heads, g = nh // nkv, hd head dim, F FFN, V vocab.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as Fn

from ..norms import DEFAULT_ORDER, add_rms
from ..numerics import exp64
from ..orders import Order
from .gguf_loader import LayerWeights, LlamaConfig, ModelBundle


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


@dataclass(frozen=True)
class Ops:
    """The pluggable glue ops of the forward: add_rms(x, residual, gamma, *, eps) -> (h, y)
    on fp32 tensors [..., H]."""

    add_rms: Callable


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


def lmtail_ops(order: Order = DEFAULT_ORDER) -> Ops:
    """The forward on lmtail.norms.add_rms (bf16 residual stream, declared ssq `order`,
    default strided(256)): every residual add + RMSNorm of the body is lmtail's op."""
    return bf16_ops(add_rms, order=order)


# ---------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------
@dataclass
class KVCache:
    """Per-layer keys/values (post-rope) for B left-padded rows; mutable decode state."""

    k: list[torch.Tensor]  # L x [B, nkv, S_cap, hd] fp32
    v: list[torch.Tensor]  # L x [B, nkv, S_cap, hd] fp32
    pad: torch.Tensor  # [B] int64, left pad slots of each row
    length: int = 0  # slots filled so far (S)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]


def new_cache(cfg: LlamaConfig, *, pad: torch.Tensor, capacity: int) -> KVCache:
    """An empty cache for len(pad) rows and `capacity` slots (pad included)."""
    if pad.dim() != 1 or pad.dtype != torch.int64:
        raise ValueError(f"pad must be [B] int64; got {tuple(pad.shape)} {pad.dtype}")
    if capacity < 1 or capacity > cfg.context_length or int(pad.max()) >= capacity:
        raise ValueError(f"capacity must be in (max pad, {cfg.context_length}]; got {capacity} "
                         f"with max pad {int(pad.max())}")
    shape = (pad.shape[0], cfg.n_kv_heads, capacity, cfg.head_dim)
    return KVCache(k=[torch.zeros(shape) for _ in range(cfg.n_layers)],
                   v=[torch.zeros(shape) for _ in range(cfg.n_layers)], pad=pad.clone())


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
    That is a tested property of the BLAS at a fixed shape (tests/test_model.py), not a
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
    """Causal GQA self-attention of y [B, T, H] at slots s0..s0+T-1; writes kc/vc [B, nkv, S_cap, hd]
    in place. pad [B] left pad slots per row; qpos [B, T] int64 query positions (< 0: a pad
    query, which sees position 0 only: junk, but finite and invisible to real rows).
    The cache is read in POSITION order (row b's slot pad_b + j is its position j), so a row's
    keys line up the same way alone and in a left-padded batch (see attend). Returns [B, T, H]."""
    B, T, _ = y.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = linear_rows(y, lw.wq).view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
    k = linear_rows(y, lw.wk).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    v = linear_rows(y, lw.wv).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    kc[:, :, s0:s0 + T] = apply_rope(k, cos, sin)
    vc[:, :, s0:s0 + T] = v
    S = s0 + T
    j = torch.arange(S)  # [S] positions
    slot = (j[None, :] + pad[:, None]).clamp(max=S - 1)  # [B, S]; past the row's end: masked anyway
    idx = slot[:, None, :, None].expand(B, nkv, S, hd)
    keys, vals = kc[:, :, :S].gather(2, idx), vc[:, :, :S].gather(2, idx)  # [B, nkv, S, hd]
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
    qpos = torch.arange(s0, s0 + T)[None, :] - cache.pad[:, None]  # [B, T] (< 0: pad queries)
    cos, sin = rope_cos_sin(qpos.clamp(min=0), head_dim=cfg.head_dim, base=cfg.rope_base)

    layers, eps = bundle.layers, cfg.eps
    x = bundle.embed[ids]  # [B, T, H]
    h, y = ops.add_rms(x, torch.zeros_like(x), layers[0].attn_norm, eps=eps)
    for i, lw in enumerate(layers):
        a = attention(y, lw, cfg, cache.k[i], cache.v[i], s0=s0, cos=cos, sin=sin, pad=cache.pad, qpos=qpos)
        h, y = ops.add_rms(a, h, lw.ffn_norm, eps=eps)
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else bundle.final_norm
        h, y = ops.add_rms(mlp(y, lw), h, nxt, eps=eps)
    cache.length = s0 + T
    return h, y


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
