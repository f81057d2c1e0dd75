// The format table's queries as ops (they take no tensor, so one composite
// kernel serves every backend).
#include <torch/library.h>

#include <string>
#include <vector>

#include "../core/ggml_types.h"

namespace {

lowbit::ggml::RuntimeInfo checked_type(const char* op, int64_t type) {
  const lowbit::ggml::RuntimeInfo info = lowbit::ggml::runtime_info(type);
  TORCH_CHECK_VALUE(info.ok, op, ": type ", type, " is not a ggml weight type lowbit supports (unknown or removed id)");
  return info;
}

// [elements per block, bytes per block] of a ggml type id.
std::vector<int64_t> ggml_type_info(int64_t type) {
  const lowbit::ggml::RuntimeInfo info = checked_type("ggml_type_info", type);
  return {info.block, info.bytes};
}

// The name of a ggml type id (ggml's own, as "Q4_K"): files can hold types
// newer than gguf-py's list.
std::string ggml_type_name(int64_t type) { return checked_type("ggml_type_name", type).name; }

}  // namespace

TORCH_LIBRARY_IMPL(lowbit, CompositeImplicitAutograd, m) {
  m.impl("ggml_type_info", &ggml_type_info);
  m.impl("ggml_type_name", &ggml_type_name);
}
