"""Resident weights of the SmolLM2 decode: the q32 body on load_model(weights="file") vs the GGUF's size.

Each arm runs in its own fresh interpreter (a subprocess of this script), loads the model,
generates `--tokens` greedy tokens for one chat prompt on one thread, and reports from
/proc/self/smaps:
  file  the resident bytes of the GGUF's memory mapping (the file's pages the process touched:
        the q32 body and the Q8_0 head read their weights there, in place)
  anon  the growth of anonymous resident memory from just before load_model to the end
        (every copy of a weight the load made -- fp32 / bf16 tensors -- lands here, next to
        the tokenizer, the KV cache, the rope tables and torch's own buffers)
  held  the bytes of the weight tensors the bundle itself holds outside the mapping (norms
        for "file"; fp32 + bf16 + packed copies for "all"), counted from the bundle
Resident weights = file + held; the issue's target is <= 1.1x the GGUF's size.

    .venv/bin/python -m lmtail.benchmarks.bench_memory [--tokens 16]

Arms: "q32 / file" (generate()'s default: load_model(weights="file")) and "declared / all"
(the seed's bf16 body on load_model(), for scale). Linux only (/proc/self/smaps).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_CHILD = "--child"


def _smaps(path: str) -> tuple[int, int]:
    """(resident bytes of mappings of `path`, resident anonymous bytes) of this process."""
    mapped = anon = 0
    cur = None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
                cur = parts[5] if len(parts) >= 6 else ""
            elif parts[0] == "Rss:" and cur == path:
                mapped += int(parts[1]) * 1024
            elif parts[0] == "Anonymous:":
                anon += int(parts[1]) * 1024
    return mapped, anon


def _held(bundle) -> int:
    """Bytes of the weight tensors the bundle holds that are not views of the file's map."""
    import dataclasses

    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()

    for name in ("embed", "final_norm", "lm_head_weight_t"):
        add(getattr(bundle, name))
    for group in (bundle.layers, bundle.linears16, bundle.packed16):
        for item in group:
            for f in dataclasses.fields(item):
                v = getattr(item, f.name)
                add(getattr(v, "data", v) if not isinstance(v, torch.Tensor) else v)
    return total


def child(body: str, weights: str, tokens: int) -> dict:
    import torch

    torch.set_num_threads(1)
    from lmtail.model import generate, llama, locate_gguf
    from lmtail.model.gguf_loader import load_model

    path = str(locate_gguf())
    _, anon0 = _smaps(path)
    bundle = load_model(weights=weights)
    ops = llama.lmtail_ops(body=body)
    hi = "fp32" if body == "q32" else "bf16"
    gen = generate(bundle, ["Tell me about the sea."], max_new_tokens=tokens, ops=ops, head_input=hi)
    mapped, anon1 = _smaps(path)
    return dict(file=mapped, anon=anon1 - anon0, held=_held(bundle), gguf=os.path.getsize(path),
                tokens=len(gen.token_ids[0]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument(_CHILD, nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, args.tokens)))
        return
    rows = []
    for body, weights in (("q32", "file"), ("declared", "all")):
        out = subprocess.run([sys.executable, "-m", "lmtail.benchmarks.bench_memory", _CHILD, body, weights,
                              "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append((f"{body} / {weights}", r))
    gguf = rows[0][1]["gguf"]
    print(f"GGUF file: {gguf / 1e6:.1f} MB; {args.tokens} greedy tokens, 1 thread, one fresh process per arm")
    print("| arm | file pages resident MB | weights held outside the map MB | resident weights / GGUF | "
          "anonymous growth MB |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['file'] / 1e6:.1f} | {r['held'] / 1e6:.1f} | {(r['file'] + r['held']) / gguf:.3f} | "
              f"{r['anon'] / 1e6:.1f} |")


if __name__ == "__main__":
    main()
