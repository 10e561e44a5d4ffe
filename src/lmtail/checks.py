"""Boundary checks shared by every public op: one rule per argument kind, one message shape.

Every public op validates its arguments here, before any work or collective, and raises
    ValueError  "<name> must be <expected>; got <got>"   for a bad value, shape or dtype,
    TypeError   "<name> must be a torch.Tensor ...; got <type>"   for a non-tensor where a
                tensor is required.
Nothing is written or mutated on the error path.

Shape legend: H hidden width (gamma's length).
"""
from __future__ import annotations

import math

import torch


def need(cond: bool, msg: str) -> None:
    """ValueError(msg) unless cond."""
    if not cond:
        raise ValueError(msg)


def need_tensor(name: str, t, expected: str) -> None:
    """TypeError unless t is a torch.Tensor; `expected` names its shape and dtype."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {expected}; got {type(t).__name__}")


def is_int(v) -> bool:
    """A Python int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_eps(eps) -> None:
    """eps: a real Python number (not bool), finite, >= 0 (every norm and the tail)."""
    ok = isinstance(eps, (int, float)) and not isinstance(eps, bool)
    need(ok and math.isfinite(eps) and eps >= 0, f"eps must be a finite number >= 0; got {eps!r}")


def check_k(k, hi: int, what: str) -> None:
    """k: an int in [1, hi]; `what` names the bound (e.g. "V=32000")."""
    need(is_int(k) and 1 <= k <= hi, f"k must be an int in [1, {what}]; got {k!r}")


def gamma32(gamma, h: int) -> torch.Tensor:
    """gamma [H] or [1, H], bf16 or fp32 -> fp32 [H], widened exactly (bf16 -> fp32 is exact)."""
    need_tensor("gamma", gamma, f"[H={h}]")
    need(gamma.dtype in (torch.bfloat16, torch.float32), f"gamma must be bf16 or fp32; got {gamma.dtype}")
    need(tuple(gamma.shape) in ((h,), (1, h)), f"gamma must be [H={h}] or [1, H]; got {tuple(gamma.shape)}")
    return gamma.reshape(h).to(torch.float32)


def check_threads(threads) -> None:
    """threads: None or an int >= 1 (bytes never depend on it)."""
    need(threads is None or (is_int(threads) and threads >= 1),
         f"threads must be a positive int or None; got {threads!r}")


def pick_backend(backend, have: tuple[str, ...]) -> str:
    """backend None -> the fastest of `have`; else it must be one of `have`."""
    need(backend is None or backend in have, f"backend must be one of {have}; got {backend!r}")
    return have[0] if backend is None else backend
