// Marks functions that the CPU build (plain C++) and the CUDA build (nvcc) share.
// Everything under csrc/core/ is torch-free and header-only so that both backends
// compile the very same definition of every format.
#pragma once

#if defined(__CUDACC__)
#define LOWBIT_HD __host__ __device__ __forceinline__
#else
#define LOWBIT_HD inline
#endif
