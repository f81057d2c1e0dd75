// CPU gptq_gemm and gptq_dequantize.
//
// Both are built on one primitive, dequant_row: a run of one weight row k,
// W[k, n0:n1], in fp32, and on its SIMD form for whole packs of rows and
// vectors of columns (gptq_dequant_simd.h). Small M fuses the decoding with
// the dot products (every weight is decoded once and used M times from
// registers/L1); large M decodes tiles of W and hands them to a GEMM that is
// faster than any loop we would write here: fp32 (float_gemm.h: oneDNN's or
// torch's BLAS), or for bf16 activations on AVX512-BF16 CPUs torch's bf16
// GEMM over two bf16 planes of W.
// Accumulation is fp32 throughout.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "../core/gptq_format.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "../ops/backend_ops.h"
#include "float_gemm.h"
#include "gptq_kernels.h"
#include "gptq_prepare.h"
#include "isa.h"
#include "parallel.h"

namespace lowbit {
namespace cpu {
namespace {

// Largest M handled by the portable fused kernel; beyond it dequantize +
// the fp32 GEMM wins, for every bit width (csrc/cpu/README.md, M thresholds).
constexpr int64_t kFusedMaxM = 8;
// The same for the SIMD fused kernels, which decode several times faster.
constexpr int64_t kSimdFusedMaxM = 64;
// bf16 activations on AVX512-BF16 CPUs leave the fused kernels for the bf16
// GEMM path (gemm_bf16x2_mm) above kSimdFusedMaxM, and above kAmxFusedMaxM
// where AMX-BF16 runs that GEMM, whose time then barely grows with M. Where
// vdpbf16ps runs at the FMA's rate and there is no AMX, the vdpbf16ps fused
// kernel takes every M: past a few rows its cost per activation row is
// torch's bf16 GEMM's, where the GEMM path does two GEMMs' work.
constexpr int64_t kAmxFusedMaxM = 40;
// Output columns per fused task: acc[kFusedMaxM][kTileN] stays in L1.
constexpr int64_t kTileN = 64;
// Bytes of fp32 weight strip decoded per GEMM call on the large-M path.
constexpr int64_t kTileBytes = 2 << 20;
// The same for the bf16 GEMM path's column strips, [2K, width] bf16: 16 MB
// is fastest at both benchmark shapes (8 and 32 MB each lose at one).
constexpr int64_t kBf16TileBytes = 16 << 20;

// Group parameters of one run of columns [n0, n1) (read_group), each group
// read at its first use and kept: consecutive rows share a group, but an
// act-order g_idx returns to each group many times. The buffers are
// allocated uninitialised, so groups a run never uses cost no pages.
template <int B>
class GroupRun {
 public:
  GroupRun(const GptqWeight& w, int64_t n0, int64_t n1)
      : w_(w), n0_(n0), n1_(n1), read_(static_cast<size_t>(w.group_of.count), false),
        z_(new int32_t[w.group_of.count * (n1 - n0)]), s_(new float[w.group_of.count * (n1 - n0)]) {}
  void select(int64_t g) {
    const int64_t at = g * (n1_ - n0_);
    if (!read_[g]) read_group<B>(w_, g, n0_, n1_, z_.get() + at, s_.get() + at), read_[g] = true;
    zeros_ = z_.get() + at, scales_ = s_.get() + at;
  }
  const int32_t* zeros() const { return zeros_; }
  const float* scales() const { return scales_; }

 private:
  const GptqWeight& w_;
  int64_t n0_, n1_;
  std::vector<bool> read_;
  std::unique_ptr<int32_t[]> z_;
  std::unique_ptr<float[]> s_;
  const int32_t* zeros_ = nullptr;
  const float* scales_ = nullptr;
};

// out[n - n0] = W[k, n] for n in [n0, n1), with run holding those columns.
template <int B>
inline void dequant_row(const GptqWeight& w, int64_t k, GroupRun<B>& run, int64_t n0, int64_t n1, float* out) {
  const gptq::FieldLoc f = gptq::locate<B>(k);
  run.select(w.group_of(k));
  const int32_t* z = run.zeros() - n0;
  const float* s = run.scales() - n0;
  for (int64_t n = n0, end; n < n1; n = end) {  // runs of contiguous words
    end = w.run_end(n, n1);
    const uint32_t* lo = w.words(f.lo, n);
    const uint32_t* hi = w.words(f.hi, n);
    for (int64_t i = n; i < end; ++i) {
      out[i - n0] = gptq::dequant(gptq::extract(lo[i - n], hi[i - n], f), z[i], s[i]);
    }
  }
}

// The portable fused kernel: out[:, n0:n1] = a[M, K] @ W[:, n0:n1], kFusedMaxM
// activation rows per pass.
template <int B>
void fused_portable(const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  if (M > kFusedMaxM) {
    for (int64_t m0 = 0; m0 < M; m0 += kFusedMaxM) {
      fused_portable<B>(a + m0 * w.K, std::min(kFusedMaxM, M - m0), w, n0, n1, out + m0 * w.N);
    }
    return;
  }
  float acc[kFusedMaxM][kTileN];
  float row[kTileN];
  for (int64_t t0 = n0; t0 < n1; t0 += kTileN) {
    const int64_t width = std::min(kTileN, n1 - t0);
    GroupRun<B> run(w, t0, t0 + width);
    for (int64_t m = 0; m < M; ++m) std::fill_n(acc[m], width, 0.0f);
    for (int64_t k = 0; k < w.K; ++k) {
      dequant_row<B>(w, k, run, t0, t0 + width, row);
      for (int64_t m = 0; m < M; ++m) {
        const float am = a[m * w.K + k];
        for (int64_t n = 0; n < width; ++n) acc[m][n] += am * row[n];
      }
    }
    for (int64_t m = 0; m < M; ++m) std::copy_n(acc[m], width, out + m * w.N + t0);
  }
}

// out[M, N] = a[M, K] @ W for small M; tasks own disjoint column
// tiles. The SIMD kernel of the active ISA takes the columns it can (whole
// vectors, contiguous groups) and the portable one the rest.
// isa: the SIMD kernels to use (kPortable when w does not suit them); a16:
// bf16 planes of a for the AVX512-BF16 kernel, or null.
template <int B>
void gemm_fused(const float* a, int64_t M, const GptqWeight& w, float* out, Isa isa, const Bf16Acts* a16) {
  for_isa_column_tasks(
      w.N, isa, kTileN,
      [&](int64_t n0, int64_t n1) {
#if LOWBIT_X86_AVX512
        if (isa == Isa::kAvx512 && a16) gptq_fused_avx512bf16(B, a, *a16, w, n0, n1, out);
        if (isa == Isa::kAvx512 && !a16) gptq_fused_avx512(B, a, M, w, n0, n1, out);
#endif
#if LOWBIT_X86_SIMD
        if (isa == Isa::kAvx2) gptq_fused_avx2(B, a, M, w, n0, n1, out);
#endif
      },
      [&](int64_t n0, int64_t n1) { fused_portable<B>(a, M, w, n0, n1, out); });
}

// Whether bf16 / fp16 activations take the vdpbf16ps kernel
// (gptq_fused_bf16.h) rather than the fp32 FMA one, on an AVX-512 CPU: both
// compute the same exact products. Where vdpbf16ps runs at the FMA's rate
// it wins for every bit width at every M; on Intel cores, at half that rate,
// the FMA kernel (words pinned in registers, 3-bit read in 4-bit chunks) wins.
// cpu_bf16_kernel("always") takes it wherever it applies (the tests do).
bool use_bf16_kernel() {
  if (!has_avx512_bf16()) return false;
  return bf16_kernel() == Bf16Kernel::kAlways || bf16_dot_at_fma_rate();
}

// The most activation rows the SIMD fused kernels take (kSimdFusedMaxM and
// kAmxFusedMaxM above); past them the dequantize + GEMM paths. bf16_gemm:
// the large-M path is gemm_bf16x2_mm; bf16_dot: the fused kernel is the
// vdpbf16ps one.
int64_t simd_fused_max_m(bool bf16_gemm, bool bf16_dot) {
  if (bf16_gemm && has_amx_bf16()) return kAmxFusedMaxM;
  if (bf16_dot && bf16_dot_at_fma_rate() && bf16_kernel() != Bf16Kernel::kGemm)
    return std::numeric_limits<int64_t>::max();
  return kSimdFusedMaxM;
}

// The bf16 planes [planes, M, K] that sum to the activations exactly
// (gptq_fused_bf16.h): a itself for bf16 input; hi = bf16(a) and lo = a - hi
// for fp16, whose 3 extra significand bits fit in lo. a2 is a in fp32.
at::Tensor bf16_planes(const at::Tensor& a2, at::ScalarType input) {
  const at::Tensor hi = a2.to(at::kBFloat16);
  if (input == at::kBFloat16) return hi.unsqueeze(0);
  return at::stack({hi, (a2 - hi.to(at::kFloat)).to(at::kBFloat16)});
}

// The ScaleType naming T's storage.
template <class T>
constexpr ScaleType storage_type() {
  if constexpr (std::is_same_v<T, at::Half>) return ScaleType::kF16;
  if constexpr (std::is_same_v<T, at::BFloat16>) return ScaleType::kBF16;
  return ScaleType::kF32;
}

// W[k, n0:n1] for k in [k0, k1) (whole packs) into out (row stride ldo) as T
// (float, at::Half, at::BFloat16): the ISA's tile dequantizer takes the whole
// vectors of columns, dequant_row the rest (and every column when isa is
// kPortable, which it must be when w does not suit the SIMD kernels:
// simd_fused_supports). n0 is a multiple of 8.
template <int B, class T>
void dequant_rows(const GptqWeight& w, Isa isa, int64_t k0, int64_t k1, int64_t n0, int64_t n1, T* out,
                  int64_t ldo) {
  int64_t simd_n1 = n0;
#if LOWBIT_X86_SIMD
  if (isa != Isa::kPortable) {
    const int64_t step = isa == Isa::kAvx512 ? kAvx512DequantCols : kAvx2DequantCols;
    simd_n1 = n0 + (n1 - n0) / step * step;
#if LOWBIT_X86_AVX512
    if (simd_n1 > n0 && isa == Isa::kAvx512) gptq_dequant_avx512(B, w, k0, k1, n0, simd_n1, storage_type<T>(), out, ldo);
#endif
    if (simd_n1 > n0 && isa == Isa::kAvx2) gptq_dequant_avx2(B, w, k0, k1, n0, simd_n1, storage_type<T>(), out, ldo);
  }
#endif
  if (simd_n1 == n1) return;
  GroupRun<B> run(w, simd_n1, n1);
  std::vector<float> row(std::is_same_v<T, float> ? 0 : n1 - simd_n1);
  for (int64_t k = k0; k < k1; ++k) {
    T* dst = out + (k - k0) * ldo + (simd_n1 - n0);
    if constexpr (std::is_same_v<T, float>) {
      dequant_row<B>(w, k, run, simd_n1, n1, dst);
    } else {
      dequant_row<B>(w, k, run, simd_n1, n1, row.data());
      std::copy(row.begin(), row.end(), dst);
    }
  }
}

// f(r0, r1) over [k0, k1) in parallel on `team` (parallel.h), in runs of
// whole packs (k0 is a pack's first row) of about `rows_per_task` rows. The
// bf16 GEMM path decodes on torch's team because its GEMM runs on it:
// torch's threads keep spinning after each mm (OpenMP's default wait), so a
// decode on the pool between two mms would share its cores with them and
// take about twice as long.
template <int B, Team team = Team::kPool, class F>
void for_pack_rows(int64_t k0, int64_t k1, int64_t rows_per_task, F&& f) {
  constexpr int64_t kFields = gptq::Pack<B>::kFields;
  const int64_t grain = std::max<int64_t>(1, rows_per_task / kFields);
  const int64_t packs = (k1 - k0 + kFields - 1) / kFields;
  const auto packs_fn = [&](int64_t p0, int64_t p1) { f(k0 + p0 * kFields, std::min(k1, k0 + p1 * kFields)); };
  if constexpr (team == Team::kTorch) {
    at::parallel_for(0, packs, grain, packs_fn);
  } else {
    parallel_for(packs, grain, packs_fn);
  }
}

// out[M, N] = a[M, K] @ W by decoding W into fp32 for the fp32 GEMM, in
// column strips over all of K (about kTileBytes each) as pool tasks: each
// decodes its strip and multiplies it on its own thread (float_gemm.h).
template <int B>
void gemm_dequant_mm(const at::Tensor& a, const GptqWeight& w, Isa isa, const at::Tensor& out) {
  const int64_t K = w.K, N = w.N;
  const int64_t cols = std::max<int64_t>(kTileN, kTileBytes / (4 * K) / kTileN * kTileN);
  parallel_chunks(N, cols, [&](int64_t n0, int64_t n1) {
    at::Tensor tile = at::empty({K, n1 - n0}, a.options());
    dequant_rows<B>(w, isa, 0, K, n0, n1, tile.data_ptr<float>(), n1 - n0);
    float_mm_out(a, tile, out.narrow(1, n0, n1 - n0));
  });
}

// out[M, N] = a[M, K] @ W for bf16 activations a on AVX512-BF16 CPUs, whose
// bf16 GEMM (AMX or vdpbf16ps, fp32 accumulation) is several times faster
// than the fp32 one (where vdpbf16ps runs at the FMA's rate the fused
// kernel takes every M instead: simd_fused_max_m). W goes
// in column strips over all of K as two bf16 planes [hi; lo] [2K, width]
// against [a, a] [M, 2K]: one GEMM adds a @ hi + a @ lo in fp32 and rounds
// to bf16 once, as the fp32 path's output is rounded once, and hi + lo holds
// the fp32 weight to 16 significand bits, 2^-17 relative, far below that
// rounding (2^-9). A single bf16 plane would add an error of about half the
// output's ulp to every result. Needs the SIMD tile dequantizer (isa is
// kAvx512); columns past its last whole vector are split in scalar code.
template <int B>
void gemm_bf16x2_mm(const at::Tensor& a, const GptqWeight& w, const at::Tensor& out) {
  const int64_t K = w.K, N = w.N;
  const int64_t cols = std::min(N, std::max<int64_t>(kTileN, kBf16TileBytes / (4 * K) / kTileN * kTileN));
  const at::Tensor a2 = at::cat({a, a}, 1);
  at::Tensor tile_buf = at::empty({2 * K * cols}, a.options());
  const at::Tensor strip_out = at::empty({a.size(0), cols}, a.options());
  uint16_t* tile = reinterpret_cast<uint16_t*>(tile_buf.data_ptr<at::BFloat16>());
  for (int64_t n0 = 0; n0 < N; n0 += cols) {
    const int64_t width = std::min(cols, N - n0);
    const int64_t simd_n1 = n0 + width / kAvx512DequantCols * kAvx512DequantCols;
    uint16_t* hi = tile;
    uint16_t* lo = tile + K * width;
    for_pack_rows<B, Team::kTorch>(0, K, 4096 / width, [&](int64_t k0, int64_t k1) {
#if LOWBIT_X86_AVX512
      if (simd_n1 > n0) gptq_dequant_bf16x2_avx512bf16(B, w, k0, k1, n0, simd_n1, hi + k0 * width, lo + k0 * width, width);
#endif
      const int64_t rest = n0 + width - simd_n1;
      if (rest == 0) return;
      std::vector<float> rows((k1 - k0) * rest);
      dequant_rows<B>(w, Isa::kPortable, k0, k1, simd_n1, n0 + width, rows.data(), rest);
      for (int64_t k = k0; k < k1; ++k) {
        for (int64_t i = 0; i < rest; ++i) {
          const float x = rows[(k - k0) * rest + i];
          const c10::BFloat16 h(x);
          const int64_t at = k * width + (simd_n1 - n0) + i;
          hi[at] = h.x;
          lo[at] = c10::BFloat16(x - static_cast<float>(h)).x;
        }
      }
    });
    // Into a contiguous strip, then copied: oneDNN writing into out's
    // strided columns directly measured 2x slower at some widths (Xeon, AMX).
    at::Tensor o = width == cols ? strip_out : at::empty({a.size(0), width}, a.options());
    at::mm_out(o, a2, tile_buf.narrow(0, 0, 2 * K * width).view({2 * K, width}));
    out.narrow(1, n0, width).copy_(o);
  }
}

}  // namespace

at::Tensor gptq_gemm(const at::Tensor& a, const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                     const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_exllama,
                     bool use_v2_format, int64_t bit) {
  // Shuffled weights: b_g_idx is the permutation given to gptq_shuffle, and
  // shuffled row i belongs to group i / (K / groups). Unshuffled: b_g_idx is
  // the checkpoint's g_idx.
  const auto [d, idx] =
      check_gemm_args(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, bit, "gptq_gemm", true);
  at::Tensor a2 = a.reshape({-1, d.K}).to(at::kFloat);
  if (use_exllama && idx.numel()) a2 = a2.index_select(1, idx.to(at::kLong));
  a2 = a2.contiguous();
  const int64_t M = a2.size(0);

  at::Tensor out = at::empty({M, d.N}, a2.options());  // fp32, unless the bf16 GEMM path writes bf16
  if (M > 0) {
    const PreparedWeight w = prepare(b_q_weight, b_gptq_qzeros, b_gptq_scales,
                                     use_exllama ? at::Tensor() : idx, d, use_v2_format, bit);
    dispatch_bits(bit, [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      const Isa isa = simd_fused_supports<B>(w.view) ? active_isa() : Isa::kPortable;
      const bool half_input = a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf;
      const bool bf16_gemm = a.scalar_type() == at::kBFloat16 && isa == Isa::kAvx512 && has_avx512_bf16();
      const bool bf16_dot = half_input && isa == Isa::kAvx512 && use_bf16_kernel();
      if (M <= (isa != Isa::kPortable ? simd_fused_max_m(bf16_gemm, bf16_dot) : kFusedMaxM)) {
        at::Tensor planes;
        if (bf16_dot) planes = bf16_planes(a2, a.scalar_type());
        const Bf16Acts a16{planes.defined() ? reinterpret_cast<const uint16_t*>(planes.data_ptr<at::BFloat16>()) : nullptr,
                           M, planes.defined() ? static_cast<int>(planes.size(0)) : 0};
        gemm_fused<B>(a2.data_ptr<float>(), M, w.view, out.data_ptr<float>(), isa, a16.data ? &a16 : nullptr);
      } else if (bf16_gemm) {
        const TorchThreadsAtPool threads;
        out = at::empty({M, d.N}, a.options());
        gemm_bf16x2_mm<B>(a2.to(at::kBFloat16), w.view, out);
      } else {
        gemm_dequant_mm<B>(a2, w.view, isa, out);
      }
    });
  }
  return as_output(out, a, d.N);
}

at::Tensor gptq_dequantize(const at::Tensor& b_q_weight, const at::Tensor& b_gptq_qzeros,
                           const at::Tensor& b_gptq_scales, const at::Tensor& b_g_idx, bool use_v2_format,
                           int64_t bit) {
  const auto [d, idx] = check_dequantize_args(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, bit);
  const PreparedWeight w = prepare(b_q_weight, b_gptq_qzeros, b_gptq_scales, idx, d, use_v2_format, bit);

  at::Tensor out = at::empty({d.K, d.N}, b_gptq_scales.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, out.scalar_type(), "gptq_dequantize", [&] {
    scalar_t* dst = out.data_ptr<scalar_t>();
    dispatch_bits(bit, [&](auto bits) {
      constexpr int B = decltype(bits)::value;
      const Isa isa = simd_fused_supports<B>(w.view) ? active_isa() : Isa::kPortable;
      for_pack_rows<B>(0, d.K, std::max<int64_t>(1, 16384 / d.N), [&](int64_t k0, int64_t k1) {
        dequant_rows<B>(w.view, isa, k0, k1, 0, d.N, dst + k0 * d.N, d.N);
      });
    });
  });
  return out;
}

}  // namespace cpu
}  // namespace lowbit
