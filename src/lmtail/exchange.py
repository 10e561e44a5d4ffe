"""The vocab-parallel decode tail: one bf16 all-to-all per hop (SPEC 1 and 5).

    every rank r (of VTP)                                    rank r after the last hop
    hidden [gbs, H] (the same on all ranks)
      | shard_logits (norm + GEMM, this rank's W [H, V_s])
      v
    logits [gbs, V_s] fp32 --(emit_logits)--> returned as is
      | bf16 mirror
      v
    mirror [gbs, V_s] bf16 ==hop 0 all-to-all==> [gbs/h0, h0*V_s] ==hop 1==> ... ==> [R, V]
         split rows into h chunks, chunk i -> member i;   received slabs [h, rows/h, C]
         de-interleaved to [rows/h, h*C] (slab i = columns of member i, in member order)
                                                              | rows_tail (top-k, sampler)
                                                              v
                                               topk/tokens/logprobs for owned_rows(r)

    batch_groups = G (single hop): the GEMM runs row block by row block
    [g*gbs/G, (g+1)*gbs/G); block g's all-to-all is issued async as soon as its logits
    exist, so it overlaps the GEMM of blocks g+1..G-1; the G received [R/G, V] blocks are
    stacked in g order (the row order of layout.owned_rows(..., batch_groups=G)).
    On a 2-core CPU box with gloo this measured slower than G=1 (each block re-streams
    the weight shard; docs/exchange.md "Overlap"); it pays only where the exchange is a
    real share of the step.

Vocab shard id: rank r's `lm_head_weight_t` must be the shard of vocab ids
r*V_s .. (r+1)*V_s - 1 (r = rank in `group`) for EVERY hop layout: hop t's groups are the
ranks differing only in mixed-radix digit d_t (layout.compose_hops), so after the last
hop the column slabs arrive in rank order (see layout's docstring). The exchange only
moves bf16 bytes (no arithmetic), so every output is bitwise the single-rank
decode_tail's on the same global inputs, for any VTP, hops and G.

Before any byte moves: the layout is validated locally (ValueError before any
collective); the inputs are validated locally and a small int64 signature (shapes,
dtypes, eps, flags, hops, checksums of hidden_states and gamma) is all-gathered, so a
rank with bad or disagreeing inputs makes EVERY rank raise ValueError rather than hang.
Every collective is async and waited with `timeout` seconds: a rank that dies, raises
or hangs makes the others raise ExchangeError (naming the phase and the ranks) within
`timeout`; the process group is unusable afterwards (tear it down).

Shape legend: gbs global batch rows, H hidden, V_s vocab shard, V = VTP*V_s full vocab,
R = gbs/VTP rows a rank owns, G batch groups, h hop size, C columns held before a hop.
"""
from __future__ import annotations

import struct
import weakref
import zlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .layout import compose_hops, owned_rows, validate_layout

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


def _parent_group(group):
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("the vocab-parallel tail needs an initialized torch.distributed "
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
    parent = _parent_group(group)
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


def exchange_rows(row_logits, *, gbs, group=None, hops=None, batch_groups=1, fence=False,
                  timeout: float = DEFAULT_TIMEOUT_S):
    """Move each rank's bf16 mirror so that it ends with its owned rows' full vocab.

    row_logits(rows: slice) -> [n, V_s] fp32: this rank's shard logits of a row block
    (row-independent). Returns (received [R, V] bf16 in owned_rows order, vocab order;
    logits [gbs, V_s] fp32 as computed). The only arithmetic is the bf16 rounding of the
    mirror; the rest is byte movement. Layout is assumed validated; collective over group.
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
        logits = row_logits(slice(0, gbs))  # [gbs, V_s] fp32
        x = logits.to(torch.bfloat16)  # [gbs, V_s] mirror
        for t, (h, pg) in enumerate(zip(hg.hops, hg.groups)):
            x = _hop(x, h, pg, hg.members[t], timeout, f"hop {t} all-to-all")
        return x, logits  # [R, V], [gbs, V_s]
    (h,), (pg,), (members,) = hg.hops, hg.groups, hg.members
    parts, pending = [], []
    for g in range(g_n):  # issue block g's exchange before computing block g+1
        lg = row_logits(slice(g * block, (g + 1) * block))  # [gbs/G, V_s]
        mirror = lg.to(torch.bfloat16).contiguous()  # [gbs/G, V_s]
        out = torch.empty_like(mirror) if h > 1 else mirror
        work = dist.all_to_all_single(out, mirror, group=pg, async_op=True) if h > 1 else None
        parts.append(lg)
        pending.append((work, out, mirror))  # keep mirror alive until its send completes
    recv = []
    for g, (work, out, _) in enumerate(pending):
        if work is not None:
            _wait(work, timeout, f"batch group {g} all-to-all", members)
        c = out.shape[1]
        recv.append(out.view(h, block // h, c).permute(1, 0, 2).reshape(block // h, h * c))
    return torch.cat(recv, dim=0), torch.cat(parts, dim=0)  # [R, V], [gbs, V_s]


# ---------------------------------------------------------------------------------------
# cross-rank input agreement
# ---------------------------------------------------------------------------------------
_SIG_FIELDS = ("ok", "gbs", "H", "V_s", "k", "hidden dtype", "gamma dtype", "weight dtype",
               "hidden_actual", "zero_interleaved_pad", "eps", "deferred_rms", "nan_fold",
               "sampling_params columns", "batch_groups", "fence", "hops",
               "hidden_states checksum", "gamma checksum")
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}


def _checksum(t: torch.Tensor) -> int:
    """Position-weighted int64 sum of the fp32 bit patterns (wraps; deterministic)."""
    bits = t.detach().reshape(-1).to(torch.float32).view(torch.int32).to(torch.int64)
    return int((bits * torch.arange(1, bits.numel() + 1, dtype=torch.int64)).sum())


def _signature(ok, hidden, gamma, weight, *, k, hidden_actual, zero_interleaved_pad, eps,
               deferred_rms, nan_fold, sampling_params, batch_groups, fence, hops):
    if not ok:
        return [0] + [-1] * (len(_SIG_FIELDS) - 1)
    gbs, h = hidden.shape
    return [1, gbs, h, weight.shape[1], int(k), _DTYPES.get(hidden.dtype, 0),
            _DTYPES.get(gamma.dtype, 0), 4 if weight.dtype == torch.bfloat16 else 0,
            h if hidden_actual is None else int(hidden_actual), int(bool(zero_interleaved_pad)),
            struct.unpack("<q", struct.pack("<d", float(eps)))[0], int(bool(deferred_rms)),
            int(bool(nan_fold)), 0 if sampling_params is None else sampling_params.shape[1],
            int(batch_groups), int(bool(fence)), zlib.crc32(repr(tuple(hops)).encode()),
            _checksum(hidden), _checksum(gamma)]


def _agree(parent, sig, local_error, hops, timeout):
    """All-gather the signatures; ValueError on every rank if any rank rejected its inputs
    or any field differs. A second (object) gather runs only on that error path."""
    mine = torch.tensor(sig, dtype=torch.int64)  # [F]
    sigs = [torch.empty_like(mine) for _ in range(parent.size())]
    _wait(dist.all_gather(sigs, mine, group=parent, async_op=True), timeout,
          "input signature all-gather", range(parent.size()))
    table = torch.stack(sigs)  # [VTP, F]
    rejected = [r for r in range(parent.size()) if int(table[r, 0]) == 0]
    differ = [] if rejected else [f for j, f in enumerate(_SIG_FIELDS)
                                  if not bool((table[:, j] == table[0, j]).all())]
    if not rejected and not differ:
        return
    notes = [None] * parent.size()
    dist.all_gather_object(notes, (str(local_error) if local_error else "", tuple(hops)), group=parent)
    if local_error is not None:
        raise local_error
    if rejected:
        raise ValueError("decode_tail_parallel: rank(s) " + "; ".join(
            f"{r} rejected its inputs: {notes[r][0]}" for r in rejected) + " (no collective ran)")
    per_rank = {f: [notes[r][1] if f == "hops" else int(table[r, _SIG_FIELDS.index(f)])
                    for r in range(parent.size())] for f in differ}
    raise ValueError("decode_tail_parallel: inputs disagree across the ranks of the "
                     "vocab-parallel group (value per rank): " +
                     "; ".join(f"{f}: {v}" for f, v in per_rank.items()))


# ---------------------------------------------------------------------------------------
# the public entry point
# ---------------------------------------------------------------------------------------
def decode_tail_parallel(hidden_states, gamma, lm_head_weight_t, *, eps=1e-5, hidden_actual=None,
                         zero_interleaved_pad=True, k=256, sampling_params=None, group=None,
                         hops=None, batch_groups=1, fence=False, emit_logits=True,
                         debug_taps=False, deferred_rms=True, nan_fold=False,
                         timeout: float = DEFAULT_TIMEOUT_S):
    """decode_tail over a vocab-parallel group (SPEC 1, 4, 5). Collective over `group`.

    hidden_states [gbs, H] and gamma: the same on every rank. lm_head_weight_t [H, V_s]
    bf16: rank r's shard (vocab ids r*V_s ..). sampling_params [R, 3|4|5] fp32: this
    rank's rows, in layout.owned_rows(r, VTP, gbs, hops, batch_groups) order.
    group: a ProcessGroup (default: the world) or a HopGroups; hops: sizes multiplying to
    VTP (default one hop). batch_groups G: G overlapped single-hop collectives. fence: a
    zero all-reduce per hop mesh first (outputs unchanged). timeout: seconds any one
    collective may take before ExchangeError.
    Returns TailOutput: logits [gbs, V_s] fp32 (this rank's shard, if emit_logits);
    topk_values [R, k] bf16, topk_indices [R, k] int64 global ids, tokens/logprobs/
    truncated [R] (with sampling_params), taps (debug_taps) for the owned rows; all
    bitwise equal to the owned rows of the single-rank decode_tail on the same inputs.
    """
    from .tail import TailOutput, rows_tail, shard_logits, validate_tail_inputs

    hg = group if isinstance(group, HopGroups) else None
    parent = _parent_group(hg.parent if hg else group)
    vtp = parent.size()
    if hg is not None and hops is not None and tuple(hops) != hg.hops:
        raise ValueError(f"hops must match the HopGroups given as group ({hg.hops}); got {tuple(hops)}")
    hops = hg.hops if hg else hops
    layout_hops = validate_layout(vtp, vtp * batch_groups, hops, batch_groups)  # gbs-free checks
    shapes_ok = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (hidden_states, lm_head_weight_t))
    gbs = hidden_states.shape[0] if shapes_ok else None
    if gbs:
        validate_layout(vtp, gbs, layout_hops, batch_groups)  # raises before any collective
    local_error = None
    try:  # a rank's bad inputs become a ValueError on every rank (via the signature)
        validate_tail_inputs(hidden_states, gamma, lm_head_weight_t, eps=eps, hidden_actual=hidden_actual,
                             zero_interleaved_pad=zero_interleaved_pad, k=k, sampling_params=sampling_params,
                             vocab_size=lm_head_weight_t.shape[1] * vtp if shapes_ok else 1,
                             rows=gbs // vtp if gbs else None)
    except ValueError as e:
        local_error = e
    sig = _signature(local_error is None, hidden_states, gamma, lm_head_weight_t, k=k,
                     hidden_actual=hidden_actual, zero_interleaved_pad=zero_interleaved_pad,
                     eps=eps, deferred_rms=deferred_rms, nan_fold=nan_fold,
                     sampling_params=sampling_params, batch_groups=batch_groups, fence=fence,
                     hops=layout_hops)
    _agree(parent, sig, local_error, layout_hops, timeout)

    def row_logits(rows):
        return shard_logits(hidden_states, gamma, lm_head_weight_t, eps=eps, hidden_actual=hidden_actual,
                            zero_interleaved_pad=zero_interleaved_pad, deferred_rms=deferred_rms, rows=rows)

    recv, logits = exchange_rows(row_logits, gbs=gbs, group=hg or parent, hops=layout_hops,
                                 batch_groups=batch_groups, fence=fence, timeout=timeout)
    assert recv.shape == (gbs // vtp, lm_head_weight_t.shape[1] * vtp), "received [R, V]"
    out = rows_tail(recv, k=k, sampling_params=sampling_params, nan_fold=nan_fold, debug_taps=debug_taps)
    return TailOutput(logits=logits if emit_logits else None, **out)


def owned_rows_of(group=None, *, gbs, hops=None, batch_groups=1) -> list[int]:
    """layout.owned_rows for this rank of `group` (default: the world)."""
    parent = _parent_group(group)
    return owned_rows(parent.rank(), parent.size(), gbs, hops, batch_groups)
