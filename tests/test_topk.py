"""Exact top-k: ties to the lower id, +-inf ordinary, NaN folded, staged == exact."""
import numpy as np
import pytest
import torch

from lmtail.reference.tail import topk_ref
from lmtail.tail.topk import exact_topk, mono_keys, mono_to_bf16


def tie_heavy_rows(r, v, seed, levels=7):
    """bf16 rows drawn from few levels, so ties are everywhere."""
    g = torch.Generator().manual_seed(seed)
    lv = torch.randn(levels, generator=g)
    return lv[torch.randint(0, levels, (r, v), generator=g)].to(torch.bfloat16)


def check_against_ref(vals, ids, x, k, nan_fold=True):
    rv, ri = topk_ref(x.float(), k, nan_fold=nan_fold)
    assert np.array_equal(ids.numpy(), ri), "ids differ from the float64 reference"
    got = vals.float().numpy()
    assert np.array_equal(np.isnan(got), np.isnan(rv))
    assert np.array_equal(np.nan_to_num(got, nan=7.0), np.nan_to_num(rv, nan=7.0))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("r,v,k,chunk", [(1, 1, 1, 4), (3, 37, 5, 8), (4, 1001, 64, 128),
                                         (2, 300, 300, 64), (5, 513, 17, 512), (1, 64, 64, 64)])
def test_topk_matches_reference_with_ties(seed, r, v, k, chunk):
    x = tie_heavy_rows(r, v, seed)
    vals, ids, _ = exact_topk(x, k=k, chunk=chunk)
    check_against_ref(vals, ids, x, k)


def test_staged_equals_single_stage():
    x = tie_heavy_rows(6, 5000, 3, levels=40)
    ref = exact_topk(x, k=256, chunk=10**6)
    for chunk in (1, 7, 256, 1024, 4096):
        got = exact_topk(x, k=256, chunk=chunk)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0].view(torch.int16), ref[0].view(torch.int16))


def test_infinities_are_ordinary_and_padding_never_wins():
    inf = float("inf")
    x = torch.tensor([[-inf, 1.0, inf, -inf, inf, 0.0, -0.0]], dtype=torch.bfloat16)
    vals, ids, _ = exact_topk(x, k=7, chunk=4)  # 7 lanes in chunks of 4: one pad lane of -inf
    assert ids.tolist() == [[2, 4, 1, 5, 6, 0, 3]]
    assert vals.float().tolist() == [[inf, inf, 1.0, 0.0, 0.0, -inf, -inf]]


def test_nan_fold_ranks_nan_below_everything():
    nan = float("nan")
    x = torch.tensor([[nan, -float("inf"), 2.0, nan, -1.0]], dtype=torch.bfloat16)
    vals, ids, _ = exact_topk(x, k=5, nan_fold=True)
    assert ids.tolist() == [[2, 4, 1, 0, 3]]
    assert torch.isnan(vals[0, 3:]).all()
    # without the fold the answer is unspecified but must not crash
    exact_topk(x, k=3, nan_fold=False)


def test_negative_nan_bits_fold_too():
    x = torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16)
    x.view(torch.int16)[0, 0] = -1  # 0xFFFF: a negative NaN
    _, ids, _ = exact_topk(x, k=2, nan_fold=True)
    assert ids.tolist() == [[1, 0]]


def test_mono_keys_roundtrip_and_monotone():
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)[None]
    finite = torch.isfinite(x.float()) | torch.isinf(x.float())
    keys = mono_keys(x, nan_fold=False)
    back = mono_to_bf16(keys)
    same = (back.view(torch.int16) == x.view(torch.int16)) | (x.float() == 0)
    assert same[finite].all()
    f = x.float()[finite]
    kk = keys[finite]
    order = torch.argsort(kk)
    assert (f[order][1:] >= f[order][:-1]).all()


def test_taps_expose_stage_results():
    x = tie_heavy_rows(2, 100, 5, levels=50)
    vals, ids, taps = exact_topk(x, k=8, chunk=32, debug_taps=True)
    assert taps["stage1_ids"].shape == (2, 4, 8)
    # each real stage-1 id is its chunk's lane: chunk * 32 + position (the last chunk
    # holds 4 real lanes, so 4 of its 8 stage-1 picks are pad lanes past the vocab)
    base = torch.arange(4)[None, :, None] * 32
    real = taps["stage1_ids"] < 100
    assert real.sum() == 2 * (3 * 8 + 4)
    assert torch.equal(taps["stage1_ids"][real], (base + taps["stage1_positions"])[real])
    assert set(ids[0].tolist()) <= set(taps["stage1_ids"][0].flatten().tolist())


def test_planted_ties_to_higher_id_is_caught():
    """A top-k that breaks ties toward the higher id must fail the reference check."""
    x = tie_heavy_rows(3, 200, 9, levels=3)
    vals, ids, _ = exact_topk(x.flip(1), k=20)
    wrong_ids = 199 - ids  # ties resolved from the other end
    with pytest.raises(AssertionError):
        check_against_ref(vals, wrong_ids, x, 20)


@pytest.mark.parametrize("k", [0, 101])
def test_k_out_of_range(k):
    with pytest.raises(ValueError, match=r"k must be in \[1, V=100\]"):
        exact_topk(tie_heavy_rows(1, 100, 0), k=k)


def test_row_independence():
    x = tie_heavy_rows(64, 700, 11, levels=30)
    full = exact_topk(x, k=32, chunk=128)
    for i in (0, 7, 63):
        solo = exact_topk(x[i:i + 1], k=32, chunk=128)
        assert torch.equal(solo[1], full[1][i:i + 1])
