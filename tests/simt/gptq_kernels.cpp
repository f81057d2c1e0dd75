// gptq_gemm's CUDA kernels on the CPU emulator, for tests/test_simt_gptq.py:
// the tensor-core kernel (csrc/cuda/gptq_mma_kernel.cuh) and the fused
// CUDA-core one (csrc/cuda/gptq_gemv_kernel.cuh), their own code on CPU
// tensors. The caller chooses the split-K count (the op plans it from the
// GPU's multiprocessors); the slices are summed in split order in fp32 and
// rounded once, as launch_splitk_reduce does.
#include "simt.h"

#include <torch/extension.h>

#include <algorithm>

#include "cuda/gptq_gemv_kernel.cuh"
#include "cuda/gptq_mma_kernel.cuh"
#include "ops/dispatch.h"

namespace {

using lowbit::cuda::GptqView;
using lowbit::cuda::SplitK;
namespace gemv = lowbit::cuda::gemv;
namespace mma = lowbit::cuda::mma;

GptqView view(const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales, const at::Tensor& g_idx,
              int64_t K, int64_t bit, bool v2) {
  TORCH_CHECK(qweight.size(0) * 32 == K * bit && qweight.size(1) % 4 == 0, "qweight is not [K * bit / 32, N]");
  GptqView w;
  w.qweight = reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>());
  w.qzeros = reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>());
  w.scales = scales.data_ptr();
  w.scale_kind = lowbit::cuda::float_kind(scales.scalar_type());
  w.K = K;
  w.N = qweight.size(1);
  w.groups = scales.size(0);
  w.zero_cols = qzeros.size(1);
  w.g_idx = g_idx.numel() ? g_idx.data_ptr<int32_t>() : nullptr;
  w.group_size = K / w.groups;
  w.v2 = v2;
  return w;
}

// The grid of `rows` activation rows by kTileN columns by split-K runs of
// `chunks` K chunks, writing out (splits == 1) or partial.
SplitK plan(at::Tensor& out, at::Tensor& partial, int64_t rows, int64_t tile_n, int64_t chunks, int64_t splits) {
  const int64_t M = out.size(0), N = out.size(1);
  splits = std::clamp<int64_t>(splits, 1, chunks);
  const int64_t per_split = (chunks + splits - 1) / splits;
  splits = (chunks + per_split - 1) / per_split;
  partial = at::zeros({splits, M, N}, out.options().dtype(at::kFloat));
  SplitK s;
  s.out = out.data_ptr();
  s.out_kind = lowbit::cuda::float_kind(out.scalar_type());
  s.partial = splits > 1 ? partial.data_ptr<float>() : nullptr;
  s.M = M;
  s.N = N;
  s.chunks = chunks;
  s.m_chunks = static_cast<int>((M + rows - 1) / rows);
  s.n_tiles = static_cast<int>((N + tile_n - 1) / tile_n);
  s.splits = static_cast<int>(splits);
  s.chunks_per_split = static_cast<int>(per_split);
  return s;
}

void reduce(at::Tensor& out, const at::Tensor& partial, const SplitK& s) {
  if (s.splits == 1) return;
  at::Tensor sum = partial[0].clone();
  for (int64_t sp = 1; sp < s.splits; ++sp) sum.add_(partial[sp]);
  out.copy_(sum);
}

lowbit::simt::Launch grid(const SplitK& s, int threads, bool copies_at_issue, std::vector<const at::Tensor*> inputs) {
  lowbit::simt::Launch cfg;
  cfg.grid = dim3(static_cast<unsigned>(int64_t{s.m_chunks} * s.n_tiles * s.splits));
  cfg.block = dim3(static_cast<unsigned>(threads));
  cfg.copies_at_issue = copies_at_issue;
  for (const at::Tensor* t : inputs) cfg.global.push_back({t->data_ptr(), t->nbytes()});
  return cfg;
}

// a_rows: [M, K] fp16 / bf16 in the weight's row order (shuffled weights: a[:, q_perm]).
at::Tensor gptq_mma(const at::Tensor& a_rows, const at::Tensor& qweight, const at::Tensor& qzeros,
                    const at::Tensor& scales, const at::Tensor& g_idx, int64_t bit, bool v2, int64_t splits,
                    bool copies_at_issue) {
  TORCH_CHECK(a_rows.dim() == 2 && a_rows.is_contiguous() &&
              (a_rows.scalar_type() == at::kHalf || a_rows.scalar_type() == at::kBFloat16));
  TORCH_CHECK(bit == 2 || bit == 4 || bit == 8, "the kernel takes 2, 4 and 8 bits");
  const GptqView w = view(qweight, qzeros, scales, g_idx, a_rows.size(1), bit, v2);
  TORCH_CHECK(w.K % mma::kChunk == 0);
  const int64_t M = a_rows.size(0);
  const int mt = M <= 16 ? 1 : 2;
  at::Tensor out = at::empty({M, w.N}, a_rows.options()), partial;
  mma::MmaArgs args;
  args.w = w;
  args.a = reinterpret_cast<const uint16_t*>(a_rows.data_ptr());
  args.M = M;
  args.s = plan(out, partial, 16 * mt, mma::kTileN, w.K / mma::kChunk, splits);
  const auto cfg = grid(args.s, mma::kThreads, copies_at_issue, {&a_rows, &qweight, &g_idx});
  const bool half = a_rows.scalar_type() == at::kHalf;
  lowbit::dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if constexpr (B != 3) {
      auto run = [&](auto kernel) { lowbit::simt::launch(cfg, [&] { kernel(args); }); };
      if (half) {
        mt == 1 ? run(mma::gptq_mma_kernel<B, 1, __half>) : run(mma::gptq_mma_kernel<B, 2, __half>);
      } else {
        mt == 1 ? run(mma::gptq_mma_kernel<B, 1, __nv_bfloat16>) : run(mma::gptq_mma_kernel<B, 2, __nv_bfloat16>);
      }
    }
  });
  reduce(out, partial, args.s);
  return out;
}

// a: [M, K] in any of the kernel's float formats; perm: q_perm of shuffled
// weights (then g_idx is empty), or empty.
at::Tensor gptq_gemv(const at::Tensor& a, const at::Tensor& qweight, const at::Tensor& qzeros,
                     const at::Tensor& scales, const at::Tensor& g_idx, const at::Tensor& perm, int64_t bit, bool v2,
                     int64_t splits) {
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous());
  const GptqView w = view(qweight, qzeros, scales, g_idx, a.size(1), bit, v2);
  const int64_t M = a.size(0);
  const int mt = M <= 1 ? 1 : (M <= 2 ? 2 : (M <= 4 ? 4 : 8));  // gemm_fused's choice
  at::Tensor out = at::empty({M, w.N}, a.options()), partial;
  gemv::GemvArgs args;
  args.w = w;
  args.a = a.data_ptr();
  args.a_kind = lowbit::cuda::float_kind(a.scalar_type());
  args.perm = perm.numel() ? perm.data_ptr<int32_t>() : nullptr;
  args.M = M;
  args.per_row_groups = w.g_idx != nullptr || w.group_size % lowbit::gptq::fields_per_pack(bit) != 0;
  args.s = plan(out, partial, mt, gemv::kTileN, (w.K + gemv::kChunk - 1) / gemv::kChunk, splits);
  const auto cfg = grid(args.s, gemv::kThreads, false, {});
  lowbit::dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    auto run = [&](auto kernel) { lowbit::simt::launch(cfg, [&] { kernel(args); }); };
    switch (mt) {
      case 1: run(gemv::gptq_gemv_kernel<B, 1>); break;
      case 2: run(gemv::gptq_gemv_kernel<B, 2>); break;
      case 4: run(gemv::gptq_gemv_kernel<B, 4>); break;
      default: run(gemv::gptq_gemv_kernel<B, 8>); break;
    }
  });
  reduce(out, partial, args.s);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gptq_mma", &gptq_mma);
  m.def("gptq_gemv", &gptq_gemv);
}
