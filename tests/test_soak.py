"""A bounded soak of the vocab-parallel tail (slow; `pytest -m slow tests/test_soak.py`).

Two gloo ranks (lmtail.launch) make 1,000 decode_tail calls over the world group, cycling
through a fixed set of mixed configurations (k, sampling columns and values, greedy and
sampled rows, deferred/legacy rms, nan_fold, batch groups, fences, hop layouts, 16-bit
hidden states). Each call's outputs are hashed bit for bit:
  * every repeat of a configuration gives the digest of its first run (no drift, no state
    leaking between calls), and that digest equals the single-rank decode_tail's owned
    rows computed in the parent (the exchange moves bytes only);
  * resident memory (/proc/self/statm) and open file descriptors (/proc/self/fd) of each
    rank, measured after a warm-up and at the end, grow by at most RSS_SLACK_MIB and
    FD_SLACK (the allocator may keep a few cached blocks; nothing may grow per call).

Shape legend: gbs rows, H hidden, V vocab (V_s = V / 2 a rank), R = gbs / 2 owned rows, k candidates.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib
import os

import pytest
import torch

import lmtail


def api(name: str, module: str):
    return getattr(lmtail, name, None) or getattr(importlib.import_module(module), name)


decode_tail = api("decode_tail", "lmtail.tail.compose")
launch = api("launch", "lmtail.launch")
owned_rows = api("owned_rows", "lmtail.tail.layout")

CALLS, WARMUP = 1000, 100
RSS_SLACK_MIB, FD_SLACK = 32.0, 2
GBS, H, V, VTP = 8, 64, 192, 2
FIELDS = ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")

CONFIGS = [
    dict(k=8, sp_cols=5, seed=0),
    dict(k=1, sp_cols=3, seed=1, deferred_rms=False),
    dict(k=32, sp_cols=4, seed=2, batch_groups=2),
    dict(k=5, sp_cols=None, seed=3, nan_fold=True, fence=True),
    dict(k=16, sp_cols=5, seed=4, hops=(2, 1), hidden_dtype="bfloat16"),
    dict(k=3, sp_cols=5, seed=5, batch_groups=4, hidden_actual=56),
    dict(k=64, sp_cols=4, seed=6, emit_logits=False),
]


def inputs(cfg):
    """The global inputs of a configuration, built identically in every process."""
    g = torch.Generator().manual_seed(100 + cfg["seed"])
    x = (torch.randn(GBS, H, generator=g) * 1.5).to(getattr(torch, cfg.get("hidden_dtype", "float32")))
    gamma = torch.rand(H, generator=g) + 0.5
    w = (torch.randn(H, V, generator=g) * 0.2).to(torch.bfloat16)
    pick = lambda vals: torch.tensor(vals)[torch.randint(0, len(vals), (GBS,), generator=g)]
    sp = torch.stack([pick([-1.0, 0.0, 1.0, 4.0, 1e9]), pick([1.0, 0.9, 0.3]), pick([0.0, 0.6, 1.0, 1.7]),
                      torch.rand(GBS, generator=g) * 0.999, pick([0.0, 0.05])], 1).to(torch.float32)
    return x, gamma, w, (None if cfg["sp_cols"] is None else sp[:, :cfg["sp_cols"]].contiguous())


def tail_kw(cfg):
    return dict(k=cfg["k"], deferred_rms=cfg.get("deferred_rms", True), nan_fold=cfg.get("nan_fold", False),
                emit_logits=cfg.get("emit_logits", True), hidden_actual=cfg.get("hidden_actual"),
                zero_interleaved_pad=False)


def digest(out, rows=None) -> str:
    """sha256 over the bit patterns of every output field (owned rows of the row-indexed ones)."""
    h = hashlib.sha256()
    for f in FIELDS:
        t = getattr(out, f)
        if t is None:
            h.update(b"none")
            continue
        if rows is not None and f != "logits":
            t = t[rows]
        t = t.contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        elif t.dtype == torch.float32:
            t = t.view(torch.int32)
        h.update(f.encode() + t.numpy().tobytes())
    return h.hexdigest()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak_rank(rank, calls, warmup):
    """calls decode_tail calls cycling through CONFIGS; digests per config and the
    RSS / fd counts after `warmup` calls and at the end."""
    import torch.distributed as dist

    prepared = [(cfg, inputs(cfg)) for cfg in CONFIGS]
    seen: dict[int, set[str]] = {i: set() for i in range(len(CONFIGS))}
    marks = {}
    for n in range(calls):
        i = n % len(CONFIGS)
        cfg, (x, gamma, w, sp) = prepared[i]
        vs = V // VTP
        rows = owned_rows(rank, VTP, GBS, cfg.get("hops"), cfg.get("batch_groups", 1))
        out = decode_tail(x, gamma, w[:, rank * vs:(rank + 1) * vs].contiguous(), **tail_kw(cfg),
                          sampling_params=None if sp is None else sp[rows], group=dist.group.WORLD,
                          hops=cfg.get("hops"), batch_groups=cfg.get("batch_groups", 1),
                          fence=cfg.get("fence", False))
        seen[i].add(digest(out))
        if n + 1 == warmup:
            marks["warm"] = (rss_mib(), open_fds())
    marks["end"] = (rss_mib(), open_fds())
    return {"digests": {i: sorted(d) for i, d in seen.items()}, "marks": marks}


def expected_digest(cfg, rank):
    """The single-rank call's bytes for the rows (and the logits shard) this rank owns."""
    x, gamma, w, sp = inputs(cfg)
    full = decode_tail(x, gamma, w, **tail_kw(cfg), sampling_params=sp)
    rows = owned_rows(rank, VTP, GBS, cfg.get("hops"), cfg.get("batch_groups", 1))
    vs = V // VTP
    shard = None if full.logits is None else full.logits[:, rank * vs:(rank + 1) * vs].contiguous()
    return digest(dataclasses.replace(full, logits=shard), rows=torch.tensor(rows))


def check_soak(res, expected) -> list[str]:
    """The soak's verdict on the per-rank results: one line per rank (raises on a failure).
    expected(config index, rank) -> the single-rank digest."""
    lines = []
    for rank, r in enumerate(res):
        for i, ds in r["digests"].items():
            assert len(ds) == 1, f"rank {rank}, config {CONFIGS[i]}: {len(ds)} different outputs over the soak"
            assert ds[0] == expected(i, rank), f"rank {rank}, config {CONFIGS[i]}: differs from the single-rank tail"
        (rss0, fd0), (rss1, fd1) = r["marks"]["warm"], r["marks"]["end"]
        assert rss1 - rss0 <= RSS_SLACK_MIB, f"rank {rank}: RSS grew {rss1 - rss0:.1f} MiB over {CALLS - WARMUP} calls"
        assert fd1 - fd0 <= FD_SLACK, f"rank {rank}: open fds grew from {fd0} to {fd1}"
        lines.append(f"rank {rank}: RSS {rss0:.1f} -> {rss1:.1f} MiB, fds {fd0} -> {fd1}")
    return lines


@pytest.mark.slow
def test_soak_vocab_parallel_1000_calls():
    res = launch(soak_rank, VTP, args=(CALLS, WARMUP), timeout_s=1500, threads=1)
    for line in check_soak(res, lambda i, rank: expected_digest(CONFIGS[i], rank)):
        print(line)


@pytest.mark.parametrize("leak", ["two digests", "wrong digest", "rss", "fds"])
def test_soak_verdict_goes_red(leak):
    """Planted soak results (drift, a wrong answer, a memory or fd leak) fail check_soak."""
    good = {"digests": {0: ["a"]}, "marks": {"warm": (100.0, 20), "end": (101.0, 20)}}
    bad = {"two digests": {"digests": {0: ["a", "b"]}},
           "wrong digest": {"digests": {0: ["c"]}},
           "rss": {"marks": {"warm": (100.0, 20), "end": (100.0 + RSS_SLACK_MIB + 1, 20)}},
           "fds": {"marks": {"warm": (100.0, 20), "end": (101.0, 20 + FD_SLACK + 1)}}}[leak]
    check_soak([good], lambda i, rank: "a")
    with pytest.raises(AssertionError):
        check_soak([{**good, **bad}], lambda i, rank: "a")


def test_soak_digest_catches_one_flipped_bit():
    """The soak's comparison can go red: one flipped logit bit changes the digest."""
    cfg = CONFIGS[0]
    x, gamma, w, sp = inputs(cfg)
    out = decode_tail(x, gamma, w, **tail_kw(cfg), sampling_params=sp)
    flipped = out.logits.clone()
    flipped.view(torch.int32)[3, 5] ^= 1
    assert digest(out) != digest(dataclasses.replace(out, logits=flipped))
