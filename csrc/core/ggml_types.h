// The one table of GGUF (ggml) weight types lowbit supports. Everything
// per-type -- validation, byte counts, block decoding, the activation format
// of the 8-bit dot products, the kernels' dispatch -- is driven from it.
#pragma once

#include <stdint.h>

#include "host_device.h"

namespace lowbit {
namespace ggml {

// How activations are quantized for the integer dot products, as llama.cpp's
// CPU backend pairs them with each weight type. Float weight types multiply
// fp32 activations directly.
enum class Act { Float, Q8_0, Q8_1, Q8_K };

// X(name, ggml id, elements per block, bytes per block,
//   elements per sub-block scale, has a per-sub-block min, activation format)
// A sub-block never spans two activation blocks: Q1_0 and Q2_0, one scale
// per block, list it per 32 elements (Decoded repeats it), as their dot
// products meet one Q8_0 activation scale per 32 (ggml_vec_dot_q1_0_q8_0).
#define LOWBIT_GGML_TYPES(X)                      \
  X(F32, 0, 1, 4, 1, false, Float)                \
  X(F16, 1, 1, 2, 1, false, Float)                \
  X(Q4_0, 2, 32, 18, 32, false, Q8_0)             \
  X(Q4_1, 3, 32, 20, 32, true, Q8_1)              \
  X(Q5_0, 6, 32, 22, 32, false, Q8_0)             \
  X(Q5_1, 7, 32, 24, 32, true, Q8_1)              \
  X(Q8_0, 8, 32, 34, 32, false, Q8_0)             \
  X(Q2_K, 10, 256, 84, 16, true, Q8_K)            \
  X(Q3_K, 11, 256, 110, 16, false, Q8_K)          \
  X(Q4_K, 12, 256, 144, 32, true, Q8_K)           \
  X(Q5_K, 13, 256, 176, 32, true, Q8_K)           \
  X(Q6_K, 14, 256, 210, 16, false, Q8_K)          \
  X(IQ2_XXS, 16, 256, 66, 32, false, Q8_K)        \
  X(IQ2_XS, 17, 256, 74, 16, false, Q8_K)         \
  X(IQ3_XXS, 18, 256, 98, 32, false, Q8_K)        \
  X(IQ1_S, 19, 256, 50, 32, false, Q8_K)          \
  X(IQ4_NL, 20, 32, 18, 32, false, Q8_0)          \
  X(IQ3_S, 21, 256, 110, 32, false, Q8_K)         \
  X(IQ2_S, 22, 256, 82, 16, false, Q8_K)          \
  X(IQ4_XS, 23, 256, 136, 32, false, Q8_K)        \
  X(IQ1_M, 29, 256, 56, 16, false, Q8_K)          \
  X(BF16, 30, 1, 2, 1, false, Float)              \
  X(TQ1_0, 34, 256, 54, 256, false, Q8_K)         \
  X(TQ2_0, 35, 256, 66, 256, false, Q8_K)         \
  X(MXFP4, 39, 32, 17, 32, false, Q8_0)           \
  X(NVFP4, 40, 64, 36, 16, false, Q8_0)           \
  X(Q1_0, 41, 128, 18, 32, false, Q8_0)           \
  X(Q2_0, 42, 64, 18, 32, false, Q8_0)

enum class Type : int {
#define LOWBIT_GGML_ENUM(name, id, block, bytes, sub, has_min, act) name = id,
  LOWBIT_GGML_TYPES(LOWBIT_GGML_ENUM)
#undef LOWBIT_GGML_ENUM
};

template <Type T>
struct TypeInfo;

#define LOWBIT_GGML_INFO(name_, id, block, bytes, sub, has_min, act)   \
  template <>                                                         \
  struct TypeInfo<Type::name_> {                                      \
    static constexpr const char* kName = #name_;                      \
    static constexpr int kBlock = block;                              \
    static constexpr int kBytes = bytes;                              \
    static constexpr int kSub = sub;                                  \
    static constexpr bool kHasMin = has_min;                          \
    static constexpr Act kAct = Act::act;                             \
    static constexpr bool kFloat = Act::act == Act::Float;            \
  };
LOWBIT_GGML_TYPES(LOWBIT_GGML_INFO)
#undef LOWBIT_GGML_INFO

// Run-time view of the same table; ok is false for unknown or removed ids.
struct RuntimeInfo {
  bool ok;
  const char* name;
  int block;
  int bytes;
};

LOWBIT_HD RuntimeInfo runtime_info(int64_t id) {
  switch (id) {
#define LOWBIT_GGML_CASE(name, id_, block, bytes, sub, has_min, act) \
  case id_:                                                          \
    return RuntimeInfo{true, #name, block, bytes};
    LOWBIT_GGML_TYPES(LOWBIT_GGML_CASE)
#undef LOWBIT_GGML_CASE
  }
  return RuntimeInfo{false, "", 0, 0};
}

}  // namespace ggml
}  // namespace lowbit
