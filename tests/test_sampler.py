"""The sampler: HF-equal kept sets, exact inverse-transform draws, flags, errors."""
import math

import numpy as np
import pytest
import torch

from conftest import bits

from lmtail.numerics import draw_u
from lmtail.reference.tail import sampler_ref
from lmtail.kernels.tail.rowmass import sum64
from lmtail.tail.sampler import SamplingParams, draw, running_sum64, sample_rows, sampling_plan, sampling_tensor, validate_params
from lmtail.tail.topk import exact_topk


def run(rows, params, k=None, nan_fold=False):
    """rows [R, V] bf16, params [R, P] -> (tokens, logprobs, truncated, plan, ids)."""
    rows = rows.to(torch.bfloat16)
    k = k or rows.shape[1]
    vals, ids, _ = exact_topk(rows, k=k, nan_fold=nan_fold)
    sp = torch.tensor(params, dtype=torch.float32)
    tok, lp, tr = sample_rows(vals, ids, rows, sp, nan_fold=nan_fold)
    plan = sampling_plan(vals, rows, sp, nan_fold=nan_fold)
    return tok, lp, tr, plan, ids


def hf_warpers(row, top_k, top_p, temperature):
    """Hugging Face's documented warper semantics, written out in float64 torch:
    temperature, TopK (remove scores < the k-th largest), TopP (sort ascending, remove
    tokens whose ascending cumulative probability is <= 1 - top_p, keep at least 1).
    Returns the probability of every token after the warpers (0 = removed)."""
    s = row.double() / temperature
    if top_k > 0:
        kth = torch.topk(s, min(top_k, s.numel())).values[-1]
        s = torch.where(s < kth, torch.full_like(s, -math.inf), s)
    if top_p < 1.0:
        # stable ascending sort with ties ordered so that the lower id counts as larger
        ids = torch.arange(s.numel())
        order = sorted(range(s.numel()), key=lambda i: (s[i].item(), -ids[i].item()))
        order = torch.tensor(order)
        probs = torch.softmax(s[order], 0)
        cum = torch.cumsum(probs, 0)
        remove = cum <= (1 - top_p)
        remove[-1] = False
        s = s.clone()
        s[order[remove]] = -math.inf
    return torch.softmax(s, 0)


HAND_ROWS = [
    [3.0, 1.0, 3.0, 2.0, 2.0, 0.0, -1.0, 2.0],
    [0.5, 0.5, 0.5, 0.5, 0.25, 0.25, 0.0, -4.0],
    [8.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0],
]
HAND_PARAMS = [(k, p, t) for k in (0, 1, 2, 3, 5, 8) for p in (0.3, 0.5, 0.75, 0.9, 1.0) for t in (0.5, 1.0, 2.0)]


@pytest.mark.parametrize("row", HAND_ROWS)
def test_kept_set_and_probs_equal_hf_warpers(row):
    x = torch.tensor([row] * len(HAND_PARAMS), dtype=torch.bfloat16)
    params = [(k, p, t, 0.5) for k, p, t in HAND_PARAMS]
    _, _, _, plan, ids = run(x, params)
    for i, (k, p, t) in enumerate(HAND_PARAMS):
        hf = hf_warpers(x[i].float(), k, p, t)
        kept = ids[i][plan["keep"][i]].tolist()
        assert sorted(kept) == torch.nonzero(hf > 0)[:, 0].tolist(), (row, k, p, t)
        # renormalized kept probabilities agree with HF's to float64 rounding
        pk = plan["p"][i][plan["keep"][i]]
        assert torch.allclose(pk / pk.sum(), hf[ids[i][plan["keep"][i]]], rtol=1e-12, atol=0)


def test_threshold_ties_survive_top_k():
    x = torch.tensor([[5.0, 4.0, 4.0, 4.0, 1.0]])
    _, _, _, plan, ids = run(x, [(2, 1.0, 1.0)])
    assert ids[0][plan["keep"][0]].tolist() == [0, 1, 2, 3]


def _crossing_kept(plan, ids) -> bool:
    """The check: probs 0.5, 0.25, 0.25, top_p = 0.6, u = 0.9 keeps [0, 1] (the crossing
    token 1 is kept) and draws token 1 (cdf over the kept: 2/3, 1)."""
    return ids[0][plan["keep"][0]].tolist() == [0, 1] and ids[0][draw(plan)].tolist() == [1]


def test_crossing_token_is_kept_and_planted_drop_is_caught():
    # probs 0.5, 0.25, 0.25 (exact): top_p = 0.6 -> mass before slot 1 is 0.5 < 0.6: kept
    x = torch.tensor([[math.log(2.0), 0.0, 0.0]])
    _, _, _, plan, ids = run(x, [(0, 0.6, 1.0, 0.9)])
    assert _crossing_kept(plan, ids)
    # planted: keep iff the mass INCLUDING the candidate is < top_p (drops the crossing token)
    keep = plan["running"] < 0.6
    keep[:, 0] = True
    assert not _crossing_kept(dict(plan, keep=keep), ids)


def test_top_p_one_keeps_all_and_first_always_kept():
    x = torch.randn(3, 50)
    _, _, _, plan, _ = run(x, [(0, 1.0, 1.0)] * 3)
    assert plan["keep"].all()
    _, _, _, plan, _ = run(torch.tensor([[9.0, 0.0, 0.0]]), [(0, 1e-6, 1.0)])
    assert plan["keep"][0].tolist() == [True, False, False]


def test_greedy_lowest_id_among_equal_maxima():
    x = torch.tensor([[1.0, 7.0, 3.0, 7.0, 7.0]])
    for t in (0.0, 9e-6):
        tok, _, tr, _, _ = run(x, [(0, 0.9, t, 0.99)])
        assert tok.tolist() == [1] and not tr.any()


def test_u_grid_reproduces_kept_distribution_exactly():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(1, 40, generator=g) * 2).to(torch.bfloat16)
    n = 4096
    us = torch.arange(n, dtype=torch.float32) / n
    rows = x.repeat(n, 1)
    params = torch.stack([torch.full((n,), 10.0), torch.full((n,), 0.9), torch.full((n,), 0.8), us], 1)
    tok, _, _, plan, ids = run(rows, params.tolist())
    p = plan["p"][0][plan["keep"][0]]
    p = p / p.sum()
    kept = ids[0][plan["keep"][0]]
    freq = torch.tensor([(tok == t).sum().item() / n for t in kept.tolist()], dtype=torch.float64)
    assert (freq - p).abs().max() <= 1.0 / n + 1e-12
    assert set(tok.tolist()) == set(kept.tolist())


def test_top_k_disabled_normalizes_over_full_vocab_and_flags_truncation():
    x = torch.zeros(1, 1000)  # uniform: 8 candidates hold 0.8% of the mass
    _, _, tr, plan, _ = run(x, [(0, 0.5, 1.0)], k=8)
    assert abs(plan["p"][0].sum().item() - 8 / 1000) < 1e-12
    assert tr.tolist() == [True] and plan["keep"][0].all()
    _, _, tr, _, _ = run(x, [(50, 0.5, 1.0)], k=8)  # top_k > k
    assert tr.tolist() == [True]
    y = torch.arange(100.0, 0, -1)[None]  # strictly descending: nothing past k ties
    _, _, tr, _, _ = run(y, [(8, 0.5, 1.0)], k=8)
    assert tr.tolist() == [False]
    z = torch.tensor([[5.0] + [1.0] * 20])  # threshold ties continue past k
    _, _, tr, _, _ = run(z, [(4, 0.9, 1.0)], k=4)
    assert tr.tolist() == [True]


def test_min_p_drops_relative_to_top():
    x = torch.tensor([[math.log(8.0), math.log(4.0), math.log(1.0), math.log(0.5)]])
    _, _, _, plan, _ = run(x, [(0, 1.0, 1.0, 0.5, 0.125)])
    assert plan["keep"][0].tolist() == [True, True, True, False]


def test_logprob_is_raw_full_row_log_softmax():
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(3, 777, generator=g) * 3).to(torch.bfloat16)
    tok, lp, _, _, _ = run(x, [(5, 0.9, 0.7, 0.3)] * 3, k=16)
    ref = torch.log_softmax(x.double(), 1).gather(1, tok[:, None])[:, 0]
    assert torch.equal(lp, ref.float()) or (lp.double() - ref).abs().max() < 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_rows_match_float64_reference(seed):
    g = torch.Generator().manual_seed(seed)
    r, v = 40, 300
    x = (torch.randn(r, v, generator=g) * 2).to(torch.bfloat16)
    params = []
    for i in range(r):
        params.append((int(torch.randint(-1, 20, (1,), generator=g)), float(torch.rand(1, generator=g)) * 0.99 + 0.01,
                       float(torch.rand(1, generator=g)) * 1.5, float(torch.rand(1, generator=g)) * 0.999,
                       float(torch.rand(1, generator=g)) * 0.2))
    tok, lp, tr, plan, _ = run(x, params, k=v)
    sp = torch.tensor(params, dtype=torch.float32).double()
    for i in range(r):
        ref = sampler_ref(x[i].float(), top_k=int(sp[i, 0]), top_p=sp[i, 1].item(), temperature=sp[i, 2].item(),
                          u=sp[i, 3].item(), min_p=sp[i, 4].item())
        assert tok[i].item() == ref["token"], (i, params[i])
        assert abs(lp[i].item() - ref["logprob"]) < 1e-5


def test_seeded_draws_are_pinned_bits():
    # the counter-based draw is a pure integer function: pin its bits
    assert draw_u(1, 0).item() == np.float32(0.3681895).item()
    assert draw_u(12345, 7) == draw_u(np.array([12345]), np.array([7]))[0]
    t = sampling_tensor([SamplingParams(top_k=5, seed=9), SamplingParams(u=0.25)], positions=[3, 0])
    assert t.shape == (2, 5) and t[0, 3].item() == draw_u(9, 3).item() and t[1, 3].item() == 0.25
    with pytest.raises(ValueError, match="either seed"):
        sampling_tensor([SamplingParams(seed=1, u=0.5)], positions=[0])


# ---------------------------------------------------------------------------------------
# no silent traps (issue 21): seeds in uint64, a draw for every sampled request, positions
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [-1, 2**64, 2**70, True, 1.0, "7", np.float64(3.0)])
def test_seed_outside_uint64_is_a_value_error_naming_seed(seed):
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*64\) or None; got"):
        SamplingParams(seed=seed)


def test_seed_covers_all_of_uint64_with_the_same_bits():
    """2**64 - 1 draws what its int64 twin -1 draws (the same 64 bits); 2**63 - 1 and 0 work."""
    t = sampling_tensor([SamplingParams(seed=s) for s in (0, 2**63 - 1, 2**63, 2**64 - 1)], positions=[5] * 4)
    want = [draw_u(0, 5), draw_u(2**63 - 1, 5), draw_u(-2**63, 5), draw_u(-1, 5)]
    assert t[:, 3].tolist() == [float(w) for w in want]
    assert t[0, 3] != t[3, 3]  # planted: distinct seeds draw distinct u here


@pytest.mark.parametrize("params", [
    [SamplingParams()],  # temperature 1.0 by default
    [SamplingParams(temperature=0.0), SamplingParams(top_p=0.9, temperature=0.7)],
])
def test_sampled_request_without_seed_or_u_is_a_value_error_naming_it(params):
    i = len(params) - 1
    with pytest.raises(ValueError, match=rf"request {i}: a sampled request .* needs a seed \(\+ positions\) or an "
                                         r"explicit u; got neither"):
        sampling_tensor(params)


def test_greedy_and_explicit_u_need_no_seed():
    """Greedy requests (temperature < 1e-5 in fp32) need no draw; u=0.5 keeps the fixed draw."""
    t = sampling_tensor([SamplingParams(temperature=0.0), SamplingParams(temperature=1e-6),
                         SamplingParams(u=0.5), SamplingParams(top_k=3, u=0.25)])
    assert t[:, 3].tolist() == [0.5, 0.5, 0.5, 0.25]


def test_greedy_threshold_is_1e_5():
    """The declared greedy threshold, 1e-5 (fp32 temperature widened): 9e-6 is greedy (needs no
    draw), 2e-5 is sampled (needs a seed or u). A threshold moved to 1e-4 (a planted mutant in
    tools/mutate.py) turns 2e-5 greedy and fails here; literals, not the module's constant."""
    greedy = sampling_tensor([SamplingParams(temperature=9e-6)])
    assert greedy[0, 3].item() == 0.5
    with pytest.raises(ValueError, match=r"request 0: a sampled request \(temperature=2e-05"):
        sampling_tensor([SamplingParams(temperature=2e-5)])


def test_seeded_request_without_positions_is_a_value_error():
    with pytest.raises(ValueError, match=r"positions must be given .* request 1 seeded"):
        sampling_tensor([SamplingParams(u=0.3), SamplingParams(seed=4)])
    with pytest.raises(ValueError, match=r"positions\[0\] must be an int in \[0, 2\*\*63\) .*got -1"):
        sampling_tensor([SamplingParams(seed=4)], positions=[-1])
    with pytest.raises(ValueError, match=r"positions must have one entry per request \(1\); got 2"):
        sampling_tensor([SamplingParams(seed=4)], positions=[0, 1])
    # the draw follows the position (what a missing one would have frozen)
    a, b = (sampling_tensor([SamplingParams(seed=4)], positions=[p])[0, 3] for p in (0, 1))
    assert a != b


def test_declared_sums_follow_their_order():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 1000, generator=g, dtype=torch.float64) * torch.tensor([1.0, 1e10])[:, None]
    got = sum64(x)
    for i in range(2):
        lanes = [0.0] * 256
        for j in range(1000):
            lanes[j % 256] += x[i, j].item()
        w = 256
        while w > 1:
            w //= 2
            lanes = [lanes[t] + lanes[t + w] for t in range(w)]
        assert got[i].item() == lanes[0]
    # planted: a plain left-to-right sum is another order, and the check tells them apart
    y = torch.ones(1, 1000, dtype=torch.float64)
    y[0, 0] = 2.0**53
    seq = 0.0
    for t in y[0].tolist():
        seq += t
    assert sum64(y).item() != seq
    c = running_sum64(x[:, :10])
    acc = 0.0
    for j in range(10):
        acc += x[0, j].item()
        assert c[0, j].item() == acc


@pytest.mark.parametrize("bad,match", [
    ([[1, float("nan"), 1.0]], r"row 0: has NaN"),
    ([[1, 0.0, 1.0]], r"row 0: top_p must be in \(0, 1\]"),
    ([[1, 1.5, 1.0]], r"top_p must be in \(0, 1\]"),
    ([[1, 0.5, -1.0]], r"temperature must be >= 0"),
    ([[1, 0.5, 1.0, 1.0]], r"u must be in \[0, 1\)"),
    ([[1, 0.5, 1.0, -0.1]], r"u must be in \[0, 1\)"),
    ([[1.5, 0.5, 1.0]], r"top_k must be a whole number"),
    ([[1, 0.5, 1.0, 0.5, 2.0]], r"min_p must be in \[0, 1\]"),
])
def test_bad_params_name_the_row(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_params(torch.tensor(bad, dtype=torch.float32), 1)


def test_bad_param_shapes():
    with pytest.raises(ValueError, match=r"must be \[R=2, 3\|4\|5\]; got \(2, 2\)"):
        validate_params(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match="float32 tensor; got torch.float64"):
        validate_params(torch.zeros(2, 3, dtype=torch.float64), 2)


def test_special_rows_are_defined():
    inf = float("inf")
    tok, lp, _, plan, _ = run(torch.tensor([[1.0, inf, 0.0, inf]]), [(0, 1.0, 1.0, 0.75)])
    assert plan["p"][0].tolist()[:2] == [0.5, 0.5] and tok.item() == 3
    tok, _, _, plan, _ = run(torch.full((1, 4), -inf), [(0, 1.0, 1.0, 0.6)])
    assert tok.item() == 2  # uniform over an all -inf row
    nan = float("nan")
    # folded NaN has no mass: p = (0.731, 0.269) on ids (2, 1); u = 0.5 draws id 2, u = 0.8 id 1
    tok, _, _, plan, _ = run(torch.tensor([[nan, 1.0, 2.0]] * 2), [(0, 0.9, 1.0, 0.5), (0, 0.9, 1.0, 0.8)],
                             nan_fold=True)
    assert tok.tolist() == [2, 1] and plan["p"][0, 2].item() == 0.0


def test_draw_counts_cdf_at_or_below_u():
    plan = {"keep": torch.tensor([[True, True, True, False]]), "running": torch.tensor([[0.25, 0.5, 1.0, 1.0]], dtype=torch.float64),
            "u": torch.tensor([0.5], dtype=torch.float64), "greedy": torch.tensor([False])}
    assert draw(plan).tolist() == [2]  # cdf 0.25, 0.5 <= 0.5: slot 2
    plan["u"] = torch.tensor([0.4999], dtype=torch.float64)
    assert draw(plan).tolist() == [1]


def test_pure_temperature_sampling_over_a_large_vocab_is_flagged_truncated():
    """top-k disabled and top_p = 1 keeps the whole vocab: k candidates are not enough."""
    x = torch.zeros(2, 100)
    x[1, 8:] = -float("inf")  # row 1: only 8 lanes carry mass, all among the candidates
    _, _, tr, _, _ = run(x, [(0, 1.0, 1.0)] * 2, k=8)
    assert tr.tolist() == [True, False]


def test_folded_nan_candidates_do_not_turn_a_row_greedy():
    nan = float("nan")
    x = torch.tensor([[1.0, nan, 1.0, nan]])  # k = 4: two NaN candidates after the fold
    tok, _, _, plan, _ = run(x, [(4, 1.0, 1.0, 0.75)], k=4, nan_fold=True)
    assert plan["keep"][0].tolist()[:2] == [True, True] and tok.item() == 2


def test_params_fast_check_is_the_rules():
    """validate_params' host check (_params_ok) accepts exactly the tensors param_problems
    finds nothing in: 3,000 random [R, 3|4|5] rows built from every rule's edge values (the
    boundaries themselves, one fp32 ulp either side, +-inf, NaN, -0), and a 40-row tensor
    with one NaN. Planted: a tensor only the whole-number rule rejects is rejected."""
    from lmtail.tail.sampler import _params_ok, param_problems

    ulp = lambda x, d: float(np.nextafter(np.float32(x), np.float32(d)))
    edges = [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 3.5, 1e-5, ulp(0, 1), ulp(1, 0), ulp(1, 2), ulp(0, -1),
             float("inf"), -float("inf"), float("nan"), 1e30, 2.0**62, 7.0]
    g = np.random.default_rng(0)
    seen = {True: 0, False: 0}
    for cols in (3, 4, 5):
        for _ in range(1000):
            r = int(g.integers(1, 4))
            good = np.array([[3.0, 0.9, 0.7, 0.5, 0.1][:cols]] * r, dtype=np.float32)
            for _ in range(int(g.integers(0, 3))):  # change a few entries to edge values
                good[g.integers(0, r), g.integers(0, cols)] = edges[g.integers(0, len(edges))]
            sp = torch.from_numpy(good)
            want = not any(bool(bad.any()) for bad, _ in param_problems(sp))
            assert _params_ok(sp.tolist()) == want, sp
            seen[want] += 1
    assert min(seen.values()) > 200
    half = np.array([[1.5, 0.9, 0.7]], dtype=np.float32)  # planted: no whole-number rule
    assert not _params_ok(half.tolist()) and np.isfinite(half).all()
    big = np.tile(np.array([[3.0, 0.9, 0.7, 0.5, 0.1]], dtype=np.float32), (40, 1))
    assert _params_ok(big.tolist())
    big[33, 2] = np.nan
    assert not _params_ok(big.tolist())


def test_shifted_exp_rows_and_sum64_rows_are_the_torch_ops():
    """kernels.tail.rowmass.shifted_exp_rows / sum64_rows (the candidates sampler's terms and
    sums, from C) equal shifted_exp / sum64 bit for bit: random rows, +-inf, -inf rows,
    z == m, terms that underflow to subnormals and 0, widths around 256; and fall back to
    the torch ops (the same bits) where z > m or a NaN appears. Planted: a sum in plain
    order (one chain) is red."""
    from lmtail.kernels.tail.rowmass import shifted_exp, shifted_exp_rows, sum64_rows

    g = torch.Generator().manual_seed(3)
    inf = float("inf")
    for r, n in ((1, 1), (3, 7), (5, 255), (4, 256), (2, 257), (3, 600)):
        z = torch.randn(r, n, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, r, dtype=torch.float64)[:, None]
        z[0, 0] = -inf
        z[-1, n // 2:] = z[-1, n // 2:] - 740.0  # subnormal and zero terms
        m = z.max(dim=1).values
        if r > 2:
            z[1] = -inf
            m[1] = -inf  # an all -inf row: every term 1
            m[2] = inf  # m = +inf: finite z -> 0
            z[2, 0] = inf
        for zz, mm in ((z, m), (z, m + 0.5)):
            got, want = shifted_exp_rows(zz, mm), shifted_exp(zz, mm)
            assert torch.equal(bits(got), bits(want))
            assert torch.equal(bits(sum64_rows(got)), bits(sum64(want)))
    z = torch.randn(2, 9, generator=g, dtype=torch.float64)
    m = z.max(dim=1).values
    for zz, mm in ((z, m - 0.1), (torch.where(z > 0, torch.nan, z), m)):  # z > m; NaN: the torch ops
        assert torch.equal(bits(shifted_exp_rows(zz, mm)), bits(shifted_exp(zz, mm)))
    x = torch.rand(3, 700, generator=g, dtype=torch.float64) * torch.logspace(-20, 20, 700, dtype=torch.float64)
    assert torch.equal(bits(sum64_rows(x)), bits(sum64(x)))
    y = torch.rand(8, 700, generator=g, dtype=torch.float64)
    plain = torch.from_numpy(np.add.accumulate(y.numpy(), axis=1)[:, -1].copy())  # one chain
    assert torch.equal(bits(sum64_rows(y)), bits(sum64(y))) and not torch.equal(bits(plain), bits(sum64(y)))


def test_sampling_tensor_calls_greedy_what_the_tail_calls_greedy():
    """T = 1e-5 rounds to fp32 9.99999974737875e-06 < 1e-5: the tail treats it as greedy, so
    sampling_tensor must not demand a seed for it (a planted fp32 comparison would)."""
    from lmtail.tail.sampler import GREEDY_TEMPERATURE, SamplingParams, sampling_tensor

    sp = sampling_tensor([SamplingParams(temperature=1e-5)])
    assert float(sp[0, 2]) < GREEDY_TEMPERATURE  # float64 of the fp32 value
    assert bool(sp[0, 2] >= GREEDY_TEMPERATURE)  # the planted fp32 comparison says "sampled"
    with pytest.raises(ValueError, match="needs a seed"):
        sampling_tensor([SamplingParams(temperature=2e-5)])


@pytest.mark.parametrize("exchange,tail_path", [("candidates", "fused"), ("mirror", "fused"),
                                                ("mirror", "reference")])
def test_min_p_one_keeps_every_tied_maximum(exchange, tail_path):
    """min_p = 1.0 keeps p >= 1.0 * p[0]: with the maximum tied between two tokens both stay,
    so a draw past the middle takes the second (higher id) one. A `>` for `>=` in the min-p cut
    keeps only slot 0 and draws the first token at every u: this test is the one that sees it
    (every pass: the fused C kernel, the candidates exchange's C sampler, the torch reference)."""
    from lmtail.tail.compose import decode_tail

    h, v = 64, 300
    g = torch.Generator().manual_seed(11)
    x = torch.randn(3, h, generator=g)
    gamma = torch.ones(h)
    w = (torch.randn(h, v, generator=g) * 0.05).to(torch.bfloat16)
    w[:, 17] = w[:, 42] = (x[0] / x[0].norm() * 40).to(torch.bfloat16)  # one clear, tied maximum in row 0
    w[:, 42] = w[:, 17]
    out = decode_tail(x, gamma, w, k=8, exchange=exchange, tail_path=tail_path,
                      sampling_params=torch.tensor([[0.0, 1.0, 1.0, u, 1.0] for u in (0.25, 0.75, 0.999)]),
                      emit_logits=True)
    row = out.logits[0]
    assert row[17] == row[42] == row.max() and int((row == row.max()).sum()) == 2
    assert out.tokens[0].item() == 17  # u = 0.25: the first of the two
    x2 = x[0:1].repeat(3, 1)
    out2 = decode_tail(x2, gamma, w, k=8, exchange=exchange, tail_path=tail_path,
                       sampling_params=torch.tensor([[0.0, 1.0, 1.0, u, 1.0] for u in (0.25, 0.75, 0.999)]))
    assert out2.tokens.tolist() == [17, 42, 42]


def test_greedy_rows_are_valid_greedy_padding():
    """greedy_rows(n): n rows the tail accepts and decides greedily (slot 0 of the candidates)."""
    from lmtail.tail.sampler import GREEDY_TEMPERATURE, greedy_rows, validate_params
    from lmtail.tail.compose import decode_tail

    sp = greedy_rows(3)
    validate_params(sp, 3)
    assert sp.shape == (3, 5) and sp.dtype == torch.float32 and bool((sp[:, 2].double() < GREEDY_TEMPERATURE).all())
    g = torch.Generator().manual_seed(4)
    out = decode_tail(torch.randn(3, 64, generator=g), torch.ones(64),
                      (torch.randn(64, 100, generator=g) * 0.1).to(torch.bfloat16), k=5, sampling_params=sp)
    assert torch.equal(out.tokens, out.topk_indices[:, 0])
