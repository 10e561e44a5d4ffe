"""Console pieces shared by the demos: how a request's sampling reads, and the table of a
certificate from lmtail.contract.certify (certified decisions vs near-ties).

Shape legend: none (a report).
"""
from __future__ import annotations

from rich.table import Table

from ..contract.certify import DECISIONS
from ..tail.sampler import GREEDY_TEMPERATURE, SamplingParams


def describe(p: SamplingParams) -> str:
    """'greedy', or the active cuts, temperature and seed, e.g. 'T=0.7 top_p=0.9 seed=1'."""
    if p.temperature < GREEDY_TEMPERATURE:
        return "greedy"
    parts = [f"T={p.temperature:g}"]
    parts += [f"top_k={p.top_k}"] if p.top_k > 0 else []
    parts += [f"top_p={p.top_p:g}"] if p.top_p < 1 else []
    parts += [f"min_p={p.min_p:g}"] if p.min_p > 0 else []
    return " ".join(parts + [f"seed={p.seed}"])


def cert_table(certs: dict[str, dict], *, title: str, group: str, count: str) -> Table:
    """One row per (certificate, decision): rows certified, how many equal float64's,
    near-ties and the worst margin (float64 gap / declared bound; > 1 is certified).
    certs: name -> certify_tail's dict; group, count: headers of the name column and of
    the row-count column."""
    tab = Table(title=title, title_justify="left")
    for i, col in enumerate((group, "decision", count, "certified", "= float64", "near-ties", "worst")):
        tab.add_column(col, justify="left" if i < 2 else "right", no_wrap=True)
    what = {"sample": "emitted token", "argmax": "argmax", "topk": "top-256 set"}
    for name, c in certs.items():
        for d in ("sample",) + tuple(x for x in DECISIONS if x != "sample"):
            s = c["decisions"][d]
            wm = c["worst_margin"].get(d)
            same = f"[green]{s['matched']}[/]" if s["matched"] == s["certified"] else f"[bold red]{s['matched']}[/]"
            tab.add_row(name if d == "sample" else "", what[d], str(c["rows"]), str(s["certified"]), same,
                        str(s["near_ties"]), "-" if wm is None else f"{wm:.2g}")
    return tab
