// 8 x 32-bit lanes of AVX2, the vector vocabulary the *_simd.h kernels are
// written in. Include only inside a `#pragma GCC target("avx2,fma,f16c")`
// region (see gptq_fused_avx2.cpp), after every non-SIMD header.
#pragma once

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "gptq_kernels.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

struct VecAvx2 {
  static constexpr int kLanes = 8;
  // lookup() reads the low kLookupBits bits of each index lane.
  static constexpr int kLookupBits = 3;
  static constexpr int kRegisters = 16;
  using F = __m256;
  using I = __m256i;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static I set1_i(int32_t x) { return _mm256_set1_epi32(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static I load_i(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  // fp16 of every lane, rounded to nearest even (F16C).
  static void store_f16(uint16_t* p, F v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // bf16 of every lane as c10::BFloat16 rounds: to nearest even, NaN as 0x7FC0.
  static void store_bf16(uint16_t* p, F v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    // packus works within 128-bit halves: gather both halves' low 64 bits.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  template <int S>
  static I srl(I v) { return _mm256_srli_epi32(v, S); }
  template <int S>
  static I sll(I v) { return _mm256_slli_epi32(v, S); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  // c - a * b
  static F fnma(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  // table[index & (2^kLookupBits - 1)] per lane; the higher index bits are ignored.
  static F lookup(F table, I index) { return _mm256_permutevar8x32_ps(table, index); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

// The integer-dot vocabulary of gptq_gemm_a8's kernel (gptq_a8_simd.h).
// vpmaddubsw sums pairs of u8 x s8 products in saturating int16 and vpmaddwd
// the pairs of those into int32. 2- and 4-bit levels (at most 15) cannot
// saturate it; 8-bit ones go in as q - 128 (kOffset), the sign moved onto
// the activation, so each product is at most 128 * 127 and a pair fits.
struct A8Avx2 {
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;
  using I = __m256i;
  using F = __m256;
  template <int B>
  static constexpr int32_t kOffset = B == 8 ? 128 : 0;

  static I zero() { return _mm256_setzero_si256(); }
  static I set1(int32_t x) { return _mm256_set1_epi32(x); }
  static I load(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  template <int B>
  static I srl(I v, int j) { return j == 0 ? v : _mm256_srli_epi32(v, j * B); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  // acc + the sums of four (level byte) x (activation byte) products per lane.
  template <int B>
  static I dot(I acc, I levels, I a) {
    __m256i pairs;
    if constexpr (B == 8) {
      const __m256i w = _mm256_xor_si256(levels, _mm256_set1_epi8(static_cast<char>(0x80)));  // q - 128
      pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
    } else {
      pairs = _mm256_maddubs_epi16(levels, a);
    }
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
  static F set1_ps(float x) { return _mm256_set1_ps(x); }
  static F load_ps(const float* p) { return _mm256_loadu_ps(p); }
  static void store_ps(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  // The B-bit fields of columns n .. n+7 (n a multiple of 8) of a packed
  // row: its B bytes from n's, loaded exactly (no read past the row).
  template <int B>
  static I fields(const uint32_t* row, int64_t n) {
    using P = PackedLanes<B, kLanes>;
    uint64_t bits = 0;
    memcpy(&bits, reinterpret_cast<const uint8_t*>(row) + n * B / 8, B);
    const I words = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(_mm_cvtsi64_si128(static_cast<int64_t>(bits))),
                                                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P::word.data())));
    const I f = _mm256_srlv_epi32(words, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(P::shift.data())));
    return _mm256_and_si256(f, _mm256_set1_epi32((1 << B) - 1));
  }
  // Columns n .. n+7 of a row of scales of `type`, in fp32 (exactly).
  static F scales(const void* row, ScaleType type, int64_t n) {
    if (type == ScaleType::kF32) return _mm256_loadu_ps(static_cast<const float*>(row) + n);
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + n));
    if (type == ScaleType::kF16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
