// The one-scale types' repacked layout (core/ggml_repack.h) read as it is
// with AVX2 (and the integer-form types': RepackedIntAvx2, below; Q5_K and
// Q6_K only for the file layout's batches): a 256-bit load of
// a word of the layout is that word of 8 of a tile's 16 rows, one per lane,
// so a tile runs as two halves of 8 rows. Each 4-element group of 8 rows
// meets its 4 activation bytes (broadcast) in one maddubs: the levels need
// no per-row decoding, no absolute value and no sign flip where they are
// unsigned, and one scale vector d_w * d_x serves the block's 8 groups.
// The one-scale types sum in one of two orders (SumOrder): the file
// layout's AVX2 matvec's (ggml_matmul_simd.h), for the file layout's
// batches, which must give its results bit for bit; or each block's exact
// int32 dot first, for the repacked layout itself (a third of the
// instructions a group; results within fp32 rounding of the file layout's).
// Include only inside the AVX2 unit's target pragma region.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "../core/ggml_q8.h"
#include "../core/ggml_repack.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"
#include "ggml_traits.h"
#include "row_tiles.h"
#include "static_for.h"

namespace lowbit {
namespace cpu {
namespace {

// Rows per half tile: one per int32 lane.
constexpr int kHalfRows = 8;

// The 4 bytes at p in every int32 lane.
inline __m256i bcast4x8(const void* p) {
  int32_t v;
  memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Word w of half h's 8 rows of a block whose words start at `words`.
inline __m256i half_word(const uint8_t* words, int h, int w) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(words + 64 * w + 32 * h));
}

// 8 fp16 values of half h of a 2-byte field of the tile's 16 rows at p, as fp32.
inline __m256 half_field(const uint8_t* p, int h) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * kHalfRows * h)));
}

// Prefetches the line at p into L1 (kIntoL1) or L2.
template <bool kIntoL1>
inline void prefetch_line(const char* p) {
  if constexpr (kIntoL1)
    _mm_prefetch(p, _MM_HINT_T0);
  else
    _mm_prefetch(p, _MM_HINT_T1);
}

// The 8 lanes of a row summed as the matvec's hsum does: ((0 + 4) + (2 + 6))
// + ((1 + 5) + (3 + 7)), lane 0's sum a0.
inline __m256 lane_order_total(__m256 a0, const __m256 (&a)[9]) {
  const __m256 even = _mm256_add_ps(_mm256_add_ps(a0, a[4]), _mm256_add_ps(a[2], a[6]));
  const __m256 odd = _mm256_add_ps(_mm256_add_ps(a[1], a[5]), _mm256_add_ps(a[3], a[7]));
  return _mm256_add_ps(even, odd);
}

// One tile of ggml::kRepackRows file-layout rows (row_bytes apart from src)
// into the repacked layout at dst: the bytes ggml::repack_rows puts where
// ggml::repacked_offset says, moved with vector loads. Each 4 words of a
// block of 8 rows (one 128-bit load a row, two rows to a register) become
// word w of those 8 rows (4 bytes apart in the layout) by a 4 x 4 transpose
// in each 128-bit half; the 2-byte fields and the last words past a multiple
// of 4 go one at a time. repack_rows' copy, a unit at a time, would cost a
// large share of a tile's time at the copy thresholds (ggml_avx2.cpp).
template <ggml::Type T>
void repack_tile(const uint8_t* src, int64_t row_bytes, uint8_t* dst) {
  using I = ggml::TypeInfo<T>;
  constexpr ggml::RepackedFields f = ggml::repacked_fields(T);
  constexpr int kFieldBytes = f.bytes();
  constexpr int kWords = (I::kBytes - kFieldBytes) / 4;
  static_assert(f.at == 0 || f.at == I::kBytes - kFieldBytes, "the fields lead or close the block: its words are contiguous");
  constexpr int kWordsAt = f.at == 0 ? kFieldBytes : 0;
  const int64_t blocks = row_bytes / I::kBytes;
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const uint8_t* in = src + bi * I::kBytes;
    uint8_t* out = dst + bi * ggml::kRepackRows * I::kBytes;
    for (int c = 0; c < f.count; ++c)
      for (int r = 0; r < ggml::kRepackRows; ++r)
        memcpy(out + ggml::repacked_offset(f, r, f.at + f.size * c), in + r * row_bytes + f.at + f.size * c, f.size);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* rows = in + kHalfRows * h * row_bytes + kWordsAt;
      // Word w of row 8h + r of the block sits at word(w) + 4r.
      const auto word = [&](int w) { return out + ggml::repacked_offset(f, kHalfRows * h, kWordsAt + 4 * w); };
      const auto load = [&](int r, int w) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + r * row_bytes + 4 * w)); };
      const auto store = [&](int w, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(word(w)), v); };
      int w = 0;
      for (; w + 4 <= kWords; w += 4) {
        __m256i y[4];  // rows r and r + 4, words w .. w + 3
        for (int r = 0; r < 4; ++r) y[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(load(r, w)), load(r + 4, w), 1);
        const __m256i lo01 = _mm256_unpacklo_epi32(y[0], y[1]), lo23 = _mm256_unpacklo_epi32(y[2], y[3]);
        const __m256i hi01 = _mm256_unpackhi_epi32(y[0], y[1]), hi23 = _mm256_unpackhi_epi32(y[2], y[3]);
        store(w, _mm256_unpacklo_epi64(lo01, lo23));
        store(w + 1, _mm256_unpackhi_epi64(lo01, lo23));
        store(w + 2, _mm256_unpacklo_epi64(hi01, hi23));
        store(w + 3, _mm256_unpackhi_epi64(hi01, hi23));
      }
      for (; w < kWords; ++w)
        for (int r = 0; r < kHalfRows; ++r) memcpy(word(w) + 4 * r, rows + r * row_bytes + 4 * w, 4);
    }
  }
}

// Half H of the tile at `tile` (`blocks` blocks) against activation rows
// a[0 .. MT), one pass over its blocks, into out (`rows` apart). The first
// half prefetches the tile Kernel::kAheadBytes ahead; the second, which
// finds the lines in cache, has the next tile's brought into L2 meanwhile,
// so that the memory never idles for a half.
template <class Kernel, int MT, int H>
__attribute__((flatten)) void run_half_pass(const uint8_t* tile, int64_t blocks, const ggml::ActRow* a,
                                            float* out, int64_t rows) {
  constexpr int64_t kBlockBytes = Kernel::kTileBlockBytes;
  const int64_t ahead = H == 0 ? Kernel::kAheadBytes : blocks * kBlockBytes;
  __m256 acc[MT][9];
  for (auto& row : acc)
    for (__m256& v : row) v = _mm256_setzero_ps();
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const uint8_t* b = tile + bi * kBlockBytes;
    Kernel::template block<MT, H == 0 && Kernel::kIntoL1>(b, H, bi, a, acc, reinterpret_cast<const char*>(b) + ahead,
                                                          kBlockBytes);
  }
  for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * rows + kHalfRows * H, Kernel::total(acc[m]));
}

// The tile at `tile` against activation rows a[0 .. MT), MT <= the
// kernel's kPassRows: each block's two halves in turn, so that the second
// reads the lines the first brought into L1, each half prefetching its
// share of the block Kernel::kMatvecAheadBytes ahead. A whole half at a
// time (run_half_pass) would re-read the tile from L2 and leave the memory
// and the arithmetic taking turns, which costs streamed weights more than
// the register pressure of two halves' sums costs weights in cache. The
// halves take h as a constant (a loop variable is slower). Each half's sums
// are its own, in the same order as a half pass's: the same results.
template <class Kernel, int MT>
__attribute__((flatten)) void run_whole_tile(const uint8_t* tile, int64_t blocks, const ggml::ActRow* a, float* out,
                                             int64_t rows) {
  constexpr int64_t kBlockBytes = Kernel::kTileBlockBytes;
  __m256 acc[2][MT][9];
  for (auto& half : acc)
    for (auto& row : half)
      for (__m256& v : row) v = _mm256_setzero_ps();
  for (int64_t bi = 0; bi < blocks; ++bi) {
    const uint8_t* b = tile + bi * kBlockBytes;
    static_for<2>([&](auto half) {
      constexpr int h = decltype(half)::value;
      const char* at = reinterpret_cast<const char*>(b) + Kernel::kMatvecAheadBytes + h * kBlockBytes / 2;
      Kernel::template block<MT, Kernel::kIntoL1>(b, h, bi, a, acc[h], at, kBlockBytes / 2);
    });
  }
  for (int h = 0; h < 2; ++h)
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + m * rows + kHalfRows * h, Kernel::total(acc[h][m]));
}

// Kernel's whole tiles from row r0 on (before r1) against M activation rows:
// up to Kernel::kPassRows of them through run_whole_tile, more half by half
// against Kernel::kPassRows activation rows at a time (run_half_pass).
// Returns the first row it did not take.
template <class Kernel>
int64_t run_half_tiles(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                       float* out, int64_t rows) {
  using I = typename Kernel::I;
  const int64_t blocks = n / I::kBlock, row_bytes = blocks * I::kBytes;
  int64_t r = r0;
  for (; r + ggml::kRepackRows <= r1; r += ggml::kRepackRows) {
    const uint8_t* tile = W + r * row_bytes;
    if (M <= Kernel::kPassRows) {
      for_row_tiles<Kernel::kPassRows>(M, [&](auto mt, int64_t m0) {
        run_whole_tile<Kernel, decltype(mt)::value>(tile, blocks, acts + m0, out + m0 * rows + r, rows);
      });
      continue;
    }
    static_for<2>([&](auto h) {
      for_row_tiles<Kernel::kPassRows>(M, [&](auto mt, int64_t m0) {
        run_half_pass<Kernel, decltype(mt)::value, decltype(h)::value>(tile, blocks, acts + m0, out + m0 * rows + r, rows);
      });
    });
  }
  return r;
}

// How RepackedFloatAvx2 forms a row's fp32 sum.
enum class SumOrder {
  // As the file layout's AVX2 matvec does, so the same results bit for bit:
  // fp32 lane g of row r (in FloatGemm's words, ggml_gemm_vnni.h)
  // accumulates the exact int32 dot of group g times d_w * d_x per block,
  // the mins (Q4_1, Q5_1) their rounded products, and the lanes sum in
  // hsum's order. Each group takes its own int32-to-fp32 conversion and FMA.
  kFileLayout,
  // Each block's exact int32 dot (the groups' maddubs pair sums added in
  // int16 as far as they cannot overflow), then one FMA a block into a
  // single fp32 sum a row, the mins' rounded products into a second one:
  // kFileLayout's conversion and FMA per group are what bound its speed.
  kBlockDot,
};

template <ggml::Type T, SumOrder kOrder>
struct RepackedFloatAvx2 {
  using I = ggml::TypeInfo<T>;
  static_assert(has_repacked_layout(T) && I::kBlock == 32, "a one-scale type with a repacked layout");
  static constexpr int64_t kTileBlockBytes = ggml::kRepackRows * I::kBytes;  // one block of the tile's rows
  // Q5_0 and Q5_1: word 0 holds each row's 32-bit qh, element i's fifth bit at bit i.
  static constexpr bool kHighBits = T == ggml::Type::Q5_0 || T == ggml::Type::Q5_1;
  // How the levels meet maddubs (unsigned x signed, pairs summed in int16):
  // IQ4_NL's, MXFP4's and Q8_0's signed levels as |w| against x with w's sign; Q4_0's
  // and Q5_0's as w + kBias (the nibble as stored, below 32, so no pair sum
  // saturates) against x, each dot less kBias * (its activations' sum): per
  // group ActRow::offset (-128 times it) shifted, per block ActRow::isum; the
  // mins types' levels as they are.
  static constexpr bool kSigned = T == ggml::Type::IQ4_NL || T == ggml::Type::MXFP4 || T == ggml::Type::Q8_0;
  static constexpr bool kBytes = T == ggml::Type::Q8_0;  // word k: elements 4k .. 4k + 3, no nibbles
  static constexpr int kBiasShift = T == ggml::Type::Q4_0 ? 4 : T == ggml::Type::Q5_0 ? 3 : 0;  // 128 >> shift
  static constexpr bool kOffsets = kBiasShift > 0;
  // kBlockDot: groups whose maddubs pair sums (|level| <= kLevelMax against
  // |x| <= 127) add up in int16 before one madd widens them.
  static constexpr int kLevelMax = kSigned ? 128 : kHighBits ? 31 : 15;
  static constexpr int kInt16Groups = 32767 / (2 * 127 * kLevelMax);
  static_assert(kInt16Groups >= 1 && 8 % kInt16Groups == 0, "whole runs of groups a block");

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
    } else if constexpr (T == ggml::Type::IQ4_NL || T == ggml::Type::MXFP4) {
      const int8_t* values = T == ggml::Type::IQ4_NL ? LOWBIT_TABLE(ggml::kvalues_iq4nl) : LOWBIT_TABLE(ggml::kvalues_fp4);
      const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
      return _mm256_shuffle_epi8(table, nibble);
    } else {
      return nibble;
    }
  }

  // Half h's 8 block scales: fp16 d, or MXFP4's E8M0 as core's
  // e8m0_to_fp32_half gives it (2^(e - 128); e < 2 subnormal), exactly.
  static __m256 scales(const uint8_t* b, int h) {
    if constexpr (T == ggml::Type::MXFP4) {
      const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + kHalfRows * h)));
      const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
      const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
      const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
      return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
    } else {
      return half_field(b, h);
    }
  }

  // Activation rows per pass: each decoded group meets them in turn, their
  // sums and scales d_w * d_x in registers as far as they go; Q4_0's offsets
  // take two more instructions a row, so it (and kFileLayout) takes 2.
  static constexpr int kPassRows = kOrder == SumOrder::kBlockDot && T != ggml::Type::Q4_0 ? 4 : 2;

  // Prefetches: all of a block's lines at once, into L1 (a streamed matvec
  // prefetching into L2 is slower), kAheadBytes ahead in a half pass,
  // kMatvecAheadBytes in a matvec.
  static constexpr bool kIntoL1 = true;
  static constexpr int64_t kAheadBytes = 4096, kMatvecAheadBytes = 2048;

  // Block bi (at b) of half h (rows 8h .. 8h + 7) against activation rows
  // a[0 .. MT), lane r for row 8h + r: kFileLayout, acc[m][g] as the file
  // layout's matvec leaves lane g; kBlockDot, acc[m][0] the sum of the
  // blocks' dots; acc[m][8] the mins. Prefetches the `ahead_bytes` from
  // `ahead` into L1 (kL1) or L2.
  template <int MT, bool kL1>
  static void block(const uint8_t* b, int h, int64_t bi, const ggml::ActRow* a, __m256 (&acc)[MT][9],
                    const char* ahead, int64_t ahead_bytes) {
    for (int64_t off = 0; off < ahead_bytes; off += 64) prefetch_line<kL1>(ahead + off);
    const __m256i low4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    const __m256 d = scales(b, h);
    __m256 ds[MT];
    for (int m = 0; m < MT; ++m) ds[m] = _mm256_mul_ps(d, _mm256_set1_ps(a[m].d[bi]));
    const int64_t e = bi * I::kBlock;
    __m256i sum[MT], run[MT];  // kBlockDot: the block's int32 dot so far; the int16 pair sums of this run of groups
    for (int m = 0; m < MT; ++m) sum[m] = run[m] = _mm256_setzero_si256();
    // Group g, the i-th the block takes.
    const auto dot = [&](__m256i levels, int g, int i) {
      const __m256i u = kSigned ? _mm256_abs_epi8(levels) : levels;
      for (int m = 0; m < MT; ++m) {
        const __m256i x = bcast4x8(a[m].q + e + 4 * g);
        const __m256i pairs = _mm256_maddubs_epi16(u, kSigned ? _mm256_sign_epi8(x, levels) : x);
        if constexpr (kOrder == SumOrder::kFileLayout) {
          __m256i p = _mm256_madd_epi16(pairs, ones);
          if constexpr (kOffsets)
            p = _mm256_add_epi32(p, _mm256_srai_epi32(bcast4x8(a[m].offset + e / 4 + g), kBiasShift));
          acc[m][g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), ds[m], acc[m][g]);
        } else if constexpr (kInt16Groups == 1) {
          sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(pairs, ones));
        } else {
          run[m] = _mm256_add_epi16(run[m], pairs);
          if ((i + 1) % kInt16Groups == 0) {
            sum[m] = _mm256_add_epi32(sum[m], _mm256_madd_epi16(run[m], ones));
            run[m] = _mm256_setzero_si256();
          }
        }
      }
    };
    const uint8_t* words = b + ggml::repacked_field_bytes(T);
    const auto word = [&](int w) { return half_word(words, h, w); };
    const __m256i qh = kHighBits ? word(0) : _mm256_setzero_si256();
    if constexpr (kBytes) {
      static_for<8>([&](auto kc) { dot(word(decltype(kc)::value), decltype(kc)::value, decltype(kc)::value); });
    } else {
      // Byte i of word k: element 4k + i in the low nibble, 16 + 4k + i in the high one.
      static_for<4>([&](auto kc) {
        constexpr int k = decltype(kc)::value;
        const __m256i v = word(kHighBits + k);
        dot(level<k>(_mm256_and_si256(v, low4), qh), k, 2 * k);
        dot(level<k + 4>(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), qh), k + 4, 2 * k + 1);
      });
    }
    if constexpr (kOrder == SumOrder::kBlockDot) {
      for (int m = 0; m < MT; ++m) {
        __m256i s = sum[m];
        if constexpr (kOffsets) s = _mm256_add_epi32(s, _mm256_set1_epi32(-(128 >> kBiasShift) * a[m].isum[bi]));
        acc[m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), ds[m], acc[m][0]);
      }
    }
    if constexpr (I::kHasMin) {
      const __m256 mw = half_field(b + 2 * ggml::kRepackRows, h);
      for (int m = 0; m < MT; ++m) {
        // The matvec rounds m_w * s_x, then adds; the barrier keeps the
        // compiler from contracting the two into one FMA.
        __m256 mins = _mm256_mul_ps(mw, _mm256_set1_ps(a[m].sum[bi]));
        __asm__("" : "+x"(mins));
        acc[m][8] = _mm256_add_ps(acc[m][8], mins);
      }
    }
  }

  // kFileLayout: the matvec's hsum(acc + mins), the mins in lane 0.
  static __m256 total(const __m256 (&a)[9]) {
    const __m256 first = I::kHasMin ? _mm256_add_ps(a[0], a[8]) : a[0];
    return kOrder == SumOrder::kFileLayout ? lane_order_total(first, a) : first;
  }
};

// Bytes B0 and B1 of every dword lane of v as the lane's low and high int16,
// zero-extended, or sign-extended (Signed).
template <int B0, int B1, bool Signed = false>
inline __m256i pick8(__m256i v) {
  constexpr char z = static_cast<char>(0x80);  // vpshufb: a zero byte
  const auto b = [](int byte, int lane) { return static_cast<char>(byte + 4 * lane); };
  // Signed: each byte into the high half of its int16, then shifted down arithmetically.
  const auto lo = [&](int byte, int lane) { return Signed ? z : b(byte, lane); };
  const auto hi = [&](int byte, int lane) { return Signed ? b(byte, lane) : z; };
  const __m128i ctrl = _mm_setr_epi8(lo(B0, 0), hi(B0, 0), lo(B1, 0), hi(B1, 0), lo(B0, 1), hi(B0, 1), lo(B1, 1),
                                     hi(B1, 1), lo(B0, 2), hi(B0, 2), lo(B1, 2), hi(B1, 2), lo(B0, 3), hi(B0, 3),
                                     lo(B1, 3), hi(B1, 3));
  const __m256i picked = _mm256_shuffle_epi8(v, _mm256_broadcastsi128_si256(ctrl));
  return Signed ? _mm256_srai_epi16(picked, 8) : picked;
}

// The integer form (IntGemm in ggml_gemm_vnni.h, MatmulSimd::IntSums in
// ggml_matmul_simd.h) over the repacked layout of the K-quants and IQ4_XS
// with AVX2, 8 rows to a half tile as above: per block and row the exact
// int32 sums S (each 4-element group's maddubs pair sums times its
// sub-block's scale in one madd) and, but for IQ4_XS, C (the coefficients,
// the K-quants' mins or Q3_K's and Q6_K's scales, times the activations'
// 16-element sums), then the matvec's fp32 step into lane block % 8: acc =
// fma(S, d_w * d_x, acc), acc = fma(C, k_w * d_x, acc) with k_w = -dmin_w,
// or -4 d_w and -32 d_w for Q3_K's and Q6_K's level offsets. The same
// integers and fp32 operations as the file layout's AVX2 matvec, so the same
// results bit for bit. Block words (after the 2-byte fields): Q4_K's and
// Q5_K's 0-2 scales[12] (get_scale_min_k4), then Q4_K's qs[128] (3-34), or
// Q5_K's qh[32] (3-10) and qs[128] (11-42); IQ4_XS's 0 scales_l[4], then
// qs[128] (1-32), its scales_h a 2-byte field after d; Q6_K's ql[128]
// (0-31), qh[64] (32-47) and int8 scales[16] (48-51); Q2_K's scales[16]
// (0-3, scale | min << 4) and qs[64] (4-19); Q3_K's hmask[32] (0-7), qs[64]
// (8-23) and scales[12] (24-26).
template <ggml::Type T>
constexpr bool has_repacked_int_avx2() {
  return has_repacked_layout(T) && ggml_cpu_traits(T).gemm == Gemm::kInt;
}

template <ggml::Type T>
struct RepackedIntAvx2 {
  using I = ggml::TypeInfo<T>;
  static_assert(has_repacked_int_avx2<T>(), "a K-quant or IQ4_XS");
  static constexpr int64_t kTileBlockBytes = ggml::kRepackRows * I::kBytes;
  static constexpr int kFieldBytes = ggml::repacked_field_bytes(T);
  static constexpr bool kHighBits = T == ggml::Type::Q5_K;
  // IQ4_XS: signed levels through |w| and sign(x, w), and no coefficients.
  static constexpr bool kSigned = T == ggml::Type::IQ4_XS;
  static constexpr bool kSixBit = T == ggml::Type::Q6_K;
  static constexpr bool kTwoBit = T == ggml::Type::Q2_K;
  static constexpr bool kThreeBit = T == ggml::Type::Q3_K;
  // The unsigned levels' offset that the coefficients (the scales) carry.
  static constexpr float kLevelOffset = kSixBit ? 32.0f : kThreeBit ? 4.0f : 0.0f;
  static constexpr int kQsWord = kSigned ? 1 : kHighBits ? 11 : 3;
  static constexpr int kSubs = I::kBlock / I::kSub;  // sub-blocks of 32 elements, or Q2_K's, Q3_K's and Q6_K's 16 of 16
  static constexpr int kSubGroups = I::kSub / 4;     // 4-element groups a sub-block
  static constexpr int kGroups = kSubs * kSubGroups;

  // Group G's levels (elements 4G .. 4G + 3). Q4_K and Q5_K (sub-block s =
  // G / 8): the low (even s) or high nibbles of qs[32 (s / 2) + 4 (G % 8)
  // ..], and for Q5_K 16 for bit s of qh[4 (G % 8) ..]. IQ4_XS: the low (G % 8
  // < 4) or high nibbles of qs[16 s + 4 (G % 4) ..] through its table. Q6_K
  // (element e = 4G, 128-element half eh = e / 128, quarter k = e % 128 / 32,
  // l = e % 32): the low (k < 2) or high nibbles of ql[64 eh + 32 (k % 2) +
  // l ..] and bits 2k, 2k + 1 of qh[32 eh + l ..] as 16 and 32: the level
  // plus 32, unsigned. Q2_K (the same e, eh, k, l): bits 2k, 2k + 1 of
  // qs[32 eh + l ..]. Q3_K: those of its qs, plus 4 for bit 4 eh + k of
  // hmask[l ..]: the level plus 4, unsigned.
  template <int G>
  static __m256i levels(const uint8_t* words, int h) {
    if constexpr (kTwoBit || kThreeBit) {
      constexpr int e = 4 * G, eh = e / 128, k = e % 128 / 32, l = e % 32;
      const __m256i q = half_word(words, h, (kThreeBit ? 8 : 4) + (32 * eh + l) / 4);
      const __m256i low = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), _mm256_set1_epi8(3));
      if constexpr (kTwoBit) return low;
      constexpr int bit = 4 * eh + k;  // to bit 2 (a 16-bit shift; the mask keeps the byte's own)
      const __m256i hm = half_word(words, h, l / 4);
      const __m256i moved = bit < 2 ? _mm256_slli_epi16(hm, 2 - bit) : _mm256_srli_epi16(hm, bit - 2);
      return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(4)));
    } else if constexpr (kSixBit) {
      constexpr int e = 4 * G, eh = e / 128, k = e % 128 / 32, l = e % 32;
      const __m256i ql = half_word(words, h, (64 * eh + 32 * (k % 2) + l) / 4);
      const __m256i qh = half_word(words, h, 32 + (32 * eh + l) / 4);
      const __m256i low = _mm256_and_si256(k >= 2 ? _mm256_srli_epi16(ql, 4) : ql, _mm256_set1_epi8(0x0f));
      // Bits 2k, 2k + 1 to bits 4, 5 (16-bit shifts; the mask keeps each byte's own).
      const __m256i high = k <= 2 ? _mm256_slli_epi16(qh, 4 - 2 * k) : _mm256_srli_epi16(qh, 2 * k - 4);
      return _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi8(0x30)));
    } else {
      constexpr int s = G / 8;
      constexpr bool high = kSigned ? G % 8 >= 4 : s % 2 == 1;
      constexpr int word = kSigned ? kQsWord + 4 * s + G % 4 : kQsWord + 8 * (s / 2) + G % 8;
      const __m256i q = half_word(words, h, word);
      const __m256i low = _mm256_and_si256(high ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0f));
      if constexpr (kSigned) {
        const __m256i table = _mm256_broadcastsi128_si256(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(LOWBIT_TABLE(ggml::kvalues_iq4nl))));
        return _mm256_shuffle_epi8(table, low);
      } else if constexpr (!kHighBits) {
        return low;
      } else {
        const __m256i qh = half_word(words, h, 3 + G % 8);  // bit s to bit 4 (a 16-bit shift; the mask keeps the byte's own)
        const __m256i moved = s < 4 ? _mm256_slli_epi16(qh, 4 - s) : _mm256_srli_epi16(qh, s - 4);
        return _mm256_or_si256(low, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
      }
    }
  }

  // A block's scale words for 8 rows, one row per lane. Q4_K and Q5_K: the
  // 6-bit scales (sc) and mins (mn) of sub-blocks 0-3 and 4-7, a byte each,
  // cut from the three scale words. IQ4_XS: scales_l (nibble s at bit 4s)
  // and scales_h (bits 2s, 2s + 1). Q6_K: the int8 scales, 4 a word. Q2_K:
  // the 4-bit scales and mins, 4 a word. Q3_K: the 6-bit scales + 32, 4 a
  // word: scale 4q + i is nibble q / 2 of scales[4 (q % 2) + i] and, as bits
  // 4-5, bits 2q, 2q + 1 of scales[8 + i] (the format's kmask shuffle).
  struct Fields {
    __m256i sc[4], mn[4];
  };
  static Fields fields(const uint8_t* b, const uint8_t* words, int h) {
    if constexpr (kThreeBit) {
      const __m256i lo = half_word(words, h, 24), mid = half_word(words, h, 25), hi = half_word(words, h, 26);
      const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
      // 16-bit shifts: the masks keep each byte's own bits.
      const auto nib = [&](__m256i v, bool high) { return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, low4); };
      return {{_mm256_or_si256(nib(lo, false), _mm256_and_si256(_mm256_slli_epi16(hi, 4), top2)),
               _mm256_or_si256(nib(mid, false), _mm256_and_si256(_mm256_slli_epi16(hi, 2), top2)),
               _mm256_or_si256(nib(lo, true), _mm256_and_si256(hi, top2)),
               _mm256_or_si256(nib(mid, true), _mm256_and_si256(_mm256_srli_epi16(hi, 2), top2))},
              {}};
    } else if constexpr (kTwoBit) {
      Fields f;
      for (int i = 0; i < 4; ++i) {
        const __m256i w = half_word(words, h, i);
        f.sc[i] = _mm256_and_si256(w, _mm256_set1_epi8(0x0f));
        f.mn[i] = _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0f));
      }
      return f;
    } else if constexpr (kSixBit) {
      return {{half_word(words, h, 48), half_word(words, h, 49), half_word(words, h, 50), half_word(words, h, 51)}, {}};
    } else if constexpr (kSigned) {
      const __m128i sh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2 * ggml::kRepackRows + 16 * h));
      return {{half_word(words, h, 0), _mm256_cvtepu16_epi32(sh)}, {}};
    } else {
      const __m256i w0 = half_word(words, h, 0), w1 = half_word(words, h, 1), w2 = half_word(words, h, 2);
      const __m256i six = _mm256_set1_epi8(0x3f), low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
      return {{_mm256_and_si256(w0, six),
               _mm256_or_si256(_mm256_and_si256(w2, low4), _mm256_and_si256(_mm256_srli_epi32(w0, 2), top2))},
              {_mm256_and_si256(w1, six),
               _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w2, 4), low4),
                               _mm256_and_si256(_mm256_srli_epi32(w1, 2), top2))}};
    }
  }

  // Sub-block J's scale in both int16 halves of each row's lane: madd
  // scales each pair sum. IQ4_XS: (nibble J | the two scales_h bits << 4) - 32.
  template <int J>
  static __m256i scale(const Fields& f) {
    if constexpr (kThreeBit) {
      return _mm256_sub_epi16(pick8<J % 4, J % 4>(f.sc[J / 4]), _mm256_set1_epi16(32));
    } else if constexpr (kSixBit) {
      return pick8<J % 4, J % 4, true>(f.sc[J / 4]);
    } else if constexpr (kSigned) {
      const __m256i low = _mm256_and_si256(_mm256_srli_epi32(f.sc[0], 4 * J), _mm256_set1_epi32(0x0f));
      const __m256i high = J <= 2 ? _mm256_slli_epi32(f.sc[1], 4 - 2 * J) : _mm256_srli_epi32(f.sc[1], 2 * J - 4);
      const __m256i v = _mm256_or_si256(low, _mm256_and_si256(high, _mm256_set1_epi32(0x30)));
      return _mm256_sub_epi16(_mm256_or_si256(v, _mm256_slli_epi32(v, 16)), _mm256_set1_epi16(32));
    } else {
      return pick8<J % 4, J % 4>(f.sc[J / 4]);
    }
  }

  // The coefficients of the activations' 16-element sums 2j and 2j + 1 as an
  // int16 pair: sub-block j's min twice (Q4_K, Q5_K), or the scales (Q3_K,
  // Q6_K) or mins (Q2_K) of sub-blocks 2j and 2j + 1.
  template <int j>
  static __m256i coefs(const Fields& f) {
    if constexpr (kThreeBit) return _mm256_sub_epi16(pick8<2 * j % 4, 2 * j % 4 + 1>(f.sc[j / 2]), _mm256_set1_epi16(32));
    if constexpr (kSixBit) return pick8<2 * j % 4, 2 * j % 4 + 1, true>(f.sc[j / 2]);
    if constexpr (kTwoBit) return pick8<2 * j % 4, 2 * j % 4 + 1>(f.mn[j / 2]);
    return pick8<j % 4, j % 4>(f.mn[j / 4]);
  }

  // Activation rows per pass: each decoded group meets them all, its sums S
  // a register each; 4 fit the registers (8 spill, fewer repeat the decoding).
  static constexpr int kPassRows = 4;

  // Prefetches: a line of the block per group, spread through the block, into
  // L2 (a 2.3 KB block prefetched at once starves a streamed matvec);
  // kAheadBytes ahead in a half pass, kMatvecAheadBytes in a matvec.
  static constexpr bool kIntoL1 = false;
  static constexpr int64_t kAheadBytes = 8192, kMatvecAheadBytes = 1024;

  // Block bi (at b) of half h (rows 8h .. 8h + 7) against activation rows
  // a[0 .. MT): acc[m][bi % 8] lane r as the file layout's matvec leaves
  // lane bi % 8 of row 8h + r; prefetches the `ahead_bytes` from `ahead`
  // into L1 (kL1) or L2, one prefetch a group, spread evenly over them.
  template <int MT, bool kL1>
  static void block(const uint8_t* b, int h, int64_t bi, const ggml::ActRow* a, __m256 (&acc)[MT][9],
                    const char* ahead, int64_t ahead_bytes) {
    const uint8_t* words = b + kFieldBytes;
    const Fields f = fields(b, words, h);
    const int64_t e = bi * I::kBlock;
    __m256i S[MT];
    for (__m256i& v : S) v = _mm256_setzero_si256();
    static_for<kSubs>([&](auto jc) {  // sub-block J
      constexpr int J = decltype(jc)::value;
      const __m256i sj = scale<J>(f);
      static_for<kSubGroups>([&](auto ic) {
        constexpr int G = kSubGroups * J + decltype(ic)::value;
        prefetch_line<kL1>(ahead + G * ahead_bytes / kGroups);
        const __m256i lv = levels<G>(words, h);
        const __m256i u = kSigned ? _mm256_abs_epi8(lv) : lv;
        for (int m = 0; m < MT; ++m) {
          const __m256i x = bcast4x8(a[m].q + e + 4 * G);
          S[m] = _mm256_add_epi32(S[m], _mm256_madd_epi16(_mm256_maddubs_epi16(u, kSigned ? _mm256_sign_epi8(x, lv) : x), sj));
          if constexpr (MT > 1) __asm__("" : "+x"(S[m]));  // a chain in its register (see MatmulSimd::int_chunk)
        }
      });
    });
    const __m256 d = half_field(b, h);
    for (int m = 0; m < MT; ++m) {
      const __m256 dx = _mm256_set1_ps(a[m].d[bi]);
      __m256& sum = acc[m][bi % 8];
      sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S[m]), _mm256_mul_ps(d, dx), sum);
    }
    if constexpr (!kSigned) {
      const __m256 k = kLevelOffset != 0.0f ? _mm256_mul_ps(d, _mm256_set1_ps(-kLevelOffset))
                                            : _mm256_sub_ps(_mm256_setzero_ps(), half_field(b + 2 * ggml::kRepackRows, h));
      __m256i c[8];  // cut once for all MT rows
      static_for<8>([&](auto jc) { c[decltype(jc)::value] = coefs<decltype(jc)::value>(f); });
      for (int m = 0; m < MT; ++m) {
        __m256i C = _mm256_setzero_si256();
        for (int j = 0; j < 8; ++j) C = _mm256_add_epi32(C, _mm256_madd_epi16(c[j], bcast4x8(a[m].isum + bi * 16 + 2 * j)));
        __m256& sum = acc[m][bi % 8];
        sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(C), _mm256_mul_ps(k, _mm256_set1_ps(a[m].d[bi])), sum);
      }
    }
  }

  static __m256 total(const __m256 (&a)[9]) { return lane_order_total(a[0], a); }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
