"""`response_format` JSON modes: a grammar per request, through llguidance (PyPI), masking
the next token's fp32 logits through the logits-processor seam (LogitProcessing.allowed).

    Grammars(tokenizer, vocab)        one per server; llguidance's LLTokenizer is built on
                                      the first JSON-mode request (about 0.25 s), from the
                                      model's own tokenizer (its `tokenizers` JSON: offline,
                                      nothing is downloaded), with the stop ids as EOS
      .compile(response_format)       per request, on the request's worker thread (never
         -> Grammar                   the event loop): {"type": "json_object"} = any JSON
                                      object; {"type": "json_schema", "json_schema":
                                      {"schema": ...}} = that schema; a schema llguidance
                                      refuses is an ApiError 400 naming response_format
    Grammar.start() -> GrammarState   one per job (a copy of the compiled matcher)
    GrammarState.allowed() -> [V]     the tokens the grammar allows next (bool, full vocab)
    GrammarState.advance(token)       consume the sampled token (RuntimeError if refused)
    with_masks(processing, states)    the decode step's per-row `processing` list with each
                                      grammar row's allowed mask set

JSON text is generated compact, one space after ':' and ',' (`{"name": "Bob", "age": 30}`):
no other whitespace, so a small model cannot idle in whitespace. When the grammar is
complete (the object closed) the mask allows only the stop ids (<|im_end|>,
<|endoftext|>): the next token ends the request with finish_reason "stop"; where the text
could go on or end (a top-level number) both are allowed. max_tokens still ends it first
("length": the text may be cut mid-object, as OpenAI's is).

Masks are exact sets (no numerics): allowed[t] is bit t of llguidance's bitmask
(little-endian 32-bit words, bit t % 32 of word t // 32); lanes past the tokenizer's
vocabulary are False. A grammar row's mask (llguidance + unpacking) costs 200-280 us a
step on this model, about 2% of a batch-of-8 step (Zen 4 box, 1 torch thread, sampled
json_object / json_schema rows); it is computed on the engine thread, once per step per
grammar row.

Shape legend: V the model's full vocab (not a shard).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..tail.processors import LogitProcessing
from .protocol import ApiError

SUPPORTED = ('{"type": "text"}, {"type": "json_object"} (any JSON object) and {"type": "json_schema", '
             '"json_schema": {"name": ..., "schema": {...}, "strict": ...}} (JSON Schema as llguidance '
             'compiles it: types, properties / required / additionalProperties, items, enum / const, '
             'anyOf / oneOf / allOf, $ref / $defs, string / number / array bounds, pattern, format)')
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}


def schema_of(response_format: dict) -> dict:
    """The JSON Schema of a checked JSON-mode response_format (protocol's _response_format)."""
    if response_format["type"] == "json_object":
        return ANY_OBJECT
    return response_format["json_schema"]["schema"]


class Grammars:
    """The server's grammar compiler for `tokenizer` (model.tokenizer.ChatTokenizer) and a
    model vocab of `vocab` ids (>= the tokenizer's). Thread-safe: compile() runs on the
    request threads; the LLTokenizer is built once, under a lock, on first use."""

    def __init__(self, tokenizer, vocab: int):
        if vocab < tokenizer.vocab_size:
            raise ValueError(f"vocab must be >= the tokenizer's {tokenizer.vocab_size} ids; got {vocab}")
        self.tok, self.vocab = tokenizer, vocab
        self._lock = threading.Lock()
        self._ll = None  # llguidance.LLTokenizer, built by ll_tokenizer()

    def ll_tokenizer(self):
        """llguidance's LLTokenizer of the model's tokenizer (built once): the tokenizers
        JSON of ChatTokenizer.backend (special tokens included), n_vocab = the model's
        vocab, EOS = the stop ids."""
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(self.tok.backend.to_str(), n_vocab=self.vocab,
                                                  eos_token=sorted(self.tok.stop_ids))
            return self._ll

    def compile(self, response_format: dict) -> "Grammar":
        """The Grammar of a checked JSON-mode response_format; ApiError 400 (param
        response_format) when llguidance refuses the schema, saying what is supported."""
        try:
            import llguidance
        except ImportError:
            raise ApiError(400, f"response_format: {response_format['type']!r} needs the llguidance package "
                                "(pip install 'lmtail[serve]'), which this server lacks", param="response_format") \
                from None
        ll = self.ll_tokenizer()
        try:
            g = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema_of(response_format)),
                                                              defaults=JSON_OPTIONS)
            err = llguidance.LLMatcher.validate_grammar(g, ll)
            m = None if err and not err.startswith("WARNING") else llguidance.LLMatcher(ll, g, log_level=0)
        except Exception as e:  # whatever llguidance (or json.dumps) refuses in the client's schema
            raise _refused(f"{type(e).__name__}: {e}") from None
        if m is None or m.is_error():
            raise _refused(err if m is None else m.get_error())
        return Grammar(matcher=m, vocab=self.vocab)


def _refused(why: str) -> ApiError:
    return ApiError(400, f"response_format: the JSON schema is invalid or not supported ({_first_line(why)}); "
                         f"supported: {SUPPORTED}", param="response_format")


def _first_line(why: str) -> str:
    """llguidance's message without its state dump (from "<state>" on), on one line, at
    most 300 characters."""
    return " ".join(why.split("<state>")[0].split())[:300]


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar (its matcher at the start); start() gives each job its own copy."""

    matcher: object  # llguidance.LLMatcher, never advanced itself
    vocab: int

    def start(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy(), self.vocab)


class GrammarState:
    """One job's matcher: allowed() before each step, advance(token) after it (engine thread)."""

    def __init__(self, matcher, vocab: int):
        self.matcher, self.vocab = matcher, vocab

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next (bits_to_mask of llguidance's
        bitmask). RuntimeError when the matcher is in an error state or allows nothing."""
        if self.matcher.is_error():
            raise RuntimeError(f"response_format grammar failed: {_first_line(self.matcher.get_error())}")
        mask = bits_to_mask(self.matcher.compute_bitmask(), self.vocab)
        if not bool(mask.any()):
            raise RuntimeError("response_format grammar allows no token")
        return mask

    def advance(self, token: int) -> None:
        """Consume the sampled token; RuntimeError if the grammar refuses it (a mask not
        applied: a bug)."""
        if not self.matcher.consume_token(int(token)):
            raise RuntimeError(f"response_format grammar refused token {int(token)}: "
                               f"{_first_line(self.matcher.get_error())}")


def bits_to_mask(bitmask: bytes, vocab: int) -> torch.Tensor:
    """[V] bool from a bitmask of little-endian 32-bit words: mask[t] = bit t % 32 of word
    t // 32 (byte t // 8, bit t % 8: the same on a little-endian word). ValueError if the
    bitmask holds fewer than vocab bits."""
    if len(bitmask) * 8 < vocab:
        raise ValueError(f"bitmask must hold >= {vocab} bits; got {len(bitmask) * 8}")
    bits = np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:vocab]  # [V] uint8
    return torch.from_numpy(bits.astype(np.bool_))


def advance_row(state: "GrammarState | None", token: int) -> None:
    """state.advance(token) for a grammar row; nothing for a row without one."""
    if state is not None:
        state.advance(token)


def with_masks(processing: list | None, states: list) -> list | None:
    """The decode step's per-row processing with each grammar row's allowed mask:
    processing None or one entry per row (LogitProcessing | None); states one
    GrammarState | None per row. Rows without a grammar keep their entry; returns None
    when no row has either (the step then runs unprocessed)."""
    if all(s is None for s in states):
        return processing
    base = [None] * len(states) if processing is None else list(processing)
    return [p if s is None else replace(p or LogitProcessing(), allowed=s.allowed()) for p, s in zip(base, states)]
