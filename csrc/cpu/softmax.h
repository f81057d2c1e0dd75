// The softmax of a decode step's scores, header-only in an anonymous
// namespace: the portable unit (decode_ops.cpp) and the AVX2 one
// (decode_avx2.cpp, inside its target pragma) each compile their own copy.
#pragma once

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>

namespace lowbit {
namespace cpu {
namespace {

// e^x for x <= 0 (a softmax's exponents after its maximum is taken off),
// within 2 ulp, in plain arithmetic the compiler vectorises (std::exp is a
// library call per value): 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2,
// e^r by its degree-6 Taylor polynomial. Below -87 it returns about 1e-38
// for what is 0 to the sum.
[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504f + kRound) - kRound;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Gemma 2's soft cap of a row of scores, in place: cap * tanh(s / cap),
// each operation rounded as transformers' eager attention rounds it.
inline void soft_cap(float* s, int64_t keys, float cap) {
  for (int64_t p = 0; p < keys; ++p) s[p] = std::tanh(s[p] / cap) * cap;
}

// A row of scores into exp(s - max(s)), in place; returns their sum (the
// softmax's divisor). With a sink (gpt-oss's per-head logit, nullptr for
// none) the maximum covers it too and its exponent joins the divisor only,
// as a softmax over the scores and the sink whose sink column is dropped.
[[gnu::always_inline]] inline float exponentiate(float* s, int64_t keys, const float* sink) {
  float top = *std::max_element(s, s + keys);
  if (sink != nullptr) top = std::max(top, *sink);
  float total = 0.0f;
  for (int64_t p = 0; p < keys; ++p) s[p] = exp_nonpositive(s[p] - top);
  for (int64_t p = 0; p < keys; ++p) total += s[p];
  return sink != nullptr ? total + exp_nonpositive(*sink - top) : total;
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
