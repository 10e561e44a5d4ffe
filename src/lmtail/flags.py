"""The rules of the command-line flags several commands share (`lmtail generate`, `lmtail
demo`, `lmtail serve`): one range and one wording per flag, whichever command takes it. No
heavy import (the commands check their flags before torch work or a model load); the
constants mirror the library's (each command's run asserts they still agree).

Shape legend: none (flag values).
"""
from __future__ import annotations

import struct

SMOLLM2_VOCAB = 49152  # V of the default model (load_model()): --ranks must divide it
SMOLLM2_CONTEXT = 8192  # its context length: prompt tokens + --max-new-tokens must fit
MASS_CHUNKS = 256  # candidates.MASS_CHUNKS: the candidates exchange needs --ranks dividing it too
SEED_LIMIT = 1 << 64  # SamplingParams seeds are uint64; row b uses --seed + b
GREEDY_TEMPERATURE = 1e-5  # sampler.GREEDY_TEMPERATURE: an fp32 temperature below it is greedy


def ranks_ok(ranks: int, exchange: str) -> bool:
    """Whether the tail runs on `ranks` vocab-parallel ranks with `exchange`: a divisor of the
    vocab; for "candidates" also of its MASS_CHUNKS mass chunks (the powers of two up to 256)."""
    return ranks >= 1 and SMOLLM2_VOCAB % ranks == 0 and (exchange == "mirror" or MASS_CHUNKS % ranks == 0)


def ranks_words(exchange: str, *, mirror_hint: bool = True) -> str:
    """What ranks_ok takes with `exchange`, in words (`lmtail serve` says the same); mirror_hint:
    name what --exchange mirror takes (for a command that has --exchange)."""
    if exchange == "mirror":
        return f"an int >= 1 dividing the vocab {SMOLLM2_VOCAB}"
    hint = f"; --exchange mirror takes any divisor of {SMOLLM2_VOCAB}" if mirror_hint else ""
    return (f"a power of two in [1, {MASS_CHUNKS}] (the candidates exchange: dividing the vocab {SMOLLM2_VOCAB} "
            f"and its {MASS_CHUNKS} mass chunks{hint})")


def shared_rules(*, threads: int, max_new_tokens: int, ranks: int, exchange: str,
                 mirror_hint: bool = True) -> list[tuple]:
    """(flag, value, ok, expected) of the flags `lmtail generate` and `lmtail demo` share: the
    same ranges and words in both (the prompt fitting the context is checked once the
    tokenizer is loaded, right after the file is opened; mirror_hint: ranks_words')."""
    return [("--threads", threads, threads >= 0, ">= 0 (0: torch's default)"),
            ("--max-new-tokens", max_new_tokens, 1 <= max_new_tokens < SMOLLM2_CONTEXT,
             f"in [1, {SMOLLM2_CONTEXT - 1}] (the context is {SMOLLM2_CONTEXT} tokens, the prompt's included)"),
            ("--ranks", ranks, ranks_ok(ranks, exchange), ranks_words(exchange, mirror_hint=mirror_hint))]


def refuse(rules: list[tuple]) -> None:
    """ValueError `<flag>: expected <what>, got <value>` for the first rule that fails."""
    for flag, value, ok, expected in rules:
        if not ok:
            raise ValueError(f"{flag}: expected {expected}, got {value}")


def fp32_sampled(temperature: float) -> bool:
    """Whether a request at this temperature samples (its fp32 value >= GREEDY_TEMPERATURE)."""
    try:
        return struct.unpack("<f", struct.pack("<f", temperature))[0] >= GREEDY_TEMPERATURE
    except OverflowError:  # beyond fp32's range: inf in fp32, sampled
        return temperature > 0
