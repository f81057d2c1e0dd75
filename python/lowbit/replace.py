"""lowbit.replace_linear: load a quantized checkpoint into an existing PyTorch /
HF transformers model, swapping its nn.Linear layers for lowbit layers."""
from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from .gguf_file import GGUFError, GGUFFile, GGUFTensor, load_gguf
from .gguf_linear import GGUFLinear
from .gguf_arch import architecture, expert_modules, hf_name, hf_value, rows_in_hf_order
from .gguf_experts import ClampedSwiGLU, GGUFExperts
from .gptq.checkpoint import GPTQCheckpoint, GPTQCheckpointError, load_gptq
from .gptq.experts import EXPERT_LAYER, PROJECTIONS, GPTQExpert, GPTQExperts, current_name
from .moe import experts_dims, plain_experts


@dataclass
class ReplaceReport:
    replaced: list[str] = field(default_factory=list)  # modules now lowbit layers
    loaded: list[str] = field(default_factory=list)  # parameters loaded as plain tensors
    unplaced: list[str] = field(default_factory=list)  # checkpoint tensors with no place in the model


def replace_linear(model: nn.Module, path: str | os.PathLike, checkpoint_format: str | None = None) -> ReplaceReport:
    """Loads the checkpoint at `path` into `model`, swapping nn.Linear layers for
    lowbit layers. A model parameter the checkpoint does not provide raises
    ValueError; checkpoint tensors the model has no place for are warned about
    and listed in the report.

    A `.gguf` file of an architecture in lowbit.gguf_arch.ARCHITECTURES
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
    `checkpoint_format` ("gptq" / "gptq_v2") overrides the config's.

    A model built on the meta device (no memory) takes the checkpoint's
    tensors on the CPU in its place (lowbit.load_gguf_model and
    load_gptq_model build models that way).
    """
    path = os.fspath(path)
    if path.endswith(".gguf"):
        return _replace_from_gguf(model, path)
    return _replace_from_gptq(model, path, checkpoint_format)


def _replace_from_gptq(model: nn.Module, path: str, checkpoint_format: str | None) -> ReplaceReport:
    ckpt = _named_as_model(model, load_gptq(path, checkpoint_format))
    report = ReplaceReport()
    wanted = [n for n, _ in model.named_parameters()]  # tied parameters once, as HF saves them
    wanted += [n for n, _ in _persistent_buffers(model)]
    placed = set()
    in_experts = _place_gptq_experts(model, ckpt, report, placed)
    for name, layer in ckpt.modules.items():
        if name in in_experts:
            continue
        module = _get_module(model, name)
        if not isinstance(module, nn.Linear):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {name!r} is quantized in the checkpoint but the "
                                      f"model has {type(module).__name__ if module is not None else 'no such module'}")
        if (module.in_features, module.out_features) != (layer.in_features, layer.out_features):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {name!r} is [{layer.out_features} x "
                                      f"{layer.in_features}] in the checkpoint but Linear({module.in_features}, "
                                      f"{module.out_features}) in the model")
        if (module.bias is None) != (layer.bias is None):
            raise GPTQCheckpointError(f"{ckpt.directory}: module {name!r}: the checkpoint "
                                      f"{'has no' if layer.bias is None else 'has a'} bias, the model "
                                      f"{'has one' if module.bias is not None else 'has none'}")
        # On the model's device; a model built on the meta device takes the checkpoint's (CPU) tensors.
        model.set_submodule(name, layer if module.weight.is_meta else layer.to(module.weight.device))
        report.replaced.append(name)
        placed.update(f"{name}.{p}" for p in ("weight", "bias"))
    targets = dict(model.named_parameters())
    targets.update(_persistent_buffers(model))
    for name, tensor in ckpt.tensors.items():
        target = targets.get(name)
        if target is None:
            report.unplaced.append(name)
            continue
        if tuple(target.shape) != tuple(tensor.shape):
            raise GPTQCheckpointError(f"{ckpt.directory}: tensor {name!r} has shape {tuple(tensor.shape)} but the "
                                      f"model's is {tuple(target.shape)}")
        _load_tensor(model, target, tensor)
        report.loaded.append(name)
        placed.add(name)
    if report.unplaced:
        warnings.warn(f"replace_linear: {ckpt.directory}: tensors with no place in the model: {report.unplaced}")
    missing = [n for n in wanted if n not in placed]
    if missing:
        raise GPTQCheckpointError(f"replace_linear: {ckpt.directory} has no tensor for model parameters {missing}")
    return report


def _named_as_model(model: nn.Module, ckpt: GPTQCheckpoint) -> GPTQCheckpoint:
    """The checkpoint with the older names the model has no module for
    under their current ones (gptq.experts.current_name)."""
    def renamed(name: str, module_name: str) -> str:
        return name if _get_module(model, module_name) is not None else current_name(name)

    return dataclasses.replace(ckpt, modules={renamed(n, n): layer for n, layer in ckpt.modules.items()},
                               tensors={renamed(n, n.rpartition(".")[0]): t for n, t in ckpt.tensors.items()})


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
        module = _get_module(model, prefix)
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


def _replace_from_gguf(model: nn.Module, path: str) -> ReplaceReport:
    return place_gguf_tensors(model, load_gguf(path), "replace_linear")


def place_gguf_tensors(model: nn.Module, f: GGUFFile, caller: str, consumed: tuple[str, ...] = ()) -> ReplaceReport:
    """replace_linear's GGUF work on an open file. File tensors with no place
    in the model are warned about (as `caller`), except those the caller
    uses itself (`consumed`). A model built on the meta device gets the
    file's float tensors as new parameters."""
    path = f.path
    spec = architecture(f.metadata, f"{caller}: {path}")
    report = ReplaceReport()
    wanted = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    placed = set()
    in_experts = set(_place_experts(model, f, report, placed))

    # Linear weights first, so bias tensors find their (new) layers afterwards.
    tensors = sorted(f.tensors.values(), key=lambda t: not t.name.endswith(".weight"))
    for t in tensors:
        if t.name in in_experts:
            continue
        name = hf_name(t.name, spec)
        module_name, _, attr = (name or "").rpartition(".")
        module = _get_module(model, module_name) if name else None
        if module is None or not hasattr(module, attr):
            report.unplaced.append(t.name)
            continue
        if isinstance(module, nn.Linear) and attr == "weight":
            # A one-output layer may come as a 1-D tensor (qwen2moe's shared-expert gate).
            one_row = module.out_features == 1 and len(t.shape) == 1
            shape = (module.out_features, module.in_features)
            check_shape(path, t, module_name, shape[1:] if one_row else shape)
            layer = GGUFLinear.from_raw(rows_in_hf_order(t.name, t.data, f.metadata), t.type, module.in_features, module.bias)
            model.set_submodule(module_name, layer)
            report.replaced.append(module_name)
        else:
            target = getattr(module, attr)
            check_shape(path, t, name, tuple(target.shape))
            value = hf_value(t.name, t.dequantize(), f.metadata)
            _load_tensor(model, target, value)
            report.loaded.append(name)
        placed.add(name)

    unexpected = [name for name in report.unplaced if name not in consumed]
    if unexpected:
        warnings.warn(f"{caller}: {path}: tensors with no place in the model: {unexpected}")
    _tie_lm_head(model, f, report, placed)
    missing = [n for n in wanted if n not in placed]
    if missing:
        raise ValueError(f"{caller}: {path} has no tensor for model parameters {missing}")
    return report


def _place_experts(model: nn.Module, f: GGUFFile, report: ReplaceReport, placed: set) -> list[str]:
    """Each layer's expert tensors as one GGUFExperts in place of the model's
    experts module (transformers' 3-D gate_up_proj and down_proj, [in, out]
    where the module says is_transposed, with biases where it has them:
    gpt-oss's, whose gated activation is its ClampedSwiGLU); returns the
    GGUF tensors it used."""
    used = []
    for module_name, parts in expert_modules(f.tensors).items():
        module = _get_module(model, module_name)
        biased = getattr(module, "has_bias", False)
        wanted = {"gate", "up", "down"} | ({"gate.bias", "up.bias", "down.bias"} if biased else set())
        dims = experts_dims(module)
        if dims is None or set(parts) != wanted:
            continue  # not transformers' 3-D experts, or not all parts: reported unplaced by the caller
        tensors = {part: f.tensors[name] for part, name in parts.items()}
        experts, hidden, intermediate = dims
        shapes = {"gate": (experts, intermediate, hidden), "up": (experts, intermediate, hidden),
                  "down": (experts, hidden, intermediate)}
        for part, shape in shapes.items():
            check_shape(f.path, tensors[part], f"{module_name}'s {part} experts", shape)
            if biased:
                check_shape(f.path, tensors[f"{part}.bias"], f"{module_name}'s {part} experts' biases", shape[:2])
        biases = {p: tensors[f"{p}.bias"].dequantize() for p in shapes} if biased else None
        glu = ClampedSwiGLU(module.alpha, module.limit) if hasattr(module, "limit") else None
        layer = GGUFExperts(*((tensors[p].data, tensors[p].type) for p in ("gate", "up", "down")), experts=experts,
                            hidden_size=hidden, intermediate_size=intermediate,
                            act_fn=None if glu else module.act_fn, glu=glu, biases=biases)
        model.set_submodule(module_name, layer)
        report.replaced.append(module_name)
        placed.update(f"{module_name}.{n}" for n, _ in module.named_parameters())
        used += parts.values()
    return used


def _load_tensor(model: nn.Module, target: torch.Tensor, value: torch.Tensor) -> None:
    """Copies `value` into the model's tensor `target`, or, where that tensor
    is on the meta device (a model built without memory), puts a CPU tensor
    of the target's dtype and kind (parameter or buffer) in its place wherever
    the model holds it, so tied parameters (an LM head tied to the embedding)
    stay tied, as they do under copy_."""
    if not target.is_meta:
        with torch.no_grad():
            target.copy_(value)
        return
    new = value.to(target.dtype)
    if isinstance(target, nn.Parameter):
        new = nn.Parameter(new, requires_grad=target.requires_grad)
    holders = [(m, name) for m in model.modules()
               for name, t in [*m._parameters.items(), *m._buffers.items()] if t is target]
    for module, name in holders:
        setattr(module, name, new)


def _tie_lm_head(model: nn.Module, f, report: ReplaceReport, placed: set) -> None:
    """Without output.weight, llama.cpp multiplies by the token embedding's
    blocks; do the same for an LM head still tied to the embedding."""
    head = _get_module(model, "lm_head")
    embd = f.tensors.get("token_embd.weight")
    if "output.weight" in f.tensors or not isinstance(head, nn.Linear) or embd is None:
        return
    check_shape(f.path, embd, "lm_head", (head.out_features, head.in_features))
    model.set_submodule("lm_head", GGUFLinear.from_raw(embd.data, embd.type, head.in_features, head.bias))
    report.replaced.append("lm_head")
    placed.add("lm_head.weight")


def _get_module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else None
    except AttributeError:
        return None


def check_shape(path: str, t: GGUFTensor, target: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise GGUFError(f"{path}: tensor {t.name!r} has shape {tuple(t.shape)} but {target} needs {tuple(shape)}")
