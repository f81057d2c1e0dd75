// Entry points of the SIMD GGUF kernels (ggml_avx2.cpp, ggml_avx512.cpp; chosen at run time, see isa.h). Torch-free.
#pragma once

#include <stdint.h>

#include "../core/ggml_q8.h"
#include "../core/ggml_types.h"
#include "ggml_traits.h"

namespace lowbit {
namespace cpu {

// out[m * rows + r] = sum over the row of dequant(W[r]) * x[m] for r in
// [r0, r1) and m < M, with acts[m] the activation rows quantized as
// TypeInfo<T>::kAct, for every quantized type. Returns false (and computes
// nothing) for the float types. The kernels read acts[m].offset where
// ggml_mul_mat_avx512_takes_offsets / ggml_mul_mat_avx2_takes_offsets say so.
bool ggml_mul_mat_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts,
                       int64_t M, float* out, int64_t rows);
bool ggml_mul_mat_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                         const ggml::ActRow* acts, int64_t M, float* out, int64_t rows);
bool ggml_mul_mat_avx512_takes_offsets(int64_t type, int64_t M);
// The same over a repacked weight (core/ggml_repack.h; r0 a multiple of its
// tile rows), for the types with a repacked layout; the signed ones read
// acts[m].offset. Returns false for the others.
bool ggml_mul_mat_repacked_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                                  const ggml::ActRow* acts, int64_t M, float* out, int64_t rows);
// The AVX2 kernel of the same, for the types reads_repacked_avx2 names;
// Q4_0 and Q5_0 read acts[m].isum. Returns false for the others.
bool ggml_mul_mat_repacked_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n,
                                const ggml::ActRow* acts, int64_t M, float* out, int64_t rows);
// Whether ggml_mul_mat_avx2 (repacked false) or ggml_mul_mat_repacked_avx2
// (true) reads acts[m].offset for M activation rows of `type`, and whether
// it reads acts[m].isum for a Q8_0 / Q8_1 `type` (for any M).
bool ggml_mul_mat_avx2_takes_offsets(int64_t type, int64_t M, bool repacked);
bool ggml_mul_mat_avx2_takes_block_sums(int64_t type, bool repacked);

// Activation blocks [b0, b1) of x (blocks of ActLayout<act>::kBlock) quantized
// as quantize_act_block<act> does, bit for bit; act is Q8_0, Q8_1 or Q8_K.
// With `offset`, also the blocks' ActRow::offset values (indexed as q / 4);
// with `isum`, their ActRow::isum values (indexed as sum). AVX2 only: the
// AVX-512 CPUs run it too.
void ggml_quantize_acts_avx2(ggml::Act act, const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, float* sum,
                             int32_t* offset, int16_t* isum);

// out[m * rows + r] = W[r] . x[m] for r in [r0, r1) and m < M, over fp32
// activation rows X[M, n], for the float types (F32, F16, BF16); false for
// the others. AVX2 with F16C: the AVX-512 CPUs run it too.
bool ggml_mul_mat_float_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const float* X,
                             int64_t M, float* out, int64_t rows);

// Rows [r0, r1) of an [rows, n] weight dequantized into out (row r from
// element (r - r0) * n) in fp32, or rounded once to fp16 / bf16; bit-exact
// with the portable path; every type.
enum class OutDtype { kF32, kF16, kBF16 };
bool ggml_dequantize_avx2(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out,
                          OutDtype dtype);
bool ggml_dequantize_avx512(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, void* out,
                            OutDtype dtype);

}  // namespace cpu
}  // namespace lowbit
