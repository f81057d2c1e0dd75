// The fused dequantize + small-M GEMM of gptq_gemm, written once over a
// vector vocabulary V (VecAvx2, VecAvx512) and instantiated per ISA in its own
// translation unit. Include only inside that unit's target pragma region.
//
// Lanes are output columns. A pack of GPTQ words (kWords rows of qweight)
// holds kFields consecutive rows k for every column, so one vector load of
// each word row gives kFields rows x kLanes columns; every field is cut out
// with compile-time shifts (gptq::locate is constexpr), its zero point
// subtracted in integers (exact, so no cancellation), converted to fp32 and
// multiplied by the broadcast activation a[m, k]. The scale multiplies the
// group's fp32 partial sum once per group:
//     out[m, n] += s[g, n] * sum_{k in g} a[m, k] * (q[k, n] - z[g, n])
// which is the reference's sum of a * s * (q - z) regrouped, fp32 throughout.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <utility>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"

namespace lowbit {
namespace cpu {

template <class V, int B>
struct FusedSimd {
  using F = typename V::F;
  using I = typename V::I;
  using P = gptq::Pack<B>;
  static constexpr int L = V::kLanes;

  // Vectors of columns per sub-tile for MT activation rows: enough independent
  // accumulator chains to hide the FMA latency, few enough to stay in
  // registers (V::kRegisters: 16 for AVX2, 32 for AVX-512).
  template <int MT>
  static constexpr int kU = V::kRegisters >= 32 ? (MT <= 2 ? 4 : 2) : (MT == 1 ? 4 : MT == 2 ? 2 : 1);

  // Field FI of the pack in `words`, for U column vectors, into acc.
  template <int MT, int U, int FI>
  static inline void field(const I (&words)[P::kWords][U], const I (&zero)[U], const float* a, int64_t K,
                           F (&acc)[MT][U]) {
    constexpr gptq::FieldLoc f = gptq::locate<B>(FI);
    F q[U];
    for (int u = 0; u < U; ++u) {
      I v = words[f.lo][u];
      if constexpr (f.lo_shift != 0) v = V::template srl<f.lo_shift>(v);
      // The top field of a word needs no mask: the shift already cleared the rest.
      if constexpr (f.lo_shift + f.hi_pos < 32) v = V::and_(v, V::set1_i(static_cast<int32_t>(f.lo_mask)));
      if constexpr (f.hi_mask != 0) {
        const I high = V::and_(words[f.hi][u], V::set1_i(static_cast<int32_t>(f.hi_mask)));
        v = V::or_(v, V::template sll<f.hi_pos>(high));
      }
      q[u] = V::cvt(V::sub(v, zero[u]));
    }
    for (int m = 0; m < MT; ++m) {
      const F x = V::set1(a[m * K + FI]);
      for (int u = 0; u < U; ++u) acc[m][u] = V::fma(x, q[u], acc[m][u]);
    }
  }

  template <int MT, int U, int... FI>
  static inline void pack(std::integer_sequence<int, FI...>, const I (&words)[P::kWords][U], const I (&zero)[U],
                          const float* a, int64_t K, F (&acc)[MT][U]) {
    (field<MT, U, FI>(words, zero, a, K, acc), ...);
  }

  // One group (packs packs, starting at activation column a / word row q) of
  // MT rows x U*L columns, added to out as s * partial sum.
  template <int MT>
  static void group_tile(const float* a, int64_t K, const uint32_t* q, int64_t N, int64_t packs, const int32_t* z,
                         const float* s, float* out) {
    constexpr int U = kU<MT>;
    F acc[MT][U];
    I zero[U];
    for (int u = 0; u < U; ++u) zero[u] = V::load_i(z + u * L);
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = V::zero();
    for (int64_t p = 0; p < packs; ++p) {
      I words[P::kWords][U];
      for (int w = 0; w < P::kWords; ++w)
        for (int u = 0; u < U; ++u) words[w][u] = V::load_i(q + (p * P::kWords + w) * N + u * L);
      pack<MT, U>(std::make_integer_sequence<int, P::kFields>{}, words, zero, a + p * P::kFields, K, acc);
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) {
        float* o = out + m * N + u * L;
        V::store(o, V::fma(V::load(s + u * L), acc[m][u], V::load(o)));
      }
  }

  // Rows m0 .. m0+MT of out[:, n0:n1], one group g.
  template <int MT>
  static void group_rows(const float* a, const GptqWeight& w, int64_t g, int64_t m0, int64_t n0, int64_t n1,
                         float* out) {
    const int64_t gs = w.group_of.group_size;
    const int64_t packs = (std::min(gs, w.K - g * gs)) / P::kFields;  // the last group may be short
    const float* ag = a + m0 * w.K + g * gs;
    const uint32_t* qg = w.qweight + g * (gs / P::kFields) * P::kWords * w.N;
    for (int64_t n = n0; n < n1; n += kU<MT> * L) {
      group_tile<MT>(ag, w.K, qg + n, w.N, packs, w.zeros + g * w.N + n, w.scales + g * w.N + n,
                     out + m0 * w.N + n);
    }
  }

  static void run(const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * w.N + n0, out + m * w.N + n1, 0.0f);
    const int64_t groups = (w.K + w.group_of.group_size - 1) / w.group_of.group_size;
    for (int64_t g = 0; g < groups; ++g) {
      // Up to 4 activation rows share each decoded weight; more take another pass.
      for (int64_t m0 = 0; m0 < M;) {
        const int64_t left = M - m0;
        if (left >= 4) {
          group_rows<4>(a, w, g, m0, n0, n1, out);
          m0 += 4;
        } else if (left == 3) {
          group_rows<3>(a, w, g, m0, n0, n1, out);
          m0 += 3;
        } else if (left == 2) {
          group_rows<2>(a, w, g, m0, n0, n1, out);
          m0 += 2;
        } else {
          group_rows<1>(a, w, g, m0, n0, n1, out);
          m0 += 1;
        }
      }
    }
  }
};

// Runs the kernel of bit width `bits` (already validated).
template <class V>
void run_fused_simd(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  switch (bits) {
    case 2: return FusedSimd<V, 2>::run(a, M, w, n0, n1, out);
    case 3: return FusedSimd<V, 3>::run(a, M, w, n0, n1, out);
    case 4: return FusedSimd<V, 4>::run(a, M, w, n0, n1, out);
    case 8: return FusedSimd<V, 8>::run(a, M, w, n0, n1, out);
  }
}

}  // namespace cpu
}  // namespace lowbit
