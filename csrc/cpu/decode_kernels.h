// Entry point of decode_attention's SIMD kernel (decode_avx2.cpp; chosen at
// run time by decode_ops.cpp, see isa.h). Torch-free.
#pragma once

#include <stdint.h>

#include "isa.h"

namespace lowbit {
namespace cpu {

#if LOWBIT_X86_SIMD
// One key-value head's group of query heads (rotated, fp32 [groups, dim]) against its fp32 key and
// value rows [0, keys): out [groups, dim] = softmax(scale q.K^T) V. dim a multiple of 32; `scratch`
// holds groups * (keys + 1) values.
void decode_attend_group_avx2(const float* queries, const float* key_rows, const float* value_rows, float* out,
                              int64_t groups, int64_t keys, int64_t dim, float scale, float* scratch);
#endif

}  // namespace cpu
}  // namespace lowbit
