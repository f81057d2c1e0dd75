"""lowbit's CUDA kernels on one GPU, against torch's dense fp16 matmul of the
same shape in the same run (and, for gptq_gemm, torch's bf16 matmul and its
CUDA int4 kernel, aten._weight_int4pack_mm, on the 4-bit rows), with achieved
GB/s against the device's copy bandwidth measured in the same run.

    python -m benchmarks.bench_cuda [--quick] [--no-crossover] [--device cuda:0]

- gptq_gemm, bits 2/3/4/8, group size 128, fp16 activations, on the
  Llama-70B MLP shapes (K x N) 8192x28672 and 28672x8192 and on 4096x14336:
  at M = 1 and 16 as plain, act-order shuffled (use_exllama=True, the fast
  layout) and act-order unshuffled (g_idx) weights; then an M sweep 1..4096
  (plain) as shipped (fp16 activations: the tensor-core kernel up to its
  M, 3-bit the CUDA-core one), and -- unless --no-crossover -- the same sweep
  with the CUDA-core fused kernel and with the dequantize + cuBLAS path
  forced (LOWBIT_CUDA_GPTQ_FUSED_MAX_M with LOWBIT_CUDA_GPTQ_MMA_MAX_M=0, in
  child processes), and the tensor-core kernel forced past its M (M >= 128,
  LOWBIT_CUDA_GPTQ_MMA_MAX_M), which is the measurement the crossover
  constants in csrc/cuda/gptq_gemm.cu are set from.
- GGUF: ggml_mul_mat_vec_a8 (the fused kernel at any M) at M = 1, 8, 16, 32,
  64 and ggml_mul_mat_a8 with its large-M path forced at every M
  (LOWBIT_CUDA_GGML_FUSED_MAX_M=0: the int8 tensor-core kernel, on compute
  capability 8.0 and later) at M = 16, 32, 64 and 512 for
  Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS and IQ2_XS (the one type here decoded
  a block per thread) on the same shapes (W is [N, K]):
  the crossover fused_max_m in csrc/cuda/ggml_matmul.cu is set from them.
  Unless --no-crossover, the M >= 64 rows again in a child process with the
  dequantize + cuBLAS path forced (LOWBIT_CUDA_GGML_MMQ_MAX_M=0): the
  tensor-core kernel's switch mmq_max_m is set from the pair.
- GGUF experts: ggml_mul_mat_id on Qwen3-30B-A3B's expert shapes (128
  experts, 8 per token, gate/up 768x2048 and down 2048x768) for 1, 32 and
  512 tokens (the last past 8 pairs per expert: the tensor-core tiles per
  expert on compute capability 8.0 and later), Q4_K and Q8_0; GB/s counts each chosen expert's bytes once; the
  peer is torch's fp16 bmm over the chosen experts' dense weights.

GB/s counts the weight bytes the op must read (qweight + qzeros + scales
[+ g_idx or q_perm] for GPTQ, the block bytes for GGUF) over the time; "of bw"
is that over the measured device-to-device copy bandwidth (bytes read +
written), the ceiling for a weight-streaming kernel. Times are medians of
CUDA-event samples after warm-up; weights are rotated among enough copies to
exceed twice the L2 cache, so repeated calls do not run from L2.

Writes benchmarks/results/<gpu>-cuda.md and .json (<gpu> from
benchmarks.machine.short_device_name, e.g. h100). Without a GPU, or with a lowbit
built without CUDA kernels, it says so and exits with status 1.
"""
import argparse
import json
import os
import subprocess
import sys

import torch

# The repository root: the forced sweeps' child processes run this module from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SHAPES = [(8192, 28672), (28672, 8192), (4096, 14336)]  # (K = in features, N = out features)
BITS = [2, 3, 4, 8]
GROUP = 128
SWEEP_MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
FUSED_SWEEP_MAX_M = 512  # the forced-fused sweep stops here (it re-decodes W per 8 rows)
# The sliced types (decoded 32 elements per lane) and IQ2_XS, one decoded a block per thread.
GGUF_TYPES = {"Q4_0": 2, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_0": 8, "IQ4_XS": 23, "IQ2_XS": 17}
GGUF_HALF_FIELDS = {"Q4_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "Q8_0": [0], "IQ4_XS": [0],
                    "IQ2_XS": [0]}
# ggml_mul_mat_vec_a8 runs the fused kernel at every M and ggml_mul_mat_a8, in
# this process, the large-M path (forced): the pairs at M = 16, 32, 64 give the crossover,
# and M = 512 the large-batch figure.
GGUF_CASES = ([("ggml_mul_mat_vec_a8", m) for m in (1, 8, 16, 32, 64)]
              + [("ggml_mul_mat_a8", m) for m in (16, 32, 64, 512)])
MOE = dict(experts=128, slots=8, shapes=[(768, 2048), (2048, 768)], tokens=[1, 32, 512], types=["Q4_K", "Q8_0"])


def fail(message, who="bench_cuda"):
    sys.exit(f"{who}: {message}")


def load_lowbit(who="bench_cuda"):
    """Exits, saying why (as `who`), unless lowbit imports with CUDA kernels and a GPU is present."""
    try:
        import lowbit  # noqa: F401  (loads torch.ops.lowbit)
    except ImportError as e:
        fail(f"cannot import lowbit ({e}); build it first (pip install --no-build-isolation -e .)", who)
    if not torch.cuda.is_available():
        fail("no CUDA device (torch.cuda.is_available() is False, torch " + torch.__version__ + "); nothing to measure",
             who)
    if not torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm", "CUDA"):
        fail("this lowbit build has no CUDA kernels; rebuild with CUDA (LOWBIT_CUDA=1, see README)", who)


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def copies_for(nbytes, device):
    """How many copies of an operand of nbytes make a rotation that L2 cannot hold."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    return max(1, min(8, -(-2 * l2 // max(nbytes, 1))))


class Rotation:
    """Cycles through equivalent operand sets, one per call."""

    def __init__(self, sets):
        self.sets = sets
        self.i = 0

    def next(self):
        s = self.sets[self.i]
        self.i = (self.i + 1) % len(self.sets)
        return s


def gptq_weight(K, N, bits, variant, device, seed):
    """(qweight, qzeros, scales, index, use_exllama) with random contents."""
    g = torch.Generator(device=device).manual_seed(seed)
    groups = K // GROUP
    qweight = torch.randint(-(2**31), 2**31, (K * bits // 32, N), dtype=torch.int64, device=device, generator=g)
    qweight = qweight.to(torch.int32)
    qzeros = torch.randint(-(2**31), 2**31, (groups, N * bits // 32), dtype=torch.int64, device=device, generator=g)
    qzeros = qzeros.to(torch.int32)
    scales = (torch.rand(groups, N, device=device, generator=g) / 2**bits + 1e-3).to(torch.float16)
    if variant == "plain":
        return qweight, qzeros, scales, torch.empty(0, dtype=torch.int32, device=device), False
    perm = torch.randperm(K, device=device, generator=g)
    g_idx = torch.empty(K, dtype=torch.int32, device=device)
    g_idx[perm] = (torch.arange(K, device=device) // GROUP).to(torch.int32)  # act-order: scattered, equal groups
    if variant == "actorder-unshuffled":
        return qweight, qzeros, scales, g_idx, False
    q_perm = torch.argsort(g_idx, stable=True).to(torch.int32)
    torch.ops.lowbit.gptq_shuffle(qweight, q_perm, bits)
    return qweight, qzeros, scales, q_perm, True


def nbytes_of(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def gguf_weight(name, rows, n, device, seed):
    """uint8 [rows, row_bytes] of random blocks with finite fp16 scale fields."""
    block, nbytes = torch.ops.lowbit.ggml_type_info(GGUF_TYPES[name])
    g = torch.Generator(device=device).manual_seed(seed)
    raw = torch.randint(0, 256, (rows, n // block * nbytes), dtype=torch.uint8, device=device, generator=g)
    blocks = raw.view(rows, n // block, nbytes)
    for off in GGUF_HALF_FIELDS[name]:
        halves = (torch.randn(rows, n // block, device=device, generator=g) * 0.05).to(torch.float16)
        blocks[:, :, off : off + 2] = halves.view(torch.uint8).view(rows, n // block, 2)
    return raw


# ---------------------------------------------------------------------------
# measurements
# ---------------------------------------------------------------------------


class Bench:
    def __init__(self, device, quick):
        from benchmarks.common import cuda_copy_bandwidth_gbs, cuda_time_ms

        self.device = device
        self.quick = quick
        self.time = lambda fn: cuda_time_ms(fn, warmup=3, samples=5 if quick else 15)
        self.bandwidth = cuda_copy_bandwidth_gbs(device)
        self.dense_cache = {}
        self.weight_cache = {}

    def dense_ms(self, K, N, M, dtype=torch.float16):
        key = (K, N, M, dtype)
        if key not in self.dense_cache:
            w = torch.randn(K, N, device=self.device, dtype=dtype)
            a = torch.randn(M, K, device=self.device, dtype=dtype)
            self.dense_cache[key] = self.time(lambda: a @ w)
            del w
        return self.dense_cache[key]

    def torch_int4_ms(self, K, N, M):
        """torch's CUDA int4 kernel (aten._weight_int4pack_mm: bf16 activations, g128 scales and
        zeros) on a random weight of the same shape, or None where this torch or GPU lacks it."""
        key = ("int4", K, N, M)
        if key not in self.dense_cache:
            try:
                packed = torch.ops.aten._convert_weight_to_int4pack(
                    torch.randint(0, 256, (N, K // 2), dtype=torch.uint8, device=self.device), 8)
                scale_zeros = torch.rand(K // GROUP, N, 2, device=self.device).bfloat16()
                a = torch.randn(M, K, device=self.device, dtype=torch.bfloat16)
                self.dense_cache[key] = self.time(
                    lambda: torch.ops.aten._weight_int4pack_mm(a, packed, GROUP, scale_zeros))
            except (RuntimeError, AttributeError) as e:
                print(f"  torch int4 kernel unavailable ({str(e).splitlines()[0][:120]})", flush=True)
                self.dense_cache[key] = None
        return self.dense_cache[key]

    def gptq_sets(self, K, N, bits, variant):
        key = (K, N, bits, variant)
        if key not in self.weight_cache:
            self.weight_cache.clear()  # keep one weight (with its copies) on the device at a time
            first = gptq_weight(K, N, bits, variant, self.device, 0)
            sets = [first] + [gptq_weight(K, N, bits, variant, self.device, s)
                              for s in range(1, copies_for(nbytes_of(*first[:4]), self.device))]
            self.weight_cache[key] = sets
        return self.weight_cache[key]

    def gptq(self, K, N, bits, variant, M):
        sets = self.gptq_sets(K, N, bits, variant)
        rot = Rotation(sets)
        a = torch.randn(M, K, device=self.device, dtype=torch.float16)

        def op():
            qweight, qzeros, scales, idx, exllama = rot.next()
            return torch.ops.lowbit.gptq_gemm(a, qweight, qzeros, scales, idx, exllama, True, bits)

        ms = self.time(op)
        gbs = nbytes_of(*sets[0][:4]) / (ms * 1e-3) / 1e9
        dense = self.dense_ms(K, N, M)
        dense_bf16 = self.dense_ms(K, N, M, torch.bfloat16)
        int4 = self.torch_int4_ms(K, N, M) if bits == 4 else None
        return dict(kind="gptq_gemm", K=K, N=N, bits=bits, group_size=GROUP, variant=variant, M=M, ms=ms, gbs=gbs,
                    bandwidth_fraction=gbs / self.bandwidth, dense_fp16_ms=dense, speedup_vs_fp16=dense / ms,
                    dense_bf16_ms=dense_bf16, speedup_vs_bf16=dense_bf16 / ms, torch_int4_ms=int4,
                    speedup_vs_torch_int4=int4 / ms if int4 else None)

    def gguf(self, name, K, N, op_name, M):
        first = gguf_weight(name, N, K, self.device, 0)
        sets = [first] + [gguf_weight(name, N, K, self.device, s) for s in range(1, copies_for(nbytes_of(first), self.device))]
        rot = Rotation(sets)
        x = torch.randn(M, K, device=self.device, dtype=torch.float16)
        fn = getattr(torch.ops.lowbit, op_name)
        t = GGUF_TYPES[name]
        ms = self.time(lambda: fn(rot.next(), x, t, N))
        gbs = nbytes_of(first) / (ms * 1e-3) / 1e9
        dense = self.dense_ms(K, N, M)
        return dict(kind=op_name, type=name, K=K, N=N, M=M, ms=ms, gbs=gbs, bandwidth_fraction=gbs / self.bandwidth,
                    dense_fp16_ms=dense, speedup_vs_fp16=dense / ms)

    def moe(self, name, rows, n, tokens):
        E, slots = MOE["experts"], MOE["slots"]
        first = gguf_weight(name, E * rows, n, self.device, 0)
        sets = [first] + [gguf_weight(name, E * rows, n, self.device, s)
                          for s in range(1, copies_for(nbytes_of(first), self.device))]
        sets = [w.view(E, rows, -1) for w in sets]
        rot = Rotation(sets)
        g = torch.Generator(device=self.device).manual_seed(tokens)
        ids = torch.rand(tokens, E, device=self.device, generator=g).topk(slots, dim=1).indices.to(torch.int32)
        x = torch.randn(tokens, n, device=self.device, dtype=torch.float16)
        t = GGUF_TYPES[name]
        ms = self.time(lambda: torch.ops.lowbit.ggml_mul_mat_id(rot.next(), x, ids, t, rows))
        experts, counts = torch.unique(ids, return_counts=True)
        chosen = int(experts.numel())
        gbs = nbytes_of(first) // E * chosen / (ms * 1e-3) / 1e9
        # The peer: torch's fp16 bmm over the chosen experts' dense weights, each
        # expert's rows of x gathered and padded to the most any expert has
        # (the grouping itself not timed).
        dense_w = [torch.randn(chosen, n, rows, device=self.device, dtype=torch.float16)
                   for _ in range(copies_for(chosen * n * rows * 2, self.device))]
        dense_rot = Rotation(dense_w)
        xp = torch.randn(chosen, int(counts.max()), n, device=self.device, dtype=torch.float16)
        dense = self.time(lambda: torch.bmm(xp, dense_rot.next()))
        del dense_w
        return dict(kind="ggml_mul_mat_id", type=name, rows=rows, n=n, experts=E, slots=slots, tokens=tokens,
                    chosen_experts=chosen, ms=ms, gbs=gbs, bandwidth_fraction=gbs / self.bandwidth,
                    dense_fp16_ms=dense, speedup_vs_fp16=dense / ms)


def sweep(bench, shapes, bits_list, ms_list):
    out = []
    for K, N in shapes:
        for bits in bits_list:
            for M in ms_list:
                out.append(bench.gptq(K, N, bits, "plain", M))
                print(f"  sweep {K}x{N} {bits}-bit M={M}: {out[-1]['ms']:.4f} ms", flush=True)
    return out


def child_sweep(args):
    """--child-sweep: runs in a process whose LOWBIT_CUDA_GPTQ_FUSED_MAX_M forces one path."""
    load_lowbit()
    device = torch.device(args.device)
    bench = Bench(device, args.quick)
    shapes = SHAPES[:1] if args.quick else SHAPES
    ms_list = [m for m in SWEEP_MS if args.child_min_m <= m <= args.child_max_m]
    records = sweep(bench, shapes, BITS, ms_list)
    print("CHILD-JSON " + json.dumps(records), flush=True)


def child_gguf(args):
    """--child-gguf: ggml_mul_mat_a8's large-M rows in a process whose
    LOWBIT_CUDA_GGML_MMQ_MAX_M=0 forces the dequantize + cuBLAS path."""
    load_lowbit()
    bench = Bench(torch.device(args.device), args.quick)
    shapes = SHAPES[:1] if args.quick else SHAPES
    records = [bench.gguf(name, K, N, op_name, M) for K, N in shapes for name in GGUF_TYPES
               for op_name, M in GGUF_CASES if op_name == "ggml_mul_mat_a8" and M >= 64]
    print("CHILD-JSON " + json.dumps(records), flush=True)


def run_child(args, flag, env, extra=()):
    """The records a child process (`flag`, with `env` forcing one path) prints."""
    cmd = [sys.executable, "-m", "benchmarks.bench_cuda", flag, *extra, "--device", args.device]
    cmd += ["--quick"] if args.quick else []
    proc = subprocess.run(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1", **env), cwd=ROOT, capture_output=True,
                          text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("CHILD-JSON "):
            return json.loads(line[len("CHILD-JSON "):])
    print(proc.stdout[-2000:], proc.stderr[-2000:], sep="\n")
    fail(f"the forced run ({flag}, {env}) failed with status {proc.returncode}")


def run_forced(args, fused_max_m, max_m):
    # The tensor-core kernel off: the forced sweeps time the CUDA-core kernel and the large-M paths.
    return run_child(args, "--child-sweep", dict(LOWBIT_CUDA_GPTQ_FUSED_MAX_M=str(fused_max_m),
                                                 LOWBIT_CUDA_GPTQ_MMA_MAX_M="0"), ["--child-max-m", str(max_m)])


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def md_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def gptq_rows(records):
    def us(ms):
        return f"{ms * 1e3:.1f}" if ms else "-"

    def x(ratio):
        return f"{ratio:.2f}x" if ratio else "-"

    return [[f"{r['K']}x{r['N']}", r["bits"], r["variant"], r["M"], us(r["ms"]), f"{r['gbs']:.0f}",
             f"{100 * r['bandwidth_fraction']:.0f}%", us(r["dense_fp16_ms"]), x(r["speedup_vs_fp16"]),
             us(r.get("dense_bf16_ms")), x(r.get("speedup_vs_bf16")), us(r.get("torch_int4_ms")),
             x(r.get("speedup_vs_torch_int4"))]
            for r in records]


GPTQ_HEADERS = ["K x N", "bits", "weights", "M", "lowbit µs", "GB/s", "of bw", "fp16 dense µs", "vs fp16",
                "bf16 dense µs", "vs bf16", "torch int4 µs", "vs torch int4"]


def crossover_rows(shipped, fused, dequant, mma):
    by_key = lambda recs: {(r["K"], r["N"], r["bits"], r["M"]): r for r in recs}
    paths = [("fused", by_key(fused)), ("dequant+cuBLAS", by_key(dequant)), ("tensor-core", by_key(mma))]
    rows = []
    for r in shipped:
        k = (r["K"], r["N"], r["bits"], r["M"])
        timed = [(name, recs[k]["ms"]) for name, recs in paths if k in recs]
        cells = [f"{recs[k]['ms'] * 1e3:.1f}" if k in recs else "-" for _, recs in paths]
        best = min(timed, key=lambda t: t[1])[0] if len(timed) > 1 else "-"
        rows.append([f"{r['K']}x{r['N']}", r["bits"], r["M"], f"{r['ms'] * 1e3:.1f}", *cells, best,
                     f"{r['dense_fp16_ms'] * 1e3:.1f}"])
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="the CUDA device to measure (default cuda)")
    parser.add_argument("--quick", action="store_true", help="one shape, fewer samples")
    parser.add_argument("--no-crossover", action="store_true", help="skip the forced-path sweeps")
    parser.add_argument("--child-sweep", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-gguf", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--child-max-m", type=int, default=max(SWEEP_MS), help=argparse.SUPPRESS)
    parser.add_argument("--child-min-m", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ["LOWBIT_CUDA_GGML_FUSED_MAX_M"] = "0"  # read at the first GGUF call (children inherit it)
    if args.child_sweep:
        return child_sweep(args)
    if args.child_gguf:
        return child_gguf(args)

    load_lowbit()
    from benchmarks.common import RESULTS, machine
    from benchmarks.machine import short_device_name

    try:
        device = torch.device(args.device)
    except RuntimeError as e:
        parser.error(f"--device {args.device}: {e}")
    if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
        parser.error(f"--device {args.device}: not one of this machine's {torch.cuda.device_count()} CUDA devices")
    info = machine(device)
    info["gpu"] = torch.cuda.get_device_name(device)
    info["cuda"] = torch.version.cuda
    bench = Bench(device, args.quick)
    print(f"device: {info['gpu']}, torch {info['torch']} (CUDA {info['cuda']})")
    print(f"measured copy bandwidth: {bench.bandwidth:.0f} GB/s (read + write)\n", flush=True)
    shapes = SHAPES[:1] if args.quick else SHAPES

    gptq_main = []
    for K, N in shapes:
        for bits in BITS:
            for variant in ("plain", "actorder-shuffled", "actorder-unshuffled"):
                for M in (1, 16):
                    gptq_main.append(bench.gptq(K, N, bits, variant, M))
                    r = gptq_main[-1]
                    print(f"  gptq {K}x{N} {bits}-bit {variant} M={M}: {r['ms'] * 1e3:.1f} µs, "
                          f"{r['gbs']:.0f} GB/s", flush=True)
    bench.weight_cache.clear()
    gptq_sweep = sweep(bench, shapes, BITS, SWEEP_MS)
    bench.weight_cache.clear()

    gguf = []
    for K, N in shapes:
        for name in GGUF_TYPES:
            for op_name, M in GGUF_CASES:
                gguf.append(bench.gguf(name, K, N, op_name, M))
                r = gguf[-1]
                print(f"  {op_name} {name} {N}x{K} M={M}: {r['ms'] * 1e3:.1f} µs, {r['gbs']:.0f} GB/s", flush=True)

    moe = []
    for name in MOE["types"]:
        for rows, n in MOE["shapes"]:
            for tokens in MOE["tokens"]:
                moe.append(bench.moe(name, rows, n, tokens))
                r = moe[-1]
                print(f"  ggml_mul_mat_id {name} {rows}x{n} tokens={tokens}: {r['ms'] * 1e3:.1f} µs, "
                      f"{r['gbs']:.0f} GB/s", flush=True)

    # The report is written here and again after the forced runs, so a run stopped during them keeps it.
    stem = os.path.join(RESULTS, f"{short_device_name(device)}-cuda")
    forced = dict(fused=[], dequant=[], mma=[], gguf_cublas=[])
    write_report(stem, info, args, gptq_main, gptq_sweep, gguf, moe, forced)
    if not args.no_crossover:
        del bench
        torch.cuda.empty_cache()
        print("forced-path sweeps (child processes) ...", flush=True)
        forced["fused"] = run_forced(args, 1 << 30, FUSED_SWEEP_MAX_M)
        forced["dequant"] = run_forced(args, 0, max(SWEEP_MS))
        # The tensor-core kernel past its M (where it serves: 2/4/8-bit), against the shipped large-M paths.
        forced["mma"] = run_child(args, "--child-sweep", dict(LOWBIT_CUDA_GPTQ_MMA_MAX_M=str(1 << 30)),
                                  ["--child-min-m", "128"])
        forced["gguf_cublas"] = run_child(args, "--child-gguf", dict(LOWBIT_CUDA_GGML_MMQ_MAX_M="0"))
        write_report(stem, info, args, gptq_main, gptq_sweep, gguf, moe, forced)


def write_report(stem, info, args, gptq_main, gptq_sweep, gguf, moe, forced):
    """<stem>.md and .json from the records (forced: the child processes' records, empty until they ran)."""
    cublas_us = {(r["type"], r["K"], r["N"], r["M"]): f"{r['ms'] * 1e3:.1f}" for r in forced["gguf_cublas"]}
    sections = [
        f"# lowbit CUDA benchmarks: {info['gpu']}\n",
        f"torch {info['torch']}, CUDA {info['cuda']}; measured device copy bandwidth "
        f"{bench_bw(gptq_main):.0f} GB/s (read + write). Command: `python -m benchmarks.bench_cuda"
        f"{' --quick' if args.quick else ''}{' --no-crossover' if args.no_crossover else ''}`. lowbit and the fp16 "
        "dense matmul take fp16 activations, the bf16 dense matmul and torch's int4 kernel "
        "(`aten._weight_int4pack_mm`, 4-bit rows) bf16 ones; GB/s = lowbit's weight bytes read / time.\n",
        "## gptq_gemm, group size 128 (M = 1 and 16)\n",
        md_table(GPTQ_HEADERS, gptq_rows(gptq_main)),
        "\n## gptq_gemm M sweep (plain weights, as shipped)\n",
        md_table(GPTQ_HEADERS, gptq_rows(gptq_sweep)),
    ]
    if forced["fused"] or forced["dequant"]:
        sections += [
            "\n## gptq_gemm: shipped (tensor-core kernel up to its M) vs the CUDA-core fused kernel vs "
            "dequantize + cuBLAS vs the tensor-core kernel at M >= 128 (each forced; 3-bit takes the other paths "
            "there), for the crossover constants\n",
            md_table(["K x N", "bits", "M", "shipped µs", "fused µs", "dequant+cuBLAS µs", "tensor-core µs",
                      "faster", "fp16 dense µs"],
                     crossover_rows(gptq_sweep, forced["fused"], forced["dequant"], forced["mma"])),
        ]
    sections += [
        "\n## GGUF (W is N x K blocks; ggml_mul_mat_a8 with its large-M path forced: the int8 tensor-core "
        "kernel on compute capability 8.0 and later)\n",
        md_table(["op", "type", "N x K", "M", "lowbit µs", "GB/s", "of bw", "fp16 dense µs", "vs fp16",
                  "dequant+cuBLAS µs (forced)"],
                 [[r["kind"], r["type"], f"{r['N']}x{r['K']}", r["M"], f"{r['ms'] * 1e3:.1f}", f"{r['gbs']:.0f}",
                   f"{100 * r['bandwidth_fraction']:.0f}%", f"{r['dense_fp16_ms'] * 1e3:.1f}",
                   f"{r['speedup_vs_fp16']:.2f}x",
                   cublas_us.get((r["type"], r["K"], r["N"], r["M"]), "-") if r["kind"] == "ggml_mul_mat_a8" else "-"]
                  for r in gguf]),
        f"\n## GGUF experts (ggml_mul_mat_id, {MOE['experts']} experts, {MOE['slots']} per token; "
        "GB/s counts each chosen expert's bytes once)\n",
        md_table(["type", "rows x n", "tokens", "experts chosen", "pairs", "lowbit µs", "GB/s", "of bw",
                  "fp16 bmm µs", "vs fp16"],
                 [[r["type"], f"{r['rows']}x{r['n']}", r["tokens"], r["chosen_experts"], r["tokens"] * r["slots"],
                   f"{r['ms'] * 1e3:.1f}", f"{r['gbs']:.0f}", f"{100 * r['bandwidth_fraction']:.0f}%",
                   f"{r['dense_fp16_ms'] * 1e3:.1f}", f"{r['speedup_vs_fp16']:.2f}x"] for r in moe]),
    ]
    report = "\n".join(sections) + "\n"
    print("\n" + report)
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".md", "w") as f:
        f.write(report)
    with open(stem + ".json", "w") as f:
        json.dump(dict(machine=info, copy_bandwidth_gbs=bench_bw(gptq_main), activations="fp16",
                       gptq=gptq_main, gptq_sweep=gptq_sweep, gptq_sweep_fused=forced["fused"],
                       gptq_sweep_dequant_cublas=forced["dequant"], gptq_sweep_mma=forced["mma"], gguf=gguf,
                       gguf_dequant_cublas=forced["gguf_cublas"], gguf_experts=moe), f, indent=2)
    print(f"wrote {stem}.md and {stem}.json", flush=True)


def bench_bw(records):
    """The copy bandwidth the records were normalised by."""
    r = records[0]
    return r["gbs"] / r["bandwidth_fraction"]


if __name__ == "__main__":
    main()
