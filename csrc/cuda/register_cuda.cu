// Registers every CUDA kernel under the CUDA dispatch key (the schemas are in
// csrc/ops.cpp; ggml_type_info takes no tensor and needs no kernel here).
#include <torch/library.h>

#include "ops_cuda.h"

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) {
  m.impl("gptq_gemm", &lowbit::cuda::gptq_gemm);
  m.impl("gptq_shuffle", &lowbit::cuda::gptq_shuffle);
  m.impl("gptq_dequantize", &lowbit::cuda::gptq_dequantize);
  m.impl("gptq_permute_rows", &lowbit::cuda::gptq_permute_rows);
  m.impl("gptq_permute_cols", &lowbit::cuda::gptq_permute_cols);
  m.impl("gptq_pack", &lowbit::cuda::gptq_pack);
  m.impl("gptq_unpack", &lowbit::cuda::gptq_unpack);
  m.impl("ggml_dequantize", &lowbit::cuda::ggml_dequantize);
  m.impl("ggml_mul_mat_vec_a8", &lowbit::cuda::ggml_mul_mat_vec_a8);
  m.impl("ggml_mul_mat_a8", &lowbit::cuda::ggml_mul_mat_a8);
  m.impl("ggml_mul_mat_id", &lowbit::cuda::ggml_mul_mat_id);
}
