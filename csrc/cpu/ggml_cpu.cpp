// CPU kernels of the GGUF ops: dequantize, and matmul with 8-bit quantized
// activations and integer dot products. One template per family, instantiated
// for every type of the table in core/ggml_types.h.
#include <ATen/Dispatch.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "../core/ggml_blocks.h"
#include "../core/ggml_q8.h"
#include "../core/ggml_slices.h"
#include "../core/ggml_quantize.h"
#include "../core/ggml_repack.h"
#include "../ops/backend_ops.h"
#include "../ops/dispatch.h"
#include "../ops/ggml_checks.h"
#include "float_gemm.h"
#include "ggml_kernels.h"
#include "huge_pages.h"
#include "isa.h"
#include "parallel.h"

namespace lowbit {
namespace cpu {
namespace {

using ggml::Act;
using ggml::TypeInfo;

// Refuses a type without a repacked layout (ggml_traits.h), naming those with one.
void check_ggml_repacked_type(const char* op, int64_t type) {
  bool has = false;
  std::string with;
#define LOWBIT_GGML_REPACKED(name, id, block, bytes, sub, has_min, act) \
  if (has_repacked_layout(ggml::Type::name)) {                          \
    has = has || type == id;                                            \
    with += std::string(with.empty() ? "" : ", ") + #name " (" #id ")"; \
  }
  LOWBIT_GGML_TYPES(LOWBIT_GGML_REPACKED)
#undef LOWBIT_GGML_REPACKED
  TORCH_CHECK_VALUE(has, op, ": type ", type, " (", ggml::runtime_info(type).name,
                    ") has no repacked layout; the types with one are ", with);
}

// Decodes one row of n weights (whole blocks) into fp32.
template <ggml::Type T>
void dequantize_row(const uint8_t* row, int64_t n, float* out) {
  constexpr int kBlock = TypeInfo<T>::kBlock, kBytes = TypeInfo<T>::kBytes;
  for (int64_t b = 0; b < n / kBlock; ++b) ggml::dequantize_block<T>(row + b * kBytes, out + b * kBlock);
}

// Rows per parallel task: about 64k weights each, so small matrices stay serial.
int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(1, n)); }

// Decodes rows [r0, r1) of W (n weights each) into dst, of dtype out_type:
// the SIMD kernel of the active ISA where the type has one (bit-exact with
// the portable loop), straight into the output dtype.
void dequantize_rows(int64_t type, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, uint8_t* dst,
                     at::ScalarType out_type) {
#if LOWBIT_X86_SIMD
  const Isa isa = active_isa();
  const OutDtype simd_dtype = out_type == at::kFloat ? OutDtype::kF32 : out_type == at::kHalf ? OutDtype::kF16 : OutDtype::kBF16;
#if LOWBIT_X86_AVX512
  if (isa == Isa::kAvx512 && ggml_dequantize_avx512(type, W, r0, r1, n, dst, simd_dtype)) return;
#endif
  if (isa == Isa::kAvx2 && ggml_dequantize_avx2(type, W, r0, r1, n, dst, simd_dtype)) return;
#endif
  // Portable: one fp32 row at a time, then rounded once to the output dtype.
  std::vector<float> row(n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out_type, "ggml_dequantize", [&] {
    dispatch_ggml_type(type, [&](auto t) {
      constexpr ggml::Type T = decltype(t)::value;
      const int64_t row_bytes = n / TypeInfo<T>::kBlock * TypeInfo<T>::kBytes;
      for (int64_t r = r0; r < r1; ++r) {
        dequantize_row<T>(W + r * row_bytes, n, row.data());
        at::vec::convert(row.data(), reinterpret_cast<scalar_t*>(dst) + (r - r0) * n, n);
      }
    });
  });
}

// Rows per matmul chunk, in whole tiles of the SIMD kernels (4 rows; 16 for
// the AVX-512 GEMM). Batches are compute-bound and take small chunks handed
// out as threads free up; a matvec streams memory in a few long contiguous
// runs per thread (kChunksPerThread), each one prefetchable stream.
int64_t row_chunk(int64_t n, int64_t M, int64_t rows) {
  int64_t chunk = row_grain(n);
  if (M == 1) {
    const int64_t parts = kChunksPerThread * pool_threads();
    chunk = std::max<int64_t>(chunk, (rows + parts - 1) / parts);
  }
  return (chunk + 15) / 16 * 16;
}

// Activation blocks [b0, b1) of x (ActLayout<A>::kBlock elements each)
// quantized by the active ISA's kernel or quantize_act_block: the same bytes.
template <Act A>
void quantize_blocks(Isa isa, const float* x, int64_t b0, int64_t b1, int8_t* q, float* d, float* sum,
                     int32_t* offset = nullptr, int16_t* isum = nullptr) {
  using L = ggml::ActLayout<A>;
#if LOWBIT_X86_SIMD
  if (isa != Isa::kPortable) return ggml_quantize_acts_avx2(A, x, b0, b1, q, d, sum, offset, isum);
#endif
  for (int64_t b = b0; b < b1; ++b) {
    ggml::quantize_act_block<A>(x + b * L::kBlock, q + b * L::kBlock, d + b, sum + b * (L::kBlock / L::kSumBlock));
  }
}

// All M activation rows quantized once per call, in the format T pairs with,
// with ActRow::offset where `offsets` asks for it, and ActRow::isum for Q8_K
// and where `block_sums` asks for it (the SIMD ISAs only: their quantizer
// fills it).
template <Act A>
struct QuantizedActs {
  using L = ggml::ActLayout<A>;
  int64_t n;
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<float> sum;
  std::vector<int32_t> offset;
  std::vector<int16_t> isum;

  QuantizedActs(const float* x, int64_t M, int64_t n_, bool offsets, bool block_sums)
      : n(n_), q(M * n_), d(M * n_ / L::kBlock), sum(M * n_ / L::kSumBlock), offset(offsets ? M * n_ / 4 : 0) {
    const int64_t blocks = n / L::kBlock;
    const Isa isa = active_isa();
    if ((A == Act::Q8_K && isa != Isa::kPortable) || block_sums) isum.resize(sum.size());
    parallel_for(M * blocks, std::max<int64_t>(1, 2048 / L::kBlock), [&](int64_t b0, int64_t b1) {
      quantize_blocks<A>(isa, x, b0, b1, q.data(), d.data(), sum.data(), offsets ? offset.data() : nullptr,
                         isum.empty() ? nullptr : isum.data());
    });
  }

  ggml::ActRow row(int64_t m) const {
    return {q.data() + m * n, d.data() + m * (n / L::kBlock), sum.data() + m * (n / L::kSumBlock),
            offset.empty() ? nullptr : offset.data() + m * (n / 4),
            isum.empty() ? nullptr : isum.data() + m * (n / L::kSumBlock)};
  }
};

// ggml_quantize's error for the block of `count` values at x[r, c:c+count]
// whose scale came out non-finite, or that holds a NaN or Inf (llama.cpp's
// quantizer refuses those too): values whose fp16 block scale overflows.
[[noreturn]] void throw_unquantizable(const float* v, int64_t r, int64_t c, int64_t count, const char* type) {
  const float* bad = std::find_if(v, v + count, [](float e) { return !std::isfinite(e); });
  TORCH_CHECK_VALUE(bad == v + count, "ggml_quantize: x holds a non-finite value (", *bad, ") at [", r, ", ",
                    c + (bad - v), "]");
  const float* big = std::max_element(v, v + count, [](float a, float b) { return std::fabs(a) < std::fabs(b); });
  TORCH_CHECK_VALUE(false, "ggml_quantize: x's block [", r, ", ", c, ":", c + count, "] reaches magnitude ", *big,
                    ", beyond ", type, "'s range (its fp16 block scale overflows)");
}

// The portable kernel: out[:, r0:r1] of X @ W.T, each weight block decoded
// once and dotted with every activation row. The sliced types decode a
// block 32 elements at a time, through the CUDA matvec's own decoders
// (core/ggml_slices.h), to the same sums.
template <ggml::Type T>
void mul_mat_rows_portable(const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                           float* out, int64_t rows) {
  using I = TypeInfo<T>;
  const int64_t blocks = n / I::kBlock;
  std::vector<float> acc(M), block_acc(M);
  for (int64_t r = r0; r < r1; ++r) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    const uint8_t* row = W + r * blocks * I::kBytes;
    for (int64_t b = 0; b < blocks; ++b) {
      if constexpr (ggml::kSliced<T>) {
        std::fill(block_acc.begin(), block_acc.end(), 0.0f);
        ggml::Slice<T> slice;
        for (int j = 0; j < I::kBlock / ggml::kSliceElems; ++j) {
          ggml::SliceCodec<T>::decode(row + b * I::kBytes, j, slice);
          for (int64_t m = 0; m < M; ++m) {
            ggml::slice_dot<T>(slice, acts[m], b * I::kBlock + j * ggml::kSliceElems, block_acc[m]);
          }
        }
        for (int64_t m = 0; m < M; ++m) acc[m] += block_acc[m];
      } else {
        ggml::Decoded<T> blk;
        ggml::Codec<T>::decode(row + b * I::kBytes, blk);
        for (int64_t m = 0; m < M; ++m) acc[m] += ggml::block_dot<T>(blk, acts[m], b);
      }
    }
    for (int64_t m = 0; m < M; ++m) out[m * rows + r] = acc[m];
  }
}

// out[:, r0:r1] of X @ W.T by the kernel of the active ISA, where the type has one.
template <ggml::Type T>
void mul_mat_rows(Isa isa, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts, int64_t M,
                  float* out, int64_t rows) {
  bool done = false;
#if LOWBIT_X86_SIMD
  const int64_t t = static_cast<int64_t>(T);
#if LOWBIT_X86_AVX512
  if (isa == Isa::kAvx512) done = ggml_mul_mat_avx512(t, W, r0, r1, n, acts, M, out, rows);
#endif
  if (isa == Isa::kAvx2) done = ggml_mul_mat_avx2(t, W, r0, r1, n, acts, M, out, rows);
#endif
  if (!done) mul_mat_rows_portable<T>(W, r0, r1, n, acts, M, out, rows);
}

// The rows [r0, r1) of a repacked weight (core/ggml_repack.h; r0 a multiple
// of its tile rows): the AVX-512 kernels, and the AVX2 ones for the types
// reads_repacked_avx2 names, read the layout as it is; otherwise a few tiles
// at a time go back in the file's layout (in a buffer that stays in cache)
// for the ISA's own kernel, so that every ISA computes what it computes for
// the file's layout.
template <ggml::Type T>
void mul_mat_repacked_rows(Isa isa, const uint8_t* W, int64_t r0, int64_t r1, int64_t n, const ggml::ActRow* acts,
                           int64_t M, float* out, int64_t rows) {
  if constexpr (has_repacked_layout(T)) {
#if LOWBIT_X86_SIMD
#if LOWBIT_X86_AVX512
    if (isa == Isa::kAvx512 && ggml_mul_mat_repacked_avx512(static_cast<int64_t>(T), W, r0, r1, n, acts, M, out, rows))
      return;
#endif
    if (isa == Isa::kAvx2 && ggml_mul_mat_repacked_avx2(static_cast<int64_t>(T), W, r0, r1, n, acts, M, out, rows))
      return;
#endif
    constexpr int64_t kStep = 4 * ggml::kRepackRows;
    const int64_t row_bytes = n / TypeInfo<T>::kBlock * TypeInfo<T>::kBytes;
    std::vector<uint8_t> plain(std::min(kStep, r1 - r0) * row_bytes);
    for (int64_t s0 = r0; s0 < r1; s0 += kStep) {
      const int64_t s1 = std::min(r1, s0 + kStep);
      ggml::repack_rows<T>(W + s0 * row_bytes, plain.data(), s1 - s0, row_bytes, /*inverse=*/true);
      mul_mat_rows<T>(isa, plain.data(), 0, s1 - s0, n, acts, M, out + s0, rows);
    }
  }
}

// What the active ISA's kernels of type T read beyond an activation row's
// q, d and sums at M rows: {ActRow::offset, ActRow::isum}.
template <ggml::Type T>
std::pair<bool, bool> act_extras(Isa isa, int64_t M, bool repacked) {
  using I = TypeInfo<T>;
  bool offsets = false, block_sums = false;
#if LOWBIT_X86_SIMD
  // The repacked one-scale types without mins start each block's dot from
  // its activations' sum (RepackedFloatGemm); rows past the last tile run
  // the file's kernels.
#if LOWBIT_X86_AVX512
  if (isa == Isa::kAvx512) {
    offsets = ggml_mul_mat_avx512_takes_offsets(static_cast<int64_t>(T), M);
    block_sums = repacked && I::kBlock == 32 && !I::kHasMin;
  }
#endif
  if (isa == Isa::kAvx2) {
    offsets = ggml_mul_mat_avx2_takes_offsets(static_cast<int64_t>(T), M, repacked);
    block_sums = ggml_mul_mat_avx2_takes_block_sums(static_cast<int64_t>(T), repacked);
  }
#endif
  return {offsets, block_sums};
}

// out[M, rows] = X[M, n] @ W.T with the activations quantized once per call;
// tasks own disjoint weight rows (whole tiles of the SIMD kernels, and of a
// repacked weight's layout).
template <ggml::Type T>
void mul_mat_quantized(const uint8_t* W, int64_t rows, int64_t n, const float* X, int64_t M, float* out,
                       bool repacked) {
  using I = TypeInfo<T>;
  const Isa isa = active_isa();
  const auto [offsets, block_sums] = act_extras<T>(isa, M, repacked);
  const QuantizedActs<I::kAct> quantized(X, M, n, offsets, block_sums);
  std::vector<ggml::ActRow> acts(M);
  for (int64_t m = 0; m < M; ++m) acts[m] = quantized.row(m);
  parallel_chunks(rows, row_chunk(n, M, rows), [&](int64_t r0, int64_t r1) {
    if (repacked)
      mul_mat_repacked_rows<T>(isa, W, r0, r1, n, acts.data(), M, out, rows);
    else
      mul_mat_rows<T>(isa, W, r0, r1, n, acts.data(), M, out, rows);
  });
}

// Float weights at M > kFloatFmaMaxM take the fp32 GEMM library
// (float_gemm.h), several times the FMA loop's rate there, in strips of
// output columns as pool tasks: each widens its rows of W to fp32 (F16,
// BF16; F32 rows are the operand as they are), about kFloatStripBytes of
// them, and multiplies them on its own thread.
constexpr int64_t kFloatFmaMaxM = 16;
constexpr int64_t kFloatStripBytes = 2 << 20;

template <ggml::Type T>
void mul_mat_float_gemm(const uint8_t* W, int64_t rows, int64_t n, const float* X, int64_t M, float* out) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor x = at::from_blob(const_cast<float*>(X), {M, n}, f32);
  const at::Tensor y = at::from_blob(out, {M, rows}, f32);
  const int64_t strip = std::max<int64_t>(16, kFloatStripBytes / (4 * n) / 16 * 16);
  parallel_chunks(rows, strip, [&](int64_t r0, int64_t r1) {
    at::Tensor w;
    if constexpr (T == ggml::Type::F32) {
      w = at::from_blob(const_cast<uint8_t*>(W) + r0 * n * 4, {r1 - r0, n}, f32);
    } else {
      w = at::empty({r1 - r0, n}, f32);
      dequantize_rows(static_cast<int64_t>(T), W, r0, r1, n, static_cast<uint8_t*>(w.data_ptr()), at::kFloat);
    }
    float_mm_out(x, w.t(), y.narrow(1, r0, r1 - r0));
  });
}

// Float weight types (F32, F16, BF16) multiply fp32 activations directly,
// in runs of whole 4-row tiles of the SIMD kernel, up to kFloatFmaMaxM rows.
template <ggml::Type T>
void mul_mat_float(const uint8_t* W, int64_t rows, int64_t n, const float* X, int64_t M, float* out) {
  if (M > kFloatFmaMaxM) return mul_mat_float_gemm<T>(W, rows, n, X, M, out);
  const Isa isa = active_isa();
  const int64_t parts = kChunksPerThread * pool_threads();
  const int64_t chunk = std::max(row_grain(n), (rows + parts - 1) / parts);
  parallel_chunks(rows, (chunk + 3) / 4 * 4, [&](int64_t r0, int64_t r1) {
#if LOWBIT_X86_SIMD
    if (isa != Isa::kPortable && ggml_mul_mat_float_avx2(static_cast<int64_t>(T), W, r0, r1, n, X, M, out, rows))
      return;
#endif
    std::vector<float> w(n);
    for (int64_t r = r0; r < r1; ++r) {
      dequantize_row<T>(W + r * n * TypeInfo<T>::kBytes, n, w.data());
      for (int64_t m = 0; m < M; ++m) {
        const float* x = X + m * n;
        float acc = 0.0f;
        for (int64_t i = 0; i < n; ++i) acc += w[i] * x[i];
        out[m * rows + r] = acc;
      }
    }
  });
}

at::Tensor ggml_mul_mat(const char* op, const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row,
                        bool repacked = false) {
  check_ggml_matmul(op, W, X, type, row);
  if (repacked) check_ggml_repacked_type(op, type);
  const at::Tensor x = X.to(at::kFloat).contiguous();
  const int64_t M = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({M, row}, x.options());
  if (M > 0 && row > 0 && n > 0) {  // n = 0: an empty sum, zeros
    const uint8_t* w = W.data_ptr<uint8_t>();
    dispatch_ggml_type(type, [&](auto t) {
      constexpr ggml::Type T = decltype(t)::value;
      if constexpr (TypeInfo<T>::kFloat) {
        mul_mat_float<T>(w, row, n, x.data_ptr<float>(), M, out.data_ptr<float>());
      } else {
        mul_mat_quantized<T>(w, row, n, x.data_ptr<float>(), M, out.data_ptr<float>(), repacked);
      }
    });
  } else {
    out.zero_();
  }
  return out.to(X.scalar_type());
}

// A mixture-of-experts call's (token, slot) pairs grouped by expert: pairs
// order[start[e] .. start[e + 1]) go to expert e, in pair order.
struct ExpertGroups {
  std::vector<int64_t> start, order;
  ExpertGroups(const int32_t* ids, int64_t pairs, int64_t experts) : start(experts + 1, 0), order(pairs) {
    for (int64_t p = 0; p < pairs; ++p) ++start[ids[p] + 1];
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[next[ids[p]]++] = p;
  }
  int64_t count(int64_t e) const { return start[e + 1] - start[e]; }
};

// out[p, :] = W[expert of pair p] @ x[its row] for every pair, in groups:
// grouped[i] is pair order[i]'s row; W's experts each in the repacked
// layout (of its own rows) where `repacked`. Each activation row is
// quantized once however many experts take it, and one parallel pass runs
// every expert's rows (in chunks as mul_mat_quantized's) against all of its
// pairs at once, so the experts of a token share the threads.
template <ggml::Type T>
void mul_mat_id_quantized(const uint8_t* W, int64_t experts, int64_t rows, int64_t n, const float* x,
                          int64_t x_rows, const ExpertGroups& groups, const std::vector<int64_t>& x_row_of,
                          float* grouped, bool repacked) {
  using I = TypeInfo<T>;
  const Isa isa = active_isa();
  int64_t most = 0;
  for (int64_t e = 0; e < experts; ++e) most = std::max(most, groups.count(e));
  const auto [offsets, block_sums] = act_extras<T>(isa, most, repacked);  // a superset for the smaller groups
  const QuantizedActs<I::kAct> quantized(x, x_rows, n, offsets, block_sums);
  std::vector<ggml::ActRow> acts(groups.order.size());
  for (size_t i = 0; i < acts.size(); ++i) acts[i] = quantized.row(x_row_of[groups.order[i]]);
  struct Task {
    int64_t expert, r0, r1;
  };
  std::vector<Task> tasks;
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t M = groups.count(e), chunk = row_chunk(n, M, rows);
    for (int64_t r0 = 0; M > 0 && r0 < rows; r0 += chunk) tasks.push_back({e, r0, std::min(rows, r0 + chunk)});
  }
  const int64_t row_bytes = n / I::kBlock * I::kBytes;
  parallel_chunks(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Task& task = tasks[t];
      const int64_t first = groups.start[task.expert];
      const uint8_t* w = W + task.expert * rows * row_bytes;
      const int64_t M = groups.count(task.expert);
      if (repacked)
        mul_mat_repacked_rows<T>(isa, w, task.r0, task.r1, n, acts.data() + first, M, grouped + first * rows, rows);
      else
        mul_mat_rows<T>(isa, w, task.r0, task.r1, n, acts.data() + first, M, grouped + first * rows, rows);
    }
  });
}

// The float weight types: each expert's rows gathered, then mul_mat_float.
template <ggml::Type T>
void mul_mat_id_float(const uint8_t* W, int64_t experts, int64_t rows, int64_t n, const float* x,
                      const ExpertGroups& groups, const std::vector<int64_t>& x_row_of, float* grouped) {
  const int64_t pairs = static_cast<int64_t>(groups.order.size());
  std::vector<float> gathered(pairs * n);
  for (int64_t i = 0; i < pairs; ++i) std::copy_n(x + x_row_of[groups.order[i]] * n, n, gathered.data() + i * n);
  const int64_t row_bytes = n * TypeInfo<T>::kBytes;
  for (int64_t e = 0; e < experts; ++e) {
    if (groups.count(e) == 0) continue;
    const int64_t first = groups.start[e];
    mul_mat_float<T>(W + e * rows * row_bytes, rows, n, gathered.data() + first * n, groups.count(e),
                     grouped + first * rows);
  }
}

at::Tensor ggml_mul_mat_id(const char* op, const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids,
                           int64_t type, int64_t row, bool repacked) {
  const GgmlMatmulId c = check_ggml_matmul_id(op, W, X, ids, type, row);
  if (repacked) check_ggml_repacked_type(op, type);
  const at::Tensor x = X.to(at::kFloat).contiguous();
  const int64_t pairs = c.tokens * c.slots;
  if (pairs == 0 || row == 0 || c.n == 0) return at::zeros({c.tokens, c.slots, row}, X.options());
  const ExpertGroups groups(c.ids.data_ptr<int32_t>(), pairs, c.experts);
  std::vector<int64_t> x_row_of(pairs);  // each pair's activation row
  for (int64_t p = 0; p < pairs; ++p) x_row_of[p] = c.per_slot ? p : p / c.slots;
  at::Tensor out = at::empty({c.tokens, c.slots, row}, x.options());
  const std::unique_ptr<float[]> grouped(new float[pairs * row]);
  const uint8_t* w = W.data_ptr<uint8_t>();
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (TypeInfo<T>::kFloat) {
      mul_mat_id_float<T>(w, c.experts, row, c.n, x.data_ptr<float>(), groups, x_row_of, grouped.get());
    } else {
      mul_mat_id_quantized<T>(w, c.experts, row, c.n, x.data_ptr<float>(), c.per_slot ? pairs : c.tokens, groups,
                              x_row_of, grouped.get(), repacked);
    }
  });
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < pairs; ++i) std::copy_n(grouped.get() + i * row, row, dst + groups.order[i] * row);
  return out.to(X.scalar_type());
}

}  // namespace

at::Tensor ggml_mul_mat_id(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                           int64_t row) {
  return ggml_mul_mat_id("ggml_mul_mat_id", W, X, ids, type, row, /*repacked=*/false);
}

at::Tensor ggml_mul_mat_id_repacked(const at::Tensor& W, const at::Tensor& X, const at::Tensor& ids, int64_t type,
                                    int64_t row) {
  return ggml_mul_mat_id("ggml_mul_mat_id_repacked", W, X, ids, type, row, /*repacked=*/true);
}

at::Tensor ggml_dequantize(const at::Tensor& W, int64_t type, int64_t m, int64_t n,
                           std::optional<at::ScalarType> dtype) {
  const auto [info, out_type] = check_ggml_dequantize(W, type, m, n, dtype);
  at::Tensor out = at::empty({m, n}, W.options().dtype(out_type));
  if (out.numel() == 0) return out;
  const uint8_t* w = W.data_ptr<uint8_t>();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  parallel_for(m, row_grain(n), [&](int64_t r0, int64_t r1) {
    dequantize_rows(type, w, r0, r1, n, dst + r0 * n * out.element_size(), out_type);
  });
  return out;
}

at::Tensor ggml_mul_mat_vec_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row) {
  return ggml_mul_mat("ggml_mul_mat_vec_a8", W, X, type, row);
}

at::Tensor ggml_mul_mat_a8(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row) {
  return ggml_mul_mat("ggml_mul_mat_a8", W, X, type, row);
}

at::Tensor ggml_mul_mat_repacked(const at::Tensor& W, const at::Tensor& X, int64_t type, int64_t row) {
  return ggml_mul_mat("ggml_mul_mat_repacked", W, X, type, row, /*repacked=*/true);
}

namespace {

// Row r of ggml_quantize's output as Q8_0 blocks: a Q8_0 weight block is a
// Q8_0 activation block (the rounding llama.cpp's quantizer and its
// activations share) with d stored as fp16.
void quantize_row_q8_0(Isa isa, const float* row, int64_t r, int64_t blocks, uint8_t* out) {
  constexpr int64_t kBlock = 32, kBytes = 34;
  std::vector<float> d(blocks), sum(blocks);
  std::vector<int8_t> q(blocks * kBlock);
  quantize_blocks<Act::Q8_0>(isa, row, 0, blocks, q.data(), d.data(), sum.data());
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = row + b * kBlock;
    if (!std::isfinite(d[b])) throw_unquantizable(v, r, b * kBlock, kBlock, "Q8_0");
    const uint16_t h = fp32_to_fp16(d[b]);  // d is fp16-exact already
    uint8_t* block = out + b * kBytes;
    block[0] = static_cast<uint8_t>(h & 0xff);
    block[1] = static_cast<uint8_t>(h >> 8);
    // A scale that rounds to 0 in fp16 (amax below 127 * 2^-25) decodes to
    // zeros whatever q holds; q is still round(x / d), as llama.cpp writes
    // it, but where its 1 / d overflows (amax below about 127 * 2^-128) it
    // writes q = 0, as gguf-py does.
    float amax = 0.0f;
    for (int64_t i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    if (std::isinf(1.0f / (amax / 127.0f))) {
      std::memset(block + 2, 0, kBlock);
    } else {
      std::memcpy(block + 2, q.data() + b * kBlock, kBlock);
    }
  }
}

// Row r as Q6_K blocks (core/ggml_quantize.h). A NaN or Inf would steer the
// scale search anywhere: a block holding one is refused before it is searched.
void quantize_row_q6_k(const float* row, int64_t r, int64_t blocks, uint8_t* out) {
  constexpr int64_t kBlock = 256, kBytes = 210;
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = row + b * kBlock;
    if (!std::all_of(v, v + kBlock, [](float e) { return std::isfinite(e); }) ||
        !std::isfinite(ggml::quantize_q6_k_block(v, out + b * kBytes)))
      throw_unquantizable(v, r, b * kBlock, kBlock, "Q6_K");
  }
}

}  // namespace

at::Tensor ggml_quantize(const at::Tensor& x, int64_t type) {
  const auto info = check_ggml_quantize(x, type);
  const int64_t m = x.size(0), n = x.size(1), blocks = n / info.block, row_bytes = blocks * info.bytes;
  at::Tensor out = at::empty({m, row_bytes}, x.options().dtype(at::kByte));
  if (out.numel() == 0) return out;
  uint8_t* dst = out.data_ptr<uint8_t>();
  const Isa isa = active_isa();
  const bool q6_k = type == static_cast<int64_t>(ggml::Type::Q6_K);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "ggml_quantize", [&] {
    const scalar_t* src = x.const_data_ptr<scalar_t>();
    parallel_for(m, row_grain(n), [&](int64_t r0, int64_t r1) {
      std::vector<float> row(n);
      for (int64_t r = r0; r < r1; ++r) {
        at::vec::convert(src + r * n, row.data(), n);
        if (q6_k) {
          quantize_row_q6_k(row.data(), r, blocks, dst + r * row_bytes);
        } else {
          quantize_row_q8_0(isa, row.data(), r, blocks, dst + r * row_bytes);
        }
      }
    });
  });
  return out;
}

at::Tensor ggml_repack(const at::Tensor& W, int64_t type, int64_t row, int64_t n, bool inverse) {
  // W [experts, row, row bytes]: each expert's rows a weight of their own.
  const int64_t experts = W.dim() == 3 ? W.size(0) : 1;
  TORCH_CHECK_VALUE(W.dim() != 3 || W.size(1) == row, "ggml_repack: W [experts, rows, row bytes] has ", W.size(1),
                    " rows per expert, but row=", row);
  const auto info = check_ggml_weight("ggml_repack", W, type, "row", experts * row, n);
  check_ggml_repacked_type("ggml_repack", type);
  at::Tensor out = at::empty_like(W);
  if (out.numel() == 0) return out;
  const int64_t row_bytes = n / info.block * info.bytes;
  const uint8_t* src = W.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  // A dense weight is streamed whole by every matvec (huge_pages.h). An
  // expert's rows are read a few experts at a time, in runs of its own size,
  // and asking huge pages for all of them made loading a mixture-of-experts
  // file several times slower on the benchmarks' VM, for no faster decode.
  if (experts == 1) advise_huge_pages(dst, out.numel());
  dispatch_ggml_type(type, [&](auto t) {
    constexpr ggml::Type T = decltype(t)::value;
    if constexpr (has_repacked_layout(T)) {
      // Tasks of whole tiles of one expert, each a weight of its own (see repack_rows).
      const int64_t tiles = (row + ggml::kRepackRows - 1) / ggml::kRepackRows;
      parallel_for(experts * tiles, std::max<int64_t>(1, row_grain(n) / ggml::kRepackRows), [&](int64_t t0, int64_t t1) {
        for (int64_t e = t0 / tiles; e * tiles < t1; ++e) {
          const int64_t r0 = (std::max(t0, e * tiles) - e * tiles) * ggml::kRepackRows;
          const int64_t r1 = std::min(row, (std::min(t1, (e + 1) * tiles) - e * tiles) * ggml::kRepackRows);
          const int64_t at = (e * row + r0) * row_bytes;
          ggml::repack_rows<T>(src + at, dst + at, r1 - r0, row_bytes, inverse);
        }
      });
    }
  });
  return out;
}

}  // namespace cpu
}  // namespace lowbit
