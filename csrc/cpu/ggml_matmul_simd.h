// The GGUF matmul with 8-bit activations, written once over an int8 dot
// product D (DotAvx2: maddubs + madd; DotVnni: AVX-512 VNNI vpdpbusd) and
// instantiated per ISA in its own translation unit. Include only inside that
// unit's target pragma region.
//
// As in llama.cpp, each 32-element chunk of a block becomes 32 int8 levels in
// a register (ggml_levels_simd.h) and meets the activations' int8 values in
// an integer dot product; the sum of each sub-block is scaled by
// d_w * d_x in fp32, and the mins of K-quants go through the activations'
// block sums (block_dot in core/ggml_q8.h is the scalar statement of all of it).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <utility>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "ggml_levels_simd.h"

namespace lowbit {
namespace cpu {

template <class D, ggml::Type T>
struct MatmulSimd {
  using I = ggml::TypeInfo<T>;
  using L = ggml::ActLayout<I::kAct>;
  static constexpr int kChunks = I::kBlock / 32;
  static_assert(I::kSub == 16 || I::kSub % 32 == 0, "sub-blocks of 16 or a multiple of 32 elements");

  static float hsum(__m256 v) {
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
  }

  // Sub-block scales d_w * d_x of one block and activation row, 8 per vector
  // (a legacy block's single scale fills all lanes).
  static constexpr int kScaleVecs = (I::kBlock / I::kSub + 7) / 8;

  // Chunk C of block `bi` against MT activation rows, with scales ds.
  template <int MT, int C>
  static inline void chunk(const uint8_t* blk, const ggml::Decoded<T>& dec, const __m256 (&ds)[MT][kScaleVecs],
                           const ggml::ActRow* acts, int64_t bi, __m256 (&acc)[MT]) {
    const __m256i w = simd::block_levels<T, C>(blk, dec);
    // Types with mins have unsigned levels and go straight into the u8 x s8
    // product; signed levels go in as |w| with the sign moved onto x.
    const __m256i wu = I::kHasMin ? w : _mm256_abs_epi8(w);
    const int64_t e = bi * I::kBlock + 32 * C;
    for (int m = 0; m < MT; ++m) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acts[m].q + e));
      if constexpr (!I::kHasMin) x = _mm256_sign_epi8(x, w);
      const __m256 p = _mm256_cvtepi32_ps(D::dot(wu, x));  // lane i: elements 4i .. 4i+3
      __m256 scale;
      if constexpr (kChunks == 1) {
        scale = ds[m][0];
      } else if constexpr (I::kSub >= 32) {  // one sub-block in every lane
        constexpr int s = 32 * C / I::kSub;
        scale = _mm256_permutevar8x32_ps(ds[m][s / 8], _mm256_set1_epi32(s % 8));
      } else {  // lanes 0-3: sub-block 2C, lanes 4-7: sub-block 2C + 1
        constexpr int j = 2 * C % 8;
        scale = _mm256_permutevar8x32_ps(ds[m][C / 4], _mm256_setr_epi32(j, j, j, j, j + 1, j + 1, j + 1, j + 1));
      }
      acc[m] = _mm256_fmadd_ps(p, scale, acc[m]);
    }
  }

  template <int MT, int... C>
  static inline void chunks(std::integer_sequence<int, C...>, const uint8_t* blk, const ggml::Decoded<T>& dec,
                            const __m256 (&ds)[MT][kScaleVecs], const ggml::ActRow* acts, int64_t bi,
                            __m256 (&acc)[MT]) {
    (chunk<MT, C>(blk, dec, ds, acts, bi, acc), ...);
  }

  // mins += sum over sub-blocks s of m_w[s] * (d_x * sum of the sub-block's
  // activation levels): the K-quants' mins through Q8_K's integer block sums
  // (one per 16 elements), or Q8_1's s, which already includes d_x.
  template <int MT>
  static inline void add_mins(const ggml::Decoded<T>& sc, const ggml::ActRow* acts, int64_t bi, __m256 (&mins)[MT]) {
    constexpr int kSubs = I::kBlock / I::kSub;
    for (int m = 0; m < MT; ++m) {
      if constexpr (I::kAct == ggml::Act::Q8_K) {
        static_assert(L::kSumBlock == 16 && kSubs >= 8, "Q8_K sums per 16 for 8 or 16 sub-blocks");
        const float* sums = acts[m].sum + bi * 16;
        const __m256 dx = _mm256_set1_ps(acts[m].d[bi]);
        const __m256 lo = _mm256_loadu_ps(sums), hi = _mm256_loadu_ps(sums + 8);
        if constexpr (kSubs == 16) {
          mins[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sc.m), _mm256_mul_ps(dx, lo), mins[m]);
          mins[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sc.m + 8), _mm256_mul_ps(dx, hi), mins[m]);
        } else {  // 8 sub-blocks of 32: pairs of sums, hadd's order put back
          const __m256 pairs = _mm256_permutevar8x32_ps(_mm256_hadd_ps(lo, hi), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
          mins[m] = _mm256_fmadd_ps(_mm256_loadu_ps(sc.m), _mm256_mul_ps(dx, pairs), mins[m]);
        }
      } else {  // Q8_1: one sub-block, one sum per block
        static_assert(kSubs == 1 && L::kSumBlock == I::kBlock, "Q8_1 pairs with one 32-element sub-block");
        mins[m] = _mm256_add_ps(mins[m], _mm256_setr_ps(sc.m[0] * acts[m].sum[bi], 0, 0, 0, 0, 0, 0, 0));
      }
    }
  }

  // One weight row against MT activation rows: out[m * rows] for m < MT.
  template <int MT>
  static void row(const uint8_t* wrow, int64_t blocks, const ggml::ActRow* acts, float* out, int64_t rows) {
    __m256 acc[MT], mins[MT];
    for (int m = 0; m < MT; ++m) acc[m] = mins[m] = _mm256_setzero_ps();
    ggml::Decoded<T> sc;
    for (int64_t bi = 0; bi < blocks; ++bi) {
      const uint8_t* blk = wrow + bi * I::kBytes;
      simd::block_scales(blk, sc);
      __m256 ds[MT][kScaleVecs];
      for (int m = 0; m < MT; ++m) {
        // One activation scale per weight block: Q8_K's 256 or Q8_0/Q8_1's 32.
        static_assert(L::kBlock == I::kBlock, "activation blocks match weight blocks");
        const float dx = acts[m].d[bi];
        if constexpr (I::kBlock == I::kSub) {
          ds[m][0] = _mm256_set1_ps(sc.d[0] * dx);
        } else {
          static_assert((I::kBlock / I::kSub) % 8 == 0, "whole vectors of sub-block scales");
          for (int v = 0; v < kScaleVecs; ++v) ds[m][v] = _mm256_mul_ps(_mm256_loadu_ps(sc.d + 8 * v), _mm256_set1_ps(dx));
        }
      }
      chunks<MT>(std::make_integer_sequence<int, kChunks>{}, blk, sc, ds, acts, bi, acc);
      if constexpr (I::kHasMin) add_mins<MT>(sc, acts, bi, mins);
    }
    for (int m = 0; m < MT; ++m) out[m * rows] = hsum(_mm256_add_ps(acc[m], mins[m]));
  }

  static void run(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                  float* out, int64_t rows) {
    const int64_t blocks = n / I::kBlock;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = W + r * blocks * I::kBytes;
      // Up to 4 activation rows share each decoded chunk; more take another pass.
      for (int64_t m = 0; m < M;) {
        const int64_t left = M - m;
        float* o = out + m * rows + r;
        if (left >= 4) {
          row<4>(wrow, blocks, acts + m, o, rows), m += 4;
        } else if (left == 3) {
          row<3>(wrow, blocks, acts + m, o, rows), m += 3;
        } else if (left == 2) {
          row<2>(wrow, blocks, acts + m, o, rows), m += 2;
        } else {
          row<1>(wrow, blocks, acts + m, o, rows), m += 1;
        }
      }
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

}  // namespace cpu
}  // namespace lowbit
