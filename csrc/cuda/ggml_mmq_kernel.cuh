// The tensor-core kernel of CUDA ggml_mul_mat_a8 at large M for the
// quantized types: int8 mma.sync on the weights' levels and the quantized
// activations' levels, as llama.cpp's MMQ. Also compiled as host code by the
// CPU emulator (tests/simt).
//
// A block owns kRows weight rows x kCols activation rows of the output; each
// of its 4 warps 16 weight rows x all kCols activation rows (8 mma tiles).
// K runs in stages of kStageElems (256) elements:
// - the block decodes the stage of each weight row once into shared memory
//   (levels as int8 words, scales, mins): the sliced types (core/ggml_slices.h)
//   a 32-element slice per thread in registers, the others a block per thread
//   by its Codec; beside them go the activations' levels, scales and sums;
// - mma.sync m16n8k16 (int8 into int32) gives every output's exact integer
//   sum per 16 elements, added up over a sub-block (16, 32 or 256 elements);
// - each sub-block's integer sum meets its scales and mins in fp32. The
//   types whose activations are Q8_K (one scale per 256 elements, a whole
//   weight block) sum d_w * isum + m_w * sum(q_x) over a block's sub-blocks
//   and multiply by the activation scale once per block: per output and
//   sub-block, one float instruction fewer than ggml::add_sub_block's terms
//   (two with mins), which the other types add as the CPU and the matvec
//   do. The fp32 sums run over a weight block's sub-blocks in order and are
//   added to the output's sum per block.
// No atomics: every output is one lane's sum, the same bits on every run.
//
// ggml_mul_mat_id takes the same tiles per chosen expert (mmq_grouped_kernel):
// the columns of a tile are 64 of the expert's (token, slot) pairs, listed by
// matvec::group_pairs_kernel, so each chosen expert's weights are decoded
// once per 64 of its pairs.
#pragma once

#include <algorithm>
#include <cstdint>

#include "../core/ggml_q8.h"
#include "../core/ggml_slices.h"
#include "common.cuh"
#include "ggml_matvec_kernels.cuh"
#include "warp_instructions.cuh"

namespace lowbit {
namespace cuda {
namespace mmq {

using ggml::TypeInfo;

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRows = 16 * kWarps;  // weight rows per block
constexpr int kTiles = 8;           // n8 tiles per warp
constexpr int kCols = 8 * kTiles;   // activation rows per block
constexpr int kStageElems = 256;  // elements of K per stage: a whole Q8_K block, and every type's blocks
// A row's words in shared memory: the stage's 64, plus 4 so that the 8 rows
// one fragment load touches fall in 32 distinct banks.
constexpr int kRowWords = kStageElems / 4 + 4;

template <ggml::Type T>
struct Stage {
  using I = TypeInfo<T>;
  using L = ggml::ActLayout<I::kAct>;
  static_assert(kStageElems % I::kBlock == 0 && kStageElems % I::kSub == 0 && I::kSub % 16 == 0,
                "a stage holds whole blocks and sub-blocks, and a sub-block whole k16 steps");
  static constexpr int kSubs = kStageElems / I::kSub;  // sub-blocks per row and stage
  static constexpr int kMinSubs = I::kHasMin ? kSubs : 1;
  static constexpr int kActScales = kStageElems / L::kBlock;
  // One activation scale per weight block, applied to the block's sum (mmq_tile).
  static constexpr bool kBlockScale = I::kAct == ggml::Act::Q8_K;
  static_assert(!kBlockScale || L::kBlock == I::kBlock, "a Q8_K scale spans exactly one weight block");
  // The activations' sums of levels: per sub-block where the block's scale
  // applies once (integers as floats: exact), add_sub_block's otherwise.
  static constexpr int kActSums = !I::kHasMin ? 1 : kBlockScale ? kSubs : kStageElems / L::kSumBlock;
  uint32_t wq[kRows][kRowWords];
  float wd[kRows][kSubs];
  float wm[kRows][kMinSubs];
  uint32_t xq[kCols][kRowWords];
  float xd[kCols][kActScales];
  float xs[kCols][kActSums];
  // The tile's columns: each one's activation row and output row (-1: none).
  int64_t act[kCols];
  int64_t dst[kCols];
};

// Levels (as words), scales and mins of `subs` sub-blocks of weight row r,
// from word w and sub-block k of the stage on.
template <ggml::Type T, int Words, int Subs>
__device__ __forceinline__ void put_weights(Stage<T>& st, int r, int w, int k, const uint32_t (&q)[Words],
                                            const float (&d)[Subs], const float* m) {
  for (int i = 0; i < Words; ++i) st.wq[r][w + i] = q[i];
  for (int i = 0; i < Subs; ++i) st.wd[r][k + i] = d[i];
  if constexpr (TypeInfo<T>::kHasMin) {
    for (int i = 0; i < Subs; ++i) st.wm[r][k + i] = m[i];
  }
}

// The stage's weights: `elems` elements from element `first` of rows row0 ..
// (rows past the end, and elements past `elems`, as zeros). A sliced type
// takes a 32-element slice per thread, decoded in registers; the others a
// block per thread, by its Codec.
template <ggml::Type T>
__device__ __forceinline__ void load_weights(const uint8_t* W, int64_t rows, int64_t blocks_per_row, int64_t row0,
                                             int64_t first, int elems, Stage<T>& st) {
  using I = TypeInfo<T>;
  constexpr int kUnit = ggml::kSliced<T> ? ggml::kSliceElems : I::kBlock;  // elements per thread and step
  constexpr int kUnits = kStageElems / kUnit;
  for (int u = threadIdx.x; u < kRows * kUnits; u += kThreads) {
    const int r = u / kUnits, j = u % kUnits;
    const bool live = row0 + r < rows && j * kUnit < elems;
    const int64_t e = first + int64_t{j} * kUnit;  // the unit's first element in the row
    // Formed only for a live unit: past the last row it would point beyond W.
    const auto block = [&] { return W + ((row0 + r) * blocks_per_row + e / I::kBlock) * I::kBytes; };
    const int k = j * kUnit / I::kSub;  // its first sub-block in the stage
    if constexpr (ggml::kSliced<T>) {
      ggml::Slice<T> sl;
      if (live) {
        ggml::SliceCodec<T>::decode(block(), static_cast<int>(e % I::kBlock / ggml::kSliceElems), sl);
      } else {
        sl = ggml::Slice<T>{};
      }
      put_weights<T>(st, r, j * 8, k, sl.q, sl.d, sl.m);
    } else {
      ggml::Decoded<T> blk;
      if (live) {
        ggml::Codec<T>::decode(block(), blk);
      } else {
        blk = ggml::Decoded<T>{};
      }
      uint32_t q[I::kBlock / 4];  // byte b of word i: level 4i + b
      for (int i = 0; i < I::kBlock / 4; ++i) {
        q[i] = 0u;
        for (int b = 0; b < 4; ++b) q[i] |= static_cast<uint32_t>(static_cast<uint8_t>(blk.q[4 * i + b])) << (8 * b);
      }
      put_weights<T>(st, r, j * (I::kBlock / 4), k, q, blk.d, blk.m);
    }
  }
}

// The stage's activations: `elems` elements from element `first` of the
// tile columns' rows st.act (columns without one, and elements past `elems`,
// as zeros).
template <ggml::Type T>
__device__ __forceinline__ void load_acts(const matvec::QuantizedActs<TypeInfo<T>::kAct>& acts, int64_t first,
                                          int elems, Stage<T>& st) {
  using S = Stage<T>;
  using L = typename S::L;
  const int64_t n = acts.n;
  // 16 bytes per thread and step: row offsets are multiples of 32 bytes from a 16-byte aligned start.
  for (int u = threadIdx.x; u < kCols * kStageElems / 16; u += kThreads) {
    const int c = u / (kStageElems / 16), v = u % (kStageElems / 16);
    const int64_t m = st.act[c];
    uint4 w = {0u, 0u, 0u, 0u};
    if (m >= 0 && 16 * v < elems) w = *reinterpret_cast<const uint4*>(acts.q + m * n + first + 16 * v);
    st.xq[c][4 * v] = w.x;
    st.xq[c][4 * v + 1] = w.y;
    st.xq[c][4 * v + 2] = w.z;
    st.xq[c][4 * v + 3] = w.w;
  }
  for (int u = threadIdx.x; u < kCols * S::kActScales; u += kThreads) {
    const int c = u / S::kActScales, k = u % S::kActScales;
    const int64_t m = st.act[c];
    st.xd[c][k] = m >= 0 && k * L::kBlock < elems ? acts.d[m * (n / L::kBlock) + first / L::kBlock + k] : 0.0f;
  }
  if constexpr (TypeInfo<T>::kHasMin) {
    // Sums of kSpan elements each: a sub-block's (several of Q8_K's integer sums per 16) or one stored sum.
    constexpr int kSpan = kStageElems / S::kActSums, kParts = kSpan / L::kSumBlock;
    for (int u = threadIdx.x; u < kCols * S::kActSums; u += kThreads) {
      const int c = u / S::kActSums, k = u % S::kActSums;
      const int64_t m = st.act[c];
      float sum = 0.0f;
      if (m >= 0 && k * kSpan < elems) {
        const float* part = acts.sum + m * (n / L::kSumBlock) + (first + int64_t{k} * kSpan) / L::kSumBlock;
        sum = part[0];
        for (int i = 1; i < kParts; ++i) sum += part[i];
      }
      st.xs[c][k] = sum;
    }
  }
}

// out[st.dst[c], r] = activation row st.act[c] . weight row r for the tile of
// weight rows row0 .. and the columns c < kCols set in st by the caller
// (whose writes the first barrier here orders before their reads).
template <ggml::Type T>
__device__ __forceinline__ void mmq_tile(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
                                         const matvec::QuantizedActs<TypeInfo<T>::kAct>& acts, int64_t row0,
                                         void* out, Float out_kind, Stage<T>& st) {
  using I = TypeInfo<T>;
  using S = Stage<T>;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wr = 16 * warp;  // the warp's first weight row in the tile
  const int64_t n = blocks_per_row * I::kBlock;
  float acc[kTiles][4], blk[kTiles][4];
  int32_t isum[kTiles][4];
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      acc[nt][r] = blk[nt][r] = 0.0f;
      isum[nt][r] = 0;
    }
  }
  for (int64_t first = 0; first < n; first += kStageElems) {
    const int elems = static_cast<int>(std::min<int64_t>(kStageElems, n - first));
    __syncthreads();  // every warp is done with the previous stage
    load_weights<T>(W, rows, blocks_per_row, row0, first, elems, st);
    load_acts<T>(acts, first, elems, st);
    __syncthreads();
    // Steps of 16 elements; stages start on block (and sub-block) boundaries.
    for (int e = 0; e < elems; e += 16) {
      const int w = e / 4 + t;
      const uint32_t a0 = st.wq[wr + g][w], a1 = st.wq[wr + g + 8][w];
#pragma unroll
      for (int nt = 0; nt < kTiles; ++nt) mma16816_s8(isum[nt], a0, a1, st.xq[8 * nt + g][w]);
      if ((e + 16) % I::kSub == 0) {  // a sub-block ends: its terms, then its integer sums start over
        const int k = (e + 16) / I::kSub - 1;
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int wrow = wr + g + 8 * (r / 2), c = 8 * nt + 2 * t + (r % 2);
            const float m = I::kHasMin ? st.wm[wrow][k % S::kMinSubs] : 0.0f;
            if constexpr (S::kBlockScale) {
              blk[nt][r] += st.wd[wrow][k] * static_cast<float>(isum[nt][r]);
              if constexpr (I::kHasMin) blk[nt][r] += m * st.xs[c][k];
            } else {
              // The activation row's scales and sums in shared memory, indexed from the stage's first element.
              const ggml::ActRow a{nullptr, st.xd[c], st.xs[c]};
              ggml::add_sub_block<T>(blk[nt][r], st.wd[wrow][k], m, isum[nt][r], a, e + 16 - I::kSub);
            }
            isum[nt][r] = 0;
          }
        }
      }
      if ((e + 16) % I::kBlock == 0) {  // a weight block ends
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int c = 8 * nt + 2 * t + (r % 2);
            acc[nt][r] += S::kBlockScale ? st.xd[c][(e + 16 - I::kBlock) / S::L::kBlock] * blk[nt][r] : blk[nt][r];
            blk[nt][r] = 0.0f;
          }
        }
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t row = row0 + wr + g + 8 * (r / 2), dst = st.dst[8 * nt + 2 * t + (r % 2)];
      if (row < rows && dst >= 0) store_float(out, out_kind, dst * rows + row, acc[nt][r]);
    }
  }
}

// ggml_mul_mat_a8: out[m, r] = activation row m . weight row r, for the
// block's row tile and every gridDim.y-th column tile from blockIdx.y on.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    mmq_kernel(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
               matvec::QuantizedActs<TypeInfo<T>::kAct> acts, int64_t M, void* out, Float out_kind) {
  __shared__ Stage<T> st;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  for (int64_t col0 = static_cast<int64_t>(blockIdx.y) * kCols; col0 < M; col0 += int64_t{gridDim.y} * kCols) {
    __syncthreads();  // the previous tile's stores have read st.dst
    for (int c = threadIdx.x; c < kCols; c += kThreads) st.act[c] = st.dst[c] = col0 + c < M ? col0 + c : -1;
    mmq_tile<T>(W, rows, blocks_per_row, acts, row0, out, out_kind, st);
  }
}

// ggml_mul_mat_id: out[p, r] = W[e] row r . activation row of pair p (p, or
// its token p / slots unless per_slot) for the pairs p of chosen expert
// e = active[1 + blockIdx.y] (group_pairs_kernel's lists), 64 at a time.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    mmq_grouped_kernel(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
                       matvec::QuantizedActs<TypeInfo<T>::kAct> acts, const int32_t* start, const int32_t* order,
                       const int32_t* active, int64_t slots, bool per_slot, void* out, Float out_kind) {
  using I = TypeInfo<T>;
  __shared__ Stage<T> st;
  if (static_cast<int32_t>(blockIdx.y) >= active[0]) return;  // the whole block: no barrier is left waiting
  const int64_t e = active[1 + blockIdx.y];
  const int64_t first = start[e], last = start[e + 1];
  const uint8_t* expert = W + e * rows * blocks_per_row * I::kBytes;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  for (int64_t c0 = first; c0 < last; c0 += kCols) {
    __syncthreads();  // the previous tile's stores have read st.dst
    for (int c = threadIdx.x; c < kCols; c += kThreads) {
      const int64_t p = c0 + c < last ? order[c0 + c] : -1;
      st.dst[c] = p;
      st.act[c] = p < 0 || per_slot ? p : p / slots;
    }
    mmq_tile<T>(expert, rows, blocks_per_row, acts, row0, out, out_kind, st);
  }
}

}  // namespace mmq
}  // namespace cuda
}  // namespace lowbit
