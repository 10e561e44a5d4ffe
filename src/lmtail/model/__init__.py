"""SmolLM2-135M-Instruct (GGUF, llama) end to end on lmtail's ops: loader, tokenizer, a row-invariant
forward whose residual add + RMSNorm steps are lmtail.norms.add_rms, generation on decode_tail
(1 or N vocab-parallel ranks), certification against float64 (certify_tail), the demo.

See docs/model.md. Typical use:

    from lmtail.model import load_model, teacher_forced_nll, generate
    bundle = load_model()                       # ~5 s once, cached per path
    nll = teacher_forced_nll(bundle, bundle.tokenizer.encode(text)[:128])
    gen = generate(bundle, ["What is the capital of France?"], max_new_tokens=16)   # ranks=4 too
"""
from .generate import Generation, TailTrace, generate
from .gguf_loader import LayerWeights, LlamaConfig, ModelBundle, ModelFileMissing, load_model, locate_gguf
from .llama import (FP32_OPS, KVCache, Ops, add_rms_fp32, bf16_ops, forward, lmtail_ops, logits_fp32, new_cache,
                    teacher_forced_nll)
from .tokenizer import ChatTokenizer, build_tokenizer

__all__ = [
    "FP32_OPS", "ChatTokenizer", "Generation", "KVCache", "LayerWeights", "LlamaConfig",
    "ModelBundle", "ModelFileMissing", "Ops", "add_rms_fp32", "bf16_ops", "build_tokenizer", "forward",
    "generate", "lmtail_ops", "load_model", "locate_gguf", "logits_fp32", "new_cache", "TailTrace", "teacher_forced_nll",
]
