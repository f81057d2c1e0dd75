// X @ W.T for the float weight types (F32, F16, BF16): each weight converted
// to fp32 as it is loaded and multiplied with FMA, no copy of W. Included in
// ggml_avx2.cpp inside its target pragma region; the AVX-512 CPUs run it too,
// since a matvec over 2- or 4-byte weights is bound by memory, not by the
// vector width. Sums run in fp32 over eight lanes per row (several partial
// sums in the matvec, added in a fixed order), added across lanes at the end
// of the row: the same for any thread count.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>

#include "../core/ggml_blocks.h"

namespace lowbit {
namespace cpu {
namespace {

// Eight weights from element i of a row, in fp32.
template <ggml::Type T>
inline __m256 load_float8(const uint8_t* row, int64_t i) {
  if constexpr (T == ggml::Type::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i));
    if constexpr (T == ggml::Type::F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

inline float lane_sum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// R weight rows from `row0` against A activation rows from `x0`: R x A sums,
// each weight vector loaded once for the A rows (registers: R * A + A + 1).
template <ggml::Type T, int R, int A>
inline void float_tile(const uint8_t* row0, int64_t row_bytes, int64_t n, const float* x0, float* out0,
                       int64_t rows) {
  __m256 acc[R][A];
  for (int j = 0; j < R; ++j)
    for (int a = 0; a < A; ++a) acc[j][a] = _mm256_setzero_ps();
  const int64_t n8 = n / 8 * 8;
  for (int64_t i = 0; i < n8; i += 8) {
    __m256 x[A];
    for (int a = 0; a < A; ++a) x[a] = _mm256_loadu_ps(x0 + a * n + i);
    for (int j = 0; j < R; ++j) {
      const __m256 w = load_float8<T>(row0 + j * row_bytes, i);
      for (int a = 0; a < A; ++a) acc[j][a] = _mm256_fmadd_ps(w, x[a], acc[j][a]);
    }
  }
  for (int j = 0; j < R; ++j) {
    for (int a = 0; a < A; ++a) {
      float s = lane_sum(acc[j][a]);
      for (int64_t i = n8; i < n; ++i)
        s += ggml::Codec<T>::value(row0 + j * row_bytes + i * ggml::TypeInfo<T>::kBytes) * x0[a * n + i];
      out0[a * rows + j] = s;
    }
  }
}

// The longest rows the matvec takes one at a time: their fp32 activation
// row (24 KB) stays in L1 while it meets every weight row.
constexpr int64_t kMatvecRowMaxN = 6144;

// One activation row x against rows [r0, r1), each row alone over 8
// accumulators (FMA latency): W is read as one run in the order it lies in
// memory, which the prefetchers follow better than the four interleaved
// streams of 4-row tiles where rows are short.
template <ggml::Type T>
void float_matvec_rows(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const float* x, float* out) {
  constexpr int U = 8;
  const int64_t row_bytes = n * ggml::TypeInfo<T>::kBytes;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = W + r * row_bytes;
    __m256 acc[U];
    for (int u = 0; u < U; ++u) acc[u] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * U <= n; i += 8 * U)
      for (int u = 0; u < U; ++u)
        acc[u] = _mm256_fmadd_ps(load_float8<T>(row, i + 8 * u), _mm256_loadu_ps(x + i + 8 * u), acc[u]);
    for (; i + 8 <= n; i += 8) acc[0] = _mm256_fmadd_ps(load_float8<T>(row, i), _mm256_loadu_ps(x + i), acc[0]);
    for (int u = U / 2; u > 0; u /= 2)
      for (int v = 0; v < u; ++v) acc[v] = _mm256_add_ps(acc[v], acc[v + u]);
    float s = lane_sum(acc[0]);
    for (; i < n; ++i) s += ggml::Codec<T>::value(row + i * ggml::TypeInfo<T>::kBytes) * x[i];
    out[r] = s;
  }
}

// out[m * rows + r] for r in [r0, r1), m < M: one activation row of short
// rows by float_matvec_rows, else tiles of 4 rows x 2 activation rows.
template <ggml::Type T>
void mul_mat_float_rows(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const float* X, int64_t M, float* out,
                        int64_t rows) {
  if (M == 1 && n <= kMatvecRowMaxN) return float_matvec_rows<T>(W, r0, r1, n, X, out);
  const int64_t row_bytes = n * ggml::TypeInfo<T>::kBytes;
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    int64_t m = 0;
    for (; m + 2 <= M; m += 2) float_tile<T, 4, 2>(W + r * row_bytes, row_bytes, n, X + m * n, out + m * rows + r, rows);
    if (m < M) float_tile<T, 4, 1>(W + r * row_bytes, row_bytes, n, X + m * n, out + m * rows + r, rows);
  }
  for (; r < r1; ++r)
    for (int64_t m = 0; m < M; ++m) float_tile<T, 1, 1>(W + r * row_bytes, row_bytes, n, X + m * n, out + m * rows + r, rows);
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
