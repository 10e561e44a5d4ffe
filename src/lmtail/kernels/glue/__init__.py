"""The glue ops' kernels: fp32 fma chains (norm sums, MoE routed sums)."""
