// Whole-op argument validation of the GGUF ops that goes beyond
// ggml_checks.h, shared by every backend (csrc/cpu/ggml_cpu.cpp, csrc/cuda/*.cu).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <utility>

#include "ggml_checks.h"

namespace lowbit {

// ggml_dequantize: validates the weight and the requested output dtype
// (fp16 when none is given); returns the type info and the dtype.
inline std::pair<ggml::RuntimeInfo, at::ScalarType> check_ggml_dequantize(const at::Tensor& W, int64_t type,
                                                                          int64_t m, int64_t n,
                                                                          std::optional<at::ScalarType> dtype) {
  const char* op = "ggml_dequantize";
  const ggml::RuntimeInfo info = check_ggml_weight(op, W, type, "m", m, n);
  const at::ScalarType out_type = dtype.value_or(at::kHalf);
  TORCH_CHECK(out_type == at::kFloat || out_type == at::kHalf || out_type == at::kBFloat16, op,
              ": dtype must be float32, float16 or bfloat16, got ", out_type);
  return {info, out_type};
}

}  // namespace lowbit
