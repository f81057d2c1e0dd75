// GPTQ weight tiles decoded with SIMD, for gptq_gemm's large-M path (tiles
// handed to a GEMM) and gptq_dequantize: W[k, n] = s[g, n] * (q[k, n] - z[g, n])
// computed exactly as gptq::dequant does (integer subtraction, one fp32
// multiply), so every ISA gives the reference's bits. Written once over a
// vector vocabulary V (VecAvx2, VecAvx512); include only inside an ISA unit's
// target pragma region, after every non-SIMD header.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_fields_simd.h"
#include "gptq_group_simd.h"
#include "gptq_kernels.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma (see gptq_fused_simd.h).
namespace {

template <class V, int B>
struct DequantSimd {
  using F = typename V::F;
  using I = typename V::I;
  using P = gptq::Pack<B>;
  static constexpr int L = V::kLanes;

  // The rows of one pack (its words, one vector of columns), each handed to
  // sink(row + field, col, W values).
  template <int... FI, class Sink>
  static inline void pack(std::integer_sequence<int, FI...>, const I (&words)[P::kWords], I zero, F scale,
                          int64_t row, int64_t col, Sink& sink) {
    const auto word = [&](int64_t i) { return words[i]; };
    (sink(row + FI, col, V::mul(scale, V::cvt(V::sub(pack_field<V, B, FI, true>(word), zero)))), ...);
  }

  // W[k, n] for k in [k0, k1) and n in [n0, n1) through sink(k - k0, n - n0,
  // vector of L columns). k0 and k1 hold whole packs, n1 - n0 is a multiple
  // of L (and n0 of 8), and w's groups are contiguous (simd_fused_supports).
  template <class Sink>
  static void run(const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1, Sink&& sink) {
    const int64_t gs = w.group_of.group_size;
    std::vector<int32_t> z(n1 - n0);
    std::vector<float> s(n1 - n0);
    for (int64_t g = k0 / gs; g * gs < k1; ++g) {
      read_group_simd<B>(w, g, n0, n1, z.data(), s.data());
      const int64_t g0 = std::max(k0, g * gs), g1 = std::min(k1, (g + 1) * gs);
      // Pack by pack, each along its rows: the output rows fill in order.
      // Walking down a column instead (rows a power-of-two stride apart) hit
      // the same few L1 sets and measured 2x slower.
      for (int64_t k = g0; k < g1; k += P::kFields) {
        const int64_t row = k / P::kFields * P::kWords;
        for (int64_t n = n0; n < n1; n += L) {
          const uint32_t* q = w.words(row, n);
          I words[P::kWords];
          for (int i = 0; i < P::kWords; ++i) words[i] = V::load_i(q + i * w.row_stride());
          pack(std::make_integer_sequence<int, P::kFields>{}, words, V::load_i(z.data() + (n - n0)),
               V::load(s.data() + (n - n0)), k - k0, n - n0, sink);
        }
      }
    }
  }
};

// DequantSimd<V, bits> (bits already validated).
template <class V, class Sink>
void run_dequant_simd(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1, Sink&& sink) {
  switch (bits) {
    case 2: return DequantSimd<V, 2>::run(w, k0, k1, n0, n1, sink);
    case 3: return DequantSimd<V, 3>::run(w, k0, k1, n0, n1, sink);
    case 4: return DequantSimd<V, 4>::run(w, k0, k1, n0, n1, sink);
    case 8: return DequantSimd<V, 8>::run(w, k0, k1, n0, n1, sink);
  }
}

// run_dequant_simd into out, whose elements are of out_type, rows ldo apart.
template <class V>
void dequant_simd_to(int bits, const GptqWeight& w, int64_t k0, int64_t k1, int64_t n0, int64_t n1,
                     ScaleType out_type, void* out, int64_t ldo) {
  using F = typename V::F;
  switch (out_type) {
    case ScaleType::kF32: {
      float* o = static_cast<float*>(out);
      return run_dequant_simd<V>(bits, w, k0, k1, n0, n1, [&](int64_t r, int64_t c, F v) { V::store(o + r * ldo + c, v); });
    }
    case ScaleType::kF16: {
      uint16_t* o = static_cast<uint16_t*>(out);
      return run_dequant_simd<V>(bits, w, k0, k1, n0, n1,
                                 [&](int64_t r, int64_t c, F v) { V::store_f16(o + r * ldo + c, v); });
    }
    case ScaleType::kBF16: {
      uint16_t* o = static_cast<uint16_t*>(out);
      return run_dequant_simd<V>(bits, w, k0, k1, n0, n1,
                                 [&](int64_t r, int64_t c, F v) { V::store_bf16(o + r * ldo + c, v); });
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
