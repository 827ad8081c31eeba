#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp sources vendored in llama-cpp-python's sdist
# (the same llama.cpp the box runs), for the benchmarks only: never an install step.
# Usage: bench/build_llama_server.sh [DEST]   (default ~/.cache/residency/llama-server)
# Prints the binary's path. About 10 minutes on 2 cores; a second run reuses the build.
set -euo pipefail
DEST=${1:-$HOME/.cache/residency/llama-server}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
BIN="$DEST/build/bin/llama-server"
if [[ -x "$BIN" ]]; then echo "$BIN"; exit 0; fi
mkdir -p "$DEST"
PY=${PYTHON:-python3}
if [[ ! -d "$DEST/src" ]]; then
  "$PY" -m pip download --no-binary :all: --no-deps -d "$DEST/sdist" "llama_cpp_python==$VERSION" >&2
  mkdir -p "$DEST/src"
  tar -xzf "$DEST"/sdist/llama_cpp_python-*.tar.gz -C "$DEST/src" --strip-components=1
fi
# GGML_NATIVE=OFF: the native build takes llama.cpp's AMX path on these CPUs, which crashes on
# the first decode of a quantized model.
cmake -S "$DEST/src/vendor/llama.cpp" -B "$DEST/build" -DGGML_NATIVE=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release >&2
cmake --build "$DEST/build" --target llama-server -j "$(nproc)" >&2
echo "$BIN"
