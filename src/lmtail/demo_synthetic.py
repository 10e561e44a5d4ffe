"""`lmtail demo --synthetic`: the single-rank tail on a GPT-OSS-shaped problem.

H = 3072 with H_u = 2880 real lanes (interleaved pad), a vocab shard of 25,136, gbs = 8.
Prints the tokens, the top-5 candidates per row, agreement with the float64 reference
(certified decisions vs near-ties) and the solo-vs-together byte check.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from .reference.tail import logits_range, logits_ref, mirror_range
from .sampler import SamplingParams, sampling_tensor
from .tail import decode_tail


def gpt_oss_problem(gbs=8, h=3072, h_u=2880, v=25136, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g) * 2.0
    gamma = 1 + 0.2 * torch.randn(h, generator=g)
    w = (torch.randn(h, v, generator=g) * 0.05).to(torch.bfloat16)
    return x, gamma, w


def demo_params(gbs):
    kinds = [SamplingParams(temperature=0.0), SamplingParams(top_k=50, top_p=0.9, temperature=0.8, seed=1),
             SamplingParams(top_p=0.95, temperature=1.0, seed=2), SamplingParams(top_k=5, temperature=1.5, seed=3),
             SamplingParams(top_k=0, top_p=0.5, min_p=0.05, temperature=0.7, seed=4)]
    ps = [kinds[i % len(kinds)] for i in range(gbs)]
    return ps, sampling_tensor(ps, positions=list(range(gbs)))


def certify(out, x, gamma, w, h_u):
    """Argmax decisions whose float64 margin exceeds twice the declared bf16 range width
    are certified and must match; the rest are near-ties, counted."""
    ideal = logits_ref(x, gamma, w, eps=1e-5, hidden_actual=h_u, interleaved=True)
    lo, hi = logits_range(x, gamma, w, eps=1e-5, hidden_actual=h_u, interleaved=True)
    inside = bool(((lo <= out.logits.double().numpy()) & (out.logits.double().numpy() <= hi)).all())
    mlo, mhi = mirror_range(lo, hi)
    top2 = np.sort(ideal, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    certified = margin > 2 * (mhi - mlo).max(axis=1)
    agree = out.topk_indices[:, 0].numpy() == ideal.argmax(1)
    rel = np.linalg.norm(out.logits.double().numpy() - ideal) / np.linalg.norm(ideal)
    ref_top5 = np.argsort(-ideal, axis=1, kind="stable")[:, :5]
    overlap = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(out.topk_indices[:, :5].tolist(), ref_top5.tolist())])
    return dict(inside=inside, certified=int(certified.sum()), near_ties=int((~certified).sum()),
                certified_agree=bool(agree[certified].all()), agree=int(agree.sum()), rel_l2=rel, top5=overlap)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmtail demo --synthetic")
    ap.add_argument("--gbs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    con = Console(width=max(Console().width, 130))
    h, h_u, v = 3072, 2880, 25136
    x, gamma, w = gpt_oss_problem(args.gbs, h, h_u, v, args.seed)
    ps, sp = demo_params(args.gbs)
    con.rule(f"[bold]lmtail decode tail[/] - synthetic GPT-OSS shape: gbs={args.gbs}, H={h} (H_u={h_u}, interleaved pad), V={v}, k=256")
    t0 = time.perf_counter()
    out = decode_tail(x, gamma, w, hidden_actual=h_u, k=256, sampling_params=sp)
    dt = time.perf_counter() - t0
    tab = Table("row", "params", "token", "logprob", "trunc", "top-5 (id:value)")
    for i in range(args.gbs):
        p = ps[i]
        desc = "greedy" if p.temperature < 1e-5 else f"k={p.top_k} p={p.top_p} T={p.temperature} min_p={p.min_p} seed={p.seed}"
        top5 = " ".join(f"{j}:{val:.3g}" for j, val in zip(out.topk_indices[i, :5].tolist(), out.topk_values[i, :5].float().tolist()))
        tab.add_row(str(i), desc, str(out.tokens[i].item()), f"{out.logprobs[i].item():.4f}", str(bool(out.truncated[i])), top5)
    con.print(tab)
    c = certify(out, x, gamma, w, h_u)
    con.print(f"float64 reference: logits inside the declared range: [bold]{c['inside']}[/]; "
              f"rel-L2 {c['rel_l2']:.2e}; argmax agree {c['agree']}/{args.gbs}; "
              f"certified {c['certified']} (all agree: {c['certified_agree']}), near-ties {c['near_ties']}; "
              f"top-5 overlap {c['top5']:.3f}")
    solo_ok = True
    for i in range(args.gbs):
        s = decode_tail(x[i:i + 1], gamma, w, hidden_actual=h_u, k=256, sampling_params=sp[i:i + 1])
        solo_ok &= torch.equal(s.tokens, out.tokens[i:i + 1]) and torch.equal(s.topk_indices, out.topk_indices[i:i + 1])
        solo_ok &= torch.equal(s.topk_values.view(torch.int16), out.topk_values[i:i + 1].view(torch.int16))
        solo_ok &= torch.equal(s.logprobs.view(torch.int32), out.logprobs[i:i + 1].view(torch.int32))
        solo_ok &= torch.equal(s.logits.view(torch.int32), out.logits[i:i + 1].view(torch.int32))
    con.print(f"solo vs together (each row alone vs in the batch of {args.gbs}), bytes of logits, top-k, "
              f"tokens, logprobs: [bold]{'IDENTICAL' if solo_ok else 'DIFFERENT'}[/]")
    con.print(f"tail time for the batch: {dt * 1e3:.0f} ms (see benchmarks/bench_tail.py for ratios)")
    return 0 if (solo_ok and c["inside"] and c["certified_agree"]) else 1
