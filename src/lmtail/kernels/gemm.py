"""The lm_head GEMM with a declared summation order: an fp32 fma chain over h.

Shape legend:
  M  rows of activations (gbs, or a row block of it)
  H  hidden size: the summed axis (sum depth)
  V  columns of the weight shard (V_s)
  a    [M, H] bf16   GEMM input activations
  w    [H, V] bf16   lm_head shard, already transposed, C-contiguous
  out  [M, V] fp32

Numerics (the contract, docs/gemm.md): every output element on its own is
    acc = +0.0;  for h = 0, 1, ..., H-1:  acc = fl32(acc + a[m,h] * w[h,v]);  out = acc
with ONE rounding per step (an fp32 fused multiply-add: the product a*w is taken exactly,
then added and rounded to nearest-even). A NaN result is stored as the canonical quiet NaN
(bits 0x7FC00000); NaN/inf otherwise follow IEEE (inf*0 = NaN, inf-inf = NaN). Subnormals
are honoured (no flush-to-zero, whatever the caller's MXCSR). One sum: fp32, depth H,
sequential in h. Hence, byte for byte: a row's result does not depend on M or on the other
rows, nor on the thread count, nor on repeats, and a column slice of w gives the same bytes
as slicing the full result. A row block goes into a preallocated result by
`gemm_bf16_chain(a[r0:r1], w, out=full[r0:r1])`.

Backends, all bit-equal (the tests prove it against `gemm_bf16_chain_reference`):
  "avx512"  C kernel (src/lmtail/kernels/gemm_chain.c): 6x64 register tiles over an fp32
            panel widened once per (h block, column tile); for M <= 6, accumulators in
            L1 and w rows streamed; pthreads over column tiles;
  "generic" the same C library's plain-C loop with fmaf (any CPU with a C compiler);
  "numba"   used only when the C library cannot be built: float64 emulation of the fma
            (product exact in float64; the double rounding float64 -> fp32 is innocuous
            here, docs/gemm.md), parallel over column tiles.
"""
from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import numba
import numpy as np
import torch

from lmtail.numerics import Decl, SumDecl, fma32

_ISA = {"generic": 0, "avx512": 2}
_NUMBA_TILE = 64


def gemm_decl(H: int) -> Decl:
    """The declaration of `gemm_bf16_chain` for hidden size H."""
    return Decl(
        op="gemm_bf16_chain",
        rounding_points=("acc = fl32(acc + a*w) each h step (fma: exact product, 1 rounding)",
                         "NaN result -> canonical quiet NaN 0x7FC00000"),
        sums=(SumDecl(name="acc", dtype="fp32", depth=H,
                      order="sequential chain h = 0..H-1 from +0.0, per output element"),),
    )


# ---------------------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------------------
def _validate(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None) -> None:
    for name, t, want in (("a", a, "[M, H]"), ("w", w, "[H, V]")):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor {want}; got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} must be 2-D {want}; got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be torch.bfloat16; got {t.dtype}")
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")
    if a.shape[1] != w.shape[0]:
        raise ValueError(f"H mismatch: a is [M, H] = {tuple(a.shape)} but w is [H, V] = "
                         f"{tuple(w.shape)}; expected a.shape[1] == w.shape[0]")
    if not w.is_contiguous():
        raise ValueError(f"w must be C-contiguous [H, V]; got strides {w.stride()} for shape "
                         f"{tuple(w.shape)} (expected ({w.shape[1]}, 1))")
    if out is None:
        return
    M, V = a.shape[0], w.shape[1]
    if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
        got = out.dtype if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a torch.float32 tensor; got {got}")
    if tuple(out.shape) != (M, V):
        raise ValueError(f"out must be [M, V] = {(M, V)}; got {tuple(out.shape)}")
    if out.device.type != "cpu":
        raise ValueError(f"out must be a CPU tensor; got device {out.device}")
    if M > 0 and V > 0 and (out.stride(1) != 1 or (M > 1 and out.stride(0) < V)):
        raise ValueError(f"out must have unit column stride and row stride >= V = {V}; "
                         f"got strides {out.stride()}")


# ---------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _c_library():
    """The compiled C kernel (built and cached on first use), or None with a warning."""
    from lmtail.kernels._cc import load_optional

    lib = load_optional(Path(__file__).with_name("gemm_chain.c"), what="gemm", fallback="the numba fallback")
    if lib is None:
        return None
    fn = lib.lmtail_gemm_bf16_chain
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    lib.lmtail_gemm_best_isa.restype = ctypes.c_int
    return lib


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, fastest first (all give the same bytes)."""
    lib = _c_library()
    if lib is None:
        return ("numba",)
    return ("avx512", "generic", "numba") if lib.lmtail_gemm_best_isa() == 2 else (
        "generic", "numba")


@numba.njit(parallel=True, cache=True)
def _chain_numba(aT, w16, out):  # aT [H, M] f32, w16 [H, V] u16, out [M, V] f32 (a view)
    H, M = aT.shape
    V = w16.shape[1]
    for t in numba.prange((V + _NUMBA_TILE - 1) // _NUMBA_TILE):
        c0 = t * _NUMBA_TILE
        nc = min(V - c0, _NUMBA_TILE)
        bits = np.empty((H, nc), np.uint32)  # [H, nc]
        for h in range(H):
            for c in range(nc):  # bf16 -> fp32 is exact: the bits shifted left by 16
                bits[h, c] = np.uint32(w16[h, c0 + c]) << np.uint32(16)
        wt = bits.view(np.float32)  # [H, nc]
        acc = np.empty(nc, np.float32)
        for m in range(M):
            acc[:] = 0.0
            for h in range(H):
                am = np.float64(aT[h, m])
                for c in range(nc):  # fma32 = round32(acc + a*w): a*w exact in float64
                    acc[c] = np.float32(np.float64(acc[c]) + am * np.float64(wt[h, c]))
            for c in range(nc):
                out[m, c0 + c] = np.float32(np.nan) if np.isnan(acc[c]) else acc[c]


def _run(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, backend: str) -> None:
    """out[:, :] = the chain, computed by `backend` (inputs already validated)."""
    M, H = a.shape
    aT = a.detach().float().t().contiguous()  # [H, M] fp32, exact widening
    if backend == "numba":
        _chain_numba(aT.numpy(), w.detach().view(torch.int16).numpy().view(np.uint16),
                     out.detach().numpy())
        return
    lib = _c_library()
    assert lib is not None and backend in _ISA, backend
    ldc = out.stride(0) if M > 1 else w.shape[1]
    used = lib.lmtail_gemm_bf16_chain(aT.data_ptr(), w.data_ptr(), out.data_ptr(), M, H,
                                      w.shape[1], ldc, torch.get_num_threads(), _ISA[backend])
    assert used == _ISA[backend], (used, backend)


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def gemm_bf16_chain(a: torch.Tensor, w: torch.Tensor, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """out = a @ w as the declared fp32 fma chain (module docstring, docs/gemm.md).

    a [M, H] bf16 (any strides), w [H, V] bf16 C-contiguous -> [M, V] fp32.
    out: optional [M, V] fp32 destination with unit column stride and row stride >= V
    (e.g. a row block `full[r0:r1]` of a bigger result); returned when given.
    Rounding: one per h step (fma), fp32 round-to-nearest-even, subnormals kept; one sum,
    fp32, depth H, sequential h = 0..H-1 from +0.0. NaN results are 0x7FC00000.
    Deterministic and batch-, thread- and column-slice-invariant to the byte. Runs on
    torch.get_num_threads() threads; the GIL is released while it runs.
    Raises ValueError (nothing written) on wrong dtypes, ranks, H mismatch, a
    non-contiguous w or a bad out.
    """
    _validate(a, w, out)
    M, H = a.shape
    V = w.shape[1]
    if out is None:
        out = torch.empty(M, V, dtype=torch.float32)  # [M, V]
    if M == 0 or V == 0:
        return out
    if H == 0:
        return out.zero_()
    _run(a, w, out, available_backends()[0])
    return out


def gemm_bf16_chain_reference(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The declared chain, obviously: a loop over h, vectorized over [M, V].

    Each step is `numerics.fma32` (an exact fp32 fma emulated in float64), so the result
    is the contract by construction. Slow (about 20 float64 ops per step and element):
    for tests on small shapes. Same validation and result as `gemm_bf16_chain`.
    """
    _validate(a, w, None)
    M, H = a.shape
    a32, w32 = a.float(), w.float()  # exact widening
    acc = torch.zeros(M, w.shape[1], dtype=torch.float32)  # [M, V], +0.0
    for h in range(H):
        acc = fma32(a32[:, h:h + 1], w32[h:h + 1, :], acc)  # [M, 1] * [1, V] + [M, V]
    return torch.where(torch.isnan(acc), torch.full_like(acc, math.nan), acc)
