"""The server's OpenAPI 3.0 document (GET /openapi.json): the two generation endpoints'
request bodies as protocol.FIELDS checks them (types, ranges, the no-op values of the
fields clients send), their responses and OpenAI's error shape, /v1/models and /health.
Every body the server accepts is valid here (a fuzzer's negative cases must be refused);
a few valid ones are still refused by rules a schema does not say (prompt + max_tokens
past the context, top_p that is 0.0 in fp32, top_logprobs without logprobs).
Written beside protocol.py; the range fields come from FIELDS' own checks (each carries its
schema), so a field's range is spelled once. tests/test_serve_hardening.py checks that every
FIELDS name is in it and fuzzes the server from it with schemathesis.

Shape legend: none (JSON values).
"""
from __future__ import annotations

from .protocol import BOTH, FIELDS, LOGIT_BIAS_RANGE, MAX_LOGPROBS, MAX_STOP, number_schema


def _num(lo, hi, *, lo_open=False, nullable=True) -> dict:
    return number_schema(lo, hi, lo_open=lo_open, nullable=nullable)


def _ranged() -> dict:
    """Both endpoints' fields whose FIELDS check carries its schema (temperature, top_p,
    min_p, seed, the penalties, ...): their ranges as protocol checks them, written once."""
    return {name: check.schema for name, (where, check) in FIELDS.items()
            if where == BOTH and hasattr(check, "schema")}


def _common(k: int, context: int, max_n: int) -> dict:
    """The fields both endpoints take."""
    stop = {"oneOf": [{"type": "string", "minLength": 1},
                      {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP}],
            "nullable": True}
    return {
        **_ranged(),
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": context - 1, "nullable": True},
        "top_k": {"type": "integer", "minimum": -1, "maximum": k, "nullable": True},
        "stop": stop,
        "stream": {"type": "boolean", "nullable": True},
        "n": {"type": "integer", "minimum": 1, "maximum": max_n, "nullable": True},
        "user": {"type": "string", "nullable": True},
        # keys: decimal token ids in [0, V) (a rule this schema does not say: other keys are a 400)
        "logit_bias": {"type": "object", "additionalProperties": _num(*LOGIT_BIAS_RANGE, nullable=False),
                       "nullable": True},
        "response_format": _response_format(),
        "store": {"type": "boolean", "nullable": True},
        "metadata": {"type": "object", "additionalProperties": {"type": "string"}, "nullable": True},
    }


def _response_format() -> dict:
    """{"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name", "description", "schema", "strict"}} (protocol._response_format; a schema the
    grammar library refuses is a 400 the document does not predict)."""
    def only(t: str, **extra) -> dict:
        return {"type": "object", "required": ["type", *extra], "additionalProperties": False,
                "properties": {"type": {"type": "string", "enum": [t]}, **extra}}
    js = {"type": "object", "required": ["schema"], "additionalProperties": False, "properties": {
        "name": {"type": "string", "nullable": True}, "description": {"type": "string", "nullable": True},
        "schema": {"type": "object"}, "strict": {"type": "boolean", "nullable": True}}}
    return {"oneOf": [only("text"), only("json_object"), only("json_schema", json_schema=js)], "nullable": True}


def _error() -> dict:
    return {"description": "OpenAI's error shape", "content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/Error"}}}}


def _op(summary: str, schema_ref: str) -> dict:
    ok = {"description": "a completion (JSON), or server-sent events with stream: true",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                       "properties": {"data": {"type": "string"}}}}}}
    return {"post": {"summary": summary,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": {
                         "$ref": schema_ref}}}},
                     "responses": {"200": ok, **{c: _error() for c in ("400", "404", "413", "429", "500", "503")}}}}


def openapi_document(model: str, context: int, k: int, vocab: int, max_n: int = 1) -> dict:
    """The document for a server of `model` with `context` tokens, top_k up to k, token
    ids below vocab and n up to max_n."""
    common = _common(k, context, max_n)
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}, "minItems": 1}
    part = {"type": "object", "required": ["type", "text"], "properties": {
        "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}
    message = {"type": "object", "required": ["role", "content"], "additionalProperties": False, "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
        "name": {"type": "string", "nullable": True}}}
    chat = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
        **common,
        "model": {"type": "string", "enum": [model]},
        "messages": {"type": "array", "items": message, "minItems": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": context - 1, "nullable": True},
        "logprobs": {"type": "boolean", "nullable": True},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "nullable": True},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                           "additionalProperties": False, "nullable": True},
        "tools": {"type": "array", "maxItems": 0, "nullable": True},
        "tool_choice": {"type": "string", "enum": ["none", None], "nullable": True},
        "parallel_tool_calls": {"type": "boolean", "nullable": True},
        "functions": {"type": "array", "maxItems": 0, "nullable": True},
        "function_call": {"type": "string", "enum": ["none", None], "nullable": True}}}
    completion = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
        **common,
        "model": {"type": "string", "enum": [model]},
        "max_tokens": {"type": "integer", "minimum": 0, "maximum": context - 1, "nullable": True},  # 0: echo
        "prompt": {"oneOf": [{"type": "string", "minLength": 1}, ids,
                             {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
                              "maxItems": 1},
                             {"type": "array", "items": ids, "minItems": 1, "maxItems": 1}]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS, "nullable": True},
        "echo": {"type": "boolean", "nullable": True},
        "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}},
                           "additionalProperties": False, "nullable": True}}}
    error = {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"], "properties": {
            "message": {"type": "string"}, "type": {"type": "string"},
            "param": {"type": "string", "nullable": True}, "code": {"type": "string", "nullable": True}}}}}
    plain = {"description": "JSON", "content": {"application/json": {"schema": {"type": "object"}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "lmtail serve", "version": "1",
                 "description": f"OpenAI-compatible completions for {model} ({context}-token context)"},
        "paths": {
            "/v1/chat/completions": _op("chat completion", "#/components/schemas/ChatRequest"),
            "/v1/completions": _op("text completion", "#/components/schemas/CompletionRequest"),
            "/v1/models": {"get": {"summary": "the served model", "responses": {"200": plain}}},
            "/health": {"get": {"summary": "load and status", "responses": {"200": plain, "503": plain}}},
        },
        "components": {"schemas": {"ChatRequest": chat, "CompletionRequest": completion, "Error": error}},
    }
