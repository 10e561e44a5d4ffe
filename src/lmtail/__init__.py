"""lmtail: the LLM decode sampling tail and its glue ops, with declared numerics.

The public API (conventions in README.md "API"; held by tests/test_api.py):
    decode_tail, TailOutput, TailConfig          the decode sampling tail (lmtail.tail.compose)
    SamplingParams, sampling_tensor              per-request sampling (lmtail.tail.sampler)
    embed_rows, add_rms, moe_add_rms, rms_parts, NormResult   glue ops (lmtail.glue.norms)
    router_topk, Routing                         MoE router (lmtail.glue.router)
    compose_hops, owned_row_block, RowBlock, owned_rows       rank layout maps (lmtail.tail.layout)
    launch                                       N local ranks (lmtail.launch.launch)
Every multi-field result (TailOutput, NormResult, Routing, RowBlock) is a frozen dataclass.
`import lmtail` loads torch and numpy only (no numba, scipy, matplotlib, rich, gguf or
tokenizers: tests/test_import.py); the model, receipts, plots and server are extras.
"""
from __future__ import annotations

from .tail.config import TailConfig
from .launch import launch  # binds the function over the submodule's name
from .tail.layout import RowBlock, compose_hops, owned_row_block, owned_rows
from .glue.norms import NormResult, add_rms, embed_rows, moe_add_rms, rms_parts
from .glue.router import Routing, router_topk
from .tail.sampler import SamplingParams, sampling_tensor
from .tail.compose import TailOutput, decode_tail

__version__ = "0.1.0"

__all__ = ["decode_tail", "TailOutput", "TailConfig", "SamplingParams", "sampling_tensor",
           "embed_rows", "add_rms", "moe_add_rms", "rms_parts", "NormResult", "router_topk",
           "Routing", "compose_hops", "owned_row_block", "RowBlock", "owned_rows", "launch"]

