"""The CPU kernels' repacked layouts across a model: which ggml types have
one, which the active kernels read as it is, and repack_model, which puts
every GGUFLinear, GGUFExperts and GPTQLinear that gains from it in it."""
import warnings

import torch
from torch import nn

from .._checks import check_module
from ..gptq.linear import GPTQLinear
from ..ops import GGMLType
from .experts import GGUFExperts, ggml_type_ids
from .linear import GGUFLinear


def has_repacked_layout(qtype: int) -> bool:
    """Whether ggml type `qtype` has the CPU kernels' repacked layout (a
    column of the CPU traits table, csrc/cpu/ggml_traits.h)."""
    return torch.ops.lowbit.ggml_has_repacked_layout(int(qtype))


def repacked_by_default(qtype: int) -> bool:
    """Whether repack_model takes a layer of type `qtype` unless told
    otherwise (the traits table's last column: Q6_K's file-layout matvec
    already reads at the memory's speed, so its layers stay as they are)."""
    return bool(torch.ops.lowbit.ggml_cpu_traits(int(qtype))[-1])


def reads_repacked_layout(qtype: int) -> bool:
    """Whether the active CPU kernels read type `qtype`'s repacked layout as
    it is (AVX-512 VNNI: every type with the layout; AVX2: those the CPU
    traits table, csrc/cpu/ggml_traits.h, names). Otherwise each call puts the
    rows back into the file's layout first: correct, but several times slower
    than the file's layout (torch.ops.lowbit.cpu_reads_repacked)."""
    return torch.ops.lowbit.cpu_reads_repacked(qtype)


def repack_model(model: nn.Module, skip_types=None, expert_skip_types=()) -> list[str]:
    """GGUFLinear.repack() on every GGUFLinear of `model` on the CPU whose
    type has the layout, is read as it is by the active CPU kernels
    (reads_repacked_layout) and is not in `skip_types` (by default, the
    types repacked_by_default leaves out), and
    GGUFExperts.repack() of every GGUFExperts' such projections (but those
    in `expert_skip_types`: its short expert rows gain from the layout in
    every type), and GPTQLinear.repack() of every GPTQLinear that can_repack()
    (on the CPU, out_features a multiple of 64); returns their names (an expert
    projection's as "<module>.gate", ".up", ".down"). It warns naming the
    types whose layout the kernels would put back on every call, and leaves
    those as they are."""
    check_module("repack_model", model)
    names, unread = [], set()
    skip_types = ({t for t in GGMLType if not repacked_by_default(t)} if skip_types is None
                  else ggml_type_ids("repack_model", skip_types, "skip_types"))
    expert_skip_types = ggml_type_ids("repack_model", expert_skip_types, "expert_skip_types")
    for name, module in model.named_modules():
        if (isinstance(module, GGUFLinear) and module.qweight.device.type == "cpu"
                and has_repacked_layout(module.qtype) and module.qtype not in skip_types):
            if reads_repacked_layout(module.qtype):
                module.repack()
                names.append(name)
            else:
                unread.add(module.qtype)
        elif isinstance(module, GPTQLinear) and (module.repacked or module.can_repack()):
            module.repack()
            names.append(name)
        elif isinstance(module, GGUFExperts) and module.gate_qweight.device.type == "cpu":
            names += [f"{name}.{p}" for p in module.repack(expert_skip_types)]
            unread.update(t for t in module.qtypes.values()
                          if has_repacked_layout(t) and not reads_repacked_layout(t) and t not in expert_skip_types)
    if unread:
        warnings.warn(f"lowbit.repack_model: this CPU's {torch.ops.lowbit.cpu_isa()} kernels would put the "
                      f"repacked rows back on every call for ggml types {sorted(unread)}; those layers stay in "
                      f"the file's layout")
    return names
