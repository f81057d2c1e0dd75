// CPU kernels that move GPTQ fields between words: pack, unpack, zero points
// and gptq_shuffle's row permutation. All field arithmetic comes from
// core/gptq_format.h.

#include <algorithm>
#include <tuple>
#include <utility>

#include "../core/gptq_format.h"
#include "../ops/backend_ops.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "parallel.h"

namespace lowbit {
namespace cpu {
namespace {

using gptq::PackedAxis;

// Work per parallel task: aim for about 16k fields so threads are worth it.
int64_t grain_for(int64_t fields_per_task) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, fields_per_task)); }

// Runs body(o, p) for every (outer index, pack index) in parallel; packs of
// one stream never share words, so tasks write disjoint words.
template <int B, typename Body>
void for_each_pack(const PackedAxis& ax, Body body) {
  const int64_t packs = ax.length / gptq::Pack<B>::kFields;
  parallel_for(ax.outer * packs, grain_for(gptq::Pack<B>::kFields * ax.inner), [&](int64_t b, int64_t e) {
    int64_t o = b / packs, p = b % packs;  // then stepped: no division per pack
    for (int64_t t = b; t < e; ++t) {
      body(o, p);
      if (++p == packs) p = 0, ++o;
    }
  });
}

// Runs body(inner) with the stride between a field's consecutive values: a
// compile-time 1 for streams packed along dim 1 (qzeros), so that the field
// loops below collapse into straight-line code, else ax.inner.
template <typename Body>
inline void with_inner(const PackedAxis& ax, Body body) {
  if (ax.inner == 1) {
    body(std::integral_constant<int64_t, 1>{});
  } else {
    body(ax.inner);
  }
}

// Runs move(field offset, word offset, stride) for every pack of every
// stream (gptq::pack_one or unpack_one at those offsets).
template <int B, typename Move>
void for_each_stream_pack(const PackedAxis& ax, Move move) {
  with_inner(ax, [&](auto inner) {
    for_each_pack<B>(ax, [&](int64_t o, int64_t p) {
      const int64_t f = gptq::pack_fields_at<B>(ax, o, p), w = gptq::pack_words_at<B>(ax, o, p);
      for (int64_t c = 0; c < inner; ++c) move(f + c, w + c, inner);
    });
  });
}

// dst row k = src row perm[k], for a weight packed along K (rows) with N
// columns. A task builds one pack's words for a tile of columns, one field at
// a time: a field's place in its source and destination words is the same in
// every column, so the column loop is plain shifts and masks (vectorized),
// not a field location worked out per word. Tasks run down a column tile
// before the next one: each source word serves kFields packs, and a tile's
// words stay in cache between them.
template <int B>
void permute_rows_impl(const uint32_t* src, uint32_t* dst, const int32_t* perm, int64_t K, int64_t N) {
  using P = gptq::Pack<B>;
  constexpr int64_t kTile = 256;
  const int64_t packs = K / P::kFields, tiles = (N + kTile - 1) / kTile;
  parallel_for(packs * tiles, grain_for(P::kFields * kTile), [&](int64_t b, int64_t e) {
    uint32_t words[P::kWords][kTile];
    for (int64_t task = b; task < e; ++task) {
      const int64_t p = task % packs, n0 = task / packs * kTile, n = std::min(kTile, N - n0);
      for (auto& row : words) std::fill(row, row + n, 0u);
      for (int j = 0; j < P::kFields; ++j) {
        const gptq::FieldLoc s = gptq::locate<B>(perm[p * P::kFields + j]), d = gptq::locate<B>(j);
        const uint32_t* lo = src + s.lo * N + n0;
        const uint32_t* hi = src + s.hi * N + n0;
        uint32_t* out = words[d.lo];
        if (s.hi_mask == 0 && d.hi_mask == 0) {  // neither field straddles two words
          for (int64_t c = 0; c < n; ++c) out[c] |= ((lo[c] >> s.lo_shift) & s.lo_mask) << d.lo_shift;
        } else {
          uint32_t* out_hi = words[d.hi];
          for (int64_t c = 0; c < n; ++c) gptq::insert(out[c], out_hi[c], d, gptq::extract(lo[c], hi[c], s));
        }
      }
      for (int v = 0; v < P::kWords; ++v) std::copy(words[v], words[v] + n, dst + (p * P::kWords + v) * N + n0);
    }
  });
}

const uint32_t* words_of(const at::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>()); }
uint32_t* words_of(at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()); }

}  // namespace

namespace {

// The fields of a validated 2-D tensor packed into words along `dim`
// (`pack`), or the words unpacked into fields.
at::Tensor convert_words(const at::Tensor& input, int64_t bit, int64_t dim, bool pack) {
  const at::Tensor in = input.contiguous();
  at::Tensor out = at::empty(converted_sizes(in, bit, dim, pack), in.options());
  const at::Tensor& fields = pack ? in : out;
  const PackedAxis ax = gptq::packed_axis(fields.size(0), fields.size(1), dim);
  int32_t* f = fields.data_ptr<int32_t>();
  uint32_t* w = reinterpret_cast<uint32_t*>((pack ? out : in).data_ptr<int32_t>());
  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (pack)
      for_each_stream_pack<B>(ax, [&](int64_t fo, int64_t wo, auto inner) { gptq::pack_one<B>(f + fo, w + wo, inner); });
    else
      for_each_stream_pack<B>(ax, [&](int64_t fo, int64_t wo, auto inner) { gptq::unpack_one<B>(w + wo, f + fo, inner); });
  });
  return out;
}

}  // namespace

at::Tensor gptq_pack(const at::Tensor& values, int64_t bit, int64_t dim) {
  check_pack_values(values, bit, dim);
  return convert_words(values, bit, dim, true);
}

at::Tensor gptq_unpack(const at::Tensor& packed, int64_t bit, int64_t dim) {
  check_unpack_words(packed, bit, dim);
  return convert_words(packed, bit, dim, false);
}

namespace {

// A copy of qweight (packed along K) with row k taken from row perm[k].
at::Tensor permute_rows(const at::Tensor& qweight, const at::Tensor& perm32, int64_t K, int64_t bit) {
  at::Tensor out = at::empty_like(qweight);
  dispatch_bits(bit, [&](auto bits) {
    permute_rows_impl<decltype(bits)::value>(words_of(qweight), words_of(out), perm32.data_ptr<int32_t>(), K,
                                             qweight.size(1));
  });
  return out;
}

}  // namespace

void gptq_shuffle(const at::Tensor& q_weight, const at::Tensor& q_perm, int64_t bit) {
  const auto [K, perm] = check_row_permutation("gptq_shuffle", "q_weight", q_weight, "q_perm", q_perm, bit, true);
  // lowbit's fast layout is the GPTQ packing with rows in q_perm order, so
  // without a permutation there is nothing to rewrite.
  if (perm.numel() == 0) return;
  q_weight.copy_(permute_rows(q_weight, perm, K, bit));
}

at::Tensor gptq_permute_rows(const at::Tensor& qweight, const at::Tensor& perm, int64_t bit) {
  const auto [K, p] = check_row_permutation("gptq_permute_rows", "qweight", qweight, "perm", perm, bit, false);
  return permute_rows(qweight, p, K, bit);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gptq_permute_cols(const at::Tensor& qweight, const at::Tensor& qzeros,
                                                                 const at::Tensor& scales, const at::Tensor& perm,
                                                                 int64_t bit) {
  const auto [d, p] = check_column_permutation("gptq_permute_cols", qweight, qzeros, scales, perm, bit);
  const at::Tensor index = p.to(at::kLong);
  // qweight and scales hold one column per output feature; zero points are
  // packed along N, so they move as unpacked fields.
  at::Tensor zeros = gptq_unpack(qzeros, bit, 1).index_select(1, index);
  return {qweight.index_select(1, index), gptq_pack(zeros, bit, 1), scales.index_select(1, index)};
}

}  // namespace cpu
}  // namespace lowbit
