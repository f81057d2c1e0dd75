// The one place where lowbit's operator schemas are declared. Backends add
// kernels for these schemas with TORCH_LIBRARY_IMPL (cpu/*.cpp, cuda/*.cu);
// fake (meta) kernels for torch.compile live in python/lowbit/_fake.py.
#include <torch/library.h>

#include <vector>

#include <optional>
#include <string>

#include "core/ggml_repack.h"
#include "core/ggml_types.h"
#include "cpu/isa.h"

namespace {

// [elements per block, bytes per block] of a ggml type id, from the one table.
std::vector<int64_t> ggml_type_info(int64_t type) {
  const lowbit::ggml::RuntimeInfo info = lowbit::ggml::runtime_info(type);
  TORCH_CHECK_VALUE(info.ok, "ggml_type_info: type ", type, " is not a ggml weight type lowbit supports (unknown or removed id)");
  return {info.block, info.bytes};
}

// The name of a ggml type id (ggml's own, as "Q4_K"), from the same table:
// files can hold types newer than gguf-py's list.
std::string ggml_type_name(int64_t type) {
  const lowbit::ggml::RuntimeInfo info = lowbit::ggml::runtime_info(type);
  TORCH_CHECK_VALUE(info.ok, "ggml_type_name: type ", type, " is not a ggml weight type lowbit supports (unknown or removed id)");
  return info.name;
}

// Whether a ggml type has the CPU kernels' repacked layout (core/ggml_repack.h).
bool ggml_has_repacked_layout(int64_t type) {
  TORCH_CHECK_VALUE(lowbit::ggml::runtime_info(type).ok, "ggml_has_repacked_layout: type ", type,
                    " is not a ggml weight type lowbit supports (unknown or removed id)");
  return lowbit::ggml::has_repacked_layout(static_cast<lowbit::ggml::Type>(type));
}

// The vector ISA the CPU kernels use now, after forcing it to `force` if given.
std::string cpu_isa(std::optional<std::string> force) {
  if (force) lowbit::cpu::force_isa(*force);
  return lowbit::cpu::isa_name(lowbit::cpu::active_isa());
}

// Whether the active ISA's CPU kernels read a weight of this type in the
// repacked layout as it is (AVX-512: every type with the layout; AVX2: those
// reads_repacked_avx2 names); elsewhere each call puts the rows back in the
// file's layout first (the same results, slower).
bool cpu_reads_repacked(int64_t type) {
  TORCH_CHECK_VALUE(lowbit::ggml::runtime_info(type).ok, "cpu_reads_repacked: type ", type,
                    " is not a ggml weight type lowbit supports (unknown or removed id)");
  const auto t = static_cast<lowbit::ggml::Type>(type);
  switch (lowbit::cpu::active_isa()) {
    case lowbit::cpu::Isa::kAvx512: return lowbit::ggml::has_repacked_layout(t);
    case lowbit::cpu::Isa::kAvx2: return lowbit::ggml::reads_repacked_avx2(t);
    default: return false;
  }
}

// Which GPTQ kernel bf16 / fp16 activations take on AVX512-BF16 CPUs
// (lowbit::cpu::Bf16Kernel), after setting it to `mode` if given.
std::string cpu_bf16_kernel(std::optional<std::string> mode) {
  if (mode) lowbit::cpu::set_bf16_kernel(*mode);
  return lowbit::cpu::bf16_kernel_name(lowbit::cpu::bf16_kernel());
}

}  // namespace

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
  // Tensor-parallel reordering (TP-aware dequantization, Hoque et al. 2024):
  // rows of a weight packed along K, gathered by a permutation of K ...
  m.def("gptq_permute_rows(Tensor qweight, Tensor perm, int bit) -> Tensor");
  // ... and output columns of (qweight, qzeros, scales), gathered by a permutation of N.
  m.def("gptq_permute_cols(Tensor qweight, Tensor qzeros, Tensor scales, Tensor perm, int bit) -> (Tensor, Tensor, Tensor)");
  // Packs unsigned `bit`-bit values (int32 tensor) into int32 words along `dim`.
  m.def("gptq_pack(Tensor values, int bit, int dim) -> Tensor");
  // The inverse of gptq_pack: int32 values of every field along `dim`.
  m.def("gptq_unpack(Tensor packed, int bit, int dim) -> Tensor");

  // GGUF. W is the raw uint8 block data of an [m, n] (or [row, n]) matrix, rows
  // of n / block * type_size bytes as stored in the file; type is the ggml id.
  // Names and argument order follow vLLM's GGUF ops.
  m.def("ggml_dequantize(Tensor W, int type, SymInt m, SymInt n, ScalarType? dtype=None) -> Tensor");
  // X [M, n] @ dequant(W).T -> [M, row], activations quantized to 8-bit blocks
  // (Q8_0 / Q8_1 / Q8_K per weight type) and integer dot products, fp32 sums.
  m.def("ggml_mul_mat_vec_a8(Tensor W, Tensor X, int type, SymInt row) -> Tensor");
  m.def("ggml_mul_mat_a8(Tensor W, Tensor X, int type, SymInt row) -> Tensor");
  // Mixture of experts, as llama.cpp's ggml_mul_mat_id: W [experts, row,
  // row_bytes] (a GGUF expert tensor's data), ids [tokens, slots] the expert
  // of each slot of each token, X [tokens, n] (every slot's row) or [tokens,
  // slots, n]; out [tokens, slots, row] = X @ dequant(W[ids]).T, as
  // ggml_mul_mat_a8 computes each.
  m.def("ggml_mul_mat_id(Tensor W, Tensor X, Tensor ids, int type, SymInt row) -> Tensor");
  // The CPU kernels' interleaved layout of a weight (core/ggml_repack.h):
  // W [row, n] reordered into it (or back, `inverse`), same size and shape;
  // and ggml_mul_mat_a8 of a weight in it (the same results, bit for bit).
  m.def("ggml_repack(Tensor W, int type, SymInt row, SymInt n, bool inverse=False) -> Tensor");
  m.def("ggml_mul_mat_repacked(Tensor W, Tensor X, int type, SymInt row) -> Tensor");
  // ggml_mul_mat_id of experts each in that layout (ggml_repack of its own rows).
  m.def("ggml_mul_mat_id_repacked(Tensor W, Tensor X, Tensor ids, int type, SymInt row) -> Tensor");
  // [elements per block, bytes per block] of a ggml type; raises for unknown ids.
  m.def("ggml_type_info(int type) -> int[]", &ggml_type_info);
  m.def("ggml_type_name(int type) -> str", &ggml_type_name);
  m.def("ggml_has_repacked_layout(int type) -> bool", &ggml_has_repacked_layout);

  // The x86 vector ISA of the CPU kernels ("portable", "avx2", "avx512"),
  // chosen from the CPU's features at load (or LOWBIT_CPU_ISA); `force`
  // lowers it, for tests of every path and for benchmarks.
  m.def("cpu_isa(str? force=None) -> str", &cpu_isa);
  m.def("cpu_bf16_kernel(str? mode=None) -> str", &cpu_bf16_kernel);
  m.def("cpu_reads_repacked(int type) -> bool", &cpu_reads_repacked);
}
