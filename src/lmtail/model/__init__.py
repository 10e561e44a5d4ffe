"""SmolLM2-135M-Instruct (GGUF, llama) end to end on lmtail's ops: loader, tokenizer, a forward
whose every step has a declared order (bf16 GEMMs, attention, rope, silu; residual add + RMSNorm
by lmtail.glue.norms.add_rms) next to the fp32 reference body, generation on decode_tail (1 or N
vocab-parallel ranks).

See docs/model.md. Typical use:

    from lmtail.model import load_model, teacher_forced_nll, generate
    bundle = load_model()                       # ~5 s once, cached per path
    nll = teacher_forced_nll(bundle, bundle.tokenizer.encode(text)[:128])
    gen = generate(bundle, ["What is the capital of France?"], max_new_tokens=16)   # ranks=4 too
"""
from .generate import Generation, TailTrace, generate
from .gguf_loader import LayerWeights, Linears16, LlamaConfig, ModelBundle, ModelFileMissing, load_model, locate_gguf
from .llama import (FP32_OPS, KVCache, Ops, add_rms_fp32, bf16_ops, forward, lmtail_ops, logits_fp32, new_cache,
                    prefill, teacher_forced_nll)
from .tokenizer import ChatTokenizer, build_tokenizer

__all__ = [
    "FP32_OPS", "ChatTokenizer", "Generation", "KVCache", "LayerWeights", "Linears16", "LlamaConfig",
    "ModelBundle", "ModelFileMissing", "Ops", "add_rms_fp32", "bf16_ops", "build_tokenizer", "forward",
    "generate", "lmtail_ops", "load_model", "locate_gguf", "logits_fp32", "new_cache", "prefill", "TailTrace", "teacher_forced_nll",
]
