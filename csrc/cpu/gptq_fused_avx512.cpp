// gptq_gemm's fused small-M kernel compiled for AVX-512 (F, BW, VL, DQ, VNNI) (gptq_fused_simd.h).
// Every non-SIMD header comes before the target pragma, so that no inline
// function shared with other translation units is compiled for AVX-512.
#include <stdint.h>

#include <algorithm>
#include <utility>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
// GCC 12 flags the deliberately undefined vectors inside its own AVX-512
// intrinsics (_mm512_undefined_*) as (maybe-)uninitialized; a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "gptq_fused_simd.h"
#include "vec_avx512.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx512(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  run_fused_simd<VecAvx512>(bits, a, M, w, n0, n1, out);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
