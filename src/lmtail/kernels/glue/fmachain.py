"""The declared fp32 fma chains as a C kernel, bit-equal to their torch emulation.

Shape legend:
  R  rows (every leading dim of a flattened)      N  the summed width
  T  tokens, H hidden width, S slots (the first `nslots` routed)
  a, b   [..., N] fp32 (b broadcast to a)  -> sums [...] fp32         (fma_sum_rows)
  slots  [S, T, H] fp32 or bf16, weights [T, >= nslots] fp32 -> [T, H] fp32 (moe_routed)

Numerics (the contract; every backend gives the same bits):
  fma_sum_rows: per lane an fp32 fma chain over the order's
    (pass, vec) elements in increasing element order from +0.0 (zero padded past N), the
    xor butterfly over each 32 lanes (16, 8, 4, 2, 1; placebo reversed), the lane groups
    added in order. Depth order.depth(N).
  moe_routed: the routed chain of norms.moe_add_rms: acc = fma(w[:, s], slot_s, acc) for
    s = 0, 1, ..., nslots - 1 from +0.0, bf16 slots widened exactly. Depth nslots.
Every step is one correctly rounded fp32 fma (C fmaf / vfmadd: what numerics.fma32
emulates in float64). NaN sign and payload are not declared (every NaN compares as one).
A row (token) is owned by one thread: neither the row count nor `threads` reaches a bit.

Backends (all bit-equal; tests/test_fmachain.py proves it), one `_backend.Dispatch` table
per op (backend=None: the fastest verified row, kernels._verify): "avx512" (16 lanes a vector op; CPUs with AVX-512F),
"c" (plain C), "torch" (numerics.fma32, an exact fp32 fma emulated in float64, as torch
tensor ops; the only one when no C compiler is found, and the one non-CPU tensors get).
"""
from __future__ import annotations

import ctypes
import math

import torch

from lmtail.checks import is_int, need, need_tensor
from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.numerics import fma32

BUTTERFLY = (16, 8, 4, 2, 1)  # the xor butterfly's offsets within a 32-lane group (orders use it)
_MIN_WORK_PER_THREAD = 1 << 16  # elements: below this a second thread costs more than it saves
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "lmtail_fma_sum": ([_P] * 3 + [_I64] * 4 + [_INT] * 5, _INT),
    "lmtail_moe_routed": ([_P, _INT, _P, _P] + [_I64] * 5 + [_INT] * 2, _INT),
}
_library = kernel_library("glue/fmachain.c", _SIGNATURES, what="fma chains", fallback="the torch backend (numerics.fma32)")
# the emulated build (SIMDe, lmtail_emulate.h): the "emu-avx512" rows, on any AVX2 + FMA + F16C CPU
_emulated = kernel_library("glue/fmachain.c", _SIGNATURES, what="fma chains", emulated=True)


def _c_available(*features: str):
    return lambda: _library() is not None and cpu.has(*features)


def _emu_available() -> bool:
    """The emulated rows run here: the C kernel builds and cpu.emulation_runs()."""
    return _library() is not None and cpu.emulation_runs()


# ---------------------------------------------------------------------------------------
# the "torch" backend: the same chains as torch tensor ops
# ---------------------------------------------------------------------------------------
def lane_fold(lanes: torch.Tensor, *, reverse: bool) -> torch.Tensor:
    """Steps 2-3 of an order: the xor butterfly within each 32-lane group (offsets 16, 8,
    4, 2, 1; reverse: 1, 2, ..., 16), then the T/32 group totals added in group order.
    lanes [..., T] fp32, T a multiple of 32 -> [...] fp32."""
    t = lanes.shape[-1]
    assert t % 32 == 0, "lanes come in groups of 32"
    g = lanes.reshape(*lanes.shape[:-1], t // 32, 32)  # [..., T/32, 32]
    # After xor step `off` every lane i holds g_i + g_(i^off) (fp32 + commutes bitwise), so
    # lane 0's butterfly is a fold: offsets 16..1 add the two halves, 1..16 adjacent pairs.
    for _ in BUTTERFLY:
        if reverse:
            g = g[..., 0::2] + g[..., 1::2]
        else:
            half = g.shape[-1] // 2
            g = g[..., :half] + g[..., half:]
    total = g[..., 0, 0]
    for k in range(1, t // 32):
        total = total + g[..., k, 0]
    return total


def products_exact(a: torch.Tensor, b: torch.Tensor, prod: torch.Tensor) -> bool:
    """True when fma(a_i, b_i, acc) == prod_i + acc for every element (prod = fp32 a*b).

    Cheap sufficient test: a and b are bf16 values (8-bit significands: low 16 bits zero),
    every product is finite and either a normal fp32 (then its 16 significant bits are
    exact) or an exact zero with a zero factor. Otherwise: compare against float64.
    """
    if not prod.numel():
        return True
    square = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    m = prod if square else prod.abs()  # a square is >= 0 or NaN
    lo, hi = torch.aminmax(m)
    bits = a.view(torch.int32) if square else a.view(torch.int32) | b.view(torch.int32)
    if bool(hi <= 3.4028234663852886e38) and int((bits & 0xFFFF).amax()) == 0:
        if bool(lo >= 2.0**-126):
            return True
        factor_zeros = m.numel() - int(torch.count_nonzero(a if square else torch.minimum(a.abs(), b.abs())))
        if int(torch.count_nonzero(m < 2.0**-126)) == factor_zeros:  # the small ones are exact zeros
            return True
    return bool(((prod.double() == a.double() * b.double()) | torch.isnan(prod)).all())


def _passes(z: torch.Tensor, t: int, v: int):
    """[..., N] -> the P passes [..., T, vec] of the order (views; only the last is padded)."""
    n, tv = z.shape[-1], t * v
    for i in range(0, n, tv):
        c = z[..., i : i + tv]
        if c.shape[-1] < tv:
            c = torch.nn.functional.pad(c, (0, tv - c.shape[-1]))
        yield c.reshape(*c.shape[:-1], t, v)


def _fma_sum_torch(a, b, lanes: int, vec: int, reverse: bool) -> torch.Tensor:
    """fma32 (exact fp32 fma emulated in float64) per step, vectorized over rows and lanes.
    When every product is exact in fp32 (squares of bf16 values) the fma is one fp32 add of
    the product: same bits."""
    prod = a * b  # [..., N] fp32 products
    acc = torch.zeros(a.shape[:-1] + (lanes,), dtype=torch.float32, device=a.device)  # [..., T]
    if products_exact(a, b, prod):  # zero padding: 0*0 = +0 adds like fma(0, 0, acc)
        for pp in _passes(prod, lanes, vec):
            for j in range(vec):
                acc = acc + pp[..., j]
    else:
        for pa, pb in zip(_passes(a, lanes, vec), _passes(b, lanes, vec)):
            for j in range(vec):
                acc = fma32(pa[..., j], pb[..., j], acc)
    return lane_fold(acc, reverse=reverse)


def _moe_routed_torch(slots, weights, nslots: int) -> torch.Tensor:
    acc = torch.zeros(slots.shape[1:], dtype=torch.float32, device=slots.device)  # [T, H], +0.0
    for i in range(nslots):  # routed chain, slot order from 0
        acc = fma32(weights[:, i : i + 1], slots[i].to(torch.float32), acc)
    return acc


# ---------------------------------------------------------------------------------------
# the C backends (unchecked: the op validated its arguments)
# ---------------------------------------------------------------------------------------
def _fma_sum_c(isa: int, library=lambda: _library()):
    def run(a, b, lanes, vec, reverse, threads):
        n, rows = a.shape[-1], math.prod(a.shape[:-1])
        a2 = a.detach().reshape(rows, n)  # [R, N]
        if a2.shape[0] and n and a2.stride(-1) != 1:
            a2 = a2.contiguous()
        b2 = b.detach().reshape(rows, n)  # [R, N]; a row broadcast keeps stride 0
        if b2.shape[0] and n and b2.stride(-1) != 1:
            b2 = b2.contiguous()
        out = torch.empty(rows, dtype=torch.float32)  # [R]
        if rows == 0:
            return out.reshape(a.shape[:-1])
        used = library().lmtail_fma_sum(
            a2.data_ptr(), b2.data_ptr(), out.data_ptr(), rows, n, a2.stride(0), b2.stride(0),
            lanes, vec, int(bool(reverse)), threads, isa)
        if used < 0:
            raise MemoryError(f"fma_sum: could not allocate a {lanes}-lane accumulator")
        assert used == isa, (used, isa)
        return out.reshape(a.shape[:-1])
    return run


def _moe_routed_c(isa: int, library=lambda: _library()):
    def run(slots, weights, nslots, threads):
        s, t, h = slots.shape
        out = torch.empty(t, h, dtype=torch.float32)  # [T, H]
        if t == 0 or h == 0:
            return out
        sl = slots.detach()
        if nslots and not (sl.stride(2) == 1 and sl.stride(1) == h):
            sl = sl.contiguous()  # [S, T, H]
        w = weights.detach()
        if w.stride(1) != 1:
            w = w.contiguous()  # [T, W]
        used = library().lmtail_moe_routed(
            sl.data_ptr(), int(sl.dtype == torch.bfloat16), w.data_ptr(), out.data_ptr(), t, h,
            nslots, sl.stride(0), w.stride(0), threads, isa)
        assert used == isa, (used, isa)
        return out
    return run


FMA_SUM = _backend.Dispatch("fma_sum_rows", (
    _backend.Backend("avx512", _fma_sum_c(2), _c_available("avx512f")),
    _backend.Backend("c", _fma_sum_c(0), _c_available()),
    _backend.Backend("torch", lambda a, b, lanes, vec, reverse, threads: _fma_sum_torch(a, b, lanes, vec, reverse),
                     device=None),
    _backend.Backend("emu-avx512", _fma_sum_c(2, _emulated), _emu_available, emulated=True),
))
MOE_ROUTED = _backend.Dispatch("moe_routed", (
    _backend.Backend("avx512", _moe_routed_c(2), _c_available("avx512f")),
    _backend.Backend("c", _moe_routed_c(0), _c_available()),
    _backend.Backend("torch", lambda slots, weights, nslots, threads: _moe_routed_torch(slots, weights, nslots),
                     device=None),
    _backend.Backend("emu-avx512", _moe_routed_c(2, _emulated), _emu_available, emulated=True),
))


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs for CPU tensors, in the table's order
    (backend=None takes the fastest verified one; all
    give the same bytes)."""
    return FMA_SUM.names()


def _device(*tensors) -> str:
    return "cpu" if all(t.device.type == "cpu" for t in tensors) else tensors[0].device.type


# ---------------------------------------------------------------------------------------
# the ops
# ---------------------------------------------------------------------------------------
def fma_sum_rows(a: torch.Tensor, b: torch.Tensor, *, lanes: int, vec: int, reverse: bool,
                 backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """sum_i a[..., i] * b[..., i] in the order (lanes, vec, reverse butterfly) (module
    docstring). a [..., N] fp32, b fp32 broadcastable to a -> [...] fp32.

    backend: one of available_backends() (default the first; non-CPU tensors: "torch");
    threads: worker threads (default: torch.get_num_threads(), fewer for small inputs); a
    row is owned by one thread, so neither can change a bit. The GIL is released while the
    C kernel runs. Raises ValueError (nothing computed) on non-fp32 or 0-d inputs, lanes
    not a positive multiple of 32, vec < 1, threads < 1 or an unknown backend (a C backend
    for non-CPU tensors); TypeError for a non-tensor.
    """
    for name, t in (("a", a), ("b", b)):
        need_tensor(name, t, "[..., N] fp32")
        need(t.dtype == torch.float32, f"{name} must be an fp32 tensor [..., N]; got {t.dtype}")
    need(a.dim() >= 1, f"a must be [..., N] with at least 1 dim; got {tuple(a.shape)}")
    need(is_int(lanes) and lanes >= 32 and lanes % 32 == 0, f"lanes must be a positive multiple of 32; got {lanes!r}")
    need(is_int(vec) and vec >= 1, f"vec must be an int >= 1; got {vec!r}")
    b = torch.broadcast_to(b, a.shape)  # raises on a bad shape
    n, rows = a.shape[-1], math.prod(a.shape[:-1])
    nthreads = _backend.threads(threads, work=rows * max(n, 1), min_work=_MIN_WORK_PER_THREAD)
    row = FMA_SUM.pick(backend, _device(a, b))
    return row.run(a, b, lanes, vec, reverse, nthreads)


def moe_routed(slots: torch.Tensor, weights: torch.Tensor, *, nslots: int,
               backend: str | None = None, threads: int | None = None) -> torch.Tensor:
    """routed[t, h] = fma(w[t, R-1], slots[R-1, t, h], ... fma(w[t, 0], slots[0, t, h], +0.0)),
    R = nslots, every step one fp32 fma rounding (module docstring).

    slots [S, T, H] fp32 or bf16 (bf16 widened exactly), weights [T, W] fp32 with W >= R,
    0 <= R <= S -> [T, H] fp32. threads/backend as fma_sum_rows (a token row per thread).
    Raises ValueError (nothing computed) on other dtypes, shapes or R; TypeError for a
    non-tensor.
    """
    need_tensor("slots", slots, "[S, T, H] fp32 or bf16")
    need(slots.dtype in (torch.float32, torch.bfloat16) and slots.dim() == 3,
         f"slots must be an fp32 or bf16 tensor [S, T, H]; got {(tuple(slots.shape), slots.dtype)}")
    s, t, h = slots.shape
    need_tensor("weights", weights, f"[T={t}, >= nslots] fp32")
    need(weights.dtype == torch.float32 and weights.dim() == 2 and weights.shape[0] == t,
         f"weights must be an fp32 tensor [T={t}, >= nslots]; got {(tuple(weights.shape), weights.dtype)}")
    need(is_int(nslots) and 0 <= nslots <= min(s, weights.shape[1]),
         f"nslots must be an int in [0, min(S={s}, W={weights.shape[1]})]; got {nslots!r}")
    nthreads = _backend.threads(threads, work=t * h * max(nslots, 1), min_work=_MIN_WORK_PER_THREAD)
    row = MOE_ROUTED.pick(backend, _device(slots, weights))
    return row.run(slots, weights, nslots, nthreads)


# ---------------------------------------------------------------------------------------
# the probes backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
@FMA_SUM.probe(sources=("glue/fmachain.c",))
def _fma_sum_probe(rows: int, seed: int):
    """a [rows, N] * b [N] fp32 in a 64-lane, vec-4, reversed order (N odd); seed 3 plants
    subnormals, inf and NaN."""
    g = torch.Generator().manual_seed(6000 + seed)
    n = 1000 if seed >= 0 else 2880
    a, b = torch.randn(rows, n, generator=g), torch.randn(n, generator=g)  # [rows, N], [N]
    if seed == 3:
        a[:, 1], b[2], a[0, 3], a[-1, 4] = 1e-41, 1e-40, float("inf"), float("nan")
    threads = torch.get_num_threads()
    return lambda name: fma_sum_rows(a, b, lanes=64, vec=4, reverse=seed % 2 == 1, backend=name,
                                     threads=threads)


@MOE_ROUTED.probe(sources=("glue/fmachain.c",))
def _moe_routed_probe(rows: int, seed: int):
    """slots [4, rows, H] (bf16 for odd seeds) and weights [rows, 4], 3 slots routed."""
    g = torch.Generator().manual_seed(6100 + seed)
    h = 100 if seed >= 0 else 2880
    slots = torch.randn(4, rows, h, generator=g)  # [S, T, H]
    if seed % 2:
        slots = slots.to(torch.bfloat16)
    weights = torch.rand(rows, 4, generator=g)  # [T, W]
    threads = torch.get_num_threads()
    return lambda name: moe_routed(slots, weights, nslots=3, backend=name, threads=threads)
