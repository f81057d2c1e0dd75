// The interleaved ("repacked") layout of a GGUF weight for the CPU kernels:
// the same bytes as the file's, reordered so that 16 rows of a block sit side
// by side, one row per 32-bit lane of a 512-bit register, as llama.cpp's
// CPU_REPACK buffers do for its own kernels. A matvec then decodes and scales
// 16 rows with each vector instruction instead of one (ggml_gemm_vnni.h),
// where a row at a time is compute-bound for the 4-bit types.
//
// The layout, per tile of kRepackRows consecutive rows (rows past the last
// whole tile stay as the file has them, as does any type without one):
// block b of the tile's rows takes the byte range the tile's rows have in
// the file at b * kRepackRows * bytes, holding first each field of the
// block (repacked_fields: the fp16 d, then m or dmin, and IQ4_XS's
// scales_h; MXFP4's one-byte E8M0 scale) of rows 0..15 (the field of the
// 16 rows side by side: 32 bytes, 16 for a one-byte field), then each
// 4-byte word of the rest of the block, in the file's order (64 bytes per
// word: word w of rows 0..15). A tile spans the same bytes as its rows did,
// so a weight keeps its size and shape, and unrepacking is the same
// permutation read the other way.
#pragma once

#include <stdint.h>

#include "ggml_types.h"
#include "host_device.h"

namespace lowbit {
namespace ggml {

constexpr int kRepackRows = 16;

// A block's fields, which the repacked layout puts first: `count` of them,
// `size` bytes each, starting at byte `at` of the file's block (the K-quants
// of 2, 3 and 6 bits keep theirs at the block's end).
struct RepackedFields {
  int at, count, size = 2;
  constexpr int bytes() const { return count * size; }
};
constexpr RepackedFields repacked_fields(Type t) {
  switch (t) {
    case Type::Q2_K: return {80, 2};   // d, dmin after scales[16] and qs[64]
    case Type::Q3_K: return {108, 1};  // d after hmask, qs and scales
    case Type::Q6_K: return {208, 1};  // d after ql, qh and scales
    case Type::Q4_1: case Type::Q5_1: case Type::Q4_K: case Type::Q5_K: return {0, 2};  // d, then m or dmin
    case Type::IQ4_XS: return {0, 2};  // d, then the 16-bit scales_h
    case Type::MXFP4: return {0, 1, 1};  // the E8M0 scale
    default: return {0, 1};            // d
  }
}

// Bytes of a tile's block before its words: every field of its 16 rows.
constexpr int repacked_field_bytes(Type t) { return repacked_fields(t).bytes() * kRepackRows; }

// Where byte j of a row's block goes within the repacked block of its tile,
// for row r of the tile.
LOWBIT_HD int repacked_offset(RepackedFields f, int r, int j) {
  const int field_bytes = f.bytes();
  if (j >= f.at && j < f.at + field_bytes)
    return (j - f.at) / f.size * f.size * kRepackRows + r * f.size + (j - f.at) % f.size;
  const int q = j < f.at ? j : j - field_bytes;  // its place among the words
  return field_bytes * kRepackRows + (q / 4) * 4 * kRepackRows + r * 4 + q % 4;
}

// A weight of `rows` rows of row_bytes each, from src into dst (distinct
// buffers): into the repacked layout, or back (`inverse`). Rows past the last
// whole tile are copied as they are. A range of rows starting at a multiple
// of kRepackRows and ending at one or at the weight's end is itself such a
// weight, so callers may split the work at tile boundaries. Goes tile by
// tile and block by block, the layout's order: each field, then each word,
// of the block's 16 rows (the places repacked_offset gives, found by adding
// strides rather than by a call per unit, which cost a load its copy speed).
template <Type T>
LOWBIT_HD void repack_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, bool inverse) {
  using I = TypeInfo<T>;
  constexpr RepackedFields f = repacked_fields(T);
  constexpr int kFieldBytes = f.bytes(), kWords = (I::kBytes - kFieldBytes) / 4;
  static_assert((I::kBytes - kFieldBytes) % 4 == 0 && f.at % 4 == 0, "whole words around the fields");
  const int64_t tiled = rows / kRepackRows * kRepackRows;
  const int64_t blocks = row_bytes / I::kBytes;
  // `size` bytes between byte `at` of the file's layout and `packed` of the repacked one.
  const auto move = [&](int64_t at, int64_t packed, int size) {
    const uint8_t* from = src + (inverse ? packed : at);
    uint8_t* to = dst + (inverse ? at : packed);
    for (int i = 0; i < size; ++i) to[i] = from[i];
  };
  for (int64_t t = 0; t < tiled; t += kRepackRows) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t plain = t * row_bytes + b * I::kBytes;               // row t's block b
      const int64_t packed = t * row_bytes + b * kRepackRows * I::kBytes;  // the tile's block b
      for (int h = 0; h < f.count; ++h)
        for (int r = 0; r < kRepackRows; ++r)
          move(plain + r * row_bytes + f.at + h * f.size, packed + (h * kRepackRows + r) * f.size, f.size);
      for (int w = 0; w < kWords; ++w) {
        const int j = 4 * w < f.at ? 4 * w : 4 * w + kFieldBytes;  // the word's byte in the file's block
        const int64_t words = packed + kFieldBytes * kRepackRows + w * 4 * kRepackRows;
        for (int r = 0; r < kRepackRows; ++r) move(plain + r * row_bytes + j, words + r * 4, 4);
      }
    }
  }
  for (int64_t j = tiled * row_bytes; j < rows * row_bytes; ++j) dst[j] = src[j];
}

}  // namespace ggml
}  // namespace lowbit
