// The fused CUDA-core kernel of gptq_gemm (gptq_gemm.cu launches it and
// describes where it serves): a GEMV at heart, bound by reading the packed
// weight. Also compiled as host code by the CPU emulator (tests/simt).
#pragma once

#include <cstdint>

#include "../core/gptq_format.h"
#include "common.cuh"
#include "gptq_cuda.cuh"

namespace lowbit {
namespace cuda {
namespace gemv {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kColsPerLane = 4;                // one 128-bit load: 4 int32 words of 4 adjacent columns
constexpr int kTileN = 32 * kColsPerLane;     // columns per block
constexpr int kChunk = 512;                    // K rows staged in shared memory per block iteration
constexpr int kRowsPerWarp = kChunk / kWarps;  // 64: whole packs for every bit width (3-bit packs 32 rows)
// Blocks wanted in flight per multiprocessor before split-K is worth its
// workspace: about two resident blocks, two waves. A guess to be tuned.
constexpr int kTargetBlocksPerSM = 4;
// 2^23 as float bits: (bits | q) as float is exactly 2^23 + q for q < 2^23.
constexpr uint32_t kMagicBits = 0x4B000000u;
constexpr float kMagic = 8388608.0f;

// Activation rows per block (the kernel's MT) for M rows.
inline int rows_per_block(int64_t M) { return M <= 1 ? 1 : (M <= 2 ? 2 : (M <= 4 ? 4 : 8)); }

struct GemvArgs {
  GptqView w;
  const void* a;  // [M, K] contiguous
  Float a_kind;
  const int32_t* perm;  // shuffled weights: a's column of shuffled row i is perm[i]; null otherwise
  int64_t M;
  bool per_row_groups;  // a pack's rows may span groups (g_idx given, or group_size % fields != 0)
  SplitK s;
};

__device__ __forceinline__ uint32_t lane_word(const uint4& v, int c) {
  return c == 0 ? v.x : (c == 1 ? v.y : (c == 2 ? v.z : v.w));
}

// Scale and 2^23 + zero point of one group for a lane's 4 columns.
struct GroupParams {
  float scale[kColsPerLane];
  float zero_magic[kColsPerLane];
};

// Inlined at two places only: once per pack on the fast path, and in the
// row-by-row loop for packs whose rows span several groups.
template <int B>
__device__ __forceinline__ GroupParams load_group(const GptqView& w, int32_t g, int64_t n) {
  GroupParams gp;
#pragma unroll
  for (int c = 0; c < kColsPerLane; ++c) {
    gp.scale[c] = scale_at(w, g, n + c);
    gp.zero_magic[c] = kMagic + static_cast<float>(zero_at<B>(w, g, n + c));
  }
  return gp;
}

// acc += scale * part per column at the end of a group (kFactorScale); part restarts.
template <int MT>
__device__ __forceinline__ void flush_group(float (&acc)[MT][kColsPerLane], float (&part)[MT][kColsPerLane],
                                            const GroupParams& gp) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) {
      acc[m][c] = fmaf(gp.scale[c], part[m][c], acc[m][c]);
      part[m][c] = 0.0f;
    }
}

// One weight (field q of column c, shared-memory row r) into the MT sums of
// the row-by-row path.
template <int MT, bool kFactorScale, int kPartRows>
__device__ __forceinline__ void accumulate(float (&acc)[MT][kColsPerLane], float (&part)[kPartRows][kColsPerLane],
                                           const GroupParams& gp, int c, uint32_t q, const float (&a_s)[MT][kChunk],
                                           int r) {
  const float qz = __uint_as_float(kMagicBits | q) - gp.zero_magic[c];
  if constexpr (kFactorScale) {
#pragma unroll
    for (int m = 0; m < MT; ++m) part[m][c] = fmaf(a_s[m][r], qz, part[m][c]);
  } else {
    const float wv = qz * gp.scale[c];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m][c] = fmaf(a_s[m][r], wv, acc[m][c]);
  }
}

// One block: columns [tile * 128, +128), activation rows [mc * MT, +MT),
// K chunks [split * chunks_per_split, +chunks_per_split).
template <int B, int MT>
__global__ void __launch_bounds__(kThreads) gptq_gemv_kernel(const GemvArgs p) {
  using P = gptq::Pack<B>;
  constexpr int kPacksPerWarp = kRowsPerWarp / P::kFields;
  // Words loaded before first use (per lane, 16 bytes each): enough bytes in
  // flight to cover memory latency, fewer for large MT where the
  // accumulators need the registers.
  constexpr int kBatchWords = MT <= 2 ? 8 : 4;
  constexpr int kPacksPerBatch =
      kBatchWords / P::kWords < 1 ? 1 : (kBatchWords / P::kWords > kPacksPerWarp ? kPacksPerWarp : kBatchWords / P::kWords);
  // Small MT: accumulate sum(a * (q - zero)) per group and multiply by the
  // scale once per group (saves a multiply per weight, which matters when
  // there are only 1-2 multiply-adds per weight). Large MT: scale each weight
  // (the multiply is shared by MT rows) and save the registers of `part`.
  constexpr bool kFactorScale = MT <= 2;
  static_assert(kRowsPerWarp % P::kFields == 0, "a warp's rows must be whole packs");
  static_assert(P::kFields % 4 == 0, "activations are read 4 rows at a time");

  __shared__ __align__(16) float a_s[MT][kChunk];
  __shared__ int32_t g_s[kChunk];
  __shared__ __align__(16) float red_s[kWarps - 1][MT][kTileN];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // The block's place, spelled out rather than through SplitK::block: with
  // the helper ptxas gives the 2-bit M = 1 kernel 80 registers and spills.
  int64_t bid = blockIdx.x;
  const int mc = static_cast<int>(bid % p.s.m_chunks);
  bid /= p.s.m_chunks;
  const int tile = static_cast<int>(bid % p.s.n_tiles);
  const int split = static_cast<int>(bid / p.s.n_tiles);
  const int64_t K = p.w.K, N = p.w.N;
  const int64_t m0 = static_cast<int64_t>(mc) * MT;
  const int mrows = static_cast<int>(p.M - m0 < MT ? p.M - m0 : MT);
  const int64_t n = static_cast<int64_t>(tile) * kTileN + lane * kColsPerLane;
  const bool active = n < N;  // N % 4 == 0, so a lane has all 4 columns or none

  float acc[MT][kColsPerLane];
  float part[kFactorScale ? MT : 1][kColsPerLane];  // sum of a * (q - zero) over the current group
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) acc[m][c] = 0.0f;
#pragma unroll
  for (int m = 0; m < (kFactorScale ? MT : 1); ++m)
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) part[m][c] = 0.0f;
  GroupParams gp = {};
  int32_t cur_g = -1;

  const int64_t chunks = (K + kChunk - 1) / kChunk;
  const int64_t c_begin = static_cast<int64_t>(split) * p.s.chunks_per_split;
  const int64_t c_end = c_begin + p.s.chunks_per_split < chunks ? c_begin + p.s.chunks_per_split : chunks;
  const uint4* qw = reinterpret_cast<const uint4*>(p.w.qweight);
  const int64_t row_vecs = N / kColsPerLane;  // uint4s per packed row
  const int64_t lane_vec = n / kColsPerLane;

  for (int64_t chunk = c_begin; chunk < c_end; ++chunk) {
    const int64_t k0 = chunk * kChunk;
    const int rows = static_cast<int>(K - k0 < kChunk ? K - k0 : kChunk);
    __syncthreads();  // every warp is done with the previous chunk's a_s / g_s
    for (int i = threadIdx.x; i < rows; i += kThreads) {
      const int64_t k = k0 + i;
      int64_t src = k;
      if (p.perm != nullptr) {
        src = p.perm[k];
        CUDA_KERNEL_ASSERT(src >= 0 && src < K && "gptq_gemm: b_g_idx (q_perm) value out of range");
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) a_s[m][i] = m < mrows ? load_float(p.a, p.a_kind, (m0 + m) * K + src) : 0.0f;
      g_s[i] = static_cast<int32_t>(group_of(p.w, k));
    }
    __syncthreads();

    const int r0 = warp * kRowsPerWarp;
    const int packs = (rows - r0 < kRowsPerWarp ? rows - r0 : kRowsPerWarp) / P::kFields;  // warp-uniform
    // Bit u: all rows of the warp's pack u are in one group (always so
    // without g_idx when group_size is a multiple of the pack; with a g_idx,
    // e.g. a plain checkpoint's k / group_size, checked here per chunk).
    uint32_t uniform_mask = 0xffffffffu;
    if (p.per_row_groups) {
      bool uniform = true;
      if (lane < packs) {
        const int rb = r0 + lane * P::kFields;
        const int32_t g0 = g_s[rb];
        for (int i = 1; i < P::kFields; ++i) uniform &= g_s[rb + i] == g0;
      }
      uniform_mask = __ballot_sync(0xffffffffu, uniform);
    }
    if (!active || packs <= 0) continue;
    const int64_t pack0 = (k0 + r0) / P::kFields;
#pragma unroll 1
    for (int pb = 0; pb < packs; pb += kPacksPerBatch) {
      uint4 words[kPacksPerBatch][P::kWords];
#pragma unroll
      for (int u = 0; u < kPacksPerBatch; ++u) {
        if (pb + u < packs) {
#pragma unroll
          for (int v = 0; v < P::kWords; ++v) {
            words[u][v] = __ldg(qw + ((pack0 + pb + u) * P::kWords + v) * row_vecs + lane_vec);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kPacksPerBatch; ++u) {
        if (pb + u >= packs) break;
        const int rbase = r0 + (pb + u) * P::kFields;
        if (!((uniform_mask >> (pb + u)) & 1u)) {
          // Rare slow path (unshuffled act-order g_idx): row by row, each
          // row's fields re-read through the shared unpack helper (L1 hits).
#pragma unroll 1
          for (int j = 0; j < P::kFields; ++j) {
            const int r = rbase + j;
            const int32_t g = g_s[r];
            if (g != cur_g) {
              if constexpr (kFactorScale) {
                if (cur_g >= 0) flush_group<MT>(acc, part, gp);
              }
              gp = load_group<B>(p.w, g, n);
              cur_g = g;
            }
#pragma unroll
            for (int c = 0; c < kColsPerLane; ++c) {
              const uint32_t q = gptq::unpack_field<B>(p.w.qweight + n + c, N, k0 + r);
              accumulate<MT, kFactorScale>(acc, part, gp, c, q, a_s, r);
            }
          }
          continue;
        }
        {
          const int32_t g = g_s[rbase];
          if (g != cur_g) {
            if constexpr (kFactorScale) {
              if (cur_g >= 0) flush_group<MT>(acc, part, gp);
            }
            gp = load_group<B>(p.w, g, n);
            cur_g = g;
          }
        }
        float av[MT][4];
#pragma unroll
        for (int j = 0; j < P::kFields; ++j) {
          const int r = rbase + j;
          if (j % 4 == 0) {
#pragma unroll
            for (int m = 0; m < MT; ++m) {
              const float4 v4 = *reinterpret_cast<const float4*>(&a_s[m][r]);
              av[m][0] = v4.x;
              av[m][1] = v4.y;
              av[m][2] = v4.z;
              av[m][3] = v4.w;
            }
          }
          // j is a compile-time constant here, so the field's words and
          // shifts are too (words[] stays in registers).
          const gptq::FieldLoc f = gptq::locate<B>(j);
#pragma unroll
          for (int c = 0; c < kColsPerLane; ++c) {
            const uint32_t q = gptq::extract(lane_word(words[u][f.lo], c), lane_word(words[u][f.hi], c), f);
            const float qz = __uint_as_float(kMagicBits | q) - gp.zero_magic[c];  // exactly q - zero
            if constexpr (kFactorScale) {
#pragma unroll
              for (int m = 0; m < MT; ++m) part[m][c] = fmaf(av[m][j % 4], qz, part[m][c]);
            } else {
              const float wv = qz * gp.scale[c];  // gptq::dequant's value: exact in fp32
#pragma unroll
              for (int m = 0; m < MT; ++m) acc[m][c] = fmaf(av[m][j % 4], wv, acc[m][c]);
            }
          }
        }
      }
    }
  }
  if constexpr (kFactorScale) {
    if (cur_g >= 0) flush_group<MT>(acc, part, gp);
  }

// Sum the warps' partial sums in a fixed order.
  if (warp > 0) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      *reinterpret_cast<float4*>(&red_s[warp - 1][m][lane * kColsPerLane]) =
          make_float4(acc[m][0], acc[m][1], acc[m][2], acc[m][3]);
    }
  }
  __syncthreads();
  if (warp != 0 || !active) return;
#pragma unroll 1
  for (int w = 0; w < kWarps - 1; ++w) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float4 v4 = *reinterpret_cast<const float4*>(&red_s[w][m][lane * kColsPerLane]);
      acc[m][0] += v4.x;
      acc[m][1] += v4.y;
      acc[m][2] += v4.z;
      acc[m][3] += v4.w;
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= mrows) break;
    const int64_t row = m0 + m;
#pragma unroll
    for (int c = 0; c < kColsPerLane; ++c) p.s.store(split, row, n + c, acc[m][c]);
  }
}

}  // namespace gemv
}  // namespace cuda
}  // namespace lowbit
