"""`shard_partials`: one vocab shard's exact fp32 top-(k+1) keys and its chunk mass partials.

The per-rank half of the candidates exchange (lmtail.candidates composes it; this module is
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
pair, scale_t for the T pair): (m, S, _) = kernels.rowmass.row_mass over the chunk's lanes
(z = fl64(v / s), m = max z, S = sum64(exp64(z - m)) with lane t of the chunk in lane chain
t mod 256), then m := m + 0.0 (a -0 max reads +0); an empty chunk or one of -inf lanes only
has (m, S) = (-inf, its lane count). Without nan_fold a NaN lane leaves its chunk's pair
undefined (the tail raises on such rows before they are sampled).

Backends (all bit-equal; tests/test_shard_partials.py proves it on this CPU), one
`_backend.Dispatch` table in this fixed preference order: "avx512" (AVX-512F), "avx2", "c"
(plain C, any CPU) -- the C kernel shard_partials.c, one thread per row from first op to
last -- and "torch" (the declared ops as torch ops; always there, the only one without a C
compiler). The C kernel leaves a row to the torch backend (recomputed here, that row only)
when with_mass and it has a NaN lane without nan_fold, or its T scale is not finite and > 0.
"""
from __future__ import annotations

import ctypes

import torch

from lmtail.kernels import _backend, cpu
from lmtail.kernels._cc import kernel_library
from lmtail.kernels.rowmass import exp64_constants, row_mass

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
}
_library = kernel_library("shard_partials.c", SIGNATURES, what="shard_partials",
                          fallback="the torch backend")


def _c_library():
    """The compiled kernel (bound; built and cached on first use), or None with a warning.
    Tests replace this to plant variants."""
    return _library()


def _c_available(*features: str):
    return lambda: _c_library() is not None and cpu.has(*features)


def _run_c(isa: int):
    def run(logits, *, col0, k1, nan_fold, bounds, scale_t, with_mass, threads):
        n, vs = logits.shape
        c = bounds.numel() - 1
        keys = torch.empty((n, k1), dtype=torch.int64)  # [n, k1]
        mass = torch.empty((n, c, PARTS), dtype=torch.float64) if with_mass else None  # [n, c, 4]
        nans = torch.empty(n, dtype=torch.int64) if with_mass else None  # [n]
        flag = torch.zeros(n, dtype=torch.int32)  # [n]
        if n == 0:
            return keys, mass, nans
        used = _c_library().lmtail_shard_partials(
            logits.data_ptr(), n, vs, vs, col0, k1, int(nan_fold), bounds.data_ptr(), c,
            scale_t.data_ptr(), int(with_mass), exp64_constants().data_ptr(), keys.data_ptr(),
            None if mass is None else mass.data_ptr(), None if nans is None else nans.data_ptr(),
            flag.data_ptr(), threads, isa)
        if used == -2:
            raise MemoryError(f"shard_partials: could not allocate scratch for k1={k1}")
        assert used == isa, (used, isa)
        left = torch.nonzero(flag)[:, 0]  # rows the torch backend decides (see the docstring)
        if left.numel():
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
))


def available_backends() -> tuple[str, ...]:
    """The backends this machine runs, in the fixed preference order (all give the same bytes)."""
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
    return SHARD_PARTIALS.pick(backend).run(logits.contiguous(), col0=col0, k1=k1, nan_fold=nan_fold,
                                            bounds=bounds.to(torch.int64).contiguous(),
                                            scale_t=scale_t.to(torch.float64).contiguous(),
                                            with_mass=with_mass, threads=_backend.threads(threads))
