"""The candidates exchange: each shard's exact fp32 top-(k+1) and its mass partials, not the bf16 mirror.

    rank r holds logits [gbs, V_s] fp32 (columns r*V_s ..)                       per row:
      keys  = exact top-(k+1) of the shard, int64 keys (fp32 order, ties to the lower id)
      mass  = per global chunk j of the shard: (m1_j, S1_j) at T = 1 and (mT_j, ST_j) at
              the row's T where the sampler needs it (top-k off, sampled, T != 1)
      nans  = NaN lanes of the shard
    pack -> [gbs, B] bytes ==exchange.exchange_rows (one all-to-all per hop)==> [R, VTP*B]
    owner: unpack VTP slabs (rank order) -> merge keys (top-(k+1) of VTP*(k+1)) and combine
      the chunk partials in global chunk order -> sampler.plan_on with MergedStats
    one rank: no wire (unpack(pack(p), vtp=1) is p on every byte an output reads); its keys
      are already the top-(k+1)

Host work per call is a few C calls (kernels.tail.shard_partials: owner_stats = the key split,
both combines and lse1; sample_candidates = plan_on + decide over MergedStats), the same
ops as the torch spellings here and in lmtail.tail.sampler, which decide whatever the C calls
decline (a NaN met, no compiler).

Chunks. The vocabulary [0, V) is cut into MASS_CHUNKS = 256 chunks at the global positions
floor(j * V / 256), j = 0..256: fixed by V alone. When VTP divides 256 (and V), every rank
boundary r * V / VTP is a chunk boundary (floor(j V / 256) with j = r * 256 / VTP), so a
rank holds whole chunks and the partials, combined in chunk order, are the same numbers
for every VTP, hop layout and batch-group count: one rank (VTP = 1) computes them from the
full row with the same code. Chunks may be empty (V < 256) or differ in width by one.

Numerics (declared; `candidates_decl`), float64 from the exactly widened fp32 logits
(NaN folded to -inf when nan_fold):
  chunk j: (m_j, S_j) = kernels.tail.rowmass.row_mass over the chunk's lanes at scale T:
    z = fl64(v / T), m_j = max z (+0.0: a -0 max reads +0), S_j = sum64(exp64(z - m_j))
    (z == m_j -> exactly 1; depth ceil(w_j / 256) + 8); an empty chunk is (-inf, 0); a
    chunk of -inf lanes only is (-inf, its lane count) (kernels.tail.shard_partials).
  row: m = max_j m_j; t_j = fl64(S_j * shifted_exp(m_j, m)) (m_j == m -> factor 1);
    S = sum64 over the 256 chunk terms in chunk order (one lane each, then the halving
    tree: depth 1 + 8). lse1 = fl64(m1 + log64(S1)); the T mass is (mT, ST).
  top-k: keys mono32(v) * 2**32 + (2**32 - 1 - id) over int64, unique per row, so the
    merge (top-(k+1) of the ranks' top-(k+1) lists) is exact: every global top-(k+1)
    member is in its own shard's top-(k+1). Values come back from the keys (-0 -> +0,
    a folded NaN -> the canonical NaN). The (k+1)-th key is the largest lane outside the
    candidates: ties at the top-k threshold past slot k and mass past slot k (top-k off)
    are read from it (sampler semantics, lmtail.tail.sampler).
Decisions (top-k, top-p, min-p, the draw, the logprob) are made on the fp32 values by the
sampler's own steps (sampler.plan_on), so no decision sees a bf16 rounding.

Shape legend: gbs rows sent, n rows of a block, R owned rows, V vocab, V_s = V / VTP,
k candidates, k1 = k + 1 keys per row per rank, C = MASS_CHUNKS, c = C / VTP chunks per
rank, B bytes per row per rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import nan_policy, need
from ..kernels.tail import shard_partials as kernel
from ..kernels.tail.rowmass import TERMS, shifted_exp, shifted_exp_rows, sum64, sum64_rows
from ..numerics import Decl, SumDecl, log64
from .sampler import COL, GREEDY_TEMPERATURE, decide, plan_on

MASS_CHUNKS = 256
PARTS = kernel.PARTS  # per chunk: m1, S1, mT, ST (float64)
PAD_KEY = kernel.PAD_KEY  # a key below every lane's: fills a shard narrower than k + 1
_ID_MASK = kernel.ID_MASK


# ---------------------------------------------------------------------------------------
# the declaration and the layout rule
# ---------------------------------------------------------------------------------------
def candidates_decl(v: int) -> Decl:
    """The candidates exchange's own numerics for a vocabulary of v (its float64 sums)."""
    w = -(-v // MASS_CHUNKS)
    return Decl(
        op="candidates_exchange",
        rounding_points=("z = v / T:fp64", "exp64 terms:fp64", "S_j * shifted_exp(m_j, m):fp64",
                         "m1 + log64(S1):fp64", "logprob:fp32"),
        sums=(SumDecl("chunk mass", "fp64", -(-w // 256) + 8, "sum64 over the chunk's lanes"),
              SumDecl("row mass", "fp64", 1 + 8, f"sum64 over {MASS_CHUNKS} chunk terms in chunk order")),
    )


def check_vtp(vtp: int) -> None:
    """ValueError unless VTP divides MASS_CHUNKS (so every rank holds whole chunks)."""
    need(MASS_CHUNKS % vtp == 0, f"exchange='candidates' needs VTP dividing {MASS_CHUNKS} (every "
                                 f"rank holds whole mass chunks); got VTP={vtp} (use exchange='mirror')")


def chunk_bounds(v: int) -> torch.Tensor:
    """[C + 1] int64: chunk j is vocab ids [b[j], b[j+1]), b[j] = floor(j * v / C)."""
    return torch.arange(MASS_CHUNKS + 1, dtype=torch.int64) * v // MASS_CHUNKS


@functools.lru_cache(maxsize=64)
def _local_bounds(v: int, j0: int, c: int) -> torch.Tensor:
    """[c + 1] int64 (read only, shared): chunks j0 .. j0 + c of chunk_bounds(v), offset to
    the shard's first column b[j0]."""
    b = chunk_bounds(v)
    return b[j0:j0 + c + 1] - b[j0]


def payload_bytes(k: int, vtp: int, sampled: bool) -> int:
    """B: bytes per row per rank through the exchange: the k + 1 int64 keys; with sampling
    also per chunk of the rank S1, ST (float64) and m1 (fp32: the chunk's max lane, exact),
    and the NaN count (int64), padded to 8 bytes. mT is not sent: the owner recomputes it
    (`unpack`)."""
    c = MASS_CHUNKS // vtp
    return (k + 1) * 8 + (16 * c + 8 + 8 * -(-c // 2) if sampled else 0)


# ---------------------------------------------------------------------------------------
# keys: fp32 order + id, one int64 (kernels.tail.shard_partials makes them)
# ---------------------------------------------------------------------------------------
def split_fp32_keys(keys: torch.Tensor):
    """int64 keys -> (fp32 values, int64 ids); a pad key gives (-inf, -1)."""
    mono = keys >> 32
    b = torch.where(mono < 0, mono ^ 0x7FFFFFFF, mono)
    b = torch.where(mono == kernel.NAN_MONO, torch.full_like(b, 0x7FC00000), b)
    pad = keys == PAD_KEY
    b = torch.where(pad, torch.full_like(b, 0xFF800000 - (1 << 32)), b)
    vals = b.to(torch.int32).view(torch.float32)
    ids = torch.where(pad, torch.full_like(keys, -1), _ID_MASK - (keys & _ID_MASK))
    return vals, ids


# ---------------------------------------------------------------------------------------
# one shard's partials
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardPartials:
    """One rank's contribution for n rows: keys [n, k1] int64 descending; mass [n, c, 4]
    float64 (m1, S1, mT, ST per chunk; None without sampling); nans [n] int64."""

    keys: torch.Tensor
    mass: torch.Tensor | None
    nans: torch.Tensor | None


def _at_t(top_k: float, t: float) -> bool:
    """needs_t's rule on one row's fp32 values as Python floats (exact): top-k off, sampled, T != 1."""
    return top_k <= 0 and t >= GREEDY_TEMPERATURE and t != 1.0


def needs_t(sp: torch.Tensor) -> torch.Tensor:
    """[R] bool: rows the sampler normalizes over the whole row at T != 1 (top-k off,
    sampled). On the host copy: [R, 5] is a few hundred bytes, a row a few comparisons."""
    return torch.tensor([_at_t(r[COL.top_k], r[COL.temperature]) for r in sp.tolist()], dtype=torch.bool)


def shard_partials(logits: torch.Tensor, *, col0: int, v: int, k: int, nan_fold: bool,
                   sp: torch.Tensor | None) -> ShardPartials:
    """The partials of logits [n, V_s] fp32 (vocab ids col0 ..) for rows whose sampling
    params are sp [n, 3|4|5] (None: top-k only, no mass): kernels.tail.shard_partials over this
    shard's slice of the global chunks."""
    vs = logits.shape[1]
    j0 = MASS_CHUNKS * col0 // v
    c = MASS_CHUNKS * vs // v
    assert j0 * v // MASS_CHUNKS == col0 and (j0 + c) * v // MASS_CHUNKS == col0 + vs, "a rank holds whole chunks"
    scale_t = None
    if sp is not None:  # T on needs_t's rows, 0 elsewhere
        scale_t = torch.tensor([r[COL.temperature] if _at_t(r[COL.top_k], r[COL.temperature]) else 0.0
                                for r in sp.tolist()], dtype=torch.float64)  # [n]
    keys, mass, nans = kernel.shard_partials(logits, col0=col0, k1=k + 1, nan_fold=nan_fold,
                                             bounds=_local_bounds(v, j0, c), scale_t=scale_t,
                                             with_mass=sp is not None)
    return ShardPartials(keys=keys, mass=mass, nans=nans)


def pack(p: ShardPartials) -> torch.Tensor:
    """ShardPartials -> [n, B] uint8: keys [k1] int64 | S1 [c] f64 | ST [c] f64 | nans int64
    | m1 [c] fp32 (+ 4 pad bytes when c is odd) (payload_bytes). m1 is a widened fp32 lane
    (or -inf), so its fp32 copy is exact."""
    if p.mass is None:
        return p.keys.contiguous().view(torch.uint8)
    n, c = p.mass.shape[:2]
    m1 = p.mass[:, :, 0].to(torch.float32)  # [n, c] exact
    if c % 2:
        m1 = torch.cat([m1, torch.zeros(n, 1, dtype=torch.float32)], dim=1)
    parts = [p.keys, p.mass[:, :, 1].contiguous().view(torch.int64), p.mass[:, :, 3].contiguous().view(torch.int64),
             p.nans[:, None], m1.contiguous().view(torch.int64)]
    return torch.cat(parts, dim=1).view(torch.uint8)  # [n, B]


def unpack(recv: torch.Tensor, *, vtp: int, k: int, sp: torch.Tensor | None) -> ShardPartials:
    """[R, VTP*B] uint8 (slab i from rank i) -> the ranks' partials side by side: keys
    [R, VTP*k1], mass [R, C, 4] in global chunk order, nans [R] summed. sp: the owned
    rows' sampling params (None: top-k only). mT = fl64(m1 / T) on the rows that need the
    T pass (needs_t), 0 elsewhere: the max of fl64(v / T) over the chunk, since the
    division by T > 0 is monotone, and never -0 since m1 is not (the kernel's mT + 0.0,
    bit for bit)."""
    r = recv.shape[0]
    words = recv.contiguous().view(torch.int64).view(r, vtp, -1)  # [R, VTP, B/8]
    k1 = k + 1
    keys = words[:, :, :k1].reshape(r, vtp * k1)
    if sp is None:
        return ShardPartials(keys=keys, mass=None, nans=None)
    c = MASS_CHUNKS // vtp
    s1 = words[:, :, k1:k1 + c].contiguous().view(torch.float64).reshape(r, MASS_CHUNKS)
    st = words[:, :, k1 + c:k1 + 2 * c].contiguous().view(torch.float64).reshape(r, MASS_CHUNKS)
    nans = words[:, :, k1 + 2 * c].sum(dim=1)
    m1 = words[:, :, k1 + 2 * c + 1:].contiguous().view(torch.float32)[:, :, :c].reshape(r, MASS_CHUNKS).double()
    at_t = needs_t(sp)
    t = torch.where(at_t, sp[:, COL.temperature].double(), torch.ones((), dtype=torch.float64))
    mt = torch.where(at_t[:, None], m1 / t[:, None], torch.zeros((), dtype=torch.float64))  # m1 is never -0
    return ShardPartials(keys=keys, mass=torch.stack([m1, s1, mt, st], dim=2), nans=nans)


# ---------------------------------------------------------------------------------------
# the owner: merge and decide
# ---------------------------------------------------------------------------------------
def combine(m: torch.Tensor, s: torch.Tensor):
    """(m, S) [R] of a row from its chunks' (m_j, S_j) [R, C] in chunk order (module
    docstring). The terms exp64(m_j - m) come from rowmass.TERMS (its C kernel, one call a
    row, bit-equal to rowmass.shifted_exp: a few ctypes calls instead of exp64's ~30 torch
    ops on a small tensor)."""
    top = m.max(dim=1).values + 0.0  # [R]
    terms = TERMS.pick(None)
    if terms.name == "torch" or bool(torch.isnan(m).any()):  # NaN pairs: undefined, the tail raises on them
        e = shifted_exp(m, top)  # [R, C]
    else:
        mc = m.contiguous()
        e = torch.stack([terms.run(mc[r], float(top[r])) for r in range(m.shape[0])]) if m.shape[0] else mc.clone()
    return top, sum64(s * e)


@dataclass(frozen=True)
class Merged:
    """The owner's view of its rows: candidates [R, k] (fp32 values descending, int64
    ids), the largest lane outside them (outside [R] fp32, has_outside [R] bool), and the
    combined masses (m1, S1, mT, ST [R] float64; None without sampling), nans [R]."""

    values: torch.Tensor
    ids: torch.Tensor
    outside: torch.Tensor
    has_outside: torch.Tensor
    mass: tuple | None
    nans: torch.Tensor | None
    stats: torch.Tensor | None = None  # [5, R] float64 m1, S1, mT, ST, lse1 = m1 + log64(S1) (the C call's)
    lp0: torch.Tensor | None = None  # [R] fp32 fp32(v_0 - lse1), slot 0's logprob (ditto)

    @property
    def lse1(self) -> torch.Tensor | None:
        return None if self.stats is None else self.stats[4]


def merge(p: ShardPartials, *, k: int) -> Merged:
    """The ranks' partials side by side (unpack's result, or one rank's own) -> Merged.
    One rank's keys are already its top-(k+1), descending (torch.topk of them is the
    identity); the split, both combines and lse1 are one C call
    (kernels.tail.shard_partials.owner_stats, the same ops as split_fp32_keys / combine /
    log64), the torch ops where it is not built or a chunk max is NaN."""
    top = p.keys if p.keys.shape[1] == k + 1 else kernel.top_keys(p.keys, k + 1)  # [R, k1]
    got = kernel.owner_stats(top, p.mass)
    if got is None:
        vals, ids = split_fp32_keys(top)
        stats, lp0, ok = None, None, False
    else:
        vals, ids, stats, lp0, ok = got
    mass = None
    if p.mass is not None and ok:
        mass = (stats[0], stats[1], stats[2], stats[3])
    elif p.mass is not None:  # combine's torch path decides (a NaN chunk max, or no kernel)
        mass = combine(p.mass[:, :, 0], p.mass[:, :, 1]) + combine(p.mass[:, :, 2], p.mass[:, :, 3])
        stats, lp0 = None, None
    return Merged(values=vals[:, :k], ids=ids[:, :k], outside=vals[:, k], has_outside=top[:, k] != PAD_KEY,
                  mass=mass, nans=p.nans, stats=stats, lp0=lp0)


class MergedStats:
    """sampler.plan_on's row statistics from merged candidates and partials."""

    def __init__(self, merged: Merged, sp: torch.Tensor, nan_fold: bool):
        self.mg, self.sp, self.nan_fold = merged, sp, nan_fold

    @functools.cached_property
    def out(self) -> torch.Tensor:
        """[R] float64: the largest lane outside the candidates (a folded NaN -> -inf)."""
        out = self.mg.outside.double()
        if self.nan_fold:
            out = torch.where(torch.isnan(out), torch.full_like(out, -torch.inf), out)
        return out

    def lse1(self) -> torch.Tensor:
        if self.mg.lse1 is not None:
            return self.mg.lse1
        m1, s1 = self.mg.mass[0], self.mg.mass[1]
        return m1 + log64(s1)

    def ties_past_k(self, thr: torch.Tensor, in_k: torch.Tensor) -> torch.Tensor:
        return self.mg.has_outside & (self.out >= thr[:, 0])

    def off_mass(self, off: torch.Tensor, t: torch.Tensor):
        m1, s1, mt, st = self.mg.mass
        at_t = needs_t(self.sp[off])
        m = torch.where(at_t, mt[off], m1[off])
        s = torch.where(at_t, st[off], s1[off])
        past = self.mg.has_outside[off] & (shifted_exp_rows((self.out[off] / t)[:, None], m)[:, 0] > 0)
        return m, s, past


def sample_merged(merged: Merged, sp: torch.Tensor, *, nan_fold: bool):
    """(tokens [R] int64, logprobs [R] fp32, truncated [R] bool) on fp32 candidates.
    When every row is greedy the sampler's answer is its slot 0 (sampler.draw: a greedy row
    draws slot 0, logprob fp32(v_0 - lse1), never truncated): read directly, the same
    bytes, without the filtered distribution nobody draws from. Otherwise one C call
    (kernels.tail.shard_partials.sample_candidates) when merge made the stats, else plan_on +
    decide as torch ops: the same bytes."""
    stats = MergedStats(merged, sp, nan_fold)
    if bool((sp.detach().numpy()[:, COL.temperature] < np.float32(GREEDY_TEMPERATURE)).all()):  # fp32 compare, as torch's
        if merged.lp0 is not None:
            logprobs = merged.lp0
        else:
            logprobs = (merged.values[:, 0].double() - stats.lse1()).to(torch.float32)  # [R]
        return merged.ids[:, 0].clone(), logprobs, torch.zeros(sp.shape[0], dtype=torch.bool)
    if merged.stats is not None:  # plan_on + decide over MergedStats in one C call (the same ops)
        got = kernel.sample_candidates(merged.values, merged.ids, sp, merged.stats, merged.outside,
                                       merged.has_outside, nan_fold=nan_fold)
        if got is not None:
            return got
    plan = plan_on(merged.values, sp, stats, nan_fold=nan_fold, terms=shifted_exp_rows, total=sum64_rows)
    return decide(plan, merged.values, merged.ids)


def check_nans(nans: torch.Tensor, *, v: int, nan_fold: bool, rows: torch.Tensor | None = None) -> None:
    """The sampler's NaN policy from per-row NaN counts [R] (tail.check_nan_rows's words)."""
    if not nans.numpy().any():
        return
    ids = torch.arange(nans.shape[0]) if rows is None else rows
    nan_policy(ids, nans > 0, nans == v, nan_fold=nan_fold)
