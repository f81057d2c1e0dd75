// Registers every CUDA kernel under the CUDA dispatch key (the repacked
// layout's ops are CPU only).
#include <torch/library.h>

#include "../ops/backend_ops.h"

TORCH_LIBRARY_IMPL(lowbit, CUDA, m) { LOWBIT_REGISTER_BACKEND_OPS(LOWBIT_BACKEND_OPS, cuda) }
