"""lmtail.kernels: the fast CPU kernels behind lmtail's ops (each with a declared order;
every backend of an op gives the same bytes). Calling convention: keyword-only
`backend=` (None: the fastest of the module's `available_backends()`) and `threads=`
(None: torch.get_num_threads()); backend names "amx", "avx512", "avx2", "c", "torch" (and "numba").
C sources are built by `_cc.load_c_library` / `_cc.load_optional`, the one loader.

gemm:      the lm_head / body GEMM `gemm_bf16` in two declared orders: "amx32" (AMX's
           TDPBF16PS block order, emulated exactly without AMX) and "chain" (one fp32 fma chain).
rows_tail: the fused post-exchange pass: exact top-k, full-row mass and the draw.
rowmass:   the sampler's full-row float64 max / exp64 / sum64 pass (`row_mass`).
fmachain:  declared-order fp32 fma reductions for the norms and the MoE routed chain.
"""
