"""Builds a binding of CUDA kernels compiled as host code against the CPU
emulator of the CUDA execution model (tests/simt/simt.h), for the
test_simt_*.py tests. It needs the CUDA toolkit's headers (nvcc on PATH, or
CUDA_HOME), as CI's compile check (`make cuda-check`) does; without them the
tests skip and say so."""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIMT = ROOT / "tests" / "simt"


def _toolkit_includes():
    """The CUDA toolkit's include folders, from CUDA_HOME or from nvcc's own plan."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (pathlib.Path(home) / "include" / "cuda_runtime.h").exists():
        return [str(pathlib.Path(home) / "include")]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return []
    plan = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                          capture_output=True, text=True).stderr
    return re.findall(r'(?:-I|-isystem" ")"?([^"\s]+)', plan)


def load(source):
    """The extension built from tests/simt/<source> (cached under build/simt/)."""
    from torch.utils import cpp_extension

    includes = [p for p in _toolkit_includes() if os.path.isdir(p)]
    if not any(os.path.exists(os.path.join(p, "cuda_runtime.h")) for p in includes):
        pytest.skip("the CUDA toolkit's headers are not installed (nvcc not on PATH, no CUDA_HOME)")
    name = "lowbit_simt_" + pathlib.Path(source).stem
    build = ROOT / "build" / "simt" / name
    build.mkdir(parents=True, exist_ok=True)
    # A CPU-only torch lacks the one header CMake generates for CUDA builds (as in .ci/cuda_compile_check.sh).
    stub = ROOT / "build" / "simt" / "include"
    macros = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True, exist_ok=True)
    if not macros.exists():
        macros.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return cpp_extension.load(
        name=name,
        sources=[str(SIMT / source)],
        extra_include_paths=[str(ROOT / "csrc"), str(SIMT), *includes, str(stub)],
        extra_cflags=["-O1", "-std=c++17"],
        build_directory=str(build),
        verbose=False,
    )
