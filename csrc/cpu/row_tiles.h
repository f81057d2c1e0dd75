// The activation-row tiling the SIMD kernels share: M rows in tiles of up to
// four (or a kernel's own count), each tile's size a compile-time constant
// so that its accumulators stay in registers. Include only inside a unit's
// target pragma region (see gptq_fused_simd.h on internal linkage).
#pragma once

#include <stdint.h>

#include <type_traits>

namespace lowbit {
namespace cpu {
namespace {

constexpr int kMaxRowTile = 4;

// tile(std::integral_constant<int, MT>{}, m0) for rows m0 .. m0+MT of
// `from` .. M: MT = K while K rows are left, then the rest in one tile
// (K = kMaxRowTile unless the caller picks its own, as the repacked kernels
// do).
template <int K = kMaxRowTile, class Tile>
inline void for_row_tiles(int64_t M, Tile&& tile, int64_t from = 0) {
  int64_t m0 = from;
  for (; m0 + K <= M; m0 += K) tile(std::integral_constant<int, K>{}, m0);
  if constexpr (K > 1) for_row_tiles<K - 1>(M, tile, m0);
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
