"""The HTTP layer: a Starlette ASGI app over one Engine.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events)
    GET  /v1/models             GET  /health            GET /openapi.json

A generation request: the body is read up to max_body_bytes (413 past it, from the
Content-Length header when it says so, else while reading); JSON decoding, validation,
tokenizing and a response_format grammar's compile (protocol.loads / protocol.parse /
serve.grammar: 400 naming the field) run on a worker thread, never on the event loop, so
/health and live streams keep their pace while a large body is parsed; the request then
becomes an engine Job whose events (engine thread) reach this event loop through
call_soon_threadsafe into an asyncio.Queue. A full engine is 429, a closing server 503.
A client that goes away cancels its job (the engine drops the row at its next step): a
stream when its write fails or Starlette's disconnect listener fires, a plain request by
a task that waits on the connection's http.disconnect beside the job's events.

Every error is OpenAI's shape {"error": {"message", "type", "param", "code"}}: the
protocol's 400s, 404 / 405 for routes, 413, 429, 503, a job's own failure (its status:
500 for an engine error, 503 at shutdown), and any unexpected exception (500). A failed
stream ends with an error event and `data: [DONE]`.

Shutdown (begin_shutdown: `lmtail serve` calls it on SIGTERM / SIGINT): new requests get
503 at once; jobs in flight have `shutdown_timeout` s to finish; then the engine is
closed, so the jobs left get Failed (503): a plain request answers 503 JSON, a stream an
error event and [DONE].

n > 1: the request becomes n engine Jobs submitted as one group (Engine.submit_group:
the prompt prefilled once, its cache copied per choice), choice i with the seed
protocol.choice_seed(seed, i); their events share one queue tagged with the choice's
index. Streams carry `index` in each choice; usage counts the prompt once and every
choice's tokens; a choice that fails fails the request (the others are cancelled).

Extra response fields (beyond OpenAI's): `seed` (the request's seed, picked from
os.urandom when it had none), choices[i].seed (choice i's: the n = 1 request with that
seed is byte-equal to choice i) and choices[i].token_ids (the generated ids, a stop
token included), so a client can replay or score a completion exactly.

Shape legend: none (JSON values).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Closed, Done, Engine, Failed, Job, Prompt, QueueFull, Token
from .grammar import Grammars
from .openapi import openapi_document
from .protocol import ApiError, CompletionLogprobs, Request, chat_logprob, choice_seed, loads, max_token_bytes, parse

DEFAULT_MAX_BODY = 1 << 20  # bytes of a request body (413 beyond)
_GONE = object()  # put in a plain request's queue when its client disconnects


def create_app(engine: Engine, *, model_name: str, shutdown_timeout: float = 10.0,
               max_body_bytes: int = DEFAULT_MAX_BODY) -> Starlette:
    """The ASGI app. Its lifespan starts the engine (if not started) and closes it on
    shutdown (joined for at most shutdown_timeout s). app.state.lmtail is the app's
    state: begin_shutdown() / begin_shutdown_threadsafe() start the graceful shutdown."""
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1; got {max_body_bytes}")
    state = _State(engine, model_name, shutdown_timeout, max_body_bytes)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = asyncio.get_running_loop()
        if not engine.started:
            engine.start()
        yield
        state.closing = True
        if state.expiry is not None:
            state.expiry.cancel()
        ended = await asyncio.to_thread(engine.close, shutdown_timeout)
        logging.getLogger("uvicorn.error").info("lmtail engine %s", "closed" if ended else "did not stop in time")

    routes = [Route("/v1/chat/completions", state.chat, methods=["POST"]),
              Route("/v1/completions", state.completions, methods=["POST"]),
              Route("/v1/models", state.models, methods=["GET"]),
              Route("/health", state.health, methods=["GET"]),
              Route("/openapi.json", state.openapi, methods=["GET"])]
    handlers = {HTTPException: _http_error, ApiError: _api_error, Exception: _internal_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.lmtail = state
    return app


async def _http_error(request, exc: HTTPException):
    return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)


async def _internal_error(request, exc: Exception):
    err = ApiError(500, f"internal server error: {type(exc).__name__}", type_="server_error")
    return JSONResponse(err.body(), status_code=500)


class _Channel:
    """The engine's sinks for a request's jobs: events cross into the event loop's queue
    as (choice index, event)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def sink(self, i: int):
        """Choice i's job sink (called on the engine thread)."""
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, event))


class _State:
    def __init__(self, engine: Engine, model_name: str, grace_s: float, max_body: int):
        self.engine, self.model = engine, model_name
        self.tok = engine.bundle.tokenizer
        self.context = engine.bundle.config.context_length
        self.token_bytes = max_token_bytes(self.tok)
        self.grammars = Grammars(self.tok, engine.bundle.config.vocab)  # response_format JSON modes
        self.grace_s, self.max_body = grace_s, max_body
        self.closing = False
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # set by the lifespan
        self.expiry: asyncio.TimerHandle | None = None  # the grace period's end
        self.closer: asyncio.Future | None = None  # engine.close at the grace period's end

    # ---- shutdown -----------------------------------------------------------------------
    def begin_shutdown_threadsafe(self) -> None:
        """begin_shutdown on the app's loop (from a signal handler or another thread)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self) -> None:
        """Stop admitting (503); after grace_s, close the engine: the jobs still in flight
        get Failed (503), which their handlers answer. On the loop; idempotent."""
        if self.closing:
            return
        self.closing = True
        self.expiry = asyncio.get_running_loop().call_later(self.grace_s, self._expire)

    def _expire(self) -> None:
        self.closer = asyncio.ensure_future(asyncio.to_thread(self.engine.close, 5.0))

    # ---- small endpoints ----------------------------------------------------------------
    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "lmtail", "max_model_len": self.context}]})

    async def openapi(self, request: HttpRequest):
        return JSONResponse(openapi_document(self.model, self.context, self.engine.k, self.tok.vocab_size,
                                             self.engine.max_batch))

    async def health(self, request: HttpRequest):
        load = self.engine.load()
        status = 503 if self.closing else 200
        return JSONResponse({"status": "closing" if self.closing else "ok", **load}, status_code=status)

    # ---- the two generation endpoints ---------------------------------------------------
    async def chat(self, request: HttpRequest):
        return await self._generate(request, "chat")

    async def completions(self, request: HttpRequest):
        return await self._generate(request, "completions")

    async def _generate(self, http: HttpRequest, kind: str):
        if self.closing:
            raise _closing()
        raw = await self._read_body(http)
        req = await asyncio.to_thread(self._parse, kind, raw)  # JSON, validation, tokenizing, grammar: off the loop
        chan = _Channel()
        jobs = [Job(prompt_ids=req.prompt_ids, params=req.choice_params(i), max_tokens=req.max_tokens,
                    sink=chan.sink(i), stop=req.stop, logprobs=req.logprobs,
                    echo_logprobs=req.echo and req.logprobs is not None, processors=req.processors,
                    grammar=None if req.grammar is None else req.grammar.start()) for i in range(req.n)]
        if self.closing:
            raise _closing()
        try:  # off the loop: submitting makes the prompt's cache memory (page faults, ~ms)
            if len(jobs) == 1:
                await asyncio.to_thread(self.engine.submit, jobs[0])
            else:
                await asyncio.to_thread(self.engine.submit_group, jobs)
        except QueueFull as e:
            raise ApiError(429, f"too many requests in flight: {e}; retry later", type_="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except Closed:
            raise _closing() from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(12).hex()
        if req.stream:
            return StreamingResponse(self._stream(req, jobs, chan, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(http, req, jobs, chan, rid)

    async def _read_body(self, http: HttpRequest) -> bytes:
        """The body, at most max_body bytes (ApiError 413 past it)."""
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body:
            raise _too_large(self.max_body, f"{declared} (Content-Length)")
        chunks, n = [], 0
        try:
            async for chunk in http.stream():
                n += len(chunk)
                if n > self.max_body:
                    raise _too_large(self.max_body, f"more than {self.max_body}")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client disconnected before sending the whole body") from None
        return b"".join(chunks)

    def _parse(self, kind: str, raw: bytes) -> Request:
        """protocol.loads + protocol.parse, a JSON-mode grammar compiled too (a worker
        thread's job)."""
        return parse(kind, loads(raw), tokenizer=self.tok, model=self.model, context=self.context,
                     k=self.engine.k, max_token_bytes=self.token_bytes, grammars=self.grammars,
                     max_n=self.engine.max_batch)

    async def _whole(self, http: HttpRequest, req: Request, jobs: list[Job], chan: _Channel, rid: str):
        watcher = asyncio.ensure_future(_on_disconnect(http, chan))
        events: list[list] = [[] for _ in jobs]  # per choice
        failed, done = None, 0
        try:
            while done < len(jobs) and failed is None:
                i, ev = await chan.queue.get()
                if ev is _GONE:  # the client went away: nothing to answer
                    return Response(status_code=499)
                events[i].append(ev)
                done += isinstance(ev, Done)
                failed = ev if isinstance(ev, Failed) else None
        finally:
            watcher.cancel()
            for job, evs in zip(jobs, events):
                if not evs or not isinstance(evs[-1], (Done, Failed)):
                    job.cancel()
        if failed is not None:
            raise _job_error(failed)
        return JSONResponse(self._body(req, rid, events))

    def _body(self, req: Request, rid: str, events: list[list]) -> dict:
        """The whole response of the n choices' events (each ending in Done)."""
        obj = "chat.completion" if req.kind == "chat" else "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model,
                "system_fingerprint": "lmtail", "seed": req.seed,
                "choices": [self._choice(req, i, evs) for i, evs in enumerate(events)],
                "usage": _usage(req, sum(evs[-1].completion_tokens for evs in events))}

    def _choice(self, req: Request, i: int, events: list) -> dict:
        """choices[i] of a whole response from choice i's events."""
        done: Done = events[-1]
        tokens = [e for e in events if isinstance(e, Token)]
        shown = [t for t in tokens if not t.special]
        choice = {"index": i, "finish_reason": done.finish_reason, "token_ids": [t.id for t in tokens],
                  "seed": choice_seed(req.seed, i)}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": done.text}
            choice["logprobs"] = None if req.logprobs is None else {
                "content": [chat_logprob(self.tok, t.id, t.logprob, t.top) for t in shown]}
        else:
            choice["text"] = (req.prompt_text if req.echo else "") + done.text
            choice["logprobs"] = None
            if req.logprobs is not None:
                lp = CompletionLogprobs(self.tok)
                for e in events:
                    if isinstance(e, Prompt):
                        _add_prompt(lp, req, e)
                for t in shown:
                    lp.add(t.id, t.logprob, t.top)
                choice["logprobs"] = lp.take()
        return choice

    async def _stream(self, req: Request, jobs: list[Job], chan: _Channel, rid: str):
        """SSE chunks, each for one choice (its `index`): chat (role first, a content delta
        per token, the finish chunk) or completions (a text chunk per token); the choices'
        chunks interleave as their tokens come; usage last if asked (every choice's
        tokens); then [DONE]. A choice's failure: an error event, the others cancelled."""
        created, chat = int(time.time()), req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        lps = [CompletionLogprobs(self.tok) for _ in jobs]

        def chunk(i, choice, usage=None):
            d = {"id": rid, "object": obj, "created": created, "model": self.model, "system_fingerprint": "lmtail",
                 "seed": req.seed, "choices": [] if choice is None else [{"index": i, **choice}]}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        finished = [False] * len(jobs)
        completion_tokens = 0
        try:
            for i in range(len(jobs)):
                if chat:
                    yield chunk(i, {"delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                    "finish_reason": None})
                elif req.echo:
                    yield chunk(i, {"text": req.prompt_text, "logprobs": None, "finish_reason": None})
            while not all(finished):
                i, ev = await chan.queue.get()
                lp = lps[i]
                if isinstance(ev, Prompt):
                    _add_prompt(lp, req, ev)
                    yield chunk(i, {"text": "", "logprobs": lp.take(), "finish_reason": None})
                elif isinstance(ev, Token):
                    logprobs = None
                    if req.logprobs is not None and not ev.special:
                        if chat:
                            logprobs = {"content": [chat_logprob(self.tok, ev.id, ev.logprob, ev.top)]}
                        else:
                            lp.add(ev.id, ev.logprob, ev.top)
                            logprobs = lp.take()
                    body = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                    yield chunk(i, {**body, "logprobs": logprobs, "finish_reason": None, "token_ids": [ev.id]})
                elif isinstance(ev, Done):
                    finished[i] = True
                    completion_tokens += ev.completion_tokens
                    body = {"delta": {}} if chat else {"text": ""}
                    yield chunk(i, {**body, "logprobs": None, "finish_reason": ev.finish_reason})
                    if req.include_usage and all(finished):
                        yield chunk(i, None, _usage(req, completion_tokens))
                else:  # Failed
                    finished[i] = True
                    yield f"data: {json.dumps(_job_error(ev).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            for job, f in zip(jobs, finished):
                if not f:
                    job.cancel()  # the client went away, a choice failed, or the server cancels us: free the slot


async def _on_disconnect(http: HttpRequest, chan: _Channel) -> None:
    """Wait for the connection's http.disconnect (the body is read already), then tell
    the plain request's loop (_GONE)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    chan.queue.put_nowait((-1, _GONE))


def _closing() -> ApiError:
    return ApiError(503, "the server is shutting down", type_="server_error")


def _too_large(limit: int, got: str) -> ApiError:
    return ApiError(413, f"the request body must be at most {limit} bytes; got {got}",
                    code="request_too_large")


def _job_error(ev: Failed) -> ApiError:
    """A job's failure as the client sees it (its status: 500 engine error, 503 shutdown)."""
    return ApiError(ev.status, ev.message, type_="server_error")


def _add_prompt(lp: CompletionLogprobs, req: Request, ev: Prompt) -> None:
    """The echoed prompt's entries: token 0 has no logprob, token p the teacher-forced one."""
    ids = req.prompt_ids
    lp.add(ids[0], None, None)
    for p, tid in enumerate(ids[1:]):
        lp.add(tid, ev.logprobs[p], None if ev.top is None else ev.top[p])


def _usage(req: Request, completion_tokens: int) -> dict:
    n = len(req.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}
