"""`shard_partials`: one vocab shard's exact fp32 top-(k+1) keys and its chunk mass partials.

The per-rank half of the candidates exchange (lmtail.tail.candidates composes it; this module is
the kernel only, with no import of the ops above it).

Shape legend:
  n  rows      V_s  shard columns (vocab ids col0 .. col0 + V_s - 1)      k1  keys per row
  c  chunks of this shard (its slice of the 256 global chunks; bounds [c + 1] local offsets)
  logits  [n, V_s] fp32          scale_t [n] float64 (0.0: no temperature pass for the row)
  keys    [n, k1] int64          descending, PAD_KEY past V_s
  mass    [n, c, 4] float64      (m1, S1, mT, ST) per chunk; mT = ST = 0 where scale_t == 0
  nans    [n] int64              NaN lanes per row

Keys: key = mono32(v) * 2**32 + (2**32 - 1 - id), int64, unique per row: mono32 is the fp32
bit pattern b with the magnitude bits flipped when negative (b ^ 0x7FFFFFFF), so the signed
order is the value order; -0 reads as +0; with nan_fold every NaN is NAN_MONO (below -inf's
mono, above the pad's). The k1 largest keys, descending: ties to the lower id.

Chunk mass (declared; the candidates exchange's numerics): lanes widened exactly to float64
(NaN -> -inf with nan_fold); chunk j of lanes [b_j, b_{j+1}) at scale s (1.0 for the T = 1
pair, scale_t for the T pair): (m, S, _) = kernels.tail.rowmass.row_mass over the chunk's lanes
(z = fl64(v / s), m = max z, S = sum64(exp64(z - m)) with lane t of the chunk in lane chain
t mod 256), then m := m + 0.0 (a -0 max reads +0); an empty chunk or one of -inf lanes only
has (m, S) = (-inf, its lane count). Without nan_fold a NaN lane leaves its chunk's pair
undefined (the tail raises on such rows before they are sampled).

Backends (all bit-equal; tests/test_shard_partials.py proves it on this CPU), one
`_backend.Dispatch` table (backend=None: the fastest verified, kernels._verify): "avx512"
(AVX-512F), "avx2", "c" (plain C, any CPU) -- the C kernel shard_partials.c, one thread per row from first op to
last -- and "torch" (the declared ops as torch ops; always there, the only one without a C
compiler). The C kernel leaves a row to the torch backend (recomputed here, that row only)
when with_mass and it has a NaN lane without nan_fold, or its T scale is not finite and > 0.

Three more single-threaded C entry points serve the tail's host work at small batch (each
the same ops as the torch spelling it replaces, each declining with None where that
spelling's NaN payloads or ranges are not pinned): `owner_stats` (candidates.merge's key
split, combines and lse1), `sample_candidates` (sampler.plan_on + decide over
candidates.MergedStats) and `tail_norm` (tail.normed_rows' deferred norm).
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from lmtail import numerics

from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.kernels.tail.rowmass import exp64_constants, row_mass
from lmtail.kernels.tail.sampling import sampling_records

PAD_KEY = -(1 << 63)  # below every lane's key: fills a shard narrower than k1
NAN_MONO = -(1 << 31) + 1  # a folded NaN's mono32
ID_MASK = (1 << 32) - 1
PARTS = 4  # per chunk: m1, S1, mT, ST


# ---------------------------------------------------------------------------------------
# the torch backend: the declared ops as torch ops
# ---------------------------------------------------------------------------------------
def fp32_keys(values: torch.Tensor, *, col0: int, nan_fold: bool) -> torch.Tensor:
    """[n, w] fp32 (column j = vocab id col0 + j) -> [n, w] int64 keys (module docstring)."""
    b = values.contiguous().view(torch.int32).to(torch.int64)  # [n, w]
    b = torch.where(b == -(1 << 31), torch.zeros_like(b), b)  # -0 -> +0
    mono = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    if nan_fold:
        mono = torch.where((b & 0x7FFFFFFF) > 0x7F800000, torch.full_like(mono, NAN_MONO), mono)
    ids = torch.arange(col0, col0 + values.shape[1], dtype=torch.int64)
    return mono * (1 << 32) + (ID_MASK - ids)


def top_keys(keys: torch.Tensor, k1: int) -> torch.Tensor:
    """[n, w] int64 -> [n, k1] the k1 largest, descending (PAD_KEY past w)."""
    n, w = keys.shape
    top = torch.topk(keys, min(k1, w), dim=1, largest=True, sorted=True).values
    if w < k1:
        top = torch.cat([top, torch.full((n, k1 - w), PAD_KEY, dtype=torch.int64)], dim=1)
    return top


def chunk_mass(row64: torch.Tensor, scale: torch.Tensor, bounds: torch.Tensor):
    """(m, S) [n, c] float64 of the chunks [bounds[j], bounds[j+1]) of row64 [n, V_s]
    float64 (NaN folded when asked) at scale [n] (module docstring)."""
    n, vs = row64.shape
    c = bounds.numel() - 1
    start, width = bounds[:-1], bounds[1:] - bounds[:-1]  # [c]
    w = max(int(width.max()), 1)
    lane = torch.arange(w)
    idx = torch.where(lane < width[:, None], start[:, None] + lane, torch.full_like(lane, vs))  # [c, w]
    padded = torch.cat([row64, torch.full((n, 1), -torch.inf, dtype=torch.float64)], dim=1)  # [n, V_s+1]
    z = padded[:, idx.reshape(-1)].reshape(n * c, w)  # [n*c, w]: pad lanes -inf
    m, s, _ = row_mass(z, scale.repeat_interleave(c))  # any row_mass backend: the same bits
    m, s = (m + 0.0).view(n, c), s.view(n, c)
    s = torch.where(m == -torch.inf, width.to(torch.float64).expand(n, c), s)  # -inf-only or empty chunk
    return m, s


def _torch_run(logits, *, col0, k1, nan_fold, bounds, scale_t, with_mass, threads):
    keys = top_keys(fp32_keys(logits, col0=col0, nan_fold=nan_fold), k1)  # [n, k1]
    if not with_mass:
        return keys, None, None
    n, c = logits.shape[0], bounds.numel() - 1
    row64 = logits.double()
    nan = torch.isnan(row64)
    if nan_fold:
        row64 = torch.where(nan, torch.full_like(row64, -torch.inf), row64)
    mass = torch.zeros(n, c, PARTS, dtype=torch.float64)
    mass[:, :, 0], mass[:, :, 1] = chunk_mass(row64, torch.ones(n, dtype=torch.float64), bounds)
    rows = torch.nonzero(scale_t != 0)[:, 0]
    if rows.numel():
        mass[rows, :, 2], mass[rows, :, 3] = chunk_mass(row64[rows], scale_t[rows], bounds)
    return keys, mass, nan.sum(dim=1)


# ---------------------------------------------------------------------------------------
# the C backends (shard_partials.c)
# ---------------------------------------------------------------------------------------
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
SIGNATURES = {
    # x, n, V, ld, col0, k1, nan_fold, bounds, c, scale, with_mass, K, keys, mass, nans, flag,
    # nthreads, isa
    "lmtail_shard_partials": ([_P] + [_I64] * 5 + [_INT, _P, _I64, _P, _INT] + [_P] * 5 + [_INT] * 2, _INT),
    # keys, R, k1, mass, c, K, L, vals, ids, stats, lp0, flag
    "lmtail_owner_stats": ([_P, _I64, _I64, _P, _I64] + [_P] * 7, _INT),
    # vals, ids, ld, R, k, sp (lmtail_sampling [R]), stats, outside, has_outside, nan_fold, K, tokens,
    # logprobs, truncated, scratch
    "lmtail_sample_candidates": ([_P, _P] + [_I64] * 3 + [_P] * 4 + [_INT] + [_P] * 5, _INT),
    # x, n, H, g, real, hu, eps, a, m, rms
    "lmtail_tail_norm": ([_P, _I64, _I64, _P, _P, ctypes.c_float, ctypes.c_float] + [_P] * 3, _INT),
    # x, n, V, s
    "lmtail_scale_rows": ([_P, _I64, _I64, _P], _INT),
}
_library = kernel_library("tail/shard_partials.c", SIGNATURES, what="shard_partials",
                          fallback="the torch backend")
# the emulated build (SIMDe, lmtail_emulate.h): the "emu-avx512" row, on any AVX2 + FMA + F16C CPU
_emulated = kernel_library("tail/shard_partials.c", SIGNATURES, what="shard_partials", emulated=True)


def _c_library():
    """The compiled kernel (bound; built and cached on first use), or None with a warning.
    Tests replace this to plant variants."""
    return _library()


def _c_available(*features: str):
    return lambda: _c_library() is not None and cpu.has(*features)


def _run_c(isa: int, library=lambda: _c_library()):
    def run(logits, *, col0, k1, nan_fold, bounds, scale_t, with_mass, threads):
        n, vs = logits.shape
        c = bounds.numel() - 1
        keys = torch.empty((n, k1), dtype=torch.int64)  # [n, k1]
        mass = torch.empty((n, c, PARTS), dtype=torch.float64) if with_mass else None  # [n, c, 4]
        nans = torch.empty(n, dtype=torch.int64) if with_mass else None  # [n]
        flag = torch.zeros(n, dtype=torch.int32)  # [n]
        if n == 0:
            return keys, mass, nans
        used = library().lmtail_shard_partials(
            logits.data_ptr(), n, vs, vs, col0, k1, int(nan_fold), bounds.data_ptr(), c,
            scale_t.data_ptr(), int(with_mass), exp64_constants().data_ptr(), keys.data_ptr(),
            None if mass is None else mass.data_ptr(), None if nans is None else nans.data_ptr(),
            flag.data_ptr(), threads, isa)
        if used == -2:
            raise MemoryError(f"shard_partials: could not allocate scratch for k1={k1}")
        assert used == isa, (used, isa)
        if flag.numpy().any():  # rows the torch backend decides (see the docstring)
            left = torch.nonzero(flag)[:, 0]
            k_, m_, n_ = _torch_run(logits[left], col0=col0, k1=k1, nan_fold=nan_fold, bounds=bounds,
                                    scale_t=scale_t[left], with_mass=with_mass, threads=threads)
            keys[left], mass[left], nans[left] = k_, m_, n_
        return keys, mass, nans
    return run


SHARD_PARTIALS = _backend.Dispatch("shard_partials", (
    _backend.Backend("avx512", _run_c(2), _c_available("avx512f")),
    _backend.Backend("avx2", _run_c(1), _c_available("avx2")),
    _backend.Backend("c", _run_c(0), _c_available()),
    _backend.Backend("torch", _torch_run, device=None),
    _backend.Backend("emu-avx512", _run_c(2, _emulated),
                     lambda: _c_library() is not None and cpu.emulation_runs(), emulated=True),
))


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, in the table's order
    (backend=None takes the fastest verified one; all give the same bytes)."""
    return SHARD_PARTIALS.names()


def shard_partials(logits: torch.Tensor, *, col0: int, k1: int, nan_fold: bool, bounds: torch.Tensor,
                   scale_t: torch.Tensor | None, with_mass: bool, backend: str | None = None,
                   threads: int | None = None):
    """(keys [n, k1] int64, mass [n, c, 4] float64 | None, nans [n] int64 | None) of
    logits [n, V_s] fp32 (module docstring). bounds [c + 1] int64 local chunk offsets
    (0 = bounds[0] <= ... <= bounds[c] = V_s); scale_t [n] float64 (0.0: no T pass; None:
    none for any row); with_mass False: keys only. Unchecked (the tail validated); a row
    is owned by one thread, so no byte depends on n, threads or the backend."""
    assert logits.dtype == torch.float32 and logits.dim() == 2, "logits [n, V_s] fp32"
    assert int(bounds[0]) == 0 and int(bounds[-1]) == logits.shape[1], "bounds cover the shard"
    n = logits.shape[0]
    if scale_t is None:
        scale_t = torch.zeros(n, dtype=torch.float64)
    # the fastest verified backend for n rows (its "1" / "16" / "many" timing, kernels._verify)
    row = SHARD_PARTIALS.pick(backend, rows=n)
    return row.run(logits.contiguous(), col0=col0, k1=k1, nan_fold=nan_fold,
                   bounds=bounds.to(torch.int64).contiguous(), scale_t=scale_t.to(torch.float64).contiguous(),
                   with_mass=with_mass, threads=_backend.threads(threads))


# ---------------------------------------------------------------------------------------
# the owner's one-call stats and the tail's norm (shard_partials.c; None: the caller's
# torch ops decide, the same bytes)
# ---------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def log64_constants() -> torch.Tensor:
    """[16] float64 handed to lmtail_owner_stats: numerics.log64_constants() (SQRT2, then
    the atanh series; shard_partials.c holds no copy)."""
    return torch.tensor(numerics.log64_constants(), dtype=torch.float64)


def owner_stats(keys: torch.Tensor, mass: torch.Tensor | None):
    """The owner's row view in one C call, or None without the compiled kernel.
    keys [R, k1] int64 descending (merged); mass [R, C, 4] float64 in global chunk order or
    None. Returns (vals [R, k1] fp32, ids [R, k1] int64, stats [5, R] float64 | None (m1,
    S1, mT, ST, lse1), lp0 [R] fp32 | None, ok): vals, ids = candidates.split_fp32_keys;
    (m1, S1), (mT, ST) = candidates.combine of each pair; lse1 = m1 + numerics.log64(S1);
    lp0 = fp32(double(vals[:, 0]) - lse1), all op for op. ok False (stats, lp0 not to be
    used): a chunk max is NaN (combine's torch path decides those)."""
    lib = _c_library()
    if lib is None:
        return None
    keys = keys.contiguous()
    r, k1 = keys.shape
    vals = torch.empty((r, k1), dtype=torch.float32)  # [R, k1]
    ids = torch.empty((r, k1), dtype=torch.int64)  # [R, k1]
    stats = lp0 = None
    c = 0
    if mass is not None:
        mass = mass.contiguous()
        c = mass.shape[1]
        stats = torch.empty((5, r), dtype=torch.float64)  # [5, R]
        lp0 = torch.empty(r, dtype=torch.float32)  # [R]
    flag = np.zeros(r, dtype=np.int32)  # [R]
    bad = lib.lmtail_owner_stats(keys.data_ptr(), r, k1, None if mass is None else mass.data_ptr(), c,
                                 exp64_constants().data_ptr(), log64_constants().data_ptr(), vals.data_ptr(),
                                 ids.data_ptr(), None if stats is None else stats.data_ptr(),
                                 None if lp0 is None else lp0.data_ptr(), flag.ctypes.data)
    return vals, ids, stats, lp0, bad == 0


def tail_norm(x: torch.Tensor, gamma: torch.Tensor, real: torch.Tensor | None, h_u: int, eps: float):
    """decode_tail's deferred norm in one C call (shard_partials.c, lmtail_tail_norm), or
    None (no compiled kernel, or a NaN on a real lane of x or gamma: the torch ops decide).
    x [n, H] fp32, gamma [H] fp32, real [H] bool or None (every lane real) -> (a [n, H]
    fp32 = x * gamma with pad lanes +0, m [n] fp32 = ssq / H_u, rms [n] fp32)."""
    lib = _c_library()
    if lib is None:
        return None
    x, gamma = x.contiguous(), gamma.contiguous()
    n, h = x.shape
    a = torch.empty((n, h), dtype=torch.float32)  # [n, H]
    m = torch.empty(n, dtype=torch.float32)  # [n]
    rms = torch.empty(n, dtype=torch.float32)  # [n]
    mask = None if real is None else real.contiguous()
    # fp32(h_u), fp32(eps): ctypes rounds a float to fp32 to nearest-even, as torch.tensor does
    bad = lib.lmtail_tail_norm(x.data_ptr(), n, h, gamma.data_ptr(), None if mask is None else mask.data_ptr(),
                               float(h_u), float(eps), a.data_ptr(), m.data_ptr(), rms.data_ptr())
    return None if bad else (a, m, rms)


def scale_rows(acc: torch.Tensor, rms: torch.Tensor) -> torch.Tensor:
    """decode_tail's deferred scale fp32(acc * rms[:, None]), acc [n, V] fp32 C-contiguous
    (overwritten and returned), rms [n] fp32: the bytes of the torch op, in one thread of C
    (shard_partials.c, lmtail_scale_rows) so the tail wakes no OpenMP team between the
    body's kernels; the torch op when the kernel is not built or an rms is NaN."""
    lib = _c_library()
    rms = rms.contiguous()
    if lib is None or not acc.is_contiguous() or acc.numel() == 0 \
            or lib.lmtail_scale_rows(acc.data_ptr(), acc.shape[0], acc.shape[1], rms.data_ptr()):
        return acc * rms[:, None]
    return acc


def sample_candidates(values: torch.Tensor, ids: torch.Tensor, sp: torch.Tensor, stats: torch.Tensor,
                      outside: torch.Tensor, has_outside: torch.Tensor, *, nan_fold: bool):
    """candidates.sample_merged's sampler (sampler.plan_on + decide over MergedStats) in one
    C call, or None (no compiled kernel, a layout it does not take, or a row meeting a NaN:
    the torch ops decide). values [R, k] fp32 / ids [R, k] int64 (rows of a common stride,
    unit column stride), sp [R, 3|4|5] fp32 (validated; passed to C as kernels.tail.sampling's
    lmtail_sampling records), stats [5, R] float64 from
    owner_stats (m1, S1, mT, ST, lse1), outside [R] fp32, has_outside [R] bool ->
    (tokens [R] int64, logprobs [R] fp32, truncated [R] bool), the same bytes."""
    lib = _c_library()
    r, k = values.shape
    if (lib is None or r == 0 or values.stride(1) != 1 or ids.stride(1) != 1 or values.stride(0) != ids.stride(0)
            or not stats.is_contiguous()):
        return None
    rec, out, has = sampling_records(sp), outside.contiguous(), has_outside.contiguous()  # rec [R] lmtail_sampling
    tokens = torch.empty(r, dtype=torch.int64)  # [R]
    logprobs = torch.empty(r, dtype=torch.float32)  # [R]
    truncated = torch.empty(r, dtype=torch.bool)  # [R]
    scratch = torch.empty(4 * k, dtype=torch.float64)  # [4k]
    bad = lib.lmtail_sample_candidates(values.data_ptr(), ids.data_ptr(), values.stride(0), r, k, rec.ctypes.data,
                                       stats.data_ptr(), out.data_ptr(), has.data_ptr(), int(nan_fold),
                                       exp64_constants().data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
                                       truncated.data_ptr(), scratch.data_ptr())
    return None if bad else (tokens, logprobs, truncated)


# ---------------------------------------------------------------------------------------
# the probe backends are verified and timed on (kernels._verify)
# ---------------------------------------------------------------------------------------
@SHARD_PARTIALS.probe(sources=("tail/shard_partials.c",))
def _shard_partials_probe(rows: int, seed: int):
    """fp32 logits [rows, V_s] in 3 chunks, keys and mass at T = 1 and T != 1 rows; seed 3
    plants NaN (nan_fold), -inf and subnormal lanes."""
    g = torch.Generator().manual_seed(5000 + seed)
    vs, k1 = (500, 17) if seed >= 0 else (25136, 65)
    logits = torch.randn(rows, vs, generator=g) * 3  # [rows, V_s]
    if seed == 3:
        logits[0, 2], logits[:, 7], logits[-1, 9] = float("nan"), -float("inf"), 1e-41
    bounds = torch.tensor([0, vs // 3, vs // 2, vs], dtype=torch.int64)  # [c + 1]
    scale_t = torch.where(torch.arange(rows) % 2 == 0, 0.0, 1.25).to(torch.float64)  # [rows]
    threads = torch.get_num_threads()
    return lambda name: shard_partials(logits, col0=1000, k1=k1, nan_fold=seed == 3, bounds=bounds,
                                       scale_t=scale_t, with_mass=True, backend=name, threads=threads)
