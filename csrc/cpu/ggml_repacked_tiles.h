// The integer-form types' blocks in the repacked layout (core/ggml_repack.h),
// read 16 rows at a time: RepackedTile<T> gives, for the tile's block, the
// same integers IntGemm<T>::decode puts in its Block (ggml_gemm_vnni.h) from
// 16 file-layout rows, with no per-row decode and no transpose, since each
// 512-bit load of a word of the layout is that word of the 16 rows, one per
// lane. Per type:
//   Fields fields(b)     the block's scale words and d, k (IntScales' d, k)
//   scale<S>(fields)     Block::scale[S]: sub-block S's scale of row r in lane
//                        r, as an int16 with a zero high half where IntGemm
//                        scales with vpdpwssd (kDotScales), else as an int32
//   coef<J>(fields)      Block::coef[J]: the int16 coefficients of the
//                        block's 16-element parts 2J and 2J + 1
//   levels<G>(words)     Block::levels[G]: elements 4G .. 4G + 3 of row r as
//                        unsigned bytes in lane r (signed levels + 128)
// where b is the tile's block and words = words_of<T>(b) (past its 2-byte
// fields), word w of the 16 rows at words + 64 w. Each comment names the
// file's bytes a word holds, after which the levels follow the format's element order
// (core/ggml_blocks.h). Include only inside the AVX-512 unit's target
// pragma region.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "../core/ggml_repack.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"

namespace lowbit {
namespace cpu {
namespace {

// Bytes B0 and B1 (B1 < 0: none) of every dword lane of v as the lane's low
// and high int16, zero-extended.
template <int B0, int B1>
inline __m512i pick(__m512i v) {
  constexpr char z = static_cast<char>(0x80);  // vpshufb: a zero byte
  const auto b = [](int byte, int lane) { return byte < 0 ? z : static_cast<char>(byte + 4 * lane); };
  const __m128i ctrl = _mm_setr_epi8(b(B0, 0), z, b(B1, 0), z, b(B0, 1), z, b(B1, 1), z, b(B0, 2), z, b(B1, 2), z,
                                     b(B0, 3), z, b(B1, 3), z);
  return _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(ctrl));
}

// In every byte of v: bits From .. From + width - 1 moved to To, the rest 0
// (`mask` = those bits at To). A 16-bit shift moves no bit it keeps across
// a byte boundary.
template <int From, int To, int Mask>
inline __m512i bits_to(__m512i v) {
  __m512i moved = v;
  if constexpr (To > From)
    moved = _mm512_slli_epi16(v, To - From);
  else if constexpr (To < From)
    moved = _mm512_srli_epi16(v, From - To);
  return _mm512_and_si512(moved, _mm512_set1_epi8(static_cast<char>(Mask)));
}

// The words of a tile's block b (core/ggml_repack.h), past its fields.
template <ggml::Type T>
inline const uint8_t* words_of(const uint8_t* b) { return b + ggml::repacked_field_bytes(T); }
inline __m512i word(const uint8_t* words, int w) { return _mm512_loadu_si512(words + 64 * w); }
// 16 fp16 values at p (a field of 16 rows) as fp32.
inline __m512 half16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// An int32 scale as vpdpwssd takes it: int16, high half 0.
inline __m512i low_half(__m512i v) { return _mm512_and_si512(v, _mm512_set1_epi32(0xffff)); }

template <ggml::Type T>
struct RepackedTile;

// Q4_K and Q5_K: scales[12] (words 0-2) hold 8 6-bit scales and 8 mins
// (get_scale_min_k4); coefficients are the mins (k = -dmin).
template <ggml::Type T>
struct K4ScalesTile {
  struct Fields {
    __m512i sc_lo, sc_hi, mn_lo, mn_hi;  // each dword: four of a row's scales (mins), 0-3 or 4-7
    __m512 d, k;
  };
  static Fields fields(const uint8_t* b) {
    const uint8_t* words = words_of<T>(b);
    const __m512i w0 = word(words, 0), w1 = word(words, 1), w2 = word(words, 2);
    const __m512i six = _mm512_set1_epi8(0x3f), low4 = _mm512_set1_epi8(0x0f), top2 = _mm512_set1_epi8(0x30);
    Fields f;
    f.sc_lo = _mm512_and_si512(w0, six);
    f.mn_lo = _mm512_and_si512(w1, six);
    f.sc_hi = _mm512_or_si512(_mm512_and_si512(w2, low4), _mm512_and_si512(_mm512_srli_epi32(w0, 2), top2));
    f.mn_hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(w2, 4), low4),
                              _mm512_and_si512(_mm512_srli_epi32(w1, 2), top2));
    f.d = half16(b);
    f.k = _mm512_sub_ps(_mm512_setzero_ps(), half16(b + 32));  // -dmin
    return f;
  }
  template <int S>  // 0..63, so the same as an int16 or an int32
  static __m512i scale(const Fields& f) { return pick<S % 4, -1>(S < 4 ? f.sc_lo : f.sc_hi); }
  template <int J>  // sub-block J's min, for both of its 16-element parts
  static __m512i coef(const Fields& f) { return pick<J % 4, J % 4>(J < 4 ? f.mn_lo : f.mn_hi); }
};

template <>
struct RepackedTile<ggml::Type::Q4_K> : K4ScalesTile<ggml::Type::Q4_K> {  // words 3-34: qs[128]
  // Group G of sub-block s = G / 8: the low (even s) or high nibbles of qs[32 (s / 2) + 4 (G % 8) ..].
  template <int G>
  static __m512i levels(const uint8_t* words) {
    return bits_to<4 * (G / 8 % 2), 0, 0x0f>(word(words, 3 + 8 * (G / 16) + G % 8));
  }
};

template <>
struct RepackedTile<ggml::Type::Q5_K> : K4ScalesTile<ggml::Type::Q5_K> {  // words 3-10: qh[32], 11-42: qs[128]
  // Q4_K's nibble plus 16 for bit s of qh[4 (G % 8) ..].
  template <int G>
  static __m512i levels(const uint8_t* words) {
    const __m512i low = bits_to<4 * (G / 8 % 2), 0, 0x0f>(word(words, 11 + 8 * (G / 16) + G % 8));
    return _mm512_or_si512(low, bits_to<G / 8, 4, 0x10>(word(words, 3 + G % 8)));
  }
};

template <>
struct RepackedTile<ggml::Type::Q2_K> {  // words 0-3: scales[16], 4-19: qs[64]; d, dmin
  struct Fields {
    __m512i w[4];
    __m512 d, k;
  };
  static Fields fields(const uint8_t* b) {
    const uint8_t* words = words_of<ggml::Type::Q2_K>(b);
    return {{word(words, 0), word(words, 1), word(words, 2), word(words, 3)},
            half16(b), _mm512_sub_ps(_mm512_setzero_ps(), half16(b + 32))};  // k = -dmin
  }
  template <int S>  // low nibble of scales[S]
  static __m512i scale(const Fields& f) { return pick<S % 4, -1>(bits_to<0, 0, 0x0f>(f.w[S / 4])); }
  template <int J>  // high nibbles of scales[2J], scales[2J + 1]: the mins
  static __m512i coef(const Fields& f) {
    return pick<2 * (J % 2), 2 * (J % 2) + 1>(bits_to<4, 0, 0x0f>(f.w[J / 2]));
  }
  // Element 128n + 32j + l: bits 2j of qs[32n + l].
  template <int G>
  static __m512i levels(const uint8_t* words) {
    return bits_to<2 * (G % 32 / 8), 0, 0x03>(word(words, 4 + 8 * (G / 32) + G % 8));
  }
};

template <>
struct RepackedTile<ggml::Type::Q3_K> {  // words 0-7: hmask[32], 8-23: qs[64], 24-26: scales[12]; d
  struct Fields {
    __m512i biased[4];  // dword q: scales 4q .. 4q + 3 of the row, + 32
    __m512 d, k;
  };
  // Biased scale 4q + i: nibble (q / 2) of scales[4 (q % 2) + i], and as
  // bits 4-5, bits 2q, 2q + 1 of scales[8 + i] (the format's kmask shuffle).
  static Fields fields(const uint8_t* b) {
    const uint8_t* words = words_of<ggml::Type::Q3_K>(b);
    const __m512i lo = word(words, 24), mid = word(words, 25), hi = word(words, 26);
    Fields f;
    f.biased[0] = _mm512_or_si512(bits_to<0, 0, 0x0f>(lo), bits_to<0, 4, 0x30>(hi));
    f.biased[1] = _mm512_or_si512(bits_to<0, 0, 0x0f>(mid), bits_to<2, 4, 0x30>(hi));
    f.biased[2] = _mm512_or_si512(bits_to<4, 0, 0x0f>(lo), bits_to<4, 4, 0x30>(hi));
    f.biased[3] = _mm512_or_si512(bits_to<4, 0, 0x0f>(mid), bits_to<6, 4, 0x30>(hi));
    f.d = half16(b);
    f.k = _mm512_mul_ps(f.d, _mm512_set1_ps(-4.0f));  // the levels' offset of 4
    return f;
  }
  template <int S>
  static __m512i scale(const Fields& f) {
    return low_half(_mm512_sub_epi32(pick<S % 4, -1>(f.biased[S / 4]), _mm512_set1_epi32(32)));
  }
  template <int J>  // the scales themselves
  static __m512i coef(const Fields& f) {
    return _mm512_sub_epi16(pick<2 * (J % 2), 2 * (J % 2) + 1>(f.biased[J / 2]), _mm512_set1_epi16(32));
  }
  // Element 128n + 32j + l, + 4: bits 2j of qs[32n + l], plus 4 for bit 4n + j of hmask[l].
  template <int G>
  static __m512i levels(const uint8_t* words) {
    const __m512i low = bits_to<2 * (G % 32 / 8), 0, 0x03>(word(words, 8 + 8 * (G / 32) + G % 8));
    return _mm512_or_si512(low, bits_to<G / 8, 2, 0x04>(word(words, G % 8)));
  }
};

template <>
struct RepackedTile<ggml::Type::Q6_K> {  // words 0-31: ql[128], 32-47: qh[64], 48-51: scales[16] (int8); d
  struct Fields {
    const uint8_t* words;
    __m512 d, k;
  };
  static Fields fields(const uint8_t* b) {
    const __m512 d = half16(b);
    return {words_of<ggml::Type::Q6_K>(b), d, _mm512_mul_ps(d, _mm512_set1_ps(-32.0f))};  // the levels' offset of 32
  }
  template <int S>  // scales[S] sign-extended to int32: moved to the top byte, shifted back
  static __m512i scale(const Fields& f) {
    return _mm512_srai_epi32(_mm512_slli_epi32(pick<S % 4, -1>(word(f.words, 48 + S / 4)), 24), 24);
  }
  template <int J>  // scales[2J], scales[2J + 1] as int16
  static __m512i coef(const Fields& f) {
    const __m512i v = pick<2 * (J % 2), 2 * (J % 2) + 1>(word(f.words, 48 + J / 2));
    return _mm512_srai_epi16(_mm512_slli_epi16(v, 8), 8);
  }
  // Element 128h + 32k + l, + 32: nibble k / 2 of ql[64h + 32 (k % 2) + l], and
  // as bits 4-5, bits 2k, 2k + 1 of qh[32h + l].
  template <int G>
  static __m512i levels(const uint8_t* words) {
    constexpr int h = G / 32, k = G % 32 / 8;
    const __m512i low = bits_to<4 * (k / 2), 0, 0x0f>(word(words, 16 * h + 8 * (k % 2) + G % 8));
    return _mm512_or_si512(low, bits_to<2 * k, 4, 0x30>(word(words, 32 + 8 * h + G % 8)));
  }
};

template <>
struct RepackedTile<ggml::Type::IQ4_XS> {  // fields d, scales_h; word 0: scales_l[4], 1-32: qs[128]
  struct Fields {
    __m512i low, high;  // per row: scales_l's 4 bytes, scales_h
    __m512 d, k;
  };
  static Fields fields(const uint8_t* b) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
    return {word(words_of<ggml::Type::IQ4_XS>(b), 0), _mm512_cvtepu16_epi32(h), half16(b), _mm512_setzero_ps()};
  }
  // (nibble S of scales_l | bits 2S, 2S + 1 of scales_h << 4) - 32, as int32.
  template <int S>
  static __m512i scale(const Fields& f) {
    const __m512i low = _mm512_and_si512(_mm512_srli_epi32(f.low, 4 * S), _mm512_set1_epi32(0x0f));
    const __m512i high = _mm512_and_si512(_mm512_srli_epi32(f.high, 2 * S), _mm512_set1_epi32(3));
    return _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(high, 4)), _mm512_set1_epi32(32));
  }
  // The levels went in + 128: -128 * scale_J off both 16-element halves of sub-block J.
  template <int J>
  static __m512i coef(const Fields& f) {
    const __m512i c = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(scale<J>(f), 7));
    return _mm512_or_si512(low_half(c), _mm512_slli_epi32(c, 16));
  }
  // Element 32s + i (i < 16: low nibble of qs[16s + i], else the high nibble of qs[16s + i - 16]).
  template <int G>
  static __m512i levels(const uint8_t* words) {
    constexpr int s = G / 8, i = 4 * (G % 8);
    const __m512i nibble = bits_to<i < 16 ? 0 : 4, 0, 0x0f>(word(words, 1 + 4 * s + i % 16 / 4));
    const __m512i table =
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(LOWBIT_TABLE(ggml::kvalues_iq4nl))));
    return _mm512_xor_si512(_mm512_shuffle_epi8(table, nibble), _mm512_set1_epi8(-128));
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
