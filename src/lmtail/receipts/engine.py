"""A receipt: run named tail arms on SmolLM2's hidden states of public texts, measure each
against a float64 reference of the tail on the same hidden states, and compare arms paired.

Rows of one passage (token ids t_0 .. t_{P+N}):
    positions 0 .. P-1              the fixed prefix (context, never scored)
    positions P .. P+N-D-1          "prompt" rows: hidden states from ONE prefill of t_0..t_{P+N-D-1}
    positions P+N-D .. P+N-1        "decode" rows: one decode step each on the KV cache
Row at position s predicts t_{s+1} (teacher forced). The body is the model's fp32 forward
(model.llama.FP32_OPS), the same for every arm; arms differ only in the tail. The float64
reference is lmtail.reference.tail.logits_ref of those hidden states.

Certification (certify_table): for each declaration (exchange, head_input) of CERT_DECLS,
the argmax and top-CERT_K set decisions of every scored row are certified against float64
(contract.certify.certify_rows on reference.contract.ideal_bound's (ref, delta), the
reference computed once per block of CERT_BLOCK rows) and the certified ones are checked
against the op (decode_tail with that exchange and head_input).

Shape legend: N scored rows of a passage, H hidden, V vocab, k candidates; "all rows"
arrays are [n]; a certification block is [B] rows (B <= CERT_BLOCK).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..reference.tail import as_np, logits_range, logits_ref, mirror_range
from . import stats
from .arms import ArmRegistry, TailInputs
from .metrics import METRICS, ref_row_stats, ref_rows, row_metrics
from .texts import Passage


@dataclass(frozen=True)
class Comparison:
    """arm vs base on the same rows, with `placebo` vs base beside it as the yardstick."""

    arm: str
    base: str
    placebo: str | None = None


@dataclass(frozen=True)
class ReceiptSpec:
    """What a receipt runs (everything the result depends on)."""

    arms: tuple[str, ...]
    comparisons: tuple[Comparison, ...]
    base: str = "chain"  # the NLL table's paired base
    prefix: int = 16  # P
    rows: int = 32  # N scored rows per passage
    decode_rows: int = 16  # D of the N run as decode steps
    block: int = 8  # rows per cluster for the standard errors
    certify: bool = True  # the certification section (certify_table)

    def __post_init__(self):
        if self.prefix < 1:
            raise ValueError(f"prefix must be >= 1; got {self.prefix}")
        if self.rows < 2:
            raise ValueError(f"rows must be >= 2; got {self.rows}")
        if not 0 <= self.decode_rows <= self.rows:
            raise ValueError(f"decode_rows must be in [0, rows={self.rows}]; got {self.decode_rows}")
        if self.block < 1:
            raise ValueError(f"block must be >= 1; got {self.block}")
        for c in self.comparisons:
            for name in (c.arm, c.base, c.placebo):
                if name is not None and name not in self.arms:
                    raise ValueError(f"comparison {c.arm} vs {c.base} names arm {name!r}, not among {self.arms}")
        if self.base not in self.arms:
            raise ValueError(f"base must be one of the arms {self.arms}; got {self.base!r}")


@dataclass
class RowTable:
    """Per-row results of a receipt, all rows of all passages in order."""

    passage: list[int] = field(default_factory=list)  # [n] passage index
    kind: list[str] = field(default_factory=list)  # [n] "prompt" | "decode"
    position: list[int] = field(default_factory=list)  # [n]
    ref: dict = field(default_factory=lambda: {"nll": [], "margin": []})
    arms: dict = field(default_factory=dict)  # arm -> metric -> list of [N] arrays
    body: list = field(default_factory=list)  # per passage [N, V] float64 fp32-body logits (keep_body)
    hidden: list = field(default_factory=list)  # per passage [N, H] fp32 pre-final-norm hidden states

    def column(self, arm: str, metric: str) -> np.ndarray:
        return np.concatenate(self.arms[arm][metric])


def passage_hidden(bundle, ids, spec: ReceiptSpec):
    """A passage's scored rows: pre-final-norm hidden h [N, H] fp32, the fp32 body's
    final-normed y [N, H], targets [N] int64 and kinds [N] ("prompt" | "decode")."""
    from ..model.llama import forward, new_cache  # lazy: the model is optional for the stats

    p, n, d = spec.prefix, spec.rows, spec.decode_rows
    ids = torch.as_tensor(ids[: p + n + 1], dtype=torch.int64)
    if ids.shape[0] < p + n + 1:
        raise ValueError(f"passage needs prefix + rows + 1 = {p + n + 1} tokens; got {ids.shape[0]}")
    cache = new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=p + n)
    h, y = forward(bundle, ids[None, : p + n - d], cache)  # [1, P+N-D, H] each
    hs, ys = [h[0, p:]], [y[0, p:]]
    for s in range(p + n - d, p + n):
        h, y = forward(bundle, ids[None, s : s + 1], cache)  # [1, 1, H] each
        hs.append(h[0])
        ys.append(y[0])
    kinds = ["prompt"] * (n - d) + ["decode"] * d
    return torch.cat(hs), torch.cat(ys), ids[p + 1 : p + n + 1].numpy(), kinds


def run_rows(bundle, passages: list[Passage], spec: ReceiptSpec, registry: ArmRegistry, *, progress=None,
             keep_body: bool = False, hidden=passage_hidden) -> RowTable:
    """Every arm on every passage's rows; progress(step_name) is called once per step.
    bundle: final_norm [H] fp32, lm_head_weight_t [H, V] bf16, config.eps (and embed for
    keep_body). hidden(bundle, ids, spec) -> (h, y, targets, kinds) as passage_hidden.
    keep_body: also keep the fp32 body's logits y @ embed.T [N, V] float64 per passage."""
    table = RowTable(arms={a: {m: [] for m in METRICS} for a in spec.arms})
    arms = [registry.get(a) for a in spec.arms]
    scratch: dict = {}
    gamma, weight, eps = bundle.final_norm, bundle.lm_head_weight_t, bundle.config.eps
    for pi, psg in enumerate(passages):
        h, y, targets, kinds = hidden(bundle, psg.ids, spec)
        table.hidden.append(h.to(torch.float32))
        if keep_body:
            table.body.append((y @ bundle.embed.T).double().numpy())  # model.llama.logits_fp32
        if progress:
            progress(f"{psg.name}: forward")
        ref = ref_rows(logits_ref(h, gamma, weight, eps=eps, interleaved=False))  # [N, V] float64
        for k, v in ref_row_stats(ref, targets).items():
            table.ref[k].append(v)
        inp = TailInputs(h, gamma, weight, eps, scratch)
        for arm in arms:
            for k, v in row_metrics(arm.fn(inp), ref, targets).items():
                table.arms[arm.name][k].append(v)
        table.passage += [pi] * len(kinds)
        table.kind += kinds
        table.position += list(range(spec.prefix, spec.prefix + spec.rows))
        if progress:
            progress(f"{psg.name}: arms")
    return table


# ---------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------
def arm_summary(table: RowTable, arm: str, mask: np.ndarray, clusters: np.ndarray) -> dict:
    """Distance to float64 and NLL of one arm over the rows in mask [n] bool."""
    col = {m: table.column(arm, m)[mask] for m in METRICS}
    w = int(np.argmax(col["worst"]))
    idx = np.flatnonzero(mask)[w]
    nll = stats.paired_mean_se(col["nll"], clusters[mask])
    return {"rows": int(mask.sum()), "rel_l2": float(col["rel_l2"].mean()), "argmax_agree": float(col["hit"].mean()),
            "misses": int((~col["hit"]).sum()), "kl": float(col["kl"].mean()),
            "worst": float(col["worst"][w]), "worst_at": {"passage": int(table.passage[idx]),
                                                         "position": int(table.position[idx]),
                                                         "column": int(col["worst_col"][w])},
            "nll": nll.mean, "nll_se": nll.se}


def paired(table: RowTable, a: str, b: str, metric: str, mask, clusters) -> stats.Paired:
    """metric(a) - metric(b) per row over mask, cluster-robust se."""
    return stats.paired_mean_se(table.column(a, metric)[mask] - table.column(b, metric)[mask], clusters[mask])


def compare(table: RowTable, comp: Comparison, classes: dict, clusters) -> dict:
    """One comparison: overall paired rel-L2 / KL / NLL, McNemar, per-class tests with Holm,
    the placebo's numbers beside, and the verdict (stats.VERDICT_RULE)."""
    every = np.ones(len(table.passage), dtype=bool)
    overall = {m: paired(table, comp.arm, comp.base, m, every, clusters) for m in ("rel_l2", "kl")}
    nll = paired(table, comp.arm, comp.base, "nll", every, clusters)
    mc = stats.mcnemar_exact(table.column(comp.base, "hit"), table.column(comp.arm, "hit"))
    plac = ({m: paired(table, comp.placebo, comp.base, m, every, clusters) for m in ("rel_l2", "kl", "nll")}
            if comp.placebo else None)
    plac_mc = (stats.mcnemar_exact(table.column(comp.base, "hit"), table.column(comp.placebo, "hit"))
               if comp.placebo else None)
    tests = [(cls, m, paired(table, comp.arm, comp.base, m, mask, clusters))
             for cls, mask in classes.items() for m in ("rel_l2", "kl")]
    adj = stats.holm([t[2].p for t in tests])
    class_tests = [(cls, m, pr, float(p)) for (cls, m, pr), p in zip(tests, adj)]
    plac_cls = {cls: paired(table, comp.placebo, comp.base, "rel_l2", mask, clusters)
                for cls, mask in classes.items()} if comp.placebo else {}
    verdict, reasons = stats.judge(overall, plac, mc, class_tests)
    return {"arm": comp.arm, "base": comp.base, "placebo": comp.placebo, "overall": overall, "nll": nll,
            "mcnemar": mc, "placebo_overall": plac, "placebo_mcnemar": plac_mc, "classes": class_tests,
            "placebo_classes": plac_cls, "verdict": verdict, "reasons": reasons}


def analyse(table: RowTable, passages: list[Passage], spec: ReceiptSpec) -> dict:
    """Summaries per arm (per passage and overall), NLL vs the base, and every comparison."""
    pas = np.asarray(table.passage)
    kind = np.asarray(table.kind)
    clusters = stats.cluster_ids(pas, spec.block)
    classes = {p.name: pas == i for i, p in enumerate(passages)}
    classes.update({k: kind == k for k in ("prompt", "decode") if (kind == k).any()})
    every = np.ones(pas.shape[0], dtype=bool)
    scopes = {"all": every, **{p.name: pas == i for i, p in enumerate(passages)}}
    summary = {a: {s: arm_summary(table, a, m, clusters) for s, m in scopes.items()} for a in spec.arms}
    ref_nll = np.concatenate(table.ref["nll"])
    ref = {s: stats.paired_mean_se(ref_nll[m], clusters[m]) for s, m in scopes.items()}
    nll_vs_base = {a: {s: paired(table, a, spec.base, "nll", m, clusters) for s, m in scopes.items()}
                   for a in spec.arms if a != spec.base}
    comps = [compare(table, c, classes, clusters) for c in spec.comparisons]
    margins = np.concatenate(table.ref["margin"])
    miss_margin = {a: float(margins[~table.column(a, "hit")].max()) if (~table.column(a, "hit")).any() else None
                   for a in spec.arms}
    return {"summary": summary, "ref_nll": ref, "nll_vs_base": nll_vs_base, "comparisons": comps,
            "miss_margin_max": miss_margin, "clusters": int(clusters.max()) + 1, "rows": int(pas.shape[0])}


# ---------------------------------------------------------------------------------------
# certification: the tail's decisions on every scored row against float64
# ---------------------------------------------------------------------------------------
CERT_DECLS = (("mirror", "bf16"), ("candidates", "bf16"), ("candidates", "bf16x2"))  # (exchange, head_input)
CERT_K = 256  # the top-k set decision's k (min(CERT_K, V))
CERT_BLOCK = 320  # rows per certification block (ref + one delta per declaration: 4 x B x V float64)
MAX_LISTED = 20  # near-tie rows and mismatches listed per declaration


def tail_topk(hidden, gamma, weight, eps, *, exchange: str, head_input: str, k: int) -> torch.Tensor:
    """The op whose decisions are certified: decode_tail(hidden [B, H] fp32, gamma [H],
    weight [H, V] bf16, eps, zero_interleaved_pad=False, k, exchange, head_input, its default
    gemm_order).topk_indices [B, k] int64 (descending, the first is the argmax)."""
    from ..tail.compose import decode_tail

    return decode_tail(hidden, gamma, weight, eps=eps, zero_interleaved_pad=False, k=k, exchange=exchange,
                       head_input=head_input, emit_logits=False).topk_indices


def _range_key(decl):
    """Declarations that differ only in a "mirror:" rounding point share logits_range."""
    return tuple(p for p in decl.rounding_points if not p.startswith("mirror:")), decl.sums


def ideal_bounds(hidden, gamma, weight, *, eps, decls, col_chunk: int = 8192):
    """(ref [B, V], [delta [B, V] per decl]) float64: reference.contract.ideal_bound's values
    for each declaration in decls (single rank, interleaved=False, deferred rms), with ref
    computed once and logits_range once per group of declarations that differ only in the
    mirror rounding point (the mirror exchange's delta is the same range rounded outward to
    bf16). Equal to ideal_bound's arrays bit for bit (tested)."""
    w64 = as_np(weight)  # [H, V]
    ref = logits_ref(hidden, gamma, w64, eps=eps, interleaved=False)
    deltas = [np.empty_like(ref) for _ in decls]
    groups: dict = {}
    for i, d in enumerate(decls):
        groups.setdefault(_range_key(d), []).append(i)
    for c0 in range(0, w64.shape[1], col_chunk):
        sl = slice(c0, c0 + col_chunk)
        for idx in groups.values():
            lo, hi = logits_range(hidden, gamma, w64[:, sl], eps=eps, decl=decls[idx[0]], interleaved=False)
            for i in idx:
                mirror = any(p.startswith("mirror:") for p in decls[i].rounding_points)
                low, up = mirror_range(lo, hi) if mirror else (lo, hi)
                deltas[i][:, sl] = np.maximum(np.maximum(up - ref[:, sl], ref[:, sl] - low), 0.0)
    return ref, deltas


def certify_table(table: RowTable, bundle, passages: list[Passage], *, op=tail_topk, progress=None,
                  block: int = CERT_BLOCK) -> dict:
    """Certify every scored row's argmax and top-k set decisions for each declaration of
    CERT_DECLS (module docstring). bundle: final_norm [H], lm_head_weight_t [H, V] bf16,
    config.eps. op(hidden [B, H], gamma, weight, eps, exchange=, head_input=, k=) ->
    topk_indices [B, k] int64 (default tail_topk; tests plant a wrong one).
    Returns {"k", "rows", "declarations": [{exchange, head_input, decl, argmax, topk,
    near_tie_rows, mismatches, ok}]}: argmax / topk are {certified, matched, mismatched,
    near_ties, worst_margin (min float64 gap / bound; > 1 certified)}; near_tie_rows (argmax,
    the first MAX_LISTED) and mismatches name {passage, position, kind}."""
    from ..contract.certify import certify_rows
    from ..tail.compose import tail_decl

    gamma, weight, eps = bundle.final_norm, bundle.lm_head_weight_t, bundle.config.eps
    h_all = torch.cat(table.hidden)  # [n, H]
    n, hid = h_all.shape
    k = min(CERT_K, weight.shape[1])
    decls = [tail_decl(hid, True, exchange=ex, head_input=hi) for ex, hi in CERT_DECLS]
    acc = [{"exchange": ex, "head_input": hi, "decl": d.op,
            **{dec: dict(certified=0, matched=0, mismatched=0, near_ties=0, worst_margin=float("inf"))
               for dec in ("argmax", "topk")}, "near_tie_rows": [], "mismatches": []}
           for (ex, hi), d in zip(CERT_DECLS, decls)]

    def where(i: int) -> dict:
        return {"passage": passages[table.passage[i]].name, "position": int(table.position[i]),
                "kind": table.kind[i]}

    for b0 in range(0, n, block):
        h = h_all[b0:b0 + block]
        ref, deltas = ideal_bounds(h, gamma, weight, eps=eps, decls=decls)
        for a, (ex, hi), delta in zip(acc, CERT_DECLS, deltas):
            ids = op(h, gamma, weight, eps, exchange=ex, head_input=hi, k=k)
            c = certify_rows(ref, delta, topk_indices=ids, k=k, max_listed=h.shape[0])
            for dec in ("argmax", "topk"):
                s = c["decisions"][dec]
                for key in ("certified", "matched", "near_ties"):
                    a[dec][key] += s[key]
                a[dec]["mismatched"] += s["certified"] - s["matched"]
                a[dec]["worst_margin"] = min(a[dec]["worst_margin"], float(c["worst_margin"][dec]))
            for i in c["near_tie_rows"]["argmax"]:
                if len(a["near_tie_rows"]) < MAX_LISTED:
                    a["near_tie_rows"].append(where(b0 + i))
            for m in c["mismatches"]:  # "row {i} {decision}: {what}"
                head, what = m.split(": ", 1)
                _, i, dec = head.split()
                if len(a["mismatches"]) < MAX_LISTED:
                    a["mismatches"].append({**where(b0 + int(i)), "decision": dec, "what": what})
        if progress:
            progress(f"certification: rows {b0}..{min(n, b0 + block) - 1}")
    for a in acc:
        a["ok"] = a["argmax"]["mismatched"] == 0 and a["topk"]["mismatched"] == 0
    return {"k": k, "rows": int(n), "declarations": acc}
