// The CPU kernels' switches and per-type facts as ops: the ISA in use, the
// bf16 GPTQ kernel, the fp32 GEMM library, the thread counts, and the traits
// table (ggml_traits.h). They take no tensor, so they register as composite
// kernels.
#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "../core/ggml_types.h"
#include "float_gemm.h"
#include "ggml_traits.h"
#include "isa.h"
#include "parallel.h"

#if AT_MKL_ENABLED()
// MKL's per-thread count, as torch.set_num_threads sets it (mkl_service.h's
// C name; the lower-case symbol is the Fortran one, taking a pointer). Weak:
// libtorch exports it in the builds that have MKL.
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
#endif

namespace lowbit {
namespace cpu {
namespace {

// Linux's most CPUs (x86-64 MAXSMP NR_CPUS); near pid_max (32768) libgomp fails to start threads and exits.
constexpr int64_t kMaxTorchThreads = 8192;

ggml::Type checked_type(const char* op, int64_t type) {
  TORCH_CHECK_VALUE(ggml::runtime_info(type).ok, op, ": type ", type,
                    " is not a ggml weight type lowbit supports (unknown or removed id)");
  return static_cast<ggml::Type>(type);
}

// The vector ISA the CPU kernels use now, after forcing it to `force` if given.
std::string cpu_isa(std::optional<std::string> force) {
  if (force) force_isa(*force);
  return isa_name(active_isa());
}

// Which GPTQ kernel bf16 / fp16 activations take on AVX512-BF16 CPUs
// (Bf16Kernel), after setting it to `mode` if given.
std::string cpu_bf16_kernel(std::optional<std::string> mode) {
  if (mode) set_bf16_kernel(*mode);
  return bf16_kernel_name(bf16_kernel());
}

// The fp32 GEMM library of the large-M paths (FloatGemm), after
// setting it to `library` if given.
std::string cpu_float_gemm(std::optional<std::string> library) {
  if (library) set_float_gemm(*library);
  return float_gemm_name(float_gemm());
}

// The CPU kernels' thread count, after setting it to `threads` if given: 0,
// the default, follows torch's intra-op count. Apart from torch's own, a
// model can run its small torch ops on one thread and its matmuls on several.
int64_t cpu_threads(std::optional<int64_t> threads) {
  if (threads) {
    TORCH_CHECK_VALUE(*threads >= 0 && *threads <= kMaxPoolThreads, "cpu_threads: threads must be 0 (torch's count) to ",
                      kMaxPoolThreads, ", got ", *threads);
    set_pool_threads(*threads);
  }
  return pool_threads_setting();
}

// Which threads run the CPU kernels ("pool": lowbit's own, the default;
// "torch": torch's OpenMP team), after setting it to `team` if given.
std::string cpu_team(std::optional<std::string> team) {
  if (team) {
    TORCH_CHECK_VALUE(*team == "pool" || *team == "torch", "cpu_team: unknown team '", *team,
                      "'; expected pool or torch");
    set_kernel_team(*team == "pool" ? Team::kPool : Team::kTorch);
  }
  return kernel_team() == Team::kPool ? "pool" : "torch";
}

// torch's thread count on the calling thread, after setting it for that
// thread alone to `threads` if given (at::set_num_threads also sets the count
// threads take at their first torch call).
int64_t cpu_torch_threads(std::optional<int64_t> threads) {
  // First: a thread's first torch call sets its count from the process's,
  // which would undo a count set here before it.
  const int64_t current = at::get_num_threads();
  if (!threads) return current;
  TORCH_CHECK_VALUE(*threads >= 1 && *threads <= kMaxTorchThreads, "cpu_torch_threads: threads must be 1 to ",
                    kMaxTorchThreads, ", got ", *threads);
  omp_set_num_threads(static_cast<int>(*threads));
#if AT_MKL_ENABLED()
  if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(static_cast<int>(*threads));
#endif
  return at::get_num_threads();
}

bool ggml_has_repacked_layout(int64_t type) {
  return has_repacked_layout(checked_type("ggml_has_repacked_layout", type));
}

// Whether the active ISA's kernels read a repacked weight of this type as it
// is; elsewhere each call puts the rows back in the file's layout first.
bool cpu_reads_repacked(int64_t type) {
  const GgmlCpuTraits t = ggml_cpu_traits(checked_type("cpu_reads_repacked", type));
  switch (active_isa()) {
    case Isa::kAvx512: return t.reads_repacked & kReadsAvx512;
    case Isa::kAvx2: return t.reads_repacked & kReadsAvx2;
    default: return false;
  }
}

// The row of the traits table, in the schema's order (ops/schemas.cpp).
std::vector<int64_t> ggml_cpu_traits_op(int64_t type) {
  const GgmlCpuTraits t = ggml_cpu_traits(checked_type("ggml_cpu_traits", type));
  return {t.simd_levels, static_cast<int64_t>(t.gemm), t.gemm_rows, t.repacked, t.reads_repacked,
          t.avx2_copy_rows, t.repack_by_default};
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit

TORCH_LIBRARY_IMPL(lowbit, CompositeImplicitAutograd, m) {
  m.impl("cpu_isa", &lowbit::cpu::cpu_isa);
  m.impl("cpu_bf16_kernel", &lowbit::cpu::cpu_bf16_kernel);
  m.impl("cpu_float_gemm", &lowbit::cpu::cpu_float_gemm);
  m.impl("cpu_threads", &lowbit::cpu::cpu_threads);
  m.impl("cpu_team", &lowbit::cpu::cpu_team);
  m.impl("cpu_torch_threads", &lowbit::cpu::cpu_torch_threads);
  m.impl("cpu_reads_repacked", &lowbit::cpu::cpu_reads_repacked);
  m.impl("ggml_has_repacked_layout", &lowbit::cpu::ggml_has_repacked_layout);
  m.impl("ggml_cpu_traits", &lowbit::cpu::ggml_cpu_traits_op);
}
