// Launchers the GGUF op files share: dequantization of whole rows (used by
// ggml_dequantize and by the large-M path of ggml_mul_mat_a8) and the int8
// tensor-core tiles (ggml_mmq.cu, used by ggml_mul_mat_a8 and ggml_mul_mat_id).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace lowbit {
namespace cuda {

// Decodes `rows` rows of `n` weights of ggml type `type` (row-major block
// bytes at W) into out, a contiguous [rows, n] float32 / float16 / bfloat16
// tensor. The type and shapes must already be validated.
void launch_ggml_dequantize(const uint8_t* W, int64_t type, int64_t rows, int64_t n, at::Tensor& out);

// Activation rows quantized in the format a weight type pairs with
// (matvec::QuantizedActs): q [M, n], d and sum per its blocks.
struct QuantizedRows {
  const int8_t* q;
  const float* d;
  const float* sum;
  int64_t n;
};

// (token, slot) pairs grouped by expert on the device (matvec::group_pairs_kernel):
// expert e's pairs are order[start[e] .. start[e + 1]), the chosen experts
// active[1 .. active[0]], at most most_chosen of them.
struct PairGroups {
  const int32_t* start;
  const int32_t* order;
  const int32_t* active;
  int64_t most_chosen;
};

// out [M, rows] (its dtype) = x . rows of W, by the int8 tensor-core tiles
// of the quantized `type`; compute capability 8.0 or later.
void launch_ggml_mmq(const uint8_t* W, int64_t type, int64_t rows, const QuantizedRows& x, int64_t M,
                     at::Tensor& out);

// out [pairs, rows] = each pair's activation row (x's row p, or p / slots
// unless per_slot) . rows of its expert's W (experts of rows x n each), by
// the same tiles per chosen expert.
void launch_ggml_mmq_grouped(const uint8_t* W, int64_t type, int64_t rows, const QuantizedRows& x,
                             const PairGroups& groups, int64_t slots, bool per_slot, at::Tensor& out);

}  // namespace cuda
}  // namespace lowbit
