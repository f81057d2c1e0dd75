// CUDA ggml_dequantize for every type of core/ggml_types.h's table, through
// the shared codecs (core/ggml_blocks.h), so every value is bit-identical to
// the CPU's (the codecs round each operation once: mul_rn / add_rn).
//
// Quantized types: a warp takes 32 consecutive blocks; each lane decodes one
// block with Codec<T>::decode into shared memory, then the warp writes the
// 32 blocks' values together, consecutive lanes to consecutive elements
// (coalesced stores; a lane writing its own block would stride by a block).
// Float types (F32/F16/BF16, one element per "block"): one thread per element.
#include "../core/ggml_blocks.h"
#include "../ops/dispatch.h"
#include "../ops/ggml_checks.h"
#include "common.cuh"
#include "ggml_cuda.cuh"
#include "../ops/backend_ops.h"

namespace lowbit {
namespace cuda {
namespace {

using ggml::TypeInfo;

constexpr int kFloatThreads = 256;

// Warps per block: as many as keep the decoded blocks within 24 KB of
// shared memory (Decoded<T> is 40 bytes for the 32-element types, up to
// 384 for Q2_K), at most 8.
template <ggml::Type T>
constexpr int warps_for() {
  constexpr int fit = 24576 / (32 * static_cast<int>(sizeof(ggml::Decoded<T>)));
  return fit < 1 ? 1 : (fit > 8 ? 8 : fit);
}

template <ggml::Type T, typename OutT>
__global__ void __launch_bounds__(32 * warps_for<T>()) ggml_dequantize_kernel(const uint8_t* W, int64_t nblocks,
                                                                              OutT* out) {
  using I = TypeInfo<T>;
  constexpr int kWarps = warps_for<T>();
  __shared__ ggml::Decoded<T> dec[kWarps][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t groups = (nblocks + 31) / 32;
  for (int64_t grp = static_cast<int64_t>(blockIdx.x) * kWarps + warp; grp < groups;
       grp += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int64_t first = grp * 32;
    const int count = static_cast<int>(nblocks - first < 32 ? nblocks - first : 32);
    if (lane < count) ggml::Codec<T>::decode(W + (first + lane) * I::kBytes, dec[warp][lane]);
    __syncwarp();
    OutT* dst = out + first * I::kBlock;
    for (int e = lane; e < count * I::kBlock; e += 32) {
      dst[e] = from_float<OutT>(ggml::weight<T>(dec[warp][e / I::kBlock], e % I::kBlock));
    }
    __syncwarp();  // the next group's decode overwrites dec[warp]
  }
}

template <ggml::Type T, typename OutT>
__global__ void __launch_bounds__(kFloatThreads) ggml_dequantize_float_kernel(const uint8_t* W, int64_t count,
                                                                              OutT* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float v;
    ggml::dequantize_block<T>(W + i * TypeInfo<T>::kBytes, &v);
    out[i] = from_float<OutT>(v);
  }
}

template <ggml::Type T, typename OutT>
void launch_typed(const uint8_t* W, int64_t nblocks, OutT* out) {
  if constexpr (TypeInfo<T>::kFloat) {
    ggml_dequantize_float_kernel<T, OutT>
        <<<grid_for(nblocks, kFloatThreads), kFloatThreads, 0, current_stream()>>>(W, nblocks, out);
  } else {
    constexpr int kWarps = warps_for<T>();
    const unsigned int blocks = grid_for(ceil_div(nblocks, 32), kWarps);
    ggml_dequantize_kernel<T, OutT><<<blocks, 32 * kWarps, 0, current_stream()>>>(W, nblocks, out);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename OutT>
void launch_out(const uint8_t* W, int64_t type, int64_t nblocks, OutT* out) {
  dispatch_ggml_type(type, [&](auto t) { launch_typed<decltype(t)::value, OutT>(W, nblocks, out); });
}

}  // namespace

void launch_ggml_dequantize(const uint8_t* W, int64_t type, int64_t rows, int64_t n, at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.numel() == rows * n);
  if (out.numel() == 0) return;
  // Rows are whole blocks, so the matrix is one run of rows * n / block blocks.
  const int64_t nblocks = rows * (n / ggml::runtime_info(type).block);
  switch (out.scalar_type()) {
    case at::kFloat: launch_out(W, type, nblocks, out.data_ptr<float>()); break;
    case at::kHalf: launch_out(W, type, nblocks, out.data_ptr<at::Half>()); break;
    case at::kBFloat16: launch_out(W, type, nblocks, out.data_ptr<at::BFloat16>()); break;
    default: TORCH_INTERNAL_ASSERT(false, "ggml dequantize: unsupported output dtype ", out.scalar_type());
  }
}

at::Tensor ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype) {
  const auto checked = check_ggml_dequantize(W, type, m, n, dtype);
  const c10::cuda::CUDAGuard guard(W.device());
  at::Tensor out = at::empty({m, n}, W.options().dtype(checked.second));
  launch_ggml_dequantize(W.data_ptr<uint8_t>(), type, m, n, out);
  return out;
}

}  // namespace cuda
}  // namespace lowbit
