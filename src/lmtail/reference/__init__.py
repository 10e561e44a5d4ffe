"""float64 NumPy references: one obvious implementation per op, imported by tests, the contract and benchmarks."""
