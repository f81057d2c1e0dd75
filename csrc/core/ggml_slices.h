// One 32-element slice of a GGUF block at a time, its levels cut out as
// words of four int8 levels, for the dot products of the types listed in
// kSliced. A CUDA lane decodes a slice in registers (word loads, shifts and
// masks, nothing in local memory) and meets the activations with __dp4a; the
// CPU's portable kernel runs the same decoders (and an exact byte dot), so
// the CPU tests check the GPU's decoding. Levels, scales and mins are Codec<T>::decode's
// (core/ggml_blocks.h), and slice_dot adds each sub-block's terms in
// block_dot's order (core/ggml_q8.h): a block's slices, run in order, give
// block_dot's sum bit for bit.
#pragma once

#include <stdint.h>
#include <string.h>

#include "float_bits.h"
#include "ggml_blocks.h"
#include "ggml_q8.h"
#include "ggml_types.h"
#include "host_device.h"

namespace lowbit {
namespace ggml {

constexpr int kSliceElems = 32;

// The types with a slice decoder below.
template <Type T>
constexpr bool kSliced = T == Type::Q4_0 || T == Type::Q4_1 || T == Type::Q5_0 || T == Type::Q5_1 ||
                         T == Type::Q8_0 || T == Type::Q2_K || T == Type::Q3_K || T == Type::Q4_K ||
                         T == Type::Q5_K || T == Type::Q6_K || T == Type::IQ4_NL || T == Type::IQ4_XS;

// The alignment the GPU's slice loads assume of a weight's first byte: they
// read words at offsets that are multiples of 2 (4 in blocks of a multiple of
// 4 bytes, 16 in Q4_K's and Q5_K's, whose sizes are multiples of 16).
constexpr int kSliceAlign = 16;

template <Type T>
struct Slice {
  static constexpr int kSubs = kSliceElems / TypeInfo<T>::kSub;
  uint32_t q[8];  // byte k of q[i]: the level of element 4i + k
  float d[kSubs];
  float m[TypeInfo<T>::kHasMin ? kSubs : 1];
};

// N little-endian words from bytes aligned to Align (2, 4 or 16). On the GPU:
// 128-bit loads at 16; 32-bit loads at 4; at 2, the N aligned words from p
// rounded down to 4 (at worst the 2 bytes before p, never before the weight's
// first byte, which is 16-byte aligned) and the run's last 16 bits, two
// neighbours funnel-shifted into each word: N + 1 loads where N pairs of
// 16-bit loads would take 2N. Nothing past the run is read.
template <int Align, int N>
LOWBIT_HD void load_words(const uint8_t* p, uint32_t (&w)[N]) {
#if LOWBIT_DEVICE_PATH
  if constexpr (Align == 16) {
    static_assert(N % 4 == 0, "128-bit loads give words in fours");
    const uint4* v = reinterpret_cast<const uint4*>(p);
    LOWBIT_UNROLL
    for (int h = 0; h < N / 4; ++h) {
      const uint4 u = v[h];
      w[4 * h] = u.x;
      w[4 * h + 1] = u.y;
      w[4 * h + 2] = u.z;
      w[4 * h + 3] = u.w;
    }
  } else if constexpr (Align == 4) {
    LOWBIT_UNROLL
    for (int i = 0; i < N; ++i) w[i] = load_w4(p + 4 * i);
  } else {
    static_assert(Align == 2, "alignment 2, 4 or 16");
    const uint32_t shift = 8u * static_cast<uint32_t>(reinterpret_cast<uintptr_t>(p) & 2u);  // 0 or 16 bits
    const uint32_t* a = reinterpret_cast<const uint32_t*>(p - shift / 8);
    uint32_t cur = a[0];
    LOWBIT_UNROLL
    for (int i = 0; i < N; ++i) {
      const uint32_t next = i + 1 < N ? a[i + 1] : static_cast<uint32_t>(load_h2(p + 4 * N - 2));
      w[i] = __funnelshift_r(cur, next, shift);
      cur = next;
    }
  }
#else
  for (int i = 0; i < N; ++i) w[i] = load_u32(p + 4 * i);
#endif
}

// An fp16 value at a 2-byte aligned offset of a block.
LOWBIT_HD float half_w2(const uint8_t* p) { return fp16_to_fp32(load_h2(p)); }

// Bytes v (each < 0x80 + off) minus off, as int8 bytes: adding 0x80 - off
// cannot carry out of a byte, and flipping the top bit is subtracting 0x80.
LOWBIT_HD uint32_t minus_bytes(uint32_t v, uint32_t off) { return (v + 0x01010101u * (0x80u - off)) ^ 0x80808080u; }

// Every level of a slice less off (minus_bytes).
LOWBIT_HD void minus_levels(uint32_t (&q)[8], uint32_t off) {
  LOWBIT_UNROLL
  for (int i = 0; i < 8; ++i) q[i] = minus_bytes(q[i], off);
}

// Bit k (k < 4) of the 4-bit x as bit 0 of byte k: the shifted copies
// x << 7k do not overlap, so the product carries nothing.
LOWBIT_HD uint32_t bits_to_bytes(uint32_t x) { return (x * 0x00204081u) & 0x01010101u; }

// __byte_perm(lo, hi, sel) for selector nibbles 0-7: byte k of the result
// is byte (sel >> 4k) & 7 of the eight bytes lo, hi.
LOWBIT_HD uint32_t byte_perm(uint32_t lo, uint32_t hi, uint32_t sel) {
#if LOWBIT_DEVICE_PATH
  return __byte_perm(lo, hi, sel);
#else
  const uint8_t bytes[8] = {static_cast<uint8_t>(lo), static_cast<uint8_t>(lo >> 8), static_cast<uint8_t>(lo >> 16),
                            static_cast<uint8_t>(lo >> 24), static_cast<uint8_t>(hi), static_cast<uint8_t>(hi >> 8),
                            static_cast<uint8_t>(hi >> 16), static_cast<uint8_t>(hi >> 24)};
  uint32_t r = 0;
  for (int k = 0; k < 4; ++k) r |= static_cast<uint32_t>(bytes[(sel >> (4 * k)) & 7]) << (8 * k);
  return r;
#endif
}

// A 16-entry int8 table as four little-endian words, and the entries of four
// 4-bit indices (one per byte of `idx`) looked up at once: bits 0-2 of each
// index pick a byte of the low or the high eight entries (byte_perm), bit 3
// picks between the two. No memory is read.
struct Table16 {
  uint32_t w[4];
};
LOWBIT_HD constexpr Table16 table16(const int8_t (&t)[16]) {
  Table16 r{};
  for (int i = 0; i < 16; ++i) r.w[i / 4] |= static_cast<uint32_t>(static_cast<uint8_t>(t[i])) << (8 * (i % 4));
  return r;
}
LOWBIT_HD uint32_t table16_lookup(const Table16& t, uint32_t idx) {
  const uint32_t low3 = idx & 0x07070707u;
  const uint32_t packed = low3 | (low3 >> 4);  // index k's low 3 bits at bits 4k (k < 2) and 8 + 4(k - 2)
  const uint32_t sel = (packed & 0xffu) | ((packed >> 8) & 0xff00u);
  const uint32_t low = byte_perm(t.w[0], t.w[1], sel), high = byte_perm(t.w[2], t.w[3], sel);
  const uint32_t upper = ((idx >> 3) & 0x01010101u) * 0xffu;  // 0xff in the bytes whose index is 8-15
  return (low & ~upper) | (high & upper);
}

template <Type T>
struct SliceCodec;

// Legacy 32-element blocks: slice 0 is the block; elements 4i..4i+3 are the
// low nibbles of qs word i, elements 16 + 4i.. its high nibbles.
template <int Align>
LOWBIT_HD void nibble_words(const uint8_t* qs, uint32_t (&q)[8]) {
  uint32_t w[4];
  load_words<Align>(qs, w);
  LOWBIT_UNROLL
  for (int i = 0; i < 4; ++i) {
    q[i] = w[i] & 0x0f0f0f0fu;
    q[4 + i] = (w[i] >> 4) & 0x0f0f0f0fu;
  }
}

// Q5's fifth bits: bit e of qh onto bit 4 of element e's byte.
LOWBIT_HD void add_fifth_bits(uint32_t qh, uint32_t (&q)[8]) {
  LOWBIT_UNROLL
  for (int i = 0; i < 8; ++i) q[i] |= bits_to_bytes((qh >> (4 * i)) & 0xfu) << 4;
}

template <>
struct SliceCodec<Type::Q4_0> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::Q4_0>& o) {
    o.d[0] = half_w2(b);
    nibble_words<2>(b + 2, o.q);
    minus_levels(o.q, 8);
  }
};

template <>
struct SliceCodec<Type::Q4_1> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::Q4_1>& o) {
    o.d[0] = half_w2(b);
    o.m[0] = half_w2(b + 2);
    nibble_words<4>(b + 4, o.q);
  }
};

template <>
struct SliceCodec<Type::Q5_0> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::Q5_0>& o) {
    o.d[0] = half_w2(b);
    uint32_t qh[1];
    load_words<2>(b + 2, qh);
    nibble_words<2>(b + 6, o.q);
    add_fifth_bits(qh[0], o.q);
    minus_levels(o.q, 16);
  }
};

template <>
struct SliceCodec<Type::Q5_1> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::Q5_1>& o) {
    o.d[0] = half_w2(b);
    o.m[0] = half_w2(b + 2);
    nibble_words<4>(b + 8, o.q);
    add_fifth_bits(load_w4(b + 4), o.q);
  }
};

template <>
struct SliceCodec<Type::Q8_0> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::Q8_0>& o) {
    o.d[0] = half_w2(b);
    load_words<2>(b + 2, o.q);
  }
};

// IQ4_NL: Q4_0's nibbles, as indices into the non-linear level table.
template <>
struct SliceCodec<Type::IQ4_NL> {
  LOWBIT_HD static void decode(const uint8_t* b, int, Slice<Type::IQ4_NL>& o) {
    constexpr Table16 kLevels = table16(kvalues_iq4nl_host);
    o.d[0] = half_w2(b);
    nibble_words<2>(b + 2, o.q);
    LOWBIT_UNROLL
    for (int i = 0; i < 8; ++i) o.q[i] = table16_lookup(kLevels, o.q[i]);
  }
};

// Q2_K / Q3_K: slice j = 4h + k holds the 2-bit fields at bit 2k of qs
// bytes 32h..32h+31 (k2_level).
template <int Align>
LOWBIT_HD void crumb_words(const uint8_t* qs, int j, uint32_t (&q)[8]) {
  const uint8_t* p = qs + 32 * (j / 4);
  const int shift = 2 * (j % 4);
  load_words<Align>(p, q);
  LOWBIT_UNROLL
  for (int i = 0; i < 8; ++i) q[i] = (q[i] >> shift) & 0x03030303u;
}

template <>
struct SliceCodec<Type::Q2_K> {  // scales[16] | qs[64] | d | dmin
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::Q2_K>& o) {
    const float d = half_w2(b + 80), dmin = half_w2(b + 82);
    LOWBIT_UNROLL
    for (int s = 0; s < 2; ++s) {
      const uint32_t sc = (load_h2(b + 2 * j) >> (8 * s)) & 0xffu;
      o.d[s] = mul_rn(d, static_cast<float>(sc & 0xf));
      o.m[s] = -mul_rn(dmin, static_cast<float>(sc >> 4));
    }
    crumb_words<4>(b + 16, j, o.q);
  }
};

template <>
struct SliceCodec<Type::Q3_K> {  // hmask[32] | qs[64] | scales[12] | d
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::Q3_K>& o) {
    uint32_t sc[3];
    load_words<2>(b + 96, sc);
    const Q3KScales k = q3k_scales(sc[0], sc[1], sc[2]);
    const float d = half_w2(b + 108);
    const uint64_t word = j < 4 ? k.words[0] : k.words[1];  // sub-blocks 2j, 2j + 1
    LOWBIT_UNROLL
    for (int s = 0; s < 2; ++s) {
      const int biased = static_cast<int>((word >> (8 * ((2 * j + s) % 8))) & 0xffu);
      o.d[s] = mul_rn(d, static_cast<float>(biased - 32));
    }
    crumb_words<2>(b + 32, j, o.q);
    // hmask bit j of byte l set means "no -4 offset" for element 32j + l.
    uint32_t hmask[8];
    load_words<2>(b, hmask);
    LOWBIT_UNROLL
    for (int i = 0; i < 8; ++i) o.q[i] = minus_bytes(o.q[i] | (((hmask[i] >> j) & 0x01010101u) << 2), 4);
  }
};

// Q4_K / Q5_K: slice j is sub-block j, the low (j even) or high nibbles of
// qs bytes 32(j / 2)..; its scale and min are byte j % 4 of k4_scale_min's
// word j / 4.
template <Type T>
LOWBIT_HD void k4_slice(const uint8_t* b, const uint8_t* qs, int j, Slice<T>& o) {
  const float d = half_w2(b), dmin = half_w2(b + 2);
  const K4ScaleMin k = k4_scale_min(load_w4(b + 4), load_w4(b + 8), load_w4(b + 12));
  const uint32_t shift = 8 * (j % 4);
  o.d[0] = mul_rn(d, static_cast<float>(((j < 4 ? k.scales[0] : k.scales[1]) >> shift) & 0xffu));
  o.m[0] = -mul_rn(dmin, static_cast<float>(((j < 4 ? k.mins[0] : k.mins[1]) >> shift) & 0xffu));
  load_words<16>(qs + 32 * (j / 2), o.q);
  const int nibble = 4 * (j % 2);
  LOWBIT_UNROLL
  for (int i = 0; i < 8; ++i) o.q[i] = (o.q[i] >> nibble) & 0x0f0f0f0fu;
}

template <>
struct SliceCodec<Type::Q4_K> {  // d | dmin | scales[12] | qs[128]
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::Q4_K>& o) { k4_slice(b, b + 16, j, o); }
};

template <>
struct SliceCodec<Type::Q5_K> {  // d | dmin | scales[12] | qh[32] | qs[128]
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::Q5_K>& o) {
    k4_slice(b, b + 48, j, o);
    // Bit j of qh[l] is the fifth bit of element 32j + l.
    uint32_t qh[8];
    load_words<16>(b + 16, qh);
    LOWBIT_UNROLL
    for (int i = 0; i < 8; ++i) o.q[i] |= ((qh[i] >> j) & 0x01010101u) << 4;
  }
};

template <>
struct SliceCodec<Type::Q6_K> {  // ql[128] | qh[64] | int8 scales[16] | d
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::Q6_K>& o) {
    const float d = half_w2(b + 208);
    const uint32_t scales = load_h2(b + 192 + 2 * j);
    LOWBIT_UNROLL
    for (int s = 0; s < 2; ++s) o.d[s] = mul_rn(d, static_cast<float>(static_cast<int8_t>(scales >> (8 * s))));
    // Slice j = 4h + k: the low (k < 2) or high nibbles of ql[64h + 32(k % 2) ..]
    // and bits 2k, 2k + 1 of qh[32h ..], less 32.
    const int h = j / 4, k = j % 4;
    uint32_t ql[8], qh[8];
    load_words<2>(b + 64 * h + 32 * (k % 2), ql);
    load_words<2>(b + 128 + 32 * h, qh);
    LOWBIT_UNROLL
    for (int i = 0; i < 8; ++i) {
      const uint32_t low = (ql[i] >> (4 * (k / 2))) & 0x0f0f0f0fu, high = (qh[i] >> (2 * k)) & 0x03030303u;
      o.q[i] = minus_bytes(low | (high << 4), 32);
    }
  }
};

// IQ4_XS: slice j is sub-block j, IQ4_NL's nibble layout in qs[16j ..], its
// 6-bit scale from a nibble of scales_l and two bits of scales_h.
template <>
struct SliceCodec<Type::IQ4_XS> {  // d | scales_h (uint16) | scales_l[4] | qs[128]
  LOWBIT_HD static void decode(const uint8_t* b, int j, Slice<Type::IQ4_XS>& o) {
    constexpr Table16 kLevels = table16(kvalues_iq4nl_host);
    const uint32_t head = load_w4(b), scales_l = load_w4(b + 4);
    const uint32_t ls = ((scales_l >> (4 * j)) & 0xfu) | (((head >> (16 + 2 * j)) & 3u) << 4);
    o.d[0] = mul_rn(fp16_to_fp32(static_cast<uint16_t>(head)), static_cast<float>(static_cast<int>(ls) - 32));
    nibble_words<4>(b + 8 + 16 * j, o.q);
    LOWBIT_UNROLL
    for (int i = 0; i < 8; ++i) o.q[i] = table16_lookup(kLevels, o.q[i]);
  }
};

// The slice's terms of a weight row . activation row, added to acc; `first`
// is the slice's first element in the row, a multiple of 32, so a.q + first
// is 16-byte aligned where a.q is (the GPU loads it as two 128-bit words).
template <Type T>
LOWBIT_HD void slice_dot(const Slice<T>& w, const ActRow& a, int64_t first, float& acc) {
  using I = TypeInfo<T>;
#if LOWBIT_DEVICE_PATH
  constexpr int kWords = I::kSub / 4;
  uint32_t x[8];
  load_words<16>(reinterpret_cast<const uint8_t*>(a.q + first), x);
#else
  // The CPU's compilers vectorize a dot over bytes, not one over words.
  int8_t levels[kSliceElems];
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  memcpy(levels, w.q, sizeof(levels));
#else
  for (int e = 0; e < kSliceElems; ++e) levels[e] = static_cast<int8_t>(w.q[e / 4] >> (8 * (e % 4)));
#endif
#endif
  LOWBIT_UNROLL
  for (int s = 0; s < Slice<T>::kSubs; ++s) {
#if LOWBIT_DEVICE_PATH
    int32_t isum = 0;
    LOWBIT_UNROLL
    for (int i = 0; i < kWords; ++i) {
      isum = __dp4a(static_cast<int>(w.q[s * kWords + i]), static_cast<int>(x[s * kWords + i]), isum);
    }
#else
    const int32_t isum = ScalarIntDot{}(levels + s * I::kSub, a.q + first + s * I::kSub, I::kSub);
#endif
    add_sub_block<T>(acc, w.d[s], I::kHasMin ? w.m[s] : 0.0f, isum, a, first + s * I::kSub);
  }
}

}  // namespace ggml
}  // namespace lowbit
