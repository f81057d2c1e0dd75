// CUDA gptq_gemm on the tensor cores: where gptq_mma_kernel.cuh's kernel
// serves, and its launch.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../ops/dispatch.h"
#include "common.cuh"
#include "gptq_cuda.cuh"
#include "gptq_mma_kernel.cuh"

namespace lowbit {
namespace cuda {
namespace {

using mma::gptq_mma_kernel;
using mma::kChunk;
using mma::kTargetBlocksPerSM;
using mma::kThreads;
using mma::kTileN;
using mma::MmaArgs;

template <int B, int MT, typename T>
void launch(const MmaArgs& args, int64_t blocks) {
  gptq_mma_kernel<B, MT, T><<<static_cast<unsigned int>(blocks), kThreads, 0, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The virtual architecture of the kernel code the current device runs: a
// build for older architectures only hands the device their PTX, JIT-compiled,
// in which the mma branch traps. Read once per device (no stream operation).
int kernel_ptx_version(c10::DeviceIndex device) {
  static std::array<std::atomic<int>, C10_COMPILE_TIME_MAX_GPUS> cache{};
  std::atomic<int>& slot = cache[static_cast<size_t>(device)];
  int version = slot.load(std::memory_order_relaxed);
  if (version == 0) {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, gptq_mma_kernel<4, 1, __half>));
    version = attr.ptxVersion;
    slot.store(version, std::memory_order_relaxed);
  }
  return version;
}

}  // namespace

bool gptq_mma_serves(const at::Tensor& a, const GptqView& w, int64_t bit) {
  return (a.scalar_type() == at::kHalf || a.scalar_type() == at::kBFloat16) && bit != 3 &&
         compute_major(a.get_device()) >= 8 && w.K % kChunk == 0 && w.N % 4 == 0 &&
         (w.g_idx != nullptr || w.group_size % 16 == 0) && kernel_ptx_version(a.get_device()) >= 80;
}

void gemm_mma(const at::Tensor& a_rows, const GptqView& w, int64_t bit, at::Tensor& out) {
  // cp.async copies 16 bytes from both operands; a 3-bit weight has no kernel here.
  TORCH_INTERNAL_ASSERT(gptq_mma_serves(a_rows, w, bit) && a_rows.is_contiguous() && a_rows.size(1) == w.K &&
                        reinterpret_cast<uintptr_t>(a_rows.data_ptr()) % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(w.qweight) % 16 == 0);
  const int mt = mma::m_tiles(a_rows.size(0));
  at::Tensor partial;
  int64_t blocks = 0;
  MmaArgs args;
  args.s = plan_split_k(a_rows, out, 16 * mt, kTileN, w.K / kChunk, kTargetBlocksPerSM, partial, blocks);
  args.w = w;
  args.a = reinterpret_cast<const uint16_t*>(a_rows.data_ptr());
  args.M = a_rows.size(0);
  const bool half = a_rows.scalar_type() == at::kHalf;
  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if constexpr (B != 3) {
      mma::dispatch_m_tiles(mt, [&](auto tiles) {
        constexpr int MT = decltype(tiles)::value;
        half ? launch<B, MT, __half>(args, blocks) : launch<B, MT, __nv_bfloat16>(args, blocks);
      });
    }
  });
  launch_splitk_reduce(partial, args.s);
}

}  // namespace cuda
}  // namespace lowbit
