"""SmolLM2's byte-level BPE tokenizer, rebuilt from GGUF metadata with `tokenizers`.

The GGUF carries the vocabulary (`tokenizer.ggml.tokens`, id = list index), the merges
(`tokenizer.ggml.merges`, "left right" strings in rank order), the token types (3 = control)
and the special ids. The pipeline matches the Hugging Face tokenizer.json of SmolLM2:

    pre-tokenizer  Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]
    model          BPE(vocab, merges), no unk, no dropout, no byte fallback
    decoder        ByteLevel
    added tokens   every control token (<|endoftext|>, <|im_start|>, <|im_end|>, ...), special

No BOS is prepended (tokenizer.ggml.add_bos_token = False).

Chat template: ChatML, with a default system turn when the conversation has none:

    <|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n
    <|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n                    (the generation prompt)

apply_chat_template renders it in plain Python; the test renders the GGUF's own Jinja
template (tokenizer.chat_template) and checks the strings are equal.

Shape legend: ids are flat Python lists of ints (one sequence).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import methodcaller

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3  # llama.cpp token type of control tokens
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass(frozen=True)
class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the model's special ids and chat template."""

    backend: Tokenizer
    bos_id: int  # 1, <|im_start|> in this GGUF
    eos_id: int  # 2, <|im_end|>: ends an assistant turn
    pad_id: int  # 2
    im_start_id: int
    im_end_id: int
    endoftext_id: int  # 0
    special_ids: frozenset[int]
    chat_template: str | None  # the GGUF's Jinja source, kept for reference

    @property
    def stop_ids(self) -> frozenset[int]:
        """Ids that end generation: <|im_end|> (eos) and <|endoftext|>."""
        return frozenset({self.eos_id, self.im_end_id, self.endoftext_id})

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it become their single ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be str; got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids, *, skip_special: bool = True) -> str:
        """Text of `ids` (ByteLevel decoding; an incomplete UTF-8 tail shows as U+FFFD)."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        """ChatML string of `messages` ([{"role", "content"}]), as the GGUF template renders it."""
        if not messages:
            raise ValueError("messages must hold at least one message; got []")
        out = []
        if messages[0].get("role") != "system":
            out.append(f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n")
        for m in messages:
            if set(m) != {"role", "content"}:
                raise ValueError(f"each message must have keys role, content; got {sorted(m)}")
            out.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
        return "".join(out)

    def chat_prompt(self, user: str, *, system: str | None = None) -> str:
        """One user turn (optionally a system turn) + the generation prompt."""
        msgs = [] if system is None else [{"role": "system", "content": system}]
        return self.apply_chat_template(msgs + [{"role": "user", "content": user}])


def build_tokenizer(*, tokens: Sequence[str], merges: Sequence[str], token_types: Sequence[int],
                    bos_id: int, eos_id: int, pad_id: int | None = None,
                    chat_template: str | None = None) -> ChatTokenizer:
    """Assemble the BPE tokenizer (see module docstring). ValueError on inconsistent metadata.
    token_types may be a numpy array (the GGUF's int32 view). No Python step per token or merge:
    the vocab, the merge pairs and their checks are built by C-level map / zip / numpy."""
    tokens, merges = list(tokens), list(merges)
    types = np.asarray(token_types)
    if types.shape != (len(tokens),):
        raise ValueError(f"token_type must have one entry per token ({len(tokens)}); got shape {types.shape}")
    vocab = dict(zip(tokens, range(len(tokens))))
    if len(vocab) != len(tokens):
        raise ValueError(f"tokens must be unique; got {len(tokens) - len(vocab)} duplicates")
    spaces = np.fromiter(map(str.count, merges, repeat(" ")), dtype=np.int64, count=len(merges))
    if (spaces != 1).any():
        bad = merges[int(np.flatnonzero(spaces != 1)[0])]
        raise ValueError(f"each merge must be 'left right'; got {bad!r}")
    pairs = list(map(tuple, map(methodcaller("split", " "), merges)))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    special = np.flatnonzero(types == CONTROL).tolist()
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in special])
    for name in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        if name not in vocab:
            raise ValueError(f"vocabulary must contain {name}; it does not")
    return ChatTokenizer(
        backend=tok, bos_id=bos_id, eos_id=eos_id, pad_id=eos_id if pad_id is None else int(pad_id),
        im_start_id=vocab["<|im_start|>"], im_end_id=vocab["<|im_end|>"],
        endoftext_id=vocab["<|endoftext|>"], special_ids=frozenset(special),
        chat_template=chat_template)
