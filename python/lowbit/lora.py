"""LoRA adapters over lowbit's quantized layers, with PEFT (QLoRA-style: the
base stays in its file's blocks, frozen; only the adapters train).

    config = lowbit.lora.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(lowbit.load_gguf_model("model.gguf"), config)
    ...                                    # train as any PEFT model
    model.save_pretrained("adapter/")      # a standard PEFT adapter
    model = lowbit.lora.load_adapter(lowbit.load_gguf_model("model.gguf"), "adapter/")

`LoraConfig` is peft.LoraConfig with GGUFLinear, GPTQLinear and the
projections fused layers leave (lowbit.fusing.ProjectionSlice) registered
through PEFT's custom-module mechanism (`register` does it to a config of
your own). Gradients reach the adapters and every layer below through
lowbit's autograd (python/lowbit/_autograd.py). Merging an adapter into a
quantized base is refused, before any layer of the model merges: it would
need re-quantization, which moves the weights away from those the adapter
was trained against.

The model's own projections take adapters: a fused layer (lowbit.fusing's
qkv_proj, gate_up_proj) that a regex matches with its slices gets none (the
slices q_proj, k_proj, ... take theirs, as in the model without fusing, so
adapters move between the two); one named in target_modules, or matched by
a regex without its slices, is refused. A quantized layer holds blocks, not
parameters: `modules_to_save` (a trainable copy) refuses it; its bias is a
frozen buffer, so bias other than 'none' is refused for training (lora_bias
trains the adapter's); an adapter saved with biases loads for inference,
onto a model loaded with fuse=False (a fused layer holds its projections'
biases as one). lowbit's MoE experts modules (GGUFExperts, GPTQExperts)
take no adapters: one matched by target_modules, or its weights named in
target_parameters (where PEFT puts gate_proj, up_proj and down_proj for
MoE models), is refused.

PEFT knows a model as quantized by transformers' quantizer attributes, which
lowbit's models do not carry (they would stop model.to(dtype)):
peft.prepare_model_for_kbit_training then leaves gradient checkpointing off;
call model.gradient_checkpointing_enable() for it
(activation_checkpointing_enable() in newer transformers). PEFT's own adapter
loaders (PeftModel.from_pretrained, its load_adapter) read a config without
lowbit's layers: `load_adapter` here loads onto a lowbit model or, as one
more adapter, onto a PEFT model of one, and refuses a file whose tensors
are not exactly those the adapter's layers take, or hold NaN / inf (PEFT
warns of the first and loads the second), and a config whose ranks exceed
every size of those tensors or whose alphas are no finite, non-zero scale
(PEFT allocates the first and turns the logits NaN with the second).
"""
from __future__ import annotations

import math
import numbers
import json
import os
import re
import subprocess
import sys

import peft
import safetensors
import torch
from peft.tuners.lora import LoraModel
from peft.tuners.lora.layer import LoraLayer
from torch import nn

from ._checks import (MAX_SCALE, check_flag, check_module, check_path, check_regular_file, is_integer, shown,
                      shown_text)
from ._stored import StoredBuffers
from .fusing import ProjectionSlice
from .gguf.experts import GGUFExperts
from .gguf.linear import GGUFLinear
from .gptq.experts import GPTQExperts
from .gptq.config import read_json
from .gptq.linear import GPTQLinear

__all__ = ["LoraConfig", "QuantizedLoraLinear", "load_adapter", "register"]

# lowbit's experts modules, and the weight parameters of transformers' that they stand for.
EXPERTS = (GGUFExperts, GPTQExperts)
EXPERT_WEIGHTS = ("gate_up_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's bias values.
BIASES = ("none", "all", "lora_only")
# The adapter weights files PEFT reads, in its order of preference.
WEIGHTS_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# How PEFT matches a config's regular expressions against the model's module names, each as a re.match
# pattern around the config's (peft.tuners.tuners_utils.check_target_module_exists, peft.utils.get_pattern_key;
# target_modules and exclude_modules are fullmatched where they are strings, rank and alpha patterns are keys).
PEFT_PATTERNS = {"target_modules": r"(?:{})\Z", "exclude_modules": r"(?:{})\Z",
                 "layers_pattern": r"(?:^|.*?\.){}\.(?P<idx>\d+)\.", "modules_to_save": r"(^|.*\.){}($|\..*)",
                 "rank_pattern": r"(.*\.)?({})$", "alpha_pattern": r"(.*\.)?({})$"}
# The time all of them may take over the model's names, matched by Python's re as PEFT does, in a child
# process: re has no timeout, and one that backtracks catastrophically never returns.
PATTERN_SECONDS = 10.0
# Distinct entries of a target_modules or exclude_modules list that name no module of the model: PEFT
# tolerates them, but matches every module against every entry and searches the list for its shortest
# suffixes in time growing with their square (20,000 of them take minutes).
MAX_UNMATCHED_NAMES = 1024
# The most decoder layers a layer_replication may build, as a multiple of the model's.
MAX_REPLICATION = 8
_MATCH_EACH = """import json, re, sys
job = json.load(sys.stdin)
for pattern in job["patterns"]:
    compiled = re.compile(pattern)
    for name in job["names"]:
        compiled.match(name)
    print(flush=True)
"""
# init_lora_weights values that read the base layer's float weight.
BASE_WEIGHT_INITS = ("pissa", "olora", "corda", "loftq", "orthogonal", "lora_ga", "mica")


class QuantizedLoraLinear(nn.Module, LoraLayer):
    """LoRA over a GGUFLinear or GPTQLinear: base(x) + B(A(dropout(x))) * scaling
    for each active adapter, the adapters in their own dtype; with PEFT's
    `adapter_names` (one per row of the batch), each row's own adapter."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: peft.LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs):
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        if config.use_dora:
            raise ValueError(f"{type(self).__name__}: DoRA needs the base weight's norm per column, which lowbit's "
                             "quantized layers do not keep; use plain LoRA")
        if config.use_qalora:  # PEFT applies it in its own GPTQ layer only: anywhere else it is plain LoRA
            raise ValueError(f"{type(self).__name__}: QA-LoRA (use_qalora) pools the adapter's inputs by the "
                             "quantization groups, which lowbit's layers do not; use plain LoRA")
        if config.bias != "none" and not config.inference_mode:  # loading such an adapter writes its biases
            raise ValueError(f"{type(self).__name__}: bias={config.bias!r} trains biases, and a quantized layer's "
                             "bias is a frozen buffer of its checkpoint: use bias='none' (lora_bias=True gives the "
                             "adapter a bias)")
        if getattr(base_layer, "fused_from", None):  # its slices call it directly: this wrapper would never run
            raise ValueError(f"{type(self).__name__}: the base layer is lowbit's fused layer of "
                             f"{', '.join(base_layer.fused_from)} (lowbit.fusing): put the adapters on those")
        init = config.init_lora_weights
        if isinstance(init, str) and init.startswith(BASE_WEIGHT_INITS):
            raise ValueError(f"{type(self).__name__}: init_lora_weights={init!r} reads the base layer's float "
                             "weight, which lowbit's quantized layers hold as blocks; use True, False or 'gaussian'")
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        return module.in_features, module.out_features

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        adapter_names = kwargs.pop("adapter_names", None)
        if adapter_names is not None and not self.disable_adapters:  # each row its own adapter (or "__base__")
            return self._mixed_batch_forward(x, *args, adapter_names=adapter_names, **kwargs)
        result = self.base_layer(x, *args, **kwargs)
        if self.disable_adapters:
            return result
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = self._cast_input_dtype(x, lora_A.weight.dtype)
            delta = lora_B(lora_A(self.lora_dropout[name](h))) * self.scaling[name]
            result = result + delta.to(result.dtype)
        return result

    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """The adapter's weight delta B @ A * scaling [out, in] (what PEFT's
        SVD combinations of adapters read); it is never merged into the base."""
        return (self.lora_B[adapter].weight @ self.lora_A[adapter].weight) * self.scaling[adapter]

    def merge(self, *args, **kwargs) -> None:
        """Refused (ValueError): see the message."""
        raise ValueError(f"{type(self).__name__}: merging a LoRA adapter into a quantized {type(self.base_layer).__name__} "
                         "would re-quantize the weight the adapter was trained against; keep the adapter separate "
                         "(or merge into a float copy: base_layer.dequantize())")

    def unmerge(self) -> None:
        """Does nothing: merge() never merges."""

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def _check_merge_allowed(self, _peft_check=LoraModel._check_merge_allowed) -> None:
    """PEFT's check before any layer merges, refusing a model with a
    QuantizedLoraLinear as its merge would: PEFT merges (and, in
    merge_and_unload, unloads) layer after layer, so a refusal at the first
    quantized one would leave the float layers before it merged."""
    _peft_check(self)
    for module in self.model.modules():
        if isinstance(module, QuantizedLoraLinear):
            module.merge()


LoraModel._check_merge_allowed = _check_merge_allowed


def _experts_error(key: str, module: nn.Module, how: str) -> ValueError:
    """The refusal of LoRA on lowbit's experts module `module` at `key`:
    PEFT adapts transformers' experts through their 3-D weight parameters,
    which lowbit's hold as quantized blocks."""
    return ValueError(f"lowbit.lora: {key} is lowbit's {type(module).__name__}, and {how}: LoRA on MoE experts is "
                      "not supported (lowbit holds their weights as quantized blocks, not parameters PEFT can "
                      "adapt); target the attention projections (q_proj, k_proj, v_proj, o_proj) instead")


def _prepare_model(self, config: peft.LoraConfig, model: nn.Module, _peft_prepare=LoraModel._prepare_model) -> None:
    """PEFT's step before it changes the model for an adapter, refusing what
    lowbit's quantized layers cannot take, matched as PEFT matches it: an
    experts module in target_modules, or its weights in target_parameters
    (_experts_error); a module in modules_to_save that is or holds a
    quantized layer (PEFT trains a copy of it, whose frozen blocks would
    train nothing and be saved whole with the adapter)."""
    for key, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, EXPERTS):
            if self._check_target_module_exists(config, key):
                raise _experts_error(key, module, "target_modules matches it")
            for name in sorted(config.target_parameters or ()):
                leaf = name.rpartition(".")[2]
                if leaf in EXPERT_WEIGHTS and (f"{key}.{leaf}" == name or f"{key}.{leaf}".endswith(f".{name}")):
                    raise _experts_error(key, module, f"target_parameters holds {name!r}, one of its weights (where "
                                                      "PEFT puts target_modules' gate_proj, up_proj and down_proj "
                                                      "for MoE models)")
        if any(key.endswith(name) for name in config.modules_to_save or ()):
            quantized = next((m for m in module.modules() if isinstance(m, (StoredBuffers, ProjectionSlice))), None)
            if quantized is not None:
                raise ValueError(f"lowbit.lora: modules_to_save names {key}, which "
                                 f"{'is' if quantized is module else 'holds'} lowbit's quantized "
                                 f"{type(quantized).__name__}: a trainable copy of its frozen blocks trains nothing; "
                                 "train LoRA adapters on lowbit's linear layers (target_modules) instead")
    _peft_prepare(self, config, model)


LoraModel._prepare_model = _prepare_model


def _lora_layer(target: nn.Module, adapter_name: str, config: peft.LoraConfig, target_name: str = "",
                **kwargs) -> nn.Module:
    """PEFT's LoRA layer for a lowbit one: a QuantizedLoraLinear over it, or
    a fused layer a regex matches with its slices as it is. Its slices take
    the adapters; a wrapper of it would take none and never run (its slices
    call the fused layer itself), which PEFT's passes over every LoRA layer,
    EVA's hooks for one, do not expect."""
    fused_from = getattr(target, "fused_from", None)
    if not fused_from:
        return QuantizedLoraLinear(target, adapter_name, config=config, target_name=target_name, **kwargs)
    parent = target_name.rpartition(".")[0]
    slices = [f"{parent}.{name}" if parent else name for name in fused_from]
    # Named, or matched by a regex that none of its slices matches: the adapter would be its own alone.
    if not isinstance(config.target_modules, str) or not any(re.fullmatch(config.target_modules, s) for s in slices):
        raise ValueError(f"lowbit.lora: {target_name or 'the target'} is lowbit's fused layer of "
                         f"{', '.join(fused_from)} (lowbit.fusing): name those in target_modules (an adapter on them "
                         "is the model's own), or load the model with fuse=False")
    return target


def register(config: peft.LoraConfig) -> peft.LoraConfig:
    """`config` with lowbit's quantized layers registered as LoRA targets."""
    if config.target_modules == peft.utils.constants.INCLUDE_LINEAR_LAYERS_SHORTHAND:
        raise ValueError("lowbit.lora: target_modules='all-linear' picks torch.nn.Linear modules, which lowbit's "
                         "quantized layers are not: name them (e.g. ['q_proj', 'k_proj', 'v_proj', 'o_proj', "
                         "'gate_proj', 'up_proj', 'down_proj'])")
    if config.trainable_token_indices:
        raise ValueError("lowbit.lora: trainable_token_indices trains rows of the token embedding, which lowbit's "
                         "models hold as a frozen GGUFEmbedding table")
    config._register_custom_module({GGUFLinear: _lora_layer, GPTQLinear: _lora_layer, ProjectionSlice: _lora_layer})
    return config


def LoraConfig(**kwargs) -> peft.LoraConfig:  # noqa: N802  (named as the class it makes)
    """peft.LoraConfig(**kwargs) with lowbit's quantized layers registered."""
    return register(peft.LoraConfig(**kwargs))


def load_adapter(model: nn.Module, path: str | os.PathLike, adapter_name: str = "default",
                 is_trainable: bool = False) -> peft.PeftModel:
    """A saved PEFT adapter onto `model`, a lowbit model of the same weights
    (peft.PeftModel.from_pretrained) or a PEFT model of one, as one more
    adapter (its load_adapter), with the adapter's config registered: PEFT's
    own loaders build the config from the file, without lowbit's layers. A
    refused file leaves the model as it came."""
    check_module("lowbit.lora.load_adapter", model)
    # An empty path is the working directory to os.path, whose adapter_config.json would be read.
    path = check_path("lowbit.lora.load_adapter", path)
    is_trainable = check_flag("lowbit.lora.load_adapter", "is_trainable", is_trainable)
    # PEFT keys the adapter's layers by it in ModuleDicts, whose KeyError or TypeError names no argument.
    if not isinstance(adapter_name, str):
        raise TypeError(f"lowbit.lora.load_adapter: adapter_name must be a str, got {type(adapter_name).__name__}")
    if not adapter_name or "." in adapter_name:
        raise ValueError(f"lowbit.lora.load_adapter: adapter_name must be a non-empty name without '.', got "
                         f"{shown(adapter_name)}")
    raw, config_file = _check_files(os.fspath(path)), os.path.join(os.fspath(path), "adapter_config.json")
    _check_patterns(raw, config_file, [name for name, _ in model.named_modules()])
    fresh = not isinstance(model, peft.PeftModel)
    decoder = _check_replication(raw.get("layer_replication"), config_file, model, fresh)
    config = register(peft.LoraConfig.from_pretrained(os.fspath(path)))
    config.inference_mode = not is_trainable
    if fresh:
        requires_grad = [(p, p.requires_grad) for p in model.parameters()]  # PEFT freezes the base's
        # PeftModel.from_pretrained's two steps, the second in the try below: a file whose tensors do not fit
        # the layers (a rank or shape apart) fails in it, after the first has put the layers into the model.
        try:
            model = peft.MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, peft.PeftModel)(model, config,
                                                                                               adapter_name)
        except Exception:  # PEFT's own refusals (no target module found) come after its layer_replication
            _restore_decoder(decoder)
            raise
    elif adapter_name in model.peft_config:
        raise ValueError(f"lowbit.lora.load_adapter: the model already has an adapter named {adapter_name!r}")
    # A refused file leaves the model as it came: PEFT puts the adapter's layers into it in place (a
    # fresh model's own modules), where they would stay active, or be saved with the model's adapters.
    try:
        if not fresh:
            model.add_adapter(adapter_name, config)
            if is_trainable:
                model.set_requires_grad(adapter_name)
        try:
            model.load_adapter(os.fspath(path), adapter_name, is_trainable=is_trainable)
        except RuntimeError as e:  # torch's load_state_dict, naming the tensors but not the file
            raise ValueError(f"lowbit.lora.load_adapter: {path}: the adapter's tensors do not fit its layers in the "
                             f"model: {shown_text(e)}") from e
        _check_loaded(model, os.fspath(path), adapter_name)
    except Exception:
        if fresh:
            model.unload()
            for p, flag in requires_grad:
                p.requires_grad_(flag)
            _restore_decoder(decoder)
        elif adapter_name in model.peft_config:
            model.delete_adapter(adapter_name)
        raise
    return model


def _check_replication(layer_map, config_file: str, model: nn.Module, fresh: bool):
    """A config's layer_replication ([start, end) ranges of decoder layers,
    which PEFT rebuilds the model's layers from, sharing their weights) as
    PEFT can take it: whole ranges of the model's layers, at most
    MAX_REPLICATION times their number in all (a range repeated a million
    times would clone a million layers), onto a model without adapters
    (PEFT would rebuild the layers the others are on). Returns what a refusal
    restores: the layers' holder, its layers and its config's layer count
    (None without replication)."""
    if layer_map is None or layer_map == []:  # PEFT's none
        return None
    holder = model
    while hasattr(holder, "model"):  # where PEFT's replicate_layers looks
        holder = holder.model
    layers = getattr(holder, "layers", None)
    count = len(layers) if isinstance(layers, nn.ModuleList) else 0
    if not fresh:
        raise ValueError(f"lowbit.lora.load_adapter: {config_file}: layer_replication rebuilds the decoder layers, "
                         "which the model's adapters are on: load it onto the model without adapters")
    ranges = isinstance(layer_map, list) and all(
        isinstance(r, list) and len(r) == 2 and all(map(is_integer, r)) and 0 <= r[0] < r[1] <= count
        for r in layer_map)
    if not ranges or not 0 < sum(end - start for start, end in layer_map) <= MAX_REPLICATION * count:
        raise ValueError(f"lowbit.lora.load_adapter: {config_file}: layer_replication must be [start, end) ranges "
                         f"of the model's {count} decoder layers, at most {MAX_REPLICATION * count} layers in all, "
                         f"got {shown(layer_map)}")
    return holder, layers, holder.config.num_hidden_layers


def _restore_decoder(decoder) -> None:
    """The decoder layers _check_replication found, which PEFT's
    layer_replication replaces and unload leaves."""
    if decoder is not None:
        holder, holder.layers, holder.config.num_hidden_layers = decoder


def _check_loaded(model: peft.PeftModel, path: str, adapter_name: str) -> None:
    """The adapter's tensors in the file are exactly those its layers in the
    model take, float, and finite in the layers' dtype: PEFT only warns of
    keys that found no layer (the adapter then adds nothing there), and
    loads NaN as it is and integers cast to float."""
    stored = peft.utils.load_peft_weights(path, device="cpu")
    taken = peft.utils.get_peft_model_state_dict(model, adapter_name=adapter_name)
    unplaced, missing = sorted(set(stored) - set(taken)), sorted(set(taken) - set(stored))
    if unplaced or missing:
        # bias='all' and 'lora_only' adapters hold the projections' own biases, which a fused layer holds as one.
        fused = any(getattr(m, "fused_from", None) for m in model.modules())
        advice = ("; its biases are the projections' own: load the model with fuse=False"
                  if fused and any(k.endswith(".bias") and ".lora_" not in k for k in unplaced) else "")
        raise ValueError(f"lowbit.lora.load_adapter: {path}: the adapter's tensors do not match its layers in the "
                         f"model (in the file only: {unplaced[:3]}{' ...' if len(unplaced) > 3 else ''}; in the "
                         f"model only: {missing[:3]}{' ...' if len(missing) > 3 else ''}){advice}")
    for name, t in stored.items():  # torch's load casts an integer or bool tensor into the float layer
        if not t.is_floating_point():
            raise ValueError(f"lowbit.lora.load_adapter: {path}: tensor {shown(name)} is {t.dtype}, not a float tensor")
    # Finite as the layers hold them: a float64 1e300 is finite in the file and inf in float32.
    bad = [name for name, t in taken.items() if not torch.isfinite(t).all()]
    if bad:
        raise ValueError(f"lowbit.lora.load_adapter: {path}: tensor {bad[0]!r} holds a NaN or infinity")


def _check_patterns(raw: dict, config_file: str, names: list[str]) -> None:
    """Each regular expression of the config compiles and matches the
    model's module names, in PEFT's patterns, within PATTERN_SECONDS, in a
    child process: one that backtracks catastrophically (`(.*.)*q_proj`)
    would hang PEFT's load for good. Lists of module names hold at most
    MAX_UNMATCHED_NAMES that name no module."""
    # A list entry names a module where it is one of the dot-separated tails of the module's name.
    tails = {".".join(parts[i:]) for parts in (name.split(".") for name in names) for i in range(len(parts))}
    for key in ("target_modules", "exclude_modules"):
        listed = raw.get(key)
        unmatched = {v for v in listed if isinstance(v, str)} - tails if isinstance(listed, list) else ()
        if len(unmatched) > MAX_UNMATCHED_NAMES:
            raise ValueError(f"lowbit.lora.load_adapter: {config_file}: {key} lists {len(unmatched)} names of no module "
                             f"of the model (at most {MAX_UNMATCHED_NAMES}), such as {shown(min(unmatched))}")
    found = []  # (key, the config's expression, PEFT's pattern around it)
    for key, around in PEFT_PATTERNS.items():
        value = raw.get(key)
        if key in ("target_modules", "exclude_modules"):  # a list is of names, matched as strings
            value = [value] if isinstance(value, str) else []
        elif key in ("rank_pattern", "alpha_pattern"):
            value = list(value) if isinstance(value, dict) else []
        elif isinstance(value, str):
            value = [value]
        found += [(key, v, around.format(v)) for v in value or () if isinstance(v, str)]
    for key, expression, pattern in found:
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            raise ValueError(f"lowbit.lora.load_adapter: {config_file}: {key} holds {shown(expression)}, no regular "
                             f"expression PEFT can use: {shown_text(e)}") from e
    if not found:
        return
    job = json.dumps({"patterns": [pattern for _, _, pattern in found], "names": names})
    try:
        subprocess.run([sys.executable, "-I", "-S", "-c", _MATCH_EACH], input=job, capture_output=True, text=True,
                       timeout=PATTERN_SECONDS, check=True)
    except subprocess.TimeoutExpired as e:
        done = (e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "").count("\n")
        key, expression, _ = found[min(done, len(found) - 1)]
        raise ValueError(f"lowbit.lora.load_adapter: {config_file}: {key} holds {shown(expression)}, which takes more "
                         f"than {PATTERN_SECONDS:g} s to match the model's {len(names)} module names (a regular "
                         "expression that backtracks)") from None


def _check_files(path: str) -> dict:
    """The adapter's files are regular files (a named pipe would block the
    reader for good), its config a LoRA one whose ranks are no larger than
    the file's tensors and whose alphas scale by a finite, non-zero factor
    within MAX_SCALE: PEFT allocates every layer's r x in_features adapter
    before it reads a tensor (r = 10^9 asks for terabytes), and takes a NaN,
    inf or 1e300 alpha, which turns every logit NaN. A rank is bounded by the
    tensors' largest size, not their ranks: a config's r that its
    rank_pattern overrides for every layer is no rank of the file. Returns
    the config as the file holds it."""
    config_file = os.path.join(path, "adapter_config.json")
    # PEFT's two weights files, in the order its loader takes them (the second is torch's pickle format).
    weights_file = next((f for f in WEIGHTS_FILES if os.path.lexists(os.path.join(path, f))), WEIGHTS_FILES[0])
    weights_file = os.path.join(path, weights_file)
    for file, what in ((config_file, "adapter config"), (weights_file, "adapter weights file")):
        check_regular_file(file, what)  # here, not in read_json: a ValueError, not one of a GPTQ checkpoint
    raw = read_json(config_file, "adapter config", ValueError)
    try:
        if weights_file.endswith(".safetensors"):
            with safetensors.safe_open(weights_file, "pt") as f:  # reads the header only
                shapes = [f.get_slice(k).get_shape() for k in f.keys()]
        else:  # mapped, not read: only the shapes are wanted here
            shapes = [t.shape for t in torch.load(weights_file, map_location="cpu", weights_only=True,
                                                  mmap=True).values()]
    except Exception as e:  # the readers' own error types, for a truncated file or a header that lies
        raise ValueError(f"lowbit.lora.load_adapter: {weights_file}: unreadable: {shown_text(e)}") from e
    largest = max((size for shape in shapes for size in shape), default=0)

    def refuse(key, value, must):
        raise ValueError(f"lowbit.lora.load_adapter: {config_file}: {key} must be {must}, got {shown(value)}")

    if raw.get("peft_type") != "LORA":
        refuse("peft_type", raw.get("peft_type"), "'LORA'")
    if raw.get("bias", "none") not in BIASES:  # PEFT refuses others after it has changed the model
        refuse("bias", raw["bias"], f"one of {BIASES}")
    targets = raw.get("target_modules")  # None: PEFT's own for the model's type
    if not (targets is None or isinstance(targets, str) or isinstance(targets, list)
            and all(isinstance(t, str) for t in targets)):
        refuse("target_modules", targets, "a regex or a list of module names")
    layers = raw.get("layers_to_transform")
    if not (layers is None or is_integer(layers) or isinstance(layers, list) and all(map(is_integer, layers))):
        refuse("layers_to_transform", layers, "a layer index or a list of them")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(raw.get(key) or {}, dict):
            refuse(key, raw[key], "an object of module patterns")
    ranks = [("r", raw.get("r", 8))] + [(f"rank_pattern[{shown(k)}]", v)
                                        for k, v in (raw.get("rank_pattern") or {}).items()]
    for key, r in ranks:
        if not is_integer(r) or not 1 <= r <= largest:
            refuse(key, r, f"an integer from 1 to {largest}, the largest size of the tensors in {weights_file}")
    alphas = [("lora_alpha", raw.get("lora_alpha", 8))] + [(f"alpha_pattern[{shown(k)}]", v)
                                                             for k, v in (raw.get("alpha_pattern") or {}).items()]
    for key, alpha in alphas:
        if (not isinstance(alpha, numbers.Real) or isinstance(alpha, bool) or not math.isfinite(alpha)
                or not 1 / MAX_SCALE <= abs(alpha) <= MAX_SCALE):
            refuse(key, alpha, f"a number of magnitude {1 / MAX_SCALE} to {MAX_SCALE:g}")
    return raw
