// Weight blocks written as llama.cpp's reference quantizer writes them
// (quantize_row_q6_K_ref), so that a table lowbit quantizes holds the bytes
// llama.cpp would put in its file. Host code only; every operation is a
// separately rounded fp32 operation in llama.cpp's order (no fused
// multiply-add: the x86-64 baseline has none to contract into), which is
// what makes the search below choose as llama.cpp chooses.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "float_bits.h"

namespace lowbit {
namespace ggml {

// llama.cpp's nearest_int: the integer nearest v (ties to even) for
// |v| < 2^22, by adding 1.5 * 2^23 and reading the mantissa. Beyond that
// range it returns what those bits give, as llama.cpp does, and the caller
// clamps it.
inline int nearest_int_magic(float v) {
  const uint32_t bits = float_to_bits(v + 12582912.0f);
  return static_cast<int>(bits & 0x007fffffu) - 0x00400000;
}

inline int clamp_int(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// The scale of n values x quantized to levels l in [-nmax, nmax - 1] that
// minimise sum x^2 (x - scale l)^2 over 19 trial reciprocals around
// -nmax / max (max: the value of largest magnitude); L[i] = l + nmax.
// llama.cpp's make_qx_quants with rmse_type 1 and no importance weights.
inline float search_levels(int n, int nmax, const float* x, int8_t* L) {
  float max = 0.0f, amax = 0.0f;
  for (int i = 0; i < n; ++i) {
    const float ax = fabsf(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < 1e-15f) {  // all zero
    memset(L, 0, static_cast<size_t>(n));
    return 0.0f;
  }
  // sum w x l and sum w l^2 (w = x^2) for the levels of reciprocal iscale.
  const auto sums = [&](float iscale, float& sumlx, float& suml2) {
    sumlx = suml2 = 0.0f;
    for (int i = 0; i < n; ++i) {
      const int l = clamp_int(nearest_int_magic(iscale * x[i]), -nmax, nmax - 1);
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
  };
  const auto levels = [&](float iscale) {
    for (int i = 0; i < n; ++i)
      L[i] = static_cast<int8_t>(nmax + clamp_int(nearest_int_magic(iscale * x[i]), -nmax, nmax - 1));
  };
  float sumlx, suml2;
  float iscale = static_cast<float>(-nmax) / max;
  sums(iscale, sumlx, suml2);
  levels(iscale);
  float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sums(iscale, sumlx, suml2);
    if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
      levels(iscale);
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

// One Q6_K block (210 bytes: ql[128], qh[64], int8 scales[16], fp16 d) of
// the 256 values x: each 16-value sub-block's scale from search_levels,
// the scales quantized to int8 against d = max_scale / -128, the values
// re-rounded to 6 bits against d * scale. Returns d as stored (fp32), for
// the caller's range check (inf: x beyond fp16's range for d).
inline float quantize_q6_k_block(const float* x, uint8_t* out) {
  constexpr int kSub = 16, kSubs = 16;
  int8_t L[256];
  float scales[kSubs];
  float max_scale = 0.0f, max_abs_scale = 0.0f;
  for (int s = 0; s < kSubs; ++s) {
    scales[s] = search_levels(kSub, 32, x + kSub * s, L + kSub * s);
    if (fabsf(scales[s]) > max_abs_scale) {
      max_abs_scale = fabsf(scales[s]);
      max_scale = scales[s];
    }
  }
  memset(out, 0, 210);
  if (max_abs_scale < 1e-15f) return 0.0f;  // d = 0: every value decodes to 0
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  int8_t* sc = reinterpret_cast<int8_t*>(out + 192);
  const float iscale = -128.0f / max_scale;
  const uint16_t d_bits = fp32_to_fp16(1.0f / iscale);
  out[208] = static_cast<uint8_t>(d_bits & 0xff);
  out[209] = static_cast<uint8_t>(d_bits >> 8);
  const float d_block = fp16_to_fp32(d_bits);
  for (int s = 0; s < kSubs; ++s) {
    const int q = nearest_int_magic(iscale * scales[s]);
    sc[s] = static_cast<int8_t>(q < 127 ? q : 127);
  }
  for (int s = 0; s < kSubs; ++s) {
    const float d = d_block * static_cast<float>(sc[s]);
    if (d == 0.0f) continue;  // the sub-block keeps search_levels' levels
    for (int i = 0; i < kSub; ++i)
      L[kSub * s + i] = static_cast<int8_t>(32 + clamp_int(nearest_int_magic(x[kSub * s + i] / d), -32, 31));
  }
  // Value j + l + 32 t (t < 4) of each half j of 128: low nibbles in ql[64 j / 2 ...],
  // two high bits at 2 t of qh[32 j / 128 + l].
  for (int j = 0; j < 256; j += 128) {
    for (int l = 0; l < 32; ++l) {
      const uint8_t* v = reinterpret_cast<const uint8_t*>(L) + j + l;
      ql[j / 2 + l] = static_cast<uint8_t>((v[0] & 0xF) | ((v[64] & 0xF) << 4));
      ql[j / 2 + l + 32] = static_cast<uint8_t>((v[32] & 0xF) | ((v[96] & 0xF) << 4));
      qh[j / 4 + l] = static_cast<uint8_t>((v[0] >> 4) | ((v[32] >> 4) << 2) | ((v[64] >> 4) << 4) | ((v[96] >> 4) << 6));
    }
  }
  return d_block;
}

}  // namespace ggml
}  // namespace lowbit
