"""Per-row distances of an arm's logits to the float64 reference, and teacher-forced NLL.

For one row with reference logits r [V] float64 and arm logits l [V] (fp32, widened exactly):
    rel_l2 = ||l - r||_2 / ||r||_2
    hit    = argmax(l) == argmax(r)          (first index on ties, both sides)
    kl     = sum_j p_r(j) (log p_r(j) - log p_l(j)),  KL(ref || arm), nats
    worst  = max_j |l_j - r_j| / rms(r),     rms(r) = sqrt(mean_j r_j^2); worst_col = its j
    nll    = -log_softmax(l)[target],         nats
All in float64 NumPy (an evaluation, not a declared op: libm exp/log are fine here).

Shape legend: N rows, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

METRICS = ("rel_l2", "hit", "kl", "worst", "worst_col", "nll")


def log_softmax64(z: np.ndarray) -> np.ndarray:
    """Row-wise log_softmax of [N, V] float64."""
    m = z.max(axis=1, keepdims=True)
    return z - (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))


@dataclass(frozen=True)
class RefRows:
    """A passage's float64 reference logits and what every arm's metrics reuse from them."""

    logits: np.ndarray  # [N, V] float64
    logp: np.ndarray  # [N, V] log_softmax
    p: np.ndarray  # [N, V] softmax
    norm: np.ndarray  # [N] ||r||_2
    rms: np.ndarray  # [N] sqrt(mean r^2)
    top: np.ndarray  # [N] argmax


def ref_rows(ref: np.ndarray) -> RefRows:
    lp = log_softmax64(ref)
    return RefRows(ref, lp, np.exp(lp), np.linalg.norm(ref, axis=1), np.sqrt((ref * ref).mean(axis=1)),
                   ref.argmax(axis=1))


def ref_row_stats(ref: RefRows, targets: np.ndarray) -> dict[str, np.ndarray]:
    """The reference's own per-row numbers: nll [N] and top-1 margin [N] (top1 - top2)."""
    top2 = np.partition(ref.logits, -2, axis=1)[:, -2:]  # [N, 2]
    return {"nll": -ref.logp[np.arange(targets.shape[0]), targets], "margin": top2[:, 1] - top2[:, 0]}


def row_metrics(logits: torch.Tensor, ref: RefRows, targets: np.ndarray) -> dict[str, np.ndarray]:
    """The module's metrics, each [N], of arm logits [N, V] against the reference rows."""
    if tuple(logits.shape) != ref.logits.shape:
        raise ValueError(f"arm logits must be [N, V] = {ref.logits.shape}; got {tuple(logits.shape)}")
    z = logits.detach().to(torch.float64).numpy()  # exact widening
    d = z - ref.logits
    lp_z = log_softmax64(z)
    ad = np.abs(d)
    rows = np.arange(z.shape[0])
    return {
        "rel_l2": np.linalg.norm(d, axis=1) / ref.norm,
        "hit": z.argmax(axis=1) == ref.top,
        "kl": (ref.p * (ref.logp - lp_z)).sum(axis=1),
        "worst": ad.max(axis=1) / ref.rms,
        "worst_col": ad.argmax(axis=1),
        "nll": -lp_z[rows, targets],
    }
