// The generic argument checks of every op, on every backend: dtype, device,
// layout, rank and index vectors.
//
// Convention: a wrong dtype, device or memory layout raises RuntimeError
// (TORCH_CHECK); a wrong value, shape or bit width raises ValueError
// (TORCH_CHECK_VALUE). Every message starts with "<op>: <argument>".
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace lowbit {

inline void check_dtype(const char* op, const char* name, const at::Tensor& t, at::ScalarType want) {
  TORCH_CHECK(t.scalar_type() == want, op, ": ", name, " must be ", want, ", got ", t.scalar_type());
}

inline void check_float_dtype(const char* op, const char* name, const at::Tensor& t) {
  const auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16, op, ": ", name,
              " must be float32, float16 or bfloat16, got ", s);
}

inline void check_same_device(const char* op, const char* name, const at::Tensor& t,
                              const at::Tensor& ref) {
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " is on ", t.device(),
              " but the other arguments are on ", ref.device());
}

inline void check_contiguous(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_dim(const char* op, const char* name, const at::Tensor& t, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == dim, op, ": ", name, " must be ", dim, "-D, got shape ", t.sizes());
}

// The least and greatest value of a non-empty CPU index vector, in one pass:
// at::aminmax would cost two tensors, a dispatch and two reads back, a good
// part of a small matvec's fixed cost (gptq_gemm checks g_idx every call).
template <class T>
inline std::pair<int64_t, int64_t> index_range(const at::Tensor& idx) {
  const at::Tensor c = idx.contiguous();
  const T* p = c.data_ptr<T>();
  T lo = p[0], hi = p[0];
  for (int64_t i = 1; i < c.numel(); ++i) {
    lo = std::min(lo, p[i]);
    hi = std::max(hi, p[i]);
  }
  return {lo, hi};
}

// Validates an int32/int64 index vector of length K (or empty) whose values
// must lie in [0, upper), and returns it as a contiguous int32 tensor. Values
// are inspected only for CPU tensors: device kernels must not sync with the
// host, so they check ranges themselves.
inline at::Tensor check_index_vector(const char* op, const char* name, const at::Tensor& idx,
                                     const at::Tensor& ref, int64_t K, int64_t upper) {
  TORCH_CHECK(idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", idx.scalar_type());
  check_same_device(op, name, idx, ref);
  if (idx.numel() == 0) return idx.to(at::kInt);
  check_dim(op, name, idx, 1);
  TORCH_CHECK_VALUE(idx.size(0) == K, op, ": ", name, " must have K=", K, " entries (or be empty), got ",
                    idx.size(0));
  if (idx.is_cpu()) {
    // Check before narrowing to int32, so that large int64 values cannot wrap into range.
    const auto [lo_v, hi_v] = idx.scalar_type() == at::kInt ? index_range<int32_t>(idx) : index_range<int64_t>(idx);
    TORCH_CHECK_VALUE(lo_v >= 0 && hi_v < upper, op, ": ", name, " values must lie in [0, ", upper,
                      "), found min ", lo_v, " and max ", hi_v);
  } else if (idx.scalar_type() == at::kLong) {
    // The device kernels' own range checks see int32 values: an int64 value
    // outside int32 (which narrowing would wrap, 2^32 + 1 to 1) becomes -1,
    // which they reject, without a sync with the host.
    const at::Tensor wraps = idx.lt(0).logical_or_(idx.gt(std::numeric_limits<int32_t>::max()));
    return at::where(wraps, at::scalar_tensor(-1, idx.options()), idx).to(at::kInt).contiguous();
  }
  return idx.to(at::kInt).contiguous();
}

// Validates that a non-empty index vector (already range-checked) is a
// permutation of [0, K).
inline void check_permutation(const char* op, const char* name, const at::Tensor& perm32) {
  if (perm32.numel() == 0 || !perm32.is_cpu()) return;
  const int64_t K = perm32.numel();
  std::vector<bool> seen(K, false);
  const int32_t* p = perm32.data_ptr<int32_t>();
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK_VALUE(!seen[p[i]], op, ": ", name, " is not a permutation: value ", p[i],
                      " appears twice (second time at index ", i, ")");
    seen[p[i]] = true;
  }
}

}  // namespace lowbit
