"""The name of the machine results were measured on, shared by the main job
and the benchmarks so result files from one machine carry one name, and the
folder the files go to."""
import os
import platform
import re
import tempfile

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def results_dir(quick: bool = False) -> str:
    """benchmarks/results, or for a --quick run (a smoke test of a script) a
    folder under the system's temp directory: a quick run never replaces the
    files of a full one, which the READMEs' tables are made from."""
    path = os.path.join(tempfile.gettempdir(), "lowbit-bench-quick") if quick else RESULTS
    os.makedirs(path, exist_ok=True)
    return path


def device_name(device: torch.device = torch.device("cpu")) -> str:
    """The CPU model (from /proc/cpuinfo where available) or the GPU's name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"model name\s*:\s*(.*)", f.read())
        if found:
            return found.group(1).strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^flags\s*:\s*(.*)$", f.read(), re.M)
        return set(found.group(1).split()) if found else set()
    except OSError:
        return set()


def machine_slug(device: torch.device = torch.device("cpu")) -> str:
    """e.g. cpu-amd-epyc-2t (CPU model and thread count; -no-avx512 where an
    x86 CPU lacks AVX-512F: virtual machines often report only the vendor and
    family, so two generations would otherwise share one name) or
    cuda-nvidia-h100-80gb-hbm3."""
    name = re.sub(r"\((r|tm)\)", "", device_name(device).lower())  # "Intel(R) Xeon(R)" -> "intel xeon"
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    if device.type != "cpu":
        return f"cuda-{slug}"
    flags = cpu_flags()
    if platform.machine() in ("x86_64", "AMD64") and flags and "avx512f" not in flags:
        slug += "-no-avx512"
    return f"cpu-{slug}-{torch.get_num_threads()}t"


_VENDOR_WORDS = {"nvidia", "tesla", "geforce", "quadro", "amd", "radeon", "instinct"}


def short_device_name(device: torch.device = torch.device("cpu")) -> str:
    """A short name for result files: the GPU model for CUDA devices ("h100"
    for "NVIDIA H100 80GB HBM3", "a100" for "NVIDIA A100-SXM4-80GB",
    "rtx-4090" for "NVIDIA GeForce RTX 4090"), machine_slug() for the CPU."""
    if device.type != "cuda":
        return machine_slug(device)
    words = [w for w in re.split(r"[\s_-]+", device_name(device)) if w and w.lower() not in _VENDOR_WORDS]
    for w in words:
        if re.fullmatch(r"[A-Za-z]{1,3}\d{1,4}[A-Za-z]?", w):  # H100, A100, L40S, GH200, T4
            return w.lower()
    slug = re.sub(r"[^a-z0-9]+", "-", " ".join(words[:2]).lower()).strip("-")
    return slug or "cuda"
