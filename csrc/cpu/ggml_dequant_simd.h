// GGUF dequantization of every type, written with
// AVX2 intrinsics and included in each GGUF ISA unit (ggml_avx2.cpp,
// ggml_avx512.cpp) inside its target pragma region. Bit-exact with the
// portable dequantize_block: w = d * q (+ m), each operation rounded once
// (the product is kept out of any FMA contraction).
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <type_traits>
#include <utility>

#include "../core/ggml_blocks.h"
#include "ggml_kernels.h"
#include "ggml_levels_simd.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

// Stores eight fp32 results in the output dtype, rounded once as torch rounds
// (nearest even; bf16 NaN as torch's 0x7FC0).
struct StoreF32 {
  static void store(void* out, int64_t i, __m256 w) { _mm256_storeu_ps(static_cast<float*>(out) + i, w); }
};
struct StoreF16 {
  static void store(void* out, int64_t i, __m256 w) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm256_cvtps_ph(w, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};
struct StoreBF16 {
  static void store(void* out, int64_t i, __m256 w) {
    const __m256i bits = _mm256_castps_si256(w);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)),
                                          _mm256_set1_epi32(0x7fff));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(w, w, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
};

template <ggml::Type T, class S>
struct DequantSimd {
  using I = ggml::TypeInfo<T>;
  static constexpr int kChunks = I::kBlock / 32;

  // d * q rounded to fp32, opaque to the compiler so that adding m cannot be
  // contracted into an FMA (ggml and gguf-py round the product first).
  static inline __m256 product(__m256 d, __m256 q) {
    __m256 p = _mm256_mul_ps(d, q);
    asm("" : "+x"(p));
    return p;
  }

  // Eight elements (chunk C, eighth k) of the block into out.
  template <int C, int k>
  static inline void eighth(__m256i levels, const ggml::Decoded<T>& sc, void* out, int64_t at) {
    const __m128i half = k < 2 ? _mm256_castsi256_si128(levels) : _mm256_extracti128_si256(levels, 1);
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(k % 2 ? _mm_srli_si128(half, 8) : half));
    constexpr int s = (32 * C + 8 * k) / I::kSub;
    __m256 w = product(_mm256_set1_ps(sc.d[s]), q);
    if constexpr (I::kHasMin) w = _mm256_add_ps(w, _mm256_set1_ps(sc.m[s]));
    S::store(out, at + 32 * C + 8 * k, w);
  }

  template <int C>
  static inline void chunk(const uint8_t* blk, const ggml::Decoded<T>& sc, void* out, int64_t at) {
    const __m256i levels = simd::block_levels<T, C>(blk, sc);
    eighth<C, 0>(levels, sc, out, at);
    eighth<C, 1>(levels, sc, out, at);
    eighth<C, 2>(levels, sc, out, at);
    eighth<C, 3>(levels, sc, out, at);
  }

  template <int... C>
  static inline void chunks(std::integer_sequence<int, C...>, const uint8_t* blk, const ggml::Decoded<T>& sc,
                            void* out, int64_t at) {
    (chunk<C>(blk, sc, out, at), ...);
  }

  // n weights (whole blocks) of one row into out, from element `at` on.
  static void row(const uint8_t* W, int64_t n, void* out, int64_t at) {
    ggml::Decoded<T> sc;
    for (int64_t bi = 0; bi < n / I::kBlock; ++bi) {
      const uint8_t* blk = W + bi * I::kBytes;
      simd::block_scales(blk, sc);
      chunks(std::make_integer_sequence<int, kChunks>{}, blk, sc, out, at + bi * I::kBlock);
    }
  }
};

// The float weight types are plain conversions: eight elements at a time.
template <ggml::Type T, class S>
void float_row(const uint8_t* W, int64_t n, void* out, int64_t at) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256 w;
    if constexpr (T == ggml::Type::F32) {
      w = _mm256_loadu_ps(reinterpret_cast<const float*>(W) + i);
    } else {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(W + 2 * i));
      w = T == ggml::Type::F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    S::store(out, at + i, w);
  }
  alignas(32) float tail[8] = {};
  for (int64_t j = i; j < n; ++j) tail[j - i] = ggml::Codec<T>::value(W + j * ggml::TypeInfo<T>::kBytes);
  if (i < n) {  // the last n % 8 elements through a scratch vector
    alignas(32) uint16_t half_tail[8];
    if constexpr (std::is_same_v<S, StoreF32>) {
      for (int64_t j = i; j < n; ++j) static_cast<float*>(out)[at + j] = tail[j - i];
    } else {
      S::store(half_tail, 0, _mm256_load_ps(tail));
      for (int64_t j = i; j < n; ++j) static_cast<uint16_t*>(out)[at + j] = half_tail[j - i];
    }
  }
}

// Rows [r0, r1) of an [rows, n] weight into out (row r from element
// (r - r0) * n, in the dtype S stores).
template <class S>
bool run_dequant_simd(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    using I = ggml::TypeInfo<T>;
    const int64_t row_bytes = n / I::kBlock * I::kBytes;
    if constexpr (I::kFloat) {
      for (int64_t r = r0; r < r1; ++r) float_row<T, S>(W + r * row_bytes, n, out, (r - r0) * n);
    } else {
      for (int64_t r = r0; r < r1; ++r) DequantSimd<T, S>::row(W + r * row_bytes, n, out, (r - r0) * n);
    }
    ran = true;
  });
  return ran;
}

inline bool run_dequant_simd(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out,
                             OutDtype dtype) {
  switch (dtype) {
    case OutDtype::kF16: return run_dequant_simd<StoreF16>(type, W, r0, r1, n, out);
    case OutDtype::kBF16: return run_dequant_simd<StoreBF16>(type, W, r0, r1, n, out);
    default: return run_dequant_simd<StoreF32>(type, W, r0, r1, n, out);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
