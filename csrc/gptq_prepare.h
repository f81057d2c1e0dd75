// Whole-op argument validation of the GPTQ ops, shared by every backend.
//
// gptq_checks.h holds the building blocks (dtype, device, shape of a GPTQ
// weight, index vectors); this header composes them into the exact sequence
// of checks each op performs, so that a backend calls one function and
// rejects the same inputs, in the same order, with the same messages as every
// other backend (csrc/cpu/gptq_gemm.cpp, gptq_packing.cpp, csrc/cuda/*.cu).
//
// Index values: gptq_checks.h's check_index_vector inspects values only for
// CPU tensors. The ops that are not on the inference path (dequantize, shuffle,
// permutations, pack) call check_index_values here, which checks a device
// vector's values on a host copy -- a synchronising copy, acceptable for an
// offline op and giving the CPU's messages exactly. gptq_gemm never copies
// (it must stay free of host syncs and CUDA-graph capturable); device kernels
// assert on out-of-range indices instead (CUDA_KERNEL_ASSERT).
#pragma once

#include <ATen/ATen.h>

#include <utility>

#include "gptq_checks.h"

namespace lowbit {

// Without a g_idx, row k belongs to group k / (K / groups), which needs K to
// split evenly; anything else would silently misassign rows.
inline void check_even_groups(const char* op, const GptqDims& d, const char* why) {
  TORCH_CHECK_VALUE(d.K % d.groups == 0, op, ": K=", d.K, " is not a multiple of the ", d.groups,
                    " groups in b_gptq_scales, ", why);
}

// check_index_vector plus, for a tensor that is not on the CPU, the same value
// checks on a host copy (synchronises with the device).
inline at::Tensor check_index_values(const char* op, const char* name, const at::Tensor& idx, const at::Tensor& ref,
                                     int64_t K, int64_t upper) {
  at::Tensor idx32 = check_index_vector(op, name, idx, ref, K, upper);
  if (!idx.is_cpu() && idx.numel() > 0) {
    const at::Tensor host = idx.cpu();  // the original dtype: int64 values are checked before narrowing
    check_index_vector(op, name, host, host, K, upper);
  }
  return idx32;
}

// check_permutation for a vector on any device (a device vector is checked on
// a host copy).
inline void check_permutation_values(const char* op, const char* name, const at::Tensor& perm32) {
  check_permutation(op, name, perm32.is_cpu() ? perm32 : perm32.cpu());
}

// ---- gptq_gemm ---------------------------------------------------------------

struct GemmArgs {
  GptqDims d;
  at::Tensor idx;  // b_g_idx as contiguous int32 (empty when none was given)
};

// Every check of gptq_gemm, in the CPU kernel's order. Index values are
// checked only for CPU tensors (see the top of this file).
inline GemmArgs check_gemm_args(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                                const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                                int64_t bit) {
  const char* op = "gptq_gemm";
  const GptqDims d = check_gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit);
  check_float_dtype(op, "a", a);
  check_same_device(op, "a", a, b_q_weight);
  TORCH_CHECK_VALUE(a.dim() >= 1 && a.size(-1) == d.K, op, ": a must be [..., K=", d.K,
                    "] to match b_q_weight, got ", a.sizes());
  // Shuffled weights: b_g_idx is the permutation given to gptq_shuffle, and
  // shuffled row i belongs to group i / (K / groups). Unshuffled: b_g_idx is
  // the checkpoint's g_idx.
  at::Tensor idx = check_index_vector(op, "b_g_idx", b_g_idx, b_q_weight, d.K, use_exllama ? d.K : d.groups);
  if (use_exllama || idx.numel() == 0) {
    check_even_groups(op, d, use_exllama ? "as shuffled (use_exllama) weights need" : "so b_g_idx must be given");
  }
  return {d, idx};
}

// ---- gptq_dequantize -----------------------------------------------------------

inline GemmArgs check_dequantize_args(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                                      const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, int64_t bit) {
  const char* op = "gptq_dequantize";
  const GptqDims d = check_gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit);
  at::Tensor idx = check_index_values(op, "b_g_idx", b_g_idx, b_q_weight, d.K, d.groups);
  if (idx.numel() == 0) check_even_groups(op, d, "so b_g_idx must be given");
  return {d, idx};
}

// ---- row permutations (gptq_shuffle, gptq_permute_rows) ------------------------

// Validates a packed-along-K weight and a permutation of its K rows (empty
// allowed when `optional_perm`); returns K and the int32 permutation.
inline std::pair<int64_t, at::Tensor> check_row_permutation(const char* op, const char* weight_name,
                                                            const at::Tensor& qweight, const char* perm_name,
                                                            const at::Tensor& perm, int64_t bit, bool optional_perm) {
  check_bits(op, bit);
  check_dtype(op, weight_name, qweight, at::kInt);
  check_dim(op, weight_name, qweight, 2);
  check_contiguous(op, weight_name, qweight);
  TORCH_CHECK_VALUE(qweight.size(0) % words_per_pack(bit) == 0, op, ": ", weight_name, " has ", qweight.size(0),
                    " rows, not a multiple of ", words_per_pack(bit), " as ", bit, "-bit packing needs");
  const int64_t K = qweight.size(0) / words_per_pack(bit) * fields_per_pack(bit);
  TORCH_CHECK_VALUE(optional_perm || perm.numel() == K, op, ": ", perm_name, " must be a permutation of the K=", K,
                    " rows, got ", perm.numel(), " entries");
  at::Tensor p = check_index_values(op, perm_name, perm, qweight, K, K);
  check_permutation_values(op, perm_name, p);
  return {K, p};
}

// ---- gptq_permute_cols ------------------------------------------------------------

// Validates the weight and a permutation of its N columns; returns the
// dimensions and the int32 permutation.
inline std::pair<GptqDims, at::Tensor> check_column_permutation(const char* op, const at::Tensor& qweight,
                                                                const at::Tensor& qzeros, const at::Tensor& scales,
                                                                const at::Tensor& perm, int64_t bit) {
  const GptqDims d = check_gptq_weight(op, qweight, qzeros, scales, bit, {"qweight", "qzeros", "scales"});
  TORCH_CHECK_VALUE(perm.numel() == d.N, op, ": perm must be a permutation of the N=", d.N, " columns, got ",
                    perm.numel(), " entries");
  at::Tensor p = check_index_values(op, "perm", perm, qweight, d.N, d.N);
  check_permutation_values(op, "perm", p);
  return {d, p};
}

// ---- gptq_pack / gptq_unpack ---------------------------------------------------------

inline void check_pack_args(const char* op, const char* name, const at::Tensor& t, int64_t bit, int64_t dim) {
  check_bits(op, bit);
  check_dtype(op, name, t, at::kInt);
  check_dim(op, name, t, 2);
  TORCH_CHECK_VALUE(dim == 0 || dim == 1, op, ": dim must be 0 or 1, got ", dim);
}

// gptq_pack's checks: whole packs along `dim` and every value in [0, 2^bit)
// (the range is read back from the device for a device tensor: an offline op).
inline void check_pack_values(const at::Tensor& values, int64_t bit, int64_t dim) {
  const char* op = "gptq_pack";
  check_pack_args(op, "values", values, bit, dim);
  const int64_t length = values.size(dim);
  TORCH_CHECK_VALUE(length % fields_per_pack(bit) == 0, op, ": values.size(", dim, ")=", length,
                    " must be a multiple of ", fields_per_pack(bit), " for ", bit, "-bit packing");
  if (values.numel() > 0) {
    const auto [lo, hi] = at::aminmax(values);
    const int32_t lo_v = lo.item<int32_t>(), hi_v = hi.item<int32_t>();
    TORCH_CHECK_VALUE(lo_v >= 0 && hi_v < (1 << bit), op, ": values must lie in [0, ", 1 << bit, ") for ", bit,
                      "-bit packing, found min ", lo_v, " and max ", hi_v);
  }
}

// gptq_unpack's checks: whole packs of words along `dim`.
inline void check_unpack_words(const at::Tensor& packed, int64_t bit, int64_t dim) {
  const char* op = "gptq_unpack";
  check_pack_args(op, "packed", packed, bit, dim);
  const int64_t words = packed.size(dim);
  TORCH_CHECK_VALUE(words % words_per_pack(bit) == 0, op, ": packed.size(", dim, ")=", words,
                    " must be a multiple of ", words_per_pack(bit), " for ", bit, "-bit packing");
}

}  // namespace lowbit
