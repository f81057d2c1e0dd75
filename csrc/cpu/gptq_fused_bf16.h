// gptq_gemm's fused small-M kernel for 4-bit weights and bf16 / fp16
// activations on AVX512-BF16 (vdpbf16ps). Include only inside the target
// pragma region of gptq_fused_avx512bf16.cpp.
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
// The weights: a 32-bit lane holds the 8 nibbles of rows k .. k+7 of one
// column; as two 16-bit halves it holds rows k .. k+3 (low) and k+4 .. k+7
// (high). A 16-bit shift by 4i and vpermw through a 32-entry table of bf16(i
// & 15) (vpermw reads the low 5 bits; the table repeats, so the fifth bit, the
// next nibble's, is ignored) turn it into the pair (q[k+i], q[k+4+i]) in bf16,
// which meets the activation pair (a[k+i], a[k+4+i]) packed the same way. The
// zero point leaves the inner loop as in the fp32 kernel:
//     out[m, n] += s[g, n] * (sum_k a[m, k] q[k, n] - z[g, n] sum_k a[m, k]).
#pragma once

#include <stdint.h>

#include <algorithm>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "gptq_group_simd.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

struct FusedBf16x4 {
  using P = gptq::Pack<4>;
  static constexpr int L = 16;         // fp32 lanes (columns) per vector
  static constexpr int kMaxRows = 4;   // activation rows sharing each decoded weight
  static constexpr int64_t kPrefetchAhead = 256;  // words; as in gptq_fused_simd.h

  template <int MT>
  static constexpr int kU = MT <= 2 ? 4 : 2;  // column vectors per tile: accumulators in registers

  // bf16(i & 15) for i < 32, the vpermw table.
  static __m512i levels() {
    alignas(64) uint16_t t[32];
    for (int i = 0; i < 32; ++i) {
      const float f = static_cast<float>(i & 15);
      uint32_t bits;
      __builtin_memcpy(&bits, &f, 4);
      t[i] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have short significands
    }
    return _mm512_load_si512(t);
  }

  // pairs[((plane * MT + m) * packs + p) * 4 + i] = (a[k+i], a[k+4+i]) as two
  // bf16 in one word, k = 8p: the activation side of each vdpbf16ps.
  struct Group {
    const uint32_t* pairs;
    int64_t packs;
    int planes;
    float a_sum[kMaxRows];
  };

  template <int MT>
  static void tile(const Group& in, const uint32_t* q, int64_t N, const int32_t* z, const float* s, float* out,
                   __m512i table) {
    constexpr int U = kU<MT>;
    __m512 acc[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
    for (int64_t p = 0; p < in.packs; ++p) {
      __m512i w[U];
      for (int u = 0; u < U; ++u) {
        const uint32_t* row = q + p * N + u * L;
        __builtin_prefetch(row + kPrefetchAhead, 0, 2);  // read, locality 2: prefetcht1, into L2
        w[u] = _mm512_loadu_si512(row);
      }
      for (int i = 0; i < 4; ++i) {
        __m512bh qv[U];
        for (int u = 0; u < U; ++u) {
          const __m512i index = i == 0 ? w[u] : _mm512_srli_epi16(w[u], static_cast<unsigned>(4 * i));
          qv[u] = (__m512bh)_mm512_permutexvar_epi16(index, table);
        }
        for (int plane = 0; plane < in.planes; ++plane)
          for (int m = 0; m < MT; ++m) {
            const uint32_t pair = in.pairs[((plane * MT + m) * in.packs + p) * 4 + i];
            const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
            for (int u = 0; u < U; ++u) acc[m][u] = _mm512_dpbf16_ps(acc[m][u], qv[u], x);
          }
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) {
        const __m512 zero = _mm512_cvtepi32_ps(_mm512_loadu_si512(z + u * L));
        const __m512 sum = _mm512_fnmadd_ps(zero, _mm512_set1_ps(in.a_sum[m]), acc[m][u]);
        float* o = out + m * N + u * L;
        _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_loadu_ps(s + u * L), sum, _mm512_loadu_ps(o)));
      }
  }

  // Rows m0 .. m0+MT of out[:, n0:n1], group g, whose zero points and scales
  // for those columns are z and s.
  template <int MT>
  static void group_rows(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t g, int64_t m0,
                         int64_t n0, int64_t n1, const int32_t* z, const float* s, std::vector<uint32_t>& scratch,
                         float* out, __m512i table) {
    const int64_t gs = w.group_of.group_size;
    const int64_t rows = std::min(gs, w.K - g * gs);  // the last group may be short
    Group in{nullptr, rows / P::kFields, a16.planes, {}};
    for (int m = 0; m < MT; ++m) {
      const float* am = a + (m0 + m) * w.K + g * gs;
      float sum = 0.0f;
      for (int64_t k = 0; k < rows; ++k) sum += am[k];
      in.a_sum[m] = sum;
    }
    scratch.resize(static_cast<size_t>(in.planes * MT * in.packs * 4));
    for (int plane = 0; plane < in.planes; ++plane)
      for (int m = 0; m < MT; ++m) {
        const uint16_t* x = a16.data + (plane * a16.M + m0 + m) * w.K + g * gs;
        uint32_t* dst = scratch.data() + (plane * MT + m) * in.packs * 4;
        for (int64_t p = 0; p < in.packs; ++p)
          for (int i = 0; i < 4; ++i) dst[p * 4 + i] = x[8 * p + i] | static_cast<uint32_t>(x[8 * p + 4 + i]) << 16;
      }
    in.pairs = scratch.data();
    const uint32_t* qg = w.qweight + g * (gs / P::kFields) * w.N;
    for (int64_t n = n0; n < n1; n += kU<MT> * L)
      tile<MT>(in, qg + n, w.N, z + (n - n0), s + (n - n0), out + m0 * w.N + n, table);
  }

  static void run(const float* a, const Bf16Acts& a16, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    const int64_t M = a16.M;
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * w.N + n0, out + m * w.N + n1, 0.0f);
    const int64_t groups = (w.K + w.group_of.group_size - 1) / w.group_of.group_size;
    const __m512i table = levels();
    std::vector<uint32_t> scratch;
    std::vector<int32_t> z(n1 - n0);
    std::vector<float> s(n1 - n0);
    for (int64_t g = 0; g < groups; ++g) {
      read_group_simd<4>(w, g, n0, n1, z.data(), s.data());
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        if (left >= 4) {
          group_rows<4>(a, a16, w, g, m0, n0, n1, z.data(), s.data(), scratch, out, table), m0 += 4;
        } else if (left == 3) {
          group_rows<3>(a, a16, w, g, m0, n0, n1, z.data(), s.data(), scratch, out, table), m0 += 3;
        } else if (left == 2) {
          group_rows<2>(a, a16, w, g, m0, n0, n1, z.data(), s.data(), scratch, out, table), m0 += 2;
        } else {
          group_rows<1>(a, a16, w, g, m0, n0, n1, z.data(), s.data(), scratch, out, table), m0 += 1;
        }
      }
    }
  }
};

}  // namespace
}  // namespace cpu
}  // namespace lowbit
