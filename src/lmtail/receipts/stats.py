"""Paired statistics for receipts: clustered standard errors, exact McNemar, Holm, sign test.

Everything is float64 NumPy; scipy supplies the exact binomial tail and Student's t.

Correlation within a passage: rows of one passage share context, so their per-row
differences are not independent and the textbook se = s / sqrt(n) is too narrow. Every
standard error here is a cluster-robust one: rows are grouped into clusters (blocks of
consecutive rows inside one passage, never spanning two), and

    d_bar = sum_i d_i / n
    se^2  = G / (G - 1) * sum_g (sum_{i in g} (d_i - d_bar))^2 / n^2

with G clusters. With one row per cluster this is exactly s^2 / n (the paired se); with
whole passages as clusters it is the passage-block se. Its p value uses Student's t with
G - 1 degrees of freedom.

Shape legend: [n] per-row values, [n] int cluster ids, [m] p values.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats as _sp


@dataclass(frozen=True)
class Paired:
    """A paired mean difference with its cluster-robust standard error."""

    mean: float
    se: float
    n: int  # rows
    clusters: int  # G
    p: float  # two-sided, t with G - 1 df; nan when G < 2; 1.0 when every d is 0

    @property
    def lo(self) -> float:
        return self.mean - 2 * self.se

    @property
    def hi(self) -> float:
        return self.mean + 2 * self.se


@dataclass(frozen=True)
class McNemar:
    """Exact McNemar on paired hits: a_only_miss rows miss on A only, b_only_miss on B only."""

    a_only_miss: int
    b_only_miss: int
    p: float  # two-sided binomial test of a_only_miss among the discordant pairs at 1/2


def cluster_ids(groups, block: int) -> np.ndarray:
    """[n] int cluster ids: consecutive blocks of `block` rows inside each group label.

    groups [n] labels (e.g. the passage of each row, rows of a group in order); a block
    never spans two groups. block >= 1."""
    if block < 1:
        raise ValueError(f"block must be >= 1; got {block}")
    count: dict = {}  # group -> rows seen so far
    ids: dict = {}  # (group, block index) -> cluster id
    out = []
    for g in np.asarray(groups).tolist():
        k = count.get(g, 0)
        count[g] = k + 1
        out.append(ids.setdefault((g, k // block), len(ids)))
    return np.asarray(out, dtype=np.int64)


def paired_mean_se(d, clusters) -> Paired:
    """Mean of d [n] with the cluster-robust se (module docstring) and its t-test p value."""
    d = np.asarray(d, dtype=np.float64)
    c = np.asarray(clusters)
    if d.ndim != 1 or c.shape != d.shape:
        raise ValueError(f"d and clusters must be equal-length 1-D; got {d.shape} and {c.shape}")
    n = d.shape[0]
    if n == 0:
        return Paired(math.nan, math.nan, 0, 0, math.nan)
    mean = float(d.sum() / n)
    _, inv = np.unique(c, return_inverse=True)
    g = int(inv.max()) + 1
    sums = np.bincount(inv, weights=d - mean, minlength=g)  # [G]
    if g < 2:
        return Paired(mean, math.nan, n, g, math.nan)
    se = math.sqrt(g / (g - 1) * float((sums * sums).sum())) / n
    if se == 0.0:
        p = 1.0 if mean == 0.0 else 0.0
    else:
        p = float(2 * _sp.t.sf(abs(mean) / se, g - 1))
    return Paired(mean, se, n, g, p)


def mcnemar_exact(hit_a, hit_b) -> McNemar:
    """Exact McNemar test of two arms' hits [n] bool on the same rows: the discordant pairs
    are a binomial(b + c, 1/2) under 'equally accurate'; two-sided p (1.0 with none)."""
    a = np.asarray(hit_a, dtype=bool)
    b = np.asarray(hit_b, dtype=bool)
    if a.shape != b.shape:
        raise ValueError(f"hit_a and hit_b must have the same shape; got {a.shape} and {b.shape}")
    a_only = int((~a & b).sum())
    b_only = int((a & ~b).sum())
    n = a_only + b_only
    p = 1.0 if n == 0 else float(_sp.binomtest(a_only, n, 0.5).pvalue)
    return McNemar(a_only, b_only, p)


def holm(pvals) -> np.ndarray:
    """Holm's step-down adjusted p values [m], in the input order (nan entries stay nan
    and do not count toward m)."""
    p = np.asarray(pvals, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    ok = np.flatnonzero(~np.isnan(p))
    m = ok.size
    running = 0.0
    for rank, i in enumerate(ok[np.argsort(p[ok], kind="stable")]):
        running = max(running, min(1.0, (m - rank) * p[i]))
        out[i] = running
    return out


def sign_test(wins: int, losses: int) -> float:
    """Two-sided sign test p of `wins` vs `losses` (ties dropped beforehand); 1.0 when both are 0."""
    n = wins + losses
    return 1.0 if n == 0 else float(_sp.binomtest(wins, n, 0.5).pvalue)


# ---------------------------------------------------------------------------------------
# the verdict rule
# ---------------------------------------------------------------------------------------
VERDICT_RULE = (
    "An arm is compared with its base on per-row paired differences d = arm - base (lower "
    "is better for rel-L2 and KL). It is **worse beyond noise** when any of: (1) for rel-L2 "
    "or KL over all rows, d_bar - 2 se > 0 AND d_bar > |d_bar(placebo)| + 2 se(placebo), "
    "i.e. the shift is past its own 2 se and past what the placebo reorder moves; (2) the "
    "exact McNemar p < 0.05 with more argmax misses on the arm; (3) some class (a passage, or "
    "prompt or decode rows) has d_bar > 0 on rel-L2 or KL with Holm-adjusted p < 0.05 over "
    "all of the comparison's class tests. **Better beyond noise** is the mirror image, when "
    "nothing is worse. Otherwise **within noise**. Standard errors are cluster-robust over "
    "blocks of consecutive rows within one passage (rows of one passage are correlated).")


def judge(overall: dict, placebo: dict | None, mcnemar: McNemar, class_tests: list) -> tuple[str, list[str]]:
    """Apply VERDICT_RULE. overall / placebo: metric -> Paired (placebo vs the base);
    class_tests: (class name, metric, Paired, holm-adjusted p). Returns (verdict, reasons)."""
    worse, better = [], []
    for metric, pr in overall.items():
        yard = placebo.get(metric) if placebo else None
        margin = 0.0 if yard is None or math.isnan(yard.se) else abs(yard.mean) + 2 * yard.se
        if math.isnan(pr.se):
            continue
        if pr.lo > 0 and pr.mean > margin:
            worse.append(f"{metric} {pr.mean:+.3g} +- {2 * pr.se:.2g} (placebo margin {margin:.2g})")
        if pr.hi < 0 and -pr.mean > margin:
            better.append(f"{metric} {pr.mean:+.3g} +- {2 * pr.se:.2g} (placebo margin {margin:.2g})")
    if mcnemar.p < 0.05:
        (worse if mcnemar.b_only_miss > mcnemar.a_only_miss else better).append(
            f"argmax misses only-arm {mcnemar.b_only_miss} vs only-base {mcnemar.a_only_miss}, McNemar p={mcnemar.p:.3g}")
    for cls, metric, pr, p_adj in class_tests:
        if not math.isnan(p_adj) and p_adj < 0.05:
            (worse if pr.mean > 0 else better).append(f"class {cls} {metric} {pr.mean:+.3g}, Holm p={p_adj:.3g}")
    if worse:
        return "worse beyond noise", worse + better
    if better:
        return "better beyond noise", better
    return "within noise", []
