// gptq_gemm's fused small-M kernel (gptq_fused_simd.h), GPTQ tile
// dequantizer (gptq_dequant_simd.h) and gptq_gemm_a8's kernel
// (gptq_a8_simd.h) compiled for AVX-512 (F, BW, VL, DQ, VNNI).
// Every non-SIMD header comes before the target pragma, so that no inline
// function shared with other translation units is compiled for AVX-512.
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
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// GCC 12 flags the deliberately undefined vectors inside its own AVX-512
// intrinsics (_mm512_undefined_*) as (maybe-)uninitialized; a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
// GCC 12 folds identical instantiations of FusedSimd<V, 3>::field and
// FusedSimd<V, 4>::field (the same code for field 0) and then checks the
// 4-bit caller's [1][U] words against the 3-bit signature's [3][U]: only
// words[0] is read, so this too is a false positive.
#pragma GCC diagnostic ignored "-Warray-bounds"
#include "gptq_a8_simd.h"
#include "gptq_dequant_simd.h"
#include "gptq_fused_simd.h"
#include "vec_avx512.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx512(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  run_fused_simd<VecAvx512>(bits, a, M, w, n0, n1, out);
}

void gptq_a8_avx512(int bits, const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1,
                    float* out) {
  run_a8_simd<A8Avx512>(bits, x, M, w, n0, n1, out);
}

void gptq_dequant_avx512(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                       ScaleType out_type, void* out, int64_t ldo) {
  dequant_simd_to<VecAvx512>(bits, w, k0, k1, n0, n1, out_type, out, ldo);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
