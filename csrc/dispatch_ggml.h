// Turns a run-time ggml type id into a compile-time Type, from the one table.
#pragma once

#include <c10/util/Exception.h>

#include <type_traits>

#include "core/ggml_types.h"

namespace lowbit {

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
