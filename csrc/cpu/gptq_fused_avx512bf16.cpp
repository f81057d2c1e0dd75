// gptq_gemm's fused kernel for bf16 / fp16 activations (gptq_fused_bf16.h),
// and the tile dequantizer into bf16 planes (gptq_dequant_simd.h), compiled
// for AVX-512 with BF16. Every
// non-SIMD header comes before the target pragma, so that no inline function
// shared with other translation units is compiled for AVX-512.
#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "isa.h"

#if LOWBIT_X86_AVX512
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi2,avx2,fma,f16c")
// GCC 12 flags the deliberately undefined vectors inside its own AVX-512
// intrinsics (_mm512_undefined_*) as (maybe-)uninitialized; a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "gptq_dequant_simd.h"
#include "gptq_fused_bf16.h"
#include "vec_avx512.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx512bf16(int bits, const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0,
                           int64_t n1, float* out) {
  run_fused_bf16(bits, a, a16, w, n0, n1, out);
}

void gptq_dequant_bf16x2_avx512bf16(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                                    uint16_t* hi, uint16_t* lo, int64_t ldo) {
  run_dequant_simd<VecAvx512>(bits, w, k0, k1, n0, n1, [&](int64_t row, int64_t col, __m512 v) {
    const __m256bh h = _mm512_cvtneps_pbh(v);
    const __m512 h32 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
    const __m256bh l = _mm512_cvtneps_pbh(_mm512_sub_ps(v, h32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + row * ldo + col), (__m256i)h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + row * ldo + col), (__m256i)l);
  });
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
