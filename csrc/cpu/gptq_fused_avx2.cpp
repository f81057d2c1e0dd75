// gptq_gemm's fused small-M kernel (gptq_fused_simd.h), GPTQ tile
// dequantizer (gptq_dequant_simd.h) and gptq_gemm_a8's kernel
// (gptq_a8_simd.h) compiled for AVX2 + FMA.
// Every non-SIMD header comes before the target pragma, so that no inline
// function shared with other translation units is compiled for AVX2.
#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "isa.h"

#if LOWBIT_X86_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "gptq_a8_simd.h"
#include "gptq_dequant_simd.h"
#include "gptq_fused_simd.h"
#include "vec_avx2.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx2(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  run_fused_simd<VecAvx2>(bits, a, M, w, n0, n1, out);
}

void gptq_a8_avx2(int bits, const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1,
                  float* out) {
  run_a8_simd<A8Avx2>(bits, x, M, w, n0, n1, out);
}

void gptq_dequant_avx2(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                       ScaleType out_type, void* out, int64_t ldo) {
  dequant_simd_to<VecAvx2>(bits, w, k0, k1, n0, n1, out_type, out, ldo);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
