"""The vocab-parallel transport: bf16 [gbs, V_s] slabs in, [R, V] owned rows out.

    every rank r (of VTP) holds a [gbs, V_s] slab (its vocab shard of every row)
    slab [gbs, V_s] ==hop 0 all-to-all==> [gbs/h0, h0*V_s] ==hop 1==> ... ==> [R, V]
         split rows into h chunks, chunk i -> member i;   received slabs [h, rows/h, C]
         de-interleaved to [rows/h, h*C] (slab i = columns of member i, in member order)

    batch_groups = G (single hop): the slab is asked for row block by row block
    [g*gbs/G, (g+1)*gbs/G); block g's all-to-all is issued async as soon as the block
    exists, so it overlaps the making of blocks g+1..G-1; the G received [R/G, V] blocks
    are stacked in g order (the row order of layout.owned_rows(..., batch_groups=G)).
    On a 2-core CPU box with gloo this measured slower than G=1 (each block re-streams
    the weight shard; docs/exchange.md "Overlap"); it pays only where the exchange is a
    real share of the step.

Column order: hop t's groups are the ranks differing only in mixed-radix digit d_t
(layout.compose_hops), so after the last hop the column slabs arrive in rank order: rank
r's slab must hold the columns r*V_s .. (r+1)*V_s - 1 for EVERY hop layout. The exchange
does no arithmetic: the bytes of each slab arrive untouched (NaN payloads included).

`agree` is the generic pre-flight: every rank all-gathers a list of named int64 fields
(or None when its own inputs were rejected), so a rank with bad or disagreeing inputs
makes EVERY rank raise ValueError rather than hang. Every collective is async and waited
with `timeout` seconds: a rank that dies, raises or hangs makes the others raise
ExchangeError (naming the phase and the ranks) within `timeout`; the process group is
unusable afterwards (tear it down). What the fields mean is the caller's business
(lmtail.tail.compose builds the tail's signature).

Shape legend: gbs global batch rows, V_s vocab shard (columns a rank contributes),
V = VTP*V_s, R = gbs/VTP rows a rank owns, G batch groups, h hop size, C columns held
before a hop, F signature fields.
"""
from __future__ import annotations

import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .layout import compose_hops

DEFAULT_TIMEOUT_S = 120.0


class ExchangeError(RuntimeError):
    """A collective of the exchange failed or timed out (a peer died, raised or hangs)."""


# ---------------------------------------------------------------------------------------
# hop subgroups: built once per (parent group, hops), every rank in the same order
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HopGroups:
    """The process groups of one hop layout, as seen by this rank.

    parent: the vocab-parallel group (its rank order is the vocab shard order);
    hops: hop sizes; members[t]: the parent-group ranks of this rank's hop-t group, in
    group-rank order; groups[t]: that group's ProcessGroup (None when hops[t] == 1).
    Build with `hop_groups`; pass as `group=` to skip the registry lookup.
    """

    parent: object
    hops: tuple[int, ...]
    members: tuple[tuple[int, ...], ...]
    groups: tuple[object, ...]


# parent ProcessGroup -> {hops: (subgroup or None per hop)}; entries die with the parent.
_REGISTRY: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def parent_group(group):
    """The vocab-parallel group `group` names (None: the world); ValueError when there is
    no initialized process group or this rank is not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("the vocab-parallel path needs an initialized torch.distributed "
                         "process group (dist.init_process_group or lmtail.launch.launch)")
    parent = dist.group.WORLD if group is None else group
    if dist.get_rank(parent) < 0:  # also catches GroupMember.NON_GROUP_MEMBER
        raise ValueError(f"this rank ({dist.get_rank()}) is not a member of the given group")
    return parent


def hop_groups(group=None, hops=None, *, timeout: float = DEFAULT_TIMEOUT_S) -> HopGroups:
    """This rank's hop groups for `hops` over `group` (default: the world), cached per
    (group, hops). Collective over `group`: every member calls it with the same hops.

    A parent spanning the whole world creates every mesh group on every rank in the same
    order (torch.distributed's rule); a smaller parent creates only this rank's groups
    with use_local_synchronization=True (all members of a parent must then share the
    same group-creation history). Hops of size VTP reuse the parent; size 1 needs none.
    """
    parent = parent_group(group)
    vtp = parent.size()
    meshes = compose_hops(vtp, hops)
    hops = tuple(len(m[0]) for m in meshes)
    me = parent.rank()
    members = tuple(next(g for g in mesh if me in g) for mesh in meshes)
    cache = _REGISTRY.setdefault(parent, {})
    if hops not in cache:
        cache[hops] = _build_subgroups(parent, meshes, members, timeout)
    subs = cache[hops]
    groups = tuple(parent if h == vtp and h > 1 else s for h, s in zip(hops, subs))
    return HopGroups(parent=parent, hops=hops, members=members, groups=groups)


def _build_subgroups(parent, meshes, members, timeout):
    vtp, whole_world = parent.size(), parent.size() == dist.get_world_size()
    granks = dist.get_process_group_ranks(parent)  # parent rank -> global rank
    td = timedelta(seconds=timeout)
    subs = []
    for mesh, mine in zip(meshes, members):
        h = len(mine)
        if h == 1 or h == vtp:
            subs.append(None)
            continue
        if whole_world:
            made = [dist.new_group([granks[i] for i in g], timeout=td) for g in mesh]
            pg = made[mesh.index(mine)]
        else:
            pg = dist.new_group([granks[i] for i in mine], timeout=td,
                                use_local_synchronization=True)
        assert pg.size() == h and pg.rank() == mine.index(parent.rank()), "hop group rank order"
        subs.append(pg)
    return tuple(subs)


def _wait(work, timeout, what, members):
    try:
        work.wait(timeout=timedelta(seconds=timeout))
    except Exception as e:  # gloo/NCCL raise RuntimeError (timeout, connection reset, ...)
        rank = dist.get_rank()
        raise ExchangeError(
            f"rank {rank}: {what} over group ranks {list(members)} failed or timed out "
            f"(timeout {timeout} s): a peer rank failed, died or is hanging ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''})") from e


# ---------------------------------------------------------------------------------------
# the exchange proper: [gbs, V_s] shards -> [R, V] owned rows
# ---------------------------------------------------------------------------------------
def _hop(x, h, pg, members, timeout, what):
    """One all-to-all: x [rows, C] -> [rows/h, h*C]; slab i (from member i) -> columns i*C.."""
    if h == 1:
        return x
    rows, c = x.shape
    out = torch.empty_like(x)  # [h * rows/h, C]
    work = dist.all_to_all_single(out, x.contiguous(), group=pg, async_op=True)
    _wait(work, timeout, what, members)
    return out.view(h, rows // h, c).permute(1, 0, 2).reshape(rows // h, h * c)


def exchange_rows(make_block: Callable[[slice], torch.Tensor], *, gbs: int, group=None, hops=None,
                  batch_groups: int = 1, fence: bool = False,
                  timeout: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Move every rank's [gbs, V_s] slab so that it ends with its owned rows' full width.

    make_block(rows: slice) -> [n, V_s] (any dtype; the tail passes its bf16 mirror):
    this rank's slab for a row block; called once per batch group, in row order.
    Returns received [R, V] (R = gbs/VTP, V = VTP*V_s) in layout.owned_rows order, column
    slab i from rank i. Bytes only: every received element is a sent element, bit for bit.
    Layout is assumed validated (layout.validate_layout); collective over `group`.
    """
    hg = group if isinstance(group, HopGroups) else hop_groups(group, hops, timeout=timeout)
    if fence:
        for t, (h, pg) in enumerate(zip(hg.hops, hg.groups)):
            if h > 1:
                z = torch.zeros(1, dtype=torch.int32)
                _wait(dist.all_reduce(z, group=pg, async_op=True), timeout, f"fence {t}", hg.members[t])
                assert int(z) == 0, "fence all-reduce of zeros is zero"
    g_n, block = batch_groups, gbs // batch_groups
    if g_n == 1:
        x = make_block(slice(0, gbs))  # [gbs, V_s]
        for t, (h, pg) in enumerate(zip(hg.hops, hg.groups)):
            x = _hop(x, h, pg, hg.members[t], timeout, f"hop {t} all-to-all")
        return x  # [R, V]
    (h,), (pg,), (members,) = hg.hops, hg.groups, hg.members
    pending = []
    for g in range(g_n):  # issue block g's exchange before making block g+1
        slab = make_block(slice(g * block, (g + 1) * block)).contiguous()  # [gbs/G, V_s]
        out = torch.empty_like(slab) if h > 1 else slab
        work = dist.all_to_all_single(out, slab, group=pg, async_op=True) if h > 1 else None
        pending.append((work, out, slab))  # keep slab alive until its send completes
    recv = []
    for g, (work, out, _) in enumerate(pending):
        if work is not None:
            _wait(work, timeout, f"batch group {g} all-to-all", members)
        c = out.shape[1]
        recv.append(out.view(h, block // h, c).permute(1, 0, 2).reshape(block // h, h * c))
    return torch.cat(recv, dim=0)  # [R, V]


def gather_rows(mine: torch.Tensor, *, group, timeout: float = DEFAULT_TIMEOUT_S) -> list[torch.Tensor]:
    """All-gather a [n, P] tensor of the same shape and dtype on every rank of `group`
    (shapes agreed beforehand, e.g. by `agree`): [VTP] tensors in group-rank order.
    Collective over `group` (a ProcessGroup; the candidates exchange's pre-flight: every
    rank learns every row's sampling params)."""
    mine = mine.contiguous()
    out = [torch.empty_like(mine) for _ in range(group.size())]
    _wait(dist.all_gather(out, mine, group=group, async_op=True), timeout, "sampling params all-gather",
          range(group.size()))
    return out


# ---------------------------------------------------------------------------------------
# cross-rank agreement on named int64 fields
# ---------------------------------------------------------------------------------------
def tensor_digest(t: torch.Tensor) -> int:
    """Position-weighted int64 sum of the fp32 bit patterns of t (wraps; deterministic)."""
    bits = t.detach().reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64)
    return int((bits * torch.arange(1, bits.numel() + 1, dtype=torch.int64)).sum())


def bytes_digest(b: bytes) -> int:
    """crc32 of b as an int (for fields that are not numbers)."""
    return zlib.crc32(b)


def agree(parent, names: Sequence[str], values: Sequence[tuple[int, object]] | None,
          local_error: BaseException | None, *, what: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
    """All-gather this rank's signature: values[i] = (int64, shown value) of field names[i],
    or None when its inputs were rejected (local_error). Returns when every rank gave the
    same int64s; else raises on every rank: local_error on the rejecting rank(s), otherwise
    a ValueError naming the rejecting ranks, or each differing field with its shown value
    per rank. `names` must be the same on every rank. Collective over `parent`; a second
    (object) gather runs only on the error path."""
    assert values is None or len(values) == len(names), "one value per field"
    ints = [0] + [-1] * len(names) if values is None else [1] + [int(v) for v, _ in values]
    mine = torch.tensor(ints, dtype=torch.int64)  # [1 + F]
    sigs = [torch.empty_like(mine) for _ in range(parent.size())]
    _wait(dist.all_gather(sigs, mine, group=parent, async_op=True), timeout,
          "input signature all-gather", range(parent.size()))
    table = torch.stack(sigs)  # [VTP, 1 + F]
    rejected = [r for r in range(parent.size()) if int(table[r, 0]) == 0]
    differ = [] if rejected else [j for j in range(len(names))
                                  if not bool((table[:, j + 1] == table[0, j + 1]).all())]
    if not rejected and not differ:
        return
    shown = None if values is None else [s for _, s in values]
    notes = [None] * parent.size()
    dist.all_gather_object(notes, (str(local_error) if local_error else "", shown), group=parent)
    if local_error is not None:
        raise local_error
    if rejected:
        raise ValueError(f"{what}: rank(s) " + "; ".join(
            f"{r} rejected its inputs: {notes[r][0]}" for r in rejected) + " (no collective ran)")
    raise ValueError(f"{what}: inputs disagree across the ranks of the vocab-parallel group "
                     "(value per rank): " + "; ".join(
                         f"{names[j]}: {[notes[r][1][j] for r in range(parent.size())]}" for j in differ))
