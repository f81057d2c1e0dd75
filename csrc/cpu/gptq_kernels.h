// The torch-free view of a GPTQ weight that the CPU gptq_gemm kernels read,
// and the entry points of its SIMD variants (gptq_fused_avx2.cpp,
// gptq_fused_avx512.cpp; chosen at run time, see isa.h).
#pragma once

#include <stdint.h>

#include "../core/gptq_format.h"

namespace lowbit {
namespace cpu {

// Group of weight row k: g_idx[k] when given, else k / group_size (the last
// group may be short).
struct RowGroups {
  const int32_t* g_idx;  // null for the trivial grouping
  int64_t group_size;
  int64_t operator()(int64_t k) const { return g_idx ? g_idx[k] : k / group_size; }
};

// A validated GPTQ weight in the form the kernels read it.
struct GptqWeight {
  const uint32_t* qweight;  // [K*bit/32, N]
  int64_t K;
  int64_t N;
  const int32_t* zeros;  // [groups, N], zero-point rule applied
  const float* scales;   // [groups, N]
  RowGroups group_of;
};

// The SIMD fused kernels compute out[m, n] = sum_k a[m, k] * W[k, n] (fp32,
// row-major a [M, K] and out [M, N]) for m < M and n in [n0, n1). They need
// contiguous groups (no g_idx: the trivial grouping, possibly with a short
// last group, or act-order weights in the shuffled layout) that hold whole
// packs, and a column range that is a
// multiple of simd_fused_cols(); simd_fused_supports() says whether w qualifies.
template <int B>
bool simd_fused_supports(const GptqWeight& w) {
  return w.group_of.g_idx == nullptr && w.group_of.group_size % gptq::Pack<B>::kFields == 0;
}
constexpr int64_t kAvx2FusedCols = 32;    // 4 vectors of 8 lanes
constexpr int64_t kAvx512FusedCols = 64;  // 4 vectors of 16 lanes

// Activations for the AVX512-BF16 kernel (4-bit only): `planes` bf16 copies
// of a [M, K] that sum to a exactly, [planes][M][K]: one plane for bf16
// input, two (hi, lo) for fp16. The kernel also reads a itself in fp32.
struct Bf16Acts {
  const uint16_t* data;
  int64_t M;
  int planes;
};

void gptq_fused_avx2(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out);
void gptq_fused_avx512(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out);
void gptq_fused_avx512bf16(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0, int64_t n1,
                           float* out);

}  // namespace cpu
}  // namespace lowbit
