"""lmtail.kernels: the fast CPU kernels behind lmtail's ops (each with a declared order,
each bit-equal to a torch reference path that the tests keep).

gemm:      the lm_head GEMM as a declared fp32 fma chain (`gemm_bf16_chain`).
rowmass:   the sampler's full-row float64 max / exp64 / sum64 pass (`row_mass_fast`).
fmachain:  declared-order fp32 fma reductions for the norms and the MoE routed chain.
"""
