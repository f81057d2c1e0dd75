"""The generated tables of lowbit's docs, from the tables the code holds and
the result files in benchmarks/results/.

    python -m benchmarks.results_tables               print every block (markdown)
    python -m benchmarks.results_tables support       print one block (support, summary, results)
    python -m benchmarks.results_tables --write       rewrite the blocks in README.md and benchmarks/README.md
    python -m benchmarks.results_tables --check       exit 1 where those blocks differ from what this prints

A block sits between "<!-- begin generated: NAME -->" and "<!-- end generated:
NAME -->" in its document:

    support  README.md          GGUF types (csrc/core/ggml_types.h, LOWBIT_GGML_TYPES) by CPU ISA and
                                backend (csrc/cpu/ggml_traits.h, LOWBIT_GGML_CPU_TRAITS), and the
                                GGUF architectures (python/lowbit/gguf/arch.py, ARCHITECTURES)
    summary  README.md          one table per machine: <machine>-gguf.json, <machine>-gptq.json and
                                smollm2-<machine>.md
    results  benchmarks/README.md  one table per result file, with its machine and command

Plain Python 3: it reads sources, JSON and markdown, and needs neither torch
nor a build of lowbit.
"""
import argparse
import glob
import json
import math
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DOCS = {"support": "README.md", "summary": "README.md", "results": "benchmarks/README.md"}
MAIN_SHAPE = (14336, 4096)  # bench_gguf.py's shape with streamed and prefill tables (rows x n)
GPTQ_SHAPE = (4096, 14336)  # bench_gptq_gemm.py's K x N of the same weight


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def cpu_traits():
    """{name: (repacked layout, ISAs reading it)} from LOWBIT_GGML_CPU_TRAITS, the CPU traits table."""
    source = read("csrc/cpu/ggml_traits.h")
    rows = re.findall(r"X\((\w+), (?:true|false), k\w+, \d+, (true|false), (\w+), \d+, (?:true|false)\)", source)
    if not rows:
        raise SystemExit("results_tables: LOWBIT_GGML_CPU_TRAITS not found in csrc/cpu/ggml_traits.h")
    return {name: (repacked == "true", reads) for name, repacked, reads in rows}


def ggml_types():
    """[(name, id, block elements, block bytes, activation format)] from LOWBIT_GGML_TYPES, in table order."""
    source = read("csrc/core/ggml_types.h")
    rows = re.findall(r"X\((\w+), (\d+), (\d+), (\d+), \d+, (?:true|false), (\w+)\)", source)
    if not rows:
        raise SystemExit("results_tables: LOWBIT_GGML_TYPES not found in csrc/core/ggml_types.h")
    return [(name, int(i), int(block), int(size), act) for name, i, block, size, act in rows]


def architectures():
    """[(GGUF architecture, transformers class, class with experts or None)] from gguf/arch.py's ARCHITECTURES."""
    source = read("python/lowbit/gguf/arch.py")
    table = source[source.index("ARCHITECTURES: dict"):]
    table = table[:table.index("\n}\n")]
    found = []
    for m in re.finditer(r'^    "([\w-]+)": Architecture\("(\w+)"(.*?)(?=^    "|\Z)', table, re.M | re.S):
        experts = re.search(r'with_experts=Architecture\("(\w+)"', m.group(3))
        found.append((m.group(1), m.group(2), experts.group(1) if experts else None))
    if not found:
        raise SystemExit("results_tables: ARCHITECTURES not found in python/lowbit/gguf/arch.py")
    return found


def support_block():
    traits = cpu_traits()
    has_layout = {name for name, (repacked, _) in traits.items() if repacked}
    avx2_reads = {name for name, (_, reads) in traits.items() if reads in ("kReadsAvx2", "kReadsBoth")}

    def simd(name, act, reads):
        if act == "Float":
            return "fp32 dot"
        return "SIMD" + (", **R**" if reads else "")

    out = ["| format / type | id | block: values, bytes | bits/weight | activations | portable | AVX2 | "
           "AVX-512 | repacked layout | CUDA |",
           "|---|---:|---|---:|---|---|---|---|---|---|",
           "| GPTQ 2/3/4/8-bit (v1 and v2 zeros, sym/asym, any group size, act-order) | | 32 fields per pack | "
           "2–8 + group metadata | fp32/fp16/bf16, or int8 (`gptq_gemm_a8`) | yes | SIMD | SIMD (+ `vdpbf16ps` for "
           "bf16/fp16 on AVX512-BF16, `vpdpbusd` for int8) | `gptq_shuffle`'s row order, every device | tested |"]
    for name, i, block, size, act in ggml_types():
        bits = f"{8 * size / block:.4g}"
        out.append(f"| GGUF {name} | {i} | {block}, {size} | {bits} | {'fp32' if act == 'Float' else act} | yes | "
                   f"{simd(name, act, name in avx2_reads)} | {simd(name, act, name in has_layout)} | "
                   f"{'yes' if name in has_layout else '—'} | tested |")
    out.append("")
    out.append("SIMD: the ISA's own kernels (levels cut out in vector registers). **R**: that ISA reads lowbit's repacked layout as "
               "it is (`torch.ops.lowbit.cpu_reads_repacked`); elsewhere a repacked weight is put back "
               "per call. CUDA tested: its kernels pass the CUDA tests on an H200, bit for bit or within the "
               "tests' fp32 tolerance of the CPU (`benchmarks/results/h200-cuda-checks.md`).")
    out.append("")
    archs = []
    for arch, cls, experts in architectures():
        archs.append(f"`{arch}` ({cls}" + (f"; with experts {experts}" if experts else "") + ")")
    out.append("GGUF architectures `load_gguf_model` and `replace_linear` take: " + ", ".join(archs) + ".")
    return "\n".join(out) + "\n"


# ---- result files -------------------------------------------------------------------------------------------------

def load_json(path):
    with open(path) as f:
        return json.load(f)


def finite(x):
    return isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x))


def ratio(x):
    return f"{x:.2f}x" if finite(x) else "—"


def ms(x):
    if not finite(x):
        return "—"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def header_lines(stem):
    """The first lines of the result file's printed table: its machine (and peer) as the benchmark wrote them."""
    path = os.path.join(RESULTS, stem + ".txt")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        lines = f.read().split("\n")
    return [line for line in lines[:3] if line.startswith(("machine:", "llama.cpp peer:"))]


def command(stem, data):
    """The command that writes benchmarks/results/<stem>.*, from the file's name and header."""
    env = []
    text = " ".join(header_lines(stem))
    if "OMP_WAIT_POLICY=ACTIVE" in text:
        env.append("OMP_WAIT_POLICY=ACTIVE")
    if data.get("ggml_lib_dir") or "LOWBIT_GGML_LIB_DIR" in text:
        env.append("LOWBIT_GGML_LIB_DIR=<ggml built for AVX2 only>")
    slug = data["machine"]["slug"]
    rest = stem[len(slug) + 1:]
    args = []
    isa = re.match(r"(portable|avx2|avx512)-", rest)
    if isa:
        args.append(f"--isa {isa.group(1)}")
        rest = rest[isa.end():]
    if rest.startswith("gguf-moe"):
        script = "bench_gguf_moe"
        if rest != "gguf-moe":
            args.append("--layers " + rest[len("gguf-moe-"):])
    elif rest.startswith("gguf"):
        script = "bench_gguf"
        words = rest.split("-")[1:]
        types = [w.upper() for w in words if not re.fullmatch(r"\d+x\d+", w)]
        shapes = [w for w in words if re.fullmatch(r"\d+x\d+", w)]
        if types:
            args.append("--types " + ",".join(types))
        if shapes:
            args.append("--shapes " + ",".join(shapes))
    elif rest == "gptq":
        script = "bench_gptq_gemm"
    elif rest == "tp":
        script = "bench_tp_mlp"
    else:
        raise SystemExit(f"results_tables: no command known for {stem}")
    return " ".join(env + [f"python -m benchmarks.{script}"] + args)


def bandwidth(data):
    by = data.get("copy_bandwidth_by_threads_gbs") or {}
    if not by:
        return ""
    parts = [f"{by[t]:.1f} GB/s on {t} thread{'s' if t != '1' else ''}" for t in sorted(by, key=int, reverse=True)]
    return "copy bandwidth " + ", ".join(parts)


def pair(entry):
    """'file / repacked' cell: lowbit's file layout over llama.cpp on the plain blocks, lowbit's repacked
    layout over llama.cpp in its loader's layout."""
    if entry is None:
        return "—"
    return f"{ratio(entry.get('speedup_vs_llama_cpp'))} / {ratio(entry.get('repacked_speedup_vs_llama_cpp_loader_layout'))}"


def index(entries):
    return {(e["type"], e["rows"], e["n"], e["M"], e["threads"]): e for e in entries or []}


def loader_layouts(cells):
    """llama.cpp's loader layout across a row's cells ("AMX → plain" where one failed at larger M and the next
    that runs was measured instead)."""
    seen = list(dict.fromkeys(e.get("llama_cpp_loader_layout") for e in cells if e and e.get("llama_cpp_loader_layout")))
    return " → ".join(seen) or "—"


def gguf_table(data, threads_list, shapes=None, compact=False):
    mm, streamed, prefill = index(data.get("matmul")), index(data.get("streamed_matvec")), index(data.get("prefill"))
    types = list(dict.fromkeys(e["type"] for e in data.get("matmul", [])))
    all_shapes = list(dict.fromkeys((e["rows"], e["n"]) for e in data.get("matmul", [])))
    shapes = shapes or ([MAIN_SHAPE] if MAIN_SHAPE in all_shapes and streamed else all_shapes)
    columns = [("M = 1, one weight", mm, 1)]
    if streamed:
        columns.append(("M = 1, streamed", streamed, 1))
    columns.append(("M = 8", mm, 8))
    prefill_m = sorted({e["M"] for e in data.get("prefill", [])})
    if prefill:
        columns.append((f"M = {prefill_m[0]}", prefill, prefill_m[0]))
    keys = "| type | llama.cpp loader layout | " if compact else "| rows x n | type | threads | llama.cpp loader layout | "
    out = [keys + " | ".join(c[0] for c in columns) + " |",
           ("|---|---|" if compact else "|---|---|---:|---|") + "---:|" * len(columns)]
    for rows, n in shapes:
        for t in types:
            for thr in threads_list:
                entries = [table.get((t, rows, n, m, thr)) for _, table, m in columns]
                key = f"| {t} | " if compact else f"| {rows}x{n} | {t} | {thr} | "
                out.append(key + loader_layouts(entries) + " | " + " | ".join(pair(e) for e in entries) + " |")
    return out


def dequantize_line(data):
    deq = data.get("dequantize") or []
    if not deq:
        return []
    speed = sorted(e["speedup_vs_gguf_py"] for e in deq if finite(e.get("speedup_vs_gguf_py")))
    rows, n = deq[0]["rows"], deq[0]["n"]
    ten = sum(s >= 10 for s in speed)
    return [f"`ggml_dequantize` ({rows}x{n}, fp32 out, {data['machine']['threads']} threads): {ten} of {len(speed)} "
            f"types at 10x gguf-py's NumPy dequantize or more; {speed[0]:.1f}x to {speed[-1]:.1f}x, median "
            f"{speed[len(speed) // 2]:.1f}x."]


def moe_table(data):
    out = ["| layer | tokens | threads | file ms | repacked ms | llama.cpp ms | file vs llama.cpp | "
           "repacked vs llama.cpp | file vs transformers fp32 |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for e in data["moe"]:
        out.append(f"| {e['layer']} | {e['tokens']} | {e['threads']} | {ms(e['lowbit_ms'])} | {ms(e['repacked_ms'])} | "
                   f"{ms(e['llama_cpp_ms'])} | {ratio(e['speedup_vs_llama_cpp'])} | "
                   f"{ratio(e['repacked_speedup_vs_llama_cpp'])} | {ratio(e['speedup_vs_transformers_fp32'])} |")
    return out


def gptq_table(data):
    most = max(e["threads"] for e in data["records"])
    int8 = all("lowbit_int8_ms" in e for e in data["records"])
    out = ["| K x N | M | bits | fp32 ms | vs torch fp32 | bf16 ms | vs torch bf16 | vs torch int4 |"
           + (" int8 ms | int8 vs torch fp32 |" if int8 else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if int8 else "")]
    for e in data["records"]:
        if e["threads"] != most:
            continue
        out.append(f"| {e['K']}x{e['N']} | {e['M']} | {e['bits']} | {ms(e['lowbit_ms'])} | {ratio(e['speedup_vs_fp32'])} | "
                   f"{ms(e['lowbit_bf16_ms'])} | {ratio(e['speedup_vs_bf16'])} | {ratio(e['speedup_vs_torch_int4'])} |"
                   + (f" {ms(e['lowbit_int8_ms'])} | {ratio(e['int8_speedup_vs_fp32'])} |" if int8 else ""))
    return out, most


def gptq_streamed_table(data):
    panels = all("panels_weight_gbs" in e for e in data["streamed"])  # runs before the panel columns lack them
    out = ["| K x N | threads | bits | fp32 act. ms | GB/s | int8 ms | int8 GB/s | int8 of copy bw | "
           "int8 vs torch fp32 | int8 vs torch int4 |" + (" panels GB/s | int8 panels GB/s |" if panels else ""),
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if panels else "")]
    for e in data["streamed"]:
        out.append(f"| {e['K']}x{e['N']} | {e['threads']} | {e['bits']} | {ms(e['lowbit_ms'])} | {e['weight_gbs']:.1f} | "
                   f"{ms(e['lowbit_int8_ms'])} | {e['int8_weight_gbs']:.1f} | "
                   f"{100 * e['int8_bandwidth_fraction_same_threads']:.0f}% | {ratio(e['int8_speedup_vs_fp32'])} | "
                   f"{ratio(e['int8_speedup_vs_torch_int4'])} |"
                   + (f" {e['panels_weight_gbs']:.1f} | {e['int8_panels_weight_gbs']:.1f} |" if panels else ""))
    return out


def tp_table(data):
    out = ["| model | TP | M | naive ms | TP-aware ms | speedup |", "|---|---:|---:|---:|---:|---:|"]
    for e in data["records"]:
        out.append(f"| {e['model']} | {e['tp']} | {e['m']} | {ms(e['naive_ms'])} | {ms(e['tp_aware_ms'])} | "
                   f"{ratio(e['speedup'])} |")
    return out


def markdown_table(path):
    """The first markdown table of a result .md file and the lines around it, as written."""
    with open(path) as f:
        return [line.rstrip() for line in f.read().strip().split("\n")]


PAIR_NOTE = ("Each cell: lowbit in the file's layout over llama.cpp on the same plain blocks / lowbit in its "
             "repacked layout over llama.cpp in the layout its loader gives the weight (above 1: lowbit faster; "
             "\"AMX → plain\": that layout failed from M = 2 and the next one that runs was measured).")


def results_block():
    out = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        stem = os.path.basename(path)[:-len(".json")]
        if os.path.exists(path[:-len(".json")] + ".md"):
            continue  # its own markdown table (below) says what it measured, with its command
        data = load_json(path)
        out += [f"#### `{stem}`", ""]
        out += [f"    {line}" for line in header_lines(stem)] or [f"    machine: {data['machine']['name']}"]
        out += ["", f"Command: `{command(stem, data)}`" + (f"; {bandwidth(data)}." if bandwidth(data) else "."), ""]
        if "moe" in data:
            out += moe_table(data)
            out += ["", "ms per layer call (gate, up and down), each the mean over "
                    f"{data.get('routings_per_call', 16)} routings."]
        elif "matmul" in data:
            threads = sorted({e["threads"] for e in data["matmul"]})
            out += gguf_table(data, threads)
            out += ["", PAIR_NOTE]
            out += [""] + dequantize_line(data) if data.get("dequantize") else []
        elif "bits" in data and "records" in data and "model" in data["records"][0]:
            out += tp_table(data)
        elif "records" in data:
            table, most = gptq_table(data)
            out += table + ["", f"{most} threads, g128, one weight multiplied call after call (a weight that fits "
                            "the L3 is read from cache); fp32 activations against torch's fp32 dense matmul, bf16 "
                            "activations against torch's bf16 dense matmul and its int4 kernel (4-bit only)."]
            if data.get("streamed"):
                out += ["", "M = 1 with the weights streamed from memory (distinct copies, 1.5 GB in all, in turn); "
                        "of copy bw: over the copy bandwidth on the same threads (read + write); torch int4 over "
                        "copies of its own layout; panels: gptq_gemm and gptq_gemm_a8 over the panel layout:", ""] + gptq_streamed_table(data)
        out.append("")
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.md"))):
        out += [f"#### `{os.path.basename(path)[:-3]}`", ""] + markdown_table(path) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def machines():
    """{slug: machine record} of every machine with a GGUF kernel run of its own
    kernels, a main job, an end-to-end or a shared-cores run."""
    found = {}
    for path in sorted(glob.glob(os.path.join(RESULTS, "*-gguf.json")) + glob.glob(os.path.join(RESULTS, "*-e2e.json"))
                       + glob.glob(os.path.join(RESULTS, "*-shared-cores.json"))):
        m = load_json(path)["machine"]
        suffix = os.path.basename(path)[len(m["slug"]):]
        if suffix in ("-gguf.json", "-e2e.json", "-shared-cores.json"):  # not a run with forced kernels (-avx2-)
            found.setdefault(m["slug"], m)
    return found


def summary_block():
    out = []
    for slug, m in machines().items():
        path = os.path.join(RESULTS, f"{slug}-gguf.json")
        if not os.path.exists(path):
            out += [f"**{m['name']}, {m['threads']} threads** (torch {m['torch']}; `benchmarks/results/{slug}-*`).", ""]
            out += main_job_lines(slug) + calibration_lines(slug) + e2e_lines(slug) + shared_cores_lines(slug)
            continue
        data = load_json(path)
        most = max(e["threads"] for e in data["matmul"])
        out += [f"**{m['name']}, {m['threads']} threads** ({data['cpu_isa']} kernels, torch {m['torch']}; "
                f"`benchmarks/results/{slug}-*`). GGUF matmuls, {MAIN_SHAPE[0]}x{MAIN_SHAPE[1]}, {most} threads:", ""]
        out += gguf_table(data, [most], compact=True)
        out += [""]
        gptq = os.path.join(RESULTS, f"{slug}-gptq.json")
        if os.path.exists(gptq):
            gptq_data = load_json(gptq)
            records = gptq_data["records"]
            pick = {e["M"]: e for e in records
                    if (e["K"], e["N"]) == GPTQ_SHAPE and e["threads"] == most and e["bits"] == 4}
            if pick:
                int4 = ", ".join(f"M = {M} {ratio(e['speedup_vs_torch_int4'])}" for M, e in sorted(pick.items()))
                fp32 = ", ".join(f"M = {M} {ratio(e['speedup_vs_fp32'])}" for M, e in sorted(pick.items()))
                int8 = ", ".join(f"M = {M} {ratio(e['int8_speedup_vs_fp32'])}" for M, e in sorted(pick.items())
                                 if "int8_speedup_vs_fp32" in e)
                out += [f"`gptq_gemm` 4-bit g128, K x N = {GPTQ_SHAPE[0]}x{GPTQ_SHAPE[1]}, {most} threads: bf16 "
                        f"activations over torch's int4 kernel {int4}; fp32 activations over torch's fp32 dense "
                        f"matmul {fp32}" + (f"; `gptq_gemm_a8` (int8) over the same {int8}" if int8 else "")
                        + " (one weight, call after call: a quantized one that fits the L3 stays there, the dense "
                        "one does not)." + streamed_gptq_sentence(gptq_data, most), ""]
        out += main_job_lines(slug) + calibration_lines(slug) + e2e_lines(slug) + shared_cores_lines(slug)
    if out:
        out += [PAIR_NOTE]
    return "\n".join(out).rstrip("\n") + "\n"


def streamed_gptq_sentence(data, threads):
    """The 4-bit M = 1 figures with the weights streamed from memory, where the run has them."""
    pick = [e for e in data.get("streamed", []) if e["bits"] == 4 and e["threads"] == threads]
    if not pick:
        return ""
    e = pick[0]
    return (f" Streamed from memory (M = 1): `gptq_gemm_a8` {e['int8_weight_gbs']:.1f} GB/s "
            f"({100 * e['int8_bandwidth_fraction_same_threads']:.0f}% of the copy bandwidth), fp32 activations "
            f"{e['weight_gbs']:.1f} GB/s"
            + (f" (in the panel layout {e['int8_panels_weight_gbs']:.1f} and {e['panels_weight_gbs']:.1f} GB/s)"
               if "panels_weight_gbs" in e else "")
            + f"; int8 over torch's fp32 dense matmul {ratio(e['int8_speedup_vs_fp32'])}, "
            f"over its int4 kernel {ratio(e['int8_speedup_vs_torch_int4'])}.")


def main_job_lines(slug):
    job = os.path.join(RESULTS, f"smollm2-{slug}.md")
    if not os.path.exists(job):
        return []
    rows = md_rows(job)
    names = [n for n in ("perplexity", "KL to fp32", "decode tok/s") if n in rows[0]]  # a file with KL has one more
    cells = "; ".join(f"{r['format']} " + " / ".join(r[n] for n in names) for r in rows)
    return [f"Main job (SmolLM2-135M, `make demo`), {' / '.join(names).replace('tok/s', 'tokens/s')}: {cells}.", ""]


def calibration_lines(slug):
    path = os.path.join(RESULTS, f"gptq-calibration-{slug}.md")
    if not os.path.exists(path):
        return []

    def label(r):
        if r["method"] == "round to nearest":
            return r["method"]
        return f"{r['calibration tokens']} tokens, {r['dampening']}" + (", act-order" if r["act-order"] == "yes" else "")
    cells = "; ".join(f"{label(r)} {r['KL to fp32']} / {r['perplexity']}" for r in md_rows(path))
    return [f"GPTQ 4-bit g128 calibration (SmolLM2, `python -m benchmarks.gptq_calibration`), KL to fp32 / "
            f"perplexity: {cells}.", ""]


def md_rows(path):
    """A result .md file's table as {column: cell} rows."""
    table = [[c.strip() for c in line.strip("|").split("|")] for line in markdown_table(path) if line.startswith("| ")]
    return [dict(zip(table[0], row)) for row in table[1:]]


def e2e_lines(slug):
    """One row per file of bench_e2e (its default models, then each --models run's):
    lowbit's faster layout against llama.cpp's default buffers."""
    default = os.path.join(RESULTS, f"{slug}-e2e.md")
    paths = [p for p in [default, *sorted(glob.glob(os.path.join(RESULTS, f"{slug}-e2e-*.md")))] if os.path.exists(p)]
    if not paths:
        return []
    rows = [r for path in paths for r in md_rows(path)]
    out = ["End-to-end generation (`python -m benchmarks.bench_e2e`), tokens/s, lowbit's faster layout "
           "(its loader's model, transformers' generate) over llama.cpp on the same file:", "",
           "| file | lowbit prefill / decode | llama.cpp prefill / decode | ratio prefill / decode |",
           "|---|---:|---:|---:|"]
    for name in dict.fromkeys(r["file"] for r in rows):
        ours = [r for r in rows if r["file"] == name and r["library"].startswith("lowbit")]
        # The row bench_e2e's ratios are over: the default buffers, or the plain blocks where those crashed.
        peer = [r for r in rows if r["file"] == name and r["library"].startswith("llama.cpp")
                and r["decode tok/s"] != "nan"]
        if not ours:
            continue
        best = max(ours, key=lambda r: float(r["decode tok/s"]))
        theirs = "—"
        if peer:
            kind = peer[0]["library"].removeprefix("llama.cpp, ")
            theirs = f"{peer[0]['prefill tok/s']} / {peer[0]['decode tok/s']}" + (
                "" if kind == "default buffers" else f" ({kind})")
        out.append(f"| {name}, {best['library'].removeprefix('lowbit, ')} | {best['prefill tok/s']} / {best['decode tok/s']} | "
                   f"{theirs} | {best['prefill vs llama.cpp']} / {best['decode vs llama.cpp']} |")
    return out + [""]


def shared_cores_lines(slug):
    path = os.path.join(RESULTS, f"{slug}-shared-cores.md")
    if not os.path.exists(path):
        return []
    def ratio(r, step):
        return float(r[f"{step} beside busy"]) / float(r[f"{step} alone"])

    cells = "; ".join(f"{r['library']} {ratio(r, 'prefill'):.2f} / {ratio(r, 'decode'):.2f}" for r in md_rows(path))
    return [f"Prefill / decode beside a process that keeps one of the two cores busy, over each alone "
            f"(`python -m benchmarks.bench_shared_cores`; 0.50 is proportional): {cells}.", ""]


BLOCKS = {"support": support_block, "summary": summary_block, "results": results_block}


def replace_block(text, name, body):
    begin, end = f"<!-- begin generated: {name} -->\n", f"<!-- end generated: {name} -->"
    if begin not in text or end not in text:
        raise SystemExit(f"results_tables: {DOCS[name]} has no '{begin.strip()}' ... '{end}' block")
    head, rest = text.split(begin, 1)
    return head + begin + body + end + rest.split(end, 1)[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("block", nargs="?", choices=sorted(BLOCKS), help="print only this block")
    parser.add_argument("--write", action="store_true", help="rewrite the blocks in their documents")
    parser.add_argument("--check", action="store_true", help="exit 1 where a document's block is out of date")
    args = parser.parse_args()
    names = [args.block] if args.block else list(BLOCKS)
    if not (args.write or args.check):
        for name in names:
            print(BLOCKS[name]())
        return 0
    stale = []
    for doc in sorted({DOCS[name] for name in names}):
        text = read(doc)
        new = text
        for name in names:
            if DOCS[name] == doc:
                new = replace_block(new, name, BLOCKS[name]())
        if new != text:
            stale.append(doc)
            if args.write:
                with open(os.path.join(ROOT, doc), "w") as f:
                    f.write(new)
    if args.check and stale:
        print(f"results_tables: out of date in {', '.join(stale)}: run python -m benchmarks.results_tables --write")
        return 1
    if args.write:
        print(f"results_tables: rewrote {', '.join(stale)}" if stale else "results_tables: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
