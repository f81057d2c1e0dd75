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
// group. With many pairs per expert (mmq_id_serves) the blocks run the
// tensor-core kernel's tiles instead, 64 pairs at a time. Float experts, and
// more experts than the grouping holds, take a pass per pair.
//
// Larger M (ggml_mul_mat_a8 only): the quantized types take the tensor-core
// kernel (ggml_mmq_kernel.cuh, launched by ggml_mmq.cu) on compute capability
// 8.0 and later: int8 mma.sync on the same quantized activations and decoded
// levels, the same scale and min terms. Elsewhere (the float types, older
// GPUs) cuBLAS (at::mm) multiplies fp32 row tiles of the dequantized W by
// the fp32 activations (a quantized type's quantized as above and expanded
// back, d * q). That equals the integer path up to fp32 rounding, except
// that it uses Q8_1's exact block sums where the fused path (and the CPU)
// use its fp16-rounded `s` (the documented tolerance covers both).
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
#include "ggml_matvec_kernels.cuh"
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
// cuBLAS path at M = 64, so a second one never pays. The quantized types'
// large-M path is the tensor-core kernel where the GPU has one; their
// crossover against it is not measured yet.
// LOWBIT_CUDA_GGML_FUSED_MAX_M overrides it for the benchmark.
constexpr char kGgmlFusedMaxMEnv[] = "LOWBIT_CUDA_GGML_FUSED_MAX_M";
template <ggml::Type T>
int64_t fused_max_m() {
  return crossover<kGgmlFusedMaxMEnv>(ggml::kSliced<T> ? 32 : 8);
}
// Largest M for which a quantized type's large-M call takes the tensor-core
// kernel rather than the dequantize-and-SGEMM path; the default sends every
// such M to it. LOWBIT_CUDA_GGML_MMQ_MAX_M overrides it for the benchmark
// (0: never).
constexpr char kGgmlMmqMaxMEnv[] = "LOWBIT_CUDA_GGML_MMQ_MAX_M";
int64_t mmq_max_m() { return crossover<kGgmlMmqMaxMEnv>(std::numeric_limits<int64_t>::max()); }

// ggml_mul_mat_id takes the tensor-core tiles per expert from this many
// (token, slot) pairs per expert on average (pairs >= it x experts), where
// the grouped matvec would read a typical chosen expert's weights more than
// once (once per 8 of its pairs); not yet measured.
// LOWBIT_CUDA_GGML_MMQ_ID_PAIRS_PER_EXPERT overrides it.
constexpr char kGgmlMmqIdEnv[] = "LOWBIT_CUDA_GGML_MMQ_ID_PAIRS_PER_EXPERT";
bool mmq_id_serves(int64_t pairs, int64_t experts, c10::DeviceIndex device) {
  const int64_t per_expert = crossover<kGgmlMmqIdEnv>(matvec::kMaxRows);
  return per_expert <= pairs / std::max<int64_t>(experts, 1) && compute_major(device) >= 8;
}

// fp32 bytes of W decoded per cuBLAS call on the large-M path.
constexpr int64_t kDequantTileBytes = int64_t{256} << 20;

using matvec::expand_acts_kernel;
using matvec::group_pairs_kernel;
using matvec::kGroupThreads;
using matvec::kMaxGroupedExperts;
using matvec::kMaxRows;
using matvec::kThreads;
using matvec::kWarps;
using matvec::matvec_float_kernel;
using matvec::matvec_grouped_kernel;
using matvec::matvec_id_kernel;
using matvec::matvec_kernel;
using matvec::quantize_acts_kernel;
using matvec::QuantizedActs;

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

// The activations as ggml_mmq.cu's launchers take them.
template <Act A>
QuantizedRows rows_of(const QuantizedActs<A>& acts) {
  return {acts.q, acts.d, acts.sum, acts.n};
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
    const int lg = matvec::lanes_log2<T>(blocks_per_row);
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
      return;
    }
    if constexpr (!TypeInfo<T>::kFloat) {
      if (M <= mmq_max_m() && compute_major(W.get_device()) >= 8) {
        const ActBuffers<TypeInfo<T>::kAct> acts = quantize_acts<TypeInfo<T>::kAct>(x);
        launch_ggml_mmq(w, type, row, rows_of(acts.view), M, out);
        return;
      }
    }
    mul_mat_dequant_mm<T>(w, type, row, x, out);
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
    const int lg = matvec::lanes_log2<T>(blocks_per_row);
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
        if (mmq_id_serves(pairs, c.experts, W.get_device())) {
          launch_ggml_mmq_grouped(Wa.data_ptr<uint8_t>(), type, row, rows_of(acts.view),
                                  PairGroups{start, order, active, most_chosen}, c.slots, c.per_slot, out);
        } else {
          matvec_grouped_kernel<T><<<dim3(row_blocks, static_cast<unsigned int>(most_chosen)), kThreads, 0,
                                     current_stream()>>>(Wa.data_ptr<uint8_t>(), row, blocks_per_row, acts.view,
                                                         start, order, active, c.slots, c.per_slot, lg, o, kind);
        }
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
