// gptq_gemm's fused kernel for 2-, 3- and 4-bit weights and bf16 /
// fp16 activations on AVX512-BF16 (vdpbf16ps). Include only inside the
// target pragma region of gptq_fused_avx512bf16.cpp.
//
// vdpbf16ps multiplies bf16 pairs exactly (8-bit x 8-bit significands fit in
// fp32) and adds both products to an fp32 lane: two weights per lane per
// instruction, against one for the fp32 FMA kernel (gptq_fused_simd.h). The
// activations come as bf16 planes whose sum is the activation exactly: a bf16
// input is one plane; an fp16 input is hi = bf16(a) plus lo = a - hi, which
// fits in bf16 because fp16 has only 3 significand bits more. So the products
// are those of the fp32 kernel, and only the order of the fp32 additions
// differs.
//
// The weights: a 32-bit lane of a pack's words is one column; its two 16-bit
// halves each become one bf16 weight, so a lane meets the activation pair
// (a[k_lo], a[k_hi]) packed the same way. Bf16Pairs<B> shifts the words so
// that field k_lo sits at bits p .. p+B of the low half and k_hi at bits
// p' .. p'+B of the high half, p, p' <= 7 - B (inside a bf16's 7-bit
// significand).
// One vpternlogd then keeps those bits and sets the exponent of 2^(7-p),
// which makes the half the bf16 of 2^(7-p) + q exactly: no table lookup, and
// one shifted vector serves every field it holds in range, each with its own
// mask. The level offsets and the zero point leave the inner loop:
//     out[m, n] += s[g, n] * (sum_k a[m, k] (base[k] + q[k, n])
//                             - z[g, n] sum_k a[m, k] - sum_k a[m, k] base[k]).
// The offsets (8 to 128, against q < 16) cost cancellation in the fp32 sums,
// a relative error of about 2^-24 * base / |q - z| per addition: far below
// the rounding of the output to bf16 or fp16, the activations' dtype. Pairs
// still take the highest position p that costs no extra shift.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "gptq_group_simd.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

// Every 16-bit half shifted right by D bits, or left by -D.
template <int D>
inline __m512i shift16(__m512i v) {
  if constexpr (D > 0) return _mm512_srli_epi16(v, D);
  if constexpr (D < 0) return _mm512_slli_epi16(v, -D);
  return v;
}


// How the words of one pack (one column vector) become kPairs vectors:
// vector I holds field kLo[I] of the pack at bits kAt[I][0] .. kAt[I][0] + B
// of each lane's low half and field kHi[I] at bits kAt[I][1] .. of its high
// half; the other bits are don't-care. Pairs that share a shifted vector are
// consecutive.
template <int B>
struct Bf16Pairs;

// 2-bit: a word holds rows 0-7 in its low half and 8-15 in its high half, at
// bits 2i of each. Bits 3 and 5 (bases 16 and 4) take two fields per shift.
template <>
struct Bf16Pairs<2> {
  static constexpr int kPairs = 8;
  static constexpr int kLo[kPairs] = {0, 1, 2, 3, 4, 5, 6, 7};
  static constexpr int kHi[kPairs] = {8, 9, 10, 11, 12, 13, 14, 15};
  static constexpr int kAt[kPairs][2] = {{3, 3}, {5, 5}, {3, 3}, {5, 5}, {3, 3}, {5, 5}, {3, 3}, {5, 5}};
  struct Words {
    __m512i w;
  };
  static Words prepare(const __m512i* raw) { return {raw[0]}; }
  template <int I>
  static __m512i pair(const Words& x) {
    return shift16<2 * (I - I % 2) - 3>(x.w);
  }
};

// 3-bit: 32 fields in 3 words (gptq_format.h), field f at bits 3f of the
// 96-bit stream the words make. Each pair takes a 32-bit window of that
// stream from bit s (one vpshrdd across two words, one shift at its ends)
// holding its low field at bit 3 lo - s and its high one at 3 hi - s - 16.
// A window from s = 3a - 1 serves two pairs, (a, a + 5) at bits (1, 0) and
// (a + 1, a + 6) at (4, 3); six such windows (a = 0, 2, 11, 14, 23, 25, s =
// 32 needing no shift) and four windows of one pair cover all 32 fields: 9
// shifts per 16 pairs, against 16 when each word was cut apart alone.
template <>
struct Bf16Pairs<3> {
  static constexpr int kPairs = 16;
  static constexpr int kLo[kPairs] = {0, 1, 2, 3, 11, 12, 14, 15, 23, 24, 25, 26, 4, 9, 18, 21};
  static constexpr int kHi[kPairs] = {5, 6, 7, 8, 16, 17, 19, 20, 28, 29, 30, 31, 10, 13, 22, 27};
  static constexpr int kFrom[kPairs] = {-1, -1, 5, 5, 32, 32, 41, 41, 68, 68, 74, 74, 10, 23, 50, 61};
  static constexpr int kAt[kPairs][2] = {{1, 0}, {4, 3}, {1, 0}, {4, 3}, {1, 0}, {4, 3}, {1, 0}, {4, 3},
                                         {1, 0}, {4, 3}, {1, 0}, {4, 3}, {2, 4}, {4, 0}, {4, 0}, {2, 4}};
  struct Words {
    __m512i raw[3];
  };
  static Words prepare(const __m512i* raw) { return {{raw[0], raw[1], raw[2]}}; }
  // Bits S .. S + 31 of the stream (zeros past its ends).
  template <int S>
  static __m512i window(const Words& x) {
    if constexpr (S < 0) return _mm512_slli_epi32(x.raw[0], -S);
    if constexpr (S >= 64) return _mm512_srli_epi32(x.raw[2], S - 64);
    if constexpr (S >= 0 && S < 64 && S % 32 == 0) return x.raw[S / 32];
    if constexpr (S >= 0 && S < 64 && S % 32 != 0)
      return _mm512_shrdi_epi32(x.raw[S / 32], x.raw[S / 32 + 1], S % 32);
    return _mm512_setzero_si512();  // unreachable
  }
  template <int I>
  static __m512i pair(const Words& x) {
    static_assert(3 * kLo[I] - kFrom[I] == kAt[I][0] && 3 * kHi[I] - kFrom[I] - 16 == kAt[I][1], "pair table");
    return window<kFrom[I]>(x);
  }
};

// 4-bit: a word holds rows 0-3 in its low half and 4-7 in its high half, at
// bits 4i of each: one 16-bit shift per pair (I, 4 + I), to bit 3 (base 16).
template <>
struct Bf16Pairs<4> {
  static constexpr int kPairs = 4;
  static constexpr int kLo[kPairs] = {0, 1, 2, 3};
  static constexpr int kHi[kPairs] = {4, 5, 6, 7};
  static constexpr int kAt[kPairs][2] = {{3, 3}, {3, 3}, {3, 3}, {3, 3}};
  struct Words {
    __m512i w;
  };
  static Words prepare(const __m512i* raw) { return {raw[0]}; }
  template <int I>
  static __m512i pair(const Words& x) {
    return shift16<4 * I - 3>(x.w);
  }
};

template <int B>
struct FusedBf16 {
  using P = gptq::Pack<B>;
  using Pairs = Bf16Pairs<B>;
  static constexpr int L = 16;         // fp32 lanes (columns) per vector
  static constexpr int kMaxRows = kFusedMaxRows;

  template <int MT>
  static constexpr int kU = MT <= 2 ? 4 : 2;  // column vectors per tile: accumulators in registers

  // The level offset of a field at bit `at`: its bf16 is base + q.
  static constexpr float base_at(int at) { return static_cast<float>(1 << (7 - at)); }

  // Pair vector I as bf16 levels base + q in both halves: keep the fields'
  // bits and set the exponent of each half's base, one vpternlogd
  // ((v & mask) | bits).
  template <int I>
  static __m512i decode(__m512i v) {
    constexpr int lo = Pairs::kAt[I][0], hi = Pairs::kAt[I][1];
    constexpr uint32_t mask = P::kMask << lo | P::kMask << (16 + hi);
    constexpr uint32_t bits = (127u + 7 - lo) << 7 | (127u + 7 - hi) << (16 + 7);
    return _mm512_ternarylogic_epi32(v, _mm512_set1_epi32(static_cast<int32_t>(mask)),
                                     _mm512_set1_epi32(static_cast<int32_t>(bits)), 0xEA);
  }

  // pairs[((plane * MT + m) * packs + p) * kPairs + I] = (a[k + kLo[I]],
  // a[k + kHi[I]]) as two bf16 in one word, k = kFields * p: the activation
  // side of each vdpbf16ps. offset[m] = sum_k a[m, k] base[k] and a_sum[m] =
  // sum_k a[m, k] over the group.
  struct Group {
    const uint32_t* pairs;
    int64_t packs;
    int planes;
    float a_sum[kMaxRows];
    float offset[kMaxRows];
  };

  template <int MT, int U, int I>
  static inline void pair(const typename Pairs::Words (&x)[U], const Group& in, int64_t p, __m512 (&acc)[MT][U]) {
    __m512bh qv[U];
    for (int u = 0; u < U; ++u) qv[u] = (__m512bh)decode<I>(Pairs::template pair<I>(x[u]));
    for (int plane = 0; plane < in.planes; ++plane)
      for (int m = 0; m < MT; ++m) {
        const uint32_t word = in.pairs[((plane * MT + m) * in.packs + p) * Pairs::kPairs + I];
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word));
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], qv[u], a);
      }
  }
  template <int MT, int U, int... I>
  static inline void pairs(std::integer_sequence<int, I...>, const typename Pairs::Words (&x)[U], const Group& in,
                           int64_t p, __m512 (&acc)[MT][U]) {
    (pair<MT, U, I>(x, in, p, acc), ...);
  }

  template <int MT>
  static void tile(const Group& in, const uint32_t* q, int64_t N, const int32_t* z, const float* s, float* out) {
    constexpr int U = kU<MT>;
    __m512 acc[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < in.packs; ++p) {
      typename Pairs::Words x[U];
      for (int u = 0; u < U; ++u) {
        __m512i raw[P::kWords];
        for (int w = 0; w < P::kWords; ++w) {
          const uint32_t* row = q + (p * P::kWords + w) * N + u * L;
          __builtin_prefetch(row + kFusedPrefetchWords, 0, 2);  // read, locality 2: prefetcht1, into L2
          raw[w] = _mm512_loadu_si512(row);
        }
        x[u] = Pairs::prepare(raw);
      }
      pairs<MT, U>(std::make_integer_sequence<int, Pairs::kPairs>{}, x, in, p, acc);
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) {
        const __m512 zero = _mm512_cvtepi32_ps(_mm512_loadu_si512(z + u * L));
        const __m512 dot = _mm512_sub_ps(acc[m][u], _mm512_set1_ps(in.offset[m]));
        const __m512 sum = _mm512_fnmadd_ps(zero, _mm512_set1_ps(in.a_sum[m]), dot);
        float* o = out + m * N + u * L;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(s + u * L), sum, _mm512_loadu_ps(o)));
      }
  }

  // base[i]: the level offset of row i of a pack.
  struct Bases {
    float of[P::kFields];
    constexpr Bases() : of{} {
      for (int i = 0; i < Pairs::kPairs; ++i) {
        of[Pairs::kLo[i]] = base_at(Pairs::kAt[i][0]);
        of[Pairs::kHi[i]] = base_at(Pairs::kAt[i][1]);
      }
    }
  };

  // Rows m0 .. m0+MT of out[:, n0:n1], group g, whose zero points and scales
  // for those columns are z and s.
  template <int MT>
  static void group_rows(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t g, int64_t m0,
                         int64_t n0, int64_t n1, const int32_t* z, const float* s, std::vector<uint32_t>& scratch,
                         float* out) {
    static constexpr Bases base;
    const int64_t gs = w.group_of.group_size;
    const int64_t rows = std::min(gs, w.K - g * gs);  // the last group may be short
    Group in{nullptr, rows / P::kFields, a16.planes, {}, {}};
    for (int m = 0; m < MT; ++m) {
      const float* am = a + (m0 + m) * w.K + g * gs;
      float sum = 0.0f, offset = 0.0f;
      for (int64_t k = 0; k < rows; ++k) {
        sum += am[k];
        offset += am[k] * base.of[k % P::kFields];
      }
      in.a_sum[m] = sum;
      in.offset[m] = offset;
    }
    scratch.resize(static_cast<size_t>(in.planes * MT * in.packs * Pairs::kPairs));
    for (int plane = 0; plane < in.planes; ++plane)
      for (int m = 0; m < MT; ++m) {
        const uint16_t* x = a16.data + (plane * a16.M + m0 + m) * w.K + g * gs;
        uint32_t* dst = scratch.data() + (plane * MT + m) * in.packs * Pairs::kPairs;
        for (int64_t p = 0; p < in.packs; ++p, x += P::kFields)
          for (int i = 0; i < Pairs::kPairs; ++i)
            dst[p * Pairs::kPairs + i] = x[Pairs::kLo[i]] | static_cast<uint32_t>(x[Pairs::kHi[i]]) << 16;
      }
    in.pairs = scratch.data();
    const uint32_t* qg = w.qweight + g * (gs / P::kFields) * P::kWords * w.N;
    for (int64_t n = n0; n < n1; n += kU<MT> * L)
      tile<MT>(in, qg + n, w.N, z + (n - n0), s + (n - n0), out + m0 * w.N + n);
  }

  static void run(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    std::vector<uint32_t> scratch;
    for_group_row_tiles<B>(w, a16.M, n0, n1, out, [&](auto mt, int64_t g, int64_t m0, const int32_t* z, const float* s) {
      group_rows<decltype(mt)::value>(a, a16, w, g, m0, n0, n1, z, s, scratch, out);
    });
  }
};

// Runs the kernel of bit width `bits` (2, 3 or 4).
inline void run_fused_bf16(int bits, const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0,
                           int64_t n1, float* out) {
  switch (bits) {
    case 2: return FusedBf16<2>::run(a, a16, w, n0, n1, out);
    case 3: return FusedBf16<3>::run(a, a16, w, n0, n1, out);
    case 4: return FusedBf16<4>::run(a, a16, w, n0, n1, out);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
