"""The declared fp32 fma chains as a C kernel, bit-equal to their torch emulation.

Shape legend:
  R  rows (every leading dim of a flattened)      N  the summed width
  T  tokens, H hidden width, S slots (the first `nslots` routed)
  a, b   [..., N] fp32 (b broadcast to a)  -> sums [...] fp32         (fma_sum_rows)
  slots  [S, T, H] fp32 or bf16, weights [T, >= nslots] fp32 -> [T, H] fp32 (moe_routed)

Numerics (the contract; the torch paths stay the declared references the tests compare
against, bit for bit):
  fma_sum_rows == orders._fma_sum_torch: per lane an fp32 fma chain over the order's
    (pass, vec) elements in increasing element order from +0.0 (zero padded past N), the
    xor butterfly over each 32 lanes (16, 8, 4, 2, 1; placebo reversed), the lane groups
    added in order. Depth order.depth(N).
  moe_routed == the routed loop of norms._moe_combine: acc = fma(w[:, s], slot_s, acc) for
    s = 0, 1, ..., nslots - 1 from +0.0, bf16 slots widened exactly. Depth nslots.
Every step is one correctly rounded fp32 fma (C fmaf / vfmadd: what numerics.fma32
emulates in float64). NaN sign and payload are not declared (every NaN compares as one).
A row (token) is owned by one thread: neither the row count nor `threads` reaches a bit.

Backends (all bit-equal; tests/test_fmachain.py proves it): "avx512" (16 lanes a vector
op), "generic" (plain C). `available_backends()` is () when no C compiler is found; the
callers then keep their torch path.
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch

_ISA = {"generic": 0, "avx512": 2}
_MIN_WORK_PER_THREAD = 1 << 16  # elements: below this a second thread costs more than it saves


@functools.lru_cache(maxsize=None)
def _c_library():
    """The compiled C kernel (built and cached on first use), or None with a warning."""
    from lmtail.kernels._cc import load_optional

    lib = load_optional(Path(__file__).with_name("fmachain.c"), what="fma chains",
                        fallback="the torch emulation (numerics.fma32)")
    if lib is None:
        return None
    fn = lib.lmtail_fma_sum
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 5
    fn.restype = ctypes.c_int
    moe = lib.lmtail_moe_routed
    moe.argtypes = [ctypes.c_void_p, ctypes.c_int] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64] * 5 + [ctypes.c_int] * 2
    moe.restype = ctypes.c_int
    lib.lmtail_fmachain_best_isa.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def available_backends() -> tuple[str, ...]:
    """The C backends this machine runs, fastest first (all give the same bytes); () when
    the kernel could not be built."""
    lib = _c_library()
    if lib is None:
        return ()
    return ("avx512", "generic") if lib.lmtail_fmachain_best_isa() == 2 else ("generic",)


def _threads_backend(threads, backend, work: int) -> tuple[int, str]:
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                or threads < 1):
        raise ValueError(f"threads must be a positive int or None; got {threads!r}")
    have = available_backends()
    backend = backend or (have[0] if have else None)
    if backend not in have:
        raise ValueError(f"backend must be one of {have}; got {backend!r}")
    if threads is None:
        threads = max(1, min(torch.get_num_threads(), work // _MIN_WORK_PER_THREAD))
    return threads, backend


def fma_sum_rows(a: torch.Tensor, b: torch.Tensor, *, lanes: int, vec: int, reverse: bool,
                 threads: int | None = None, backend: str | None = None) -> torch.Tensor:
    """sum_i a[..., i] * b[..., i] in the order (lanes, vec, reverse butterfly): the bits of
    orders._fma_sum_torch. a [..., N] fp32 CPU, b fp32 broadcastable to a -> [...] fp32.

    threads: worker threads (default: torch.get_num_threads(), fewer for small inputs); a
    row is owned by one thread, so the count cannot change a bit. backend: one of
    available_backends() (default the fastest). The GIL is released while the kernel runs.
    Raises ValueError (nothing computed) on non-fp32 / non-CPU / 0-d inputs, lanes not a
    positive multiple of 32, vec < 1, threads < 1 or an unknown backend.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
            got = (t.dtype, str(t.device)) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be an fp32 CPU tensor [..., N]; got {got}")
    if a.dim() < 1:
        raise ValueError(f"a must be [..., N] with at least 1 dim; got {tuple(a.shape)}")
    if not (isinstance(lanes, int) and lanes >= 32 and lanes % 32 == 0):
        raise ValueError(f"lanes must be a positive multiple of 32; got {lanes!r}")
    if not (isinstance(vec, int) and vec >= 1):
        raise ValueError(f"vec must be an int >= 1; got {vec!r}")
    b = torch.broadcast_to(b, a.shape)  # raises on a bad shape
    n, rows = a.shape[-1], math.prod(a.shape[:-1])
    a2 = a.detach().reshape(rows, n)  # [R, N]
    if a2.shape[0] and n and a2.stride(-1) != 1:
        a2 = a2.contiguous()
    b2 = b.detach().reshape(rows, n)  # [R, N]; a row broadcast keeps stride 0
    if b2.shape[0] and n and b2.stride(-1) != 1:
        b2 = b2.contiguous()
    threads, backend = _threads_backend(threads, backend, rows * max(n, 1))
    out = torch.empty(rows, dtype=torch.float32)  # [R]
    if rows == 0:
        return out.reshape(a.shape[:-1])
    used = _c_library().lmtail_fma_sum(
        a2.data_ptr(), b2.data_ptr(), out.data_ptr(), rows, n, a2.stride(0), b2.stride(0),
        lanes, vec, int(bool(reverse)), threads, _ISA[backend])
    if used < 0:
        raise MemoryError(f"fma_sum: could not allocate a {lanes}-lane accumulator")
    assert used == _ISA[backend], (used, backend)
    return out.reshape(a.shape[:-1])


def moe_routed(slots: torch.Tensor, weights: torch.Tensor, *, nslots: int,
               threads: int | None = None, backend: str | None = None) -> torch.Tensor:
    """routed[t, h] = fma(w[t, R-1], slots[R-1, t, h], ... fma(w[t, 0], slots[0, t, h], +0.0)),
    R = nslots, every step one fp32 fma rounding: the bits of norms' torch routed loop.

    slots [S, T, H] fp32 or bf16 (bf16 widened exactly), weights [T, W] fp32 with W >= R,
    0 <= R <= S -> [T, H] fp32. threads/backend as fma_sum_rows (a token row per thread).
    Raises ValueError (nothing computed) on other dtypes, devices, shapes or R.
    """
    if not isinstance(slots, torch.Tensor) or slots.dtype not in (torch.float32, torch.bfloat16) \
            or slots.dim() != 3 or slots.device.type != "cpu":
        got = (tuple(slots.shape), slots.dtype) if isinstance(slots, torch.Tensor) else type(slots).__name__
        raise ValueError(f"slots must be an fp32 or bf16 CPU tensor [S, T, H]; got {got}")
    s, t, h = slots.shape
    if not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32 \
            or weights.dim() != 2 or weights.shape[0] != t or weights.device.type != "cpu":
        got = (tuple(weights.shape), weights.dtype) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"weights must be an fp32 CPU tensor [T={t}, >= nslots]; got {got}")
    if not (isinstance(nslots, int) and 0 <= nslots <= min(s, weights.shape[1])):
        raise ValueError(f"nslots must be an int in [0, min(S={s}, W={weights.shape[1]})]; got {nslots!r}")
    threads, backend = _threads_backend(threads, backend, t * h * max(nslots, 1))
    out = torch.empty(t, h, dtype=torch.float32)  # [T, H]
    if t == 0 or h == 0:
        return out
    sl = slots.detach()
    if nslots and not (sl.stride(2) == 1 and sl.stride(1) == h):
        sl = sl.contiguous()  # [S, T, H]
    w = weights.detach()
    if w.stride(1) != 1:
        w = w.contiguous()  # [T, W]
    used = _c_library().lmtail_moe_routed(
        sl.data_ptr(), int(sl.dtype == torch.bfloat16), w.data_ptr(), out.data_ptr(), t, h,
        nslots, sl.stride(0), w.stride(0), threads, _ISA[backend])
    assert used == _ISA[backend], (used, backend)
    return out
