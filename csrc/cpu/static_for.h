// A compile-time loop for the SIMD kernels, whose intrinsics take immediate
// operands (shift counts, shuffle controls) that must be constants.
#pragma once

#include <type_traits>
#include <utility>

namespace lowbit {
namespace cpu {
namespace {

// Calls f(std::integral_constant<int, I>{}) for I = 0 .. N - 1 in turn.
template <int N, class F>
inline void static_for(F&& f) {
  [&]<int... I>(std::integer_sequence<int, I...>) { (f(std::integral_constant<int, I>{}), ...); }(
      std::make_integer_sequence<int, N>{});
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
