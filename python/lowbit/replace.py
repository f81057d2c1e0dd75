"""lowbit.replace_linear: load a quantized checkpoint into an existing PyTorch /
HF transformers model, swapping its nn.Linear layers for lowbit layers. Each
format places its own tensors (lowbit.gguf.model, lowbit.gptq.placing); this
module only tells the formats apart."""
from __future__ import annotations

import os

from torch import nn

from ._checks import check_module, check_path
from ._placing import ReplaceReport, check_no_meta, has_meta_tensors, rebuild_computed_buffers
from .gguf.file import GGUFError, is_gguf_path, load_gguf
from .gguf.model import check_config_matches, place_gguf_tensors
from .gptq.config import GPTQCheckpointError, check_format
from .gptq.placing import place_gptq_checkpoint
from .threads import kernel_threads

__all__ = ["ReplaceReport", "replace_linear"]


def replace_linear(model: nn.Module, path: str | os.PathLike, checkpoint_format: str | None = None) -> ReplaceReport:
    """Loads the checkpoint at `path` into `model`, swapping nn.Linear layers for
    lowbit layers. A model parameter the checkpoint does not provide raises
    ValueError; checkpoint tensors the model has no place for are warned about
    and listed in the report.

    A `.gguf` file of an architecture in lowbit.gguf.arch.ARCHITECTURES
    (names as llama.cpp's converter writes them; others raise ValueError):
    every nn.Linear the file
    has a quantized weight for becomes a GGUFLinear over the file's own
    blocks; embeddings, norms and biases are loaded as float tensors; what
    the converter did is undone: a llama file's Q/K row permutation on the
    quantized rows (and biases), the + 1 on a Gemma file's norm weights.

    A GPTQ checkpoint (a directory, or a .safetensors file beside its config):
    every module with a qweight becomes a GPTQLinear holding the checkpoint's
    tensors, and the per-expert layers of a mixture of experts
    (`<...>.experts.<e>.gate_proj`, `up_proj`, `down_proj`) a GPTQExperts in
    place of transformers' experts module with 3-D parameters; everything
    else is loaded into the model's own parameters and buffers. A Mixtral
    checkpoint's transformers 4 names (`block_sparse_moe`, experts' w1 / w3
    / w2) that the model does not have are read as transformers 5's (`mlp`,
    gate_proj / up_proj / down_proj); the report and errors use the model's.
    `checkpoint_format` ("gptq" / "gptq_v2") overrides the config's (as in
    load_gptq: a warning where the words do not show it).

    A model built on the meta device (no memory) takes the checkpoint's
    tensors on the CPU in its place, and its computed buffers (rotary
    tables) are built again from its config; any tensor left without a
    value raises (lowbit.load_gguf_model and load_gptq_model build models
    that way). A GGUF file's head counts and sizes, norm epsilon, rotary
    base, experts per token, softcaps and Granite multipliers must be the
    model config's where both give them (lowbit.gguf.model.SHAPELESS_KEYS):
    they change the results but no weight's shape. The model's forward calls then
    give torch's threads to lowbit's kernels (lowbit.kernel_threads).
    """
    check_module("replace_linear", model)
    path = check_path("replace_linear", path)
    where = f"replace_linear: {path}"
    on_meta = has_meta_tensors(model)
    if is_gguf_path(path):
        if checkpoint_format is not None:
            raise ValueError(f"replace_linear: checkpoint_format is a GPTQ checkpoint's; {path} is a GGUF file")
        f, error = load_gguf(path), GGUFError
        check_config_matches(model, f, where)
        report = place_gguf_tensors(model, f, "replace_linear")
    else:
        error = GPTQCheckpointError
        if checkpoint_format is not None:  # load_gptq's check would name load_gptq
            check_format(checkpoint_format, "replace_linear")
        report = place_gptq_checkpoint(model, path, checkpoint_format)
    if on_meta:  # what no checkpoint stores (rotary tables) is computed again from the config, or named
        rebuild_computed_buffers(model, where, error)
        check_no_meta(model, where, error)
    kernel_threads(model)
    return report
