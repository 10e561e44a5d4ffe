"""The logits-processor seam: per-row edits of the fp32 shard logits, between the lm_head
GEMM (logits = fp32(acc * rms)) and the exchange, on each rank's own vocab shard.

    logits [gbs, V_s] fp32 (rank r: global ids v0 = r*V_s .. v0+V_s-1)
      row b with processing[b] = LogitProcessing(...), lane j (its global id), in this order,
      one fp32 rounding point after each step; a step whose parameter is neutral is not run
      (no arithmetic at all), and only the listed ids are read or written:
      1 repetition (vLLM's), r = fp32(repetition_penalty) != 1, j in prompt_ids or output_counts:
            l = l > 0 ? fp32(l / r) : fp32(l * r)           (NaN: NaN; -inf: -inf)
      2 frequency (OpenAI's), f = fp32(frequency_penalty) != 0, c = count of j in output_counts > 0:
            l = fp32(l - fp32(f * c))
      3 presence (OpenAI's), p = fp32(presence_penalty) != 0, c > 0:
            l = fp32(l - p)
      4 logit_bias, j listed with bias b (fp32(b)):
            l = fp32(l + b)
      5 allowed (a grammar mask, [V] bool over the full vocab), allowed[j] False:
            l = -inf                                          (whatever l was, NaN included)
    A row whose entry is None, or whose fields are all neutral, is not touched (its bytes
    are the GEMM's). Every step is lane-wise, so the values never depend on the rank
    layout: rank r edits lanes v0 .. v0+V_s-1 of the full-vocab result, byte for byte.

The order is vLLM's (penalties, then bias, then the structured-output mask) with OpenAI's
presence / frequency formula (mu[j] - c[j]*alpha_frequency - (c[j] > 0)*alpha_presence,
as two declared subtractions). Declared: `processors_decl()`; the tail's declaration
(tail.tail_decl) names the seam as its rounding point "processors"; docs/numerics.md.

Efficiency: per call, the listed ids of every row are gathered into one flat index list
and edited with one numpy op per step on a view of the logits (no dense [gbs, V] pass, no
thread-pool wake-up); the mask is one masked store per masked row. With processing None
(or all None) nothing runs.

Validation (`plan_processing`, the seam's one boundary check): ValueError naming the
field (processing[b].<field>) with expected vs got: ids ints in [0, V) (logit_bias and
output_counts ids unique), bias values real with a finite fp32 value, presence and
frequency penalties in [-2, 2] (OpenAI's range), repetition_penalty > 0 and finite in
fp32 (vLLM's), counts ints in [1, 2**24) (exact in fp32), allowed a CPU [V] bool tensor
with at least one True. Bad input writes nothing.

Shape legend: gbs rows of the call, V_s vocab shard, V full vocab, n listed lanes.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..checks import is_int, is_real
from ..numerics import Decl

MAX_COUNT = 1 << 24  # counts are exact in fp32 below this
PENALTY_RANGE = (-2.0, 2.0)  # presence / frequency (OpenAI)
STEPS = ("repetition", "frequency", "presence", "logit_bias", "allowed")  # the declared order


@dataclass(frozen=True, eq=False)
class LogitProcessing:
    """One row's logits processors for one decode step (module docstring: order and
    rounding). Defaults are neutral; eq is identity (a tensor field has no truth value)."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (global token id, bias) pairs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's: > 0, 1 = off
    output_counts: tuple[tuple[int, int], ...] = ()  # (token id, times generated so far)
    prompt_ids: tuple[int, ...] = ()  # the prompt's token ids (repetition)
    allowed: torch.Tensor | None = None  # [V] bool over the FULL vocab; False -> -inf

    @property
    def neutral(self) -> bool:
        """True when no step would run (the row's logits stay the GEMM's bytes)."""
        return (not self.logit_bias and self.allowed is None and self.presence_penalty == 0
                and self.frequency_penalty == 0 and self.repetition_penalty == 1)


def processors_decl() -> Decl:
    """The seam's declared numerics: one fp32 rounding point per step, in order; no sums."""
    return Decl("logits_processors",
                ("l/r|l*r:fp32 (repetition)", "f*c:fp32", "l-f*c:fp32 (frequency)", "l-p:fp32 (presence)",
                 "l+b:fp32 (logit_bias)", "allowed: -inf (exact)"), ())


# ---------------------------------------------------------------------------------------
# validation: one row's plan (its listed ids as arrays)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowPlan:
    """One validated row: sorted unique global ids per step and their parameters."""

    rep_ids: np.ndarray  # [n_r] int64 (empty when r == 1)
    r: float  # fp32 value
    cnt_ids: np.ndarray  # [n_c] int64 (empty when f == p == 0)
    cnts: np.ndarray  # [n_c] float32, exact
    f: float  # fp32 value
    p: float  # fp32 value
    bias_ids: np.ndarray  # [n_b] int64
    bias: np.ndarray  # [n_b] float32
    allowed: torch.Tensor | None  # [V] bool


def _f32(x: float) -> float:
    """x rounded to fp32 (nearest even; past the largest fp32: inf of its sign)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _ids(name: str, values, v: int) -> np.ndarray:
    """[n] int64 of a sequence of ints in [0, v)."""
    if not isinstance(values, (tuple, list)):
        raise ValueError(f"{name} must be a tuple of int token ids; got {type(values).__name__}")
    if not values:
        return np.zeros(0, dtype=np.int64)
    arr = np.asarray(values)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        bad = next((x for x in values if not is_int(x)), values[0])
        raise ValueError(f"{name} must hold int token ids; got {bad!r}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= v:
        raise ValueError(f"{name} must hold token ids in [0, V={v}); got {lo if lo < 0 else hi}")
    return arr.astype(np.int64, copy=False)


def _pairs(name: str, pairs) -> tuple[tuple, tuple]:
    """(ids, values) of a sequence of (id, value) pairs."""
    ok = isinstance(pairs, (tuple, list))
    if ok and not pairs:
        return (), ()
    try:
        ok = ok and set(map(len, pairs)) == {2}
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be a tuple of (token id, value) pairs; got {pairs!r:.120}")
    ids, vals = zip(*pairs)
    return ids, vals


def _numbers(name: str, vals, what: str) -> np.ndarray:
    """[n] int or float array of a sequence of real numbers (ints or floats, not bools)."""
    arr = np.asarray(vals) if vals else np.zeros(0)
    if arr.ndim != 1 or arr.dtype.kind not in "iuf":
        bad = next((x for x in vals if not is_real(x)), vals[0])
        raise ValueError(f"{name} must map ids to {what}; got {bad!r}")
    return arr


def _unique(name: str, ids: np.ndarray) -> np.ndarray:
    """argsort of ids; ValueError if an id repeats."""
    order = np.argsort(ids, kind="stable")
    s = ids[order]
    dup = np.nonzero(s[1:] == s[:-1])[0]
    if dup.size:
        raise ValueError(f"{name} must list each token id once; got id {int(s[dup[0]])} twice")
    return order


def _penalty(name: str, x, lo: float, hi: float) -> float:
    if not (is_real(x) and lo <= x <= hi):
        raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}]; got {x!r}")
    return _f32(float(x))


def plan_row(p: LogitProcessing, v: int, name: str = "processing") -> RowPlan | None:
    """One row's RowPlan (None: neutral), or ValueError naming `name`.<field>."""
    if not isinstance(p, LogitProcessing):
        raise ValueError(f"{name} must be a LogitProcessing or None; got {type(p).__name__}")
    f = _penalty(f"{name}.frequency_penalty", p.frequency_penalty, *PENALTY_RANGE)
    pr = _penalty(f"{name}.presence_penalty", p.presence_penalty, *PENALTY_RANGE)
    rp = p.repetition_penalty
    r = _f32(float(rp)) if is_real(rp) else math.nan
    if not (is_real(rp) and math.isfinite(rp) and rp > 0 and 0 < r < math.inf):
        raise ValueError(f"{name}.repetition_penalty must be a finite number > 0 (in fp32 too); got {rp!r}"
                         + (f", which is {r!r} in fp32" if is_real(rp) and math.isfinite(rp) and rp > 0 else ""))
    b_ids, b_vals = _pairs(f"{name}.logit_bias", p.logit_bias)
    bias_ids = _ids(f"{name}.logit_bias", b_ids, v)
    with np.errstate(over="ignore"):
        bias = _numbers(f"{name}.logit_bias", b_vals, "numbers finite in fp32").astype(np.float32)
    if not np.isfinite(bias).all():
        bad = b_vals[int(np.nonzero(~np.isfinite(bias))[0][0])]
        raise ValueError(f"{name}.logit_bias must map ids to numbers finite in fp32; got {bad!r}")
    c_ids, c_vals = _pairs(f"{name}.output_counts", p.output_counts)
    cnt_ids = _ids(f"{name}.output_counts", c_ids, v)
    cnts = _numbers(f"{name}.output_counts", c_vals, "int counts in [1, 2**24)")
    if cnts.size and (cnts.dtype.kind == "f" or cnts.min() < 1 or cnts.max() >= MAX_COUNT):
        bad = next(x for x in c_vals if not (is_int(x) and 1 <= x < MAX_COUNT))
        raise ValueError(f"{name}.output_counts must map ids to int counts in [1, 2**24); got {bad!r}")
    prompt = _ids(f"{name}.prompt_ids", p.prompt_ids, v)
    allowed = p.allowed
    if allowed is not None:
        if not (isinstance(allowed, torch.Tensor) and allowed.device.type == "cpu" and allowed.dtype == torch.bool
                and tuple(allowed.shape) == (v,)):
            got = (f"{tuple(allowed.shape)} {allowed.dtype}" if isinstance(allowed, torch.Tensor)
                   else type(allowed).__name__)
            raise ValueError(f"{name}.allowed must be a CPU [V={v}] bool tensor; got {got}")
        if not allowed.numpy().any():
            raise ValueError(f"{name}.allowed must allow at least one token; got none allowed")
    bo = _unique(f"{name}.logit_bias", bias_ids)
    co = _unique(f"{name}.output_counts", cnt_ids)
    if r == 1 and f == 0 and pr == 0 and not bias_ids.size and allowed is None:
        return None
    empty = np.zeros(0, dtype=np.int64)
    return RowPlan(rep_ids=np.union1d(prompt, cnt_ids) if r != 1 else empty, r=r,
                   cnt_ids=cnt_ids[co] if (f != 0 or pr != 0) else empty,
                   cnts=cnts.astype(np.float32)[co] if (f != 0 or pr != 0)
                   else np.zeros(0, dtype=np.float32),
                   f=f, p=pr, bias_ids=bias_ids[bo], bias=bias[bo], allowed=allowed)


def plan_processing(processing, *, rows: int, vocab_size: int) -> list[RowPlan | None] | None:
    """Validate `processing` (None, or a sequence of `rows` entries, each a LogitProcessing
    or None) for a vocabulary of V = vocab_size ids. Returns the rows' plans, or None when
    no row has processing (the tail then does nothing). ValueError naming processing[b]."""
    if processing is None:
        return None
    if not isinstance(processing, Sequence) or isinstance(processing, (str, bytes)):
        raise ValueError(f"processing must be None or a sequence of {rows} entries (LogitProcessing | None); "
                         f"got {type(processing).__name__}")
    if len(processing) != rows:
        raise ValueError(f"processing must hold one entry per row ({rows}); got {len(processing)}")
    plans = [None if p is None else plan_row(p, vocab_size, f"processing[{b}]") for b, p in enumerate(processing)]
    return plans if any(pl is not None for pl in plans) else None


# ---------------------------------------------------------------------------------------
# applying plans to a shard
# ---------------------------------------------------------------------------------------
def _lanes(pl: RowPlan, v0: int, vs: int) -> np.ndarray:
    """The row's listed global ids that fall in [v0, v0 + vs), sorted unique."""
    ids = np.unique(np.concatenate([pl.rep_ids, pl.cnt_ids, pl.bias_ids]))
    return ids[(ids >= v0) & (ids < v0 + vs)]


def _member(lanes: np.ndarray, ids: np.ndarray, vals: np.ndarray | None = None):
    """(in [n] bool, value at the lane [n] or None) for sorted unique ids."""
    if not ids.size:
        return np.zeros(lanes.shape, dtype=bool), None if vals is None else np.zeros(lanes.shape, vals.dtype)
    at = np.minimum(np.searchsorted(ids, lanes), ids.size - 1)
    hit = ids[at] == lanes
    return hit, None if vals is None else np.where(hit, vals[at], 0).astype(vals.dtype)


def apply_plans(logits: torch.Tensor, plans: Sequence[RowPlan | None], *, v0: int) -> torch.Tensor:
    """Edit logits [n, V_s] fp32 (C-contiguous; row i under plans[i]) IN PLACE, lanes
    holding global ids v0 .. v0+V_s-1, in the declared order (module docstring). Returns
    logits. Plans come from plan_processing (validated)."""
    n, vs = logits.shape
    parts = []  # per row: (flat index, rep, r, freq, f, c, pres, p, has_b, b)
    for i, pl in enumerate(plans):
        if pl is None:
            continue
        lanes = _lanes(pl, v0, vs)
        if not lanes.size:
            continue
        rep, _ = _member(lanes, pl.rep_ids)
        cnt, c = _member(lanes, pl.cnt_ids, pl.cnts)
        hb, b = _member(lanes, pl.bias_ids, pl.bias)
        m = lanes.size
        parts.append((lanes - v0 + i * vs, rep, np.full(m, pl.r, np.float32), cnt & (pl.f != 0),
                      np.full(m, pl.f, np.float32), c, cnt & (pl.p != 0), np.full(m, pl.p, np.float32), hb, b))
    x = logits.numpy()  # [n, V_s] fp32, a view: the edits land in logits
    if parts:
        _edit(x.reshape(-1), *(np.concatenate(col) for col in zip(*parts)))
    for i, pl in enumerate(plans):
        if pl is not None and pl.allowed is not None:
            x[i][~pl.allowed.numpy()[v0:v0 + vs]] = -np.inf
    return logits


def _edit(flat, idx, rep, r, freq, f, c, pres, p, hb, b) -> None:
    """Steps 1-4 on the listed lanes flat[idx] [n], fp32 arrays, one fp32 rounding each
    (numpy float32 arithmetic: IEEE, nearest even)."""
    g = flat[idx]  # [n] fp32
    with np.errstate(all="ignore"):  # inf - inf, NaN compares: IEEE results, no warnings
        g = np.where(rep, np.where(g > 0, g / r, g * r), g)  # 1 repetition
        g = np.where(freq, g - f * c, g)  # 2 frequency: fp32(f*c), then fp32(l - that)
        g = np.where(pres, g - p, g)  # 3 presence
        g = np.where(hb, g + b, g)  # 4 logit_bias
    flat[idx] = g


def apply_processing(logits: torch.Tensor, processing, *, v0: int = 0, vocab_size: int | None = None) -> torch.Tensor:
    """The seam as a public op: a processed copy of logits [n, V_s] fp32 whose lanes hold
    global ids v0 .. v0+V_s-1 of a V-id vocabulary (vocab_size: V, default v0 + V_s),
    under processing (None or n entries of LogitProcessing | None), in the declared order
    (module docstring). ValueError naming the field for bad processing; the input is
    never written."""
    if not (isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.dim() == 2):
        raise ValueError(f"logits must be a [n, V_s] float32 tensor; got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}"
                         f"{' ' + str(logits.dtype) if isinstance(logits, torch.Tensor) else ''}")
    v = v0 + logits.shape[1] if vocab_size is None else vocab_size
    if not (is_int(v0) and is_int(v) and 0 <= v0 and v0 + logits.shape[1] <= v):
        raise ValueError(f"v0 must be an int with 0 <= v0 and v0 + V_s <= V={v}; got v0={v0!r}, V_s={logits.shape[1]}")
    plans = plan_processing(processing, rows=logits.shape[0], vocab_size=v)
    out = logits.clone(memory_format=torch.contiguous_format)
    return out if plans is None else apply_plans(out, plans, v0=v0)


# ---------------------------------------------------------------------------------------
# a request's processors, expanded per decode step
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Processors:
    """One request's processors as a client gives them (OpenAI's logit_bias, presence /
    frequency penalties, vLLM's repetition_penalty); `at` builds the row's LogitProcessing
    for one decode step from the prompt and the tokens generated so far. Defaults are
    neutral. Validated where it becomes a LogitProcessing (plan_row's rules)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def neutral(self) -> bool:
        return (not self.logit_bias and self.presence_penalty == 0 and self.frequency_penalty == 0
                and self.repetition_penalty == 1)

    def at(self, prompt_ids: Sequence[int], counts: dict[int, int],
           allowed: torch.Tensor | None = None) -> LogitProcessing | None:
        """The step's LogitProcessing (None when neutral and no mask): counts {token id:
        times generated so far}; prompt_ids read only with a repetition penalty; allowed:
        the step's [V] bool grammar mask (None: none), passed through."""
        if self.neutral:
            return None if allowed is None else LogitProcessing(allowed=allowed)
        penal = self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1
        return LogitProcessing(logit_bias=self.logit_bias, presence_penalty=self.presence_penalty,
                               frequency_penalty=self.frequency_penalty,
                               repetition_penalty=self.repetition_penalty,
                               output_counts=tuple(sorted(counts.items())) if penal else (),
                               prompt_ids=tuple(prompt_ids) if self.repetition_penalty != 1 else (),
                               allowed=allowed)

    def check(self, vocab_size: int, name: str = "processors") -> None:
        """ValueError naming the field unless every step's LogitProcessing would be valid
        (the rules of plan_row on the static fields)."""
        plan_row(self.at((), {}) or LogitProcessing(), vocab_size, name)
