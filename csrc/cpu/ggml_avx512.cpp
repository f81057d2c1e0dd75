// The GGUF SIMD kernels (ggml_matmul_simd.h, ggml_dequant_simd.h) compiled for AVX-512 with
// VNNI: the int8 dot product is one vpdpbusd on 256-bit registers (AVX512VL).
// Every non-SIMD header comes before the target pragma, so no inline function
// shared with other units gets AVX-512 code.
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <utility>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_repack.h"
#include "../core/ggml_tables.h"
#include "../core/ggml_types.h"
#include "../ops/dispatch.h"
#include "ggml_kernels.h"
#include "isa.h"

#if LOWBIT_X86_AVX512
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define LOWBIT_SIMD_AVX512BW 1
// GCC 12's 512-bit intrinsics pass an "undefined" vector (a self-initialised
// local) as the unused merge source, which -W(maybe-)uninitialized reports
// wherever they inline into a long enough function.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "ggml_dequant_simd.h"
#include "ggml_matmul_simd.h"

namespace lowbit {
namespace cpu {
namespace {

struct DotVnni {
  // 32 ymm registers (AVX512VL): tiles of 4 weight rows x 4 activation rows.
  static constexpr int kRowTile = 4;
  // vpdpbusd sums its four u8 x s8 products in int32: any levels are safe.
  static constexpr bool kWideProducts = true;
  // start + 8 int32 lanes, lane i = sum of u[j] * s[j] over bytes 4i .. 4i+3.
  static __m256i dot(__m256i start, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(start, u, s); }
  // The same on 512-bit registers: 16 lanes.
  static __m512i dot2(__m512i start, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(start, u, s); }
  // acc + 8 int32 lanes, lane i = pairs[i] (an int16 scale in both halves)
  // times the sum of u[j] * s[j] over bytes 4i .. 4i+3, for |u| * 127 * 2 < 2^15.
  static __m256i scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i pairs) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), pairs);
  }
};

}  // namespace

bool ggml_mul_mat_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                         const ggml::ActRow* acts, int64_t M, float* out, int64_t rows) {
  return run_matmul_simd<DotVnni>(type, W, r0, r1, n, acts, M, out, rows);
}

bool ggml_mul_mat_repacked_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                                  const ggml::ActRow* acts, int64_t M, float* out, int64_t rows) {
  bool ran = false;
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (has_repacked_layout(T)) {
      // Whole tiles repacked; the rows past the last one as the file has them.
      using Form = std::conditional_t<(ggml::TypeInfo<T>::kBlock == 32), RepackedFloatGemm<T>, RepackedIntGemm<T>>;
      const int64_t r = Form::run(W, r0, r1, n, acts, M, out, rows);
      MatmulSimd<DotVnni, T>::run(W, r, r1, n, acts, M, out, rows);
      ran = true;
    }
  });
  return ran;
}

bool ggml_mul_mat_avx512_takes_offsets(int64_t type, int64_t M) {
  return matmul_simd_takes_offsets<DotVnni>(type, M);
}

bool ggml_dequantize_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out,
                          OutDtype dtype) {
  return run_dequant_simd(type, W, r0, r1, n, out, dtype);
}

}  // namespace cpu
}  // namespace lowbit
#pragma GCC pop_options
#endif
