// Turns a run-time bit width or ggml type id into a compile-time template
// argument, so each kernel family is written once and specialised per bit
// width or per type of the one type table.
#pragma once

#include <c10/util/Exception.h>

#include <type_traits>

#include "../core/ggml_types.h"

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

template <ggml::Type T>
using GgmlType = std::integral_constant<ggml::Type, T>;

// Calls f(GgmlType<T>{}) for the type with id `type`; `type` must already
// have been validated.
template <typename F>
decltype(auto) dispatch_ggml_type(int64_t type, F&& f) {
  switch (type) {
#define LOWBIT_GGML_DISPATCH(name, id, block, bytes, sub, has_min, act) \
  case id:                                                              \
    return f(GgmlType<ggml::Type::name>{});
    LOWBIT_GGML_TYPES(LOWBIT_GGML_DISPATCH)
#undef LOWBIT_GGML_DISPATCH
  }
  TORCH_CHECK_VALUE(false, "lowbit: unsupported ggml type ", type);
}

}  // namespace lowbit
