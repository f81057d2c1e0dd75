// The one place where lowbit's operator schemas are declared. Backends add
// kernels for these schemas with TORCH_LIBRARY_IMPL (cpu/*.cpp, cuda/*.cu);
// fake (meta) kernels for torch.compile live in python/lowbit/_fake.py.
#include <torch/library.h>

TORCH_LIBRARY(lowbit, m) {
  // a @ W for a GPTQ weight W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]).
  // Argument names and order follow vLLM's op so callers can switch.
  m.def(
      "gptq_gemm(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
      "Tensor b_g_idx, bool use_exllama, bool use_v2_format, int bit) -> Tensor");
  // Rewrites q_weight in place into lowbit's fast layout (rows permuted by q_perm).
  m.def("gptq_shuffle(Tensor(a!) q_weight, Tensor q_perm, int bit) -> ()");
  // The float weight W [K, N] of an unshuffled GPTQ weight, in the scales' dtype.
  m.def(
      "gptq_dequantize(Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
      "Tensor b_g_idx, bool use_v2_format, int bit) -> Tensor");
  // Packs unsigned `bit`-bit values (int32 tensor) into int32 words along `dim`.
  m.def("gptq_pack(Tensor values, int bit, int dim) -> Tensor");
  // The inverse of gptq_pack: int32 values of every field along `dim`.
  m.def("gptq_unpack(Tensor packed, int bit, int dim) -> Tensor");
}
