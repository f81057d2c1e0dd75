// The GGUF matmul with 8-bit activations, written once over an int8 dot
// product D (DotAvx2: maddubs + madd; DotVnni: AVX-512 VNNI vpdpbusd, and
// vpdpwssd for the dots scaled by integer sub-block scales) and
// instantiated per ISA in its own translation unit. D also says how many
// weight rows a tile shares each activation load between (what its register
// file holds) and whether its u8 x s8 products are safe from saturation.
// Include only inside that unit's target pragma region.
//
// As in llama.cpp, each 32-element chunk of a block becomes 32 int8 levels in
// a register (ggml_levels_simd.h) and meets the activations' int8 values in
// an integer dot product. For the legacy and the IQ types the sum of each
// sub-block is scaled by d_w * d_x in fp32 (block_dot in core/ggml_q8.h is
// the scalar statement of it); the K-quants and IQ4_XS scale each sub-block's
// sum by its integer scale in int32 and meet fp32 once per block
// (simd::IntScales). The mins (and Q6_K's and Q3_K's level offsets) go
// through the activations' block sums.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "ggml_levels_simd.h"
#include "row_tiles.h"
#if LOWBIT_SIMD_AVX512BW
#include "ggml_gemm_vnni.h"
#endif

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

template <class D, ggml::Type T>
struct MatmulSimd {
  using I = ggml::TypeInfo<T>;
  using L = ggml::ActLayout<I::kAct>;
  static constexpr int kChunks = I::kBlock / 32;
  static constexpr int kSubs = I::kBlock / I::kSub;
  static constexpr int kScaleVecs = (kSubs + 7) / 8;
  static constexpr int kActs = I::kBlock / L::kBlock;  // activation blocks a weight block
  // The K-quants and IQ4_XS scale each chunk's dot by integer sub-block
  // scales and meet fp32 once per block, as llama.cpp's kernels do
  // (simd::IntScales): a chain of one FMA per block instead of one per
  // chunk, and no sign trick for Q6_K and Q3_K.
  static constexpr bool kIntScales = simd::has_int_scales<T>();
  // Weight rows per tile: D::kRowTile for the types without mins and with
  // one scale vector per block (the signed legacy types). The others' per-row
  // scales, mins or int32 block sums would outgrow the registers: one row.
  static constexpr int kRowTile = !I::kHasMin && kScaleVecs == 1 && !kIntScales ? D::kRowTile : 1;
  static_assert(I::kSub == 16 || I::kSub % 32 == 0, "sub-blocks of 16 or a multiple of 32 elements");
  // Weight bytes a tile has in flight ahead of its loads, across its rows.
  static constexpr int kPrefetchBytes = 4096;

  static float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }

  // Sub-block scales d_w * d_x of one block, weight row and activation row,
  // 8 per vector (a legacy block's single scale fills all lanes). Tiles of
  // several weight rows pack a legacy block's RT scales per activation row
  // into one vector instead (lane r, in both 128-bit halves), and each FMA
  // takes its own with one vshufps: as RT x MT broadcast vectors, a 4 x 4
  // tile's scales and accumulators would outgrow the registers and spill.
  template <int RT>
  static constexpr bool kPackedScales = I::kBlock == I::kSub && RT > 1;
  template <int RT, int MT>
  struct ScaleVecs {
    __m256 v[RT][MT][kScaleVecs];
  };
  template <int MT>
  struct PackedScales {
    __m256 v[MT];  // lanes r and 4 + r: weight row r
  };
  // Lanes r and 4 + r of v in every lane. vshufps takes an immediate and r is
  // a loop index, constant only once the loop is unrolled (not at -O1, the
  // sanitizer build): the switch folds away where it is.
  static inline __m256 lane_broadcast(__m256 v, int r) {
    switch (r) {
      case 0: return _mm256_shuffle_ps(v, v, 0x00);
      case 1: return _mm256_shuffle_ps(v, v, 0x55);
      case 2: return _mm256_shuffle_ps(v, v, 0xAA);
      default: return _mm256_shuffle_ps(v, v, 0xFF);
    }
  }
  template <int RT, int MT>
  using Scales = std::conditional_t<kPackedScales<RT>, PackedScales<MT>, ScaleVecs<RT, MT>>;

  // The AVX-512 unit runs those packed-scale tiles two weight rows to a
  // 512-bit register (lanes 0-7 row 2p, lanes 8-15 row 2p + 1), every lane
  // computing what its 256-bit counterpart does, so the results stay bit for
  // bit those of single rows, at half the issue slots per row where a 512-bit
  // instruction costs what a 256-bit one does. Not for one or two activation
  // rows: there the 256-bit level decoding dominates, and 512-bit
  // instructions in flight close one of the ports it runs on.
#if LOWBIT_SIMD_AVX512BW
  template <int RT, int MT>
  static constexpr bool kPairedRows = kPackedScales<RT> && RT % 2 == 0 && MT > 2;
#else
  template <int RT, int MT>
  static constexpr bool kPairedRows = false;
#endif

  // The first N (2 or 4) floats at p in the low lanes.
  template <int N>
  static inline __m128 load_floats(const float* p) {
    static_assert(N == 2 || N == 4, "two or four floats");
    if constexpr (N == 4) return _mm_loadu_ps(p);
    return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));  // no 8-byte alignment needed
  }

  // Whether chunk() takes signed levels as w + 128 against ActRow::offset
  // (see there): where D's products cannot saturate and RT > 1 rows share
  // the offset loads.
  template <int RT>
  static constexpr bool kOffsetDots = !I::kHasMin && D::kWideProducts && RT > 1;

  // Per-sub-block values held 8 per vector (vector s / 8, lane s % 8): the
  // vector and lanes that chunk C's dot lanes take theirs from.
  template <int C>
  static constexpr int sub_vec() { return I::kSub >= 32 ? 32 * C / I::kSub / 8 : C / 4; }
  template <int C>
  static __m256i sub_lanes() {
    if constexpr (I::kSub >= 32) {  // one sub-block in every lane
      return _mm256_set1_epi32(32 * C / I::kSub % 8);
    } else {  // lanes 0-3: sub-block 2C, lanes 4-7: sub-block 2C + 1
      constexpr int j = 2 * C % 8;
      return _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1);
    }
  }

  // Chunk C of block `bi` of RT weight rows against MT activation rows: each
  // activation load serves RT rows and each decoded chunk MT activation rows.
  template <int RT, int MT, int C>
  static inline void chunk(const uint8_t* const (&blk)[RT], const ggml::Decoded<T> (&dec)[RT],
                           const Scales<RT, MT>& ds, const ggml::ActRow* acts, int64_t bi, __m256 (&acc)[RT][MT]) {
    // The u8 x s8 product needs unsigned weights. Types with mins have them.
    // Signed levels w go in either as |w| with the sign moved onto x (one
    // vpsignb per weight row and activation row), or, where D's products
    // cannot saturate and RT rows share the cost, as w + 128 with
    // ActRow::offset, -128 * (each lane's 4 activations) worked out once per
    // call, as the dot's starting value: per lane the same integer sum, so
    // the same float result.
    constexpr bool kOffset = kOffsetDots<RT>;
    __m256i w[RT], wu[RT];
    for (int r = 0; r < RT; ++r) {
      w[r] = simd::block_levels<T, C>(blk[r], dec[r]);
      wu[r] = I::kHasMin ? w[r] : kOffset ? simd::plus128(w[r]) : _mm256_abs_epi8(w[r]);
    }
    const int64_t e = bi * I::kBlock + 32 * C;
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].q + e));
      __m256i start = _mm256_setzero_si256();
      if constexpr (kOffset) start = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].offset + e / 4));
      for (int r = 0; r < RT; ++r) {
        const __m256i xs = I::kHasMin || kOffset ? x : _mm256_sign_epi8(x, w[r]);
        const __m256 p = _mm256_cvtepi32_ps(D::dot(start, wu[r], xs));  // lane i: elements 4i .. 4i+3
        __m256 scale;
        if constexpr (kPackedScales<RT>)
          scale = lane_broadcast(ds.v[m], r);
        else if constexpr (kChunks == 1)
          scale = ds.v[r][m][0];
        else
          scale = _mm256_permutevar8x32_ps(ds.v[r][m][sub_vec<C>()], sub_lanes<C>());
        acc[r][m] = _mm256_fmadd_ps(p, scale, acc[r][m]);
      }
    }
  }

  template <int RT, int MT, int... C>
  static inline void chunks(std::integer_sequence<int, C...>, const uint8_t* const (&blk)[RT],
                            const ggml::Decoded<T> (&dec)[RT], const Scales<RT, MT>& ds, const ggml::ActRow* acts,
                            int64_t bi, __m256 (&acc)[RT][MT]) {
    (chunk<RT, MT, C>(blk, dec, ds, acts, bi, acc), ...);
  }

  // The integer form's chunk C: iacc += scale_s * (int levels . x) per lane.
  template <int RT, int MT, int C>
  static inline void int_chunk(const uint8_t* const (&blk)[RT], const simd::IntScales (&is)[RT],
                               const ggml::ActRow* acts, int64_t bi, __m256i (&iacc)[RT][MT]) {
    using Lv = simd::Levels<T>;
    static_assert(Lv::kIntLevelMax * 127 * 2 < (1 << 15), "maddubs pair sums fit int16");
    __m256i w[RT], u[RT], scale[RT];
    for (int r = 0; r < RT; ++r) {
      w[r] = simd::int_levels<T, C>(blk[r]);
      u[r] = Lv::kSignedIntLevels ? _mm256_abs_epi8(w[r]) : w[r];
      scale[r] = _mm256_permutevar8x32_epi32(is[r].pairs[sub_vec<C>()], sub_lanes<C>());
    }
    const int64_t e = bi * I::kBlock + 32 * C;
    for (int m = 0; m < MT; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].q + e));
      for (int r = 0; r < RT; ++r) {
        iacc[r][m] = D::scaled_dot(iacc[r][m], u[r], Lv::kSignedIntLevels ? _mm256_sign_epi8(x, w[r]) : x, scale[r]);
        // Integer adds reassociate freely, and GCC would form all of a
        // block's products first (AVX2's madd + add), spill them and sum them
        // after; each sum stays in its register (the same integers).
        __asm__("" : "+x"(iacc[r][m]));
      }
    }
  }

  // Chunk C adds into chain C % 2: two dependency chains of vpdpwssd per
  // output instead of one, and integer sums, so the same result.
  template <int RT, int MT, int... C>
  static inline void int_chunks(std::integer_sequence<int, C...>, const uint8_t* const (&blk)[RT],
                                const simd::IntScales (&is)[RT], const ggml::ActRow* acts, int64_t bi,
                                __m256i (&iacc)[2][RT][MT]) {
    (int_chunk<RT, MT, C>(blk, is, acts, bi, iacc[C % 2]), ...);
  }

  // mins += m_w * s for the legacy types with mins, whose Q8_1 activation
  // blocks keep s = d_x * sum(q_x) (the integer form carries the K-quants').
  template <int MT>
  static inline void add_mins(const ggml::Decoded<T>& sc, const ggml::ActRow* acts, int64_t bi, __m256 (&mins)[MT]) {
    static_assert(I::kAct == ggml::Act::Q8_1 && I::kSub == I::kBlock, "Q8_1 pairs with one 32-element sub-block");
    for (int m = 0; m < MT; ++m)
      mins[m] = _mm256_add_ps(mins[m], _mm256_setr_ps(sc.m[0] * acts[m].sum[bi], 0, 0, 0, 0, 0, 0, 0));
  }

  // block(blk, bi) for every block bi of RT weight rows (from wrow,
  // row_bytes apart), blk[r] pointing at row r's.
  template <int RT, class Block>
  static void for_blocks(const uint8_t* wrow, int64_t row_bytes, int64_t blocks, Block&& block) {
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const uint8_t* blk[RT];
      for (int r = 0; r < RT; ++r) {
        blk[r] = wrow + r * row_bytes + bi * I::kBytes;
        // The hardware prefetcher alone falls behind wherever the weights are
        // not the only stream (interleaved rows, or rows longer than L1 holds
        // activations for), so every line is fetched kPrefetchBytes / RT ahead.
        for (int off = 0; off < I::kBytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk[r]) + kPrefetchBytes / RT + off, _MM_HINT_T0);
      }
      block(blk, bi);
    }
  }

  // RT weight rows (from wrow, row_bytes apart) against MT activation rows:
  // out[m * rows + r] for r < RT, m < MT.
  template <int RT, int MT>
  static void tile(const uint8_t* wrow, int64_t row_bytes, int64_t blocks, const ggml::ActRow* acts, float* out,
                   int64_t rows) {
    // One activation scale per weight block (Q8_K's 256 or Q8_0/Q8_1's 32),
    // or per sub-block group where a block spans several (kActs).
    static_assert(I::kBlock % L::kBlock == 0 && L::kBlock % I::kSub == 0, "sub-blocks inside activation blocks");
#if LOWBIT_SIMD_AVX512BW
    if constexpr (kPairedRows<RT, MT>) {
      __m512 acc[RT / 2][MT];
      for (int p = 0; p < RT / 2; ++p)
        for (int m = 0; m < MT; ++m) acc[p][m] = _mm512_setzero_ps();
      for_blocks<RT>(wrow, row_bytes, blocks, [&](const uint8_t* const (&blk)[RT], int64_t bi) {
        paired_block<RT, MT>(blk, acts, bi, acc);
      });
      for (int p = 0; p < RT / 2; ++p)
        for (int m = 0; m < MT; ++m) {
          out[m * rows + 2 * p] = hsum(_mm512_castps512_ps256(acc[p][m]));
          out[m * rows + 2 * p + 1] = hsum(_mm512_extractf32x8_ps(acc[p][m], 1));
        }
      return;
    }
#endif
    if constexpr (kIntScales) {
      IntSums<RT, MT> sums;
      __m256 acc[RT][MT];
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
      int j = 0;  // block bi's entry of `sums`: bi % 8
      for_blocks<RT>(wrow, row_bytes, blocks, [&](const uint8_t* const (&blk)[RT], int64_t bi) {
        int_block<RT, MT>(blk, acts, bi, sums, j);
        if (++j == 8) sums.add_to(acts, bi - 7, 8, acc), j = 0;
      });
      if (j > 0) sums.add_to(acts, blocks - j, j, acc);
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) out[m * rows + r] = hsum(acc[r][m]);
    } else {
      __m256 acc[RT][MT], mins[RT][MT];
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) acc[r][m] = mins[r][m] = _mm256_setzero_ps();
      for_blocks<RT>(wrow, row_bytes, blocks, [&](const uint8_t* const (&blk)[RT], int64_t bi) {
        float_block<RT, MT>(blk, acts, bi, acc, mins);
      });
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) out[m * rows + r] = hsum(_mm256_add_ps(acc[r][m], mins[r][m]));
    }
  }

  // The integer form's fp32 step, bit for bit that of the batched GEMM
  // (ggml_gemm_vnni.h): block bi's exact int32 sums S (levels times scales)
  // and C (coefficients times the activations' sums) go into fp32 lane
  // bi % 8 as acc = fma(S, d_w * d_x, acc), then acc = fma(C, k_w * d_x,
  // acc), and the 8 lanes sum as hsum does. Integer sums do not depend on
  // the order they are formed in, so the GEMM, with weight rows across its
  // lanes, meets the same numbers. Here a block's lanes hold partial sums;
  // 8 blocks' worth are kept and reduced together (one transposing hadd
  // tree per 8 blocks, not one per block), and their products d_w * d_x
  // formed 8 at a time, not by a scalar multiply per block and row.
  template <int RT, int MT>
  struct IntSums {
    alignas(32) int32_t s[RT][MT][8][8], c[RT][MT][8][8];  // [..][block % 8][lane]; c: kIntCoefs only
    alignas(32) float d[RT][8], k[RT][8];                  // d_w, k_w (kIntCoefs only) [..][block % 8]
    // The entries of blocks b0 .. b0 + count - 1 (count <= 8) into acc;
    // a row's last blocks may fill fewer than 8, and the entries past them,
    // left from the row's group before, count as zero: masked loads of the
    // scales, zero registers for the sums, not zeroed memory (vector loads
    // right after scalar stores cannot take them from the store buffer).
    void add_to(const ggml::ActRow* acts, int64_t b0, int count, __m256 (&acc)[RT][MT]) const {
      // The activation scales of those blocks, zero past count (no read
      // past the row's end).
      const __m256i in_range = _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      for (int m = 0; m < MT; ++m) {
        const __m256 dx = _mm256_maskload_ps(acts[m].d + b0, in_range);
        for (int r = 0; r < RT; ++r) {
          const __m256 dd = _mm256_mul_ps(_mm256_maskload_ps(d[r], in_range), dx);
          acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_totals(s[r][m], count)), dd, acc[r][m]);
          if constexpr (simd::Levels<T>::kIntCoefs) {
            const __m256 kd = _mm256_mul_ps(_mm256_maskload_ps(k[r], in_range), dx);
            acc[r][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_totals(c[r][m], count)), kd, acc[r][m]);
          }
        }
      }
    }
    // Lane b: the sum of v[b]'s 8 lanes, b < count (0 past it: not read).
    static __m256i lane_totals(const int32_t (&v)[8][8], int count) {
      const auto at = [&](int b) {
        return b < count ? _mm256_load_si256(reinterpret_cast<const __m256i*>(v[b])) : _mm256_setzero_si256();
      };
      const __m256i h03 = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)), _mm256_hadd_epi32(at(2), at(3)));
      const __m256i h47 = _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)), _mm256_hadd_epi32(at(6), at(7)));
      // Halves: lanes 0-3 and 4-7 of blocks 0-3 (h03) and 4-7 (h47).
      return _mm256_add_epi32(_mm256_permute2x128_si256(h03, h47, 0x20), _mm256_permute2x128_si256(h03, h47, 0x31));
    }
  };

  // Block bi in the integer form into entry j of `sums` (see IntSums).
  template <int RT, int MT>
  static inline void int_block(const uint8_t* const (&blk)[RT], const ggml::ActRow* acts, int64_t bi,
                               IntSums<RT, MT>& out, int j) {
    simd::IntScales is[RT];
    for (int r = 0; r < RT; ++r) {
      simd::Levels<T>::int_scales(blk[r], is[r]);
      out.d[r][j] = is[r].d;
      if constexpr (simd::Levels<T>::kIntCoefs) out.k[r][j] = is[r].k;
    }
    __m256i iacc[2][RT][MT];
    for (int c = 0; c < 2; ++c)
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) iacc[c][r][m] = _mm256_setzero_si256();
    int_chunks<RT, MT>(std::make_integer_sequence<int, kChunks>{}, blk, is, acts, bi, iacc);
    for (int m = 0; m < MT; ++m) {
      __m256i xsums;  // int16 sums per 16 activations
      if constexpr (simd::Levels<T>::kIntCoefs)
        xsums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].isum + bi * 16));
      for (int r = 0; r < RT; ++r) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(out.s[r][m][j]), _mm256_add_epi32(iacc[0][r][m], iacc[1][r][m]));
        if constexpr (simd::Levels<T>::kIntCoefs)
          _mm256_store_si256(reinterpret_cast<__m256i*>(out.c[r][m][j]), _mm256_madd_epi16(is[r].coef16, xsums));
      }
    }
  }

  // The single scale d_w of RT <= 4 rows' block in lanes 0 .. RT-1.
  template <int RT>
  static inline __m128 row_scales(const uint8_t* const (&blk)[RT], const ggml::Decoded<T> (&sc)[RT]) {
    static_assert(RT <= 4 && I::kBlock == I::kSub, "one scale per block, one 128-bit vector");
    const auto row = [&](int r) { return std::min(r, RT - 1); };  // lanes past RT: unused
    if constexpr (std::is_base_of_v<simd::LegacyScales, simd::Levels<T>>)
      return simd::LegacyScales::d_x4(blk[row(0)], blk[row(1)], blk[row(2)], blk[row(3)]);
    else
      return _mm_setr_ps(sc[row(0)].d[0], sc[row(1)].d[0], sc[row(2)].d[0], sc[row(3)].d[0]);
  }

#if LOWBIT_SIMD_AVX512BW
  static inline __m512i pair(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
  // Lanes 0-7: r, lanes 8-15: r + 1.
  static inline __m512i pair_lanes(int r) { return pair(_mm256_set1_epi32(r), _mm256_set1_epi32(r + 1)); }

  // chunk() of RT (even) rows held in pairs, two to each 512-bit vector: the
  // signed levels as w + 128 against ActRow::offset (chunk's kOffset form),
  // ds[p][m] pair p's scales for activation row m.
  template <int RT, int MT, int C>
  static inline void paired_chunk(const uint8_t* const (&blk)[RT], const ggml::Decoded<T> (&dec)[RT],
                                  const __m512 (&ds)[RT / 2][MT], const ggml::ActRow* acts, int64_t bi,
                                  __m512 (&acc)[RT / 2][MT]) {
    static_assert(kOffsetDots<RT>, "levels + 128 against an offset start");
    const auto levels = [&](int r) { return simd::plus128(simd::block_levels<T, C>(blk[r], dec[r])); };
    __m512i wu[RT / 2];
    for (int p = 0; p < RT / 2; ++p) wu[p] = pair(levels(2 * p), levels(2 * p + 1));
    const int64_t e = bi * I::kBlock + 32 * C;
    for (int m = 0; m < MT; ++m) {
      const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].q + e)));
      const __m512i start =
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].offset + e / 4)));
      for (int p = 0; p < RT / 2; ++p)
        acc[p][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D::dot2(start, wu[p], x)), ds[p][m], acc[p][m]);
    }
  }

  template <int RT, int MT, int... C>
  static inline void paired_chunks(std::integer_sequence<int, C...>, const uint8_t* const (&blk)[RT],
                                   const ggml::Decoded<T> (&dec)[RT], const __m512 (&ds)[RT / 2][MT],
                                   const ggml::ActRow* acts, int64_t bi, __m512 (&acc)[RT / 2][MT]) {
    (paired_chunk<RT, MT, C>(blk, dec, ds, acts, bi, acc), ...);
  }

  // float_block for RT (even) rows held in pairs.
  template <int RT, int MT>
  static inline void paired_block(const uint8_t* const (&blk)[RT], const ggml::ActRow* acts, int64_t bi,
                                  __m512 (&acc)[RT / 2][MT]) {
    ggml::Decoded<T> sc[RT];
    for (int r = 0; r < RT; ++r) simd::block_scales(blk[r], sc[r]);
    // Pair p's scales d_w(2p) (lanes 0-7) and d_w(2p + 1) (lanes 8-15)
    // times each activation row's: the products of float_block's.
    const __m512 dw = _mm512_castps128_ps512(row_scales<RT>(blk, sc));
    __m512 ds[RT / 2][MT];
    for (int p = 0; p < RT / 2; ++p) {
      const __m512 dwp = _mm512_permutexvar_ps(pair_lanes(2 * p), dw);
      for (int m = 0; m < MT; ++m) ds[p][m] = _mm512_mul_ps(dwp, _mm512_set1_ps(acts[m].d[bi]));
    }
    paired_chunks<RT, MT>(std::make_integer_sequence<int, kChunks>{}, blk, sc, ds, acts, bi, acc);
  }
#endif

  // Block bi with fp32 sub-block scales d_w * d_x applied to every chunk.
  template <int RT, int MT>
  static inline void float_block(const uint8_t* const (&blk)[RT], const ggml::ActRow* acts, int64_t bi,
                                 __m256 (&acc)[RT][MT], __m256 (&mins)[RT][MT]) {
    ggml::Decoded<T> sc[RT];
    for (int r = 0; r < RT; ++r) simd::block_scales(blk[r], sc[r]);
    Scales<RT, MT> ds;
    if constexpr (kPackedScales<RT>) {
      // The RT weight scales in one vector times each activation scale: the
      // same fp32 products as one multiply per pair.
      const __m128 dw = row_scales<RT>(blk, sc);
      const __m256 dw2 = _mm256_set_m128(dw, dw);
      for (int m = 0; m < MT; ++m) ds.v[m] = _mm256_mul_ps(dw2, _mm256_set1_ps(acts[m].d[bi]));
    } else if constexpr (kActs > 1) {
      // Several activation blocks a weight block (NVFP4, Q1_0, Q2_0), each
      // sub-block inside one: lane s holds sub-block s's own d_w * d_x (the
      // same fp32 products as block_dot's). Built in registers: a lane at a
      // time through memory, the vector load would stall on the scalar stores.
      __m256 dw[RT];
      for (int r = 0; r < RT; ++r) dw[r] = _mm256_zextps128_ps256(load_floats<kSubs>(sc[r].d));
      for (int m = 0; m < MT; ++m) {
        // Activation block j = s * kSub / 32 in lane s: NVFP4's two a block each twice.
        static_assert(I::kSub == L::kBlock || 2 * I::kSub == L::kBlock, "one or two sub-blocks an activation block");
        const __m128 dx = load_floats<kActs>(acts[m].d + bi * kActs);
        const __m256 dxs = _mm256_zextps128_ps256(I::kSub == L::kBlock ? dx : _mm_unpacklo_ps(dx, dx));
        for (int r = 0; r < RT; ++r) ds.v[r][m][0] = _mm256_mul_ps(dw[r], dxs);
      }
    } else {
      for (int m = 0; m < MT; ++m) {
        const float dx = acts[m].d[bi];
        for (int r = 0; r < RT; ++r) {
          if constexpr (I::kBlock == I::kSub) {
            ds.v[r][m][0] = _mm256_set1_ps(sc[r].d[0] * dx);
          } else {
            static_assert((I::kBlock / I::kSub) % 8 == 0, "whole vectors of sub-block scales");
            for (int v = 0; v < kScaleVecs; ++v)
              ds.v[r][m][v] = _mm256_mul_ps(_mm256_loadu_ps(sc[r].d + 8 * v), _mm256_set1_ps(dx));
          }
        }
      }
    }
    chunks<RT, MT>(std::make_integer_sequence<int, kChunks>{}, blk, sc, ds, acts, bi, acc);
    if constexpr (I::kHasMin)
      for (int r = 0; r < RT; ++r) add_mins<MT>(sc[r], acts, bi, mins[r]);
  }

  // Whether run() takes tiles of kRowTile > 1 weight rows for M activation
  // rows: not for a matvec, whose single rows read a thread's weights as one
  // sequential stream (a tile reads its rows' blocks in turn, slower once
  // the weights come from memory); from M = 2 tiles share each decoded chunk.
  static bool row_tiles(int64_t M) { return kRowTile > 1 && M > 1; }
  // Whether run() reads ActRow::offset: row tiles in chunk()'s offset form,
  // and the GEMM of the signed one-scale types.
  static bool takes_offsets(int64_t M) {
    return (kOffsetDots<kRowTile> && row_tiles(M)) || (gemm(M) && !I::kHasMin && !kIntScales);
  }

  // Activation rows per panel: each weight row tile runs against a panel of
  // about 32 KB of int8 values (L1) before the next tile, and the thread's
  // weight rows (about 64k weights, row_chunk) go round again for the next
  // panel from L2. As one panel, a large batch's activations would stream
  // from L2 or beyond for every weight row.
  static int64_t panel_rows(int64_t n) { return std::max<int64_t>(kMaxRowTile, (32 << 10) / n / 4 * 4); }

  // Whether M activation rows take the GEMM with weight rows across the
  // lanes (ggml_gemm_vnni.h), where the unit has it and the type a GEMM form
  // (from the M of ggml_traits.h).
#if LOWBIT_SIMD_AVX512BW
  static constexpr bool kGemm = has_gemm_vnni<T>();
#else
  static constexpr bool kGemm = false;
#endif
  static constexpr int64_t kGemmRows = ggml_cpu_traits(T).gemm_rows;
  static bool gemm(int64_t M) { return kGemm && M >= kGemmRows; }

  static void run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                  float* out, int64_t rows) {
#if LOWBIT_SIMD_AVX512BW
    if constexpr (kGemm)
      if (gemm(M)) r0 = GemmVnni<GemmForm<T>>::run(W, r0, r1, n, acts, M, out, rows);
#endif
    const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
    const bool tiles = row_tiles(M);
    const int64_t panel = panel_rows(n);
    for (int64_t m0 = 0; m0 < M; m0 += panel) {
      const int64_t mp = std::min(panel, M - m0);
      const auto against_panel = [&](auto rt, int64_t r) {
        constexpr int RT = decltype(rt)::value;
        for_row_tiles(mp, [&](auto mt, int64_t m) {
          tile<RT, decltype(mt)::value>(W + r * row_bytes, row_bytes, blocks, acts + m0 + m,
                                        out + (m0 + m) * rows + r, rows);
        });
      };
      int64_t r = r0;
      if (tiles)
        for (; r + kRowTile <= r1; r += kRowTile) against_panel(std::integral_constant<int, kRowTile>{}, r);
      for (; r < r1; ++r) against_panel(std::integral_constant<int, 1>{}, r);
    }
  }
};

// Runs the kernel of a quantized `type` (dispatch_ggml_type validated ids).
template <class D>
bool run_matmul_simd(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts,
                     int64_t M, float* out, int64_t rows) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (!ggml::TypeInfo<T>::kFloat) {
      MatmulSimd<D, T>::run(W, r0, r1, n, acts, M, out, rows);
      ran = true;
    }
  });
  return ran;
}

// MatmulSimd<D, T>::takes_offsets for a quantized `type`.
template <class D>
bool matmul_simd_takes_offsets(int64_t type, int64_t M) {
  bool takes = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (!ggml::TypeInfo<T>::kFloat) takes = MatmulSimd<D, T>::takes_offsets(M);
  });
  return takes;
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
