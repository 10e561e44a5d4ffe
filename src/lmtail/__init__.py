"""lmtail: the LLM decode sampling tail and its glue ops, with declared numerics."""
__version__ = "0.1.0"
