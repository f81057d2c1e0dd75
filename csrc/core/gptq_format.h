// The GPTQ packing format, shared by every backend.
//
// GPTQ packs b-bit unsigned fields into int32 words along one tensor axis
// (qweight along K, qzeros along N). Along that axis the words of one column
// form a single little-endian bit stream: field i occupies stream bits
// [b*i, b*i + b). For b in {2, 4, 8} no field crosses a word; for b = 3 every
// 32 fields fill exactly 3 words and fields 10 and 21 straddle two words
// (the 10|1|10|1|10 layout).
//
// A field is described once by FieldLoc (which words, which bits) so that a
// kernel can locate a row of fields once and then extract it from many
// columns with the same shifts and masks.
#pragma once

#include <stdint.h>

#include "host_device.h"

namespace lowbit {
namespace gptq {

// Bit widths lowbit supports.
LOWBIT_HD bool is_supported_bits(int64_t bits) {
  return bits == 2 || bits == 3 || bits == 4 || bits == 8;
}

// Fields per "pack": the smallest run of fields that fills whole words.
// 3-bit packs 32 fields into 3 words; the others pack 32/b fields into 1 word.
template <int BITS>
struct Pack {
  static_assert(BITS == 2 || BITS == 3 || BITS == 4 || BITS == 8, "bits");
  static constexpr int kFields = BITS == 3 ? 32 : 32 / BITS;
  static constexpr int kWords = BITS == 3 ? 3 : 1;  // fields_per_pack / words_per_pack below, at compile time
  static constexpr uint32_t kMask = (1u << BITS) - 1u;
};

// The same, for a run-time bit width (validation and shape arithmetic).
LOWBIT_HD int64_t fields_per_pack(int64_t bits) { return bits == 3 ? 32 : 32 / bits; }
LOWBIT_HD int64_t words_per_pack(int64_t bits) { return bits == 3 ? 3 : 1; }

// Where field i lives: its low part in word `lo` at bit `lo_shift` (lo_mask
// wide), and, for a straddling 3-bit field, its high part in the low bits of
// word `hi` (hi_mask wide), to be placed above the low part at `hi_pos`.
// Non-straddling fields have hi == lo and hi_mask == 0.
struct FieldLoc {
  int64_t lo;
  int64_t hi;
  uint32_t lo_shift;
  uint32_t lo_mask;
  uint32_t hi_mask;
  uint32_t hi_pos;
};

// constexpr so that SIMD kernels can unroll a pack with compile-time shifts.
template <int BITS>
LOWBIT_HD constexpr FieldLoc locate(int64_t i) {
  FieldLoc f{};
  const int64_t pack = i / Pack<BITS>::kFields;
  const uint32_t bit = BITS * static_cast<uint32_t>(i % Pack<BITS>::kFields);
  f.lo = pack * Pack<BITS>::kWords + bit / 32;
  f.lo_shift = bit % 32;
  const uint32_t lo_bits = 32 - f.lo_shift < BITS ? 32 - f.lo_shift : BITS;
  f.lo_mask = (1u << lo_bits) - 1u;
  f.hi_mask = (1u << (BITS - lo_bits)) - 1u;  // 0 unless the field straddles
  f.hi_pos = lo_bits;
  f.hi = f.hi_mask ? f.lo + 1 : f.lo;
  return f;
}

// Value of a located field given the two words it touches.
LOWBIT_HD uint32_t extract(uint32_t lo_word, uint32_t hi_word, const FieldLoc& f) {
  return ((lo_word >> f.lo_shift) & f.lo_mask) | ((hi_word & f.hi_mask) << f.hi_pos);
}

// Field i of a stream whose consecutive words are `stride` words apart
// (stride = N for qweight, 1 for a row of qzeros).
template <int BITS>
LOWBIT_HD uint32_t unpack_field(const uint32_t* stream, int64_t stride, int64_t i) {
  const FieldLoc f = locate<BITS>(i);
  return extract(stream[f.lo * stride], stream[f.hi * stride], f);
}

// ORs `value` into a located field of zero-initialised words (the inverse of
// extract). lo_word and hi_word may be the same word.
LOWBIT_HD void insert(uint32_t& lo_word, uint32_t& hi_word, const FieldLoc& f, uint32_t value) {
  lo_word |= (value & f.lo_mask) << f.lo_shift;
  hi_word |= (value >> f.hi_pos) & f.hi_mask;
}

// ORs `value` into field i of a zero-initialised stream (the inverse of
// unpack_field).
template <int BITS>
LOWBIT_HD void deposit_field(uint32_t* stream, int64_t stride, int64_t i, uint32_t value) {
  const FieldLoc f = locate<BITS>(i);
  insert(stream[f.lo * stride], stream[f.hi * stride], f, value);
}

// A 2-D tensor of fields seen as [outer, length, inner] and packed along
// `length` (dim 0: [1, rows, cols], dim 1: [rows, cols, 1]). Pack p of the
// stream (o, c) holds fields (o, p*kFields + j, c), j < kFields, in the words
// (o, p*kWords + v, c), v < kWords, of the packed tensor (the same shape with
// `length` fields become length / kFields * kWords words). Every pack/unpack
// kernel walks packs with these offsets and moves one pack with pack_one /
// unpack_one.
struct PackedAxis {
  int64_t outer;
  int64_t length;  // fields along the packed axis
  int64_t inner;
};

LOWBIT_HD PackedAxis packed_axis(int64_t rows, int64_t cols, int64_t dim) {
  return dim == 0 ? PackedAxis{1, rows, cols} : PackedAxis{rows, cols, 1};
}

// Where pack p of the streams (o, c) starts, for c = 0: in the fields and in the words.
template <int BITS>
LOWBIT_HD int64_t pack_fields_at(const PackedAxis& ax, int64_t o, int64_t p) {
  return (o * ax.length + p * Pack<BITS>::kFields) * ax.inner;
}
template <int BITS>
LOWBIT_HD int64_t pack_words_at(const PackedAxis& ax, int64_t o, int64_t p) {
  return (o * (ax.length / Pack<BITS>::kFields * Pack<BITS>::kWords) + p * Pack<BITS>::kWords) * ax.inner;
}

// One pack: the kFields values fields[j * stride] (each in [0, 2^BITS))
// into the kWords words words[v * stride], and back. `stride` is the
// tensor's inner size (a compile-time 1 where the caller knows it).
template <int BITS, typename Stride>
LOWBIT_HD void pack_one(const int32_t* fields, uint32_t* words, Stride stride) {
  uint32_t w[Pack<BITS>::kWords] = {};
  LOWBIT_UNROLL
  for (int j = 0; j < Pack<BITS>::kFields; ++j) {
    const FieldLoc f = locate<BITS>(j);
    insert(w[f.lo], w[f.hi], f, static_cast<uint32_t>(fields[j * stride]));
  }
  LOWBIT_UNROLL
  for (int v = 0; v < Pack<BITS>::kWords; ++v) words[v * stride] = w[v];
}
template <int BITS, typename Stride>
LOWBIT_HD void unpack_one(const uint32_t* words, int32_t* fields, Stride stride) {
  uint32_t w[Pack<BITS>::kWords];
  LOWBIT_UNROLL
  for (int v = 0; v < Pack<BITS>::kWords; ++v) w[v] = words[v * stride];
  LOWBIT_UNROLL
  for (int j = 0; j < Pack<BITS>::kFields; ++j) {
    const FieldLoc f = locate<BITS>(j);
    fields[j * stride] = static_cast<int32_t>(extract(w[f.lo], w[f.hi], f));
  }
}

// Pack p of one column of a weight packed along K (`stride` words between
// rows): its fields gathered from rows from[0 .. kFields) of `src` (the
// column's first word) into the kWords words dst[v * stride]. The rows must
// lie in [0, K).
template <int BITS>
LOWBIT_HD void gather_one(const uint32_t* src, const int32_t* from, uint32_t* dst, int64_t stride) {
  uint32_t w[Pack<BITS>::kWords] = {};
  LOWBIT_UNROLL
  for (int j = 0; j < Pack<BITS>::kFields; ++j) {
    const FieldLoc s = locate<BITS>(from[j]);
    const FieldLoc d = locate<BITS>(j);
    insert(w[d.lo], w[d.hi], d, extract(src[s.lo * stride], src[s.hi * stride], s));
  }
  LOWBIT_UNROLL
  for (int v = 0; v < Pack<BITS>::kWords; ++v) dst[v * stride] = w[v];
}

// The zero-point rule. GPTQ v1 checkpoints ("gptq") store zero - 1, GPTQ v2
// ("gptq_v2") store the zero itself. The offset is applied to each unpacked
// field, never to packed words, where it would carry across fields.
LOWBIT_HD int32_t zero_point(uint32_t stored, bool v2_format) {
  return static_cast<int32_t>(stored) + (v2_format ? 0 : 1);
}

// One dequantized weight: scale * (q - zero), in fp32.
LOWBIT_HD float dequant(uint32_t q, int32_t zero, float scale) {
  return scale * static_cast<float>(static_cast<int32_t>(q) - zero);
}

}  // namespace gptq
}  // namespace lowbit
