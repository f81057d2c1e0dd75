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

#include <algorithm>

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

// The scales of the 16 sub-blocks of 16 values of x (256 values), each
// quantized to levels l in [-32, 31] that minimise sum x^2 (x - scale l)^2
// over 19 trial reciprocals around -32 / max (max: the sub-block's value of
// largest magnitude); L[16 s + i] = l + 32. llama.cpp's make_qx_quants
// (nmax 32, rmse_type 1, no importance weights) for each sub-block: its
// sums run in the same order, one lane per sub-block, so that the compiler
// can vectorise across sub-blocks without reordering a sum.
inline void search_sub_block_scales(const float* x, int8_t* L, float* scales) {
  constexpr int kN = 16, kLanes = 16, kMax = 32;
  float xt[kN][kLanes];  // xt[i][s]: value i of sub-block s
  for (int s = 0; s < kLanes; ++s)
    for (int i = 0; i < kN; ++i) xt[i][s] = x[kN * s + i];
  float max[kLanes] = {}, amax[kLanes] = {};
  for (int i = 0; i < kN; ++i)
    for (int s = 0; s < kLanes; ++s) {
      const float ax = fabsf(xt[i][s]);
      max[s] = ax > amax[s] ? xt[i][s] : max[s];
      amax[s] = ax > amax[s] ? ax : amax[s];
    }
  // sum w x l and sum w l^2 (w = x^2) per lane for the levels of reciprocals iscale.
  const auto sums = [&](const float* iscale, float* sumlx, float* suml2) {
    for (int s = 0; s < kLanes; ++s) sumlx[s] = suml2[s] = 0.0f;
    for (int i = 0; i < kN; ++i)
      for (int s = 0; s < kLanes; ++s) {
        const float l = static_cast<float>(std::clamp(nearest_int_magic(iscale[s] * xt[i][s]), -kMax, kMax - 1));
        const float w = xt[i][s] * xt[i][s];
        sumlx[s] += w * xt[i][s] * l;
        suml2[s] += w * l * l;
      }
  };
  float iscale[kLanes], best_iscale[kLanes], sumlx[kLanes], suml2[kLanes], best[kLanes];
  for (int s = 0; s < kLanes; ++s) best_iscale[s] = iscale[s] = static_cast<float>(-kMax) / max[s];
  sums(iscale, sumlx, suml2);
  for (int s = 0; s < kLanes; ++s) {
    scales[s] = suml2[s] != 0.0f ? sumlx[s] / suml2[s] : 0.0f;
    best[s] = scales[s] * sumlx[s];
  }
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    for (int s = 0; s < kLanes; ++s) iscale[s] = -(static_cast<float>(kMax) + 0.1f * static_cast<float>(is)) / max[s];
    sums(iscale, sumlx, suml2);
    for (int s = 0; s < kLanes; ++s) {
      if (suml2[s] > 0.0f && sumlx[s] * sumlx[s] > best[s] * suml2[s]) {
        best_iscale[s] = iscale[s];
        scales[s] = sumlx[s] / suml2[s];
        best[s] = scales[s] * sumlx[s];
      }
    }
  }
  // The levels of each lane's best reciprocal; an all-zero sub-block (llama.cpp's
  // GROUP_MAX_EPS) has scale 0 and levels 0.
  for (int s = 0; s < kLanes; ++s) {
    const bool zero = amax[s] < 1e-15f;
    if (zero) scales[s] = 0.0f;
    for (int i = 0; i < kN; ++i)
      L[kN * s + i] = zero ? 0
                           : static_cast<int8_t>(kMax + std::clamp(nearest_int_magic(best_iscale[s] * xt[i][s]),
                                                                   -kMax, kMax - 1));
  }
}

// One Q6_K block (210 bytes: ql[128], qh[64], int8 scales[16], fp16 d) of
// the 256 values x: each 16-value sub-block's scale from search_sub_block_scales,
// the scales quantized to int8 against d = max_scale / -128, the values
// re-rounded to 6 bits against d * scale. Returns d as stored (fp32), for
// the caller's range check (inf or NaN: x beyond fp16's range for d, or
// beyond the search's).
inline float quantize_q6_k_block(const float* x, uint8_t* out) {
  constexpr int kSub = 16, kSubs = 16;
  int8_t L[256];
  float scales[kSubs];
  search_sub_block_scales(x, L, scales);
  float max_scale = 0.0f, max_abs_scale = 0.0f;
  for (int s = 0; s < kSubs; ++s) {
    // |x| past ~1.8e19 overflows the search's weights x^2: its scale is
    // NaN, which no comparison would pick, so the block is refused here.
    if (scales[s] != scales[s]) return scales[s];
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
    if (d == 0.0f) continue;  // the sub-block keeps the search's levels
    for (int i = 0; i < kSub; ++i)
      L[kSub * s + i] = static_cast<int8_t>(32 + std::clamp(nearest_int_magic(x[kSub * s + i] / d), -32, 31));
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
