"""The model body's kernels: norms, rope, silu, attention, and the native decode step."""
