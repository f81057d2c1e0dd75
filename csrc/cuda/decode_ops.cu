// The decode-step ops on CUDA: rms_norm (a block per row) and
// decode_attention (the new key and value written by one kernel, then a
// block per query head). Sums run in fp32 in a fixed order: no atomics.
#include "../core/rotary.h"
#include "../ops/backend_ops.h"
#include "../ops/decode_checks.h"
#include "common.cuh"

#include <limits>

namespace lowbit {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// The sum (or maximum) of one value per thread of the block, on every thread.
template <bool kMax>
__device__ float block_reduce(float v, float* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      const float other = shared[threadIdx.x + stride];
      shared[threadIdx.x] = kMax ? fmaxf(shared[threadIdx.x], other) : shared[threadIdx.x] + other;
    }
    __syncthreads();
  }
  const float result = shared[0];
  __syncthreads();
  return result;
}

// v rounded to the format `kind`, back in fp32.
__device__ __forceinline__ float rounded(Float kind, float v) {
  switch (kind) {
    case Float::F16: return static_cast<float>(c10::Half(v));
    case Float::BF16: return static_cast<float>(c10::BFloat16(v));
    default: return v;
  }
}

__global__ void rms_norm_kernel(const void* x, const void* weight, void* out, Float kind, int64_t n, float eps) {
  __shared__ float shared[kThreads];
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  float sum = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = load_float(x, kind, base + i);
    sum += v * v;
  }
  // 1 / sqrtf, both IEEE-rounded as the CPU kernel computes it (rsqrtf is approximate).
  const float inv = 1.0f / sqrtf(block_reduce<false>(sum, shared) / static_cast<float>(n) + eps);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    // Normalised in fp32, rounded to x's dtype, then scaled (transformers' order).
    const float normed = rounded(kind, load_float(x, kind, base + i) * inv);
    store_float(out, kind, base + i, __fmul_rn(load_float(weight, kind, i), normed));
  }
}

// Element i of the head at `row` of x, its first `rotated` values rotated.
__device__ float rotated_at(const void* x, const void* cos, const void* sin, Float kind, int64_t row, int64_t i,
                            int64_t rotated) {
  return rotary::element([=](int64_t j) { return load_float(x, kind, row + j); },
                         [=](int64_t j) { return load_float(cos, kind, j); },
                         [=](int64_t j) { return load_float(sin, kind, j); }, i, rotated);
}

// Block h: row `position` of key-value head h, the key rotated.
__global__ void append_kernel(const void* k, const void* v, const void* cos, const void* sin, void* key_cache,
                              void* value_cache, Float kind, int64_t dim, int64_t rotated, int64_t capacity,
                              int64_t position) {
  const int64_t h = blockIdx.x, row = (h * capacity + position) * dim;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    store_float(key_cache, kind, row + i, rotated_at(k, cos, sin, kind, h * dim, i, rotated));
    store_float(value_cache, kind, row + i, load_float(v, kind, h * dim + i));
  }
}

// Block h: query head h against rows [start, start + keys) of its key-value
// head; the scores go through `scores` [q_heads, keys] (global: any length fits).
__global__ void attend_kernel(const void* q, const void* cos, const void* sin, const void* key_cache,
                              const void* value_cache, void* out, float* scores, Float kind, int64_t dim,
                              int64_t rotated, int64_t capacity, int64_t start, int64_t keys, int64_t groups,
                              float scale, float softcap, const float* sinks) {
  extern __shared__ float query[];  // dim values, then kThreads for the reductions
  float* shared = query + dim;
  const int64_t h = blockIdx.x, kv = ((h / groups) * capacity + start) * dim;
  float* s = scores + h * keys;
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) query[i] = rotated_at(q, cos, sin, kind, h * dim, i, rotated);
  __syncthreads();
  float top = -INFINITY;
  for (int64_t p = threadIdx.x; p < keys; p += blockDim.x) {
    float dot = 0.0f;
    for (int64_t i = 0; i < dim; ++i) dot += query[i] * load_float(key_cache, kind, kv + p * dim + i);
    const float scaled = dot * scale;
    s[p] = softcap > 0.0f ? tanhf(scaled / softcap) * softcap : scaled;  // Gemma 2's soft cap
    top = fmaxf(top, s[p]);
  }
  top = block_reduce<true>(top, shared);
  if (sinks != nullptr) top = fmaxf(top, sinks[h]);  // the sink joins the maximum and the divisor only
  float total = 0.0f;
  for (int64_t p = threadIdx.x; p < keys; p += blockDim.x) total += s[p] = expf(s[p] - top);
  total = block_reduce<false>(total, shared);  // its barriers also publish every s[p]
  if (sinks != nullptr) total += expf(sinks[h] - top);
  for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) {
    float acc = 0.0f;
    for (int64_t p = 0; p < keys; ++p) acc += s[p] * load_float(value_cache, kind, kv + p * dim + i);
    store_float(out, kind, h * dim + i, acc / total);
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rms_norm(x, weight, eps);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor out = at::empty_like(xc);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : xc.numel() / n;
  TORCH_CHECK_VALUE(rows <= std::numeric_limits<int32_t>::max(), "rms_norm: x has too many rows (", rows, ")");
  if (rows == 0) return out;
  rms_norm_kernel<<<static_cast<unsigned int>(rows), kThreads, 0, current_stream()>>>(
      xc.const_data_ptr(), wc.const_data_ptr(), out.mutable_data_ptr(), float_kind(x.scalar_type()), n,
      static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cos,
                            const at::Tensor& sin, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            int64_t position, double scale, int64_t start, const std::optional<at::Tensor>& sinks,
                            double softcap) {
  const auto d =
      check_decode_attention(q, k, v, cos, sin, key_cache, value_cache, position, scale, start, sinks, softcap);
  const at::Tensor sink_logits = sinks.has_value() ? sinks->to(at::kFloat).contiguous() : at::Tensor();
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK_VALUE(d.dim <= 4096 && d.q_heads <= std::numeric_limits<int32_t>::max(),
                    "decode_attention: at most 4096 values per head on CUDA, got ", d.dim);
  at::Tensor out = at::empty_like(q);
  const int64_t keys = position + 1 - start;
  at::Tensor scores = at::empty({d.q_heads, keys}, q.options().dtype(at::kFloat));
  const Float kind = float_kind(q.scalar_type());
  const cudaStream_t stream = current_stream();
  append_kernel<<<static_cast<unsigned int>(d.kv_heads), 128, 0, stream>>>(
      k.const_data_ptr(), v.const_data_ptr(), cos.const_data_ptr(), sin.const_data_ptr(),
      key_cache.mutable_data_ptr(), value_cache.mutable_data_ptr(), kind, d.dim, d.rotated, d.capacity, position);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const size_t shared = static_cast<size_t>(d.dim + kThreads) * sizeof(float);
  attend_kernel<<<static_cast<unsigned int>(d.q_heads), kThreads, shared, stream>>>(
      q.const_data_ptr(), cos.const_data_ptr(), sin.const_data_ptr(), key_cache.const_data_ptr(),
      value_cache.const_data_ptr(), out.mutable_data_ptr(), scores.mutable_data_ptr<float>(), kind, d.dim,
      d.rotated, d.capacity, start, keys, d.q_heads / d.kv_heads, static_cast<float>(scale),
      static_cast<float>(softcap), sinks.has_value() ? sink_logits.const_data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace cuda
}  // namespace lowbit
