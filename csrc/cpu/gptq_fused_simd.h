// The fused dequantize + small-M GEMM of gptq_gemm, written once over a
// vector vocabulary V (VecAvx2, VecAvx512) and instantiated per ISA in its own
// translation unit. Include only inside that unit's target pragma region.
//
// Lanes are output columns. A pack of GPTQ words (kWords rows of qweight)
// holds kFields consecutive rows k for every column, so one vector load of
// each word row gives kFields rows x kLanes columns; every field is cut out
// with compile-time shifts (gptq::locate is constexpr) and multiplied by the
// broadcast activation a[m, k]. The kernel is bound by the instructions spent
// per weight, so the decode takes as few as the field width allows:
//  - a field of at most V::kLookupBits bits is one shift and one table lookup
//    (the lookup ignores the bits above the field: no mask, no convert);
//  - narrower fields (2-bit, and 3-bit on AVX-512) are not cut out at all:
//    each word is read in chunks of V::kLookupBits bits at fixed offsets,
//    whatever fields they cross, and a chunk indexes a per-row table of what
//    its bits add to the dot product (bit j of field k adds a[k] * 2^j), so
//    one shift and one lookup-add serve kLookupBits bits of weights, not B;
//  - 4-bit fields on AVX2 are masked where they lie, not shifted down: the
//    masked word is q * 2^shift, which converts to float exactly (it stays
//    below 2^31), and the activation is pre-scaled by 2^-shift once per call,
//    so the product is a[k] * q[k] all the same (exact unless |a| < 2^-102,
//    where the pre-scaled value is subnormal). A word's top field is shifted
//    down instead, which clears the rest. A mask, a convert and an FMA per
//    vector, against a shift, a mask, a subtraction, a convert and an FMA;
//  - 8-bit fields are cut out, converted and have the zero point subtracted
//    in integers: streamed from memory, as a model's are, they run slower
//    through the in-place loop than through this one.
// For lookup and in-place fields the zero point leaves the inner loop,
//     sum_k a[m, k] (q[k, n] - z[n]) = sum_k a[m, k] q[k, n] - z[n] sum_k a[m, k],
// which costs a few ulps of |a| @ |W| in cancellation (q, z < 16). The
// scale multiplies the group's
// fp32 partial sum once per group:
//     out[m, n] += s[g, n] * sum_{k in g} a[m, k] * (q[k, n] - z[g, n])
// which is the reference's sum of a * s * (q - z) regrouped, fp32 throughout.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "../core/gptq_format.h"
#include "gptq_kernels.h"
#include "gptq_fields_simd.h"
#include "gptq_group_simd.h"

namespace lowbit {
namespace cpu {
// Internal linkage: each ISA's unit compiles its own copy under its target
// pragma, and a shared (weak) symbol would let the linker run one unit's
// instructions on behalf of another.
namespace {

template <class V, int B>
struct FusedSimd {
  using F = typename V::F;
  using I = typename V::I;
  using P = gptq::Pack<B>;
  static constexpr int L = V::kLanes;
  static constexpr bool kLookup = B <= V::kLookupBits;
  static constexpr bool kInPlace = !kLookup && B == 4;
  static constexpr bool kFoldZero = kLookup || kInPlace;
  // Whether field FI is its word's top field, which a shift alone cuts out.
  static constexpr bool top_field(int FI) { return gptq::locate<B>(FI).lo_shift + B == 32; }
  // What kInPlace pre-scales field FI's activation by: 2^-shift of the
  // masked field (a power of two, so the scaling itself is exact).
  static constexpr float in_place_scale(int FI) {
    return top_field(FI) ? 1.0f : 1.0f / static_cast<float>(1u << gptq::locate<B>(FI).lo_shift);
  }
  static constexpr int kMaxRows = kFusedMaxRows;

  // The chunks of the chunk tables: C bits at offsets 0, C, 2C, ... of every
  // word (the last one shorter where C does not divide 32).
  static constexpr int C = V::kLookupBits;
  static constexpr int kChunksPerWord = (32 + C - 1) / C;
  static constexpr int kChunksPerPack = P::kWords * kChunksPerWord;
  // Whether MT rows take the chunk tables. Counted per word in instructions,
  // which bound the kernel: a shift, then MT lookups and MT adds per chunk,
  // against a shift and a lookup per field, then MT FMAs. The tables win for
  // 2-bit, and for 3-bit on AVX-512 up to 2 rows.
  template <int MT>
  static constexpr bool kChunks = kLookup && B < C && kChunksPerWord * (1 + 2 * MT) * B < 32 * (2 + MT);

  // What bits [j0, j0 + len) of a chunk's value hold: bits [pos, pos + len)
  // of field f of the pack.
  struct Segment {
    int f, j0, len, pos;
  };
  static constexpr int kMaxSegments = (C - 1) / B + 2;
  struct ChunkBits {
    int n;
    Segment seg[kMaxSegments];
  };
  // Chunk t of a pack, which starts at bit 32 w + first of the pack's stream
  // (the fields' little-endian bit stream, as gptq::locate reads it).
  static constexpr ChunkBits chunk_bits(int t) {
    ChunkBits c{};
    const int w = t / kChunksPerWord, first = t % kChunksPerWord * C;
    const int last = first + C < 32 ? first + C : 32;
    for (int b = first; b < last;) {
      const int bit = 32 * w + b, pos = bit % B;
      const int len = B - pos < last - b ? B - pos : last - b;
      c.seg[c.n++] = Segment{bit / B, b - first, len, pos};
      b += len;
    }
    return c;
  }

  // Vectors of columns per sub-tile for MT activation rows: enough independent
  // accumulator chains to hide the FMA latency, few enough to stay in
  // registers (V::kRegisters: 16 for AVX2, 32 for AVX-512).
  template <int MT>
  static constexpr int kU = V::kRegisters >= 32 ? (MT <= 2 ? 4 : 2) : (MT == 1 ? 4 : MT == 2 ? 2 : 1);

  // Whether a pack's words stay in registers for all its fields. GCC would
  // rather reload them as every shift's memory operand (a load per field);
  // an empty asm that claims to change each loaded word stops that where
  // the register file holds them beside the accumulators and temporaries.
  template <int MT>
  static constexpr bool kPinWords = P::kWords * kU<MT> + (MT + 2) * kU<MT> + 4 <= V::kRegisters;

  // What one group of one MT-row tile reads besides the weights.
  struct GroupInputs {
    const float* a;       // a[m0, g * group_size]; rows K apart
    int64_t K;
    const float* tables;  // kChunks<MT>: [MT][tables_per_row][L] chunk tables, else null
    int64_t tables_per_row;
    float a_sum[kMaxRows];  // kFoldZero: sum of the group's (unscaled) activations per row
  };

  // Field FI of the pack in `words`, for U column vectors, into acc.
  template <int MT, int U, int FI>
  static inline void field(const I (&words)[P::kWords][U], const I (&zero)[U], F levels, const float* a, int64_t K,
                           F (&acc)[MT][U]) {
    constexpr bool kUnmasked = kLookup && gptq::locate<B>(FI).hi_mask == 0;
    F q[U];
    for (int u = 0; u < U; ++u) {
      const auto word = [&](int64_t i) { return words[i][u]; };
      if constexpr (kUnmasked) {
        q[u] = V::lookup(levels, pack_field<V, B, FI, false>(word));
      } else if constexpr (kInPlace && top_field(FI)) {
        constexpr gptq::FieldLoc f = gptq::locate<B>(FI);
        q[u] = V::cvt(V::template srl<f.lo_shift>(word(f.lo)));
      } else if constexpr (kInPlace) {
        constexpr gptq::FieldLoc f = gptq::locate<B>(FI);
        q[u] = V::cvt(V::and_(word(f.lo), V::set1_i(static_cast<int32_t>(P::kMask << f.lo_shift))));
      } else {
        I v = pack_field<V, B, FI, true>(word);
        if constexpr (!kFoldZero) v = V::sub(v, zero[u]);
        q[u] = V::cvt(v);
      }
    }
    for (int m = 0; m < MT; ++m) {
      const F x = V::set1(a[m * K + FI]);
      for (int u = 0; u < U; ++u) acc[m][u] = V::fma(x, q[u], acc[m][u]);
    }
  }

  // Chunk T of the pack (kChunks<MT>), through the tables of pack p.
  template <int MT, int U, int T>
  static inline void chunk(const I (&words)[P::kWords][U], const GroupInputs& in, int64_t p, F (&acc)[MT][U]) {
    constexpr int kShift = T % kChunksPerWord * C;
    I index[U];
    for (int u = 0; u < U; ++u) {
      index[u] = words[T / kChunksPerWord][u];
      if constexpr (kShift != 0) index[u] = V::template srl<kShift>(index[u]);
    }
    for (int m = 0; m < MT; ++m) {
      const F table = V::load(in.tables + (m * in.tables_per_row + p * kChunksPerPack + T) * L);
      for (int u = 0; u < U; ++u) {
        acc[m][u] = V::add(acc[m][u], V::lookup(table, index[u]));
        // GCC would otherwise hoist a whole pack's lookups ahead of the adds
        // (up to 96 vectors) and spill them to the stack: 25% slower.
        asm("" : "+v"(acc[m][u]));
      }
    }
  }

  template <int MT, int U, int... FI>
  static inline void fields(std::integer_sequence<int, FI...>, const I (&words)[P::kWords][U], const I (&zero)[U],
                            F levels, const float* a, int64_t K, F (&acc)[MT][U]) {
    (field<MT, U, FI>(words, zero, levels, a, K, acc), ...);
  }
  template <int MT, int U, int... T>
  static inline void chunks(std::integer_sequence<int, T...>, const I (&words)[P::kWords][U], const GroupInputs& in,
                            int64_t p, F (&acc)[MT][U]) {
    (chunk<MT, U, T>(words, in, p, acc), ...);
  }

  // The float value of every index a lookup can see: index & kMask.
  static F levels() { return V::cvt(V::and_(V::iota(), V::set1_i(static_cast<int32_t>(P::kMask)))); }

  // One group (packs packs from word row q, rows `stride` words apart) of MT
  // rows x U*L columns, added to out (rows N apart) as s * partial sum; the
  // same columns `ahead` words on (the next group's rows) are prefetched.
  // Never inlined: where GCC inlined it (3-bit, 3 rows) its register
  // allocation in the larger caller was 10% slower.
  template <int MT>
  __attribute__((noinline)) static void group_tile(const GroupInputs& in, const uint32_t* q, int64_t stride,
                                                   int64_t N, int64_t packs, int64_t ahead, const int32_t* z,
                                                   const float* s, float* out) {
    constexpr int U = kU<MT>;
    F acc[MT][U];
    I zero[U];
    for (int u = 0; u < U; ++u) zero[u] = V::load_i(z + u * L);
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = V::zero();
    const F lv = levels();
    for (int64_t p = 0; p < packs; ++p) {
      I words[P::kWords][U];
      for (int w = 0; w < P::kWords; ++w)
        for (int u = 0; u < U; ++u) {
          const uint32_t* row = q + (p * P::kWords + w) * stride + u * L;
          __builtin_prefetch(row + ahead, 0, 2);  // read, locality 2: prefetcht1, into L2
          words[w][u] = V::load_i(row);
          if constexpr (kPinWords<MT>) asm("" : "+v"(words[w][u]));
        }
      if constexpr (kChunks<MT>) {
        chunks<MT, U>(std::make_integer_sequence<int, kChunksPerPack>{}, words, in, p, acc);
      } else {
        fields<MT, U>(std::make_integer_sequence<int, P::kFields>{}, words, zero, lv, in.a + p * P::kFields, in.K,
                      acc);
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int u = 0; u < U; ++u) {
        F sum = acc[m][u];
        if constexpr (kFoldZero) sum = V::fnma(V::cvt(zero[u]), V::set1(in.a_sum[m]), sum);
        float* o = out + m * N + u * L;
        V::store(o, V::fma(V::load(s + u * L), sum, V::load(o)));
      }
  }

  // The chunk tables' scratch, per call: map[t] is chunk t's bits (worked
  // out once here, not for every table); levels[(t * kMaxSegments + i) * L + j]
  // is what segment i of chunk t contributes to entry j of a table, per unit
  // of its field's activation; tables holds up to kMaxRows rows of one
  // group's tables.
  struct Scratch {
    ChunkBits map[kChunksPerPack];
    std::vector<float> levels, tables;
    explicit Scratch(int64_t packs_per_group) {
      if (!kChunks<1>) return;
      levels.assign(kChunksPerPack * kMaxSegments * L, 0.0f);
      for (int t = 0; t < kChunksPerPack; ++t) {
        const ChunkBits& c = map[t] = chunk_bits(t);
        for (int i = 0; i < c.n; ++i)
          for (int j = 0; j < L; ++j) {
            const int bits = (j >> c.seg[i].j0) & ((1 << c.seg[i].len) - 1);
            levels[(t * kMaxSegments + i) * L + j] = static_cast<float>(bits << c.seg[i].pos);
          }
      }
      tables.resize(kMaxRows * packs_per_group * kChunksPerPack * L);
    }
  };

  // Rows m0 .. m0+MT of out[:, n0:n1], one group g, whose zero points and
  // scales for those columns are z and s. a_fields is what the fields
  // multiply: a itself, or a pre-scaled for kInPlace. The chunk tables
  // (kChunks<MT>) are built once here for every column tile.
  template <int MT>
  static void group_rows(const float* a, const float* a_fields, const GptqWeight& w, int64_t g, int64_t m0,
                         int64_t n0, int64_t n1, const int32_t* z, const float* s, Scratch& scratch, float* out) {
    const int64_t gs = w.group_of.group_size;
    const int64_t rows = std::min(gs, w.K - g * gs);  // the last group may be short
    const int64_t packs = rows / P::kFields;
    const int64_t first = m0 * w.K + g * gs;
    GroupInputs in{a_fields + first, w.K, nullptr, packs * kChunksPerPack, {}};
    if constexpr (kFoldZero) {
      for (int m = 0; m < MT; ++m) {
        float sum = 0.0f;
        for (int64_t k = 0; k < rows; ++k) sum += a[first + m * w.K + k];
        in.a_sum[m] = sum;
      }
    }
    if constexpr (kChunks<MT>) {
      float* table = scratch.tables.data();
      for (int m = 0; m < MT; ++m)
        for (int64_t p = 0; p < packs; ++p) {
          const float* x = in.a + m * w.K + p * P::kFields;
          for (int t = 0; t < kChunksPerPack; ++t, table += L) {
            const ChunkBits& c = scratch.map[t];
            F sum = V::zero();
            for (int i = 0; i < c.n; ++i)
              sum = V::fma(V::set1(x[c.seg[i].f]), V::load(&scratch.levels[(t * kMaxSegments + i) * L]), sum);
            V::store(table, sum);
          }
        }
      in.tables = scratch.tables.data();
    }
    // In the checkpoint's layout a task's columns of a group's rows are short
    // runs N * 4 bytes apart, too many streams for the hardware prefetcher:
    // each tile prefetches its columns of the next group's rows, read after
    // the rest of this group's (in the panel layout, the words that follow).
    // A tile's U * L columns divide a panel's, so no tile crosses one.
    const int64_t group_rows = gs / P::kFields * P::kWords, stride = w.row_stride();
    for (int64_t n = n0; n < n1; n += kU<MT> * L) {
      group_tile<MT>(in, w.words(g * group_rows, n), stride, w.N, packs, group_rows * stride, z + (n - n0),
                     s + (n - n0), out + m0 * w.N + n);
    }
  }

  static void run(const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
    Scratch scratch(std::min(w.group_of.group_size, w.K) / P::kFields);
    std::vector<float> scaled;
    if constexpr (kInPlace) {
      float scale[P::kFields];
      for (int f = 0; f < P::kFields; ++f) scale[f] = in_place_scale(f);
      scaled.resize(M * w.K);
      for (int64_t i = 0; i < M * w.K; ++i) scaled[i] = a[i] * scale[i % w.K % P::kFields];
    }
    const float* a_fields = kInPlace ? scaled.data() : a;
    for_group_row_tiles<B>(w, M, n0, n1, out, [&](auto mt, int64_t g, int64_t m0, const int32_t* z, const float* s) {
      group_rows<decltype(mt)::value>(a, a_fields, w, g, m0, n0, n1, z, s, scratch, out);
    });
  }
};

// Runs the kernel of bit width `bits` (already validated).
template <class V>
void run_fused_simd(int bits, const float* a, int64_t M, const GptqWeight& w, int64_t n0, int64_t n1, float* out) {
  switch (bits) {
    case 2: return FusedSimd<V, 2>::run(a, M, w, n0, n1, out);
    case 3: return FusedSimd<V, 3>::run(a, M, w, n0, n1, out);
    case 4: return FusedSimd<V, 4>::run(a, M, w, n0, n1, out);
    case 8: return FusedSimd<V, 8>::run(a, M, w, n0, n1, out);
  }
}

}  // namespace
}  // namespace cpu
}  // namespace lowbit
