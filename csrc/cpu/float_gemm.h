// The fp32 GEMM of the large-M paths of gptq_gemm and of the GGUF float
// weights: oneDNN's, where torch is built with it, or torch's BLAS (at::mm:
// MKL on x86 wheels). Both sum in fp32; MKL's sgemm takes slower code paths
// on AMD CPUs, where oneDNN's runs several times faster (csrc/cpu/README.md).
// Both follow torch's float32 matmul precision, as torch.mm does.
#pragma once

#include <ATen/ATen.h>

#include <string>

namespace lowbit {
namespace cpu {

enum class FloatGemm : int { kOneDnn = 0, kBlas = 1 };
// The library in use: oneDNN where torch has it, unless set otherwise.
FloatGemm float_gemm();
// Sets it by name ("onednn", "blas"); raises ValueError for another name,
// or for "onednn" where torch has no oneDNN.
void set_float_gemm(const std::string& name);
const char* float_gemm_name(FloatGemm g);

// a [M, k] @ b [k, n] into out [M, n] (any strides) by the library in use,
// on the calling thread alone (its OpenMP thread count is one for the call).
// Callers run strips of a product as tasks of lowbit's pool: on shared cores
// an OpenMP team's barriers each wait for a descheduled thread, where the
// pool's other threads take its strips.
void float_mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor out);

}  // namespace cpu
}  // namespace lowbit
