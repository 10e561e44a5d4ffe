"""The "bq32" body: the q32 body's layer loop with every linear on gemm_bq (the order bq32, AMX's
tile order) over SmolLM2's own blocks, packed once at load. Gates: greedy tokens and hidden
bytes identical on every gemm_bq path (native avx512 / avx2 and emu-avx512 here; c and emu-amx,
the AMX code through the tile model, under -m slow), a row alone == in a left-padded batch ==
reversed, threads 1 == 2, and the teacher-forced distance to the fp32 reference body (argmax
agreement, mean KL) next to the q32 body's. Planted: the q32 body (another declared order) is
told apart."""
from __future__ import annotations

import pytest
import torch
from conftest import at_threads, bits, last_hidden, mean_kl, teacher_forced_logp

from lmtail.kernels.quant import gemm_bq as bq_mod
from lmtail.model import llama

BQ32 = llama.lmtail_ops(body="bq32")
Q32_PY = llama.Ops(add_rms=llama.add_rms_fp32, body="q32", fused_norm_lanes=BQ32.fused_norm_lanes, native_step=False)
FAST_PATHS = [p for p in ("avx512", "avx2", "emu-avx512") if p in bq_mod.GEMM_BQ.names(emulated=True)]
SLOW_PATHS = [p for p in ("c", "emu-amx") if p in bq_mod.GEMM_BQ.names(emulated=True)]


def on_path(monkeypatch, path: str):
    row = next(r for r in bq_mod.GEMM_BQ.rows if r.name == path)
    monkeypatch.setattr(llama, "bq_gemm_row", lambda rows: row)


def greedy(bundle, prompt, steps, ops=BQ32):
    """Greedy tokens (fp32 head argmax) and every call's final-normed last states [steps+1, H]."""
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=len(prompt) + steps)
    x, toks, ys = torch.tensor([prompt]), [], []
    for _ in range(steps + 1):
        _, y = llama.forward(bundle, x, cache, ops=ops)
        ys.append(y[0, -1])
        toks.append(int(llama.logits_fp32(bundle, y[0, -1]).argmax()))
        x = torch.tensor([[toks[-1]]])
    return toks, torch.stack(ys)


def paths_agree(bundle, ids, paths, monkeypatch, prompt_len, steps):
    runs = {}
    for p in paths:
        on_path(monkeypatch, p)
        runs[p] = greedy(bundle, ids[:prompt_len], steps)
    base = runs[paths[0]]
    for p, (toks, ys) in runs.items():
        assert toks == base[0] and torch.equal(bits(ys), bits(base[1])), p
    return base


def test_tokens_identical_on_every_fast_path(bundle, ids, monkeypatch):
    toks, ys = paths_agree(bundle, ids, FAST_PATHS, monkeypatch, prompt_len=6, steps=3)
    q32_toks, q32_ys = greedy(bundle, ids[:6], 3, ops=Q32_PY)
    assert not torch.equal(bits(ys), bits(q32_ys))  # planted: another declared order, other bytes
    print(f"bq32 greedy {toks}, q32 {q32_toks}")


@pytest.mark.slow
def test_tokens_identical_on_c_and_emulated_amx(bundle, ids, monkeypatch):
    """The plain-C path and the AMX code (through lmtail_emulate.h's tile model) give the
    native path's tokens and bytes (slow: both run every fma in software)."""
    paths_agree(bundle, ids, FAST_PATHS[:1] + SLOW_PATHS, monkeypatch, prompt_len=3, steps=1)


def test_solo_equals_batch_bitwise(bundle, ids):
    prompts, feed = [ids[:1], ids[40:53], ids[80:90]], [100, 101, 102]
    together = last_hidden(bundle, prompts, feed, ops=BQ32, steps=2)
    assert torch.equal(bits(together), bits(last_hidden(bundle, prompts[::-1], feed[::-1], ops=BQ32, steps=2).flip(0)))
    for b in range(3):
        assert torch.equal(bits(last_hidden(bundle, [prompts[b]], [feed[b]], ops=BQ32, steps=2)[0]), bits(together[b])), b


def test_threads_1_equals_2(bundle, ids):
    prompts, feed = [ids[:9], ids[50:70]], [7, 8]

    def at(n):
        return at_threads(n, lambda: last_hidden(bundle, prompts, feed, ops=BQ32, steps=1))

    assert torch.equal(bits(at(1)), bits(at(2)))


def test_distance_to_fp32_reference(bundle, ids):
    """Teacher-forced on 64 tokens, the same fp32 head: bq32's argmax agrees with the fp32
    reference body's at every position and its mean KL is as small as q32's (both keep the
    file's exact weights and fp32 activations; bq32's Q4_1 values are the real d*q + m)."""
    ref = teacher_forced_logp(bundle, ids[:64], llama.FP32_OPS)  # [64, V]
    got = teacher_forced_logp(bundle, ids[:64], BQ32)
    q32 = teacher_forced_logp(bundle, ids[:64], Q32_PY)
    agree = float((got.argmax(-1) == ref.argmax(-1)).double().mean())
    kl_b, kl_q = mean_kl(ref, got), mean_kl(ref, q32)
    print(f"teacher-forced vs fp32 over 64 tokens: bq32 argmax {agree:.1%} KL {kl_b:.3e}; q32 KL {kl_q:.3e}")
    assert agree == 1.0 and kl_b < 1e-8


def test_bq32_needs_a_plain_strided_norm():
    with pytest.raises(ValueError, match=r"the bq32 body needs fused_norm_lanes .* got None"):
        llama.Ops(add_rms=llama.add_rms_fp32, body="bq32")
