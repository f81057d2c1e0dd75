// Launchers the GGUF op files share: dequantization of whole rows (used by
// ggml_dequantize and by the large-M path of ggml_mul_mat_a8).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace lowbit {
namespace cuda {

// Decodes `rows` rows of `n` weights of ggml type `type` (row-major block
// bytes at W) into out, a contiguous [rows, n] float32 / float16 / bfloat16
// tensor. The type and shapes must already be validated.
void launch_ggml_dequantize(const uint8_t* W, int64_t type, int64_t rows, int64_t n, at::Tensor& out);

}  // namespace cuda
}  // namespace lowbit
