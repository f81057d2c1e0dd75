// Block decoding for every GGUF weight type, shared by all backends.
//
// Every quantized block decodes to one form:
//     w[i] = d[i / kSub] * q[i]            (+ m[i / kSub] for kHasMin types)
// with q an int8 level and d, m fp32 per sub-block. Dequantization evaluates
// exactly that (each operation rounded once, in ggml's order), and the 8-bit
// dot products use the same q, d, m with quantized activations, so both paths
// read a format through one definition. The types with SIMD CPU kernels also
// expose scales() alone: the SIMD code cuts the levels out in vector
// registers (cpu/ggml_levels_simd.h, tested equal to decode()) and takes the
// sub-block scales from here. Byte layouts follow ggml's
// ggml-common.h; element order follows ggml-quants.c's dequantize_row_*.
#pragma once

#include <stdint.h>

#include "float_bits.h"
#include "ggml_tables.h"
#include "ggml_types.h"
#include "host_device.h"

namespace lowbit {
namespace ggml {

// One block decoded into levels and sub-block scales (and mins).
template <Type T>
struct Decoded {
  int8_t q[TypeInfo<T>::kBlock];
  float d[TypeInfo<T>::kBlock / TypeInfo<T>::kSub];
  float m[TypeInfo<T>::kHasMin ? TypeInfo<T>::kBlock / TypeInfo<T>::kSub : 1];
};

template <Type T>
struct Codec;

// ---- float types: one element per "block" --------------------------------

template <>
struct Codec<Type::F32> {
  LOWBIT_HD static float value(const uint8_t* b) { return bits_to_float(load_u32(b)); }
};
template <>
struct Codec<Type::F16> {
  LOWBIT_HD static float value(const uint8_t* b) { return fp16_to_fp32(load_u16(b)); }
};
template <>
struct Codec<Type::BF16> {
  LOWBIT_HD static float value(const uint8_t* b) { return bf16_to_fp32(load_u16(b)); }
};

// ---- helpers shared by several layouts -------------------------------------

LOWBIT_HD float half_at(const uint8_t* b, int offset) { return fp16_to_fp32(load_u16(b + offset)); }

// ggml's iq2/iq3 sign bytes: 7 stored bits plus an 8th that makes the number
// of set bits even (ggml tabulates this as ksigns_iq2xs).
LOWBIT_HD uint32_t even_parity_signs(uint32_t seven_bits) {
  uint32_t parity = seven_bits;
  parity ^= parity >> 4;
  parity ^= parity >> 2;
  parity ^= parity >> 1;
  return seven_bits | ((parity & 1u) << 7);
}

LOWBIT_HD int8_t signed_level(uint32_t magnitude, uint32_t signs, int bit) {
  return static_cast<int8_t>((signs >> bit) & 1u ? -static_cast<int>(magnitude) : static_cast<int>(magnitude));
}

// Byte j of a grid entry stored as a little-endian 32/64-bit word.
LOWBIT_HD uint32_t grid_byte(uint64_t entry, int j) { return static_cast<uint32_t>((entry >> (8 * j)) & 0xffu); }

// Two nibbles per byte, byte j holding element j (low) and j + 16 (high): the
// legacy 32-element layouts (Q4_0, Q4_1, Q5_x, IQ4_NL, MXFP4) and IQ4_XS's sub-blocks.
LOWBIT_HD int nibble_of_element(const uint8_t* qs, int e) { return e < 16 ? (qs[e] & 0xf) : (qs[e - 16] >> 4); }

// The eight 6-bit scales and mins of Q4_K / Q5_K (ggml's get_scale_min_k4),
// unpacked from their 12 bytes a word at a time: byte j of scales[h] (mins[h])
// is the scale (min) of sub-block 4h + j. Sub-blocks 0-3 keep the low 6 bits
// of bytes 0-3 (4-7); sub-blocks 4-7 take a nibble of bytes 8-11 and the top
// 2 bits of bytes 0-3 (4-7).
struct K4ScaleMin {
  uint32_t scales[2];
  uint32_t mins[2];
};
LOWBIT_HD K4ScaleMin k4_scale_min(uint32_t a, uint32_t b, uint32_t c) {
  K4ScaleMin r;
  r.scales[0] = a & 0x3f3f3f3fu;
  r.mins[0] = b & 0x3f3f3f3fu;
  r.scales[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
  r.mins[1] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
  return r;
}
LOWBIT_HD K4ScaleMin k4_scale_min(const uint8_t* s) { return k4_scale_min(load_u32(s), load_u32(s + 4), load_u32(s + 8)); }

// ---- legacy 32-element types -----------------------------------------------

template <>
struct Codec<Type::Q4_0> {  // d | qs[16]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q4_0>& o) { o.d[0] = half_at(b, 0); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q4_0>& o) {
    scales(b, o);
    for (int e = 0; e < 32; ++e) o.q[e] = static_cast<int8_t>(nibble_of_element(b + 2, e) - 8);
  }
};

template <>
struct Codec<Type::Q4_1> {  // d | m | qs[16]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q4_1>& o) {
    o.d[0] = half_at(b, 0);
    o.m[0] = half_at(b, 2);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q4_1>& o) {
    scales(b, o);
    for (int e = 0; e < 32; ++e) o.q[e] = static_cast<int8_t>(nibble_of_element(b + 4, e));
  }
};

// Q5: bit e of the 32-bit qh is the fifth bit of element e.
LOWBIT_HD int q5_level(const uint8_t* qs, uint32_t qh, int e) {
  return nibble_of_element(qs, e) | static_cast<int>(((qh >> e) & 1u) << 4);
}

template <>
struct Codec<Type::Q5_0> {  // d | qh[4] | qs[16]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q5_0>& o) { o.d[0] = half_at(b, 0); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q5_0>& o) {
    scales(b, o);
    const uint32_t qh = load_u32(b + 2);
    for (int e = 0; e < 32; ++e) o.q[e] = static_cast<int8_t>(q5_level(b + 6, qh, e) - 16);
  }
};

template <>
struct Codec<Type::Q5_1> {  // d | m | qh[4] | qs[16]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q5_1>& o) {
    o.d[0] = half_at(b, 0);
    o.m[0] = half_at(b, 2);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q5_1>& o) {
    scales(b, o);
    const uint32_t qh = load_u32(b + 4);
    for (int e = 0; e < 32; ++e) o.q[e] = static_cast<int8_t>(q5_level(b + 8, qh, e));
  }
};

template <>
struct Codec<Type::Q8_0> {  // d | int8 qs[32]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q8_0>& o) { o.d[0] = half_at(b, 0); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q8_0>& o) {
    scales(b, o);
    for (int e = 0; e < 32; ++e) o.q[e] = static_cast<int8_t>(b[2 + e]);
  }
};

template <>
struct Codec<Type::IQ4_NL> {  // d | qs[16], levels from the non-linear table
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ4_NL>& o) { o.d[0] = half_at(b, 0); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ4_NL>& o) {
    scales(b, o);
    for (int e = 0; e < 32; ++e) o.q[e] = LOWBIT_TABLE(kvalues_iq4nl)[nibble_of_element(b + 2, e)];
  }
};

template <>
struct Codec<Type::MXFP4> {  // e (E8M0) | qs[16] of E2M1 values (doubled, scale halved)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::MXFP4>& o) { o.d[0] = e8m0_to_fp32_half(b[0]); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::MXFP4>& o) {
    scales(b, o);
    for (int e = 0; e < 32; ++e) o.q[e] = LOWBIT_TABLE(kvalues_fp4)[nibble_of_element(b + 1, e)];
  }
};

template <>
struct Codec<Type::NVFP4> {  // d[4] (UE4M3, one per 16 elements) | qs[32] of E2M1 values (doubled, scales halved)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::NVFP4>& o) {
    for (int s = 0; s < 4; ++s) o.d[s] = ue4m3_to_fp32_half(b[s]);
  }
  // Sub-block s: byte j of qs[8s ..] holds element j (low nibble) and j + 8 (high).
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::NVFP4>& o) {
    scales(b, o);
    for (int e = 0; e < 64; ++e) {
      const uint8_t byte = b[4 + 8 * (e / 16) + e % 8];
      o.q[e] = LOWBIT_TABLE(kvalues_fp4)[e % 16 < 8 ? byte & 0xf : byte >> 4];
    }
  }
};

// ---- one scale per 128 / 64 elements, 1 and 2 bits ------------------------
// Their one fp16 scale is repeated per 32 elements (see ggml_types.h).
template <Type T>
LOWBIT_HD void repeated_scale(const uint8_t* b, Decoded<T>& o) {
  const float d = half_at(b, 0);
  for (float& s : o.d) s = d;
}

template <>
struct Codec<Type::Q1_0> {  // d | qs[16]: bit e set is +d, clear -d
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q1_0>& o) { repeated_scale(b, o); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q1_0>& o) {
    scales(b, o);
    for (int e = 0; e < 128; ++e) o.q[e] = static_cast<int8_t>((b[2 + e / 8] >> (e % 8)) & 1 ? 1 : -1);
  }
};

template <>
struct Codec<Type::Q2_0> {  // d | qs[16]: element e in bits 2 (e % 4) of byte e / 4, level minus 1
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q2_0>& o) { repeated_scale(b, o); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q2_0>& o) {
    scales(b, o);
    for (int e = 0; e < 64; ++e) o.q[e] = static_cast<int8_t>(((b[2 + e / 4] >> (2 * (e % 4))) & 3) - 1);
  }
};

// ---- K-quants (256 elements) -----------------------------------------------

// Q2_K and Q3_K store 2-bit levels in qs[64]: element 128h + 32j + l sits in
// byte 32h + l at bit 2j.
LOWBIT_HD int k2_level(const uint8_t* qs, int e) {
  const int h = e / 128, j = (e % 128) / 32, l = e % 32;
  return (qs[32 * h + l] >> (2 * j)) & 3;
}

template <>
struct Codec<Type::Q2_K> {  // scales[16] | qs[64] | d | dmin
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q2_K>& o) {
    const float d = half_at(b, 80), dmin = half_at(b, 82);
    for (int s = 0; s < 16; ++s) {
      o.d[s] = mul_rn(d, static_cast<float>(b[s] & 0xf));
      o.m[s] = -mul_rn(dmin, static_cast<float>(b[s] >> 4));
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q2_K>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) o.q[e] = static_cast<int8_t>(k2_level(b + 16, e));
  }
};

// The sixteen 6-bit scales of Q3_K, unpacked a word at a time: byte j of
// words[h] is the scale of sub-block 8h + j plus 32. Scale s keeps its low 4
// bits in a nibble of byte s % 8 (low nibble for s < 8) and its top 2 bits at
// bit 2 * (s / 4) of byte 8 + s % 4.
struct Q3KScales {
  uint64_t words[2];
};
// Two bits per byte of the scales' top-bit word: at `shift` for bytes 0-3,
// at shift + 2 for bytes 4-7.
LOWBIT_HD uint64_t q3k_top_bits(uint32_t top, int shift) {
  return static_cast<uint64_t>((top >> shift) & 0x03030303u) |
         (static_cast<uint64_t>((top >> (shift + 2)) & 0x03030303u) << 32);
}
LOWBIT_HD Q3KScales q3k_scales(uint32_t w0, uint32_t w1, uint32_t top) {
  const uint64_t low = w0 | (static_cast<uint64_t>(w1) << 32);
  Q3KScales r;
  r.words[0] = (low & 0x0f0f0f0f0f0f0f0full) | (q3k_top_bits(top, 0) << 4);
  r.words[1] = ((low >> 4) & 0x0f0f0f0f0f0f0f0full) | (q3k_top_bits(top, 4) << 4);
  return r;
}
LOWBIT_HD Q3KScales q3k_scales(const uint8_t* sc) { return q3k_scales(load_u32(sc), load_u32(sc + 4), load_u32(sc + 8)); }

template <>
struct Codec<Type::Q3_K> {  // hmask[32] | qs[64] | scales[12] | d
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q3_K>& o) {
    const Q3KScales k = q3k_scales(b + 96);
    const float d = half_at(b, 108);
    for (int s = 0; s < 16; ++s) {
      const int biased = static_cast<int>((k.words[s / 8] >> (8 * (s % 8))) & 0xffu);
      o.d[s] = mul_rn(d, static_cast<float>(biased - 32));
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q3_K>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) {
      // hmask bit (4h + j) of byte l set means "no -4 offset".
      const int h = e / 128, j = (e % 128) / 32, l = e % 32;
      const bool high_bit = (b[l] >> (4 * h + j)) & 1;
      o.q[e] = static_cast<int8_t>(k2_level(b + 32, e) - (high_bit ? 0 : 4));
    }
  }
};

// Q4_K / Q5_K: 128 bytes of nibbles, byte 32j + l holds element 64j + l (low)
// and 64j + 32 + l (high); eight 32-element sub-blocks with 6-bit scale/min.
LOWBIT_HD int k4_nibble(const uint8_t* qs, int e) {
  const int j = e / 64, r = e % 64;
  return r < 32 ? (qs[32 * j + r] & 0xf) : (qs[32 * j + r - 32] >> 4);
}

template <Type T>
LOWBIT_HD void k4_scales(const uint8_t* b, Decoded<T>& o) {
  const float d = half_at(b, 0), dmin = half_at(b, 2);
  const K4ScaleMin k = k4_scale_min(b + 4);
  for (int s = 0; s < 8; ++s) {
    const uint32_t shift = 8 * (s % 4);
    o.d[s] = mul_rn(d, static_cast<float>((k.scales[s / 4] >> shift) & 0xffu));
    o.m[s] = -mul_rn(dmin, static_cast<float>((k.mins[s / 4] >> shift) & 0xffu));
  }
}

template <>
struct Codec<Type::Q4_K> {  // d | dmin | scales[12] | qs[128]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q4_K>& o) { k4_scales(b, o); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q4_K>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) o.q[e] = static_cast<int8_t>(k4_nibble(b + 16, e));
  }
};

template <>
struct Codec<Type::Q5_K> {  // d | dmin | scales[12] | qh[32] | qs[128]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q5_K>& o) { k4_scales(b, o); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q5_K>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) {
      const bool fifth = (b[16 + e % 32] >> (e / 32)) & 1;  // bit k of qh[l] is element 32k + l
      o.q[e] = static_cast<int8_t>(k4_nibble(b + 48, e) + (fifth ? 16 : 0));
    }
  }
};

template <>
struct Codec<Type::Q6_K> {  // ql[128] | qh[64] | int8 scales[16] | d
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::Q6_K>& o) {
    const float d = half_at(b, 208);
    for (int s = 0; s < 16; ++s) o.d[s] = mul_rn(d, static_cast<float>(static_cast<int8_t>(b[192 + s])));
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::Q6_K>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) {
      // Per 128-element half h: quarter k of element 128h + 32k + l takes the
      // low (k < 2) or high nibble of ql[64h + 32(k % 2) + l] and bits 2k..2k+1 of qh[32h + l].
      const int h = e / 128, k = (e % 128) / 32, l = e % 32;
      const uint8_t ql = b[64 * h + 32 * (k % 2) + l];
      const int low = k < 2 ? (ql & 0xf) : (ql >> 4);
      const int high = (b[128 + 32 * h + l] >> (2 * k)) & 3;
      o.q[e] = static_cast<int8_t>((low | (high << 4)) - 32);
    }
  }
};

// ---- i-quants (256 elements) -------------------------------------------------

// The IQ2/IQ3 scale d * (0.5 + s) * f, in ggml's order of operations.
LOWBIT_HD float iq_half_step_scale(float d, uint32_t s, float f) {
  return mul_rn(mul_rn(d, 0.5f + static_cast<float>(s)), f);
}

template <>
struct Codec<Type::IQ2_XXS> {  // d | 8 x (4 grid bytes, uint32 of 4 x 7 sign bits + 4-bit scale)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ2_XXS>& o) {
    const float d = half_at(b, 0);
    for (int ib = 0; ib < 8; ++ib) o.d[ib] = iq_half_step_scale(d, load_u32(b + 6 + 8 * ib) >> 28, 0.25f);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ2_XXS>& o) {
    scales(b, o);
    for (int ib = 0; ib < 8; ++ib) {
      const uint8_t* grid_idx = b + 2 + 8 * ib;
      const uint32_t meta = load_u32(grid_idx + 4);
      for (int l = 0; l < 4; ++l) {
        const uint64_t entry = LOWBIT_TABLE(iq2xxs_grid)[grid_idx[l]];
        const uint32_t signs = even_parity_signs((meta >> (7 * l)) & 127u);
        for (int j = 0; j < 8; ++j) o.q[32 * ib + 8 * l + j] = signed_level(grid_byte(entry, j), signs, j);
      }
    }
  }
};

template <>
struct Codec<Type::IQ2_XS> {  // d | uint16 qs[32] (9-bit grid index, 7 sign bits) | scales[8]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ2_XS>& o) {
    const float d = half_at(b, 0);
    for (int s = 0; s < 16; ++s) o.d[s] = iq_half_step_scale(d, (b[66 + s / 2] >> (4 * (s % 2))) & 0xf, 0.25f);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ2_XS>& o) {
    scales(b, o);
    for (int g = 0; g < 32; ++g) {
      const uint32_t v = load_u16(b + 2 + 2 * g);
      const uint64_t entry = LOWBIT_TABLE(iq2xs_grid)[v & 511];
      const uint32_t signs = even_parity_signs(v >> 9);
      for (int j = 0; j < 8; ++j) o.q[8 * g + j] = signed_level(grid_byte(entry, j), signs, j);
    }
  }
};

template <>
struct Codec<Type::IQ2_S> {  // d | qs[32] grid low bits | signs[32] | qh[8] | scales[8]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ2_S>& o) {
    const float d = half_at(b, 0);
    for (int s = 0; s < 16; ++s) o.d[s] = iq_half_step_scale(d, (b[74 + s / 2] >> (4 * (s % 2))) & 0xf, 0.25f);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ2_S>& o) {
    scales(b, o);
    for (int g = 0; g < 32; ++g) {
      const int ib = g / 4, l = g % 4;
      const uint32_t index = b[2 + g] | ((static_cast<uint32_t>(b[66 + ib]) << (8 - 2 * l)) & 0x300u);
      const uint64_t entry = LOWBIT_TABLE(iq2s_grid)[index];
      const uint32_t signs = b[34 + g];
      for (int j = 0; j < 8; ++j) o.q[8 * g + j] = signed_level(grid_byte(entry, j), signs, j);
    }
  }
};

template <>
struct Codec<Type::IQ3_XXS> {  // d | qs[64] grid indices | 8 x uint32 (4 x 7 sign bits + 4-bit scale)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ3_XXS>& o) {
    const float d = half_at(b, 0);
    for (int ib = 0; ib < 8; ++ib) o.d[ib] = iq_half_step_scale(d, load_u32(b + 66 + 4 * ib) >> 28, 0.5f);
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ3_XXS>& o) {
    scales(b, o);
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t meta = load_u32(b + 66 + 4 * ib);
      for (int l = 0; l < 4; ++l) {
        const uint32_t signs = even_parity_signs((meta >> (7 * l)) & 127u);
        for (int half = 0; half < 2; ++half) {
          const uint32_t entry = LOWBIT_TABLE(iq3xxs_grid)[b[2 + 8 * ib + 2 * l + half]];
          for (int j = 0; j < 4; ++j) {
            o.q[32 * ib + 8 * l + 4 * half + j] = signed_level(grid_byte(entry, j), signs, 4 * half + j);
          }
        }
      }
    }
  }
};

template <>
struct Codec<Type::IQ3_S> {  // d | qs[64] | qh[8] | signs[32] | scales[4]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ3_S>& o) {
    const float d = half_at(b, 0);
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t s = (b[106 + ib / 2] >> (4 * (ib % 2))) & 0xf;
      o.d[ib] = mul_rn(d, static_cast<float>(1 + 2 * static_cast<int>(s)));
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ3_S>& o) {
    scales(b, o);
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t qh = b[66 + ib];
      for (int l = 0; l < 4; ++l) {
        const uint32_t signs = b[74 + 4 * ib + l];
        for (int half = 0; half < 2; ++half) {
          // The 9th index bit of grid 2l + half is bit 2l + half of qh.
          const uint32_t index = b[2 + 8 * ib + 2 * l + half] | (((qh >> (2 * l + half)) & 1u) << 8);
          const uint32_t entry = LOWBIT_TABLE(iq3s_grid)[index];
          for (int j = 0; j < 4; ++j) {
            o.q[32 * ib + 8 * l + 4 * half + j] = signed_level(grid_byte(entry, j), signs, 4 * half + j);
          }
        }
      }
    }
  }
};

// IQ1: w = dl * (grid + delta) with grid in {-1, 0, 1} and delta = +-1/8, kept
// integral as q = 8 * grid +- 1 with scale dl / 8 (exact: a power of two).
LOWBIT_HD int8_t iq1_level(uint64_t entry, int j, bool negative_delta) {
  const int grid = static_cast<int8_t>(grid_byte(entry, j));
  return static_cast<int8_t>(8 * grid + (negative_delta ? -1 : 1));
}

template <>
struct Codec<Type::IQ1_S> {  // d | qs[32] | uint16 qh[8] (3-bit scale, delta sign, 4 x 3 index bits)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ1_S>& o) {
    const float d = half_at(b, 0);
    for (int ib = 0; ib < 8; ++ib) {
      o.d[ib] = mul_rn(mul_rn(d, static_cast<float>(2 * ((load_u16(b + 34 + 2 * ib) >> 12) & 7) + 1)), 0.125f);
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ1_S>& o) {
    scales(b, o);
    for (int ib = 0; ib < 8; ++ib) {
      const uint32_t qh = load_u16(b + 34 + 2 * ib);
      const bool negative = qh & 0x8000u;
      for (int l = 0; l < 4; ++l) {
        const uint64_t entry = LOWBIT_TABLE(iq1s_grid)[b[2 + 4 * ib + l] | (((qh >> (3 * l)) & 7u) << 8)];
        for (int j = 0; j < 8; ++j) o.q[32 * ib + 8 * l + j] = iq1_level(entry, j, negative);
      }
    }
  }
};

template <>
struct Codec<Type::IQ1_M> {  // qs[32] | qh[16] | scales[8] (3-bit sub-scales + the fp16 d in the top nibbles)
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ1_M>& o) {
    uint16_t sc[4];
    for (int i = 0; i < 4; ++i) sc[i] = load_u16(b + 48 + 2 * i);
    const uint16_t d_bits = static_cast<uint16_t>((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) |
                                                  (sc[3] & 0xf000));
    const float d = fp16_to_fp32(d_bits);
    for (int s = 0; s < 16; ++s) {
      const int ib = s / 2;
      const int scale = (sc[ib / 2] >> (6 * (ib % 2) + 3 * (s % 2))) & 7;
      o.d[s] = mul_rn(mul_rn(d, static_cast<float>(2 * scale + 1)), 0.125f);
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ1_M>& o) {
    scales(b, o);
    const uint8_t* qs = b;
    const uint8_t* qh = b + 32;
    for (int g = 0; g < 32; ++g) {
      // Group g of 8: low index byte qs[g]; qh[g / 2] holds, per nibble, 3 high
      // index bits and the delta sign (bit 3).
      const uint32_t nibble = (qh[g / 2] >> (4 * (g % 2))) & 0xf;
      const uint64_t entry = LOWBIT_TABLE(iq1s_grid)[qs[g] | ((nibble & 7u) << 8)];
      for (int j = 0; j < 8; ++j) o.q[8 * g + j] = iq1_level(entry, j, nibble & 8u);
    }
  }
};

template <>
struct Codec<Type::IQ4_XS> {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::IQ4_XS>& o) {
    const float d = half_at(b, 0);
    const uint32_t scales_h = load_u16(b + 2);
    for (int ib = 0; ib < 8; ++ib) {
      const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xf) | (((scales_h >> (2 * ib)) & 3) << 4);
      o.d[ib] = mul_rn(d, static_cast<float>(ls - 32));
    }
  }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::IQ4_XS>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) o.q[e] = LOWBIT_TABLE(kvalues_iq4nl)[nibble_of_element(b + 8 + 16 * (e / 32), e % 32)];
  }
};

// ---- ternary types -----------------------------------------------------------

// Trit n (0..4) of a base-3 byte, ggml's fixed-point digit extraction.
LOWBIT_HD int trit(uint8_t byte, int n) {
  const uint8_t pow3[5] = {1, 3, 9, 27, 81};
  const uint8_t shifted = static_cast<uint8_t>(byte * pow3[n]);
  return ((static_cast<uint16_t>(shifted) * 3) >> 8) - 1;
}

template <>
struct Codec<Type::TQ1_0> {  // qs[48] (5 trits per byte) | qh[4] (4 trits per byte) | d
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::TQ1_0>& o) {
    o.d[0] = half_at(b, 52);
    int e = 0;
    for (int n = 0; n < 5; ++n)
      for (int m = 0; m < 32; ++m) o.q[e++] = static_cast<int8_t>(trit(b[m], n));
    for (int n = 0; n < 5; ++n)
      for (int m = 0; m < 16; ++m) o.q[e++] = static_cast<int8_t>(trit(b[32 + m], n));
    for (int n = 0; n < 4; ++n)
      for (int m = 0; m < 4; ++m) o.q[e++] = static_cast<int8_t>(trit(b[48 + m], n));
  }
};

template <>
struct Codec<Type::TQ2_0> {  // qs[64] (2 bits per element) | d
  LOWBIT_HD static void scales(const uint8_t* b, Decoded<Type::TQ2_0>& o) { o.d[0] = half_at(b, 64); }
  LOWBIT_HD static void decode(const uint8_t* b, Decoded<Type::TQ2_0>& o) {
    scales(b, o);
    for (int e = 0; e < 256; ++e) {
      const int h = e / 128, l = (e % 128) / 32, m = e % 32;
      o.q[e] = static_cast<int8_t>(((b[32 * h + m] >> (2 * l)) & 3) - 1);
    }
  }
};

// ---- the shared definition of a weight --------------------------------------

// Element i of a decoded block as fp32.
template <Type T>
LOWBIT_HD float weight(const Decoded<T>& blk, int i) {
  using I = TypeInfo<T>;
  const float w = mul_rn(blk.d[i / I::kSub], static_cast<float>(blk.q[i]));
  if constexpr (I::kHasMin) {
    return add_rn(w, blk.m[i / I::kSub]);
  } else {
    return w;
  }
}

// Decodes one block of type T into kBlock fp32 values.
template <Type T>
LOWBIT_HD void dequantize_block(const uint8_t* block, float* out) {
  if constexpr (TypeInfo<T>::kFloat) {
    out[0] = Codec<T>::value(block);
  } else {
    Decoded<T> blk;
    Codec<T>::decode(block, blk);
    for (int i = 0; i < TypeInfo<T>::kBlock; ++i) out[i] = weight<T>(blk, i);
  }
}

}  // namespace ggml
}  // namespace lowbit
