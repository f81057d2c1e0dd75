// gptq_gemm_a8's kernel for 2-, 4- and 8-bit weights, written once over an
// integer-dot vocabulary D (A8Avx512: VNNI vpdpbusd; A8Avx2: vpmaddubsw and
// vpmaddwd) and instantiated per ISA in its own translation unit. Include
// only inside that unit's target pragma region, after every non-SIMD header.
//
// Lanes are output columns, as in the fp32 kernel (gptq_fused_simd.h), but
// the weights never become floats: a 32-bit lane of a packed word holds
// 32/B fields of one column, and shifting it right by j*B bits and masking
// B bits of every byte leaves fields j, S+j, 2S+j, 3S+j (S = 8/B) as four
// unsigned bytes. D::dot multiplies them by four int8 activations, the dword
// of the pack that a8_byte<B> laid out for shift j, and adds the four
// products to the lane's int32 sum: one vpdpbusd per 4 weights per column,
// against a shift, a lookup and an FMA per weight in fp32. Per group and
// column the sum is exact; the zero point leaves it through the group's
// activation sum, and the two scales multiply it once:
//     out[m, n] = fma(s[g, n] * d[m, g], float(sum_k q_a q_w - z sum_k q_a), out[m, n])
// group by group, the portable kernel's order, so both give the same bits.
#pragma once

#include <stdint.h>

#include <algorithm>

#include "gptq_kernels.h"
#include "row_tiles.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy (gptq_fused_simd.h).
namespace {

template <class D, int B>
struct A8Simd {
  static_assert(B == 2 || B == 4 || B == 8, "3-bit fields straddle words: the portable kernel reads them");
  using I = typename D::I;
  using F = typename D::F;
  static constexpr int F_ = 32 / B;  // fields per word
  static constexpr int S = 8 / B;    // shifts per word, each giving 4 fields per lane
  static constexpr int L = D::kLanes;
  static constexpr uint32_t kByteMask = ((1u << B) - 1u) * 0x01010101u;
  // Column vectors per tile for MT activation rows: as many accumulator
  // chains as the register file holds beside the words and fields.
  template <int MT>
  static constexpr int kU = D::kRegisters >= 32 ? 4 : (MT == 1 ? 4 : MT == 2 ? 2 : 1);

  // One group (packs words from word row q, rows q_stride apart) of MT
  // activation rows x U*L columns from column n, added to the fp32 sums
  // `out`. x: row m0's dwords at the group's first pack, rows x_stride
  // dwords apart. The group's zeros and scales of those columns are
  // converted from `params` in registers (a buffer of a task's columns,
  // filled per group, cost a streamed matvec about a seventh of its time).
  template <int MT>
  __attribute__((always_inline)) static void add_group(const int32_t* x, int64_t x_stride, const uint32_t* q,
                                                       int64_t q_stride, int64_t packs, int64_t ahead,
                                                       const GroupRow& params, int64_t n, const float* d,
                                                       const int32_t* a_sum, F (&out)[MT][kU<MT>]) {
    constexpr int U = kU<MT>;
    I acc[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = D::zero();
    const I mask = D::set1(static_cast<int32_t>(kByteMask));
    for (int64_t p = 0; p < packs; ++p) {
      I words[U];
      for (int u = 0; u < U; ++u) {
        const uint32_t* row = q + p * q_stride + u * L;
        __builtin_prefetch(row + ahead, 0, 2);  // the rows `ahead` words on, into L2
        words[u] = D::load(row);
      }
      for (int j = 0; j < S; ++j) {
        I fields[U];
        for (int u = 0; u < U; ++u) {
          fields[u] = D::template srl<B>(words[u], j);
          if constexpr (B < 8) fields[u] = D::and_(fields[u], mask);
        }
        for (int m = 0; m < MT; ++m) {
          const I a = D::set1(x[m * x_stride + p * S + j]);
          for (int u = 0; u < U; ++u) acc[m][u] = D::template dot<B>(acc[m][u], fields[u], a);
        }
      }
    }
    // The stored zero plus the format's addend; D::dot<B> may sum
    // q_w - kOffset<B> (a signed byte) in place of q_w.
    const I offset = D::set1(D::template kOffset<B> - params.zero_offset);
    I zero[U];
    F scale[U];
    for (int u = 0; u < U; ++u) {
      zero[u] = D::sub(D::template fields<B>(params.zeros, n + u * L), offset);
      scale[u] = D::scales(params.scales, params.type, n + u * L);
    }
    for (int m = 0; m < MT; ++m) {
      const F dm = D::set1_ps(d[m]);
      const I sum_m = D::set1(a_sum[m]);
      for (int u = 0; u < U; ++u) {
        const I r = D::sub(acc[m][u], D::mullo(zero[u], sum_m));
        out[m][u] = D::fma(D::mul(scale[u], dm), D::cvt(r), out[m][u]);
      }
    }
  }

  // add_group on sums kept in out (MT rows N apart): the checkpoint's
  // layout, read one group at a time across a task's columns.
  template <int MT>
  __attribute__((noinline)) static void group_tile(const int32_t* x, int64_t x_stride, const uint32_t* q,
                                                   int64_t q_stride, int64_t N, int64_t packs, int64_t ahead,
                                                   const GroupRow& params, int64_t n, const float* d,
                                                   const int32_t* a_sum, float* out) {
    F sums[MT][kU<MT>];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < kU<MT>; ++u) sums[m][u] = D::load_ps(out + m * N + u * L);
    add_group<MT>(x, x_stride, q, q_stride, packs, ahead, params, n, d, a_sum, sums);
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < kU<MT>; ++u) D::store_ps(out + m * N + u * L, sums[m][u]);
  }

  // Every group of one panel's U*L columns from n against MT activation
  // rows from m0, the fp32 sums held in registers from the first group to
  // the last (group_tile's order of operations, so the same bits): the
  // panel is read as one stream, with no loads and stores of the output
  // between its groups. A group's zeros and scales lie rows of N columns
  // apart, a stride the hardware prefetcher does not follow: they are
  // fetched two groups ahead, as the weights are.
  template <int MT>
  __attribute__((noinline)) static void panel_tile(const GptqActs8& x, int64_t m0, const GptqWeight& w, int64_t n,
                                                   float* out) {
    constexpr int U = kU<MT>;
    const int64_t gs = w.group_of.group_size;
    const int64_t ahead = 2 * (gs / F_) * w.row_stride();
    const int64_t scale_bytes = w.params.scale_type == ScaleType::kF32 ? 4 : 2;
    F sums[MT][U];
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) sums[m][u] = D::set1_ps(0.0f);
    for (int64_t g = 0; g < x.groups; ++g) {
      if (g + 2 < x.groups) {
        const GroupRow next = group_row<B>(w, g + 2);
        __builtin_prefetch(reinterpret_cast<const char*>(next.zeros) + n * B / 8, 0, 3);
        for (int64_t b = 0; b < U * L * scale_bytes; b += 64)
          __builtin_prefetch(static_cast<const char*>(next.scales) + n * scale_bytes + b, 0, 3);
      }
      float d[MT];
      int32_t a_sum[MT];
      for (int m = 0; m < MT; ++m) {
        d[m] = x.scale[(m0 + m) * x.groups + g];
        a_sum[m] = x.sum[(m0 + m) * x.groups + g];
      }
      const int64_t packs = std::min(gs, w.K - g * gs) / F_;  // the last group may be short
      add_group<MT>(reinterpret_cast<const int32_t*>(x.q + m0 * w.K + g * gs), w.K / 4, w.words(g * gs / F_, n),
                    w.row_stride(), packs, ahead, group_row<B>(w, g), n, d, a_sum, sums);
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) D::store_ps(out + (m0 + m) * w.N + n + u * L, sums[m][u]);
  }

  static void run(const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    // In the panel layout a panel's rows are one contiguous stream, which
    // panel_tile reads start to end, one panel after another. The
    // checkpoint's layout is read group by group across the task's columns
    // (each group's rows prefetched while the group before it runs).
    if (w.panel) {
      for_row_tiles(M, [&](auto mt, int64_t m0) {
        constexpr int MT = decltype(mt)::value;
        for (int64_t n = n0; n < n1; n += kU<MT> * L) panel_tile<MT>(x, m0, w, n, out);
      });
      return;
    }
    const int64_t gs = w.group_of.group_size;
    const int64_t ahead = gs / F_ * w.row_stride();
    for (int64_t m = 0; m < M; ++m) std::fill(out + m * w.N + n0, out + m * w.N + n1, 0.0f);
    for (int64_t g = 0; g < x.groups; ++g) {
      const GroupRow params = group_row<B>(w, g);
      for_row_tiles(M, [&](auto mt, int64_t m0) {
        constexpr int MT = decltype(mt)::value;
        const int64_t packs = std::min(gs, w.K - g * gs) / F_;  // the last group may be short
        float d[MT];
        int32_t a_sum[MT];
        for (int m = 0; m < MT; ++m) {
          d[m] = x.scale[(m0 + m) * x.groups + g];
          a_sum[m] = x.sum[(m0 + m) * x.groups + g];
        }
        const int32_t* xg = reinterpret_cast<const int32_t*>(x.q + m0 * w.K + g * gs);
        for (int64_t n = n0; n < n1; n += kU<MT> * L) {
          group_tile<MT>(xg, w.K / 4, w.words(g * gs / F_, n), w.row_stride(), w.N, packs, ahead, params, n, d, a_sum,
                         out + m0 * w.N + n);
        }
      });
    }
  }
};

template <class D>
void run_a8_simd(int bits, const GptqActs8& x, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  switch (bits) {
    case 2: return A8Simd<D, 2>::run(x, M, w, n0, n1, out);
    case 4: return A8Simd<D, 4>::run(x, M, w, n0, n1, out);
    case 8: return A8Simd<D, 8>::run(x, M, w, n0, n1, out);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
