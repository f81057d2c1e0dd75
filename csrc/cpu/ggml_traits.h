// What the CPU kernels do with each GGUF type: one row per row of the format
// table (core/ggml_types.h), as ggml keeps its CPU type traits beside its
// type table. The kernels' compile-time choices, the settings ops
// (cpu_settings.cpp) and Python's repack_model all read this table.
// Torch-free.
#pragma once

#include <stdint.h>

#include "../core/ggml_types.h"

namespace lowbit {
namespace cpu {

// The GEMM form of a type for larger M (ggml_gemm_vnni.h): none, one float
// scale per 32 elements (FloatGemm), or integer sub-block scales (IntGemm).
enum class Gemm : int { kNone = 0, kFloat = 1, kInt = 2 };

// The ISAs whose kernels read a repacked weight as it is; the others put its
// rows back in the file's layout on every call (the same results, slower).
constexpr int kReadsAvx2 = 1, kReadsAvx512 = 2, kReadsBoth = kReadsAvx2 | kReadsAvx512;

// X(name, SIMD levels, GEMM form, GEMM from M, repacked layout, ISAs reading
//   it, AVX2 tile copies from M (0: none), repack_model takes it by default)
// - SIMD levels: every quantized type's levels are cut in vector registers
//   (ggml_levels_simd.h).
// - GEMM from M: the signed one-scale types start later, as their 512-bit row
//   tiles already share each decoded chunk (csrc/cpu/README.md, M thresholds).
// - Repacked layout (core/ggml_repack.h): the one-scale types of 4, 5 and 8
//   bits and every integer-form type, whose blocks past their fields are
//   whole 4-byte words.
// - AVX2 reads: with AVX2, Q5_K's and Q6_K's repacked matvec streams slower
//   than their file layout's, so AVX2 uses their tiles for file-layout
//   batches only.
// - AVX2 copies: from that M, a file-layout weight goes through the repacked
//   kernel a tile at a time (repacked into a buffer that stays in cache);
//   each value is the smallest M where that beats the matvec form at every
//   benchmark shape and thread count.
// - repack_model: Q6_K's repacked kernels gain least, so models keep it in
//   the file's layout unless asked.
#define LOWBIT_GGML_CPU_TRAITS(X)                       \
  X(F32, false, kNone, 0, false, 0, 0, false)           \
  X(F16, false, kNone, 0, false, 0, 0, false)           \
  X(Q4_0, true, kFloat, 32, true, kReadsBoth, 8, true)  \
  X(Q4_1, true, kFloat, 8, true, kReadsBoth, 8, true)   \
  X(Q5_0, true, kFloat, 32, true, kReadsBoth, 128, true) \
  X(Q5_1, true, kFloat, 8, true, kReadsBoth, 16, true)  \
  X(Q8_0, true, kFloat, 32, true, kReadsBoth, 16, true) \
  X(Q2_K, true, kInt, 8, true, kReadsBoth, 16, true)    \
  X(Q3_K, true, kInt, 8, true, kReadsBoth, 32, true)    \
  X(Q4_K, true, kInt, 8, true, kReadsBoth, 16, true)    \
  X(Q5_K, true, kInt, 8, true, kReadsAvx512, 32, true)  \
  X(Q6_K, true, kInt, 8, true, kReadsAvx512, 32, false) \
  X(IQ2_XXS, true, kNone, 0, false, 0, 0, false)       \
  X(IQ2_XS, true, kNone, 0, false, 0, 0, false)        \
  X(IQ3_XXS, true, kNone, 0, false, 0, 0, false)       \
  X(IQ1_S, true, kNone, 0, false, 0, 0, false)         \
  X(IQ4_NL, true, kFloat, 32, true, kReadsBoth, 16, true) \
  X(IQ3_S, true, kNone, 0, false, 0, 0, false)         \
  X(IQ2_S, true, kNone, 0, false, 0, 0, false)         \
  X(IQ4_XS, true, kInt, 8, true, kReadsBoth, 16, true)  \
  X(IQ1_M, true, kNone, 0, false, 0, 0, false)         \
  X(BF16, false, kNone, 0, false, 0, 0, false)          \
  X(TQ1_0, true, kNone, 0, false, 0, 0, false)          \
  X(TQ2_0, true, kNone, 0, false, 0, 0, false)          \
  X(MXFP4, true, kFloat, 32, true, kReadsBoth, 0, true) \
  X(NVFP4, true, kNone, 0, false, 0, 0, false)          \
  X(Q1_0, true, kNone, 0, false, 0, 0, false)           \
  X(Q2_0, true, kNone, 0, false, 0, 0, false)

struct GgmlCpuTraits {
  bool ok;  // false for an id the format table does not have
  bool simd_levels;
  Gemm gemm;
  int64_t gemm_rows;
  bool repacked;
  int reads_repacked;
  int64_t avx2_copy_rows;  // 0: none
  bool repack_by_default;
};

// static: each SIMD unit keeps its own copy (test_isa_units_share_no_symbols).
static constexpr GgmlCpuTraits ggml_cpu_traits(ggml::Type t) {
  switch (t) {
#define LOWBIT_GGML_CPU_CASE(name, levels, gemm, gemm_m, repacked, reads, copy_m, by_default) \
  case ggml::Type::name:                                                                    \
    return {true, levels, Gemm::gemm, gemm_m, repacked, reads, copy_m, by_default};
    LOWBIT_GGML_CPU_TRAITS(LOWBIT_GGML_CPU_CASE)
#undef LOWBIT_GGML_CPU_CASE
  }
  return {};
}

// Every type of the format table has a row here, and each row's facts fit
// the format: the float types take no CPU kernel choices; a repacked layout
// needs a GEMM form; the float GEMM needs one scale per 32 elements.
#define LOWBIT_GGML_CPU_CHECK(name, id, block, bytes, sub, has_min, act)                                       \
  static_assert(ggml_cpu_traits(ggml::Type::name).ok, #name " needs a row in LOWBIT_GGML_CPU_TRAITS");         \
  static_assert(ggml_cpu_traits(ggml::Type::name).simd_levels != ggml::TypeInfo<ggml::Type::name>::kFloat,       \
                #name ": the quantized types have SIMD levels, the float types none");                        \
  static_assert(!ggml_cpu_traits(ggml::Type::name).repacked || ggml_cpu_traits(ggml::Type::name).gemm != Gemm::kNone, \
                #name ": a repacked layout needs a GEMM form");                                                 \
  static_assert(ggml_cpu_traits(ggml::Type::name).gemm != Gemm::kFloat || (block == 32 && sub == 32),          \
                #name ": the float GEMM takes one scale per 32 elements");
LOWBIT_GGML_TYPES(LOWBIT_GGML_CPU_CHECK)
#undef LOWBIT_GGML_CPU_CHECK

static constexpr bool has_simd_levels(ggml::Type t) { return ggml_cpu_traits(t).simd_levels; }
static constexpr bool has_repacked_layout(ggml::Type t) { return ggml_cpu_traits(t).repacked; }
static constexpr bool reads_repacked_avx2(ggml::Type t) { return ggml_cpu_traits(t).reads_repacked & kReadsAvx2; }

}  // namespace cpu
}  // namespace lowbit
