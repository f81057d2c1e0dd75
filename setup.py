"""Builds lowbit's C++/CUDA extension (lowbit._C) against the installed torch.

CPU-only when torch has no CUDA or nvcc is missing; CUDA too when both are
there. LOWBIT_CUDA=0/1 overrides the choice; TORCH_CUDA_ARCH_LIST picks the
GPU architectures and MAX_JOBS the parallel compile jobs (torch's own
variables); LOWBIT_SANITIZE=1 builds with AddressSanitizer and
UndefinedBehaviorSanitizer; LOWBIT_DEBUG=1 keeps debug info (-g);
LOWBIT_CPU_SIMD=0 compiles only the portable CPU kernels (a quick build for a
GPU machine, where they are the CUDA tests' reference). Install with: pip install --no-build-isolation -e .
"""
import glob
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def want_cuda() -> bool:
    choice = os.environ.get("LOWBIT_CUDA")
    if choice is not None:
        if choice == "1" and CUDA_HOME is None:
            raise RuntimeError("LOWBIT_CUDA=1 but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        return choice == "1"
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    sources = sorted(glob.glob("csrc/ops/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    # at::parallel_for expands OpenMP pragmas inside our own code, so we must
    # compile with OpenMP like torch itself.
    # C++20 is named explicitly: torch before 2.13 passes -std=c++17 on its own.
    # -g0 drops the -g Python's flags add (it multiplies compile time and .so
    # size); LOWBIT_DEBUG=1 keeps debug info.
    debug = ["-g"] if os.environ.get("LOWBIT_DEBUG") == "1" else ["-g0"]
    cxx = ["-O3", "-std=c++20", "-fopenmp", *debug]
    link = ["-fopenmp"]
    if os.environ.get("LOWBIT_SANITIZE") == "1":
        # AddressSanitizer + UndefinedBehaviorSanitizer build for the sanitizer
        # test run (make sanitize); every finding aborts.
        flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g"]
        cxx = ["-O1", "-std=c++20", "-fopenmp", *flags]
        link = ["-fopenmp", *flags]
    macros = []
    if os.environ.get("LOWBIT_CPU_SIMD") == "0":
        macros.append(("LOWBIT_PORTABLE_ONLY", "1"))  # csrc/cpu/isa.h: the portable kernels only
    if not want_cuda():
        return CppExtension("lowbit._C", sources, define_macros=macros, extra_compile_args={"cxx": cxx},
                            extra_link_args=link)
    sources += sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
    return CUDAExtension(
        "lowbit._C",
        sources,
        define_macros=[("LOWBIT_WITH_CUDA", "1"), *macros],
        extra_compile_args={"cxx": cxx, "nvcc": nvcc},
        extra_link_args=link,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
