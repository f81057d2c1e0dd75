// gptq_gemm's fused small-M kernel for 2-, 3- and 4-bit weights and bf16 / fp16
// activations, compiled for AVX-512 with BF16 (gptq_fused_bf16.h). Every
// non-SIMD header comes before the target pragma, so that no inline function
// shared with other translation units is compiled for AVX-512.
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"

#if defined(__x86_64__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx512vbmi2,avx2,fma,f16c")
// GCC 12 flags the deliberately undefined vectors inside its own AVX-512
// intrinsics (_mm512_undefined_*) as (maybe-)uninitialized; a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include "gptq_fused_bf16.h"

namespace lowbit {
namespace cpu {

void gptq_fused_avx512bf16(int bits, const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0,
                           int64_t n1, float* out) {
  run_fused_bf16(bits, a, a16, w, n0, n1, out);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
