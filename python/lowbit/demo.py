"""The demo main job: quantize a random Linear layer to GPTQ at 2/3/4/8 bits,
run it through torch.ops.lowbit.gptq_gemm, and print error and timing.

    python -m lowbit.demo [--in-features 4096] [--out-features 4096]
"""
import argparse
import time

import torch

import lowbit


def median_ms(fn, reps=20):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--in-features", type=int, default=4096)
    parser.add_argument("--out-features", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    layer = torch.nn.Linear(args.in_features, args.out_features, bias=False)
    x1 = torch.randn(1, args.in_features)
    x64 = torch.randn(64, args.in_features)
    dense = layer.weight.detach().t().contiguous()  # [K, N]
    ref = x64 @ dense
    dense_ms = median_ms(lambda: x1 @ dense)
    print(f"lowbit {lowbit.__version__}: random Linear {args.in_features} -> {args.out_features}, "
          f"GPTQ g{args.group_size} asymmetric (v2 zeros), {torch.get_num_threads()} CPU threads")
    print(f"dense fp32 matmul, M=1: {dense_ms:.3f} ms\n")
    header = f"{'bits':>4}  {'MB':>6}  {'rel. error vs fp32':>18}  {'max |kernel - exact|':>20}  {'M=1 ms':>7}  {'vs dense':>8}"
    print(header)
    print("-" * len(header))
    for bits in (8, 4, 3, 2):
        q = lowbit.quantize_rtn(layer.weight, bits, args.group_size, sym=False, checkpoint_format="gptq_v2")
        gemm = lambda x: torch.ops.lowbit.gptq_gemm(x, q.qweight, q.qzeros, q.scales, q.g_idx, False, True, bits)
        out = gemm(x64)
        # Kernel error: both paths (M=1 fused, M=64 dequantize+matmul) against the
        # same weights dequantized exactly (fp32 scales) and multiplied in float64.
        w = torch.ops.lowbit.gptq_dequantize(q.qweight, q.qzeros, q.scales.float(), q.g_idx, True, bits).double()
        kernel_err = max((gemm(x) - (x.double() @ w)).abs().max().item() for x in (x1, x64))
        rel_err = ((out - ref).norm() / ref.norm()).item()
        ms = median_ms(lambda: gemm(x1))
        mb = sum(t.numel() * t.element_size() for t in (q.qweight, q.qzeros, q.scales)) / 1e6
        print(f"{bits:>4}  {mb:>6.1f}  {rel_err:>18.4f}  {kernel_err:>20.2e}  {ms:>7.3f}  {dense_ms / ms:>7.2f}x")


if __name__ == "__main__":
    main()
