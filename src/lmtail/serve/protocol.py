"""The OpenAI request bodies: parsing and validation into one typed Request, and the
token / logprob formatting of the responses.

`loads` decodes a body (bytes) into JSON values: malformed JSON, invalid UTF-8 and
nesting past Python's recursion limit are ApiErrors (400); an integer literal longer than
MAX_INT_DIGITS digits becomes a `Huge` value (no field takes it, so the field's own check
names it; Python would refuse to convert a 5,000-digit one at all).

Every field is checked by one table (FIELDS: name -> endpoint set, check); an unknown
field, a wrong type or an out-of-range value is an ApiError (HTTP 400, OpenAI's error
shape, `param` naming the field). Supported: model, messages | prompt, max_tokens
(max_completion_tokens), temperature [0, 2], top_p (0, 1], top_k (vLLM: -1 or 0 off,
1..k), min_p [0, 1], seed (int64; absent: one from os.urandom, reported back), stop
(a string or up to 4), stream, stream_options.include_usage, n (1..max_n), logprobs
(chat: bool + top_logprobs 0..20; completions: int 0..20), echo (completions), user;
the `developer` role (as `system`); logit_bias (OpenAI's: {"token id": bias}, keys
decimal token ids in [0, V), biases numbers in [-100, 100]), presence_penalty and
frequency_penalty (OpenAI's, [-2, 2]) and repetition_penalty (vLLM's, > 0, finite in
fp32): lmtail.tail.processors.Processors, applied at the tail's logits-processor seam;
response_format {"type": "text"} (a no-op), {"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name", "schema", "strict", "description"}}: its shape is
checked here, its grammar compiled by the `grammars` parse() is given
(serve.grammar.Grammars: a schema it refuses is a 400 naming response_format; without one
the JSON modes are not supported). Accepted as no-ops: tools [], tool_choice "none",
parallel_tool_calls, store, metadata. Any other value of those is a 400 naming the field
and saying it is not supported yet.

n choices: choice i (0 <= i < n) is the request served alone with the seed
choice_seed(seed, i) = seed + i wrapped into int64 (its 64 bits: (seed mod 2**64 + i)
mod 2**64, the bits numerics.draw_u reads); so the n seeds are distinct, each a valid
`seed` a client can send back, and choice i is byte-equal to that n = 1 request. A
request without a seed gets one from os.urandom (reported back as `seed`, each choice's
as choices[i].seed): deterministic given the reported seeds. A greedy request
(temperature 0) reads no seed: its n choices are the same. max_n (the server's
max_batch: a request's choices decode together) bounds n: a 400 naming n beyond.

Admission checks the sampling values in the terms the kernels read them: the fp32 value
of each float (top_p 1e-50 is 0.0 in fp32: a 400 naming top_p), the seed's 64 bits (an
int64 seed s is the uint64 s mod 2**64, the bits numerics.draw_u reads), and finally
sampler.sampling_tensor on the request's first and last decode positions, so no value
that passes here can fail a decode step.

Every string the tokenizer or the response will see must be valid Unicode text without
lone surrogates (JSON allows "\ud800"; UTF-8 does not): a 400 naming the field.

Prompt length: a prompt of `context` tokens or more is a 400 naming it; a text prompt
whose UTF-8 size exceeds max_token_bytes * (context - 1) (each token covers at most
max_token_bytes bytes) is refused by its size alone, before it is tokenized.

Shape legend: none (JSON values).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from dataclasses import dataclass

from ..tail.processors import Processors
from ..tail.sampler import U64, SamplingParams, sampling_tensor

MAX_LOGPROBS = 20
MAX_STOP = 4
LOGIT_BIAS_RANGE = (-100, 100)  # OpenAI's
INT64 = (-(1 << 63), (1 << 63) - 1)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # the legacy completions API's default
MAX_INT_DIGITS = 40  # longer integer literals become Huge (int64 needs at most 19 digits)
NOT_YET = "is not supported yet"


class ApiError(Exception):
    """An OpenAI-shaped error: status, message, param (the field), type, code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        """{"error": {...}}; lone surrogates of a client's text (a field name) escaped, so
        the body always has a UTF-8 form."""
        return {"error": {"message": _utf8_safe(self.message), "type": self.type,
                          "param": None if self.param is None else _utf8_safe(self.param), "code": self.code}}


def _utf8_safe(s: str) -> str:
    return s if s.isascii() else s.encode("utf-8", "backslashreplace").decode("utf-8")


def bad(param: str, expected: str, got) -> ApiError:
    return ApiError(400, f"{param} must be {expected}; got {_short(got)}", param=param)


def not_yet(param: str, what: str, got) -> ApiError:
    """A 400 for a field clients send whose value this server does not implement."""
    return ApiError(400, f"{param}: {what} {NOT_YET}; got {_short(got)}", param=param)


def _short(v) -> str:
    """repr(v) cut to 200 characters (a huge value is not repr'd whole)."""
    if isinstance(v, (list, dict)) and len(v) > 50:
        return f"a {type(v).__name__} of {len(v)} items"
    if isinstance(v, str) and len(v) > 200:
        v = v[:200]
    return f"{v!r:.200}"


class Huge:
    """An integer literal of more than MAX_INT_DIGITS digits, kept as its text (not an int:
    every integer field refuses it, naming itself)."""

    def __init__(self, digits: str):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {len(self.digits.lstrip('-'))} digits"


def _parse_int(s: str):
    return int(s) if len(s) <= MAX_INT_DIGITS else Huge(s)


def loads(raw: bytes):
    """The JSON value of a request body; ApiError (400) for invalid UTF-8, malformed JSON
    or nesting deeper than the interpreter's recursion limit."""
    try:
        return json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        raise ApiError(400, "the request body must be valid JSON; got arrays / objects nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise ApiError(400, f"the request body must be valid JSON; got {str(e):.200}") from None


@dataclass(frozen=True)
class Request:
    """One validated request. prompt_ids: the tokens the model sees; params: with the seed
    (given or picked); logprobs: None, or n alternatives (chat: top_logprobs)."""

    kind: str  # "chat" | "completions"
    model: str
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    seed: int
    max_tokens: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: int | None
    echo: bool
    processors: Processors | None = None  # logit_bias and penalties (None: none)
    grammar: object = None  # serve.grammar.Grammar of a JSON-mode response_format, or None
    n: int = 1

    def choice_params(self, i: int) -> SamplingParams:
        """Choice i's sampling params: params with seed choice_seed(seed, i) (its uint64 bits)."""
        if not 0 <= i < self.n:
            raise ValueError(f"i must be in [0, {self.n}); got {i}")
        return dataclasses.replace(self.params, seed=choice_seed(self.seed, i) % U64)


def choice_seed(seed: int, i: int) -> int:
    """The int64 seed of choice i of a request with int64 `seed`: seed + i wrapped into
    [-2**63, 2**63) (choice 0: seed itself)."""
    return (seed + i - INT64[0]) % U64 + INT64[0]


# ---------------------------------------------------------------------------------------
# field checks: value -> normalized value, or raise ApiError via bad()
# ---------------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def number_schema(lo, hi, *, lo_open=False, nullable=True) -> dict:
    """The OpenAPI schema of a number in [lo, hi] ((lo, hi] with lo_open); hi = inf: no
    maximum (JSON has no infinity)."""
    d = {"type": "number", "minimum": lo, "nullable": nullable}
    if hi != math.inf:
        d["maximum"] = hi
    if lo_open:
        d["exclusiveMinimum"] = True
    return d


def _with_schema(check, schema: dict):
    """A field check that also carries its OpenAPI schema (openapi.py builds the request
    bodies' range fields from FIELDS through it: a field's range is written once)."""
    check.schema = schema
    return check


def _num_in(lo, hi, *, lo_open=False):
    def check(name, v):
        if v is None:
            return None
        ok = _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi
        if not ok:
            raise bad(name, f"a number in {'(' if lo_open else '['}{lo}, {hi}]", v)
        return float(v)
    return _with_schema(check, number_schema(lo, hi, lo_open=lo_open))


def _int_in(lo, hi):
    def check(name, v):
        if v is None:
            return None
        if not (_is_int(v) and lo <= v <= hi):
            raise bad(name, f"an integer in [{lo}, {hi}]", v)
        return v
    return _with_schema(check, {"type": "integer", "minimum": lo, "maximum": hi, "nullable": True})


def _bool(name, v):
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(name, "a boolean", v)
    return v


def _text(name: str, v: str) -> str:
    """v itself if it is valid Unicode text (no lone surrogate, so it has a UTF-8 form)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{name} must be text without lone surrogates (UTF-8 encodable); got "
                            f"{v[e.start]!r} at position {e.start}", param=name) from None
    return v


def _str(name, v):
    if v is not None and not isinstance(v, str):
        raise bad(name, "a string", v)
    return v if v is None else _text(name, v)


def _penalty(lo: float, hi: float, *, lo_open: bool = False):
    """A penalty: a number in [lo, hi] ((lo, hi] with lo_open), and nonzero, finite in fp32
    (the dtype the tail reads it in) when lo_open. Returns it as a float."""
    def check(name, v):
        if v is None:
            return None
        if not (_is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise bad(name, f"a finite number > {lo:g}" if hi == math.inf else
                      f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]", v)
        if lo_open and not 0 < abs(_fp32_or_inf(float(v))) < math.inf:
            raise ApiError(400, f"{name} must be > 0 and finite in fp32 (the tail's dtype); got {v!r}, which is "
                                f"{_fp32_or_inf(float(v))!r} in fp32", param=name)
        return float(v)
    return _with_schema(check, number_schema(lo, hi, lo_open=lo_open))


def _fp32_or_inf(x: float) -> float:
    try:
        return _fp32(x)
    except OverflowError:
        return math.inf


def _n(name, v):
    if v is None:
        return 1
    if not (_is_int(v) and v >= 1):
        raise bad(name, "an integer >= 1", v)
    return v


def _logit_bias(name, v):
    """OpenAI's {"token id": bias} -> ((id, bias), ...) sorted by id; ids checked against
    the vocabulary in parse()."""
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad(name, "an object {token id: bias}", v)
    lo, hi = LOGIT_BIAS_RANGE
    out = {}
    for key, b in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12):
            raise bad(name, "an object whose keys are token ids (decimal strings)", key)
        if not (_is_num(b) and lo <= b <= hi):
            raise bad(f"{name}[{key}]", f"a number in [{lo}, {hi}]", b)
        if int(key) in out:
            raise bad(name, "an object naming each token id once", key)
        out[int(key)] = float(b)
    return tuple(sorted(out.items()))


RESPONSE_FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


def _response_format(name, v):
    """None for no format or {"type": "text"}; the checked object of a JSON mode
    (json_schema.schema an object; name / description strings, strict a boolean)."""
    if v is None:
        return None
    if not (isinstance(v, dict) and isinstance(v.get("type"), str)):
        raise bad(name, 'an object {"type": "text" | "json_object" | "json_schema", ...}', v)
    if v["type"] not in RESPONSE_FORMATS:
        raise not_yet(name, f'{v["type"]!r} (only "text", "json_object" and "json_schema" are)', v)
    keys = {"type", "json_schema"} if v["type"] == "json_schema" else {"type"}
    if set(v) != keys:
        raise bad(name, f"an object with the keys {sorted(keys)} for type {v['type']!r}", v)
    if v["type"] == "text":
        return None
    if v["type"] == "json_schema":
        js = v["json_schema"]
        if not (isinstance(js, dict) and isinstance(js.get("schema"), dict) and set(js) <= JSON_SCHEMA_KEYS):
            raise bad(f"{name}.json_schema", 'an object {"name": ..., "schema": {...}, "strict": ...} with the '
                                             "schema a JSON object", js)
        for key, kind, ok in (("name", "a string", str), ("description", "a string", str),
                              ("strict", "a boolean", bool)):
            if js.get(key) is not None and not isinstance(js[key], ok):
                raise bad(f"{name}.json_schema.{key}", kind, js[key])
    return v


def _tools(name, v):
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad(name, "a list of tools", v)
    if v:
        raise not_yet(name, "tool calling (this model's chat template has no tools)", v)
    return v


def _tool_choice(name, v):
    if v is None or v == "none":
        return v
    if not isinstance(v, (str, dict)):
        raise bad(name, '"none", "auto", "required" or an object', v)
    raise not_yet(name, "tool calling (only \"none\" is)", v)


def _functions(name, v):
    if v is None or v == []:
        return v
    if not isinstance(v, list):
        raise bad(name, "a list of functions", v)
    raise not_yet(name, "function calling", v)


def _function_call(name, v):
    if v is None or v == "none":
        return v
    if not isinstance(v, (str, dict)):
        raise bad(name, '"none", "auto" or an object', v)
    raise not_yet(name, "function calling (only \"none\" is)", v)


def _metadata(name, v):
    if v is not None and not (isinstance(v, dict) and all(isinstance(x, str) for x in v.values())):
        raise bad(name, "an object of strings", v)
    return v


def _stop(name, v):
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not (isinstance(items, list) and len(items) <= MAX_STOP and all(isinstance(s, str) and s for s in items)):
        raise bad(name, f"a non-empty string or a list of at most {MAX_STOP} non-empty strings", v)
    return tuple(_text(name, s) for s in items)


def _stream_options(name, v):
    if v is None:
        return False
    if not isinstance(v, dict) or set(v) - {"include_usage"} or not isinstance(v.get("include_usage", False), bool):
        raise bad(name, 'an object {"include_usage": bool}', v)
    return v.get("include_usage", False)


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _messages(name, v):
    """[{"role", "content"}] with the role mapped (developer -> system) and the content a
    string (a list of text parts joined)."""
    ok = isinstance(v, list) and v
    out = []
    for i, m in enumerate(v if ok else []):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in ROLES \
                or set(m) - {"role", "content", "name"}:
            raise bad(f"{name}[{i}]", 'an object {"role": system|developer|user|assistant, "content": ...}', m)
        c = m.get("content")
        if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in c):
            c = "".join(p["text"] for p in c)
        if not isinstance(c, str):
            raise bad(f"{name}[{i}].content", "a string (or a list of text parts)", c)
        _str(f"{name}[{i}].name", m.get("name"))
        out.append({"role": ROLES[m["role"]], "content": _text(f"{name}[{i}].content", c)})
    if not out:
        raise bad(name, "a non-empty list of messages", v)
    return out


def _prompt(name, v):
    """A string, a list of token ids, or a list holding one of those (n = 1)."""
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        v = v[0]
    if isinstance(v, str) and v:
        return _text(name, v)
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        return list(v)
    raise bad(name, "a non-empty string or a non-empty list of token ids (one prompt)", v)


def _fp32(x: float) -> float:
    """x rounded to fp32 (round to nearest even), as the sampler's tensor holds it."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


BOTH, CHAT, COMP = ("chat", "completions"), ("chat",), ("completions",)
FIELDS = {
    "model": (BOTH, _str),
    "messages": (CHAT, _messages),
    "prompt": (COMP, _prompt),
    "max_tokens": (BOTH, None),  # checked with the prompt length
    "max_completion_tokens": (CHAT, None),
    "temperature": (BOTH, _num_in(0, 2)),
    "top_p": (BOTH, _num_in(0, 1, lo_open=True)),
    "top_k": (BOTH, None),  # checked against the server's k
    "min_p": (BOTH, _num_in(0, 1)),
    "seed": (BOTH, _int_in(*INT64)),
    "stop": (BOTH, _stop),
    "stream": (BOTH, _bool),
    "stream_options": (BOTH, _stream_options),
    "n": (BOTH, _n),
    "user": (BOTH, _str),
    "presence_penalty": (BOTH, _penalty(-2, 2)),
    "frequency_penalty": (BOTH, _penalty(-2, 2)),
    "repetition_penalty": (BOTH, _penalty(0, math.inf, lo_open=True)),
    "logit_bias": (BOTH, _logit_bias),
    "response_format": (BOTH, _response_format),
    "tools": (CHAT, _tools),
    "tool_choice": (CHAT, _tool_choice),
    "parallel_tool_calls": (CHAT, _bool),
    "functions": (CHAT, _functions),
    "function_call": (CHAT, _function_call),
    "store": (BOTH, _bool),
    "metadata": (BOTH, _metadata),
    "logprobs": (BOTH, None),  # bool (chat) or int (completions)
    "top_logprobs": (CHAT, _int_in(0, MAX_LOGPROBS)),
    "echo": (COMP, _bool),
}


def parse(kind: str, body, *, tokenizer, model: str, context: int, k: int,
          max_token_bytes: int | None = None, grammars=None, max_n: int = 1) -> Request:
    """Validate a request body (already JSON-decoded) for endpoint `kind` ("chat" or
    "completions"); ApiError naming the first bad field. context: the model's context
    length (prompt + max_tokens must fit); k: the largest top_k the server takes;
    max_token_bytes: the most UTF-8 bytes one token covers (None: no size pre-check);
    grammars: serve.grammar.Grammars compiling a JSON-mode response_format, last (None:
    the JSON modes are a 400, not supported). max_n: the largest n (choices) the server
    takes."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object; got {type(body).__name__}")
    for name in body:
        if name not in FIELDS or kind not in FIELDS[name][0]:
            raise ApiError(400, f"Unrecognized request argument supplied: {name[:200]}", param=name[:200])
    v = {}
    for name, (_, check) in FIELDS.items():
        if check is not None and kind in FIELDS[name][0]:
            v[name] = check(name, body.get(name))
    need = "messages" if kind == "chat" else "prompt"
    if need not in body or "model" not in body or v["model"] is None:
        missing = "model" if "model" not in body or v["model"] is None else need
        raise ApiError(400, f"{missing} is required", param=missing)
    if v["model"] != model:
        raise ApiError(404, f"The model {v['model']!r:.200} does not exist (this server has {model!r})",
                       param="model", code="model_not_found")
    if v["n"] > max_n:
        raise bad("n", f"an integer in [1, {max_n}] (the server's max batch: a request's choices decode "
                       "together)", v["n"])
    if v["stream_options"] and not v["stream"]:
        raise bad("stream_options", "given only with stream=true", body["stream_options"])
    logprobs, echo = _logprobs(kind, body, v), bool(v.get("echo"))
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k == -1 or 0 <= top_k <= k)):
        raise bad("top_k", f"an integer in [0, {k}] or -1 (0 and -1 disable it)", top_k)
    if v["top_p"] is not None and _fp32(v["top_p"]) <= 0:
        raise ApiError(400, f"top_p must be in (0, 1] in fp32 (the sampler's dtype); got {body['top_p']!r}, "
                            "which is 0.0 in fp32", param="top_p")
    text, ids = _prompt_ids(kind, v[need], body[need], tokenizer, context, max_token_bytes)
    max_tokens = _max_tokens(kind, body, len(ids), context, echo)
    seed = v["seed"] if v["seed"] is not None else int.from_bytes(os.urandom(8), "little") >> 1
    temperature = 1.0 if v["temperature"] is None else v["temperature"]
    params = SamplingParams(top_k=max(top_k or 0, 0), top_p=1.0 if v["top_p"] is None else v["top_p"],
                            temperature=temperature, min_p=v["min_p"] or 0.0, seed=seed % U64)
    try:  # the tail's own rules on the fp32 rows of the first and the last decode position
        sampling_tensor([params, params], positions=[len(ids), len(ids) + max(max_tokens - 1, 0)])
    except ValueError as e:
        raise ApiError(400, f"the sampling parameters are refused in fp32: {e}") from None
    fmt = v["response_format"]
    if fmt is not None and grammars is None:
        raise not_yet("response_format", f"{fmt['type']!r} (this parse has no grammar compiler)", fmt)
    return Request(kind=kind, model=model, prompt_ids=list(ids), prompt_text=text, params=params, seed=seed,
                   max_tokens=max_tokens, stop=v["stop"], stream=bool(v["stream"]),
                   include_usage=bool(v["stream_options"]), logprobs=logprobs, echo=echo, n=v["n"],
                   processors=_processors(v, tokenizer.vocab_size),
                   grammar=None if fmt is None else grammars.compile(fmt))


def _processors(v: dict, vocab: int) -> Processors | None:
    """The request's Processors (None when every field is neutral); a logit_bias id outside
    [0, vocab) is a 400 naming logit_bias."""
    for tid, _ in v["logit_bias"]:
        if tid >= vocab:
            raise bad("logit_bias", f"an object whose keys are token ids in [0, {vocab})", str(tid))
    q = Processors(logit_bias=v["logit_bias"], presence_penalty=v["presence_penalty"] or 0.0,
                   frequency_penalty=v["frequency_penalty"] or 0.0,
                   repetition_penalty=1.0 if v["repetition_penalty"] is None else v["repetition_penalty"])
    return None if q.neutral else q


def _prompt_ids(kind: str, value, raw, tokenizer, context: int, max_token_bytes: int | None):
    """(prompt text, token ids) of a checked messages / prompt value; ApiError naming the
    field for an empty prompt or one of `context` tokens or more (a text one refused by
    its UTF-8 size alone when that proves it, before tokenizing)."""
    need = "messages" if kind == "chat" else "prompt"
    if kind == "chat":
        text = tokenizer.apply_chat_template(value)
    elif isinstance(value, str):
        text = value
    else:
        ids = value
        bad_id = [t for t in ids if not 0 <= t < tokenizer.vocab_size]
        if bad_id:
            raise bad("prompt", f"token ids in [0, {tokenizer.vocab_size})", bad_id[0])
        text = None
    if text is not None:
        size = len(text.encode("utf-8"))
        if max_token_bytes is not None and size > max_token_bytes * (context - 1):
            raise ApiError(400, f"{need} must be shorter than the context ({context} tokens); got {size} UTF-8 "
                                f"bytes, at least {-(-size // max_token_bytes)} tokens", param=need)
        ids = encode(tokenizer, text)
    else:
        text = tokenizer.decode(ids, skip_special=False)
    if not ids:
        raise bad(need, "a prompt of at least one token", raw)
    if len(ids) >= context:
        raise ApiError(400, f"{need} must be shorter than the context ({context} tokens); got {len(ids)} tokens",
                       param=need)
    return text, ids


def encode(tokenizer, text: str) -> list[int]:
    """tokenizer.encode(text) (model.tokenizer.ChatTokenizer: no special tokens added), the
    same ids, through the backend's batch call, which releases the GIL while it runs (the
    single-text call holds it: a 600 KB prompt would stall the event loop's thread for
    half a second). tests/test_serve_hardening.py checks the ids equal."""
    return tokenizer.backend.encode_batch([text], add_special_tokens=False)[0].ids


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token of the vocabulary covers (its longest token)."""
    return max(len(token_bytes(tokenizer, t)) for t in range(tokenizer.vocab_size))


def _logprobs(kind: str, body: dict, v: dict) -> int | None:
    lp = body.get("logprobs")
    if kind == "chat":
        _bool("logprobs", lp)
        top = v["top_logprobs"]
        if top is not None and not lp:
            raise bad("top_logprobs", "given only with logprobs=true", top)
        return (top or 0) if lp else None
    if v["echo"] and lp is None:
        return None
    return _int_in(0, MAX_LOGPROBS)("logprobs", lp)


def _max_tokens(kind: str, body: dict, n_prompt: int, context: int, echo: bool) -> int:
    name = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(name)
    room = context - n_prompt
    if mt is None:
        return room if kind == "chat" else min(COMPLETIONS_DEFAULT_MAX_TOKENS, room)
    lo = 0 if echo else 1
    if not (_is_int(mt) and lo <= mt):
        hint = " (0 only with echo)" if not echo and kind == "completions" else ""
        raise bad(name, f"an integer >= {lo}{hint}", mt)
    if mt > room:
        raise ApiError(400, f"{name} must be <= {room} (context {context} - {n_prompt} prompt tokens); got {mt}",
                       param=name)
    return mt

# ---------------------------------------------------------------------------------------
# tokens as the API shows them
# ---------------------------------------------------------------------------------------
def _byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's bytes_to_unicode (the ByteLevel alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTES = _byte_decoder()


def token_bytes(tokenizer, tid: int) -> bytes:
    """The raw bytes of token `tid` (a special token: its name in UTF-8)."""
    s = tokenizer.backend.id_to_token(tid)
    if tid in tokenizer.special_ids or s is None or any(c not in _BYTES for c in s):
        return (s or "").encode()
    return bytes(_BYTES[c] for c in s)


def token_str(tokenizer, tid: int) -> str:
    return token_bytes(tokenizer, tid).decode("utf-8", errors="replace")


def chat_logprob(tokenizer, tid: int, lp: float, top) -> dict:
    """One entry of choices[].logprobs.content (chat)."""
    b = token_bytes(tokenizer, tid)
    return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b),
            "top_logprobs": [{"token": token_str(tokenizer, i), "logprob": v, "bytes": list(token_bytes(tokenizer, i))}
                             for i, v in (top or [])]}


class CompletionLogprobs:
    """choices[].logprobs of the legacy completions API, built token by token."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        self.offset = 0

    def add(self, tid: int, lp: float | None, top) -> None:
        s = token_str(self.tok, tid)
        self.tokens.append(s)
        self.token_logprobs.append(lp)
        self.top_logprobs.append(None if top is None else {token_str(self.tok, i): v for i, v in top})
        self.text_offset.append(self.offset)
        self.offset += len(s)

    def take(self) -> dict:
        """The entries added since the last take() (streaming) or all of them."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
