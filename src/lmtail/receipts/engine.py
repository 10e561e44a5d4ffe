"""A receipt: run named tail arms on SmolLM2's hidden states of public texts, measure each
against a float64 reference of the tail on the same hidden states, and compare arms paired.

Rows of one passage (token ids t_0 .. t_{P+N}):
    positions 0 .. P-1              the fixed prefix (context, never scored)
    positions P .. P+N-D-1          "prompt" rows: hidden states from ONE prefill of t_0..t_{P+N-D-1}
    positions P+N-D .. P+N-1        "decode" rows: one decode step each on the KV cache
Row at position s predicts t_{s+1} (teacher forced). The body is the model's fp32 forward
(model.llama.FP32_OPS), the same for every arm; arms differ only in the tail. The float64
reference is lmtail.reference.tail.logits_ref of those hidden states.

Shape legend: N scored rows of a passage, H hidden, V vocab; "all rows" arrays are [n].
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..reference.tail import logits_ref
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
