"""Whole transformers models straight from quantized checkpoints: a GGUF file
(config from its metadata) or a GPTQ directory (config.json). The model is
built on the meta device and replace_linear fills it, so no float copy of a
linear layer's weight (nor, from GGUF, of the token embedding) is made at
any point: a model needs about its checkpoint's size in memory, not its
float size."""
from __future__ import annotations

import os

import torch
from torch import nn

from .gguf_embedding import GGUFEmbedding
from .gguf_file import GGUFFile, load_gguf
from .repacking import repack_model
from .gguf_arch import ARCHITECTURES, architecture, check_block_count, config_from_gguf
from .gptq.checkpoint import check_layer_count, checkpoint_files
from .replace import check_shape, place_gguf_tensors, replace_linear

__all__ = ["load_gguf_model", "load_gguf_tokenizer", "load_gptq_model"]

# llama.cpp's converter stores Llama 3.1+'s rope scaling as per-frequency
# divisors in this tensor instead of metadata.
ROPE_FREQS = "rope_freqs.weight"
TOKEN_EMBD = "token_embd.weight"
# A phi3 LongRoPE file's per-frequency factors, which its config holds (config_from_gguf).
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def load_gguf_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, repack: bool = False) -> nn.Module:
    """The transformers model (lowbit.gguf_arch.ARCHITECTURES: LlamaForCausalLM,
    or MixtralForCausalLM for a llama file with experts, SmolLM3ForCausalLM,
    GraniteForCausalLM,
    Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM, GptOssForCausalLM, GemmaForCausalLM,
    Gemma2ForCausalLM, Gemma3ForCausalLM or Phi3ForCausalLM) that a GGUF file of one of those
    architectures describes, in eval mode on the CPU.

    Every linear layer the file has a quantized weight for is a GGUFLinear
    over the file's blocks (memory-mapped, so loading reads no weight
    bytes), a mixture-of-experts layer's experts a GGUFExperts (a GGUFLinear
    per expert and projection over the same mapping), the token embedding a
    GGUFEmbedding over its blocks (rows dequantized as they are looked up);
    norms, biases and routers are dequantized to `dtype`. Move it
    with `.to(device)`. Unlike transformers' own GGUF loading, no float copy
    of a weight matrix is ever made: the model takes about its file's size.
    `repack` reorders the layers of the types that have one into the CPU
    kernels' interleaved layout (GGUFLinear.repack: the same results, for the
    32-element types to fp32 rounding; faster on AVX-512 VNNI CPUs and for
    most of those types on AVX2 ones), which copies their blocks out of the mapping.
    """
    import transformers

    path = os.fspath(path)
    where = f"load_gguf_model: {path}"
    f = load_gguf(path)
    spec = architecture(f.metadata, where)
    # The layer count against the file's layers first: the model is built
    # with as many as its config says, before any tensor is placed.
    check_block_count(f.metadata, f.tensors, where)
    model_class = getattr(transformers, spec.model_class)
    config = model_class.config_class(**config_from_gguf(f.metadata, f.tensors, where))
    model = _on_meta(lambda: model_class(config), config, dtype)
    _embed_tokens_from_blocks(model, f, dtype, spec.scaled_embedding)
    place_gguf_tensors(model, f, "load_gguf_model", consumed=(ROPE_FREQS, TOKEN_EMBD, *ROPE_FACTORS))
    _rebuild_computed_buffers(model)
    _apply_rope_freqs(model, f)
    if repack:
        repack_model(model)
    return _checked(model, where)


def _embed_tokens_from_blocks(model: nn.Module, f: GGUFFile, dtype: torch.dtype, scaled: bool) -> None:
    """The token embedding as a GGUFEmbedding over the file's blocks (rows
    dequantized as they are looked up; a tied LM head multiplies by the same
    blocks), where a float table would be the model's largest tensor. Where
    the model's own embedding scales its output (`scaled`: the Gemma
    models' ScaledWordEmbedding, by sqrt(hidden_size)), the GGUFEmbedding does."""
    embd = f.tensors.get(TOKEN_EMBD)
    if embd is None:
        return  # replace_linear reports the missing parameter
    current = model.get_input_embeddings()
    check_shape(f.path, embd, "the config's token embedding", tuple(current.weight.shape))
    if scaled != hasattr(current, "embed_scale"):  # a transformers version that scales elsewhere
        raise RuntimeError(f"load_gguf_model: {type(current).__name__} of {type(model).__name__} "
                           f"{'does not scale' if scaled else 'scales'} its embeddings, which lowbit does not expect")
    scale = model.config.hidden_size ** 0.5 if scaled else None
    model.set_input_embeddings(GGUFEmbedding(embd.data, embd.type, embd.shape[1], dtype, scale))


def load_gguf_tokenizer(path: str | os.PathLike):
    """The transformers tokenizer that transformers builds from the file's
    tokenizer.ggml.* metadata: AutoTokenizer's class for the file's
    architecture, built straight from the file (0.3 s for SmolLM2's, against
    AutoTokenizer's 3-4 s). Architectures lowbit does not know go through
    AutoTokenizer itself."""
    import transformers

    path = os.fspath(path)
    directory, name = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    arch = load_gguf(path).metadata.get("general.architecture")
    spec = ARCHITECTURES.get(arch) if isinstance(arch, str) else None  # a list would be unhashable
    tokenizer_class = spec.tokenizer_class if spec else None
    if tokenizer_class is None:
        return transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return getattr(transformers, tokenizer_class).from_pretrained(directory, gguf_file=name)


def load_gptq_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    checkpoint_format: str | None = None) -> nn.Module:
    """The transformers model (AutoModelForCausalLM) of an HF GPTQ checkpoint
    directory, in eval mode on the CPU: its config.json builds the model, every
    quantized module becomes a GPTQLinear holding the checkpoint's tensors,
    every other tensor is loaded as `dtype` (a tied LM head stays tied to the
    embedding). `checkpoint_format` overrides the config's, as in replace_linear.
    """
    import transformers

    directory, _ = checkpoint_files(os.fspath(path))
    check_layer_count(directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    # The quantization_config is lowbit's to read (replace_linear does); left
    # on the config, transformers would look for a GPTQ backend of its own.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = _on_meta(lambda: transformers.AutoModelForCausalLM.from_config(config), config, dtype)
    replace_linear(model, directory, checkpoint_format)
    _rebuild_computed_buffers(model)
    return _checked(model, f"load_gptq_model: {directory}")


def _on_meta(build, config, dtype: torch.dtype) -> nn.Module:
    """build() with every tensor on the meta device: no memory, no init."""
    config.dtype = dtype
    with torch.device("meta"):
        return build().to(dtype)


def _rebuild_computed_buffers(model: nn.Module) -> None:
    """Rotary embeddings hold computed (non-persistent) inverse frequencies,
    which no checkpoint stores and the meta build left empty: build each such
    module again on the CPU from its config."""
    for name, module in list(model.named_modules()):
        if name and hasattr(module, "config") and any(b.is_meta for b in module.buffers(recurse=False)):
            model.set_submodule(name, type(module)(config=module.config))


def _apply_rope_freqs(model: nn.Module, f: GGUFFile) -> None:
    """The file's rope_freqs divisors, applied as llama.cpp does (theta / freq_factor)."""
    freqs = f.tensors.get(ROPE_FREQS)
    if freqs is None:
        return
    rotary = model.model.rotary_emb
    if freqs.shape != tuple(rotary.inv_freq.shape):  # one divisor per frequency
        raise ValueError(f"load_gguf_model: {f.path}: {ROPE_FREQS} has shape {freqs.shape}, "
                         f"the model's rotary embedding {tuple(rotary.inv_freq.shape)}")
    rotary.inv_freq = rotary.inv_freq / freqs.dequantize()
    rotary.original_inv_freq = rotary.inv_freq.clone()


def _checked(model: nn.Module, where: str) -> nn.Module:
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"{where}: no value for {still_meta} (this {type(model).__name__} has tensors "
                           f"that neither the checkpoint nor lowbit fills)")
    return model.eval()
