"""The tail passes' kernels: rows_tail (top-k + sampler), shard_partials, row mass."""
