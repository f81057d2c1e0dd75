"""Prefill of long prompts, alone and on shared cores, and decode at their
length: lowbit as it loads
(a call over lowbit.threads.TORCH_TEAM_TOKENS tokens or more runs its
kernels on torch's threads, beside torch's own ops), lowbit with its kernels
on their own pool in every call (torch's ops on one thread), and llama.cpp.

    python -m benchmarks.bench_long_prompt [--tokens 2048] [--models smollm2,1b] [--rounds 2]

Each measurement is bench_e2e's (a fresh process per configuration, the
prompt from the shipped held-out text, `--threads` threads per library),
once alone and once beside a process that keeps one core busy, as
bench_shared_cores runs it; rounds interleave the configurations, and each
reports its median. A prompt's attention grows with the square of its
length: on the pool split torch's ops get one thread. Decode is measured
alone, over NEW_TOKENS steps that each attend to the whole prompt.
Results: benchmarks/results/<machine>-long-prompt.{txt,json,md}.
"""
import argparse
import os

from benchmarks import bench_e2e
from benchmarks.bench_shared_cores import BUSY_LOOP, measure_rounds, median
from benchmarks.cli import positive_int, require_llama_cpp

VARIANTS = ("lowbit", "lowbit-pool", "llama")
NEW_TOKENS = 32  # decode steps after the prompt
HEADERS = ["file", "prompt tokens", "library", "prefill alone", "beside busy", "ratio", "alone vs llama.cpp",
           "decode alone", "decode vs llama.cpp"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048", help="prompt lengths, comma-separated")
    ap.add_argument("--models", default="smollm2,1b", help="of smollm2,1b (bench_e2e's files)")
    ap.add_argument("--threads", type=positive_int, default=2, help="threads of every library (default 2)")
    ap.add_argument("--rounds", type=positive_int, default=2, help="rounds of every configuration (default 2)")
    args = ap.parse_args()

    from benchmarks.common import RESULTS, machine, print_table, printed_to, write_results

    try:
        lengths = [positive_int(t) for t in args.tokens.split(",")]
    except argparse.ArgumentTypeError as e:
        ap.error(f"--tokens {args.tokens}: {e}")
    models = args.models.split(",")
    if not set(models) <= {"smollm2", "1b"}:
        ap.error(f"--models {args.models}: choose from smollm2, 1b")
    require_llama_cpp("bench_long_prompt")
    gguf = [(label, path) for label, path, variants in bench_e2e.files(models, args.threads) if "llama" in variants]
    cases = [(label, path, n, v) for label, path in gguf for n in lengths for v in VARIANTS]
    prompts = {n: bench_e2e.prompt_ids(n) for n in lengths}
    short = [n for n in lengths if len(prompts[n]) < n]
    if short:
        ap.error(f"--tokens {args.tokens}: the shipped held-out text has {len(prompts[short[0]])} tokens")
    load_before = os.getloadavg()
    records = measure_rounds(
        cases, args.rounds,
        lambda c: dict(variant=c[3], path=c[1], threads=args.threads, prompt=prompts[c[2]], new_tokens=NEW_TOKENS,
                       reps=1),
        lambda c: f"{c[0]}, {c[2]} tokens, {bench_e2e.VARIANTS[c[3]]}", lambda rec: f"{rec['prefill_tps']:.0f} tok/s")
    load_after = os.getloadavg()

    rows, summary = [], []
    for case in cases:
        label, path, n, variant = case
        alone, busy = median(records, case, False, "prefill_tps"), median(records, case, True, "prefill_tps")
        llama = median(records, (label, path, n, "llama"), False, "prefill_tps")
        decode, llama_decode = (median(records, c, False, "decode_tps") for c in (case, (label, path, n, "llama")))
        rows.append([label, str(n), bench_e2e.VARIANTS[variant], f"{alone:.1f}", f"{busy:.1f}",
                     f"{busy / alone:.2f}", f"{alone / llama:.2f}x", f"{decode:.1f}", f"{decode / llama_decode:.2f}x"])
        summary.append(dict(file=label, prompt_tokens=n, variant=variant, prefill_alone=alone,
                            prefill_beside_busy=busy, ratio=busy / alone, vs_llama_cpp=alone / llama,
                            decode_alone=decode, decode_vs_llama_cpp=decode / llama_decode))
    info = machine()
    stem = os.path.join(RESULTS, f"{info['slug']}-long-prompt")
    cpus = os.cpu_count()
    lines = [f"machine: {info['name']} ({cpus} CPUs), {args.threads} threads per library; load average "
             f"{load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end.",
             f"prefill tokens/s (the prompt's first token out); decode tokens/s: {NEW_TOKENS} greedy steps after "
             f"it, each attending to the whole prompt; median of {args.rounds} rounds, each configuration "
             f"in a fresh process; busy: another process spinning ({BUSY_LOOP!r}).",
             f"ratio: beside busy / alone ({(cpus - 1) / cpus:.2f} is a proportional slowdown with one of {cpus} "
             f"cores taken); vs llama.cpp (alone): above 1, lowbit faster.",
             "Command: `python -m benchmarks.bench_long_prompt"
             + (f" --tokens {args.tokens}" if args.tokens != "2048" else "")
             + (f" --models {args.models}" if args.models != "smollm2,1b" else "")
             + (f" --threads {args.threads}" if args.threads != 2 else "")
             + (f" --rounds {args.rounds}" if args.rounds != 2 else "") + "`."]
    with printed_to(stem + ".txt"):
        print_table(HEADERS, rows)
        print()
        print("\n".join(lines))
    with open(stem + ".md", "w") as f:
        f.write(f"# Long prompts: prefill, and decode at their length, {info['name']}, {args.threads} threads\n\n")
        f.write("| " + " | ".join(HEADERS) + " |\n|---|---:|---|" + "---:|" * (len(HEADERS) - 3) + "\n")
        f.writelines("| " + " | ".join(r) + " |\n" for r in rows)
        f.write("\n" + "\n\n".join(lines) + "\n")
    write_results(stem + ".json", dict(machine=info, threads=args.threads, rounds=args.rounds, lengths=lengths,
                                       load_average_start=load_before, load_average_end=load_after, summary=summary,
                                       records={f"{c[0]} {c[2]} {c[3]} {'busy' if b else 'alone'}": recs
                                                for (c, b), recs in records.items()}))


if __name__ == "__main__":
    main()
