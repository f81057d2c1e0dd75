// The tensor ops every backend implements, declared once: each backend
// defines them in its namespace (lowbit::cpu in csrc/cpu/, lowbit::cuda in
// csrc/cuda/) and registers them under its dispatch key with
// LOWBIT_REGISTER_BACKEND_OPS. Same signatures, semantics and validation on
// every backend; the schemas are in schemas.cpp.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

// X(op): the ops with a kernel on every backend.
#define LOWBIT_BACKEND_OPS(X) \
  X(gptq_gemm)                \
  X(gptq_shuffle)             \
  X(gptq_dequantize)          \
  X(gptq_permute_rows)        \
  X(gptq_permute_cols)        \
  X(gptq_pack)                \
  X(gptq_unpack)              \
  X(ggml_dequantize)          \
  X(ggml_mul_mat_vec_a8)      \
  X(ggml_mul_mat_a8)          \
  X(ggml_mul_mat_id)          \
  X(rms_norm)                 \
  X(decode_attention)

// X(op): the CPU-only ops: GPTQ with int8 activations (for the VNNI dot
// product), float weights into GGUF blocks (a load-time step) and the CPU
// kernels' repacked GGUF layout.
#define LOWBIT_CPU_ONLY_OPS(X) \
  X(gptq_gemm_a8)              \
  X(ggml_quantize)             \
  X(ggml_repack)               \
  X(ggml_mul_mat_repacked)     \
  X(ggml_mul_mat_id_repacked)

// Inside TORCH_LIBRARY_IMPL(lowbit, <key>, m): m.impl of every op in `list`
// from namespace lowbit::<backend>.
#define LOWBIT_REGISTER_BACKEND_OPS(list, backend) \
  list(LOWBIT_IMPL_OP_##backend)
#define LOWBIT_IMPL_OP_cpu(op) m.impl(#op, &lowbit::cpu::op);
#define LOWBIT_IMPL_OP_cuda(op) m.impl(#op, &lowbit::cuda::op);

#define LOWBIT_DECLARE_BACKEND_OPS                                                                                 \
  at::Tensor gptq_gemm(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,         \
                       const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,               \
                       bool use_v2_format, int64_t bit);                                                            \
  void gptq_shuffle(const at::Tensor& q_weight, const at::Tensor& q_perm, int64_t bit);                             \
  at::Tensor gptq_dequantize(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,                        \
                             const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format,       \
                             int64_t bit);                                                                          \
  at::Tensor gptq_permute_rows(const at::Tensor& qweight, const at::Tensor& perm, int64_t bit);                     \
  std::tuple<at::Tensor, at::Tensor, at::Tensor> gptq_permute_cols(                                                 \
      const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales, const at::Tensor& perm,        \
      int64_t bit);                                                                                                 \
  at::Tensor gptq_pack(const at::Tensor& values, int64_t bit, int64_t dim);                                         \
  at::Tensor gptq_unpack(const at::Tensor& packed, int64_t bit, int64_t dim);                                       \
  at::Tensor ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,                              \
                             std::optional<at::ScalarType> dtype);                                                  \
  at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);              \
  at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);                  \
  at::Tensor ggml_mul_mat_id(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,         \
                             int64_t row);                                                                          \
  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);                                   \
  at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos, \
                              const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,    \
                              int64_t position, double scale, int64_t start,                                        \
                              const std::optional<at::Tensor>& sinks, double softcap);

namespace lowbit {
namespace cpu {
LOWBIT_DECLARE_BACKEND_OPS
at::Tensor gptq_gemm_a8(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                        const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format, int64_t bit);
at::Tensor ggml_quantize(const at::Tensor& x, int64_t type);
at::Tensor ggml_repack(const at::Tensor& W, int64_t type, int64_t row, int64_t n, bool inverse);
at::Tensor ggml_mul_mat_repacked(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row);
at::Tensor ggml_mul_mat_id_repacked(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                                    int64_t row);
}  // namespace cpu
namespace cuda {
LOWBIT_DECLARE_BACKEND_OPS
}  // namespace cuda
}  // namespace lowbit
