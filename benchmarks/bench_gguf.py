"""GGUF ops on the CPU against their peers, measured in the same run on the
same threads:

- matvec / small-batch matmul (M = 1, 8), and a prompt-sized batch
  (M = 128, prefill), of every main type against
  llama.cpp's CPU backend on identical blocks (tests/llama_cpp_peer.py, the optional
  llama-cpp-python extra) twice: on the plain blocks, and in the layout
  llama.cpp's model loader gives the weight (the first of the CPU backend's
  extra buffer types, AMX or CPU_REPACK, that takes the type and runs here,
  else the plain blocks); torch's dense fp32 and bf16 matmul of the same
  shape, and the machine's copy bandwidth;
- for the types with one, lowbit's repacked layout (ggml_repack, 16 rows
  interleaved; the same results bit for bit, the 32-element types' to fp32
  rounding where the kernels read their layout) beside the file's, in every
  table but dequantize;
- the matvec again with its weights streamed from memory, as a model's decode
  reads them: distinct copies of the weight, STREAMED_BYTES in all (more than
  the machines' last-level caches), multiplied in turn, on every side;
- dequantize of every type against gguf-py's NumPy dequantize.

    python -m benchmarks.bench_gguf [--quick] [--isa avx2] [--types NVFP4,Q1_0,Q2_0] [--shapes 2048x768,...]

Prints the tables and writes benchmarks/results/<machine>-gguf.json, .txt and
a PNG of matvec throughput per type against the peers; with --isa, lowbit's
kernels of that ISA (torch.ops.lowbit.cpu_isa) and files named
<machine>-<isa>-gguf.*; with --types, those types in every table instead of
the main ones (and in dequantize instead of all), in files named
<machine>-gguf-<types>.* (the gguf-py column of Q1_0 and Q2_0, which gguf-py
cannot dequantize, times the tests' NumPy reference instead); with --shapes,
the M = 1 and 8 tables alone at those weight shapes, in files named
<machine>-gguf[-<types>]-<shapes>.*. The llama.cpp peer comes from llama-cpp-python, or
from LOWBIT_GGML_LIB_DIR (tests/llama_cpp_peer.py): to meet the AVX2 kernels, a
ggml built for AVX2 only (benchmarks/README.md). Each comparison is
timed in alternating rounds, each side's fastest round reported
(common.time_rounds_ms), so that load from elsewhere on a shared machine
cannot land on one side only.
"""
import argparse
import os

from benchmarks.common import (CopyBandwidth, add_isa_argument, force_isa, machine,  # first: sets THP
                               openmp_header, print_table, printed_to, results_dir, time_rounds_ms, write_results)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import lowbit  # noqa: E402,F401  (loads torch.ops.lowbit)
from tests import gguf_blocks as gb  # noqa: E402  (valid random blocks of every type)
from tests import llama_cpp_peer  # noqa: E402  (llama.cpp's ggml_mul_mat through llama-cpp-python's libggml)

MAIN_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"]
SHAPES = [(14336, 4096), (4096, 14336)]  # (rows = out features, n = in features)
MS = [1, 8]
PREFILL_M = 128  # a prompt's worth of rows: compute-bound, so GFLOP/s rather than GB/s
THREADS = [1, 2]
# Weights the streamed matvec goes through in turn: 3x the Xeon VM's 480 MB L3,
# so no copy is still cached when its turn comes again.
STREAMED_BYTES = 1.5e9


def dequant_table(rng, rows, n, budget, types):
    """Each type against gguf-py and against the floor any dequantizer that
    returns a fresh fp32 tensor pays: allocating and filling [rows, n] fp32
    (the kernel zeroes every new page before the first write). gguf-py ms /
    floor ms is the largest speedup over gguf-py that is possible at all."""
    rows_out, records = [], []
    for name in types:
        raw = gb.random_blocks(rng, name, rows, n)
        W = torch.from_numpy(raw)
        t = gb.type_id(name)
        ms, numpy_ms, floor_ms = time_rounds_ms([lambda: torch.ops.lowbit.ggml_dequantize(W, t, rows, n, torch.float32),
                                                 lambda: gb.dequantize(raw, name),
                                                 lambda: torch.empty(rows, n).fill_(1.0)], min_reps=3, budget_s=budget)
        gbs = raw.nbytes / (ms * 1e-3) / 1e9
        records.append(dict(type=name, rows=rows, n=n, lowbit_ms=ms, input_gbs=gbs, gguf_py_ms=numpy_ms,
                            speedup_vs_gguf_py=numpy_ms / ms, fresh_output_floor_ms=floor_ms))
        rows_out.append([name, f"{ms:.2f}", f"{gbs:.2f}", f"{numpy_ms:.1f}", f"{numpy_ms / ms:.1f}x",
                         f"{floor_ms:.2f}", f"{ms / floor_ms:.2f}x", f"{numpy_ms / floor_ms:.1f}x"])
    print_table(["type", "lowbit ms", "GB/s in", "gguf-py ms", "vs gguf-py", "floor ms", "of floor", "floor vs gguf-py"],
                rows_out)
    print("floor: a fresh fp32 tensor of the output's shape allocated and filled (torch.empty(...).fill_), "
          "timed in the same rounds; 'floor vs gguf-py' is the most any dequantizer returning a new tensor can reach")
    return records


def runnable_extra_buffers(nbytes, t, rows, n, M, threads):
    """The extra buffer types that take this matmul and run here, in loader
    order, and why the others were left out ({name: reason}); each one that
    takes it is first tried in a child process, since one that crashes would
    take the benchmark with it."""
    runs, left_out = [], {}
    for buffer in llama_cpp_peer.extra_buffers():
        if not llama_cpp_peer.buffer_takes(t, rows, n, M, buffer):
            left_out[buffer] = "does not take the type or shape"
            continue
        why = llama_cpp_peer.runs_in_subprocess(nbytes, t, rows, n, M, threads, buffer)
        if why is None:
            runs.append(buffer)
        else:
            left_out[buffer] = why
    return runs, left_out


def loader_layout_peers(raw_np, t, rows, n, M, threads):
    """llama.cpp's matmul in each extra buffer type that takes this weight and
    runs here ({name: GgmlMatmul}, in loader order), and why the others were
    left out ({name: reason})."""
    runs, left_out = runnable_extra_buffers(raw_np.nbytes, t, rows, n, M, threads)
    return {b: llama_cpp_peer.GgmlMatmul(raw_np, t, rows, n, M, 1, buffer=b) for b in runs}, left_out


def repacked(raw, t, rows, n):
    """The weight in lowbit's repacked layout, or None for a type without one."""
    return torch.ops.lowbit.ggml_repack(raw, t, rows, n) if lowbit.gguf.repacking.has_repacked_layout(t) else None


def sums_in_block_order(t):
    """Whether the active kernels' repacked matmul of type t sums each block's
    dot in int32 first (the 32-element types where they read the layout),
    agreeing with the file layout's to fp32 rounding rather than bit for bit."""
    return torch.ops.lowbit.ggml_type_info(t)[0] == 32 and torch.ops.lowbit.cpu_reads_repacked(t)


def repacked_fields(packed_ms, ms, layout_ms):
    """A record's repacked-layout entries (NaN for a type without the layout)."""
    return dict(repacked_ms=packed_ms, repacked_speedup_vs_file_layout=ms / packed_ms,
                repacked_speedup_vs_llama_cpp_loader_layout=layout_ms / packed_ms)


def matmul_table(rng, shapes, types, threads_list, budget, bandwidth, batch_sizes=MS):
    """Times every case, sampling the copy bandwidth at each shape."""
    peer_missing = llama_cpp_peer.available()
    if peer_missing:
        print(peer_missing)
    else:
        print(f"llama.cpp's extra buffer types here: {', '.join(llama_cpp_peer.extra_buffers()) or 'none'}")
    records = []
    for rows, n in shapes:
        torch.set_num_threads(max(threads_list))
        bandwidth.sample()
        dense = torch.randn(rows, n)
        dense16 = dense.bfloat16()
        for M in batch_sizes:
            x = torch.randn(M, n)
            x16 = x.bfloat16()
            dense_ms = {}
            for threads in threads_list:
                torch.set_num_threads(threads)
                dense_ms[threads] = time_rounds_ms([lambda: torch.nn.functional.linear(x, dense),
                                                    lambda: torch.nn.functional.linear(x16, dense16)], budget_s=budget)
            for name in types:
                raw_np = gb.random_blocks(rng, name, rows, n)
                raw = torch.from_numpy(raw_np)
                t = gb.type_id(name)
                op = torch.ops.lowbit.ggml_mul_mat_vec_a8 if M == 1 else torch.ops.lowbit.ggml_mul_mat_a8
                packed = repacked(raw, t, rows, n)
                if packed is not None:  # the same results, or the timing means nothing
                    got, want = torch.ops.lowbit.ggml_mul_mat_repacked(packed, x, t, rows), op(raw, x, t, rows)
                    if sums_in_block_order(t):
                        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), name
                    else:
                        assert torch.equal(got, want), name
                peer = None if peer_missing else llama_cpp_peer.GgmlMatmul(raw_np, t, rows, n, M, 1)
                extra, left_out = ({}, {}) if peer_missing else loader_layout_peers(raw_np, t, rows, n, M,
                                                                                    max(threads_list))
                agree = float("nan")
                if peer:  # the same blocks and activations through both: they must agree
                    for p in [peer, *extra.values()]:
                        p.set_input(x.numpy())
                    peer.compute()
                    ref = peer.result()
                    agree = float(np.abs(op(raw, x, t, rows).numpy() - ref).max() / max(np.abs(ref).max(), 1e-30))
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    for p in [peer, *extra.values()] if peer else []:
                        p.threads = threads
                    ms, packed_ms, peer_ms, *extra_ms = time_rounds_ms(
                        [lambda: op(raw, x, t, rows),
                         packed is not None and (lambda: torch.ops.lowbit.ggml_mul_mat_repacked(packed, x, t, rows)),
                         peer and peer.compute, *(p.compute for p in extra.values())],
                        budget_s=budget)
                    extra_ms = dict(zip(extra, extra_ms))
                    # What llama.cpp's loader would run: the first extra buffer that takes W, else plain blocks.
                    layout, layout_ms = next(iter(extra_ms.items()), ("plain", peer_ms))
                    fp32_ms, bf16_ms = dense_ms[threads]
                    gbs = raw.numel() / (ms * 1e-3) / 1e9
                    records.append(dict(type=name, rows=rows, n=n, M=M, threads=threads, lowbit_ms=ms,
                                        weight_gbs=gbs, llama_cpp_ms=peer_ms,
                                        speedup_vs_llama_cpp=peer_ms / ms, max_rel_diff_vs_llama_cpp=agree,
                                        llama_cpp_extra_buffer_ms=extra_ms, llama_cpp_extra_buffer_left_out=left_out,
                                        llama_cpp_loader_layout=layout, llama_cpp_loader_layout_ms=layout_ms,
                                        speedup_vs_llama_cpp_loader_layout=layout_ms / ms,
                                        **repacked_fields(packed_ms, ms, layout_ms),
                                        torch_fp32_ms=fp32_ms, torch_bf16_ms=bf16_ms,
                                        speedup_vs_fp32=fp32_ms / ms, speedup_vs_bf16=bf16_ms / ms))
    torch.set_num_threads(max(threads_list))
    return records


def streamed_matvec_table(rng, shape, types, threads_list, budget):
    """M = 1 with the weights streamed from memory: per type, copies of one
    weight (STREAMED_BYTES in all) multiplied in turn by lowbit, by llama.cpp
    on the plain blocks and in its loader's layout; each side's time per
    matvec is its time for all copies over their number."""
    if llama_cpp_peer.available():
        return []
    rows, n = shape
    records = []
    for name in types:
        one = gb.random_blocks(rng, name, rows, n)
        t = gb.type_id(name)
        copies = max(2, int(STREAMED_BYTES // one.nbytes))
        x = torch.randn(1, n)
        raws = [torch.from_numpy(one.copy()) for _ in range(copies)]
        runs, _ = runnable_extra_buffers(one.nbytes, t, rows, n, 1, max(threads_list))
        layout = runs[0] if runs else "plain"
        plain = [llama_cpp_peer.GgmlMatmul(r.numpy(), t, rows, n, 1, 1) for r in raws]
        extra = [llama_cpp_peer.GgmlMatmul(r.numpy(), t, rows, n, 1, 1, buffer=layout) for r in raws] if runs else []
        for p in plain + extra:
            p.set_input(x.numpy())

        packs = [repacked(r, t, rows, n) for r in raws] if lowbit.gguf.repacking.has_repacked_layout(t) else []

        def lowbit_all():
            for r in raws:
                torch.ops.lowbit.ggml_mul_mat_vec_a8(r, x, t, rows)

        def lowbit_repacked_all():
            for p in packs:
                torch.ops.lowbit.ggml_mul_mat_repacked(p, x, t, rows)

        def peers_all(peers):
            return lambda: [p.compute() for p in peers]

        for threads in threads_list:
            torch.set_num_threads(threads)
            for p in plain + extra:
                p.threads = threads
            ms, packed_ms, plain_ms, layout_ms = (v / copies for v in time_rounds_ms(
                [lowbit_all, packs and lowbit_repacked_all, peers_all(plain), extra and peers_all(extra)], min_reps=2,
                budget_s=2 * budget))
            if not extra:  # the loader leaves the plain blocks
                layout_ms = plain_ms
            records.append(dict(type=name, rows=rows, n=n, M=1, threads=threads, copies=copies, lowbit_ms=ms,
                                weight_gbs=one.nbytes / (ms * 1e-3) / 1e9, llama_cpp_ms=plain_ms,
                                speedup_vs_llama_cpp=plain_ms / ms, llama_cpp_loader_layout=layout,
                                llama_cpp_loader_layout_ms=layout_ms,
                                speedup_vs_llama_cpp_loader_layout=layout_ms / ms,
                                **repacked_fields(packed_ms, ms, layout_ms)))
        del raws, packs, plain, extra
    torch.set_num_threads(max(threads_list))
    return records


def print_streamed(records, bandwidth):
    rows_out = []
    for r in records:
        r["bandwidth_fraction_same_threads"] = r["weight_gbs"] / bandwidth.gbs_at(r["threads"])
        peer_gbs = r["weight_gbs"] * r["lowbit_ms"] / r["llama_cpp_loader_layout_ms"]
        rows_out.append([f"{r['rows']}x{r['n']}", r["threads"], r["type"], r["copies"], f"{r['lowbit_ms']:.2f}",
                         f"{r['weight_gbs']:.1f}", f"{100 * r['bandwidth_fraction_same_threads']:.0f}%",
                         f"{r['llama_cpp_ms']:.2f}", f"{r['speedup_vs_llama_cpp']:.2f}x", *loader_layout_cells(r),
                         f"{peer_gbs:.1f}", *repacked_cells(r)])
    print_table(["rows x n", "thr", "type", "copies", "lowbit ms", "GB/s", "of thr bw", "llama.cpp ms", "vs llama.cpp",
                 *LOADER_LAYOUT_HEADER, "its GB/s", *REPACKED_HEADER], rows_out)
    print(LOADER_LAYOUT_NOTE)
    print(REPACKED_NOTE)


def print_matmul(records, bandwidth):
    """The matmul table, each case's GB/s also as a fraction of the machine's copy
    bandwidth (of bw) and of the copy on the case's own threads (of thr bw),
    both stored in the records."""
    rows_out = []
    for r in records:
        r["bandwidth_fraction"] = r["weight_gbs"] / bandwidth.gbs
        r["bandwidth_fraction_same_threads"] = r["weight_gbs"] / bandwidth.gbs_at(r["threads"])
        rows_out.append([f"{r['rows']}x{r['n']}", r["M"], r["threads"], r["type"], f"{r['lowbit_ms']:.2f}",
                         f"{r['weight_gbs']:.1f}", f"{100 * r['bandwidth_fraction']:.0f}%",
                         f"{100 * r['bandwidth_fraction_same_threads']:.0f}%", f"{r['llama_cpp_ms']:.2f}",
                         f"{r['speedup_vs_llama_cpp']:.2f}x", f"{r['max_rel_diff_vs_llama_cpp']:.0e}",
                         *loader_layout_cells(r), *repacked_cells(r),
                         f"{r['torch_fp32_ms']:.2f}", f"{r['speedup_vs_fp32']:.1f}x", f"{r['speedup_vs_bf16']:.1f}x"])
    print_table(["rows x n", "M", "thr", "type", "lowbit ms", "GB/s", "of bw", "of thr bw", "llama.cpp ms", "vs llama.cpp",
                 "rel diff", *LOADER_LAYOUT_HEADER, *REPACKED_HEADER, "fp32 ms", "vs fp32", "vs bf16"], rows_out)
    print(LOADER_LAYOUT_NOTE)
    print(REPACKED_NOTE)
    print_left_out(records)


LOADER_LAYOUT_HEADER = ["loader layout", "its ms", "vs it"]
REPACKED_HEADER = ["repacked ms", "vs file", "vs loader"]
REPACKED_NOTE = ("repacked: lowbit's repacked layout (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, the K-quants, IQ4_XS; "
                 "the same results bit for bit, the 32-element types' to fp32 rounding), its time and "
                 "its speedup over lowbit's file layout and over "
                 "llama.cpp's loader layout")


def repacked_cells(r):
    if r["repacked_ms"] != r["repacked_ms"]:  # NaN: no repacked layout
        return ["-", "-", "-"]
    return [f"{r['repacked_ms']:.2f}", f"{r['repacked_speedup_vs_file_layout']:.2f}x",
            f"{r['repacked_speedup_vs_llama_cpp_loader_layout']:.2f}x"]
LOADER_LAYOUT_NOTE = ("llama.cpp ms: ggml_mul_mat on the plain blocks; loader layout: the layout llama.cpp's model "
                      "loader gives the weight (the first extra buffer type that takes it and runs here, else plain), "
                      "its time and lowbit's speedup over it")


def loader_layout_cells(r):
    measured = r["llama_cpp_loader_layout_ms"] == r["llama_cpp_loader_layout_ms"]  # NaN: no llama.cpp peer ran
    return [r["llama_cpp_loader_layout"] if measured else "-", f"{r['llama_cpp_loader_layout_ms']:.2f}",
            f"{r['speedup_vs_llama_cpp_loader_layout']:.2f}x"]


def print_left_out(records):
    """Each extra buffer type left out of a case and why, once per distinct reason."""
    seen = {}
    for r in records:
        for buffer, why in r.get("llama_cpp_extra_buffer_left_out", {}).items():
            if "does not take" not in why:  # a type the buffer has no kernel for is no news
                seen.setdefault((buffer, why), []).append(f"{r['type']} M={r['M']}")
    for (buffer, why), cases in seen.items():
        print(f"left out {buffer} ({why}): {', '.join(sorted(set(cases)))}")


def print_prefill(records):
    """The prefill table: multiply-adds per second (2 M rows n / time)."""
    rows_out = []
    for r in records:
        r["gflops"] = 2 * r["M"] * r["rows"] * r["n"] / (r["lowbit_ms"] * 1e-3) / 1e9
        rows_out.append([f"{r['rows']}x{r['n']}", r["M"], r["threads"], r["type"], f"{r['lowbit_ms']:.2f}",
                         f"{r['gflops']:.0f}", f"{r['llama_cpp_ms']:.2f}", f"{r['speedup_vs_llama_cpp']:.2f}x",
                         f"{r['max_rel_diff_vs_llama_cpp']:.0e}", *loader_layout_cells(r), *repacked_cells(r),
                         f"{r['torch_fp32_ms']:.2f}", f"{r['speedup_vs_fp32']:.2f}x", f"{r['speedup_vs_bf16']:.2f}x"])
    print_table(["rows x n", "M", "thr", "type", "lowbit ms", "GFLOP/s", "llama.cpp ms", "vs llama.cpp", "rel diff",
                 *LOADER_LAYOUT_HEADER, *REPACKED_HEADER, "fp32 ms", "vs fp32", "vs bf16"], rows_out)
    print(LOADER_LAYOUT_NOTE)
    print(REPACKED_NOTE)
    print_left_out(records)


def plot(records, bandwidth, info, path):
    """Weight GB/s per type, M = 1, most threads, first shape: lowbit (file and repacked layouts) vs
    llama.cpp (plain blocks and its loader's layout) vs dense."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = max(r["threads"] for r in records)
    sel = [r for r in records if r["M"] == 1 and r["threads"] == threads]
    shape = (sel[0]["rows"], sel[0]["n"])
    sel = [r for r in sel if (r["rows"], r["n"]) == shape]
    names = [r["type"] for r in sel]
    gb_of = lambda ms, r: r["weight_gbs"] * r["lowbit_ms"] / ms  # same bytes, the peer's time
    series = {
        "lowbit": [r["weight_gbs"] for r in sel],
        "lowbit, repacked": [gb_of(r["repacked_ms"], r) for r in sel],
        "llama.cpp, plain blocks": [gb_of(r["llama_cpp_ms"], r) for r in sel],
        "llama.cpp, loader layout": [gb_of(r["llama_cpp_loader_layout_ms"], r) for r in sel],
    }
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.2
    for i, (label, vals) in enumerate(series.items()):
        ax.bar(np.arange(len(names)) + (i - 1.5) * width, vals, width, label=label)
    ax.axhline(bandwidth, color="k", linestyle="--", linewidth=1, label=f"copy bandwidth {bandwidth:.0f} GB/s")
    fp32_gbs = 4 * shape[0] * shape[1] / (sel[0]["torch_fp32_ms"] * 1e-3) / 1e9
    ax.axhline(fp32_gbs, color="gray", linestyle=":", linewidth=1, label=f"torch fp32 dense {fp32_gbs:.0f} GB/s")
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_ylabel("weight bytes read per second (GB/s)")
    ax.set_title(f"GGUF matvec {shape[0]}x{shape[1]}, M=1, {threads} threads — {info['name']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smaller shapes, shorter timing, and the first 3 main types unless --types names them")
    add_isa_argument(parser)
    parser.add_argument("--types", help="comma-separated ggml types to measure instead of the main ones")
    parser.add_argument("--shapes", help="comma-separated ROWSxN weight shapes (e.g. 2048x768): the M = 1 and 8 "
                                         "tables only, for those shapes instead of the main ones")
    args = parser.parse_args()
    try:
        shapes = [tuple(map(int, shape.split("x"))) for shape in args.shapes.split(",")] if args.shapes else None
    except ValueError:
        parser.error(f"--shapes: {args.shapes!r} is not a list of ROWSxN")
    types = args.types.split(",") if args.types else None
    for name in types or []:
        if name not in gb.TYPES:
            parser.error(f"--types: {name!r} is not one of {', '.join(gb.TYPES)}")
    matmul_types = types or (MAIN_TYPES[:3] if args.quick else MAIN_TYPES)
    for rows, n in shapes or []:
        whole = [gb.block_shape(name)[0] for name in matmul_types]
        if rows < 1 or n < 1 or any(n % block for block in whole):
            parser.error(f"--shapes: {rows}x{n} needs ROWS and N from 1, N a multiple of {max(whole)} "
                         f"(the blocks of {', '.join(matmul_types)})")
    budget = 0.1 if args.quick else 0.2  # per round of time_rounds_ms
    rng = np.random.default_rng(0)
    force_isa(parser, args.isa)

    info = machine()
    threads = [1] if args.quick else [t for t in THREADS if t <= torch.get_num_threads()]
    stem = f"{info['slug']}-{args.isa}-gguf" if args.isa else f"{info['slug']}-gguf"
    if types:
        stem += "-" + "-".join(name.lower() for name in types)
    if shapes:
        stem += "-" + "-".join(f"{rows}x{n}" for rows, n in shapes)
    stem = os.path.join(results_dir(args.quick), stem)
    with printed_to(f"{stem}.txt"):
        bandwidth = CopyBandwidth(threads=threads)
        print(f"machine: {info['name']} ({info['threads']} threads), torch {info['torch']}, "
              f"CPU kernels: {torch.ops.lowbit.cpu_isa()}, {openmp_header()}")
        if os.environ.get("LOWBIT_GGML_LIB_DIR"):
            print(f"llama.cpp peer: libggml from LOWBIT_GGML_LIB_DIR={os.environ['LOWBIT_GGML_LIB_DIR']}")
        only_matmul = bool(shapes)
        shapes = shapes or ([(4096, 4096)] if args.quick else SHAPES)
        mm = matmul_table(rng, shapes, matmul_types, threads, budget, bandwidth)
        torch.set_num_threads(max(threads))
        bandwidth.sample()
        print(bandwidth.describe() + "\n")
        print("matmul with 8-bit activations (GB/s = weight bytes / time)")
        print_matmul(mm, bandwidth)
        pf = [] if args.quick or only_matmul else matmul_table(rng, shapes[:1], matmul_types, threads, budget, bandwidth,
                                                batch_sizes=[PREFILL_M])
        if pf:
            print(f"\nprefill: a batch of M = {PREFILL_M} activation rows")
            print_prefill(pf)
        st = [] if args.quick or only_matmul else streamed_matvec_table(rng, shapes[0], matmul_types, threads, budget)
        if st:
            print(f"\nmatvec (M = 1) with the weights streamed from memory: copies of the weight, "
                  f"{STREAMED_BYTES / 1e9:.1f} GB in all, multiplied in turn (ms per matvec)")
            print_streamed(st, bandwidth)
        elif not (args.quick or only_matmul):
            print(f"\nmatvec with the weights streamed from memory: left out, {llama_cpp_peer.available()}")
        dq = []
        if not only_matmul:
            print(f"\ndequantize to fp32, {1024 if args.quick else 4096} x 4096 weights, {max(threads)} threads")
            dq = dequant_table(rng, 1024 if args.quick else 4096, 4096, budget, types or gb.TYPES)
    write_results(f"{stem}.json", dict(machine=info, cpu_isa=torch.ops.lowbit.cpu_isa(),
                                       ggml_lib_dir=os.environ.get("LOWBIT_GGML_LIB_DIR"),
                                       **bandwidth.as_record(), dequantize=dq, matmul=mm, prefill=pf,
                                       streamed_matvec=st))
    if not args.quick and not only_matmul and not llama_cpp_peer.available():
        plot(mm, bandwidth.gbs, info, f"{stem}.png")



if __name__ == "__main__":
    main()
