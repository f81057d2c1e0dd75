"""A GPTQ checkpoint in a model: place_gptq_checkpoint swaps the model's
quantized modules for GPTQLinear / GPTQExperts layers and loads every other
tensor (replace_linear's GPTQ work); load_gptq_model builds the transformers
model of a checkpoint directory on the meta device and fills it that way, so
no float copy of a quantized weight is made at any point, and the float token
embedding and LM head stay the checkpoint's bytes (the GGUF float types)."""
from __future__ import annotations

import dataclasses
import math
import os
import warnings

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from .._checks import (MAX_INT, MAX_NORM_EPS, MAX_ROPE_BASE, MAX_SCALE, check_finite, check_flag, check_path,
                       is_integer, shown, shown_names)
from .._placing import (GPTQ_SAVE_ADVICE, ReplaceReport, checked, get_module, load_tensor, model_dtype, on_meta,
                        rebuild_computed_buffers, refuse_save_pretrained, tensor_holders)
from ..fusing import fuse_projections
from ..moe import experts_dims, plain_experts
from .checkpoint import GPTQCheckpoint, GPTQCheckpointError, check_layer_count, checkpoint_files, load_gptq
from .config import check_format, read_json
from ..decoding import fast_decoding
from ..threads import kernel_threads
from .experts import EXPERT_LAYER, PROJECTIONS, GPTQExpert, GPTQExperts, current_name
from .linear import GPTQLinear

__all__ = ["load_gptq_model", "place_gptq_checkpoint"]


def load_gptq_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                    checkpoint_format: str | None = None, fuse: bool = True,
                    int8_activations: bool = False, float_tables: str | None = None,
                    repack: bool = False) -> nn.Module:
    """The transformers model (AutoModelForCausalLM) of an HF GPTQ checkpoint
    directory, in eval mode on the CPU: its config.json builds the model, every
    quantized module becomes a GPTQLinear holding the checkpoint's tensors,
    every other tensor is loaded as `dtype`, but for the token embedding and
    an unquantized LM head: a GGUFEmbedding and a GGUFLinear over the
    checkpoint's own fp16 / bf16 / fp32 bytes (one copy for both where the
    head is tied to the embedding; an untied embedding stays in the file,
    its rows read as tokens use them), so the model takes at most its
    checkpoint's size and the head's matvec reads 2-byte weights where the
    checkpoint has them. `checkpoint_format` overrides the config's, as in replace_linear.
    `fuse` joins each decoder layer's q, k and v (and gate and up) GPTQLinears
    into one where they are quantized alike (lowbit.fusing: one gptq_gemm
    instead of three; save_gptq writes them apart again).
    `int8_activations` sets every GPTQLinear's (GPTQLinear: activations
    rounded to int8 per group for integer dot products, faster on the CPU;
    2-, 4- and 8-bit layers). `repack` holds every GPTQLinear in the panel
    layout (lowbit.repack_model; GPTQLinear.repack says when it is faster;
    the same results bit for bit, the checkpoint's layout again in a state
    dict).
    `float_tables="Q8_0"` holds those two tables as Q8_0 blocks instead,
    quantized at load as llama.cpp's quantizer does (lowbit.ops.ggml_quantize):
    about half their memory and half the head's reads per token, which is
    what a 4-bit model's decode step spends most on after its layers, for
    Q8_0's rounding (at most half a step of amax / 127 per 32 values), as
    llama.cpp's files hold them; "Q6_K" (hidden sizes of whole 256-value
    blocks) as llama.cpp's Q4_K_M files hold their output tensor, about a
    fifth fewer bytes again for 6-bit levels; None keeps the checkpoint's bytes.
    Its forward calls run torch's ops on one thread and lowbit's kernels on
    torch's thread count (lowbit.kernel_threads), and a llama-family model's
    decode steps skip transformers' per-layer machinery (lowbit.fast_decoding).
    An untied embedding's rows are read from the file as they are used, as
    load_gguf's tensors are: the file must not change while the model is in
    use (truncating it ends the process, SIGBUS, at the next lookup).
    """
    import transformers

    dtype = model_dtype(dtype, "load_gptq_model")
    fuse, repack = check_flag("load_gptq_model", "fuse", fuse), check_flag("load_gptq_model", "repack", repack)
    int8_activations = check_flag("load_gptq_model", "int8_activations", int8_activations)
    if checkpoint_format is not None:  # load_gptq's check would name load_gptq, after the model is built
        check_format(checkpoint_format, "load_gptq_model")
    _table_type("load_gptq_model", float_tables)  # as checkpoint_format: by this name, before the model is built
    directory, _ = checkpoint_files(check_path("load_gptq_model", path))
    check_layer_count(directory)

    def make_config():
        check_config_sizes(read_json(os.path.join(directory, "config.json"), "config"),
                           os.path.join(directory, "config.json"))
        config = transformers.AutoConfig.from_pretrained(directory)
        # The quantization_config is lowbit's to read (place_gptq_checkpoint does); left
        # on the config, transformers would look for a GPTQ backend of its own.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        check_config_values(config.to_dict(), os.path.join(directory, "config.json"))
        return config

    model = on_meta(make_config, transformers.AutoModelForCausalLM.from_config,
                    dtype, os.path.join(directory, "config.json"), GPTQCheckpointError)
    place_gptq_checkpoint(model, directory, checkpoint_format, float_tables)
    rebuild_computed_buffers(model, f"load_gptq_model: {directory}", GPTQCheckpointError)
    if int8_activations:
        for module in model.modules():
            if isinstance(module, GPTQLinear):
                module.int8_activations = True
    if fuse:
        fuse_projections(model)
    if repack:
        from ..gguf.repacking import repack_model  # lowbit.gguf imports lowbit.ops, which imports this package

        repack_model(model)
    kernel_threads(model)
    fast_decoding(model)
    return checked(model, f"load_gptq_model: {directory}", GPTQCheckpointError)


# Multipliers and softcaps of activations, attention scores and logits (Granite's, Gemma's).
SCALE_KEYS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
              "attn_logit_softcapping", "final_logit_softcapping")
# Config values that must be finite and > 0 where a config.json has them:
# transformers takes any number (a linear rope factor of 0 only warns), and
# a norm's epsilon below 0 or a rotary base of 0 gives NaN or wrong logits.
# The rotary keys are read at the top level and in rope_parameters /
# rope_scaling (per layer type too), as transformers nests them.
POSITIVE_KEYS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "max_position_embeddings",
                 "query_pre_attn_scalar", "decoder_sparse_step", *SCALE_KEYS)
POSITIVE_ROPE_KEYS = ("rope_theta", "factor", "attention_factor", "beta_fast", "beta_slow", "low_freq_factor",
                      "high_freq_factor", "original_max_position_embeddings", "partial_rotary_factor")
# DeepSeek's YaRN attention scales, where 0 turns them off: finite and >= 0.
MSCALE_KEYS = ("mscale", "mscale_all_dim")
# The least and most some of them may be (lowbit._checks: the GGUF loader's
# bounds too). transformers' validators ask rope factors of at least 1 (a
# tiny linear one makes NaN rotation tables, a huge dynamic one too) and
# rotate at most the whole head.
MINIMA = {"factor": 1.0, "attention_factor": 1 / MAX_SCALE, **{key: 1 / MAX_SCALE for key in SCALE_KEYS}}
MAXIMA = {"rms_norm_eps": MAX_NORM_EPS, "layer_norm_eps": MAX_NORM_EPS, "layer_norm_epsilon": MAX_NORM_EPS,
          "norm_eps": MAX_NORM_EPS, "rope_theta": MAX_ROPE_BASE, "max_position_embeddings": MAX_INT,
          "original_max_position_embeddings": MAX_INT, "factor": MAX_SCALE, "attention_factor": MAX_SCALE,
          "partial_rotary_factor": 1.0, **{key: MAX_SCALE for key in SCALE_KEYS + MSCALE_KEYS}}
# Sizes a model is built from, where a config.json has them: a whole number
# from 1 (0 heads divides by zero as transformers builds the model, -4 makes a
# tensor of negative size).
SIZE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
# A mixture of experts' count, under each class's name, which its experts per token may not exceed.
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


def check_config_sizes(config: dict, where: str) -> None:
    """Refuses, naming `where` and the key, a size of SIZE_KEYS that is not a
    whole number from 1 to MAX_INT: before transformers reads the config
    (its config classes divide by the head count)."""
    for key in SIZE_KEYS:
        value = config.get(key)
        if value is not None and not (is_integer(value) and 1 <= value <= MAX_INT):
            raise GPTQCheckpointError(f"{where}: {key} must be a whole number from 1 to {MAX_INT}, got {shown(value)}")


def check_config_values(config: dict, where: str) -> None:
    """Refuses, naming `where` and the key, a value of POSITIVE_KEYS or of the
    rotary keys that is not a finite number > 0 (>= 0 for MSCALE_KEYS) within
    its MINIMA and MAXIMA, LongRoPE factors that are not, or not one per
    rotated frequency (transformers only warns, and broadcasts one factor
    over all), a partial rotation of no frequency, KV heads that do not divide
    the attention heads, more experts per token than experts (or none), and
    an attention window that is not a whole number from 2 (transformers'
    sliding cache would keep every row of a window of 1: lowbit.gguf.arch._sliding_window),
    a size of SIZE_KEYS that is not a whole number from 1, and a rotary type
    transformers does not have."""
    def number(key, value):
        name = key.rpartition(".")[2]
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              and (value >= 0 if name in MSCALE_KEYS else value > 0))
        if not ok:
            raise GPTQCheckpointError(f"{where}: {key} must be a finite number {'>=' if name in MSCALE_KEYS else '>'} "
                                      f"0, got {shown(value)}")
        least, most = MINIMA.get(name, 0.0), MAXIMA.get(name, math.inf)
        if value < least:
            raise GPTQCheckpointError(f"{where}: {key} must be at least {least}, got {shown(value)}")
        if value > most:
            raise GPTQCheckpointError(f"{where}: {key} must be at most {most}, got {shown(value)}")

    check_config_sizes(config, where)
    # The head size as transformers' rotary embeddings take it (None: the config gives none).
    head, hidden, heads = config.get("head_dim"), config.get("hidden_size"), config.get("num_attention_heads")
    if head is None and is_integer(hidden) and is_integer(heads) and heads > 0:
        head = hidden // heads

    def rope(prefix, params):
        if not isinstance(params, dict):
            return
        kind = params.get("rope_type", params.get("type"))
        if isinstance(kind, str) and kind != "default" and kind not in ROPE_INIT_FUNCTIONS:
            # transformers only warns, then fails building the model with KeyError: 'name'.
            raise GPTQCheckpointError(f"{where}: {prefix}.rope_type {shown(kind)} is not a rotary embedding "
                                      f"transformers has (default, {', '.join(ROPE_INIT_FUNCTIONS)})")
        for key, value in params.items():
            if key in POSITIVE_ROPE_KEYS + MSCALE_KEYS and value is not None:
                number(f"{prefix}.{key}", value)
            elif isinstance(value, dict):
                rope(f"{prefix}.{key}", value)
        # The frequencies a head rotates, as transformers counts them.
        part = params.get("partial_rotary_factor", 1.0)
        count = int(head * part) // 2 if is_integer(head) else None
        if count is not None and count < 1:
            raise GPTQCheckpointError(f"{where}: {prefix}.partial_rotary_factor {shown(part)} of a head of {head} "
                                      "dimensions rotates no frequency")
        for key in ("long_factor", "short_factor"):
            factors = params.get(key)
            if factors is None:
                continue
            if not isinstance(factors, list) or count is not None and len(factors) != count:
                raise GPTQCheckpointError(f"{where}: {prefix}.{key} must be a list of one factor per rotated "
                                          f"frequency ({count}), got {shown(factors)}")
            for i, v in enumerate(factors):
                number(f"{prefix}.{key}[{i}]", v)

    for key in POSITIVE_KEYS + POSITIVE_ROPE_KEYS:
        if config.get(key) is not None:
            number(key, config[key])
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and (kv_heads <= 0 or heads % kv_heads):
        # transformers builds the model and fails in its first forward: each KV head serves a whole set of heads.
        raise GPTQCheckpointError(f"{where}: num_key_value_heads {kv_heads} does not divide num_attention_heads "
                                  f"{heads}")
    for key in ("rope_parameters", "rope_scaling"):
        rope(key, config.get(key))
    count_key = next((key for key in EXPERT_COUNT_KEYS if is_integer(config.get(key)) and config[key] > 0), None)
    used = config.get("num_experts_per_tok")
    if count_key is not None and used is not None and not (is_integer(used) and 1 <= used <= config[count_key]):
        # torch.topk fails in the first forward on more, and none makes every expert layer's output 0.
        raise GPTQCheckpointError(f"{where}: num_experts_per_tok must be a whole number from 1 to {count_key} "
                                  f"({config[count_key]}), got {shown(used)}")
    # A window applies to the config's sliding layers, or to every layer where it names no layer types
    # (Qwen2-MoE's 0 over layers all full is none).
    window, layer_types = config.get("sliding_window"), config.get("layer_types")
    slides = "sliding_attention" in layer_types if isinstance(layer_types, list) else True
    if window is not None and slides and not (is_integer(window) and 2 <= window <= MAX_INT):
        raise GPTQCheckpointError(f"{where}: sliding_window {shown(window)} is not supported: a window is a whole "
                                  f"number of tokens from 2 to {MAX_INT}, or null for none (transformers' sliding "
                                  "cache would keep every row of a window of 1)")


def place_gptq_checkpoint(model: nn.Module, path: str, checkpoint_format: str | None = None,
                          float_tables: str | None = None) -> ReplaceReport:
    """replace_linear's GPTQ work: the checkpoint at `path` (a directory, or a
    .safetensors file beside its config) into `model`; `checkpoint_format`
    ("gptq" / "gptq_v2") overrides the config's. A model built on the meta
    device takes the checkpoint's (CPU) tensors in its place, its float token
    embedding and LM head as GGUF tables (as load_gptq_model describes, with
    its `float_tables`). Act-order layers hold their rows sorted by group
    (GPTQLinear.sort_rows)."""
    table_type = _table_type("place_gptq_checkpoint", float_tables)
    mapped = _lookup_only_table(model, table_type)
    ckpt = _named_as_model(model, load_gptq(path, checkpoint_format, mapped))
    for layer in ckpt.modules.values():
        # The tensors are the loader's own: act-order rows sorted in place,
        # one copy of the weights (GPTQLinear.sort_rows).
        layer.sort_rows()
    report = ReplaceReport()
    wanted = [n for n, _ in model.named_parameters()]  # tied parameters once, as HF saves them
    wanted += [n for n, _ in _persistent_buffers(model)]
    placed = set()
    in_experts = _place_gptq_experts(model, ckpt, report, placed)
    _float_tables_in_place(model, ckpt, report, placed, table_type)
    for name, layer in ckpt.modules.items():
        if name in in_experts:
            continue
        module = get_module(model, name)
        if not isinstance(module, nn.Linear):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {shown(name)} is quantized in the checkpoint but the "
                                      f"model has {type(module).__name__ if module is not None else 'no such module'}")
        if (module.in_features, module.out_features) != (layer.in_features, layer.out_features):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {shown(name)} is [{layer.out_features} x "
                                      f"{layer.in_features}] in the checkpoint but Linear({module.in_features}, "
                                      f"{module.out_features}) in the model")
        if module.bias is None and layer.bias is not None and not bool(layer.bias.any()):
            layer.bias = None  # AutoGPTQ and GPTQ-for-LLaMa write zero biases for bias-free Linears (vLLM skips them)
        if (module.bias is None) != (layer.bias is None):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {shown(name)}: the checkpoint "
                                      f"{'has no' if layer.bias is None else 'has a'} bias, the model "
                                      f"{'has one' if module.bias is not None else 'has none'}")
        # On the model's device; a model built on the meta device takes the checkpoint's (CPU) tensors.
        model.set_submodule(name, layer if module.weight.is_meta else layer.to(module.weight.device))
        report.replaced.append(name)
        placed.update(f"{name}.{p}" for p in ("weight", "bias"))
    targets = dict(model.named_parameters())
    targets.update(_persistent_buffers(model))
    holders = tensor_holders(model)
    for name, tensor in ckpt.tensors.items():
        target = targets.get(name)
        if target is None:
            report.unplaced.append(name)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise GPTQCheckpointError(f"{ckpt.directory}: tensor {shown(name)} has shape {tuple(tensor.shape)} but the "
                                      f"model's is {tuple(target.shape)}")
        if target.is_floating_point() != tensor.is_floating_point():
            raise GPTQCheckpointError(f"{ckpt.directory}: tensor {shown(name)} is {tensor.dtype}, where the model's "
                                      f"is {target.dtype}: a float tensor is stored as floats, an integer one as "
                                      "integers")
        # A corrupt norm or bias would turn every output after it NaN; a
        # mapped table is left unread, its pages read as tokens need them,
        # unless it is cast (a float64 one), which reads it all anyway.
        if tensor.is_floating_point() and (name not in mapped or tensor.dtype != target.dtype):
            check_finite(tensor, f"{ckpt.directory}: tensor {shown(name)}", GPTQCheckpointError)
            if tensor.dtype != target.dtype:  # as the model holds it: float32's 1e6 is inf in float16
                tensor = tensor.to(target.dtype)
                check_finite(tensor, f"{ckpt.directory}: tensor {shown(name)}, held as the model's {target.dtype},",
                             GPTQCheckpointError)
        load_tensor(model, target, tensor, holders)
        report.loaded.append(name)
        placed.add(name)
    if report.unplaced:
        warnings.warn(f"replace_linear: {ckpt.directory}: tensors with no place in the model: "
                      f"{shown_names(report.unplaced)}")
    missing = [n for n in wanted if n not in placed]
    if missing:
        raise GPTQCheckpointError(f"replace_linear: {ckpt.directory} has no tensor for model parameters {missing}")
    refuse_save_pretrained(model, GPTQ_SAVE_ADVICE)
    return report


def _lookup_only_table(model: nn.Module, table_type: int | None) -> frozenset[str]:
    """The name of the token embedding's weight where the model only looks
    rows up in it (built on the meta device, not tied to the LM head, kept in
    the checkpoint's float type): left in the file, its pages are read as
    tokens need them, not all at load."""
    if table_type is not None or not hasattr(model, "get_input_embeddings"):  # not a transformers model
        return frozenset()
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    weight = getattr(embedding, "weight", None)
    if weight is None or not weight.is_meta or getattr(head, "weight", None) is weight:
        return frozenset()
    return frozenset(n for n, p in model.named_parameters() if p is weight)


# float_tables -> the ggml type the tables are held in (None: the checkpoint's own float type).
TABLE_TYPES = {None: None, "Q8_0": 8, "Q6_K": 14}


def _table_type(who: str, float_tables: str | None) -> int | None:
    # A str or None only: `in` on a list would be a bare TypeError (unhashable).
    if not (float_tables is None or isinstance(float_tables, str)) or float_tables not in TABLE_TYPES:
        raise ValueError(f"{who}: float_tables must be one of {sorted(t for t in TABLE_TYPES if t)} or None, "
                         f"got {float_tables!r}")
    return TABLE_TYPES[float_tables]


def _float_tables_in_place(model: nn.Module, ckpt: GPTQCheckpoint, report: ReplaceReport, placed: set,
                           table_type: int | None = None) -> None:
    """In a model built on the meta device, the token embedding (a plain
    nn.Embedding) and the LM head (an unquantized, unbiased nn.Linear, tied
    to the embedding or not) over the checkpoint's own bytes, as the GGUF
    loader holds a file's (lowbit.gguf.model): a float32 copy of a 2-byte
    table doubles a small model's memory and its head's reads per token.
    `table_type` (a ggml type id): each table quantized to it instead, one
    copy for a tied pair."""
    # Imported here: lowbit.gguf imports lowbit.ops, which imports this package.
    from ..gguf import GGUFEmbedding, GGUFLinear
    from ..gguf.linear import FLOAT_QTYPES

    names = {id(p): n for n, p in model.named_parameters()}  # tied parameters: the first name, as HF saves them
    views = {}  # (bytes, type) per table: a tied head holds the embedding's

    def held(name: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A table's bytes and ggml type: the checkpoint's, or quantized to table_type."""
        if table_type is None:
            return tensor.contiguous().view(torch.uint8), FLOAT_QTYPES[tensor.dtype]
        try:
            return torch.ops.lowbit.ggml_quantize(tensor.contiguous(), table_type), table_type
        except ValueError as e:  # rows not whole blocks, NaN / Inf, or values beyond the type's range
            raise GPTQCheckpointError(f"{ckpt.directory}: float_tables: tensor {shown(name)}: {e}") from None

    def table(module: nn.Module | None, kinds: tuple[type, ...]):
        """(checkpoint name, bytes, ggml type) of the module's weight, or None."""
        if type(module) not in kinds or not module.weight.is_meta:
            return None
        name = names.get(id(module.weight))
        tensor = ckpt.tensors.get(name)
        if tensor is None or tensor.dtype not in FLOAT_QTYPES or tuple(tensor.shape) != tuple(module.weight.shape):
            return None  # the general path loads or reports it
        if name not in views:
            views[name] = held(name, tensor)
        return (name, *views[name])

    embedding, head = model.get_input_embeddings(), get_module(model, "lm_head")
    # Gemma's ScaledWordEmbedding multiplies its rows by sqrt(hidden_size), a
    # computed buffer the meta build left empty: the GGUFEmbedding scales them.
    scaled = isinstance(embedding, nn.Embedding) and hasattr(embedding, "embed_scale")
    found = {}
    if (t := table(embedding, (type(embedding) if scaled else nn.Embedding,))) and embedding.max_norm is None:
        found[t[0].rpartition(".")[0]] = t[0]
        scale = model.config.hidden_size ** 0.5 if scaled else None
        model.set_input_embeddings(GGUFEmbedding(t[1], t[2], embedding.embedding_dim, embedding.weight.dtype, scale))
    if "lm_head" not in ckpt.modules and (t := table(head, (nn.Linear,))) and head.bias is None:
        found["lm_head"] = t[0]
        model.set_submodule("lm_head", GGUFLinear.from_raw(t[1], t[2], head.in_features))
    report.replaced += found
    placed.update(found.values())
    ckpt.tensors = {n: t for n, t in ckpt.tensors.items() if n not in placed}


def _named_as_model(model: nn.Module, ckpt: GPTQCheckpoint) -> GPTQCheckpoint:
    """The checkpoint with the older names the model has no module for
    under their current ones (gptq.experts.current_name)."""
    def renamed(items: dict, module_of) -> dict:
        out, source = {}, {}
        for name, value in items.items():
            new = name if get_module(model, module_of(name)) is not None else current_name(name)
            # Both names in one checkpoint: one of them would be dropped without a word.
            if new in out:
                raise GPTQCheckpointError(f"{ckpt.directory}: {shown(source[new])} and {shown(name)} are both the "
                                          f"model's {shown(new)} (under transformers 4's and today's names)")
            out[new], source[new] = value, name
        return out

    return dataclasses.replace(ckpt, modules=renamed(ckpt.modules, lambda n: n),
                               tensors=renamed(ckpt.tensors, lambda n: n.rpartition(".")[0]))


def _place_gptq_experts(model: nn.Module, ckpt: GPTQCheckpoint, report: ReplaceReport, placed: set) -> set[str]:
    """The checkpoint's per-expert layers (`<experts>.<e>.gate_proj`, ...) as one
    GPTQExperts in place of each transformers experts module that holds its
    experts in 3-D parameters (gate_up_proj, down_proj); returns the layers'
    names. Models with a module per expert take them one by one instead."""
    found: dict[str, dict[int, dict[str, object]]] = {}
    for name, layer in ckpt.modules.items():
        m = EXPERT_LAYER.fullmatch(name)
        if m:
            found.setdefault(m["experts"], {}).setdefault(int(m["expert"]), {})[m["projection"]] = layer
    used = set()
    for prefix, experts in found.items():
        module = get_module(model, prefix)
        if experts_dims(module) is None:
            continue
        if not plain_experts(module):
            raise GPTQCheckpointError(f"{ckpt.directory}: {prefix}: the model's {type(module).__name__} is not an "
                                      "experts module GPTQExperts computes (unbiased gate/up then down)")
        count, hidden, intermediate = experts_dims(module)
        missing = [f"{e}.{p}" for e in range(count) for p in PROJECTIONS if p not in experts.get(e, {})]
        extra = sorted(set(experts) - set(range(count)))
        if missing or extra:
            raise GPTQCheckpointError(f"{ckpt.directory}: {prefix}: the model has {count} experts; the checkpoint "
                                      + (f"lacks {prefix}.{missing[0]}" if missing else f"has expert {extra[0]}"))
        for e in range(count):
            for p, (n_in, n_out) in zip(PROJECTIONS, ((hidden, intermediate), (hidden, intermediate),
                                                      (intermediate, hidden))):
                layer = experts[e][p]
                if (layer.in_features, layer.out_features) != (n_in, n_out):
                    raise GPTQCheckpointError(f"{ckpt.directory}: module '{prefix}.{e}.{p}' is [{layer.out_features} x "
                                              f"{layer.in_features}] in the checkpoint but [{n_out} x {n_in}] in the "
                                              f"model's experts")
        layer = GPTQExperts([GPTQExpert(*(experts[e][p] for p in PROJECTIONS)) for e in range(count)], module.act_fn)
        model.set_submodule(prefix, layer)
        report.replaced.append(prefix)
        placed.update(f"{prefix}.{n}" for n, _ in module.named_parameters())
        used.update(f"{prefix}.{e}.{p}" for e in range(count) for p in PROJECTIONS)
    return used


def _persistent_buffers(model: nn.Module):
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf
