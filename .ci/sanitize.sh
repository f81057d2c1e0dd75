#!/usr/bin/env bash
# Builds lowbit with sanitizers in a scratch copy of the tree and runs the CPU
# op-level tests against it (make sanitize). SANITIZERS, the -fsanitize list,
# is AddressSanitizer by default: any out-of-bounds access in the C++ kernels
# aborts the run. SANITIZERS=address,undefined adds UndefinedBehaviorSanitizer,
# which doubles the build of the SIMD units (about 15 minutes on one core for
# ggml_avx2.cpp). torch.compile cases are left out: inductor's own generated C++
# would be loaded into the sanitized process too.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r csrc python tests setup.py pyproject.toml "$work/"
rm -f "$work"/python/lowbit/_C*.so
# Only the kernels this CPU runs: the AVX-512 units' sanitized build alone takes
# longer than the rest, and their tests skip on a CPU without AVX-512.
simd=1
if ! grep -qw avx512_vnni /proc/cpuinfo; then simd=avx2; fi
sanitizers=${SANITIZERS:-address}
(cd "$work" && LOWBIT_SANITIZE=$sanitizers LOWBIT_CUDA=0 LOWBIT_CPU_SIMD=$simd python3 setup.py -q build_ext --inplace >/dev/null)
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# libstdc++ beside the runtime from the start: python3 does not link it, and
# ASan's exception interceptor finds no __cxa_throw when it is loaded later.
preload="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so.6)"
case ",$sanitizers," in *,undefined,*) preload="$preload $(gcc -print-file-name=libubsan.so)" ;; esac
export LD_PRELOAD="$preload"
cd "$work"
# The op-level tests, the layers' and the C++ decode step's: every op, type,
# bit width, ISA and edge input reaches the kernels here. The tests of whole
# checkpoints and architectures run the same ops for many more minutes under
# ASan, and stay in the plain run.
PYTHONPATH="$work/python" python3 -m pytest -q -p no:cacheprovider -k "not compile and not cuda" \
  tests/test_cpu_kernels.py tests/test_gguf_ops.py tests/test_gguf_mul_mat_id.py tests/test_gguf_repack.py \
  tests/test_gguf_linear.py tests/test_gguf_fuzz.py tests/test_gptq_gemm.py tests/test_gptq_packing.py \
  tests/test_gptq_permute.py tests/test_gptq_validation.py tests/test_gptq_linear.py tests/test_validation_matrix.py \
  tests/test_edge_inputs.py tests/test_op_contracts.py tests/test_concurrency.py tests/test_autograd.py \
  tests/test_gptq_gemm_a8.py tests/test_decode_ops.py tests/test_decoding.py tests/test_gguf_quantize.py "$@"
