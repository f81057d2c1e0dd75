// The torch-facing side of the CPU GPTQ matmuls (gptq_gemm.cpp,
// gptq_gemm_a8.cpp): a validated weight's tensors as the GptqWeight view the
// kernels read, and the split of its output columns into parallel tasks.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "../ops/gptq_checks.h"
#include "gptq_kernels.h"
#include "isa.h"
#include "parallel.h"

namespace lowbit {
namespace cpu {
namespace {

// Owns what a GptqWeight points into.
struct PreparedWeight {
  at::Tensor g_idx;
  GptqWeight view;
};

// A g_idx that is k / gs for some group size gs (contiguous groups, the last
// one possibly short, as checkpoints with K % group_size != 0 store it) is the
// trivial grouping RowGroups{nullptr, gs}, which the SIMD kernels take; 0 if
// g_idx is anything else.
int64_t contiguous_group_size(const at::Tensor& g_idx, int64_t K) {
  const int32_t* g = g_idx.data_ptr<int32_t>();
  int64_t gs = 1;
  while (gs < K && g[gs] == 0) ++gs;
  // Group by group, with no division per row: every call checks all K rows.
  int32_t group = 0;
  for (int64_t k0 = 0; k0 < K; k0 += gs, ++group) {
    bool same = true;
    for (int64_t k = k0; k < std::min(K, k0 + gs); ++k) same &= g[k] == group;
    if (!same) return 0;
  }
  return gs;
}

PreparedWeight prepare(const at::Tensor& qweight, const at::Tensor& qzeros, const at::Tensor& scales,
                       const at::Tensor& g_idx, const GptqDims& d, bool use_v2_format, int64_t bit) {
  PreparedWeight p;
  p.g_idx = g_idx;
  const ScaleType scale_type = scales.scalar_type() == at::kFloat  ? ScaleType::kF32
                               : scales.scalar_type() == at::kHalf ? ScaleType::kF16
                                                                   : ScaleType::kBF16;
  int64_t group_size = d.K / d.groups;
  const int32_t* gi = g_idx.numel() ? g_idx.data_ptr<int32_t>() : nullptr;
  if (gi) {
    if (const int64_t gs = contiguous_group_size(g_idx, d.K)) {
      gi = nullptr;
      group_size = gs;
    }
  }
  p.view = GptqWeight{reinterpret_cast<const uint32_t*>(qweight.data_ptr<int32_t>()),
                      d.K,
                      d.N,
                      GroupParams{reinterpret_cast<const uint32_t*>(qzeros.data_ptr<int32_t>()), scales.data_ptr(),
                                  scale_type, use_v2_format},
                      RowGroups{gi, group_size, d.groups}};
  p.view.rows = qweight.size(qweight.dim() - 2);
  p.view.panel = qweight.dim() == 3 ? kGptqPanelCols : 0;
  return p;
}

// The fp32 [M, N] result as the op returns it: [..., N] in a's dtype.
inline at::Tensor as_output(const at::Tensor& out, const at::Tensor& a, int64_t N) {
  std::vector<int64_t> sizes = a.sizes().vec();
  sizes.back() = N;
  return out.to(a.scalar_type()).view(sizes);
}

// fn(n0, n1) over [0, N) in parallel tasks of whole `step`s of columns (the
// last may be short): up to 16 steps, wide for long contiguous reads of each
// weight row (16 measured ~10% faster than 4 at M=1 on wide layers), and
// narrower where that gives each thread fewer than kChunksPerThread of them:
// a small layer's columns (576 or 192 in a 135M model) then still spread evenly.
template <class Fn>
void for_column_tasks(int64_t N, int64_t step, const Fn& fn) {
  const int64_t per_chunk = N / (kChunksPerThread * pool_threads()) / step * step;
  const int64_t task = std::clamp(per_chunk, step, 16 * step);
  parallel_for((N + task - 1) / task, 1, [&](int64_t t0, int64_t t1) { fn(t0 * task, std::min(N, t1 * task)); });
}

// for_column_tasks for kernels of `isa`, whose SIMD kernels take whole steps
// of columns (kAvx512FusedCols, kAvx2FusedCols): simd(n0, n1) on each task's
// columns below the last whole step, portable(n0, n1) on the rest (every
// column when isa is kPortable, in tasks of portable_step).
template <class Simd, class Portable>
void for_isa_column_tasks(int64_t N, Isa isa, int64_t portable_step, const Simd& simd, const Portable& portable) {
  const int64_t step = isa == Isa::kAvx512 ? kAvx512FusedCols : isa == Isa::kAvx2 ? kAvx2FusedCols : portable_step;
  const int64_t simd_end = isa == Isa::kPortable ? 0 : N - N % step;
  for_column_tasks(N, step, [&](int64_t n0, int64_t n1) {
    const int64_t simd_n1 = std::min(n1, simd_end);
    if (simd_n1 > n0) simd(n0, simd_n1);
    if (n1 > std::max(n0, simd_n1)) portable(std::max(n0, simd_n1), n1);
  });
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
