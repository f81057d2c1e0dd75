"""Tensor parallelism for act-order GPTQ layers: TP-aware dequantization
(Hoque et al., "TP-Aware Dequantization", IBM 2024).

An act-order (desc_act) checkpoint keeps input rows in their original order
with a scattered g_idx, so a row-parallel shard of rows [k0, k1) would need
scales and zeros from groups all over the tensor. Sorting the rows by group
(Algorithm 1, `make_sequential`) gives every shard a contiguous run of groups,
but the activations must then be permuted the same way; in a column-parallel
-> row-parallel MLP that costs an AllGather of the intermediate activation
(Algorithm 2, `NaiveTPMLP`). Algorithm 3 (`tp_aware`, `reorder_checkpoint`,
`TPAwareMLP`) moves that permutation offline into the output columns of the
column-parallel layers, so the sharded MLP needs one AllReduce and nothing else.

Row-parallel layers take this rank's slice of the input and all-reduce their
output over the process group (any backend: gloo on CPU, NCCL on CUDA);
column-parallel layers return this rank's slice of the output and
communicate nothing. Loaders build CPU modules; move them with `.to(device)`.
"""
from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from .checkpoint import (HEADER_DTYPES, GPTQCheckpointError, _module, check_finite_floats, check_module_tensors,
                         check_new_directory, checkpoint_files, forced_format_warning, hold_gptqmodel_zeros_as_v2,
                         read_tensors, source_configs, stored_format, v1_zeros_as_v2, v2_zeros_as_gptqmodel_v1,
                         write_checkpoint)
from .config import GPTQConfig, check_format, read_config
from .._checks import check_path, is_integer, shown, shown_text
from .._stored import StoredBuffers, holds_integers
from .linear import GPTQLinear, g_idx_out_of_range
from .packing import fields_per_pack, words_per_pack

__all__ = [
    "ColumnParallelGPTQLinear", "NaiveTPMLP", "RowParallelGPTQLinear", "SequentialGPTQLinear", "TPAwareMLP",
    "group_order", "make_sequential", "permute_inputs", "permute_outputs", "reorder_checkpoint", "tp_aware",
]

MLP_PARTS = ("gate_proj", "up_proj", "down_proj")
_TENSORS = ("qweight", "qzeros", "scales", "g_idx", "bias")


# ---------------------------------------------------------------------------
# Offline reorderings (Algorithms 1 and 3)
# ---------------------------------------------------------------------------

def _integers(who: str, name: str, t) -> torch.Tensor:
    """`t` as int64, or an error naming `name`: TypeError for what is not a
    tensor (a list: `.long()`'s AttributeError names no argument), ValueError
    for floats or bools, which `.long()` would truncate into other rows."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: {name} must be a tensor of integers, got {type(t).__name__}")
    if not holds_integers(t):
        raise ValueError(f"{who}: {name} must hold integers, got {t.dtype}")
    return t.long()


def group_order(g_idx: torch.Tensor) -> torch.Tensor:
    """The permutation P (int64) that sorts input rows by group; stable, so
    rows of one group keep their relative order."""
    return torch.argsort(_integers("group_order", "g_idx", g_idx), stable=True)


def _is_sorted(g_idx: torch.Tensor) -> bool:
    return bool((g_idx[1:] >= g_idx[:-1]).all())


def _permuted_rows(t: dict[str, torch.Tensor], perm: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """qweight and g_idx with input row k taken from row perm[k]. Scales and
    zeros are per group, not per row, so they stay as they are."""
    qweight = t["qweight"]
    # The permute ops are offline steps with CPU kernels; results go back to the tensors' device.
    out = torch.ops.lowbit.gptq_permute_rows(qweight.cpu(), perm.cpu(), bits).to(qweight.device)
    return {"qweight": out, "g_idx": t["g_idx"][perm.to(t["g_idx"].device)]}


def _permuted_cols(t: dict[str, torch.Tensor | None], perm: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """qweight, qzeros, scales (and bias) with output column n taken from column perm[n]."""
    device = t["qweight"].device
    qweight, qzeros, scales = torch.ops.lowbit.gptq_permute_cols(t["qweight"].cpu(), t["qzeros"].cpu(),
                                                                 t["scales"].cpu(), perm.cpu(), bits)
    out = {"qweight": qweight.to(device), "qzeros": qzeros.to(device), "scales": scales.to(device)}
    if t.get("bias") is not None:
        out["bias"] = t["bias"][perm.to(t["bias"].device)]
    return out


def _buffers(layer: GPTQLinear) -> dict[str, torch.Tensor | None]:
    """The layer's checkpoint tensors (qweight in the checkpoint's row order)."""
    state = layer.state_dict(keep_vars=True)
    return {name: state.get(name) for name in _TENSORS}


def _copy(layer: GPTQLinear, cls: type[GPTQLinear] | None = None, **tensors: torch.Tensor) -> GPTQLinear:
    """A new layer of `cls` (default: layer's class) like `layer`, with the given buffers replaced."""
    state = layer.state_dict(keep_vars=True)
    g_idx = tensors.get("g_idx", layer.g_idx)
    new = (cls or type(layer))(layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.sym,
              not _is_sorted(g_idx), layer.checkpoint_format, layer.bias is not None, layer.scales.dtype,
              layer.qweight.device)
    with torch.no_grad():
        for name, buffer in new.named_buffers(recurse=False):
            source = tensors.get(name, state.get(name))
            if source is not None:
                buffer.copy_(source)
    new.int8_activations = layer.int8_activations  # how it multiplies, which the copy computes the same as
    return new


def _check_layer(layer: nn.Module, who: str) -> None:
    """Refuses a layer the reorderings and shards cannot read, naming it (a
    plain nn.Linear has no packed tensors to move)."""
    if not isinstance(layer, GPTQLinear):
        raise TypeError(f"{who}: layer must be a GPTQLinear, got {type(layer).__name__}"
                        + (" (a fused projection: load the model with fuse=False)"
                           if hasattr(layer, "fused_name") else ""))


def permute_inputs(layer: GPTQLinear, perm: torch.Tensor) -> GPTQLinear:
    """A copy of `layer` whose input row k is the original's row perm[k], so
    that `new(x[..., perm]) == layer(x)`."""
    _check_layer(layer, "permute_inputs")
    if isinstance(layer, SequentialGPTQLinear):
        raise TypeError("permute_inputs: a SequentialGPTQLinear already permutes its input in forward; "
                        "permute the layer it was made from")
    return _copy(layer, **_permuted_rows(_buffers(layer), _integers("permute_inputs", "perm", perm), layer.bits))


def permute_outputs(layer: GPTQLinear, perm: torch.Tensor) -> GPTQLinear:
    """A copy of `layer` whose output column n is the original's column
    perm[n], so that `new(x) == layer(x)[..., perm]`."""
    _check_layer(layer, "permute_outputs")
    return _copy(layer, **_permuted_cols(_buffers(layer), _integers("permute_outputs", "perm", perm), layer.bits))


class SequentialGPTQLinear(GPTQLinear):
    """A GPTQLinear whose input rows are sorted by group (Algorithm 1): its
    g_idx is non-decreasing, so each group's scales and zeros serve one
    contiguous run of rows, and forward gathers `x[..., input_perm]` to match."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("input_perm", torch.arange(self.in_features, device=self.qweight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):  # as GPTQLinear's: .shape's AttributeError would name nothing
            raise TypeError(f"SequentialGPTQLinear: input must be a tensor, got {type(x).__name__}")
        if x.shape[-1] != self.in_features:  # the gather would take any width
            raise ValueError(f"SequentialGPTQLinear: input has {x.shape[-1]} features, expected {self.in_features}")
        return super().forward(x.index_select(-1, self.input_perm))


def make_sequential(layer: GPTQLinear) -> SequentialGPTQLinear:
    """Algorithm 1: a new layer computing the same as `layer`, with its
    qweight rows sorted by group (P = argsort(g_idx)) and the input permuted
    by P at run time. A SequentialGPTQLinear keeps its input order: the
    permutations compose."""
    _check_layer(layer, "make_sequential")
    perm = group_order(layer.g_idx)
    input_perm = layer.input_perm[perm] if isinstance(layer, SequentialGPTQLinear) else perm
    return _copy(layer, SequentialGPTQLinear, input_perm=input_perm,
                 **_permuted_rows(_buffers(layer), perm, layer.bits))


def _mlp_layers(mlp: nn.Module) -> tuple[GPTQLinear, GPTQLinear, GPTQLinear]:
    layers = tuple(getattr(mlp, part, None) for part in MLP_PARTS)
    for part, layer in zip(MLP_PARTS, layers):
        if not isinstance(layer, GPTQLinear):
            raise TypeError(f"tp_aware: mlp.{part} must be a GPTQLinear, got {type(layer).__name__}"
                            + (" (a fused projection: load the model with fuse=False)"
                               if hasattr(layer, "fused_name") else ""))
    gate, up, down = layers
    if not gate.out_features == up.out_features == down.in_features:
        raise ValueError(f"tp_aware: gate_proj and up_proj must have down_proj's {down.in_features} input "
                         f"features as outputs, got {gate.out_features} and {up.out_features}")
    return gate, up, down


def tp_aware(mlp: nn.Module) -> nn.Module:
    """Algorithm 3, in place: with P2 = argsort(down_proj.g_idx), permutes the
    output columns of gate_proj and up_proj by P2 and the input rows of
    down_proj by P2. The MLP computes the same; down_proj's g_idx is sorted,
    so it shards row-parallel with no activation permutation. Returns `mlp`."""
    gate, up, down = _mlp_layers(mlp)
    perm = group_order(down.g_idx)
    mlp.gate_proj = permute_outputs(gate, perm)
    mlp.up_proj = permute_outputs(up, perm)
    mlp.down_proj = permute_inputs(down, perm)
    return mlp


def _find_mlps(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Prefixes p with quantized p.gate_proj, p.up_proj and p.down_proj."""
    suffix = ".down_proj.qweight"
    prefixes = [name[: -len(suffix)] for name in tensors if name.endswith(suffix)]
    return sorted(p for p in prefixes if all(f"{p}.{part}.qweight" in tensors for part in MLP_PARTS))


def _module_tensors(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor | None]:
    return {part: tensors.get(f"{name}.{part}") for part in _TENSORS}


def _checked_module(directory: str, config: GPTQConfig, tensors: dict[str, torch.Tensor], name: str) -> GPTQLinear:
    """Module `name` of the checkpoint's tensors, checked as load_gptq checks
    it: a corrupt module is refused naming the checkpoint, not met as a bare
    error in the permute ops or written out reordered."""
    quant = config.for_module(name)
    if quant is None:
        raise GPTQCheckpointError(f"{directory}: module {shown(name)} has a qweight but the config's dynamic rules "
                                  "exclude it")
    return _module(name, quant, config, _module_tensors(tensors, name), directory)


def _reorder_mlp(tensors: dict[str, torch.Tensor], prefix: str, config: GPTQConfig, directory: str) -> None:
    """Algorithm 3 on one MLP's checkpoint tensors, in place."""
    names = {part: f"{prefix}.{part}" for part in MLP_PARTS}
    missing = [n for n in names.values() if f"{n}.qweight" not in tensors]
    if missing:
        raise ValueError(f"reorder_checkpoint: MLP {prefix!r} has no quantized {', '.join(missing)}")
    layers = {part: _checked_module(directory, config, tensors, name) for part, name in names.items()}
    gate, up, inputs = (layers["gate_proj"].out_features, layers["up_proj"].out_features,
                        layers["down_proj"].in_features)
    if not gate == up == inputs:
        raise GPTQCheckpointError(f"{directory}: MLP {prefix!r}: gate_proj and up_proj must have down_proj's "
                                  f"{inputs} input features as outputs, got {gate} and {up}")
    down = _module_tensors(tensors, names["down_proj"])
    if down["g_idx"] is None:  # no g_idx: not act-order, nothing to reorder
        return
    perm = group_order(down["g_idx"])
    for part in ("gate_proj", "up_proj"):
        name = names[part]
        module = _module_tensors(tensors, name)
        # GPTQModel's v1 words carry between fields: their columns move as the zero points they encode.
        gptqmodel = False
        if config.checkpoint_format == "gptq":
            zeros, gptqmodel = v1_zeros_as_v2(module["qzeros"], layers[part].bits)
        if gptqmodel:
            module["qzeros"] = torch.ops.lowbit.gptq_pack(zeros, layers[part].bits, 1)
        permuted = _permuted_cols(module, perm, layers[part].bits)
        if gptqmodel:
            permuted["qzeros"] = v2_zeros_as_gptqmodel_v1(
                torch.ops.lowbit.gptq_unpack(permuted["qzeros"], layers[part].bits, 1), layers[part].bits)
        tensors.update({f"{name}.{k}": v for k, v in permuted.items()})
    permuted = _permuted_rows(down, perm, layers["down_proj"].bits)
    tensors.update({f"{names['down_proj']}.{k}": v for k, v in permuted.items()})


def reorder_checkpoint(src: str | os.PathLike, dst: str | os.PathLike,
                       mlp_prefixes: Sequence[str] | None = None) -> list[str]:
    """Writes `dst`: the GPTQ checkpoint `src` with Algorithm 3 (`tp_aware`)
    applied to every MLP (or those in `mlp_prefixes`), i.e. to the modules
    `<prefix>.gate_proj`, `.up_proj` and `.down_proj`. The config is kept:
    the reordered g_idx tensors say which layers are still act-order.
    Returns the prefixes reordered."""
    if isinstance(mlp_prefixes, str):  # would be read as one prefix per character
        raise TypeError(f"reorder_checkpoint: mlp_prefixes must be a sequence of prefixes, got the string "
                        f"{mlp_prefixes!r} (pass [{mlp_prefixes!r}])")
    if mlp_prefixes is not None and not isinstance(mlp_prefixes, Iterable):  # list()'s error names no argument
        raise TypeError(f"reorder_checkpoint: mlp_prefixes must be a sequence of prefixes or None, got "
                        f"{type(mlp_prefixes).__name__}")
    src = check_path("reorder_checkpoint", src, "src")
    check_new_directory("reorder_checkpoint", "dst", dst)
    directory, files = checkpoint_files(src)
    config = read_config(directory)
    tensors = read_tensors(files)
    prefixes = _find_mlps(tensors) if mlp_prefixes is None else list(mlp_prefixes)
    if not prefixes:
        raise ValueError(f"reorder_checkpoint: {directory} has no MLP with quantized "
                         f"{'/'.join(MLP_PARTS)} modules")
    for prefix in prefixes:
        _reorder_mlp(tensors, prefix, config, directory)
    content, quantize = source_configs(directory, config)
    write_checkpoint(dst, tensors, content, copy_from=directory, quantize_config=quantize)
    return prefixes


# ---------------------------------------------------------------------------
# Sharded layers
# ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _Source:
    """One GPTQ module to shard: its quantization and a reader of slices of
    its tensors, so a rank loads only what it keeps."""
    name: str
    in_features: int
    out_features: int
    bits: int
    group_size: int
    sym: bool
    checkpoint_format: str
    has_bias: bool
    read: Callable[..., torch.Tensor | None]  # read(tensor, *index): that slice, None if absent
    where: str = ""  # the checkpoint and module its errors name ("": the module's name alone)

    @property
    def fields(self) -> int:
        return fields_per_pack(self.bits)

    @property
    def words(self) -> int:
        return words_per_pack(self.bits)

    @property
    def rows_per_group(self) -> int:
        return self.in_features if self.group_size == -1 else self.group_size

    def g_idx(self) -> torch.Tensor:
        g_idx = self.read("g_idx", slice(None))
        if g_idx is None:  # checkpoints without g_idx are not act-order
            device = self.read("scales", slice(0, 1)).device
            g_idx = torch.arange(self.in_features, device=device) // self.rows_per_group
        # Checked before the int32 cast, which would wrap a value beyond it into range, as load_gptq checks it.
        groups = -(-self.in_features // self.rows_per_group)
        if error := g_idx_out_of_range(g_idx, groups):
            raise GPTQCheckpointError(f"{self.where or self.name}: {error}")
        return g_idx.to(torch.int32)


def _layer_source(layer: GPTQLinear, name: str) -> _Source:
    _check_layer(layer, name)
    state = _buffers(layer)  # the checkpoint's tensors: qweight in its row order

    def read(tensor, *index):
        t = state[tensor]
        return None if t is None else t[index]

    return _Source(name, layer.in_features, layer.out_features, layer.bits, layer.group_size, layer.sym,
                   layer.checkpoint_format, layer.bias is not None, read)


def _checkpoint_source(path: str | os.PathLike, name: str, checkpoint_format: str | None) -> _Source:
    """Reads only headers now; `read` opens the file and takes a slice later.
    `checkpoint_format` overrides the config's and the words' reading, with load_gptq's warning where the
    words contradict it (once per checkpoint), as in load_gptq."""
    if checkpoint_format is not None:
        check_format(checkpoint_format, name)
    directory, files = checkpoint_files(check_path(name, path))
    config = read_config(directory)
    where = f"{directory}: module {shown(name)}"
    file_of, shapes, dtypes = {}, {}, {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for tensor in _TENSORS:
                    if f"{name}.{tensor}" in f.keys():
                        header = f.get_slice(f"{name}.{tensor}")
                        file_of[tensor] = file
                        shapes[tensor], dtypes[tensor] = tuple(header.get_shape()), header.get_dtype()
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise GPTQCheckpointError(f"{file}: unreadable safetensors file: {shown_text(e)}") from e
    quant = config.for_module(name)
    check_module_tensors(where, name, {t: HEADER_DTYPES.get(d) for t, d in dtypes.items()},
                         quant is not None and quant.desc_act, labels=dtypes)
    if quant is None:
        raise GPTQCheckpointError(f"{where}: has a qweight but the config's dynamic rules exclude it")
    fields, words = fields_per_pack(quant.bits), words_per_pack(quant.bits)
    if len(shapes["qweight"]) != 2 or 0 in shapes["qweight"]:
        raise GPTQCheckpointError(f"{where}: qweight has shape {shapes['qweight']}, expected 2-D and non-empty")
    rows, N = shapes["qweight"]
    K = rows // words * fields
    groups = 1 if quant.group_size == -1 else -(-K // quant.group_size)
    expect = {"qweight": (K // fields * words, N), "qzeros": (groups, N // fields * words),
              "scales": (groups, N), "g_idx": (K,), "bias": (N,)}
    for tensor, shape in shapes.items():
        if shape != expect[tensor]:
            raise GPTQCheckpointError(f"{where}: {tensor} has shape {shape}, expected {expect[tensor]} for a "
                                      f"{quant.bits}-bit weight with group_size {quant.group_size}")

    def read(tensor, *index):
        if tensor not in file_of:
            return None
        with safe_open(file_of[tensor], framework="pt") as f:
            return f.get_slice(f"{name}.{tensor}")[index]

    # Keyed by the files' sizes and times too: a checkpoint rewritten in place is read again.
    versions = tuple((file, os.stat(file).st_mtime_ns, os.stat(file).st_size) for file in (*files, config.source))
    if checkpoint_format is None:
        fmt = _stored_format(directory, versions)
    else:
        fmt = checkpoint_format
        if fmt != config.checkpoint_format:
            _check_forced_format(directory, versions, fmt)
    return _Source(name, K, N, quant.bits, quant.group_size, quant.sym, fmt, "bias" in file_of, read, where)


def _zero_words(config: GPTQConfig, versions: tuple[tuple[str, int, int], ...]
                ) -> tuple[list[str], dict[str, tuple[torch.Tensor, int]]]:
    """(the asymmetric modules' names, every symmetric module's name -> (qzeros,
    bits)) of the checkpoint, by name as load_gptq holds its modules.
    `versions`: (path, mtime, size) of its weight files, then its config."""
    asymmetric, symmetric = [], {}
    for file, _, _ in versions[:-1]:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                name = key.removesuffix(".qzeros")
                quant = config.for_module(name) if key.endswith(".qzeros") else None
                if quant is not None and quant.sym:
                    symmetric[name] = (f.get_tensor(key), quant.bits)
                elif quant is not None:
                    asymmetric.append(name)
    return sorted(asymmetric), dict(sorted(symmetric.items()))


@functools.lru_cache(maxsize=8)
def _stored_format(directory: str, versions: tuple[tuple[str, int, int], ...]) -> str:
    """The zero format the checkpoint's words say (stored_format, as load_gptq
    decides it for the whole checkpoint), from every symmetric module's
    qzeros: read once per checkpoint, however many shards are loaded."""
    config = read_config(directory)
    return stored_format(config.checkpoint_format, _zero_words(config, versions)[1], directory, stacklevel=6)


@functools.lru_cache(maxsize=8)
def _check_forced_format(directory: str, versions: tuple[tuple[str, int, int], ...], forced: str) -> None:
    """forced_format_warning for a checkpoint_format given against the
    config's, from every module of the checkpoint, as load_gptq warns: once
    per checkpoint and format, however many shards are loaded."""
    config = read_config(directory)
    forced_format_warning(directory, config.source, forced, config.checkpoint_format,
                          *_zero_words(config, versions), stacklevel=6)


def _check_rank(name: str, rank: int, world_size: int, group) -> None:
    for what, value in (("rank", rank), ("world_size", world_size)):
        if not is_integer(value):  # else a float fails as a slice index
            raise TypeError(f"{name}: {what} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"{name}: rank {rank} is not in [0, world_size={world_size})")
    if world_size > 1 and dist.is_initialized():
        actual = (dist.get_rank(group), dist.get_world_size(group))
        if actual != (rank, world_size):
            raise ValueError(f"{name}: asked for rank {rank} of {world_size}, but this process is rank "
                             f"{actual[0]} of {actual[1]} in its process group")


def _check_distributed(who: str, world_size: int) -> None:
    """RuntimeError naming `who` where shards of a world of several would
    communicate without torch.distributed: its own error names neither the
    layer nor what it needs. (Shards are made without it: forward needs it.)"""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{who}: a shard of world_size={world_size} combines its output with the other ranks' "
                           "through torch.distributed, which is not initialized (init_process_group)")


def _split(src: _Source, size: int, what: str, world_size: int) -> int:
    """size / world_size, with the alignment the packed tensors need."""
    if size % world_size:
        raise ValueError(f"{src.name}: {what} {size} is not divisible by world_size {world_size}")
    local = size // world_size
    if local % src.fields:
        raise ValueError(f"{src.name}: each rank would hold {local} of the {size} {what}, but {src.bits}-bit "
                         f"packing stores {src.fields} per {src.words} int32 word(s), so {size} / {world_size} "
                         f"must be a multiple of {src.fields}")
    return local


def _local_layer(src: _Source, in_features: int, out_features: int, has_bias: bool,
                 tensors: dict[str, torch.Tensor]) -> GPTQLinear:
    check_finite_floats(tensors["scales"], tensors.get("bias"), src.where or src.name)
    layer = GPTQLinear(in_features, out_features, src.bits, src.group_size, src.sym, not _is_sorted(tensors["g_idx"]),
                       src.checkpoint_format, has_bias, tensors["scales"].dtype)
    with torch.no_grad():
        for name, buffer in layer.named_buffers(recurse=False):
            buffer.copy_(tensors[name])
    if hold_gptqmodel_zeros_as_v2(layer):
        warnings.warn(f"{src.name}: v1 zero fields of all ones (zero point 2^bits, which no quantizer produces) "
                      "were read as GPTQModel writes them (a zero of 0) and are held as exact v2 zeros", stacklevel=3)
    return layer.sort_rows()  # its own copy: act-order rows sorted in place, as the checkpoint loaders hold them


def _column_shard(src: _Source, rank: int, world_size: int) -> GPTQLinear:
    """Output columns [rank*N/T, (rank+1)*N/T) with every input row and group."""
    n = _split(src, src.out_features, "output features (columns)", world_size)
    all_, cols = slice(None), slice(rank * n, (rank + 1) * n)
    packed = slice(rank * n // src.fields * src.words, (rank + 1) * n // src.fields * src.words)
    tensors = {"qweight": src.read("qweight", all_, cols), "qzeros": src.read("qzeros", all_, packed),
               "scales": src.read("scales", all_, cols), "g_idx": src.g_idx(), "bias": src.read("bias", cols)}
    return _local_layer(src, src.in_features, n, src.has_bias, tensors)


def _row_shard(src: _Source, rank: int, world_size: int) -> GPTQLinear:
    """Input rows [rank*K/T, (rank+1)*K/T) with the groups they use, without the
    bias (a row-parallel layer adds it once, after the reduction)."""
    K, G = src.in_features, src.rows_per_group
    k = _split(src, K, "input features (rows)", world_size)
    if src.group_size != -1 and k % G and world_size > 1:  # one rank may keep a short last group
        raise ValueError(f"{src.name}: each rank would hold {k} of the {K} input rows, which is not a whole number "
                         f"of groups of {G}; row-parallel sharding needs (K / world_size) % group_size == 0")
    g_idx = src.g_idx()
    if not _is_sorted(g_idx):
        raise ValueError(f"{src.name}: g_idx is act-order (rows are not sorted by group), so a row-parallel shard "
                         "would need scales from groups all over the tensor; reorder it first: tp_aware(mlp) or "
                         "reorder_checkpoint(src, dst) for an MLP's down_proj, make_sequential(layer) otherwise")
    if not torch.equal(g_idx, (torch.arange(K, device=g_idx.device) // G).to(g_idx.dtype)):
        raise ValueError(f"{src.name}: g_idx is sorted but its groups are not {G} rows each (g_idx != arange(K) // "
                         f"{G}), so row shards would not own whole groups")
    rows = slice(rank * k, (rank + 1) * k)
    packed = slice(rank * k // src.fields * src.words, (rank + 1) * k // src.fields * src.words)
    groups = slice(0, 1) if src.group_size == -1 else slice(rank * k // G, -(-(rank + 1) * k // G))
    tensors = {"qweight": src.read("qweight", packed), "qzeros": src.read("qzeros", groups),
               "scales": src.read("scales", groups), "g_idx": g_idx[rows] - g_idx[rows][0]}
    return _local_layer(src, k, src.out_features, False, tensors)


class ColumnParallelGPTQLinear(nn.Module):
    """This rank's output columns [rank*N/T, (rank+1)*N/T) of a GPTQ layer.

    forward(x) takes the full input [..., K] and returns this rank's slice of
    the output [..., N/T], bias included; it communicates nothing (`group` is
    kept to say which process group the shards belong to)."""

    def __init__(self, local: GPTQLinear, rank: int, world_size: int, group=None):
        super().__init__()
        self.local = local
        self.rank, self.world_size, self.group = rank, world_size, group
        self.in_features, self.out_features = local.in_features, local.out_features * world_size

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, module_name: str, rank: int, world_size: int,
                        group=None, checkpoint_format: str | None = None) -> ColumnParallelGPTQLinear:
        """Reads only this rank's columns of `module_name` from a GPTQ checkpoint;
        `checkpoint_format` ("gptq" / "gptq_v2") overrides the config's, as in load_gptq."""
        _check_rank(module_name, rank, world_size, group)
        src = _checkpoint_source(path, module_name, checkpoint_format)
        return cls(_column_shard(src, rank, world_size), rank, world_size, group)

    @classmethod
    def from_layer(cls, layer: GPTQLinear, rank: int, world_size: int, group=None,
                   name: str = "layer") -> ColumnParallelGPTQLinear:
        """Shards `layer`'s stored columns; a SequentialGPTQLinear's input_perm
        is not applied here, the caller must permute the input."""
        _check_rank(name, rank, world_size, group)
        local = _column_shard(_layer_source(layer, name), rank, world_size)
        local.int8_activations = layer.int8_activations  # the shard multiplies as the layer does
        return cls(local, rank, world_size, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(x)


class RowParallelGPTQLinear(StoredBuffers):
    """This rank's input rows [rank*K/T, (rank+1)*K/T) of a GPTQ layer whose
    g_idx is sorted (not act-order, or reordered by tp_aware/make_sequential).

    forward(x) takes this rank's slice of the input [..., K/T], all-reduces
    (sums) the partial products over `group` and adds the bias once."""

    STORED_FLOATS = ("bias",)  # held as the unsharded layer holds it: in the scales' dtype

    def __init__(self, local: GPTQLinear, bias: torch.Tensor | None, rank: int, world_size: int, group=None):
        super().__init__()
        self.local = local
        self.register_buffer("bias", bias)
        self.rank, self.world_size, self.group = rank, world_size, group
        self.in_features, self.out_features = local.in_features * world_size, local.out_features

    @classmethod
    def _from_source(cls, src: _Source, rank: int, world_size: int, group) -> RowParallelGPTQLinear:
        _check_rank(src.name, rank, world_size, group)
        local = _row_shard(src, rank, world_size)
        bias = src.read("bias", slice(None))
        if bias is not None:  # checked and held as the unsharded layer holds it: in the scales' dtype
            check_finite_floats(local.scales, bias, src.where or src.name)
            bias = bias.to(local.scales.dtype)
        return cls(local, bias, rank, world_size, group)

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, module_name: str, rank: int, world_size: int,
                        group=None, checkpoint_format: str | None = None) -> RowParallelGPTQLinear:
        """Reads only this rank's rows (and their groups) of `module_name` from a
        GPTQ checkpoint; `checkpoint_format` as in ColumnParallelGPTQLinear."""
        return cls._from_source(_checkpoint_source(path, module_name, checkpoint_format), rank, world_size, group)

    @classmethod
    def from_layer(cls, layer: GPTQLinear, rank: int, world_size: int, group=None,
                   name: str = "layer") -> RowParallelGPTQLinear:
        """Shards `layer`'s stored rows; a SequentialGPTQLinear's input_perm is
        not applied here, the caller must permute the input."""
        sharded = cls._from_source(_layer_source(layer, name), rank, world_size, group)
        sharded.local.int8_activations = layer.int8_activations  # the shard multiplies as the layer does
        return sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.local(x)
        if self.world_size > 1:
            _check_distributed("RowParallelGPTQLinear", self.world_size)
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.group)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y


# ---------------------------------------------------------------------------
# Tensor-parallel SwiGLU MLPs
# ---------------------------------------------------------------------------

class TPAwareMLP(nn.Module):
    """Algorithm 3: down(silu(gate(x)) * up(x)) with gate/up column-parallel
    and down row-parallel, loaded from a `reorder_checkpoint` checkpoint.
    Takes the full input, returns the full output; one AllReduce."""

    def __init__(self, gate_proj: ColumnParallelGPTQLinear, up_proj: ColumnParallelGPTQLinear,
                 down_proj: RowParallelGPTQLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, prefix: str, rank: int, world_size: int,
                        group=None, checkpoint_format: str | None = None) -> TPAwareMLP:
        """This rank's shards of `<prefix>.gate_proj`, `.up_proj` and `.down_proj`
        from a checkpoint that reorder_checkpoint wrote (down_proj's g_idx sorted)."""
        column = lambda part: ColumnParallelGPTQLinear.from_checkpoint(path, f"{prefix}.{part}", rank, world_size,
                                                                       group, checkpoint_format)
        down = RowParallelGPTQLinear.from_checkpoint(path, f"{prefix}.down_proj", rank, world_size, group,
                                                     checkpoint_format)
        return cls(column("gate_proj"), column("up_proj"), down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NaiveTPMLP(nn.Module):
    """Algorithm 2, the baseline: gate/up column-parallel from the original
    act-order checkpoint, down reordered by Algorithm 1 and sharded by rows.
    forward AllGathers the intermediate activation Y1, takes this rank's chunk
    of Y1[..., P2], multiplies it by the local down shard and AllReduces."""

    def __init__(self, gate_proj: ColumnParallelGPTQLinear, up_proj: ColumnParallelGPTQLinear,
                 down_proj: RowParallelGPTQLinear, input_perm: torch.Tensor, group=None):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj
        self.register_buffer("input_perm", input_perm)  # this rank's chunk of P2
        self.group = group

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike, prefix: str, rank: int, world_size: int,
                        group=None, checkpoint_format: str | None = None) -> NaiveTPMLP:
        """This rank's shards of `<prefix>`'s MLP from a checkpoint as it is: every
        rank reads all of down_proj to sort its rows (Algorithm 1), then keeps its own."""
        column = lambda part: ColumnParallelGPTQLinear.from_checkpoint(path, f"{prefix}.{part}", rank, world_size,
                                                                       group, checkpoint_format)
        name = f"{prefix}.down_proj"
        _check_rank(name, rank, world_size, group)
        # Algorithm 1 permutes rows across the whole tensor, so every rank reads
        # all of down_proj (the one column shard of a world of one).
        down = make_sequential(_column_shard(_checkpoint_source(path, name, checkpoint_format), 0, 1))
        k = down.in_features // world_size
        return cls(column("gate_proj"), column("up_proj"),
                   RowParallelGPTQLinear.from_layer(down, rank, world_size, group, name),
                   down.input_perm[rank * k:(rank + 1) * k].clone(), group)

    def _all_gather(self, y: torch.Tensor) -> torch.Tensor:
        world_size = self.down_proj.world_size
        if world_size == 1:
            return y
        _check_distributed("NaiveTPMLP", world_size)
        parts = [torch.empty_like(y) for _ in range(world_size)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y1 = self._all_gather(F.silu(self.gate_proj(x)) * self.up_proj(x))
        # Gathering just this rank's chunk of P2 equals permuting all of Y1 and
        # chunking it, with less copying: the baseline is not made slower than it must be.
        return self.down_proj(y1.index_select(-1, self.input_perm))
