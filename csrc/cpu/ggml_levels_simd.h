// The int8 levels of a GGUF block, 32 elements at a time, cut out in AVX2
// registers for the SIMD kernels (ggml_matmul_simd.h, ggml_dequant_simd.h),
// for every quantized type (has_simd_levels(), ggml_traits.h). Element order
// and values are exactly those of Codec<T>::decode in core/ggml_blocks.h (a
// test runs every ISA against the portable kernels and the reference). The
// sub-block scales come from Codec<T>::scales, except for the K-quants whose
// scalar scale decoding would cost as much as their levels: their scales()
// here computes the same products (d * scale, -dmin * min, each rounded once)
// eight at a time.
// Include only inside an AVX2 (or wider) target pragma region; a unit whose
// region also enables AVX-512 BW and VL defines LOWBIT_SIMD_AVX512BW to 1
// first (a target pragma does not define __AVX512BW__ in C++).
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../core/ggml_blocks.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"
#include "ggml_kernels.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {
namespace simd {

// A stored fp16 as fp32 through F16C (the core's portable conversion costs a
// dozen instructions, once or twice per 32 weights in the legacy types). It
// equals the portable conversion for every pattern but signalling NaNs, which
// F16C quiets; a scale only ever enters arithmetic, which quiets them anyway.
inline float half_at(const uint8_t* b, int offset) {
  uint16_t h;
  memcpy(&h, b + offset, 2);
  return _cvtsh_ss(h);
}

// Two adjacent stored fp16 (a block's d and m or dmin) in one 32-bit load
// and one conversion, against two of each (GCC loads a lone fp16 with a
// 2-uop vpinsrw, and these matvecs are bound by uops per block).
inline void half_pair(const uint8_t* b, int offset, float& first, float& second) {
  uint32_t h;
  memcpy(&h, b + offset, 4);
  const __m128 v = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(h)));
  first = _mm_cvtss_f32(v);
  second = _mm_cvtss_f32(_mm_movehdup_ps(v));
}

inline __m256i bytes(int8_t v) { return _mm256_set1_epi8(v); }
// Signed int8 levels w as the unsigned w + 128 that u8 x s8 dot products
// take, as a byte add (not the equal xor): it folds into the level offset of
// Q4_0 and Q5_0 (q - 8 + 128 is one add).
inline __m256i plus128(__m256i w) { return _mm256_add_epi8(w, bytes(-128)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// Bits S.. of every byte moved to bit B by one 16-bit shift, which also
// shifts in bits of the neighbouring byte: a bit p that the caller's mask
// keeps is the byte's own bit p + S - B wherever both lie within the byte.
template <int S, int B = 0>
inline __m256i moved_bits(__m256i v) {
  if constexpr (S > B) return _mm256_srli_epi16(v, S - B);
  if constexpr (S < B) return _mm256_slli_epi16(v, B - S);
  return v;
}
// The same, masked.
template <int S, int B = 0>
inline __m256i byte_bits(__m256i v, int8_t mask) {
  return _mm256_and_si256(moved_bits<S, B>(v), bytes(mask));
}
// (a & mask) | b: a level from two fields, b's masked already and a's
// masked here. AVX-512 VL does it in one vpternlogd (0xEC: the truth table
// of (a & c) | b), with byte_bits' moves three instructions fewer than a
// mask, a shift and an or.
inline __m256i or_masked(__m256i a, __m256i b, int8_t mask) {
#if LOWBIT_SIMD_AVX512BW
  return _mm256_ternarylogic_epi32(a, b, bytes(mask), 0xEC);
#else
  return _mm256_or_si256(_mm256_and_si256(a, bytes(mask)), b);
#endif
}

// The legacy nibble layout: byte j holds element j (low) and j + 16 (high).
// The 16 bytes broadcast to both halves by the load itself (vbroadcasti128),
// the high half shifted by a blend: one load, shift, blend and mask, where
// masking and shifting each half apart took two loads and a vinserti128.
inline __m256i nibbles16(const uint8_t* p) {
  const __m256i v = _mm256_broadcastsi128_si256(load16(p));
  return _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xf0), bytes(0xf));
}

// `value` in byte e where bit e of the 32 bits (at p) is set, else 0 (the
// Q5_0/Q5_1 fifth bit, Q1_0's and the i-quants' signs).
inline __m256i bit_bytes(uint32_t bits, int8_t value) {
#if LOWBIT_SIMD_AVX512BW
  // The bits are the byte mask itself: one masked move, against five instructions.
  return _mm256_maskz_mov_epi8(bits, bytes(value));
#endif
  // Byte e takes byte e / 8 of the bits, then tests bit e % 8 of it.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(bits)),
      _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), bytes(value));
}
inline __m256i bit_bytes(const uint8_t* p, int8_t value) {
  uint32_t bits;
  memcpy(&bits, p, 4);
  return bit_bytes(bits, value);
}
inline __m256i fifth_bits(const uint8_t* qh_bytes) { return bit_bytes(qh_bytes, 0x10); }

// A 16-entry int8 table in both lanes, for _mm256_shuffle_epi8 lookups.
inline __m256i table16(const int8_t* t) {
  return _mm256_broadcastsi128_si256(load16(t));
}

// Eight bytes (the low ones of v; little-endian in two words) as fp32 lanes,
// unsigned / signed.
inline __m256 low8_to_float(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }
inline __m256 s8x8_to_float(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Q4_K / Q5_K's eight 6-bit scales (bytes 0-7) and mins (bytes 8-15), core's
// k4_scale_min in a vector register (the scalar unpacking and the moves into
// vector registers cost more than these shuffles). Of the 12 bytes at b + 4,
// scale and min j < 4 are the low 6 bits of bytes j and 4 + j; scale and min
// 4 + j the low and high nibble of byte 8 + j, with bits 6-7 of bytes j and
// 4 + j above them.
inline __m128i k4_scale_min_bytes(const uint8_t* b) {
  const __m128i v = load16(b + 4);  // the 12 bytes and 4 level bytes after them
  const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11));
  const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  const __m128i fields = _mm_and_si128(_mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4)),
                                       _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  return _mm_or_si128(fields, _mm_and_si128(_mm_srli_epi16(top, 2), _mm_set1_epi8(0x30)));  // bits 6-7 to 4-5
}

// Q4_K / Q5_K: d * scale and -dmin * min.
template <ggml::Type T>
inline void k4_scales_x8(const uint8_t* b, ggml::Decoded<T>& o) {
  const __m128i k = k4_scale_min_bytes(b);
  float d, dmin;
  half_pair(b, 0, d, dmin);
  _mm256_storeu_ps(o.d, _mm256_mul_ps(_mm256_set1_ps(d), low8_to_float(k)));
  _mm256_storeu_ps(o.m, _mm256_mul_ps(_mm256_set1_ps(-dmin), low8_to_float(_mm_srli_si128(k, 8))));
}

// The K-quants and IQ4_XS as llama.cpp's integer kernels take them: a
// block's dot product with 8-bit activations x is
//   d * sum_s scale_s * dot(u_s, x_s)  +  k * sum_s coef_s * sum(x_s)
// over its sub-blocks s, with small integer scale_s and coef_s. The levels u
// (int_levels below) are unsigned where coef carries the type's mins or
// level offset (Q6_K's 32, Q3_K's 4), so they meet x without a sign trick,
// and every dot of a block sums in int32 before one fp32 multiply. Each
// Levels<T> of the form says how large its int levels get (kIntLevelMax), for
// kernels whose int16 sums must not overflow.
struct IntScales {
  // scale_s in both 16-bit halves of int32 lane s % 8 of pairs[s / 8], the
  // form madd / vpdpwssd multiply int16 pair sums by.
  __m256i pairs[2];
  // coef_s as int16, one per 16 elements (twice for a sub-block of 32): the
  // form madd takes Q8_K's int16 sums per 16 (ActRow::isum) in.
  __m256i coef16;
  float d, k;
};

// int16 scales 0-7 (a 128-bit half) or 0-15 (a whole register) into pairs.
inline void scale_pairs(__m128i s8, IntScales& o) {
  o.pairs[0] = _mm256_set_m128i(_mm_unpackhi_epi16(s8, s8), _mm_unpacklo_epi16(s8, s8));
}
inline void scale_pairs(__m256i s16, IntScales& o) {
  // unpack works per 128-bit lane: quarters 0, 2 | 1, 3 put the scales back in order.
  const __m256i q = _mm256_permute4x64_epi64(s16, 0xD8);
  o.pairs[0] = _mm256_unpacklo_epi16(q, q);
  o.pairs[1] = _mm256_unpackhi_epi16(q, q);
}
// 16 coefficients of 16-element sub-blocks, or 8 of 32-element ones, as int16.
inline void coefs(__m256i s16, IntScales& o) { o.coef16 = s16; }
inline void coefs(__m128i s8, IntScales& o) {
  o.coef16 = _mm256_set_m128i(_mm_unpackhi_epi16(s8, s8), _mm_unpacklo_epi16(s8, s8));
}

// Q4_K / Q5_K: integer scales and mins (the coefficients, times -dmin).
inline void k4_int_scales(const uint8_t* b, IntScales& o) {
  const __m128i k = k4_scale_min_bytes(b);
  scale_pairs(_mm_cvtepu8_epi16(k), o);
  coefs(_mm_cvtepu8_epi16(_mm_srli_si128(k, 8)), o);
  float dmin;
  half_pair(b, 0, o.d, dmin);
  o.k = -dmin;
}

template <ggml::Type T>
struct Levels;

// A block's scales into dec, and chunk C of its levels (elements 32C ..
// 32C + 31 as int8), cut from the bytes.
template <ggml::Type T>
inline void block_scales(const uint8_t* blk, ggml::Decoded<T>& dec) {
  static_assert(has_simd_levels(T), "every quantized type has SIMD levels (ggml_traits.h)");
  if constexpr (requires { Levels<T>::scales(blk, dec); }) {
    Levels<T>::scales(blk, dec);
  } else {
    ggml::Codec<T>::scales(blk, dec);
  }
}
template <ggml::Type T, int C>
inline __m256i block_levels(const uint8_t* blk, const ggml::Decoded<T>&) {
  return Levels<T>::template chunk<C>(blk);
}

using ggml::Type;

// The legacy blocks (and IQ4_NL) start with d, then m for the types with mins, as fp16.
struct LegacyScales {
  template <Type T>
  static void scales(const uint8_t* b, ggml::Decoded<T>& o) {
    if constexpr (ggml::TypeInfo<T>::kHasMin) {
      half_pair(b, 0, o.d[0], o.m[0]);
    } else {
      o.d[0] = half_at(b, 0);
    }
  }
  // The d of four blocks (lanes 0-3) in one conversion, for row tiles: one
  // each cost two vpinsrw and two conversion uops per row.
  static __m128 d_x4(const uint8_t* b0, const uint8_t* b1, const uint8_t* b2, const uint8_t* b3) {
    uint16_t h[4];
    memcpy(&h[0], b0, 2), memcpy(&h[1], b1, 2), memcpy(&h[2], b2, 2), memcpy(&h[3], b3, 2);
    return _mm_cvtph_ps(_mm_setr_epi16(h[0], h[1], h[2], h[3], 0, 0, 0, 0));
  }
};

template <>
struct Levels<Type::Q4_0> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) { return _mm256_sub_epi8(nibbles16(b + 2), bytes(8)); }
};
template <>
struct Levels<Type::Q4_1> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) { return nibbles16(b + 4); }
};
template <>
struct Levels<Type::Q5_0> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    return _mm256_sub_epi8(_mm256_or_si256(nibbles16(b + 6), fifth_bits(b + 2)), bytes(16));
  }
};
template <>
struct Levels<Type::Q5_1> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) { return _mm256_or_si256(nibbles16(b + 8), fifth_bits(b + 4)); }
};
template <>
struct Levels<Type::Q8_0> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) { return load32(b + 2); }
};
template <>
struct Levels<Type::IQ4_NL> : LegacyScales {
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    return _mm256_shuffle_epi8(table16(LOWBIT_TABLE(ggml::kvalues_iq4nl)), nibbles16(b + 2));
  }
};
template <>
struct Levels<Type::IQ4_XS> {  // sub-block C: the legacy nibble layout at qs + 16C
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    return _mm256_shuffle_epi8(table16(LOWBIT_TABLE(ggml::kvalues_iq4nl)), nibbles16(b + 8 + 16 * C));
  }
  // Signed levels (|level| <= 127) and no coefficients.
  static constexpr bool kSignedIntLevels = true, kIntCoefs = false;
  static constexpr int kIntLevelMax = 127;  // largest |int level|
  // scale_s = (low nibble s of bytes 4-7 | bits 2s, 2s+1 of scales_h << 4) - 32.
  static void int_scales(const uint8_t* b, IntScales& o) {
    uint32_t lo;
    memcpy(&lo, b + 4, 4);
    const __m128i v = _mm_cvtsi32_si128(static_cast<int>(lo)), m = _mm_set1_epi8(0xf);
    const __m128i low = _mm_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m)));
    // Lane s: scales_h << (14 - 2s), then its top two bits.
    const __m128i h = _mm_srli_epi16(_mm_mullo_epi16(_mm_set1_epi16(static_cast<short>(b[2] | b[3] << 8)),
                                                     _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                                                    1 << 2, 1)),
                                     14);
    scale_pairs(_mm_sub_epi16(_mm_or_si128(low, _mm_slli_epi16(h, 4)), _mm_set1_epi16(32)), o);
    o.d = half_at(b, 0);
  }
};
template <>
struct Levels<Type::MXFP4> {  // the legacy nibble layout through the E2M1 table
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    return _mm256_shuffle_epi8(table16(LOWBIT_TABLE(ggml::kvalues_fp4)), nibbles16(b + 1));
  }
};
template <>
struct Levels<Type::NVFP4> {  // E2M1 nibbles of 16-element sub-blocks: byte j of 8 holds elements j and j + 8
  // The four UE4M3 scales as core's ue4m3_to_fp32_half computes them (the
  // same exact products), in one vector and one store, which the matmul's
  // vector load of them then forwards from.
  static void scales(const uint8_t* b, ggml::Decoded<Type::NVFP4>& o) {
    uint32_t bytes4;
    memcpy(&bytes4, b, 4);
    const __m128i x = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(static_cast<int>(bytes4)));
    const __m128i m = _mm_and_si128(x, _mm_set1_epi32(7)), e = _mm_and_si128(_mm_srli_epi32(x, 3), _mm_set1_epi32(15));
    const __m128 normal = _mm_mul_ps(_mm_cvtepi32_ps(_mm_add_epi32(m, _mm_set1_epi32(8))),
                                     _mm_castsi128_ps(_mm_slli_epi32(_mm_add_epi32(e, _mm_set1_epi32(127 - 11)), 23)));
    const __m128 subnormal = _mm_mul_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(1.0f / 1024.0f));
    const __m128 v = _mm_blendv_ps(normal, subnormal, _mm_castsi128_ps(_mm_cmpeq_epi32(e, _mm_setzero_si128())));
    _mm_storeu_ps(o.d, _mm_andnot_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, _mm_set1_epi32(0x7f))), v));
  }
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    // Sub-blocks 2C (bytes 0-7 of the 16) and 2C + 1 (bytes 8-15): the low
    // half takes the low then the high nibbles of bytes 0-7, the high half
    // those of bytes 8-15.
    const __m256i v = _mm256_broadcastsi128_si256(load16(b + 4 + 16 * C));
    const __m256i lo = _mm256_and_si256(v, bytes(0xf)), hi = byte_bits<4>(v, 0xf);
    const __m256i idx = _mm256_blend_epi32(_mm256_unpacklo_epi64(lo, hi), _mm256_unpackhi_epi64(lo, hi), 0xf0);
    return _mm256_shuffle_epi8(table16(LOWBIT_TABLE(ggml::kvalues_fp4)), idx);
  }
};
// Q1_0 and Q2_0: one fp16 d a block, repeated per 32 elements (ggml_types.h).
struct RepeatedScale {
  template <Type T>
  static void scales(const uint8_t* b, ggml::Decoded<T>& o) {
    // One store of all of them (see Levels<NVFP4>::scales).
    const __m128 d = _mm_set1_ps(half_at(b, 0));
    static_assert(sizeof(o.d) == 16 || sizeof(o.d) == 8, "four or two scales");
    if constexpr (sizeof(o.d) == 16)
      _mm_storeu_ps(o.d, d);
    else
      _mm_storel_epi64(reinterpret_cast<__m128i*>(o.d), _mm_castps_si128(d));  // no 8-byte alignment needed
  }
};
template <>
struct Levels<Type::Q1_0> : RepeatedScale {  // bit e of qs: +1 set, -1 clear
  template <int C>
  static __m256i chunk(const uint8_t* b) { return _mm256_sub_epi8(bit_bytes(b + 2 + 4 * C, 2), bytes(1)); }
};
// ---- i-quants: 8 (IQ2, IQ1) or 4 (IQ3) elements per grid entry ---------------
// The entries are looked up one by one (four or eight loads a chunk, as ggml's
// AVX2 kernels do: a gather costs more) and their signs applied as bytes.

// ggml's 7-bit sign fields as the byte masks of their 8 signs (the 8th the
// parity bit, core even_parity_signs): 0xff in byte j where sign j is set,
// one load per 8 elements instead of the parity's and the spread's work.
struct ParitySignMasks {
  uint64_t mask[128];
  constexpr ParitySignMasks() : mask() {
    for (uint32_t v = 0; v < 128; ++v) {
      uint32_t parity = v;
      parity ^= parity >> 4, parity ^= parity >> 2, parity ^= parity >> 1;
      const uint32_t signs = v | (parity & 1u) << 7;
      for (int j = 0; j < 8; ++j) mask[v] |= (signs >> j & 1u ? 0xffull : 0ull) << (8 * j);
    }
  }
};
constexpr ParitySignMasks kParitySignMasks;
static_assert(kParitySignMasks.mask[1] == 0xff000000000000ffull && kParitySignMasks.mask[3] == 0xffffull,
              "bit 7 makes the count of signs even");
// Magnitudes negated where `negative` has 0xff bytes.
inline __m256i negated(__m256i magnitudes, __m256i negative) {
  return _mm256_sub_epi8(_mm256_xor_si256(magnitudes, negative), negative);
}
// Magnitudes with the sign of bit e of `signs` applied to byte e.
inline __m256i with_signs(__m256i magnitudes, uint32_t signs) { return negated(magnitudes, bit_bytes(signs, -1)); }
// Four 7-bit sign fields, at bits 7l .. 7l + 6 of meta: the signs of 32 elements.
inline __m256i parity_signs(uint32_t f0, uint32_t f1, uint32_t f2, uint32_t f3) {
  const uint64_t* m = kParitySignMasks.mask;
  return _mm256_set_epi64x(static_cast<int64_t>(m[f3 & 127u]), static_cast<int64_t>(m[f2 & 127u]),
                           static_cast<int64_t>(m[f1 & 127u]), static_cast<int64_t>(m[f0 & 127u]));
}
inline __m256i parity_signs(uint32_t meta) { return parity_signs(meta, meta >> 7, meta >> 14, meta >> 21); }
inline __m256i entries64(const uint64_t* grid, uint32_t i0, uint32_t i1, uint32_t i2, uint32_t i3) {
  return _mm256_set_epi64x(static_cast<int64_t>(grid[i3]), static_cast<int64_t>(grid[i2]),
                           static_cast<int64_t>(grid[i1]), static_cast<int64_t>(grid[i0]));
}
inline __m256i entries32(const uint32_t* grid, const uint32_t (&i)[8]) {
  return _mm256_setr_epi32(static_cast<int>(grid[i[0]]), static_cast<int>(grid[i[1]]), static_cast<int>(grid[i[2]]),
                           static_cast<int>(grid[i[3]]), static_cast<int>(grid[i[4]]), static_cast<int>(grid[i[5]]),
                           static_cast<int>(grid[i[6]]), static_cast<int>(grid[i[7]]));
}
// IQ1's levels 8 * grid + delta (core iq1_level): grid bytes in {-1, 0, 1}.
inline __m256i iq1_levels(__m256i grid, __m256i delta) {
  return _mm256_add_epi8(_mm256_sign_epi8(bytes(8), grid), delta);
}

template <>
struct Levels<Type::IQ2_XXS> {  // sub-block C: 4 grid bytes, then 4 x 7 sign bits and the scale
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 2 + 8 * C;
    return negated(entries64(LOWBIT_TABLE(ggml::iq2xxs_grid), q[0], q[1], q[2], q[3]), parity_signs(load_u32(q + 4)));
  }
};
template <>
struct Levels<Type::IQ2_XS> {  // groups 4C .. 4C + 3: uint16 of a 9-bit grid index and 7 sign bits
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    uint32_t v[4];
    for (int l = 0; l < 4; ++l) v[l] = load_u16(b + 2 + 8 * C + 2 * l);
    return negated(entries64(LOWBIT_TABLE(ggml::iq2xs_grid), v[0] & 511, v[1] & 511, v[2] & 511, v[3] & 511),
                   parity_signs(v[0] >> 9, v[1] >> 9, v[2] >> 9, v[3] >> 9));
  }
};
template <>
struct Levels<Type::IQ2_S> {  // groups 4C + l: low index byte, 2 high bits of qh[C], a sign byte each
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 2 + 4 * C;
    const uint32_t qh = b[66 + C];
    return with_signs(entries64(LOWBIT_TABLE(ggml::iq2s_grid), q[0] | (qh << 8 & 0x300u), q[1] | (qh << 6 & 0x300u),
                                q[2] | (qh << 4 & 0x300u), q[3] | (qh << 2 & 0x300u)),
                      load_u32(b + 34 + 4 * C));
  }
};
template <>
struct Levels<Type::IQ3_XXS> {  // sub-block C: 8 grid bytes of 4 elements; 4 x 7 sign bits and the scale
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 2 + 8 * C;
    const uint32_t i[8] = {q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7]};
    return negated(entries32(LOWBIT_TABLE(ggml::iq3xxs_grid), i), parity_signs(load_u32(b + 66 + 4 * C)));
  }
};
template <>
struct Levels<Type::IQ3_S> {  // sub-block C: 8 index bytes, their 9th bits in qh[C], 4 sign bytes
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 2 + 8 * C;
    const uint32_t qh = b[66 + C];
    uint32_t i[8];
    for (int k = 0; k < 8; ++k) i[k] = q[k] | ((qh >> k) & 1u) << 8;
    return with_signs(entries32(LOWBIT_TABLE(ggml::iq3s_grid), i), load_u32(b + 74 + 4 * C));
  }
};
template <>
struct Levels<Type::IQ1_S> {  // sub-block C: 4 index bytes; qh[C]: 4 x 3 index bits, scale, delta sign
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 2 + 4 * C;
    const uint32_t qh = load_u16(b + 34 + 2 * C);
    const __m256i grid = entries64(LOWBIT_TABLE(ggml::iq1s_grid), q[0] | (qh & 7u) << 8, q[1] | (qh >> 3 & 7u) << 8,
                                   q[2] | (qh >> 6 & 7u) << 8, q[3] | (qh >> 9 & 7u) << 8);
    return iq1_levels(grid, bytes(qh & 0x8000u ? -1 : 1));
  }
};
template <>
struct Levels<Type::IQ1_M> {  // groups 4C + l: index byte; a qh nibble of 3 index bits and the delta sign
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const uint8_t* q = b + 4 * C;
    const uint32_t qh = load_u16(b + 32 + 2 * C);  // the nibbles of groups 4C .. 4C + 3, in order
    uint32_t index[4];
    int64_t delta[4];
    for (int l = 0; l < 4; ++l) {
      const uint32_t nibble = qh >> (4 * l) & 0xfu;
      index[l] = q[l] | (nibble & 7u) << 8;
      delta[l] = nibble & 8u ? -1 : 0x0101010101010101;
    }
    return iq1_levels(entries64(LOWBIT_TABLE(ggml::iq1s_grid), index[0], index[1], index[2], index[3]),
                      _mm256_set_epi64x(delta[3], delta[2], delta[1], delta[0]));
  }
};

template <>
struct Levels<Type::Q2_0> : RepeatedScale {  // element e: bits 2 (e % 4) of byte e / 4, minus 1
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    // The four fields of each of the chunk's 8 bytes, then interleaved back
    // into element order: bytes (f0, f1) and (f2, f3), then pairs of those.
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * C)), m = _mm_set1_epi8(3);
    const __m128i f0 = _mm_and_si128(v, m), f1 = _mm_and_si128(_mm_srli_epi16(v, 2), m);
    const __m128i f2 = _mm_and_si128(_mm_srli_epi16(v, 4), m), f3 = _mm_and_si128(_mm_srli_epi16(v, 6), m);
    const __m128i f01 = _mm_unpacklo_epi8(f0, f1), f23 = _mm_unpacklo_epi8(f2, f3);
    return _mm256_sub_epi8(_mm256_set_m128i(_mm_unpackhi_epi16(f01, f23), _mm_unpacklo_epi16(f01, f23)), bytes(1));
  }
};
template <>
struct Levels<Type::TQ2_0> {  // Q2_K's level layout, minus 1
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    return _mm256_sub_epi8(byte_bits<2 * (C % 4)>(load32(b + 32 * (C / 4)), 3), bytes(1));
  }
};
// ggml's base-3 digits (core trit(): ((byte * 3^n) mod 256 * 3) >> 8, minus 1)
// of 32 source bytes, lo = elements 0-15 and hi = 16-31, each element with its
// power 3^n in pow_lo / pow_hi: 16-bit lanes, as x86 has no byte multiply.
inline __m256i trit_digits(__m128i bytes16, __m256i pow) {
  const __m256i wide = _mm256_cvtepu8_epi16(bytes16);
  const __m256i shifted = _mm256_and_si256(_mm256_mullo_epi16(wide, pow), _mm256_set1_epi16(0xff));
  return _mm256_srli_epi16(_mm256_mullo_epi16(shifted, _mm256_set1_epi16(3)), 8);
}
inline __m256i trits(__m128i lo, __m128i hi, __m256i pow_lo, __m256i pow_hi) {
  // packus works per 128-bit lane: put the four 8-byte runs back in order.
  const __m256i packed = _mm256_packus_epi16(trit_digits(lo, pow_lo), trit_digits(hi, pow_hi));
  return _mm256_sub_epi8(_mm256_permute4x64_epi64(packed, 0xD8), bytes(1));
}

// Chunks 0-4: trit C of qs[0..31]; 5-6: two trits of qs[32..47]; 7: trit 4
// of qs[32..47], then trits 0-3 of qh[0..3] (Codec<TQ1_0>'s element order).
template <>
struct Levels<Type::TQ1_0> {
  static void scales(const uint8_t* b, ggml::Decoded<Type::TQ1_0>& o) { o.d[0] = half_at(b, 52); }
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    constexpr short kPow[5] = {1, 3, 9, 27, 81};
    if constexpr (C < 5) {
      const __m256i p = _mm256_set1_epi16(kPow[C]);
      return trits(load16(b), load16(b + 16), p, p);
    } else if constexpr (C < 7) {
      const __m128i q = load16(b + 32);
      return trits(q, q, _mm256_set1_epi16(kPow[2 * (C - 5)]), _mm256_set1_epi16(kPow[2 * (C - 5) + 1]));
    } else {
      int32_t qh;
      memcpy(&qh, b + 48, 4);
      return trits(load16(b + 32), _mm_set1_epi32(qh), _mm256_set1_epi16(81),
                   _mm256_setr_epi16(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27));
    }
  }
};
template <>
struct Levels<Type::Q2_K> {  // chunk 4h + j: bits 2j of qs[32h + l]
  // scales[16]: low nibble * d, high nibble * -dmin.
  static void scales(const uint8_t* b, ggml::Decoded<Type::Q2_K>& o) {
    const __m128i v = load16(b);
    const __m128i m = _mm_set1_epi8(0xf);
    const __m128i lo = _mm_and_si128(v, m), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m);
    float dd, dmin;
    half_pair(b, 80, dd, dmin);
    const __m256 d = _mm256_set1_ps(dd), nmin = _mm256_set1_ps(-dmin);
    _mm256_storeu_ps(o.d, _mm256_mul_ps(d, low8_to_float(lo)));
    _mm256_storeu_ps(o.d + 8, _mm256_mul_ps(d, low8_to_float(_mm_srli_si128(lo, 8))));
    _mm256_storeu_ps(o.m, _mm256_mul_ps(nmin, low8_to_float(hi)));
    _mm256_storeu_ps(o.m + 8, _mm256_mul_ps(nmin, low8_to_float(_mm_srli_si128(hi, 8))));
  }
  template <int C>
  static __m256i chunk(const uint8_t* b) { return byte_bits<2 * (C % 4)>(load32(b + 16 + 32 * (C / 4)), 3); }
  // Integer scales (low nibbles) and mins (high nibbles, times -dmin).
  static constexpr bool kSignedIntLevels = false, kIntCoefs = true;
  static constexpr int kIntLevelMax = 3;  // largest |int level|
  static void int_scales(const uint8_t* b, IntScales& o) {
    const __m128i v = load16(b), m = _mm_set1_epi8(0xf);
    scale_pairs(_mm256_cvtepu8_epi16(_mm_and_si128(v, m)), o);
    coefs(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), m)), o);
    float dmin;
    half_pair(b, 80, o.d, dmin);
    o.k = -dmin;
  }
};
template <>
struct Levels<Type::Q3_K> {  // Q2_K's levels minus 4 where hmask bit C of byte l is clear
  // The 16 biased 6-bit scales (core's q3k_scales) in bytes 0-15: scale s
  // has the low (s < 8) or high nibble of byte s % 8 and, as bits 4-5, bits
  // 2 (s / 4) and 2 (s / 4) + 1 of byte 8 + s % 4. In vector registers, by
  // shuffles and one variable shift: cheaper than core's scalar 64-bit
  // unpacking and the moves into vector registers.
  static __m128i biased_scales(const uint8_t* b) {
    const __m128i v = load16(b + 94);  // the block's last 16 bytes: the scales are bytes 2-13
    const __m128i low = _mm_shuffle_epi8(v, _mm_setr_epi8(2, 3, 4, 5, 6, 7, 8, 9, 2, 3, 4, 5, 6, 7, 8, 9));
    const __m128i nibbles = _mm_and_si128(_mm_blend_epi32(low, _mm_srli_epi16(low, 4), 0xc), _mm_set1_epi8(0xf));
    const __m128i top = _mm_shuffle_epi8(v, _mm_setr_epi8(10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13, 10, 11, 12, 13));
    const __m128i two = _mm_and_si128(_mm_srlv_epi32(top, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_or_si128(nibbles, _mm_slli_epi16(two, 4));  // two <= 3: no bit crosses a byte
  }
  // d * (scale - 32).
  static void scales(const uint8_t* b, ggml::Decoded<Type::Q3_K>& o) {
    const __m128i biased = biased_scales(b);
    const __m256 d = _mm256_set1_ps(half_at(b, 108));
    const __m256i bias = _mm256_set1_epi32(32);
    for (int h = 0; h < 2; ++h) {
      const __m256i s = _mm256_sub_epi32(_mm256_cvtepu8_epi32(h ? _mm_srli_si128(biased, 8) : biased), bias);
      _mm256_storeu_ps(o.d + 8 * h, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s)));
    }
  }
  template <int C>
  static __m256i chunk(const uint8_t* b) { return _mm256_sub_epi8(int_levels<C>(b), bytes(4)); }
  // Levels + 4 (0..7), the offset through the coefficients: scale_s, times -4d.
  static constexpr bool kSignedIntLevels = false, kIntCoefs = true;
  static constexpr int kIntLevelMax = 7;  // largest |int level|
  template <int C>
  static __m256i int_levels(const uint8_t* b) {
    const __m256i low = moved_bits<2 * (C % 4)>(load32(b + 32 + 32 * (C / 4)));
    const __m256i high = byte_bits<C, 2>(load32(b), 4);  // hmask bit C as 4
    return or_masked(low, high, 3);
  }
  static void int_scales(const uint8_t* b, IntScales& o) {
    const __m256i s = _mm256_sub_epi16(_mm256_cvtepu8_epi16(biased_scales(b)), _mm256_set1_epi16(32));
    scale_pairs(s, o);
    coefs(s, o);
    o.d = half_at(b, 108);
    o.k = -4.0f * o.d;
  }
};
template <>
struct Levels<Type::Q4_K> {  // chunk 2j (+1): low (high) nibbles of qs[32j + l]
  static void scales(const uint8_t* b, ggml::Decoded<Type::Q4_K>& o) { k4_scales_x8(b, o); }
  template <int C>
  static __m256i chunk(const uint8_t* b) { return byte_bits<4 * (C % 2)>(load32(b + 16 + 32 * (C / 2)), 0xf); }
  static constexpr bool kSignedIntLevels = false, kIntCoefs = true;
  static constexpr int kIntLevelMax = 15;  // largest |int level|
  static void int_scales(const uint8_t* b, IntScales& o) { k4_int_scales(b, o); }
};
template <>
struct Levels<Type::Q5_K> {  // Q4_K's nibbles plus 16 for bit C of qh[l]
  static void scales(const uint8_t* b, ggml::Decoded<Type::Q5_K>& o) { k4_scales_x8(b, o); }
  template <int C>
  static __m256i chunk(const uint8_t* b) {
    const __m256i low = moved_bits<4 * (C % 2)>(load32(b + 48 + 32 * (C / 2)));
    return or_masked(low, byte_bits<C, 4>(load32(b + 16), 0x10), 0xf);  // qh bit C as 16
  }
  static constexpr bool kSignedIntLevels = false, kIntCoefs = true;
  static constexpr int kIntLevelMax = 31;  // largest |int level|
  static void int_scales(const uint8_t* b, IntScales& o) { k4_int_scales(b, o); }
};
template <>
struct Levels<Type::Q6_K> {  // chunk 4h + k: nibble of ql[64h + 32(k % 2) + l], bits 2k of qh[32h + l]
  // int8 scales[16] at byte 192, times d.
  static void scales(const uint8_t* b, ggml::Decoded<Type::Q6_K>& o) {
    const __m256 d = _mm256_set1_ps(half_at(b, 208));
    _mm256_storeu_ps(o.d, _mm256_mul_ps(d, s8x8_to_float(b + 192)));
    _mm256_storeu_ps(o.d + 8, _mm256_mul_ps(d, s8x8_to_float(b + 200)));
  }
  template <int C>
  static __m256i chunk(const uint8_t* b) { return _mm256_sub_epi8(int_levels<C>(b), bytes(32)); }
  // Levels + 32 (0..63), the offset through the coefficients: scale_s, times -32d.
  static constexpr bool kSignedIntLevels = false, kIntCoefs = true;
  static constexpr int kIntLevelMax = 63;  // largest |int level|
  template <int C>
  static __m256i int_levels(const uint8_t* b) {
    constexpr int h = C / 4, k = C % 4;
    const __m256i low = moved_bits<k < 2 ? 0 : 4>(load32(b + 64 * h + 32 * (k % 2)));
    const __m256i high = byte_bits<2 * k, 4>(load32(b + 128 + 32 * h), 0x30);  // qh bits 2k, 2k + 1 as 16, 32
    return or_masked(low, high, 0xf);
  }
  static void int_scales(const uint8_t* b, IntScales& o) {
    const __m256i s = _mm256_cvtepi8_epi16(load16(b + 192));
    scale_pairs(s, o);
    coefs(s, o);
    o.d = half_at(b, 208);
    o.k = -32.0f * o.d;
  }
};

// Chunk C of the levels the integer form takes: Levels<T>::int_levels where
// the type defines its own (Q3_K and Q6_K, unsigned before their offset),
// else its ordinary levels.
template <ggml::Type T, int C>
inline __m256i int_levels(const uint8_t* b) {
  if constexpr (requires { Levels<T>::template int_levels<C>(b); })
    return Levels<T>::template int_levels<C>(b);
  else
    return Levels<T>::template chunk<C>(b);
}

// Whether T has the integer form (Levels<T>::int_scales; see IntScales):
// the integer GEMM form of the traits table, which its Levels must provide.
template <ggml::Type T>
constexpr bool has_int_scales() {
  constexpr bool table = ggml_cpu_traits(T).gemm == Gemm::kInt;
  if constexpr (has_simd_levels(T))
    static_assert(table == requires { Levels<T>::kIntCoefs; }, "the traits table's GEMM form and Levels<T> agree");
  return table;
}

}  // namespace simd
}  // namespace
}  // namespace cpu
}  // namespace lowbit
