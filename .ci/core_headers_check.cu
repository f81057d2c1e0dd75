// CI-only translation unit: instantiates every torch-free core helper in
// device code, so nvcc proves the CPU and CUDA backends can share them.
#include <stdint.h>

#include "core/gptq_format.h"

template <int B>
__global__ void gptq_core_check(const uint32_t* in, uint32_t* out, float* w, int64_t n) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= n || !lowbit::gptq::is_supported_bits(B)) return;
  const uint32_t q = lowbit::gptq::unpack_field<B>(in, 1, i);
  lowbit::gptq::deposit_field<B>(out, 1, i, q);
  w[i] = lowbit::gptq::dequant(q, lowbit::gptq::zero_point(q, false), 0.5f);
}

template __global__ void gptq_core_check<2>(const uint32_t*, uint32_t*, float*, int64_t);
template __global__ void gptq_core_check<3>(const uint32_t*, uint32_t*, float*, int64_t);
template __global__ void gptq_core_check<4>(const uint32_t*, uint32_t*, float*, int64_t);
template __global__ void gptq_core_check<8>(const uint32_t*, uint32_t*, float*, int64_t);
