"""SmolLM2 (llama) forward in torch fp32 with a KV cache: prefill, then decode.

Block structure, written so that every "residual add + RMSNorm" is ONE call of the seam
`ops.add_rms(x, residual, gamma, eps=eps) -> (h, y)`, h = x + residual, y = rmsnorm(h) * gamma:

    h, y = add_rms(embed[ids], 0, attn_norm[0])           # layer 0: nothing to add yet
    for l in 0..L-1:
        h, y = add_rms(attention_l(y), h, ffn_norm[l])
        h, y = add_rms(mlp_l(y), h, attn_norm[l+1] | final_norm)
    return h, y          # h: pre-final-norm hidden (decode_tail's input); y: final-normed

The default seam FP32_OPS is plain fp32 (below). `bf16_ops(fn)` adapts lmtail's bf16
`add_rms` (h = bf16(x + residual), y = bf16(h * inv_rms(h) * gamma)) to this fp32 body, so
switching the model onto lmtail's op is `ops=bf16_ops(lmtail_add_rms, order=...)`.

Rope (GGUF layout): the converter permuted the rows of attn_q / attn_k so that rope rotates
ADJACENT pairs (x[2i], x[2i+1]) of each 64-wide head by angle pos * base**(-2i/hd), i < hd/2.
(HF checkpoints rotate halves (x[i], x[i+hd/2]); the two are the same model after the permute.)
Angles and cos/sin are computed in float64 per position and rounded once to fp32.

GQA: query head j reads KV head j // (nh/nkv). Scores are fp32 q.k * hd**-0.5 (0.125, exact).

Batching: rows are LEFT-padded to a common prompt length. `KVCache.pad[b]` is the number
of pad slots before row b's first real token; slot s of row b has position s - pad[b], and
pad slots are invisible as keys to every real query. A pad query attends only to itself
(so its junk stays finite and can't poison real rows through 0 * NaN).

Numerics: this is model plumbing, not a declared-order op: torch fp32 GEMMs and softmax,
reduction orders chosen by the BLAS. Prefill vs decode and batch vs solo agree to fp32
rounding (tested with allclose), not to the byte; the byte-exact part is lmtail's tail.

Shape legend: B rows, T new tokens this call, S cache slots used (<= S_cap capacity),
H hidden, nh / nkv query / KV heads, g = nh // nkv, hd head dim, F FFN, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as Fn

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


def bf16_ops(add_rms_bf16: Callable, **kwargs) -> Ops:
    """Ops whose add_rms is lmtail's bf16 op `add_rms_bf16(x, residual, gamma, *, eps, **kwargs)`.

    x and residual are rounded to bf16 (so the residual stream becomes bf16, as in a bf16
    engine), gamma is passed as fp32 [H] (this model's norm weights are exact in bf16, so
    a bf16-gamma op may cast it losslessly), and h, y come back widened to fp32 (exact)."""

    def add_rms(x, residual, gamma, *, eps):
        lead = x.shape[:-1]
        xb = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)  # [N, H]
        rb = residual.expand_as(x).reshape(-1, x.shape[-1]).to(torch.bfloat16)
        h, y = add_rms_bf16(xb, rb, gamma, eps=eps, **kwargs)
        return h.float().reshape(*lead, -1), y.float().reshape(*lead, -1)

    return Ops(add_rms=add_rms)


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
# rope, attention, mlp
# ---------------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, *, head_dim: int, base: float):
    """cos, sin [B, 1, T, hd/2] fp32 of angle pos * base**(-2i/hd), computed in float64."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = base ** (-2.0 * i / head_dim)  # [hd/2]
    ang = positions.to(torch.float64)[:, None, :, None] * inv_freq  # [B, 1, T, hd/2]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) of x [B, n, T, hd] by (cos, sin) [B, 1, T, hd/2]."""
    xe, xo = x[..., 0::2], x[..., 1::2]  # [B, n, T, hd/2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)


def attention(y, lw: LayerWeights, cfg: LlamaConfig, kc, vc, *, s0, cos, sin, allowed):
    """Causal GQA self-attention of y [B, T, H] at slots s0..s0+T-1; writes kc/vc [B, nkv, S_cap, hd]
    in place; allowed [B, 1, 1, T, S] bool. Returns [B, T, H]."""
    B, T, _ = y.shape
    nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = Fn.linear(y, lw.wq).view(B, T, nh, hd).transpose(1, 2)  # [B, nh, T, hd]
    k = Fn.linear(y, lw.wk).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    v = Fn.linear(y, lw.wv).view(B, T, nkv, hd).transpose(1, 2)  # [B, nkv, T, hd]
    kc[:, :, s0:s0 + T] = apply_rope(k, cos, sin)
    vc[:, :, s0:s0 + T] = v
    S = s0 + T
    q = apply_rope(q, cos, sin).view(B, nkv, nh // nkv, T, hd)  # [B, nkv, g, T, hd]
    keys, vals = kc[:, :, None, :S], vc[:, :, None, :S]  # [B, nkv, 1, S, hd]
    scores = (q @ keys.transpose(-1, -2)) * hd ** -0.5  # [B, nkv, g, T, S]
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (p @ vals).reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)  # [B, T, H]
    return Fn.linear(out, lw.wo)


def mlp(y, lw: LayerWeights):
    """SwiGLU: w_down(silu(w_gate y) * w_up y); y [B, T, H] -> [B, T, H]."""
    return Fn.linear(Fn.silu(Fn.linear(y, lw.w_gate)) * Fn.linear(y, lw.w_up), lw.w_down)


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
    slots = torch.arange(s0, s0 + T)  # [T]
    positions = (slots[None, :] - cache.pad[:, None]).clamp(min=0)  # [B, T]
    cos, sin = rope_cos_sin(positions, head_dim=cfg.head_dim, base=cfg.rope_base)
    keys = torch.arange(s0 + T)  # [S]
    causal = keys[None, :] <= slots[:, None]  # [T, S]
    visible = keys[None, :] >= cache.pad[:, None]  # [B, S]
    allowed = causal & (visible[:, None, :] | (keys[None, :] == slots[:, None]))  # [B, T, S]
    allowed = allowed[:, None, None]  # [B, 1, 1, T, S]

    layers, eps = bundle.layers, cfg.eps
    x = bundle.embed[ids]  # [B, T, H]
    h, y = ops.add_rms(x, torch.zeros_like(x), layers[0].attn_norm, eps=eps)
    for i, lw in enumerate(layers):
        a = attention(y, lw, cfg, cache.k[i], cache.v[i], s0=s0, cos=cos, sin=sin, allowed=allowed)
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
