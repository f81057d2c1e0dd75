// Argument checks of the decode-step ops (rms_norm, decode_attention), the
// same on every backend and in their fake kernels (python/lowbit/ops.py).
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <limits>

#include "checks.h"

namespace lowbit {

inline void check_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "rms_norm";
  check_float_dtype(op, "x", x);
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), op, ": weight must be ", x.scalar_type(), " (x's dtype), got ",
              weight.scalar_type());
  check_same_device(op, "weight", weight, x);
  TORCH_CHECK_VALUE(x.dim() >= 1, op, ": x must have at least 1 dimension, got a scalar");
  check_dim(op, "weight", weight, 1);
  TORCH_CHECK_VALUE(weight.size(0) == x.size(-1), op, ": weight must have x's last dimension ", x.size(-1),
                    " entries, got ", weight.size(0));
  TORCH_CHECK_VALUE(std::isfinite(eps) && eps >= 0, op, ": eps must be finite and non-negative");
}

struct DecodeAttentionDims {
  int64_t q_heads, kv_heads, dim, capacity;
  int64_t rotated;  // the leading values of each head that rotate: cos's length
};

inline DecodeAttentionDims check_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& cos, const at::Tensor& sin,
                                                  const at::Tensor& key_cache, const at::Tensor& value_cache,
                                                  int64_t position, double scale, int64_t start,
                                                  const std::optional<at::Tensor>& sinks, double softcap) {
  constexpr const char* op = "decode_attention";
  check_float_dtype(op, "q", q);
  const std::pair<const char*, const at::Tensor*> others[] = {
      {"k", &k}, {"v", &v}, {"cos", &cos}, {"sin", &sin}, {"key_cache", &key_cache}, {"value_cache", &value_cache}};
  for (const auto& [name, t] : others) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), op, ": ", name, " must be ", q.scalar_type(), " (q's dtype), got ",
                t->scalar_type());
    check_same_device(op, name, *t, q);
  }
  check_dim(op, "q", q, 2);
  check_dim(op, "k", k, 2);
  check_dim(op, "v", v, 2);
  check_dim(op, "cos", cos, 1);
  check_dim(op, "sin", sin, 1);
  check_dim(op, "key_cache", key_cache, 3);
  check_dim(op, "value_cache", value_cache, 3);
  const int64_t q_heads = q.size(0), dim = q.size(1), kv_heads = k.size(0), capacity = key_cache.size(1);
  TORCH_CHECK_VALUE(dim > 0 && dim % 2 == 0, op, ": q's head size must be even and positive, got ", dim);
  TORCH_CHECK_VALUE(kv_heads > 0 && q_heads > 0 && q_heads % kv_heads == 0, op, ": q's ", q_heads,
                    " heads must be a positive multiple of k's ", kv_heads);
  TORCH_CHECK_VALUE(k.size(1) == dim && v.sizes() == k.sizes(), op, ": k and v must be [", kv_heads, ", ", dim,
                    "], got ", k.sizes(), " and ", v.sizes());
  const int64_t rotated = cos.size(0);
  TORCH_CHECK_VALUE(sin.size(0) == rotated && rotated > 0 && rotated % 2 == 0 && rotated <= dim, op,
                    ": cos and sin must have one even number of entries in [2, ", dim, "] (q's head size), got ",
                    cos.size(0), " and ", sin.size(0));
  TORCH_CHECK_VALUE(key_cache.size(0) == kv_heads && key_cache.size(2) == dim, op, ": key_cache must be [", kv_heads,
                    ", capacity, ", dim, "], got ", key_cache.sizes());
  TORCH_CHECK_VALUE(value_cache.sizes() == key_cache.sizes(), op, ": value_cache must have key_cache's shape ",
                    key_cache.sizes(), ", got ", value_cache.sizes());
  TORCH_CHECK_VALUE(position >= 0 && position < capacity, op, ": position must lie in [0, ", capacity,
                    ") (the caches' capacity), got ", position);
  TORCH_CHECK_VALUE(start >= 0 && start <= position, op, ": start must lie in [0, ", position,
                    "] (position), got ", start);
  // The kernels compute in fp32: a scale or cap past fp32's range would be inf there (NaN outputs), and a
  // cap below its smallest positive value 0, which means no cap at all.
  constexpr double kMaxF = std::numeric_limits<float>::max(), kMinF = std::numeric_limits<float>::denorm_min();
  TORCH_CHECK_VALUE(std::isfinite(scale) && std::abs(scale) <= kMaxF, op, ": scale must be finite in fp32 (|scale| <= ",
                    kMaxF, "), got ", scale);
  TORCH_CHECK_VALUE(softcap == 0 || (softcap >= kMinF && softcap <= kMaxF), op,
                    ": softcap must be finite and >= 0 (0: none) in fp32 (0 or in [", kMinF, ", ", kMaxF, "]), got ",
                    softcap);
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == q.scalar_type(), op, ": sinks must be ", q.scalar_type(), " (q's dtype), got ",
                sinks->scalar_type());
    check_same_device(op, "sinks", *sinks, q);
    check_dim(op, "sinks", *sinks, 1);
    TORCH_CHECK_VALUE(sinks->size(0) == q_heads, op, ": sinks must have one entry per query head (", q_heads,
                      "), got ", sinks->size(0));
  }
  const std::pair<const char*, const at::Tensor*> all[] = {{"q", &q}, {"k", &k}, {"v", &v}, {"cos", &cos},
                                                           {"sin", &sin}, {"key_cache", &key_cache},
                                                           {"value_cache", &value_cache}};
  for (const auto& [name, t] : all) check_contiguous(op, name, *t);
  // The caches are written: they may share memory with no other argument.
  for (const auto& [cache_name, cache] : {all[5], all[6]}) {
    for (const auto& [name, t] : all) {
      TORCH_CHECK(t == cache || at::get_overlap_status(*cache, *t) == at::MemOverlapStatus::No, op, ": ", cache_name,
                  " shares memory with ", name);
    }
    // sinks may be strided, where get_overlap_status gives up (TooHard) even
    // across storages: there, what counts is whether its storage is the cache's.
    TORCH_CHECK(!sinks.has_value() || sinks->numel() == 0 ||
                    (sinks->is_non_overlapping_and_dense()
                         ? at::get_overlap_status(*cache, *sinks) == at::MemOverlapStatus::No
                         : !sinks->storage().is_alias_of(cache->storage())),
                op, ": ", cache_name, " shares memory with sinks");
  }
  return {q_heads, kv_heads, dim, capacity, rotated};
}

}  // namespace lowbit
