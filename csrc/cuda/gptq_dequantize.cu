// CUDA gptq_dequantize, and the dequantization gptq_gemm's large-M path
// decodes its fp32 weight tiles with.
//
// One thread per (pack of rows, column): it reads the pack's 1 or 3 words of
// its column (consecutive threads, consecutive columns: coalesced) and writes
// the pack's rows. Every value is gptq::dequant(q, zero, scale) in fp32 --
// exact, as on the CPU -- rounded once to the output dtype.
#include "../core/gptq_format.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "common.cuh"
#include "gptq_cuda.cuh"
#include "../ops/backend_ops.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kThreads = 256;

template <int B, typename OutT>
__global__ void __launch_bounds__(kThreads) gptq_dequantize_kernel(GptqView w, int64_t n0, int64_t width, OutT* out) {
  using P = gptq::Pack<B>;
  const int64_t packs = w.K / P::kFields;
  const int64_t total = packs * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t p = i / width, j = i % width, n = n0 + j;
    uint32_t words[P::kWords];
#pragma unroll
    for (int v = 0; v < P::kWords; ++v) words[v] = w.qweight[(p * P::kWords + v) * w.N + n];
    int64_t cur_g = -1;
    int32_t zero = 0;
    float scale = 0.0f;
#pragma unroll
    for (int f = 0; f < P::kFields; ++f) {
      // f is a compile-time constant after unrolling, so locate() folds to
      // fixed shifts and words[] stays in registers.
      const gptq::FieldLoc loc = gptq::locate<B>(f);
      const int64_t k = p * P::kFields + f;
      const int64_t g = group_of(w, k);
      if (g != cur_g) {
        zero = zero_at<B>(w, g, n);
        scale = scale_at(w, g, n);
        cur_g = g;
      }
      const uint32_t q = gptq::extract(words[loc.lo], words[loc.hi], loc);
      out[k * width + j] = from_float<OutT>(gptq::dequant(q, zero, scale));
    }
  }
}

template <typename OutT>
void launch_typed(const GptqView& w, int64_t bit, int64_t n0, int64_t width, OutT* out) {
  const int64_t packs = w.K / gptq::fields_per_pack(bit);
  const unsigned int blocks = grid_for(packs * width, kThreads);
  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    gptq_dequantize_kernel<B, OutT><<<blocks, kThreads, 0, current_stream()>>>(w, n0, width, out);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace

void launch_gptq_dequantize(const GptqView& w, int64_t bit, int64_t n0, at::Tensor& out) {
  TORCH_INTERNAL_ASSERT(out.is_contiguous() && out.dim() == 2 && out.size(0) == w.K && n0 + out.size(1) <= w.N);
  const int64_t width = out.size(1);
  if (width == 0) return;
  switch (out.scalar_type()) {
    case at::kFloat: launch_typed(w, bit, n0, width, out.data_ptr<float>()); break;
    case at::kHalf: launch_typed(w, bit, n0, width, out.data_ptr<at::Half>()); break;
    case at::kBFloat16: launch_typed(w, bit, n0, width, out.data_ptr<at::BFloat16>()); break;
    default: TORCH_INTERNAL_ASSERT(false, "gptq dequantize: unsupported output dtype ", out.scalar_type());
  }
}

at::Tensor gptq_dequantize(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                           const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format,
                           int64_t bit) {
  // Same checks and messages as the CPU kernel; g_idx values are checked on a
  // host copy (an offline op, so the sync is acceptable).
  const GemmArgs args = check_dequantize_args(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, bit);
  const c10::cuda::CUDAGuard guard(b_q_weight.device());
  at::Tensor out = at::empty({args.d.K, args.d.N}, b_gptq_scales.options());
  const GptqView w = make_view(b_q_weight, b_gptq_qzeros, b_gptq_scales, args.idx, args.d, use_v2_format);
  launch_gptq_dequantize(w, bit, 0, out);
  return out;
}

}  // namespace cuda
}  // namespace lowbit
