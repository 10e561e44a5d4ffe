"""GEMM bindings: the bf16 lm_head GEMM in its declared orders (chain, amx32, dp32)."""
