// CPU kernels of the GGUF ops (registered in register_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lowbit {
namespace cpu {

at::Tensor ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype);
at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_mul_mat_id(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                           int64_t row);
at::Tensor ggml_mul_mat_id_repacked(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                                    int64_t row);
at::Tensor ggml_mul_mat_repacked(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_repack(const at::Tensor& W, int64_t type, int64_t row, int64_t n, bool inverse);

}  // namespace cpu
}  // namespace lowbit
