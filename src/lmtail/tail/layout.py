"""Rank layout of the vocab-parallel exchange: pure integer maps (no torch).

A decode step starts with every rank holding all `gbs` rows of its own vocab shard and
ends with every rank holding all `V` columns of the rows it owns. The exchange is a
sequence of all-to-all hops whose sizes multiply to VTP; these functions say which ranks
talk in each hop (`compose_hops`) and which rows a rank owns at the end
(`owned_row_block`, `owned_rows`). lmtail.tail.exchange moves the bytes; these maps are the
contract it is tested against.

Mixed radix. Write rank r in digits of the hop sizes, hop 0 least significant:
    r = d_0 + h_0*(d_1 + h_1*(d_2 + ...)),   d_t = (r // (h_0*...*h_{t-1})) % h_t
Hop t's groups are the ranks that differ only in digit d_t (stride h_0*...*h_{t-1}).
Rows go the other way round: hop 0 splits the batch into h_0 blocks and member d_0 keeps
block d_0, hop 1 splits that block into h_1 and so on, so
    row_start = sum_t d_t * gbs / (h_0*...*h_t),   n_rows = R = gbs / VTP.
Columns: after hop t a rank holds the shards of the h_0*...*h_t ranks that share its
higher digits, concatenated in rank order, so after the last hop the column blocks are
the shards of ranks 0..VTP-1 in rank order: the vocab shard id of rank r is r itself for
every hop layout (shard r holds vocab ids r*V_s .. (r+1)*V_s - 1).

Batch groups (G > 1, single hop only): the exchange runs as G collectives over the row
blocks [g*gbs/G, (g+1)*gbs/G); group g is one more, outermost digit, so rank r owns rows
g*gbs/G + r*R/G + j for g < G, j < R/G, received group by group.

Shape legend: gbs global batch rows, VTP ranks in the vocab-parallel group,
R = gbs / VTP rows a rank owns, G batch groups, h_t hop sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod


@dataclass(frozen=True)
class RowBlock:
    """owned_row_block's result, a frozen dataclass like every lmtail result (read by
    field name; also unpacks as `start, rows = ...`, in field order)."""

    start: int  # the first global row the rank owns
    rows: int  # R = gbs / VTP rows, contiguous

    def __iter__(self):
        return iter((self.start, self.rows))


def _norm_hops(vtp: int, hops) -> tuple[int, ...]:
    """Validated hop sizes (None means one hop of vtp)."""
    if not isinstance(vtp, int) or isinstance(vtp, bool) or vtp < 1:
        raise ValueError(f"vtp must be an int >= 1; got {vtp!r}")
    if hops is None:
        return (vtp,)
    try:
        hops = tuple(hops)
    except TypeError:
        raise ValueError(f"hops must be a sequence of ints; got {hops!r}") from None
    if not hops:
        raise ValueError("hops must name at least one hop; got ()")
    for h in hops:
        if not isinstance(h, int) or isinstance(h, bool) or h < 1:
            raise ValueError(f"every hop size must be an int >= 1; got hops={hops}")
    if prod(hops) != vtp:
        raise ValueError(f"hop sizes must multiply to vtp={vtp}; got hops={hops} (product {prod(hops)})")
    return hops


def _check_rank(rank: int, vtp: int) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < vtp:
        raise ValueError(f"rank must be in [0, vtp={vtp}); got {rank!r}")


def validate_layout(vtp: int, gbs: int, hops=None, batch_groups: int = 1) -> tuple[int, ...]:
    """ValueError unless (vtp, gbs, hops, batch_groups) is a valid layout; returns hops.

    Valid: hop sizes >= 1 multiplying to vtp; gbs >= 1 divisible by vtp; batch_groups
    G >= 1 dividing R = gbs/vtp; G > 1 only with a single hop.
    """
    hops = _norm_hops(vtp, hops)
    if not isinstance(gbs, int) or isinstance(gbs, bool) or gbs < 1:
        raise ValueError(f"gbs must be an int >= 1; got {gbs!r}")
    if gbs % vtp:
        raise ValueError(f"gbs must be divisible by vtp={vtp}; got gbs={gbs}")
    g = batch_groups
    if not isinstance(g, int) or isinstance(g, bool) or g < 1:
        raise ValueError(f"batch_groups must be an int >= 1; got {g!r}")
    r = gbs // vtp
    if r % g:
        raise ValueError(f"batch_groups must divide R = gbs/vtp = {r}; got batch_groups={g}")
    if g > 1 and len(hops) > 1:
        raise ValueError(f"batch_groups > 1 needs a single hop; got hops={hops}, batch_groups={g}")
    return hops


def compose_hops(vtp: int, hops) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Replica-group meshes, one per hop: mesh t is a tuple of groups (sorted rank tuples).

    stride starts at 1; for hop size h the groups are (base + i*stride for i < h) for
    every base with (base // stride) % h == 0, in increasing base order; then stride *= h.
    Each mesh partitions range(vtp). hops=(8, 16): hop 0 is 16 groups of 8 contiguous
    ranks, hop 1 is 8 groups of 16 ranks at stride 8.
    """
    hops = _norm_hops(vtp, hops)
    meshes, stride = [], 1
    for h in hops:
        mesh = tuple(tuple(base + i * stride for i in range(h))
                     for base in range(vtp) if (base // stride) % h == 0)
        meshes.append(mesh)
        stride *= h
    return tuple(meshes)


def hop_digits(rank: int, vtp: int, hops=None) -> tuple[int, ...]:
    """The mixed-radix digits (d_0, d_1, ...) of rank: d_t is its position in its hop-t group."""
    hops = _norm_hops(vtp, hops)
    _check_rank(rank, vtp)
    digits, stride = [], 1
    for h in hops:
        digits.append((rank // stride) % h)
        stride *= h
    return tuple(digits)


def owned_row_block(rank: int, vtp: int, gbs: int, hops=None) -> RowBlock:
    """RowBlock(start, rows) of the contiguous row block rank owns after all hops (G = 1).

    span = gbs; start = 0; for each hop h (digit d): span //= h; start += d * span.
    A single hop gives RowBlock(rank * R, R). hops default None: one hop of size vtp.
    """
    hops = validate_layout(vtp, gbs, hops)
    _check_rank(rank, vtp)
    span, start = gbs, 0
    for d, h in zip(hop_digits(rank, vtp, hops), hops):
        span //= h
        start += d * span
    return RowBlock(start, gbs // vtp)


def owned_rows(rank: int, vtp: int, gbs: int, hops=None, batch_groups: int = 1) -> list[int]:
    """The global rows rank owns, in receive order (the row order of its [R, V] matrix
    and of its sampling_params).

    G = 1: range(row_start, row_start + R) from owned_row_block.
    G > 1 (single hop): [g*gbs/G + start/G + j for g < G for j < R/G], start = rank*R.
    """
    hops = validate_layout(vtp, gbs, hops, batch_groups)
    start, n = owned_row_block(rank, vtp, gbs, hops)
    g_n = batch_groups
    per = n // g_n
    return [g * (gbs // g_n) + start // g_n + j for g in range(g_n) for j in range(per)]
