"""The decode sampling tail: final RMSNorm -> lm_head -> exchange -> top-k -> sampler."""
