"""Token certification: the tail's decisions against the float64 ideal logits.

For every row, three kinds of decision are taken on the float64 ideal logits `ref`
(reference.tail.logits_ref: no rounding anywhere) with the declared bound `delta`
(reference.contract.ideal_bound: how far the bf16 mirror of ANY op that meets its
declaration can sit from ref, element by element):

  argmax   the top-1 id. Certified iff ref[i1] - delta[i1] > ref[j] + delta[j] for every
           other j: then the ideal and every conforming op agree.
  top-k    the set of the k best ids (the k-th candidate's membership). Certified iff the
           k-th lowest bound is above the (k+1)-th best's highest.
  sample   the sampled token for the row's (top_k, top_p, temperature, u, min_p):
           reference.contract.sample_decision on (ref, delta): certified iff the top-k
           cut, the top-p cut, the min-p cut and the draw's slot are certain for every
           value within the bounds (masses bounded through exp((v +- delta)/T)), plus the
           sampler's own float64 slack. The op's truncated flag must be the defined one; the
           token is compared where k candidates suffice for the exact answer.

A certified decision must match the op's output (a mismatch is a contract failure); an
uncertified one is a near-tie: counted, its rows listed, never dropped silently.

Shape legend: gbs rows (R = gbs: single-rank outputs), H hidden, V vocab, k candidates.
"""
from __future__ import annotations

import math

import numpy as np

from ..reference.contract import ideal_bound, sample_decision, sampler_slack
from ..tail.config import TailConfig
from ..tail.compose import tail_decl

DECISIONS = ("argmax", "topk", "sample")


def _get(out, name):
    return out.get(name) if isinstance(out, dict) else getattr(out, name, None)


def _ratio(gap, bound):
    return gap / bound if bound > 0 else math.inf


def _argmax(r, d, order):
    i1, rest = order[0], order[1:]
    if rest.size == 0:
        return True, math.inf
    j = rest[np.argmax((r + d)[rest])]
    return bool(r[i1] - d[i1] > r[j] + d[j]), _ratio(r[i1] - r[order[1]], d[i1] + d[order[1]])


def _topk(r, d, order, k):
    if k >= r.size:
        return True, math.inf
    s, rest = order[:k], order[k:]
    lo_in, hi_out = (r - d)[s].min(), (r + d)[rest].max()
    return bool(lo_in > hi_out), _ratio(r[order[k - 1]] - r[order[k]], d[order[k - 1]] + d[order[k]])


def certify_rows(ref, delta, *, topk_indices, k, tokens=None, truncated=None, sampling_params=None,
                 max_listed=20) -> dict:
    """Certification from (ref, delta) [R, V] float64 and the op's outputs (module
    docstring). Returns the dict described in certify_tail."""
    ref, delta = np.asarray(ref, np.float64), np.asarray(delta, np.float64)
    n_r, n_v = ref.shape
    ids = topk_indices.numpy()
    stats = {d: dict(certified=0, matched=0, near_ties=0) for d in DECISIONS}
    near = {d: [] for d in DECISIONS}
    mismatches, worst = [], {d: math.inf for d in DECISIONS}
    n_trunc = 0
    sp = None
    if sampling_params is not None:
        sp = np.pad(sampling_params.double().numpy(), ((0, 0), (0, max(0, 5 - sampling_params.shape[1]))))
        if sampling_params.shape[1] < 4:
            sp[:, 3] = 0.5
    slack = sampler_slack(n_v, k)
    for i in range(n_r):
        r, d = ref[i], delta[i]
        order = np.lexsort((np.arange(n_v), -r))
        results = {"argmax": _argmax(r, d, order) + (ids[i, 0] == order[0], f"top-1 id {ids[i, 0]}, float64 {order[0]}"),
                   "topk": _topk(r, d, order, k) + (set(ids[i].tolist()) == set(order[:k].tolist()),
                                                   "top-k set differs from float64's")}
        if sp is not None:
            tk, tp, t, u, mp = sp[i]
            dec = sample_decision(r, d, top_k=tk, top_p=tp, temperature=t, u=u, min_p=mp, k=k, slack=slack)
            flag = None if truncated is None else bool(truncated[i])
            n_trunc += bool(dec["certified"] and dec["truncated"])
            if dec["certified"] and flag is not None and flag != dec["truncated"]:
                results["sample"] = (True, dec["margin"], False,
                                     f"truncated flag {flag}, defined {dec['truncated']} ({sp[i].tolist()})")
            elif dec["comparable"] or not dec["certified"]:
                ok = tokens is not None and int(tokens[i]) == dec["token"]
                results["sample"] = (dec["certified"], dec["margin"], ok,
                                     f"token {None if tokens is None else int(tokens[i])}, float64 {dec['token']} "
                                     f"(slot {dec['slot']} of {dec['n_keep']}; {sp[i].tolist()})")
        for name, (cert, margin, match, what) in results.items():
            worst[name] = min(worst[name], margin)
            if not cert:
                stats[name]["near_ties"] += 1
                if len(near[name]) < max_listed:
                    near[name].append(i)
                continue
            stats[name]["certified"] += 1
            if match:
                stats[name]["matched"] += 1
            elif len(mismatches) < max_listed:
                mismatches.append(f"row {i} {name}: {what}")
    tot = {key: sum(s[key] for s in stats.values()) for key in ("certified", "matched", "near_ties")}
    return dict(rows=n_r, **tot, mismatched=tot["certified"] - tot["matched"], truncated=n_trunc,
                decisions=stats, near_tie_rows=near, worst_margin=worst, mismatches=mismatches,
                ok=tot["certified"] == tot["matched"])


def certify_tail(hidden, gamma, w, out, *, sampling_params=None, eps=1e-5, hidden_actual=None,
                 interleaved=True, deferred_rms=True, gemm_order=TailConfig.gemm_order,
                 exchange=TailConfig.exchange, head_input=TailConfig.head_input, k=None, decl=None,
                 col_chunk=8192, max_listed=20) -> dict:
    """Certify a single-rank decode_tail's outputs against float64.

    hidden [gbs, H], gamma [H], w [H, V] bf16 (the FULL vocab: single rank, or the
    concatenated shards) or, with head_input="fp32", the full-vocab Q8_0 head (a
    kernels.quant.gemm_q.QuantWeight (V, H): the ideal logits use its exact dequantized values),
    out: a TailOutput (or dict) with topk_indices [gbs, k] and, when
    sampling_params [gbs, 3|4|5] is given, tokens and truncated [gbs]. eps, hidden_actual,
    interleaved (zero_interleaved_pad), deferred_rms, gemm_order, exchange, head_input: as
    passed to decode_tail. decl: the tail's declaration the bound is computed from (default
    tail.tail_decl(H, deferred_rms, gemm_order, exchange, head_input): with the mirror exchange the
    bound holds half a bf16 ulp of the logit, with the candidates exchange only the norm
    and GEMM rounding).
    Returns dict: rows; certified, matched, mismatched, near_ties (totals over the three
    decisions); truncated (rows the exact answer needs > k candidates for); decisions
    {argmax|topk|sample: {certified, matched, near_ties}}; near_tie_rows {decision: [row]}
    (the first max_listed); worst_margin {decision: min over rows of float64 gap / bound
    (> 1 certified)}; mismatches (descriptions); ok (no certified decision mismatched).
    """
    ids = _get(out, "topk_indices")
    if ids is None:
        raise ValueError("out must carry topk_indices [gbs, k]")
    if tuple(ids.shape[:1]) != tuple(hidden.shape[:1]):
        raise ValueError(f"out must hold every row of hidden (single-rank outputs): topk_indices is "
                         f"{tuple(ids.shape)}, hidden is {tuple(hidden.shape)}")
    k = ids.shape[1] if k is None else k
    quant = hasattr(w, "fmt") and hasattr(w, "data")
    if quant != (head_input == "fp32"):
        raise ValueError("head_input='fp32' goes with a Q8_0 head (a kernels.quant.gemm_q.QuantWeight (V, H)) and a "
                         f"[H, V] bf16 w with 'bf16'/'bf16x2'; got head_input={head_input!r} with "
                         + (f"a QuantWeight {w.fmt} {w.shape}" if quant else f"a {type(w).__name__}"))
    decl = tail_decl(hidden.shape[1], deferred_rms, gemm_order, exchange, head_input) if decl is None else decl
    ref, delta = ideal_bound(hidden, gamma, w, eps=eps, decl=decl, hidden_actual=hidden_actual,
                             interleaved=interleaved, deferred_rms=deferred_rms, col_chunk=col_chunk)
    tokens, trunc = _get(out, "tokens"), _get(out, "truncated")
    return certify_rows(ref, delta, topk_indices=ids, k=k, sampling_params=sampling_params,
                        tokens=None if tokens is None else tokens.numpy(),
                        truncated=None if trunc is None else trunc.numpy(), max_listed=max_listed)


def format_certificate(c: dict) -> str:
    """A few lines for a console: per decision certified/matched/near-ties, the worst
    margins, the near-tie rows and any mismatch."""
    lines = [f"certified {c['matched']}/{c['certified']} decisions match over {c['rows']} rows; "
             f"{c['near_ties']} near-ties, {c['truncated']} truncated rows"]
    for name, s in c["decisions"].items():
        if s["certified"] or s["near_ties"]:
            rows = c["near_tie_rows"][name]
            lines.append(f"  {name:<7} certified {s['matched']}/{s['certified']}, near-ties {s['near_ties']}"
                         f"{' (rows ' + ', '.join(map(str, rows)) + ')' if rows else ''}, worst margin "
                         f"{c['worst_margin'][name]:.3g}")
    lines += [f"  MISMATCH {m}" for m in c["mismatches"]]
    return "\n".join(lines)


def certify_demo(hidden, gamma, w, out, **kw) -> str:
    """certify_tail + format_certificate (for the demo's console)."""
    return format_certificate(certify_tail(hidden, gamma, w, out, **kw))


__all__ = ["certify_tail", "certify_rows", "format_certificate", "certify_demo"]
