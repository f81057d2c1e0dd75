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
// the file at b * kRepackRows * bytes, holding first each fp16 field (d, then
// m for the types with mins) of rows 0..15 (32 bytes per field), then each
// 4-byte word of the quants, word w of rows 0..15 (64 bytes per word). A tile
// spans the same bytes as its rows did, so a weight keeps its size and
// shape, and unrepacking is the same permutation read the other way.
#pragma once

#include <stdint.h>

#include "ggml_types.h"
#include "host_device.h"

namespace lowbit {
namespace ggml {

constexpr int kRepackRows = 16;

// The types with a repacked layout and kernels for it: fp16 scale fields
// (1 + has_min of them) first, then whole 4-byte words (Q4_K's 12 bytes of
// 6-bit scales and mins, then its quants).
constexpr bool has_repacked_layout(Type t) {
  return t == Type::Q4_0 || t == Type::Q4_1 || t == Type::Q8_0 || t == Type::IQ4_NL || t == Type::Q4_K;
}

// Where byte j of a row's block goes within the repacked block of its tile,
// for row r of the tile; `halves` is the number of fp16 fields (1 + has_min).
LOWBIT_HD int repacked_offset(int halves, int r, int j) {
  if (j < 2 * halves) return (j / 2) * 2 * kRepackRows + r * 2 + j % 2;
  const int q = j - 2 * halves;
  return halves * 2 * kRepackRows + (q / 4) * 4 * kRepackRows + r * 4 + q % 4;
}

// A weight of `rows` rows of row_bytes each, from src into dst (distinct
// buffers): into the repacked layout, or back (`inverse`). Rows past the last
// whole tile are copied as they are. A range of rows starting at a multiple
// of kRepackRows and ending at one or at the weight's end is itself such a
// weight, so callers may split the work at tile boundaries. Copies whole
// fields and words (repacked_offset, unit by unit).
template <Type T>
LOWBIT_HD void repack_rows(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t row_bytes, bool inverse) {
  using I = TypeInfo<T>;
  constexpr int halves = 1 + I::kHasMin;
  constexpr int words = (I::kBytes - 2 * halves) / 4;
  const int64_t tiled = rows / kRepackRows * kRepackRows;
  const int64_t blocks = row_bytes / I::kBytes;
  for (int64_t r = 0; r < tiled; ++r) {
    const int in_tile = static_cast<int>(r % kRepackRows);
    const int64_t tile = (r - in_tile) * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t plain = r * row_bytes + b * I::kBytes;
      const int64_t packed = tile + b * kRepackRows * I::kBytes;
      const auto unit = [&](int j, int size) {  // `size` bytes from byte j of the row's block
        const int64_t p = packed + repacked_offset(halves, in_tile, j);
        const int64_t from = inverse ? p : plain + j, to = inverse ? plain + j : p;
        for (int i = 0; i < size; ++i) dst[to + i] = src[from + i];
      };
      for (int h = 0; h < halves; ++h) unit(2 * h, 2);
      for (int w = 0; w < words; ++w) unit(2 * halves + 4 * w, 4);
    }
  }
  for (int64_t j = tiled * row_bytes; j < rows * row_bytes; ++j) dst[j] = src[j];
}

}  // namespace ggml
}  // namespace lowbit
