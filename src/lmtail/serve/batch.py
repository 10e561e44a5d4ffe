"""One decode step of SmolLM2's declared body for R rows, each row with ITS OWN KV cache
and position (the continuous batch: rows joined at different steps, so their caches hold
different lengths).

    tokens [R] --embed--> x [R, H] --add_rms--> (h, y)        rows stacked
    per layer:
      qkv  = gemm_bf16(y, w_qkv)                              rows stacked  [R, qd + 2 kvd]
      row r: rope_qkv(qkv[r], pos_r) -> cache_r, q_r;          per row, own cache / position
             attend(q_r, cache_r)                             [1, 1, nh, hd]
      h, y = add_rms(gemm_bf16(a, w_o), h)                    rows stacked
      h, y = add_rms(gemm_bf16(silu_mul(gemm_bf16(y, w_gu)), w_down), h)
    returns h [R, H] fp32 (the pre-final-norm hidden: decode_tail's input)

Why a row's bytes equal the same row decoded alone (llama.forward with B = 1, T = 1):
every stacked op is row-invariant by declaration (gemm_bf16: each output's sum reads one
row of the activations; add_rms / silu_mul: one row at a time), and the per-row ops are
the very calls llama's declared body makes for one row (rope_qkv, attend with pad 0 at
the row's own s0 = cache.length). tests/test_serve.py checks it bit for bit against
llama.forward, rows joining and leaving. Only the declared body (ops.body == "declared")
is supported: the fp32 body's BLAS is not row-invariant in general.

Caches here are one-row KVCache values (pad [0]) from `row_cache`: every layer's keys and
values in ONE anonymous memory mapping, zero-filled by the kernel and made memory page by
page as slots are first written, so a cache sized for its row's whole life (prompt +
max_tokens) costs what it holds and never grows on the step path. `grow` reallocates one
with more slots (the filled slots copied: attention reads position-ordered keys only, so
the extra capacity changes no byte); the engine sizes caches so that it is not needed.

Shape legend: R rows, H hidden, nh / nkv query / KV heads, hd head dim, qd = nh*hd,
kvd = nkv*hd, F FFN width, L layers, S cache slots.
"""
from __future__ import annotations

import functools
import math
import mmap
import time

import torch

from ..kernels.quant import gemm_q as quant_mod
from ..kernels.model import step as kstep
from ..kernels.gemm.bf16 import gemm_bf16
from ..kernels.model.step import StepBuffers
from ..model import body as decl
from ..model.gguf_loader import LlamaConfig, ModelBundle
from ..model.body import SLACK
from ..kernels.model import body as kbody
from ..model.llama import (BQ32_BODY, Q32_BODY, KVCache, Ops, attend_unchecked, bq_gemm_row, bq_linears,
                           declared_kernels, embed_rows, forward, linear_q32, new_cache, norm_fn, q32_model)

GROW_SLOTS = 256  # a cache grows by at least this many slots at a time


def row_cache(cfg: LlamaConfig, capacity: int) -> KVCache:
    """An empty one-row cache (pad 0) with `capacity` slots (in [1, the context length]),
    the layout of model.llama.new_cache (k [1, nkv, hd, capacity + SLACK], v [1, nkv,
    capacity + SLACK, hd] fp32 per layer, every slot 0.0) in one anonymous mmap: the kernel
    zero-fills its pages on first touch, so untouched slots cost no memory (a row may be
    given its whole context up front) and read as 0.0, as new_cache's zeros do. Each
    layer's tensors start at a multiple of 256 bytes. The mapping is freed with the
    tensors (they hold it)."""
    if not 1 <= capacity <= cfg.context_length:
        raise ValueError(f"capacity must be in [1, {cfg.context_length}]; got {capacity}")
    nkv, hd, s = cfg.n_kv_heads, cfg.head_dim, capacity + SLACK
    per = nkv * hd * s  # fp32 values of one layer's k (and of its v)
    flat = torch.frombuffer(mmap.mmap(-1, 2 * cfg.n_layers * per * 4), dtype=torch.float32)  # zero pages
    k = [flat[2 * i * per:(2 * i + 1) * per].view(1, nkv, hd, s) for i in range(cfg.n_layers)]
    v = [flat[(2 * i + 1) * per:(2 * i + 2) * per].view(1, nkv, s, hd) for i in range(cfg.n_layers)]
    return KVCache(k=k, v=v, pad=torch.zeros(1, dtype=torch.int64))


def touch(cache: KVCache, slots: int, *, idle: float = 0.0) -> KVCache:
    """Make the pages of slots [0, slots) of a row_cache memory now (a 0.0 written at
    every 1,024th value of each key row and value block, and at its last one: every page
    they span): the page faults a first write there would take, taken by the caller's
    thread instead (Engine.submit_group: off the engine thread). Only for slots not
    written yet (0.0 stays 0.0). idle >= 0: after each layer the thread sleeps idle x the
    time that layer took (it leaves the cores to others for that share: a long prompt's
    faults spread out beside decoding rows instead of taking a core at once). Returns cache."""
    if idle < 0:
        raise ValueError(f"idle must be >= 0; got {idle!r}")
    n = min(slots, cache.capacity)
    if n < 1:
        return cache
    for k, v in zip(cache.k, cache.v):
        t0 = time.perf_counter()
        k[..., :n:1024] = 0.0  # [1, nkv, hd, n]: one value per page of each key row
        k[..., n - 1] = 0.0
        flat = v[0, :, :n].reshape(v.shape[1], -1)  # [nkv, n * hd] (a view: each head's slots are contiguous)
        flat[:, ::1024] = 0.0
        flat[:, -1] = 0.0
        if idle:
            time.sleep(idle * (time.perf_counter() - t0))
    return cache


def grow(cfg: LlamaConfig, cache: KVCache, need: int) -> KVCache:
    """`cache` if it holds `need` slots, else a copy with capacity min(context, max(need,
    capacity + GROW_SLOTS)); the filled slots copied, length kept. ValueError past the context."""
    if need <= cache.capacity:
        return cache
    if need > cfg.context_length:
        raise ValueError(f"need must be <= the context length {cfg.context_length}; got {need}")
    return copy_cache(cfg, cache, min(cfg.context_length, max(need, cache.capacity + GROW_SLOTS)))


@functools.lru_cache(maxsize=4)
def _gammas(bundle: ModelBundle):
    """(attn_norm[0..L-1] + final_norm, ffn_norm[0..L-1]) as contiguous fp32 [H] tensors."""
    attn = [lw.attn_norm.float().contiguous() for lw in bundle.layers] + [bundle.final_norm.float().contiguous()]
    return attn, [lw.ffn_norm.float().contiguous() for lw in bundle.layers]


ROWS_BODIES = ("declared", Q32_BODY, BQ32_BODY)  # the bodies step_rows (and the server) run


def step_rows(bundle: ModelBundle, tokens: torch.Tensor, caches: list[KVCache], ops: Ops, *,
              scratch: StepBuffers | None = None) -> torch.Tensor:
    """Feed tokens [R] int64 (row r's next token) through the declared, q32 or bq32 body, row
    r at position caches[r].length of its own one-row cache (which must hold one more slot:
    see grow); appends each row's key/value. Returns h [R, H] fp32, row r bytes-equal to
    llama.forward(bundle, tokens[r, None, None], caches[r], ops=ops)[0][0, 0].
    The q32 body runs kernels.model.step's rows entry (one C call for the R rows; `scratch` its
    buffers, kept by the caller across steps; None: fresh ones) when its libraries are
    built, else llama.forward row by row (the same bytes). The bq32 body runs each linear once
    for the R rows (gemm_bq on [R, in]: where AMX is, the tile rate) and each row's rope and
    attention on its own cache."""
    cfg = bundle.config
    if ops.body not in ROWS_BODIES:
        raise ValueError(f"ops.body must be one of {ROWS_BODIES} (row-invariant linears); got {ops.body!r}")
    if tokens.dim() != 1 or tokens.dtype != torch.int64 or tokens.shape[0] != len(caches):
        raise ValueError(f"tokens must be [R={len(caches)}] int64; got {tuple(tokens.shape)} {tokens.dtype}")
    for c in caches:
        if c.pad.shape != (1,) or int(c.pad[0]) != 0 or c.length + 1 > c.capacity:
            raise ValueError(f"each cache must be one row, pad 0, with a free slot; got pad {c.pad.tolist()}, "
                             f"length {c.length}, capacity {c.capacity}")
    if ops.body == Q32_BODY:
        return _step_rows_q32(bundle, tokens, caches, ops, scratch)
    if ops.body == BQ32_BODY:
        return _step_rows_bq32(bundle, tokens, caches, ops)
    R, nh, hd = len(caches), cfg.n_heads, cfg.head_dim
    cos_t, sin_t = decl.rope_table(cfg.context_length, cfg.head_dim, cfg.rope_base)  # [ctx, hd/2]
    norm = norm_fn(ops, cfg.eps)
    attn_g, ffn_g = _gammas(bundle)
    pos = [torch.tensor([[c.length]], dtype=torch.int64) for c in caches]  # R x [1, 1]
    x = bundle.embed[tokens]  # [R, H] fp32
    h, y = norm(x, torch.zeros(x.shape, dtype=torch.bfloat16), attn_g[0])  # bf16 residual stream
    weights = bundle.packed16 if ops.gemm_order == "amx32" and bundle.packed16 else bundle.linears16
    scale = 1.0 / math.sqrt(hd)
    for i, l16 in enumerate(weights):
        qkv = gemm_bf16(y, l16.w_qkv, order=ops.gemm_order)  # [R, qd + 2 kvd]
        a = torch.empty(R, nh * hd, dtype=torch.float32)  # [R, qd]
        for r, c in enumerate(caches):
            q = decl.rope_qkv(qkv[r:r + 1], cos_t, sin_t, pos[r], c.k[i], c.v[i], s0=c.length, nh=nh)  # [1, 1, nh, hd]
            a[r] = decl.attend(q, c.k[i], c.v[i], c.pad, s0=c.length, scale=scale).view(-1)
        h, y = norm(gemm_bf16(a.to(torch.bfloat16), l16.w_o, order=ops.gemm_order), h, ffn_g[i])
        gu = gemm_bf16(y, l16.w_gu, order=ops.gemm_order)  # [R, 2F]
        h, y = norm(gemm_bf16(decl.silu_mul_bf16(gu), l16.w_down, order=ops.gemm_order), h, attn_g[i + 1])
    for c in caches:
        c.length += 1
    return h.float()


def _step_rows_q32(bundle: ModelBundle, tokens, caches: list[KVCache], ops: Ops, scratch) -> torch.Tensor:
    """step_rows for the q32 body (inputs checked): kernels.model.step.run_q32_rows, or per row."""
    rows = len(caches)  # the rows' shape class picks each kernel's row (the same bytes on every row)
    gemm_row, attend_row = quant_mod.GEMM_Q.pick(None, rows=rows), decl.ATTEND.pick(None, rows=rows)
    if not (ops.native_step and kstep.available(gemm_row.name, attend_row.name)):
        return torch.cat([forward(bundle, tokens[r, None, None], c, ops=ops)[0][0] for r, c in enumerate(caches)])
    model = q32_model(bundle, ops.fused_norm_lanes, gemm_row.name, attend_row.name)
    scratch = kstep.StepBuffers(model.shape) if scratch is None else scratch
    h, _ = kstep.run_q32_rows(model, scratch, embed_rows(bundle, tokens), caches)  # [R, H]
    for c in caches:
        c.length += 1
    return h


def _step_rows_bq32(bundle: ModelBundle, tokens, caches: list[KVCache], ops: Ops) -> torch.Tensor:
    """step_rows for the bq32 body (inputs checked): llama._q32_layers' calls with the R rows'
    linears in one gemm_bq call each (row-invariant by the bq32 declaration) and each row's
    rope_qkv and attention on its own cache at its own position (the solo forward's calls)."""
    cfg = bundle.config
    R, nh, hd = len(caches), cfg.n_heads, cfg.head_dim
    cos_t, sin_t = decl.rope_table(cfg.context_length, cfg.head_dim, cfg.rope_base)  # [ctx, hd/2]
    attn_g, ffn_g = _gammas(bundle)
    lin = functools.partial(linear_q32, row=bq_gemm_row(R), threads=torch.get_num_threads())
    kerns = [declared_kernels(ops, cfg.eps, 1, 1, nh, c.length) for c in caches]  # each row's own s0
    pos = [torch.tensor([[c.length]], dtype=torch.int64) for c in caches]  # R x [1, 1]
    silu = kbody.silu_mul if kbody.available() else decl.silu_mul

    def norm(a, r, gamma):
        return decl.add_rms_rows32(a, r, gamma, eps=cfg.eps, lanes=ops.fused_norm_lanes)

    h, y = norm(embed_rows(bundle, tokens), None, attn_g[0])  # [R, H] fp32
    for i, q in enumerate(bq_linears(bundle)):
        qkv = lin(y, q.w_qkv)  # [R, qd + 2 kvd]
        a = torch.empty(R, nh * hd, dtype=torch.float32)  # [R, qd]
        for r, (c, kern) in enumerate(zip(caches, kerns)):
            qr = kern.rope_qkv(qkv[r:r + 1], cos_t, sin_t, pos[r], c.k[i], c.v[i], c.length, nh)  # [1, 1, nh, hd]
            a[r] = attend_unchecked(qr, c.k[i], c.v[i], c.pad, s0=c.length, scale=1.0 / math.sqrt(hd),
                                    row=kern.attend_row, threads=kern.attend_threads).reshape(-1)
        h, y = norm(lin(a, q.w_o), h, ffn_g[i])
        h, y = norm(lin(silu(lin(y, q.w_gu)), q.w_down), h, attn_g[i + 1])
    for c in caches:
        c.length += 1
    return h


def copy_cache(cfg: LlamaConfig, cache: KVCache, capacity: int | None = None) -> KVCache:
    """A copy of one-row `cache` with `capacity` slots (None: its own; >= its length): the
    filled slots copied, length kept (a row_cache when `cache` has pad 0). grow's new
    cache; a group's later jobs decode on their own copies of the prompt's cache."""
    capacity = cache.capacity if capacity is None else capacity
    one_row = cache.pad.shape == (1,) and int(cache.pad[0]) == 0
    new = row_cache(cfg, capacity) if one_row else new_cache(cfg, pad=cache.pad, capacity=capacity)
    s = cache.length
    for i in range(cfg.n_layers):
        new.k[i][..., :s] = cache.k[i][..., :s]
        new.v[i][:, :, :s] = cache.v[i][:, :, :s]
    new.length = s
    return new
