"""The "q32" body: the GGUF's own blocks (kernels.quant.gemm_q.gemm_q) on an fp32 stream, and its
native step (kernels/model/step.c: the whole layer loop in one C call). Gates: native == the python
loop bitwise (planted: a bf16 rounding inside the loop), solo == batch == reversed, cached
== chunked == one prefill, threads 1 == 2, the fp32 norm kernel == its torch spelling (special
values; planted: another lane count), and the distance to the fp32 reference body."""
from __future__ import annotations

import dataclasses
import pytest
import torch
from conftest import at_threads, bits, cached_vs_recomputed, last_hidden, mean_kl, teacher_forced_logp

from lmtail.kernels.model import body as kbody
from lmtail.kernels.model import step as kstep
from lmtail.model import body as decl
from lmtail.model import llama
from lmtail.model.gguf_loader import load_model
from lmtail.glue.norms import inv_rms
from lmtail.orders import strided

Q32 = llama.lmtail_ops(body="q32")
Q32_PY = dataclasses.replace(Q32, native_step=False)
BQ32 = llama.lmtail_ops(body="bq32")  # the same rows step, every linear on gemm_bq for all rows at once
needs_step = pytest.mark.skipif(not kstep.available("avx2" if "avx2" in llama.quant_mod.available_backends()
                                                    else "c", "c"), reason="the native step's C libraries are not built")


def hidden(bundle, prompts, feed, steps=2, ops=Q32):
    return last_hidden(bundle, prompts, feed, ops=ops, steps=steps)


def canon(t):
    """NaN payloads and signs aside (neither side declares them): every NaN as one pattern."""
    return torch.where(torch.isnan(t), torch.tensor(float("nan")), t)


def norm32_torch(x, r, g, lanes):
    h = x + (0.0 if r is None else r)
    return h, (h * inv_rms(h, eps=1e-5, order=strided(lanes))[:, None]) * g


@pytest.mark.skipif(not kbody.available(), reason="body.c is not built")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_add_rms_rows32_equals_torch_spelling(seed):
    """body.c's fp32 add + RMSNorm == h = x + r, norms.inv_rms(strided(lanes)), (h*inv)*gamma,
    bitwise: odd widths, inf / NaN / subnormal / zero rows, no residual. Planted: lanes 128."""
    g = torch.Generator().manual_seed(seed)
    for n, hdim in ((1, 576), (4, 97), (3, 1536)):
        x, r, gam = torch.randn(n, hdim, generator=g), torch.randn(n, hdim, generator=g), torch.randn(hdim, generator=g)
        x[0, 5] = float("inf") if n > 1 else x[0, 5]
        if n > 2:
            x[1, 2], x[2] = float("nan"), 1e-41  # a NaN row; a subnormal row
        for res in (r, None):
            got = kbody.add_rms_rows32(x, res, gam, 1e-5, 256)
            want = norm32_torch(x, res, gam, 256)
            assert all(torch.equal(bits(canon(a)), bits(canon(b))) for a, b in zip(got, want))
    x, gam = torch.randn(64, 1536, generator=g), torch.randn(1536, generator=g)
    assert not torch.equal(bits(kbody.add_rms_rows32(x, None, gam, 1e-5, 128)[1]),
                           bits(norm32_torch(x, None, gam, 256)[1]))


@needs_step
def test_native_step_takes_the_default_backends():
    """forward() runs the native step on the backends it picks by default (the fastest this
    CPU has), never silently the python loop; and every attend backend name is one it takes."""
    gemm, att = llama.quant_mod.GEMM_Q.pick(None).name, decl.ATTEND.pick(None).name
    assert kstep.available(gemm, att)
    assert all(kstep.available(gemm, b) for b in decl.ATTEND.names() if b != "torch")
    assert not kstep.available(gemm, "torch")


@needs_step
def test_native_step_equals_python_loop(bundle, ids, monkeypatch):
    """The one-call step == the python layer loop, bitwise, for a padded 3-row prefill and 2
    decode steps. Planted: the loop's attention output rounded to bf16 (the quant body's
    rounding point) is told apart."""
    prompts, feed = [ids[:5], ids[40:53], ids[80:91]], [100, 101, 102]
    native = hidden(bundle, prompts, feed)
    assert torch.equal(bits(native), bits(hidden(bundle, prompts, feed, ops=Q32_PY)))
    real = llama.attend_unchecked
    monkeypatch.setattr(llama, "attend_unchecked", lambda *a, **k: real(*a, **k).bfloat16().float())
    assert not torch.equal(bits(native), bits(hidden(bundle, prompts, feed, ops=Q32_PY)))


@pytest.mark.parametrize("ops", [Q32, Q32_PY], ids=["native", "python"])
def test_solo_equals_batch_bitwise(bundle, ids, ops):
    """Each row alone == in a left-padded batch of 3 == in the batch reversed (prefill + 2 steps)."""
    prompts, feed = [ids[:1], ids[40:53], ids[80:98]], [100, 101, 102]
    together = hidden(bundle, prompts, feed, ops=ops)
    assert torch.equal(bits(together), bits(hidden(bundle, prompts[::-1], feed[::-1], ops=ops).flip(0)))
    for b in range(3):
        assert torch.equal(bits(hidden(bundle, [prompts[b]], [feed[b]], ops=ops)[0]), bits(together[b])), b


def test_cached_equals_recomputed_bitwise(bundle, ids):
    """One 20-token forward == prefill of 14 + 6 decode steps == prefill in chunks of 7."""
    want, stepped, last = cached_vs_recomputed(bundle, ids, Q32)
    assert torch.equal(bits(stepped), bits(want)) and torch.equal(bits(last), bits(want[:, -1]))


def test_threads_1_equals_2(bundle, ids):
    prompts, feed = [ids[:9], ids[50:70]], [7, 8]

    def at(n):
        return at_threads(n, lambda: hidden(bundle, prompts, feed, steps=1))

    assert torch.equal(bits(at(1)), bits(at(2)))


def test_distance_to_fp32_reference(bundle, ids):
    """Teacher-forced on 64 tokens, the same fp32 head: the q32 body's distribution is within
    1e-8 mean KL of the fp32 reference body's (measured 1.5e-11 on 8 tokens), 100x below the
    declared body's (bf16 rounding points: ~1e-3)."""
    def logp(ops):
        return teacher_forced_logp(bundle, ids[:64], ops)  # [64, V]

    ref = logp(llama.FP32_OPS)
    kl_q, kl_d = mean_kl(ref, logp(Q32)), mean_kl(ref, logp(llama.lmtail_ops()))
    print(f"mean KL to the fp32 body over 64 tokens: q32 {kl_q:.3e}, declared {kl_d:.3e}")
    assert kl_q < 1e-8 and kl_q < kl_d / 100


def test_q32_needs_a_plain_strided_norm():
    with pytest.raises(ValueError, match=r"the q32 body needs fused_norm_lanes .* got None"):
        llama.Ops(add_rms=llama.add_rms_fp32, body="q32")
    with pytest.raises(ValueError, match=r"the q32 body needs fused_norm_lanes .* in \[32, 1024\]; got 2048"):
        llama.Ops(add_rms=llama.add_rms_fp32, body="q32", fused_norm_lanes=2048)
    assert llama.Ops(add_rms=llama.add_rms_fp32, body="q32", fused_norm_lanes=decl.NORM32_MAX_LANES).body == "q32"


def test_file_weights_bundle(bundle, ids):
    """load_model(weights="file") keeps the file's blocks and the norms only: the q32 body on it
    is the same bytes as on the full bundle; another body on it is a ValueError naming the
    load; an unknown `weights` is a ValueError."""
    light = load_model(weights="file")
    assert light.embed is None and light.lm_head_weight_t is None and light.layers[0].wq is None
    assert light.embed_q.fmt == "Q8_0" and light.head_q is light.embed_q
    x, zero = torch.tensor([ids[:6]]), torch.zeros(1, dtype=torch.int64)
    got, _ = llama.forward(light, x, llama.new_cache(light.config, pad=zero, capacity=6), ops=Q32)
    want, _ = llama.forward(bundle, x, llama.new_cache(bundle.config, pad=zero, capacity=6), ops=Q32)
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(bits(llama.embed_rows(light, x[0])), bits(bundle.embed[x[0]]))
    with pytest.raises(ValueError, match=r"the declared body needs load_model\(weights='all'\); .* weights='file'"):
        llama.forward(light, x, llama.new_cache(light.config, pad=zero, capacity=6), ops=llama.lmtail_ops())
    with pytest.raises(ValueError, match=r"weights must be one of \('all', 'file'\); got 'bf16'"):
        load_model(weights="bf16")


@pytest.mark.parametrize("ops", [Q32, Q32_PY, BQ32], ids=["native", "python", "bq32"])
def test_rows_step_joins_and_leaves(bundle, ids, ops):
    """serve.batch.step_rows on the q32 (and bq32) body: rows in their own one-row caches at different
    positions, joining and leaving between steps; each row's h == llama.forward on that row
    alone, bitwise (the continuous batch's gate). Planted: a shared slot (every row at the
    first row's position) is told apart."""
    from lmtail.serve import batch

    cfg = bundle.config
    prompts = [ids[:3], ids[20:31], ids[50:57]]

    def caches():
        out = []
        for p in prompts:
            c = batch.row_cache(cfg, 16)
            llama.forward(bundle, torch.tensor([p]), c, ops=ops)
            out.append(c)
        return out

    stepped, alone = caches(), caches()
    scratch = kstep.StepBuffers(kstep.StepShape(L=cfg.n_layers, H=cfg.hidden, nh=cfg.n_heads,
                                                nkv=cfg.n_kv_heads, F=cfg.ffn))
    for t, rows in enumerate(([0, 1], [0, 1, 2], [1, 2])):
        tok = torch.tensor([300 + t + r for r in rows])
        h = batch.step_rows(bundle, tok, [stepped[r] for r in rows], ops, scratch=scratch)
        for i, r in enumerate(rows):
            want = llama.forward(bundle, tok[i, None, None], alone[r], ops=ops)[0][0, 0]
            assert torch.equal(bits(h[i]), bits(want)), (t, r)
    lens = [c.length for c in stepped]
    assert lens == [len(p) + n for p, n in zip(prompts, (2, 3, 2))]
    shared = caches()
    for c in shared[1:]:
        c.length = shared[0].length
    wrong = batch.step_rows(bundle, torch.tensor([5, 5]), shared[:2], ops, scratch=scratch)
    right = batch.step_rows(bundle, torch.tensor([5, 5]), caches()[:2], ops, scratch=scratch)
    assert not torch.equal(bits(wrong[1]), bits(right[1]))


@pytest.mark.slow
def test_file_bundle_on_two_ranks_equals_one():
    """generate on a load_model(weights="file") bundle: its ranks map the same file (the
    parcel is the path); tokens and logprob bits on 2 ranks == 1 rank (the Q8_0 head's
    shards with a planted shifted ownership are tests/test_tail_q8.py's; this is the parcel
    path)."""
    import numpy as np

    from lmtail.model import generate

    light = load_model(weights="file")
    kw = dict(max_new_tokens=4, temperature=0.7, seed=3)
    one, two = generate(light, ["Name a fruit."], **kw), generate(light, ["Name a fruit."], ranks=2, **kw)
    assert one.token_ids == two.token_ids
    assert np.array_equal(np.array(one.logprobs[0]).view(np.int64), np.array(two.logprobs[0]).view(np.int64))


def test_weights_needed_follows_body_and_head():
    """The CLIs load only the file's blocks exactly when the q32 body runs with the Q8_0 head."""
    from lmtail.model.generate import weights_needed

    assert weights_needed("q32", None) == weights_needed("q32", "fp32") == "file"
    assert weights_needed("q32", "bf16") == weights_needed("q32", "bf16x2") == "all"
    assert weights_needed("declared", None) == weights_needed("quant", "fp32") == "all"
