// The GGUF SIMD kernels (ggml_matmul_simd.h, ggml_dequant_simd.h) compiled for AVX2, with the
// int8 dot product as maddubs + madd. Every non-SIMD header comes before the
// target pragma, so no inline function shared with other units gets AVX2 code.
#include <stdint.h>
#include <string.h>

#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"
#include "../ops/dispatch.h"
#include "ggml_kernels.h"
#include "isa.h"

#if LOWBIT_X86_SIMD
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "ggml_act_quant_simd.h"
#include "ggml_dequant_simd.h"
#include "ggml_float_simd.h"
#include "ggml_matmul_simd.h"
#include "ggml_repacked_avx2.h"

namespace lowbit {
namespace cpu {
namespace {

struct DotAvx2 {
  // 16 ymm registers: tiles of 2 weight rows x 4 activation rows.
  static constexpr int kRowTile = 2;
  // maddubs sums pairs in int16, safe only for |levels| <= 128 (with
  // |activations| <= 127): signed levels go in as |w|, never as w + 128.
  static constexpr bool kWideProducts = false;
  // start + 8 int32 lanes, lane i = sum of u[j] * s[j] over bytes 4i .. 4i+3.
  static __m256i dot(__m256i start, __m256i u, __m256i s) {
    return _mm256_add_epi32(start, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  // acc + 8 int32 lanes, lane i = pairs[i] (an int16 scale in both halves)
  // times the sum of u[j] * s[j] over bytes 4i .. 4i+3, for |u| * 127 * 2 < 2^15.
  static __m256i scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i pairs) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), pairs));
  }
};

// The AVX2 repacked kernel of type T: RepackedFloatAvx2 for the one-scale
// types, summing in `order`, RepackedIntAvx2 for the integer-form ones (one
// order, the file layout's).
template <ggml::Type T, SumOrder order>
using RepackedAvx2 =
    std::conditional_t<(ggml::TypeInfo<T>::kBlock == 32), RepackedFloatAvx2<T, order>, RepackedIntAvx2<T>>;

// From how many activation rows (ggml_traits.h) a file-layout weight of type
// T goes through RepackedAvx2<T>, a tile at a time repacked into a buffer that
// stays in cache (repack_tile): its passes share each decoded group between
// activation rows and need no horizontal sums.
constexpr int64_t kNoCopies = std::numeric_limits<int64_t>::max();
constexpr int64_t repacked_copy_rows(ggml::Type t) {
  return ggml_cpu_traits(t).avx2_copy_rows ? ggml_cpu_traits(t).avx2_copy_rows : kNoCopies;
}

// RepackedAvx2<T> over the whole tiles of file-layout rows r0 .. r1, each
// repacked first, in the file layout's order (so every row is the matvec's
// bit for bit at every M); returns the first row it did not take.
template <ggml::Type T>
int64_t run_repacked_copies(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                            float* out, int64_t rows) {
  const int64_t row_bytes = n / ggml::TypeInfo<T>::kBlock * ggml::TypeInfo<T>::kBytes;
  std::vector<uint8_t> tile(ggml::kRepackRows * row_bytes);
  int64_t r = r0;
  for (; r + ggml::kRepackRows <= r1; r += ggml::kRepackRows) {
    repack_tile<T>(W + r * row_bytes, row_bytes, tile.data());
    run_half_tiles<RepackedAvx2<T, SumOrder::kFileLayout>>(tile.data(), 0, ggml::kRepackRows, n, acts, M, out + r,
                                                           rows);
  }
  return r;
}

}  // namespace

bool ggml_mul_mat_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts,
                       int64_t M, float* out, int64_t rows) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (!ggml::TypeInfo<T>::kFloat) {
      if constexpr (repacked_copy_rows(T) != kNoCopies)
        if (M >= repacked_copy_rows(T)) r0 = run_repacked_copies<T>(W, r0, r1, n, acts, M, out, rows);
      MatmulSimd<DotAvx2, T>::run(W, r0, r1, n, acts, M, out, rows);
      ran = true;
    }
  });
  return ran;
}

bool ggml_mul_mat_repacked_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                                const ggml::ActRow* acts, int64_t M, float* out, int64_t rows) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (reads_repacked_avx2(T)) {
      // Whole tiles repacked, each block's dot summed in int32 first; the
      // rows past the last one as the file has them.
      const int64_t r = run_half_tiles<RepackedAvx2<T, SumOrder::kBlockDot>>(W, r0, r1, n, acts, M, out, rows);
      MatmulSimd<DotAvx2, T>::run(W, r, r1, n, acts, M, out, rows);
      ran = true;
    }
  });
  return ran;
}

bool ggml_mul_mat_avx2_takes_offsets(int64_t type, int64_t M, bool repacked) {
  bool takes = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    // A repacked weight of a type AVX2 does not read goes back to the file
    // layout's kernels (copies included) a few tiles at a time; one it reads
    // takes ActRow::isum instead.
    constexpr bool reads = reads_repacked_avx2(T);
    if constexpr (ggml::TypeInfo<T>::kBlock == 32 && repacked_copy_rows(T) != kNoCopies)
      takes = RepackedFloatAvx2<T, SumOrder::kFileLayout>::kOffsets && !(repacked && reads) &&
              M >= repacked_copy_rows(T);
  });
  return takes;
}

bool ggml_mul_mat_avx2_takes_block_sums(int64_t type, bool repacked) {
  bool takes = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (ggml::TypeInfo<T>::kBlock == 32 && reads_repacked_avx2(T))
      takes = repacked && RepackedFloatAvx2<T, SumOrder::kBlockDot>::kOffsets;
  });
  return takes;
}

void ggml_quantize_acts_avx2(ggml::Act act, const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, float* sum,
                             int32_t* offset, int16_t* isum) {
  const int block = act == ggml::Act::Q8_K ? 256 : 32;
  if (act == ggml::Act::Q8_K) {
    for (int64_t b = b0; b < b1; ++b) quantize_q8_k_block(x + 256 * b, q + 256 * b, d + b, sum + 16 * b);
    // |sum of 16 int8| <= 2032: exact in int16.
    if (isum)
      for (int64_t i = 16 * b0; i < 16 * b1; ++i) isum[i] = static_cast<int16_t>(sum[i]);
  } else {
    for (int64_t b = b0; b < b1; ++b) quantize_q8_0_block(x + 32 * b, q + 32 * b, d + b, sum + b, isum ? isum + b : nullptr);
  }
  if (offset)
    for (int64_t e = b0 * block; e < b1 * block; e += 32) act_offsets(q + e, offset + e / 4);
}

bool ggml_mul_mat_float_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const float* X,
                             int64_t M, float* out, int64_t rows) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (ggml::TypeInfo<T>::kFloat) {
      mul_mat_float_rows<T>(W, r0, r1, n, X, M, out, rows);
      ran = true;
    }
  });
  return ran;
}

bool ggml_dequantize_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out,
                          OutDtype dtype) {
  return run_dequant_simd(type, W, r0, r1, n, out, dtype);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
