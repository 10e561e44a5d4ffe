"""Contract kind of the logits-processor seam (lmtail.tail.processors) on the harness's Kind /
Control / Case / Verdict types.

    kind             op                             outputs   declaration
    tail.processors  processors.apply_processing    logits    processors.processors_decl()

The seam is exact per step (one fp32 rounding point each, no sums), so its check is
bytes: the op's logits == reference/processors.py's float64 steps rounded to fp32 (bit
views; NaN payloads compared too). Gate data: shapes (odd V, one row, V = 1), random
(several seeds, every processor mixed with None and neutral rows), special (NaN / inf / -0
/ subnormal logits, ids at the edges, a mask allowing one id; the boundary errors, each a
ValueError naming its field), adversarial (lanes where the step order decides the value:
l = +-0 at the repetition test, a bias cancelling a penalty to an exact zero, f * c not
exact in fp32). The ranks gate splits the vocabulary into shards in this process (v0
offsets; 2 .. nranks shards, uneven too) and compares the concatenation with one shard.

Shape legend: n rows, V vocab (V_s a shard).
"""
from __future__ import annotations

from functools import partial

import numpy as np
import torch

from ..tail.processors import LogitProcessing, apply_processing, processors_decl
from ..reference.processors import processed_logits
from .harness import Case, Control, Kind, Verdict, diff_outputs

NAN_ODD = torch.tensor([0x7FC0BEEF], dtype=torch.int32).view(torch.float32)[0]


# =======================================================================================
# data
# =======================================================================================
def _logits(n: int, v: int, seed: int, specials: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 4  # [n, V]
    if specials and v >= 8:
        x[0, 0], x[0, v - 1], x[n - 1, 1], x[n - 1, v - 2] = float("nan"), float("inf"), -0.0, -float("inf")
        x[n // 2, 2], x[n // 2, 3], x[n // 2, v // 2] = 1e-40, -3e-39, NAN_ODD
    return x


def _processing(n: int, v: int, seed: int, edges=()) -> list:
    """n rows: None, neutral, and random mixes of every processor (ids at `edges` too)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        kind = i % 5
        if kind < 2:
            out.append(None if kind == 0 else LogitProcessing())
            continue
        ids = np.unique(np.concatenate([rng.integers(0, v, size=rng.integers(1, 12)), np.array(edges, int)]))
        ids = ids[(ids >= 0) & (ids < v)]
        allowed = None
        if kind == 4:
            allowed = torch.from_numpy(rng.random(v) < 0.6)
            allowed[int(ids[0])] = True
        half = max(1, ids.size // 2)
        out.append(LogitProcessing(
            logit_bias=tuple((int(j), float(rng.uniform(-100, 100))) for j in rng.permutation(ids)[:half]),
            presence_penalty=float(rng.uniform(-2, 2)) if kind != 3 else 0.0,
            frequency_penalty=float(rng.uniform(-2, 2)),
            repetition_penalty=float(rng.choice([0.5, 1.3, 1.7, 2.9])) if kind != 2 else 1.0,
            output_counts=tuple((int(j), int(rng.integers(1, 9))) for j in rng.permutation(ids)[:half]),
            prompt_ids=tuple(int(j) for j in rng.integers(0, v, size=rng.integers(0, 20))),
            allowed=allowed))
    return out


def _case(label: str, n: int, v: int, seed: int, specials: bool = True) -> dict:
    edges = tuple(e for e in (0, 1, v // 2 - 1, v // 2, v - 2, v - 1) if 0 <= e < v)
    return {"label": label, "logits": _logits(n, v, seed, specials), "processing": _processing(n, v, seed, edges)}


def _adversarial() -> dict:
    """Lanes whose value depends on the declared order and roundings."""
    x = torch.tensor([[0.0, -0.0, 1e-45, -1e-45, 3.0, 0.1, 7.0, 1.0, 5.0, -5.0]])  # [1, 10]
    p = LogitProcessing(repetition_penalty=3.0, prompt_ids=(0, 1, 2, 3, 4), frequency_penalty=0.1,
                        presence_penalty=-1.5, output_counts=((4, 3), (5, 7), (6, 1)),
                        logit_bias=((4, 0.5), (6, -5.5), (7, -1.0), (8, -5.0), (9, 5.0)))
    return {"label": "order-sensitive lanes 1x10", "logits": x, "processing": [p]}


def _specials() -> list:
    v = 16
    x = torch.tensor([[float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40, 2.0] * 2] * 3)
    x[2, 9] = NAN_ODD
    one = torch.zeros(v, dtype=torch.bool)
    one[v - 1] = True
    ps = [LogitProcessing(repetition_penalty=0.25, prompt_ids=tuple(range(v)), logit_bias=((1, -100.0), (2, 100.0))),
          LogitProcessing(allowed=one, frequency_penalty=2.0, output_counts=((0, 5), (15, 1))), None]
    return [{"label": "NaN/inf/-0/subnormal 3x16", "logits": x, "processing": ps}]


BAD = [  # (field change, error regex): each must raise before any byte is written
    (dict(logit_bias=((16, 1.0),)), r"logit_bias must hold token ids in \[0, V=16\)"),
    (dict(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\]"),
    (dict(repetition_penalty=0.0), r"repetition_penalty must be a finite number > 0"),
    (dict(output_counts=((3, 0),)), r"output_counts must map ids to int counts"),
    (dict(allowed=torch.zeros(16, dtype=torch.bool)), r"allowed must allow at least one token"),
]


def _data(gate: int) -> list:
    if gate == 1:
        return [_case("1x1", 1, 1, 1, False), _case("1x7", 1, 7, 2), _case("5x101", 5, 101, 3),
                _case("10x4099", 10, 4099, 4)]
    if gate == 2:
        return [_case(f"seed{s} 10x1000", 10, 1000, 10 + s) for s in range(4)]
    if gate == 3:
        return _specials()
    return [_adversarial()]


def _cases(gate: int, fast: bool) -> list:
    cases = [Case(d["label"], d) for d in _data(gate)]
    if gate == 3:
        cases += [Case(f"bad {next(iter(ch))}", {"logits": torch.zeros(1, 16), "processing": [LogitProcessing(**ch)]},
                       raises=rx) for ch, rx in BAD]
    return cases


# =======================================================================================
# the kind
# =======================================================================================
def _run(d) -> dict:
    return {"logits": apply_processing(d["logits"], d["processing"])}


def _check(d, out, run, decl) -> Verdict:
    diff = diff_outputs(out, {"logits": processed_logits(d["logits"], d["processing"])})
    return Verdict(not diff, None, diff or "bytes == the float64 reference's fp32 steps")


def _take_rows(d, idx) -> dict:
    idx = list(idx)
    return {**d, "logits": d["logits"][idx].contiguous(), "processing": [d["processing"][i] for i in idx]}


def _splits(v: int, nranks: int) -> list[tuple[str, tuple[int, ...]]]:
    """(layout, cut points) for 2 .. nranks equal shards and one uneven split."""
    out = [(f"{r} shards", tuple(v * i // r for i in range(1, r))) for r in range(2, nranks + 1) if v >= r]
    if v >= 3:
        out.append(("uneven 1 | V-1", (1,)))
    return out


def _ranks(d, nranks: int, run, *, apply=apply_processing) -> list:
    x, proc = d["logits"], d["processing"]
    v = x.shape[1]
    res = []
    for layout, cuts in _splits(v, nranks):
        edges = [0, *cuts, v]
        parts = [apply(x[:, a:b].contiguous(), proc, v0=a, vocab_size=v) for a, b in zip(edges[:-1], edges[1:])]
        res.append((layout, {"logits": torch.cat(parts, dim=1)}))
    return res


def processor_kinds() -> list[Kind]:
    gens = {g: partial(_cases, i) for i, g in enumerate(("shapes", "random", "special", "adversarial"), 1)}
    gens["bytes"] = lambda fast: [Case(d["label"], d) for d in (_data(2)[0], _specials()[0], _adversarial())]
    return [Kind("tail.processors", lambda d: processors_decl(), _run, _check, gens, take_rows=_take_rows,
                 ranks=_ranks, emulate=lambda d: {"logits": processed_logits(d["logits"], d["processing"])},
                 group="tail", about="processors.apply_processing -> logits (exact per step)")]


# =======================================================================================
# planted controls: each must be RED at its gate
# =======================================================================================
def _variant(d, *, bias_first=False, bias_twice=False, rep_output_only=False, fused_freq=False) -> dict:
    """A dense torch fp32 implementation of the seam with one defect."""
    x = d["logits"].clone()
    v = x.shape[1]
    for i, p in enumerate(d["processing"]):
        if p is None or p.neutral:
            continue
        row = x[i].clone()
        cnt = torch.zeros(v)
        for j, c in p.output_counts:
            cnt[j] = c
        bias = torch.zeros(v)
        hb = torch.zeros(v, dtype=torch.bool)
        for j, b in p.logit_bias:
            bias[j], hb[j] = b, True
        if bias_first:
            row = torch.where(hb, row + bias, row)
        r = torch.tensor(p.repetition_penalty, dtype=torch.float32)
        if p.repetition_penalty != 1:
            seen = torch.zeros(v, dtype=torch.bool)
            seen[[j for j, _ in p.output_counts]] = True
            if not rep_output_only:
                seen[list(p.prompt_ids)] = True
            row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
        f, pr = (torch.tensor(q, dtype=torch.float32) for q in (p.frequency_penalty, p.presence_penalty))
        if p.frequency_penalty != 0:
            sub = ((f.double() * cnt.double()) if fused_freq else (f * cnt)).double()
            row = torch.where(cnt > 0, (row.double() - sub).to(torch.float32), row)
        if p.presence_penalty != 0:
            row = torch.where(cnt > 0, row - pr, row)
        if not bias_first:
            row = torch.where(hb, row + bias, row)
        if bias_twice:
            row = torch.where(hb, row + bias, row)
        if p.allowed is not None:
            row = row.masked_fill(~p.allowed, -float("inf"))
        x[i] = row
    return {"logits": x}


def _mask_only_on_shard0(logits, processing, *, v0, vocab_size):
    """PLANTED: shards past the first skip the allowed mask."""
    if v0 > 0 and processing is not None:
        processing = [p if p is None else LogitProcessing(**{**p.__dict__, "allowed": None}) for p in processing]
    return apply_processing(logits, processing, v0=v0, vocab_size=vocab_size)


def processor_controls() -> list[Control]:
    c = lambda name, gate, what, run=None, ranks=None: Control(  # noqa: E731
        f"tail.processors.{name}", "tail.processors", gate, what, run=run, ranks=ranks)
    return [
        c("bias_before_penalties", "random", "logit_bias applied before the penalties (another order)",
          partial(_variant, bias_first=True)),
        c("bias_twice", "random", "logit_bias added twice", partial(_variant, bias_twice=True)),
        c("repetition_output_only", "random", "repetition penalty over the output tokens only (not the prompt)",
          partial(_variant, rep_output_only=True)),
        c("frequency_fused", "adversarial", "l - f*c with f*c unrounded (one rounding, an fma)",
          partial(_variant, fused_freq=True)),
        c("mask_rank0_only", "ranks", "the allowed mask applied on the first shard only",
          ranks=partial(_ranks, apply=_mask_only_on_shard0)),
    ]
