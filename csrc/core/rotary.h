// The rotary position embedding as transformers' llama-family models apply
// it: each head's two halves rotated against each other (rotate_half), not
// interleaved pairs. Shared by the CPU and CUDA decode_attention kernels.
#pragma once

#include "float_bits.h"

namespace lowbit {
namespace rotary {

// Element i of a rotated head of `dim` values: x[i] cos[i] + r[i] sin[i],
// r = (-x[dim/2:], x[:dim/2]); `partner` is x[i + dim/2] in the first half
// and x[i - dim/2] in the second. Each operation rounds on its own, as the
// separate torch ops of transformers' apply_rotary_pos_emb do.
LOWBIT_HD float rotated(float x, float partner, float cos, float sin, bool first_half) {
  return add_rn(mul_rn(x, cos), mul_rn(first_half ? -partner : partner, sin));
}

}  // namespace rotary
}  // namespace lowbit
