"""gptq_gemm throughput against dense torch matmul of the same shape, measured
in the same run, with achieved GB/s against the machine's copy bandwidth.

    python benchmarks/bench_gptq_gemm.py [--device cpu|cuda] [--quick]

Writes benchmarks/results/<machine>-gptq.json.
"""
import argparse

import torch

import lowbit  # noqa: F401  (loads torch.ops.lowbit)
from common import copy_bandwidth_gbs, machine, print_table, time_ms, write_results

SHAPES = [(4096, 4096), (4096, 14336)]  # (K = in features, N = out features)
BITS = [2, 3, 4, 8]
MS = [1, 16, 256]
GROUP = 128


def random_gptq_weight(K, N, bits, device):
    """Valid GPTQ tensors with random contents (every bit pattern is a valid weight)."""
    g = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=g).to(torch.int32)
    groups = K // GROUP
    return (
        words(K * bits // 32, N).to(device),
        words(groups, N * bits // 32).to(device),
        (torch.rand(groups, N, generator=g) / 2**bits).to(torch.float16).to(device),
        torch.empty(0, dtype=torch.int32, device=device),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true", help="one shape, shorter timing")
    args = parser.parse_args()
    device = torch.device(args.device)
    budget = 0.3 if args.quick else 1.0
    shapes = SHAPES[:1] if args.quick else SHAPES

    info = machine(device)
    bandwidth = copy_bandwidth_gbs(device)
    print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}")
    print(f"measured copy bandwidth: {bandwidth:.1f} GB/s\n")

    rows, records = [], []
    for K, N in shapes:
        dense32 = torch.randn(K, N, device=device)
        dense16 = dense32.to(torch.bfloat16)
        for M in MS:
            a32 = torch.randn(M, K, device=device)
            a16 = a32.to(torch.bfloat16)
            fp32_ms = time_ms(lambda: a32 @ dense32, device, budget_s=budget)
            bf16_ms = time_ms(lambda: a16 @ dense16, device, budget_s=budget)
            for bits in BITS:
                qweight, qzeros, scales, g_idx = random_gptq_weight(K, N, bits, device)
                op = lambda: torch.ops.lowbit.gptq_gemm(a32, qweight, qzeros, scales, g_idx, False, True, bits)
                ms = time_ms(op, device, budget_s=budget)
                nbytes = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales, a32)) + M * N * 4
                gbs = nbytes / (ms * 1e-3) / 1e9
                rec = dict(K=K, N=N, M=M, bits=bits, group_size=GROUP, lowbit_ms=ms, gbs=gbs,
                           bandwidth_fraction=gbs / bandwidth, torch_fp32_ms=fp32_ms, torch_bf16_ms=bf16_ms,
                           speedup_vs_fp32=fp32_ms / ms, speedup_vs_bf16=bf16_ms / ms)
                records.append(rec)
                rows.append([f"{K}x{N}", bits, M, f"{ms:.3f}", f"{gbs:.1f}", f"{100 * gbs / bandwidth:.0f}%",
                             f"{fp32_ms:.3f}", f"{bf16_ms:.3f}", f"{fp32_ms / ms:.2f}x", f"{bf16_ms / ms:.2f}x"])
    print_table(["KxN", "bits", "M", "lowbit ms", "GB/s", "of bw", "fp32 ms", "bf16 ms", "vs fp32", "vs bf16"], rows)
    write_results(f"{info['slug']}-gptq.json", dict(machine=info, copy_bandwidth_gbs=bandwidth,
                                                     activations="fp32", records=records))


if __name__ == "__main__":
    main()
