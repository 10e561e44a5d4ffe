"""The JSON-lines protocol between benchmarks/peers/table.py and its arm workers.

Each arm of the peer table (lmtail, llama.cpp, vLLM) lives in its own venv, so the driver
starts one persistent worker process per arm and talks to it over pipes, one JSON object a
line: the driver writes {"op": NAME, ...args} to the worker's stdin; the worker answers
{"ok": true, ...result} or {"ok": false, "error": "..."} on the PROTOCOL channel. Timings
are taken inside the worker (time.perf_counter around the work only), so the pipe never
enters a measured time.

The protocol channel is the worker's original stdout, moved to a private file descriptor at
start-up; fd 1 is then pointed at stderr, so whatever an engine prints (vLLM's and
llama.cpp's logs) cannot corrupt the protocol. Pure standard library: importable from every
venv (the workers put benchmarks/peers on sys.path).

Ops every worker answers (token ids are the GGUF vocabulary's, no BOS added anywhere):
  info                                  -> {"engine", "version", ...}
  decode    prompts [[id]], n, threads  -> {"s": seconds of the n steps after the first
                                            token, "tokens": [[first n+1 ids]] per row}
  prefill   ids [id], threads           -> {"s": seconds to the first token, "token": id}
  alone_vs_batch prompts [[id]], n, threads
                                        -> {"alone": [[n ids]] each prompt by itself,
                                            "batch": [[n ids]] all prompts in one batch}
                                            (or {"batch": null, "why": ...})
  logits    ids [id], path              -> writes float32 [T, V] logits (np.save) to path
  quit
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def protocol_channel():
    """Move the real stdout to a private fd (returned as a text file) and send fd 1 to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def say(chan, line: str) -> None:
    """One line to the driver (a worker's SKIP reason) on `chan`, or to stdout without one."""
    if chan is None:
        print(line, flush=True)
    else:
        chan.write(line + "\n")
        chan.flush()


def serve(handlers: dict, chan=None) -> int:
    """Answer requests from stdin until EOF or {"op": "quit"}; handlers: op -> fn(**args) -> dict.
    chan: the protocol channel (protocol_channel(), taken BEFORE the engine is imported, so
    that loggers bound to stdout at import write to stderr); None: take it now."""
    chan = chan or protocol_channel()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        req = json.loads(line)
        op = req.pop("op", None)
        if op == "quit":
            break
        try:
            if op not in handlers:
                raise ValueError(f"op must be one of {sorted(handlers)}; got {op!r}")
            out = {"ok": True, **handlers[op](**req)}
        except Exception as e:  # reported to the driver, the worker stays up
            traceback.print_exc(file=sys.stderr)
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        chan.write(json.dumps(out) + "\n")
        chan.flush()
    return 0
