#!/usr/bin/env bash
# Install residency into ./.venv with the extras given as arguments (e.g. "demo", "test").
#
# llama-cpp-python is built with CMAKE_ARGS="-DGGML_NATIVE=OFF": the default native build picks
# llama.cpp's AMX path on AMX CPUs and segfaults on the first decode of a quantized model. pip's
# wheel cache ignores CMAKE_ARGS, so the build runs with --no-cache-dir and the wheel it makes is
# kept in a cache folder named after those flags (reused by later installs on this machine).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_VERSION=0.3.36
# Override for a GPU build, e.g. LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CUDA=on".
LLAMA_CMAKE_ARGS=${LLAMA_CMAKE_ARGS:-"-DGGML_NATIVE=OFF"}
PY=${PYTHON:-python3}
VENV=${RESIDENCY_VENV:-.venv}
flags=$(printf '%s' "$LLAMA_CMAKE_ARGS" | tr -c 'A-Za-z0-9=_-' '_')
WHEELS="${XDG_CACHE_HOME:-$HOME/.cache}/residency/wheels/llama-cpp-python-${LLAMA_VERSION}${flags}"

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "residency needs Python 3.11+")'
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip >/dev/null

if ! "$VENV/bin/python" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$LLAMA_VERSION')" 2>/dev/null; then
  if ! ls "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $LLAMA_VERSION with $LLAMA_CMAKE_ARGS (a few minutes, once)..." >&2
    mkdir -p "$WHEELS"
    CMAKE_ARGS="$LLAMA_CMAKE_ARGS" "${PIP[@]}" wheel --no-cache-dir --no-deps \
      "llama-cpp-python==$LLAMA_VERSION" -w "$WHEELS"
  fi
  "${PIP[@]}" install "$WHEELS"/llama_cpp_python-"$LLAMA_VERSION"-*.whl
fi

extras=$(IFS=,; echo "$*")
# RESIDENCY_EDITABLE=0 installs a copy (deploy/Dockerfile: the image carries the venv only).
if [ "${RESIDENCY_EDITABLE:-1}" = 0 ]; then
  "${PIP[@]}" install --no-cache-dir ".${extras:+[$extras]}"
else
  "${PIP[@]}" install -e ".${extras:+[$extras]}"
fi
