// The kernels of CUDA ggml_mul_mat_vec_a8, ggml_mul_mat_a8 and ggml_mul_mat_id
// (ggml_matmul.cu launches them and describes the design): the activation
// quantizer, the fused lane-group matvecs, and the grouping of (token, slot)
// pairs by expert. Also compiled as host code by the CPU emulator (tests/simt).
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_slices.h"
#include "common.cuh"

namespace lowbit {
namespace cuda {
namespace matvec {

using ggml::Act;
using ggml::ActLayout;
using ggml::TypeInfo;

// Activation rows per fused launch (accumulators in registers).
constexpr int kMaxRows = 8;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;

// log2 of the lanes of a group that owns one weight row: about the row's
// units (32-element slices for the sliced types, else blocks), at most 32.
template <ggml::Type T>
inline int lanes_log2(int64_t blocks_per_row) {
  const int64_t units = ggml::kSliced<T> ? blocks_per_row * (TypeInfo<T>::kBlock / ggml::kSliceElems) : blocks_per_row;
  int lg = 0;
  while (lg < 5 && (int64_t{1} << lg) < units) ++lg;
  return lg;
}

// The exact integer sum of n int8 products, 4 per __dp4a (n % 4 == 0; both
// pointers 4-byte aligned: a sub-block of a Decoded<T> or of an activation
// row, whose offsets are multiples of 16).
struct Dp4aDot {
  __device__ __forceinline__ int32_t operator()(const int8_t* w, const int8_t* x, int n) const {
    const int* w4 = reinterpret_cast<const int*>(w);
    const int* x4 = reinterpret_cast<const int*>(x);
    int32_t isum = 0;
#pragma unroll
    for (int i = 0; i < n / 4; ++i) isum = __dp4a(w4[i], x4[i], isum);
    return isum;
  }
};

// All M activation rows, quantized: q [M, n], d [M, n / kBlock], sum [M, n / kSumBlock].
template <Act A>
struct QuantizedActs {
  const int8_t* q;
  const float* d;
  const float* sum;
  int64_t n;
  __device__ __forceinline__ ggml::ActRow row(int64_t m) const {
    using L = ActLayout<A>;
    return {q + m * n, d + m * (n / L::kBlock), sum + m * (n / L::kSumBlock)};
  }
};

// A warp per activation block (32 or 256 values: one or eight per lane),
// quantized as the CPU's quantize_act_block does, through the same helpers
// (core/ggml_q8.h) and with the block's maximum and sums formed by shuffles
// (exact: maxima and integer sums do not depend on their order), so the
// blocks are the CPU's bit for bit.
template <Act A>
__global__ void __launch_bounds__(kThreads)
    quantize_acts_kernel(const float* x, int64_t nblocks, int8_t* q, float* d, float* sum) {
  using L = ActLayout<A>;
  constexpr int kPer = L::kBlock / 32;
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5); b < nblocks; b += warps) {
    float v[kPer];
    bool finite = true;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      v[i] = x[b * L::kBlock + lane * kPer + i];
      finite &= isfinite(v[i]);
    }
    int8_t* qb = q + b * L::kBlock;
    float* sb = sum + b * (L::kBlock / L::kSumBlock);
    if (!__all_sync(kAll, finite)) {
      if (lane == 0) ggml::non_finite_act_block<A>(qb, d + b, sb);
      continue;
    }
    int8_t levels[kPer];
    int s = 0;
    if constexpr (A == Act::Q8_K) {
      // The value of largest magnitude, the first of equals: each lane's
      // first, then the lowest index among the lanes' equals.
      float amax = 0.0f, max = 0.0f;
      int at = 0;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        if (fabsf(v[i]) > amax) {
          amax = fabsf(v[i]);
          max = v[i];
          at = lane * kPer + i;
        }
      }
      for (int off = 16; off > 0; off >>= 1) {
        const float o_amax = __shfl_xor_sync(kAll, amax, off), o_max = __shfl_xor_sync(kAll, max, off);
        const int o_at = __shfl_xor_sync(kAll, at, off);
        if (o_amax > amax || (o_amax == amax && o_at < at)) {
          amax = o_amax;
          max = o_max;
          at = o_at;
        }
      }
      const float iscale = amax == 0.0f ? 0.0f : -127.0f / max;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        levels[i] = amax == 0.0f ? int8_t{0} : ggml::q8k_level(v[i], iscale);
        s += levels[i];
      }
      s += __shfl_xor_sync(kAll, s, 1);  // lanes 2k, 2k + 1 hold the 16 values of sum k
      if (lane % 2 == 0) sb[lane / 2] = static_cast<float>(s);
      if (lane == 0) d[b] = amax == 0.0f ? 0.0f : 1.0f / iscale;
    } else {
      float amax = fabsf(v[0]);
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kAll, amax, off));
      const float step = ggml::q8_step(amax);
      levels[0] = ggml::q8_level(v[0], ggml::q8_inverse(step));
      s = levels[0];
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(kAll, s, off);
      if (lane == 0) {
        d[b] = ggml::q8_stored_step(step);
        sb[0] = ggml::q8_stored_sum(s, step);
      }
    }
    if constexpr (kPer == 8) {  // one 8-byte store
      uint2 w = {0u, 0u};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w.x |= static_cast<uint32_t>(static_cast<uint8_t>(levels[i])) << (8 * i);
        w.y |= static_cast<uint32_t>(static_cast<uint8_t>(levels[4 + i])) << (8 * i);
      }
      *reinterpret_cast<uint2*>(qb + lane * 8) = w;
    } else {
      qb[lane] = levels[0];
    }
  }
}

// The quantized activations as fp32 values d * q (large-M path).
template <Act A>
__global__ void __launch_bounds__(kThreads)
    expand_acts_kernel(const int8_t* q, const float* d, int64_t count, float* out) {
  using L = ActLayout<A>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = d[i / L::kBlock] * static_cast<float>(q[i]);
  }
}

// A thread's place in the fused kernels: groups of `lanes` (1 << lanes_log2)
// lanes of a warp, each group one weight row (`row`, counted over the
// grid's x blocks), the thread lane `sub` of its group.
struct LaneGroup {
  int lanes, sub;
  int64_t row;
  __device__ __forceinline__ explicit LaneGroup(int lanes_log2) : lanes(1 << lanes_log2) {
    const int lane = threadIdx.x & 31;
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    row = warp * (32 >> lanes_log2) + (lane >> lanes_log2);
    sub = lane & (lanes - 1);
  }
};

// Lane `sub` of a group of `lanes`: its units of weight row `row` dotted with
// activation rows act_row(m), m < mrows, added to acc[m].
template <ggml::Type T, int R, typename ActRowOf>
__device__ __forceinline__ void row_dots(const uint8_t* row, int64_t blocks_per_row, int sub, int lanes, int mrows,
                                         ActRowOf act_row, float (&acc)[R]) {
  using I = TypeInfo<T>;
  if constexpr (ggml::kSliced<T>) {
    constexpr int kSlices = I::kBlock / ggml::kSliceElems;
    const int64_t slices = blocks_per_row * kSlices;
    ggml::Slice<T> slice;
    for (int64_t s = sub; s < slices; s += lanes) {
      ggml::SliceCodec<T>::decode(row + s / kSlices * I::kBytes, static_cast<int>(s % kSlices), slice);
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m < mrows) ggml::slice_dot<T>(slice, act_row(m), s * ggml::kSliceElems, acc[m]);
      }
    }
  } else {
    ggml::Decoded<T> blk;
    for (int64_t b = sub; b < blocks_per_row; b += lanes) {
      ggml::Codec<T>::decode(row + b * I::kBytes, blk);
#pragma unroll
      for (int m = 0; m < R; ++m) {
        if (m < mrows) acc[m] += ggml::block_dot<T>(blk, act_row(m), b, Dp4aDot{});
      }
    }
  }
}

// Each acc[m] summed over its lane group, and stored at out[index(m)] for
// m < mrows by the lane that `stores`. Lane groups are aligned powers of two,
// so xor offsets below `lanes` stay inside the group; every lane of the warp
// takes part.
template <typename Index>
__device__ __forceinline__ void store_group_sums(float (&acc)[kMaxRows], int lanes, bool stores, int mrows,
                                                 Index index, void* out, Float out_kind) {
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    for (int off = lanes >> 1; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
  }
  if (stores) {
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m < mrows) store_float(out, out_kind, index(m), acc[m]);
    }
  }
}

// out[m0 + m, r] for m < mrows and every row r; see the top of the file.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    matvec_kernel(const uint8_t* W, int64_t rows, int64_t blocks_per_row, QuantizedActs<TypeInfo<T>::kAct> acts,
                  int64_t m0, int mrows, int lanes_log2, void* out, Float out_kind) {
  using I = TypeInfo<T>;
  const LaneGroup g(lanes_log2);
  const int lanes = g.lanes, sub = g.sub;
  const int64_t r = g.row;
  float acc[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) acc[m] = 0.0f;
  if (r < rows) {
    row_dots<T>(W + r * blocks_per_row * I::kBytes, blocks_per_row, sub, lanes, mrows,
                [&](int m) { return acts.row(m0 + m); }, acc);
  }
  store_group_sums(acc, lanes, r < rows && sub == 0, mrows, [&](int m) { return (m0 + m) * rows + r; }, out,
                   out_kind);
}

// ggml_mul_mat_id: out[p, r] = W[ids[p]] row r . activation row of pair p
// (p, or its token p / slots where every slot shares its token's row), for
// pairs p = blockIdx.y, blockIdx.y + gridDim.y, ...; lane groups as
// matvec_kernel's. Float weight types take x's fp32 rows as they are, their
// "blocks" single elements.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    matvec_id_kernel(const uint8_t* W, int64_t experts, int64_t rows, int64_t blocks_per_row,
                     QuantizedActs<TypeInfo<T>::kAct> acts, const float* x, const int32_t* ids, int64_t pairs,
                     int64_t slots, bool per_slot, int lanes_log2, void* out, Float out_kind) {
  using I = TypeInfo<T>;
  const LaneGroup g(lanes_log2);
  const int lanes = g.lanes, sub = g.sub;
  const int64_t r = g.row;
  for (int64_t p = blockIdx.y; p < pairs; p += gridDim.y) {
    const int32_t e = ids[p];
    CUDA_KERNEL_ASSERT(e >= 0 && e < experts && "ggml_mul_mat_id: ids value out of range");
    const int64_t m = per_slot ? p : p / slots;
    float acc = 0.0f;
    if (r < rows) {
      const uint8_t* row = W + (e * rows + r) * blocks_per_row * I::kBytes;
      if constexpr (I::kFloat) {
        for (int64_t i = sub; i < blocks_per_row; i += lanes) {
          float w;
          ggml::dequantize_block<T>(row + i * I::kBytes, &w);
          acc += w * x[m * blocks_per_row + i];
        }
      } else {
        const ggml::ActRow a = acts.row(m);
        float one[1] = {0.0f};
        row_dots<T>(row, blocks_per_row, sub, lanes, 1, [&](int) { return a; }, one);
        acc = one[0];
      }
    }
    for (int off = lanes >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (r < rows && sub == 0) store_float(out, out_kind, p * rows + r, acc);
  }
}

// The pairs grouped by expert, on the device: order[start[e] .. start[e + 1])
// lists the pairs whose slot chose expert e, in pair order, and active[1 ..
// active[0]] the experts chosen at all, in expert order. One block of
// kGroupThreads: thread e counts expert e's pairs, a block scan of the counts
// (and of the chosen flags) gives the starts, and thread e lists its pairs.
// No atomics (the same lists on every run) and no host synchronisation.
constexpr int kGroupThreads = 1024;
constexpr int64_t kMaxGroupedExperts = 8 * kGroupThreads;  // 40 KB of shared memory with the scans
static_assert(kMaxGroupedExperts <= 65535, "the grouped kernel's grid.y spans up to that many chosen experts");

__global__ void __launch_bounds__(kGroupThreads) group_pairs_kernel(const int32_t* ids, int64_t pairs,
                                                                     int64_t experts, int32_t* start,
                                                                     int32_t* order, int32_t* active) {
  __shared__ int32_t counts[kMaxGroupedExperts];
  __shared__ int32_t sums[kGroupThreads], chosen[kGroupThreads];
  const int t = threadIdx.x;
  for (int64_t p = t; p < pairs; p += kGroupThreads) {
    CUDA_KERNEL_ASSERT(ids[p] >= 0 && ids[p] < experts && "ggml_mul_mat_id: ids value out of range");
  }
  for (int64_t e = t; e < experts; e += kGroupThreads) {
    int32_t n = 0;
    for (int64_t p = 0; p < pairs; ++p) n += ids[p] == e;
    counts[e] = n;
  }
  __syncthreads();
  // Thread t's experts are [t * per, (t + 1) * per); inclusive scans of their
  // pair and chosen-expert totals over the threads give each range's first
  // positions.
  const int64_t per = (experts + kGroupThreads - 1) / kGroupThreads;
  const int64_t e0 = std::min<int64_t>(t * per, experts), e1 = std::min<int64_t>(e0 + per, experts);
  int32_t own = 0, own_chosen = 0;
  for (int64_t e = e0; e < e1; ++e) {
    own += counts[e];
    own_chosen += counts[e] > 0;
  }
  sums[t] = own;
  chosen[t] = own_chosen;
  __syncthreads();
  for (int off = 1; off < kGroupThreads; off <<= 1) {
    const int32_t v = t >= off ? sums[t - off] : 0, c = t >= off ? chosen[t - off] : 0;
    __syncthreads();
    sums[t] += v;
    chosen[t] += c;
    __syncthreads();
  }
  int32_t pos = sums[t] - own, slot = chosen[t] - own_chosen;
  for (int64_t e = e0; e < e1; ++e) {
    const int32_t n = counts[e];
    if (n > 0) active[1 + slot++] = static_cast<int32_t>(e);
    counts[e] = pos;
    start[e] = pos;
    pos += n;
  }
  if (t == kGroupThreads - 1) {
    start[experts] = sums[t];
    active[0] = chosen[t];
  }
  __syncthreads();
  for (int64_t e = t; e < experts; e += kGroupThreads) {
    int32_t at = counts[e];
    for (int64_t p = 0; p < pairs; ++p) {
      if (ids[p] == e) order[at++] = static_cast<int32_t>(p);
    }
  }
}

// ggml_mul_mat_id of quantized experts over grouped pairs: block (x, y)
// takes rows of the y-th chosen expert (lane groups as matvec_kernel's) and
// its pairs up to kMaxRows at a time, so each of the expert's weight blocks
// is read and decoded once per 8 of its pairs. The grid's y extent bounds the
// number of chosen experts (min(experts, pairs)); the blocks past it return.
// Each output is one lane group's sum, as in matvec_id_kernel.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    matvec_grouped_kernel(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
                          QuantizedActs<TypeInfo<T>::kAct> acts, const int32_t* start, const int32_t* order,
                          const int32_t* active, int64_t slots, bool per_slot, int lanes_log2, void* out,
                          Float out_kind) {
  using I = TypeInfo<T>;
  if (static_cast<int32_t>(blockIdx.y) >= active[0]) return;  // the whole block: no shuffle is left waiting
  const int64_t e = active[1 + blockIdx.y];
  const int32_t first = start[e], last = start[e + 1];
  const LaneGroup g(lanes_log2);
  const int lanes = g.lanes, sub = g.sub;
  const int64_t r = g.row;
  // Formed only for a row of the expert: past the last expert it would point beyond W.
  const uint8_t* row = r < rows ? W + (e * rows + r) * blocks_per_row * I::kBytes : W;
  for (int64_t c = first; c < last; c += kMaxRows) {  // 64-bit: c + kMaxRows passes INT32_MAX near 2^31 pairs
    const int mrows = last - c < kMaxRows ? static_cast<int>(last - c) : kMaxRows;
    int32_t pair[kMaxRows];
    float acc[kMaxRows];
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      pair[m] = m < mrows ? order[c + m] : 0;
      acc[m] = 0.0f;
    }
    if (r < rows) {
      row_dots<T>(row, blocks_per_row, sub, lanes, mrows,
                  [&](int m) { return acts.row(per_slot ? pair[m] : pair[m] / slots); }, acc);
    }
    store_group_sums(acc, lanes, r < rows && sub == 0, mrows, [&](int m) { return int64_t{pair[m]} * rows + r; },
                     out, out_kind);
  }
}

// Float weight types (F32, F16, BF16) take the fp32 activations as they are:
// one warp per weight row, lanes striding over its elements.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    matvec_float_kernel(const uint8_t* W, int64_t rows, int64_t n, const float* x, int64_t m0, int mrows, void* out,
                        Float out_kind) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  float acc[kMaxRows];
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) acc[m] = 0.0f;
  if (r < rows) {
    const uint8_t* row = W + r * n * TypeInfo<T>::kBytes;
    for (int64_t i = lane; i < n; i += 32) {
      float w;
      ggml::dequantize_block<T>(row + i * TypeInfo<T>::kBytes, &w);
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m < mrows) acc[m] += w * x[(m0 + m) * n + i];
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    for (int off = 16; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
  }
  if (r < rows && lane == 0) {
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m < mrows) store_float(out, out_kind, (m0 + m) * rows + r, acc[m]);
    }
  }
}

}  // namespace matvec
}  // namespace cuda
}  // namespace lowbit
