// A validated GPTQ weight as the CUDA kernels read it, the per-element
// accessors they share (group of a row, zero point and scale of a group and
// column: all from core/gptq_format.h), and the launchers one op file offers
// another (dequantization for gptq_gemm's large-M path, raw pack/unpack for
// gptq_permute_cols).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../core/gptq_format.h"
#include "../ops/gptq_checks.h"
#include "common.cuh"

namespace lowbit {
namespace cuda {

struct GptqView {
  const uint32_t* qweight;  // [K*bit/32, N], packed along K
  const uint32_t* qzeros;   // [groups, zero_cols], packed along N (stored zeros, rule not applied)
  const void* scales;       // [groups, N] in scale_kind
  Float scale_kind;
  int64_t K;
  int64_t N;
  int64_t groups;
  int64_t zero_cols;
  const int32_t* g_idx;  // group of each row, or null: row k is in group k / group_size
  int64_t group_size;
  bool v2;
};

// `g_idx` must be an int32 contiguous vector on the weight's device, or an
// undefined / empty tensor for the trivial grouping.
inline GptqView make_view(const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales,
                          const at::Tensor& g_idx, const GptqDims& d, bool v2) {
  GptqView v;
  v.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  v.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>());
  v.scales = scales.data_ptr();
  v.scale_kind = float_kind(scales.scalar_type());
  v.K = d.K;
  v.N = d.N;
  v.groups = d.groups;
  v.zero_cols = qzeros.size(1);
  v.g_idx = g_idx.defined() && g_idx.numel() ? g_idx.data_ptr<int32_t>() : nullptr;
  v.group_size = d.K / d.groups;
  v.v2 = v2;
  return v;
}

// Group of weight row k. g_idx values cannot be range-checked on the host
// without a sync, so an out-of-range value stops the kernel here instead of
// reading outside scales / qzeros.
__device__ __forceinline__ int64_t group_of(const GptqView& w, int64_t k) {
  if (w.g_idx == nullptr) return k / w.group_size;
  const int64_t g = w.g_idx[k];
  CUDA_KERNEL_ASSERT(g >= 0 && g < w.groups && "gptq: b_g_idx value out of range");
  return g;
}

// Zero point of group g, column n, with the v1/v2 rule applied per field.
template <int B>
__device__ __forceinline__ int32_t zero_at(const GptqView& w, int64_t g, int64_t n) {
  return gptq::zero_point(gptq::unpack_field<B>(w.qzeros + g * w.zero_cols, 1, n), w.v2);
}

__device__ __forceinline__ float scale_at(const GptqView& w, int64_t g, int64_t n) {
  return load_float(w.scales, w.scale_kind, g * w.N + n);
}

// gptq_dequantize.cu: out[k, j] = W[k, n0 + j] for j < out.size(1), written in
// out's dtype (float32, float16 or bfloat16; out contiguous [K, width]).
void launch_gptq_dequantize(const GptqView& w, int64_t bit, int64_t n0, at::Tensor& out);

// W in two terms of a 16-bit float type T, for products with fp16 / bf16
// activations on the tensor cores that keep the fp32 weight:
//   W[k, n] * 2^exps[n] = hi[k, n] + lo[k, n] * 2^-split_lo_shift(T).
// hi is the scaled value rounded to T and lo the remainder, which is exact in
// fp32 and has at most 24 - s significant bits for T's s (11 for fp16, 8 for
// bf16): with fp16 or bf16 scales W has at most bit + 11 of them, so the two
// fp16 terms hold it exactly, and two bf16 terms to within 2^-17 of |W|.
// exps[n] puts each column's bound |W| < 2^kSplitHiExponent, far inside
// fp16's range, so neither term overflows and hi is normal down to 2^-28 of
// the bound.
constexpr int kSplitHiExponent = 14;

inline int split_lo_shift(at::ScalarType t) { return t == at::kHalf ? 11 : 8; }

// exps: int32 [N]; the exponent of every column (launch_gptq_split_exponents
// writes it from the scales).
void launch_gptq_split_exponents(const GptqView& w, int64_t bit, at::Tensor& exps);
// hi, lo: [K, width] of the same dtype (float16 or bfloat16), columns n0 ...
void launch_gptq_dequantize_split(const GptqView& w, int64_t bit, int64_t n0, const at::Tensor& exps, at::Tensor& hi,
                                  at::Tensor& lo);

// gptq_gemm.cu: out = the sum over splits of partial [splits, M, N] (fp32),
// in split order, rounded once to out's dtype (out contiguous [M, N]).
void launch_splitk_reduce(const at::Tensor& partial, int64_t splits, at::Tensor& out);

// gptq_mma.cu: the tensor-core kernel. Serves a (its dtype and device) and w
// with this bit width where true; gemm_mma takes a in the weight's row order
// (shuffled weights: a[:, q_perm]), contiguous, 16-byte aligned.
bool gptq_mma_serves(const at::Tensor& a, const GptqView& w, int64_t bit);
void gemm_mma(const at::Tensor& a_rows, const GptqView& w, int64_t bit, at::Tensor& out);

// gptq_packing.cu: pack / unpack along `dim` without validation (the caller
// has validated the shapes and values).
at::Tensor pack_words(const at::Tensor& values, int64_t bit, int64_t dim);
at::Tensor unpack_words(const at::Tensor& packed, int64_t bit, int64_t dim);

}  // namespace cuda
}  // namespace lowbit
