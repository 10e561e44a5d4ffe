"""Rank layout maps (lmtail.tail.layout): coverage, mesh partitions and agreement with
an independent symbolic model of the exchange; planted wrong maps must be caught.

The symbolic model moves (row id, vocab shard id) labels through the hops exactly as
lmtail.tail.exchange moves bytes: in each hop group every member splits the rows it holds
into h consecutive chunks and sends chunk i to member i, who appends the slabs in
member order. After the last hop a rank must hold owned_rows(...) and shards 0..VTP-1.
"""
from __future__ import annotations

import ast
import itertools
from math import prod
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmtail.tail import layout
from lmtail.tail.layout import compose_hops, hop_digits, owned_row_block, owned_rows, validate_layout


# ---------------------------------------------------------------------------------------
# the checks (each takes the maps under test as arguments, so planted maps can be fed in)
# ---------------------------------------------------------------------------------------
def simulate_exchange(vtp, gbs, hops, batch_groups, meshes):
    """Per rank: (rows in receive order, vocab shard ids in column order), from the meshes."""
    g_n = batch_groups
    block = gbs // g_n
    rows_out = {r: [] for r in range(vtp)}
    cols_out = {}
    for g in range(g_n):
        rows = {r: list(range(g * block, (g + 1) * block)) for r in range(vtp)}
        cols = {r: [r] for r in range(vtp)}
        for mesh in meshes:
            new_rows, new_cols = {}, {}
            for grp in mesh:
                held = [rows[m] for m in grp]
                assert all(h == held[0] for h in held), f"members of {grp} hold different rows"
                n = len(held[0]) // len(grp)
                for i, m in enumerate(grp):
                    new_rows[m] = held[0][i * n:(i + 1) * n]
                    new_cols[m] = [c for j in grp for c in cols[j]]
            rows, cols = new_rows, new_cols
        for r in range(vtp):
            rows_out[r] += rows[r]
            cols_out[r] = cols[r]
    return rows_out, cols_out


def check_layout(vtp, gbs, hops, batch_groups=1, *, owned=owned_rows, meshes_of=compose_hops):
    """AssertionError unless the maps cover every row once and agree with the model."""
    meshes = meshes_of(vtp, hops)
    for t, mesh in enumerate(meshes):  # each hop mesh partitions the ranks
        flat = sorted(r for grp in mesh for r in grp)
        assert flat == list(range(vtp)), f"hop {t} mesh does not partition the ranks: {mesh}"
        assert all(list(grp) == sorted(grp) and len(grp) == hops[t] for grp in mesh), f"hop {t}: {mesh}"
    maps = {r: owned(r, vtp, gbs, hops, batch_groups) for r in range(vtp)}
    every = sorted(x for m in maps.values() for x in m)
    assert every == list(range(gbs)), f"rows not covered exactly once: {maps}"
    assert all(len(m) == gbs // vtp for m in maps.values()), f"uneven ownership: {maps}"
    rows, cols = simulate_exchange(vtp, gbs, hops, batch_groups, meshes)
    for r in range(vtp):
        assert rows[r] == maps[r], f"rank {r}: the exchange delivers rows {rows[r]}, the map says {maps[r]}"
        assert cols[r] == list(range(vtp)), f"rank {r}: columns arrive as shards {cols[r]}, not in rank order"


@st.composite
def layouts(draw):
    hops = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    vtp = prod(hops)
    g_n = draw(st.sampled_from([1, 2, 3, 4])) if len(hops) == 1 else 1
    r = g_n * draw(st.integers(1, 3))
    return vtp, vtp * r, hops, g_n


# ---------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(layouts())
def test_every_row_owned_once_and_exchange_agrees(lay):
    vtp, gbs, hops, g_n = lay
    check_layout(vtp, gbs, hops, g_n)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_hop_groups_are_digit_classes(lay):
    """Hop t's group of a rank = the ranks that differ from it only in digit d_t, listed
    by d_t; the row block start is the mixed-radix sum of the digits."""
    vtp, gbs, hops, _ = lay
    meshes = compose_hops(vtp, hops)
    for r in range(vtp):
        d = hop_digits(r, vtp, hops)
        for t, mesh in enumerate(meshes):
            grp = next(g for g in mesh if r in g)
            assert grp.index(r) == d[t]
            others = [hop_digits(m, vtp, hops) for m in grp]
            assert all(o[:t] + o[t + 1:] == d[:t] + d[t + 1:] for o in others)
        spans = [gbs // prod(hops[:t + 1]) for t in range(len(hops))]
        assert tuple(owned_row_block(r, vtp, gbs, hops)) == (sum(a * b for a, b in zip(d, spans)), gbs // vtp)


def test_spec_examples():
    m = compose_hops(128, (8, 16))
    assert len(m[0]) == 16 and m[0][0] == tuple(range(8)) and m[0][1] == tuple(range(8, 16))
    assert len(m[1]) == 8 and m[1][0] == tuple(range(0, 128, 8)) and m[1][7] == tuple(range(7, 128, 8))
    assert [owned_row_block(r, 4, 12) for r in range(4)] == [layout.RowBlock(s, 3) for s in (0, 3, 6, 9)]
    assert [tuple(owned_row_block(r, 8, 16, (2, 4))) for r in range(4)] == [(0, 2), (8, 2), (2, 2), (10, 2)]
    assert owned_rows(1, 2, 8, None, 2) == [2, 3, 6, 7]
    assert owned_rows(1, 4, 16, (4,), 1) == [4, 5, 6, 7]
    assert owned_rows(3, 4, 16, (2, 2)) == list(range(12, 16))  # d = (1, 1): 8 + 4


# ---------------------------------------------------------------------------------------
# planted wrong maps: the same checks must go red
# ---------------------------------------------------------------------------------------
def _off_by_one(rank, vtp, gbs, hops=None, batch_groups=1):
    return [x + 1 for x in owned_rows(rank, vtp, gbs, hops, batch_groups)]


def _rows_hops_reversed(rank, vtp, gbs, hops=None, batch_groups=1):
    return owned_rows(rank, vtp, gbs, None if hops is None else tuple(reversed(hops)), batch_groups)


def _meshes_reversed(vtp, hops):
    return tuple(reversed(compose_hops(vtp, tuple(reversed(hops)))))


def _group_inner_digit(rank, vtp, gbs, hops=None, batch_groups=1):
    """batch group as the INNER digit: [start + g*R/G + j] (a contiguous block again)."""
    start, n = owned_row_block(rank, vtp, gbs, hops)
    return list(range(start, start + n))


GRID = [(h, r, g) for h in [(2,), (4,), (2, 2), (2, 4), (4, 2), (2, 3), (3, 2, 2), (2, 2, 2)]
        for r in (1, 2, 4) for g in (1, 2, 4) if r % g == 0 and (g == 1 or len(h) == 1)]


@pytest.mark.parametrize("planted", [_off_by_one, _rows_hops_reversed, _meshes_reversed, _group_inner_digit])
def test_planted_maps_are_caught(planted):
    caught = total = 0
    for hops, r, g in GRID:
        vtp = prod(hops)
        if planted is _meshes_reversed:
            kw = dict(meshes_of=planted)
        else:
            kw = dict(owned=planted)
        should = {_off_by_one: True, _rows_hops_reversed: hops != hops[::-1],
                  _meshes_reversed: len(hops) > 1, _group_inner_digit: g > 1}[planted]
        check_layout(vtp, vtp * r, hops, g)  # the real maps pass on this layout
        try:
            check_layout(vtp, vtp * r, hops, g, **kw)
        except AssertionError:
            caught += 1
            assert should, f"{planted.__name__} flagged on {hops, r, g} where it is harmless"
        else:
            assert not should, f"{planted.__name__} NOT caught on hops={hops}, R={r}, G={g}"
        total += should
    assert caught == total > 0


# ---------------------------------------------------------------------------------------
# invalid layouts
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("call, match", [
    (lambda: compose_hops(8, (2, 2)), r"multiply to vtp=8; got hops=\(2, 2\) \(product 4\)"),
    (lambda: compose_hops(4, (4, 0)), r"hop size must be an int >= 1; got hops=\(4, 0\)"),
    (lambda: compose_hops(4, (-2, -2)), r"hop size must be an int >= 1"),
    (lambda: compose_hops(4, ()), r"at least one hop"),
    (lambda: compose_hops(4, (2.0, 2)), r"hop size must be an int"),
    (lambda: compose_hops(0, None), r"vtp must be an int >= 1; got 0"),
    (lambda: owned_row_block(0, 4, 10), r"gbs must be divisible by vtp=4; got gbs=10"),
    (lambda: owned_row_block(4, 4, 8), r"rank must be in \[0, vtp=4\); got 4"),
    (lambda: owned_row_block(-1, 4, 8), r"rank must be in \[0, vtp=4\); got -1"),
    (lambda: owned_rows(0, 2, 8, None, 3), r"batch_groups must divide R = gbs/vtp = 4; got batch_groups=3"),
    (lambda: owned_rows(0, 4, 16, (2, 2), 2), r"batch_groups > 1 needs a single hop; got hops=\(2, 2\)"),
    (lambda: owned_rows(0, 2, 8, None, 0), r"batch_groups must be an int >= 1; got 0"),
    (lambda: owned_rows(0, 2, 0), r"gbs must be an int >= 1; got 0"),
    (lambda: hop_digits(8, 8, (2, 4)), r"rank must be in \[0, vtp=8\)"),
    (lambda: validate_layout(6, 12, (2, 2)), r"multiply to vtp=6"),
])
def test_invalid_layouts_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_layout_imports_no_torch():
    tree = ast.parse(Path(layout.__file__).read_text())
    mods = {n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in (n.names if isinstance(n, ast.Import) else [None])}
    assert mods <= {"__future__", "math", "dataclasses"}, mods


def test_small_grid_exhaustive():
    """Every hop factorization of VTP <= 8 with R <= 4 and valid G."""
    def factorizations(n):
        if n == 1:
            return [()]
        return [(h,) + rest for h in range(2, n + 1) if n % h == 0 for rest in factorizations(n // h)]
    for vtp in range(1, 9):
        for hops in factorizations(vtp) or [(1,)]:
            hops = hops or (1,)
            for r, g in itertools.product((1, 2, 3, 4), (1, 2, 4)):
                if r % g == 0 and (g == 1 or len(hops) == 1):
                    check_layout(vtp, vtp * r, hops, g)
