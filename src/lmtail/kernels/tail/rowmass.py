"""The sampler's full-vocab pass `row_mass`: max, shifted mass and massive-lane count of a row.

Shape legend:
  R  rows
  V  vocab: the full row (the summed axis)
  row    [R, V] float64   logits, NaN already folded to -inf when the caller asked for it
  scale  [R]    float64   divisor per row (1.0 for lse1, else the temperature)
  m, S   [R]    float64
  nz     [R]    int64     lanes whose exp term is > 0 (the lanes carrying probability mass)

Numerics (the contract): per row, z = row / scale (one float64 division per lane; the C
kernel multiplies by the exact 1/scale when scale is a power of two: the same bits),
m = max(z), nz = #{lanes with shifted_exp(z, m) > 0} and S = sum64(shifted_exp(z, m)),
where shifted_exp = numerics.exp64(z - m) with z == m -> exactly 1, and sum64 = SUM64_LANES
float64 lane chains in pass order (lane t holds t, t+256, ..., from +0.0), then a halving
tree of 8 levels: depth ceil(V/256) + 8. Every float64 op of exp64 (clamp,
round-half-even, Cody-Waite reduction, the in-place degree-13 Horner, the 2**n product)
runs in the same order on every lane: rowmass.c spells it out and argues why picking the
2**n path per lane instead of per tensor cannot change a bit. Hence every backend gives
the same (m, S, nz) bits, and a row's result depends on nothing but that row and its
scale: not R, not the thread count, not repeats.

Rows whose bits the declared ops alone do not pin down are computed by the torch path on
those rows only: a NaN among z (NaN lanes without the fold, inf/inf, 0/0) and a zero max
reached by both +0.0 and -0.0. They are rare (never in a folded, finite-temperature row
without signed-zero ties) and cost one torch pass over those rows.

`shifted_exp_rows` / `sum64_rows` are `shifted_exp` / `sum64` on small row blocks from C (the
same bits; the torch ops where a NaN or z > m appears): the candidates sampler's terms.

Backends (all bit-equal; tests/test_rowmass.py proves it), one `_backend.Dispatch` table
in the table's order (backend=None: the fastest verified, kernels._verify): "avx512" (8
lanes per vector op; AVX-512F), "c" (plain C),
"torch" (the declared ops as torch float64 tensor ops; the only one when no C compiler is
found).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from lmtail import numerics
from lmtail.checks import need, need_tensor
from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.numerics import exp64

SUM64_LANES = 256
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "lmtail_row_mass": ([_P] * 7 + [_I64] * 3 + [_INT] * 2, _INT),
    "lmtail_rowmass_terms": ([_P, ctypes.c_double, _P, _P, _I64, _INT], _INT),
    "lmtail_shifted_exp_rows": ([_P] * 4 + [_I64] * 2, _INT),
    "lmtail_sum64_rows": ([_P] * 2 + [_I64] * 2, _INT),
}
_library = kernel_library("tail/rowmass.c", _SIGNATURES, what="row_mass", fallback="the torch backend")
# the emulated build (SIMDe, lmtail_emulate.h): the "emu-avx512" rows, on any AVX2 + FMA + F16C CPU
_emulated = kernel_library("tail/rowmass.c", _SIGNATURES, what="row_mass", emulated=True)


# ---------------------------------------------------------------------------------------
# the declared float64 ops (the "torch" backend, and the pieces the sampler reuses)
# ---------------------------------------------------------------------------------------
def sum64(x: torch.Tensor) -> torch.Tensor:
    """Declared float64 row sum [R, N] -> [R]: SUM64_LANES lane chains (lane t holds t,
    t+256, ..., added in pass order from +0.0), then a halving tree (lane t += lane t+128,
    +64, ..., +1). Depth ceil(N/256) + 8."""
    r, n = x.shape
    p = -(-n // SUM64_LANES)
    x = torch.nn.functional.pad(x.double(), (0, p * SUM64_LANES - n)).view(r, p, SUM64_LANES)
    acc = torch.zeros(r, SUM64_LANES, dtype=torch.float64)
    for i in range(p):
        acc = acc + x[:, i]
    w = SUM64_LANES
    while w > 1:
        w //= 2
        acc = acc[:, :w] + acc[:, w:2 * w]
    return acc[:, 0]


def shifted_exp(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """exp64(z - m) with z == m -> 1 (defines +inf rows and all -inf rows). z [R, N], m [R]."""
    d = torch.where(z == m[:, None], torch.zeros_like(z), z - m[:, None])
    return exp64(d)


def shifted_exp_rows(z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """shifted_exp(z, m) (z [R, N], m [R]) with the same bits: rowmass.c's
    lmtail_shifted_exp_rows when built and every z <= m, nothing NaN; else the torch ops."""
    lib = _library()
    if lib is not None and z.dim() == 2 and z.dtype == m.dtype == torch.float64 and z.numel():
        zc, mc = z.detach().contiguous(), m.detach().contiguous()
        y = torch.empty_like(zc)  # [R, N]
        if not lib.lmtail_shifted_exp_rows(zc.data_ptr(), mc.data_ptr(), exp64_constants().data_ptr(),
                                           y.data_ptr(), zc.shape[0], zc.shape[1]):
            return y
    return shifted_exp(z, m)


def sum64_rows(x: torch.Tensor) -> torch.Tensor:
    """sum64(x) (x [R, N] float64) with the same bits: rowmass.c's lmtail_sum64_rows when
    built and nothing is NaN; else the torch ops."""
    lib = _library()
    if lib is not None and x.dim() == 2 and x.dtype == torch.float64 and x.numel():
        xc = x.detach().contiguous()
        out = torch.empty(xc.shape[0], dtype=torch.float64)  # [R]
        if not lib.lmtail_sum64_rows(xc.data_ptr(), out.data_ptr(), xc.shape[0], xc.shape[1]):
            return out
    return sum64(x)


def _row_mass_torch(row: torch.Tensor, scale: torch.Tensor):
    z = row / scale[:, None]  # [R, V]
    m = z.max(dim=1).values
    e = shifted_exp(z, m)
    return m, sum64(e), (e > 0).sum(dim=1)


# ---------------------------------------------------------------------------------------
# the C backends (unchecked: row_mass validated its arguments)
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def exp64_constants() -> torch.Tensor:
    """[17] float64 the C kernel is handed: numerics.exp64_constants() (rowmass.c holds no
    constant of its own)."""
    c = numerics.exp64_constants()
    assert len(c) == 17, "rowmass.c hard-codes exp64's degree-13 Horner"
    return torch.tensor(c, dtype=torch.float64)


def _row_mass_c(isa: int, library=lambda: _library()):
    def run(row, scale, threads):
        R, V = row.shape
        row = row.detach().contiguous()  # [R, V]
        scale = scale.detach().to(torch.float64).contiguous()  # [R], exact widening
        m = torch.empty(R, dtype=torch.float64)  # [R]
        S = torch.empty(R, dtype=torch.float64)  # [R]
        nz = torch.empty(R, dtype=torch.int64)  # [R]
        flag = torch.zeros(R, dtype=torch.int32)  # [R]
        if R == 0:
            return m, S, nz
        used = library().lmtail_row_mass(
            row.data_ptr(), scale.data_ptr(), exp64_constants().data_ptr(), m.data_ptr(),
            S.data_ptr(), nz.data_ptr(), flag.data_ptr(), R, V, V, threads, isa)
        if used < 0:
            raise MemoryError(f"row_mass: could not allocate a {V}-lane row buffer")
        assert used == isa, (used, isa)
        left = torch.nonzero(flag)[:, 0]  # rows the torch path decides (NaN, +-0 max ties)
        if left.numel():
            m[left], S[left], nz[left] = _row_mass_torch(row[left], scale[left].to(torch.float64))
        return m, S, nz
    return run


def _terms_c(isa: int, library=lambda: _library()):
    def run(z, m):
        y = torch.empty_like(z)  # [n]
        used = library().lmtail_rowmass_terms(z.data_ptr(), float(m), exp64_constants().data_ptr(),
                                               y.data_ptr(), z.numel(), isa)
        assert used == isa, (used, isa)
        return y
    return run


def _c_available(*features: str):
    return lambda: _library() is not None and cpu.has(*features)


def _emu_available() -> bool:
    """The emulated rows run here: the C kernel builds and cpu.emulation_runs()."""
    return _library() is not None and cpu.emulation_runs()


ROW_MASS = _backend.Dispatch("row_mass", (
    _backend.Backend("avx512", _row_mass_c(2), _c_available("avx512f")),
    _backend.Backend("c", _row_mass_c(0), _c_available()),
    _backend.Backend("torch", lambda row, scale, threads: _row_mass_torch(row, scale), device=None),
    _backend.Backend("emu-avx512", _row_mass_c(2, _emulated), _emu_available, emulated=True),
))
TERMS = _backend.Dispatch("shifted_exp_terms", (
    _backend.Backend("avx512", _terms_c(2), _c_available("avx512f")),
    _backend.Backend("c", _terms_c(0), _c_available()),
    _backend.Backend("torch", lambda z, m: shifted_exp(z[None], torch.tensor([float(m)], dtype=torch.float64))[0],
                     device=None),
    _backend.Backend("emu-avx512", _terms_c(2, _emulated), _emu_available, emulated=True),
))


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, in the table's order
    (backend=None takes the fastest verified one; all give the same bytes)."""
    return ROW_MASS.names()


def shifted_exp_terms(z: torch.Tensor, m: float, *, backend: str | None = None) -> torch.Tensor:
    """The per-lane terms shifted_exp(z, m) of a 1-D float64 z <= m (no NaN), as `backend`
    computes them ("torch": `shifted_exp`). The sum S >= 1 hides every term below 2**-53;
    this shows their bits."""
    need_tensor("z", z, "[n] float64")
    need(z.dim() == 1 and z.dtype == torch.float64, f"z must be [n] float64; got {tuple(z.shape)} {z.dtype}")
    return TERMS.pick(backend).run(z.detach().contiguous(), m)


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def _validate(row, scale) -> None:
    need_tensor("row", row, "[R, V] float64")
    need_tensor("scale", scale, "[R] floating")
    if row.dim() != 2:
        raise ValueError(f"row must be a 2-D torch.Tensor [R, V]; got {tuple(row.shape)}")
    if row.dtype != torch.float64:
        raise ValueError(f"row must be torch.float64; got {row.dtype}")
    if row.shape[1] == 0:
        raise ValueError(f"row must have V >= 1 lanes (the max of an empty row is "
                         f"undefined); got shape {tuple(row.shape)}")
    if tuple(scale.shape) != (row.shape[0],):
        raise ValueError(f"scale must be a tensor [R] = ({row.shape[0]},); got {tuple(scale.shape)}")
    if not scale.dtype.is_floating_point:
        raise ValueError(f"scale must be a floating tensor; got {scale.dtype}")
    for name, t in (("row", row), ("scale", scale)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")


def row_mass(row: torch.Tensor, scale: torch.Tensor, *, backend: str | None = None,
             threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, S, nz) = max, shifted mass and massive-lane count of row/scale over the row.

    row [R, V] float64 (NaN already folded to -inf if asked; any strides), scale [R]
    floating (widened to float64 exactly, as torch's promotion does) -> (m [R], S [R]
    float64, nz [R] int64) with m = max(row/scale), S = sum64(exp64(row/scale - m)) >= 1
    and nz the number of lanes whose exp64 term is > 0 (module docstring). Rounding
    points: the division, exp64's float64 ops, the sum's adds; one sum, float64, depth
    ceil(V/256) + 8. backend: one of `available_backends()` (default the first);
    threads: worker threads (default torch.get_num_threads()); a row is owned by one
    thread, so neither can change a bit. The GIL is released while the kernel runs.
    Raises ValueError (nothing computed) on a non-2-D or non-float64 row, V == 0, a
    scale that is not a floating [R] tensor, threads < 1 or an unknown backend; TypeError
    for a non-tensor row or scale.
    """
    _validate(row, scale)
    nthreads = _backend.threads(threads)
    return ROW_MASS.pick(backend).run(row, scale, nthreads)


# ---------------------------------------------------------------------------------------
# the probes backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
@ROW_MASS.probe(sources=("tail/rowmass.c",))
def _row_mass_probe(rows: int, seed: int):
    """float64 rows [rows, V] at mixed scales (1/T); seed 3 plants -inf and subnormal lanes."""
    g = torch.Generator().manual_seed(4000 + seed)
    V = 1000 if seed >= 0 else 32768
    row = torch.randn(rows, V, generator=g, dtype=torch.float64) * 4  # [rows, V]
    if seed == 3:
        row[:, 3], row[:, 8] = -float("inf"), 1e-41
    scale = torch.rand(rows, generator=g, dtype=torch.float64) + 0.5  # [rows]
    threads = torch.get_num_threads()
    return lambda name: row_mass(row, scale, backend=name, threads=threads)


@TERMS.probe(sources=("tail/rowmass.c",))
def _terms_probe(rows: int, seed: int):
    """z [64 rows] float64 <= m, some far below it (the underflow split)."""
    g = torch.Generator().manual_seed(4100 + seed)
    z = -torch.rand(64 * rows, generator=g, dtype=torch.float64) * (800.0 if seed == 3 else 30.0)
    return lambda name: shifted_exp_terms(z, 0.25, backend=name)
