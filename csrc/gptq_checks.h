// Argument validation for the GPTQ ops, shared by every backend so that CPU
// and CUDA reject exactly the same inputs with the same messages.
//
// Convention: a wrong dtype, device or memory layout raises RuntimeError
// (TORCH_CHECK); a wrong value, shape or bit width raises ValueError
// (TORCH_CHECK_VALUE). Every message starts with "<op>: <argument>".
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "core/gptq_format.h"

namespace lowbit {

inline void check_bits(const char* op, int64_t bit) {
  TORCH_CHECK_VALUE(gptq::is_supported_bits(bit), op, ": bit must be 2, 3, 4 or 8, got ", bit);
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
}

inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", s);
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the other arguments are on ", ref.device());
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

using gptq::fields_per_pack;
using gptq::words_per_pack;

// Shape of a GPTQ weight after validation: W is [K, N] with `groups` groups.
struct GptqDims {
  int64_t K;
  int64_t N;
  int64_t groups;
};

// The names an op's schema gives the three weight tensors, for messages.
struct GptqWeightNames {
  const char* qweight;
  const char* qzeros;
  const char* scales;
};
// vLLM's names (gptq_gemm, gptq_dequantize).
constexpr GptqWeightNames kVllmWeightNames{"b_q_weight", "b_gptq_qzeros", "b_gptq_scales"};

// Validates qweight [K*bit/32, N], qzeros [groups, N*bit/32], scales [groups, N]
// (dtypes, devices, contiguity, shapes consistent with `bit`).
inline GptqDims check_gptq_weight(const char* op, const at::Tensor& qweight, const at::Tensor& qzeros,
                                  const at::Tensor& scales, int64_t bit,
                                  const GptqWeightNames& names = kVllmWeightNames) {
  check_bits(op, bit);
  check_dtype(op, names.qweight, qweight, at::kInt);
  check_dtype(op, names.qzeros, qzeros, at::kInt);
  check_float_dtype(op, names.scales, scales);
  check_same_device(op, names.qzeros, qzeros, qweight);
  check_same_device(op, names.scales, scales, qweight);
  check_dim(op, names.qweight, qweight, 2);
  check_dim(op, names.qzeros, qzeros, 2);
  check_dim(op, names.scales, scales, 2);
  check_contiguous(op, names.qweight, qweight);
  check_contiguous(op, names.qzeros, qzeros);
  check_contiguous(op, names.scales, scales);

  const int64_t rows = qweight.size(0);
  const int64_t N = qweight.size(1);
  TORCH_CHECK_VALUE(rows > 0 && N > 0, op, ": ", names.qweight, " must be non-empty, got shape ", qweight.sizes());
  TORCH_CHECK_VALUE(rows % words_per_pack(bit) == 0, op, ": ", names.qweight, " has ", rows,
                    " rows, not a multiple of ", words_per_pack(bit), " as ", bit, "-bit packing needs");
  const int64_t K = rows / words_per_pack(bit) * fields_per_pack(bit);

  const int64_t groups = scales.size(0);
  TORCH_CHECK_VALUE(groups > 0, op, ": ", names.scales, " must have at least one group, got shape ",
                    scales.sizes());
  TORCH_CHECK_VALUE(groups <= K, op, ": ", names.scales, " has ", groups, " groups but K is only ", K);
  TORCH_CHECK_VALUE(scales.size(1) == N, op, ": ", names.scales, " must be [groups, N=", N, "], got ",
                    scales.sizes());
  TORCH_CHECK_VALUE(N % fields_per_pack(bit) == 0, op, ": N=", N, " (", names.qweight, ".size(1)) must be a multiple of ",
                    fields_per_pack(bit), " so that ", bit, "-bit ", names.qzeros, " pack whole words");
  const int64_t zero_cols = N / fields_per_pack(bit) * words_per_pack(bit);
  TORCH_CHECK_VALUE(qzeros.size(0) == groups && qzeros.size(1) == zero_cols, op,
                    ": ", names.qzeros, " must be [groups=", groups, ", N*bit/32=", zero_cols, "], got ",
                    qzeros.sizes());
  return {K, N, groups};
}

// Validates an int32/int64 index vector of length K (or empty) whose values
// must lie in [0, upper), and returns it as a contiguous int32 tensor. Values
// are inspected only for CPU tensors: device kernels must not sync with the
// host, so they check ranges themselves.
inline at::Tensor check_index_vector(const char* op, const char* name, const at::Tensor& idx,
                                     const at::Tensor& ref, int64_t K, int64_t upper) {
  TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", idx.scalar_type());
  check_same_device(op, name, idx, ref);
  if (idx.numel() == 0) return idx.to(at::kInt);
  check_dim(op, name, idx, 1);
  TORCH_CHECK_VALUE(idx.size(0) == K, op, ": ", name, " must have K=", K, " entries (or be empty), got ",
                    idx.size(0));
  if (idx.is_cpu()) {
    // Check before narrowing to int32, so that large int64 values cannot wrap into range.
    const auto [lo, hi] = at::aminmax(idx);
    const int64_t lo_v = lo.item<int64_t>(), hi_v = hi.item<int64_t>();
    TORCH_CHECK_VALUE(lo_v >= 0 && hi_v < upper, op, ": ", name, " values must lie in [0, ", upper,
                      "), found min ", lo_v, " and max ", hi_v);
  } else if (idx.scalar_type() == at::kLong) {
    // The device kernels' own range checks see int32 values: an int64 value
    // outside int32 (which narrowing would wrap, 2^32 + 1 to 1) becomes -1,
    // which they reject, without a sync with the host.
    const at::Tensor wraps = idx.lt(0).logical_or_(idx.gt(std::numeric_limits<int32_t>::max()));
    return at::where(wraps, at::scalar_tensor(-1, idx.options()), idx).to(at::kInt).contiguous();
  }
  return idx.to(at::kInt).contiguous();
}

// Validates that a non-empty index vector (already range-checked) is a
// permutation of [0, K).
inline void check_permutation(const char* op, const char* name, const at::Tensor& perm32) {
  if (perm32.numel() == 0 || !perm32.is_cpu()) return;
  const int64_t K = perm32.numel();
  std::vector<bool> seen(K, false);
  const int32_t* p = perm32.data_ptr<int32_t>();
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK_VALUE(!seen[p[i]], op, ": ", name, " is not a permutation: value ", p[i],
                      " appears twice (second time at index ", i, ")");
    seen[p[i]] = true;
  }
}

}  // namespace lowbit
