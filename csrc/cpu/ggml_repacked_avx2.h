// The 4- and 5-bit one-scale types' repacked layout (core/ggml_repack.h)
// read as it is with AVX2: a 256-bit load of a word of the layout is that word of 8 of a
// tile's 16 rows, one per lane, so a tile runs as two halves of 8 rows. Each
// 4-element group of 8 rows meets its 4 activation bytes (broadcast) in one
// maddubs + madd: the levels need no per-row decoding, no absolute value and
// no sign flip where they are unsigned, and one scale vector d_w * d_x serves
// the block's 8 groups. The arithmetic is the file layout's AVX2 matvec's
// (ggml_matmul_simd.h): fp32 lane g of row r (in FloatGemm's words,
// ggml_gemm_vnni.h) accumulates the exact int32 dot of group g times
// d_w * d_x per block, the mins (Q4_1, Q5_1) their rounded products, and the
// lanes sum in hsum's order, so the results are the same bit for bit.
// Include only inside the AVX2 unit's target pragma region.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>

#include "../core/ggml_q8.h"
#include "../core/ggml_repack.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"

namespace lowbit {
namespace cpu {
namespace {

template <ggml::Type T>
struct RepackedFloatAvx2 {
  using I = ggml::TypeInfo<T>;
  static_assert(ggml::reads_repacked_avx2(T), "a 4- or 5-bit one-scale type with a repacked layout");
  static constexpr int kRows = 8;                                            // rows per half tile: int32 lanes
  static constexpr int kHalves = ggml::repacked_fields(T).count;             // fp16 fields per block
  static constexpr int64_t kTileBlockBytes = ggml::kRepackRows * I::kBytes;  // one block of the tile's rows
  // Q5_0 and Q5_1: word 0 holds each row's 32-bit qh, element i's fifth bit at bit i.
  static constexpr bool kHighBits = T == ggml::Type::Q5_0 || T == ggml::Type::Q5_1;
  static constexpr int kQuantWords = (I::kBytes - 2 * kHalves) / 4 - kHighBits;
  // How the levels meet maddubs (unsigned x signed, pairs summed in int16):
  // IQ4_NL's signed levels as |w| against x with w's sign; Q4_0's
  // and Q5_0's as w + kBias (the nibble as stored, below 32, so no pair sum
  // saturates) against x, the dot starting from -kBias * (the 4 activations'
  // sum), which is ActRow::offset (-128 times it) shifted; the mins types'
  // levels as they are.
  static constexpr bool kSigned = T == ggml::Type::IQ4_NL;
  static constexpr int kBiasShift = T == ggml::Type::Q4_0 ? 4 : T == ggml::Type::Q5_0 ? 3 : 0;  // 128 >> shift
  static constexpr bool kOffsets = kBiasShift > 0;

  // The 4 bytes at p in every int32 lane.
  static __m256i bcast4(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }

  // Group G's levels (elements 4G .. 4G + 3 of 8 rows) from their 4-bit
  // field `nibble`, and for Q5 the rows' qh: the fifth bit of element
  // 4G + i is bit 4G + i of qh, put at bit 4 of byte i.
  template <int G>
  static __m256i level(__m256i nibble, __m256i qh) {
    if constexpr (kHighBits) {
      // Each row's qh byte G / 2 in all 4 bytes of its lane, then per byte the bit of its element.
      constexpr char c = static_cast<char>(G / 2);
      const __m256i spread = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(c, c, c, c, c + 4, c + 4, c + 4, c + 4, c + 8, c + 8,
                                                                       c + 8, c + 8, c + 12, c + 12, c + 12, c + 12, c, c,
                                                                       c, c, c + 4, c + 4, c + 4, c + 4, c + 8, c + 8,
                                                                       c + 8, c + 8, c + 12, c + 12, c + 12, c + 12));
      const __m256i bit = _mm256_set1_epi32(0x08040201 << (4 * (G % 2)));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
      return _mm256_or_si256(nibble, _mm256_and_si256(set, _mm256_set1_epi8(16)));
    } else if constexpr (T == ggml::Type::IQ4_NL) {
      const __m256i table =
          _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(LOWBIT_TABLE(ggml::kvalues_iq4nl))));
      return _mm256_shuffle_epi8(table, nibble);
    } else {
      return nibble;
    }
  }

  // Half h (rows 8h .. 8h + 7) of the tile at `tile` (`blocks` blocks)
  // against activation row a: acc[g] lane r as the file layout's matvec
  // leaves lane g of row 8h + r, acc[8] its mins.
  static void half_pass(const uint8_t* tile, int h, int64_t blocks, const ggml::ActRow& a, __m256 (&acc)[9]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const uint8_t* b = tile + bi * kTileBlockBytes;
      // The first half reads the tile's lines into L1 4 KB ahead; the
      // second, which finds them in cache, has the next tile's block brought
      // into L2 meanwhile, so that the memory never idles for a half.
      for (int64_t off = 0; off < kTileBlockBytes; off += 64) {
        if (h == 0)
          _mm_prefetch(reinterpret_cast<const char*>(b) + 4096 + off, _MM_HINT_T0);
        else
          _mm_prefetch(reinterpret_cast<const char*>(b) + blocks * kTileBlockBytes + off, _MM_HINT_T1);
      }
      const __m256 ds = _mm256_mul_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * kRows * h))),
          _mm256_set1_ps(a.d[bi]));
      const int64_t e = bi * I::kBlock;
      const auto dot = [&](__m256i levels, int g) {
        const __m256i x = bcast4(a.q + e + 4 * g);
        __m256i p;
        if constexpr (kSigned)
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(levels), _mm256_sign_epi8(x, levels)), ones);
        else
          p = _mm256_madd_epi16(_mm256_maddubs_epi16(levels, x), ones);
        if constexpr (kOffsets) p = _mm256_add_epi32(p, _mm256_srai_epi32(bcast4(a.offset + e / 4 + g), kBiasShift));
        acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), ds, acc[g]);
      };
      // Word w of the 8 rows at words + 64 w + 32 h.
      const uint8_t* words = b + 2 * ggml::kRepackRows * kHalves + 32 * h;
      const auto word = [&](int w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 64 * w)); };
      const __m256i qh = kHighBits ? word(0) : _mm256_setzero_si256();
      // Byte i of word k: element 4k + i in the low nibble, 16 + 4k + i in the high one.
      const auto both = [&](auto kc) {
        constexpr int k = decltype(kc)::value;
        const __m256i v = word(kHighBits + k);
        dot(level<k>(_mm256_and_si256(v, low4), qh), k);
        dot(level<k + 4>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), qh), k + 4);
      };
      both(std::integral_constant<int, 0>{}), both(std::integral_constant<int, 1>{});
      both(std::integral_constant<int, 2>{}), both(std::integral_constant<int, 3>{});
      if constexpr (I::kHasMin) {
        // The matvec rounds m_w * s_x, then adds; the barrier keeps the
        // compiler from contracting the two into one FMA.
        __m256 mins = _mm256_mul_ps(
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * ggml::kRepackRows + 2 * kRows * h))),
            _mm256_set1_ps(a.sum[bi]));
        __asm__("" : "+x"(mins));
        acc[8] = _mm256_add_ps(acc[8], mins);
      }
    }
  }

  // The 8 lanes of a row summed as the matvec's hsum(acc + mins) does:
  // ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)), the mins in lane 0.
  static __m256 total(const __m256 (&a)[9]) {
    const __m256 a0 = I::kHasMin ? _mm256_add_ps(a[0], a[8]) : a[0];
    const __m256 even = _mm256_add_ps(_mm256_add_ps(a0, a[4]), _mm256_add_ps(a[2], a[6]));
    const __m256 odd = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
    return _mm256_add_ps(even, odd);
  }

  // Rows r0 .. (the last whole tile before r1) against M activation rows;
  // returns the first row it did not take.
  static int64_t run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                     float* out, int64_t rows) {
    const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
    int64_t r = r0;
    for (; r + ggml::kRepackRows <= r1; r += ggml::kRepackRows)
      for (int64_t m = 0; m < M; ++m)
        for (int h = 0; h < 2; ++h) {
          __m256 acc[9];
          for (__m256& v : acc) v = _mm256_setzero_ps();
          half_pass(W + r * row_bytes, h, blocks, acts[m], acc);
          _mm256_storeu_ps(out + m * rows + r + kRows * h, total(acc));
        }
    return r;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
