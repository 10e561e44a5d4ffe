"""lmtail.kernels: the fast CPU kernels behind lmtail's ops (each with a declared order).

gemm: the lm_head GEMM as a declared fp32 fma chain (`gemm_bf16_chain`).
"""
