"""A receipt's outputs: the markdown report, the JSON record and the PNG plots.

Inputs are the engine's analysis dict, the spec, the passages and a provenance dict
(what ran). Nothing here computes a statistic; it only formats what analyse() returned.

Shape legend: none (tables and files).
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from . import stats


def _pm(p: stats.Paired, fmt: str = ".2e") -> str:
    """'mean ± 2 se' of a paired difference."""
    if math.isnan(p.mean):
        return "n/a"
    if p.se == 0.0 and p.mean == 0.0:
        return "0 (identical)"
    return f"{p.mean:+{fmt}} ± {2 * p.se:{fmt}}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def what_ran(prov: dict, spec, passages, arm_status: dict, used_tokens: int) -> str:
    lines = ["## What ran", ""]
    for k in ("command", "lmtail", "git", "python", "torch", "numpy", "scipy", "cpu", "threads", "model",
              "model_sha256", "body", "reference"):
        if k in prov:
            lines.append(f"- **{k}**: `{prov[k]}`")
    lines.append(f"- **rows**: prefix {spec.prefix} tokens, then {spec.rows} scored rows per passage "
                 f"({spec.rows - spec.decode_rows} from one prefill = `prompt`, {spec.decode_rows} decode "
                 f"steps on the KV cache = `decode`); {used_tokens} scored tokens in all")
    lines.append(f"- **standard errors**: cluster-robust over blocks of {spec.block} consecutive rows "
                 "within a passage (never across passages); t with G-1 df")
    lines.append("- **seeds**: none: the receipt draws no random numbers; it is deterministic given its "
                 "arguments, the texts' bytes and the thread count")
    lines += ["", _table(["text", "file", "sha256", "tokens in file", "tokens used"],
                         [[p.name, f"`{p.source}`", f"`{p.sha256}`", str(len(p.ids)),
                           str(spec.prefix + spec.rows + 1)] for p in passages])]
    lines += ["", _table(["arm", "what it computes", "status"],
                         [[a, desc, st] for a, (desc, st) in arm_status.items()])]
    return "\n".join(lines)


def distance_tables(an: dict, arms, passages) -> str:
    scopes = [p.name for p in passages] + ["all"]
    out = ["## Distance to the float64 reference (same hidden states)", ""]
    specs = [("mean rel-L2 of the logits", lambda s: f"{s['rel_l2']:.4e}"),
             ("argmax agreement", lambda s: f"{100 * s['argmax_agree']:.2f}% ({s['misses']} miss)"),
             ("mean KL(ref ‖ arm), nats", lambda s: f"{s['kl']:.3e}"),
             ("worst column, |arm - ref| / rms(ref row) (position, column)",
              lambda s: f"{s['worst']:.3e} ({s['worst_at']['position']}, {s['worst_at']['column']})")]
    for title, f in specs:
        out += [f"**{title}**", "", _table(["passage"] + list(arms),
                                           [[sc] + [f(an["summary"][a][sc]) for a in arms] for sc in scopes]), ""]
    mm = ", ".join(f"{a} {v:.3g}" if v is not None else f"{a} none" for a, v in an["miss_margin_max"].items())
    out.append(f"Largest reference top-1 margin (logits) at an argmax miss: {mm}.")
    return "\n".join(out)


def comparison_tables(an: dict) -> str:
    out = ["## Paired comparisons, placebo beside each", "", stats.VERDICT_RULE, ""]
    rows = []
    for c in an["comparisons"]:
        pl, pm = c["placebo_overall"], c["placebo_mcnemar"]
        mc = c["mcnemar"]
        rows.append([f"{c['arm']} vs {c['base']}", _pm(c["overall"]["rel_l2"]),
                     _pm(pl["rel_l2"]) if pl else "-", _pm(c["overall"]["kl"]), _pm(pl["kl"]) if pl else "-",
                     f"{mc.b_only_miss} / {mc.a_only_miss} (p={mc.p:.3g})",
                     f"{pm.b_only_miss} / {pm.a_only_miss} (p={pm.p:.3g})" if pm else "-",
                     _pm(c["nll"]), f"**{c['verdict']}**"])
    out.append(_table(["arm vs base", "paired rel-L2 ± 2se", "placebo", "paired KL ± 2se", "placebo",
                       "misses only-arm / only-base (McNemar p)", "placebo", "NLL ± 2se", "verdict"], rows))
    for c in an["comparisons"]:
        out += ["", f"**{c['arm']} vs {c['base']}, per class** (Holm over the {len(c['classes'])} tests)"
                + (": " + "; ".join(c["reasons"]) if c["reasons"] else ""), ""]
        by = {}
        for cls, m, pr, p in c["classes"]:
            by.setdefault(cls, {})[m] = (pr, p)
        out.append(_table(["class", "rows", "rel-L2 ± 2se", "Holm p", "KL ± 2se", "Holm p", "placebo rel-L2 ± 2se"],
                          [[cls, str(v["rel_l2"][0].n), _pm(v["rel_l2"][0]), f"{v['rel_l2'][1]:.3g}",
                            _pm(v["kl"][0]), f"{v['kl'][1]:.3g}",
                            _pm(c["placebo_classes"][cls]) if cls in c["placebo_classes"] else "-"]
                           for cls, v in by.items()]))
    return "\n".join(out)


def nll_table(an: dict, arms, base: str, passages) -> str:
    scopes = [p.name for p in passages] + ["all"]
    others = [a for a in arms if a != base]
    head = ["text", "tokens", "float64 ref", f"{base} ± 2se"] + [f"{a} - {base} ± 2se" for a in others]
    rows = []
    for sc in scopes:
        s = an["summary"][base][sc]
        r = an["ref_nll"][sc]
        rows.append([sc, str(s["rows"]), f"{r.mean:.4f}", f"{s['nll']:.4f} ± {2 * s['nll_se']:.4f}"]
                    + [_pm(an["nll_vs_base"][a][sc], ".2e") for a in others])
    return "\n".join(["## Teacher-forced NLL, nats/token", "", _table(head, rows)])


def _margin(x) -> str:
    return "inf" if isinstance(x, str) or math.isinf(x) else f"{x:.3g}"


def certification_section(cert: dict) -> str:
    """The certified decisions per declaration (engine.certify_table's dict)."""
    k = cert["k"]
    out = ["## Certified decisions vs float64 (teacher-forced rows)", "",
           f"For each declaration of the tail (exchange, head_input), every scored row's argmax and top-{k} set "
           "are certified against the float64 ideal logits: `reference.contract.ideal_bound` gives (ref, delta), "
           "how far ANY op meeting that declaration can sit from ref per column (with the mirror exchange, "
           "rounded outward to bf16), and `contract.certify.certify_rows` certifies a decision when no value "
           "within the bounds can change it. A certified decision must equal the op's "
           "(`decode_tail(..., exchange, head_input)`, its default GEMM order); an uncertified one is a "
           "near-tie, counted and listed, never dropped. Worst margin: the smallest float64 gap / bound "
           "over the rows (> 1 is certified).", ""]
    rows = []
    for d in cert["declarations"]:
        a, t = d["argmax"], d["topk"]
        rows.append([f"`{d['exchange']}`", f"`{d['head_input']}`", str(cert["rows"]),
                     f"{a['certified']} ({100 * a['certified'] / max(cert['rows'], 1):.1f}%)",
                     f"{a['matched']}/{a['certified']}", str(a["near_ties"]), _margin(a["worst_margin"]),
                     f"{t['certified']}", f"{t['matched']}/{t['certified']}", str(t["near_ties"]),
                     "ok" if d["ok"] else "**CONTRACT FAILURE**"])
    out.append(_table(["exchange", "head_input", "rows", "argmax certified", "op matches", "near-ties",
                       "worst margin", f"top-{k} set certified", "op matches", "near-ties", "status"], rows))
    for d in cert["declarations"]:
        name = f"`{d['exchange']}`, `{d['head_input']}`"
        if d["near_tie_rows"]:
            shown = ", ".join(f"{r['passage']} @{r['position']} ({r['kind']})" for r in d["near_tie_rows"])
            more = d["argmax"]["near_ties"] - len(d["near_tie_rows"])
            out += ["", f"Argmax near-ties, {name}: {shown}" + (f", and {more} more" if more > 0 else "") + "."]
        for m in d["mismatches"]:
            out += ["", f"**MISMATCH** {name}: {m['passage']} @{m['position']} ({m['kind']}) {m['decision']}: "
                        f"{m['what']}"]
    return "\n".join(out)


def markdown(an: dict, spec, passages, prov: dict, arm_status: dict, plots: list[str]) -> str:
    parts = ["# lmtail receipt", "", what_ran(prov, spec, passages, arm_status, an["rows"]), "",
             distance_tables(an, spec.arms, passages), "", comparison_tables(an), "",
             nll_table(an, spec.arms, spec.base, passages)]
    if "certification" in an:
        parts += ["", certification_section(an["certification"])]
    if plots:
        parts += ["", "## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots]
    return "\n".join(parts) + "\n"


def _plain(x):
    """JSON-ready copy of analysis values (dataclasses, numpy scalars, tuples)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)
    return x


def record(an: dict, spec, passages, prov: dict, arm_status: dict) -> str:
    """The JSON record (sorted keys, so equal receipts give equal bytes)."""
    return json.dumps(_plain({"spec": spec, "provenance": prov, "arms": arm_status,
                              "texts": [{"name": p.name, "source": p.source, "sha256": p.sha256,
                                         "tokens": len(p.ids)} for p in passages],
                              "analysis": an}), indent=1, sort_keys=True)


def plots(table, an: dict, spec, passages, out: Path) -> list[str]:
    """paired_rel_l2.png (histograms of per-row differences, placebo overlaid) and
    nll.png (per-text NLL vs the base with 2 se bars). Returns the written paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    comps = an["comparisons"]
    if comps:
        fig, axes = plt.subplots(len(comps), 1, figsize=(7, 2.4 * len(comps)), squeeze=False)
        for ax, c in zip(axes[:, 0], comps):
            d = table.column(c["arm"], "rel_l2") - table.column(c["base"], "rel_l2")
            series = [(d, f"{c['arm']} - {c['base']}")]
            if c["placebo"]:
                series.append((table.column(c["placebo"], "rel_l2") - table.column(c["base"], "rel_l2"),
                               f"placebo ({c['placebo']}) - {c['base']}"))
            lo = min(float(s.min()) for s, _ in series)
            hi = max(float(s.max()) for s, _ in series)
            bins = np.linspace(lo, hi, 41) if hi > lo else 3
            for s, label in series:
                ax.hist(s, bins=bins, histtype="step", label=label)
            if c["placebo"]:
                p = series[1][0]
                ax.axvspan(p.mean() - 2 * p.std(), p.mean() + 2 * p.std(), alpha=0.15, color="gray",
                           label="placebo mean ± 2 sd")
            ax.axvline(0.0, color="black", lw=0.5)
            ax.set_title(f"{c['arm']} vs {c['base']}: {c['verdict']}", fontsize=9)
            ax.set_xlabel("per-row paired difference of rel-L2")
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / "paired_rel_l2.png"
        fig.savefig(path, dpi=90, metadata={"Software": None})
        plt.close(fig)
        written.append(str(path))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6))
    names = [p.name for p in passages] + ["all"]
    xs = np.arange(len(names))
    for j, a in enumerate(spec.arms):
        s = [an["summary"][a][n] for n in names]
        ax0.errorbar(xs + 0.08 * (j - len(spec.arms) / 2), [v["nll"] for v in s],
                     yerr=[2 * v["nll_se"] for v in s], fmt="o", ms=3, capsize=2, label=a, color=f"C{j % 10}")
        if a != spec.base:
            q = [an["nll_vs_base"][a][n] for n in names]
            ax1.errorbar(xs + 0.08 * (j - len(spec.arms) / 2), [v.mean for v in q], yerr=[2 * v.se for v in q],
                         fmt="o", ms=3, capsize=2, label=a, color=f"C{j % 10}")
    ax0.set_title("teacher-forced NLL ± 2 se (nats/token)", fontsize=9)
    ax1.set_title(f"paired NLL vs {spec.base} ± 2 se", fontsize=9)
    ax1.axhline(0.0, color="black", lw=0.5)
    for ax in (ax0, ax1):
        ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    path = out / "nll.png"
    fig.savefig(path, dpi=90, metadata={"Software": None})
    plt.close(fig)
    written.append(str(path))
    return written
