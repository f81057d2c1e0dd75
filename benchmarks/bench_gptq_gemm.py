"""gptq_gemm, with fp32 and with bf16 activations, and gptq_gemm_a8 (fp32
activations rounded to int8, CPU), against their peers, measured in the same
run on the same threads:
torch's dense fp32 and bf16 matmul of the same shape, torch's own int4 CPU
kernel (aten._weight_int4pack_mm_for_cpu, bf16 activations, for 4-bit), and
the machine's copy bandwidth (GB/s = bytes of qweight + scales + zeros / time).

The main table multiplies the same weight call after call: a weight smaller
than the L3 (4-bit 4096x14336 is 30 MB) is read from cache there. The
streamed table (CPU, M = 1) multiplies distinct copies in turn, 1.5 GB in
all, as a model's decode reads its weights from memory; its GB/s are the
ones to hold against the copy bandwidth.

    python -m benchmarks.bench_gptq_gemm [--device cpu|cuda] [--quick]

Writes benchmarks/results/<machine>-gptq.json and .txt. Every kernel of a
shape, M and thread count is timed in alternating rounds, each one's fastest
round reported (common.time_rounds_ms).
"""
import argparse
import os

from benchmarks.common import (CopyBandwidth, machine, print_table, printed_to,  # first: sets THP
                               results_dir, time_rounds_ms, write_results)

import torch  # noqa: E402

import lowbit  # noqa: E402,F401  (loads torch.ops.lowbit)
from lowbit.gptq.packing import to_panels  # noqa: E402

SHAPES = [(4096, 14336), (14336, 4096)]  # (K = in features, N = out features)
BITS = [2, 3, 4, 8]
MS = [1, 8, 16, 256]
THREADS = [1, 2]
GROUP = 128
STREAMED_BYTES = 1.5e9  # as bench_gguf's: several times any L3 here


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


def torch_int4(K, N, M):
    """torch's int4 CPU matmul of the same shape and group size, or None."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2)
        scale_zeros = torch.rand(K // GROUP, N, 2).bfloat16()
        x = torch.randn(M, K).bfloat16()
        fn = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zeros)
        fn()
        return fn
    except (RuntimeError, AttributeError):
        return None


def torch_int4_packed(K, N):
    """torch's int4 CPU layout of a random [N, K] weight and its g128 scales and zeros."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (N, K), dtype=torch.int32), 2)
    return packed, torch.rand(K // GROUP, N, 2).bfloat16()


def streamed_table(K, N, threads_list, budget):
    """M = 1 over distinct copies of each weight, STREAMED_BYTES in all, taken
    in turn (each side's time per matmul: its time for all copies over their
    number): gptq_gemm (fp32 activations) and gptq_gemm_a8, each over the
    checkpoint's layout and over the panel layout (GPTQLinear.repack's),
    torch's int4 kernel (4-bit) and torch's fp32 dense matmul (one weight: 4
    bytes per element already exceed any L3 here)."""
    dense = torch.randn(K, N)
    a32 = torch.randn(1, K)
    records = []
    for bits in BITS:
        one = random_gptq_weight(K, N, bits, torch.device("cpu"))
        nbytes = sum(t.numel() * t.element_size() for t in one[:3])
        copies = max(2, int(STREAMED_BYTES // nbytes))
        weights = [tuple(t.clone() for t in one) for _ in range(copies)]
        paneled = [(to_panels(w[0]), *w[1:]) for w in weights]
        int4 = None
        if bits == 4:
            try:
                packs = [torch_int4_packed(K, N) for _ in range(copies)]
                a16 = a32.bfloat16()
                int4 = lambda: [torch.ops.aten._weight_int4pack_mm_for_cpu(a16, p, GROUP, sz) for p, sz in packs]
            except (RuntimeError, AttributeError):
                pass
        fp32 = lambda: [torch.ops.lowbit.gptq_gemm(a32, *w, False, True, bits) for w in weights]
        a8 = lambda: [torch.ops.lowbit.gptq_gemm_a8(a32, *w, True, bits) for w in weights]
        fp32_p = lambda: [torch.ops.lowbit.gptq_gemm(a32, *w, False, True, bits) for w in paneled]
        a8_p = lambda: [torch.ops.lowbit.gptq_gemm_a8(a32, *w, True, bits) for w in paneled]
        for threads in threads_list:
            torch.set_num_threads(threads)
            ms, ms8, int4_ms, ms_p, ms8_p = (v / copies for v in time_rounds_ms([fp32, a8, int4, fp32_p, a8_p],
                                                                               min_reps=2, budget_s=2 * budget))
            (dense_ms,) = time_rounds_ms([lambda: a32 @ dense], budget_s=budget)
            records.append(dict(K=K, N=N, M=1, threads=threads, bits=bits, group_size=GROUP, copies=copies,
                                lowbit_ms=ms, lowbit_int8_ms=ms8, weight_gbs=nbytes / (ms * 1e-3) / 1e9,
                                int8_weight_gbs=nbytes / (ms8 * 1e-3) / 1e9, torch_int4_ms=int4_ms,
                                lowbit_panels_ms=ms_p, panels_weight_gbs=nbytes / (ms_p * 1e-3) / 1e9,
                                lowbit_int8_panels_ms=ms8_p, int8_panels_weight_gbs=nbytes / (ms8_p * 1e-3) / 1e9,
                                torch_fp32_ms=dense_ms, speedup_vs_fp32=dense_ms / ms,
                                int8_speedup_vs_fp32=dense_ms / ms8, int8_speedup_vs_torch_int4=int4_ms / ms8))
        del weights, paneled
    torch.set_num_threads(max(threads_list))
    return records


def print_streamed(records, bandwidth):
    rows = []
    for r in records:
        thr_bw = bandwidth.gbs_at(r["threads"])
        r["bandwidth_fraction_same_threads"] = r["weight_gbs"] / thr_bw
        r["int8_bandwidth_fraction_same_threads"] = r["int8_weight_gbs"] / thr_bw
        rows.append([f"{r['K']}x{r['N']}", r["threads"], r["bits"], r["copies"], f"{r['lowbit_ms']:.3f}",
                     f"{r['weight_gbs']:.1f}", f"{100 * r['bandwidth_fraction_same_threads']:.0f}%",
                     f"{r['lowbit_int8_ms']:.3f}", f"{r['int8_weight_gbs']:.1f}",
                     f"{100 * r['int8_bandwidth_fraction_same_threads']:.0f}%", f"{r['torch_fp32_ms']:.3f}",
                     f"{r['speedup_vs_fp32']:.2f}x", f"{r['int8_speedup_vs_fp32']:.2f}x", f"{r['torch_int4_ms']:.3f}",
                     f"{r['int8_speedup_vs_torch_int4']:.2f}x", f"{r['panels_weight_gbs']:.1f}",
                     f"{r['int8_panels_weight_gbs']:.1f}"])
    print_table(["KxN", "thr", "bits", "copies", "fp32 act ms", "GB/s", "of thr bw", "int8 ms", "int8 GB/s",
                 "of thr bw", "torch fp32 ms", "vs fp32", "int8 vs fp32", "torch int4 ms", "int8 vs int4",
                 "panels GB/s", "int8 panels GB/s"], rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or a CUDA device")
    parser.add_argument("--quick", action="store_true", help="one shape, M = 1, shorter timing")
    args = parser.parse_args()
    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {e}")
    cuda_here = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm",
                                                                                             "CUDA")
    if device.type == "cuda" and not (cuda_here and (device.index or 0) < torch.cuda.device_count()):
        parser.error(f"--device {args.device}: no such CUDA device here, or a lowbit built without CUDA kernels")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: lowbit's kernels run on cpu and cuda")
    budget = 0.1 if args.quick else 0.15  # per round of time_rounds_ms
    shapes = [(4096, 4096)] if args.quick else SHAPES
    ms_list = [1] if args.quick else MS
    threads_list = [torch.get_num_threads()] if args.quick or device.type != "cpu" else THREADS

    info = machine(device)
    records = []
    stem = os.path.join(results_dir(args.quick), f"{info['slug']}-gptq")
    with printed_to(f"{stem}.txt"):
        bandwidth = CopyBandwidth(device, threads_list)
        isa = torch.ops.lowbit.cpu_isa() if device.type == "cpu" else "-"
        print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}, CPU kernels: {isa}")
        for K, N in shapes:
            torch.set_num_threads(max(threads_list))
            bandwidth.sample()
            dense32 = torch.randn(K, N, device=device)
            dense16 = dense32.to(torch.bfloat16)
            for M in ms_list:
                a32 = torch.randn(M, K, device=device)
                a16 = a32.to(torch.bfloat16)
                int4 = torch_int4(K, N, M) if device.type == "cpu" else None
                weights = {bits: random_gptq_weight(K, N, bits, device) for bits in BITS}
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    # fp32 activations against fp32 dense; bf16 activations (what torch's
                    # int4 kernel and bf16 dense take) against those two. All in turns.
                    gemm = lambda a, w, bits: lambda: torch.ops.lowbit.gptq_gemm(a, *w, False, True, bits)
                    a8 = lambda w, bits: (lambda: torch.ops.lowbit.gptq_gemm_a8(a32, *w, True, bits)) \
                        if device.type == "cpu" else None
                    fp32_ms, bf16_ms, int4_ms, *lowbit_ms = time_rounds_ms(
                        [lambda: a32 @ dense32, lambda: a16 @ dense16, int4] +
                        [f for bits in BITS for f in (gemm(a32, weights[bits], bits), gemm(a16, weights[bits], bits),
                                                      a8(weights[bits], bits))], device, budget_s=budget)
                    for i, bits in enumerate(BITS):
                        qweight, qzeros, scales, g_idx = weights[bits]
                        ms, ms16, ms8 = lowbit_ms[3 * i: 3 * i + 3]
                        nbytes = sum(t.numel() * t.element_size() for t in (qweight, qzeros, scales))
                        gbs = nbytes / (min(ms, ms16, ms8) * 1e-3) / 1e9
                        peer_int4 = int4_ms if bits == 4 else float("nan")
                        records.append(dict(K=K, N=N, M=M, threads=threads, bits=bits, group_size=GROUP,
                                            lowbit_ms=ms, lowbit_bf16_ms=ms16, lowbit_int8_ms=ms8, weight_gbs=gbs,
                                            torch_fp32_ms=fp32_ms, torch_bf16_ms=bf16_ms, torch_int4_ms=peer_int4,
                                            speedup_vs_fp32=fp32_ms / ms, speedup_vs_bf16=bf16_ms / ms16,
                                            int8_speedup_vs_fp32=fp32_ms / ms8,
                                            speedup_vs_torch_int4=peer_int4 / ms16))
        streamed = [] if args.quick or device.type != "cpu" else streamed_table(*SHAPES[0], threads_list, budget)
        torch.set_num_threads(max(threads_list))
        bandwidth.sample()
        print(bandwidth.describe() + "\n")
        rows = []
        for r in records:
            r["bandwidth_fraction"] = r["weight_gbs"] / bandwidth.gbs
            r["bandwidth_fraction_same_threads"] = r["weight_gbs"] / bandwidth.gbs_at(r["threads"])
            rows.append([f"{r['K']}x{r['N']}", r["M"], r["threads"], r["bits"], f"{r['lowbit_ms']:.3f}",
                         f"{r['lowbit_bf16_ms']:.3f}", f"{r['lowbit_int8_ms']:.3f}", f"{r['weight_gbs']:.1f}", f"{100 * r['bandwidth_fraction']:.0f}%",
                         f"{100 * r['bandwidth_fraction_same_threads']:.0f}%",
                         f"{r['torch_fp32_ms']:.3f}", f"{r['speedup_vs_fp32']:.2f}x",
                         f"{r['int8_speedup_vs_fp32']:.2f}x", f"{r['speedup_vs_bf16']:.2f}x",
                         f"{r['torch_int4_ms']:.3f}", f"{r['speedup_vs_torch_int4']:.2f}x"])
        print("One weight, multiplied call after call (a weight that fits the L3 is read from cache).\n"
              "lowbit ms: fp32 activations, compared with fp32 dense; bf16 ms: bf16 activations, compared with\n"
              "bf16 dense and torch's int4 kernel (both take bf16); int8 ms: gptq_gemm_a8 of the fp32 activations,\n"
              "compared with fp32 dense (int8 vs fp32); GB/s from the fastest of the three\n")
        print_table(["KxN", "M", "thr", "bits", "lowbit ms", "bf16 ms", "int8 ms", "GB/s", "of bw", "of thr bw",
                     "fp32 ms", "vs fp32", "int8 vs fp32", "vs bf16", "int4 ms", "vs int4"], rows)
        if streamed:
            print(f"\nM = 1 with the weights streamed from memory: copies of each weight, {STREAMED_BYTES / 1e9:.1f} GB "
                  "in all, in turn;\nfp32 act: gptq_gemm, int8: gptq_gemm_a8, torch int4: its kernel over copies of "
                  "its own layout (bf16\nactivations), torch fp32: dense matmul of one weight (beyond the L3 already);\npanels GB/s: "
                  "the two over the panel layout (GPTQLinear.repack's)\n")
            print_streamed(streamed, bandwidth)
    write_results(f"{stem}.json", dict(machine=info, cpu_isa=isa, **bandwidth.as_record(),
                                       activations="lowbit_ms: fp32, lowbit_bf16_ms: bf16 (torch int4 and bf16 dense: "
                                                   "bf16), lowbit_int8_ms: gptq_gemm_a8 of the fp32 activations",
                                       records=records, streamed=streamed))



if __name__ == "__main__":
    main()
