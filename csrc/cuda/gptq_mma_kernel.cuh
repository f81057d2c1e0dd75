// The tensor-core kernel of CUDA gptq_gemm, for fp16 / bf16 activations at
// small and medium M (gptq_mma.cu launches it; gptq_gemm.cu decides where it
// serves). It is also compiled as host code by the CPU emulator (tests/simt),
// which runs it on emulated warps in the CPU tests.
//
// mma.sync m16n8k16 multiplies the activations (their own dtype, exact) by
// weight fragments that hold q - zero exactly (|q - zero| <= 256 is exact in
// fp16 and bf16), accumulating in fp32; each group's fp32 sums are scaled
// once, in fp32, and added to the result: the weights stay the op's fp32
// scale * (q - zero), as in every other gptq_gemm path.
//
// - A block owns 128 columns (32 per warp, four n8 tiles) and 16, 32 or 64
//   activation rows (MT = 1, 2 or 4 m16 tiles, each B fragment decoded once
//   for all of them, as Marlin's thread_m_blocks); K is walked in 64-row
//   chunks, packed weights and activations copied to shared memory by
//   cp.async in a 2-4 stage pipeline; split-K as in the fused kernel (fp32
//   slices summed in a fixed order: deterministic).
// - A lane's B fragment rows (2t, 2t + 1, 2t + 8, 2t + 9 of a k16 step, t =
//   lane % 4) are adjacent fields of packed words for 2, 4 and 8 bits
//   (PairLayout: three instructions per pair for fp16), and its n8 column is
//   one of 4 adjacent columns that one 16-byte shared load brings: n8 tile j
//   holds columns 4c + j of the warp's 32 (c = lane / 4).
// - Groups: with a g_idx (staged in shared memory with each chunk), every
//   k16 step checks that its 16 rows share one
//   group (sorted groups on 16-row boundaries: plain checkpoints and sorted
//   act-order rows); a step whose rows span groups runs once per group with
//   the other rows' fragments zeroed, so any g_idx gives the exact result.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../core/gptq_format.h"
#include "gptq_cuda.cuh"
#include "warp_instructions.cuh"

namespace lowbit {
namespace cuda {
namespace mma {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTileN = 32 * kWarps;  // columns per block
constexpr int kChunk = 64;           // K rows per pipeline stage
constexpr int kSteps = kChunk / 16;  // k16 steps per chunk
constexpr int kAStride = kChunk + 8;  // halves per staged activation row: conflict-free fragment loads
// Blocks wanted per multiprocessor before split-K is worth its workspace.
constexpr int kTargetBlocksPerSM = 4;
constexpr uint32_t kMagicBits = 0x4B000000u;  // (bits | q) as float is 2^23 + q
constexpr float kMagic = 8388608.0f;

// Pipeline stages by bit width and m16 tiles: within static shared memory's
// 48 KB (the kernel checks), fewer for 8 bits and for four tiles.
template <int B, int MT>
constexpr int kStages = MT == 4 ? (B == 8 ? 2 : 3) : (B == 8 ? 3 : 4);

// The m16 tiles a block takes for M activation rows: the fewest that hold
// them, at most 4 (larger M takes several blocks).
inline int m_tiles(int64_t M) { return M <= 16 ? 1 : M <= 32 ? 2 : 4; }

// f(std::integral_constant<int, MT>) for mt = m_tiles(M).
template <typename F>
void dispatch_m_tiles(int mt, F&& f) {
  switch (mt) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

struct MmaArgs {
  GptqView w;
  const uint16_t* a;  // [M, K] fp16 / bf16 bits in the weight's row order, rows 16-byte aligned
  int64_t M;
  SplitK s;
};

// Two exact integers as the low and high halves of a T pair.
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(lo, hi);
    __builtin_memcpy(&r, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    __builtin_memcpy(&r, &h, 4);
  }
  return r;
}

// Where a lane's row pair (rows 2t, 2t + 1 of a k16 step, h = 0; 2t + 8,
// 2t + 9, h = 1) sits in its packed word: the pair's 2B bits start at bit
// off[h]. fp16 decodes with three instructions per pair: __byte_perm puts the
// byte(s) holding the two fields at bytes 0 and 2, one lop3 keeps the fields
// (the first at bit s of its half, the second at bit s2) under fp16's 1024,
// and one fma scales each half by its power of two and subtracts
// 1024 * 2^-s + zero: exactly q - zero.
template <int B>
struct PairLayout {
  int off[2];
  uint32_t sel[2];
  uint32_t mask;
  float mul[2];  // 2^-s, 2^-s2

  __device__ __forceinline__ explicit PairLayout(int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      off[h] = ((2 * t + 8 * h) * B) % 32;
      const uint32_t b0 = off[h] / 8, b1 = (off[h] + B) / 8;  // bytes of the two fields
      sel[h] = b0 | (b0 << 4) | (b1 << 8) | (b1 << 12);
    }
    const int s = off[0] % 8, s2 = (off[0] + B) % 8;  // the same for both pairs
    mask = (((1u << B) - 1) << s) | ((((1u << B) - 1) << s2) << 16);
    mul[0] = 1.0f / static_cast<float>(1 << s);
    mul[1] = 1.0f / static_cast<float>(1 << s2);
  }
};

// A lane's parameters of one group: what decodes its 4 B columns (fp16:
// the fma's addends as half pairs; bf16: 2^23 + zero), and the scales of its
// 8 output columns (n8 tile j, d-pair element e: column 8t + 4e + j).
struct Group {
  uint32_t add[4];
  float zero_magic[4];
  float scale[4][2];
};

template <int B, typename T>
__device__ __forceinline__ Group load_group(const GptqView& w, int32_t g, int64_t bcol, int64_t ccol,
                                           const PairLayout<B>& lay) {
  Group p;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float z = bcol + j < w.N ? static_cast<float>(zero_at<B>(w, g, bcol + j)) : 0.0f;
    if constexpr (std::is_same_v<T, __half>) {
      p.add[j] = pack_pair<__half>(-(1024.0f * lay.mul[0] + z), -(1024.0f * lay.mul[1] + z));
    } else {
      p.zero_magic[j] = kMagic + z;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t c = ccol + 4 * e + j;
      p.scale[j][e] = c < w.N ? scale_at(w, g, c) : 0.0f;
    }
  }
  return p;
}

// q - zero of the lane's row pair h in `word` (column j of its group), exact, as a T pair.
template <int B, typename T>
__device__ __forceinline__ uint32_t decode_pair(uint32_t word, int h, int j, const PairLayout<B>& lay,
                                                const Group& p) {
  if constexpr (std::is_same_v<T, __half>) {
    // (bytes & mask) | 1024's exponent in one lop3.
    const uint32_t biased = lop3<0xEA>(__byte_perm(word, 0, lay.sel[h]), lay.mask, 0x64006400u);
    __half2 v, mul, add;
    __builtin_memcpy(&v, &biased, 4);
    mul = __floats2half2_rn(lay.mul[0], lay.mul[1]);
    __builtin_memcpy(&add, &p.add[j], 4);
    const __half2 r = __hfma2(v, mul, add);
    uint32_t out;
    __builtin_memcpy(&out, &r, 4);
    return out;
  } else {
    constexpr uint32_t kMask = (1u << B) - 1;
    const uint32_t f = word >> lay.off[h];
    return pack_pair<T>(__uint_as_float(kMagicBits | (f & kMask)) - p.zero_magic[j],
                        __uint_as_float(kMagicBits | ((f >> B) & kMask)) - p.zero_magic[j]);
  }
}

// The lane's m16n8k16 A fragment of the 16x16 tile at `tile` (row-major,
// rows `stride` elements apart, 16-byte aligned) by one ldmatrix: lane
// 8i + r gives row r of 8x8 matrix i, rows + 8 for odd i, columns + 8 for i >= 2.
__device__ __forceinline__ void load_a_fragment(uint32_t (&a)[4], const uint16_t* tile, int stride, int lane) {
  ldmatrix_x4(a, tile + ((lane & 7) + 8 * ((lane >> 3) & 1)) * stride + 8 * (lane >> 4));
}

// acc += scale * part per output column; part restarts.
template <int MT>
__device__ __forceinline__ void flush(float (&acc)[MT][4][4], float (&part)[MT][4][4], const Group& p) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        acc[mt][j][r] = fmaf(p.scale[j][r & 1], part[mt][j][r], acc[mt][j][r]);
        part[mt][j][r] = 0.0f;
      }
}

// One block: columns [tile * 128, +128), activation rows [mc * 16 * MT, +16 * MT),
// K chunks [split * chunks_per_split, +chunks_per_split).
template <int B, int MT, typename T>
__global__ void __launch_bounds__(kThreads) gptq_mma_kernel(const MmaArgs p) {
  constexpr int kWordRows = kChunk * B / 32;  // packed rows per chunk
  constexpr int S = kStages<B, MT>;
  static_assert(S * (kWordRows * kTileN * 4 + 16 * MT * kAStride * 2 + kChunk * 4) <= 48 * 1024,
                "the stages fit static shared memory");
  __shared__ __align__(16) uint32_t w_s[S][kWordRows][kTileN];
  __shared__ __align__(16) uint16_t a_s[S][16 * MT][kAStride];
  __shared__ int32_t g_s[S][kChunk];  // the chunk's g_idx values (with a g_idx)

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int c = lane >> 2, t = lane & 3;
  const SplitK::Block blk = p.s.block(blockIdx.x);
  const int64_t K = p.w.K, N = p.w.N;
  const int64_t n_block = static_cast<int64_t>(blk.tile) * kTileN;
  const int64_t m0 = static_cast<int64_t>(blk.mc) * 16 * MT;
  const int64_t c_begin = blk.c_begin;
  const int nchunks = static_cast<int>(blk.c_end - blk.c_begin);

  auto load_stage = [&](int stage, int64_t chunk) {
    const int64_t k0 = chunk * kChunk;
    for (int i = threadIdx.x; i < kWordRows * (kTileN / 4); i += kThreads) {
      const int r = i / (kTileN / 4), v = i % (kTileN / 4);
      const int64_t col = n_block + 4 * v;
      const bool valid = col < N;  // N % 4 == 0: a 16-byte run is all in or all out
      cp_async16(&w_s[stage][r][4 * v], p.w.qweight + (k0 * B / 32 + r) * N + (valid ? col : 0), valid);
    }
    for (int i = threadIdx.x; i < 16 * MT * (kChunk / 8); i += kThreads) {
      const int r = i / (kChunk / 8), v = i % (kChunk / 8);
      const int64_t row = m0 + r;
      const bool valid = row < p.M;
      cp_async16(&a_s[stage][r][8 * v], p.a + (valid ? row : 0) * K + k0 + 8 * v, valid);
    }
    // The rows' groups travel with the stage: a k16 step reads them from
    // shared memory, not from global memory on its way to the vote.
    if (p.w.g_idx != nullptr && threadIdx.x < kChunk) cp_async4(&g_s[stage][threadIdx.x], p.w.g_idx + k0 + threadIdx.x);
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nchunks) load_stage(s, c_begin + s);
    cp_async_commit();
  }

  float acc[MT][4][4], part[MT][4][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[mt][j][r] = part[mt][j][r] = 0.0f;
  const int64_t bcol = n_block + warp * 32 + 4 * c;  // the lane's B columns: bcol + j
  const int64_t ccol = n_block + warp * 32 + 8 * t;  // its output columns: ccol + 4e + j
  const PairLayout<B> lay(t);
  Group gp = {};
  int32_t cur_g = -1;
  int64_t next_k = 0;  // trivial grouping: the first row of the next group

  for (int i = 0; i < nchunks; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();  // chunk i is in shared memory; every warp is done with chunk i - 1's stage
    {
      const int nx = i + S - 1;
      if (nx < nchunks) load_stage(nx % S, c_begin + nx);
      cp_async_commit();
    }
    const int st = i % S;
    const int64_t k0 = (c_begin + i) * kChunk;
#pragma unroll 1
    for (int ks = 0; ks < kSteps; ++ks) {
      const int64_t k = k0 + 16 * ks;
      // The lane's row pairs of this step and their packed words, [pair][n8 tile].
      const int rows[2] = {16 * ks + 2 * t, 16 * ks + 2 * t + 8};
      uint32_t words[2][4];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = *reinterpret_cast<const uint4*>(&w_s[st][rows[h] * B / 32][warp * 32 + 4 * c]);
        words[h][0] = v.x;
        words[h][1] = v.y;
        words[h][2] = v.z;
        words[h][3] = v.w;
      }
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) load_a_fragment(a[mt], &a_s[st][16 * mt][16 * ks], kAStride, lane);
      // The step's group g; with a g_idx, each of the lane's four rows' groups
      // and whether all 16 rows of the step share g.
      int32_t g;
      bool uniform = true;
      int32_t lane_g[4] = {0, 0, 0, 0};
      if (p.w.g_idx == nullptr) {
        if (k >= next_k) {
          g = static_cast<int32_t>(k / p.w.group_size);
          next_k = (g + int64_t{1}) * p.w.group_size;
        } else {
          g = cur_g;
        }
      } else {
        g = g_s[st][16 * ks];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            lane_g[2 * h + e] = g_s[st][rows[h] + e];
            CUDA_KERNEL_ASSERT(lane_g[2 * h + e] >= 0 && lane_g[2 * h + e] < p.w.groups &&
                               "gptq: b_g_idx value out of range");
          }
        uniform = __all_sync(0xffffffffu, lane_g[0] == g && lane_g[1] == g && lane_g[2] == g && lane_g[3] == g);
      }
      if (uniform) {
        if (g != cur_g) {
          if (cur_g >= 0) flush<MT>(acc, part, gp);
          gp = load_group<B, T>(p.w, g, bcol, ccol, lay);
          cur_g = g;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b0 = decode_pair<B, T>(words[0][j], 0, j, lay, gp);
          const uint32_t b1 = decode_pair<B, T>(words[1][j], 1, j, lay, gp);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma16816<T>(part[mt][j], a[mt], b0, b1);
        }
        continue;
      }
      // Rows of several groups (an unsorted g_idx): one pass per group, in
      // increasing group order, each with the other rows' fragments zeroed.
      if (cur_g >= 0) flush<MT>(acc, part, gp);
      cur_g = -1;
      int32_t h_g = -1;
      while (true) {
        int32_t lane_next = INT32_MAX;
#pragma unroll
        for (int q = 0; q < 4; ++q)
          if (lane_g[q] > h_g && lane_g[q] < lane_next) lane_next = lane_g[q];
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
          const int32_t other = __shfl_xor_sync(0xffffffffu, lane_next, o);
          lane_next = other < lane_next ? other : lane_next;
        }
        if (lane_next == INT32_MAX) break;
        h_g = lane_next;
        const Group hp = load_group<B, T>(p.w, h_g, bcol, ccol, lay);
        // The halves of the lane's pairs whose rows are in group h_g; the
        // others are +0 in the weights and in the activations (an infinite
        // activation of another group's row gives 0, not 0 * inf = NaN). A
        // lane's A columns are its B rows: 2t, 2t + 1 (a0, a1), 2t + 8, 2t + 9 (a2, a3).
        uint32_t keep[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          keep[h] = (lane_g[2 * h] == h_g ? 0x0000ffffu : 0u) | (lane_g[2 * h + 1] == h_g ? 0xffff0000u : 0u);
        }
        uint32_t am[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 4; ++r) am[mt][r] = a[mt][r] & keep[r / 2];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t b0 = decode_pair<B, T>(words[0][j], 0, j, lay, hp) & keep[0];
          const uint32_t b1 = decode_pair<B, T>(words[1][j], 1, j, lay, hp) & keep[1];
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma16816<T>(part[mt][j], am[mt], b0, b1);
        }
        flush<MT>(acc, part, hp);
      }
    }
  }
  cp_async_wait<0>();
  if (cur_g >= 0) flush<MT>(acc, part, gp);

  // d0, d1: row c, columns 2t, 2t + 1 of the n8 tile; d2, d3: row c + 8.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int64_t row = m0 + 16 * mt + c + 8 * (r >> 1);
      if (row >= p.M) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t col = ccol + 4 * (r & 1) + j;
        if (col < N) p.s.store(blk.split, row, col, acc[mt][j][r]);
      }
    }
}

}  // namespace mma
}  // namespace cuda
}  // namespace lowbit
