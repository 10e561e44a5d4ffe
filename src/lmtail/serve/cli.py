"""`lmtail serve` (and `python -m lmtail.serve`): load SmolLM2, start the engine, serve the
app with uvicorn on 127.0.0.1:8000 by default.

SIGTERM / SIGINT (_Server: uvicorn's handlers, plus the app's begin_shutdown): stop
accepting (the listening socket closes; a request on a kept-alive connection gets 503),
let in-flight requests finish for at most --shutdown-timeout s, then close the engine:
the jobs left fail with "server shutting down", answered as 503 JSON (plain requests) or
an error event and `data: [DONE]` (streams); uvicorn's own cut (connections cancelled)
is only a backstop, SHUTDOWN_MARGIN_S later. The lifespan then closes the engine (logged
"lmtail engine closed") and the process exits 0 (the signal is handled, not re-raised;
1 if the engine thread did not stop in time). With --ranks N > 1 the engine's close also stops its N - 1 rank processes
(a stop command, a bounded join, then terminate), and each rank is SIGKILLed by the kernel
if this process dies any other way (PR_SET_PDEATHSIG): none outlives the server.

Shape legend: none (a command line).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import signal
import sys
import threading
import time

from ..tail.config import EXCHANGES, TAIL_HEAD_INPUTS, TailConfig

SERVE_BODIES = ("q32", "declared", "bq32")  # serve.batch.ROWS_BODIES, spelled here so --help imports no torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY = 1 << 20  # app.DEFAULT_MAX_BODY (not imported: the app pulls in starlette)
SHUTDOWN_MARGIN_S = 5.0  # uvicorn's cut comes this long after the app's grace period


def configure(ap: argparse.ArgumentParser) -> None:
    """The `lmtail serve` options, added to `ap`."""
    ap.description = ("An OpenAI-compatible server (chat / completions, streaming) for SmolLM2-135M-Instruct "
                      "on lmtail's declared decode, with continuous batching: every response is byte-equal "
                      "to the same request served alone.")
    ap.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--ranks", type=int, default=1,
                    help="vocab-parallel tail ranks: N spawned gloo ranks share the decode tail's head, every "
                         "response byte-equal to --ranks 1 (N must divide 49152 and 256)")
    ap.add_argument("--max-batch", type=int, default=16, help="requests decoding at once")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting at most (beyond: HTTP 429)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--k", type=int, default=TailConfig.k, help="the tail's candidates (the largest top_k accepted)")
    ap.add_argument("--model-name", default=DEFAULT_MODEL_NAME, help="the id clients pass as `model`")
    ap.add_argument("--exchange", choices=EXCHANGES, default=TailConfig.exchange,
                    help="the tail's exchange: 'candidates' (decisions on the fp32 logits) or 'mirror' (on their "
                         "bf16 mirror); default: %(default)s")
    ap.add_argument("--body", choices=SERVE_BODIES, default="q32",
                    help="the model body: 'q32' (the default: the GGUF's own blocks on an fp32 stream, the "
                         "Q8_0 head; loads only the file's bytes), 'declared' (bf16 weights and stream) or "
                         "'bq32' (q32's stream with every linear in the bq32 order, which AMX computes at its "
                         "tile rate: the fastest at batch where the CPU has AMX, other bytes than q32's)")
    ap.add_argument("--head-input", choices=TAIL_HEAD_INPUTS, default=None,
                    help="the head GEMM's activation: 'fp32' (the file's Q8_0 head; the default with --body "
                         "q32), 'bf16' (the bf16 head; the default with --body declared) or 'bf16x2' (hi + lo "
                         "bf16 rows on the bf16 head: 16 bits, two GEMM rows per request)")
    ap.add_argument("--shutdown-timeout", type=float, default=10.0,
                    help="seconds in-flight requests may take after SIGTERM (then 503 / an SSE error event)")
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                    help=f"the largest request body accepted (HTTP 413 beyond; default {DEFAULT_MAX_BODY})")


def check(args: argparse.Namespace) -> None:
    """ValueError naming the flag (expected vs got) for a value the server cannot take."""
    rules = [
        ("--port", args.port, 0 <= args.port <= 65535, "in [0, 65535]"),
        ("--ranks", args.ranks, args.ranks >= 1 and 49152 % args.ranks == 0 and 256 % args.ranks == 0,
         "a power of two in [1, 256] (dividing the vocab 49152 and the candidates exchange's 256 mass chunks)"),
        ("--max-batch", args.max_batch, args.max_batch >= 1, ">= 1"),
        ("--max-queue", args.max_queue, args.max_queue >= 0, ">= 0"),
        ("--threads", args.threads, args.threads >= 0, ">= 0 (0: torch's default)"),
        ("--k", args.k, 1 <= args.k <= 49152, "in [1, 49152]"),
        ("--shutdown-timeout", args.shutdown_timeout, args.shutdown_timeout >= 0, ">= 0"),
        ("--max-body-bytes", args.max_body_bytes, args.max_body_bytes >= 1, ">= 1"),
    ]
    for flag, value, ok, expected in rules:
        if not ok:
            raise ValueError(f"{flag} must be {expected}; got {value}")


def port_free(host: str, port: int) -> None:
    """ValueError naming --port (or --host) unless a socket can bind host:port now, the way
    uvicorn will (SO_REUSEADDR: a port only in TIME_WAIT is free); port 0 (any free port)
    always is. The test socket is closed at once; run calls this before the model loads (not
    check: a value check binds nothing)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host: cannot resolve {host!r} ({e.strerror})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port: {host}:{port} is in use (another server listens there); pick another "
                                 f"--port, or stop that server") from None
            raise ValueError(f"--port: cannot bind {host}:{port} ({e.strerror})") from None


def build(args: argparse.Namespace, bundle=None):
    """(engine, app) for the parsed flags; bundle None loads the model."""
    import torch

    from ..model.generate import weights_needed
    from ..model.gguf_loader import load_model
    from ..model.llama import lmtail_ops
    from .app import create_app
    from .engine import Engine

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    bundle = load_model(weights=weights_needed(args.body, args.head_input)) if bundle is None else bundle
    engine = Engine(bundle, max_batch=args.max_batch, max_queue=args.max_queue, k=args.k, exchange=args.exchange,
                    head_input=args.head_input, ranks=args.ranks, ops=lmtail_ops(body=args.body))
    return engine, create_app(engine, model_name=args.model_name, shutdown_timeout=args.shutdown_timeout,
                              max_body_bytes=args.max_body_bytes)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM / SIGINT (flags already passed `check`); 2 with one line, before the
    model loads, when --host:--port cannot be bound (port_free)."""
    import uvicorn

    try:  # the address first: a busy port is one line, not a model load and then uvicorn's errno 98
        port_free(args.host, args.port)
    except ValueError as e:
        print(f"lmtail serve: error: {e}", file=sys.stderr)
        return 2
    print("lmtail serve: loading SmolLM2-135M-Instruct ...", file=sys.stderr, flush=True)
    engine, app = build(args)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_MARGIN_S)
    try:
        _server_class()(config, app.state.lmtail).run()
    finally:  # the app's lifespan has closed the engine already, unless uvicorn never started
        ok = engine.close(args.shutdown_timeout)
    return 0 if ok else 1


def _server_class():
    """uvicorn.Server that tells the app when a signal starts the shutdown and does not
    re-raise the signal afterwards (the shutdown it asked for is the clean exit: 0)."""
    import uvicorn

    class _Server(uvicorn.Server):
        def __init__(self, config, state):
            super().__init__(config)
            self.app_state = state

        def handle_exit(self, sig, frame):
            self.app_state.begin_shutdown_threadsafe()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return _Server


class ThreadServer:
    """uvicorn serving `app` on a background thread (tests, benchmarks): start() returns
    once it listens; .port is the bound port (ask for port 0: an ephemeral one);
    stop(timeout) asks it to exit and joins it."""

    def __init__(self, app, *, host: str = "127.0.0.1", port: int = 0, graceful_s: float = 5.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=graceful_s))
        self.thread = threading.Thread(target=self.server.run, name="lmtail-serve-http", daemon=True)
        self.port = None

    def start(self, timeout: float = 60.0) -> "ThreadServer":
        self.thread.start()
        t_end = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > t_end or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> bool:
        """Exit at once (uvicorn's own shutdown: in-flight connections get its grace)."""
        self.server.should_exit = True
        self.thread.join(timeout)
        return not self.thread.is_alive()
