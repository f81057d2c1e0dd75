// Registers every CPU kernel under the CPU dispatch key.
#include <torch/library.h>

#include "../ops/backend_ops.h"

TORCH_LIBRARY_IMPL(lowbit, CPU, m) {
  LOWBIT_REGISTER_BACKEND_OPS(LOWBIT_BACKEND_OPS, cpu)
  LOWBIT_REGISTER_BACKEND_OPS(LOWBIT_CPU_ONLY_OPS, cpu)
}
