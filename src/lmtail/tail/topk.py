"""Exact top-k over bf16 rows, staged: chunks, then a merge.

Definition: the k largest values of each row, ties broken by the LOWER vocab id,
sorted descending. +-inf are ordinary values, -0.0 == +0.0 (a tie, broken by id). NaN:
with nan_fold=True NaN lanes rank below every number (and among themselves by id); with
nan_fold=False the caller promises NaN-free rows, and NaN input gives an unspecified (but
crash-free) answer.

How the order becomes a property of the code rather than of torch.topk: every lane gets
a unique int64 key

    key = mono16(value) * 2**32 + (2**32 - 1 - vocab_id)

where mono16 maps the bf16 bit pattern to an unsigned integer that increases with the
value. Keys are distinct within a row, so "the k largest keys" has exactly one answer and
torch.topk (any algorithm, any thread count) must return it.

Stages:  row [R, V] --pad to n*C with -inf (ids >= V)--> [R, n, C]
         stage 1: top-min(k, C) keys per chunk           [R, n, k1]
                  (for C <= 2**14 on int32 chunk-local keys mono << 14 | (C-1-pos): the
                  same order inside a chunk, half the bytes; then widened to global keys)
         stage 2: top-k of the n*k1 candidates            [R, k]
Exact because every global top-k key is among its own chunk's top-k1 keys. Pad lanes are
-inf past the vocab with the reserved key 0, below every real lane (a real -inf, even a
folded NaN), so with k <= V no pad lane is ever chosen.

Shape legend: R rows, V vocab, C chunk width, n = ceil(V / C) chunks, k candidates.
"""
from __future__ import annotations

import torch

from lmtail.numerics import Decl

_ID_MASK = (1 << 32) - 1
NEG_INF_BF16_BITS = 0xFF80


def mono_keys(values: torch.Tensor, *, nan_fold: bool) -> torch.Tensor:
    """bf16 [R, V] -> int32 [R, V] in [1, 65536]: an integer that orders like the value.
    -0.0 maps to +0.0's key; with nan_fold every NaN maps to 1 (below -inf's 0x0080).
    0 is reserved for pad lanes, below everything.

    Signed 16-bit pattern b: negative floats have their 15 magnitude bits flipped
    (b ^ 0x7FFF), which makes the signed order the float order; + 32769 shifts to [1, 65536].
    """
    assert values.dtype == torch.bfloat16
    b = values.view(torch.int16).to(torch.int32)  # [R, V] sign-extended pattern
    b = b.masked_fill(b == -32768, 0)  # -0 -> +0
    mono = (b ^ ((b >> 15) & 0x7FFF)) + 32769
    if nan_fold:
        mono = mono.masked_fill((b & 0x7FFF) > 0x7F80, 1)
    return mono


def mono_to_bf16(mono: torch.Tensor) -> torch.Tensor:
    """Inverse of mono_keys (a folded NaN decodes as a NaN, a pad lane as -inf)."""
    m = mono.to(torch.int64) - 1
    pos = (m & 0x8000) != 0
    bits = torch.where(pos, m & 0x7FFF, (~m) & 0xFFFF)
    bits = torch.where(m == 0, torch.full_like(bits, 0x7FC0), bits)  # folded NaN
    bits = torch.where(mono == 0, torch.full_like(bits, NEG_INF_BF16_BITS), bits)  # pad
    return bits.to(torch.int16).view(torch.bfloat16)


def row_keys(values: torch.Tensor, *, nan_fold: bool, id_offset: int = 0) -> torch.Tensor:
    """Unique ordering keys [R, V] int64 for a bf16 row block whose column j is vocab id
    id_offset + j."""
    ids = torch.arange(id_offset, id_offset + values.shape[-1], dtype=torch.int64)
    return (mono_keys(values, nan_fold=nan_fold).to(torch.int64) << 32) | (_ID_MASK - ids)


def split_keys(keys: torch.Tensor):
    """int64 keys -> (bf16 values, int64 vocab ids)."""
    return mono_to_bf16(keys >> 32), _ID_MASK - (keys & _ID_MASK)


def exact_topk_decl() -> Decl:
    """The declaration of exact_topk: it is exact. It compares unique int64 keys built by
    integer operations (mono16 of the bf16 bits, the vocab id); no value is computed, so
    there is no rounding point and no sum: the outputs are input values and ids, bit for bit."""
    return Decl(
        op="exact_topk",
        rounding_points=("none: comparisons of unique int64 keys (mono16(bf16 bits) << 32 | "
                         "(2^32 - 1 - id)); values returned as they came in",),
        sums=(),
    )


def exact_topk(values: torch.Tensor, *, k: int, nan_fold: bool = False, chunk: int = 4096,
               debug_taps: bool = False):
    """Exact top-k of bf16 rows (see module docstring).

    values [R, V] bf16; 1 <= k <= V; chunk >= 1.
    Returns (topk_values [R, k] bf16 descending, topk_indices [R, k] int64, taps) where
    taps is None or a dict of the stage results:
      stage1_keys [R, n, k1] int64, stage1_positions [R, n, k1] (lane within its chunk),
      stage1_ids [R, n, k1], stage1_values [R, n, k1] bf16, candidates [R, n*k1] int64 keys.
    Deterministic and row-independent: a row's answer never depends on the other rows.
    """
    r, v = values.shape
    if not 1 <= k <= v:
        raise ValueError(f"k must be in [1, V={v}]; got {k}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1; got {chunk}")
    n = -(-v // chunk)
    pad = n * chunk - v
    k1 = min(k, chunk)
    if chunk <= 1 << 14:  # stage 1 on int32 keys local to the chunk: mono << 14 | (C-1-pos)
        local = mono_keys(values, nan_fold=nan_fold)  # [R, V] int32
        if pad:  # mono 0: a -inf past the vocab, below every real lane (even a folded NaN)
            local = torch.cat([local, torch.zeros((r, pad), dtype=torch.int32)], dim=1)
        pos = torch.arange(chunk, dtype=torch.int32)
        local = (local.view(r, n, chunk) << 14) | ((chunk - 1) - pos)  # [R, n, C]
        l1, pos1 = torch.topk(local, k1, dim=-1, largest=True, sorted=True)  # [R, n, k1]
        gid = pos1 + torch.arange(n, dtype=torch.int64)[None, :, None] * chunk  # [R, n, k1]
        s1 = ((l1 >> 14).to(torch.int64) << 32) | (_ID_MASK - gid)  # global int64 keys
        s1 = torch.where(gid >= v, torch.zeros_like(s1), s1)  # pad lanes keep key 0
    else:
        keys = row_keys(values, nan_fold=nan_fold)  # [R, V]
        if pad:
            keys = torch.cat([keys, torch.zeros((r, pad), dtype=torch.int64)], dim=1)
        s1, pos1 = torch.topk(keys.view(r, n, chunk), k1, dim=-1, largest=True, sorted=True)
    cand = s1.reshape(r, n * k1)  # [R, n*k1]
    top, _ = torch.topk(cand, k, dim=-1, largest=True, sorted=True)  # [R, k]
    vals, ids = split_keys(top)
    taps = None
    if debug_taps:
        v1, i1 = split_keys(s1)
        taps = {"stage1_keys": s1, "stage1_positions": pos1, "stage1_ids": i1,
                "stage1_values": v1, "candidates": cand, "chunk": chunk}
    return vals, ids, taps
