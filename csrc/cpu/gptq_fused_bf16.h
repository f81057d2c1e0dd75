// gptq_gemm's fused kernel for bf16 / fp16 activations on AVX512-BF16
// (vdpbf16ps), every bit width. Include only inside the target pragma region
// of gptq_fused_avx512bf16.cpp.
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
// The weights: a 32-bit lane of a pack's words is one column; each pair
// vector (Bf16Pairs<B>::levels) holds in every lane two of its fields as bf16
// levels base + q, the low half field kLo[I] and the high half kHi[I], so a
// lane meets the activation pair (a[k_lo], a[k_hi]) packed the same way. The
// level offsets and the zero point leave the inner loop:
//     out[m, n] += s[g, n] * (sum_k a[m, k] (base[k] + q[k, n])
//                             - z[g, n] sum_k a[m, k] - sum_k a[m, k] base[k]).
// The offsets (up to 128) and the zero points (up to 255) cost cancellation in
// the fp32 sums, a relative error of about 2^-24 * (base + z) / |q - z| per
// addition: far below the rounding of the output to bf16 or fp16, the
// activations' dtype.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "gptq_group_simd.h"
#include "row_tiles.h"
#include "static_for.h"

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


// How the words of one pack (one column vector) become kPairs pair vectors
// of bf16 levels (levels<I>), the level offset base(I, half) of each field,
// and the column each lane of a sum over those vectors belongs to
// (in_column_order).
template <int B>
struct Bf16Pairs;

// 2-, 3- and 4-bit fields take their levels from the exponent: Derived::pair<I>
// shifts the words so that field kLo[I] sits at bits at = kAt[I][0] .. at + B
// of each lane's low half and kHi[I] at bits kAt[I][1] .. of its high half,
// at <= 7 - B (inside a bf16's 7-bit significand; the other bits are
// don't-care). One vpternlogd then keeps those bits and sets the exponent of
// 2^(7 - at), which makes the half the bf16 of 2^(7 - at) + q exactly: no
// table lookup, and one shifted vector serves every field it holds in range,
// each with its own mask. Pairs take the highest position that costs no extra
// shift, the smallest offset, and those that share a shifted vector are
// consecutive.
template <int B, class Derived>
struct ExponentPairs {
  template <int I, class Words>  // Derived::Words, incomplete where this is declared
  static __m512i levels(const Words& x) {
    constexpr int lo = Derived::kAt[I][0], hi = Derived::kAt[I][1];
    constexpr uint32_t mask = gptq::Pack<B>::kMask << lo | gptq::Pack<B>::kMask << (16 + hi);
    constexpr uint32_t bits = (127u + 7 - lo) << 7 | (127u + 7 - hi) << (16 + 7);
    // (v & mask) | bits
    return _mm512_ternarylogic_epi32(Derived::template pair<I>(x), _mm512_set1_epi32(static_cast<int32_t>(mask)),
                                     _mm512_set1_epi32(static_cast<int32_t>(bits)), 0xEA);
  }
  static constexpr float base(int i, int half) { return static_cast<float>(1 << (7 - Derived::kAt[i][half])); }
  static __m512 in_column_order(__m512 sums) { return sums; }
};

// 2-bit: a word holds rows 0-7 in its low half and 8-15 in its high half, at
// bits 2i of each. Bits 3 and 5 (bases 16 and 4) take two fields per shift.
template <>
struct Bf16Pairs<2> : ExponentPairs<2, Bf16Pairs<2>> {
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
struct Bf16Pairs<3> : ExponentPairs<3, Bf16Pairs<3>> {
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
struct Bf16Pairs<4> : ExponentPairs<4, Bf16Pairs<4>> {
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

// 8-bit: a word holds rows 0-3 as its bytes. 2^7 + q would need 9
// significand bits, but q itself (< 256) is exact in bf16: vpshufb spreads
// the bytes of rows (r, r + 1) of two columns into zero-extended 32-bit
// lanes, vcvtdq2ps makes them floats and vcvtne2ps2bf16 packs two such
// vectors into one of bf16 pairs, exactly. The offset is 0 and the zero point
// still leaves the loop. vpshufb keeps bytes in their 128-bit lane, so lane
// 2j + t of a pair vector (j < 4, t < 2) holds column 4j + t, and lane
// 8 + 2j + t column 4j + 2 + t; in_column_order undoes that in each sum.
// (vpermb would keep the order but needs AVX512-VBMI, which Cooper Lake,
// with AVX512-BF16, lacks.)
template <>
struct Bf16Pairs<8> {
  static constexpr int kPairs = 2;
  static constexpr int kLo[kPairs] = {0, 2};
  static constexpr int kHi[kPairs] = {1, 3};
  struct Words {
    __m512i w;
  };
  static Words prepare(const __m512i* raw) { return {raw[0]}; }
  // Rows r and r + 1 of columns c0 and c0 + 1 of each 128-bit lane (4
  // columns), one byte per 32-bit lane; index bit 7 zeroes the byte.
  template <int R, int C0>
  static __m512 rows_as_floats(__m512i w) {
    constexpr char z = static_cast<char>(0x80), a = 4 * C0 + R, b = 4 * C0 + 4 + R;
    const __m128i spread = _mm_setr_epi8(a, z, z, z, a + 1, z, z, z, b, z, z, z, b + 1, z, z, z);
    return _mm512_cvtepi32_ps(_mm512_shuffle_epi8(w, _mm512_broadcast_i32x4(spread)));
  }
  template <int I>
  static __m512i levels(const Words& x) {
    return (__m512i)_mm512_cvtne2ps_pbh(rows_as_floats<2 * I, 2>(x.w), rows_as_floats<2 * I, 0>(x.w));
  }
  static constexpr float base(int, int) { return 0.0f; }
  static __m512 in_column_order(__m512 sums) {
    const __m512i lane_of_column = _mm512_setr_epi32(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
    return _mm512_permutexvar_ps(lane_of_column, sums);
  }
};

template <int B>
struct FusedBf16 {
  using P = gptq::Pack<B>;
  using Pairs = Bf16Pairs<B>;
  using Words = typename Pairs::Words;
  static constexpr int L = 16;  // fp32 lanes (columns) per vector
  // Rows of a group taken at a time: a panel (below) of that many rows stays
  // in L1 (8 KB). The zero-point and offset terms are linear, so a group's
  // chunks each add their own share to out.
  static constexpr int64_t kChunkRows = 128;
  // Column vectors of a panel and of the tiles that read it. With 4, GCC
  // keeps a 4-row tile's 4 x 4 accumulators on the stack.
  static constexpr int kPanelU = 2;
  // Column vectors of a tile that decodes as it goes: its accumulators and
  // the decoding share the registers.
  template <int MT>
  static constexpr int kU = MT <= 2 ? 4 : 2;
  // The most activation rows whose tiles each decode as they go; more share
  // a panel. 8-bit levels take the vdpbf16ps's own ports (vcvtdq2ps,
  // vcvtne2ps2bf16), so a second row tile already pays for the panel;
  // 3-bit's shifts and merges pay soon after; 2- and 4-bit decode on other
  // ports, and panels only pay (and run steadier) for large M.
  static constexpr int64_t kDecodeMaxRows = B == 8 ? kFusedMaxRows : B == 3 ? 8 : 32;

  // The activation side of a chunk of rows k0 .. k0 + kFields * packs, for
  // every row m < M: pairs[((plane * M + m) * packs + p) * kPairs + I] =
  // (a[m, k + kLo[I]], a[m, k + kHi[I]]) as two bf16 in one word, k = k0 +
  // kFields * p, what each vdpbf16ps broadcasts; a_sum[m] = sum_k a[m, k]
  // and offset[m] = sum_k a[m, k] base[k] over the chunk.
  struct Chunk {
    int64_t M = 0, packs = 0;
    int planes = 0;
    std::vector<uint32_t> pairs;
    std::vector<float> a_sum, offset;
  };

  // base[i]: the level offset of row i of a pack.
  struct Bases {
    float of[P::kFields];
    constexpr Bases() : of{} {
      for (int i = 0; i < Pairs::kPairs; ++i) {
        of[Pairs::kLo[i]] = Pairs::base(i, 0);
        of[Pairs::kHi[i]] = Pairs::base(i, 1);
      }
    }
  };

  static void read_chunk(const float* a, const Bf16Acts& a16, int64_t K, int64_t k0, int64_t rows, Chunk& in) {
    static constexpr Bases base;
    in.M = a16.M, in.packs = rows / P::kFields, in.planes = a16.planes;
    in.a_sum.resize(static_cast<size_t>(in.M));
    in.offset.resize(static_cast<size_t>(in.M));
    for (int64_t m = 0; m < in.M; ++m) {
      const float* am = a + m * K + k0;
      float sum = 0.0f, offset = 0.0f;
      for (int64_t k = 0; k < rows; ++k) {
        sum += am[k];
        offset += am[k] * base.of[k % P::kFields];
      }
      in.a_sum[m] = sum;
      in.offset[m] = offset;
    }
    in.pairs.resize(static_cast<size_t>(in.planes * in.M * in.packs * Pairs::kPairs));
    for (int64_t pm = 0; pm < in.planes * in.M; ++pm) {  // plane * M + m
      const uint16_t* x = a16.data + pm * K + k0;
      uint32_t* dst = in.pairs.data() + pm * in.packs * Pairs::kPairs;
      for (int64_t p = 0; p < in.packs; ++p, x += P::kFields)
        for (int i = 0; i < Pairs::kPairs; ++i)
          dst[p * Pairs::kPairs + i] = x[Pairs::kLo[i]] | static_cast<uint32_t>(x[Pairs::kHi[i]]) << 16;
    }
  }

  // Where a tile's pair vectors come from: decoded from the packed words as
  // the tile goes, where it is the only row tile and each is used once ...
  template <int U>
  struct Decoded {
    const uint32_t* q;  // the chunk's first words, at the tile's first column
    int64_t stride;     // words from a row to the next
    int64_t ahead;  // words from a row to the same column of the next chunk's, prefetched
    struct Pack {
      Words x[U];
    };
    Pack at(int64_t p) const {
      Pack pack;
      for (int u = 0; u < U; ++u) {
        __m512i raw[P::kWords];
        for (int w = 0; w < P::kWords; ++w) {
          const uint32_t* row = q + (p * P::kWords + w) * stride + u * L;
          __builtin_prefetch(row + ahead, 0, 2);  // read, locality 2: prefetcht1, into L2
          raw[w] = _mm512_loadu_si512(row);
          // Held in a register: GCC would fold this load into each shift
          // that reads it, 4 to 16 loads of a line still on its way from L2
          // (a third slower at M = 1).
          asm("" : "+v"(raw[w]));
        }
        pack.x[u] = Pairs::prepare(raw);
      }
      return pack;
    }
    template <int I>
    static __m512bh level_pair(const Pack& pack, int u) {
      return (__m512bh)Pairs::template levels<I>(pack.x[u]);
    }
  };
  // ... or from a panel decoded once for every row tile, where decoding in
  // each would cost as much as the products (8-bit: vcvtdq2ps and
  // vcvtne2ps2bf16 take the vdpbf16ps's ports): panel[(p * kPairs + I) * U + u].
  template <int U>
  struct Panel {
    const __m512i* panel;
    using Pack = const __m512i*;
    Pack at(int64_t p) const { return panel + p * Pairs::kPairs * U; }
    template <int I>
    static __m512bh level_pair(const __m512i* pack, int u) {
      return (__m512bh)_mm512_load_si512(pack + I * U + u);
    }
  };

  static void decode_panel(const uint32_t* q, int64_t stride, int64_t packs, __m512i* panel) {
    using Source = Decoded<kPanelU>;
    for (int64_t p = 0; p < packs; ++p) {
      const typename Source::Pack pack = Source{q, stride}.at(p);
      static_for<Pairs::kPairs>([&](auto I) {
        for (int u = 0; u < kPanelU; ++u)
          _mm512_store_si512(panel + (p * Pairs::kPairs + I) * kPanelU + u,
                             (__m512i)Source::template level_pair<decltype(I)::value>(pack, u));
      });
    }
  }

  // Pair I of pack p, whose activation pairs for the tile's rows start at
  // `pairs` (planes plane_words apart), into the accumulators. A function
  // rather than a lambda: GCC kept a lambda's captured accumulators in
  // memory, which cost the matvec a third of its time.
  template <int MT, int U, int Planes, class Source, int I>
  static inline void pair(const Source::Pack& pack, const uint32_t* pairs, int64_t packs, int64_t plane_words,
                          int64_t p, __m512 (&acc)[MT][U]) {
    __m512bh qv[U];
    for (int u = 0; u < U; ++u) qv[u] = Source::template level_pair<I>(pack, u);
    for (int plane = 0; plane < Planes; ++plane)
      for (int m = 0; m < MT; ++m) {
        const uint32_t word = pairs[plane * plane_words + (m * packs + p) * Pairs::kPairs + I];
        const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(word));
        for (int u = 0; u < U; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], qv[u], a);
      }
  }
  template <int MT, int U, int Planes, class Source, int... I>
  static inline void pairs_of_pack(std::integer_sequence<int, I...>, const Source::Pack& pack, const uint32_t* pairs,
                                   int64_t packs, int64_t plane_words, int64_t p, __m512 (&acc)[MT][U]) {
    (pair<MT, U, Planes, Source, I>(pack, pairs, packs, plane_words, p, acc), ...);
  }

  // Adds the chunk's share of rows m0 .. m0 + MT and U column vectors to out
  // (rows N apart; out, z and s at the tile's first column). Planes is
  // in.planes, a constant so that the accumulators stay in registers across
  // its loop.
  template <int MT, int U, int Planes, class Source>
  static void tile(Source src, const Chunk& in, int64_t m0, const int32_t* z, const float* s, float* out,
                   int64_t N) {
    __m512 acc[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    const int64_t plane_words = in.M * in.packs * Pairs::kPairs;
    const uint32_t* pairs = in.pairs.data() + m0 * in.packs * Pairs::kPairs;
    for (int64_t p = 0; p < in.packs; ++p)
      pairs_of_pack<MT, U, Planes, Source>(std::make_integer_sequence<int, Pairs::kPairs>{}, src.at(p), pairs,
                                           in.packs, plane_words, p, acc);
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) {
        const __m512 zero = _mm512_cvtepi32_ps(_mm512_loadu_si512(z + u * L));
        const __m512 dot = _mm512_sub_ps(Pairs::in_column_order(acc[m][u]), _mm512_set1_ps(in.offset[m0 + m]));
        const __m512 sum = _mm512_fnmadd_ps(zero, _mm512_set1_ps(in.a_sum[m0 + m]), dot);
        float* o = out + (m0 + m) * N + u * L;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(s + u * L), sum, _mm512_loadu_ps(o)));
      }
  }

  // out[:, n0:n1] for all a16.M rows: group by group, chunk by chunk. Up to
  // kDecodeMaxRows rows, each row tile decodes as it goes; more share a
  // panel per kPanelU column vectors.
  template <int Planes>
  static void run_planes(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0, int64_t n1,
                         float* out) {
    const int64_t M = a16.M, N = w.N, gs = w.group_of.group_size;
    __m512i panel[kChunkRows / 2 * kPanelU];  // a chunk's pair vectors, kChunkRows / 2 a column vector
    Chunk in;
    for_groups<B>(w, M, n0, n1, out, [&](int64_t g, const int32_t* z, const float* s) {
      const int64_t group_end = std::min(w.K, (g + 1) * gs);  // the last group may be short
      for (int64_t k0 = g * gs; k0 < group_end; k0 += kChunkRows) {
        read_chunk(a, a16, w.K, k0, std::min(kChunkRows, group_end - k0), in);
        const int64_t row = k0 / P::kFields * P::kWords, stride = w.row_stride();
        // In the checkpoint's layout a task's columns of a chunk's rows are
        // short runs N * 4 bytes apart, too many streams for the hardware
        // prefetcher: each tile prefetches its columns of the next chunk's
        // rows (in the panel layout, the words that follow). A tile's
        // columns divide a panel's, so no tile crosses one.
        const int64_t ahead = kChunkRows / P::kFields * P::kWords * stride;
        if (M <= kDecodeMaxRows) {
          for_row_tiles(M, [&](auto mt, int64_t m0) {
            constexpr int MT = decltype(mt)::value, U = kU<MT>;
            for (int64_t n = n0; n < n1; n += U * L)
              tile<MT, U, Planes>(Decoded<U>{w.words(row, n), stride, ahead}, in, m0, z + (n - n0), s + (n - n0), out + n, N);
          });
          continue;
        }
        for (int64_t n = n0; n < n1; n += kPanelU * L) {
          decode_panel(w.words(row, n), stride, in.packs, panel);
          for_row_tiles(M, [&](auto mt, int64_t m0) {
            tile<decltype(mt)::value, kPanelU, Planes>(Panel<kPanelU>{panel}, in, m0, z + (n - n0), s + (n - n0),
                                                       out + n, N);
          });
        }
      }
    });
  }

  static void run(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    if (a16.planes == 1) return run_planes<1>(a, a16, w, n0, n1, out);
    run_planes<2>(a, a16, w, n0, n1, out);
  }
};

// Runs the kernel of bit width `bits`.
inline void run_fused_bf16(int bits, const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0,
                           int64_t n1, float* out) {
  switch (bits) {
    case 2: return FusedBf16<2>::run(a, a16, w, n0, n1, out);
    case 3: return FusedBf16<3>::run(a, a16, w, n0, n1, out);
    case 4: return FusedBf16<4>::run(a, a16, w, n0, n1, out);
    case 8: return FusedBf16<8>::run(a, a16, w, n0, n1, out);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
