"""The HTTP layer: a Starlette ASGI app over one Engine.

    POST /v1/chat/completions   POST /v1/completions   (stream: server-sent events)
    GET  /v1/models             GET  /health

Each request is parsed (protocol.parse: 400 naming the field), becomes an engine Job
whose events (engine thread) reach this event loop through call_soon_threadsafe into an
asyncio.Queue; a full engine queue is 429, a closing engine 503. A client that goes away
(a stream whose write fails or is cancelled, a plain request whose connection reports
http.disconnect) cancels its job: the engine drops the row at its next step.

Extra response fields (beyond OpenAI's): `seed` (the seed used, picked from os.urandom
when the request had none) and choices[0].token_ids (the generated ids, a stop token
included), so a client can replay or score a completion exactly.

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
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .engine import Closed, Done, Engine, Failed, Job, Prompt, QueueFull, Token
from .protocol import ApiError, CompletionLogprobs, Request, chat_logprob, parse

DISCONNECT_POLL_S = 0.5  # how often a plain (non-streaming) request checks its client


def create_app(engine: Engine, *, model_name: str, shutdown_timeout: float = 10.0) -> Starlette:
    """The ASGI app. Its lifespan starts the engine (if not started) and closes it on
    shutdown (joined for at most shutdown_timeout s)."""
    state = _State(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not engine.started:
            engine.start()
        yield
        state.closing = True
        ended = await asyncio.to_thread(engine.close, shutdown_timeout)
        logging.getLogger("uvicorn.error").info("lmtail engine %s", "closed" if ended else "did not stop in time")

    routes = [Route("/v1/chat/completions", state.chat, methods=["POST"]),
              Route("/v1/completions", state.completions, methods=["POST"]),
              Route("/v1/models", state.models, methods=["GET"]),
              Route("/health", state.health, methods=["GET"])]
    handlers = {HTTPException: _http_error, ApiError: _api_error}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


async def _http_error(request, exc: HTTPException):
    return JSONResponse(ApiError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)


async def _api_error(request, exc: ApiError):
    return JSONResponse(exc.body(), status_code=exc.status)


class _Channel:
    """The engine's sink for one job: events cross into the event loop's queue."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, event) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class _State:
    def __init__(self, engine: Engine, model_name: str):
        self.engine, self.model = engine, model_name
        self.tok = engine.bundle.tokenizer
        self.context = engine.bundle.config.context_length
        self.closing = False
        self.created = int(time.time())

    # ---- small endpoints ----------------------------------------------------------------
    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "lmtail", "max_model_len": self.context}]})

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
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body must be valid JSON; got {e}") from None
        req = parse(kind, body, tokenizer=self.tok, model=self.model, context=self.context, k=self.engine.k)
        chan = _Channel()
        job = Job(prompt_ids=req.prompt_ids, params=req.params, max_tokens=req.max_tokens, sink=chan,
                  stop=req.stop, logprobs=req.logprobs, echo_logprobs=req.echo and req.logprobs is not None)
        if self.closing:
            raise ApiError(503, "the server is shutting down", type_="server_error")
        try:
            self.engine.submit(job)
        except QueueFull as e:
            raise ApiError(429, f"too many requests in flight: {e}; retry later", type_="rate_limit_error",
                           code="rate_limit_exceeded") from None
        except Closed:
            raise ApiError(503, "the server is shutting down", type_="server_error") from None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + os.urandom(12).hex()
        if req.stream:
            return StreamingResponse(self._stream(req, job, chan, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._whole(http, req, job, chan, rid)

    async def _whole(self, http: HttpRequest, req: Request, job: Job, chan: _Channel, rid: str):
        events = []
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(chan.queue.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        job.cancel()
                        return JSONResponse({}, status_code=499)
                    continue
                events.append(ev)
                if isinstance(ev, (Done, Failed)):
                    break
        finally:
            if not events or not isinstance(events[-1], (Done, Failed)):
                job.cancel()
        if isinstance(events[-1], Failed):
            raise ApiError(503, events[-1].message, type_="server_error")
        return JSONResponse(self._body(req, rid, events))

    def _body(self, req: Request, rid: str, events: list) -> dict:
        done: Done = events[-1]
        tokens = [e for e in events if isinstance(e, Token)]
        shown = [t for t in tokens if not t.special]
        choice = {"index": 0, "finish_reason": done.finish_reason, "token_ids": [t.id for t in tokens]}
        if req.kind == "chat":
            choice["message"] = {"role": "assistant", "content": done.text}
            choice["logprobs"] = None if req.logprobs is None else {
                "content": [chat_logprob(self.tok, t.id, t.logprob, t.top) for t in shown]}
            obj = "chat.completion"
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
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": self.model,
                "system_fingerprint": "lmtail", "seed": req.seed, "choices": [choice],
                "usage": _usage(req, done.completion_tokens)}

    async def _stream(self, req: Request, job: Job, chan: _Channel, rid: str):
        """SSE chunks: chat (role first, a content delta per token, the finish chunk) or
        completions (a text chunk per token); usage last if asked; then [DONE]."""
        created, chat = int(time.time()), req.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        lp = CompletionLogprobs(self.tok)

        def chunk(choice, usage=None):
            d = {"id": rid, "object": obj, "created": created, "model": self.model, "system_fingerprint": "lmtail",
                 "seed": req.seed, "choices": [] if choice is None else [{"index": 0, **choice}]}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        finished = False
        try:
            if chat:
                yield chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            elif req.echo:
                yield chunk({"text": req.prompt_text, "logprobs": None, "finish_reason": None})
            while True:
                ev = await chan.queue.get()
                if isinstance(ev, Prompt):
                    _add_prompt(lp, req, ev)
                    yield chunk({"text": "", "logprobs": lp.take(), "finish_reason": None})
                elif isinstance(ev, Token):
                    logprobs = None
                    if req.logprobs is not None and not ev.special:
                        if chat:
                            logprobs = {"content": [chat_logprob(self.tok, ev.id, ev.logprob, ev.top)]}
                        else:
                            lp.add(ev.id, ev.logprob, ev.top)
                            logprobs = lp.take()
                    body = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                    yield chunk({**body, "logprobs": logprobs, "finish_reason": None, "token_ids": [ev.id]})
                elif isinstance(ev, Done):
                    finished = True
                    body = {"delta": {}} if chat else {"text": ""}
                    yield chunk({**body, "logprobs": None, "finish_reason": ev.finish_reason})
                    if req.include_usage:
                        yield chunk(None, _usage(req, ev.completion_tokens))
                    break
                else:  # Failed
                    finished = True
                    yield f"data: {json.dumps(ApiError(503, ev.message, type_='server_error').body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                job.cancel()  # the client went away (or the server is cancelling us): free the slot


def _add_prompt(lp: CompletionLogprobs, req: Request, ev: Prompt) -> None:
    """The echoed prompt's entries: token 0 has no logprob, token p the teacher-forced one."""
    ids = req.prompt_ids
    lp.add(ids[0], None, None)
    for p, tid in enumerate(ids[1:]):
        lp.add(tid, ev.logprobs[p], None if ev.top is None else ev.top[p])


def _usage(req: Request, completion_tokens: int) -> dict:
    n = len(req.prompt_ids)
    return {"prompt_tokens": n, "completion_tokens": completion_tokens, "total_tokens": n + completion_tokens}
