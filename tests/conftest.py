import os
import sys

import pytest
import torch

# Nothing in the suite may reach a model hub (transformers builds the SmolLM2
# tokenizer from the GGUF file on disk).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Tests import their NumPy references (gptq_reference.py, ...) as plain modules.
sys.path.insert(0, os.path.dirname(__file__))

import lowbit  # noqa: E402,F401  (loads torch.ops.lowbit)


def _devices():
    devices = [pytest.param("cpu", id="cpu")]
    reason = "CUDA cases need a GPU and a CUDA build of lowbit"
    cuda_ok = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "lowbit::gptq_gemm", "CUDA"
    )
    devices.append(pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not cuda_ok, reason=reason)))
    return devices


DEVICES = _devices()


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
