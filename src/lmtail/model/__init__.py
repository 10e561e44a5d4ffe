"""SmolLM2-135M-Instruct (GGUF, llama) end to end: loader, tokenizer, fp32 forward, generation.

See docs/model.md. Typical use:

    from lmtail.model import load_model, teacher_forced_nll, generate
    bundle = load_model()                       # ~5 s once, cached per path
    nll = teacher_forced_nll(bundle, bundle.tokenizer.encode(text)[:128])
    gen = generate(bundle, ["What is the capital of France?"], max_new_tokens=16)
"""
from .generate import Generation, LocalTail, generate
from .gguf_loader import LayerWeights, LlamaConfig, ModelBundle, ModelFileMissing, load_model, locate_gguf
from .llama import FP32_OPS, KVCache, Ops, add_rms_fp32, bf16_ops, forward, logits_fp32, new_cache, teacher_forced_nll
from .tokenizer import ChatTokenizer, build_tokenizer

__all__ = [
    "FP32_OPS", "ChatTokenizer", "Generation", "KVCache", "LayerWeights", "LlamaConfig", "LocalTail",
    "ModelBundle", "ModelFileMissing", "Ops", "add_rms_fp32", "bf16_ops", "build_tokenizer", "forward",
    "generate", "load_model", "locate_gguf", "logits_fp32", "new_cache", "teacher_forced_nll",
]
