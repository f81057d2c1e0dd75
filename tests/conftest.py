import contextlib
import os

import pytest
import torch

# Nothing in the suite may reach a model hub (transformers builds the SmolLM2
# tokenizer from the GGUF file on disk).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lowbit  # noqa: E402,F401  (loads torch.ops.lowbit)


ISAS = ("portable", "avx2", "avx512")


def _cpu_isas():
    """Every x86 vector ISA of the CPU kernels: each CPU case runs once per ISA
    so the SIMD paths and the portable fallback meet the same tests. An ISA
    this CPU lacks skips with that reason."""
    best = torch.ops.lowbit.cpu_isa("best")
    params = []
    for isa in ISAS:
        missing = ISAS.index(isa) > ISAS.index(best)
        marks = pytest.mark.skipif(missing, reason=f"this CPU cannot run the {isa} kernels (best: {best})")
        params.append(pytest.param(("cpu", isa), id=f"cpu-{isa}", marks=marks))
    return params


def _devices():
    devices = _cpu_isas()
    reason = "CUDA cases need a GPU and a CUDA build of lowbit"
    cuda_ok = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key(
        "lowbit::gptq_gemm", "CUDA"
    )
    devices.append(pytest.param(("cuda", None), id="cuda", marks=pytest.mark.skipif(not cuda_ok, reason=reason)))
    return devices


DEVICES = _devices()


@contextlib.contextmanager
def _forced_isa(isa):
    """The CPU kernels forced to `isa` for the block."""
    before = torch.ops.lowbit.cpu_isa()
    torch.ops.lowbit.cpu_isa(isa)
    # The vdpbf16ps GPTQ kernel wherever it applies, on a CPU whose own choice
    # (auto) would take the fp32 one for some M and bit widths.
    torch.ops.lowbit.cpu_bf16_kernel("always")
    try:
        yield
    finally:
        torch.ops.lowbit.cpu_isa(before)
        torch.ops.lowbit.cpu_bf16_kernel("auto")


@pytest.fixture(params=DEVICES)
def device(request):
    """The device name; CPU cases run with the CPU kernels forced to one ISA."""
    name, isa = request.param
    if isa is None:
        yield name
        return
    with _forced_isa(isa):
        yield name


@pytest.fixture(params=_cpu_isas())
def cpu_isa(request):
    """For what only the CPU has (the repacked layout): the CPU cases of
    `device`, the kernels forced to each ISA in turn."""
    _, isa = request.param
    with _forced_isa(isa):
        yield isa
