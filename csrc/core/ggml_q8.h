// 8-bit activation blocks for the GGUF integer dot products, quantized the
// way llama.cpp's CPU backend does (quantize_row_q8_0/q8_1/q8_K_ref), and the
// dot product of one decoded weight block with them.
#pragma once

#include <math.h>
#include <stdint.h>

#include "float_bits.h"
#include "ggml_blocks.h"
#include "ggml_types.h"
#include "host_device.h"

namespace lowbit {
namespace ggml {

// Elements per activation scale, and per stored activation sum.
template <Act A>
struct ActLayout;
template <>
struct ActLayout<Act::Q8_0> {
  static constexpr int kBlock = 32;
  static constexpr int kSumBlock = 32;
};
template <>
struct ActLayout<Act::Q8_1> {
  static constexpr int kBlock = 32;
  static constexpr int kSumBlock = 32;
};
template <>
struct ActLayout<Act::Q8_K> {
  static constexpr int kBlock = 256;
  static constexpr int kSumBlock = 16;
};

// One row of quantized activations: q[n], d[n / kBlock] and sum[n / kSumBlock].
// sum is, per kSumBlock elements, d * sum(q) as llama.cpp keeps it: Q8_1's
// fp16 `s`, or Q8_K's integer bsums (scaled by d when used). offset[n / 4],
// where a backend's kernels ask for it, is -128 * (the sum of each 4
// consecutive q): the integer dot of levels + 128 (as unsigned bytes) with q
// that starts from it comes to the dot of the levels themselves. isum, where
// a backend's kernels ask for it, is sum(q) per kSumBlock as int16 (exact:
// at most 32 * 127): Q8_K's as llama.cpp's own bsums, the form integer dot
// products take them in, and Q8_0's / Q8_1's undivided by d.
struct ActRow {
  const int8_t* q;
  const float* d;
  const float* sum;
  const int32_t* offset = nullptr;
  const int16_t* isum = nullptr;
};

// A block holding NaN or Inf has no 8-bit form: its levels become 0 and its
// scale NaN, so every dot product that reads it is NaN, as the float matmul
// is non-finite there. Q8_K's sums stay integers (0); Q8_0's / Q8_1's
// (which include d) become NaN too.
template <Act A>
LOWBIT_HD void non_finite_act_block(int8_t* q, float* d, float* sum) {
  constexpr int kSums = ActLayout<A>::kBlock / ActLayout<A>::kSumBlock;
  for (int j = 0; j < ActLayout<A>::kBlock; ++j) q[j] = 0;
  d[0] = NAN;
  for (int j = 0; j < kSums; ++j) sum[j] = A == Act::Q8_K ? 0.0f : NAN;
}

// The level of x in a Q8_K block whose value of largest magnitude is max:
// nearest (ties to even) of iscale * x, iscale = -127 / max, clamped to 127.
LOWBIT_HD int8_t q8k_level(float x, float iscale) {
  const int v = static_cast<int>(nearbyintf(iscale * x));
  return static_cast<int8_t>(v < 127 ? v : 127);
}

// A Q8_0 / Q8_1 block's step d = amax / 127 and the level of x in it:
// round(x / d) (half away from zero, C's roundf), computed as x * (1 / d).
LOWBIT_HD float q8_step(float amax) { return amax / 127.0f; }
LOWBIT_HD float q8_inverse(float step) { return step != 0.0f ? 1.0f / step : 0.0f; }
LOWBIT_HD int8_t q8_level(float x, float inverse) { return static_cast<int8_t>(roundf(x * inverse)); }
// What a Q8_0 / Q8_1 block stores: d and d * sum(q) (Q8_1's s) as fp16.
LOWBIT_HD float q8_stored_step(float step) { return fp16_to_fp32(fp32_to_fp16(step)); }
LOWBIT_HD float q8_stored_sum(int s, float step) { return fp16_to_fp32(fp32_to_fp16(static_cast<float>(s) * step)); }

// Q8_0 / Q8_1: d = amax / 127 stored as fp16, q = round(x / d) (half away
// from zero), computed with the unrounded d as llama.cpp does. Q8_K: fp32 d
// from the signed value of largest magnitude (the first of equals), the
// levels of q8k_level, integer sums per 16. A backend may quantize a block
// with other threads (the CUDA one: a warp per block) through the same
// helpers, to the same bits.
template <Act A>
LOWBIT_HD void quantize_act_block(const float* x, int8_t* q, float* d, float* sum) {
  bool finite = true;
  for (int j = 0; j < ActLayout<A>::kBlock; ++j) finite &= isfinite(x[j]);
  if (!finite) return non_finite_act_block<A>(q, d, sum);
  if constexpr (A == Act::Q8_K) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 256; ++j) {
      const float ax = fabsf(x[j]);
      if (ax > amax) {
        amax = ax;
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      d[0] = 0.0f;
      for (int j = 0; j < 256; ++j) q[j] = 0;
      for (int j = 0; j < 16; ++j) sum[j] = 0.0f;
      return;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < 256; ++j) q[j] = q8k_level(x[j], iscale);
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int i = 0; i < 16; ++i) s += q[16 * j + i];
      sum[j] = static_cast<float>(s);  // bsums: integer, scaled by d at use
    }
    d[0] = 1.0f / iscale;
  } else {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = fmaxf(amax, fabsf(x[j]));
    const float dd = q8_step(amax);
    const float id = q8_inverse(dd);
    int s = 0;
    for (int j = 0; j < 32; ++j) {
      q[j] = q8_level(x[j], id);
      s += q[j];
    }
    d[0] = q8_stored_step(dd);
    sum[0] = q8_stored_sum(s, dd);
  }
}

// sum(q_w[i] * q_x[i]) over n int8 pairs, as a plain loop. The sum is exact,
// so a backend may pass block_dot its own packed-instruction version (the
// CUDA backend uses __dp4a, n being a multiple of 4) without changing results.
struct ScalarIntDot {
  LOWBIT_HD int32_t operator()(const int8_t* w, const int8_t* x, int n) const {
    int32_t isum = 0;
    for (int i = 0; i < n; ++i) isum += static_cast<int32_t>(w[i]) * x[i];
    return isum;
  }
};

// One sub-block's terms of a dot product, added to acc: d_w * d_x * isum
// (isum the sub-block's integer sum of level products) and, for types with
// mins, m_w * (d_x * sum(q_x)). `first` is the sub-block's first element in
// the row. block_dot and slice_dot (core/ggml_slices.h) both add through it.
template <Type T>
LOWBIT_HD void add_sub_block(float& acc, float d, float m, int32_t isum, const ActRow& a, int64_t first) {
  using I = TypeInfo<T>;
  using L = ActLayout<I::kAct>;
  const float dx = a.d[first / L::kBlock];
  acc += d * dx * static_cast<float>(isum);
  if constexpr (I::kHasMin) {
    float xsum = 0.0f;
    for (int k = 0; k < I::kSub / L::kSumBlock; ++k) xsum += a.sum[first / L::kSumBlock + k];
    // Q8_K keeps integer sums; Q8_1's s already includes d.
    acc += m * (I::kAct == Act::Q8_K ? dx * xsum : xsum);
  }
}

// sum(w[i] * x[i]) over one weight block (block index `bi` of the row) with
// integer products per sub-block.
template <Type T, typename IntDot = ScalarIntDot>
LOWBIT_HD float block_dot(const Decoded<T>& w, const ActRow& a, int64_t bi, IntDot int_dot = IntDot{}) {
  using I = TypeInfo<T>;
  const int64_t base = bi * I::kBlock;
  float acc = 0.0f;
  for (int s = 0; s < I::kBlock / I::kSub; ++s) {
    const int32_t isum = int_dot(w.q + s * I::kSub, a.q + base + s * I::kSub, I::kSub);
    add_sub_block<T>(acc, w.d[s], I::kHasMin ? w.m[s] : 0.0f, isum, a, base + s * I::kSub);
  }
  return acc;
}

}  // namespace ggml
}  // namespace lowbit
