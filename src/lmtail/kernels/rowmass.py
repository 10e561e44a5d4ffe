"""The sampler's full-vocab pass `row_mass` as a C kernel, bit-equal to the torch reference.

Shape legend:
  R  rows
  V  vocab: the full row (the summed axis)
  row    [R, V] float64   logits, NaN already folded to -inf when the caller asked for it
  scale  [R]    float64   divisor per row (1.0 for lse1, else the temperature)
  m, S   [R]    float64
  nz     [R]    int64     lanes whose exp term is > 0 (the lanes carrying probability mass)

Numerics (the contract; the same as `lmtail.sampler.row_mass`, which stays the declared
reference the tests compare against): per row, z = row / scale (one float64 division per
lane; a product by the exact 1/scale when scale is a power of two: the same bits),
m = max(z), nz = #{lanes with shifted_exp(z, m) > 0} and S = sum64(shifted_exp(z, m)),
where shifted_exp = numerics.exp64(z - m) with z == m -> exactly 1, and sum64 = 256 float64 lane chains in pass order (lane t holds
t, t+256, ..., from +0.0), then a halving tree of 8 levels: depth ceil(V/256) + 8. Every
float64 op of exp64 (clamp, round-half-even, Cody-Waite reduction, the in-place degree-13
Horner, the 2**n product) runs in the same order on every lane: src/lmtail/kernels/
rowmass.c spells it out and argues why picking the 2**n path per lane instead of per
tensor cannot change a bit. Hence (m, S, nz) are the reference's bits, and a row's result
depends on nothing but that row and its scale: not R, not the thread count, not repeats.

Rows whose bits the reference does not pin down by declared ops alone are computed by the
reference itself (on those rows only): a NaN among z (NaN lanes without the fold, inf/inf,
0/0) and a zero max reached by both +0.0 and -0.0. They are rare (never in a folded,
finite-temperature row without signed-zero ties) and cost one torch pass over those rows.

Backends (all bit-equal; the tests prove it): "avx512" (8 lanes per vector op),
"generic" (plain C), "torch" (the reference; used when no C compiler is found).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from lmtail import numerics
from lmtail.numerics import Decl, SumDecl

_ISA = {"generic": 0, "avx512": 2}
LANES = 256


def row_mass_decl(V: int) -> Decl:
    """The declaration of `row_mass_fast` (and of the reference) for a row of V lanes."""
    return Decl(
        op="row_mass",
        rounding_points=("z = fl64(row / scale)",
                         "e = exp64(z - m) (z == m -> 1): numerics.exp64's float64 ops",
                         "S = sum64(e)"),
        sums=(SumDecl(name="S", dtype="fp64", depth=-(-V // LANES) + 8,
                      order="256 lane chains in pass order from +0.0, then a halving "
                            "tree (lane t += lane t+128, +64, ..., +1)"),),
    )


# ---------------------------------------------------------------------------------------
# the C library
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _c_library():
    """The compiled C kernel (built and cached on first use), or None with a warning."""
    from lmtail.kernels._cc import load_optional

    lib = load_optional(Path(__file__).with_name("rowmass.c"), what="row_mass", fallback="the torch reference")
    if lib is None:
        return None
    fn = lib.lmtail_row_mass
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2
    fn.restype = ctypes.c_int
    lib.lmtail_rowmass_best_isa.restype = ctypes.c_int
    hook = lib.lmtail_rowmass_terms
    hook.argtypes = [ctypes.c_void_p, ctypes.c_double] + [ctypes.c_void_p] * 2 + [
        ctypes.c_int64, ctypes.c_int]
    hook.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def _constants() -> torch.Tensor:
    """[17] float64: INV_LN2, LN2_HI, LN2_LO, C[0..13], read from numerics (no copy)."""
    c = numerics._EXP_C
    assert len(c) == 14, "rowmass.c hard-codes exp64's degree-13 Horner"
    return torch.tensor([numerics._INV_LN2, numerics._LN2_HI, numerics._LN2_LO, *c],
                        dtype=torch.float64)


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, fastest first (all give the same bytes)."""
    lib = _c_library()
    if lib is None:
        return ("torch",)
    return ("avx512", "generic", "torch") if lib.lmtail_rowmass_best_isa() == 2 else (
        "generic", "torch")


def _terms(z: torch.Tensor, m: float, *, backend: str) -> torch.Tensor:
    """Test hook: the kernel's per-lane terms shifted_exp(z, m) for a 1-D float64 z <= m
    (no NaN), as `backend` computes them. The sum S >= 1 hides every term below 2**-53;
    this shows their bits (compare with sampler.shifted_exp(z[None], m))."""
    z = z.detach().to(torch.float64).contiguous()  # [n]
    y = torch.empty_like(z)  # [n]
    used = _c_library().lmtail_rowmass_terms(z.data_ptr(), float(m), _constants().data_ptr(),
                                             y.data_ptr(), z.numel(), _ISA[backend])
    assert used == _ISA[backend], (used, backend)
    return y


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
def _validate(row, scale) -> None:
    if not isinstance(row, torch.Tensor) or row.dim() != 2:
        got = tuple(row.shape) if isinstance(row, torch.Tensor) else type(row).__name__
        raise ValueError(f"row must be a 2-D torch.Tensor [R, V]; got {got}")
    if row.dtype != torch.float64:
        raise ValueError(f"row must be torch.float64; got {row.dtype}")
    if row.shape[1] == 0:
        raise ValueError(f"row must have V >= 1 lanes (the max of an empty row is "
                         f"undefined); got shape {tuple(row.shape)}")
    if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (row.shape[0],):
        got = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
        raise ValueError(f"scale must be a tensor [R] = ({row.shape[0]},); got {got}")
    if not scale.dtype.is_floating_point:
        raise ValueError(f"scale must be a floating tensor; got {scale.dtype}")
    for name, t in (("row", row), ("scale", scale)):
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be a CPU tensor; got device {t.device}")


def row_mass_fast(row: torch.Tensor, scale: torch.Tensor, *, threads: int | None = None,
                  backend: str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(m, S, nz) = max, shifted mass and massive-lane count of row/scale over the row.

    row [R, V] float64 (NaN already folded to -inf if asked; any strides), scale [R]
    floating (widened to float64 exactly, as torch's promotion does) -> (m [R], S [R]
    float64, nz [R] int64) with m = max(row/scale), S = sum64(exp64(row/scale - m)) >= 1
    and nz the number of lanes whose exp64 term is > 0: the same bits as
    `lmtail.sampler.row_mass` (module docstring). Rounding points: the division,
    exp64's float64 ops, the sum's adds; one sum, float64, depth ceil(V/256) + 8.
    threads: worker threads (default torch.get_num_threads()); a row is owned by one
    thread, so the count cannot change a bit. backend: one of `available_backends()`
    (default the fastest). The GIL is released while the kernel runs.
    Raises ValueError (nothing computed) on a non-2-D or non-float64 row, V == 0, or a
    scale that is not a floating [R] tensor, threads < 1, or an unknown backend.
    """
    _validate(row, scale)
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a positive int or None; got {threads!r}")
    backend = backend or available_backends()[0]
    if backend not in available_backends():
        raise ValueError(f"backend must be one of {available_backends()}; got {backend!r}")
    from lmtail.sampler import row_mass  # the declared reference (lazy: sampler may import us)

    assert row_mass is not row_mass_fast, "sampler.row_mass must stay the torch reference"
    R, V = row.shape
    if backend == "torch":
        return row_mass(row, scale)
    row = row.detach().contiguous()  # [R, V]
    scale = scale.detach().to(torch.float64).contiguous()  # [R], exact widening
    m = torch.empty(R, dtype=torch.float64)  # [R]
    S = torch.empty(R, dtype=torch.float64)  # [R]
    nz = torch.empty(R, dtype=torch.int64)  # [R]
    flag = torch.zeros(R, dtype=torch.int32)  # [R]
    if R == 0:
        return m, S, nz
    nthreads = torch.get_num_threads() if threads is None else int(threads)
    used = _c_library().lmtail_row_mass(
        row.data_ptr(), scale.data_ptr(), _constants().data_ptr(), m.data_ptr(),
        S.data_ptr(), nz.data_ptr(), flag.data_ptr(), R, V, V, nthreads, _ISA[backend])
    if used < 0:
        raise MemoryError(f"row_mass: could not allocate a {V}-lane row buffer")
    assert used == _ISA[backend], (used, backend)
    left = torch.nonzero(flag)[:, 0]  # rows the reference decides (NaN, +-0 max ties)
    if left.numel():
        m[left], S[left], nz[left] = row_mass(row[left], scale[left])
    return m, S, nz
