// 16 x 32-bit lanes of AVX-512, the same vocabulary as VecAvx2. Include only
// inside a `#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")`
// region (see gptq_fused_avx512.cpp), after every non-SIMD header.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "gptq_kernels.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

struct VecAvx512 {
  static constexpr int kLanes = 16;
  // lookup() reads the low kLookupBits bits of each index lane.
  static constexpr int kLookupBits = 4;
  static constexpr int kRegisters = 32;
  using F = __m512;
  using I = __m512i;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static I set1_i(int32_t x) { return _mm512_set1_epi32(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static I load_i(const void* p) { return _mm512_loadu_si512(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  // fp16 of every lane, rounded to nearest even.
  static void store_f16(uint16_t* p, F v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // bf16 of every lane as c10::BFloat16 rounds: to nearest even, NaN as 0x7FC0.
  static void store_bf16(uint16_t* p, F v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  template <int S>
  static I srl(I v) { return _mm512_srli_epi32(v, S); }
  template <int S>
  static I sll(I v) { return _mm512_slli_epi32(v, S); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  // c - a * b
  static F fnma(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // table[index & (2^kLookupBits - 1)] per lane; the higher index bits are ignored.
  static F lookup(F table, I index) { return _mm512_permutexvar_ps(index, table); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

// The integer-dot vocabulary of gptq_gemm_a8's kernel (gptq_a8_simd.h):
// vpdpbusd adds four u8 x s8 products per lane to an int32, exactly.
struct A8Avx512 {
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  using I = __m512i;
  using F = __m512;
  template <int B>
  static constexpr int32_t kOffset = 0;

  static I zero() { return _mm512_setzero_si512(); }
  static I set1(int32_t x) { return _mm512_set1_epi32(x); }
  static I load(const uint32_t* p) { return _mm512_loadu_si512(p); }
  template <int B>
  static I srl(I v, int j) { return j == 0 ? v : _mm512_srli_epi32(v, j * B); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int B>
  static I dot(I acc, I levels, I a) { return _mm512_dpbusd_epi32(acc, levels, a); }
  static F set1_ps(float x) { return _mm512_set1_ps(x); }
  static F load_ps(const float* p) { return _mm512_loadu_ps(p); }
  static void store_ps(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  // The B-bit fields of columns n .. n+15 (n a multiple of 16) of a packed
  // row: its 2B bytes from n's, loaded exactly (no read past the row).
  template <int B>
  static I fields(const uint32_t* row, int64_t n) {
    using P = PackedLanes<B, kLanes>;
    const uint8_t* p = reinterpret_cast<const uint8_t*>(row) + n * B / 8;
    __m128i bytes;
    if constexpr (B == 2) bytes = _mm_loadu_si32(p);
    else if constexpr (B == 4) bytes = _mm_loadu_si64(p);
    else bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const I words = _mm512_permutexvar_epi32(_mm512_loadu_si512(P::word.data()), _mm512_castsi128_si512(bytes));
    const I f = _mm512_srlv_epi32(words, _mm512_loadu_si512(P::shift.data()));
    return _mm512_and_si512(f, _mm512_set1_epi32((1 << B) - 1));
  }
  // Columns n .. n+15 of a row of scales of `type`, in fp32 (exactly).
  static F scales(const void* row, ScaleType type, int64_t n) {
    if (type == ScaleType::kF32) return _mm512_loadu_ps(static_cast<const float*>(row) + n);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + n));
    if (type == ScaleType::kF16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
