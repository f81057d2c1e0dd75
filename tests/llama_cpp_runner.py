"""llama.cpp (llama-cpp-python, the optional extra `make deps` installs) as a
model the tests can compare lowbit's with: loaded with its extra weight
buffer types off, and callable like a transformers model."""
import numpy as np
import torch

import llama_cpp


def llama_without_extra_buffers(**kwargs):
    """llama_cpp.Llama with llama.cpp's extra weight buffer types (repacked
    and AMX layouts) off: on a Xeon with AMX, llama-cpp-python 0.3.36 built
    for it (AMX_INT8 = 1) crashes with a segmentation fault in the first
    decode of a file with them on, and runs with them off. The plain CPU
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
        llm = llama_cpp.Llama(**kwargs)
    finally:
        low_level.llama_model_default_params = defaults
    assert not llm.model_params.use_extra_bufts
    return llm


class LlamaCppLogits:
    """llama.cpp as a callable with the transformers output shape: the logits
    of every position of ids [1, T], from an empty context."""

    def __init__(self, llm):
        self.llm = llm

    def __call__(self, ids):
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        scores = np.array(self.llm.scores[: ids.shape[1]], dtype=np.float32)
        return type("Output", (), {"logits": torch.from_numpy(scores)[None]})
