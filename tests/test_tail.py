"""decode_tail on one rank: batch invariance, exact widening, declared float64 bounds,
pad lanes, outputs, errors."""
import numpy as np
import pytest
import torch

from lmtail.reference.tail import logits_range, logits_ref, mirror_range
from lmtail.tail import TailOutput, decode_tail, pad_mask, shard_logits

H, H_U, V = 96, 88, 1000


def problem(gbs, seed=0, h=H, v=V, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g) * scale
    gamma = 1 + 0.1 * torch.randn(h, generator=g)
    w = (torch.randn(h, v, generator=g) * 0.3).to(torch.bfloat16)
    return x, gamma, w


def params(gbs, seed=0):
    g = torch.Generator().manual_seed(seed + 100)
    return torch.stack([torch.randint(0, 40, (gbs,), generator=g).float(), 0.5 + 0.5 * torch.rand(gbs, generator=g),
                        torch.rand(gbs, generator=g) * 1.5, torch.rand(gbs, generator=g) * 0.999], 1)


def bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def same(a: TailOutput, b: TailOutput, rows=slice(None)):
    for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
        x, y = getattr(a, f), getattr(b, f)
        assert torch.equal(bits(x), bits(y[rows])), f
    if a.logits is not None:
        assert torch.equal(bits(a.logits), bits(b.logits[rows])), "logits"


KW = dict(hidden_actual=H_U, k=64)


@pytest.mark.parametrize("seed", [0, 1])
def test_solo_equals_together_bitwise(seed):
    x, gamma, w = problem(128, seed)
    sp = params(128, seed)
    full = decode_tail(x, gamma, w, sampling_params=sp, **KW)
    for n in (1, 2, 3, 4, 7, 8, 64, 128):
        for start in (0, 128 - n):
            part = decode_tail(x[start:start + n], gamma, w, sampling_params=sp[start:start + n], **KW)
            same(part, full, slice(start, start + n))


def test_planted_batch_mixing_is_caught():
    """A 'tail' that lets rows share a statistic (the batch mean of ssq) goes red."""
    x, gamma, w = problem(8, 3)
    ok = shard_logits(x, gamma, w, hidden_actual=H_U)
    x2 = x.clone()
    x2[1:] *= 1.5  # other rows change; row 0's result must not
    assert torch.equal(bits(shard_logits(x2, gamma, w, hidden_actual=H_U)[0]), bits(ok[0]))
    mixed = lambda xx: shard_logits(xx * (xx.pow(2).mean() / xx[0].pow(2).mean()).rsqrt(), gamma, w, hidden_actual=H_U)
    assert not torch.equal(bits(mixed(x2)[0]), bits(mixed(x)[0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_input_equals_prewidened(dtype):
    x, gamma, w = problem(7, 2)
    x16 = x.to(dtype)
    a = decode_tail(x16, gamma, w, sampling_params=params(7), **KW)
    b = decode_tail(x16.float(), gamma, w, sampling_params=params(7), **KW)
    same(a, b)


@pytest.mark.parametrize("deferred", [True, False])
@pytest.mark.parametrize("seed,gbs,h,h_u,interleaved,scale", [
    (0, 1, 96, 88, True, 1.0), (1, 5, 96, 96, True, 1.0), (2, 3, 61, 50, False, 1e-3),
    (3, 4, 128, 120, True, 30.0), (4, 2, 40, 33, False, 1.0)])
def test_logits_within_declared_float64_range(deferred, seed, gbs, h, h_u, interleaved, scale):
    x, gamma, w = problem(gbs, seed, h=h, v=301, scale=scale)
    kw = dict(hidden_actual=h_u, zero_interleaved_pad=interleaved)
    out = decode_tail(x, gamma, w, k=8, deferred_rms=deferred, **kw)
    lo, hi = logits_range(x, gamma, w, eps=1e-5, hidden_actual=h_u, interleaved=interleaved, deferred_rms=deferred)
    got = out.logits.double().numpy()
    assert ((lo <= got) & (got <= hi)).all()
    mlo, mhi = mirror_range(lo, hi)
    m = out.logits.to(torch.bfloat16).double().numpy()
    assert ((mlo <= m) & (m <= mhi)).all()
    # the range is tight: its width is a few ulps of the logits scale, not a free pass
    ideal = logits_ref(x, gamma, w, eps=1e-5, hidden_actual=h_u, interleaved=interleaved)
    assert np.median((hi - lo) / np.abs(ideal).max()) < 1e-3


@pytest.mark.parametrize("planted", ["divide_by_H", "eps_dropped", "pad_not_zeroed"])
def test_planted_norm_mistakes_leave_the_range(planted):
    h, h_u = 64, 48
    x, gamma, w = problem(4, 5, h=h, v=50)
    if planted == "eps_dropped":
        x = x * 3e-4  # ssq/H_u ~ 1e-7: eps dominates
    x[:, ~pad_mask(h, h_u, True)] = 5.0
    lo, hi = logits_range(x, gamma, w, eps=1e-5, hidden_actual=h_u, interleaved=True)
    kw = {"divide_by_H": dict(hidden_actual=h, zero_interleaved_pad=True),
          "eps_dropped": dict(hidden_actual=h_u, zero_interleaved_pad=True, eps=0.0),
          "pad_not_zeroed": dict(hidden_actual=h, zero_interleaved_pad=True)}[planted]
    xin = x.clone()
    if planted == "divide_by_H":
        xin[:, ~pad_mask(h, h_u, True)] = 0.0  # zero pad but divide by H
    wrong = shard_logits(xin, gamma, w, **({"eps": 1e-5} | kw)).double().numpy()
    assert not ((lo <= wrong) & (wrong <= hi)).all()
    right = shard_logits(x, gamma, w, hidden_actual=h_u).double().numpy()
    assert ((lo <= right) & (right <= hi)).all()


def test_gpt_oss_interleaved_pad_lanes():
    pad = ~pad_mask(3072, 2880, True)
    lanes = torch.nonzero(pad)[:, 0]
    expect = torch.cat([torch.arange(720, 768), torch.arange(1488, 1536), torch.arange(2256, 2304), torch.arange(3024, 3072)])
    assert torch.equal(lanes, expect)
    assert torch.equal(torch.nonzero(~pad_mask(10, 7, False))[:, 0], torch.tensor([7, 8, 9]))


def test_pad_lane_garbage_is_ignored():
    x, gamma, w = problem(3, 6)
    dirty = x.clone()
    dirty[:, ~pad_mask(H, H_U, True)] = torch.tensor([float("nan"), float("inf"), 1e30, -7.0]).repeat(6)[:H - H_U]
    a = decode_tail(x, gamma, w, sampling_params=params(3), **KW)
    b = decode_tail(dirty, gamma, w, sampling_params=params(3), **KW)
    same(a, b)


def test_threads_and_repeats_do_not_change_bytes():
    x, gamma, w = problem(9, 7)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = decode_tail(x, gamma, w, sampling_params=params(9), **KW)
        torch.set_num_threads(2)
        b = decode_tail(x, gamma, w, sampling_params=params(9), **KW)
        c = decode_tail(x, gamma, w, sampling_params=params(9), **KW)
    finally:
        torch.set_num_threads(n)
    same(a, b)
    same(b, c)


def test_outputs_and_flags():
    x, gamma, w = problem(4, 8)
    out = decode_tail(x, gamma, w, k=5, emit_logits=False, hidden_actual=H_U)
    assert out.logits is None and out.tokens is None and out.taps is None
    assert out.topk_values.dtype == torch.bfloat16 and out.topk_indices.dtype == torch.int64
    assert out.topk_values.shape == (4, 5)
    assert (out.topk_values[:, :-1].float() >= out.topk_values[:, 1:].float()).all()
    t = decode_tail(x, gamma, w, k=5, debug_taps=True, sampling_params=params(4), hidden_actual=H_U)
    assert t.taps is not None and "stage1_ids" in t.taps
    assert t.tokens.dtype == torch.int64 and t.logprobs.dtype == torch.float32 and t.truncated.dtype == torch.bool
    greedy = decode_tail(x, gamma, w, k=5, sampling_params=torch.tensor([[0, 1.0, 0.0]] * 4), hidden_actual=H_U)
    assert torch.equal(greedy.tokens, greedy.topk_indices[:, 0])
    # both realizations are reproducible on their own and agree on the argmax here
    legacy = decode_tail(x, gamma, w, k=5, deferred_rms=False, hidden_actual=H_U)
    assert torch.equal(legacy.topk_indices[:, 0], out.topk_indices[:, 0])


def test_argmax_agrees_with_float64_when_margin_exceeds_bound():
    x, gamma, w = problem(64, 9, v=2000)
    out = decode_tail(x, gamma, w, k=2, hidden_actual=H_U)
    ideal = logits_ref(x, gamma, w, eps=1e-5, hidden_actual=H_U, interleaved=True)
    lo, hi = mirror_range(*logits_range(x, gamma, w, eps=1e-5, hidden_actual=H_U, interleaved=True))
    top2 = np.sort(ideal, axis=1)[:, -2:]
    certified = (top2[:, 1] - top2[:, 0]) > 2 * (hi - lo).max(axis=1)
    assert certified.sum() >= 32
    assert (out.topk_indices[:, 0].numpy() == ideal.argmax(1))[certified].all()


@pytest.mark.parametrize("change,match", [
    (dict(hidden_states=torch.zeros(3)), r"hidden_states must be \[gbs, H\]; got \(3,\)"),
    (dict(hidden_states=torch.zeros(2, H, dtype=torch.float64)), r"float32, float16 or bfloat16; got torch.float64"),
    (dict(gamma=torch.ones(H + 1)), r"gamma must be \[H=96\] or \[1, H\]; got \(97,\)"),
    (dict(gamma=torch.ones(H, dtype=torch.float16)), r"gamma must be float32; got torch.float16"),
    (dict(lm_head_weight_t=torch.zeros(H, 10)), r"lm_head_weight_t must be bfloat16; got torch.float32"),
    (dict(lm_head_weight_t=torch.zeros(H + 2, 10, dtype=torch.bfloat16)), r"\[H=96, V_s\]; got \(98, 10\)"),
    (dict(lm_head_weight_t=torch.zeros(10, H, dtype=torch.bfloat16).t()), r"C-contiguous"),
    (dict(k=V + 1), r"k must be in \[1, V=1000\]; got 1001"),
    (dict(k=0), r"k must be in \[1, V=1000\]; got 0"),
    (dict(hidden_actual=H + 1), r"hidden_actual must be in \[1, H=96\]; got 97"),
    (dict(hidden_actual=90), r"interleaved padding needs H and H - H_u divisible by 4"),
    (dict(sampling_params=torch.zeros(3, 3)), r"sampling_params must be \[R=2, 3\|4\|5\]; got \(3, 3\)"),
    (dict(sampling_params=torch.tensor([[1, 0.5, 1.0]] * 2 + [[1, 0.5, -1.0]])[1:]), r"row 1: temperature"),
    (dict(batch_groups=2), r"batch_groups and fence need a process group"),
])
def test_bad_inputs_are_value_errors(change, match):
    x, gamma, w = problem(2, 0)
    kw = dict(hidden_states=x, gamma=gamma, lm_head_weight_t=w, hidden_actual=H_U, k=8)
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        decode_tail(kw.pop("hidden_states"), kw.pop("gamma"), kw.pop("lm_head_weight_t"), **kw)
