"""Contract kinds and planted controls for the candidates exchange and the bf16x2 head input.

Kinds:
  tail.exchange.candidates     decode_tail(exchange="candidates", debug_taps=True,
                               emit_logits=True), one rank; every case is judged on
    (a) the op's own fp32 logits: inside reference.tail.logits_range of the declaration
        (finite inputs), and the top-k values/ids and taps (outside, has_outside, nans, and
        with sampling m1, S1, mT, ST) bit-equal to reference.candidates.candidates_emulation
        of those logits (T pass on the rows the sampler normalizes at T != 1: top-k off,
        sampled, T != 1); the raw logprob bit-equal to fp32(v_tok - (m1 + log64(S1)))
        from the emulation's masses (any NaN matches any NaN);
    (b) VTP invariance in one process (no process group): for every VTP in 2, 4, 8 that
        divides V, the run with data["vtp"] = VTP (each rank's partials by
        candidates.shard_partials on its column slice, packed, the slabs concatenated in
        rank order as the exchange delivers them, unpacked, merged, sample_merged) gives
        the single-rank bytes of every output (logits shards concatenated, top-k, tokens,
        logprobs, truncated, taps);
    (c) certification (finite logits): contract.certify.certify_tail(exchange="candidates")
        on the single-rank outputs, every certified decision matches (counts reported).
  tail.logits.deferred.fp32[.chain|.dp32].bf16x2   decode_tail(head_input="bf16x2")
    logits: inside reference.tail.logits_range(decl=tail_decl(H, True, order,
    "candidates", "bf16x2")) (two GEMMs, a_hi and a_lo, added in fp32) on the tail logits
    kinds' data, and the emulate gate's bytes: a_hi = bf16(g), a_lo = bf16(fp32(g - a_hi))
    (0 beside an inf), g = fp32(x * gamma), each GEMM by reference.gemm's emulation of the
    order, acc = fp32(acc_hi + acc_lo), logits = fp32(acc * rms).

Controls are the op restated with ONE defect (`exchange_variant`, `x2_variant`;
defect=None is the real op's bytes: for the exchange that is gate (b) itself) or the
real op under a wrong declaration.

Data: the tail data of tail_kinds (x, gamma, w, eps, h_u, interleaved, deferred,
gemm_order) + k, nan_fold, sp [R, 5] fp32 | None (exchange kind), head_input (bf16x2
kinds), vtp (the in-process shard count; absent: one rank).

Shape legend: gbs rows (R = gbs: one rank), H hidden (padded), H_u real hidden, V vocab,
V_s = V / VTP, k candidates, C = 256 mass chunks.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import torch

from ..tail import candidates
from ..tail.config import TailConfig
from ..kernels.tail import shard_partials as shard_kernel
from ..kernels.gemm.bf16 import gemm_bf16
from ..numerics import Decl, log64, sqrt_rn32
from ..orders import sum_squares
from ..reference.candidates import MASS_CHUNKS, candidates_emulation
from ..tail.sampler import GREEDY_TEMPERATURE
from ..tail.compose import SSQ_ORDER, decode_tail, head_shard, head_shard_width, logits_from, normed_rows, pad_mask, tail_decl, validate_tail_inputs
from . import logits_kinds as lk
from . import sampler_kinds as sk
from .harness import Case, Control, Kind, Verdict, diff_outputs, half_depth, same_bytes

TAPS = ("outside", "has_outside", "nans", "m1", "S1", "mT", "ST")
FIELDS = ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated") + TAPS
VTPS = (2, 4, 8)  # the in-process shard counts of gate (b), where they divide V


# ---------------------------------------------------------------------------------------
# the candidates exchange: data, declaration, the op and its restatement
# ---------------------------------------------------------------------------------------
def exchange_decl_of(data) -> Decl:
    """The tail's declaration with exchange "candidates" (no mirror rounding point: the
    certification bound is the norm + GEMM range only) + candidates.candidates_decl(V)'s
    float64 points and sums."""
    t = tail_decl(data["x"].shape[1], data.get("deferred", True), lk.gemm_order_of(data), "candidates",
                  data.get("head_input", "bf16"))
    c = candidates.candidates_decl(head_shard_width(data["w"]))
    return Decl(f"{t.op} + {c.op}", t.rounding_points + c.rounding_points, t.sums + c.sums)


def tail_config(data) -> TailConfig:
    return TailConfig(eps=data["eps"], hidden_actual=data["h_u"], zero_interleaved_pad=data["interleaved"],
                      k=data["k"], deferred_rms=data["deferred"], nan_fold=data["nan_fold"], debug_taps=True,
                      gemm_order=lk.gemm_order_of(data), exchange="candidates",
                      head_input=data.get("head_input", "bf16"))


def _flat(out) -> dict:
    """TailOutput -> {field: tensor | None} (FIELDS; the taps as fields of their own)."""
    res = {f: getattr(out, f) for f in FIELDS[:6]}
    res.update({t: out.taps.get(t) for t in TAPS})
    return res


def run_exchange(data) -> dict:
    """decode_tail(exchange="candidates") on one rank (data["vtp"] > 1: `exchange_variant`,
    the same bytes through VTP shards in one process)."""
    if data.get("vtp", 1) != 1:
        return exchange_variant(data)
    out = decode_tail(data["x"], data["gamma"], data["w"], sampling_params=data["sp"], config=tail_config(data))
    return _flat(out)


def local_chunk_bounds(vs: int, vtp: int) -> torch.Tensor:
    """A WRONG per-shard chunking (control): the shard's V_s columns cut into C / VTP chunks
    of width ceil(V_s / (C / VTP)), the last ones short or empty, so chunk edges move with
    VTP (the declared edges floor(j V / C) depend on V alone)."""
    c = MASS_CHUNKS // vtp
    w = -(-vs // c)
    return torch.clamp(torch.arange(c + 1, dtype=torch.int64) * w, max=vs)


def hop_transposed_order() -> torch.Tensor:
    """A WRONG combine order (control): the 256 chunk terms read slab by slab in the order
    of hops (2, 4) transposed (slab r = a * 4 + b read as b * 2 + a). Not reversal or a
    rotation: sum64's halving tree adds lane t with t + 128, then t + 64, ..., so those
    permutations pair the same terms and give the same bits."""
    c = MASS_CHUNKS // 8
    ranks = [b * 2 + a for a in range(2) for b in range(4)]
    return torch.cat([torch.arange(r * c, (r + 1) * c) for r in ranks])


def _default_vtp(v: int) -> int:
    return next(n for n in (8, 4, 2, 1) if v % n == 0)


def _t_scale(sp) -> torch.Tensor:
    """[R] float64: the row's T where the sampler normalizes over the whole row at T != 1
    (top-k off, sampled: fp32 T widened >= GREEDY_TEMPERATURE, T != 1), else 0."""
    t = sp[:, 2].double()
    on = (sp[:, 0] <= 0) & (t >= GREEDY_TEMPERATURE) & (t != 1.0)
    return torch.where(on, t, torch.zeros((), dtype=torch.float64))


def exchange_variant(data, defect=None, vtp=None) -> dict:
    """decode_tail(exchange="candidates") restated over VTP shards in one process (vtp:
    data["vtp"], else the given one, else the largest of 8, 4, 2, 1 dividing V): per rank
    the shard logits (tail.logits_from on its columns), candidates.shard_partials, pack;
    the slabs side by side in rank order; unpack, merge, the NaN policy, sample_merged.
    defect=None gives the single-rank bytes (gate (b)); a defect: "chunks_move" (per-shard
    chunk edges, local_chunk_bounds), "keys_k_minus_1" / "keys_k" (each shard sends only
    k - 1 / k real keys, the rest pads), "combine_out_of_order" (the chunk terms combined
    in hop_transposed_order)."""
    x, w, sp = data["x"], data["w"], data["sp"]
    cfg = tail_config(data)
    v, k, nf = head_shard_width(w), data["k"], data["nan_fold"]
    vtp = data.get("vtp") or vtp or _default_vtp(v)
    validate_tail_inputs(x, data["gamma"], w, sp, cfg, vocab_size=v)
    candidates.check_vtp(vtp)
    if v % vtp:
        raise ValueError(f"vtp must divide V={v}; got {vtp}")
    a, rms = normed_rows(x, data["gamma"], cfg)
    vs = v // vtp
    slabs, shards = [], []
    for r in range(vtp):
        lg = logits_from(a, rms, head_shard(w, r, vtp), cfg)  # [gbs, V_s]
        shards.append(lg)
        if defect == "chunks_move":
            keys, mass, nans = shard_kernel.shard_partials(
                lg, col0=r * vs, k1=k + 1, nan_fold=nf, bounds=local_chunk_bounds(vs, vtp),
                scale_t=None if sp is None else _t_scale(sp), with_mass=sp is not None)
            part = candidates.ShardPartials(keys=keys, mass=mass, nans=nans)
        else:
            part = candidates.shard_partials(lg, col0=r * vs, v=v, k=k, nan_fold=nf, sp=sp)
        if defect in ("keys_k_minus_1", "keys_k"):
            keys = part.keys.clone()
            keys[:, k - 1 if defect == "keys_k_minus_1" else k:] = candidates.PAD_KEY
            part = replace(part, keys=keys)
        slabs.append(candidates.pack(part))
    return merged_outputs(data, shards, slabs, defect=defect)


def outputs_from_shards(data, shards) -> dict:
    """Every output of decode_tail(exchange="candidates") from given shard logits ([gbs,
    V_s] fp32 per rank, in rank order): each shard's partials packed, side by side in rank
    order, unpacked, merged, the NaN policy, sample_merged (no defect)."""
    k, nf, sp = data["k"], data["nan_fold"], data["sp"]
    vs = shards[0].shape[1]
    v = vs * len(shards)
    slabs = [candidates.pack(candidates.shard_partials(lg, col0=r * vs, v=v, k=k, nan_fold=nf, sp=sp))
             for r, lg in enumerate(shards)]
    return merged_outputs(data, shards, slabs)


def merged_outputs(data, shards, slabs, *, defect=None) -> dict:
    """The owner's half of exchange_variant: the packed slabs [R, B] of the VTP shards side
    by side, unpacked, merged (defect "combine_out_of_order": the chunk terms reordered),
    the NaN policy, sample_merged; shards: the shard logits (the "logits" output)."""
    sp, k, nf = data["sp"], data["k"], data["nan_fold"]
    vtp = len(slabs)
    v = shards[0].shape[1] * vtp
    recv = torch.cat(slabs, dim=1)  # [R, VTP*B]: what the exchange delivers
    part = candidates.unpack(recv, vtp=vtp, k=k, sp=sp)
    if defect == "combine_out_of_order" and part.mass is not None:
        part = replace(part, mass=part.mass[:, hop_transposed_order()].contiguous())
    mg = candidates.merge(part, k=k)
    res = {"logits": torch.cat(shards, dim=1), "topk_values": mg.values, "topk_indices": mg.ids,
           "tokens": None, "logprobs": None, "truncated": None, "outside": mg.outside,
           "has_outside": mg.has_outside, "nans": mg.nans}
    if sp is not None:
        candidates.check_nans(mg.nans, v=v, nan_fold=nf)
        res["tokens"], res["logprobs"], res["truncated"] = candidates.sample_merged(mg, sp, nan_fold=nf)
        res.update(zip(("m1", "S1", "mT", "ST"), mg.mass))
    else:
        res.update(dict.fromkeys(("m1", "S1", "mT", "ST")))
    return res


# ---------------------------------------------------------------------------------------
# the three judgements
# ---------------------------------------------------------------------------------------
def emulation_verdict(data, out) -> Verdict:
    """(a): top-k and taps bit-equal to candidates_emulation of the op's own fp32 logits;
    with sampling the logprob too (fp32(v_tok - (m1 + log64(S1))), any NaN == any NaN)."""
    sp = data["sp"]
    want = candidates_emulation(out["logits"], k=data["k"], nan_fold=data["nan_fold"],
                                temperatures=None if sp is None else _t_scale(sp).numpy())
    names = {"topk_values": "values", "topk_indices": "ids", "outside": "outside", "has_outside": "has_outside"}
    if sp is not None:
        names.update({n: n for n in ("nans", "m1", "S1", "mT", "ST")})
    for got_name, want_name in names.items():
        g, w = out[got_name], torch.from_numpy(np.ascontiguousarray(want[want_name]))
        if g is None or not same_bytes(g.contiguous(), w):
            d = diff_outputs({got_name: g}, {got_name: w}) if g is not None else f"{got_name} missing"
            return Verdict(False, None, f"vs candidates_emulation: {d}")
    if sp is None:
        return Verdict(True, None, f"{out['topk_indices'].numel()} candidates + taps == emulation")
    lse1 = torch.from_numpy(want["m1"]) + log64(torch.from_numpy(want["S1"]))
    v_tok = out["logits"].double().gather(1, out["tokens"][:, None])[:, 0]
    d = diff_outputs(out, {"logprobs": (v_tok - lse1).to(torch.float32)}, nan_equal=True)
    if d:
        return Verdict(False, None, f"logprob vs fp32(v_tok - lse1) of the emulated mass: {d}")
    return Verdict(True, None, f"{out['topk_indices'].numel()} candidates, taps and logprobs == emulation")


def vtp_verdict(data, out, run) -> Verdict:
    """(b): for each VTP in VTPS dividing V, run(vtp=VTP) gives out's bytes, every field."""
    v = head_shard_width(data["w"])
    done = []
    for vtp in VTPS:
        if v % vtp:
            continue
        d = diff_outputs(run(dict(data, vtp=vtp)), {f: t for f, t in out.items() if t is not None})
        if d:
            return Verdict(False, None, f"VTP {vtp} in one process vs one rank: {d}")
        done.append(vtp)
    return Verdict(True, None, f"VTP {done or 'none (V odd)'} == one rank")


def certify_verdict(data, out, decl) -> Verdict:
    """(c): every certified decision matches float64 (certify_tail, exchange="candidates")."""
    from .certify import certify_tail

    c = certify_tail(data["x"], data["gamma"], data["w"], out, sampling_params=data["sp"], eps=data["eps"],
                     hidden_actual=data["h_u"], interleaved=data["interleaved"], deferred_rms=data["deferred"],
                     gemm_order=lk.gemm_order_of(data), exchange="candidates",
                     head_input=data.get("head_input", "bf16"), k=data["k"], decl=decl)
    counts = {"certified": c["certified"], "near_ties": c["near_ties"], "truncated": c["truncated"]}
    if c["mismatched"]:
        return Verdict(False, None, f"certified decision differs from float64: {c['mismatches'][0]}", counts)
    return Verdict(True, None, f"certified {c['matched']}/{c['certified']} match, {c['near_ties']} near-ties", counts)


def check_exchange_values(data, out, run, decl) -> Verdict:
    """(a) + (b) only: for special values (non-finite logits: no range, no certification)."""
    a = emulation_verdict(data, out)
    if not a.ok:
        return a
    b = vtp_verdict(data, out, run)
    return b if not b.ok else Verdict(True, None, f"{a.detail}; {b.detail}")


def check_exchange(data, out, run, decl) -> Verdict:
    """logits in range + (a) + (b) + (c) (module docstring)."""
    r = lk.logits_verdict(data, out["logits"], decl)
    if not r.ok:
        return r
    ab = check_exchange_values(data, out, run, decl)
    if not ab.ok:
        return Verdict(False, r.margin, ab.detail)
    c = certify_verdict(data, out, decl)
    return Verdict(c.ok, r.margin, f"{ab.detail}; {c.detail}", c.counts)


# ---------------------------------------------------------------------------------------
# the exchange kind's gate data
# ---------------------------------------------------------------------------------------
EXCHANGE_SHAPES = [  # (gbs, H, H_u, V, interleaved, k): V < 256 odd and even, V % 256 != 0, k = V
    (1, 64, 64, 100, False, 16), (13, 61, 61, 37, False, 37), (7, 96, 88, 129, True, 16),
    (5, 257, 250, 104, False, 9), (4, 64, 64, 300, False, 7), (3, 128, 120, 1000, True, 32),
    (2, 8, 4, 9, True, 4), (4, 64, 64, 2048, False, 5)]


def exchange_params(gbs, seed, k) -> torch.Tensor:
    """[gbs, 5] fp32: tail_kinds.random_params with every 4th row from row 0 (top_k 0,
    T 1.5) and from row 1 (top_k -1, T 0.7) sampled over the whole row at T != 1, so the
    T pass (mT, ST) runs on some rows of every case."""
    sp = sk.random_params(gbs, seed, k)
    sp[0::4, 0], sp[0::4, 2] = 0.0, 1.5
    sp[1::4, 0], sp[1::4, 2] = -1.0, 0.7
    return sp


def exchange_data(gbs, h, h_u, v, interleaved, seed, *, k=32, scale=1.0, sampled=True):
    d = lk.tail_data(gbs, h, h_u, v, interleaved, seed, scale=scale, k=k)
    d["sp"] = exchange_params(gbs, seed, d["k"]) if sampled else None
    return d


def exchange_shapes(fast):
    return [Case(f"{gbs}x{h} (H_u={hu}) V={v} k={k}", exchange_data(gbs, h, hu, v, il, 600 + i, k=k))
            for i, (gbs, h, hu, v, il, k) in enumerate(EXCHANGE_SHAPES)]


def exchange_random(fast):
    """V = 1000: VTP 2, 4, 8 divide it, 256 does not (chunk widths 3 and 4)."""
    return [Case(f"seed {s} V=1000", exchange_data(8, 256, 240, 1000, True, s, scale=(1.0, 3.0, 0.3, 1.0)[s]))
            for s in range(2 if fast else 4)]


def special_logits_data(seed, gbs, v, *, k, nan_fold, sampled=True, all_inf=False):
    """Tail data (gemm_order "chain": IEEE subnormals) whose logits hold +-inf, NaN, +0, -0
    and ties. Lane 0 is +-4 by row, lane 1 is 2^-16 (times W = -2^-133: -2^-149, times
    rms < 1: -0), the other lanes in [4, 8). Columns: c % 8 == 0: W[0] = +inf (+-inf);
    1: W[0] = +inf, W[2] = -inf (NaN where lane 0 > 0, -inf elsewhere); 2: zeros (+0);
    3: W[1] = -2^-133 (-0); 4: a copy of column 5 (ties); else N(0, 0.04). all_inf: every
    column W[0] = +inf (rows of all +inf or all -inf)."""
    h = 48
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(gbs, h, generator=g) * 4 + 4
    x[:, 1] = 2.0**-16
    x[:, 0] = torch.where(torch.rand(gbs, generator=g) < 0.5, -4.0, 4.0)
    w = torch.zeros(h, v)
    w[2:] = torch.randn(h - 2, v, generator=g) * 0.2
    c = torch.arange(v)
    for m in (0, 1, 2, 3):
        w[:, c % 8 == m] = 0.0
    w[0, c % 8 == 0] = torch.inf
    w[0, c % 8 == 1], w[2, c % 8 == 1] = torch.inf, -torch.inf
    w[1, c % 8 == 3] = -(2.0**-133)
    four = c[(c % 8 == 4) & (c + 1 < v)]
    w[:, four] = w[:, four + 1]
    if all_inf:
        w = torch.zeros(h, v)
        w[0] = torch.inf
    return dict(x=x, gamma=torch.ones(h), w=w.to(torch.bfloat16), eps=1e-5, h_u=h, interleaved=False,
                deferred=True, gemm_order="chain", k=k, nan_fold=nan_fold,
                sp=exchange_params(gbs, seed, k) if sampled else None)


def _with_nan_rows(d):
    x = d["x"].clone()
    x[1, 3] = float("nan")
    return dict(d, x=x)


def exchange_special(fast):
    ck = check_exchange_values
    d = exchange_data(4, 64, 64, 104, False, 21, k=8)
    return [
        Case("+-inf, NaN (folded), +0, -0, ties in the logits; V=104",
             special_logits_data(7, 24, 104, k=8, nan_fold=True), expect=ck),
        Case("the same, V=296 (256 < V, not a multiple), k=9", special_logits_data(8, 16, 296, k=9, nan_fold=True),
             expect=ck),
        Case("no sampling params: NaN unfolded orders by its bits", special_logits_data(9, 12, 104, k=6, nan_fold=False,
                                                                                      sampled=False), expect=ck),
        Case("rows of all +inf / all -inf: m1 = +-inf, S1 = V", special_logits_data(10, 12, 104, k=5, nan_fold=False,
                                                                                    all_inf=True), expect=ck),
        Case("NaN in the logits without nan_fold -> ValueError naming the rows",
             special_logits_data(11, 8, 104, k=5, nan_fold=False), raises=r"NaN in the logits of rows"),
        Case("a NaN hidden lane (nan_fold): an all-NaN row -> ValueError",
             _with_nan_rows(dict(d, nan_fold=True)), raises=r"rows \[1\] are all NaN"),
        Case("k > V -> ValueError", dict(d, k=105), raises=r"k must be"),
    ]


def top_in_one_shard(gbs=8, h=64, v=1000, k=16, seed=31):
    """The global top k + 1 (distinct values) sit in columns 0..k, one shard for every VTP
    <= 8: lane 0 of x is 8, W[0, j] = 2 + (k + 1 - j) / 4 for j <= k and 0 elsewhere, the
    rest N(0, 1/H). A shard list of k keys loses the (k+1)-th (outside), of k - 1 keys the
    k-th candidate."""
    d = exchange_data(gbs, h, h, v, False, seed, k=k)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g)
    x[:, 0] = 8.0
    w = torch.randn(h, v, generator=g) / h**0.5
    w[0] = 0.0
    w[0, :k + 1] = 2.0 + torch.arange(k + 1, 0, -1, dtype=torch.float32) / 4
    return dict(d, x=x, gamma=torch.ones(h), w=w.to(torch.bfloat16))


def ties_everywhere(gbs=8, h=64, v=1000, k=16, seed=32):
    """W holds 6 distinct columns: every logit ties, at the top-k threshold and past slot k."""
    d = exchange_data(gbs, h, h, v, False, seed, k=k)
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(h, 6, generator=g) / h**0.5
    return dict(d, w=base[:, torch.randint(0, 6, (v,), generator=g)].to(torch.bfloat16).contiguous())


def exchange_adversarial(fast):
    bound = lk.gemm_at_bound(dtype=torch.float32, deferred=True, k=16, order=TailConfig.gemm_order)
    bound["sp"] = exchange_params(2, 33, bound["k"])
    return [Case("the top k + 1 in one shard (VTP <= 8), V=1000 k=16", top_in_one_shard()),
            Case("ties everywhere (6 distinct columns), V=1000 k=16", ties_everywhere()),
            Case("amx32 GEMM near its declared bound (H = 2048, V = 24)", bound)]


def exchange_kind() -> Kind:
    return Kind("tail.exchange.candidates", exchange_decl_of, run_exchange, check_exchange,
                {"shapes": exchange_shapes, "random": exchange_random, "special": exchange_special,
                 "adversarial": exchange_adversarial}, take_rows=lk.tail_rows,
                about="decode_tail(exchange='candidates'): == candidates_emulation, VTP-invariant, certified")


# ---------------------------------------------------------------------------------------
# head_input="bf16x2": the logits kinds
# ---------------------------------------------------------------------------------------
def x2_decl_of(data) -> Decl:
    return tail_decl(data["w"].shape[0], True, lk.gemm_order_of(data), "candidates", "bf16x2")


def plain_decl_of(data) -> Decl:
    """Control: the bf16x2 op checked against the one-bf16-input declaration."""
    return tail_decl(data["w"].shape[0], True, lk.gemm_order_of(data), "candidates", "bf16")


def run_x2(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=1, head_input="bf16x2",
                      **dict(lk.tail_kw(data), exchange="candidates"))
    return {"logits": out.logits}


def x2_variant(data, defect=None) -> dict:
    """tail.normed_rows + logits_from with head_input "bf16x2" restated step by step (module
    docstring) with one defect: "emulate" (not a defect: each GEMM by reference.gemm's
    emulation of the order), "lo_dropped" (a_lo = 0: the GEMM of a_hi only), "sum_bf16"
    (acc_hi + acc_lo rounded to bf16), "k_concat" (one GEMM over the 2H lanes [a_hi | a_lo]
    against [W; W]), "amx32_order" (both GEMMs in amx32 whatever the declared order)."""
    x, g, w = data["x"], data["gamma"].reshape(-1), data["w"]
    order = lk.gemm_order_of(data)
    validate_tail_inputs(x, data["gamma"], w, None,
                         TailConfig(eps=data["eps"], hidden_actual=data["h_u"],
                                    zero_interleaved_pad=data["interleaved"], k=1, gemm_order=order,
                                    exchange="candidates", head_input="bf16x2"),
                         vocab_size=w.shape[1])
    h, h_u = x.shape[1], data["h_u"]
    real = pad_mask(h, h_u, data["interleaved"])  # [H]
    zero32, zero16 = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.bfloat16)
    x = torch.where(real, x.to(torch.float32), zero32)
    ssq = sum_squares(x, SSQ_ORDER)  # [gbs]
    t = ssq / torch.tensor(float(h_u), dtype=torch.float32) + torch.tensor(data["eps"], dtype=torch.float32)
    rms = torch.tensor(1.0, dtype=torch.float32) / sqrt_rn32(t)  # [gbs]
    xg = x * g.to(torch.float32)  # [gbs, H] fp32
    hi = xg.to(torch.bfloat16)
    lo = torch.where(torch.isinf(hi), zero32, xg - hi.to(torch.float32)).to(torch.bfloat16)
    if defect == "lo_dropped":
        lo = torch.zeros_like(hi)
    hi, lo = torch.where(real, hi, zero16), torch.where(real, lo, zero16)
    if defect == "k_concat":
        acc = gemm_bf16(torch.cat([hi, lo], 1).contiguous(), torch.cat([w, w], 0).contiguous(), order=order)
    else:
        if defect == "emulate":
            gemm = lk.EMULATIONS[order]
        else:
            gemm = partial(gemm_bf16, order="amx32" if defect == "amx32_order" else order)
        acc = gemm(hi, w) + gemm(lo, w)  # [gbs, V] fp32: acc_hi + acc_lo
    if defect == "sum_bf16":
        acc = acc.to(torch.bfloat16).to(torch.float32)
    return {"logits": acc * rms[:, None]}


def _x2_gen(gen, order):
    return lambda fast: [replace(c, data=dict(c.data, gemm_order=order, head_input="bf16x2")) for c in gen(fast)]


def x2_kind(name, order) -> Kind:
    kw = dict(dtype=torch.float32, deferred=True)
    gens = {"shapes": partial(lk.tail_shapes, **kw), "random": partial(lk.tail_random, **kw),
            "special": partial(lk.tail_special, **kw),
            "adversarial": partial(lk.tail_adversarial, gemm_order=order, **kw)}
    return Kind(name, x2_decl_of, run_x2, lk.check_logits, {g: _x2_gen(f, order) for g, f in gens.items()},
                take_rows=lk.tail_rows, emulate=partial(x2_variant, defect="emulate"),
                about=f"decode_tail(head_input='bf16x2') logits, gemm_order={order!r}: in the two-GEMM range")


X2 = "tail.logits.deferred.fp32"


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def exchange_kinds() -> list[Kind]:
    return [exchange_kind(), x2_kind(f"{X2}.bf16x2", "amx32"), x2_kind(f"{X2}.chain.bf16x2", "chain"),
            x2_kind(f"{X2}.dp32.bf16x2", "dp32")]


def exchange_controls() -> list[Control]:
    ev = lambda defect: partial(exchange_variant, defect=defect)  # noqa: E731
    xv = lambda defect: partial(x2_variant, defect=defect)  # noqa: E731
    ex = "tail.exchange.candidates"
    return [
        Control("tail.exchange.chunks_move_with_vtp", ex, "random",
                "each shard cuts its V_s into C/VTP chunks of ceil width: edges move with VTP", ev("chunks_move")),
        Control("tail.exchange.keys_k_minus_1", ex, "adversarial", "each shard sends k - 1 keys, not k + 1",
                ev("keys_k_minus_1")),
        Control("tail.exchange.keys_k", ex, "adversarial", "each shard sends k keys, not k + 1 (the outside lane lost)",
                ev("keys_k")),
        Control("tail.exchange.combine_out_of_order", ex, "random",
                "chunk terms combined in the (2,4) hops' transposed slab order", ev("combine_out_of_order")),
        Control("tail.exchange.decl_half_depth", ex, "adversarial",
                "the real op, its sums declared half as deep", decl=half_depth(exchange_decl_of)),
        Control("tail.bf16x2.lo_dropped", f"{X2}.bf16x2", "random", "a_lo dropped: the GEMM of a_hi only",
                xv("lo_dropped")),
        Control("tail.bf16x2.sum_bf16", f"{X2}.bf16x2", "random", "acc_hi + acc_lo rounded to bf16", xv("sum_bf16")),
        Control("tail.bf16x2.k_concat", f"{X2}.bf16x2", "emulate",
                "one GEMM over a_hi and a_lo side by side (2H lanes)", xv("k_concat")),
        Control("tail.bf16x2.plain_decl", f"{X2}.bf16x2", "random",
                "the real op under the one-bf16-input declaration (no a_lo point)", decl=plain_decl_of),
        Control("tail.bf16x2.decl_half_depth", f"{X2}.bf16x2", "adversarial",
                "the real op, its sums declared half as deep", decl=half_depth(x2_decl_of)),
        Control("tail.bf16x2.chain.amx32_order", f"{X2}.chain.bf16x2", "emulate",
                "both GEMMs in amx32 posing as the chain", xv("amx32_order")),
        Control("tail.bf16x2.chain.decl_half_depth", f"{X2}.chain.bf16x2", "adversarial",
                "the real op in the chain order, half-depth declaration", decl=half_depth(x2_decl_of)),
        Control("tail.bf16x2.dp32.amx32_order", f"{X2}.dp32.bf16x2", "emulate",
                "both GEMMs in amx32 posing as dp32", xv("amx32_order")),
        Control("tail.bf16x2.dp32.decl_half_depth", f"{X2}.dp32.bf16x2", "adversarial",
                "the real op in the dp32 order, half-depth declaration", decl=half_depth(x2_decl_of)),
    ]
