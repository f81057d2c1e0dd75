// decode_attention's kernel for fp32, bf16 and fp16 rows, compiled for AVX2 +
// FMA + F16C (decode_kernels.h).
// Every non-SIMD header comes before the target pragma, so no inline
// function shared with other units gets AVX2 code.
#include <stdint.h>
#include <string.h>

#include <algorithm>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_types.h"
#include "decode_kernels.h"
#include "gptq_kernels.h"
#include "isa.h"

#if LOWBIT_X86_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "ggml_act_quant_simd.h"
#include "ggml_float_simd.h"
#include "softmax.h"
#include "vec_avx2.h"

namespace lowbit {
namespace cpu {
// Internal linkage: a shared symbol could be replaced by another unit's copy
// compiled for another ISA.
namespace {

// Lane r of the result: the sum of v[r]'s eight lanes.
inline __m256 lane_sums8(const __m256 v[8]) {
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

// softmax.h's exp_nonpositive in eight lanes: the same steps, each an FMA
// where the scalar form's multiply and add contract to one here.
inline __m256 exp_nonpositive8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 round = _mm256_set1_ps(12582912.0f);
  const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504f), round), round);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) {
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  }
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// softmax.h's exponentiate in eight lanes: s into exp(s - max(s)), in
// place; returns their sum (the sink's exponent added, where there is one).
inline float exponentiate8(float* s, int64_t keys, const float* sink) {
  __m256 max8 = _mm256_set1_ps(s[0]);
  int64_t p = 0;
  for (; p + 8 <= keys; p += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + p));
  float top = hmax_ps(max8);
  for (; p < keys; ++p) top = std::max(top, s[p]);
  if (sink != nullptr) top = std::max(top, *sink);
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  p = 0;
  for (; p + 8 <= keys; p += 8) {
    const __m256 e = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(s + p), top8));
    _mm256_storeu_ps(s + p, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = lane_sum(sum8);
  for (; p < keys; ++p) total += (s[p] = exp_nonpositive(s[p] - top));
  return sink != nullptr ? total + exp_nonpositive(*sink - top) : total;
}

// sums[0, 8 R) += s[k] * rows[k, 0:8 R) over the rows k in order (rows of
// T, `stride` bytes apart), in R independent registers; `first`: sums start at zero.
template <int R, ggml::Type T>
inline void add_weighted_rows(const float* s, const uint8_t* rows, int64_t n, int64_t stride, float* sums,
                              bool first) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(sums + 8 * r);
  for (int64_t k = 0; k < n; ++k) {
    const __m256 w = _mm256_broadcast_ss(s + k);
    const uint8_t* row = rows + k * stride;
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(w, load_float8<T>(row, 8 * r), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(sums + 8 * r, acc[r]);
}

// Value rows per block: every query of the group and every 64 values of a
// row take a block while it is in L1 (64 rows of 128 values: 32 KB). Each
// sum still adds its rows in order, so blocks change no result.
constexpr int64_t kValueBlock = 64;

// decode_ops.cpp's attend_group for heads of a multiple of 32 values.
// Every loop keeps eight independent sums, which an FMA's latency needs to
// run at its throughput: the scores take blocks of eight keys (the block's
// rows stay in L1 for every query of the group, and one horizontal
// reduction per block gives its eight scores), the weighted sums of values
// eight registers of a query's output (64 values) per pass over the rows.
// 16-bit rows are widened to fp32 as they are loaded (load_float8).
template <ggml::Type T>
void attend_group(const float* queries, const uint8_t* key_rows, const uint8_t* value_rows, uint8_t* out,
                  int64_t groups, int64_t keys, int64_t dim, float scale, float softcap, const float* sinks,
                  float* scratch) {
  const int64_t stride = dim * ggml::TypeInfo<T>::kBytes;  // bytes per row
  float* scores = scratch;                  // [groups, keys]
  float* totals = scores + groups * keys;   // [groups]: the softmax divisors
  // [groups, dim]: the fp32 sums of 16-bit heads, rounded once at the end.
  float* sums = T == ggml::Type::F32 ? reinterpret_cast<float*>(out) : totals + groups;
  const __m256 vscale = _mm256_set1_ps(scale);
  int64_t p = 0;
  for (; p + 8 <= keys; p += 8) {
    const uint8_t* block = key_rows + p * stride;
    for (int64_t j = 0; j < groups; ++j) {
      const float* q = queries + j * dim;
      __m256 dots[8];
      for (int r = 0; r < 8; ++r) dots[r] = _mm256_setzero_ps();
      for (int64_t i = 0; i < dim; i += 8) {
        const __m256 q8 = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; ++r) dots[r] = _mm256_fmadd_ps(q8, load_float8<T>(block + r * stride, i), dots[r]);
      }
      _mm256_storeu_ps(scores + j * keys + p, _mm256_mul_ps(lane_sums8(dots), vscale));
    }
  }
  for (; p < keys; ++p) {  // the last keys short of a block
    const uint8_t* key = key_rows + p * stride;
    for (int64_t j = 0; j < groups; ++j) {
      __m256 dot = _mm256_setzero_ps();
      for (int64_t i = 0; i < dim; i += 8) {
        dot = _mm256_fmadd_ps(_mm256_loadu_ps(queries + j * dim + i), load_float8<T>(key, i), dot);
      }
      scores[j * keys + p] = lane_sum(dot) * scale;
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    if (softcap > 0.0f) soft_cap(scores + j * keys, keys, softcap);
    totals[j] = exponentiate8(scores + j * keys, keys, sinks != nullptr ? sinks + j : nullptr);
  }
  for (int64_t k0 = 0; k0 < keys; k0 += kValueBlock) {
    const int64_t n = std::min(kValueBlock, keys - k0);
    for (int64_t j = 0; j < groups; ++j) {
      for (int64_t i0 = 0; i0 < dim; i0 += 64) {
        const float* s = scores + j * keys + k0;
        const uint8_t* rows = value_rows + k0 * stride + i0 * ggml::TypeInfo<T>::kBytes;
        if (dim - i0 >= 64) {
          add_weighted_rows<8, T>(s, rows, n, stride, sums + j * dim + i0, k0 == 0);
        } else {  // the last 32 values
          add_weighted_rows<4, T>(s, rows, n, stride, sums + j * dim + i0, k0 == 0);
        }
      }
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    const __m256 inv = _mm256_set1_ps(1.0f / totals[j]);
    float* head = sums + j * dim;
    uint16_t* head16 = reinterpret_cast<uint16_t*>(out) + j * dim;
    for (int64_t i = 0; i < dim; i += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(head + i), inv);
      if constexpr (T == ggml::Type::F32) _mm256_storeu_ps(head + i, v);
      if constexpr (T == ggml::Type::BF16) VecAvx2::store_bf16(head16 + i, v);
      if constexpr (T == ggml::Type::F16) VecAvx2::store_f16(head16 + i, v);
    }
  }
}

}  // namespace

void decode_attend_group_avx2(ggml::Type type, const float* queries, const void* key_rows, const void* value_rows,
                              void* out, int64_t groups, int64_t keys, int64_t dim, float scale, float softcap,
                              const float* sinks, float* scratch) {
  const auto* k = static_cast<const uint8_t*>(key_rows);
  const auto* v = static_cast<const uint8_t*>(value_rows);
  auto* o = static_cast<uint8_t*>(out);
  switch (type) {
    case ggml::Type::F32:
      return attend_group<ggml::Type::F32>(queries, k, v, o, groups, keys, dim, scale, softcap, sinks, scratch);
    case ggml::Type::BF16:
      return attend_group<ggml::Type::BF16>(queries, k, v, o, groups, keys, dim, scale, softcap, sinks, scratch);
    case ggml::Type::F16:
      return attend_group<ggml::Type::F16>(queries, k, v, o, groups, keys, dim, scale, softcap, sinks, scratch);
    default: return;  // decode_ops.cpp passes only these
  }
}

}  // namespace cpu
}  // namespace lowbit

#pragma GCC pop_options
#endif
