// gptq_gemm's CUDA kernels on the CPU emulator, for tests/test_simt_gptq.py:
// the tensor-core kernel (csrc/cuda/gptq_mma_kernel.cuh) and the fused
// CUDA-core one (csrc/cuda/gptq_gemv_kernel.cuh), their own code on CPU
// tensors. The caller chooses the split-K count (the op plans it from the
// GPU's multiprocessors); the slices are summed in split order in fp32 and
// rounded once, as launch_splitk_reduce does. mma_tile runs one mma.sync on
// one warp, for test_simt_gptq.py's check of the emulated fragment layout;
// a_fragments one warp's ldmatrix of an A fragment, for its check against it.
#include "simt.h"

#include <torch/extension.h>

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
  SplitK s = SplitK::layout(out.size(0), out.size(1), rows, tile_n, chunks, splits);
  partial = at::zeros({s.splits, s.M, s.N}, out.options().dtype(at::kFloat));
  s.out = out.data_ptr();
  s.out_kind = lowbit::cuda::float_kind(out.scalar_type());
  s.partial = s.splits > 1 ? partial.data_ptr<float>() : nullptr;
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
  const int mt = mma::m_tiles(M);
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
      mma::dispatch_m_tiles(mt, [&](auto tiles) {
        constexpr int MT = decltype(tiles)::value;
        half ? run(mma::gptq_mma_kernel<B, MT, __half>) : run(mma::gptq_mma_kernel<B, MT, __nv_bfloat16>);
      });
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
  const int mt = gemv::rows_per_block(M);
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

// D = A @ B + C by one warp's mma16816, each lane's fragments gathered from
// (and D scattered to) the whole row-major matrices A [16, 16], B [16, 8] and
// C [16, 8] by the PTX ISA's m16n8k16 layout, written out here apart from the
// emulator's and the kernels' own (test_mma_tile_matches_the_product states
// it): lane = 4 * group + tig; A's a0..a7 at row group + 8 * bit 1 of i,
// column 2 * tig + bit 0 + 8 * bit 2; B's b0..b3 at row 2 * tig + bit 0 +
// 8 * bit 1, column group; C's and D's c0..c3 at row group + 8 * bit 1,
// column 2 * tig + bit 0. Each 32-bit register holds the lower index in its
// low half.
template <typename T>
void mma_warp(const uint16_t* A, const uint16_t* B, const float* C, float* D) {
  lowbit::simt::Launch cfg;
  cfg.grid = dim3(1);
  cfg.block = dim3(32);
  lowbit::simt::launch(cfg, [&] {
    const int lane = static_cast<int>(threadIdx.x), group = lane >> 2, tig = lane & 3;
    auto pack = [](uint16_t lo, uint16_t hi) { return uint32_t{lo} | uint32_t{hi} << 16; };
    auto a_at = [&](int i) { return A[(group + 8 * ((i >> 1) & 1)) * 16 + 2 * tig + (i & 1) + 8 * (i >> 2)]; };
    auto b_at = [&](int i) { return B[(2 * tig + (i & 1) + 8 * (i >> 1)) * 8 + group]; };
    auto cd_at = [&](int i) { return (group + 8 * (i >> 1)) * 8 + 2 * tig + (i & 1); };
    uint32_t a[4];
    for (int r = 0; r < 4; ++r) a[r] = pack(a_at(2 * r), a_at(2 * r + 1));
    const uint32_t b0 = pack(b_at(0), b_at(1)), b1 = pack(b_at(2), b_at(3));
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = C[cd_at(i)];
    lowbit::cuda::mma16816<T>(d, a, b0, b1);
    for (int i = 0; i < 4; ++i) D[cd_at(i)] = d[i];
  });
}

// Each lane's four A-fragment registers [32, 4] of the int16 tile a [16, 16],
// loaded as the tensor-core kernel loads them (load_a_fragment's ldmatrix).
at::Tensor a_fragments(const at::Tensor& a) {
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 16}) && a.scalar_type() == at::kShort,
              "a_fragments takes int16 [16, 16]");
  const at::Tensor A = a.contiguous();
  at::Tensor out = at::empty({32, 4}, a.options().dtype(at::kInt));
  int32_t* o = out.data_ptr<int32_t>();
  lowbit::simt::Launch cfg;
  cfg.grid = dim3(1);
  cfg.block = dim3(32);
  lowbit::simt::launch(cfg, [&] {
    const int lane = static_cast<int>(threadIdx.x);
    uint32_t frag[4];
    mma::load_a_fragment(frag, reinterpret_cast<const uint16_t*>(A.data_ptr<int16_t>()), 16, lane);
    for (int r = 0; r < 4; ++r) o[4 * lane + r] = static_cast<int32_t>(frag[r]);
  });
  return out;
}

at::Tensor mma_tile(const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
  TORCH_CHECK(a.sizes() == at::IntArrayRef({16, 16}) && b.sizes() == at::IntArrayRef({16, 8}) &&
              c.sizes() == at::IntArrayRef({16, 8}), "mma_tile takes A [16, 16], B [16, 8], C [16, 8]");
  TORCH_CHECK((a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16) &&
              b.scalar_type() == a.scalar_type() && c.scalar_type() == at::kFloat);
  const at::Tensor A = a.contiguous(), B = b.contiguous(), C = c.contiguous();
  at::Tensor D = at::empty({16, 8}, C.options());
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
  if (a.scalar_type() == at::kHalf) {
    mma_warp<__half>(bits(A), bits(B), C.data_ptr<float>(), D.data_ptr<float>());
  } else {
    mma_warp<__nv_bfloat16>(bits(A), bits(B), C.data_ptr<float>(), D.data_ptr<float>());
  }
  return D;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gptq_mma", &gptq_mma);
  m.def("gptq_gemv", &gptq_gemv);
  m.def("mma_tile", &mma_tile);
  m.def("a_fragments", &a_fragments);
}
