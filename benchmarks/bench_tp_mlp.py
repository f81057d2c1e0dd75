"""Tensor-parallel act-order GPTQ MLP latency: the naive baseline (Algorithm 2:
AllGather + permute before the row-parallel down projection) against
TP-aware dequantization (Algorithm 3: reordered offline, one AllReduce), in
the shape of Hoque et al.'s tables (MLP sizes of Llama-70B and Granite-20B,
4-bit, group size 128, act-order; M tokens; TP ranks).

    python -m benchmarks.bench_tp_mlp [--quick] [--reps N]

Each TP size runs as that many gloo processes on this machine, with the
cores split between them (oversubscribed when TP exceeds the cores), so the
numbers show the algorithms' cost on CPU, not GPU-cluster behaviour. The
weights are random but valid act-order GPTQ tensors. A rep is timed from a
barrier to the end of the forward on each rank; a rep's time is the slowest
rank's, and the table shows the median over reps.

Writes benchmarks/results/<machine>-tp.json and -tp.png (--quick: under the temp directory).
On the 2-core dev machine --quick takes about 20 s and the full sweep a few
minutes; its slowest cells are TP=1, M=16 (about 8 s per Llama-70B forward).
"""
import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.cli import positive_int
from benchmarks.common import machine, print_table, results_dir, write_results
from lowbit.gptq import GPTQConfig
from lowbit.gptq.checkpoint import write_checkpoint
from lowbit.gptq.tp import NaiveTPMLP, TPAwareMLP, reorder_checkpoint

MODELS = {"Llama-70B": (8192, 28672), "Granite-20B": (6144, 24576)}  # (hidden, intermediate)
MS = [1, 2, 4, 8, 16]
TPS = [1, 2, 4]
BITS, GROUP = 4, 128
PREFIX = "model.layers.0.mlp"


def random_act_order(K, N, rng):
    """Valid 4-bit act-order GPTQ tensors with random contents: every bit
    pattern is a valid weight, and g_idx gives each group GROUP scattered rows."""
    words = lambda *shape: torch.from_numpy(rng.integers(0, 2**32, shape, dtype=np.uint32).view(np.int32))
    g_idx = np.empty(K, dtype=np.int32)
    g_idx[rng.permutation(K)] = np.arange(K) // GROUP
    return {
        "qweight": words(K * BITS // 32, N),
        "qzeros": words(K // GROUP, N * BITS // 32),
        "scales": torch.from_numpy((rng.random((K // GROUP, N)) * 0.01 + 0.001).astype(np.float16)),
        "g_idx": torch.from_numpy(g_idx),
    }


def write_mlp(directory, hidden, inter):
    """An act-order checkpoint of one SwiGLU MLP."""
    rng = np.random.default_rng(0)
    shapes = {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {f"{PREFIX}.{part}.{name}": t for part, (K, N) in shapes.items()
               for name, t in random_act_order(K, N, rng).items()}
    config = GPTQConfig(bits=BITS, group_size=GROUP, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    write_checkpoint(directory, tensors, {"quantization_config": config.to_dict()})


def timed(mlps, x, reps):
    """Per-rep latencies (ms) of each MLP, the slowest rank's, and each MLP's
    last output. Reps alternate between the MLPs (in alternating order) so
    that load changes on a shared machine hit both alike."""
    times = torch.empty(len(mlps), reps, dtype=torch.float64)
    outputs = [None] * len(mlps)
    for i in range(reps):
        for j in (range(len(mlps)) if i % 2 == 0 else reversed(range(len(mlps)))):
            dist.barrier()
            t0 = time.perf_counter()
            outputs[j] = mlps[j](x)
            times[j, i] = (time.perf_counter() - t0) * 1e3
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist(), outputs


def worker(rank, tp, init_file, original, reordered, hidden, ms, reps, out_file):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // tp))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp,
                            timeout=timedelta(minutes=10))
    naive = NaiveTPMLP.from_checkpoint(original, PREFIX, rank, tp)
    aware = TPAwareMLP.from_checkpoint(reordered, PREFIX, rank, tp)
    records = []
    with torch.no_grad():
        # Warm-up: the first forward builds the act-order layers' shuffled weights.
        for mlp in (naive, aware):
            mlp(torch.zeros(1, hidden))
        for m in ms:
            x = torch.randn(m, hidden, generator=torch.Generator().manual_seed(m))  # the same on every rank
            (naive_ms, aware_ms), (ref, out) = timed([naive, aware], x, reps)
            records.append(dict(m=m, naive_ms=naive_ms, tp_aware_ms=aware_ms,
                                max_rel_diff=((out - ref).abs().max() / ref.abs().max()).item()))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(records, f)
    dist.destroy_process_group()


def run_tp(tp, work, original, reordered, hidden, ms, reps):
    init_file, out_file = os.path.join(work, f"init-{tp}"), os.path.join(work, f"result-{tp}.json")
    mp.spawn(worker, args=(tp, init_file, original, reordered, hidden, ms, reps, out_file), nprocs=tp, join=True)
    with open(out_file) as f:
        return json.load(f)


def plot(records, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    ms = sorted({r["m"] for r in records})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        top, bottom = axes[0][col], axes[1][col]
        for i, tp in enumerate(sorted({r["tp"] for r in records})):
            rows = [r for r in records if r["model"] == model and r["tp"] == tp]
            m = [r["m"] for r in rows]
            color = f"C{i}"
            top.plot(m, [r["naive_ms"] for r in rows], "--o", color=color, label=f"TP={tp} naive")
            top.plot(m, [r["tp_aware_ms"] for r in rows], "-o", color=color, label=f"TP={tp} TP-aware")
            bottom.plot(m, [r["speedup"] for r in rows], "-o", color=color, label=f"TP={tp}")
        top.set(title=f"{model} MLP, {BITS}-bit g{GROUP} act-order", xlabel="M (tokens)", ylabel="median ms",
                xscale="log", yscale="log")
        bottom.axhline(1.0, color="gray", lw=0.8)
        bottom.set(xlabel="M (tokens)", ylabel="speedup (naive / TP-aware)", xscale="log")
        for ax in (top, bottom):
            ax.xaxis.set_minor_locator(NullLocator())  # label only the measured M
            ax.set_xticks(ms, labels=[str(m) for m in ms])
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="Granite-20B only, M in {1, 8}, TP in {1, 2}")
    parser.add_argument("--reps", type=positive_int, default=5, help="timed forwards per cell (default 5)")
    args = parser.parse_args()
    models = ["Granite-20B"] if args.quick else list(MODELS)
    ms, tps = ([1, 8], [1, 2]) if args.quick else (MS, TPS)

    info = machine()
    print(f"machine: {info['name']} ({info['cores']} cores), torch {info['torch']}, gloo; "
          f"{BITS}-bit g{GROUP} act-order, {args.reps} reps per cell\n")
    records, rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as work:
        for model in models:
            hidden, inter = MODELS[model]
            original, reordered = os.path.join(work, f"{model}"), os.path.join(work, f"{model}-tp")
            write_mlp(original, hidden, inter)
            reorder_checkpoint(original, reordered)
            for tp in tps:
                for r in run_tp(tp, work, original, reordered, hidden, ms, args.reps):
                    naive, aware = statistics.median(r["naive_ms"]), statistics.median(r["tp_aware_ms"])
                    rec = dict(model=model, hidden=hidden, intermediate=inter, tp=tp, m=r["m"], naive_ms=naive,
                               tp_aware_ms=aware, speedup=naive / aware, naive_reps_ms=r["naive_ms"],
                               tp_aware_reps_ms=r["tp_aware_ms"], max_rel_diff=r["max_rel_diff"],
                               threads_per_rank=max(1, (os.cpu_count() or 1) // tp))
                    records.append(rec)
                    rows.append([model, tp, r["m"], f"{naive:.1f}", f"{aware:.1f}", f"{naive / aware:.2f}x",
                                 f"{r['max_rel_diff']:.1e}"])
    print()
    print_table(["model", "TP", "M", "naive ms", "TP-aware ms", "speedup", "max rel diff"], rows)
    name = os.path.join(results_dir(args.quick), f"{info['slug']}-tp")
    write_results(f"{name}.json", dict(
        machine=info, bits=BITS, group_size=GROUP, act_order=True, backend="gloo", reps=args.reps, quick=args.quick,
        notes="TP ranks are processes on one CPU sharing its cores; a rep's time is the slowest rank's, from a "
              "barrier to the end of the forward; *_ms are medians over reps.",
        records=records))
    plot(records, models, f"{name}.png")


if __name__ == "__main__":
    main()
