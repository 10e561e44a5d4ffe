"""decode_tail on one rank: batch invariance, exact widening, declared float64 bounds,
pad lanes, outputs, errors."""
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import bits
from lmtail.reference.tail import logits_range, logits_ref, mirror_range
from lmtail.tail.config import TailConfig
from lmtail.tail.compose import TailOutput, decode_tail, pad_mask, shard_logits, tail_decl

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


def same(a: TailOutput, b: TailOutput, rows=slice(None)):
    for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated"):
        x, y = getattr(a, f), getattr(b, f)
        assert torch.equal(bits(x), bits(y[rows])), f
    if a.logits is not None:
        assert torch.equal(bits(a.logits), bits(b.logits[rows])), "logits"


KW = dict(hidden_actual=H_U, k=64)
KW_MIRROR = dict(KW, exchange="mirror")  # tail_path and bf16 candidates are the mirror's


@pytest.mark.parametrize("seed,exchange", [(0, "candidates"), (1, "candidates"), (0, "mirror"), (1, "mirror")])
def test_solo_equals_together_bitwise(seed, exchange):
    x, gamma, w = problem(128, seed)
    sp = params(128, seed)
    kw = dict(KW, exchange=exchange)
    full = decode_tail(x, gamma, w, sampling_params=sp, **kw)
    for n in (1, 2, 3, 4, 7, 8, 64, 128):
        for start in (0, 128 - n):
            part = decode_tail(x[start:start + n], gamma, w, sampling_params=sp[start:start + n], **kw)
            same(part, full, slice(start, start + n))


def test_planted_batch_mixing_is_caught():
    """A 'tail' that lets rows share a statistic (the batch mean of ssq) goes red."""
    x, gamma, w = problem(8, 3)
    ok = shard_logits(x, gamma, w, config=TailConfig(hidden_actual=H_U))
    x2 = x.clone()
    x2[1:] *= 1.5  # other rows change; row 0's result must not
    assert torch.equal(bits(shard_logits(x2, gamma, w, config=TailConfig(hidden_actual=H_U))[0]), bits(ok[0]))
    mixed = lambda xx: shard_logits(xx * (xx.pow(2).mean() / xx[0].pow(2).mean()).rsqrt(), gamma, w, config=TailConfig(hidden_actual=H_U))
    assert not torch.equal(bits(mixed(x2)[0]), bits(mixed(x)[0]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_input_equals_prewidened(dtype):
    x, gamma, w = problem(7, 2)
    x16 = x.to(dtype)
    a = decode_tail(x16, gamma, w, sampling_params=params(7), **KW)
    b = decode_tail(x16.float(), gamma, w, sampling_params=params(7), **KW)
    same(a, b)


@pytest.mark.parametrize("deferred,gemm_order", [(True, "chain"), (False, "chain"), (True, "amx32"), (False, "amx32"),
                                                  (True, "dp32"), (False, "dp32")])
@pytest.mark.parametrize("seed,gbs,h,h_u,interleaved,scale", [
    (0, 1, 96, 88, True, 1.0), (1, 5, 96, 96, True, 1.0), (2, 3, 61, 50, False, 1e-3),
    (3, 4, 128, 120, True, 30.0), (4, 2, 40, 33, False, 1.0)])
def test_logits_within_declared_float64_range(deferred, gemm_order, seed, gbs, h, h_u, interleaved, scale):
    x, gamma, w = problem(gbs, seed, h=h, v=301, scale=scale)
    kw = dict(hidden_actual=h_u, zero_interleaved_pad=interleaved)
    out = decode_tail(x, gamma, w, k=8, deferred_rms=deferred, gemm_order=gemm_order, **kw)
    lo, hi = logits_range(x, gamma, w, eps=1e-5, decl=tail_decl(h, deferred, gemm_order), hidden_actual=h_u,
                          interleaved=interleaved, deferred_rms=deferred)
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
    lo, hi = logits_range(x, gamma, w, eps=1e-5, decl=tail_decl(h), hidden_actual=h_u, interleaved=True)
    kw = {"divide_by_H": dict(hidden_actual=h, zero_interleaved_pad=True),
          "eps_dropped": dict(hidden_actual=h_u, zero_interleaved_pad=True, eps=0.0),
          "pad_not_zeroed": dict(hidden_actual=h, zero_interleaved_pad=True)}[planted]
    xin = x.clone()
    if planted == "divide_by_H":
        xin[:, ~pad_mask(h, h_u, True)] = 0.0  # zero pad but divide by H
    wrong = shard_logits(xin, gamma, w, config=TailConfig(**({"eps": 1e-5} | kw))).double().numpy()
    assert not ((lo <= wrong) & (wrong <= hi)).all()
    right = shard_logits(x, gamma, w, config=TailConfig(hidden_actual=h_u)).double().numpy()
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
    cand = decode_tail(x, gamma, w, k=5, emit_logits=False, hidden_actual=H_U)  # the default exchange
    assert cand.topk_values.dtype == torch.float32 and cand.topk_indices.dtype == torch.int64
    out = decode_tail(x, gamma, w, k=5, emit_logits=False, hidden_actual=H_U, exchange="mirror")
    assert torch.equal(cand.topk_values.to(torch.bfloat16)[:, 0], out.topk_values[:, 0])
    assert out.logits is None and out.tokens is None and out.taps is None
    assert out.topk_values.dtype == torch.bfloat16 and out.topk_indices.dtype == torch.int64
    assert out.topk_values.shape == (4, 5)
    assert (out.topk_values[:, :-1].float() >= out.topk_values[:, 1:].float()).all()
    t = decode_tail(x, gamma, w, k=5, debug_taps=True, sampling_params=params(4), hidden_actual=H_U, exchange="mirror")
    assert t.taps is not None and "stage1_ids" in t.taps
    assert t.tokens.dtype == torch.int64 and t.logprobs.dtype == torch.float32 and t.truncated.dtype == torch.bool
    greedy = decode_tail(x, gamma, w, k=5, sampling_params=torch.tensor([[0, 1.0, 0.0]] * 4), hidden_actual=H_U)
    assert torch.equal(greedy.tokens, greedy.topk_indices[:, 0])
    # both realizations are reproducible on their own and agree on the argmax here
    legacy = decode_tail(x, gamma, w, k=5, deferred_rms=False, hidden_actual=H_U, exchange="mirror")
    assert torch.equal(legacy.topk_indices[:, 0], out.topk_indices[:, 0])


def test_argmax_agrees_with_float64_when_margin_exceeds_bound():
    x, gamma, w = problem(64, 9, v=2000)
    out = decode_tail(x, gamma, w, k=2, hidden_actual=H_U)
    ideal = logits_ref(x, gamma, w, eps=1e-5, hidden_actual=H_U, interleaved=True)
    lo, hi = mirror_range(*logits_range(x, gamma, w, eps=1e-5, decl=tail_decl(H), hidden_actual=H_U,
                                         interleaved=True))
    top2 = np.sort(ideal, axis=1)[:, -2:]
    certified = (top2[:, 1] - top2[:, 0]) > 2 * (hi - lo).max(axis=1)
    assert certified.sum() >= 32
    assert (out.topk_indices[:, 0].numpy() == ideal.argmax(1))[certified].all()


@pytest.mark.parametrize("change,match", [
    (dict(hidden_states=torch.zeros(3)), r"hidden_states must be \[gbs, H\]; got \(3,\)"),
    (dict(hidden_states=torch.zeros(2, H, dtype=torch.float64)), r"float32, float16 or bfloat16; got torch.float64"),
    (dict(gamma=torch.ones(H + 1)), r"gamma must be \[H=96\] or \[1, H\]; got \(97,\)"),
    (dict(gamma=torch.ones(H, dtype=torch.float16)), r"gamma must be bf16 or fp32; got torch.float16"),
    (dict(lm_head_weight_t=torch.zeros(H, 10)), r"lm_head_weight_t must be bfloat16; got torch.float32"),
    (dict(lm_head_weight_t=torch.zeros(H + 2, 10, dtype=torch.bfloat16)), r"\[H=96, V_s\]; got \(98, 10\)"),
    (dict(lm_head_weight_t=torch.zeros(10, H, dtype=torch.bfloat16).t()), r"C-contiguous"),
    (dict(k=V + 1), r"k must be an int in \[1, V=1000\]; got 1001"),
    (dict(k=0), r"k must be an int in \[1, V\]; got 0"),  # TailConfig's own rule (V unknown there)
    (dict(k=2.0), r"k must be an int in \[1, V\]; got 2.0"),
    (dict(hidden_actual=H + 1), r"hidden_actual must be an int in \[1, H=96\]; got 97"),
    (dict(hidden_actual=87.5), r"hidden_actual must be None \(H\) or an int in \[1, H\]; got 87.5"),
    (dict(eps=float("inf")), r"eps must be a finite number >= 0; got inf"),
    (dict(eps=-1e-6), r"eps must be a finite number >= 0; got -1e-06"),
    (dict(gemm_order="amx"), r"gemm_order must be one of \('chain', 'amx32', 'dp32'\); got 'amx'"),
    (dict(tail_path="fast"), r"tail_path must be one of \('fused', 'reference'\); got 'fast'"),
    (dict(config=TailConfig(k=8)), r"either as config= or as keywords, not both"),
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


def test_k_above_the_vocab_says_so_and_is_never_clamped():
    x, gamma, w = problem(1, 0, v=100)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, V=100\]; got 256 \(k candidates per row "
                                         r"cannot exceed the vocabulary width .* never clamped: pass k=min\(256, V\)"):
        decode_tail(x, gamma, w, hidden_actual=H_U)  # the default k=256
    assert decode_tail(x, gamma, w, hidden_actual=H_U, k=100).topk_values.shape == (1, 100)


def _count_calls(monkeypatch, module, names):
    """Wrap module.<name> for each name to count its calls; returns the counts dict."""
    import importlib

    mod = importlib.import_module(module)
    counts = dict.fromkeys(names, 0)
    for n in names:
        fn = getattr(mod, n)

        def counted(*a, _fn=fn, _n=n, **kw):
            counts[_n] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(mod, n, counted)
    return counts


@pytest.mark.parametrize("tail_path", ["fused", "reference"])
@pytest.mark.parametrize("eps", [1e-5, 0.0])
def test_validation_runs_once_per_call(monkeypatch, tail_path, eps):
    """decode_tail checks its inputs once at the boundary (validate_tail_inputs, with the
    sampling_params rules once) and runs one sum of squares, also with eps=0 (its zero-row
    rule rides on the norm's own pass); the internal halves do not re-check.
    Planted: the public rows_tail on the same rows runs the params rules again."""
    x, gamma, w = problem(3, 4)
    sp = params(3)
    tail_calls = _count_calls(monkeypatch, "lmtail.tail.compose", ["validate_tail_inputs", "validate_params", "sum_squares"])
    norm_calls = _count_calls(monkeypatch, "lmtail.kernels.tail.shard_partials", ["tail_norm"])  # the C norm pass
    sampler_calls = _count_calls(monkeypatch, "lmtail.tail.sampler", ["validate_params"])
    out = decode_tail(x, gamma, w, k=8, hidden_actual=H_U, sampling_params=sp, eps=eps, tail_path=tail_path)
    assert out.tokens.shape == (3,)
    ssq = tail_calls.pop("sum_squares") + norm_calls["tail_norm"]
    assert tail_calls == {"validate_tail_inputs": 1, "validate_params": 1} and ssq == 1
    assert sampler_calls == {"validate_params": 0}
    from lmtail.tail.compose import rows_tail

    rows_tail(out.logits.to(torch.bfloat16), k=8, sampling_params=sp, path=tail_path)
    assert tail_calls["validate_params"] + sampler_calls["validate_params"] == 2  # planted: a second check counts


def test_eps0_zero_row_is_refused_before_the_gemm(monkeypatch):
    """eps=0 with a row whose real lanes square to 0 (all-zero, or squares that underflow)
    is a ValueError naming the rows, from the norm's own sum of squares, before the GEMM."""
    x, gamma, w = problem(4, 5)
    x[1] = 0.0
    x[3] = 1e-30  # squares underflow to 0 in fp32: no rms either
    x[3, H_U:] = 1.0  # pad lanes do not count
    calls = _count_calls(monkeypatch, "lmtail.tail.compose", ["gemm_bf16"])
    with pytest.raises(ValueError, match=r"eps=0.0 \(0 in fp32\) leaves hidden_states row\(s\) \[1, 3\] undefined"):
        decode_tail(x, gamma, w, k=8, hidden_actual=H_U, zero_interleaved_pad=False, eps=0.0)
    assert calls["gemm_bf16"] == 0
    ok = decode_tail(x[[0, 2]], gamma, w, k=8, hidden_actual=H_U, zero_interleaved_pad=False, eps=0.0)
    assert calls["gemm_bf16"] == 1 and ok.topk_values.shape == (2, 8)
    with pytest.raises(ValueError, match=r"leaves hidden_states row\(s\) \[1\] undefined"):
        decode_tail(x[:2], gamma, w, k=8, hidden_actual=H_U, eps=1e-46)  # 0 in fp32 too


@pytest.mark.parametrize("nan_fold", [False, True])
def test_nan_policy_names_the_same_rows_on_both_paths(nan_fold):
    """The fused path scans only the rows its kernel flags (undecided, or an all-NaN first
    candidate) and must name exactly the rows the reference path's full scan names.
    Planted: a scan that skips the flagged rows raises nothing."""
    from lmtail.tail import compose as tail_mod

    x, gamma, w = problem(12, 3)
    x[[2, 5, 9, 10, 11]] = torch.tensor(float("nan"))  # whole rows NaN
    x[7, :3] = torch.tensor(float("inf"))  # an inf lane: rms = 0, inf * 0 -> a NaN row too
    sp = params(12, 3)
    msgs = []
    for path in ("fused", "reference"):
        with pytest.raises(ValueError, match=r"all NaN" if nan_fold else r"NaN in the logits of rows") as e:
            decode_tail(x, gamma, w, sampling_params=sp, tail_path=path, nan_fold=nan_fold, **KW)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1] and "rows [2, 5, 7, 9, 10, 11]" in msgs[0]
    none = torch.zeros(0, dtype=torch.int64)
    tail_mod.check_nan_rows(torch.full((1, 4), float("nan"), dtype=torch.bfloat16), nan_fold=nan_fold, only=none)


def test_non_tensors_are_type_errors():
    x, gamma, w = problem(2, 0)
    for args, name in (((x.tolist(), gamma, w), "hidden_states"), ((x, None, w), "gamma"),
                       ((x, gamma, w.tolist()), "lm_head_weight_t")):
        with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
            decode_tail(*args, k=8, hidden_actual=H_U)


def test_config_equals_keywords_and_bf16_gamma_is_widened_exactly():
    """config=TailConfig(...) gives the keywords' bytes; a bf16 gamma gives the bytes of its
    exact fp32 widening. Planted: a gamma one bf16 ulp off changes the logits."""
    x, gamma, w = problem(6, 4)
    g16 = gamma.to(torch.bfloat16)
    sp = params(6)
    a = decode_tail(x, g16.float(), w, sampling_params=sp, **KW)
    b = decode_tail(x, g16, w, sampling_params=sp, config=TailConfig(**KW))
    same(a, b)
    off = (g16.view(torch.int16) + 1).view(torch.bfloat16)
    c = decode_tail(x, off, w, sampling_params=sp, **KW)
    assert not torch.equal(bits(c.logits), bits(a.logits))


@pytest.mark.parametrize("h,ssq_depth", [(1, 13), (96, 13), (256, 13), (257, 14), (2880, 24), (3072, 24)])
def test_declaration_is_pinned(h, ssq_depth):
    """The tail's declared sums, written out here by hand (not from the op's constants):
    ssq a strided(256) fp32 chain, depth ceil(H/256) + 5 + 7; gemm by default amx32 (fp32,
    depth 16 + 1 + ceil(H/32), FTZ/DAZ, 34 roundings per block), with gemm_order="chain"
    a sequential fp32 chain, depth H, gradual underflow. A change to the op's order
    constant must change this test too."""
    for deferred in (True, False):
        d = tail_decl(h, deferred)
        assert (d.sum("ssq").dtype, d.sum("ssq").depth) == ("fp32", ssq_depth)
        g = d.sum("gemm")
        assert (g.dtype, g.depth, g.flush, g.roundings) == ("fp32", 16 + 1 + -(-h // 32), True, 34 * -(-h // 32))
        c = tail_decl(h, deferred, "chain").sum("gemm")
        assert (c.dtype, c.depth, c.flush, c.roundings) == ("fp32", h, False, None)
        p = tail_decl(h, deferred, "dp32").sum("gemm")
        assert (p.dtype, p.depth, p.flush) == ("fp32", 32 + -(-h // 32), True)
    assert "strided(256)" in tail_decl(h).sum("ssq").order


def test_tail_path_fused_is_the_default_and_gives_the_reference_bytes(monkeypatch):
    """With the mirror exchange, tail_path "fused" (the default) runs the rows_tail kernel,
    "reference" never does;
    both give the same bytes (NaN lanes under nan_fold=True included; without the fold a
    NaN row is the NaN policy's ValueError, on the fused path read off the kernel's
    undecided rows, so the kernel has run once more). Planted: a kernel
    whose tokens are off by one is seen by the default path and not by "reference"."""
    from lmtail.kernels.tail import rows_tail as rows_kernel

    if not rows_kernel.available_backends():
        pytest.skip("no C compiler: tail_path 'fused' runs the reference path")
    x, gamma, w = problem(9, 11)
    sp = params(9, 11)
    w_nan = w.clone()
    w_nan[:, 7] = float("nan")  # NaN logits on every row
    real = rows_kernel.rows_tail_fused
    calls = []

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(rows_kernel, "rows_tail_fused", spy)
    ref = decode_tail(x, gamma, w, sampling_params=sp, tail_path="reference", **KW_MIRROR)
    assert calls == []
    for ww, cfg in ((w, dict(KW_MIRROR)), (w_nan, dict(KW_MIRROR, nan_fold=True))):
        got = decode_tail(x, gamma, ww, sampling_params=sp, **cfg)
        same(got, decode_tail(x, gamma, ww, sampling_params=sp, tail_path="reference", **cfg))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="NaN in the logits"):
        decode_tail(x, gamma, w_nan, sampling_params=sp, **KW_MIRROR)
    assert len(calls) == 3
    same(decode_tail(x[:, :], gamma, w, sampling_params=sp, config=TailConfig(**KW_MIRROR)), ref)

    def off_by_one(*a, **kw):
        out = real(*a, **kw)
        out.tokens.add_(1)
        return out

    monkeypatch.setattr(rows_kernel, "rows_tail_fused", off_by_one)
    w2 = w.clone()
    w2[:, 7] = 0.0  # NaN-free: every row decided by the kernel
    bad = decode_tail(x, gamma, w2, sampling_params=sp, **KW_MIRROR).tokens
    good = decode_tail(x, gamma, w2, sampling_params=sp, tail_path="reference", **KW_MIRROR).tokens
    assert torch.equal(bad, good + 1)


def test_gemm_order_changes_only_what_its_declaration_allows():
    """gemm_order="amx32" is another declared sum: its logits differ from "chain" in some
    fp32 bits (planted: were they equal, the option would not reach the GEMM), and its
    declared GEMM depth is 16 + 1 + ceil(H/32) (written out here)."""
    x, gamma, w = problem(16, 9, h=512, v=400)
    a = decode_tail(x, gamma, w, k=4, gemm_order="chain").logits
    b = decode_tail(x, gamma, w, k=4, gemm_order="amx32").logits
    assert not torch.equal(bits(a), bits(b))
    assert tail_decl(512, True, "amx32").sum("gemm").depth == 16 + 1 + 16


@pytest.mark.parametrize("deferred", [True, False])
def test_dp32_logits_are_the_dp32_gemm_composed_as_the_tail_composes_it(deferred):
    """gemm_order="dp32": logits == fp32(gemm_bf16(a, W, order="dp32") * rms) (deferred) or
    gemm_bf16(a, W, order="dp32") (legacy) on normed_rows' a and rms, and == the same with
    reference.gemm.gemm_dp32_emulation, byte for byte. Planted: the amx32 order differs."""
    from lmtail.kernels.gemm.bf16 import gemm_bf16
    from lmtail.reference.gemm import gemm_dp32_emulation
    from lmtail.tail.compose import normed_rows

    x, gamma, w = problem(6, 11, h=160, v=333)
    cfg = TailConfig(hidden_actual=152, k=4, deferred_rms=deferred, gemm_order="dp32")
    got = decode_tail(x, gamma, w, config=cfg).logits  # [6, 333]
    a, rms = normed_rows(x, gamma, cfg)  # [6, 160] bf16, [6] fp32
    scale = (lambda acc: acc * rms[:, None]) if deferred else (lambda acc: acc)
    assert torch.equal(bits(got), bits(scale(gemm_bf16(a, w, order="dp32"))))
    assert torch.equal(bits(got), bits(scale(gemm_dp32_emulation(a, w))))
    assert not torch.equal(bits(got), bits(scale(gemm_bf16(a, w, order="amx32"))))


def test_dp32_tail_is_batch_thread_and_repeat_invariant():
    """gemm_order="dp32" end to end (sampled): every row alone, the batch, and the batch
    reversed give the same bytes per row; 1 thread == 2 threads == a repeat."""
    x, gamma, w = problem(33, 12)
    sp = params(33, 12)
    kw = dict(KW, gemm_order="dp32")
    full = decode_tail(x, gamma, w, sampling_params=sp, **kw)
    rev = torch.arange(32, -1, -1)
    back = decode_tail(x[rev], gamma, w, sampling_params=sp[rev], **kw)
    for f in ("topk_values", "topk_indices", "tokens", "logprobs", "truncated", "logits"):
        assert torch.equal(bits(getattr(back, f)), bits(getattr(full, f)[rev])), f
    for r in (0, 5, 32):
        same(decode_tail(x[r:r + 1], gamma, w, sampling_params=sp[r:r + 1], **kw), full, slice(r, r + 1))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_tail(x, gamma, w, sampling_params=sp, **kw)
        torch.set_num_threads(2)
        two = decode_tail(x, gamma, w, sampling_params=sp, **kw)
    finally:
        torch.set_num_threads(n)
    same(one, full)
    same(two, full)
    assert not torch.equal(bits(decode_tail(x, gamma, w, sampling_params=sp, **KW).logits), bits(full.logits))


@pytest.mark.parametrize("order", ["amx32", "dp32"])
@pytest.mark.parametrize("deferred", [True, False])
def test_amx32_range_declares_daz_and_ftz(deferred, order):
    """The default (amx32) GEMM and dp32 read subnormal inputs as 0 (DAZ) and flush tiny
    results (FTZ); the tail's range takes both from the declared sum's flush. Planted: the
    same declaration without flush leaves their logits outside on such data."""
    from dataclasses import replace

    x, gamma, w = problem(4, 3, h=256, v=64)
    cases = {"daz": (x * 2.0**-128, w), "ftz": (x * 2.0**-64, (w.float() * 2.0**-62).to(torch.bfloat16))}
    for name, (xx, ww) in cases.items():
        kw = dict(eps=1e-5, hidden_actual=256, interleaved=False, deferred_rms=deferred)
        got = decode_tail(xx, gamma, ww, k=1, hidden_actual=256, zero_interleaved_pad=False,
                          deferred_rms=deferred, gemm_order=order).logits.double().numpy()
        decl = tail_decl(256, deferred, order)
        lo, hi = logits_range(xx, gamma, ww, decl=decl, **kw)
        assert ((lo <= got) & (got <= hi)).all(), name
        ieee = replace(decl, sums=tuple(replace(s, flush=False) for s in decl.sums))
        lo, hi = logits_range(xx, gamma, ww, decl=ieee, **kw)
        assert not ((lo <= got) & (got <= hi)).all(), name


def test_bf16x2_split_is_exact():
    """head_input="bf16x2": a_lo = bf16(fp32(g - a_hi)) where the fp32 difference g - a_hi is
    exact (the rounding error of a bf16 rounding of an fp32 value is an fp32 number), so
    a_hi + a_lo carries g to 16 significant bits: |g - (a_hi + a_lo)| <= 2**-16 |g| + 2**-134
    (float64; the absolute term is half a bf16 subnormal step). Values across the fp32 range,
    subnormals included. Planted: the difference taken in bf16 arithmetic (0 here), whose
    split is as coarse as a_hi alone."""
    g32 = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * torch.logspace(-40, 30, 4096)
    g32 = g32.to(torch.float32)
    hi = g32.to(torch.bfloat16)
    diff = g32 - hi.to(torch.float32)
    assert torch.equal(diff.double(), g32.double() - hi.double())  # the fp32 difference is exact
    lo = diff.to(torch.bfloat16)
    err = (g32.double() - (hi.double() + lo.double())).abs()
    bound = 2.0**-16 * g32.double().abs() + 2.0**-134
    assert bool((err <= bound).all())
    planted = (g32.to(torch.bfloat16) - hi).double()  # the difference in bf16: always 0 here
    assert not bool(((g32.double() - (hi.double() + planted)).abs() <= bound).all())


# ---------------------------------------------------------------------------------------
# the norm's C pass (kernels.tail.shard_partials.tail_norm) against the torch ops, bit for bit
# ---------------------------------------------------------------------------------------
def _norm_inputs(seed, gbs, h):
    """hidden [gbs, h] fp32 and gamma [h] fp32 across the fp32 range: subnormals, +-0,
    +-inf, huge lanes (ssq overflows), tiny rows (ssq underflows), ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g) * torch.logspace(-25, 25, gbs)[:, None]
    x[0, : h // 3] = 1e-42  # subnormal lanes
    x[1] = torch.randint(-4, 5, (h,), generator=g).float()  # small integers: exact ssq, +-0
    x[1, 0] = -0.0
    x[2, 3] = float("inf")
    x[3, 5] = -3e38
    x[4] = 1e-30  # squares underflow to 0: ssq 0
    gamma = 1 + 0.3 * torch.randn(h, generator=g)
    gamma[7] = 1e-40
    gamma[8] = -0.0
    return x.contiguous(), gamma


@pytest.mark.parametrize("h, h_u, interleaved", [(96, 88, False), (96, 88, True), (96, 96, True), (600, 577, False),
                                                 (256, 256, False), (40, 37, False)])
@pytest.mark.parametrize("head_input", ["fp32", "bf16", "bf16x2"])
def test_norm_c_pass_is_the_torch_ops(monkeypatch, h, h_u, interleaved, head_input):
    """normed_rows (deferred rms) through the C pass equals its torch ops (the pass
    disabled) bit for bit: a, rms on every head input, pad layout and special lanes; the
    eps = 0 refusal names the same rows; fp16 / bf16 hidden and bf16 gamma widen the same.
    Planted: the C pass's ssq summed in plain lane order is red."""
    from lmtail.tail import compose as tail_mod
    from lmtail.kernels.tail import shard_partials as spk

    x, gamma = _norm_inputs(h + h_u, 12, h)
    cfgs = [TailConfig(hidden_actual=h_u, zero_interleaved_pad=interleaved, head_input=head_input, eps=e)
            for e in (1e-5, 1e-6, 3.0)]
    real = spk.tail_norm
    for cfg in cfgs:
        for xx, gg in ((x, gamma), (x.to(torch.bfloat16), gamma.to(torch.bfloat16)), (x.to(torch.float16), gamma)):
            monkeypatch.setattr(spk, "tail_norm", real)
            assert spk.tail_norm(xx.float(), gg.float(), None, h_u, cfg.eps) is not None  # the C pass runs
            got = tail_mod.normed_rows(xx, gg, cfg)
            monkeypatch.setattr(spk, "tail_norm", lambda *a, **k: None)
            want = tail_mod.normed_rows(xx, gg, cfg)
            for a, b in zip(got, want):
                assert torch.equal(bits(a), bits(b)), (cfg, xx.dtype)
    # eps = 0: the same rows refused with the same words (rows 0 and 4 square to 0)
    cfg0 = replace(cfgs[0], eps=0.0)
    msgs = []
    for fn in (real, lambda *a, **k: None):
        monkeypatch.setattr(spk, "tail_norm", fn)
        with pytest.raises(ValueError, match=r"leaves hidden_states row\(s\) \[0, 4\] undefined") as e:
            tail_mod.normed_rows(x, gamma, cfg0)
        msgs.append(str(e.value))
    assert msgs[0] == msgs[1]
    # planted: ssq in plain lane order (not strided(256)) differs somewhere
    monkeypatch.setattr(spk, "tail_norm", real)
    xs = torch.randn(64, h, generator=torch.Generator().manual_seed(1)).contiguous()
    rms = tail_mod.normed_rows(xs, gamma, cfgs[0])[1]
    xr = torch.where(pad_mask(h, h_u, interleaved), xs, torch.zeros(()))
    plain = torch.tensor([float(np.float32(np.sum(np.float32(r) ** 2, dtype=np.float32))) for r in xr.numpy()])
    planted = 1 / torch.sqrt(plain.float() / h_u + torch.tensor(1e-5, dtype=torch.float32))
    assert h < 256 or not torch.equal(bits(rms), bits(planted.float()))


def test_norm_c_pass_leaves_nan_rows_to_torch(monkeypatch):
    """A NaN on a real lane of x or gamma: the C pass declines (None) and the torch ops give
    the bytes (NaN payloads are theirs); a NaN on a pad lane is ignored by both."""
    from lmtail.tail import compose as tail_mod
    from lmtail.kernels.tail import shard_partials as spk

    x, gamma, _ = problem(3, 2)
    cfg = TailConfig(hidden_actual=H_U, zero_interleaved_pad=False, head_input="fp32")
    x[:, H_U + 1] = float("nan")  # pad lane
    assert spk.tail_norm(x, gamma, pad_mask(H, H_U, False), H_U, 1e-5) is not None
    x[1, 2] = float("nan")
    assert spk.tail_norm(x, gamma, pad_mask(H, H_U, False), H_U, 1e-5) is None
    g2 = gamma.clone()
    g2[5] = float("nan")
    assert spk.tail_norm(x[[0]], g2, pad_mask(H, H_U, False), H_U, 1e-5) is None
    got = tail_mod.normed_rows(x, gamma, cfg)
    monkeypatch.setattr(spk, "tail_norm", lambda *a, **k: None)
    want = tail_mod.normed_rows(x, gamma, cfg)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want))


@pytest.mark.parametrize("gemm_order,exchange", [("amx32", "candidates"), ("dp32", "mirror")])
def test_packed_head_equals_plain_head_bitwise(gemm_order, exchange):
    """A head packed once at load (kernels.gemm.bf16.PackedWeight) gives the plain head's bytes;
    the chain order, head_shard and head_input='fp32' refuse it with their words."""
    from lmtail.kernels.gemm.bf16 import pack_weight
    from lmtail.tail.compose import head_shard

    x, gamma, w = problem(5, 3)
    sp = params(5, 3)
    kw = dict(KW, gemm_order=gemm_order, exchange=exchange, sampling_params=sp)
    same(decode_tail(x, gamma, pack_weight(w), **kw), decode_tail(x, gamma, w, **kw))
    with pytest.raises(ValueError, match="gemm_order must be 'amx32' or 'dp32' with a PackedWeight head"):
        decode_tail(x, gamma, pack_weight(w), **dict(kw, gemm_order="chain"))
    with pytest.raises(ValueError, match="head_shard takes the plain"):
        head_shard(pack_weight(w), 0, 2)
    with pytest.raises(ValueError, match=r"a PackedWeight head must be \[H=64, V_s\]"):
        decode_tail(x[:, :64], gamma[:64], pack_weight(w), **dict(kw, hidden_actual=None))


def test_the_odd_width_is_the_one_named():
    """x [4, 257] with gamma [256] and w [256, 1024]: hidden_states is named (gamma and the
    head agree); an odd gamma or an odd weight keep their own messages."""
    x, gamma, w = problem(4, 0, h=256, v=1024)
    with pytest.raises(ValueError, match=r"hidden_states must be \[gbs, H=256\] \(gamma \(256,\) and "
                                         r"lm_head_weight_t \(256, 1024\) agree on H=256\); got \(4, 257\)"):
        decode_tail(torch.randn(4, 257), gamma, w, k=8)
    with pytest.raises(ValueError, match=r"gamma must be \[H=256\]"):
        decode_tail(x, gamma[:255], w, k=8)
    with pytest.raises(ValueError, match=r"lm_head_weight_t must be \[H=256, V_s\]"):
        decode_tail(x, gamma, w[:255].contiguous(), k=8)
