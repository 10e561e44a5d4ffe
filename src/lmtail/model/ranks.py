"""Sharing a loaded model with N spawned ranks, and running a function of it on each.

    pack_bundle(bundle) -> parcel            every weight in two (three) shared-memory buffers
    unpack_bundle(parcel) -> ModelBundle     views into the parcel's buffers (no copy)
    run_ranks(entry, bundle, args, ...)      lmtail.launch N ranks of rank_main; rank 0's
                                             on_step calls reach the caller through a queue

One tail step over N vocab-parallel ranks, the same on every rank (generate's group_step
and the server's serve.ranks both run it):
    pad_step(x [B, H], sp [B, 5], N) -> xp [gbs, H], spp [gbs, 5]   zero rows after B, greedy dummies
    rank_step(tail, xp, spp, rank=r, n=N, ...) -> [gbs, 3 + k (+ k)] int64
        tail(xp, spp[owned_rows(r, N, gbs)]): the tail on this rank's shard (collective),
        then one all-gather of each rank's owned rows (token, logprob bits, truncated,
        top-k ids[, top-k value bits]) put back in global row order
    gathered_rows(full, B, value_dtype) -> GatheredRows     the B real rows, bits exact

rank_main(rank, entry, parcel, args, queue) runs in each spawned rank: it rebuilds the bundle
from the parcel and returns entry(bundle, rank, world, *args, on_step=...). `entry` must be a
module-level function (it is pickled by name); lmtail.model.generate's rank_decode is the one
generate() uses. Pickling the parcel to a spawned rank passes a few file descriptors instead
of ~400 tensors (torch's per-storage fd passing takes seconds per rank).

Shape legend: N fp32 elements of the body buffer, N16 bf16 elements of the linears buffer,
H hidden, V vocab; a step: B rows, gbs = B rounded up to a multiple of the N ranks, R = gbs / N
rows a rank owns, k candidates.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..tail.exchange import ExchangeError
from ..launch import launch
from ..kernels.quant.gemm_q import QuantWeight
from ..tail.layout import owned_rows
from ..tail.sampler import greedy_rows
from .gguf_loader import LayerWeights, Linears16, ModelBundle, load_model

_ALIGN = 16  # fp32 elements (64 bytes) between tensor starts


def pack_bundle(bundle: ModelBundle) -> dict:
    """The bundle as {flat [N] fp32, head [H, V] bf16, flat16 [N16] bf16 (each in shared
    memory), layout, layout16, rest}: every body weight at a 64-byte-aligned offset of flat,
    the declared body's linears in flat16, the rest (config, tokenizer, path) as is.
    A load_model(weights="file") bundle travels as {file: path}: each rank maps the same
    file (the OS shares its pages), nothing is copied."""
    if bundle.weights == "file":
        return dict(file=bundle.path)
    named = [("embed", bundle.embed), ("final_norm", bundle.final_norm)]
    named += [(f"{i}.{f.name}", getattr(lw, f.name)) for i, lw in enumerate(bundle.layers) for f in fields(lw)]
    layout, off = [], 0
    for name, t in named:
        layout.append((name, off, tuple(t.shape)))
        off += -(-t.numel() // _ALIGN) * _ALIGN
    flat = torch.empty(off, dtype=torch.float32).share_memory_()  # [N]
    for (_, o, _), (_, t) in zip(layout, named):
        flat[o:o + t.numel()] = t.reshape(-1)
    head = torch.empty_like(bundle.lm_head_weight_t).share_memory_()  # [H, V]
    head.copy_(bundle.lm_head_weight_t)
    named16 = [(f"{i}.{f.name}", getattr(l16, f.name)) for i, l16 in enumerate(bundle.linears16) for f in fields(l16)]
    layout16, off16 = [], 0
    for name, t in named16:
        layout16.append((name, off16, tuple(t.shape)))
        off16 += -(-t.numel() // (2 * _ALIGN)) * (2 * _ALIGN)
    flat16 = torch.empty(off16, dtype=torch.bfloat16).share_memory_()  # [N16], the declared body's linears
    for (_, o, _), (_, t) in zip(layout16, named16):
        flat16[o:o + t.numel()] = t.reshape(-1)
    quant = {}
    for name in ("embed_q", "head_q"):  # the file's blocks (the q32 body, the Q8_0 head), in shared memory
        w = getattr(bundle, name)
        if w is not None and name == "head_q" and w is bundle.embed_q:
            quant[name] = quant["embed_q"]  # tied: one buffer
        elif w is not None:
            quant[name] = QuantWeight(w.fmt, w.shape, w.data.clone().share_memory_())
    return dict(flat=flat, head=head, layout=layout, flat16=flat16, layout16=layout16,
                rest=dict(config=bundle.config, tokenizer=bundle.tokenizer, path=bundle.path, **quant))


def unpack_bundle(parcel: dict) -> ModelBundle:
    """A ModelBundle of views into the parcel's buffers (no copy)."""
    if "file" in parcel:
        return load_model(parcel["file"], weights="file")
    views = {name: parcel["flat"][o:o + int(np.prod(s))].view(s) for name, o, s in parcel["layout"]}
    cfg = parcel["rest"]["config"]
    layers = tuple(LayerWeights(**{f.name: views[f"{i}.{f.name}"] for f in fields(LayerWeights)})
                   for i in range(cfg.n_layers))
    v16 = {name: parcel["flat16"][o:o + int(np.prod(s))].view(s) for name, o, s in parcel["layout16"]}
    lin16 = tuple(Linears16(**{f.name: v16[f"{i}.{f.name}"] for f in fields(Linears16)})
                  for i in range(len(parcel["layout16"]) // len(fields(Linears16))))
    return ModelBundle(embed=views["embed"], final_norm=views["final_norm"], layers=layers,
                       lm_head_weight_t=parcel["head"], linears16=lin16, **parcel["rest"])


def rank_main(rank: int, entry, parcel: dict, args: tuple, queue):
    """One rank of run_ranks (run by lmtail.launch in a spawned process): entry(bundle, rank,
    world, *args, on_step=...) on the parcel's bundle; rank 0 forwards on_step to the queue."""
    bundle = unpack_bundle(parcel)
    on_step = None
    if rank == 0 and queue is not None:
        def on_step(*item):
            queue.put(item)
    return entry(bundle, rank, dist.get_world_size(), *args, on_step=on_step)


def run_ranks(entry, bundle: ModelBundle, args: tuple, *, ranks: int, on_step=None,
              timeout_s: float) -> list:
    """entry(bundle, rank, ranks, *args, on_step=...) on `ranks` spawned gloo ranks (each
    with the caller's torch thread count); their return values in rank order. Rank 0's
    on_step(*item) calls are replayed to `on_step` in this process as they happen.
    LaunchError (lmtail.launch) when a rank fails or timeout_s passes."""
    queue = mp.get_context("spawn").SimpleQueue() if on_step is not None else None
    pump = None
    if queue is not None:
        def drain():
            while (item := queue.get()) is not None:
                on_step(*item)
        pump = threading.Thread(target=drain, daemon=True)
        pump.start()
    try:
        return launch(rank_main, ranks, args=(entry, pack_bundle(bundle), args, queue),
                      timeout_s=timeout_s, threads=torch.get_num_threads())
    finally:
        if queue is not None:
            queue.put(None)
            pump.join()


# ---------------------------------------------------------------------------------------
# one tail step over the ranks
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GatheredRows:
    """One tail step's rows as every rank holds them after rank_step (rows in call order)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32
    truncated: torch.Tensor  # [B] bool
    topk_indices: torch.Tensor  # [B, k] int64 global ids
    topk_values: torch.Tensor | None = None  # [B, k] fp32 ("candidates") or bf16 ("mirror"); None if not gathered


def pad_step(x: torch.Tensor, sp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(xp [gbs, H] fp32: x then zero rows, spp [gbs, 5] fp32: sp then greedy dummies), gbs
    = B rounded up to a multiple of n (decode_tail's layout needs n | gbs; a dummy row is
    row-independent and dropped by gathered_rows)."""
    b, hid = x.shape
    gbs = -(-b // n) * n
    xp = torch.zeros(gbs, hid, dtype=torch.float32)  # [gbs, H]
    xp[:b] = x
    spp = greedy_rows(gbs)  # [gbs, 5] padding rows
    spp[:b] = sp
    return xp, spp


def rank_step(tail, xp: torch.Tensor, spp: torch.Tensor, *, rank: int, n: int, values: bool,
              timeout: float) -> torch.Tensor:
    """Rank `rank`'s part of one padded step (collective over the default group of n ranks):
    res = tail(xp, spp[owned rows]) (decode_tail's outputs for the rows this rank owns,
    layout.owned_rows(rank, n, gbs)), then one all-gather of [R, 3 + k (+ k with values)]
    int64 per rank: token, logprob bits, truncated, top-k ids (and top-k value bits).
    Returns [gbs, 3 + k (+ k)] int64 in global row order (the bits of every rank's rows).
    ExchangeError when the all-gather fails or takes longer than timeout s."""
    gbs = xp.shape[0]
    res = tail(xp, spp[owned_rows(rank, n, gbs)])
    cols = [res.tokens[:, None], res.logprobs.view(torch.int32).to(torch.int64)[:, None],
            res.truncated.to(torch.int64)[:, None], res.topk_indices]
    if values:
        v = res.topk_values
        cols.append(v.view(torch.int32 if v.dtype == torch.float32 else torch.int16).to(torch.int64))
    mine = torch.cat(cols, dim=1).contiguous()  # [R, 3 + k (+ k)] int64, bits exact
    got = [torch.empty_like(mine) for _ in range(n)]
    work = dist.all_gather(got, mine, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except Exception as e:  # gloo raises RuntimeError on a timeout or a reset connection
        raise ExchangeError(f"rank step: the result all-gather failed on rank {rank} (timeout {timeout} s): "
                            f"a peer rank failed, died or is hanging ({type(e).__name__}: {e})") from e
    order = torch.tensor([r for q in range(n) for r in owned_rows(q, n, gbs)])  # [gbs]
    full = torch.empty(gbs, mine.shape[1], dtype=torch.int64)
    full[order] = torch.cat(got)
    return full


def gathered_rows(full: torch.Tensor, b: int, value_dtype: torch.dtype | None = None) -> GatheredRows:
    """The first b rows of rank_step's [gbs, 3 + k (+ k)] int64 (dummies dropped) as tensors,
    bits exact; value_dtype: the top-k values' dtype (torch.float32 | torch.bfloat16) when
    they were gathered (values=True), else None."""
    full = full[:b]
    k = (full.shape[1] - 3) // (1 if value_dtype is None else 2)
    vals = None
    if value_dtype is not None:
        ibits = torch.int32 if value_dtype == torch.float32 else torch.int16
        vals = full[:, 3 + k:].to(ibits).view(value_dtype).clone()
    return GatheredRows(tokens=full[:, 0].clone(), logprobs=full[:, 1].to(torch.int32).view(torch.float32).clone(),
                    truncated=full[:, 2].bool(), topk_indices=full[:, 3:3 + k].clone(), topk_values=vals)
