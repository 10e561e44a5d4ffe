"""The "quant" body: the declared body whose linears run kernels.quant.gemm_q.gemm_q on the GGUF's
own Q4_1 blocks (bf16 inputs widened exactly to fp32). Row-invariance gates (solo == batch,
cached == chunked == one prefill, threads 1 == 2), its linears inside gemm_q's float64
range, and its distance to the fp32 reference body (of the declared body's order: see the
last test for why it is not below it)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import at_threads, bits, cached_vs_recomputed, mean_kl, teacher_forced_logp
from conftest import last_hidden as shared_last_hidden

from lmtail.kernels.quant.gemm_q import GEMM_Q, dequantize, gemm_q_decl
from lmtail.model import llama
from lmtail.model.generate import generate
from lmtail.model.gguf_loader import QuantLinears, quant_linears
from lmtail.reference.gemm import in_range
from lmtail.reference.quant import gemm_q_f64, gemm_q_range

QUANT = llama.lmtail_ops(body="quant")
DECLARED = llama.lmtail_ops()


def last_hidden(bundle, prompts, feed, steps=2, ops=QUANT):
    return shared_last_hidden(bundle, prompts, feed, ops=ops, steps=steps)


def blas_linear_q(y, ws, **kw):
    """Planted: the quant linear as one fp32 BLAS call over the whole batch (shape-dependent)."""
    a = y.float()
    return torch.cat([a @ dequantize(w).T for w in ws], 1)


def threads_split_linear_q(y, ws, *, row, threads):
    """Planted: the in-dim split in `threads` halves, partial results added (thread-dependent)."""
    a = y.float()
    K = a.shape[1]
    cut = K // 2 if torch.get_num_threads() > 1 else K
    out = [a[:, :cut] @ dequantize(w)[:, :cut].T for w in ws]
    if cut < K:
        out = [o + a[:, cut:] @ dequantize(w)[:, cut:].T for o, w in zip(out, ws)]
    return torch.cat(out, 1)


def test_quant_linears_are_the_files_blocks(bundle):
    ql = quant_linears(bundle)
    assert len(ql) == bundle.config.n_layers and isinstance(ql[0], QuantLinears)
    assert quant_linears(bundle) is ql  # cached: built once
    assert {w.fmt for q in ql for ws in (q.w_qkv, q.w_o, q.w_gu, q.w_down) for w in ws} == {"Q4_1"}
    assert sum(q.nbytes for q in ql) == 30 * 20 * (576 * 576 * 2 + 192 * 576 * 2 + 1536 * 576 * 3) // 32
    with pytest.raises(ValueError, match=r"body must be one of \('fp32', 'declared', 'quant', 'q32', 'bq32'\); got 'q4'"):
        llama.Ops(add_rms=llama.add_rms_fp32, body="q4")
    with pytest.raises(ValueError, match="the quant body needs add_rms_bf16"):
        llama.Ops(add_rms=llama.add_rms_fp32, body="quant")


def test_solo_equals_batch_bitwise(bundle, ids, monkeypatch):
    """Each row's hidden states (prefill and 2 decode steps) are the same bytes alone as in a
    left-padded batch of 3, and as in the batch reversed. Planted: a whole-batch BLAS linear."""
    prompts, feed = [ids[:1], ids[40:53], ids[80:98]], [100, 101, 102]
    together = last_hidden(bundle, prompts, feed)
    assert torch.equal(bits(together), bits(last_hidden(bundle, prompts[::-1], feed[::-1]).flip(0)))
    for b in range(3):
        assert torch.equal(bits(last_hidden(bundle, [prompts[b]], [feed[b]])[0]), bits(together[b])), b
    monkeypatch.setattr(llama, "linear_q", blas_linear_q)
    wrong = last_hidden(bundle, prompts, feed)
    assert not all(torch.equal(bits(last_hidden(bundle, [prompts[b]], [feed[b]])[0]), bits(wrong[b]))
                   for b in range(3))


def test_generation_solo_equals_batch(bundle):
    """Greedy token ids and logprob bits: each prompt alone == its row in a batch of 2."""
    qs = ["What is 2+2?", "Name a color."]
    both = generate(bundle, qs, max_new_tokens=4, ops=QUANT)
    for b in range(2):
        solo = generate(bundle, [qs[b]], max_new_tokens=4, ops=QUANT)
        assert solo.token_ids[0] == both.token_ids[b]
        assert np.array_equal(np.array(solo.logprobs[0], np.float64).view(np.int64),
                              np.array(both.logprobs[b], np.float64).view(np.int64))


def test_cached_equals_recomputed_bitwise(bundle, ids):
    """One 20-token forward == prefill of 14 + 6 single-token decode steps == prefill in
    chunks of 7 (llama.prefill), bitwise."""
    want, stepped, last = cached_vs_recomputed(bundle, ids, QUANT)
    assert torch.equal(bits(stepped), bits(want)) and torch.equal(bits(last), bits(want[:, -1]))


def test_threads_1_equals_2(bundle, ids, monkeypatch):
    """A 2-row left-padded batch: the same bytes on 1 and 2 threads. Planted: a linear
    whose in-dim split follows the thread count."""
    prompts, feed = [ids[:9], ids[50:70]], [7, 8]

    def at(n):
        return at_threads(n, lambda: last_hidden(bundle, prompts, feed, steps=1))

    assert torch.equal(bits(at(1)), bits(at(2)))
    monkeypatch.setattr(llama, "linear_q", threads_split_linear_q)
    assert not torch.equal(bits(at(1)), bits(at(2)))


def test_linears_inside_float64_range(bundle):
    """Layer 0's four linears on bf16 rows: inside gemm_q_decl's float64 range around the
    exact dequantized weights, within 1e-4 of the float64 product. Planted: the declared
    body's bf16-rounded weights (the same inputs) land outside."""
    q0, row = quant_linears(bundle)[0], GEMM_Q.pick(None)
    g = torch.Generator().manual_seed(5)
    for ws in (q0.w_qkv, q0.w_o, q0.w_gu, q0.w_down):
        y = torch.randn(3, ws[0].shape[1], generator=g).to(torch.bfloat16)  # [3, K]
        out = llama.linear_q(y, ws, row=row, threads=2)  # [3, sum N]
        a, c0 = y.float(), 0
        for w in ws:
            part = out[:, c0:c0 + w.shape[0]]
            lo, hi = gemm_q_range(a, w, gemm_q_decl(w.shape[1], w.fmt))
            assert in_range(part, lo, hi).all()
            assert np.abs(part.double().numpy() - gemm_q_f64(a, w)).max() < 1e-4
            bad = a @ dequantize(w).to(torch.bfloat16).float().T
            assert not in_range(bad, lo, hi).all()
            c0 += w.shape[0]


def test_distance_to_fp32_like_declared(bundle, ids):
    """Teacher-forced on 64 tokens: mean KL from the fp32 reference body's distribution.
    The quant body's weights are the file's exact values, but it keeps the declared body's
    bf16 rounding points (residual stream, norm outputs, linear inputs), which dominate the
    distance: measured on GPL-3 windows it is NOT reliably below the declared body's
    (tokens 0..63: 1.37e-3 vs 1.11e-3; 500..563: 1.53e-3 vs 1.77e-3; 0..255: 8.8e-4 vs
    8.9e-4). Asserted: both small, and quant within 1.5x of declared."""
    def logp(ops):
        return teacher_forced_logp(bundle, ids[:64], ops)  # [64, V]

    ref = logp(llama.FP32_OPS)
    kl_q, kl_d = mean_kl(ref, logp(QUANT)), mean_kl(ref, logp(DECLARED))
    print(f"mean KL to the fp32 body over 64 tokens: quant {kl_q:.3e}, declared {kl_d:.3e}")
    assert kl_q < 5e-3 and kl_d < 5e-3
    assert kl_q < 1.5 * kl_d
