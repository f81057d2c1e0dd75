// CUDA gptq_dequantize, and the dequantization gptq_gemm's large-M path
// decodes its weight tiles with.
//
// One thread per (pack of rows, column): it reads the pack's 1 or 3 words of
// its column (consecutive threads, consecutive columns: coalesced) and writes
// the pack's rows. Every value is gptq::dequant(q, zero, scale) in fp32 --
// exact, as on the CPU -- rounded once to the output dtype, or, for the
// large-M path's fp16 / bf16 products, split into two terms of that dtype
// (gptq_cuda.cuh).
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

// One thread per (pack of rows, column j of the tile): decodes the pack's
// values and hands each, W[k, n0 + j] in fp32, to `store(k, j, value)`.
template <int B, typename Store>
__global__ void __launch_bounds__(kThreads) gptq_dequantize_kernel(GptqView w, int64_t n0, int64_t width, Store store) {
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
      store(k, j, gptq::dequant(q, zero, scale));
    }
  }
}

// The value rounded once to OutT: out is [K, width].
template <typename OutT>
struct StoreRounded {
  OutT* out;
  int64_t width;
  __device__ __forceinline__ void operator()(int64_t k, int64_t j, float x) const {
    out[k * width + j] = from_float<OutT>(x);
  }
};

// 2^e as a float, for e in [-126, 127] (a normal number).
__device__ __forceinline__ float pow2(int e) { return __int_as_float((e + 127) << 23); }

// x * 2^e for e in [-126, 254] where the product is finite: ldexpf's value
// (one rounding, as a single multiplication by a normal power of two; the
// 2^127 step only scales up, which is exact), in a few instructions instead
// of ldexpf's range handling, which the unrolled kernels repeat per value.
__device__ __forceinline__ float mul_pow2(float x, int e) {
  if (e > 127) {
    x *= pow2(127);
    e -= 127;
  }
  return x * pow2(e);
}

// The value scaled by 2^exps[j] as hi + lo * 2^-lo_shift in T (hi and lo are [K, width]).
template <typename T>
struct StoreSplit {
  T* hi;
  T* lo;
  const int32_t* exps;
  int lo_shift;
  int64_t width;
  __device__ __forceinline__ void operator()(int64_t k, int64_t j, float x) const {
    // exps[j] lies in [-122, 160] (split_exponents_kernel), the scaled value below 2^kSplitHiExponent.
    const float scaled = mul_pow2(x, __ldg(exps + j));
    const T h = from_float<T>(scaled);
    const float hf = static_cast<float>(h);
    hi[k * width + j] = h;
    // scaled - h is exact in fp32 (the rounding error of a narrower format),
    // and so is its scaling up; an infinite value is all in hi (inf - inf
    // would make lo NaN).
    lo[k * width + j] = from_float<T>(isfinite(hf) ? (scaled - hf) * pow2(lo_shift) : 0.0f);
  }
};

template <typename Store>
void launch_store(const GptqView& w, int64_t bit, int64_t n0, int64_t width, const Store& store) {
  const int64_t packs = w.K / gptq::fields_per_pack(bit);
  const unsigned int blocks = grid_for(packs * width, kThreads);
  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    gptq_dequantize_kernel<B, Store><<<blocks, kThreads, 0, current_stream()>>>(w, n0, width, store);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

template <typename OutT>
void launch_typed(const GptqView& w, int64_t bit, int64_t n0, int64_t width, OutT* out) {
  launch_store(w, bit, n0, width, StoreRounded<OutT>{out, width});
}

template <typename T>
void launch_split(const GptqView& w, int64_t bit, int64_t n0, int64_t width, const int32_t* exps, T* hi, T* lo,
                  int lo_shift) {
  launch_store(w, bit, n0, width, StoreSplit<T>{hi, lo, exps, lo_shift, width});
}

// exps[n] = kSplitHiExponent - e, where 2^e exceeds max_g |scale[g, n]| * 2^bit,
// a bound on |W[:, n]| (|q - zero| <= 2^bit under either zero format). Only
// finite scales count: a NaN or infinite one makes its own values NaN or
// infinite whatever the exponent, and must not push the others out of range.
__global__ void __launch_bounds__(kThreads) split_exponents_kernel(GptqView w, int bit, int32_t* exps) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; n < w.N; n += stride) {
    float m = 0.0f;
    for (int64_t g = 0; g < w.groups; ++g) {
      const float s = fabsf(scale_at(w, g, n));
      if (isfinite(s)) m = fmaxf(m, s);
    }
    int e = 0;
    frexpf(m, &e);  // m < 2^e; the bound's exponent is e + bit (no overflow: e <= 128)
    exps[n] = kSplitHiExponent - (e + bit);
  }
}

}  // namespace

void launch_gptq_split_exponents(const GptqView& w, int64_t bit, at::Tensor& exps) {
  TORCH_INTERNAL_ASSERT(exps.is_contiguous() && exps.scalar_type() == at::kInt && exps.numel() == w.N);
  split_exponents_kernel<<<grid_for(w.N, kThreads), kThreads, 0, current_stream()>>>(w, static_cast<int>(bit),
                                                                                      exps.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void launch_gptq_dequantize_split(const GptqView& w, int64_t bit, int64_t n0, const at::Tensor& exps, at::Tensor& hi,
                                  at::Tensor& lo) {
  TORCH_INTERNAL_ASSERT(hi.is_contiguous() && lo.is_contiguous() && hi.dim() == 2 && hi.size(0) == w.K &&
                        hi.sizes() == lo.sizes() && hi.scalar_type() == lo.scalar_type() &&
                        n0 + hi.size(1) <= w.N && exps.numel() == w.N);
  const int64_t width = hi.size(1);
  if (width == 0) return;
  const int32_t* e = exps.data_ptr<int32_t>() + n0;
  const int shift = split_lo_shift(hi.scalar_type());
  switch (hi.scalar_type()) {
    case at::kHalf: launch_split(w, bit, n0, width, e, hi.data_ptr<at::Half>(), lo.data_ptr<at::Half>(), shift); break;
    case at::kBFloat16:
      launch_split(w, bit, n0, width, e, hi.data_ptr<at::BFloat16>(), lo.data_ptr<at::BFloat16>(), shift);
      break;
    default: TORCH_INTERNAL_ASSERT(false, "gptq dequantize split: unsupported dtype ", hi.scalar_type());
  }
}

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
