// Argument checks of the GPTQ ops, shared by every backend: the building
// blocks (bit width, a GPTQ weight's shapes) and, composed from them and
// checks.h, the exact sequence each op runs, so that every backend rejects the
// same inputs in the same order with the same messages.
//
// Index values: check_index_vector inspects values only for CPU tensors. The
// ops that are not on the inference path (dequantize, shuffle, permutations,
// pack) call check_index_values, which checks a device vector's values on a
// host copy -- a synchronising copy, acceptable for an offline op and giving
// the CPU's messages exactly. gptq_gemm never copies (it must stay free of
// host syncs and CUDA-graph capturable); device kernels assert on
// out-of-range indices instead (CUDA_KERNEL_ASSERT).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "checks.h"

namespace lowbit {

inline void check_bits(const char* op, int64_t bit) {
  TORCH_CHECK_VALUE(gptq::is_supported_bits(bit), op, ": bit must be 2, 3, 4 or 8, got ", bit);
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

// The panel layout of a qweight (gptq_gemm_a8 reads it): [N/64, K*bit/32, 64],
// each panel the checkpoint's rows of 64 consecutive columns, so that a run
// of columns is one contiguous stream (csrc/README.md).
constexpr int64_t kGptqPanelCols = 64;

// Validates qweight [K*bit/32, N] (or, where `panels`, the panel layout
// [N/64, K*bit/32, 64]), qzeros [groups, N*bit/32], scales [groups, N]
// (dtypes, devices, contiguity, shapes consistent with `bit`).
inline GptqDims check_gptq_weight(const char* op, const at::Tensor& qweight, const at::Tensor& qzeros,
                                  const at::Tensor& scales, int64_t bit,
                                  const GptqWeightNames& names = kVllmWeightNames, bool panels = false) {
  check_bits(op, bit);
  check_dtype(op, names.qweight, qweight, at::kInt);
  check_dtype(op, names.qzeros, qzeros, at::kInt);
  check_float_dtype(op, names.scales, scales);
  check_same_device(op, names.qzeros, qzeros, qweight);
  check_same_device(op, names.scales, scales, qweight);
  const bool paneled = panels && qweight.dim() == 3;
  if (paneled) {
    TORCH_CHECK_VALUE(qweight.size(2) == kGptqPanelCols, op, ": a 3-D ", names.qweight, " is the panel layout [N/",
                      kGptqPanelCols, ", K*bit/32, ", kGptqPanelCols, "], got shape ", qweight.sizes());
  } else if (panels) {
    TORCH_CHECK_VALUE(qweight.dim() == 2, op, ": ", names.qweight, " must be 2-D [K*bit/32, N] or the 3-D panel "
                      "layout [N/", kGptqPanelCols, ", K*bit/32, ", kGptqPanelCols, "], got shape ", qweight.sizes());
  } else {
    check_dim(op, names.qweight, qweight, 2);
  }
  check_dim(op, names.qzeros, qzeros, 2);
  check_dim(op, names.scales, scales, 2);
  check_contiguous(op, names.qweight, qweight);
  check_contiguous(op, names.qzeros, qzeros);
  check_contiguous(op, names.scales, scales);

  const int64_t rows = qweight.size(paneled ? 1 : 0);
  const int64_t N = paneled ? qweight.size(0) * kGptqPanelCols : qweight.size(1);
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

// Every check of gptq_gemm (op names gptq_gemm_a8's messages), in the CPU
// kernel's order. Index values are checked only for CPU tensors (see the top
// of this file).
inline GemmArgs check_gemm_args(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                                const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                                int64_t bit, const char* op = "gptq_gemm", bool panels = false) {
  const GptqDims d = check_gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit, kVllmWeightNames, panels);
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
  // A repeated row would read one activation twice and drop another.
  if (use_exllama) check_permutation(op, "b_g_idx", idx);
  return {d, idx};
}

// gptq_gemm_a8's integer sums of one group stay below 2^31 (|q_a| <= 127,
// |q_w - z| <= 2^bit) up to groups of this many rows.
constexpr int64_t kA8MaxGroupRows = 32768;

// The checks gptq_gemm_a8 adds once the grouping is known: contiguous
// groups (g_idx[k] == k // group_size, the last one possibly short) of at
// most kA8MaxGroupRows rows; group_size 0 means g_idx is not contiguous.
inline void check_a8_groups(int64_t group_size) {
  TORCH_CHECK_VALUE(group_size > 0, "gptq_gemm_a8: b_g_idx must put the rows in contiguous groups "
                    "(g_idx[k] == k // group_size); sort an act-order weight's rows by group first (GPTQLinear does)");
  TORCH_CHECK_VALUE(group_size <= kA8MaxGroupRows, "gptq_gemm_a8: b_gptq_scales has groups of ", group_size,
                    " rows; at most ", kA8MaxGroupRows, " keep the int32 sums exact");
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

// The sizes of gptq_pack's (`pack`) or gptq_unpack's output for a validated
// input: `dim` holding whole packs of words instead of fields, or back.
inline std::vector<int64_t> converted_sizes(const at::Tensor& input, int64_t bit, int64_t dim, bool pack) {
  std::vector<int64_t> sizes = input.sizes().vec();
  const int64_t fields = fields_per_pack(bit), words = words_per_pack(bit);
  sizes[dim] = pack ? sizes[dim] / fields * words : sizes[dim] / words * fields;
  return sizes;
}

}  // namespace lowbit
