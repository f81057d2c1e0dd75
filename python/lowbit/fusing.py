"""Projections that read the same input, as one quantized matmul.

A decoder layer multiplies its normed hidden states by q_proj, k_proj and
v_proj, and its MLP's input by gate_proj and up_proj. Each of lowbit's
matmuls has a fixed cost (the call, quantizing the activations, starting the
threads) that is as large as a small layer's whole matvec, so
fuse_projections(model) puts each such group's rows into one layer of the
same type over the concatenated rows (`qkv_proj`, `gate_up_proj` beside
them, as vLLM's models have), and leaves in each projection's place a
ProjectionSlice: the first slice called on an input runs the fused layer,
and each sibling called on the same input takes its columns of that result.

The model's own forward is unchanged, so any architecture works: a slice
called on an input its group has not just computed (another tensor, the same
one written in between, the same slice twice, or after the fused layer's
load_state_dict) runs the fused layer again.
(Inference tensors and torch.compile's graphs count no writes: there only
the input's identity is checked.)
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ._checks import check_module
from ._frozen import autocast_dtype

if TYPE_CHECKING:
    from .gguf.file import GGUFFile

__all__ = ["PROJECTION_GROUPS", "ProjectionSlice", "fuse_projections", "unfused_state_dict"]

# Sibling projections that transformers' decoder layers call on one input.
PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedOutputs:
    """A fused layer's latest output, for its slices: one tuple of the input
    it was for, that input's version and the parts not taken yet, read and
    replaced whole, so threads sharing the model never pair one call's input
    with another's parts. A plain object: nn.Module's __setattr__ would cost
    more per call than a small matvec."""

    def __init__(self, layer: nn.Module, sizes: Sequence[int]):
        self.layer, self.sizes = layer, tuple(sizes)
        self.latest = None  # (input, (version, grad mode), parts)

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Part `index` of layer(x): the parts of one call, each taken once."""
        latest = self.latest
        # Inference tensors and traced graphs have no version counters (nor
        # can torch.compile guard on one): there the input's identity decides.
        # A result made without autograd serves no call that records a graph (nor the other way round),
        # nor one made in another autocast dtype (or outside autocast) a call in another.
        version = (None if torch.compiler.is_compiling() or x.is_inference() else x._version, torch.is_grad_enabled(),
                   autocast_dtype(x.device.type))
        if latest is None or latest[0] is not x or latest[1] != version or latest[2][index] is None:
            latest = self.latest = (x, version, list(self.layer(x).split(self.sizes, dim=-1)))
        parts = latest[2]
        out, parts[index] = parts[index], None
        # Once every part is taken nothing is held: no activation outlives its step.
        if self.latest is latest and all(p is None for p in parts):
            self.latest = None
        return out

    def forget(self, module=None, incompatible_keys=None) -> None:
        """Drops the parts not taken yet: the fused layer's load_state_dict
        post hook, since a load changes the weights they were computed with
        and the input they were for may come again unchanged."""
        self.latest = None

    def __getstate__(self):
        return {"layer": self.layer, "sizes": self.sizes, "latest": None}


class _Forget:
    """The fused layer's load_state_dict post hook: its outputs' forget().
    It holds them weakly, since they hold the layer, whose hooks hold it: a
    cycle would keep a dropped model's fused weights until Python's cyclic
    collector runs. A copy (deepcopy, pickle) hooks the copy's outputs."""

    def __init__(self, outputs: FusedOutputs | None):
        self.outputs = weakref.ref(outputs) if outputs is not None else None

    def __call__(self, module=None, incompatible_keys=None) -> None:
        outputs = self.outputs and self.outputs()
        if outputs is not None:
            outputs.forget()

    def __reduce__(self):
        return type(self), (self.outputs and self.outputs(),)


class ProjectionSlice(nn.Module):
    """A projection whose rows are rows [start, start + out_features) of a
    fused layer (its parent's qkv_proj or gate_up_proj): that part of the
    fused layer's output."""

    def __init__(self, outputs: FusedOutputs, index: int, name: str):
        super().__init__()
        # Not a submodule: the parent holds the fused layer, once, under its own name.
        self.__dict__["outputs"] = outputs
        self.index, self.fused_name = index, name
        self.in_features = outputs.layer.in_features
        self.out_features = outputs.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outputs.take(self.index, x)

    @property
    def rows(self) -> slice:
        """Its rows of the fused layer."""
        start = sum(self.outputs.sizes[:self.index])
        return slice(start, start + self.out_features)

    @property
    def qweight(self) -> torch.Tensor:
        """Its rows' quantized weight in the checkpoint's layout (where PEFT,
        for one, finds a quantized layer's device)."""
        return self.outputs.layer.part_state(self.rows)["qweight"]

    @property
    def bias(self) -> torch.Tensor | None:
        """This projection's part of the fused layer's bias (None without one)."""
        bias = self.outputs.layer.bias
        return None if bias is None else bias[self.rows]

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features]: its rows of the fused layer's."""
        layer = self.outputs.layer
        return (layer.dequantize() if dtype is None else layer.dequantize(dtype))[self.rows]

    def extra_repr(self) -> str:
        return f"{self.fused_name} part {self.index}, in_features={self.in_features}, out_features={self.out_features}"


def fused_name(names: Sequence[str]) -> str:
    """qkv_proj for q_proj, k_proj, v_proj; gate_up_proj for gate_proj, up_proj."""
    stems = [n.removesuffix("_proj") for n in names]
    return ("" if all(len(s) == 1 for s in stems) else "_").join(stems) + "_proj"


def fuse_projections(model: nn.Module, mapped: GGUFFile | None = None) -> list[str]:
    """Each PROJECTION_GROUPS group of sibling lowbit layers in `model` (or
    the members of one that can join: same type, same input size, ...) as
    one layer over their concatenated rows, with a ProjectionSlice in each one's place. Layers
    of other types, and names the parent already uses for the fused layer
    (Phi-3's own qkv_proj), are left as they are. `mapped`: the file whose
    mapping the layers' rows may be views of. Rows it stores back to back
    are joined as one view of it, without a copy (GGUFFile.back_to_back);
    rows joined by copying have their pages of the mapping dropped from
    memory (GGUFFile.release). A layer registered in several places (tied
    parents) is fused once, its fused layer and slices shared by them all,
    where each holds it under the same name beside the same siblings;
    anywhere else it stays as it is. Returns the fused layers' names, one
    per parent."""
    check_module("fuse_projections", model)
    from .gguf.file import GGUFFile  # here: lowbit.gguf.model, which lowbit.gguf imports, imports this module

    if mapped is not None and not isinstance(mapped, GGUFFile):  # else an AttributeError at the first join
        raise TypeError(f"fuse_projections: mapped must be a GGUFFile or None, got {type(mapped).__name__}")
    parent_names = {id(module): name for name, module in model.named_modules()}
    tied = _tied_projections(model)
    fused_names = []
    # Names, not modules: a list of the modules would keep every replaced
    # projection (its weights) alive until the last group is joined.
    for parent_name in list(parent_names.values()):
        parent = model.get_submodule(parent_name)
        for group in PROJECTION_GROUPS:
            for names in _joinable(parent, group, tied):
                name = fused_name(names)
                holders = tied[id(parent), names[0]]
                if any(hasattr(holder, name) for holder in holders):
                    continue
                layers = [parent._modules[n] for n in names]
                fused = type(layers[0]).joined(layers, mapped.back_to_back if mapped is not None else None)
                outputs = FusedOutputs(fused, [layer.out_features for layer in layers])
                fused.register_load_state_dict_post_hook(_Forget(outputs))
                fused.fused_from = tuple(names)  # what it stands for (lowbit.lora leaves it to its slices)
                slices = [ProjectionSlice(outputs, index, name) for index in range(len(names))]
                for holder in holders:
                    holder.add_module(name, fused)
                    for n, part in zip(names, slices):
                        holder.add_module(n, part)
                    holder_name = parent_names[id(holder)]
                    fused_names.append(f"{holder_name}.{name}" if holder_name else name)
                if mapped is not None and fused.qweight.data_ptr() != layers[0].qweight.data_ptr():  # a copy
                    mapped.release([layer.qweight for layer in layers])
                del layers
    return fused_names


def _tied_projections(model: nn.Module) -> dict[tuple[int, str], list[nn.Module]]:
    """(id of a parent, a projection's name) -> every parent that holds that
    projection's layer, for each layer that can be fused once for them all:
    each holds it under that name, beside the same layers under the group's
    other names. A layer held anywhere else (under another name, in another
    group, or beside other siblings) is left out: a fused copy of it would
    hold its weights twice, and the places would compute with different modules."""
    places = {}
    for parent in model.modules():
        for name, child in parent._modules.items():
            if child is not None:
                places.setdefault(id(child), []).append((parent, name))
    tied = {}
    for parent in model.modules():
        for group in PROJECTION_GROUPS:
            siblings = [parent._modules.get(n) for n in group]
            for n, layer in zip(group, siblings):
                held = places.get(id(layer), [])
                if layer is not None and all(name == n and [holder._modules.get(g) for g in group] == siblings
                                              for holder, name in held):
                    tied[id(parent), n] = [holder for holder, _ in held]
    return tied


def _joinable(parent: nn.Module, group: Sequence[str], tied: dict) -> list[list[str]]:
    """The sets of the group's layers in `parent` that can join, each of two
    or more, in the group's order (a Q4_K_M file's q and k may share a type
    that its v does not); only layers in `tied` (_tied_projections)."""
    left = [n for n in group if hasattr(parent._modules.get(n), "can_join") and (id(parent), n) in tied]
    runs = []
    while len(left) > 1:
        first = parent._modules[left[0]]
        members = [left[0]] + [n for n in left[1:] if first.can_join(parent._modules[n])]
        if len(members) > 1:
            runs.append(members)
        left = [n for n in left if n not in members]
    return runs


def unfused_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """model.state_dict() as the model before fuse_projections has it: each
    fused layer's tensors under its projections' names, each projection its
    rows (GPTQ: columns) of them, so a checkpoint saved from a fused model
    is the checkpoint it was loaded from."""
    check_module("unfused_state_dict", model)
    state = model.state_dict()
    fused = set()
    # Every name a shared slice has: state_dict holds its tensors under each.
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, ProjectionSlice):
            parent = name.rpartition(".")[0]
            fused.add(f"{parent}.{module.fused_name}." if parent else f"{module.fused_name}.")
            for key, tensor in module.outputs.layer.part_state(module.rows).items():
                state[f"{name}.{key}"] = tensor
    for key in [k for k in state if any(k.startswith(prefix) for prefix in fused)]:
        del state[key]
    return state
