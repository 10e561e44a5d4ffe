"""`rows_tail_fused`: the decode tail after the exchange (exact top-k, the full-row mass terms,
the draw) as one CPU kernel that reads each bf16 row once, bit-equal to the reference path
`lmtail.tail.topk.exact_topk` + `lmtail.tail.sampler.sample_rows`. The public op is
`lmtail.tail.compose.rows_tail` (path="fused" calls this kernel, path="reference" the reference);
this module is the kernel only: its ctypes call, the checks of its own arguments, and no
import of the ops above it.

Shape legend:
  R  rows (the rows this rank owns)      V  vocab (the full row)      k  candidates
  rows_bf16        [R, V] bf16   full-vocab rows, column j = vocab id j
  sampling_params  [R, 3|4|5] fp32  top_k, top_p, temperature[, u[, min_p]] (kernels.tail.sampling.COL),
                   passed to C as [R] lmtail_sampling records (kernels.tail.sampling.sampling_records)
  topk_values      [R, k] bf16   descending;  topk_indices [R, k] int64
  tokens [R] int64;  logprobs [R] fp32;  truncated [R] bool;  undecided [R] bool

Semantics: exactly the reference's (lmtail.tail.topk and lmtail.tail.sampler document them): the k
largest values with ties to the lower id, +-inf ordinary, -0.0 == +0.0 (returned as +0.0),
NaN below -inf with nan_fold; then top-k / greedy / softmax(v / T) over the filtered set
(the whole row when top-k is off) / top-p / min-p / the inverse-cdf draw, and the raw
full-row logprob.

Numerics (declared; `rows_tail_decl`): the same float64 ops in the same order as the
reference, so the same bits:
  z = fl64(v / T) per lane (T widened exactly from fp32; a product by 1/T when T is a
    power of two: the same bits); m = fl64(vmax / T), which is max(z) since division is
    monotone;
  e = exp64(z - m) with z == m -> 1 (numerics.exp64's basic float64 ops, no libm);
  S = sum64(e) over the full row: 256 float64 lane chains in pass order from +0.0, then a
    halving tree (depth ceil(V/256) + 8); the same sum over the k candidates for top-k rows;
  p = e / S; c = sequential float64 running sum of p over the candidates (depth k);
  lse1 = vmax + log64(S at T = 1); logprob = fp32(v_tok - lse1).
The full-row passes run at T = 1 (always, for the logprob) and at T (only for rows with
top-k off and T != 1; at T = 1 the first pass is reused, which is the same value). A term is
a function of the lane's 16 bits, so when the row's value range spans few bf16 patterns
compared with V, the kernel computes each pattern's term once into a table and adds the
looked-up terms in the declared order: the same terms, the same order, the same bits.

Rows whose sampler bits the reference leaves to torch's undeclared behaviour come back
`undecided` for the reference sampler to decide (lmtail.tail.compose.rows_tail does), on those rows
only: a NaN lane without nan_fold, and a zero row maximum (vmax == 0 or vmax / T == 0, where
torch's choice between +0.0 and -0.0 is not declared). Their top-k is the kernel's (it is
defined by keys).

Memory: O(R * k) outputs plus O(k) scratch per thread and a 640 KB term table per worker
(pooled across calls); no [R, V] keys, no float copy of the rows.
Determinism: a row is owned by one thread from its first op to its last, so no bit depends
on R, the thread count, the backend or repeats. The kernel has no staged top-k taps (they
belong to the staged reference algorithm; lmtail.tail.compose.rows_tail takes them from exact_topk).

Backends (all bit-equal; tests/test_rows_tail.py proves it on this CPU), one
`_backend.Dispatch` table (backend=None: the fastest verified, kernels._verify): "avx512"
(AVX-512 F+BW), "avx2", "c" (plain C, any CPU); none when no C compiler is found.

Debug export: `debug_mass=True` also returns each sampled row's float64 full-row normalizer
S (at T = 1), its log-normalizer lse1 = vmax + log64(S) and its massive-lane count nz, as the
kernel computed them (tests compare them with kernels.tail.rowmass.row_mass bit for bit).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from lmtail.checks import check_k, check_threads, need, need_tensor
from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.kernels.tail.rowmass import exp64_constants
from lmtail.kernels.tail.sampling import sampling_records
from lmtail.numerics import Decl, SumDecl

LANES = 256
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    # rows, R, V, ld, k, nan_fold, sp (lmtail_sampling [R]), K, vals, ids, tokens, logprobs, trunc,
    # flag, dbg, nthreads, isa
    "lmtail_rows_tail": ([_P] + [_I64] * 4 + [_INT] + [_P] * 9 + [_INT] * 2, _INT),
    "lmtail_rows_tail_constants": ([_P], _INT),
}
_library = kernel_library("tail/rows_tail.c", SIGNATURES, what="rows_tail",
                          fallback="the reference path (topk.exact_topk + sampler.sample_rows)")
# the emulated build (SIMDe, lmtail_emulate.h): the "emu-avx512" row, on any AVX2 + FMA + F16C CPU
_emulated = kernel_library("tail/rows_tail.c", SIGNATURES, what="rows_tail", emulated=True)


def rows_tail_decl(V: int, k: int) -> Decl:
    """The declared numerics of `rows_tail_fused` (and of the reference) for V lanes, k
    candidates."""
    return Decl(
        op="rows_tail",
        rounding_points=("z = fl64(v / T)", "m = fl64(vmax / T)",
                         "e = exp64(z - m) (z == m -> 1): numerics.exp64's float64 ops",
                         "S = sum64(e)", "p = fl64(e / S)", "c = running sum64 of p",
                         "cdf = fl64(c / c_last)", "lse1 = fl64(vmax + log64(S1))",
                         "logprob = fp32(fl64(v_tok - lse1))"),
        sums=(SumDecl(name="S (full row)", dtype="fp64", depth=-(-V // LANES) + 8,
                      order="256 lane chains in pass order from +0.0, then a halving tree"),
              SumDecl(name="S (top-k candidates)", dtype="fp64", depth=-(-k // LANES) + 8,
                      order="256 lane chains in candidate order from +0.0, then a halving tree"),
              SumDecl(name="c (running mass)", dtype="fp64", depth=k,
                      order="sequential over candidates 0..k-1 from +0.0")),
    )


# ---------------------------------------------------------------------------------------
# the C library
# ---------------------------------------------------------------------------------------
def _c_library():
    """The compiled kernel (bound; built and cached on first use), or None with a warning.
    Tests replace this to plant variants."""
    return _library()


def c_constants() -> torch.Tensor:
    """[17] float64: the constants rows_tail.c holds itself: GREEDY_T, SQRT2 and log64's
    series coefficients 1/(2i+1), i = 0..14 (tests compare them with numerics and the sampler)."""
    out = torch.empty(17, dtype=torch.float64)
    assert _c_library().lmtail_rows_tail_constants(out.data_ptr()) == 17
    return out


def _c_available(*features: str):
    return lambda: _c_library() is not None and cpu.has(*features)


def _run_c(isa: int, library=lambda: _c_library()):
    def run(rows, k, nan_fold, ptrs, threads):
        r, v = rows.shape
        ld = rows.stride(0) if r > 1 else v
        used = library().lmtail_rows_tail(rows.data_ptr(), r, v, ld, k, int(nan_fold), *ptrs, threads, isa)
        if used == -2:
            raise MemoryError(f"rows_tail: could not allocate scratch for k={k}")
        assert used == isa, (used, isa)
    return run


ROWS_TAIL = _backend.Dispatch("rows_tail_fused", (
    _backend.Backend("avx512", _run_c(2), _c_available("avx512f", "avx512bw")),
    _backend.Backend("avx2", _run_c(1), _c_available("avx2")),
    _backend.Backend("c", _run_c(0), _c_available()),
    _backend.Backend("emu-avx512", _run_c(2, _emulated),
                     lambda: _c_library() is not None and cpu.emulation_runs(), emulated=True),
))


def available_backends() -> tuple[str, ...]:
    """The kernel's backends on this machine, in the table's order (backend=None takes the
    fastest verified one; all give the same bytes); () when no C compiler built it (lmtail.tail.compose.rows_tail then runs its
    reference path)."""
    return ROWS_TAIL.names()


# ---------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FusedRows:
    """What `rows_tail_fused` returns. The sampler fields are None without sampling_params;
    with them, rows where `undecided` is True hold tokens 0, logprobs 0.0, truncated False
    and must be sampled by the reference sampler (lmtail.tail.compose.rows_tail does that)."""

    topk_values: torch.Tensor  # [R, k] bf16, descending, ties to the lower id
    topk_indices: torch.Tensor  # [R, k] int64 vocab ids
    tokens: torch.Tensor | None = None  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] fp32, raw log_softmax over the full row
    truncated: torch.Tensor | None = None  # [R] bool
    undecided: torch.Tensor | None = None  # [R] bool: the reference sampler decides these rows
    debug_mass: torch.Tensor | None = None  # [R, 3] float64 S1, lse1, nz (debug_mass=True); NaN on undecided rows


def check_arguments(rows_bf16, *, k, nan_fold, threads) -> None:
    """The rows-tail arguments every path shares: TypeError for a non-tensor, else
    ValueError naming the argument (expected vs got)."""
    rows = rows_bf16
    need_tensor("rows_bf16", rows, "[R, V] bf16")
    need(rows.dtype == torch.bfloat16 and rows.dim() == 2,
         f"rows_bf16 must be a 2-D bfloat16 tensor [R, V]; got {rows.dtype} of shape {tuple(rows.shape)}")
    need(rows.device.type == "cpu", f"rows_bf16 must be a CPU tensor; got device {rows.device}")
    v = rows.shape[1]
    need(v < 1 << 32, f"V must be < 2**32 (ids are 32-bit in the keys); got {v}")
    check_k(k, v, f"V={v}")
    need(isinstance(nan_fold, bool), f"nan_fold must be a bool; got {nan_fold!r}")
    check_threads(threads)


def _check_params_layout(sp, r: int) -> None:
    """The layout the kernel reads (values are the caller's to validate: see
    rows_tail_fused)."""
    need_tensor("sampling_params", sp, f"[R={r}, 3|4|5] fp32")
    need(sp.dtype == torch.float32 and sp.dim() == 2 and sp.shape[0] == r and sp.shape[1] in (3, 4, 5),
         f"sampling_params must be a float32 tensor [R={r}, 3|4|5]; got {sp.dtype} of shape {tuple(sp.shape)}")


def rows_tail_fused(rows_bf16, *, k, sampling_params=None, nan_fold=False,
                    backend: str | None = None, threads: int | None = None,
                    debug_mass: bool = False) -> FusedRows:
    """Exact top-k and the sampler on full-vocab bf16 rows, in one pass per row (the C
    kernel; the public op is lmtail.tail.compose.rows_tail, whose path="fused" calls this).

    rows_bf16 [R, V] bf16 CPU (unit stride along V; other layouts are copied); 1 <= k <= V;
    sampling_params None or [R, 3|4|5] fp32 whose values sampler.validate_params accepts
    (the caller validates them; any values are memory-safe here, but only valid ones have
    the reference's meaning).
    Returns FusedRows: topk_values [R, k] bf16 (descending, ties to the lower id),
    topk_indices [R, k] int64, and with sampling_params tokens [R] int64, logprobs [R] fp32,
    truncated [R] bool, undecided [R] bool (rows whose sampler bits the reference defines:
    a NaN lane without nan_fold, a zero row maximum). Every decided row's bytes equal the
    reference's for every backend and thread count (module docstring: numerics).
    backend: one of available_backends() (None: the first); threads: worker threads
    (None: torch.get_num_threads()). The GIL is released while the kernel runs.
    debug_mass=True (with sampling_params) also fills debug_mass [R, 3] float64: each
    decided row's full-row S at T = 1, lse1 and nz as the kernel computed them.
    Raises TypeError for a non-tensor, ValueError (nothing computed) for a bad argument,
    RuntimeError when no C compiler built the kernel (available_backends() == ()).
    """
    check_arguments(rows_bf16, k=k, nan_fold=nan_fold, threads=threads)
    if not available_backends():
        raise RuntimeError("rows_tail_fused: the C kernel is unavailable (no C compiler or a "
                           "failed build); lmtail.tail.compose.rows_tail falls back to the reference path")
    row = ROWS_TAIL.pick(backend)
    r = rows_bf16.shape[0]
    if sampling_params is not None:
        _check_params_layout(sampling_params, r)
    need(isinstance(debug_mass, bool), f"debug_mass must be a bool; got {debug_mass!r}")
    need(not debug_mass or sampling_params is not None, "debug_mass=True needs sampling_params")
    return fused_unchecked(rows_bf16, k, sampling_params, nan_fold, row,
                           _backend.threads(threads), debug_mass)


def fused_unchecked(rows_bf16, k: int, sampling_params, nan_fold: bool, row: _backend.Backend,
                    threads: int, debug_mass: bool = False) -> FusedRows:
    """rows_tail_fused on arguments it has validated (row: a ROWS_TAIL backend row)."""
    r, v = rows_bf16.shape
    sampling = sampling_params is not None
    rows = rows_bf16 if rows_bf16.stride(1) == 1 else rows_bf16.contiguous()  # [R, V]
    vals = torch.empty((r, k), dtype=torch.bfloat16)  # [R, k]
    ids = torch.empty((r, k), dtype=torch.int64)  # [R, k]
    consts = exp64_constants()
    dbg = torch.full((r, 3), float("nan"), dtype=torch.float64) if debug_mass else None  # [R, 3]
    if sampling:
        rec = sampling_records(sampling_params)  # [R] lmtail_sampling
        tokens = torch.zeros(r, dtype=torch.int64)  # [R]
        logprobs = torch.zeros(r, dtype=torch.float32)  # [R]
        trunc = torch.zeros(r, dtype=torch.bool)  # [R]
        flag = torch.zeros(r, dtype=torch.int32)  # [R]
        ptrs = [rec.ctypes.data, consts.data_ptr(), vals.data_ptr(),
                ids.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(), trunc.data_ptr(),
                flag.data_ptr(), None if dbg is None else dbg.data_ptr()]
    else:
        ptrs = [None, consts.data_ptr(), vals.data_ptr(), ids.data_ptr(), None, None, None, None, None]
    if r:
        row.run(rows, k, nan_fold, ptrs, threads)
    if not sampling:
        return FusedRows(topk_values=vals, topk_indices=ids)
    return FusedRows(topk_values=vals, topk_indices=ids, tokens=tokens, logprobs=logprobs,
                     truncated=trunc, undecided=flag != 0, debug_mass=dbg)


# ---------------------------------------------------------------------------------------
# the probe backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
@ROWS_TAIL.probe(sources=("tail/rows_tail.c",))
def _rows_tail_probe(rows: int, seed: int):
    """bf16 rows [rows, V] with ties, sampled with mixed top_k / top_p / T / u / min_p (a
    greedy row among them); seed 3 plants NaN (nan_fold), inf and subnormal lanes."""
    g = torch.Generator().manual_seed(3000 + seed)
    V, k = (300, 20) if seed >= 0 else (32768, 64)
    x = (torch.randn(rows, V, generator=g) * 3).to(torch.bfloat16)  # [rows, V]
    x[:, 5] = x[:, 9]  # a tie
    if seed == 3:
        x[0, 2], x[-1, 4], x[:, 6] = float("nan"), float("inf"), 1e-39
    sp = torch.stack([torch.randint(0, k + 1, (rows,), generator=g).float(),
                      torch.rand(rows, generator=g) * 0.9 + 0.1,
                      torch.rand(rows, generator=g) * 1.5 + 0.25,
                      torch.rand(rows, generator=g),
                      torch.rand(rows, generator=g) * 0.2], dim=1)  # [rows, 5]
    sp[0, 2] = 0.0  # greedy
    threads = torch.get_num_threads()
    return lambda name: rows_tail_fused(x, k=k, sampling_params=sp, nan_fold=seed == 3,
                                        backend=name, threads=threads)
