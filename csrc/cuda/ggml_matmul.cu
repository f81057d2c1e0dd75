// CUDA ggml_mul_mat_vec_a8 and ggml_mul_mat_a8: X [M, n] @ dequant(W).T, and
// ggml_mul_mat_id: the same per (token, slot) with each slot's expert's W.
//
// Same arithmetic as the CPU (csrc/cpu/ggml_cpu.cpp), from the same shared
// definitions: the activations are quantized once per call by
// ggml::quantize_act_block (Q8_0 / Q8_1 / Q8_K as the weight type's table entry
// says), each weight block is decoded by its Codec<T>, and ggml::block_dot
// combines the sub-block integer sums with the scales and mins. Only the
// integer sums are computed differently -- with __dp4a (4 int8 products per
// instruction), exact like the CPU's loop -- and the fp32 sums over blocks
// are added in another order.
//
// Fused kernel (every M for ggml_mul_mat_vec_a8; M <= kFusedMaxM for
// ggml_mul_mat_a8): a group of `lanes` lanes (a power of two <= 32, about the
// number of blocks in a row) owns one weight row; lane i decodes blocks i,
// i + lanes, ... into registers/local memory and dots each with up to 8
// activation rows, then the group sums its lanes with shuffles. Every weight
// block is read and decoded once per 8 activation rows.
//
// ggml_mul_mat_id (mixture of experts): a lane group per (pair, weight row),
// each pair's expert read from ids on the device, so no expert counts ever
// reach the host (no sync); each pair decodes its expert's rows for itself,
// where the CPU groups a prefill's pairs by expert and decodes each block
// once per group.
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

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
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
// On an H200 (benchmarks/results/h200-cuda.md, 28672x8192) one 8-row pass
// (M = 8) costs 0.50x / 0.53x of the cuBLAS path at M = 64 for Q4_0 / Q8_0
// and 0.7-1.3x for the K-quants and IQ4_XS: a second pass never pays.
constexpr int64_t kFusedMaxM = 8;
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

// One thread per activation block, through the CPU's own quantizer.
template <Act A>
__global__ void __launch_bounds__(kThreads)
    quantize_acts_kernel(const float* x, int64_t nblocks, int8_t* q, float* d, float* sum) {
  using L = ActLayout<A>;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < nblocks; b += stride) {
    ggml::quantize_act_block<A>(x + b * L::kBlock, q + b * L::kBlock, d + b, sum + b * (L::kBlock / L::kSumBlock));
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
    const uint8_t* row = W + r * blocks_per_row * I::kBytes;
    ggml::Decoded<T> blk;
    for (int64_t b = sub; b < blocks_per_row; b += lanes) {
      ggml::Codec<T>::decode(row + b * I::kBytes, blk);
#pragma unroll
      for (int m = 0; m < kMaxRows; ++m) {
        if (m < mrows) acc[m] += ggml::block_dot<T>(blk, acts.row(m0 + m), b, Dp4aDot{});
      }
    }
  }
  // Lane groups are aligned powers of two, so xor offsets below `lanes` stay
  // inside the group; every lane of the warp takes part.
#pragma unroll
  for (int m = 0; m < kMaxRows; ++m) {
    for (int off = lanes >> 1; off > 0; off >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], off);
  }
  if (r < rows && sub == 0) {
#pragma unroll
    for (int m = 0; m < kMaxRows; ++m) {
      if (m < mrows) store_float(out, out_kind, (m0 + m) * rows + r, acc[m]);
    }
  }
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
        ggml::Decoded<T> blk;
        const ggml::ActRow a = acts.row(m);
        for (int64_t b = sub; b < blocks_per_row; b += lanes) {
          ggml::Codec<T>::decode(row + b * I::kBytes, blk);
          acc += ggml::block_dot<T>(blk, a, b, Dp4aDot{});
        }
      }
    }
    for (int off = lanes >> 1; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (r < rows && sub == 0) store_float(out, out_kind, p * rows + r, acc);
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
    quantize_acts_kernel<A><<<grid_for(nblocks, kThreads), kThreads, 0, current_stream()>>>(
        x.data_ptr<float>(), nblocks, b.q.template data_ptr<int8_t>(), b.d.template data_ptr<float>(),
        b.sum.template data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  b.view = {b.q.template data_ptr<int8_t>(), b.d.template data_ptr<float>(), b.sum.template data_ptr<float>(), n};
  return b;
}

int log2_lanes_for(int64_t blocks_per_row) {
  int lg = 0;
  while (lg < 5 && (int64_t{1} << lg) < blocks_per_row) ++lg;
  return lg;
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
    const int lg = log2_lanes_for(blocks_per_row);
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
  const uint8_t* w = W.data_ptr<uint8_t>();
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if (any_m_fused || M <= kFusedMaxM) {
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
    const int64_t blocks_per_row = c.n / I::kBlock;
    const int lg = log2_lanes_for(blocks_per_row);
    const dim3 grid(static_cast<unsigned int>(ceil_div(row, int64_t{kWarps} * (32 >> lg))),
                    static_cast<unsigned int>(std::min<int64_t>(pairs, 65535)));
    QuantizedActs<I::kAct> view{};
    ActBuffers<I::kAct> acts;
    if constexpr (!I::kFloat) {
      acts = quantize_acts<I::kAct>(x);
      view = acts.view;
    }
    matvec_id_kernel<T><<<grid, kThreads, 0, current_stream()>>>(
        W.data_ptr<uint8_t>(), c.experts, row, blocks_per_row, view, x.data_ptr<float>(),
        c.ids.data_ptr<int32_t>(), pairs, c.slots, c.per_slot, lg, out.data_ptr(), float_kind(out.scalar_type()));
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
