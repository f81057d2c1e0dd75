// Which x86 vector instruction set the CPU kernels use, chosen at run time.
//
// Each fast kernel is compiled once per ISA in its own translation unit
// (*_avx2.cpp, *_avx512.cpp, with GCC target pragmas, so the library still
// loads on CPUs without them); the torch-facing code asks active_isa() which
// one to call. The portable C++ loops stay as the fallback and as the
// reference the fast paths are tested against: tests force each ISA in turn
// through the cpu_isa op (or LOWBIT_CPU_ISA at load time).
#pragma once

#include <string>

// Whether this build has the x86 SIMD kernels. A build with LOWBIT_CPU_SIMD=0
// (setup.py defines LOWBIT_PORTABLE_ONLY) compiles only the portable ones,
// in a fraction of the time: for a GPU machine, where the CPU ops serve as
// the CUDA tests' reference. Every SIMD unit and call site is behind it.
#if defined(__x86_64__) && !defined(LOWBIT_PORTABLE_ONLY)
#define LOWBIT_X86_SIMD 1
#else
#define LOWBIT_X86_SIMD 0
#endif
// Whether it has the AVX-512 ones. LOWBIT_CPU_SIMD=avx2 (setup.py defines
// LOWBIT_NO_AVX512) leaves them out, for a build that only runs on CPUs
// without AVX-512 (the sanitizer build of make sanitize compiles in a third
// of the time); the AVX-512 units and call sites are behind it.
#if LOWBIT_X86_SIMD && !defined(LOWBIT_NO_AVX512)
#define LOWBIT_X86_AVX512 1
#else
#define LOWBIT_X86_AVX512 0
#endif

namespace lowbit {
namespace cpu {

enum class Isa : int {
  kPortable = 0,
  kAvx2 = 1,    // AVX2 + FMA + F16C
  kAvx512 = 2,  // AVX-512 F/BW/VL/DQ + VNNI
};

// The best ISA this CPU supports (kPortable on non-x86 builds).
Isa detected_isa();
// The ISA kernels use now: detected_isa(), or a lower one when forced.
Isa active_isa();
const char* isa_name(Isa isa);
// Whether the CPU has AVX512-BF16 (vdpbf16ps) and VBMI2, which the kAvx512 kernels may
// use on top of their ISA for bf16 / fp16 activations.
bool has_avx512_bf16();
// Whether vdpbf16ps (two bf16 products per fp32 lane) issues as often as an
// fp32 FMA, as on AMD Zen 4; Intel cores issue it at half that rate, so it
// multiplies no faster than FMA there (gptq_gemm measures both).
bool bf16_dot_at_fma_rate();
// Which kernel bf16 / fp16 activations of a GPTQ weight take where both the
// vdpbf16ps and the fp32 FMA kernels apply: kAuto picks the faster on this
// CPU; kAlways takes vdpbf16ps wherever it applies, so that the tests run it
// at every M and bit width on any CPU that has it; kGemm is kAuto, except
// that bf16 activations past the fused kernels' usual range (M > 64) take
// the bf16 GEMM also where the vdpbf16ps kernel would run at every M, so
// that the tests run that path on any CPU with AVX512-BF16.
enum class Bf16Kernel : int { kAuto = 0, kAlways = 1, kGemm = 2 };
Bf16Kernel bf16_kernel();
// Sets it by name ("auto", "always", "gemm"); raises ValueError for another.
void set_bf16_kernel(const std::string& name);
const char* bf16_kernel_name(Bf16Kernel k);
// Whether it also has AMX-BF16, whose tile multiply makes torch's bf16 GEMM
// (oneDNN) fast enough to pay off at smaller M than the fused kernels.
bool has_amx_bf16();
// Forces kernels down to `name` ("portable", "avx2", "avx512", or "" / "best"
// for the detected one). Raises ValueError for a name this CPU cannot run.
void force_isa(const std::string& name);

}  // namespace cpu
}  // namespace lowbit
