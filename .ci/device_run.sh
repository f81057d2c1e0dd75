#!/usr/bin/env bash
# What runs on a lent GPU machine (nvidia-h100-x1 / nvidia-h200: torch
# 2.11+cu130, nvcc 13.0, Python 3.12, 16 cores, no network) runs there, one
# phase per device call (each call may run at most 600 s):
#
#   bash .ci/device_run.sh build      # CUDA build (sm_90a) + ptxas resource report
#   bash .ci/device_run.sh test       # CUDA tests: tests/test_cuda_backend.py + every [cuda] case
#   bash .ci/device_run.sh sanitize   # compute-sanitizer memcheck / racecheck / synccheck on a subset
#   bash .ci/device_run.sh bench      # python -m benchmarks.bench_cuda (BENCH_ARGS=--quick to shorten)
#   bash .ci/device_run.sh all        # the four in turn, within ALL_BUDGET (480) seconds
#
# Run from the repository root with $OUT set (the device tool sets it); logs
# and results are copied into $OUT (at most 8 files per call come back).
#
# The machine goes back after 30 s idle, and a fresh one has no build. `build`
# therefore also copies the extension (python/lowbit/_C.*.so) into $OUT: copy
# it from the returned files into python/lowbit/ here and name that path in
# the next call's `carry`; every later phase rebuilds first only when
# `import lowbit` finds no CUDA kernels.
#
# Test dependencies: pytest, numpy, safetensors and transformers are in the
# machine's image; gguf is not (lowbit itself imports it only to name a type
# it does not support). Test modules that need gguf are not collected
# (listed in the log) unless gguf wheels are carried in .whl/, e.g. made here
# (with network) by:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp -d .whl gguf==0.19.0 pyyaml tqdm
# and carried with carry: [".whl", "python/lowbit/_C.cpython-312-x86_64-linux-gnu.so"].
set -uo pipefail
cd "$(dirname "$0")/.."

PHASE=${1:-}
OUT=${OUT:-/tmp/lowbit-device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
export LOWBIT_CUDA=1
# The portable CPU kernels only (the CUDA tests' reference): minutes less to build.
export LOWBIT_CPU_SIMD=${LOWBIT_CPU_SIMD:-0}
export HF_HUB_OFFLINE=1
# Seconds a phase's main command may take before it is stopped (the logs up
# to then are kept): under the tool's 600 s per call.
BUDGET=${BUDGET:-540}

log() { echo "[device_run $(date +%H:%M:%S)] $*"; }

if compgen -G ".whl/*.whl" >/dev/null; then
  log "installing carried wheels: $(ls .whl)"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

has_cuda_build() {
  $PY -c 'import sys, torch, lowbit
sys.exit(0 if torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm", "CUDA") else 1)' 2>/dev/null
}

# Register and shared-memory use of every kernel for sm_90a (ptxas -v), for
# the tuning notes: spills and stack frames show up here.
ptxas_report() {
  local inc
  inc=$($PY -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))')
  local py_inc
  py_inc=-I$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
  for src in csrc/cuda/*.cu; do
    echo "== $src"
    nvcc -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo -DLOWBIT_WITH_CUDA=1 -D_GLIBCXX_USE_CXX11_ABI=1 \
      -gencode=arch=compute_90a,code=sm_90a -Xptxas -v $inc $py_inc -Icsrc -c "$src" -o /dev/null 2>&1 |
      grep -E "Compiling entry|registers|spill|error" | sed 's/ptxas info    : //'
  done
}

build() {
  log "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  log "nvcc: $(nvcc --version | tail -n 2 | tr '\n' ' ')"
  log "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  log "building (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
  local t0=$SECONDS
  timeout -k 10 "$BUDGET" $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1
  local rc=$?
  log "build exit status $rc after $((SECONDS - t0)) s (log: build.log)"
  tail -n 25 "$OUT/build.log"
  [ $rc -eq 0 ] || return $rc
  if ! has_cuda_build; then
    log "the build has no CUDA kernels registered"
    return 1
  fi
  for so in python/lowbit/_C*.so; do
    local size
    size=$(stat -c %s "$so")
    if [ "$size" -gt $((15 * 1024 * 1024)) ]; then
      strip --strip-debug -o "$OUT/$(basename "$so")" "$so"
      log "copied $so to \$OUT stripped of debug info ($size bytes before)"
    else
      cp "$so" "$OUT/"
      log "copied $so to \$OUT ($size bytes)"
    fi
  done
  if [ $((SECONDS - t0)) -lt $((BUDGET - 180)) ]; then
    log "ptxas resource report (ptxas.log)"
    export -f ptxas_report
    export PY
    timeout -k 5 $((BUDGET - (SECONDS - t0) - 10)) bash -c ptxas_report >"$OUT/ptxas.log" 2>&1
    grep -B1 -E "[1-9][0-9]* bytes spill" "$OUT/ptxas.log" | head -n 20
  fi
}

ensure_built() {
  if has_cuda_build; then
    log "lowbit with CUDA kernels found ($(ls python/lowbit/_C*.so 2>/dev/null))"
  else
    log "no CUDA build of lowbit here: building first"
    build || exit 1
  fi
}

# Test modules that import gguf at import time (themselves or through the
# tests' gguf helpers) cannot even be collected without it.
pytest_ignores() {
  if ! $PY -c 'import gguf' 2>/dev/null; then
    grep -lE '^(import|from) (gguf|gguf_blocks|gguf_files|tiny_models)([ .]|$)' tests/*.py | sed 's/^/--ignore=/'
  fi
}

run_tests() {
  ensure_built
  local ignores
  ignores=$(pytest_ignores)
  [ -n "$ignores" ] && log "gguf is not installed: not collected: $(echo $ignores | sed 's/--ignore=//g')"
  local t0=$SECONDS rc1 rc2
  log "pytest tests/test_cuda_backend.py"
  timeout -k 10 $((BUDGET * 2 / 3)) $PY -m pytest -q -rs --durations=15 tests/test_cuda_backend.py \
    2>&1 | tee "$OUT/test-cuda-backend.log" | tail -n 40
  rc1=${PIPESTATUS[0]}
  log "pytest -k cuda (the device-parametrized cases of the other test files)"
  # shellcheck disable=SC2086
  timeout -k 10 $((BUDGET - (SECONDS - t0))) $PY -m pytest -q -rs -k cuda --ignore=tests/test_cuda_backend.py \
    $ignores tests 2>&1 | tee "$OUT/test-device-params.log" | tail -n 30
  rc2=${PIPESTATUS[0]}
  log "exit status: test_cuda_backend $rc1, [cuda] cases $rc2"
  [ $rc1 -eq 0 ] && { [ $rc2 -eq 0 ] || [ $rc2 -eq 5 ]; }
}

sanitize() {
  ensure_built
  # Without the caching allocator every tensor is its own allocation, so an
  # out-of-bounds access cannot land silently in a neighbour's memory.
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  local sel="sanitize" t0=$SECONDS status=0
  local -a tools=(memcheck racecheck synccheck)
  for tool in "${tools[@]}"; do
    local left=$((BUDGET - (SECONDS - t0)))
    if [ $left -lt 60 ]; then
      log "no time left for $tool"
      status=1
      continue
    fi
    local -a extra=()
    [ "$tool" = memcheck ] && extra=(--leak-check no)
    [ "$tool" = racecheck ] && extra=(--racecheck-report hazard)
    log "compute-sanitizer --tool $tool on tests/test_cuda_backend.py -k $sel (${left} s left)"
    timeout -k 10 $((left - 5)) compute-sanitizer --tool "$tool" "${extra[@]}" --error-exitcode 99 --print-limit 30 \
      $PY -m pytest -q -x -p no:cacheprovider tests/test_cuda_backend.py -k "$sel" >"$OUT/sanitize-$tool.log" 2>&1
    local rc=$?
    tail -n 15 "$OUT/sanitize-$tool.log"
    log "$tool exit status $rc"
    [ $rc -eq 0 ] || status=1
    # racecheck and synccheck only look at shared memory and barriers: every
    # kernel using them (GPTQ, the decode ops' block reductions, the GGUF
    # dequantize, mul_mat_id) runs, the GGUF ones for three types of the 30.
    sel="sanitize_gptq or sanitize_decode or (sanitize_ggml and (Q4_K or Q8_0 or IQ4_XS))"
  done
  return $status
}

bench() {
  ensure_built
  log "python -m benchmarks.bench_cuda ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  timeout -k 10 "$BUDGET" $PY -m benchmarks.bench_cuda ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  cp benchmarks/results/*-cuda.md benchmarks/results/*-cuda.json "$OUT/" 2>/dev/null
  log "bench exit status $rc"
  return $rc
}

# Every phase in one device call, each within its share of ALL_BUDGET seconds
# (default 480: one call and a rerun fit a 15-minute lease); each phase's logs
# are in $OUT as soon as it ends, so a time-out loses only the phase it cut.
all_phases() {
  local total=${ALL_BUDGET:-480} status=0 phase share rc
  for phase in "build 42" "run_tests 31" "sanitize 17" "bench 10"; do
    set -- $phase
    share=$((total * $2 / 100))
    BUDGET=$share
    log "phase $1 (${share} s)"
    "$1"
    rc=$?
    log "phase $1 exit status $rc"
    echo "$1 $rc" >>"$OUT/summary.txt"
    [ $rc -eq 0 ] || status=1
    [ "$1" = build ] && [ $rc -ne 0 ] && break
  done
  cat "$OUT/summary.txt"
  return $status
}

case "$PHASE" in
  build) build ;;
  test) run_tests ;;
  sanitize) sanitize ;;
  bench) bench ;;
  all) all_phases ;;
  *)
    echo "usage: bash .ci/device_run.sh build|test|sanitize|bench|all" >&2
    exit 2
    ;;
esac
