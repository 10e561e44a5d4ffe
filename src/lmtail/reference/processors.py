"""float64 reference for the logits-processor seam (lmtail.tail.processors), imports no op.

Dense and lane by lane: every step of the declared order is computed on the whole row in
float64 from fp32 inputs and rounded to fp32 right after (numpy float32 casts, nearest
even, IEEE subnormals). For +, -, *, / of two fp32 values the float64 result rounded to
fp32 is the correctly rounded fp32 result (53 >= 2*24 + 2), so these bytes are exactly
what the declared fp32 operations give.

    1 repetition  r != 1, j in prompt_ids or output ids:  l > 0 ? l / r : l * r
    2 frequency   f != 0, c_j > 0:                         l - fp32(f * c_j)
    3 presence    p != 0, c_j > 0:                         l - p
    4 logit_bias  j listed:                                l + b_j
    5 allowed     allowed[j] False:                        -inf
(r, f, p, b the fp32 values of the fields.) A row's processing is read by its field
names (any object with LogitProcessing's attributes, or None).

Shape legend: n rows, V_s lanes of the shard (global ids v0 .. v0+V_s-1).
"""
from __future__ import annotations

import numpy as np
import torch


def _r32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def processed_row(row: np.ndarray, p, v0: int) -> np.ndarray:
    """One row [V_s] float32 under processing p (None: unchanged). Returns [V_s] float32."""
    if p is None:
        return row.copy()
    vs = row.shape[0]
    ids = np.arange(v0, v0 + vs)  # [V_s] global ids
    z = row.astype(np.float64)
    r, f, pr = (float(np.float32(x)) for x in (p.repetition_penalty, p.frequency_penalty, p.presence_penalty))
    counts = np.zeros(vs, dtype=np.float64)
    for j, c in p.output_counts:
        if v0 <= j < v0 + vs:
            counts[j - v0] = c
    with np.errstate(all="ignore"):
        if r != 1:
            seen = np.isin(ids, list(p.prompt_ids) + [j for j, _ in p.output_counts])
            z = np.where(seen, np.where(z > 0, _r32(z / r), _r32(z * r)), z)
        if f != 0:
            z = np.where(counts > 0, _r32(z - _r32(f * counts)), z)
        if pr != 0:
            z = np.where(counts > 0, _r32(z - pr), z)
        for j, b in p.logit_bias:
            if v0 <= j < v0 + vs:
                z[j - v0] = _r32(z[j - v0] + float(np.float32(b)))
    if p.allowed is not None:
        ok = np.asarray(p.allowed, dtype=bool)[v0:v0 + vs]
        z = np.where(ok, z, -np.inf)
    return z.astype(np.float32)


def processed_logits(logits: torch.Tensor, processing, *, v0: int = 0) -> torch.Tensor:
    """logits [n, V_s] fp32 under processing (None or n entries) -> [n, V_s] fp32."""
    x = logits.numpy()
    if processing is None:
        return logits.clone()
    return torch.from_numpy(np.stack([processed_row(x[i], processing[i], v0) for i in range(x.shape[0])]))
