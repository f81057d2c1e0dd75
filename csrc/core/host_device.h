// Marks functions that the CPU build (plain C++) and the CUDA build (nvcc) share.
// Everything under csrc/core/ is torch-free and header-only so that both backends
// compile the very same definition of every format.
#pragma once

#if defined(__CUDACC__)
#define LOWBIT_HD __host__ __device__ __forceinline__
#else
#define LOWBIT_HD inline
#endif

// The device's code paths of the shared helpers (word loads, __dp4a, ...):
// compiled for the GPU, and as host code for the CPU emulator of the CUDA
// execution model (tests/simt), which defines LOWBIT_SIMT_HOST and the CUDA
// built-ins they call. The CPU build takes the other paths.
#if defined(__CUDA_ARCH__) || defined(LOWBIT_SIMT_HOST)
#define LOWBIT_DEVICE_PATH 1
#else
#define LOWBIT_DEVICE_PATH 0
#endif

// Unrolls the loop that follows (a pack's fields, at compile-time shifts).
#if defined(__CUDACC__)
#define LOWBIT_UNROLL _Pragma("unroll")
#elif defined(__GNUC__) && !defined(__clang__)
#define LOWBIT_UNROLL _Pragma("GCC unroll 32")
#else
#define LOWBIT_UNROLL
#endif

// A constant lookup table readable from host and device code. Under nvcc the
// data is emitted twice, in host memory and in device global memory, and
// LOWBIT_TABLE(name) picks the copy of the side being compiled.
#if defined(__CUDACC__)
#define LOWBIT_DEFINE_TABLE(type, name, size, ...)                 \
  static constexpr type name##_host[size] = __VA_ARGS__;           \
  static __device__ const type name##_device[size] = __VA_ARGS__;
#if defined(__CUDA_ARCH__)
#define LOWBIT_TABLE(name) name##_device
#else
#define LOWBIT_TABLE(name) name##_host
#endif
#else
#define LOWBIT_DEFINE_TABLE(type, name, size, ...) static constexpr type name##_host[size] = __VA_ARGS__;
#define LOWBIT_TABLE(name) name##_host
#endif
