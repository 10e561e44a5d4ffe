"""`lmtail serve`: an OpenAI-compatible HTTP server with continuous batching whose every
response is byte-equal (token ids, text, logprob bits) to the same request served alone.

    protocol  request validation (OpenAI error shape) and token / logprob formatting
    batch     one decode step of the declared body for rows with their own KV caches
    engine    the engine thread: prefill alone, join the batch, one tail per step, leave
    app       the Starlette app (chat / completions, SSE streaming, models, health)
    cli       `lmtail serve` options and the uvicorn runner

See docs/serve.md.
"""
