#!/usr/bin/env bash
# The GPU benchmark, in one call of the device tool on a lent `nvidia-h200` (one H200, 16 cores,
# no network). First, HERE, in the repository root that the tool sends (the session's checkout):
#
#   bench/gpu_prepare.sh          # fills .gpu/ (~21 MiB: llama.cpp's sources, llama_cpp, wheels)
#
# then one device call (the whole script stays inside 570 s, so it returns before the limit):
#
#   run  command:   bash bench/gpu.sh
#        carry:     [".gpu"]
#        timeout_s: 600
#
# What comes back under $OUT: gpu.log (every step, timed), steps.txt (seconds per step),
# build.log, load.txt and load.md (bench/load.py's table and markdown section), smi.csv (GPU
# memory and utilization every second). Call give_back afterwards unless you rerun at once: a
# rerun on the still-warm machine reuses the build (in $GPU_WORK) and skips to the benchmark.
#
# Steps: install the carried wheels (--target, the image's python3); build llama.cpp 0.3.36's
# vendored sources with CUDA for sm_90 only (llama-server and the shared libraries llama-cpp-python
# loads: llama, ggml, mtmd); write a random-weight GGUF in Llama 3.2 1B's shape (1.24B
# parameters, f16, residency/tinymodel.py); then bench/load.py: the box (`residency up`, its
# device found by nvidia-smi: cuda:0, n_gpu_layers -1 = all) against llama-server -ngl 99 with
# the same slots and context, at 1, 8, 32 and 64 clients.
#
# The build, with the flags below, compiled and linked on a CPU machine (CUDA 13.0's nvcc, cuBLAS
# from its wheel, a stub libcuda): 2,160 CPU-seconds in all, the longest single file 33 s (an
# MMQ instance), so about 2.5 to 4 minutes on 16 cores (an estimate; gpu.log will say).
#
# FlashAttention is off on both sides (load.py --flash-attn off: the box's flash_attn and
# llama-server's -fa), so the FA kernels are not built (GGML_CUDA_FA=OFF, which shortens the
# build by minutes); both default to llama.cpp's auto otherwise.
#
# GPU=0 is the dry run for a machine without one: no build, the CPU llama-server and libraries
# of bench/build_llama_server.sh, a small model, one client; everything else as on the GPU.
# Env (defaults): GPU (1), PYTHON (python3), PREP (.gpu), GPU_WORK (/tmp/residency-gpu),
# BUDGET_S (570), CLIENTS (1,8,32,64), SLOTS (32), TOKENS (64), REQUESTS (4), ROUNDS (1),
# MODEL_ARGS (the 1B shape), SERVER_ARGS (-ngl 99), CPU_BUILD (GPU=0's llama.cpp build
# dir), CONFIGURE_ONLY (1: stop after cmake's configure step, to check the flags where nvcc is).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
GPU=${GPU:-1}
PY=${PYTHON:-python3}
PREP=${PREP:-.gpu}
WORK=${GPU_WORK:-/tmp/residency-gpu}
OUT=${OUT:-$WORK/out}
BUDGET_S=${BUDGET_S:-570}
START=$(date +%s)
DEADLINE=$((START + BUDGET_S))
mkdir -p "$OUT" "$WORK"
LOG=$OUT/gpu.log
STEPS=$OUT/steps.txt
: >"$STEPS"
exec > >(tee -a "$LOG") 2>&1

if [[ "$GPU" == 1 ]]; then
  CLIENTS=${CLIENTS:-1,8,32,64}
  SLOTS=${SLOTS:-32}
  MODEL_ARGS=${MODEL_ARGS:---n-layer 16 --n-embd 2048 --n-head 32 --n-head-kv 8 --n-ff 8192 --n-vocab 128256}
  SERVER_ARGS=${SERVER_ARGS:--ngl 99}
else
  CLIENTS=${CLIENTS:-1}
  SLOTS=${SLOTS:-1}
  MODEL_ARGS=${MODEL_ARGS:---n-layer 2 --n-embd 256 --n-head 4 --n-head-kv 2 --n-ff 512 --n-vocab 4096}
  SERVER_ARGS=${SERVER_ARGS:-}
fi
TOKENS=${TOKENS:-64}
REQUESTS=${REQUESTS:-4}
ROUNDS=${ROUNDS:-1}

left() { echo $((DEADLINE - $(date +%s))); }
stamp() { echo "== $(date -u +%H:%M:%S) (+$(($(date +%s) - START)) s, $(left) s left) $*"; }
# step NAME CMD...: runs CMD, logs its start, end and seconds; returns its status.
step() {
  local name=$1 t0 rc
  shift
  stamp "start: $name"
  t0=$(date +%s)
  "$@"
  rc=$?
  echo "$name $(($(date +%s) - t0)) s rc=$rc" >>"$STEPS"
  stamp "end: $name (rc=$rc, $(($(date +%s) - t0)) s)"
  return $rc
}
finish() {
  stamp "done"
  echo "--- seconds per step:"
  cat "$STEPS"
  sleep 1 # let tee write the last lines into gpu.log
  exit "$1"
}

facts() {
  uname -a
  nproc
  "$PY" --version
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
    --format=csv,noheader
  command -v nvcc >/dev/null && nvcc --version | tail -2
  command -v cmake >/dev/null && cmake --version | head -1
  du -sh "$PREP" 2>/dev/null
  return 0
}

SITE=$WORK/site
deps() {
  rm -rf "$SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$PREP"/whl/*.whl
}

SRC=$WORK/llama.cpp
BUILD=$WORK/build
SHIM=$WORK/cuda-shim
FIND_CUBLAS='
import glob, os, sys
for p in sys.path:
    for d in ("nvidia/cu13", "nvidia/cublas"):
        if glob.glob(os.path.join(p, d, "lib", "libcublas.so.*")):
            print(os.path.join(p, d))
            raise SystemExit
'
# The libraries ggml-cuda links that a toolkit assembled from wheels may lack, found elsewhere
# and given the unversioned names CMake looks for in the folder $SHIM; prints the cmake options
# (none where the toolkit has them). cuBLAS: PyTorch's wheel (CUDA 13: nvidia/cu13/{lib,include};
# 12: nvidia/cublas/...). libcuda: the toolkit's stub, else the driver's own library.
cuda_args() {
  local nvcc=$1 home d dir so name args=()
  home=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  local libs=("$home/lib64" "$home/lib" "$home/targets/x86_64-linux/lib")
  rm -rf "$SHIM" && mkdir -p "$SHIM"
  if ! for d in "${libs[@]}"; do [[ -e "$d/libcublas.so" ]] && break; done; then
    dir=${CUBLAS_DIR:-$("$PY" -c "$FIND_CUBLAS")}
    if [[ -z "$dir" ]]; then
      echo "no cuBLAS: not in the toolkit ($home) nor in a Python wheel" >&2
      return 1
    fi
    for so in "$dir"/lib/libcublas.so.* "$dir"/lib/libcublasLt.so.*; do
      name=$(basename "$so")
      ln -sf "$so" "$SHIM/$name"
      ln -sf "$so" "$SHIM/${name%%.so.*}.so"
    done
    args+=("-DCUDA_cublas_LIBRARY=$SHIM/libcublas.so" "-DCUDA_cublasLt_LIBRARY=$SHIM/libcublasLt.so")
    args+=("-DCMAKE_CUDA_FLAGS=-I$dir/include" "-DCMAKE_CXX_FLAGS=-I$dir/include")
  fi
  if ! for d in "${libs[@]}"; do [[ -e "$d/stubs/libcuda.so" || -e "$d/libcuda.so" ]] && break; done; then
    so=${CUDA_DRIVER_LIB:-}
    if [[ -z "$so" ]]; then
      so=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so\.1 .*x86-64/ {print $NF; exit}')
      for d in /usr/local/nvidia/lib64 /usr/local/nvidia/lib /usr/lib/x86_64-linux-gnu /usr/lib64; do
        [[ -z "$so" && -e "$d/libcuda.so.1" ]] && so=$d/libcuda.so.1
      done
    fi
    if [[ -z "$so" ]]; then
      echo "no libcuda: not in the toolkit ($home) nor the driver's folders" >&2
      return 1
    fi
    # libcuda.so.1 too: the name the linker looks for (in the RUNPATH) when it links llama-server.
    ln -sf "$so" "$SHIM/libcuda.so"
    ln -sf "$so" "$SHIM/libcuda.so.1"
    args+=("-DCUDA_cuda_driver_LIBRARY=$SHIM/libcuda.so")
  fi
  echo "${args[*]}"
}

build() {
  if [[ -x "$BUILD/bin/llama-server" && -e "$BUILD/bin/libllama.so" \
    && -e "$BUILD/bin/libggml-cuda.so" ]]; then
    echo "reusing the build in $BUILD (a warm machine)"
    return 0
  fi
  if [[ ! -d "$SRC" ]]; then
    tar -xzf "$PREP/llama.cpp.tar.gz" -C "$WORK" || return 1
  fi
  local gen=() nvcc extra
  command -v ninja >/dev/null && gen=(-G Ninja)
  nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  extra=$(cuda_args "$nvcc") || return 1
  echo "CUDA libraries: ${extra:-all from the toolkit}"
  # sm_90 only; FA kernels off (see the top); NCCL off (one GPU); no fatbin compression (a
  # faster build); tests, examples and the unified app are not built.
  cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CUDA_COMPILER="$nvcc" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=ON -DGGML_CUDA_FA=OFF -DGGML_CUDA_FA_ALL_QUANTS=OFF \
    -DGGML_CUDA_NCCL=OFF -DGGML_CUDA_COMPRESSION_MODE=none -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF $extra \
    >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; return 1; }
  if [[ "${CONFIGURE_ONLY:-0}" == 1 ]]; then
    grep -E "CUDA|Using" "$OUT/build.log" | head -20
    return 0
  fi
  # The build may take what is left but 150 s (the model and the benchmark's shortest run).
  local t=$(($(left) - 150))
  ((t > 60)) || { echo "no time left to build"; return 1; }
  timeout "$t" cmake --build "$BUILD" --target llama-server llama ggml mtmd \
    -j 16 >>"$OUT/build.log" 2>&1
  local rc=$?
  tail -5 "$OUT/build.log"
  return $rc
}

MODEL=$WORK/bench-1b.gguf
model() {
  if [[ -e "$MODEL" && "$(cat "$MODEL.args" 2>/dev/null)" == "$MODEL_ARGS" ]]; then
    echo "reusing $MODEL (a warm machine)"
    return 0
  fi
  # shellcheck disable=SC2086  # MODEL_ARGS is a list of options
  "$PY" -m residency.cli tiny-model "$MODEL" --dtype f16 --seed 0 $MODEL_ARGS || return 1
  echo "$MODEL_ARGS" >"$MODEL.args"
  ls -l "$MODEL"
}

check() {
  GPU=$GPU "$PY" - <<'EOF'
import llama_cpp, os
print("llama_cpp", llama_cpp.__version__, "from", os.path.dirname(llama_cpp.__file__))
print("libraries", os.environ["LLAMA_CPP_LIB_PATH"])
offload = bool(llama_cpp.llama_supports_gpu_offload())
print("gpu offload", offload)
if os.environ["GPU"] == "1" and not offload:
    raise SystemExit("these libraries cannot offload to a GPU: the box would run on the CPU")
try:
    import pynvml
    pynvml.nvmlInit()
    print("NVML", pynvml.nvmlDeviceGetCount(), "GPU(s)")
except Exception as e:  # noqa: BLE001 - only a fact for the log
    print("NVML:", type(e).__name__, e)
EOF
}

bench() {
  local smi="" t=$(($(left) - 15))
  ((t > 30)) || { echo "no time left for the benchmark"; return 1; }
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,memory.used,utilization.gpu,power.draw \
      --format=csv -l 1 >"$OUT/smi.csv" 2>&1 &
    smi=$!
  fi
  # SIGINT first: load.py then stops every server it started.
  PYTHONUNBUFFERED=1 timeout -s INT -k 15 "$t" "$PY" bench/load.py \
    --model "$MODEL" --llama-server "$SERVER" --server-args "$SERVER_ARGS" --flash-attn off \
    --clients "$CLIENTS" --slots "$SLOTS" --tokens "$TOKENS" --requests "$REQUESTS" \
    --rounds "$ROUNDS" --single-max-clients 8 --out "$OUT/load.md" 2>&1 | tee "$OUT/load.txt"
  local rc=${PIPESTATUS[0]}
  [[ -n "$smi" ]] && kill "$smi" 2>/dev/null
  return "$rc"
}

stamp "bench/gpu.sh GPU=$GPU, budget ${BUDGET_S} s, out $OUT"
step facts facts
[[ -d "$PREP/whl" && -d "$PREP/py/llama_cpp" ]] || {
  echo "no $PREP/whl or $PREP/py: run bench/gpu_prepare.sh here and carry $PREP"
  finish 2
}
step deps deps || finish 1
export PYTHONPATH=$SITE:$ROOT/$PREP/py:$ROOT${PYTHONPATH:+:$PYTHONPATH}
if [[ "${CONFIGURE_ONLY:-0}" == 1 ]]; then
  step build build
  finish $?
fi
# The model is written (one core, numpy) while the build runs on the others.
step model model &
model_pid=$!
if [[ "$GPU" == 1 ]]; then
  step build build || { wait "$model_pid"; finish 1; }
  LIBDIR=$BUILD/bin
else
  LIBDIR=${CPU_BUILD:-$HOME/.cache/residency/llama-server/build}/bin
fi
wait "$model_pid" || finish 1
SERVER=$LIBDIR/llama-server
export LLAMA_CPP_LIB_PATH=$LIBDIR MTMD_CPP_LIB=$LIBDIR
# For the loader: the shim's libcublas.so.13 names (cuBLAS from a wheel; the build's RUNPATH
# names the shim too), and the toolkit's libcudart.so.13, which the RUNPATH does not name and
# ldconfig may not know.
if [[ "$GPU" == 1 ]]; then
  cuda_home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")")
  for d in "$cuda_home/targets/x86_64-linux/lib" "$cuda_home/lib" "$cuda_home/lib64" "$SHIM"; do
    [[ -d "$d" ]] && LD_LIBRARY_PATH=$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
  export LD_LIBRARY_PATH
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi
step check check || finish 1
# A slow build leaves less than a full run needs: the smaller client counts alone, then.
if (($(left) < ${FULL_RUN_S:-240})) && [[ "$CLIENTS" != 1 ]]; then
  echo "only $(left) s left: clients 1,8 instead of $CLIENTS"
  CLIENTS=1,8
fi
step bench bench
finish $?
