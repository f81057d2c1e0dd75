// One field of a GPTQ pack cut out of its words for a vector of columns,
// shared by the fused kernels (gptq_fused_simd.h) and the tile dequantizer
// (gptq_dequant_simd.h). Include only inside an ISA unit's target pragma
// region, after the vector vocabulary's header is reachable (V is a template
// parameter: VecAvx2, VecAvx512).
#pragma once

#include <stdint.h>

#include "../core/gptq_format.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma (see gptq_fused_simd.h).
namespace {

// Field FI of a pack for one vector of columns, whose word i (i < kWords,
// one vector load of each word row) is word(i). With kMasked the result is
// the field's value in every lane; without, only its low bits are (the
// higher bits hold the next fields), which suits a table lookup that reads
// the low bits alone. Shifts and masks are compile-time constants
// (gptq::locate is constexpr).
template <class V, int B, int FI, bool kMasked, class Word>
inline typename V::I pack_field(Word&& word) {
  constexpr gptq::FieldLoc f = gptq::locate<B>(FI);
  typename V::I v = word(f.lo);
  if constexpr (f.lo_shift != 0) v = V::template srl<f.lo_shift>(v);
  if constexpr (!kMasked) return v;
  // The top field of a word needs no mask: the shift already cleared the rest.
  if constexpr (f.lo_shift + f.hi_pos < 32) v = V::and_(v, V::set1_i(static_cast<int32_t>(f.lo_mask)));
  if constexpr (f.hi_mask != 0) {
    const typename V::I high = V::and_(word(f.hi), V::set1_i(static_cast<int32_t>(f.hi_mask)));
    v = V::or_(v, V::template sll<f.hi_pos>(high));
  }
  return v;
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
