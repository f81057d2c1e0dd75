// CUDA gptq_gemm: out[M, N] = a[M, K] @ W, accumulated in fp32.
//
// fp16 / bf16 activations at M <= mma_max_m() take the
// tensor-core kernel (gptq_mma.cu) where it serves the weight; otherwise two
// paths, as on the CPU:
//
// * M <= fused_max_m(bit, ...): one fused kernel (gptq_gemv_kernel) decodes each
//   weight once per M-chunk of up to 8 activation rows and accumulates in fp32
//   registers. It is a GEMV at heart and bound by reading the packed weight,
//   so the kernel is built around that read:
//     - a block owns 128 output columns: every lane holds 4 adjacent columns
//       and reads their words with one 128-bit load; a warp reads 512
//       contiguous bytes of a packed row (coalesced);
//     - the block's 8 warps split the block's K range (64 rows each per
//       512-row chunk), with up to 8 words per lane loaded before first use;
//     - the chunk's activations (gathered through q_perm for shuffled
//       weights) and the group of each row are staged in shared memory once
//       per block; per-group partial sums sum(a * (q - zero)) are scaled once
//       per group (one multiply per group and column instead of per weight);
//     - q - zero is formed exactly in fp32 with the 2^23 bit trick (no
//       int->float conversion on the critical path);
//     - split-K across blocks when the column tiles alone cannot fill the GPU:
//       every split writes its own fp32 slice of a [splits, M, N] workspace and
//       a second kernel sums the slices in a fixed order. No atomics: the
//       result is deterministic (same bits on every run, as CUDA-graph replay
//       tests require), there is no output to zero first and so no race on it.
// * larger M: W is dequantized in column tiles (gptq_dequantize.cu) and
//   multiplied by cuBLAS through at::mm. fp32 activations take fp32 tiles and
//   SGEMM (TF32 only if the caller enabled it with
//   torch.backends.cuda.matmul.allow_tf32). fp16 / bf16 activations take each
//   tile as two terms of their own dtype, hi + lo (gptq_cuda.cuh), and two
//   tensor-core GEMMs with fp32 sums and fp32 outputs: a rounded fp16 / bf16
//   copy of W would break the op's fp32 weights, two terms keep them (fp16:
//   exactly) at twice a half GEMM's cost, far under fp32 SGEMM's.
//
// Shuffled weights (use_exllama=True): rows are in q_perm order, b_g_idx is
// that q_perm, so the kernel reads a[m, q_perm[i]] for shuffled row i and row
// i belongs to group i / (K / groups), as in csrc/cpu/gptq_gemm.cpp.
//
// No host synchronisation and no allocation other than the output and
// caching-allocator temporaries (the split-K workspace, the large-M tiles),
// all on the current stream: the op can be captured in a CUDA graph. Index
// values (g_idx, q_perm) are not range-checked on the host (that would need a
// sync); the kernels assert on them instead.
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <vector>

#include "../core/gptq_format.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "common.cuh"
#include "gptq_cuda.cuh"
#include "gptq_gemv_kernel.cuh"
#include "../ops/backend_ops.h"

namespace lowbit {
namespace cuda {
namespace {

// Largest M that takes the fused kernel; above it a large-M path runs. The
// fused kernel re-decodes W once per 8 rows of M, so its time grows with M;
// the large-M paths cost a dequantized copy of W plus cuBLAS, nearly flat in
// M up to a few hundred rows. On an H200 (benchmarks/results/h200-cuda.md,
// 8192x28672, every path forced in turn):
// - fp32 path (fp32 tile, SGEMM): every bit width is faster fused at M = 32
//   and about 1.8x slower at M = 64;
// - two-term path (fp16 / bf16 activations): at M = 64 it takes 0.93-1.03 ms
//   for 2/3/4-bit, less than the fused kernel's 1.08-1.41 ms at M = 32 (and
//   at M = 32 it costs no more than at 64); 8-bit is fused 1.06 ms at M = 32
//   against 1.17 ms for the two-term path at M = 64.
constexpr char kGptqFusedMaxMEnv[] = "LOWBIT_CUDA_GPTQ_FUSED_MAX_M";
int64_t fused_max_m(int64_t bit, bool two_term) {
  return crossover<kGptqFusedMaxMEnv>(two_term && bit != 8 ? 16 : 32);
}

// fp16 / bf16 activations with M <= mma_max_m() take the tensor-core kernel
// (gptq_mma.cu) where it serves the weight; above, the large-M paths' flat
// cost. Not yet run on a GPU: bench_cuda's shipped M sweep against its
// forced fused one (LOWBIT_CUDA_GPTQ_MMA_MAX_M=0) sets it.
constexpr char kGptqMmaMaxMEnv[] = "LOWBIT_CUDA_GPTQ_MMA_MAX_M";
int64_t mma_max_m() { return crossover<kGptqMmaMaxMEnv>(64); }

// fp32 bytes of W decoded per cuBLAS call on the large-M path.
constexpr int64_t kDequantTileBytes = int64_t{256} << 20;

using gemv::GemvArgs;
using gemv::gptq_gemv_kernel;
using gemv::kChunk;
using gemv::kTargetBlocksPerSM;
using gemv::kThreads;
using gemv::kTileN;

// out[i] = sum over splits of partial[s, i], in split order (deterministic).
__global__ void __launch_bounds__(kThreads)
    splitk_reduce_kernel(const float* partial, int splits, int64_t mn, void* out, Float out_kind) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < mn; i += stride) {
    float s = 0.0f;
    for (int sp = 0; sp < splits; ++sp) s += partial[sp * mn + i];
    store_float(out, out_kind, i, s);
  }
}

template <int B, int MT>
void launch_gemv(const GemvArgs& args, int64_t blocks) {
  gptq_gemv_kernel<B, MT><<<static_cast<unsigned int>(blocks), kThreads, 0, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void gemm_fused(const at::Tensor& a2, const GptqView& w, const at::Tensor& perm, int64_t bit, at::Tensor& out) {
  const int64_t M = a2.size(0);
  const int mt = gemv::rows_per_block(M);
  at::Tensor partial;
  int64_t blocks = 0;
  GemvArgs args;
  args.s = plan_split_k(a2, out, mt, kTileN, ceil_div(w.K, kChunk), kTargetBlocksPerSM, partial, blocks);
  args.w = w;
  args.a = a2.data_ptr();
  args.a_kind = float_kind(a2.scalar_type());
  args.perm = perm.defined() && perm.numel() ? perm.data_ptr<int32_t>() : nullptr;
  args.M = M;
  args.per_row_groups = w.g_idx != nullptr || w.group_size % gptq::fields_per_pack(bit) != 0;

  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    switch (mt) {
      case 1: launch_gemv<B, 1>(args, blocks); break;
      case 2: launch_gemv<B, 2>(args, blocks); break;
      case 4: launch_gemv<B, 4>(args, blocks); break;
      default: launch_gemv<B, 8>(args, blocks); break;
    }
  });
  launch_splitk_reduce(partial, args.s);
}

// The large-M paths' activations, contiguous, in the weight's row order
// (shuffled weights: a[:, q_perm]).
at::Tensor in_row_order(const at::Tensor& a, const at::Tensor& perm) {
  return (perm.defined() && perm.numel() ? a.index_select(1, perm) : a).contiguous();
}

// The column tile width of the large-M paths: at most kDequantTileBytes of W
// (4 bytes per weight: an fp32 tile, or the two 16-bit terms).
int64_t dequant_tile_cols(int64_t K, int64_t N) {
  return std::min(N, std::max<int64_t>(kTileN, kDequantTileBytes / (4 * K) / kTileN * kTileN));
}

// at::mm of fp16 / bf16 operands into fp32 (aten::mm.dtype) exists from torch
// 2.8 on; before it, half activations take the fp32 path below.
#define LOWBIT_HALF_MM_TO_FLOAT (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 8))
#if LOWBIT_HALF_MM_TO_FLOAT
// out[m, n0 + j] = (hi[m, j] + lo[m, j] * 2^-lo_shift) * 2^-exps[n0 + j], rounded once to out's dtype.
__global__ void __launch_bounds__(kThreads)
    combine_split_kernel(const float* hi, const float* lo, const int32_t* exps, int lo_shift, int64_t rows,
                         int64_t width, int64_t N, int64_t n0, void* out, Float out_kind) {
  const int64_t total = rows * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t m = i / width, j = i % width;
    const float v = ldexpf(hi[i] + ldexpf(lo[i], -lo_shift), -exps[n0 + j]);
    store_float(out, out_kind, m * N + n0 + j, v);
  }
}

// Whether cuBLAS multiplies a's dtype into fp32 here: torch refuses fp16 ->
// fp32 while torch.backends.cuda.matmul.allow_fp16_accumulation is set, and
// bf16 -> fp32 below compute capability 8.0.
bool split_mm_serves(const at::Tensor& a) {
  if (a.scalar_type() == at::kHalf) return !at::globalContext().allowFP16AccumulationCuBLAS();
  return a.scalar_type() == at::kBFloat16 && compute_major(a.get_device()) >= 8;
}

// Large M with fp16 / bf16 activations: each tile of W as hi + lo in a's
// dtype, both multiplied by a with cuBLAS into fp32, combined in fp32.
void gemm_split_mm(const at::Tensor& a2, const GptqView& w, const at::Tensor& perm, int64_t bit, at::Tensor& out) {
  const int64_t K = w.K, N = w.N, M = a2.size(0);
  const at::Tensor a = in_row_order(a2, perm);
  const int64_t cols = dequant_tile_cols(K, N);
  at::Tensor exps = at::empty({N}, a.options().dtype(at::kInt));
  launch_gptq_split_exponents(w, bit, exps);
  at::Tensor hi_buf = at::empty({K * cols}, a.options());
  at::Tensor lo_buf = at::empty({K * cols}, a.options());
  const int lo_shift = split_lo_shift(a.scalar_type());
  for (int64_t n0 = 0; n0 < N; n0 += cols) {
    const int64_t width = std::min(cols, N - n0);
    at::Tensor hi = hi_buf.narrow(0, 0, K * width).view({K, width});
    at::Tensor lo = lo_buf.narrow(0, 0, K * width).view({K, width});
    launch_gptq_dequantize_split(w, bit, n0, exps, hi, lo);
    const at::Tensor hi_out = at::mm(a, hi, at::kFloat);
    const at::Tensor lo_out = at::mm(a, lo, at::kFloat);
    combine_split_kernel<<<grid_for(M * width, kThreads), kThreads, 0, current_stream()>>>(
        hi_out.data_ptr<float>(), lo_out.data_ptr<float>(), exps.data_ptr<int32_t>(), lo_shift, M, width, N, n0,
        out.data_ptr(), float_kind(out.scalar_type()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}
#endif

// Large M in fp32: fp32 tiles of W times a in fp32 with cuBLAS's SGEMM, the
// result rounded once to a's dtype.
void gemm_dequant_mm(const at::Tensor& a2, const GptqView& w, const at::Tensor& perm, int64_t bit, at::Tensor& out) {
  const int64_t K = w.K, N = w.N;
  const at::Tensor a32 = in_row_order(a2.to(at::kFloat), perm);
  const int64_t cols = dequant_tile_cols(K, N);
  at::Tensor out32 = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  at::Tensor tile_buf = at::empty({K * cols}, a32.options());
  for (int64_t n0 = 0; n0 < N; n0 += cols) {
    const int64_t width = std::min(cols, N - n0);
    at::Tensor tile = tile_buf.narrow(0, 0, K * width).view({K, width});
    launch_gptq_dequantize(w, bit, n0, tile);
    if (width == N) {
      at::mm_out(out32, a32, tile);
    } else {
      out32.narrow(1, n0, width).copy_(at::mm(a32, tile));
    }
  }
  if (!out32.is_same(out)) out.copy_(out32);
}

}  // namespace

SplitK plan_split_k(const at::Tensor& a, at::Tensor& out, int64_t rows, int64_t tile_n, int64_t chunks,
                    int blocks_per_sm, at::Tensor& partial, int64_t& blocks) {
  const int64_t M = a.size(0), N = out.size(1);
  const int64_t base = ceil_div(M, rows) * ceil_div(N, tile_n);
  const int64_t target = int64_t{blocks_per_sm} * sm_count(a.get_device());
  SplitK s = SplitK::layout(M, N, rows, tile_n, chunks, ceil_div(target, base));
  blocks = base * s.splits;
  TORCH_CHECK(blocks <= 0x7fffffff, "gptq_gemm: ", M, " x ", N, " is too large for one launch");
  if (s.splits > 1) partial = at::empty({s.splits, M, N}, a.options().dtype(at::kFloat));
  s.out = out.data_ptr();
  s.out_kind = float_kind(out.scalar_type());
  s.partial = s.splits > 1 ? partial.data_ptr<float>() : nullptr;
  return s;
}

void launch_splitk_reduce(const at::Tensor& partial, const SplitK& s) {
  if (s.splits == 1) return;
  const int64_t mn = s.M * s.N;
  splitk_reduce_kernel<<<grid_for(mn, kThreads), kThreads, 0, current_stream()>>>(partial.data_ptr<float>(), s.splits,
                                                                                  mn, s.out, s.out_kind);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor gptq_gemm(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                     const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                     bool use_v2_format, int64_t bit) {
  const GemmArgs args = check_gemm_args(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, bit);
  const GptqDims& d = args.d;
  const c10::cuda::CUDAGuard guard(b_q_weight.device());

  const at::Tensor a2 = a.reshape({-1, d.K}).contiguous();
  const int64_t M = a2.size(0);
  std::vector<int64_t> out_sizes = a.sizes().vec();
  out_sizes.back() = d.N;
  at::Tensor out = at::empty({M, d.N}, a2.options());
  if (M == 0) return out.view(out_sizes);

  // The fused kernel reads qweight 16 bytes at a time; a view at an odd
  // offset gets an aligned copy (a caching-allocator temporary).
  const at::Tensor qweight =
      reinterpret_cast<uintptr_t>(b_q_weight.data_ptr()) % 16 == 0 ? b_q_weight : b_q_weight.clone();
  const GptqView w = make_view(qweight, b_gptq_qzeros, b_gptq_scales, use_exllama ? at::Tensor() : args.idx, d,
                               use_v2_format);
  const at::Tensor perm = use_exllama ? args.idx : at::Tensor();
#if LOWBIT_HALF_MM_TO_FLOAT
  const bool two_term = split_mm_serves(a2);
#else
  const bool two_term = false;
#endif
  if (M <= mma_max_m() && gptq_mma_serves(a2, w, bit)) {
    at::Tensor rows = in_row_order(a2, perm);
    if (reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 != 0) rows = rows.clone();
    gemm_mma(rows, w, bit, out);
  } else if (M <= fused_max_m(bit, two_term)) {
    gemm_fused(a2, w, perm, bit, out);
#if LOWBIT_HALF_MM_TO_FLOAT
  } else if (two_term) {
    gemm_split_mm(a2, w, perm, bit, out);
#endif
  } else {
    gemm_dequant_mm(a2, w, perm, bit, out);
  }
  return out.view(out_sizes);
}

}  // namespace cuda
}  // namespace lowbit
