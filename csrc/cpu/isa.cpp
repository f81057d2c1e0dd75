#include "isa.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

namespace lowbit {
namespace cpu {
namespace {

Isa detect() {
#if LOWBIT_X86_SIMD && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx512 && avx2 && LOWBIT_X86_AVX512) return Isa::kAvx512;
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kPortable;
}

Isa parse(const std::string& name) {
  if (name.empty() || name == "best") return detected_isa();
  for (Isa isa : {Isa::kPortable, Isa::kAvx2, Isa::kAvx512}) {
    if (name == isa_name(isa)) {
      TORCH_CHECK_VALUE(static_cast<int>(isa) <= static_cast<int>(detected_isa()), "cpu_isa: ",
                        LOWBIT_X86_SIMD ? "this CPU cannot run " : "this build (LOWBIT_CPU_SIMD=0) has no ", name,
                        " kernels; the best it runs is ", isa_name(detected_isa()));
      return isa;
    }
  }
  TORCH_CHECK_VALUE(false, "cpu_isa: unknown ISA '", name, "'; expected portable, avx2, avx512 or best");
}

// Starts at LOWBIT_CPU_ISA when set (an unusable value raises at first use).
std::atomic<int>& active() {
  static std::atomic<int> isa{[] {
    const char* env = std::getenv("LOWBIT_CPU_ISA");
    return static_cast<int>(env ? parse(env) : detected_isa());
  }()};
  return isa;
}

}  // namespace

Isa detected_isa() {
  static const Isa isa = detect();
  return isa;
}

bool has_avx512_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    __builtin_cpu_init();
    // The 3-bit kernel's windows are VBMI2 funnel shifts; every CPU with
    // AVX512-BF16 has it but Cooper Lake, which takes the fp32 kernel.
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi2");
  }();
  return has && detected_isa() == Isa::kAvx512;
#else
  return false;
#endif
}

// The vendor-dependent kernel choice below was measured on one Intel and one
// AMD machine; other x86 vendors follow AMD's.
static bool is_intel() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool intel = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("intel") != 0;
  }();
  return intel;
#else
  return false;
#endif
}

bool bf16_dot_at_fma_rate() {
#if defined(__x86_64__) && defined(__GNUC__)
  return !is_intel();
#else
  return false;
#endif
}

namespace {
std::atomic<int> bf16_kernel_choice{static_cast<int>(Bf16Kernel::kAuto)};
}  // namespace

Bf16Kernel bf16_kernel() { return static_cast<Bf16Kernel>(bf16_kernel_choice.load(std::memory_order_relaxed)); }

void set_bf16_kernel(const std::string& name) {
  for (Bf16Kernel k : {Bf16Kernel::kAuto, Bf16Kernel::kAlways, Bf16Kernel::kGemm}) {
    if (name == bf16_kernel_name(k)) {
      bf16_kernel_choice.store(static_cast<int>(k), std::memory_order_relaxed);
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "cpu_bf16_kernel: unknown mode '", name, "'; expected auto, always or gemm");
}

const char* bf16_kernel_name(Bf16Kernel k) {
  return k == Bf16Kernel::kAlways ? "always" : k == Bf16Kernel::kGemm ? "gemm" : "auto";
}

bool has_amx_bf16() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("amx-bf16") != 0;
  }();
  return has && has_avx512_bf16();
#else
  return false;
#endif
}

Isa active_isa() { return static_cast<Isa>(active().load(std::memory_order_relaxed)); }

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
    default:
      return "portable";
  }
}

void force_isa(const std::string& name) { active().store(static_cast<int>(parse(name))); }

}  // namespace cpu
}  // namespace lowbit
