// The activation-row tiling the SIMD kernels share: M rows in tiles of up to
// four, each tile's size a compile-time constant so that its accumulators
// stay in registers. Include only inside a unit's target pragma region (see
// gptq_fused_simd.h on internal linkage).
#pragma once

#include <stdint.h>

#include <type_traits>

namespace lowbit {
namespace cpu {
namespace {

constexpr int kMaxRowTile = 4;

// tile(std::integral_constant<int, MT>{}, m0) for rows m0 .. m0+MT of 0 .. M,
// MT <= kMaxRowTile.
template <class Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    if (left >= 4) {
      tile(std::integral_constant<int, 4>{}, m0), m0 += 4;
    } else if (left == 3) {
      tile(std::integral_constant<int, 3>{}, m0), m0 += 3;
    } else if (left == 2) {
      tile(std::integral_constant<int, 2>{}, m0), m0 += 2;
    } else {
      tile(std::integral_constant<int, 1>{}, m0), m0 += 1;
    }
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
