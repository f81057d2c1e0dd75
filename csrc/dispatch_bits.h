// Turns a run-time bit width into a compile-time template argument, so each
// kernel family is written once and specialised per bit width.
#pragma once

#include <c10/util/Exception.h>

#include <type_traits>

namespace lowbit {

template <int B>
using Bits = std::integral_constant<int, B>;

// Calls f(Bits<bit>{}); `bit` must already have been validated.
template <typename F>
decltype(auto) dispatch_bits(int64_t bit, F&& f) {
  switch (bit) {
    case 2: return f(Bits<2>{});
    case 3: return f(Bits<3>{});
    case 4: return f(Bits<4>{});
    case 8: return f(Bits<8>{});
  }
  TORCH_CHECK_VALUE(false, "lowbit: unsupported bit width ", bit);
}

}  // namespace lowbit
