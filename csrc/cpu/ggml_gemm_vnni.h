// The batched GGUF matmul of the integer-form types (the K-quants and
// IQ4_XS) on AVX-512 VNNI, with 16 weight rows across the lanes of a
// register, as llama.cpp's tiled CPU GEMM does: each block of a 16-row tile
// is decoded once into int8 levels laid out [4 elements][16 rows], and every
// activation row meets it in one vpdpbusd per 4 elements (64 products), its
// 4 activation bytes broadcast. The matvec form (ggml_matmul_simd.h) decodes
// a chunk per activation row tile and spends two instructions per 32
// products.
//
// Results equal the matvec's bit for bit: both form the same exact int32
// block sums S and C (see MatmulSimd::IntSums) and meet fp32 in the same
// FMAs, lane bi % 8 per block, the 8 lanes summed in hsum's order.
// Include only inside the AVX-512 unit's target pragma region, after
// ggml_levels_simd.h.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <utility>

#include "../core/ggml_q8.h"
#include "ggml_levels_simd.h"
#include "row_tiles.h"

namespace lowbit {
namespace cpu {
namespace {

// The 16 x 16 int32 matrix in[row] transposed: out[c] lane r = in[r] lane c.
inline void transpose16(const __m512i (&in)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // row pairs: 2 x 2 dword blocks per 128-bit lane
    t[2 * i] = _mm512_unpacklo_epi32(in[2 * i], in[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(in[2 * i], in[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + k] lane L: column 4L + k of rows 4i .. 4i+3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i p0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44), p1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i q0 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44), q1 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    out[k] = _mm512_shuffle_i32x4(p0, q0, 0x88);
    out[4 + k] = _mm512_shuffle_i32x4(p0, q0, 0xDD);
    out[8 + k] = _mm512_shuffle_i32x4(p1, q1, 0x88);
    out[12 + k] = _mm512_shuffle_i32x4(p1, q1, 0xDD);
  }
}

// Transposes 16 rows of 64-byte lines (row r at src + r * stride) into dst[c]
// = dword c of every row.
inline void transpose16_lines(const uint8_t* src, int64_t stride, __m512i* dst) {
  __m512i in[16], out[16];
  for (int r = 0; r < 16; ++r) in[r] = _mm512_loadu_si512(src + r * stride);
  transpose16(in, out);
  for (int c = 0; c < 16; ++c) _mm512_store_si512(dst + c, out[c]);
}

template <ggml::Type T>
struct GemmVnni {
  using I = ggml::TypeInfo<T>;
  using Lv = simd::Levels<T>;
  static constexpr int kRows = 16;                // weight rows per tile, one per int32 lane
  static constexpr int kSubs = I::kBlock / I::kSub;  // sub-blocks per block
  static constexpr int kGroups = I::kSub / 4;        // 4-element groups per sub-block
  // The largest unsigned level the kernel takes (signed ones go in + 128).
  static constexpr int kMaxLevel = Lv::kIntLevelMax + (Lv::kSignedIntLevels ? 128 : 0);
  // Where a dot over 16 elements (of one sub-block) fits int16, its int32
  // lanes are their own low halves: one vpdpwssd against the scale (high
  // half 0) scales and adds it, against vpmulld's two uops and an add.
  // Q2_K, Q3_K and Q4_K (in halves of its 32-element sub-blocks) take it.
  static constexpr bool kDotScales = kMaxLevel * 127 * 16 < (1 << 15);
  static constexpr int kSpanGroups = kDotScales ? 4 : kGroups;  // groups per scaled dot
  static_assert(I::kBlock == 256 && simd::has_int_scales<T>(), "the integer-form types");

  // One block of a tile, decoded: levels as unsigned bytes (signed ones
  // + 128), and per row the integer scales, the coefficients and d, k.
  struct Block {
    __m512i levels[64];  // [group of 4 elements]: row r's 4 bytes in lane r
    __m512i scale[16];   // [sub-block]: scale_s of row r in lane r
    __m512i coef[16];    // [pair of 16-element parts]: two int16 coefficients (8 used)
    __m512 d, k;
  };

  // Decodes block bi of the tile's 16 rows (from wrow, row_bytes apart).
  static void decode(const uint8_t* wrow, int64_t row_bytes, int64_t bi, Block& out) {
    alignas(64) uint8_t lv[kRows][256];
    alignas(64) int32_t sc[kRows][16], cf[kRows][16];
    alignas(64) float d[kRows], k[kRows];
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* b = wrow + r * row_bytes + bi * I::kBytes;
      store_levels(b, lv[r], std::make_integer_sequence<int, 8>{});
      simd::IntScales is;
      Lv::int_scales(b, is);
      // pairs hold scale_s in both int16 halves of lane s: sign-extend one.
      for (int v = 0; v < 2; ++v) {
        // The scale as int32, or for vpdpwssd as int16 with a zero high half.
        const __m256i s = v >= kSubs / 8 ? _mm256_setzero_si256()
                          : kDotScales   ? _mm256_and_si256(is.pairs[v], _mm256_set1_epi32(0xffff))
                                         : _mm256_srai_epi32(_mm256_slli_epi32(is.pairs[v], 16), 16);
        _mm256_store_si256(reinterpret_cast<__m256i*>(sc[r] + 8 * v), s);
      }
      __m256i c = _mm256_setzero_si256();
      if constexpr (Lv::kIntCoefs)
        c = is.coef16;
      else  // signed levels went in + 128: take 128 * scale_s * sum(x_s) back off S
        c = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(is.pairs[0], 7));
      _mm256_store_si256(reinterpret_cast<__m256i*>(cf[r]), c);
      _mm256_store_si256(reinterpret_cast<__m256i*>(cf[r] + 8), _mm256_setzero_si256());  // unused
      d[r] = is.d;
      k[r] = is.k;
    }
    for (int q = 0; q < 4; ++q) transpose16_lines(&lv[0][64 * q], 256, out.levels + 16 * q);
    transpose16_lines(reinterpret_cast<const uint8_t*>(sc), 64, out.scale);
    transpose16_lines(reinterpret_cast<const uint8_t*>(cf), 64, out.coef);
    out.d = _mm512_load_ps(d);
    out.k = _mm512_load_ps(k);
  }

  static inline __m256i unsigned_levels(__m256i w) {
    return Lv::kSignedIntLevels ? _mm256_add_epi8(w, _mm256_set1_epi8(-128)) : w;
  }
  template <int... C>
  static void store_levels(const uint8_t* b, uint8_t* dst, std::integer_sequence<int, C...>) {
    (_mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * C), unsigned_levels(simd::int_levels<T, C>(b))), ...);
  }

  // The 4 bytes at p in every int32 lane.
  static inline __m512i bcast(const void* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }

  // Block bi of MT activation rows against the decoded block, each level
  // load serving MT rows: lane r of acc[m] += S * (d_r * d_x), then
  // += C * (k_r * d_x), MatmulSimd::IntSums' step.
  template <int MT>
  static inline void block_step(const Block& w, const ggml::ActRow* a, int64_t bi, __m512* const (&acc)[MT]) {
    const int64_t e = bi * I::kBlock;
    __m512i s[MT], c[MT];
    for (int m = 0; m < MT; ++m) s[m] = c[m] = _mm512_setzero_si512();
    for (int g0 = 0; g0 < 64; g0 += kSpanGroups) {
      __m512i t[MT];
      for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
      for (int g = g0; g < g0 + kSpanGroups; ++g)
        for (int m = 0; m < MT; ++m) t[m] = _mm512_dpbusd_epi32(t[m], w.levels[g], bcast(a[m].q + e + 4 * g));
      const __m512i scale = w.scale[g0 / kGroups];
      for (int m = 0; m < MT; ++m)
        s[m] = kDotScales ? _mm512_dpwssd_epi32(s[m], t[m], scale) : _mm512_add_epi32(s[m], _mm512_mullo_epi32(t[m], scale));
    }
    for (int j = 0; j < 8; ++j)
      for (int m = 0; m < MT; ++m) c[m] = _mm512_dpwssd_epi32(c[m], w.coef[j], bcast(a[m].isum + bi * 16 + 2 * j));
    for (int m = 0; m < MT; ++m) {
      const __m512 dx = _mm512_set1_ps(a[m].d[bi]);
      if constexpr (Lv::kIntCoefs) {
        *acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m]), _mm512_mul_ps(w.d, dx), *acc[m]);
        *acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c[m]), _mm512_mul_ps(w.k, dx), *acc[m]);
      } else {
        *acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s[m], c[m])), _mm512_mul_ps(w.d, dx), *acc[m]);
      }
    }
  }

  struct Scratch {
    __m512* acc;
    Block* block;
    explicit Scratch(int64_t M)
        : acc(static_cast<__m512*>(_mm_malloc(M * 8 * sizeof(__m512), 64))),
          block(static_cast<Block*>(_mm_malloc(sizeof(Block), 64))) {}
    ~Scratch() { _mm_free(acc), _mm_free(block); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
  };

  // Rows r0 .. r0 + 16 * tiles against all M activation rows; returns the
  // first row it did not take (the matvec form takes the rest).
  static int64_t run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                     float* out, int64_t rows) {
    const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
    if (r1 - r0 < kRows) return r0;
    // The tile's fp32 sums, [m][block % 8][row], and its decoded block.
    Scratch scratch(M);
    int64_t r = r0;
    for (; r + kRows <= r1; r += kRows) {
      __m512* acc = scratch.acc;
      for (int64_t i = 0; i < M * 8; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t bi = 0; bi < blocks; ++bi) {
        decode(W + r * row_bytes, row_bytes, bi, *scratch.block);
        for_row_tiles(M, [&](auto mt, int64_t m0) {
          constexpr int MT = decltype(mt)::value;
          __m512* a[MT];
          for (int m = 0; m < MT; ++m) a[m] = acc + (m0 + m) * 8 + bi % 8;
          block_step<MT>(*scratch.block, acts + m0, bi, a);
        });
      }
      for (int64_t m = 0; m < M; ++m) {  // hsum's order: ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7))
        const __m512* a = acc + m * 8;
        const __m512 even = _mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6]));
        const __m512 odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
        _mm512_storeu_ps(out + m * rows + r, _mm512_add_ps(even, odd));
      }
    }
    return r;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
