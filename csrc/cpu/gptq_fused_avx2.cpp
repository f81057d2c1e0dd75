// gptq_gemm's fused small-M kernel compiled for AVX2 + FMA (gptq_fused_simd.h).
// Every non-SIMD header comes before the target pragma, so that no inline
// function shared with other translation units is compiled for AVX2.
#include <stdint.h>

#include <algorithm>
#include <utility>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "gptq_fused_simd.h"
#include "vec_avx2.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx2(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  run_fused_simd<VecAvx2>(bits, a, M, w, n0, n1, out);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
