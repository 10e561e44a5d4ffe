"""Cold start: opening SmolLM2's GGUF (metadata, tokenizer, tensor table) in a fresh process,
lmtail's reader (lmtail.model.gguf_read) vs gguf-py's GGUFReader (what load_model used before
issue 32), and the whole `lmtail generate --prompt Hi --max-new-tokens 4` wall time.

Each arm runs in its own fresh process (the loader caches per path in-process, and a cold
start is what is measured); the process imports what it needs untimed, times the load, and
prints the seconds and what it read. Checked first: both arms read the same tensor count
and metadata keys and their tokenizers give the same ids on a fixed text; then A-B-B-A.

  case "parse"       read_gguf(path) vs gguf.GGUFReader(path)
  case "load file"   load_model(weights="file") vs the pre-issue-32 recipe (GGUFReader, then the
                     tokenizer from its field lists)
  generate wall      median of --rounds runs of the CLI (warm kernel cache), no peer arm
  llama.cpp          its load of the same file (Llama(model_path, n_ctx=512), mmap on), timed
                     in --peer-python's interpreter if it has llama_cpp; else a noted figure

    python -m lmtail.benchmarks.bench_load [--rounds 3] [--quick] [--peer-python PATH]

Shape legend: none (seconds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lmtail.bench import abba, format_table

TEXT = "Hello, world! 3.14 <|im_start|>user\nnaïve 東京 😀<|im_end|>"
LLAMA_CPP_NOTED_S = 0.16  # issue 32's figure for llama.cpp opening this file (not measured here)

PRELUDE = """
import json, sys, time
path, text = sys.argv[1], sys.argv[2]
"""
ARMS = {
    "lmtail read_gguf": """
from lmtail.model.gguf_read import read_gguf
from lmtail.model.gguf_loader import _read_tokenizer
t0 = time.perf_counter(); g = read_gguf(path); s = time.perf_counter() - t0
print(json.dumps({"s": s, "tensors": len(g.tensors), "keys": sorted(g.fields),
                  "ids": _read_tokenizer(g).encode(text)}))
""",
    "gguf-py GGUFReader": """
import gguf
from lmtail.model.tokenizer import build_tokenizer
t0 = time.perf_counter(); r = gguf.GGUFReader(path); s = time.perf_counter() - t0
f = lambda k: r.fields[k].contents()
tok = build_tokenizer(tokens=f("tokenizer.ggml.tokens"), merges=f("tokenizer.ggml.merges"),
                      token_types=f("tokenizer.ggml.token_type"), bos_id=1, eos_id=2)
print(json.dumps({"s": s, "tensors": len(r.tensors), "keys": sorted(k for k in r.fields if not k.startswith("GGUF.")),
                  "ids": tok.encode(text)}))
""",
    "lmtail load_model(file)": """
from lmtail.model.gguf_loader import load_model
t0 = time.perf_counter(); b = load_model(path, weights="file"); s = time.perf_counter() - t0
print(json.dumps({"s": s, "ids": b.tokenizer.encode(text)}))
""",
    "before: GGUFReader + tokenizer": """
import gguf
from lmtail.model.tokenizer import build_tokenizer
t0 = time.perf_counter()
r = gguf.GGUFReader(path)
f = lambda k: r.fields[k].contents()
tok = build_tokenizer(tokens=list(f("tokenizer.ggml.tokens")), merges=list(f("tokenizer.ggml.merges")),
                      token_types=list(f("tokenizer.ggml.token_type")), bos_id=1, eos_id=2)
s = time.perf_counter() - t0
print(json.dumps({"s": s, "ids": tok.encode(text)}))
""",
}
LLAMA_CPP = """
import json, sys, time
import llama_cpp
t0 = time.perf_counter()
m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=512, verbose=False)
s = time.perf_counter() - t0
print(json.dumps({"s": s, "ids": m.tokenize(sys.argv[2].encode(), add_bos=False, special=True)}))
"""


def fresh(python: str, code: str, path: str) -> dict:
    """The JSON line a fresh `python -c PRELUDE+code path TEXT` prints."""
    r = subprocess.run([python, "-c", code, path, TEXT], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{python} failed: {r.stderr[-800:]}")
    return json.loads(r.stdout.splitlines()[-1])


def same_read(name: str, out: dict, base_out: dict) -> None:
    diff = [k for k in base_out if k != "s" and out.get(k) != base_out[k]]
    if diff:
        raise AssertionError(f"{name} read something else: {diff}")


def case(names: list[str], path: str, rounds: int):
    arms = {n: (lambda n=n: fresh(sys.executable, PRELUDE + ARMS[n], path)) for n in names}
    return abba(arms, base=names[0], rounds=rounds, check=same_read, timer=lambda fn: fn()["s"])


def generate_wall(rounds: int) -> list[float]:
    """Wall seconds of `lmtail generate --prompt Hi --max-new-tokens 4`, one fresh process each
    (the first, untimed, warms the kernel cache)."""
    argv = [sys.executable, "-m", "lmtail.cli", "generate", "--prompt", "Hi", "--max-new-tokens", "4"]
    walls = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True, timeout=600)
        if i:
            walls.append(time.perf_counter() - t0)
    return walls


def default_peer_python() -> str | None:
    """A checkout's benchmarks/.venv-llamacpp interpreter (benchmarks/peers/llamacpp/setup.sh)."""
    for parent in Path(__file__).resolve().parents:
        p = parent / "benchmarks" / ".venv-llamacpp" / "bin" / "python"
        if p.exists():
            return str(p)
    return None


def llama_cpp_line(python: str | None, path: str, rounds: int, ids: list[int]) -> str:
    if python is None or subprocess.run([python, "-c", "import llama_cpp"], capture_output=True).returncode:
        return (f"| llama.cpp Llama(model_path) | {LLAMA_CPP_NOTED_S:.2f} s (noted, issue 32; llama_cpp not "
                f"installed here: benchmarks/peers/llamacpp/setup.sh) | - |")
    outs = [fresh(python, LLAMA_CPP, path) for _ in range(rounds)]
    agree = "same ids" if outs[0]["ids"] == ids else f"other ids {outs[0]['ids']}"
    return f"| llama.cpp Llama(model_path) | {statistics.median(o['s'] for o in outs):.3f} s | {agree} |"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1 round, no generate wall")
    ap.add_argument("--peer-python", default=default_peer_python(),
                    help="an interpreter with llama_cpp (default: benchmarks/.venv-llamacpp's, if built)")
    args = ap.parse_args(argv)
    from lmtail.model.gguf_loader import locate_gguf

    path = str(locate_gguf())
    rounds = 1 if args.quick else args.rounds
    res = {"parse": case(["lmtail read_gguf", "gguf-py GGUFReader"], path, rounds),
           "load file": case(["lmtail load_model(file)", "before: GGUFReader + tokenizer"], path, rounds)}
    print(format_table(res, title=f"cold start: opening {Path(path).name} in a fresh process (ratio > 1 = slower "
                                  f"than lmtail's reader)"))
    ids = fresh(sys.executable, PRELUDE + ARMS["lmtail load_model(file)"], path)["ids"]
    print("| also | median | tokenizer |\n|---|---:|---|")
    print(llama_cpp_line(args.peer_python, path, rounds, ids))
    if not args.quick:
        walls = generate_wall(rounds)
        print(f"| lmtail generate --prompt Hi --max-new-tokens 4 (wall) | {statistics.median(walls):.2f} s | - |")


if __name__ == "__main__":
    main()
