// A validated GPTQ weight as the CUDA kernels read it, the per-element
// accessors they share (group of a row, zero point and scale of a group and
// column: all from core/gptq_format.h), and the launchers one op file offers
// another (dequantization for gptq_gemm's large-M path, raw pack/unpack for
// gptq_permute_cols).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../core/gptq_format.h"
#include "../ops/gptq_checks.h"
#include "common.cuh"

namespace lowbit {
namespace cuda {

struct GptqView {
  const uint32_t* qweight;  // [K*bit/32, N], packed along K
  const uint32_t* qzeros;   // [groups, zero_cols], packed along N (stored zeros, rule not applied)
  const void* scales;       // [groups, N] in scale_kind
  Float scale_kind;
  int64_t K;
  int64_t N;
  int64_t groups;
  int64_t zero_cols;
  const int32_t* g_idx;  // group of each row, or null: row k is in group k / group_size
  int64_t group_size;
  bool v2;
};

// `g_idx` must be an int32 contiguous vector on the weight's device, or an
// undefined / empty tensor for the trivial grouping.
inline GptqView make_view(const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales,
                          const at::Tensor& g_idx, const GptqDims& d, bool v2) {
  GptqView v;
  v.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  v.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>());
  v.scales = scales.data_ptr();
  v.scale_kind = float_kind(scales.scalar_type());
  v.K = d.K;
  v.N = d.N;
  v.groups = d.groups;
  v.zero_cols = qzeros.size(1);
  v.g_idx = g_idx.defined() && g_idx.numel() ? g_idx.data_ptr<int32_t>() : nullptr;
  v.group_size = d.K / d.groups;
  v.v2 = v2;
  return v;
}

// Group of weight row k. g_idx values cannot be range-checked on the host
// without a sync, so an out-of-range value stops the kernel here instead of
// reading outside scales / qzeros.
__device__ __forceinline__ int64_t group_of(const GptqView& w, int64_t k) {
  if (w.g_idx == nullptr) return k / w.group_size;
  const int64_t g = w.g_idx[k];
  CUDA_KERNEL_ASSERT(g >= 0 && g < w.groups && "gptq: b_g_idx value out of range");
  return g;
}

// Zero point of group g, column n, with the v1/v2 rule applied per field.
template <int B>
__device__ __forceinline__ int32_t zero_at(const GptqView& w, int64_t g, int64_t n) {
  return gptq::zero_point(gptq::unpack_field<B>(w.qzeros + g * w.zero_cols, 1, n), w.v2);
}

__device__ __forceinline__ float scale_at(const GptqView& w, int64_t g, int64_t n) {
  return load_float(w.scales, w.scale_kind, g * w.N + n);
}

// gptq_dequantize.cu: out[k, j] = W[k, n0 + j] for j < out.size(1), written in
// out's dtype (float32, float16 or bfloat16; out contiguous [K, width]).
void launch_gptq_dequantize(const GptqView& w, int64_t bit, int64_t n0, at::Tensor& out);

// W in two terms of a 16-bit float type T, for products with fp16 / bf16
// activations on the tensor cores that keep the fp32 weight:
//   W[k, n] * 2^exps[n] = hi[k, n] + lo[k, n] * 2^-split_lo_shift(T).
// hi is the scaled value rounded to T and lo the remainder, which is exact in
// fp32 and has at most 24 - s significant bits for T's s (11 for fp16, 8 for
// bf16): with fp16 or bf16 scales W has at most bit + 11 of them, so the two
// fp16 terms hold it exactly, and two bf16 terms to within 2^-17 of |W|.
// exps[n] puts each column's bound |W| < 2^kSplitHiExponent, far inside
// fp16's range, so neither term overflows and hi is normal down to 2^-28 of
// the bound.
constexpr int kSplitHiExponent = 14;

inline int split_lo_shift(at::ScalarType t) { return t == at::kHalf ? 11 : 8; }

// exps: int32 [N]; the exponent of every column (launch_gptq_split_exponents
// writes it from the scales).
void launch_gptq_split_exponents(const GptqView& w, int64_t bit, at::Tensor& exps);
// hi, lo: [K, width] of the same dtype (float16 or bfloat16), columns n0 ...
void launch_gptq_dequantize_split(const GptqView& w, int64_t bit, int64_t n0, const at::Tensor& exps, at::Tensor& hi,
                                  at::Tensor& lo);

// The grid and output of a split-K GPTQ kernel (gptq_gemm.cu's fused one,
// gptq_mma.cu's): a block per (chunk of activation rows, column tile, run of
// K chunks). With one split a block writes out [M, N] directly; with several,
// its fp32 slice of a [splits, M, N] workspace, which launch_splitk_reduce
// sums in split order: no atomics, the same bits on every run.
struct SplitK {
  void* out;
  Float out_kind;
  float* partial;
  int64_t M;
  int64_t N;
  int64_t chunks;
  int m_chunks;
  int n_tiles;
  int splits;
  int chunks_per_split;

  // The grid over M rows in chunks of `rows`, N columns in tiles of tile_n
  // and K's `chunks` chunks in about `wanted` runs (1 to chunks, none empty);
  // the outputs (out, out_kind, partial) are the caller's to set.
  static SplitK layout(int64_t M, int64_t N, int64_t rows, int64_t tile_n, int64_t chunks, int64_t wanted) {
    const int64_t splits = wanted < 1 ? 1 : wanted > chunks ? chunks : wanted;
    const int64_t per_split = (chunks + splits - 1) / splits;
    SplitK s{};
    s.M = M;
    s.N = N;
    s.chunks = chunks;
    s.m_chunks = static_cast<int>((M + rows - 1) / rows);
    s.n_tiles = static_cast<int>((N + tile_n - 1) / tile_n);
    s.splits = static_cast<int>((chunks + per_split - 1) / per_split);
    s.chunks_per_split = static_cast<int>(per_split);
    return s;
  }

  struct Block {
    int mc;  // row chunk
    int tile;
    int split;
    int64_t c_begin;  // K chunks [c_begin, c_end)
    int64_t c_end;
  };
  __device__ __forceinline__ Block block(int64_t bid) const {
    Block b;
    b.mc = static_cast<int>(bid % m_chunks);
    bid /= m_chunks;
    b.tile = static_cast<int>(bid % n_tiles);
    b.split = static_cast<int>(bid / n_tiles);
    b.c_begin = static_cast<int64_t>(b.split) * chunks_per_split;
    b.c_end = b.c_begin + chunks_per_split < chunks ? b.c_begin + chunks_per_split : chunks;
    return b;
  }
  __device__ __forceinline__ void store(int split, int64_t row, int64_t col, float v) const {
    if (splits == 1) {
      store_float(out, out_kind, row * N + col, v);
    } else {
      partial[(static_cast<int64_t>(split) * M + row) * N + col] = v;
    }
  }
};

// gptq_gemm.cu: plans the grid over a's M rows in chunks of `rows`, out's N
// columns in tiles of `tile_n` and K's `chunks` chunks, splitting K until
// there are about blocks_per_sm blocks per multiprocessor; the workspace goes
// to `partial`, the block count to `blocks`. launch_splitk_reduce then writes
// out where there are several splits.
SplitK plan_split_k(const at::Tensor& a, at::Tensor& out, int64_t rows, int64_t tile_n, int64_t chunks,
                    int blocks_per_sm, at::Tensor& partial, int64_t& blocks);
void launch_splitk_reduce(const at::Tensor& partial, const SplitK& s);

// gptq_mma.cu: the tensor-core kernel. Serves a (its dtype and device) and w
// with this bit width where true; gemm_mma takes a in the weight's row order
// (shuffled weights: a[:, q_perm]), contiguous, 16-byte aligned.
bool gptq_mma_serves(const at::Tensor& a, const GptqView& w, int64_t bit);
void gemm_mma(const at::Tensor& a_rows, const GptqView& w, int64_t bit, at::Tensor& out);

// gptq_packing.cu: pack / unpack along `dim` without validation (the caller
// has validated the shapes and values).
at::Tensor pack_words(const at::Tensor& values, int64_t bit, int64_t dim);
at::Tensor unpack_words(const at::Tensor& packed, int64_t bit, int64_t dim);

}  // namespace cuda
}  // namespace lowbit
