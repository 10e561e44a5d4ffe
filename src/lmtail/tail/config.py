"""The decode tail's options as one frozen value: what every rank must agree on.

TailConfig travels unchanged from `decode_tail` to its two halves (shard logits, owned
rows) on one rank or many; the vocab-parallel path all-gathers it (as part of the input
signature, `tail.tail_signature`: a bool as 0/1, a choice as its code in OPTION_CODES)
so that ranks with different options raise instead of computing different answers.
TailConfig checks its own fields when it is made (`__post_init__`: each field's type and
allowed values, ValueError naming the field, expected vs got); the rules that need the
tensors (k <= V, hidden_actual <= H, the head's kind and the options that go with it)
live in `lmtail.tail.compose.validate_tail_inputs`, the one boundary check of the tail.

The choice sets live here, next to TailConfig, and every command line builds its
`choices=` and defaults from them: EXCHANGES, TAIL_HEAD_INPUTS, GEMM_ORDERS, TAIL_PATHS.

Shape legend: H hidden (padded), H_u = hidden_actual real lanes, k candidates, V vocab.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass, fields

from ..checks import check_eps, is_int
from ..kernels.gemm.bf16 import DEFAULT_ORDER, TAIL_ORDERS

EXCHANGES = ("mirror", "candidates")  # TailConfig.exchange
HEAD_INPUTS = ("bf16", "bf16x2")  # a bf16 head's activations
TAIL_HEAD_INPUTS = HEAD_INPUTS + ("fp32",)  # TailConfig.head_input: + the Q8_0 head's ("fp32")
GEMM_ORDERS = TAIL_ORDERS  # TailConfig.gemm_order: the orders of kernels.gemm.bf16 the tail's head GEMM takes
TAIL_PATHS = ("fused", "reference")  # TailConfig.tail_path: the owned rows' top-k + sampler, the same bytes

# each choice field -> {choice: its int64 code in the ranks' input signature (tail.tail_signature)}:
# fixed per name (a new choice takes a new code), never a position in a tuple
OPTION_CODES = {
    "gemm_order": {"chain": 0, "amx32": 1, "dp32": 2},
    "tail_path": {"fused": 0, "reference": 1},
    "exchange": {"mirror": 0, "candidates": 1},
    "head_input": {"bf16": 0, "bf16x2": 1, "fp32": 2},
}
CHOICES = {"gemm_order": GEMM_ORDERS, "tail_path": TAIL_PATHS, "exchange": EXCHANGES,
           "head_input": TAIL_HEAD_INPUTS}  # TailConfig's choice fields and their sets
FLAGS = ("zero_interleaved_pad", "deferred_rms", "nan_fold", "emit_logits", "debug_taps")  # its bool fields
RANK_LOCAL = ("emit_logits", "debug_taps")  # what a rank returns only: the one fields ranks may differ on
assert all(set(OPTION_CODES[f]) == set(c) for f, c in CHOICES.items()), "one code per choice"


@dataclass(frozen=True)
class TailConfig:
    """Options of one decode-tail call, checked when made (ValueError naming the field,
    expected vs got: each field's type and allowed values below; head_input other than
    "bf16" needs deferred_rms). The flags (FLAGS: zero_interleaved_pad, deferred_rms,
    nan_fold, emit_logits, debug_taps) are bools; the choices are str in their CHOICES set.

    Every field with its default:
    eps (1e-5): added to ssq / H_u (a real number, finite, >= 0, also in fp32; rounded to
        fp32 once).
    hidden_actual (None: H): H_u, the real lanes: None or an int >= 1 (<= H: the tail checks).
    zero_interleaved_pad (True): pad lanes are the last (H-H_u)/4 of each of 4 groups
        (True) or the tail [H_u:] (False).
    k (256): top-k candidates per row, an int, 1 <= k <= V (V = V_s x ranks, checked by the
        tail); a k above V is a ValueError that says so, never clamped (a shard narrower
        than 256 needs k <= V).
    deferred_rms (True): logits = fp32(gemm(bf16(x*gamma)) * rms) (True) or
        gemm(bf16((x*rms)*gamma)) (False).
    nan_fold (False): NaN lanes rank below -inf in top-k and carry no mass in the sampler.
    emit_logits (True): return the fp32 shard logits [gbs, V_s].
    debug_taps (False): return top-k stage taps.
    gemm_order: the lm_head GEMM's declared order, one of GEMM_ORDERS: "amx32"
        (AMX's block order, FTZ/DAZ), "chain" (the sequential fp32 chain) or "dp32"
        (VDPBF16PS's order: per 32-lane block an odd-then-even fma chain, FTZ/DAZ); default
        kernels.gemm.bf16.DEFAULT_ORDER ("amx32"), the one default of every GEMM in lmtail.
    tail_path ("fused"): how the owned rows' top-k + sampler run, one of TAIL_PATHS:
        "fused" (the one-pass C kernel kernels.tail.rows_tail) or "reference"
        (topk.exact_topk + sampler.sample_rows); the same bytes either way (mirror only).
    exchange ("candidates"): what crosses the all-to-all and what the decisions are made
        on, one of EXCHANGES: "candidates" (each shard's exact fp32 top-(k+1) and its chunk
        mass partials, lmtail.tail.candidates: decisions on fp32 logits; VTP must divide 256) or
        "mirror" (the bf16 mirror of every logit; top-k and the sampler on bf16 values).
        Either way the bytes do not depend on VTP, hops or batch groups.
    head_input ("bf16"): the lm_head GEMM's activation, one of TAIL_HEAD_INPUTS: "bf16" (a =
        bf16(x*gamma), one GEMM row per row) or "bf16x2" (a = a_hi + a_lo, a_hi =
        bf16(x*gamma), a_lo = bf16(x*gamma - a_hi): two GEMM rows per row in one GEMM call,
        logits = fp32(fp32(acc_hi + acc_lo) * rms); the activation carries 16 significant
        bits instead of 8; needs deferred_rms) or "fp32" (the Q8_0 head: lm_head_weight_t
        is a kernels.quant.gemm_q.QuantWeight "Q8_0" (V_s, H), the GGUF rows of this vocab shard;
        g = fp32(x*gamma) goes into kernels.quant.gemm_q.gemm_q unrounded, acc in gemm_q's
        declared order "lanes32", logits = fp32(acc * rms)). The rule is explicit, both
        ways, checked by tail.validate_tail_inputs (ValueError naming the argument): a
        QuantWeight head needs head_input="fp32", fmt "Q8_0", K = H (so H % 32 == 0),
        deferred_rms=True and gemm_order at its default (it does not apply to gemm_q: a
        non-default one is refused, never ignored); head_input="fp32" needs a QuantWeight.
    """

    eps: float = 1e-5
    hidden_actual: int | None = None
    zero_interleaved_pad: bool = True
    k: int = 256
    deferred_rms: bool = True
    nan_fold: bool = False
    emit_logits: bool = True
    debug_taps: bool = False
    gemm_order: str = DEFAULT_ORDER
    tail_path: str = "fused"
    exchange: str = "candidates"
    head_input: str = "bf16"

    def __post_init__(self):
        check_eps_once(self.eps)
        h_u = self.hidden_actual
        if not (h_u is None or is_int(h_u) and h_u >= 1):
            raise ValueError(f"hidden_actual must be None (H) or an int in [1, H]; got {h_u!r}")
        if not (is_int(self.k) and self.k >= 1):
            raise ValueError(f"k must be an int in [1, V]; got {self.k!r}")
        for flag in FLAGS:
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag} must be a bool; got {getattr(self, flag)!r}")
        for name, allowed in CHOICES.items():
            got = getattr(self, name)
            if not (isinstance(got, str) and got in allowed):
                raise ValueError(f"{name} must be one of {allowed}; got {got!r}")
        if not (self.head_input == "bf16" or self.deferred_rms):
            raise ValueError(f"head_input={self.head_input!r} needs deferred_rms=True (its GEMM input is x*gamma, "
                             "rms applied after); got deferred_rms=False")


def resolve(config: TailConfig | None, keywords: dict) -> TailConfig:
    """The options of one call that takes them either as `config` or as keywords (decode_tail):
    keywords {field: value} build the TailConfig when config is None; with config, every
    keyword must be at its default (ValueError naming the ones that are not). A config that
    is not a TailConfig is returned as it is (the caller's boundary check names it)."""
    if config is None:
        return TailConfig(**keywords)
    changed = {n: v for n, v in keywords.items() if not _at_default(n, v)}
    if changed:
        raise ValueError(f"give the options either as config= or as keywords, not both; got config={config} "
                         f"and keywords {changed}")
    return config


_DEFAULTS = {f.name: f.default for f in fields(TailConfig)}  # field -> its default
SIGNED = tuple(n for n in _DEFAULTS if n not in RANK_LOCAL)  # the fields every rank must agree on


def signature(config: TailConfig, h: int) -> dict:
    """{field: (int64, shown value)} of every SIGNED field, for the ranks' input signature
    (tail.tail_signature): a bool as 0/1, a choice as its OPTION_CODES code, an int as
    itself, a float by its float64 bits; hidden_actual None as H = h (the same lanes). A
    new TailConfig field is signed here without another line."""
    out = {}
    for name in SIGNED:
        v = getattr(config, name)
        if name == "hidden_actual" and v is None:
            v = h
        if isinstance(v, bool) or is_int(v):
            code = int(v)
        elif isinstance(v, str):
            code = OPTION_CODES[name][v]
        else:  # a real number
            code = struct.unpack("<q", struct.pack("<d", float(v)))[0]
        out[name] = (code, v if code != v else code)
    return out


def _at_default(name: str, value) -> bool:
    default = _DEFAULTS[name]
    return type(value) is type(default) and value == default


@functools.lru_cache(maxsize=64, typed=True)
def _eps_ok(eps) -> bool:
    check_eps(eps)  # raises (and caches nothing) for a bad eps
    return True


def check_eps_once(eps) -> None:
    """checks.check_eps, remembered per (type, value) it accepted: the rule is a pure
    function of both (an unhashable eps is checked every time)."""
    try:
        hash(eps)
    except TypeError:
        check_eps(eps)
        return
    _eps_ok(eps)
