"""The one sampling schema: the public tensor's column names and the C record of a row.

The tail's public `sampling_params` is an fp32 tensor [R, 3|4|5] whose columns are, in
order, SAMPLING_COLUMNS = (top_k, top_p, temperature, u, min_p); COL names each column's
index (COL.top_k == 0, ..., COL.min_p == 4), so no module spells a column by a literal
index. The C kernels read each row as one `lmtail_sampling` struct (lmtail_kernels.h):

    typedef struct { int64_t top_k; double top_p, temperature, u, min_p; } lmtail_sampling;

SAMPLING_RECORD is that struct as a numpy dtype (the same field names, order and offsets;
tests compare the offsets with the compiled ones), and `sampling_records` is the one
conversion from the public tensor, shared by every C binding (kernels.tail.rows_tail,
kernels.tail.shard_partials) and by the torch sampler (sampler.plan_on), so every pass reads
the same widened values:
  top_k = int64(clamp(fp32 top_k, -1, 2**62)) (truncation toward zero; top_k > k then caps at
          k however large, never wrapping to "off");
  top_p, temperature, u, min_p = exact float64 widenings of the fp32 columns; without a u
          column u = numerics.DEFAULT_U (0.5), without a min_p column min_p = 0.0.

Shape legend: R rows, P = 3|4|5 columns.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from lmtail.numerics import DEFAULT_U

TOP_K_MAX = 2.0**62  # top_k's clamp: any value above k caps at k; 2**62 fits int64


@dataclass(frozen=True)
class SamplingColumns:
    """The column index of each sampling parameter in the public [R, 3|4|5] fp32 tensor."""

    top_k: int = 0
    top_p: int = 1
    temperature: int = 2
    u: int = 3  # optional: a [R, 3] tensor draws u = DEFAULT_U
    min_p: int = 4  # optional: a [R, 3|4] tensor has min_p = 0


COL = SamplingColumns()
SAMPLING_COLUMNS = tuple(f.name for f in fields(SamplingColumns))  # ("top_k", ..., "min_p")
WIDTHS = (COL.u, COL.min_p, len(SAMPLING_COLUMNS))  # the accepted column counts: 3, 4, 5

# lmtail_kernels.h's lmtail_sampling, field for field (40 bytes, no padding)
SAMPLING_RECORD = np.dtype([(n, np.int64 if n == "top_k" else np.float64) for n in SAMPLING_COLUMNS])


def sampling_records(sp: torch.Tensor) -> np.ndarray:
    """[R, 3|4|5] fp32 -> [R] SAMPLING_RECORD (contiguous; its buffer is the C kernels'
    `const lmtail_sampling *`), the widenings and defaults of the module docstring. The
    values are the caller's to validate (sampler.validate_params)."""
    spd = sp.detach().double().numpy()  # [R, P] exact widenings
    r, width = spd.shape
    rec = np.empty(r, dtype=SAMPLING_RECORD)  # [R]
    rec["top_k"] = np.clip(spd[:, COL.top_k], -1.0, TOP_K_MAX).astype(np.int64)  # clamp, then truncate
    for name in ("top_p", "temperature", "u", "min_p"):
        col = getattr(COL, name)
        rec[name] = spd[:, col] if col < width else (DEFAULT_U if name == "u" else 0.0)
    return rec


def record_tensors(rec: np.ndarray) -> dict[str, torch.Tensor]:
    """{name: [R] tensor} of a SAMPLING_RECORD array (top_k int64, the rest float64), each a
    contiguous copy: the torch sampler's view of the same record."""
    return {n: torch.from_numpy(np.ascontiguousarray(rec[n])) for n in SAMPLING_COLUMNS}
