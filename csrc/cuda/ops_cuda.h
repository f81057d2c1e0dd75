// CUDA kernels of every lowbit op (registered in register_cuda.cu). Same
// signatures, semantics and validation as the CPU kernels in csrc/cpu/.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace lowbit {
namespace cuda {

// gptq_gemm.cu
at::Tensor gptq_gemm(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                     const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                     bool use_v2_format, int64_t bit);

// gptq_dequantize.cu
at::Tensor gptq_dequantize(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                           const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format,
                           int64_t bit);

// gptq_packing.cu
void gptq_shuffle(const at::Tensor& q_weight, const at::Tensor& q_perm, int64_t bit);
at::Tensor gptq_permute_rows(const at::Tensor& qweight, const at::Tensor& perm, int64_t bit);
std::tuple<at::Tensor, at::Tensor, at::Tensor> gptq_permute_cols(const at::Tensor& qweight, const at::Tensor& qzeros,
                                                                 const at::Tensor& scales, const at::Tensor& perm,
                                                                 int64_t bit);
at::Tensor gptq_pack(const at::Tensor& values, int64_t bit, int64_t dim);
at::Tensor gptq_unpack(const at::Tensor& packed, int64_t bit, int64_t dim);

// ggml_dequantize.cu
at::Tensor ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype);

// ggml_matmul.cu
at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_mul_mat_id(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                           int64_t row);

}  // namespace cuda
}  // namespace lowbit
