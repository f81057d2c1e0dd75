// The batched GGUF matmul on AVX-512 VNNI, with 16 weight rows across the
// lanes of a register, as llama.cpp's tiled CPU GEMM does: each block of a
// 16-row tile is decoded once into int8 levels laid out [4 elements][16
// rows], and every activation row meets it in one vpdpbusd per 4 elements
// (64 products), its 4 activation bytes broadcast. The matvec form
// (ggml_matmul_simd.h) decodes a chunk per activation row tile.
//
// Two forms, one driver (GemmVnni):
// - IntGemm, the integer-form types (the K-quants and IQ4_XS): each block's
//   exact int32 sums S and C (see MatmulSimd::IntSums) meet fp32 in the
//   matvec's FMAs, lane bi % 8 per block.
// - FloatGemm, the types of one scale per 32-element block (the legacy
//   types, IQ4_NL, MXFP4): each 4-element dot, exact in int32, is scaled by
//   d_w * d_x into fp32 lane (its place in the block), as the matvec's
//   vector lanes are, and the mins (Q4_1, Q5_1) sum apart as there.
// Either way every fp32 operation is the matvec's, in its order, and the 8
// lanes sum in hsum's order, so results equal the matvec's bit for bit.
// RepackedIntGemm runs IntGemm's arithmetic, at every M, over a weight whose
// 16-row tiles are stored the way this GEMM lays them out
// (core/ggml_repack.h), with nothing left to transpose; RepackedFloatGemm
// reads the one-scale types' tiles so, but sums each block's dot in int32
// before fp32 (results to fp32 rounding of the matvec's).
// Include only inside the AVX-512 unit's target pragma region, after
// ggml_levels_simd.h.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "../core/ggml_q8.h"
#include "../core/ggml_repack.h"
#include "ggml_levels_simd.h"
#include "ggml_repacked_tiles.h"
#include "row_tiles.h"
#include "static_for.h"

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

// The 4 bytes at p in every int32 lane.
inline __m512i bcast4(const void* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// The 8 fp32 lanes of a row summed in hsum's order: ((0 + 4) + (2 + 6)) +
// ((1 + 5) + (3 + 7)).
inline __m512 lane_order_sum(__m512 a0, const __m512* a) {
  const __m512 even = _mm512_add_ps(_mm512_add_ps(a0, a[4]), _mm512_add_ps(a[2], a[6]));
  const __m512 odd = _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7]));
  return _mm512_add_ps(even, odd);
}

// Weight rows per GEMM tile, one per int32 lane of a 512-bit register.
constexpr int kGemmTileRows = 16;

template <ggml::Type T>
struct IntGemm {
  using I = ggml::TypeInfo<T>;
  using Lv = simd::Levels<T>;
  static constexpr int kSubs = I::kBlock / I::kSub;  // sub-blocks per block
  static constexpr int kGroups = I::kSub / 4;        // 4-element groups per sub-block
  static constexpr int kAccs = 8;                    // fp32 sums per activation row: block % 8
  static constexpr int kDecodeBlocks = 1;            // blocks per decode
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
  static void decode(const uint8_t* wrow, int64_t row_bytes, int64_t bi, int /*count*/, Block& out) {
    alignas(64) uint8_t lv[kGemmTileRows][256];
    alignas(64) int32_t sc[kGemmTileRows][16], cf[kGemmTileRows][16];
    alignas(64) float d[kGemmTileRows], k[kGemmTileRows];
    for (int r = 0; r < kGemmTileRows; ++r) {
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

  template <int... C>
  static void store_levels(const uint8_t* b, uint8_t* dst, std::integer_sequence<int, C...>) {
    (store_chunk(dst + 32 * C, simd::int_levels<T, C>(b)), ...);
  }
  // Signed levels go in + 128.
  static void store_chunk(uint8_t* dst, __m256i w) {
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst), Lv::kSignedIntLevels ? simd::plus128(w) : w);
  }

  // Block bi of MT activation rows against the decoded block, each level
  // load serving MT rows: lane r of acc[m][bi % 8] += S * (d_r * d_x), then
  // += C * (k_r * d_x), MatmulSimd::IntSums' step.
  template <int MT>
  static inline void step(const Block& w, int /*count*/, const ggml::ActRow* a, int64_t bi, __m512* const (&acc)[MT]) {
    const int64_t e = bi * I::kBlock;
    __m512i s[MT], c[MT];
    for (int m = 0; m < MT; ++m) s[m] = c[m] = _mm512_setzero_si512();
    for (int g0 = 0; g0 < 64; g0 += kSpanGroups) {
      __m512i t[MT];
      for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
      for (int g = g0; g < g0 + kSpanGroups; ++g)
        for (int m = 0; m < MT; ++m) t[m] = _mm512_dpbusd_epi32(t[m], w.levels[g], bcast4(a[m].q + e + 4 * g));
      const __m512i scale = w.scale[g0 / kGroups];
      for (int m = 0; m < MT; ++m) s[m] = add_scaled(s[m], t[m], scale);
    }
    for (int j = 0; j < 8; ++j)
      for (int m = 0; m < MT; ++m) c[m] = _mm512_dpwssd_epi32(c[m], w.coef[j], bcast4(a[m].isum + bi * 16 + 2 * j));
    for (int m = 0; m < MT; ++m) add_block(s[m], c[m], w.d, w.k, a[m].d[bi], acc[m][bi % 8]);
  }

  // S + t * scale (the scale in Block::scale's form).
  static __m512i add_scaled(__m512i S, __m512i t, __m512i scale) {
    return kDotScales ? _mm512_dpwssd_epi32(S, t, scale) : _mm512_add_epi32(S, _mm512_mullo_epi32(t, scale));
  }
  // A block's sums S and C, rows' d and k, into fp32 (the matvec's step):
  // sum += S * (d * d_x), then += C * (k * d_x), or (S + C) * (d * d_x)
  // where the coefficients are the level offset's.
  static void add_block(__m512i S, __m512i C, __m512 d, __m512 k, float d_x, __m512& sum) {
    const __m512 dx = _mm512_set1_ps(d_x);
    if constexpr (Lv::kIntCoefs) {
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(d, dx), sum);
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(C), _mm512_mul_ps(k, dx), sum);
    } else {
      sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(S, C)), _mm512_mul_ps(d, dx), sum);
    }
  }

  static __m512 total(const __m512* a) { return lane_order_sum(a[0], a); }
};

template <ggml::Type T>
struct FloatGemm {
  using I = ggml::TypeInfo<T>;
  static constexpr int kAccs = 8 + I::kHasMin;  // fp32 sums per activation row: 4-element group, mins
  // Blocks per decode: their 4 x 32 bytes of levels per row are two 16 x 16
  // transposes, and each activation row's sums stay in registers across
  // them (loaded and stored once per 4 blocks).
  static constexpr int kDecodeBlocks = 4;
  static_assert(I::kBlock == 32 && I::kSub == 32 && !simd::has_int_scales<T>(), "one scale per 32 elements");

  struct Block {
    __m512i levels[8 * kDecodeBlocks];  // [block j][group of 4 elements]: row r's 4 bytes in lane r
    __m512 d[kDecodeBlocks], m[kDecodeBlocks];  // [block j]: d_w (m_w) of row r in lane r
  };

  // Decodes blocks bi .. bi + count - 1 of the tile's 16 rows: levels
  // unsigned (signed ones + 128, against ActRow::offset as the matvec's
  // offset form takes them).
  static void decode(const uint8_t* wrow, int64_t row_bytes, int64_t bi, int count, Block& out) {
    alignas(64) uint8_t lv[kGemmTileRows][32 * kDecodeBlocks];
    alignas(64) float d[kDecodeBlocks][kGemmTileRows], m[kDecodeBlocks][kGemmTileRows];
    for (int r = 0; r < kGemmTileRows; ++r) {
      for (int j = 0; j < kDecodeBlocks; ++j) {
        __m256i w = _mm256_setzero_si256();  // past the row's end: unused
        if (j < count) {
          const uint8_t* b = wrow + r * row_bytes + (bi + j) * I::kBytes;
          ggml::Decoded<T> dec;
          simd::block_scales(b, dec);
          w = simd::block_levels<T, 0>(b, dec);
          if constexpr (!I::kHasMin) w = simd::plus128(w);
          d[j][r] = dec.d[0];
          if constexpr (I::kHasMin) m[j][r] = dec.m[0];
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(lv[r] + 32 * j), w);
      }
    }
    for (int h = 0; h < kDecodeBlocks / 2; ++h) transpose16_lines(&lv[0][64 * h], sizeof(lv[0]), out.levels + 16 * h);
    for (int j = 0; j < count; ++j) {
      out.d[j] = _mm512_load_ps(d[j]);
      if constexpr (I::kHasMin) out.m[j] = _mm512_load_ps(m[j]);
    }
  }

  // Blocks bi .. bi + count - 1 of MT activation rows: lane r of acc[m][g]
  // += (4-element dot g) * (d_r * d_x) per block, as the matvec's lane g,
  // and acc[m][8] += m_r * s_x, its mins.
  template <int MT>
  static inline void step(const Block& w, int count, const ggml::ActRow* a, int64_t bi, __m512* const (&acc)[MT]) {
    const int64_t e = bi * I::kBlock;
    const int8_t* q[MT];
    const int32_t* offset[MT];
    __m512 ds[MT][kDecodeBlocks];
    for (int m = 0; m < MT; ++m) {
      q[m] = a[m].q + e;
      offset[m] = a[m].offset + e / 4;
      for (int j = 0; j < count; ++j) ds[m][j] = _mm512_mul_ps(w.d[j], _mm512_set1_ps(a[m].d[bi + j]));
    }
    for (int g = 0; g < 8; ++g)
      for (int m = 0; m < MT; ++m) {
        __m512 sum = acc[m][g];
        for (int j = 0; j < count; ++j) {
          const __m512i start = I::kHasMin ? _mm512_setzero_si512() : bcast4(offset[m] + 8 * j + g);
          const __m512i p = _mm512_dpbusd_epi32(start, w.levels[8 * j + g], bcast4(q[m] + 32 * j + 4 * g));
          sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), ds[m][j], sum);
        }
        acc[m][g] = sum;
      }
    // The matvec rounds m_w * s_x, then adds: an explicitly rounded multiply
    // cannot be contracted into an FMA with the add.
    if constexpr (I::kHasMin)
      for (int m = 0; m < MT; ++m) {
        __m512 mins = acc[m][8];
        for (int j = 0; j < count; ++j)
          mins = _mm512_add_ps(mins, _mm512_mul_round_ps(w.m[j], _mm512_set1_ps(a[m].sum[bi + j]),
                                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        acc[m][8] = mins;
      }
  }

  // The matvec's hsum(acc + mins): the mins sit in lane 0 there, the other
  // lanes add +0, which changes nothing (a sum from +0 is never -0).
  static __m512 total(const __m512* a) { return lane_order_sum(I::kHasMin ? _mm512_add_ps(a[0], a[8]) : a[0], a); }
};

// Tile bytes in flight ahead of a pass's loads: each pass reads its tile as
// one sequential stream, which the hardware prefetcher alone does not keep
// up with (as for the file layout's rows, ggml_matmul_simd.h).
constexpr int kRepackedPrefetchBytes = 4096;

// Prefetches the `bytes` bytes kRepackedPrefetchBytes past p.
inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + kRepackedPrefetchBytes + off, _MM_HINT_T0);
}

// The TT tiles from row r (row_bytes a row) against activation rows m0 ..
// m0 + MT: from zeroed sums, Repacked::block of each tile in turn per block
// (acc[u][m] as the form's step leaves it), then Repacked::total into out.
// Flattened: otherwise GCC leaves the integer forms' block out of line and
// passes its sums through memory.
template <class Repacked, int MT, int TT>
__attribute__((flatten)) void run_pass(const uint8_t* W, int64_t r, int64_t row_bytes, int64_t blocks,
                                       const ggml::ActRow* acts, int64_t m0, float* out, int64_t rows) {
  __m512 acc[TT][MT][Repacked::kAccs];
  for (int u = 0; u < TT; ++u)
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < Repacked::kAccs; ++j) acc[u][m][j] = _mm512_setzero_ps();
  const uint8_t* tiles = W + r * row_bytes;
  const int64_t tile_bytes = ggml::kRepackRows * row_bytes;
  for (int64_t bi = 0; bi < blocks; ++bi)
    for (int u = 0; u < TT; ++u)
      Repacked::template block<MT>(tiles + u * tile_bytes + bi * Repacked::kTileBlockBytes, bi, acts + m0, acc[u]);
  for (int u = 0; u < TT; ++u)
    for (int m = 0; m < MT; ++m)
      _mm512_storeu_ps(out + (m0 + m) * rows + r + ggml::kRepackRows * u, Repacked::total(acc[u][m]));
}

// The repacked kernels' driver: rows r0 .. r0 + 16 * tiles (r0 a tile's first
// row) against M activation rows: a matvec Repacked::kMatvecTiles tiles a
// pass, else each tile per Repacked::kPassRows activation rows (fewer for
// those left over).
// Returns the first row it did not take (past the last whole tile, in the
// file's layout).
template <class Repacked>
int64_t run_passes(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                   float* out, int64_t rows) {
  using I = typename Repacked::I;
  const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
  int64_t r = r0;
  constexpr int kTiles = Repacked::kMatvecTiles;
  if (M == 1)
    for (; r + kTiles * ggml::kRepackRows <= r1; r += kTiles * ggml::kRepackRows)
      run_pass<Repacked, 1, kTiles>(W, r, row_bytes, blocks, acts, 0, out, rows);
  for (; r + ggml::kRepackRows <= r1; r += ggml::kRepackRows)
    for_row_tiles<Repacked::kPassRows>(M, [&](auto mt, int64_t m0) {
      run_pass<Repacked, decltype(mt)::value, 1>(W, r, row_bytes, blocks, acts, m0, out, rows);
    });
  return r;
}

// The one-scale types over a repacked weight (core/ggml_repack.h): a
// block's 16 rows already lie one to a lane, so decoding is cutting nibbles
// (or flipping Q8_0's sign bits) in 512-bit registers, with no per-row decode
// and no transpose, and cheap enough to redo for every pass of activation
// rows: levels and sums stay in registers, where GemmVnni writes each
// decoded Block to L1 and reads it back per activation row tile.
// The levels are FloatGemm's, but each block's 8 group dots chain into one
// int32 sum per row (starting from -128 * the activations' block sum,
// ActRow::isum, where the levels went in + 128) and meet fp32 in one FMA a
// block: FloatGemm's order (a conversion and an FMA per group) would take 3
// of every 4 instructions a group. Results agree with the file layout's to
// fp32 rounding, each row its own matvec's bit for bit at every M.
template <ggml::Type T>
struct RepackedFloatGemm {
  using I = ggml::TypeInfo<T>;
  static_assert(has_repacked_layout(T) && I::kBlock == 32, "a one-scale type with a repacked layout");
  static constexpr int kWords = (I::kBytes - ggml::repacked_fields(T).bytes()) / 4;  // 4-byte words of quants
  static constexpr int64_t kTileBlockBytes = ggml::kRepackRows * I::kBytes;  // one block of the tile's rows
  static constexpr int kAccs = 1 + I::kHasMin;  // fp32 sums per activation row: the dots, the mins
  // Tiles per matvec pass, each block of one followed by the same block of
  // the next: with one tile a pass a streamed matvec leaves memory and
  // arithmetic taking turns. Each tile's sums keep their order: same results.
  static constexpr int kMatvecTiles = 2;
  static __m512 total(const __m512* a) { return I::kHasMin ? _mm512_add_ps(a[0], a[1]) : a[0]; }
  // Activation rows per pass: with a block's dot in one int32 register and
  // one fp32 sum a row, 8 fit the registers (fewer a pass run slower).
  static constexpr int kPassRows = 8;

  // Q5_0 and Q5_1: word 0 holds each row's 32-bit qh, element i's fifth bit at bit i.
  static constexpr bool kHighBits = T == ggml::Type::Q5_0 || T == ggml::Type::Q5_1;
  static constexpr int kQuantWords = kWords - kHighBits;

  // Group G's nibbles (elements 4G .. 4G + 3) as FloatGemm's unsigned
  // levels: Q4_1's as they are, Q4_0's (nibble - 8) + 128, IQ4_NL's and
  // MXFP4's table value + 128, Q5_1's nibble + 16 * (its qh bit), Q5_0's
  // that - 16 + 128.
  template <int G>
  static __m512i level(__m512i nibble, __m512i qh) {
    if constexpr (T == ggml::Type::Q4_1) {
      return nibble;
    } else if constexpr (T == ggml::Type::Q4_0) {
      return _mm512_add_epi8(nibble, _mm512_set1_epi8(120));
    } else if constexpr (kHighBits) {
      // Each row's qh byte G / 2 in all 4 bytes of its dword, then in byte i the bit of element 4G + i.
      constexpr int c = 0x01010101 * (G / 2);
      const __m512i spread =
          _mm512_shuffle_epi8(qh, _mm512_broadcast_i32x4(_mm_setr_epi32(c, 0x04040404 + c, 0x08080808 + c, 0x0C0C0C0C + c)));
      const __mmask64 high = _mm512_test_epi8_mask(spread, _mm512_set1_epi32(0x08040201 << (4 * (G % 2))));
      const __m512i low = T == ggml::Type::Q5_0 ? _mm512_add_epi8(nibble, _mm512_set1_epi8(112)) : nibble;
      return _mm512_mask_add_epi8(low, high, low, _mm512_set1_epi8(16));
    } else {
      static_assert(T == ggml::Type::IQ4_NL || T == ggml::Type::MXFP4, "the 4- and 5-bit repacked types");
      const int8_t* values = T == ggml::Type::IQ4_NL ? LOWBIT_TABLE(ggml::kvalues_iq4nl) : LOWBIT_TABLE(ggml::kvalues_fp4);
      const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
      return _mm512_xor_si512(_mm512_shuffle_epi8(table, nibble), _mm512_set1_epi8(-128));
    }
  }

  // The 16 rows' block scales: fp16 d, or MXFP4's E8M0 as core's
  // e8m0_to_fp32_half gives it (2^(e - 128); e < 2 subnormal), exactly.
  static __m512 scales(const uint8_t* b) {
    if constexpr (T == ggml::Type::MXFP4) {
      const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
      const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
      const __m512i subnormal = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), e);
      const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
      return _mm512_castsi512_ps(_mm512_mask_blend_epi32(small, normal, subnormal));
    } else {
      return half16(b);
    }
  }

  // Block bi of a tile (at b) against MT activation rows: lane r of
  // acc[m][0] += (row r's int32 dot) * (d_r * d_x), acc[m][1] += its mins.
  template <int MT>
  static inline void block(const uint8_t* b, int64_t bi, const ggml::ActRow* a, __m512 (&acc)[MT][kAccs]) {
    prefetch_ahead(b, kTileBlockBytes);
    __m512 ds[MT];  // d_w * d_x
    const __m512 dw = scales(b);
    for (int m = 0; m < MT; ++m) ds[m] = _mm512_mul_ps(dw, _mm512_set1_ps(a[m].d[bi]));
    const int64_t e = bi * I::kBlock;
    // The block's int32 dot per row (lane r), from -128 * (the activations'
    // sum) where the levels went in + 128.
    __m512i sum[MT];
    for (int m = 0; m < MT; ++m)
      sum[m] = I::kHasMin ? _mm512_setzero_si512() : _mm512_set1_epi32(-128 * a[m].isum[bi]);
    // Group g's 4-element dots (levels: row r's 4 bytes in lane r).
    const auto dot = [&](__m512i levels, int g) {
      for (int m = 0; m < MT; ++m) sum[m] = _mm512_dpbusd_epi32(sum[m], levels, bcast4(a[m].q + e + 4 * g));
    };
    const uint8_t* words = words_of<T>(b);  // word w of the 16 rows at words + 64 w
    const __m512i qh = kHighBits ? _mm512_loadu_si512(words) : _mm512_setzero_si512();
    const uint8_t* q = words + 64 * kHighBits;  // the quant words
    static_for<kQuantWords>([&](auto word) {
      constexpr int k = decltype(word)::value;
      const __m512i v = _mm512_loadu_si512(q + 64 * k);
      if constexpr (T == ggml::Type::Q8_0) {
        dot(_mm512_xor_si512(v, _mm512_set1_epi8(-128)), k);  // w + 128
      } else {  // byte i: element 4k + i in the low nibble, 16 + 4k + i in the high one
        dot(level<k>(_mm512_and_si512(v, _mm512_set1_epi8(0x0f)), qh), k);
        dot(level<k + 4>(_mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0f)), qh), k + 4);
      }
    });
    for (int m = 0; m < MT; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[m]), ds[m], acc[m][0]);
    if constexpr (I::kHasMin) {  // FloatGemm::step's mins: the product rounded, then added
      const __m512 mw = half16(b + 32);
      for (int m = 0; m < MT; ++m)
        acc[m][1] = _mm512_add_ps(acc[m][1], _mm512_mul_round_ps(mw, _mm512_set1_ps(a[m].sum[bi]),
                                                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  }

  static int64_t run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                     float* out, int64_t rows) {
    return run_passes<RepackedFloatGemm>(W, r0, r1, n, acts, M, out, rows);
  }
};

template <class Form>
struct GemmVnni;  // below: the driver of the forms that decode a Block per tile and block

// IntGemm's arithmetic over a repacked weight of an integer-form type (the
// K-quants, IQ4_XS), as RepackedFloatGemm is FloatGemm's: the same int32
// sums S (levels times scales) and C (coefficients times the activations'
// sums) per block and row, then IntGemm::add_block's fp32 step into lane
// block % 8, so the same results bit for bit. RepackedTile<T>
// (ggml_repacked_tiles.h) cuts the scales, coefficients and levels of the
// tile's 16 rows out of the layout's words with a few whole-register
// operations per block. Its speed against the file layout's kernels: the
// `vs file` column of benchmarks/results/*-gguf.txt.
template <ggml::Type T>
struct RepackedIntGemm {
  using I = ggml::TypeInfo<T>;
  using Int = IntGemm<T>;
  // Activation rows per pass over a tile. Each pass past a tile's first
  // reads it from L2 while the memory idles, so fewer rows a pass (2 or 4)
  // run slower, streamed and in cache (csrc/cpu/README.md).
  static constexpr int kPassRows = 8;
  using Tile = RepackedTile<T>;
  static_assert(has_repacked_layout(T) && simd::has_int_scales<T>(), "an integer-form type with a repacked layout");
  static constexpr int64_t kTileBlockBytes = ggml::kRepackRows * I::kBytes;
  static constexpr int kAccs = Int::kAccs;
  // One tile a matvec pass: a block's scales and sums already fill the
  // registers, and two tiles (as RepackedFloatGemm takes) run slower.
  static constexpr int kMatvecTiles = 1;
  static __m512 total(const __m512* a) { return Int::total(a); }

  // From kGemmRows activation rows: IntGemm's Block cut from the repacked
  // tile once per block for GemmVnni to meet every row with, 4 rows per
  // level load, instead of the passes' cut per pass. The passes stay ahead
  // longer where a span's scaling is one vpdpwssd than where it is a
  // vpmulld per activation row (csrc/cpu/README.md, M thresholds).
  struct Form : IntGemm<T> {
    using Block = typename IntGemm<T>::Block;
    static void decode(const uint8_t* tile, int64_t /*row_bytes*/, int64_t bi, int /*count*/, Block& out) {
      const uint8_t* b = tile + bi * kTileBlockBytes;
      prefetch_ahead(b, kTileBlockBytes);
      const auto f = Tile::fields(b);
      static_for<Int::kSubs>([&](auto s) { out.scale[s] = Tile::template scale<decltype(s)::value>(f); });
      static_for<8>([&](auto j) { out.coef[j] = Tile::template coef<decltype(j)::value>(f); });
      static_for<64>([&](auto g) { out.levels[g] = Tile::template levels<decltype(g)::value>(words_of<T>(b)); });
      out.d = f.d;
      out.k = f.k;
    }
  };
  static constexpr int64_t kGemmRows = Int::kDotScales ? 64 : 16;
  // The pass prefetches the block kPrefetchAhead bytes on into L2, a line
  // per group (a few twice): these blocks are 1.3-3.3 KB, and prefetched into
  // L1 all at once, as RepackedFloatGemm's small blocks are, they starve a streamed matvec.
  static constexpr int64_t kPrefetchAhead = 8192;

  // Block bi of a tile (at b) against MT activation rows: acc[m] as
  // IntGemm::step leaves it. Integer sums are exact, so their order is free;
  // the fp32 step is IntGemm's.
  template <int MT>
  static inline void block(const uint8_t* b, int64_t bi, const ggml::ActRow* a, __m512 (&acc)[MT][kAccs]) {
    const auto f = Tile::fields(b);
    const int64_t e = bi * I::kBlock;
    __m512i S[MT], C[MT];
    for (int m = 0; m < MT; ++m) S[m] = C[m] = _mm512_setzero_si512();
    static_for<8>([&](auto j) {
      const __m512i coef = Tile::template coef<decltype(j)::value>(f);
      for (int m = 0; m < MT; ++m) C[m] = _mm512_dpwssd_epi32(C[m], coef, bcast4(a[m].isum + bi * 16 + 2 * j));
    });
    // Spans of Int::kSpanGroups groups (a sub-block, or a 16-element half
    // of one where Int scales with vpdpwssd) meet their sub-block's scale.
    static_for<64 / Int::kSpanGroups>([&](auto span) {
      constexpr int g0 = decltype(span)::value * Int::kSpanGroups;
      __m512i t[MT];
      for (int m = 0; m < MT; ++m) t[m] = _mm512_setzero_si512();
      static_for<Int::kSpanGroups>([&](auto i) {
        constexpr int g = g0 + decltype(i)::value;
        _mm_prefetch(reinterpret_cast<const char*>(b) + kPrefetchAhead + g * kTileBlockBytes / 64, _MM_HINT_T1);
        const __m512i levels = Tile::template levels<g>(words_of<T>(b));
        for (int m = 0; m < MT; ++m) t[m] = _mm512_dpbusd_epi32(t[m], levels, bcast4(a[m].q + e + 4 * g));
      });
      const __m512i scale = Tile::template scale<g0 / Int::kGroups>(f);
      for (int m = 0; m < MT; ++m) S[m] = Int::add_scaled(S[m], t[m], scale);
    });
    for (int m = 0; m < MT; ++m) Int::add_block(S[m], C[m], f.d, f.k, a[m].d[bi], acc[m][bi % 8]);
  }

  static int64_t run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                     float* out, int64_t rows) {
    if (M >= kGemmRows) return GemmVnni<Form>::run(W, r0, r1, n, acts, M, out, rows);
    return run_passes<RepackedIntGemm>(W, r0, r1, n, acts, M, out, rows);
  }
};

// Whether type T has a GEMM form, and which.
template <ggml::Type T>
constexpr bool has_gemm_vnni() {
  return ggml_cpu_traits(T).gemm != Gemm::kNone;
}
template <ggml::Type T>
using GemmForm = std::conditional_t<simd::has_int_scales<T>(), IntGemm<T>, FloatGemm<T>>;

// The driver: tiles of 16 weight rows against all M activation rows, each
// decoded block (Form::kDecodeBlocks of them) meeting every activation row
// before the next; the fp32 sums ([m][Form::kAccs] per tile) in scratch.
template <class Form>
struct GemmVnni {
  using Block = typename Form::Block;

  struct Scratch {
    __m512* acc;
    Block* block;
    explicit Scratch(int64_t M)
        : acc(static_cast<__m512*>(_mm_malloc(M * Form::kAccs * sizeof(__m512), 64))),
          block(static_cast<Block*>(_mm_malloc(sizeof(Block), 64))) {}
    ~Scratch() { _mm_free(acc), _mm_free(block); }
    Scratch(const Scratch&) = delete;
    Scratch& operator=(const Scratch&) = delete;
  };

  // Rows r0 .. r0 + 16 * tiles against all M activation rows; returns the
  // first row it did not take (the matvec form takes the rest).
  static int64_t run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                     float* out, int64_t rows) {
    using I = typename Form::I;
    const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
    if (r1 - r0 < kGemmTileRows) return r0;
    Scratch scratch(M);
    int64_t r = r0;
    for (; r + kGemmTileRows <= r1; r += kGemmTileRows) {
      __m512* acc = scratch.acc;
      for (int64_t i = 0; i < M * Form::kAccs; ++i) acc[i] = _mm512_setzero_ps();
      for (int64_t bi = 0; bi < blocks; bi += Form::kDecodeBlocks) {
        const int count = static_cast<int>(std::min<int64_t>(Form::kDecodeBlocks, blocks - bi));
        Form::decode(W + r * row_bytes, row_bytes, bi, count, *scratch.block);
        for_row_tiles(M, [&](auto mt, int64_t m0) {
          constexpr int MT = decltype(mt)::value;
          __m512* a[MT];
          for (int m = 0; m < MT; ++m) a[m] = acc + (m0 + m) * Form::kAccs;
          Form::template step<MT>(*scratch.block, count, acts + m0, bi, a);
        });
      }
      for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(out + m * rows + r, Form::total(acc + m * Form::kAccs));
    }
    return r;
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
