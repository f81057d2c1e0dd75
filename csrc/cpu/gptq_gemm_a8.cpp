// CPU gptq_gemm_a8: gptq_gemm with int8 activations.
//
// Each activation row is quantized per weight group, as llama.cpp quantizes
// activations per block for its integer dot products: q = round(a * 127 /
// amax) in [-127, 127], d = amax / 127. A group's dot product is then exact
// in int32, and the fp32 kernel's shift, lookup and FMA per weight become one
// vpdpbusd per 4 weights (gptq_a8_simd.h; vpmaddubsw and vpmaddwd on AVX2),
// which leaves a matvec bound by memory. The rounding of the activations is
// the only difference from gptq_gemm; the portable kernel and the SIMD ones
// give the same bits.
#include <ATen/ATen.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/gptq_format.h"
#include "../ops/backend_ops.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "gptq_kernels.h"
#include "gptq_prepare.h"
#include "isa.h"
#include "parallel.h"
#include "static_for.h"

namespace lowbit {
namespace cpu {
namespace {

// v rounded to the nearest integer, ties to even (nearbyint's result in the
// default rounding mode), for |v| <= 2^22: adding 1.5 * 2^23 leaves no
// fraction bits, so the sum rounds v and the subtraction is exact: two adds
// where nearbyintf is a library call per element.
inline float round_even(float v) {
  constexpr float kMagic = 12582912.0f;
  return (v + kMagic) - kMagic;
}

// Rows [m0, m1) of a [M, K] quantized into x (GptqActs8's layout for B).
// A group holding a NaN or an infinity gets the scale NaN (and q = 0), so
// that every output it meets is NaN, as the float product would be. A group
// whose amax is below 2^-64 is scaled by 2^64 first (exact), so that 127 /
// amax cannot overflow: q is what unbounded fp32 exponents would give.
// Every call quantizes its activations, so the loops are written for the
// compiler's vectorizer: amax as the integer maximum of |a|'s bits (the
// order of non-negative floats; Inf and NaN lie above every finite value),
// q in row order into `run`, then moved into a8_byte order.
template <int B>
void quantize_rows(const float* a, const GptqWeight& w, int64_t m0, int64_t m1, int8_t* q, float* scale,
                   int32_t* sum) {
  constexpr uint32_t kInfBits = 0x7f800000u;
  const int64_t gs = w.group_of.group_size, groups = w.group_of.count;
  std::vector<int8_t> run(static_cast<size_t>(w.K));
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t k0 = g * gs, n = std::min(w.K, k0 + gs) - k0;
      const float* x = a + m * w.K + k0;
      uint32_t amax_bits = 0;
      for (int64_t i = 0; i < n; ++i) amax_bits = std::max(amax_bits, std::bit_cast<uint32_t>(x[i]) & 0x7fffffffu);
      const bool finite = amax_bits < kInfBits;
      const float amax = std::bit_cast<float>(amax_bits);
      const float pre = amax < 0x1p-64f ? 0x1p64f : 1.0f;
      const float inv = amax > 0.0f ? 127.0f / (amax * pre) : 0.0f;
      int8_t* r = run.data() + k0;
      int32_t total = 0;
      if (finite) {
        // |x * pre * inv| <= 127 (rounded): an exact int32 after rounding.
        for (int64_t i = 0; i < n; ++i) {
          const int32_t v = static_cast<int32_t>(round_even(x[i] * pre * inv));
          r[i] = static_cast<int8_t>(v);
          total += v;
        }
      } else {
        std::fill(r, r + n, 0);
      }
      scale[m * groups + g] = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      sum[m * groups + g] = total;
    }
    // K holds whole packs, and a8_byte(k0 + f) = k0 + a8_byte(f) for k0 a
    // multiple of the pack: each byte moves by a compile-time offset.
    constexpr int64_t F = B == 3 ? 1 : 32 / B;
    int8_t* qrow = q + m * w.K;
    for (int64_t k0 = 0; k0 < w.K; k0 += F) {
      static_for<F>([&](auto f) { qrow[k0 + a8_byte<B>(f)] = run[k0 + f]; });
    }
  }
}

// out[:, n0:n1] of every bit width: per group and activation row, each weight
// row's fields are added into int32 column sums times that row's activation
// (a loop over columns the compiler vectorises), then scaled as the SIMD
// kernels scale them.
template <int B>
void a8_portable(const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  const int64_t gs = w.group_of.group_size, width = n1 - n0;
  std::vector<int32_t> z(width), dot(width);
  std::vector<float> s(width);
  for (int64_t m = 0; m < M; ++m) std::fill(out + m * w.N + n0, out + m * w.N + n1, 0.0f);
  for (int64_t g = 0; g < x.groups; ++g) {
    read_group<B>(w, g, n0, n1, z.data(), s.data());
    const int64_t k0 = g * gs, k1 = std::min(w.K, k0 + gs);
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* q = x.q + m * w.K;
      std::fill(dot.begin(), dot.end(), 0);
      for (int64_t k = k0; k < k1; ++k) {
        const int32_t qa = q[a8_byte<B>(k)];
        if (qa == 0) continue;
        const gptq::FieldLoc f = gptq::locate<B>(k);
        for (int64_t n = n0, end; n < n1; n = end) {  // runs of contiguous words
          end = w.run_end(n, n1);
          const uint32_t* lo = w.words(f.lo, n);
          const uint32_t* hi = w.words(f.hi, n);
          int32_t* dn = dot.data() + (n - n0);
          for (int64_t i = 0; i < end - n; ++i) dn[i] += qa * static_cast<int32_t>(gptq::extract(lo[i], hi[i], f));
        }
      }
      const float d = x.scale[m * x.groups + g];
      const int32_t a_sum = x.sum[m * x.groups + g];
      float* o = out + m * w.N + n0;
      for (int64_t i = 0; i < width; ++i) o[i] = std::fma(s[i] * d, static_cast<float>(dot[i] - z[i] * a_sum), o[i]);
    }
  }
}

}  // namespace

at::Tensor gptq_gemm_a8(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                        const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format, int64_t bit) {
  const auto [d, idx] =
      check_gemm_args(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, false, bit, "gptq_gemm_a8", true);
  const PreparedWeight w = prepare(b_q_weight, b_gptq_qzeros, b_gptq_scales, idx, d, use_v2_format, bit);
  check_a8_groups(w.view.group_of.g_idx ? 0 : w.view.group_of.group_size);
  const at::Tensor a2 = a.reshape({-1, d.K}).to(at::kFloat).contiguous();
  const int64_t M = a2.size(0);
  at::Tensor out = at::empty({M, d.N}, a2.options());
  if (M > 0) {
    at::Tensor q = at::empty({M, d.K}, a2.options().dtype(at::kChar));
    at::Tensor scale = at::empty({M, d.groups}, a2.options());
    at::Tensor sum = at::empty({M, d.groups}, a2.options().dtype(at::kInt));
    const GptqActs8 x{q.data_ptr<int8_t>(), scale.data_ptr<float>(), sum.data_ptr<int32_t>(), d.groups};
    dispatch_bits(bit, [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      parallel_for(M, 1, [&](int64_t m0, int64_t m1) {
        quantize_rows<B>(a2.data_ptr<float>(), w.view, m0, m1, q.data_ptr<int8_t>(), scale.data_ptr<float>(),
                         sum.data_ptr<int32_t>());
      });
      const Isa isa = B != 3 && simd_fused_supports<B>(w.view) ? active_isa() : Isa::kPortable;
      float* o = out.data_ptr<float>();
      for_isa_column_tasks(
          d.N, isa, 64,
          [&](int64_t n0, int64_t n1) {
#if LOWBIT_X86_AVX512
            if (isa == Isa::kAvx512) gptq_a8_avx512(B, x, M, w.view, n0, n1, o);
#endif
#if LOWBIT_X86_SIMD
            if (isa == Isa::kAvx2) gptq_a8_avx2(B, x, M, w.view, n0, n1, o);
#endif
          },
          [&](int64_t n0, int64_t n1) { a8_portable<B>(x, M, w.view, n0, n1, o); });
    });
  }
  return as_output(out, a, d.N);
}

}  // namespace cpu
}  // namespace lowbit
