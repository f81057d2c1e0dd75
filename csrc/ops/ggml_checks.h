// Argument checks of the GGUF ops, shared by every backend: a weight's type
// and byte count, the matmul and mixture-of-experts shapes, and the exact
// sequence each op runs (conventions in checks.h).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/safe_numerics.h>

#include <optional>
#include <utility>

#include "../core/ggml_types.h"
#include "checks.h"

namespace lowbit {

// Validates a type id and a matrix of `rows` x `cols` weights stored in W;
// returns the ggml type info. W must hold exactly rows * row_bytes bytes (in
// any shape: only its bytes mean something). `rows_name` is the op's name for
// the row count ("m" or "row"); the column count is always "n".
inline ggml::RuntimeInfo check_ggml_weight(const char* op, const at::Tensor& W, int64_t type, const char* rows_name,
                                           int64_t rows, int64_t cols) {
  const ggml::RuntimeInfo info = ggml::runtime_info(type);
  TORCH_CHECK_VALUE(info.ok, op, ": type ", type, " is not a ggml weight type lowbit supports (unknown or removed id)");
  check_dtype(op, "W", W, at::kByte);
  check_contiguous(op, "W", W);
  TORCH_CHECK_VALUE(rows >= 0, op, ": ", rows_name, " must be non-negative, got ", rows);
  TORCH_CHECK_VALUE(cols >= 0, op, ": n must be non-negative, got ", cols);
  TORCH_CHECK_VALUE(cols % info.block == 0, op, ": n=", cols, " is not a multiple of the ", info.name,
                    " block size ", info.block);
  int64_t row_bytes = 0, total = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(cols / info.block, static_cast<int64_t>(info.bytes), &row_bytes), op,
                    ": n=", cols, " ", info.name, " weights per row overflow int64 in bytes");
  TORCH_CHECK_VALUE(!c10::mul_overflows(rows, row_bytes, &total), op, ": ", rows, " rows of ", row_bytes,
                    " bytes overflow int64");
  TORCH_CHECK_VALUE(W.numel() == total, op, ": W has ", W.numel(), " bytes but ", rows, " rows of ", cols, " ",
                    info.name, " weights need ", total, " (", row_bytes, " per row)");
  return info;
}

// Validates X [M, n] against a weight with `rows` rows of the given type.
inline ggml::RuntimeInfo check_ggml_matmul(const char* op, const at::Tensor& W, const at::Tensor& X, int64_t type,
                                           int64_t rows) {
  check_float_dtype(op, "X", X);
  check_same_device(op, "X", X, W);
  check_dim(op, "X", X, 2);
  return check_ggml_weight(op, W, type, "row", rows, X.size(1));
}

// The shapes of a validated ggml_mul_mat_id call, and its ids as a
// contiguous int32 [tokens * slots] tensor.
struct GgmlMatmulId {
  ggml::RuntimeInfo info;
  int64_t experts, tokens, slots, n;
  bool per_slot;  // X [tokens, slots, n] (else [tokens, n], the same row for every slot)
  at::Tensor ids;
};

// Validates W [experts, row, row_bytes] (the experts' weights one after
// another, as a GGUF expert tensor stores them), X [tokens, n] or [tokens,
// slots, n] and ids [tokens, slots] (int32 / int64, values in [0, experts):
// checked here for CPU tensors, by the device kernels otherwise).
inline GgmlMatmulId check_ggml_matmul_id(const char* op, const at::Tensor& W, const at::Tensor& X,
                                         const at::Tensor& ids, int64_t type, int64_t row) {
  check_float_dtype(op, "X", X);
  check_same_device(op, "X", X, W);
  TORCH_CHECK_VALUE(X.dim() == 2 || X.dim() == 3, op, ": X must be [tokens, n] or [tokens, slots, n], got shape ",
                    X.sizes());
  check_dim(op, "W", W, 3);
  check_dim(op, "ids", ids, 2);
  const int64_t tokens = ids.size(0), slots = ids.size(1), n = X.size(-1), experts = W.size(0);
  TORCH_CHECK_VALUE(X.size(0) == tokens && (X.dim() == 2 || X.size(1) == slots), op, ": X must be [tokens=", tokens,
                    ", n]", " or [tokens=", tokens, ", slots=", slots, ", n] for ids ", ids.sizes(), ", got ",
                    X.sizes());
  int64_t weight_rows = 0;
  TORCH_CHECK_VALUE(!c10::mul_overflows(experts, row, &weight_rows), op, ": ", experts, " experts of ", row,
                    " rows overflow int64");
  const ggml::RuntimeInfo info = check_ggml_weight(op, W, type, "row", weight_rows, n);
  TORCH_CHECK_VALUE(W.size(1) == row, op, ": W must be [experts, row=", row, ", row_bytes], got shape ", W.sizes());
  TORCH_CHECK_VALUE(experts > 0 || tokens * slots == 0, op, ": W holds no experts for the ", tokens * slots,
                    " (token, slot) pairs of ids ", ids.sizes());
  const at::Tensor ids32 = check_index_vector(op, "ids", ids.reshape(-1), W, tokens * slots, experts);
  return {info, experts, tokens, slots, n, X.dim() == 3, ids32};
}

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

// Validates ggml_quantize's x [m, n] (n whole blocks) and type (the types
// lowbit writes: Q8_0 and Q6_K); returns the type info.
inline ggml::RuntimeInfo check_ggml_quantize(const at::Tensor& x, int64_t type) {
  const char* op = "ggml_quantize";
  const ggml::RuntimeInfo info = ggml::runtime_info(type);
  TORCH_CHECK_VALUE(info.ok, op, ": type ", type, " is not a ggml weight type lowbit supports (unknown or removed id)");
  TORCH_CHECK_VALUE(type == static_cast<int64_t>(ggml::Type::Q8_0) || type == static_cast<int64_t>(ggml::Type::Q6_K),
                    op, ": type ", type, " (", info.name, "): lowbit writes Q8_0 (8) and Q6_K (14) only");
  check_float_dtype(op, "x", x);
  check_contiguous(op, "x", x);
  check_dim(op, "x", x, 2);
  TORCH_CHECK_VALUE(x.size(1) % info.block == 0, op, ": x's rows (n=", x.size(1), ") are not a multiple of the ",
                    info.name, " block size ", info.block);
  return info;
}

}  // namespace lowbit
