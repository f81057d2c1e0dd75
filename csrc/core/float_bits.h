// Bit-level conversions between fp32 and the small float formats found in
// GGUF blocks (fp16, bf16, E8M0), written out so that host and device code
// decode every value identically, and the separately rounded multiply/add
// that keeps nvcc from contracting a*b+c into an fma (which would differ
// from the CPU in the last bit).
#pragma once

#include <stdint.h>
#include <string.h>

#include <math.h>

#include "host_device.h"

namespace lowbit {

LOWBIT_HD float bits_to_float(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

LOWBIT_HD uint32_t float_to_bits(float f) {
  uint32_t bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// IEEE binary16 -> fp32 (exact: every half is a float).
LOWBIT_HD float fp16_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

// fp32 -> IEEE binary16, round to nearest even (as F16C / numpy do).
LOWBIT_HD uint16_t fp32_to_fp16(float f) {
  const uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u);  // inf / nan
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {
    // below the smallest normal half: count units of 2^-24, rounding to even
    const float units = bits_to_float(ax) * 16777216.0f;  // exact scaling
    return sign | static_cast<uint16_t>(nearbyintf(units));
  }
  const uint32_t rounded = ax + 0xfffu + ((ax >> 13) & 1u);
  return sign | static_cast<uint16_t>((rounded - 0x38000000u) >> 13);
}

// bfloat16 -> fp32 (exact).
LOWBIT_HD float bf16_to_fp32(uint16_t b) { return bits_to_float(static_cast<uint32_t>(b) << 16); }

// E8M0 scale of MXFP4, halved (2^(e-128)), as ggml applies it to the doubled
// E2M1 values; e < 2 gives fp32 subnormals.
LOWBIT_HD float e8m0_to_fp32_half(uint8_t e) {
  return bits_to_float(e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23));
}

// UE4M3 sub-block scale of NVFP4 (unsigned, 4 exponent bits biased by 7, 3
// mantissa bits; bit 7 unused), halved like MXFP4's: ggml's
// ggml_ue4m3_to_fp32. 0x7F, E4M3's NaN, reads as zero there, and so here.
// Both forms are exact products of the mantissa and a power of two:
// m * 2^-10 for exponent 0, (8 + m) * 2^(e - 11) otherwise.
LOWBIT_HD float ue4m3_to_fp32_half(uint8_t x) {
  if (x == 0x7f) return 0.0f;
  const uint32_t e = (x >> 3) & 0xfu, m = x & 7u;
  return e == 0 ? static_cast<float>(m) * bits_to_float((127u - 10u) << 23)
                : static_cast<float>(8u + m) * bits_to_float((e + 127u - 11u) << 23);
}

// a * b and a * b + c with every operation rounded separately.
LOWBIT_HD float mul_rn(float a, float b) {
#if LOWBIT_DEVICE_PATH
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

LOWBIT_HD float add_rn(float a, float b) {
#if LOWBIT_DEVICE_PATH
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// Little-endian loads from unaligned block bytes.
LOWBIT_HD uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
LOWBIT_HD uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

// The same from 2-byte (load_h2) or 4-byte (load_w4) aligned bytes: one load
// on the GPU, where the unaligned forms cost a byte load each (the CPU's
// compilers make one load of either).
LOWBIT_HD uint16_t load_h2(const uint8_t* p) {
#if LOWBIT_DEVICE_PATH
  return *reinterpret_cast<const uint16_t*>(p);
#else
  return load_u16(p);
#endif
}
LOWBIT_HD uint32_t load_w4(const uint8_t* p) {
#if LOWBIT_DEVICE_PATH
  return *reinterpret_cast<const uint32_t*>(p);
#else
  return load_u32(p);
#endif
}

}  // namespace lowbit
