// Plumbing shared by lowbit's CUDA kernels: the current stream and device
// guard, launch checks, the float formats kernels read and write, and the
// device's multiprocessor count.
//
// Only c10/cuda headers are used (not ATen/cuda/CUDAContext.h): they are all
// the kernels need, and unlike CUDAContext.h they do not pull in cuBLAS,
// cuSPARSE and cuSOLVER headers, so the sources also compile-check against a
// CPU-only torch and a bare CUDA toolkit (.ci/cuda_compile_check.sh). Dense
// products go through at::mm, which dispatches to cuBLAS itself.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace lowbit {
namespace cuda {

// The stream every lowbit kernel is launched on: torch's current stream of
// the current device (set by the caller's CUDAGuard), as at::cuda does.
inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of a 1-D launch over `n` items, capped (kernels loop grid-stride);
// the cap keeps the grid within its x limit and avoids tiny blocks' overhead.
inline unsigned int grid_for(int64_t n, int threads, int64_t max_blocks = 65535) {
  const int64_t blocks = ceil_div(n, threads);
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks));
}

// A device attribute (never 0 for those read here), read once per device:
// cudaDeviceGetAttribute is no stream operation, so this is safe during
// CUDA-graph capture too.
template <cudaDeviceAttr Attr>
inline int device_attribute(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  std::atomic<int>& slot = cache[static_cast<size_t>(device)];
  int value = slot.load(std::memory_order_relaxed);
  if (value == 0) {
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, Attr, device));
    slot.store(value, std::memory_order_relaxed);
  }
  return value;
}

inline int sm_count(c10::DeviceIndex device) { return device_attribute<cudaDevAttrMultiProcessorCount>(device); }
inline int compute_major(c10::DeviceIndex device) {
  return device_attribute<cudaDevAttrComputeCapabilityMajor>(device);
}

// A crossover constant a benchmark overrides to time either path at any M:
// the environment variable `name` (read once per process) when set, else
// `fallback`. A value that is not a whole non-negative number raises rather
// than reading as 0, which would silently pick one path for every M.
template <const char* name>
inline int64_t crossover(int64_t fallback) {
  static const int64_t forced = [] {
    const char* s = std::getenv(name);
    if (!s || !*s) return int64_t{-1};
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s, &end, 10);
    TORCH_CHECK_VALUE(*end == '\0' && errno == 0 && v >= 0, name, " must be a whole number >= 0, got '",
                      std::string(s).substr(0, 40), "'");
    return static_cast<int64_t>(v);
  }();
  return forced >= 0 ? forced : fallback;
}

// The float formats of activations, scales and outputs. Kernels take them as
// a run-time tag instead of a template parameter: the branch is uniform
// across a warp and outside the inner loops, and it keeps the number of
// instantiations (and the build time) down.
enum class Float : int { F32 = 0, F16 = 1, BF16 = 2 };

inline Float float_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return Float::F32;
    case at::kHalf: return Float::F16;
    case at::kBFloat16: return Float::BF16;
    default: break;
  }
  TORCH_CHECK(false, "lowbit: no CUDA float format for ", t);
}

// Element i of a float32 / float16 / bfloat16 array, exactly, as fp32.
__device__ __forceinline__ float load_float(const void* p, Float kind, int64_t i) {
  switch (kind) {
    case Float::F16: return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
    case Float::BF16: return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Stores v rounded once (to nearest even) to the array's format, as a CPU
// .to(dtype) of the fp32 value does.
__device__ __forceinline__ void store_float(void* p, Float kind, int64_t i, float v) {
  switch (kind) {
    case Float::F16: static_cast<c10::Half*>(p)[i] = c10::Half(v); break;
    case Float::BF16: static_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(v); break;
    default: static_cast<float*>(p)[i] = v; break;
  }
}

// The output element type of a templated store (dequantize kernels write
// float, at::Half or at::BFloat16 directly).
template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return static_cast<T>(v);
}

}  // namespace cuda
}  // namespace lowbit
