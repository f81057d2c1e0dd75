"""Nsight Compute (ncu) counters of lowbit's CUDA kernels on the shapes of
benchmarks/bench_cuda.py: where each kernel's time goes (memory, issue slots,
occupancy, the stalls it waits on), for the misses bench_cuda's table shows.

    python -m benchmarks.profile_cuda kernels KERNELS.json
    ncu --profile-from-start off --clock-control none --csv --page raw --log-file RAW.csv \\
        --section SpeedOfLight --section Occupancy --section LaunchStats \\
        --section WarpStateStats --section SchedulerStats --section InstructionStats \\
        python -m benchmarks.profile_cuda run
    python -m benchmarks.profile_cuda summarize RAW.csv KERNELS.json

`.ci/device_run.sh profile` runs the three steps. `kernels` records, per case,
the names of the CUDA kernels one call launches (torch.profiler); `run` calls
each case twice to warm up and once between cudaProfilerStart and
cudaProfilerStop, so ncu profiles that call alone; `summarize` assigns ncu's
rows to the cases in launch order and writes
benchmarks/results/<gpu>-cuda-profile.md with, per kernel: time, weight GB/s,
DRAM and SM throughput, issue slots busy, achieved occupancy, registers, thread
instructions per weight and the three largest stall reasons (cycles per issued
instruction).
"""
import argparse
import csv
import json
import os
import re
import sys

K, N = 8192, 28672  # the Llama-70B MLP shape of the CUDA targets (K = in features)
GPTQ_CASES = [  # (bits, variant, activation dtype, M)
    (4, "plain", "float16", 1), (4, "plain", "bfloat16", 1), (4, "plain", "float32", 1),
    (2, "plain", "float16", 1), (3, "plain", "float16", 1), (8, "plain", "float16", 1),
    (4, "actorder-shuffled", "float16", 1),
    (4, "plain", "float16", 16), (4, "plain", "float16", 64), (4, "plain", "float16", 4096),
]
# (type, M), ggml_mul_mat_a8; at M = 512 the int8 tensor-core tiles: sub-blocks of 32 (Q4_K) and 16
# (Q6_K) elements, and a block decoded per thread (IQ2_XS).
GGUF_CASES = [("Q4_0", 1), ("Q4_K", 1), ("Q6_K", 1), ("Q8_0", 1), ("Q4_K", 512), ("Q6_K", 512), ("IQ2_XS", 512)]
STALL = re.compile(r"issue_stalled_(\w+?)_per_issue_active\.ratio$")
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6}


def case_names():
    names = [f"gptq_gemm {b}-bit {v} {d} M={m}" for b, v, d, m in GPTQ_CASES]
    return names + [f"ggml_mul_mat_a8 {t} M={m}" for t, m in GGUF_CASES]


def build_cases(device):
    """[(name, op, weight bytes, weights)]: op() is one call of the case's op on fresh random operands."""
    import torch

    from benchmarks.bench_cuda import GGUF_TYPES, gguf_weight, gptq_weight, nbytes_of

    cases = []
    for (bits, variant, dtype, m), name in zip(GPTQ_CASES, case_names()):
        qweight, qzeros, scales, idx, exllama = gptq_weight(K, N, bits, variant, device, 0)
        a = torch.randn(m, K, device=device, dtype=getattr(torch, dtype))
        args = (a, qweight, qzeros, scales, idx, exllama, True, bits)
        cases.append((name, lambda args=args: torch.ops.lowbit.gptq_gemm(*args),
                      nbytes_of(qweight, qzeros, scales, idx), K * N))
    for (t, m), name in zip(GGUF_CASES, case_names()[len(GPTQ_CASES):]):
        w = gguf_weight(t, N, K, device, 0)
        x = torch.randn(m, K, device=device, dtype=torch.float16)
        cases.append((name, lambda w=w, x=x, t=t: torch.ops.lowbit.ggml_mul_mat_a8(w, x, GGUF_TYPES[t], N),
                      nbytes_of(w), K * N))
    return cases


def cuda_device():
    import torch

    from benchmarks.bench_cuda import load_lowbit

    load_lowbit("profile_cuda")  # exits with a message without a GPU or a CUDA build
    return torch.device("cuda")


def record_kernels(path):
    """Per case, the kernels one warm call launches, in order, as JSON at path."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = cuda_device()
    out = []
    for name, op, nbytes, weights in build_cases(device):
        op()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            op()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and not e.name.startswith(("Memcpy", "Memset"))]
        kernels.sort(key=lambda e: e.time_range.start)
        out.append(dict(case=name, kernels=[e.name for e in kernels], weight_bytes=nbytes, weights=weights))
        print(f"{name}: {len(kernels)} kernel(s)")
    from benchmarks.machine import short_device_name

    with open(path, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(device), gpu=short_device_name(device), cases=out), f,
                  indent=1)


def run_cases():
    """Each case warmed up, then one call inside the profiler's capture range."""
    import torch

    device = cuda_device()
    cudart = torch.cuda.cudart()
    for name, op, _, _ in build_cases(device):
        op(), op()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        op()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        print(f"profiled {name}", flush=True)


def read_raw_csv(path):
    """ncu's --page raw --csv rows as dicts, with the units row, skipping its ==PROF== lines."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f"profile_cuda: no ncu raw CSV header (\"ID\", ...) in {path}: did ncu profile anything?")
    rows = list(csv.DictReader(lines[start:]))
    if not rows:
        return {}, []
    units, rows = rows[0], rows[1:]
    return units, [r for r in rows if r.get("ID", "").strip().isdigit()]


def number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def short_kernel(name):
    """A kernel's name without its namespaces, template arguments and parameters."""
    depth, out = 0, []
    for ch in name:
        depth += ch in "<("
        if depth == 0:
            out.append(ch)
        depth -= ch in ">)"
    base = "".join(out).split()[-1] if "".join(out).split() else name
    return base.split("::")[-1]


def kernel_row(case, raw, units, weight_bytes, weights):
    def metric(key, scale=1.0):
        v = number(raw.get(key))
        return None if v is None else v * scale

    us = metric("gpu__time_duration.sum", TIME_UNITS.get(units.get("gpu__time_duration.sum", "").strip(), 1e-3))
    inst = metric("smsp__inst_executed.sum")
    stalls = sorted(((number(v), STALL.search(k).group(1)) for k, v in raw.items()
                     if STALL.search(k) and number(v) is not None), reverse=True)[:3]
    return dict(case=case, kernel=short_kernel(raw.get("Kernel Name", "?")), us=us,
                gbs=weight_bytes / (us * 1e3) if us else None,
                dram=metric("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                sm=metric("sm__throughput.avg.pct_of_peak_sustained_elapsed"),
                issue=metric("smsp__issue_active.avg.pct_of_peak_sustained_active"),
                occupancy=metric("sm__warps_active.avg.pct_of_peak_sustained_active"),
                theoretical=metric("sm__maximum_warps_per_active_cycle_pct"),
                registers=metric("launch__registers_per_thread"),
                grid=(raw.get("Grid Size") or raw.get("launch__grid_size") or "?").strip(),
                block=(raw.get("Block Size") or raw.get("launch__block_size") or "?").strip(),
                inst_per_weight=inst * 32 / weights if inst is not None else None,
                stalls=", ".join(f"{r} {v:.1f}" for v, r in stalls))


def assign(cases, rows):
    """ncu's rows (launch order) split among the cases by their kernel counts; a note where they disagree."""
    want = sum(len(c["kernels"]) for c in cases)
    note = "" if want == len(rows) else (f"ncu profiled {len(rows)} kernels where the cases launch {want}: the rows "
                                         "below are assigned in launch order and may be misattributed")
    rows = sorted(rows, key=lambda r: int(r["ID"]))
    out, i = [], 0
    for c in cases:
        for _ in c["kernels"]:
            if i < len(rows):
                out.append((c, rows[i]))
            i += 1
    return out, note


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def summarize(raw_path, kernels_path, out_path=None):
    units, rows = read_raw_csv(raw_path)
    with open(kernels_path) as f:
        recorded = json.load(f)
    pairs, note = assign(recorded["cases"], rows)
    table = [kernel_row(c["case"], r, units, c["weight_bytes"], c["weights"]) for c, r in pairs]
    lines = [f"# lowbit CUDA kernels under Nsight Compute: {recorded['device']}", "",
             f"Command: `bash .ci/device_run.sh profile` (`python -m benchmarks.profile_cuda`, ncu raw page); "
             f"K x N = {K}x{N}, group size 128; one warm call per case, caches flushed by ncu before each "
             "kernel, clocks left alone (`--clock-control none`).", "",
             "GB/s: the case's weight bytes over the kernel's time. DRAM, SM: throughput as % of peak; issue: "
             "issue slots busy; occupancy: achieved (theoretical) % of the warp slots; inst/weight: thread "
             "instructions per weight; stalls: the largest reasons, in cycles per issued instruction.", ""]
    if note:
        lines += [note, ""]
    lines += ["| case | kernel | grid x block | µs | GB/s | DRAM % | SM % | issue % | occupancy % | regs | "
              "inst/weight | stalls |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for t in table:
        lines.append(f"| {t['case']} | `{t['kernel']}` | {t['grid']} x {t['block']} | {fmt(t['us'], '.1f')} | "
                     f"{fmt(t['gbs'], '.0f')} | {fmt(t['dram'], '.0f')} | {fmt(t['sm'], '.0f')} | "
                     f"{fmt(t['issue'], '.0f')} | {fmt(t['occupancy'], '.0f')} ({fmt(t['theoretical'], '.0f')}) | "
                     f"{fmt(t['registers'], '.0f')} | {fmt(t['inst_per_weight'], '.2f')} | {t['stalls'] or '-'} |")
    text = "\n".join(lines) + "\n"
    if out_path is None:
        gpu = re.sub(r"[^a-z0-9-]+", "-", recorded["gpu"]) or "cuda"
        out_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"{gpu}-cuda-profile.md")
    with open(out_path, "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out_path}")
    return table, note


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="step", required=True)
    sub.add_parser("kernels", help="record each case's kernels").add_argument("path")
    sub.add_parser("run", help="each case once inside the profiler's capture range (under ncu)")
    s = sub.add_parser("summarize", help="ncu's raw CSV into benchmarks/results/<gpu>-cuda-profile.md")
    s.add_argument("raw_csv")
    s.add_argument("kernels_json")
    s.add_argument("--out", help="the markdown file to write (default benchmarks/results/<gpu>-cuda-profile.md)")
    args = parser.parse_args()
    if args.step == "kernels":
        record_kernels(args.path)
    elif args.step == "run":
        run_cases()
    else:
        for path in (args.raw_csv, args.kernels_json):
            if not os.path.isfile(path):
                parser.error(f"{path}: no such file")
        summarize(args.raw_csv, args.kernels_json, args.out)


if __name__ == "__main__":
    sys.exit(main())
