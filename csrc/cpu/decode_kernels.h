// Entry point of decode_attention's SIMD kernel (decode_avx2.cpp; chosen at
// run time by decode_ops.cpp, see isa.h). Torch-free.
#pragma once

#include <stdint.h>

#include "../core/ggml_types.h"
#include "isa.h"

namespace lowbit {
namespace cpu {

#if LOWBIT_X86_SIMD
// One key-value head's group of query heads (rotated, fp32 [groups, dim]) against its key and value
// rows [0, keys) of `type` (F32, F16 or BF16): out [groups, dim] = softmax(scale q.K^T) V, summed in
// fp32 and rounded to `type` once; softcap > 0: the scores soft-capped first (Gemma 2's); `sinks`
// (nullptr for none): each query head's sink logit, which joins its softmax's divisor. dim a multiple
// of 32; `scratch` holds groups * (keys + dim + 1) values.
void decode_attend_group_avx2(ggml::Type type, const float* queries, const void* key_rows, const void* value_rows,
                              void* out, int64_t groups, int64_t keys, int64_t dim, float scale, float softcap,
                              const float* sinks, float* scratch);
#endif

}  // namespace cpu
}  // namespace lowbit
