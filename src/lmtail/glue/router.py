"""Sigmoid top-k MoE router with declared numerics (DeepSeek-V3 / Nemotron style).

Shape legend: K logit slices (partial GEMM outputs), T rows (tokens), E experts, k chosen.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_positive, is_int, need, need_tensor
from ..numerics import Decl, SumDecl, exp64

GUARD = 1e-20  # the load-bearing zero guard of the weight normalizer (rounded to fp32)


@dataclass(frozen=True)
class Routing:
    """router_topk's result, a frozen dataclass like every lmtail result (read by field
    name; also unpacks as `ids, weights = ...`, in field order)."""

    ids: torch.Tensor  # [T, k] int64
    weights: torch.Tensor  # [T, k] fp32

    def __iter__(self):
        return iter((self.ids, self.weights))


def selection_keys(key32: torch.Tensor) -> torch.Tensor:
    """fp32 [T, E] -> unique int64 [T, E] ordering like (value desc, expert id asc).

    key = mono32(value) * E + (E - 1 - id); mono32 is the fp32 bit pattern made monotone
    (-0.0 first folded to +0.0, so +-0 tie), NaN maps below -inf. Unique keys make the
    top-k a single answer, whatever torch.topk's algorithm or thread count.
    """
    e = key32.shape[-1]
    bits = (key32 + 0.0).view(torch.int32)  # -0 + 0 = +0
    mono = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(torch.int64)  # [T, E] increasing with value
    mono = torch.where(torch.isnan(key32), torch.full_like(mono, -(2**31)), mono)
    ids = torch.arange(e, dtype=torch.int64)
    return mono * e + (e - 1 - ids)


def router_topk(logit_slices: torch.Tensor, *, k: int, bias: torch.Tensor | None = None,
                scale: float = 2.5) -> Routing:
    """Sigmoid top-k routing: returns Routing(ids [T, k] int64, weights [T, k] fp32).

    logit = ((l_0 + l_1) + ...) + l_{K-1}       fp32 adds in slice order (K=1: l_0 as is)
    e     = fl32(exp64(-logit))                  numerics.exp64 (float64, basic ops only)
    s     = fl32(1 / fl32(1 + e))                sigmoid; logit -inf -> 0, +inf -> 1
    key   = fl32(s + bias)                       (key = s without bias); selection only
    ids   = the k experts with the largest key, ties to the lower expert id, NaN keys rank
            below every number; returned in that order (key descending, then id ascending)
    sum   = ((s_sel[0] + s_sel[1]) + ...) + s_sel[k-1]   fp32, the returned order, depth k-1
    w_j   = fl32(fl32(s_sel[j] / fl32(sum + 1e-20)) * scale)
    The +1e-20 guard (fp32 9.99999968e-21) makes an all-underflow row (every selected
    s == 0, e.g. logits of -100) give weights 0, not 0/0 = NaN. A row that must select a
    NaN key (fewer than k non-NaN experts) gets NaN weights. Row-independent, deterministic.
    logit_slices [K, T, E] fp32; k in [1, E]; bias [E] fp32 finite or None; scale > 0 finite.
    """
    need_tensor("logit_slices", logit_slices, "[K, T, E] fp32")
    need(logit_slices.dtype == torch.float32, f"logit_slices must be fp32 [K, T, E]; got {logit_slices.dtype}")
    need(logit_slices.dim() == 3 and logit_slices.shape[0] >= 1 and logit_slices.shape[2] >= 1,
          f"logit_slices must be [K, T, E] with K, E >= 1; got {tuple(logit_slices.shape)}")
    n_slices, _, e = logit_slices.shape
    need(is_int(k) and 1 <= k <= e, f"k must be an int in [1, E={e}]; got {k!r}")
    check_positive("scale", scale)
    if bias is not None:
        need_tensor("bias", bias, f"[E={e}] fp32")
        need(bias.dtype == torch.float32 and tuple(bias.shape) == (e,),
              f"bias must be fp32 [E={e}]; got {getattr(bias, 'dtype', type(bias).__name__)} "
              f"{tuple(getattr(bias, 'shape', ()))}")
        need(bool(torch.isfinite(bias).all()), "bias must be finite; got a NaN or inf entry")
    if logit_slices.shape[1] == 0:
        return Routing(torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k, dtype=torch.float32))
    logit = logit_slices[0]  # [T, E]
    for i in range(1, n_slices):
        logit = logit + logit_slices[i]
    ex = exp64(-logit.double()).to(torch.float32)  # [T, E]
    s = torch.ones_like(ex) / (torch.ones_like(ex) + ex)  # [T, E] sigmoid
    key32 = s if bias is None else s + bias
    ids = torch.topk(selection_keys(key32), k, dim=-1, sorted=True).indices  # [T, k]
    s_sel = s.gather(1, ids)  # [T, k]
    tot = s_sel[:, 0]
    for j in range(1, k):
        tot = tot + s_sel[:, j]
    den = tot + torch.full_like(tot, GUARD)  # [T]
    w = (s_sel / den.unsqueeze(1)) * torch.full_like(s_sel, scale)  # [T, k]
    return Routing(ids, w)


def router_topk_decl(k: int, *, n_slices: int) -> Decl:
    """router_topk's rounding points and sums (k chosen of n_slices logit slices)."""
    return Decl("router_topk",
                ("logit = fp32 slice sum", "e = fl32(exp64(-logit))", "s = fl32(1 / fl32(1 + e))",
                 "key = fl32(s + bias)", "top-k by key, ties to the lower id, NaN last",
                 "den = fl32(sum + fp32(1e-20))", "w = fl32(fl32(s / den) * scale)"),
                (SumDecl("logit", "fp32", max(n_slices - 1, 0), "slice order: ((l0 + l1) + ...) + l_{K-1}"),
                 SumDecl("s_sum", "fp32", max(k - 1, 0), "the returned order (key desc, id asc), from s_sel[0]")))
