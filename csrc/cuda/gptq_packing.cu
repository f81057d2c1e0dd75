// CUDA kernels that move GPTQ fields between words: gptq_pack, gptq_unpack,
// gptq_shuffle / gptq_permute_rows (a row gather along K) and
// gptq_permute_cols. All field arithmetic comes from core/gptq_format.h.
//
// Each thread owns one pack of one stream (kFields fields in kWords words),
// so it assembles its words in registers and writes them whole: no thread
// shares an output word, no atomics, and no zero-filled output is needed.
// These are offline ops (checkpoint preparation), so validation may read
// index and value ranges back from the device (gptq_prepare.h).
#include "../core/gptq_format.h"
#include "../dispatch_bits.h"
#include "../gptq_prepare.h"
#include "common.cuh"
#include "gptq_cuda.cuh"
#include "ops_cuda.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// A 2-D tensor seen as [outer, length, inner] and packed along `length`:
// dim 0 is [1, rows, cols], dim 1 is [rows, cols, 1]. Consecutive threads
// take consecutive `inner` positions, so dim-0 packing is coalesced.
struct PackedAxis {
  int64_t outer;
  int64_t length;  // fields along the packed axis
  int64_t inner;
};

PackedAxis packed_axis(at::IntArrayRef value_sizes, int64_t dim) {
  return dim == 0 ? PackedAxis{1, value_sizes[0], value_sizes[1]} : PackedAxis{value_sizes[0], value_sizes[1], 1};
}

template <int B>
__global__ void __launch_bounds__(kThreads) pack_kernel(const int32_t* values, uint32_t* words, PackedAxis ax) {
  using P = gptq::Pack<B>;
  const int64_t packs = ax.length / P::kFields;
  const int64_t word_len = packs * P::kWords;
  const int64_t total = ax.outer * packs * ax.inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const int64_t c = t % ax.inner, p = (t / ax.inner) % packs, o = t / (ax.inner * packs);
    const int32_t* src = values + (o * ax.length + p * P::kFields) * ax.inner + c;
    uint32_t out[P::kWords] = {};
#pragma unroll
    for (int j = 0; j < P::kFields; ++j) {
      const gptq::FieldLoc f = gptq::locate<B>(j);
      gptq::insert(out[f.lo], out[f.hi], f, static_cast<uint32_t>(src[j * ax.inner]));
    }
    uint32_t* dst = words + (o * word_len + p * P::kWords) * ax.inner + c;
#pragma unroll
    for (int v = 0; v < P::kWords; ++v) dst[v * ax.inner] = out[v];
  }
}

template <int B>
__global__ void __launch_bounds__(kThreads) unpack_kernel(const uint32_t* words, int32_t* values, PackedAxis ax) {
  using P = gptq::Pack<B>;
  const int64_t packs = ax.length / P::kFields;
  const int64_t word_len = packs * P::kWords;
  const int64_t total = ax.outer * packs * ax.inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const int64_t c = t % ax.inner, p = (t / ax.inner) % packs, o = t / (ax.inner * packs);
    const uint32_t* src = words + (o * word_len + p * P::kWords) * ax.inner + c;
    uint32_t in[P::kWords];
#pragma unroll
    for (int v = 0; v < P::kWords; ++v) in[v] = src[v * ax.inner];
    int32_t* dst = values + (o * ax.length + p * P::kFields) * ax.inner + c;
#pragma unroll
    for (int j = 0; j < P::kFields; ++j) {
      const gptq::FieldLoc f = gptq::locate<B>(j);
      dst[j * ax.inner] = static_cast<int32_t>(gptq::extract(in[f.lo], in[f.hi], f));
    }
  }
}

// dst row k = src row perm[k] for a weight packed along K with N columns:
// one thread per (destination pack, column) gathers its kFields source fields
// (each located at run time) and writes its kWords words.
template <int B>
__global__ void __launch_bounds__(kThreads)
    permute_rows_kernel(const uint32_t* src, uint32_t* dst, const int32_t* perm, int64_t K, int64_t N) {
  using P = gptq::Pack<B>;
  const int64_t packs = K / P::kFields;
  const int64_t total = packs * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const int64_t n = t % N, p = t / N;
    uint32_t out[P::kWords] = {};
#pragma unroll
    for (int j = 0; j < P::kFields; ++j) {
      const int64_t from = perm[p * P::kFields + j];
      CUDA_KERNEL_ASSERT(from >= 0 && from < K && "gptq: permutation value out of range");
      const gptq::FieldLoc s = gptq::locate<B>(from);
      const gptq::FieldLoc d = gptq::locate<B>(j);
      gptq::insert(out[d.lo], out[d.hi], d, gptq::extract(src[s.lo * N + n], src[s.hi * N + n], s));
    }
#pragma unroll
    for (int v = 0; v < P::kWords; ++v) dst[(p * P::kWords + v) * N + n] = out[v];
  }
}

const uint32_t* words_of(const at::Tensor& t) { return reinterpret_cast<const uint32_t*>(t.data_ptr<int32_t>()); }
uint32_t* words_of(at::Tensor& t) { return reinterpret_cast<uint32_t*>(t.data_ptr<int32_t>()); }

// A copy of qweight (packed along K, contiguous) with row k taken from row perm32[k].
at::Tensor permute_rows(const at::Tensor& qweight, const at::Tensor& perm32, int64_t K, int64_t bit) {
  at::Tensor out = at::empty_like(qweight);
  const int64_t N = qweight.size(1);
  if (out.numel() == 0) return out;
  const unsigned int blocks = grid_for(K / gptq::fields_per_pack(bit) * N, kThreads);
  dispatch_bits(bit, [&](auto bits) {
    permute_rows_kernel<decltype(bits)::value><<<blocks, kThreads, 0, current_stream()>>>(
        words_of(qweight), words_of(out), perm32.data_ptr<int32_t>(), K, N);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

at::Tensor pack_words(const at::Tensor& values, int64_t bit, int64_t dim) {
  const at::Tensor v = values.contiguous();
  std::vector<int64_t> out_sizes = v.sizes().vec();
  out_sizes[dim] = v.size(dim) / gptq::fields_per_pack(bit) * gptq::words_per_pack(bit);
  at::Tensor out = at::empty(out_sizes, v.options());
  if (out.numel() == 0) return out;
  const PackedAxis ax = packed_axis(v.sizes(), dim);
  const unsigned int blocks = grid_for(ax.outer * (ax.length / gptq::fields_per_pack(bit)) * ax.inner, kThreads);
  dispatch_bits(bit, [&](auto bits) {
    pack_kernel<decltype(bits)::value><<<blocks, kThreads, 0, current_stream()>>>(v.data_ptr<int32_t>(),
                                                                                 words_of(out), ax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor unpack_words(const at::Tensor& packed, int64_t bit, int64_t dim) {
  const at::Tensor w = packed.contiguous();
  std::vector<int64_t> out_sizes = w.sizes().vec();
  out_sizes[dim] = w.size(dim) / gptq::words_per_pack(bit) * gptq::fields_per_pack(bit);
  at::Tensor out = at::empty(out_sizes, w.options());
  if (out.numel() == 0) return out;
  const PackedAxis ax = packed_axis(out.sizes(), dim);
  const unsigned int blocks = grid_for(ax.outer * (ax.length / gptq::fields_per_pack(bit)) * ax.inner, kThreads);
  dispatch_bits(bit, [&](auto bits) {
    unpack_kernel<decltype(bits)::value><<<blocks, kThreads, 0, current_stream()>>>(words_of(w),
                                                                                   out.data_ptr<int32_t>(), ax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

at::Tensor gptq_pack(const at::Tensor& values, int64_t bit, int64_t dim) {
  check_pack_values(values, bit, dim);
  const c10::cuda::CUDAGuard guard(values.device());
  return pack_words(values, bit, dim);
}

at::Tensor gptq_unpack(const at::Tensor& packed, int64_t bit, int64_t dim) {
  check_unpack_words(packed, bit, dim);
  const c10::cuda::CUDAGuard guard(packed.device());
  return unpack_words(packed, bit, dim);
}

void gptq_shuffle(const at::Tensor& q_weight, const at::Tensor& q_perm, int64_t bit) {
  const auto [K, perm] = check_row_permutation("gptq_shuffle", "q_weight", q_weight, "q_perm", q_perm, bit, true);
  // lowbit's fast layout is the GPTQ packing with rows in q_perm order, so
  // without a permutation there is nothing to rewrite.
  if (perm.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q_weight.device());
  // Gathered into a temporary first: rows are read from anywhere in q_weight.
  const at::Tensor shuffled = permute_rows(q_weight, perm, K, bit);
  q_weight.copy_(shuffled);
}

at::Tensor gptq_permute_rows(const at::Tensor& qweight, const at::Tensor& perm, int64_t bit) {
  const auto [K, p] = check_row_permutation("gptq_permute_rows", "qweight", qweight, "perm", perm, bit, false);
  const c10::cuda::CUDAGuard guard(qweight.device());
  return permute_rows(qweight, p, K, bit);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gptq_permute_cols(const at::Tensor& qweight, const at::Tensor& qzeros,
                                                                 const at::Tensor& scales, const at::Tensor& perm,
                                                                 int64_t bit) {
  const at::Tensor p = check_column_permutation("gptq_permute_cols", qweight, qzeros, scales, perm, bit).second;
  const c10::cuda::CUDAGuard guard(qweight.device());
  const at::Tensor index = p.to(at::kLong);
  // qweight and scales hold one column per output feature; zero points are
  // packed along N, so they move as unpacked fields.
  const at::Tensor zeros = unpack_words(qzeros, bit, 1).index_select(1, index);
  return {qweight.index_select(1, index), pack_words(zeros, bit, 1), scales.index_select(1, index)};
}

}  // namespace cuda
}  // namespace lowbit
