#!/usr/bin/env bash
# Build the benchmark-only venv benchmarks/.venv-llamacpp: llama.cpp through
# llama-cpp-python 0.3.36, compiled from source for THIS CPU (GGML_NATIVE=ON: its AVX2 /
# AVX-512 / AVX512-BF16 paths as the flags allow), next to lmtail for
# benchmarks/peers/llamacpp/bench.py. Never a dependency of lmtail. torch is installed first
# and pinned (the CPU build, 2.13.0) so lmtail (installed --no-deps -e) imports in the venv.
# The compile takes ~15 min on 2 cores (cmake + g++). Exits 0 with a "SKIP:" line when the
# package cannot be built here (bench.py then prints the same skip). The stamp
# benchmarks/.venv-llamacpp/.lmtail-ready is written once `import llama_cpp` works; the
# script exits at once while the stamp is newer than the script.
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/../venv.sh"
peer_venv llamacpp
"${pip[@]}" "torch==2.13.0" "numpy>=1.26,<2.5" "gguf>=0.10" tokenizers ml_dtypes
if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
    echo "SKIP: llama-cpp-python builds from source and needs cmake and g++"
    exit 0
fi
if ! CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${pip[@]}" --no-binary llama-cpp-python "llama-cpp-python==0.3.36"; then
    echo "SKIP: llama-cpp-python==0.3.36 could not be built here (see the pip output above)"
    exit 0
fi
"${pip[@]}" --no-deps -e "$root"
if ! "$venv/bin/python" -c "import llama_cpp, torch; print('benchmarks/.venv-llamacpp ready: llama_cpp', llama_cpp.__version__, 'torch', torch.__version__)"; then
    echo "SKIP: benchmarks/.venv-llamacpp was built but llama_cpp does not import (see above)"
    exit 0
fi
touch "$stamp"
