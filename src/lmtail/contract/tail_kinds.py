"""The decode tail's contract kinds and planted controls (docs/contract.md).

Kinds (op x variant x dtype), each run through gates 1-4 and the byte gates:
  tail.logits.deferred.fp32   decode_tail logits, deferred_rms=True, fp32 hidden
  tail.logits.legacy.fp32     deferred_rms=False: a = bf16((x*rms)*gamma)
  tail.logits.deferred.fp16   fp16 hidden: in range AND the bytes of the widened fp32 run
  tail.logits.deferred.bf16   bf16 hidden: the same
  tail.logits.*.fp32.chain    deferred and legacy with gemm_order="chain" (the others run
                              TailConfig's default order, amx32)
  tail.logits.*.fp32.dp32     deferred and legacy with gemm_order="dp32"
  tail.mirror.bf16            the bf16 mirror: top-k of decode_tail == exact top-k of
                              bf16(its own fp32 logits), values and ids
  tail.topk.exact             exact_topk == reference.tail.topk_ref, exactly
  tail.sampler                rows_tail's tokens/truncated/logprobs vs the float64 sampler
                              (reference.contract.sample_decision); near-ties counted; the
                              emulate gate also compares the fused kernel's own float64 S1,
                              lse1 and nz (its debug_mass export) with the declared mass
                              (reference.tail.mass_emulation) bit for bit
  tail.decode                 decode_tail end to end; tokens certified against the float64
                              ideal logits (certify.certify_tail); the ranks gate runs here

Data dicts ("tail data"): x [gbs, H] fp32|fp16|bf16, gamma [H] fp32, w [H, V] bf16, eps,
h_u, interleaved, deferred, gemm_order (absent: TailConfig's default) (+ k, sp [R, 5] fp32,
nan_fold for the mirror/decode kinds);
"rows data": rows [R, V] bf16, k, chunk, nan_fold (+ sp, exact for the sampler).

Controls are the same bodies as the real ops with ONE defect each (`logits_variant`,
`sampler_variant`, ...; defect=None reproduces the real op byte for byte, which the tests
assert), so a red control shows the gate sees that defect and nothing else; one control
keeps the real op and plants a declaration shallower than the code runs (`shallow_decl`).

Checks take (data, out, run, decl): the ranges come from decl (the harness passes
decl(data), the kind's declaration unless a control replaces it).

Shape legend: gbs rows, H hidden (padded), H_u real hidden, V vocab, R rows, k candidates.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from ..kernels.tail.rows_tail import rows_tail_decl
from ..numerics import Decl
from ..tail.compose import decode_tail
from ..tail.config import TailConfig
from ..tail.topk import exact_topk_decl
from .harness import Case, Control, Kind, Verdict
from .logits_kinds import (SHAPES, check_logits, check_mirror, emulate_logits, logits_variant, mirror_variant,
    run_logits, run_mirror, shallow_decl, tail_adversarial, tail_data, tail_decl_of, tail_kw, tail_random, tail_rows,
    tail_shapes, tail_special)
from .sampler_kinds import (check_sampler, check_topk, emulate_row_mass, emulate_sampler, mass_kind, random_params,
    run_sampler, run_topk, sampler_adversarial, sampler_bytes, sampler_mass_lanes_128, sampler_random,
    sampler_shapes, sampler_special, sampler_variant, sampler_verdict, take_rows_rows, topk_adversarial, topk_random,
    topk_shapes, topk_special, topk_variant)


# ---------------------------------------------------------------------------------------
# decode_tail end to end (certified tokens; the ranks gate)
# ---------------------------------------------------------------------------------------
def decode_data(gbs, h, h_u, v, interleaved, seed, *, k=32, scale=1.0):
    return tail_data(gbs, h, h_u, v, interleaved, seed, scale=scale, k=k, sp=random_params(gbs, seed, min(k, v)))


def run_decode(data) -> dict:
    out = decode_tail(data["x"], data["gamma"], data["w"], k=data["k"], sampling_params=data["sp"],
                      nan_fold=data["nan_fold"], **tail_kw(data))
    return {f: getattr(out, f) for f in ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")}


def check_decode(data, out, run, decl) -> Verdict:
    """mirror check (range + exact top-k of bf16(logits)) + the sampler on its own mirror
    rows (exact float64 decisions) + certification against the float64 ideal logits."""
    from .certify import certify_tail

    v = check_mirror(data, out, run, decl)
    if not v.ok:
        return v
    s = sampler_verdict(out["logits"].to(torch.bfloat16), data["sp"], data["k"], data["nan_fold"], out)
    if not s.ok:
        return Verdict(False, v.margin, "sampler on the mirror: " + s.detail)
    c = certify_tail(data["x"], data["gamma"], data["w"], out, sampling_params=data["sp"], eps=data["eps"],
                     hidden_actual=data["h_u"], interleaved=data["interleaved"], deferred_rms=data["deferred"],
                     k=data["k"], decl=decl)
    counts = {"certified": c["certified"], "near_ties": c["near_ties"], "truncated": c["truncated"]}
    if c["mismatched"]:
        return Verdict(False, v.margin, f"certified decision differs from float64: {c['mismatches'][0]}", counts)
    return Verdict(True, v.margin, f"{v.detail}; certified {c['matched']}/{c['certified']} match, "
                   f"{c['near_ties']} near-ties", counts)


def decode_shapes(fast):
    return [Case(f"{gbs}x{h} (H_u={hu}) V={v}", decode_data(gbs, h, hu, v, il, 500 + i))
            for i, (gbs, h, hu, v, il) in enumerate(SHAPES) if gbs * v <= 20000]


def decode_random(fast):
    return [Case(f"seed {s}", decode_data(8, 256, 240, 1024, True, s, scale=(1.0, 3.0, 0.3, 1.0)[s % 4]))
            for s in range(2 if fast else 4)]


def decode_temperature_ignored(data) -> dict:
    """Control: the sampler runs at T = 1 whatever the request says (greedy kept)."""
    sp = data["sp"].clone()
    sp[:, 2] = torch.where(sp[:, 2] >= 1e-5, torch.ones_like(sp[:, 2]), sp[:, 2])
    return run_decode(dict(data, sp=sp))


# ---------------------------------------------------------------------------------------
# the ranks gate: decode_tail over 2, 4 (or 8) gloo ranks vs one rank
# ---------------------------------------------------------------------------------------
def rank_layouts(world: int):
    """(label, vtp, hops, batch_groups, fence) run inside one launch of `world` ranks
    (vtp < world: on subgroups of consecutive ranks)."""
    out = [("vtp2", 2, (2,), 1, False), ("vtp2 G=2", 2, (2,), 2, False)]
    if world >= 4:
        out += [("vtp4", 4, (4,), 1, False), ("vtp4 hops=(2,2)", 4, (2, 2), 1, False),
                ("vtp4 G=2 fence", 4, (4,), 2, True)]
    if world >= 8:
        out += [("vtp8", 8, (8,), 1, False), ("vtp8 hops=(2,4)", 8, (2, 4), 1, False),
                ("vtp8 hops=(2,2,2)", 8, (2, 2, 2), 1, False)]
    return [lay for lay in out if lay[1] <= world]


def _rank_fn(rank, data, world):
    """Runs in a spawned rank: every layout, on subgroups when vtp < world. Returns
    [(label, rank-in-group, owned rows, outputs)] for the ranks of group 0."""
    import torch.distributed as dist

    from ..tail.layout import owned_rows

    torch.set_num_threads(1)
    res, made = [], {}
    for label, vtp, hops, g, fence in rank_layouts(world):
        if vtp not in made:  # every rank creates every group, in the same order
            made[vtp] = [dist.new_group(list(range(s, s + vtp))) for s in range(0, world, vtp)]
        grp, sub = made[vtp][rank // vtp], rank % vtp
        rows = owned_rows(sub, vtp, data["x"].shape[0], hops, g)
        vs = data["w"].shape[1] // vtp
        out = decode_tail(data["x"], data["gamma"], data["w"][:, sub * vs:(sub + 1) * vs].contiguous(),
                          k=data["k"], sampling_params=data["sp"][rows], nan_fold=data["nan_fold"], group=grp,
                          hops=hops, batch_groups=g, fence=fence, **tail_kw(data))
        if rank < vtp:
            res.append((label, sub, rows, {f: getattr(out, f) for f in
                                           ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")}))
    return res


def assemble(per_rank, gbs, *, shift=0):
    """Global-row outputs from the ranks' owned rows (shift != 0: the ownership map off by
    that many rows, a planted control); logits: the column shards in rank order."""
    by_label = {}
    for label, sub, rows, out in per_rank:
        by_label.setdefault(label, []).append((sub, rows, out))
    result = []
    for label, parts in by_label.items():
        parts.sort(key=lambda p: p[0])
        glob = {"logits": torch.cat([p[2]["logits"] for p in parts], 1)}
        for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
            t = parts[0][2][f]
            full = torch.empty((gbs,) + tuple(t.shape[1:]), dtype=t.dtype)
            for _, rows, out in parts:
                full[[(r + shift) % gbs for r in rows]] = out[f]
            glob[f] = full
        result.append((label, glob))
    return result


class RankRuns:
    """launch() once per problem and world size; both the kind and its ownership control
    read the same rank outputs (the control differs only in how it assembles them)."""

    def __init__(self):
        self._cache = {}

    def per_rank(self, data, world):
        from ..launch import launch

        key = (world, data["x"].numpy().tobytes(), data["sp"].numpy().tobytes())
        if key not in self._cache:
            res = launch(_rank_fn, world, args=(data, world), timeout_s=300.0, threads=1)
            self._cache[key] = [item for rank_res in res for item in rank_res]
        return self._cache[key]

    def gate(self, data, world, run, *, shift=0):
        return assemble(self.per_rank(data, world), data["x"].shape[0], shift=shift)


# ---------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------
def in_order(gen, order):
    """The cases of generator `gen` with the tail's GEMM in `order` (data["gemm_order"])."""
    return lambda fast: [replace(c, data=dict(c.data, gemm_order=order)) for c in gen(fast)]


def _logits_kind(name, *, dtype, deferred, about, order=TailConfig.gemm_order):
    kw = dict(dtype=dtype, deferred=deferred)
    gens = {"shapes": partial(tail_shapes, **kw), "random": partial(tail_random, **kw),
            "special": partial(tail_special, **kw), "adversarial": partial(tail_adversarial, gemm_order=order, **kw)}
    return Kind(name, tail_decl_of, run_logits, check_logits, {g: in_order(f, order) for g, f in gens.items()},
                take_rows=tail_rows, emulate=emulate_logits, about=about)


def _mirror_decl(data) -> Decl:
    d = tail_decl_of(data)
    return Decl("decode_tail mirror + exact_topk", d.rounding_points + ("top-k: exact, no rounding",), d.sums)


def _sampler_decl(data) -> Decl:
    """The sampler's declaration is the op's own: kernels.tail.rows_tail.rows_tail_decl(V, k)."""
    return rows_tail_decl(data["rows"].shape[1], data["k"])


def tail_kinds(ranks: RankRuns | None = None) -> list[Kind]:
    ranks = ranks or RankRuns()
    mirror_kw = dict(k=64, check=check_mirror)
    return [
        _logits_kind("tail.logits.deferred.fp32", dtype=torch.float32, deferred=True,
                     about="decode_tail logits, deferred rms, fp32 hidden"),
        _logits_kind("tail.logits.legacy.fp32", dtype=torch.float32, deferred=False,
                     about="decode_tail logits, a = bf16((x*rms)*gamma)"),
        _logits_kind("tail.logits.deferred.fp16", dtype=torch.float16, deferred=True,
                     about="fp16 hidden: in range and the widened fp32 run's bytes"),
        _logits_kind("tail.logits.deferred.bf16", dtype=torch.bfloat16, deferred=True,
                     about="bf16 hidden: in range and the widened fp32 run's bytes"),
        _logits_kind("tail.logits.deferred.fp32.chain", dtype=torch.float32, deferred=True, order="chain",
                     about="decode_tail logits, deferred rms, gemm_order='chain'"),
        _logits_kind("tail.logits.legacy.fp32.chain", dtype=torch.float32, deferred=False, order="chain",
                     about="decode_tail logits, legacy rms, gemm_order='chain'"),
        _logits_kind("tail.logits.deferred.fp32.dp32", dtype=torch.float32, deferred=True, order="dp32",
                     about="decode_tail logits, deferred rms, gemm_order='dp32'"),
        _logits_kind("tail.logits.legacy.fp32.dp32", dtype=torch.float32, deferred=False, order="dp32",
                     about="decode_tail logits, legacy rms, gemm_order='dp32'"),
        Kind("tail.mirror.bf16", _mirror_decl, run_mirror, check_mirror,
             {"shapes": partial(tail_shapes, k=64), "random": partial(tail_random, k=64, v=4096),
              "special": partial(tail_special, **mirror_kw), "adversarial": partial(tail_adversarial, **mirror_kw)},
             take_rows=tail_rows, about="top-k of decode_tail == exact top-k of bf16(its logits)"),
        Kind("tail.topk.exact", lambda d: exact_topk_decl(), run_topk, check_topk,
             {"shapes": topk_shapes, "random": topk_random, "special": topk_special, "adversarial": topk_adversarial},
             take_rows=take_rows_rows, about="== topk_ref exactly (ties to the lower id)"),
        Kind("tail.sampler", _sampler_decl, run_sampler, check_sampler,
             {"shapes": sampler_shapes, "random": sampler_random, "special": sampler_special,
              "adversarial": sampler_adversarial, "bytes": sampler_bytes},
             take_rows=take_rows_rows, emulate=emulate_sampler,
             about="tokens vs the float64 sampler where the margin is clear; logprob bytes vs the declared mass"),
        mass_kind(),
        Kind("tail.decode", tail_decl_of, run_decode, check_decode,
             {"shapes": decode_shapes, "random": decode_random}, take_rows=tail_rows, ranks=ranks.gate,
             about="decode_tail end to end; tokens certified against float64 ideal logits"),
    ]


def tail_controls(ranks: RankRuns | None = None) -> list[Control]:
    ranks = ranks or RankRuns()
    lv = lambda defect: partial(logits_variant, defect=defect)  # noqa: E731
    d32 = "tail.logits.deferred.fp32"
    return [
        Control("tail.fp16_accum", d32, "adversarial", "GEMM chain accumulated in fp16", lv("fp16_accum")),
        Control("tail.gemm_other_order", d32, "emulate", "the chain GEMM posing as amx32", lv("other_order")),
        Control("tail.chain.gemm_other_order", f"{d32}.chain", "emulate", "the amx32 GEMM posing as the chain",
                lv("other_order")),
        Control("tail.chain.legacy_other_order", "tail.logits.legacy.fp32.chain", "emulate",
                "legacy kind: the amx32 GEMM posing as the chain", lv("other_order")),
        Control("tail.chain.decl_half_depth", f"{d32}.chain", "adversarial",
                "the real op in the chain order, its sums declared half as deep", decl=shallow_decl),
        Control("tail.dp32.gemm_amx32_order", f"{d32}.dp32", "emulate", "the amx32 GEMM posing as dp32",
                lv("amx32_order")),
        Control("tail.dp32.legacy_amx32_order", "tail.logits.legacy.fp32.dp32", "emulate",
                "legacy kind: the amx32 GEMM posing as dp32", lv("amx32_order")),
        Control("tail.dp32.decl_half_depth", f"{d32}.dp32", "adversarial",
                "the real op in the dp32 order, its sums declared half as deep", decl=shallow_decl),
        Control("tail.decl_half_depth", d32, "adversarial",
                "the real op, its sums declared half as deep as it runs them", decl=shallow_decl),
        Control("tail.eps_dropped", d32, "special", "rms = 1/sqrt(ssq/H_u), no eps", lv("eps_dropped")),
        Control("tail.mean_over_H", d32, "shapes", "ssq divided by H instead of H_u", lv("mean_over_H")),
        Control("tail.pad_not_zeroed", d32, "shapes", "pad lanes enter ssq and the GEMM", lv("pad_not_zeroed")),
        Control("tail.row_mixing", d32, "batch", "ssq += 2^-12 * the next row's ssq", lv("row_mixing")),
        Control("tail.splitk_threads", d32, "threads", "GEMM split-K over the thread count", lv("splitk_threads")),
        Control("tail.shuffled_order", d32, "repeat", "GEMM summed in a fresh order each call", lv("shuffled_order")),
        Control("tail.rms_after_round", "tail.logits.legacy.fp32", "random",
                "legacy kind computed the deferred way (rms after the bf16 rounding)", lv("rms_after_round")),
        Control("tail.fp16_narrowed", "tail.logits.deferred.fp16", "random",
                "fp16 hidden multiplied by gamma in fp16 before widening", lv("fp16_narrowed")),
        Control("tail.mirror_skipped", "tail.mirror.bf16", "random",
                "fp32 logits carried and ranked instead of the bf16 mirror", partial(mirror_variant, defect="mirror_skipped")),
        Control("tail.ties_higher_id", "tail.topk.exact", "random", "equal values ranked by the higher id",
                partial(topk_variant, defect="ties_higher_id")),
        Control("tail.stage1_short", "tail.topk.exact", "adversarial", "stage 1 keeps k/2 per chunk",
                partial(topk_variant, defect="stage1_short")),
        Control("tail.topp_drops_crossing", "tail.sampler", "adversarial",
                "top-p keeps mass-including-i < top_p (drops the crossing token)",
                partial(sampler_variant, defect="topp_drops_crossing")),
        Control("tail.greedy_1e-3", "tail.sampler", "special", "temperature < 1e-3 treated as greedy",
                partial(sampler_variant, defect="greedy_1e-3")),
        Control("tail.sampler.mass_lanes_128", "tail.sampler", "emulate",
                "the full-row mass in 128 lane chains (the logprob shows it)", sampler_mass_lanes_128),
        Control("tail.row_mass.lanes_128", "tail.row_mass", "emulate", "sum64 in 128 lane chains",
                partial(emulate_row_mass, lanes=128)),
        Control("tail.row_mass.exp_libm", "tail.row_mass", "emulate", "the terms by libm exp (in range, not the order)",
                partial(emulate_row_mass, exp=torch.exp)),
        Control("tail.temperature_ignored", "tail.decode", "random", "the sampler always runs at T = 1",
                decode_temperature_ignored),
        Control("tail.ownership_off_by_one", "tail.decode", "ranks", "rank outputs assembled one row off",
                ranks=partial(ranks.gate, shift=1)),
    ]
