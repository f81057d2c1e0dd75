#include "float_gemm.h"

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <omp.h>

#include <atomic>
#include <optional>
#include <vector>

namespace lowbit {
namespace cpu {
namespace {

// oneDNN's matmul as torch exposes it on dense operands to inductor's CPU
// linear fusions: mkldnn::_linear_pointwise(X, W [out, in], ...) -> X @ W^T.
const std::optional<c10::OperatorHandle>& onednn_linear() {
  static const std::optional<c10::OperatorHandle> op = []() -> std::optional<c10::OperatorHandle> {
    if (!at::hasMKLDNN()) return std::nullopt;
    return c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  }();
  return op;
}

std::atomic<int> choice{-1};  // -1: not set, the default

}  // namespace

FloatGemm float_gemm() {
  const int c = choice.load(std::memory_order_relaxed);
  if (c >= 0) return static_cast<FloatGemm>(c);
  return onednn_linear() ? FloatGemm::kOneDnn : FloatGemm::kBlas;
}

void set_float_gemm(const std::string& name) {
  for (FloatGemm g : {FloatGemm::kOneDnn, FloatGemm::kBlas}) {
    if (name == float_gemm_name(g)) {
      TORCH_CHECK_VALUE(g != FloatGemm::kOneDnn || onednn_linear(),
                        "cpu_float_gemm: this torch has no oneDNN (mkldnn::_linear_pointwise)");
      choice.store(static_cast<int>(g), std::memory_order_relaxed);
      return;
    }
  }
  TORCH_CHECK_VALUE(false, "cpu_float_gemm: unknown library '", name, "'; expected onednn or blas");
}

const char* float_gemm_name(FloatGemm g) { return g == FloatGemm::kOneDnn ? "onednn" : "blas"; }

namespace {

// For its lifetime the calling thread's OpenMP thread count (a per-thread
// setting, read by oneDNN and MKL when they are called) is one.
class OneOpenMpThread {
 public:
  OneOpenMpThread() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneOpenMpThread() { omp_set_num_threads(saved_); }
  OneOpenMpThread(const OneOpenMpThread&) = delete;
  OneOpenMpThread& operator=(const OneOpenMpThread&) = delete;

 private:
  int saved_;
};

}  // namespace

void float_mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor out) {
  const OneOpenMpThread one;
  if (float_gemm() == FloatGemm::kBlas) {
    at::mm_out(out, a, b);
    return;
  }
  // The op returns a new tensor: copied into out (M x n values, against the
  // GEMM's M x n x k multiply-adds).
  std::vector<c10::IValue> stack{a, b.t(), c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  onednn_linear()->callBoxed(stack);
  out.copy_(stack[0].toTensor());
}

}  // namespace cpu
}  // namespace lowbit
