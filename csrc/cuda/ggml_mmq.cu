// Launches of the int8 tensor-core tiles (ggml_mmq_kernel.cuh) for
// ggml_mul_mat_a8 and ggml_mul_mat_id, which decide where they serve
// (ggml_matmul.cu). A translation unit of their own: the tiles of 25 types
// compile beside the matvec kernels rather than after them.
#include <algorithm>
#include <limits>

#include "../ops/dispatch.h"
#include "common.cuh"
#include "ggml_cuda.cuh"
#include "ggml_mmq_kernel.cuh"

namespace lowbit {
namespace cuda {
namespace {

// The launches below for a quantized type T; none exist for the float types.
template <typename F>
void dispatch_quantized(int64_t type, F&& f) {
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (ggml::TypeInfo<T>::kFloat) {
      TORCH_INTERNAL_ASSERT(false, "the int8 tensor-core tiles take quantized types only, not ", type);
    } else {
      f(t);
    }
  });
}

template <ggml::Type T>
matvec::QuantizedActs<ggml::TypeInfo<T>::kAct> acts_of(const QuantizedRows& x) {
  return {x.q, x.d, x.sum, x.n};
}

unsigned int row_tiles(const char* op, int64_t rows) {
  const int64_t tiles = ceil_div(rows, mmq::kRows);
  TORCH_CHECK(tiles <= std::numeric_limits<int32_t>::max(), op, ": ", rows, " weight rows are too many for one launch");
  return static_cast<unsigned int>(tiles);
}

}  // namespace

void launch_ggml_mmq(const uint8_t* W, int64_t type, int64_t rows, const QuantizedRows& x, int64_t M,
                     at::Tensor& out) {
  dispatch_quantized(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    const dim3 grid(row_tiles("ggml_mul_mat_a8", rows),
                    static_cast<unsigned int>(std::min<int64_t>(ceil_div(M, mmq::kCols), 65535)));
    mmq::mmq_kernel<T><<<grid, mmq::kThreads, 0, current_stream()>>>(
        W, rows, x.n / ggml::TypeInfo<T>::kBlock, acts_of<T>(x), M, out.data_ptr(), float_kind(out.scalar_type()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

void launch_ggml_mmq_grouped(const uint8_t* W, int64_t type, int64_t rows, const QuantizedRows& x,
                             const PairGroups& groups, int64_t slots, bool per_slot, at::Tensor& out) {
  dispatch_quantized(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    const dim3 grid(row_tiles("ggml_mul_mat_id", rows), static_cast<unsigned int>(groups.most_chosen));
    mmq::mmq_grouped_kernel<T><<<grid, mmq::kThreads, 0, current_stream()>>>(
        W, rows, x.n / ggml::TypeInfo<T>::kBlock, acts_of<T>(x), groups.start, groups.order, groups.active, slots,
        per_slot, out.data_ptr(), float_kind(out.scalar_type()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace cuda
}  // namespace lowbit
