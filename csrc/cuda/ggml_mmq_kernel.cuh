// The tensor-core kernel of CUDA ggml_mul_mat_a8 at large M for the sliced
// types (core/ggml_slices.h): int8 mma.sync on the weights' levels and the
// quantized activations' levels, as llama.cpp's MMQ. Also compiled as host
// code by the CPU emulator (tests/simt).
//
// A block owns kRows weight rows x kCols activation rows of the output; each
// of its 4 warps 16 weight rows x all kCols activation rows (8 mma tiles).
// K runs in stages of kStageSlices 32-element slices:
// - the block decodes each (weight row, slice) of the stage once, by its
//   SliceCodec, into shared memory (levels as int8 words, scales, mins), and
//   copies the stage's activation levels, scales and sums there;
// - per slice, mma.sync m16n8k16 (int8 into int32) gives every output's
//   exact integer sum per 16 elements; a sub-block of 16 takes its own, one
//   of 32 adds its two halves (exact);
// - ggml::add_sub_block combines each sub-block's integer sum with its
//   scales and mins, as the CPU and the matvec do. The fp32 sums run over a
//   weight block's sub-blocks in order and are added to the output's sum per
//   block, block_dot's order.
// No atomics: every output is one lane's sum, the same bits on every run.
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
constexpr int kStageSlices = 8;     // 256 elements of K, a whole Q8_K block
constexpr int kStageElems = kStageSlices * ggml::kSliceElems;
// A row's words in shared memory: the stage's 8 words per slice, plus 4 so
// that the 8 rows one fragment load touches (4 words apart in the row)
// fall in 32 distinct banks.
constexpr int kRowWords = kStageSlices * 8 + 4;

template <ggml::Type T>
struct Stage {
  using I = TypeInfo<T>;
  using L = ggml::ActLayout<I::kAct>;
  static constexpr int kSubs = ggml::Slice<T>::kSubs;
  static constexpr int kMinSubs = I::kHasMin ? kSubs : 1;
  static constexpr int kActScales = kStageElems / L::kBlock;
  static constexpr int kActSums = I::kHasMin ? kStageElems / L::kSumBlock : 1;
  uint32_t wq[kRows][kRowWords];
  float wd[kRows][kStageSlices][kSubs];
  float wm[kRows][kStageSlices][kMinSubs];
  uint32_t xq[kCols][kRowWords];
  float xd[kCols][kActScales];
  float xs[kCols][kActSums];
};

// Puts stage s0 (slices s0 .. s0 + count of every row) of weight rows row0
// .. and activation rows col0 .. into st; rows past the ends as zeros.
template <ggml::Type T>
__device__ __forceinline__ void load_stage(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
                                           const matvec::QuantizedActs<TypeInfo<T>::kAct>& acts, int64_t M,
                                           int64_t row0, int64_t col0, int64_t s0, int count, Stage<T>& st) {
  using I = TypeInfo<T>;
  using S = Stage<T>;
  using L = typename S::L;
  constexpr int kSlicesPerBlock = I::kBlock / ggml::kSliceElems;
  for (int u = threadIdx.x; u < kRows * kStageSlices; u += kThreads) {
    const int r = u / kStageSlices, j = u % kStageSlices;
    ggml::Slice<T> sl;
    if (row0 + r < rows && j < count) {
      const int64_t s = s0 + j;
      ggml::SliceCodec<T>::decode(W + ((row0 + r) * blocks_per_row + s / kSlicesPerBlock) * I::kBytes,
                                  static_cast<int>(s % kSlicesPerBlock), sl);
    } else {
      for (int i = 0; i < 8; ++i) sl.q[i] = 0u;
      for (int k = 0; k < S::kSubs; ++k) sl.d[k] = 0.0f;
      for (int k = 0; k < S::kMinSubs; ++k) sl.m[k] = 0.0f;
    }
    for (int i = 0; i < 8; ++i) st.wq[r][8 * j + i] = sl.q[i];
    for (int k = 0; k < S::kSubs; ++k) st.wd[r][j][k] = sl.d[k];
    if constexpr (I::kHasMin) {
      for (int k = 0; k < S::kSubs; ++k) st.wm[r][j][k] = sl.m[k];
    }
  }
  // Activation levels: 16 bytes per thread and step (row offsets are
  // multiples of 32 bytes from a 16-byte aligned start).
  const int64_t n = acts.n, first = s0 * ggml::kSliceElems;
  for (int u = threadIdx.x; u < kCols * kStageSlices * 2; u += kThreads) {
    const int c = u / (2 * kStageSlices), v = u % (2 * kStageSlices);
    uint4 w = {0u, 0u, 0u, 0u};
    if (col0 + c < M && v < 2 * count) w = *reinterpret_cast<const uint4*>(acts.q + (col0 + c) * n + first + 16 * v);
    st.xq[c][4 * v] = w.x;
    st.xq[c][4 * v + 1] = w.y;
    st.xq[c][4 * v + 2] = w.z;
    st.xq[c][4 * v + 3] = w.w;
  }
  const int elems = count * ggml::kSliceElems;
  for (int u = threadIdx.x; u < kCols * S::kActScales; u += kThreads) {
    const int c = u / S::kActScales, k = u % S::kActScales;
    st.xd[c][k] = col0 + c < M && k * L::kBlock < elems ? acts.d[(col0 + c) * (n / L::kBlock) + first / L::kBlock + k]
                                                         : 0.0f;
  }
  if constexpr (I::kHasMin) {
    for (int u = threadIdx.x; u < kCols * S::kActSums; u += kThreads) {
      const int c = u / S::kActSums, k = u % S::kActSums;
      st.xs[c][k] = col0 + c < M && k * L::kSumBlock < elems
                        ? acts.sum[(col0 + c) * (n / L::kSumBlock) + first / L::kSumBlock + k]
                        : 0.0f;
    }
  }
}

// out[m, r] = activation row m . weight row r, for the block's tile.
template <ggml::Type T>
__global__ void __launch_bounds__(kThreads)
    mmq_kernel(const uint8_t* W, int64_t rows, int64_t blocks_per_row,
               matvec::QuantizedActs<TypeInfo<T>::kAct> acts, int64_t M, void* out, Float out_kind) {
  using I = TypeInfo<T>;
  using S = Stage<T>;
  constexpr int kSubs = S::kSubs;
  constexpr int kSlicesPerBlock = I::kBlock / ggml::kSliceElems;
  __shared__ Stage<T> st;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wr = 16 * warp;  // the warp's first weight row in the tile
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t slices = blocks_per_row * kSlicesPerBlock;
  for (int64_t col0 = static_cast<int64_t>(blockIdx.y) * kCols; col0 < M; col0 += int64_t{gridDim.y} * kCols) {
    float acc[kTiles][4], blk[kTiles][4];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[nt][r] = blk[nt][r] = 0.0f;
    }
    for (int64_t s0 = 0; s0 < slices; s0 += kStageSlices) {
      const int count = static_cast<int>(std::min<int64_t>(kStageSlices, slices - s0));
      __syncthreads();  // every warp is done with the previous stage
      load_stage<T>(W, rows, blocks_per_row, acts, M, row0, col0, s0, count, st);
      __syncthreads();
      for (int j = 0; j < count; ++j) {
        int32_t isum[kSubs][kTiles][4];
#pragma unroll
        for (int k = 0; k < kSubs; ++k) {
#pragma unroll
          for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
            for (int r = 0; r < 4; ++r) isum[k][nt][r] = 0;
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t a0 = st.wq[wr + g][8 * j + 4 * h + t], a1 = st.wq[wr + g + 8][8 * j + 4 * h + t];
#pragma unroll
          for (int nt = 0; nt < kTiles; ++nt) {
            mma16816_s8(isum[kSubs == 2 ? h : 0][nt], a0, a1, st.xq[8 * nt + g][8 * j + 4 * h + t]);
          }
        }
        // The outputs' sub-block terms, through shared-memory activation rows
        // indexed from the stage's first element.
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            const int wrow = wr + g + 8 * (r / 2), c = 8 * nt + 2 * t + (r % 2);
            const ggml::ActRow a{nullptr, st.xd[c], st.xs[c]};
#pragma unroll
            for (int k = 0; k < kSubs; ++k) {
              const float m = I::kHasMin ? st.wm[wrow][j][k % S::kMinSubs] : 0.0f;
              ggml::add_sub_block<T>(blk[nt][r], st.wd[wrow][j][k], m, isum[k][nt][r], a,
                                     j * ggml::kSliceElems + k * I::kSub);
            }
          }
        }
        if ((s0 + j + 1) % kSlicesPerBlock == 0) {
#pragma unroll
          for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
            for (int r = 0; r < 4; ++r) {
              acc[nt][r] += blk[nt][r];
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
        const int64_t row = row0 + wr + g + 8 * (r / 2), col = col0 + 8 * nt + 2 * t + (r % 2);
        if (row < rows && col < M) store_float(out, out_kind, col * rows + row, acc[nt][r]);
      }
    }
  }
}

}  // namespace mmq
}  // namespace cuda
}  // namespace lowbit
