"""The synthetic demo: the single-rank tail on a GPT-OSS-shaped problem, no model file.

H = 3072 with H_u = 2880 real lanes (interleaved pad), a vocab shard of V = 25,136 (or
another width), gbs rows of random hidden states, gamma and bf16 weights. Prints each row's token, logprob and top-5,
the certificate of lmtail.contract.certify.certify_tail (certified decisions must equal the
float64 tail's; near-ties are counted) and the solo-vs-together byte check (each row alone
vs in the batch: logits, top-k, tokens, logprobs compared on bit views). Exit status 0 only
if the bytes are identical and no certified decision mismatched.

Shape legend: gbs rows, H hidden (H_u real lanes), V vocab shard, k = 256 candidates.
"""
from __future__ import annotations

import time

import torch
from rich.console import Console
from rich.table import Table

from ..contract.certify import certify_tail
from ..tail.sampler import SamplingParams, sampling_tensor
from ..tail.compose import decode_tail
from .report import cert_table, describe

H, H_U, V, K, EPS = 3072, 2880, 25136, 256, 1e-5  # V: the default vocab shard
PARAM_CYCLE = (SamplingParams(temperature=0.0),
               SamplingParams(top_k=50, top_p=0.9, temperature=0.8, seed=1),
               SamplingParams(top_p=0.95, temperature=1.0, seed=2),
               SamplingParams(top_k=5, temperature=1.5, seed=3),
               SamplingParams(top_k=0, top_p=0.5, min_p=0.05, temperature=0.7, seed=4))


def gpt_oss_problem(*, gbs: int, seed: int, v: int = V):
    """x [gbs, H] fp32, gamma [H] fp32, w [H, v] bf16, from torch's generator at `seed`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, H, generator=g) * 2.0
    gamma = 1 + 0.2 * torch.randn(H, generator=g)
    w = (torch.randn(H, v, generator=g) * 0.05).to(torch.bfloat16)
    return x, gamma, w


def tail(x, gamma, w, sp):
    return decode_tail(x, gamma, w, hidden_actual=H_U, k=K, sampling_params=sp)


def rows_table(out, params: list[SamplingParams]) -> Table:
    tab = Table("row", "sampling", "token", "logprob", "trunc", "top-5 (id:value)")
    for i, p in enumerate(params):
        top5 = " ".join(f"{j}:{val:.3g}" for j, val in zip(out.topk_indices[i, :5].tolist(),
                                                          out.topk_values[i, :5].float().tolist()))
        tab.add_row(str(i), describe(p), str(out.tokens[i].item()), f"{out.logprobs[i].item():.4f}",
                    str(bool(out.truncated[i])), top5)
    return tab


def solo_equals_batch(x, gamma, w, sp, out) -> bool:
    """Each row alone gives the bytes of its row in the batch (bit views of every output)."""
    ok = True
    for i in range(x.shape[0]):
        s = tail(x[i:i + 1], gamma, w, sp[i:i + 1])
        ok &= torch.equal(s.tokens, out.tokens[i:i + 1]) and torch.equal(s.topk_indices, out.topk_indices[i:i + 1])
        ok &= torch.equal(s.topk_values.view(torch.int16), out.topk_values[i:i + 1].view(torch.int16))
        ok &= torch.equal(s.logprobs.view(torch.int32), out.logprobs[i:i + 1].view(torch.int32))
        ok &= torch.equal(s.logits.view(torch.int32), out.logits[i:i + 1].view(torch.int32))
    return ok


def run_synthetic_demo(*, gbs: int = 8, seed: int = 0, vocab: int = V) -> int:
    """Print the synthetic demo for `gbs` rows of the problem at `seed` with a `vocab`-wide
    shard (>= K); 0 when every check holds."""
    con = Console(width=max(Console().width, 130))
    x, gamma, w = gpt_oss_problem(gbs=gbs, seed=seed, v=vocab)
    params = [PARAM_CYCLE[i % len(PARAM_CYCLE)] for i in range(gbs)]
    sp = sampling_tensor(params, positions=list(range(gbs)))
    con.rule(f"[bold]lmtail decode tail[/] - synthetic GPT-OSS shape: gbs={gbs}, H={H} "
             f"(H_u={H_U}, interleaved pad), V={vocab}, k={K}")
    t0 = time.perf_counter()
    out = tail(x, gamma, w, sp)
    dt = time.perf_counter() - t0
    con.print(rows_table(out, params))
    cert = certify_tail(x, gamma, w, out, sampling_params=sp, eps=EPS, hidden_actual=H_U, interleaved=True)
    con.print(cert_table({"all rows": cert}, title="the tail's decisions vs a float64 tail on the same inputs",
                         group="batch", count="rows"))
    for m in cert["mismatches"]:
        con.print(f"  [bold red]MISMATCH[/] {m}")
    solo_ok = solo_equals_batch(x, gamma, w, sp, out)
    con.print(f"solo vs together (each row alone vs in the batch of {gbs}), bytes of logits, top-k, "
              f"tokens, logprobs: [bold]{'IDENTICAL' if solo_ok else 'DIFFERENT'}[/]")
    con.print(f"tail time for the batch: {dt * 1e3:.0f} ms (`lmtail bench --only tail` for ratios)")
    ok = solo_ok and cert["ok"]
    con.print(f"[bold]{'ALL CHECKS PASS' if ok else 'CHECKS FAILED'}[/]")
    return 0 if ok else 1
