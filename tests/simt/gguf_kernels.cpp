// The CUDA GGUF matmul kernels (csrc/cuda/ggml_matvec_kernels.cuh,
// ggml_mmq_kernel.cuh) on the CPU emulator, for tests/test_simt_gguf.py,
// launched as ggml_matmul.cu and ggml_mmq.cu launch them: the activation
// quantizer, then the fused matvec over 8 activation rows at a time or, for
// large M, the int8 tensor-core kernel; for ggml_mul_mat_id the grouping of
// (token, slot) pairs by expert and the grouped matvec or tensor-core tiles
// per expert (or the matvec per pair). The shared helpers run their device paths
// (LOWBIT_DEVICE_PATH): word loads, __dp4a.
#include "simt.h"

#include <torch/extension.h>

#include <algorithm>

#include "cuda/ggml_matvec_kernels.cuh"
#include "cuda/ggml_mmq_kernel.cuh"
#include "ops/dispatch.h"

namespace {

namespace mv = lowbit::cuda::matvec;
namespace mmq = lowbit::cuda::mmq;
namespace ggml = lowbit::ggml;

lowbit::simt::Launch grid(dim3 blocks, int threads) {
  lowbit::simt::Launch cfg;
  cfg.grid = blocks;
  cfg.block = dim3(static_cast<unsigned>(threads));
  return cfg;
}

template <ggml::Act A>
struct Acts {
  at::Tensor q, d, sum;
  mv::QuantizedActs<A> view;
};

// x [M, n] fp32, quantized by a warp per block over `blocks` thread blocks.
template <ggml::Act A>
Acts<A> quantize(const at::Tensor& x, unsigned blocks) {
  using L = ggml::ActLayout<A>;
  const int64_t M = x.size(0), n = x.size(1), nblocks = M * n / L::kBlock;
  Acts<A> b;
  b.q = at::empty({M * n}, x.options().dtype(at::kChar));
  b.d = at::empty({nblocks}, x.options());
  b.sum = at::empty({M * n / L::kSumBlock}, x.options());
  lowbit::simt::launch(grid(dim3(blocks), mv::kThreads), [&] {
    mv::quantize_acts_kernel<A>(x.data_ptr<float>(), nblocks, b.q.template data_ptr<int8_t>(),
                                b.d.template data_ptr<float>(), b.sum.template data_ptr<float>());
  });
  b.view = {b.q.template data_ptr<int8_t>(), b.d.template data_ptr<float>(), b.sum.template data_ptr<float>(), n};
  return b;
}

// out [M, rows] = x [M, n] @ dequant(W).T for a quantized type.
at::Tensor mul_mat(const at::Tensor& W, const at::Tensor& x, int64_t type, int64_t rows, int64_t quantizer_blocks) {
  at::Tensor out = at::empty({x.size(0), rows}, x.options());
  lowbit::dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    using I = ggml::TypeInfo<T>;
    if constexpr (I::kFloat) {
      TORCH_CHECK(false, "the float types take matvec_float_kernel, not emulated here");
    } else {
      const Acts<I::kAct> acts = quantize<I::kAct>(x, static_cast<unsigned>(quantizer_blocks));
      const int64_t M = x.size(0), blocks_per_row = x.size(1) / I::kBlock;
      const int lg = mv::lanes_log2<T>(blocks_per_row);
      const int64_t rows_per_block = int64_t{mv::kWarps} * (32 >> lg);
      const auto cfg = grid(dim3(static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block)), mv::kThreads);
      for (int64_t m0 = 0; m0 < M; m0 += mv::kMaxRows) {
        const int mrows = static_cast<int>(std::min<int64_t>(mv::kMaxRows, M - m0));
        lowbit::simt::launch(cfg, [&] {
          mv::matvec_kernel<T>(W.data_ptr<uint8_t>(), rows, blocks_per_row, acts.view, m0, mrows, lg, out.data_ptr(),
                               lowbit::cuda::Float::F32);
        });
      }
    }
  });
  return out;
}

// out [M, rows] (fp32, fp16 or bf16) = x [M, n] @ dequant(W).T for a
// quantized type, by the tensor-core kernel over a grid of at most grid_y
// column blocks (each then takes every grid_y-th activation tile).
void mul_mat_mmq(const at::Tensor& W, const at::Tensor& x, int64_t type, int64_t rows, int64_t grid_y,
                 at::Tensor& out) {
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == rows);
  lowbit::dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    using I = ggml::TypeInfo<T>;
    if constexpr (I::kFloat) {
      TORCH_CHECK(false, "the tensor-core kernel takes the quantized types only");
    } else {
      const Acts<I::kAct> acts = quantize<I::kAct>(x, 2);
      const int64_t M = x.size(0), tiles = (M + mmq::kCols - 1) / mmq::kCols;
      const auto cfg = grid(dim3(static_cast<unsigned>((rows + mmq::kRows - 1) / mmq::kRows),
                                 static_cast<unsigned>(std::min(tiles, grid_y))),
                            mmq::kThreads);
      lowbit::simt::launch(cfg, [&] {
        mmq::mmq_kernel<T>(W.data_ptr<uint8_t>(), rows, x.size(1) / I::kBlock, acts.view, M, out.data_ptr(),
                           lowbit::cuda::float_kind(out.scalar_type()));
      });
    }
  });
}

// out [pairs, rows]: pair p's activation row (p, or p / slots unless
// per_slot) times expert ids[p]'s rows of W [experts, rows, row bytes];
// grouped: the pairs grouped by expert, then the grouped matvec or (mmq) the
// tensor-core tiles per expert; else a pass per pair.
at::Tensor mul_mat_id(const at::Tensor& W, const at::Tensor& x, const at::Tensor& ids, int64_t type, int64_t rows,
                      int64_t slots, bool per_slot, bool grouped, bool mmq) {
  const int64_t experts = W.size(0), pairs = ids.numel();
  at::Tensor out = at::zeros({pairs, rows}, x.options());
  lowbit::dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    using I = ggml::TypeInfo<T>;
    if constexpr (I::kFloat) {
      TORCH_CHECK(false, "the float types are not emulated here");
    } else {
      const Acts<I::kAct> acts = quantize<I::kAct>(x, 2);
      const int64_t blocks_per_row = x.size(1) / I::kBlock;
      const int lg = mv::lanes_log2<T>(blocks_per_row);
      const unsigned row_blocks = static_cast<unsigned>((rows + int64_t{mv::kWarps} * (32 >> lg) - 1) /
                                                        (int64_t{mv::kWarps} * (32 >> lg)));
      const int32_t* id = ids.data_ptr<int32_t>();
      const uint8_t* w = W.data_ptr<uint8_t>();
      if (grouped) {
        TORCH_CHECK(experts <= mv::kMaxGroupedExperts);
        const int64_t most_chosen = std::min(experts, pairs);
        at::Tensor lists = at::full({experts + 1 + pairs + 1 + most_chosen}, -1, ids.options());
        int32_t* start = lists.data_ptr<int32_t>();
        int32_t* order = start + experts + 1;
        int32_t* active = order + pairs;
        lowbit::simt::launch(grid(dim3(1), mv::kGroupThreads),
                             [&] { mv::group_pairs_kernel(id, pairs, experts, start, order, active); });
        if (mmq) {
          const unsigned row_tiles = static_cast<unsigned>((rows + mmq::kRows - 1) / mmq::kRows);
          lowbit::simt::launch(grid(dim3(row_tiles, static_cast<unsigned>(most_chosen)), mmq::kThreads), [&] {
            mmq::mmq_grouped_kernel<T>(w, rows, blocks_per_row, acts.view, start, order, active, slots, per_slot,
                                       out.data_ptr(), lowbit::cuda::Float::F32);
          });
        } else {
          lowbit::simt::launch(grid(dim3(row_blocks, static_cast<unsigned>(most_chosen)), mv::kThreads), [&] {
            mv::matvec_grouped_kernel<T>(w, rows, blocks_per_row, acts.view, start, order, active, slots, per_slot,
                                         lg, out.data_ptr(), lowbit::cuda::Float::F32);
          });
        }
      } else {
        lowbit::simt::launch(grid(dim3(row_blocks, static_cast<unsigned>(std::min<int64_t>(pairs, 3))), mv::kThreads),
                             [&] {
                               mv::matvec_id_kernel<T>(w, experts, rows, blocks_per_row, acts.view, nullptr, id, pairs,
                                                       slots, per_slot, lg, out.data_ptr(), lowbit::cuda::Float::F32);
                             });
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mul_mat", &mul_mat);
  m.def("mul_mat_id", &mul_mat_id);
  m.def("mul_mat_mmq", &mul_mat_mmq);
}
