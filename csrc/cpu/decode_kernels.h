// Entry point of decode_attention's SIMD kernel (decode_avx2.cpp; chosen at
// run time by decode_ops.cpp, see isa.h). Torch-free.
#pragma once

#include <stdint.h>

#include "isa.h"

namespace lowbit {
namespace cpu {

// How key, value and output rows are stored: fp32, or the 16-bit bf16 / fp16 (uint16_t bits).
enum class RowFormat { kF32, kBF16, kF16 };

#if LOWBIT_X86_SIMD
// One key-value head's group of query heads (rotated, fp32 [groups, dim]) against its key and value
// rows [0, keys), stored as `format`: out [groups, dim] = softmax(scale q.K^T) V, summed in fp32 and
// rounded to `format` once. dim a multiple of 32; `scratch` holds groups * (keys + dim + 1) values.
void decode_attend_group_avx2(RowFormat format, const float* queries, const void* key_rows, const void* value_rows,
                              void* out, int64_t groups, int64_t keys, int64_t dim, float scale, float* scratch);
#endif

}  // namespace cpu
}  // namespace lowbit
