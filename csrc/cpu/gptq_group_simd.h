// read_group (gptq_kernels.h) eight columns at a time with AVX2 and F16C, for
// the fused SIMD kernels, which read every group's parameters once per task:
// the scalar unpacking and fp16 conversion cost as much as a 4-bit matvec.
// Same values as read_group (fp16 and bf16 widen exactly). Also the group and
// row-tile loop those kernels share. Include only inside an AVX2 + F16C (or
// wider) target pragma region, after every non-SIMD header.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "gptq_kernels.h"
#include "row_tiles.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma (see gptq_fused_simd.h).
namespace {

// Group g's zero points and fp32 scales for columns [n0, n1), n0 and n1
// multiples of 8.
template <int B>
inline void read_group_simd(const GptqWeight& w, int64_t g, int64_t n0, int64_t n1, int32_t* z, float* s) {
  // The packed words of a row are one little-endian bit stream (3-bit fields
  // straddle words within it), so columns n .. n+7, n a multiple of 8, are
  // the 8B bits from byte nB / 8: B whole bytes.
  const uint8_t* zrow = reinterpret_cast<const uint8_t*>(w.params.qzeros + g * (w.N * B / 32));
  const __m256i offset = _mm256_set1_epi32(w.params.v2_format ? 0 : 1);
  const __m256i mask = _mm256_set1_epi32((1 << B) - 1);
  const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
  for (int64_t n = n0; n < n1; n += 8) {
    __m256i fields;
    if constexpr (B == 8) {
      fields = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zrow + n)));
    } else {
      // Assembled in a register: a 3-byte memcpy compiles to narrow stores
      // and a wide reload that misses store forwarding, which cost 3-bit
      // kernels a sixth of their time.
      const uint8_t* bytes = zrow + n * B / 8;
      uint32_t word = 0;
      for (int b = 0; b < B; ++b) word |= static_cast<uint32_t>(bytes[b]) << (8 * b);
      fields = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts), mask);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(z + (n - n0)), _mm256_add_epi32(fields, offset));
  }
  const int64_t at = g * w.N;
  for (int64_t n = n0; n < n1; n += 8) {
    __m256 v;
    if (w.params.scale_type == ScaleType::kF32) {
      v = _mm256_loadu_ps(static_cast<const float*>(w.params.scales) + at + n);
    } else {
      const __m128i h =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w.params.scales) + at + n));
      v = w.params.scale_type == ScaleType::kF16 ? _mm256_cvtph_ps(h)
                                                 : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    _mm256_storeu_ps(s + (n - n0), v);
  }
}

// The loop of a fused kernel over columns [n0, n1) of out [M, N]: zeroes
// them, then for every group reads its zero points z and scales s for those
// columns and calls group(g, z, s), which adds the group's share to out.
template <int B, class Group>
inline void for_groups(const GptqWeight& w, int64_t M, int64_t n0, int64_t n1, float* out, Group&& group) {
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * w.N + n0, out + m * w.N + n1, 0.0f);
  const int64_t groups = (w.K + w.group_of.group_size - 1) / w.group_of.group_size;
  std::vector<int32_t> z(n1 - n0);
  std::vector<float> s(n1 - n0);
  const int64_t scale_bytes = w.params.scale_type == ScaleType::kF32 ? 4 : 2;
  for (int64_t g = 0; g < groups; ++g) {
    // The next group's zeros and scales lie a row (N columns) on, a stride
    // the hardware prefetcher does not follow: fetched into L2 during this group.
    if (g + 1 < groups) {
      const GroupRow next = group_row<B>(w, g + 1);
      const char* zrow = reinterpret_cast<const char*>(next.zeros);
      const char* srow = static_cast<const char*>(next.scales);
      for (int64_t b = n0 * B / 8 / 64 * 64; b < n1 * B / 8; b += 64) __builtin_prefetch(zrow + b, 0, 2);
      for (int64_t b = n0 * scale_bytes / 64 * 64; b < n1 * scale_bytes; b += 64) __builtin_prefetch(srow + b, 0, 2);
    }
    read_group_simd<B>(w, g, n0, n1, z.data(), s.data());
    group(g, static_cast<const int32_t*>(z.data()), static_cast<const float*>(s.data()));
  }
}

// for_groups with tile(std::integral_constant<int, MT>, g, m0, z, s) called
// for each tile of MT <= kFusedMaxRows activation rows m0 .. m0+MT.
template <int B, class Tile>
inline void for_group_row_tiles(const GptqWeight& w, int64_t M, int64_t n0, int64_t n1, float* out, Tile&& tile) {
  static_assert(kFusedMaxRows == kMaxRowTile, "for_row_tiles' tiles");
  for_groups<B>(w, M, n0, n1, out, [&](int64_t g, const int32_t* z, const float* s) {
    for_row_tiles(M, [&](auto mt, int64_t m0) { tile(mt, g, m0, z, s); });
  });
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
