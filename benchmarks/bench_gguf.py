"""GGUF ops: dequantize throughput per type (against gguf-py's NumPy
dequantize), and matvec / small-batch matmul per main type against torch's
dense fp32 matmul of the same shape, measured in the same run, with GB/s
against the machine's copy bandwidth.

    python benchmarks/bench_gguf.py [--quick]

Writes benchmarks/results/<machine>-gguf.json.
"""
import argparse
import os
import sys
import time

import numpy as np
import torch

import lowbit  # noqa: F401  (loads torch.ops.lowbit)
from common import copy_bandwidth_gbs, machine, print_table, time_ms, write_results

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import gguf_blocks as gb  # noqa: E402  (valid random blocks of every type)

MAIN_TYPES = ["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ4_XS"]
SHAPES = [(14336, 4096), (4096, 14336)]  # (rows = out features, n = in features)
MS = [1, 8]


def dequant_table(rng, rows, n, budget):
    rows_out, records = [], []
    for name in gb.TYPES:
        raw = gb.random_blocks(rng, name, rows, n)
        W = torch.from_numpy(raw)
        t = gb.type_id(name)
        ms = time_ms(lambda: torch.ops.lowbit.ggml_dequantize(W, t, rows, n, torch.float32), budget_s=budget)
        t0 = time.perf_counter()
        gb.dequantize(raw, name)
        numpy_ms = (time.perf_counter() - t0) * 1e3
        gbs = raw.nbytes / (ms * 1e-3) / 1e9
        records.append(dict(type=name, rows=rows, n=n, lowbit_ms=ms, input_gbs=gbs, gguf_py_ms=numpy_ms,
                            speedup_vs_gguf_py=numpy_ms / ms))
        rows_out.append([name, f"{ms:.2f}", f"{gbs:.2f}", f"{numpy_ms:.1f}", f"{numpy_ms / ms:.1f}x"])
    print_table(["type", "lowbit ms", "GB/s in", "gguf-py ms", "vs gguf-py"], rows_out)
    return records


def matmul_table(rng, shapes, bandwidth, budget):
    rows_out, records = [], []
    for rows, n in shapes:
        dense = torch.randn(rows, n)
        for M in MS:
            x = torch.randn(M, n)
            fp32_ms = time_ms(lambda: torch.nn.functional.linear(x, dense), budget_s=budget)
            for name in MAIN_TYPES:
                raw = torch.from_numpy(gb.random_blocks(rng, name, rows, n))
                t = gb.type_id(name)
                op = torch.ops.lowbit.ggml_mul_mat_vec_a8 if M == 1 else torch.ops.lowbit.ggml_mul_mat_a8
                ms = time_ms(lambda: op(raw, x, t, rows), budget_s=budget)
                gbs = raw.numel() / (ms * 1e-3) / 1e9
                records.append(dict(type=name, rows=rows, n=n, M=M, lowbit_ms=ms, weight_gbs=gbs,
                                    bandwidth_fraction=gbs / bandwidth, torch_fp32_ms=fp32_ms,
                                    speedup_vs_fp32=fp32_ms / ms))
                rows_out.append([f"{rows}x{n}", M, name, f"{ms:.2f}", f"{gbs:.2f}", f"{100 * gbs / bandwidth:.0f}%",
                                 f"{fp32_ms:.2f}", f"{fp32_ms / ms:.2f}x"])
    print_table(["rows x n", "M", "type", "lowbit ms", "GB/s", "of bw", "fp32 ms", "vs fp32"], rows_out)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller shapes, shorter timing")
    args = parser.parse_args()
    budget = 0.2 if args.quick else 0.5
    rng = np.random.default_rng(0)

    info = machine()
    bandwidth = copy_bandwidth_gbs()
    print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s\n")
    print("dequantize to fp32, 4096 x 4096 weights")
    dq = dequant_table(rng, 1024 if args.quick else 4096, 4096, budget)
    print("\nmatmul with 8-bit activations")
    mm = matmul_table(rng, [(4096, 4096)] if args.quick else SHAPES, bandwidth, budget)
    write_results(f"{info['slug']}-gguf.json", dict(machine=info, copy_bandwidth_gbs=bandwidth,
                                                     dequantize=dq, matmul=mm))


if __name__ == "__main__":
    main()
