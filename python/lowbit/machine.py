"""The name of the machine results were measured on, shared by the main job
and the benchmarks so result files from one machine carry one name."""
import platform
import re

import torch


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


def machine_slug(device: torch.device = torch.device("cpu")) -> str:
    """e.g. cpu-amd-epyc-2t (CPU model and thread count) or cuda-nvidia-h100-80gb-hbm3."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name(device).lower()).strip("-")
    return f"cpu-{slug}-{torch.get_num_threads()}t" if device.type == "cpu" else f"cuda-{slug}"
