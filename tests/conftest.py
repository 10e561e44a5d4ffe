"""Shared test helpers: the bit views every byte comparison uses.

Import them as `from conftest import bits, same_bits` (pytest puts tests/ on sys.path).
"""
from __future__ import annotations

import torch

_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of a float tensor's bit patterns (bf16/fp16 -> int16, fp32 ->
    int32, fp64 -> int64; integer and bool tensors as they are), contiguous: comparing
    views compares bytes, so -0.0 != +0.0 and NaN payloads count."""
    t = t.contiguous()
    return t.view(_VIEWS[t.dtype]) if t.dtype in _VIEWS else t


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality of two tensors (dtype, shape and every byte), or both None."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))



def gather_rows(per_rank, maps, gbs):
    """{rank: tensor [R, ...]} placed at rows maps[rank] -> [gbs, ...]; each row exactly once
    (the vocab-parallel tests gather per-rank outputs into global row order with it)."""
    first = next(iter(per_rank.values()))
    out = torch.empty((gbs,) + tuple(first.shape[1:]), dtype=first.dtype)
    seen = torch.zeros(gbs, dtype=torch.int64)
    for r, t in per_rank.items():
        idx = torch.tensor(maps[r], dtype=torch.int64)
        assert idx.min() >= 0 and idx.max() < gbs, f"rank {r}'s map leaves the batch: {maps[r]}"
        out[idx] = t
        seen[idx] += 1
    assert bool((seen == 1).all()), "some rows owned zero or several times"
    return out
