// The decode-step ops on the CPU: rms_norm and decode_attention. A decode
// step makes a few of each per layer on vectors of a few hundred values, so
// they are written for low fixed cost: one pass, no temporaries beyond a
// row of scores, lowbit's pool (parallel.h) over rows or key-value heads,
// as the matmuls around them.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../core/rotary.h"
#include "../ops/backend_ops.h"
#include "../ops/decode_checks.h"
#include "decode_kernels.h"
#include "isa.h"
#include "parallel.h"

#include "softmax.h"

namespace lowbit {
namespace cpu {
namespace {

// Sum of a[i] * b[i] over n values, in 8 fp32 lanes the compiler can keep in
// vector registers (a single running sum would serialise on its adds).
template <typename A, typename B>
[[gnu::always_inline]] inline float dot(const A* a, const B* b, int64_t n) {
  float lanes[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += static_cast<float>(a[i + j]) * static_cast<float>(b[i + j]);
  }
  for (; i < n; ++i) lanes[0] += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// Rows are short: a task takes enough of them to outweigh its scheduling.
constexpr int64_t kNormValuesPerTask = 16384;

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, weight, eps);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : xc.numel() / n;
  const float feps = static_cast<float>(eps);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const scalar_t* wp = wc.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, kNormValuesPerTask / std::max<int64_t>(n, 1));
    parallel_for(rows, grain, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* row = xp + r * n;
        const float inv = 1.0f / std::sqrt(dot(row, row, n) / static_cast<float>(n) + feps);
        for (int64_t i = 0; i < n; ++i) {
          // Normalised in fp32, rounded to x's dtype, then scaled: transformers' order.
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(row[i]) * inv);
          op[r * n + i] = static_cast<scalar_t>(static_cast<float>(wp[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

namespace {

// One key-value head's group of query heads (already rotated, fp32) against
// its rows [0, keys): scores, softmax and the weighted sum of values, the
// rows read once for the whole group; softcap > 0: the scores soft-capped;
// `sinks`: the group's sink logits (nullptr for none). `scratch` holds
// groups * (keys + dim + 1) values.
template <typename T>
[[gnu::always_inline]] inline void attend_group(const float* queries, const T* key_rows, const T* value_rows,
                                                T* out, int64_t groups, int64_t keys, int64_t dim, float scale,
                                                float softcap, const float* sinks, float* scratch) {
  float* scores = scratch;                 // [groups, keys]
  float* acc = scratch + groups * keys;    // [groups, dim]
  for (int64_t p = 0; p < keys; ++p) {
    for (int64_t j = 0; j < groups; ++j) {
      scores[j * keys + p] = dot(queries + j * dim, key_rows + p * dim, dim) * scale;
    }
  }
  std::fill(acc, acc + groups * dim, 0.0f);
  float* totals = acc + groups * dim;      // [groups]
  for (int64_t j = 0; j < groups; ++j) {
    if (softcap > 0.0f) soft_cap(scores + j * keys, keys, softcap);
    totals[j] = exponentiate(scores + j * keys, keys, sinks != nullptr ? sinks + j : nullptr);
  }
  for (int64_t p = 0; p < keys; ++p) {
    const T* row = value_rows + p * dim;
    for (int64_t j = 0; j < groups; ++j) {
      const float w = scores[j * keys + p];
      float* a = acc + j * dim;
      for (int64_t i = 0; i < dim; ++i) a[i] += w * static_cast<float>(row[i]);
    }
  }
  for (int64_t j = 0; j < groups; ++j) {
    for (int64_t i = 0; i < dim; ++i) out[j * dim + i] = static_cast<T>(acc[j * dim + i] / totals[j]);
  }
}


// Runs the AVX2 kernel where it applies (heads of a multiple of 32 values,
// cpu_isa at AVX2 or above); false where the portable loops must.
template <typename T>
bool attend_group_simd(const float* queries, const T* key_rows, const T* value_rows, T* out, int64_t groups,
                       int64_t keys, int64_t dim, float scale, float softcap, const float* sinks, float* scratch) {
#if LOWBIT_X86_SIMD
  constexpr bool f32 = std::is_same_v<T, float>, bf16 = std::is_same_v<T, at::BFloat16>;
  if constexpr (f32 || bf16 || std::is_same_v<T, at::Half>) {  // not double
    if (dim % 32 == 0 && active_isa() >= Isa::kAvx2) {
      const ggml::Type type = f32 ? ggml::Type::F32 : bf16 ? ggml::Type::BF16 : ggml::Type::F16;
      decode_attend_group_avx2(type, queries, key_rows, value_rows, out, groups, keys, dim, scale, softcap, sinks,
                               scratch);
      return true;
    }
  }
#endif
  return false;
}

}  // namespace

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t position, double scale, int64_t start, const std::optional<at::Tensor>& sinks,
                            double softcap) {
  const auto d =
      check_decode_attention(q, k, v, cos, sin, key_cache, value_cache, position, scale, start, sinks, softcap);
  const float fsoftcap = static_cast<float>(softcap);
  at::Tensor out = at::empty_like(q);
  // Each query head's sink logit, fp32 (transformers adds it in the scores' dtype, which holds it exactly).
  const at::Tensor sink_logits = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const float* sp32 = sinks.has_value() ? sink_logits.const_data_ptr<float>() : nullptr;
  const int64_t dim = d.dim, groups = d.q_heads / d.kv_heads, keys = position + 1 - start;
  const float fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_attention", [&] {
    const scalar_t* cp = cos.const_data_ptr<scalar_t>();
    const scalar_t* sp = sin.const_data_ptr<scalar_t>();
    scalar_t* kc = key_cache.mutable_data_ptr<scalar_t>();
    scalar_t* vc = value_cache.mutable_data_ptr<scalar_t>();
    const auto cos_at = [cp](int64_t i) { return static_cast<float>(cp[i]); };
    const auto sin_at = [sp](int64_t i) { return static_cast<float>(sp[i]); };
    auto rotate = [&](const scalar_t* x, int64_t i) {
      return rotary::element([x](int64_t j) { return static_cast<float>(x[j]); }, cos_at, sin_at, i, d.rotated);
    };
    // The new token's key (rotated) and value, at row `position` of each head.
    for (int64_t h = 0; h < d.kv_heads; ++h) {
      const scalar_t* kh = k.const_data_ptr<scalar_t>() + h * dim;
      const scalar_t* vh = v.const_data_ptr<scalar_t>() + h * dim;
      scalar_t* krow = kc + (h * d.capacity + position) * dim;
      scalar_t* vrow = vc + (h * d.capacity + position) * dim;
      for (int64_t i = 0; i < dim; ++i) {
        krow[i] = static_cast<scalar_t>(rotate(kh, i));
        vrow[i] = vh[i];
      }
    }
    const scalar_t* qp = q.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    parallel_for(d.kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> queries(groups * dim), scratch(groups * (keys + dim + 1));
      for (int64_t h = begin; h < end; ++h) {
        // Query heads h * groups .. (h + 1) * groups - 1 read key-value head h.
        for (int64_t j = 0; j < groups; ++j) {
          const scalar_t* head = qp + (h * groups + j) * dim;
          for (int64_t i = 0; i < dim; ++i) queries[j * dim + i] = rotate(head, i);
        }
        const scalar_t* key_rows = kc + (h * d.capacity + start) * dim;
        const scalar_t* value_rows = vc + (h * d.capacity + start) * dim;
        scalar_t* heads_out = op + h * groups * dim;
        const float* group_sinks = sp32 != nullptr ? sp32 + h * groups : nullptr;
        if (attend_group_simd(queries.data(), key_rows, value_rows, heads_out, groups, keys, dim, fscale, fsoftcap,
                              group_sinks, scratch.data())) {
          continue;
        }
        attend_group(queries.data(), key_rows, value_rows, heads_out, groups, keys, dim, fscale, fsoftcap,
                     group_sinks, scratch.data());
      }
    });
  });
  return out;
}

}  // namespace cpu
}  // namespace lowbit
