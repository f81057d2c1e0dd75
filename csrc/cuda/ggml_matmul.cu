// CUDA ggml_mul_mat_vec_a8 and ggml_mul_mat_a8: X [M, n] @ dequant(W).T, and
// ggml_mul_mat_id: the same per (token, slot) with each slot's expert's W.
//
// Same arithmetic as the CPU (csrc/cpu/ggml_cpu.cpp), from the same shared
// definitions: the activations are quantized once per call, a warp per block,
// to the bits of ggml::quantize_act_block (Q8_0 / Q8_1 / Q8_K as the weight
// type's table entry says); weight blocks are decoded by their SliceCodec<T>
// or Codec<T>, and ggml::add_sub_block combines the sub-block integer sums
// with the scales and mins. Only the integer sums are computed differently --
// with __dp4a (4 int8 products per instruction), exact like the CPU's loop --
// and the fp32 sums over slices and blocks are added in another order.
//
// Fused kernel (every M for ggml_mul_mat_vec_a8; M <= fused_max_m<T>() for
// ggml_mul_mat_a8): a group of `lanes` lanes (a power of two <= 32, about the
// number of units in a row) owns one weight row and dots it with up to 8
// activation rows; the group then sums its lanes with shuffles. The sliced
// types (core/ggml_slices.h: the legacy ones but MXFP4, the K-quants, IQ4_NL
// and IQ4_XS) take 32-element slices as units: lane i decodes slices i,
// i + lanes, ... with word loads into registers and meets the activations'
// words with __dp4a, so a warp reads 32 consecutive slices of its row at a
// time. The other types take whole blocks, each lane decoding its blocks
// into a local Decoded<T>. Every weight block is read and decoded once per 8
// activation rows.
//
// ggml_mul_mat_id (mixture of experts): one kernel groups the (token, slot)
// pairs by expert on the device, so no expert counts reach the host (no
// sync); then a block per (row tile, expert) runs the fused kernel's lane
// groups over that expert's pairs, 8 at a time: each chosen expert's weights
// are read once per 8 of its pairs, as the CPU decodes each block once per
// group. Float experts, and more experts than the grouping holds, take a pass
// per pair.
//
// Larger M (ggml_mul_mat_a8 only): the activations are quantized exactly as
// above and expanded back to fp32 (d * q), W is dequantized to fp32 row tiles,
// and cuBLAS multiplies them in fp32 (at::mm). That equals the integer path up
// to fp32 rounding, except that it uses Q8_1's exact block sums where the
// fused path (and the CPU) use its fp16-rounded `s` (the documented tolerance
// covers both).
//
// No host synchronisation: temporaries come from the caching allocator and
// everything runs on the current stream (CUDA-graph capturable).
#include <algorithm>
#include <limits>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_slices.h"
#include "../ops/dispatch.h"
#include "../ops/ggml_checks.h"
#include "common.cuh"
#include "ggml_cuda.cuh"
#include "../ops/backend_ops.h"

namespace lowbit {
namespace cuda {
namespace {

using ggml::Act;
using ggml::ActLayout;
using ggml::TypeInfo;

// Largest M for which ggml_mul_mat_a8 takes the fused kernel. The fused
// kernel decodes W once per 8 rows, so its time grows by one pass per 8 rows;
// the cuBLAS path pays one fp32 copy of W and SGEMM, nearly flat up to M = 64.
// On an H200 (benchmarks/results/h200-cuda.md, 28672x8192) the slice kernel
// beats the cuBLAS path at M = 32 for every sliced type measured (0.26x for
// Q6_K to 0.86x for Q8_0 of its time) and loses at M = 64 for Q4_0, Q4_K and
// Q8_0; a block-decoding type's 8-row pass already costs 0.7-1.3x of the
// cuBLAS path at M = 64, so a second one never pays.
// LOWBIT_CUDA_GGML_FUSED_MAX_M overrides it for the benchmark.
constexpr char kGgmlFusedMaxMEnv[] = "LOWBIT_CUDA_GGML_FUSED_MAX_M";
template <ggml::Type T>
int64_t fused_max_m() {
  return crossover<kGgmlFusedMaxMEnv>(ggml::kSliced<T> ? 32 : 8);
}
// Activation rows per fused launch (accumulators in registers).
constexpr int kMaxRows = 8;
constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// fp32 bytes of W decoded per cuBLAS call on the large-M path.
constexpr int64_t kDequantTileBytes = int64_t{256} << 20;

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

// Units (slices or blocks, see the top of the file) per row of a type.
template <ggml::Type T>
int64_t units_per_row(int64_t blocks_per_row) {
  return ggml::kSliced<T> ? blocks_per_row * (TypeInfo<T>::kBlock / ggml::kSliceElems) : blocks_per_row;
}

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

// Quantized activations of x [M, n] in the format T pairs with; the tensors
// own the memory QuantizedActs points into.
template <Act A>
struct ActBuffers {
  at::Tensor q, d, sum;
  QuantizedActs<A> view;
};

template <Act A>
ActBuffers<A> quantize_acts(const at::Tensor& x) {
  using L = ActLayout<A>;
  const int64_t M = x.size(0), n = x.size(1);
  ActBuffers<A> b;
  b.q = at::empty({M * n}, x.options().dtype(at::kChar));
  b.d = at::empty({M * n / L::kBlock}, x.options());
  b.sum = at::empty({M * n / L::kSumBlock}, x.options());
  const int64_t nblocks = M * n / L::kBlock;
  if (nblocks > 0) {
    quantize_acts_kernel<A><<<grid_for(nblocks, kWarps), kThreads, 0, current_stream()>>>(
        x.data_ptr<float>(), nblocks, b.q.template data_ptr<int8_t>(), b.d.template data_ptr<float>(),
        b.sum.template data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  b.view = {b.q.template data_ptr<int8_t>(), b.d.template data_ptr<float>(), b.sum.template data_ptr<float>(), n};
  return b;
}

int log2_lanes_for(int64_t units_per_row) {
  int lg = 0;
  while (lg < 5 && (int64_t{1} << lg) < units_per_row) ++lg;
  return lg;
}

// Slices read whole words of W (ggml::kSliceAlign): a sliced type's weight
// that starts elsewhere in its storage (a view at an odd offset; allocations
// are aligned) is copied to an aligned allocation, on every call.
template <ggml::Type T>
at::Tensor slice_aligned(const char* op, const at::Tensor& W) {
  if (!ggml::kSliced<T> || reinterpret_cast<uintptr_t>(W.data_ptr()) % ggml::kSliceAlign == 0) return W;
  TORCH_WARN_ONCE(op, ": W starts ", reinterpret_cast<uintptr_t>(W.data_ptr()) % ggml::kSliceAlign,
                  " bytes past a 16-byte boundary; each call copies it to an aligned buffer first");
  return W.clone(at::MemoryFormat::Contiguous);
}

// The fused path: out [M, rows] in out's dtype.
template <ggml::Type T>
void mul_mat_fused(const uint8_t* W, int64_t rows, const at::Tensor& x, at::Tensor& out) {
  using I = TypeInfo<T>;
  const int64_t M = x.size(0), n = x.size(1);
  const Float out_kind = float_kind(out.scalar_type());
  if constexpr (I::kFloat) {
    const unsigned int blocks = static_cast<unsigned int>(ceil_div(rows, kWarps));
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mrows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      matvec_float_kernel<T><<<blocks, kThreads, 0, current_stream()>>>(W, rows, n, x.data_ptr<float>(), m0, mrows,
                                                                        out.data_ptr(), out_kind);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  } else {
    const ActBuffers<I::kAct> acts = quantize_acts<I::kAct>(x);
    const int64_t blocks_per_row = n / I::kBlock;
    const int lg = log2_lanes_for(units_per_row<T>(blocks_per_row));
    const int64_t rows_per_block = int64_t{kWarps} * (32 >> lg);
    const unsigned int blocks = static_cast<unsigned int>(ceil_div(rows, rows_per_block));
    for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
      const int mrows = static_cast<int>(std::min<int64_t>(kMaxRows, M - m0));
      matvec_kernel<T><<<blocks, kThreads, 0, current_stream()>>>(W, rows, blocks_per_row, acts.view, m0, mrows, lg,
                                                                  out.data_ptr(), out_kind);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }
}

// The large-M path: fp32 activations (quantized and expanded for quantized
// types) times fp32 row tiles of W, by cuBLAS.
template <ggml::Type T>
void mul_mat_dequant_mm(const uint8_t* W, int64_t type, int64_t rows, const at::Tensor& x, at::Tensor& out) {
  using I = TypeInfo<T>;
  const int64_t M = x.size(0), n = x.size(1);
  at::Tensor xd = x;
  if constexpr (!I::kFloat) {
    const ActBuffers<I::kAct> acts = quantize_acts<I::kAct>(x);
    xd = at::empty({M, n}, x.options());
    expand_acts_kernel<I::kAct><<<grid_for(M * n, kThreads), kThreads, 0, current_stream()>>>(
        acts.view.q, acts.view.d, M * n, xd.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t row_bytes = n / I::kBlock * I::kBytes;
  const int64_t tile_rows = std::min(rows, std::max<int64_t>(1, kDequantTileBytes / (4 * std::max<int64_t>(n, 1))));
  at::Tensor out32 = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  at::Tensor tile_buf = at::empty({tile_rows * n}, x.options());
  for (int64_t r0 = 0; r0 < rows; r0 += tile_rows) {
    const int64_t count = std::min(tile_rows, rows - r0);
    at::Tensor tile = tile_buf.narrow(0, 0, count * n).view({count, n});
    launch_ggml_dequantize(W + r0 * row_bytes, type, count, n, tile);
    if (count == rows) {
      at::mm_out(out32, xd, tile.t());
    } else {
      out32.narrow(1, r0, count).copy_(at::mm(xd, tile.t()));
    }
  }
  if (!out32.is_same(out)) out.copy_(out32);  // rounded once to X's dtype
}

at::Tensor ggml_mul_mat(const char* op, const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row,
                        bool any_m_fused) {
  check_ggml_matmul(op, W, X, type, row);
  const c10::cuda::CUDAGuard guard(W.device());
  const at::Tensor x = X.to(at::kFloat).contiguous();
  const int64_t M = x.size(0);
  at::Tensor out = at::empty({M, row}, X.options());
  if (M == 0 || row == 0) return out;
  if (x.size(1) == 0) return out.zero_();  // an empty sum
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    const at::Tensor Wa = slice_aligned<T>(op, W);
    const uint8_t* w = Wa.data_ptr<uint8_t>();
    if (any_m_fused || M <= fused_max_m<T>()) {
      mul_mat_fused<T>(w, row, x, out);
    } else {
      mul_mat_dequant_mm<T>(w, type, row, x, out);
    }
  });
  return out;
}

}  // namespace

at::Tensor ggml_mul_mat_id(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                           int64_t row) {
  const GgmlMatmulId c = check_ggml_matmul_id("ggml_mul_mat_id", W, X, ids, type, row);
  const c10::cuda::CUDAGuard guard(W.device());
  const int64_t pairs = c.tokens * c.slots;
  at::Tensor out = at::zeros({c.tokens, c.slots, row}, X.options());
  if (pairs == 0 || row == 0 || c.n == 0) return out;
  const at::Tensor x = X.to(at::kFloat).contiguous().view({-1, c.n});
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    using I = TypeInfo<T>;
    const at::Tensor Wa = slice_aligned<T>("ggml_mul_mat_id", W);
    const int64_t blocks_per_row = c.n / I::kBlock;
    const int lg = log2_lanes_for(units_per_row<T>(blocks_per_row));
    const unsigned int row_blocks = static_cast<unsigned int>(ceil_div(row, int64_t{kWarps} * (32 >> lg)));
    const int32_t* id = c.ids.data_ptr<int32_t>();
    void* o = out.data_ptr();
    const Float kind = float_kind(out.scalar_type());
    if constexpr (I::kFloat) {
      matvec_id_kernel<T><<<dim3(row_blocks, static_cast<unsigned int>(std::min<int64_t>(pairs, 65535))), kThreads, 0,
                            current_stream()>>>(Wa.data_ptr<uint8_t>(), c.experts, row, blocks_per_row,
                                                QuantizedActs<I::kAct>{}, x.data_ptr<float>(), id, pairs, c.slots,
                                                c.per_slot, lg, o, kind);
    } else {
      const ActBuffers<I::kAct> acts = quantize_acts<I::kAct>(x);
      if (c.experts <= kMaxGroupedExperts && pairs <= std::numeric_limits<int32_t>::max()) {
        const int64_t most_chosen = std::min(c.experts, pairs);
        at::Tensor lists = at::empty({c.experts + 1 + pairs + 1 + most_chosen}, x.options().dtype(at::kInt));
        int32_t* start = lists.data_ptr<int32_t>();
        int32_t* order = start + c.experts + 1;
        int32_t* active = order + pairs;
        group_pairs_kernel<<<1, kGroupThreads, 0, current_stream()>>>(id, pairs, c.experts, start, order, active);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        matvec_grouped_kernel<T><<<dim3(row_blocks, static_cast<unsigned int>(most_chosen)), kThreads, 0,
                                   current_stream()>>>(Wa.data_ptr<uint8_t>(), row, blocks_per_row, acts.view, start,
                                                       order, active, c.slots, c.per_slot, lg, o, kind);
      } else {
        matvec_id_kernel<T><<<dim3(row_blocks, static_cast<unsigned int>(std::min<int64_t>(pairs, 65535))),
                              kThreads, 0, current_stream()>>>(Wa.data_ptr<uint8_t>(), c.experts, row,
                                                               blocks_per_row, acts.view, x.data_ptr<float>(), id,
                                                               pairs, c.slots, c.per_slot, lg, o, kind);
      }
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row) {
  return ggml_mul_mat("ggml_mul_mat_vec_a8", W, X, type, row, /*any_m_fused=*/true);
}

at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row) {
  return ggml_mul_mat("ggml_mul_mat_a8", W, X, type, row, /*any_m_fused=*/false);
}

}  // namespace cuda
}  // namespace lowbit
