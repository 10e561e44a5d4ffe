"""The shared glue ops around the big matmuls: norms and the MoE router."""
