// The rotary position embedding as transformers' llama-family models apply
// it: the two halves of each head's rotated part turned against each other
// (rotate_half), not interleaved pairs. The rotated part is the head's first
// `rotated` values: all of them in most models, a share in those with a
// partial rotary factor (Phi-4-mini's 96 of 128), the rest passing through.
// Shared by the CPU and CUDA decode_attention kernels.
#pragma once

#include "float_bits.h"

namespace lowbit {
namespace rotary {

// Element i of a rotated part of `dim` values: x[i] cos[i] + r[i] sin[i],
// r = (-x[dim/2:], x[:dim/2]); `partner` is x[i + dim/2] in the first half
// and x[i - dim/2] in the second. Each operation rounds on its own, as the
// separate torch ops of transformers' apply_rotary_pos_emb do.
LOWBIT_HD float rotated(float x, float partner, float cos, float sin, bool first_half) {
  return add_rn(mul_rn(x, cos), mul_rn(first_half ? -partner : partner, sin));
}

// Element i of a head whose first `rotated_dims` values rotate: at(j) reads
// the head's element j, cos(j) and sin(j) the tables (read for j < rotated_dims).
template <class At, class Cos, class Sin>
LOWBIT_HD float element(At at, Cos cos, Sin sin, int64_t i, int64_t rotated_dims) {
  if (i >= rotated_dims) return at(i);
  const int64_t half = rotated_dims / 2;
  const bool first = i < half;
  return rotated(at(i), at(first ? i + half : i - half), cos(i), sin(i), first);
}

}  // namespace rotary
}  // namespace lowbit
