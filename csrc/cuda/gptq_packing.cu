// CUDA kernels that move GPTQ fields between words: gptq_pack, gptq_unpack,
// gptq_shuffle / gptq_permute_rows (a row gather along K) and
// gptq_permute_cols. All field arithmetic comes from core/gptq_format.h.
//
// Each thread owns one pack of one stream (kFields fields in kWords words),
// so it assembles its words in registers and writes them whole: no thread
// shares an output word, no atomics, and no zero-filled output is needed.
// These are offline ops (checkpoint preparation), so validation may read
// index and value ranges back from the device (ops/gptq_checks.h).
#include "../core/gptq_format.h"
#include "../ops/dispatch.h"
#include "../ops/gptq_checks.h"
#include "common.cuh"
#include "gptq_cuda.cuh"
#include "../ops/backend_ops.h"

namespace lowbit {
namespace cuda {
namespace {

constexpr int kThreads = 256;

using gptq::PackedAxis;

// body(o, p, c) for every pack p of every stream (o, c), one thread each
// (grid-stride); consecutive threads take consecutive c, so dim-0 packing is
// coalesced.
template <int B, typename Body>
__device__ void for_each_pack(const PackedAxis& ax, Body body) {
  const int64_t packs = ax.length / gptq::Pack<B>::kFields;
  const int64_t total = ax.outer * packs * ax.inner;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride)
    body(t / (ax.inner * packs), (t / ax.inner) % packs, t % ax.inner);
}

// Every pack of every stream packed (kPack: fields into words) or unpacked.
template <int B, bool kPack>
__global__ void __launch_bounds__(kThreads) pack_kernel(int32_t* fields, uint32_t* words, PackedAxis ax) {
  for_each_pack<B>(ax, [&](int64_t o, int64_t p, int64_t c) {
    int32_t* f = fields + gptq::pack_fields_at<B>(ax, o, p) + c;
    uint32_t* w = words + gptq::pack_words_at<B>(ax, o, p) + c;
    if constexpr (kPack)
      gptq::pack_one<B>(f, w, ax.inner);
    else
      gptq::unpack_one<B>(w, f, ax.inner);
  });
}

// dst row k = src row perm[k] for a weight packed along K with N columns:
// one thread per (destination pack, column) gathers its kFields source fields
// (each located at run time) and writes its kWords words.
template <int B>
__global__ void __launch_bounds__(kThreads)
    permute_rows_kernel(const uint32_t* src, uint32_t* dst, const int32_t* perm, int64_t K, int64_t N) {
  const PackedAxis ax{1, K, N};
  for_each_pack<B>(ax, [&](int64_t, int64_t p, int64_t n) {
    const int32_t* from = perm + p * gptq::Pack<B>::kFields;
    for (int j = 0; j < gptq::Pack<B>::kFields; ++j)
      CUDA_KERNEL_ASSERT(from[j] >= 0 && from[j] < K && "gptq: permutation value out of range");
    gptq::gather_one<B>(src + n, from, dst + gptq::pack_words_at<B>(ax, 0, p) + n, N);
  });
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

namespace {

// The fields of a validated 2-D tensor packed into words along `dim`
// (`pack`), or the words unpacked into fields.
at::Tensor convert_words(const at::Tensor& input, int64_t bit, int64_t dim, bool pack) {
  const at::Tensor in = input.contiguous();
  at::Tensor out = at::empty(converted_sizes(in, bit, dim, pack), in.options());
  if (out.numel() == 0) return out;
  const at::Tensor& field_tensor = pack ? in : out;
  const PackedAxis ax = gptq::packed_axis(field_tensor.size(0), field_tensor.size(1), dim);
  const unsigned int blocks = grid_for(ax.outer * (ax.length / gptq::fields_per_pack(bit)) * ax.inner, kThreads);
  int32_t* f = field_tensor.data_ptr<int32_t>();
  uint32_t* w = reinterpret_cast<uint32_t*>((pack ? out : in).data_ptr<int32_t>());
  dispatch_bits(bit, [&](auto bits) {
    constexpr int B = decltype(bits)::value;
    if (pack)
      pack_kernel<B, true><<<blocks, kThreads, 0, current_stream()>>>(f, w, ax);
    else
      pack_kernel<B, false><<<blocks, kThreads, 0, current_stream()>>>(f, w, ax);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

at::Tensor pack_words(const at::Tensor& values, int64_t bit, int64_t dim) { return convert_words(values, bit, dim, true); }

at::Tensor unpack_words(const at::Tensor& packed, int64_t bit, int64_t dim) {
  return convert_words(packed, bit, dim, false);
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
