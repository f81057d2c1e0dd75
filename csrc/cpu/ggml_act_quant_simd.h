// Activation blocks quantized to Q8_0 / Q8_1 / Q8_K with AVX2, bit for bit
// what the scalar quantize_act_block (core/ggml_q8.h) computes, whose roundf
// does not vectorize. Include only inside the AVX2 unit's target pragma region.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "../core/float_bits.h"
#include "../core/ggml_q8.h"

namespace lowbit {
namespace cpu {
namespace {

inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

// v * 0: +-0 where v is finite, NaN where it is NaN or Inf. OR-ed over a
// block (the zeros' bits add nothing), has_nan finds any non-finite element.
inline __m256 nan_where_non_finite(__m256 v) { return _mm256_mul_ps(v, _mm256_setzero_ps()); }
inline bool has_nan(__m256 v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }

// C's roundf (halves away from zero): trunc(t), plus t's sign where the
// dropped fraction (exact: |t| < 2^23 here) is at least one half.
inline __m256i round_half_away(__m256 t) {
  const __m256 r = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256 up = _mm256_cmp_ps(abs_ps(_mm256_sub_ps(t, r)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
  const __m256 one = _mm256_or_ps(_mm256_and_ps(t, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(1.0f));
  return _mm256_cvttps_epi32(_mm256_add_ps(r, _mm256_and_ps(up, one)));
}

// 32 int32 levels (in [-128, 127]) as 32 int8 in element order: the packs
// work per 128-bit half, the permute puts the halves' quarters back.
inline void store_levels(const __m256i (&v)[4], int8_t* q) {
  const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// ActRow::offset of 32 quantized activations: -128 * (q[4i] + .. + q[4i+3]).
inline void act_offsets(const int8_t* q, int32_t* offset) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), v), _mm256_set1_epi16(1));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(offset), _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sums, 7)));
}

// One Q8_0 / Q8_1 block of 32; with isum, also its sum(q) (ActRow::isum).
inline void quantize_q8_0_block(const float* x, int8_t* q, float* d, float* sum, int16_t* isum) {
  __m256 v[4], amax = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(abs_ps(v[i]), amax);
    probe = _mm256_or_ps(probe, nan_where_non_finite(v[i]));
  }
  if (has_nan(probe)) {
    ggml::non_finite_act_block<ggml::Act::Q8_0>(q, d, sum);
    if (isum) isum[0] = 0;
    return;
  }
  const float dd = hmax_ps(amax) / 127.0f;
  const __m256 id = _mm256_set1_ps(dd != 0.0f ? 1.0f / dd : 0.0f);
  __m256i l[4];
  for (int i = 0; i < 4; ++i) l[i] = round_half_away(_mm256_mul_ps(v[i], id));
  store_levels(l, q);
  const int32_t s = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(l[0], l[1]), _mm256_add_epi32(l[2], l[3])));
  d[0] = fp16_to_fp32(fp32_to_fp16(dd));
  sum[0] = fp16_to_fp32(fp32_to_fp16(static_cast<float>(s) * dd));
  if (isum) isum[0] = static_cast<int16_t>(s);  // |s| <= 32 * 127: exact
}

// One Q8_K block of 256: scaled by the signed element of largest magnitude
// (the first of equals), rounded to nearest even, clamped to 127, sums per 16.
inline void quantize_q8_k_block(const float* x, int8_t* q, float* d, float* sum) {
  __m256 amax = _mm256_setzero_ps(), probe = _mm256_setzero_ps();
  for (int i = 0; i < 32; ++i) {
    const __m256 v = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(abs_ps(v), amax);
    probe = _mm256_or_ps(probe, nan_where_non_finite(v));
  }
  if (has_nan(probe)) return ggml::non_finite_act_block<ggml::Act::Q8_K>(q, d, sum);
  const float a = hmax_ps(amax);
  if (a == 0.0f) {
    d[0] = 0.0f;
    for (int i = 0; i < 256; i += 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_setzero_si256());
    for (int j = 0; j < 16; ++j) sum[j] = 0.0f;
    return;
  }
  float max = 0.0f;
  for (int i = 0; i < 32; ++i) {
    const int hits = _mm256_movemask_ps(_mm256_cmp_ps(abs_ps(_mm256_loadu_ps(x + 8 * i)), _mm256_set1_ps(a), _CMP_EQ_OQ));
    if (hits) {
      max = x[8 * i + __builtin_ctz(hits)];
      break;
    }
  }
  const float iscale = -127.0f / max;
  const __m256 s = _mm256_set1_ps(iscale);
  for (int c = 0; c < 8; ++c) {  // 32 elements: sub-blocks 2c and 2c + 1
    __m256i l[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + 32 * c + 8 * i), s);
      l[i] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)),
                              _mm256_set1_epi32(127));
    }
    store_levels(l, q + 32 * c);
    sum[2 * c] = static_cast<float>(hsum_epi32(_mm256_add_epi32(l[0], l[1])));
    sum[2 * c + 1] = static_cast<float>(hsum_epi32(_mm256_add_epi32(l[2], l[3])));
  }
  d[0] = 1.0f / iscale;
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
