"""Builds lowbit's C++/CUDA extension (lowbit._C) against the installed torch.

CPU-only when torch has no CUDA or nvcc is missing; CUDA too when both are
there. LOWBIT_CUDA=0/1 overrides the choice; TORCH_CUDA_ARCH_LIST picks the
GPU architectures and MAX_JOBS the parallel compile jobs (torch's own
variables); LOWBIT_SANITIZE=1 builds with AddressSanitizer and
UndefinedBehaviorSanitizer, LOWBIT_SANITIZE=address (or another -fsanitize
list) with those sanitizers; LOWBIT_DEBUG=1 keeps debug info (-g);
LOWBIT_CPU_SIMD=0 compiles only the portable CPU kernels (a quick build for a
GPU machine, where they are the CUDA tests' reference), LOWBIT_CPU_SIMD=avx2
leaves out the AVX-512 ones (a build for CPUs without AVX-512). Install with: pip install --no-build-isolation -e .
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
    sanitizers = os.environ.get("LOWBIT_SANITIZE", "")
    if sanitizers not in ("", "0"):
        # The sanitizer build of the sanitizer test run (make sanitize); every finding aborts.
        sanitizers = "address,undefined" if sanitizers == "1" else sanitizers
        flags = [f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer", "-g0"]
        cxx = ["-O1", "-std=c++20", "-fopenmp", *flags]
        link = ["-fopenmp", *flags]
    macros = []
    simd = os.environ.get("LOWBIT_CPU_SIMD")
    if simd == "0":
        macros.append(("LOWBIT_PORTABLE_ONLY", "1"))  # csrc/cpu/isa.h: the portable kernels only
    elif simd == "avx2":
        macros.append(("LOWBIT_NO_AVX512", "1"))  # csrc/cpu/isa.h: no AVX-512 kernels
    elif simd not in (None, "", "1"):
        raise RuntimeError(f"LOWBIT_CPU_SIMD={simd!r}: expected 0 (portable kernels only), avx2 or 1 (all, the default)")
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
