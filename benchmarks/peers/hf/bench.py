"""lmtail's SmolLM2 body vs Hugging Face transformers (float32) on the same GGUF, one process.

Arms run side by side, alternating (A B B A, lmtail.bench.abba), after a check that they
agree; the table reports median paired ratios (HF time / lmtail time: > 1 = lmtail faster).

  decode   greedy generate of NEW tokens after a 32-token prompt, batch 1 and 4, threads
           1 and 2; time from the first generated token to the last (NEW - 1 forwards +
           tails; the prefill is not in it). Check: every row's first token agrees, except
           at a near tie of the fp32 body (logits < 0.1 apart).
  prefill  one 2,048-token prompt to its first token (HF: forward with logits_to_keep=1;
           lmtail: chunked prefill + the tail). Check: the same next token.
  argmax   GPL-3's first 256 tokens, teacher-forced: how often each arm's top-1 equals HF
           float32's (lmtail: decode_tail's greedy token; HF bf16: the same model in
           bfloat16, HF's own low-precision mode).
  NLL      teacher-forced NLL over the receipt texts (first 256 tokens each): the declared
           body minus the fp32 body (FP32_OPS), paired per token, mean +- 2 se.

Run in the benchmark-only venv (built by benchmarks/peers/hf/setup.sh):

    benchmarks/.venv-hf/bin/python benchmarks/peers/hf/bench.py [--rounds 3] [--new 16]

Without transformers it prints a SKIP line and exits 0. Shape legend: B rows, P prompt
tokens, N new tokens, T scored tokens, H hidden, V vocab.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "src"))

from lmtail.bench import abba, format_table  # noqa: E402
from lmtail.model import llama  # noqa: E402
from lmtail.model.generate import DEFAULT_TAIL, decode_loop, default_head_input, local_step, step_config  # noqa: E402
from lmtail.model.gguf_loader import load_model  # noqa: E402
from lmtail.tail.sampler import SamplingParams, greedy_rows  # noqa: E402

GPL3 = Path("/usr/share/common-licenses/GPL-3")
TARGETS = {"decode": 1.5, "prefill": 1.0}


def load_hf(path: str, dtype):
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
    return model.eval()


# ---------------------------------------------------------------------------------------
# arms
# ---------------------------------------------------------------------------------------
def hf_decode(model, prompts: torch.Tensor, new: int):
    """(tokens [B, N], seconds from the first generated token to the last)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    stamps = []

    class Stamp(LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    with torch.inference_mode():
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([Stamp()]))
    end = time.perf_counter()
    return out[:, prompts.shape[1]:], end - stamps[0]


def lm_decode(bundle, ops, prompts: torch.Tensor, new: int):
    """(tokens [B, N], seconds from the first generated token to the last): lmtail's
    generation loop (body + decode_tail, greedy, k = 256 as generate() asks)."""
    stamps = []
    params = [SamplingParams(temperature=0.0)] * prompts.shape[0]
    gen = decode_loop(bundle, prompts.tolist(), params, max_new_tokens=new, ops=ops,
                      tail_step=local_step(DEFAULT_TAIL, bundle, step_config(bundle, k=256,
                                                                             head_input=default_head_input(ops))),
                      on_step=lambda s, t, d: stamps.append(time.perf_counter()))
    end = time.perf_counter()
    return torch.tensor([list(t) for t in gen.token_ids]), end - stamps[0]


def hf_prefill(model, ids: torch.Tensor):
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=1).logits[:, -1]  # [1, V]
    return int(logits.argmax(-1))


def lm_prefill(bundle, ops, ids: torch.Tensor):
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=ids.shape[1])
    h = llama.prefill(bundle, ids, cache, ops=ops)  # [1, H]
    return int(greedy_tokens(bundle, h)[0])


def greedy_tokens(bundle, h: torch.Tensor) -> torch.Tensor:
    """decode_tail's greedy tokens for hidden states h [T, H] fp32 -> [T] int64."""
    sp = greedy_rows(h.shape[0])  # [T, 5] greedy rows
    out = DEFAULT_TAIL(h.contiguous(), bundle.final_norm, bundle.lm_head_weight_t, eps=bundle.config.eps,
                       k=8, sampling_params=sp, emit_logits=False)
    return out.tokens


TIE_NATS = 0.1  # first tokens may differ only where the fp32 body scores them this close


def first_tokens_agree(bundle, prompts: torch.Tensor):
    """abba check: every row's first greedy token is the same in both arms, except where the
    two tokens are a near tie of the fp32 body (|logit difference| < TIE_NATS)."""
    cache = llama.new_cache(bundle.config, pad=torch.zeros(prompts.shape[0], dtype=torch.int64),
                            capacity=prompts.shape[1])
    _, y = llama.forward(bundle, prompts, cache, ops=llama.FP32_OPS)
    logits = llama.logits_fp32(bundle, y[:, -1])  # [B, V]

    def check(name, out, base_out):
        a, b = out[0][:, 0], base_out[0][:, 0]
        for r in range(a.shape[0]):
            gap = float((logits[r, a[r]] - logits[r, b[r]]).abs())
            if a[r] != b[r] and gap >= TIE_NATS:
                raise AssertionError(f"{name}: row {r} first token {int(a[r])} vs {int(b[r])}, "
                                     f"fp32 logit gap {gap:.3f} >= {TIE_NATS}")
    return check


def same_token(name, out, base_out):
    if out != base_out:
        raise AssertionError(f"{name}: next token {out} != {base_out}")


# ---------------------------------------------------------------------------------------
# quality
# ---------------------------------------------------------------------------------------
def argmax_agreement(bundle, ops, hf32, hf16, ids: list[int]) -> dict[str, float]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        a32 = hf32(x).logits[0].argmax(-1)  # [T]
        a16 = hf16(x).logits[0].float().argmax(-1)
    cache = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids))
    h, y = llama.forward(bundle, x, cache, ops=ops)  # [1, T, H]
    lm = greedy_tokens(bundle, h[0])
    c32 = llama.new_cache(bundle.config, pad=torch.zeros(1, dtype=torch.int64), capacity=len(ids))
    _, y32 = llama.forward(bundle, x, c32, ops=llama.FP32_OPS)
    f32 = llama.logits_fp32(bundle, y32[0]).argmax(-1)
    agree = lambda t: float((t == a32).double().mean())  # noqa: E731
    return {"HF bf16": agree(a16), "lmtail (declared body + tail)": agree(lm), "lmtail fp32 body": agree(f32)}


def paired_nll(bundle, ops, tokens: int) -> tuple[float, float, int, float, float]:
    """(mean d, se d, n, mean nll declared, mean nll fp32) over the receipt texts, d per token."""
    from lmtail.receipts.texts import load_passages

    diffs, a_all, b_all = [], [], []
    for p in load_passages(bundle.tokenizer, count=6, min_tokens=tokens):
        ids = list(p.ids[:tokens])
        a = llama.teacher_forced_nll(bundle, ids, ops=ops)
        b = llama.teacher_forced_nll(bundle, ids, ops=llama.FP32_OPS)
        diffs.append(a - b)
        a_all.append(a)
        b_all.append(b)
    d = torch.cat(diffs)
    return (float(d.mean()), float(d.std() / math.sqrt(d.numel())), d.numel(),
            float(torch.cat(a_all).mean()), float(torch.cat(b_all).mean()))


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=16, help="new tokens per decode run")
    ap.add_argument("--prefill", type=int, default=2048, help="prefill prompt tokens")
    ap.add_argument("--prefill-rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--gemm-order", default="amx32", choices=["amx32", "chain"])
    args = ap.parse_args(argv)
    try:
        import accelerate  # noqa: F401
        import transformers
    except ImportError as e:
        print(f"SKIP: Hugging Face arm unavailable ({e}); build it with benchmarks/peers/hf/setup.sh "
              f"and run this script with benchmarks/.venv-hf/bin/python")
        return 0
    torch.set_num_threads(max(args.threads))
    bundle = load_model()
    ops = llama.lmtail_ops(gemm_order=args.gemm_order)
    hf32 = load_hf(bundle.path, torch.float32)
    hf16 = load_hf(bundle.path, torch.bfloat16)
    gpl = bundle.tokenizer.encode(GPL3.read_text())
    results, rows = {}, []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for b in args.batches:
            prompts = torch.tensor([gpl[300 + 40 * r:332 + 40 * r] for r in range(b)])  # [B, 32]
            res = abba({"HF": lambda: hf_decode(hf32, prompts, args.new),
                        "lmtail": lambda: lm_decode(bundle, ops, prompts, args.new)},
                       base="lmtail", rounds=args.rounds, check=first_tokens_agree(bundle, prompts),
                       timer=lambda fn: fn()[1])
            results[f"decode B={b} threads={threads}"] = res
            tps = {k: b * (args.new - 1) / v for k, v in res.median_s.items()}
            rows.append((f"decode tokens/s, batch {b}, {threads} thread(s)", tps["HF"], tps["lmtail"],
                         res.ratio["HF"], TARGETS["decode"]))
    torch.set_num_threads(1)
    long = torch.tensor([(gpl * 4)[:args.prefill]])  # [1, P]
    res = abba({"HF": lambda: hf_prefill(hf32, long), "lmtail": lambda: lm_prefill(bundle, ops, long)},
               base="lmtail", rounds=args.prefill_rounds, check=same_token)
    results[f"prefill {args.prefill}"] = res
    rows.append((f"prefill {args.prefill} tokens, s (1 thread)", res.median_s["HF"], res.median_s["lmtail"],
                 res.ratio["HF"], TARGETS["prefill"]))
    print(format_table(results, title="lmtail vs HF transformers float32 (same GGUF), A-B-B-A"))
    agree = argmax_agreement(bundle, ops, hf32, hf16, gpl[:256])
    d, se, n, nll_a, nll_b = paired_nll(bundle, ops, 256)
    print(f"### SmolLM2-135M: lmtail (declared body, gemm {args.gemm_order}) vs HF transformers "
          f"{transformers.__version__} float32\n")
    print("| metric | HF | lmtail | HF / lmtail | target | met |\n|---|---:|---:|---:|---:|---|")
    for what, hf, lm, ratio, target in rows:
        print(f"| {what} | {hf:.2f} | {lm:.2f} | {ratio:.2f}x | >= {target}x | {'yes' if ratio >= target else 'NO'} |")
    hb = agree["HF bf16"]
    for name, v in agree.items():
        met = "-" if name == "HF bf16" else ("yes" if v >= hb else "NO")
        print(f"| argmax agreement with HF fp32, GPL-3 first 256 tokens: {name} | | {100 * v:.1f}% | | "
              f">= HF bf16 ({100 * hb:.1f}%) | {met} |")
    print(f"| teacher-forced NLL, receipt texts ({n} tokens): declared - fp32 body | | {d:+.4f} +- {2 * se:.4f} "
          f"(2 se) | | within 2 se of 0 | {'yes' if abs(d) <= 2 * se else 'NO'} |")
    print(f"\n(NLL declared {nll_a:.4f}, fp32 body {nll_b:.4f} nats/token; the per-token se ignores "
          f"correlation within a text. Times are medians; ratios are paired per round.)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
