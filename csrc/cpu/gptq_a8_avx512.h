// gptq_gemm_a8's kernel for 2-, 4- and 8-bit weights on AVX-512 VNNI. Include
// only inside the target pragma region of gptq_fused_avx512.cpp.
//
// Lanes are output columns, as in the fp32 kernel (gptq_fused_simd.h), but
// the weights never become floats: a 32-bit lane of a packed word holds
// 32/B fields of one column, and shifting it right by j*B bits and masking
// B bits of every byte leaves fields j, S+j, 2S+j, 3S+j (S = 8/B) as four
// unsigned bytes. vpdpbusd multiplies them by four int8 activations, the
// dword of the pack that a8_byte<B> laid out for shift j, and adds the four
// products to the lane's int32 sum: one instruction per 4 weights per
// column, against a shift, a lookup and an FMA per weight in fp32. Per group
// and column the sum is exact; the zero point leaves it through the group's
// activation sum, and the two scales multiply it once:
//     out[m, n] = fma(s[g, n] * d[m, g], float(sum_k q_a q_w - z sum_k q_a), out[m, n])
// group by group, the portable kernel's order, so both give the same bits.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "gptq_group_simd.h"
#include "gptq_kernels.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy (gptq_fused_simd.h).
namespace {

template <int B>
struct A8Avx512 {
  static_assert(B == 2 || B == 4 || B == 8, "3-bit fields straddle words: the portable kernel reads them");
  static constexpr int F = 32 / B;  // fields per word
  static constexpr int S = 8 / B;   // shifts per word, each giving 4 fields per lane
  static constexpr int L = 16;      // columns per vector
  static constexpr int U = 4;       // column vectors per tile (kAvx512FusedCols)
  static constexpr uint32_t kByteMask = ((1u << B) - 1u) * 0x01010101u;

  // One group (packs words from word row q, rows N apart) of MT activation
  // rows x U*L columns, added to out (rows N apart). x: row m0's dwords at
  // the group's first pack, rows K/4 dwords apart.
  template <int MT>
  __attribute__((noinline)) static void group_tile(const int32_t* x, int64_t x_stride, const uint32_t* q, int64_t N,
                                                   int64_t packs, int64_t ahead, const int32_t* z, const float* s,
                                                   const float* d, const int32_t* a_sum, float* out) {
    __m512i acc[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_si512();
    const __m512i mask = _mm512_set1_epi32(static_cast<int>(kByteMask));
    for (int64_t p = 0; p < packs; ++p) {
      __m512i words[U];
      for (int u = 0; u < U; ++u) {
        const uint32_t* row = q + p * N + u * L;
        __builtin_prefetch(row + ahead, 0, 2);  // the next group's rows, into L2
        words[u] = _mm512_loadu_si512(row);
      }
      for (int j = 0; j < S; ++j) {
        __m512i fields[U];
        for (int u = 0; u < U; ++u) {
          fields[u] = j == 0 ? words[u] : _mm512_srli_epi32(words[u], j * B);
          if constexpr (B < 8) fields[u] = _mm512_and_si512(fields[u], mask);
        }
        for (int m = 0; m < MT; ++m) {
          const __m512i a = _mm512_set1_epi32(x[m * x_stride + p * S + j]);
          for (int u = 0; u < U; ++u) acc[m][u] = _mm512_dpbusd_epi32(acc[m][u], fields[u], a);
        }
      }
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 dm = _mm512_set1_ps(d[m]);
      const __m512i sum_m = _mm512_set1_epi32(a_sum[m]);
      for (int u = 0; u < U; ++u) {
        const __m512i r = _mm512_sub_epi32(acc[m][u], _mm512_mullo_epi32(_mm512_loadu_si512(z + u * L), sum_m));
        const __m512 sd = _mm512_mul_ps(_mm512_loadu_ps(s + u * L), dm);
        float* o = out + m * N + u * L;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(sd, _mm512_cvtepi32_ps(r), _mm512_loadu_ps(o)));
      }
    }
  }

  static void run(const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    const int64_t gs = w.group_of.group_size;
    const int64_t x_stride = w.K / 4;
    const int64_t group_words = gs / F * w.N;
    for_group_row_tiles<B>(w, M, n0, n1, out, [&](auto mt, int64_t g, int64_t m0, const int32_t* z, const float* s) {
      constexpr int MT = decltype(mt)::value;
      const int64_t packs = (std::min(gs, w.K - g * gs)) / F;  // the last group may be short
      float d[MT];
      int32_t a_sum[MT];
      for (int m = 0; m < MT; ++m) {
        d[m] = x.scale[(m0 + m) * x.groups + g];
        a_sum[m] = x.sum[(m0 + m) * x.groups + g];
      }
      const int32_t* xg = reinterpret_cast<const int32_t*>(x.q + m0 * w.K + g * gs);
      const uint32_t* qg = w.qweight + g * group_words;
      for (int64_t n = n0; n < n1; n += U * L) {
        group_tile<MT>(xg, x_stride, qg + n, w.N, packs, group_words, z + (n - n0), s + (n - n0), d, a_sum,
                       out + m0 * w.N + n);
      }
    });
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
