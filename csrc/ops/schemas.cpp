// The one place where lowbit's operator schemas are declared. The backends
// register kernels for them with TORCH_LIBRARY_IMPL (backend_ops.h, cpu/,
// cuda/), the table queries and CPU settings as composite kernels
// (ggml_type_ops.cpp, cpu/cpu_settings.cpp), the matmuls' autocast casts in
// autocast.cpp; fake kernels for torch.compile are Python (python/lowbit/ops.py).
#include <torch/library.h>

#include "decode_step.h"

TORCH_LIBRARY(lowbit, m) {
  // a @ W for a GPTQ weight W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]).
  // Argument names and order follow vLLM's op so callers can switch.
  m.def(
      "gptq_gemm(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
      "Tensor b_g_idx, bool use_exllama, bool use_v2_format, int bit) -> Tensor");
  // gptq_gemm (unshuffled, contiguous groups) with each activation row's
  // groups quantized to int8, q = round(a * 127 / amax), integer dot
  // products per group and fp32 sums across groups; CPU.
  m.def(
      "gptq_gemm_a8(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, Tensor b_gptq_scales, "
      "Tensor b_g_idx, bool use_v2_format, int bit) -> Tensor");
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
  // W [row, n] reordered into it (or back, `inverse`), same size and shape,
  // or W [experts, row, row bytes] each expert's rows as a weight of their
  // own; and ggml_mul_mat_a8 of a weight in it (the same results, bit for bit).
  m.def("ggml_repack(Tensor W, int type, SymInt row, SymInt n, bool inverse=False) -> Tensor");
  m.def("ggml_mul_mat_repacked(Tensor W, Tensor X, int type, SymInt row) -> Tensor");
  // ggml_mul_mat_id of experts each in that layout (ggml_repack of its own rows).
  m.def("ggml_mul_mat_id_repacked(Tensor W, Tensor X, Tensor ids, int type, SymInt row) -> Tensor");
  // The blocks of x [m, n] as type `type` (Q8_0), uint8 [m, n / 32 * 34],
  // rounded as llama.cpp's quantizer rounds; CPU. Non-finite values raise.
  m.def("ggml_quantize(Tensor x, int type) -> Tensor");
  // [elements per block, bytes per block] of a ggml type; raises for unknown ids.
  m.def("ggml_type_info(int type) -> int[]");
  m.def("ggml_type_name(int type) -> str");
  // Whether a type has the CPU kernels' repacked layout, and all the CPU
  // kernels' facts of a type (cpu/ggml_traits.h): [SIMD levels, GEMM form
  // (0 none, 1 float, 2 integer), the M the GEMM starts at, repacked layout,
  // the ISAs that read it as it is (bit 0 AVX2, bit 1 AVX-512), the M from
  // which AVX2 copies file-layout tiles into it, whether repack_model takes it].
  m.def("ggml_has_repacked_layout(int type) -> bool");
  m.def("ggml_cpu_traits(int type) -> int[]");

  // A decode step's small ops. rms_norm: weight * (x / sqrt(mean(x^2) + eps))
  // over the last dimension, normalised in fp32 and rounded to x's dtype
  // before the scaling, as transformers' RMSNorm does.
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  // One new token's attention, batch 1: q [q_heads, dim], k and v
  // [kv_heads, dim] its projections, cos and sin [rotated] its rotary tables
  // (rotate-half convention over each head's first `rotated` values, the
  // rest passing through); the key rotated and the value are written to
  // row `position` of key_cache and value_cache [kv_heads, capacity, dim],
  // and each rotated query head attends (softmax(scale q.K^T) V, fp32) to
  // rows [start, position] of key-value head h / (q_heads / kv_heads)
  // (start > 0: a sliding window's rows, older ones left unread); sinks
  // [q_heads] (gpt-oss's): each head's logit that joins its softmax's
  // divisor and nothing else; softcap > 0 (Gemma 2's): the scaled scores
  // soft-capped to softcap * tanh(s / softcap) first.
  m.def(
      "decode_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, int position, float scale, int start=0, Tensor? sinks=None, float softcap=0.0) "
      "-> Tensor");
  // A whole decode step of a llama-family model in one C++ loop (decode_step.h).
  m.class_<lowbit::DecodeStep>("DecodeStep")
      .def(torch::init<>())
      .def("projection", &lowbit::DecodeStep::projection)
      .def("layer", &lowbit::DecodeStep::layer)
      .def("layer_extras", &lowbit::DecodeStep::layer_extras)
      .def("expert_projection", &lowbit::DecodeStep::expert_projection)
      .def("layer_experts", &lowbit::DecodeStep::layer_experts)
      .def("style", &lowbit::DecodeStep::style)
      .def("head", &lowbit::DecodeStep::head)
      .def("run", &lowbit::DecodeStep::run)
      .def("num_layers", &lowbit::DecodeStep::num_layers);

  // The x86 vector ISA of the CPU kernels ("portable", "avx2", "avx512"),
  // chosen from the CPU's features at load (or LOWBIT_CPU_ISA); `force`
  // lowers it, for tests of every path and for benchmarks.
  m.def("cpu_isa(str? force=None) -> str");
  m.def("cpu_bf16_kernel(str? mode=None) -> str");
  // The fp32 GEMM of gptq_gemm's and of the GGUF float weights' large-M paths
  // ("onednn" where torch has it, or "blas", torch's at::mm), after setting
  // it to `library` if given.
  m.def("cpu_float_gemm(str? library=None) -> str");
  // The thread count of the CPU kernels' own pool (cpu/parallel.h), after
  // setting it to `threads` if given; 0 follows torch.get_num_threads().
  m.def("cpu_threads(int? threads=None) -> int");
  // Which threads run the CPU kernels: "pool" (that pool, the default) or
  // "torch" (torch's OpenMP team), after setting it to `team` if given.
  m.def("cpu_team(str? team=None) -> str");
  // torch's intra-op thread count on the calling thread (torch.get_num_threads()
  // there), after setting it to `threads` for that thread alone: OpenMP's and
  // MKL's per-thread counts. torch.set_num_threads also sets the count every
  // thread takes at its first torch call, so a thread starting meanwhile would
  // keep a count meant for one call of another thread.
  m.def("cpu_torch_threads(int? threads=None) -> int");
  m.def("cpu_reads_repacked(int type) -> bool");
}
