#!/usr/bin/env bash
# Compiles every .cu under csrc/ (and the torch-free core headers, as device
# code) with nvcc for sm_75, sm_80 and sm_90a. Compile only: no GPU is needed,
# and a compile error fails the script. sm_75 stands for the architectures
# before sm_80 a build may target (TORCH_CUDA_ARCH_LIST, or a visible T4):
# the sm_80 instructions (cp.async, mma.sync) must stay behind __CUDA_ARCH__
# guards for them.
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
TORCH_INC=$(python3 -c 'from torch.utils.cpp_extension import include_paths; print(" ".join("-I" + p for p in include_paths()))')
PY_INC=-I$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
ARCHS=(-gencode=arch=compute_75,code=sm_75 -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_90a,code=sm_90a)
# torch's own extension flags (COMMON_NVCC_FLAGS: no implicit half/bf16
# operators or conversions), as setup.py's build gets them; -O1 keeps the
# check quick.
TORCH_NVCC=$(python3 -c 'from torch.utils.cpp_extension import COMMON_NVCC_FLAGS; print(" ".join(COMMON_NVCC_FLAGS))')
FLAGS=(-std=c++20 -O1 $TORCH_NVCC -DLOWBIT_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C -D_GLIBCXX_USE_CXX11_ABI=1)
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# A CPU-only torch ships the c10/cuda headers the kernels use but not the one
# header CMake generates for CUDA builds, c10/cuda/impl/cuda_cmake_macros.h
# (it only defines C10_CUDA_BUILD_SHARED_LIBS, which matters for Windows DLL
# exports). Supply that one-line header when it is missing, so every source
# compiles against the same torch headers a CUDA build uses.
STUB_INC=()
if ! python3 -c 'import os, sys; from torch.utils.cpp_extension import include_paths; sys.exit(not any(os.path.exists(os.path.join(p, "c10/cuda/impl/cuda_cmake_macros.h")) for p in include_paths()))'; then
  mkdir -p "$out/include/c10/cuda/impl"
  printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' >"$out/include/c10/cuda/impl/cuda_cmake_macros.h"
  STUB_INC=(-I"$out/include")
fi

mapfile -t sources < <(find csrc -name '*.cu' | sort)
sources+=(.ci/core_headers_check.cu)
for src in "${sources[@]}"; do
  echo "nvcc: $src (sm_75, sm_80, sm_90a)"
  "$NVCC" "${FLAGS[@]}" "${ARCHS[@]}" $TORCH_INC "${STUB_INC[@]}" $PY_INC -Icsrc -c "$src" -o "$out/$(basename "$src").o"
done
echo "cuda compile check: ${#sources[@]} file(s) compiled"
