// decode_attention's fp32 kernel compiled for AVX2 + FMA (decode_kernels.h).
// Every non-SIMD header comes before the target pragma, so no inline
// function shared with other units gets AVX2 code.
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "../core/ggml_blocks.h"
#include "decode_kernels.h"
#include "isa.h"

#if LOWBIT_X86_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "ggml_float_simd.h"
#include "softmax.h"

namespace lowbit {
namespace cpu {

// decode_ops.cpp's attend_group for fp32 heads of a multiple of 32 values:
// each key row loaded once for up to 4 queries' dot products (independent
// sums), each value row into 4 registers of sums per 32 values of a query.
void decode_attend_group_avx2(const float* queries, const float* key_rows, const float* value_rows, float* out,
                              int64_t groups, int64_t keys, int64_t dim, float scale, float* scratch) {
  float* scores = scratch;
  for (int64_t j0 = 0; j0 < groups; j0 += 4) {
    const int64_t n = std::min<int64_t>(4, groups - j0);
    for (int64_t p = 0; p < keys; ++p) {
      __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      const float* key = key_rows + p * dim;
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 k8 = _mm256_loadu_ps(key + i);
        for (int64_t j = 0; j < n; ++j) {
          sums[j] = _mm256_fmadd_ps(_mm256_loadu_ps(queries + (j0 + j) * dim + i), k8, sums[j]);
        }
      }
      for (int64_t j = 0; j < n; ++j) scores[(j0 + j) * keys + p] = lane_sum(sums[j]) * scale;
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    float* s = scores + j * keys;
    const __m256 inv = _mm256_set1_ps(1.0f / exponentiate(s, keys));
    for (int64_t i0 = 0; i0 < dim; i0 += 32) {
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t p = 0; p < keys; ++p) {
        const __m256 w = _mm256_set1_ps(s[p]);
        const float* row = value_rows + p * dim + i0;
        for (int r = 0; r < 4; ++r) acc[r] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * r), acc[r]);
      }
      for (int r = 0; r < 4; ++r) _mm256_storeu_ps(out + j * dim + i0 + 8 * r, _mm256_mul_ps(acc[r], inv));
    }
  }
}

}  // namespace cpu
}  // namespace lowbit

#pragma GCC pop_options
#endif
