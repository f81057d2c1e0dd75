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

#include "core/ggml_blocks.h"
#include "core/ggml_q8.h"

// Every GGUF type: decode and dequantize a block, and the 8-bit dot product.
template <lowbit::ggml::Type T>
__global__ void ggml_core_check(const uint8_t* blocks, const float* x, float* out) {
  using I = lowbit::ggml::TypeInfo<T>;
  lowbit::ggml::dequantize_block<T>(blocks + blockIdx.x * I::kBytes, out + blockIdx.x * I::kBlock);
  if constexpr (!I::kFloat) {
    using L = lowbit::ggml::ActLayout<I::kAct>;
    int8_t q[I::kBlock];
    float d[I::kBlock / L::kBlock], sum[I::kBlock / L::kSumBlock];
    for (int b = 0; b < I::kBlock / L::kBlock; ++b) {
      lowbit::ggml::quantize_act_block<I::kAct>(x + b * L::kBlock, q + b * L::kBlock, d + b,
                                                sum + b * (L::kBlock / L::kSumBlock));
    }
    lowbit::ggml::Decoded<T> blk;
    lowbit::ggml::Codec<T>::decode(blocks, blk);
    out[0] = lowbit::ggml::block_dot<T>(blk, lowbit::ggml::ActRow{q, d, sum}, 0);
  }
}

#define LOWBIT_GGML_INSTANTIATE(name, id, block, bytes, sub, has_min, act) \
  template __global__ void ggml_core_check<lowbit::ggml::Type::name>(const uint8_t*, const float*, float*);
LOWBIT_GGML_TYPES(LOWBIT_GGML_INSTANTIATE)

#include "core/rotary.h"

// The rotary embedding of one head of `dim` values.
__global__ void rotary_core_check(const float* x, const float* cos, const float* sin, float* out, int dim) {
  const int i = threadIdx.x, half = dim / 2;
  if (i < dim) out[i] = lowbit::rotary::rotated(x[i], x[i < half ? i + half : i - half], cos[i], sin[i], i < half);
}
