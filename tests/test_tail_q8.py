"""decode_tail with the checkpoint's Q8_0 head: lm_head_weight_t a kernels.quant.gemm_q.QuantWeight
"Q8_0" (V_s, H), head_input="fp32" (src/lmtail/tail/compose.py; docs/quant.md, "The Q8_0 head").

Each property is asserted on bit views and comes with a planted wrong variant that the same
comparison must reject:
  * bytes == a plain composition (the norm's own normed_rows rms, gemm_q on g = fp32(x*gamma),
    acc*rms)  -- planted: g rounded to bf16 first;
  * inside reference.tail.logits_range of tail_decl(..., "fp32") over the exact dequantized
    head  -- planted: the bf16 activation, and the bf16-activation declaration;
  * a row alone == the row in a batch  -- planted: rms over the batch's mean ssq;
  * both exchanges: "candidates" == candidates_emulation of the fp32 logits, "mirror" ==
    exact top-k of their bf16 mirror  -- planted: the top-k of the bf16 head's logits;
  * VTP shards in one process (QuantWeight.rows) == one rank  -- planted: strided rows;
  * 2 gloo ranks == 1 rank, both exchanges, G 1 and 2  -- planted: the ownership map shifted
    (@pytest.mark.slow: run with -m slow);
  * the defined errors (ValueError naming the argument, expected vs got).

Shape legend: gbs rows, H hidden (a multiple of 32), H_u real lanes, V vocab, V_s = V / VTP, k.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from conftest import bits, gather_rows, same_bits
from lmtail.tail.config import TailConfig
from lmtail.contract import head_kinds as hk
from lmtail.contract.certify import certify_tail
from lmtail.kernels.quant.gemm_q import QuantWeight, dequantize, gemm_q
from lmtail.launch import launch
from lmtail.tail.layout import owned_rows
from lmtail.reference.candidates import candidates_emulation
from lmtail.reference.tail import logits_range, topk_ref
from lmtail.tail.compose import TAIL_SIGNATURE, decode_tail, normed_rows, tail_decl, tail_signature

H, H_U, V, GBS, K = 128, 120, 296, 6, 8
FIELDS = ("logits", "topk_values", "topk_indices", "tokens", "logprobs", "truncated")


def inputs(seed=0, gbs=GBS, h=H, v=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(gbs, h, generator=g)
    x[:, 3] *= 20.0
    gamma = 1 + 0.3 * torch.randn(h, generator=g)
    w = QuantWeight.quantize(torch.randn(v, h, generator=g) / h**0.5, "Q8_0")  # (V, H)
    sp = torch.tensor([[0, 1.0, 0.0, 0.5, 0.0], [8, 0.9, 0.8, 0.3, 0.0], [0, 1.0, 1.5, 0.7, 0.05],
                       [4, 1.0, 1.0, 0.1, 0.0], [0, 0.95, 0.7, 0.9, 0.0], [2, 1.0, 2.0, 0.5, 0.0]],
                      dtype=torch.float32)[:gbs]
    return x, gamma, w, sp


KW = dict(k=K, hidden_actual=H_U, zero_interleaved_pad=False, head_input="fp32")
CFG = TailConfig(k=K, hidden_actual=H_U, zero_interleaved_pad=False, head_input="fp32")


def composed(x, gamma, w, *, bf16_act=False, batch_rms=False):
    """The plain composition: rms from the tail's own norm code, gemm_q on g = fp32(x*gamma)
    (pad lanes 0), acc*rms. bf16_act / batch_rms: planted wrong variants."""
    g, rms = normed_rows(x, gamma, CFG)  # [gbs, H] fp32, [gbs]
    if bf16_act:
        g = g.to(torch.bfloat16).float()
    if batch_rms:
        rms = torch.full_like(rms, float(rms.mean()))
    return gemm_q(g, w) * rms[:, None]


def test_bytes_are_the_plain_composition():
    x, gamma, w, sp = inputs()
    out = decode_tail(x, gamma, w, sampling_params=sp, **KW)
    g, _ = normed_rows(x, gamma, CFG)
    assert g.dtype == torch.float32 and not g[:, H_U:].any()  # pad lanes are zeros in g
    want = (x[:, :H_U] * gamma[:H_U]).float()
    assert same_bits(g[:, :H_U], want)  # g is fp32(x*gamma), unrounded
    assert same_bits(out.logits, composed(x, gamma, w))
    assert not same_bits(out.logits, composed(x, gamma, w, bf16_act=True))  # planted


def test_inside_the_float64_range():
    x, gamma, w, _ = inputs(1)
    y = decode_tail(x, gamma, w, **KW).logits.double().numpy()
    decl = tail_decl(H, True, TailConfig.gemm_order, "candidates", "fp32")
    assert decl.sum("gemm").depth == H // 32 + 5 and not decl.sum("gemm").flush
    assert "a:bf16" not in decl.rounding_points and "x*gamma:fp32" in decl.rounding_points
    kw = dict(eps=1e-5, hidden_actual=H_U, interleaved=False)
    lo, hi = logits_range(x, gamma, w, decl=decl, **kw)
    assert ((y >= lo) & (y <= hi)).all()
    assert np.median((hi - lo) / np.abs(y).max(axis=1, keepdims=True)) < 1e-5  # a few ulps, not a free pass
    bad = composed(x, gamma, w, bf16_act=True).double().numpy()  # planted: the bf16 activation
    assert not ((bad >= lo) & (bad <= hi)).all()
    lo_b, hi_b = logits_range(x, gamma, w, decl=tail_decl(H, True, exchange="candidates"), **kw)
    assert not ((y >= lo_b) & (y <= hi_b)).all()  # planted: the bf16-activation declaration


def test_solo_equals_in_batch():
    x, gamma, w, sp = inputs(2)
    full = decode_tail(x, gamma, w, sampling_params=sp, **KW)
    for i in (0, 3, GBS - 1):
        one = decode_tail(x[i:i + 1], gamma, w, sampling_params=sp[i:i + 1], **KW)
        for f in FIELDS:
            assert same_bits(getattr(one, f), getattr(full, f)[i:i + 1]), (i, f)
    batch_wrong = composed(x, gamma, w, batch_rms=True)  # planted: a statistic over the batch
    assert not same_bits(composed(x[:1], gamma, w, batch_rms=True), batch_wrong[:1])


def test_both_exchanges():
    x, gamma, w, sp = inputs(3)
    cand = decode_tail(x, gamma, w, sampling_params=sp, debug_taps=True, **KW)
    em = candidates_emulation(cand.logits, k=K, nan_fold=False)
    assert same_bits(cand.topk_values, torch.from_numpy(np.ascontiguousarray(em["values"])))
    assert same_bits(cand.topk_indices, torch.from_numpy(np.ascontiguousarray(em["ids"])))
    mir = decode_tail(x, gamma, w, sampling_params=sp, exchange="mirror", **KW)
    assert same_bits(mir.logits, cand.logits)
    rv, ri = topk_ref(cand.logits.to(torch.bfloat16), K)
    assert (mir.topk_indices.numpy() == ri).all() and (mir.topk_values.double().numpy() == rv).all()
    # planted: the same judgement on the bf16 head's logits (the same weights, bf16 activation path)
    wt = dequantize(w).t().contiguous().to(torch.bfloat16)  # Q8_0 values are not all bf16: a different head
    other = decode_tail(x, gamma, wt, k=K, hidden_actual=H_U, zero_interleaved_pad=False)
    assert not same_bits(other.topk_values, cand.topk_values)


def test_vtp_shards_in_one_process():
    data = hk.q8_data(5, H, H_U, V, False, 4, k=K)
    one = hk.head_variant(data)
    real = decode_tail(data["x"], data["gamma"], data["w"], sampling_params=data["sp"], debug_taps=True,
                       k=K, hidden_actual=H_U, zero_interleaved_pad=False, head_input="fp32", eps=data["eps"])
    for f in FIELDS:
        assert same_bits(one[f], getattr(real, f)), f
    for vtp in (2, 4, 8):
        got = hk.head_variant(dict(data, vtp=vtp))
        assert all(same_bits(got[f], one[f]) for f in FIELDS), vtp
    wrong = hk.head_variant(dict(data, vtp=2), defect="shard_strided")  # planted
    assert not same_bits(wrong["logits"], one["logits"])


def test_rows_slices_the_head():
    _, _, w, _ = inputs(5)
    r = w.rows(37, 111)
    assert r.shape == (74, H) and r.data.data_ptr() == w.data[37].data_ptr()  # a view, no copy
    assert same_bits(dequantize(r), dequantize(w)[37:111])
    assert w.rows(5, 5).shape == (0, H)
    for bad in ((-1, 3), (4, 2), (0, V + 1), (0.5, 3)):
        with pytest.raises(ValueError, match=r"rows\(start, stop\) needs ints 0 <= start <= stop <= N=296"):
            w.rows(*bad)


def test_errors_name_the_argument():
    x, gamma, w, _ = inputs(6)
    q41 = QuantWeight.quantize(torch.randn(V, H) * 0.05, "Q4_1")
    cases = [
        (dict(lm_head_weight_t=q41), r"lm_head_weight_t: a QuantWeight head must be fmt 'Q8_0'; got 'Q4_1'"),
        (dict(lm_head_weight_t=QuantWeight.quantize(torch.randn(V, 96), "Q8_0")),
         r"lm_head_weight_t: a Q8_0 head must be \(V_s, K=H=128\); got \(296, 96\)"),
        (dict(head_input="bf16"), r"head_input must be 'fp32' with a Q8_0 head .*got 'bf16'"),
        (dict(head_input="bf16x2"), r"head_input must be 'fp32' with a Q8_0 head .*got 'bf16x2'"),
        (dict(lm_head_weight_t=dequantize(w).t().contiguous().bfloat16()),
         r"head_input='fp32' needs a kernels.quant.gemm_q.QuantWeight Q8_0 head \(V_s, H=128\) .*got a torch.bfloat16"),
        (dict(gemm_order="chain"), r"gemm_order must be the default 'amx32' with a Q8_0 head .*got 'chain'"),
        (dict(deferred_rms=False), r"head_input='fp32' needs deferred_rms=True"),
        (dict(head_input="fp64"), r"head_input must be one of \('bf16', 'bf16x2', 'fp32'\); got 'fp64'"),
    ]
    for kw, msg in cases:
        args = dict(lm_head_weight_t=w, head_input="fp32")
        args.update(kw)
        with pytest.raises(ValueError, match=msg):
            decode_tail(x, gamma, args.pop("lm_head_weight_t"), k=K, **args)
    with pytest.raises(ValueError, match=r"K must be a positive multiple of 32; got 48"):
        tail_decl(48, True, TailConfig.gemm_order, "candidates", "fp32")
    out = decode_tail(x, gamma, w, **KW)
    with pytest.raises(ValueError, match=r"head_input='fp32' goes with a Q8_0 head .*got head_input='bf16' with "
                                         r"a QuantWeight Q8_0"):
        certify_tail(x, gamma, w, out, hidden_actual=H_U, interleaved=False)


def test_certified_and_signature_covers_the_head():
    x, gamma, w, sp = inputs(7)
    out = decode_tail(x, gamma, w, sampling_params=sp, **KW)
    c = certify_tail(x, gamma, w, out, sampling_params=sp, hidden_actual=H_U, interleaved=False, head_input="fp32")
    assert c["ok"] and c["certified"] > 0, c
    sig = dict(zip(TAIL_SIGNATURE, tail_signature(x, gamma, w, sp, CFG, hops=(2,), batch_groups=1, fence=False)))
    wt = dequantize(w).t().contiguous().bfloat16()
    sig_b = dict(zip(TAIL_SIGNATURE, tail_signature(x, gamma, wt, sp, TailConfig(k=K, hidden_actual=H_U,
                                                                                  zero_interleaved_pad=False),
                                                    hops=(2,), batch_groups=1, fence=False)))
    assert sig["V_s"] == sig_b["V_s"] and sig["head format"] != sig_b["head format"]


# ---------------------------------------------------------------------------------------
# 2 gloo ranks == 1 rank
# ---------------------------------------------------------------------------------------
LAYOUTS = [("candidates", 1), ("candidates", 2), ("mirror", 1), ("mirror", 2)]  # (exchange, G)
RGBS = 8


def _rank_job(rank, world):
    import torch.distributed as dist

    x, gamma, w, _ = inputs(8, gbs=RGBS)
    sp = torch.cat([inputs(8)[3], inputs(8)[3][:2]])  # [8, 5]
    vs = V // world
    outs = []
    for exchange, g in LAYOUTS:
        rows = owned_rows(rank, world, RGBS, (world,), g)
        o = decode_tail(x, gamma, w.rows(rank * vs, (rank + 1) * vs), sampling_params=sp[rows],
                        group=dist.group.WORLD, batch_groups=g, exchange=exchange, timeout=60, **KW)
        outs.append({f: getattr(o, f) for f in FIELDS})
    return outs


def check_ranks(res, world, *, shift=0):
    x, gamma, w, _ = inputs(8, gbs=RGBS)
    sp = torch.cat([inputs(8)[3], inputs(8)[3][:2]])
    vs = V // world
    for i, (exchange, g) in enumerate(LAYOUTS):
        ref = decode_tail(x, gamma, w, sampling_params=sp, exchange=exchange, **KW)
        maps = {r: [(j + shift) % RGBS for j in owned_rows(r, world, RGBS, (world,), g)] for r in range(world)}
        for f in FIELDS[1:]:
            got = gather_rows({r: res[r][i][f] for r in range(world)}, maps, RGBS)
            assert same_bits(got, getattr(ref, f)), (exchange, g, f)
        for r in range(world):
            assert torch.equal(bits(res[r][i]["logits"]), bits(ref.logits[:, r * vs:(r + 1) * vs])), (exchange, r)


@pytest.mark.slow  # 2 spawned ranks: 8.6 s idle, 22-31 s under load on the 2-core box (budget: 10 s)
def test_two_ranks_are_bitwise_one_rank():
    t0 = time.monotonic()
    res = launch(_rank_job, 2, args=(2,), timeout_s=240, threads=1)
    print(f"2-rank job: {time.monotonic() - t0:.1f} s")
    check_ranks(res, 2)
    with pytest.raises(AssertionError):  # planted: a wrong ownership map, the same comparison goes red
        check_ranks(res, 2, shift=1)


def big_torch_ops(fn) -> list[str]:
    """The aten ops fn() runs on >= 32,768 elements (torch's parallel grain: such an op wakes
    torch's OpenMP team, whose spinning then takes a core from the body's next GEMM)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return [f"{e.name} {e.input_shapes}" for e in prof.events()
            if any(np.prod(s) >= 32768 for s in e.input_shapes if s)]


def test_decode_step_tail_wakes_no_torch_team(monkeypatch):
    """The model's tail at batch 1 and 4 (V = 49,152, the Q8_0 head, greedy and sampled rows)
    runs no torch op at torch's parallel grain: the deferred scale and the candidates'
    passes are C. Planted: the same tail with the scale as the torch op is caught."""
    x, gamma, _, sp = inputs(gbs=4)
    blocks = torch.randint(-127, 128, (49152, H // 32, 34), dtype=torch.int16).to(torch.uint8)  # q bytes
    blocks[:, :, :2] = torch.tensor([0x1F, 0x21], dtype=torch.uint8)  # d = fp16 0x211F ~ 0.01
    w = QuantWeight("Q8_0", (49152, H), blocks.reshape(49152, -1).contiguous())  # (V, H), random Q8_0
    for b in (1, 4):
        run = lambda: decode_tail(x[:b], gamma, w, **KW, sampling_params=sp[:b])  # noqa: E731
        run()
        assert big_torch_ops(run) == [], b
    from lmtail.kernels.tail import shard_partials as SP

    monkeypatch.setattr(SP, "scale_rows", lambda acc, rms: acc * rms[:, None])
    assert big_torch_ops(lambda: decode_tail(x[:1], gamma, w, **KW, sampling_params=sp[:1]))
