// The torch-free view of a GPTQ weight that the CPU gptq_gemm kernels read,
// and the entry points of its SIMD variants (gptq_fused_avx2.cpp,
// gptq_fused_avx512.cpp; chosen at run time, see isa.h).
#pragma once

#include <stdint.h>

#include <string.h>

#include <algorithm>
#include <array>

#include "../core/float_bits.h"
#include "../core/gptq_format.h"

namespace lowbit {
namespace cpu {

// Group of weight row k: g_idx[k] when given, else k / group_size (the last
// group may be short).
struct RowGroups {
  const int32_t* g_idx;  // null for the trivial grouping
  int64_t group_size;
  int64_t count;  // groups: every group id is below it
  int64_t operator()(int64_t k) const { return g_idx ? g_idx[k] : k / group_size; }
};

// A GPTQ weight's per-group parameters as the checkpoint stores them. The
// kernels unpack the run of columns they work on, one group at a time, into
// small buffers (read_group): unpacking all [groups, N] up front, per call,
// cost a matvec about a third of its time, mostly in page faults on the
// fresh [groups, N] buffers.
enum class ScaleType { kF32, kF16, kBF16 };
struct GroupParams {
  const uint32_t* qzeros;  // [groups, N * bits / 32], packed along N
  const void* scales;      // [groups, N] of scale_type
  ScaleType scale_type;
  bool v2_format;  // qzeros store the zero itself (else zero - 1, GPTQ v1)
};

// A validated GPTQ weight in the form the kernels read it.
struct GptqWeight {
  const uint32_t* qweight;  // [rows, N], or panels [N / panel, rows, panel]
  int64_t K;
  int64_t N;
  GroupParams params;
  RowGroups group_of;
  int64_t rows = 0;   // K*bit/32 packed rows
  int64_t panel = 0;  // columns per panel; 0: the checkpoint's layout
  // The words of packed row `row` from column n on, contiguous up to the end
  // of n's panel; row_stride() words further on is the next row's.
  const uint32_t* words(int64_t row, int64_t n) const {
    return panel ? qweight + (n / panel * rows + row) * panel + n % panel : qweight + row * N + n;
  }
  int64_t row_stride() const { return panel ? panel : N; }
  // The end of the contiguous run of columns from n, at most n1.
  int64_t run_end(int64_t n, int64_t n1) const { return panel ? std::min(n1, (n / panel + 1) * panel) : n1; }
};

// Group g's zero points and scales as the checkpoint stores them, for the
// kernels that convert a vector of columns in registers as they need it
// (gptq_a8_simd.h): zeros[g] packed along N, scales[g] of `type`, and the
// format's addend to a stored zero (1 for GPTQ v1, 0 for v2).
struct GroupRow {
  const uint32_t* zeros;
  const void* scales;
  ScaleType type;
  int32_t zero_offset;
};
template <int B>
inline GroupRow group_row(const GptqWeight& w, int64_t g) {
  const int64_t scale_bytes = w.params.scale_type == ScaleType::kF32 ? 4 : 2;
  return {w.params.qzeros + g * (w.N * B / 32), static_cast<const char*>(w.params.scales) + g * w.N * scale_bytes,
          w.params.scale_type, w.params.v2_format ? 0 : 1};
}

// Lane i of a vector of L columns from column n (a multiple of L) of a row of
// B-bit fields packed along N (2-, 4- and 8-bit): dword word[i] of the L*B
// bits from n's, shifted right by shift[i].
template <int B, int L>
struct PackedLanes {
  static constexpr std::array<int32_t, L> word = [] {
    std::array<int32_t, L> a{};
    for (int i = 0; i < L; ++i) a[i] = i * B / 32;
    return a;
  }();
  static constexpr std::array<int32_t, L> shift = [] {
    std::array<int32_t, L> a{};
    for (int i = 0; i < L; ++i) a[i] = i * B % 32;
    return a;
  }();
};

// Internal linkage for the readers: every ISA unit includes this header, and
// tests/test_cpu_kernels.py checks that no kernel function is a symbol the
// units share.
namespace {

// z[n - n0] for n in [n0, n1): group g's zero points, the format's rule applied.
template <int B>
inline void read_zeros(const GptqWeight& w, int64_t g, int64_t n0, int64_t n1, int32_t* z) {
  using P = gptq::Pack<B>;
  const uint32_t* zrow = w.params.qzeros + g * (w.N / P::kFields * P::kWords);
  for (int64_t n = n0; n < n1; ++n) z[n - n0] = gptq::zero_point(gptq::unpack_field<B>(zrow, 1, n), w.params.v2_format);
}

// s[n - n0] for n in [n0, n1): group g's scales in fp32.
inline void read_scales(const GptqWeight& w, int64_t g, int64_t n0, int64_t n1, float* s) {
  const int64_t at = g * w.N + n0, count = n1 - n0;
  if (w.params.scale_type == ScaleType::kF32) {
    memcpy(s, static_cast<const float*>(w.params.scales) + at, static_cast<size_t>(count) * sizeof(float));
    return;
  }
  const uint16_t* h = static_cast<const uint16_t*>(w.params.scales) + at;
  if (w.params.scale_type == ScaleType::kF16) {
    for (int64_t i = 0; i < count; ++i) s[i] = fp16_to_fp32(h[i]);
  } else {
    for (int64_t i = 0; i < count; ++i) s[i] = bf16_to_fp32(h[i]);
  }
}

template <int B>
inline void read_group(const GptqWeight& w, int64_t g, int64_t n0, int64_t n1, int32_t* z, float* s) {
  read_zeros<B>(w, g, n0, n1, z);
  read_scales(w, g, n0, n1, s);
}

}  // namespace

// The SIMD fused kernels compute out[m, n] = sum_k a[m, k] * W[k, n] (fp32,
// row-major a [M, K] and out [M, N]) for m < M and n in [n0, n1). They need
// contiguous groups (no g_idx: the trivial grouping, possibly with a short
// last group, or act-order weights in the shuffled layout) that hold whole
// packs, and a column range that is a
// multiple of simd_fused_cols(); simd_fused_supports() says whether w qualifies.
// (Internal linkage, as every function of these headers: see read_zeros.)
namespace {
template <int B>
bool simd_fused_supports(const GptqWeight& w) {
  return w.group_of.g_idx == nullptr && w.group_of.group_size % gptq::Pack<B>::kFields == 0;
}
}  // namespace
constexpr int64_t kAvx2FusedCols = 32;    // 4 vectors of 8 lanes
constexpr int64_t kAvx512FusedCols = 64;  // 4 vectors of 16 lanes
// Activation rows that share each decoded weight in the SIMD fused kernels;
// more take another pass (for_group_row_tiles in gptq_group_simd.h).
constexpr int kFusedMaxRows = 4;

// Activations for the AVX512-BF16 kernel: `planes` bf16 copies
// of a [M, K] that sum to a exactly, [planes][M][K]: one plane for bf16
// input, two (hi, lo) for fp16. The kernel also reads a itself in fp32.
struct Bf16Acts {
  const uint16_t* data;
  int64_t M;
  int planes;
};

// The SIMD tile dequantizers write W[k, n] for k in [k0, k1) and n in [n0, n1)
// at out[(k - k0) * ldo + n - n0], exactly as gptq::dequant computes it, in
// out_type (fp16 and bf16 rounded to nearest even, as torch converts). k0
// and k1 hold whole packs, n0 is a multiple of 8 and n1 - n0 of the vector
// width (kAvx2DequantCols, kAvx512DequantCols); groups as simd_fused_supports().
constexpr int64_t kAvx2DequantCols = 8;
constexpr int64_t kAvx512DequantCols = 16;
void gptq_dequant_avx2(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                       ScaleType out_type, void* out, int64_t ldo);
void gptq_dequant_avx512(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                         ScaleType out_type, void* out, int64_t ldo);
// The same as two bf16 planes, hi = bf16(W) and lo = bf16(W - hi), each
// rounded to nearest even: hi + lo is W to 16 significand bits, for a bf16
// GEMM that must not lose the fp32 weight's precision (AVX512-BF16 CPUs).
void gptq_dequant_bf16x2_avx512bf16(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                                    uint16_t* hi, uint16_t* lo, int64_t ldo);

// gptq_gemm_a8's activations: each row's groups of K quantized to int8,
// q = round(a * 127 / amax) with scale d = amax / 127, in the byte order
// a8_byte<B> gives. The AVX-512 kernel broadcasts dword j of each pack to
// every column; byte b of a weight word shifted right by j*B bits (and
// masked) holds field b*S + j, so that dword holds those fields' activations
// (gptq_a8_simd.h).
struct GptqActs8 {
  const int8_t* q;       // [M][K] in a8_byte order
  const float* scale;    // [M][groups]: d, NaN where the group holds a NaN or an infinity
  const int32_t* sum;    // [M][groups]: the sum of the group's q
  int64_t groups;
};
template <int B>
constexpr int64_t a8_byte(int64_t k) {
  if constexpr (B == 3) {
    return k;  // fields straddle words: only the portable kernel reads 3-bit
  } else {
    constexpr int64_t F = 32 / B, S = 8 / B;
    const int64_t f = k % F;
    return k - f + (f % S) * 4 + f / S;
  }
}
// out[m, n] for n in [n0, n1) (multiples of kAvx2FusedCols / kAvx512FusedCols),
// 2-, 4- and 8-bit weights with contiguous groups of whole packs, rows m < M.
void gptq_a8_avx2(int bits, const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1,
                  float* out);
void gptq_a8_avx512(int bits, const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1,
                    float* out);

void gptq_fused_avx2(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out);
void gptq_fused_avx512(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out);
void gptq_fused_avx512bf16(int bits, const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0,
                           int64_t n1, float* out);

}  // namespace cpu
}  // namespace lowbit
