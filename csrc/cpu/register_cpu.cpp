// Registers every CPU kernel under the CPU dispatch key.
#include <torch/library.h>

#include "ggml_cpu.h"
#include "gptq_cpu.h"

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  m.impl("gptq_gemm", &lowbit::cpu::gptq_gemm);
  m.impl("gptq_shuffle", &lowbit::cpu::gptq_shuffle);
  m.impl("gptq_dequantize", &lowbit::cpu::gptq_dequantize);
  m.impl("gptq_permute_rows", &lowbit::cpu::gptq_permute_rows);
  m.impl("gptq_permute_cols", &lowbit::cpu::gptq_permute_cols);
  m.impl("gptq_pack", &lowbit::cpu::gptq_pack);
  m.impl("gptq_unpack", &lowbit::cpu::gptq_unpack);
  m.impl("ggml_dequantize", &lowbit::cpu::ggml_dequantize);
  m.impl("ggml_mul_mat_vec_a8", &lowbit::cpu::ggml_mul_mat_vec_a8);
  m.impl("ggml_mul_mat_a8", &lowbit::cpu::ggml_mul_mat_a8);
  m.impl("ggml_mul_mat_id", &lowbit::cpu::ggml_mul_mat_id);
  m.impl("ggml_mul_mat_repacked", &lowbit::cpu::ggml_mul_mat_repacked);
  m.impl("ggml_mul_mat_id_repacked", &lowbit::cpu::ggml_mul_mat_id_repacked);
  m.impl("ggml_repack", &lowbit::cpu::ggml_repack);
}
