// torch.autocast for the matmul ops: inside an autocast region they take
// their activations in autocast's dtype, as torch's own matmuls do (nn.Linear
// gives bf16 under a bf16 autocast), so a quantized layer's output joins the
// region's other tensors. Only the activation argument is cast: a GPTQ
// weight's scales keep their dtype (fp16 scales rounded to bf16 would change
// the weight itself), and float64 activations stay as autocast leaves them.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

#include <memory>
#include <utility>

namespace lowbit {
namespace {

// Each op and the position of its activations among its arguments.
constexpr std::pair<const char*, size_t> kActivationArgs[] = {
    {"gptq_gemm", 0},          {"gptq_gemm_a8", 0},          {"ggml_mul_mat_vec_a8", 1},
    {"ggml_mul_mat_a8", 1},    {"ggml_mul_mat_repacked", 1}, {"ggml_mul_mat_id", 1},
    {"ggml_mul_mat_id_repacked", 1},
};

template <c10::DeviceType device>
class CastActivations final : public c10::OperatorKernel {
 public:
  explicit CastActivations(size_t index) : index_(index) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const c10::impl::ExcludeDispatchKeyGuard no_autocast(
        at::autocast::get_autocast_dispatch_key_from_device_type(device));
    c10::IValue& arg = (*stack)[stack->size() - op.schema().arguments().size() + index_];
    if (arg.isTensor()) {
      arg = at::autocast::cached_cast(at::autocast::get_autocast_dtype(device), arg.toTensor(), device);
    }
    op.callBoxed(stack);
  }

 private:
  size_t index_;
};

template <c10::DeviceType device>
void register_casts(torch::Library& m) {
  for (const auto& [name, index] : kActivationArgs) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CastActivations<device>>(index)));
  }
}

}  // namespace
}  // namespace lowbit

TORCH_LIBRARY_IMPL(lowbit, AutocastCPU, m) { lowbit::register_casts<c10::DeviceType::CPU>(m); }
TORCH_LIBRARY_IMPL(lowbit, AutocastCUDA, m) { lowbit::register_casts<c10::DeviceType::CUDA>(m); }
