"""The per-row sampler over exact top-k candidates, and its friendly params.

Per row, given candidates v[0..k-1] (bf16, descending, ties by lower id), their ids, the
FULL bf16 row (for normalizers over the whole vocabulary) and (top_k, top_p, temperature,
u, min_p):
  1. top-k: 1 <= top_k <= k keeps v >= v[top_k-1] (ties at the threshold survive);
     top_k <= 0 disables it (the filtered set is the whole vocab); top_k > k acts as k
     (however large: clamped before the int64 conversion, never wrapping to "off") and
     flags `truncated`; so does a threshold tie that continues past the k-th candidate.
  2. greedy: temperature < 1e-5 returns idx[0] (the lowest id among equal maxima).
  3. p = softmax(v / T) over the filtered set; when top-k is disabled the normalizer is
     the log-sum-exp over all V lanes of the row.
  4. top-p: keep candidate i iff the mass strictly before it is < top_p (the crossing
     token is kept; the first always); top_p >= 1 keeps all. Top-k disabled and the k
     candidates' mass < top_p (or, at top_p >= 1, any lane past them with mass > 0):
     all k kept, `truncated`.
  5. min_p: drop p < min_p * p[0] (HF's order: top-k, top-p, then min-p; vLLM applies
     min-p before top-k/top-p, so the kept sets can differ when both are on).
  6. draw: cdf_j = c_j / c_last over the kept prefix (c = running sum of p), token =
     idx[pos], pos = #{j : cdf_j <= u} clamped to the last kept slot.
Every kept set is a prefix of the candidates (values descend, so p descends), which is
what makes 4-6 prefix computations.

Numerics (declared; all float64 from the exactly widened bf16 values):
  z = v / T (one float64 division; T widened exactly from fp32); e = exp64(z - m) with m
  the max of the normalizing set (exp64: basic ops only; z == m gives exactly 1, so +-inf
  rows are defined: the +inf lanes split the mass equally; an all -inf row is uniform);
  p = e / S with S = sum64(e over the set) (one correctly rounded division).
  The full-row pass is kernels.tail.rowmass.row_mass (the same float64 ops per lane on every
  backend). Sums over the full row: kernels.tail.rowmass.sum64 (256 float64 lane chains in
  pass order, then a halving tree of 8 levels; depth ceil(V/256) + 8). Running sums over candidates: a sequential
  float64 chain in candidate order (depth k). log via numerics.log64.
  logprobs = fp32(v_tok - (max + log64(sum64(exp64(v - max))))) at T = 1 over the full row.
With nan_fold=True NaN lanes count as -inf (zero mass) in the full-row sums.

The parameters of a row: the public fp32 tensor [R, 3|4|5] with the columns SAMPLING_COLUMNS
= (top_k, top_p, temperature, u, min_p) (COL names each index); every pass reads it through
kernels.tail.sampling.sampling_records (the C kernels' lmtail_sampling records; plan_on their
fields), the one place the widenings and defaults are spelled.

Shape legend: R rows, V vocab (full row), k candidates, P = 3|4|5 parameter columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..checks import is_int, is_real, need, need_tensor
from ..kernels.tail.rowmass import row_mass, shifted_exp, sum64
from ..kernels.tail.sampling import COL, SAMPLING_COLUMNS, record_tensors, sampling_records
from ..numerics import DEFAULT_U, draw_u, log64  # DEFAULT_U: the u of a [R, 3] tensor and of greedy requests

GREEDY_TEMPERATURE = 1e-5  # temperature < this (after the fp32 -> float64 widening) is greedy


# ---------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------
U64 = 1 << 64  # seeds are uint64: [0, 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings; `sampling_tensor` reduces a batch of them to the
    tail's [R, 5] fp32 tensor (top_k, top_p, temperature, u, min_p).

    Defaults: top_k=0 (off), top_p=1.0 (off), temperature=1.0 (sampled), min_p=0.0 (off),
    seed=None, u=None. A sampled request (fp32 temperature >= GREEDY_TEMPERATURE = 1e-5)
    needs its draw from exactly one of:
      seed: an int in [0, 2**64); u = numerics.draw_u(seed, position) (SplitMix64, the same
            bits on any machine), so `sampling_tensor` then needs each request's decode
            position, and the draw changes every step;
      u:    a fixed draw in [0, 1) (u=0.5 is the middle of the kept distribution).
    Neither is a ValueError in `sampling_tensor` (an engine that forgot both would draw the
    same u at every step); both is a ValueError too. A greedy request needs neither (its
    u column is 0.5 and unused). A seed that is not an int in [0, 2**64) (a bool, a float,
    a negative int, 2**64 or more) is a ValueError naming `seed` at construction."""

    top_k: int = 0
    top_p: float = 1.0
    temperature: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    u: float | None = None

    def __post_init__(self):
        s = self.seed
        need(s is None or (is_int(s) and 0 <= s < U64),
             f"seed must be an int in [0, 2**64) or None; got {s!r}")


def seed_int64(seed: int) -> int:
    """A uint64 seed as the int64 with the same 64 bits (what numerics.draw_u reads)."""
    return int(seed) - U64 if seed >= 1 << 63 else int(seed)


def greedy_rows(n: int) -> torch.Tensor:
    """[n, 5] fp32 greedy rows (top_k 0, top_p 1, temperature 0, u DEFAULT_U, min_p 0): the
    one spelling of a padding row or a scoring call's rows (their decisions are slot 0; u is
    never read on a greedy row)."""
    row = {"top_k": 0.0, "top_p": 1.0, "temperature": 0.0, "u": DEFAULT_U, "min_p": 0.0}
    return torch.tensor([[row[c] for c in SAMPLING_COLUMNS]], dtype=torch.float32).repeat(n, 1)  # [n, 5]


def sampling_tensor(params: list[SamplingParams], positions=None) -> torch.Tensor:
    """[R] SamplingParams (+ decode positions when seeds are used) -> [R, 5] fp32
    (top_k, top_p, temperature, u, min_p).

    positions: one int >= 0 per request, the decode position of the token being drawn
    (u = draw_u(seed, position) on seeded requests; ignored on the others). Default None,
    which is allowed only when no request has a seed (a ValueError otherwise: a missing
    position would silently draw position 0's u at every step).
    Each field must be a real number (not bool); the fp32 tensor is then checked with the
    tail's own rules (`param_problems`), so a value that passes in Python but not after
    the fp32 rounding (u = 0.99999999 -> 1.0) is a ValueError naming the request; so is a
    sampled request with neither seed nor u (SamplingParams)."""
    params = list(params)
    seeded = [i for i, p in enumerate(params) if isinstance(p, SamplingParams) and p.seed is not None]
    if positions is None:
        need(not seeded, f"positions must be given (one decode position per request) when a request "
                         f"has a seed; got None with request {seeded[0] if seeded else 0} seeded "
                         "(pass positions=[...]; without them every step would draw position 0's u)")
        positions = [0] * len(params)
    positions = list(positions)
    if len(positions) != len(params):
        raise ValueError(f"positions must have one entry per request ({len(params)}); got {len(positions)}")
    rows = [_request_row(i, p, pos) for i, (p, pos) in enumerate(zip(params, positions))]
    sp = torch.tensor(rows, dtype=torch.float32).reshape(len(params), len(SAMPLING_COLUMNS))  # [R, 5]
    for bad, what in param_problems(sp):
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"request {i}: {what}; got {params[i]}, which is {sp[i].tolist()} in fp32")
    # sampled as the tail decides it: float64(fp32 T) >= GREEDY_TEMPERATURE
    for i, (p, sampled) in enumerate(zip(params, (sp[:, COL.temperature].double() >= GREEDY_TEMPERATURE).tolist())):
        need(not sampled or p.seed is not None or p.u is not None,
             f"request {i}: a sampled request (temperature={p.temperature!r} >= {GREEDY_TEMPERATURE}) needs "
             "a seed (+ positions) or an explicit u; got neither, which would draw the same u every "
             "step (pass u=0.5 for the fixed draw)")
    return sp


def _request_row(i: int, p, pos) -> list[float]:
    """One request's row (SAMPLING_COLUMNS order) as Python floats (not yet fp32)."""
    if not isinstance(p, SamplingParams):
        raise ValueError(f"request {i}: params must be a SamplingParams; got {type(p).__name__}")
    if p.seed is not None and p.u is not None:
        raise ValueError(f"request {i}: give either seed (+ position) or u, not both")
    if p.seed is not None:
        need(is_int(pos) and 0 <= pos < 1 << 63,
             f"positions[{i}] must be an int in [0, 2**63) (request {i} has a seed); got {pos!r}")
    fields = {c: (DEFAULT_U if p.u is None else p.u) if c == "u" else getattr(p, c) for c in SAMPLING_COLUMNS}
    for name, v in fields.items():
        if not is_real(v):
            raise ValueError(f"request {i}: {name} must be a real number (not bool); got {v!r}")
    u = float(draw_u(seed_int64(p.seed), int(pos))) if p.seed is not None else float(fields["u"])
    try:  # every column but u is the SamplingParams field of its name
        return [u if c == "u" else float(getattr(p, c)) for c in SAMPLING_COLUMNS]
    except OverflowError:
        raise ValueError(f"request {i}: a field is too large for fp32; got {p}") from None


def param_problems(sp: torch.Tensor) -> list[tuple[torch.Tensor, str]]:
    """The parameter rules on a [R, 3|4|5] fp32 tensor: (bad rows [R] bool, what) per rule."""
    top_k, top_p, temp = sp[:, COL.top_k], sp[:, COL.top_p], sp[:, COL.temperature]
    checks = [
        (torch.isnan(sp).any(dim=1), "has NaN"),
        (torch.isinf(top_k), "top_k must be finite (<= 0 disables top-k, > k caps it at k)"),
        (top_k != torch.round(top_k), "top_k must be a whole number"),
        ((top_p <= 0) | (top_p > 1), "top_p must be in (0, 1]"),
        (temp < 0, "temperature must be >= 0"),
        (torch.isinf(temp), "temperature must be finite"),
    ]
    if sp.shape[1] > COL.u:
        checks.append(((sp[:, COL.u] < 0) | (sp[:, COL.u] >= 1), "u must be in [0, 1)"))
    if sp.shape[1] > COL.min_p:
        checks.append(((sp[:, COL.min_p] < 0) | (sp[:, COL.min_p] > 1), "min_p must be in [0, 1]"))
    return checks


def _params_ok(rows: list) -> bool:
    """True iff no row of `rows` (sp.tolist(): the fp32 values as Python floats, exact)
    breaks a `param_problems` rule: the same rules on the host, a microsecond a row. Every
    comparison with a NaN is False, so a NaN anywhere fails its field's rule."""
    inf = math.inf
    ck, cp, ct, cu, cm = (getattr(COL, c) for c in SAMPLING_COLUMNS)
    for r in rows:
        k, p, t = r[ck], r[cp], r[ct]
        if not (-inf < k < inf and k == math.floor(k) and 0 < p <= 1 and 0 <= t < inf):
            return False
        if len(r) > cu and not 0 <= r[cu] < 1:
            return False
        if len(r) > cm and not 0 <= r[cm] <= 1:
            return False
    return True


def validate_params(sp: torch.Tensor, rows: int) -> None:
    """ValueError (naming the row) unless sp is a valid [rows, 3|4|5] fp32 CPU tensor;
    TypeError if it is not a tensor."""
    if not (isinstance(sp, torch.Tensor) and sp.device.type == "cpu"):  # checks' words, built only on failure
        need_tensor("sampling_params", sp, f"[R={rows}, 3|4|5] float32")
    if sp.dtype != torch.float32:
        raise ValueError(f"sampling_params must be a float32 tensor; got {sp.dtype}")
    if sp.dim() != 2 or sp.shape[0] != rows or sp.shape[1] not in (3, 4, 5):
        raise ValueError(f"sampling_params must be [R={rows}, 3|4|5]; got {tuple(sp.shape)}")
    if sp.shape[0] and _params_ok(sp.tolist()):
        return
    for bad, what in param_problems(sp):
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"sampling_params row {i}: {what}; got {sp[i].tolist()}")


# ---------------------------------------------------------------------------------------
# the declared float64 running sum over candidates
# ---------------------------------------------------------------------------------------
def running_sum64(x: torch.Tensor) -> torch.Tensor:
    """Sequential float64 running sum along candidates: c_j = (...((+0 + x_0) + x_1) + ...) + x_j.

    numpy's add.accumulate is defined as r[i] = r[i-1] + x[i] (one IEEE add per step, in
    order), so accumulating [+0, x_0, x_1, ...] and dropping the first column is exactly
    this chain."""
    x64 = x.detach().to(torch.float64).numpy()  # [R, k]
    z = np.concatenate([np.zeros((x64.shape[0], 1)), x64], axis=1)  # [R, 1 + k]
    return torch.from_numpy(np.add.accumulate(z, axis=1)[:, 1:].copy())


# ---------------------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------------------
class FullRowStats:
    """What the sampler reads of a row beyond its k candidates, from the full bf16 row
    (the mirror path): the T = 1 log-normalizer, whether a lane outside the candidates
    reaches the top-k threshold, and the temperature-T mass of rows normalized over the
    whole vocabulary. row64 [R, V] float64 (NaN folded to -inf when asked)."""

    def __init__(self, row64: torch.Tensor, k: int):
        self.row64, self.k = row64, k

    def lse1(self) -> torch.Tensor:
        """[R] float64: m1 + log64(S1), (m1, S1) = row_mass(row, 1)."""
        m1, s1, _ = row_mass(self.row64, torch.ones(self.row64.shape[0], dtype=torch.float64))
        return m1 + log64(s1)

    def ties_past_k(self, thr: torch.Tensor, in_k: torch.Tensor) -> torch.Tensor:
        """[R] bool: more lanes of the row are >= thr [R, 1] than candidates in in_k [R, k]."""
        return (self.row64 >= thr).sum(dim=1) > in_k.sum(dim=1)

    def off_mass(self, off: torch.Tensor, t: torch.Tensor):
        """(m, S [n] float64, mass_past_k [n] bool) of rows `off` [n] over the whole row at
        temperatures t [n]: row_mass, and whether more than k lanes carry mass."""
        m, s, nz = row_mass(self.row64[off], t)
        return m, s, nz > self.k


def sampling_plan(cand_values, full_rows, sampling_params, *, nan_fold=False) -> dict:
    """Steps 1-5 for every row: the filtered probabilities and the kept prefix.

    cand_values [R, k] bf16 descending; full_rows [R, V] bf16; sampling_params validated
    [R, 3|4|5]. Returns p [R, k] float64 (softmax over the filtered set; 0 outside it),
    running [R, k] (running sum of p), keep [R, k] bool (a prefix, slot 0 always kept),
    u [R], greedy [R], truncated [R] (False on greedy rows: their answer is exact),
    lse1 [R] (full-row log-sum-exp at T = 1).
    """
    row64 = full_rows.double()  # [R, V]
    if nan_fold:
        row64 = torch.where(torch.isnan(row64), torch.full_like(row64, -torch.inf), row64)
    return plan_on(cand_values, sampling_params, FullRowStats(row64, cand_values.shape[1]), nan_fold=nan_fold)


def plan_on(cand_values, sampling_params, stats, *, nan_fold=False, terms=shifted_exp, total=sum64) -> dict:
    """sampling_plan's steps 1-5 on candidates [R, k] (bf16 or fp32, descending; widened
    exactly to float64) with the full row seen only through `stats` (FullRowStats, or the
    candidates exchange's merged partials: the same three questions). terms / total: the
    shifted_exp and sum64 it uses (default the declared torch ops; the candidates exchange
    passes kernels.tail.rowmass.shifted_exp_rows / sum64_rows, the same bits from C)."""
    r, k = cand_values.shape
    rec = record_tensors(sampling_records(sampling_params))  # the C kernels' lmtail_sampling fields, [R] each
    top_k, top_p, temp, u, min_p = (rec[c] for c in SAMPLING_COLUMNS)  # top_k int64 (> k caps at k)
    v = cand_values.double()  # [R, k]
    if nan_fold:  # a folded NaN candidate (fewer than k numbers) has no mass
        v = torch.where(torch.isnan(v), torch.full_like(v, -torch.inf), v)
    greedy = temp < GREEDY_TEMPERATURE
    safe_t = torch.where(greedy, torch.ones_like(temp), temp)
    lse1 = stats.lse1()

    # 1. top-k: a prefix of the candidates
    enabled = top_k > 0
    kk = torch.where(enabled, top_k.clamp(max=k), torch.full_like(top_k, k))
    thr = v.gather(1, (kk - 1)[:, None])  # [R, 1]
    in_k = v >= thr  # [R, k]
    truncated = enabled & ((top_k > k) | stats.ties_past_k(thr, in_k))

    # 3. softmax(v / T) over the filtered set (the whole row when top-k is disabled)
    z = v / safe_t[:, None]
    m_k = z[:, 0]  # candidates descend: the filtered set's max
    s_k = total(torch.where(in_k, terms(z, m_k), torch.zeros_like(z)))
    m, s, past = m_k.clone(), s_k.clone(), torch.zeros(r, dtype=torch.bool)
    off = torch.nonzero(~enabled & ~greedy)[:, 0]  # rows normalized over the whole vocab
    if off.numel():
        m[off], s[off], past[off] = stats.off_mass(off, safe_t[off])
    p = terms(z, m) / s[:, None]
    p = torch.where(in_k, p, torch.zeros_like(p))  # [R, k]
    p = torch.nan_to_num(p, nan=0.0)  # only NaN rows without the fold get here

    # 4. top-p on the mass strictly before each candidate; 5. min-p
    c = running_sum64(p)  # [R, k]
    keep = in_k & ((c - p < top_p[:, None]) | (top_p[:, None] >= 1))
    # top-k disabled: truncated when the k candidates cannot reach top_p, or (top_p >= 1)
    # when a lane outside them still carries mass (past)
    short = torch.where(top_p < 1, c[:, -1] < top_p, past)
    truncated = truncated | (~enabled & short)
    keep = keep & (p >= min_p[:, None] * p[:, :1])
    keep[:, 0] = True
    return {"p": p, "running": c, "keep": keep, "u": u, "greedy": greedy,
            "truncated": truncated & ~greedy, "lse1": lse1}


def draw(plan: dict) -> torch.Tensor:
    """Step 6: slot [R] = #{j kept : cdf_j <= u}, cdf = running / running[last kept];
    clamped to the last kept slot; 0 on greedy rows."""
    keep, c = plan["keep"], plan["running"]
    n_keep = keep.sum(dim=1)  # [R] >= 1
    total = c.gather(1, (n_keep - 1)[:, None])  # [R, 1]
    cdf = c / total
    pos = ((cdf <= plan["u"][:, None]) & keep).sum(dim=1).clamp(max=n_keep - 1)
    return torch.where(plan["greedy"], torch.zeros_like(pos), pos)


def sample_rows(cand_values, cand_ids, full_rows, sampling_params, *, nan_fold=False):
    """Sample one token per row (module docstring: semantics and numerics).

    cand_values [R, k] bf16 descending; cand_ids [R, k] int64; full_rows [R, V] bf16;
    sampling_params [R, 3|4|5] fp32 (validated here; a [R, 3] tensor draws u = DEFAULT_U
    = 0.5 on every row).
    Returns (tokens [R] int64, logprobs [R] fp32, truncated [R] bool).
    """
    validate_params(sampling_params, cand_values.shape[0])
    return sample_rows_unchecked(cand_values, cand_ids, full_rows, sampling_params, nan_fold=nan_fold)


def sample_rows_unchecked(cand_values, cand_ids, full_rows, sampling_params, *, nan_fold=False):
    """`sample_rows` on inputs the caller has validated (lmtail.tail.compose validates once per
    call at its boundary); the same bytes."""
    plan = sampling_plan(cand_values, full_rows, sampling_params, nan_fold=nan_fold)
    return decide(plan, cand_values, cand_ids)


def decide(plan: dict, cand_values, cand_ids):
    """Step 6 and the outputs from a plan: (tokens [R] int64, logprobs [R] fp32 =
    fp32(v_tok - lse1), truncated [R] bool)."""
    pos = draw(plan)[:, None]
    tokens = cand_ids.gather(1, pos)[:, 0]
    v_tok = cand_values.double().gather(1, pos)[:, 0]
    logprobs = (v_tok - plan["lse1"]).to(torch.float32)
    return tokens, logprobs, plan["truncated"]
