"""Shared benchmark plumbing: timing, the machine's measured memory bandwidth,
a description of the machine, and result files under benchmarks/results/."""
import json
import os
import platform
import statistics
import time

import torch

from lowbit.machine import device_name, machine_slug

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device=torch.device("cpu"), min_reps=5, budget_s=1.0):
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 200:
            break
    return statistics.median(times)


def copy_bandwidth_gbs(device=torch.device("cpu"), nbytes=1 << 29):
    """Read+write bandwidth of a large tensor copy, in GB/s (1e9 bytes)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, min_reps=5, budget_s=2.0)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def machine(device=torch.device("cpu")):
    """A description of the machine and a short name for result files."""
    return {
        "name": device_name(device),
        "slug": machine_slug(device),
        "device": device.type,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def print_table(headers, rows):
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def write_results(name, payload):
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
    return path
