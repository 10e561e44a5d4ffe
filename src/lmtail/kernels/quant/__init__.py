"""Quantized-weight GEMM bindings: gemm_q on the GGUF's own Q4_1 / Q8_0 bytes."""
