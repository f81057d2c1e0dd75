// CPU kernels of the GPTQ ops (registered in register_cpu.cpp).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace lowbit {
namespace cpu {

at::Tensor gptq_gemm(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                     const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                     bool use_v2_format, int64_t bit);
void gptq_shuffle(const at::Tensor& q_weight, const at::Tensor& q_perm, int64_t bit);
at::Tensor gptq_dequantize(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                           const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format,
                           int64_t bit);
at::Tensor gptq_permute_rows(const at::Tensor& qweight, const at::Tensor& perm, int64_t bit);
std::tuple<at::Tensor, at::Tensor, at::Tensor> gptq_permute_cols(const at::Tensor& qweight, const at::Tensor& qzeros,
                                                                 const at::Tensor& scales, const at::Tensor& perm,
                                                                 int64_t bit);
at::Tensor gptq_pack(const at::Tensor& values, int64_t bit, int64_t dim);
at::Tensor gptq_unpack(const at::Tensor& packed, int64_t bit, int64_t dim);

}  // namespace cpu
}  // namespace lowbit
