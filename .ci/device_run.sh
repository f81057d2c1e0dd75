#!/usr/bin/env bash
# What runs on a lent GPU machine (nvidia-h100-x1 / nvidia-h200: torch
# 2.11+cu130, nvcc 13.0, Python 3.12, 16 cores, no network) runs there, one
# phase per device call (each call may run at most 600 s):
#
#   bash .ci/device_run.sh build      # CUDA build (sm_90a) + ptxas resource report
#   bash .ci/device_run.sh test       # CUDA tests: tests/test_cuda_backend.py + every [cuda] case
#   bash .ci/device_run.sh sanitize   # compute-sanitizer memcheck / racecheck / synccheck on a subset
#   bash .ci/device_run.sh bench      # python -m benchmarks.bench_cuda (BENCH_ARGS=--quick to shorten)
#   bash .ci/device_run.sh profile    # ncu counters of the kernels (benchmarks.profile_cuda), about 2 minutes
#   bash .ci/device_run.sh all        # the four in turn, within ALL_BUDGET (480) seconds
#
# Run from the repository root with $OUT set (the device tool sets it). At
# most 8 files per call come back, so the logs go into one archive,
# $OUT/logs.tar.gz, rewritten as each phase ends; the extension and the
# benchmark results are files of their own in $OUT.
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
LOGS=${LOGS:-/tmp/lowbit-device-logs}
mkdir -p "$OUT" "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a}
export MAX_JOBS=${MAX_JOBS:-16}
export LOWBIT_CUDA=1
# The portable CPU kernels only (the CUDA tests' reference): minutes less to build.
export LOWBIT_CPU_SIMD=${LOWBIT_CPU_SIMD:-0}
export HF_HUB_OFFLINE=1
# A compiler that finds no shared libstdc++ (the image's CXX, /opt/gcc, is one)
# links a private copy of it into the extension, whose iostreams then crash
# inside torch's process at the first error message: use one that links
# libstdc++.so.6 as torch does.
if [ ! -f "$(${CXX:-g++} -print-file-name=libstdc++.so)" ] && [ -x /usr/bin/g++ ]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
fi
# Seconds a phase's main command may take before it is stopped (the logs up
# to then are kept): under the tool's 600 s per call.
BUDGET=${BUDGET:-540}

log() { echo "[device_run $(date +%H:%M:%S)] $*" | tee -a "$LOGS/run.log"; }
pack_logs() { tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null; }

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
  local flags dir
  flags=$($PY -c 'from torch.utils.cpp_extension import include_paths, COMMON_NVCC_FLAGS as f
print(" ".join(f + ["-I" + p for p in include_paths()]))')
  flags="$flags -I$($PY -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  dir=$(mktemp -d)
  for src in csrc/cuda/*.cu; do
    # shellcheck disable=SC2086
    nvcc -std=c++20 -O3 --expt-relaxed-constexpr -lineinfo -DLOWBIT_WITH_CUDA=1 -D_GLIBCXX_USE_CXX11_ABI=1 \
      -gencode=arch=compute_90a,code=sm_90a -Xptxas -v $flags -Icsrc -c "$src" -o /dev/null \
      >"$dir/$(basename "$src").log" 2>&1 &
  done
  wait
  for src in csrc/cuda/*.cu; do
    echo "== $src"
    grep -E "Compiling entry|registers|spill|error" "$dir/$(basename "$src").log" | sed 's/ptxas info    : //'
  done
}

build() {
  log "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1)"
  log "nvcc: $(nvcc --version | tail -n 2 | tr '\n' ' ')"
  log "torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)'), CXX=${CXX:-g++}"
  log "building (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
  local t0=$SECONDS
  timeout -k 10 "$BUDGET" $PY setup.py build_ext --inplace >"$LOGS/build.log" 2>&1
  local rc=$?
  log "build exit status $rc after $((SECONDS - t0)) s (log: build.log)"
  tail -n 25 "$LOGS/build.log"
  [ $rc -eq 0 ] || return $rc
  readelf -d python/lowbit/_C*.so | grep -q 'libstdc++.so' || log "the extension does not link libstdc++.so.6"
  if ! has_cuda_build; then
    log "the build has no CUDA kernels registered (or import lowbit fails)"
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
  # One nvcc per source on the CPU cores, beside the later phases, which use the GPU.
  log "ptxas resource report in the background (ptxas.log)"
  export -f ptxas_report
  export PY
  (timeout -k 5 240 bash -c ptxas_report >"$LOGS/ptxas.log" 2>&1; pack_logs) &
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
  local t0=$SECONDS rc1 rc2 workers=""
  # pytest-xdist (in the image): a few workers share the GPU and the cores.
  $PY -c 'import xdist' 2>/dev/null && workers="-n ${PYTEST_WORKERS:-12}"
  log "pytest tests/test_cuda_backend.py $workers"
  # shellcheck disable=SC2086
  timeout -k 10 $((BUDGET * 2 / 3)) $PY -m pytest -q -rs $workers --durations=15 tests/test_cuda_backend.py \
    2>&1 | tee "$LOGS/test-cuda-backend.log" | tail -n 40
  rc1=${PIPESTATUS[0]}
  log "pytest -k cuda (the device-parametrized cases of the other test files)"
  # shellcheck disable=SC2086
  timeout -k 10 $((BUDGET - (SECONDS - t0))) $PY -m pytest -q -rs $workers -k cuda --ignore=tests/test_cuda_backend.py \
    $ignores tests 2>&1 | tee "$LOGS/test-device-params.log" | tail -n 30
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
      $PY -m pytest -q -x -p no:cacheprovider tests/test_cuda_backend.py -k "$sel" >"$LOGS/sanitize-$tool.log" 2>&1
    local rc=$?
    tail -n 15 "$LOGS/sanitize-$tool.log"
    log "$tool exit status $rc"
    [ $rc -eq 0 ] || status=1
    # racecheck and synccheck only look at shared memory and barriers: every
    # kernel using them (GPTQ, the decode ops' block reductions, the GGUF
    # dequantize, the int8 tensor-core tiles, mul_mat_id) runs, the GGUF ones
    # for three types of the 30.
    sel="sanitize_gptq or sanitize_decode or (sanitize_ggml and (Q4_K or Q8_0 or IQ4_XS))"
  done
  return $status
}

bench() {
  ensure_built
  log "python -m benchmarks.bench_cuda ${BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  timeout -k 10 "$BUDGET" $PY -m benchmarks.bench_cuda ${BENCH_ARGS:-} 2>&1 | tee "$LOGS/bench.log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  cp benchmarks/results/*-cuda.md benchmarks/results/*-cuda.json "$OUT/" 2>/dev/null
  log "bench exit status $rc"
  return $rc
}

# Nsight Compute on one call of each case of benchmarks/profile_cuda.py: the
# counters behind bench's misses. Not part of `all`: a second call, on the
# machine `all` left warm (or with the extension carried).
profile() {
  ensure_built
  command -v ncu >/dev/null || { log "ncu is not on the PATH"; return 1; }
  local t0=$SECONDS rc
  log "python -m benchmarks.profile_cuda kernels"
  timeout -k 10 120 $PY -m benchmarks.profile_cuda kernels "$LOGS/profile-kernels.json" >"$LOGS/profile-kernels.log" 2>&1
  rc=$?
  tail -n 20 "$LOGS/profile-kernels.log"
  [ $rc -eq 0 ] || { log "profile_cuda kernels exit status $rc"; return $rc; }
  log "ncu over python -m benchmarks.profile_cuda run ($((BUDGET - (SECONDS - t0) - 20)) s)"
  timeout -k 10 $((BUDGET - (SECONDS - t0) - 20)) ncu --profile-from-start off --clock-control none --csv --page raw \
    --log-file "$LOGS/ncu-raw.csv" --section SpeedOfLight --section Occupancy --section LaunchStats \
    --section WarpStateStats --section SchedulerStats --section InstructionStats \
    $PY -m benchmarks.profile_cuda run >"$LOGS/profile-run.log" 2>&1
  rc=$?
  tail -n 20 "$LOGS/profile-run.log"
  log "ncu exit status $rc"
  $PY -m benchmarks.profile_cuda summarize "$LOGS/ncu-raw.csv" "$LOGS/profile-kernels.json" | tail -n 40
  cp benchmarks/results/*-cuda-profile.md "$OUT/" 2>/dev/null
  pack_logs
  return $rc
}

# Every phase in one device call within ALL_BUDGET seconds (default 480: one
# call and a rerun fit a 15-minute lease). Each phase must end by its share of
# the budget, counted from the start, so time a phase leaves goes to the next;
# each phase's logs are in $OUT as soon as it ends, so a time-out loses only
# the phase it cut.
all_phases() {
  local total=${ALL_BUDGET:-480} status=0 phase rc start=$SECONDS
  for phase in "build 25" "run_tests 65" "sanitize 88" "bench 100"; do
    set -- $phase
    BUDGET=$((total * $2 / 100 - (SECONDS - start)))
    log "phase $1 (${BUDGET} s)"
    if [ "$BUDGET" -lt 30 ]; then
      rc=124
    else
      "$1"
      rc=$?
    fi
    log "phase $1 exit status $rc"
    echo "$1 $rc" >>"$LOGS/summary.txt"
    pack_logs
    [ $rc -eq 0 ] || status=1
    [ "$1" = build ] && [ $rc -ne 0 ] && break
  done
  # What a results file records: exit statuses, build time, test counts, sanitizer verdicts.
  grep -hE "exit status|build exit|passed|failed|error|SUMMARY" "$LOGS/run.log" "$LOGS"/test-*.log \
    "$LOGS"/sanitize-*.log 2>/dev/null | grep -vE "^E |Error\(|\.py:[0-9]+" >>"$LOGS/summary.txt"
  pack_logs
  cat "$LOGS/summary.txt"
  return $status
}

case "$PHASE" in
  build) build ;;
  test) run_tests ;;
  sanitize) sanitize ;;
  bench) bench ;;
  profile) profile ;;
  all) all_phases ;;
  *)
    echo "usage: bash .ci/device_run.sh build|test|sanitize|bench|profile|all" >&2
    exit 2
    ;;
esac
rc=$?
wait  # the background ptxas report, within its own time limit
pack_logs
exit $rc
