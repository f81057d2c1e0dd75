"""Reading and writing GPTQ checkpoints in the layout AutoGPTQ, GPTQModel and
HF transformers use: a directory with a quantization config and one or more
safetensors files (sharded ones listed in model.safetensors.index.json)."""
from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .._checks import (check_finite, check_module, check_path, check_regular_file, is_integer, shown, shown_names,
                       shown_text)
from .._mapping import map_private
from .packing import fields_per_pack, words_per_pack
from .config import GPTQCheckpointError, GPTQConfig, check_format, ModuleQuant, read_config, read_json
from ..fusing import ProjectionSlice, unfused_state_dict
from .linear import GPTQLinear, g_idx_out_of_range

INDEX_FILE = "model.safetensors.index.json"
QUANT_TENSORS = ("qweight", "qzeros", "scales", "g_idx")


@dataclass
class GPTQCheckpoint:
    """An HF GPTQ checkpoint as load_gptq reads it: its quantization config,
    its quantized Linears as GPTQLinear and every other tensor."""

    config: GPTQConfig
    directory: str
    modules: dict[str, GPTQLinear] = field(default_factory=dict)  # quantized Linears by module name
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # every other tensor by name


def checkpoint_files(path: str | os.PathLike) -> tuple[str, list[str]]:
    """(directory, safetensors files) of a checkpoint directory or single file."""
    path = os.fspath(path)
    index = weight_map = None
    if os.path.isdir(path):
        index = os.path.join(path, INDEX_FILE)
        if os.path.lexists(index):
            weight_map = _index_weight_map(index)
            files = [os.path.join(path, s) for s in sorted(set(weight_map.values()))]
            missing = [f for f in files if not os.path.lexists(f)]
            if missing:
                raise GPTQCheckpointError(f"{index}: lists shards that do not exist: {shown_names(missing)}")
        else:
            files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise GPTQCheckpointError(f"{path}: no .safetensors files")
    elif os.path.lexists(path):
        if not path.endswith(".safetensors"):
            raise GPTQCheckpointError(f"{path}: expected a .safetensors file or a checkpoint directory")
        files, path = [path], os.path.dirname(os.path.abspath(path))
    else:
        raise GPTQCheckpointError(f"{path}: no such file or directory")
    for file in files:
        check_regular_file(file, "safetensors file", GPTQCheckpointError)
    if weight_map is not None:
        _check_index_tensors(index, weight_map, files)
    return path, files


def _check_index_tensors(index: str, weight_map: dict[str, str], files: list[str]) -> None:
    """Refuses an index that lists a tensor none of its shards holds (a shard
    truncated or replaced): every reader takes the shards' tensors, and the
    module would be left out without a word. Reads only the headers."""
    held = set()
    for file in files:
        stat = os.stat(file)
        held.update(_tensor_names(file, stat.st_mtime_ns, stat.st_size))
    absent = [name for name in weight_map if name not in held]
    if absent:
        raise GPTQCheckpointError(f"{index}: lists {len(absent)} tensor(s) that no shard holds, e.g. "
                                  f"{shown(absent[0])} in {shown(weight_map[absent[0]])}")


@functools.lru_cache(maxsize=256)
def _tensor_names(file: str, mtime_ns: int, size: int) -> frozenset[str]:
    """The tensor names in a safetensors file's header; kept per file version,
    as the sharded loaders list a checkpoint's files once per module."""
    try:
        with safe_open(file, framework="pt") as f:
            return frozenset(f.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise GPTQCheckpointError(f"{file}: unreadable safetensors file: {shown_text(e)}") from e


def _index_weight_map(index: str) -> dict[str, str]:
    """The tensor name -> shard file map of a model.safetensors.index.json,
    each shard checked to be a .safetensors path inside the index's directory."""
    content = read_json(index, "shard index")
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise GPTQCheckpointError(f"{index}: weight_map must be a non-empty JSON object of tensor name -> shard "
                                  f"file, got {type(weight_map).__name__}")
    for name, shard in weight_map.items():
        # A shard path from an untrusted index must not reach files outside the checkpoint.
        if (not isinstance(shard, str) or not shard.endswith(".safetensors") or os.path.isabs(shard)
                or os.path.normpath(shard).split(os.sep)[0] == os.pardir):
            raise GPTQCheckpointError(f"{index}: weight_map[{shown(name)}] is {shown(shard)}, not the name of a "
                                      ".safetensors file in the checkpoint directory")
    return weight_map


# torch's dtypes by the names safetensors headers give them.
HEADER_DTYPES = {"I32": torch.int32, "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16,
                 "F32": torch.float32, "F64": torch.float64, "I16": torch.int16, "I8": torch.int8,
                 "U8": torch.uint8, "BOOL": torch.bool}


def read_tensors(files: list[str], mapped: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files, read into memory of its own,
    but for those named in `mapped`: views of a copy-on-write mapping of
    their file, whose pages are read only where they are used (a token
    embedding's rows).

    safetensors checks each file's header against the file first. The data
    is then read with plain reads into fresh (aligned) allocations, not
    taken as views of a mapping of the file: the kernels read those views
    25-35% slower (a 1B GPTQ model's decode), and a copy out of a mapping
    that the other tensors keep alive would hold the weights twice."""
    tensors, reads = {}, []
    for file in files:
        try:
            with safe_open(file, framework="pt") as f, open(file, "rb") as raw:
                header_bytes = int.from_bytes(raw.read(8), "little")
                header = json.loads(raw.read(header_bytes))
                mapping = None
                for name in f.keys():
                    if name in tensors:
                        raise GPTQCheckpointError(f"{file}: tensor {shown(name)} appears in more than one shard")
                    info = header[name]
                    dtype = HEADER_DTYPES.get(info["dtype"])
                    if dtype is None:  # a dtype lowbit reads nowhere: safetensors' own copy
                        tensors[name] = f.get_tensor(name).clone()
                        continue
                    begin, end = info["data_offsets"]
                    start = 8 + header_bytes + begin
                    if name in mapped and start % dtype.itemsize == 0:
                        if mapping is None:
                            mapping = map_private(file)
                        # A storage of the tensor's own bytes: torch.save and deepcopy copy what it holds.
                        data = torch.from_numpy(mapping[start:8 + header_bytes + end])
                        if data.numel() != end - begin:
                            raise GPTQCheckpointError(f"{file}: tensor {shown(name)} is truncated")
                    else:
                        data = torch.empty(end - begin, dtype=torch.uint8)
                        reads.append((file, name, start, data))
                    tensors[name] = data.view(dtype).reshape(info["shape"])
        except GPTQCheckpointError:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt headers and data
            raise GPTQCheckpointError(f"{file}: unreadable safetensors file: {shown_text(e)}") from e
    _read_all(reads)
    return tensors


# Threads that read a checkpoint's tensors: a read from the page cache into
# fresh memory is bound by the page faults it takes, which cores take in
# parallel (a 1B checkpoint reads in 0.25 s on two threads, 0.34 s on one).
READ_THREADS = 4


def _read_all(reads: list[tuple[str, str, int, torch.Tensor]]) -> None:
    """Fills each (file, tensor name, offset, uint8 tensor) with the file's
    bytes at that offset, on up to READ_THREADS threads (no more than torch's)."""
    def read(job):
        file, name, start, data = job
        try:
            with open(file, "rb") as raw:  # buffered: readinto loops until the tensor is full or the file ends
                raw.seek(start)
                got = raw.readinto(data.numpy())
        except OSError as e:
            raise GPTQCheckpointError(f"{file}: unreadable safetensors file: {shown_text(e)}") from e
        if got != data.numel():
            raise GPTQCheckpointError(f"{file}: tensor {shown(name)} is truncated")

    threads = min(READ_THREADS, torch.get_num_threads(), len(reads))
    if threads <= 1:
        for job in reads:
            read(job)
        return
    with ThreadPoolExecutor(threads) as pool:
        for _ in pool.map(read, reads):  # the first error, in the tensors' order
            pass


def load_gptq(path: str | os.PathLike, checkpoint_format: str | None = None,
              mapped: frozenset[str] = frozenset()) -> GPTQCheckpoint:
    """Reads a GPTQ checkpoint (directory or single .safetensors file next to its
    config) into GPTQLinear modules, keyed by module name, plus the remaining
    tensors. `checkpoint_format` overrides the config's "gptq" / "gptq_v2"
    (and stored_format's reading of the words), with a warning where it is
    not the config's and the words do not show it; `mapped` names tensors
    left in the file (read_tensors)."""
    # Checked here: each module's GPTQLinear would refuse a bad format as an
    # error of the checkpoint's, and `in` over a str mapped matches substrings.
    if checkpoint_format is not None:
        check_format(checkpoint_format, "load_gptq")
    if isinstance(mapped, (str, bytes)) or not isinstance(mapped, (set, frozenset, list, tuple)) \
            or not all(isinstance(n, str) for n in mapped):
        raise TypeError(f"load_gptq: mapped must be a set of tensor names, got {shown(mapped)}")
    mapped = frozenset(mapped)
    directory, files = checkpoint_files(check_path("load_gptq", path))
    config = read_config(directory)
    label = config.checkpoint_format
    if checkpoint_format is not None:
        config = replace(config, checkpoint_format=checkpoint_format)
    tensors = read_tensors(files, mapped)
    ckpt = GPTQCheckpoint(config, directory)
    prefixes = sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight"))
    # qzeros and g_idx are GPTQ's own names (unlike "scales"): a module with them but no qweight lost its weight.
    orphans = sorted({n.rpartition(".")[0] for n in tensors if n.endswith((".qzeros", ".g_idx"))} - set(prefixes))
    if orphans:
        name = orphans[0]
        found = [k for k in QUANT_TENSORS if f"{name}.{k}" in tensors]
        raise GPTQCheckpointError(f"{directory}: module {shown(name)}: missing tensor {shown(name + '.qweight')} "
                                  f"(the checkpoint has its {', '.join(found)})")
    for prefix in prefixes:
        quant = config.for_module(prefix)
        if quant is None:
            raise GPTQCheckpointError(f"{directory}: module {shown(prefix)} has a qweight but the config's dynamic "
                                      "rules exclude it from quantization")
        parts = {k: tensors.pop(f"{prefix}.{k}", None) for k in (*QUANT_TENSORS, "bias")}
        ckpt.modules[prefix] = _module(prefix, quant, config, parts, directory)
    if checkpoint_format is None:  # a format the caller gives is read as given
        _check_labelled_format(ckpt)
    elif checkpoint_format != label:
        _check_forced_format(ckpt, label)
    _read_gptqmodel_v1_zeros(ckpt)
    ckpt.tensors = tensors
    return ckpt


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
# The dtypes each tensor of a quantized module may have.
MODULE_DTYPES = {"qweight": (torch.int32,), "qzeros": (torch.int32,), "scales": _FLOATS,
                 "g_idx": (torch.int32, torch.int64), "bias": _FLOATS}


def check_module_tensors(where: str, name: str, dtypes: dict[str, torch.dtype | None], desc_act: bool,
                         labels: dict[str, str] | None = None) -> None:
    """What every loader checks of a quantized module before its shapes: the
    tensors it needs are there (g_idx too when act-order) and have allowed
    dtypes. `dtypes` has the tensors present (None: a dtype torch does not
    know); `labels` names their dtypes in messages when not torch's names."""
    for key in ("qweight", "qzeros", "scales"):
        if key not in dtypes:
            raise GPTQCheckpointError(f"{where}: missing tensor {shown(f'{name}.{key}')}")
    if "g_idx" not in dtypes and desc_act:  # without it the rows would be read in the wrong groups
        raise GPTQCheckpointError(f"{where}: missing tensor {shown(name + '.g_idx')}, which an act-order (desc_act) "
                                  "checkpoint needs")
    for key, dtype in dtypes.items():
        if dtype not in MODULE_DTYPES[key]:
            label = labels[key] if labels else dtype
            raise GPTQCheckpointError(f"{where}: {key} has dtype {label}, expected one of {MODULE_DTYPES[key]}")


def _module(name: str, q: ModuleQuant, config: GPTQConfig, t: dict[str, torch.Tensor | None],
            directory: str) -> GPTQLinear:
    where = f"{directory}: module {shown(name)}"
    check_module_tensors(where, name, {k: v.dtype for k, v in t.items() if v is not None}, q.desc_act)
    qweight, qzeros, scales, g_idx, bias = (t[k] for k in (*QUANT_TENSORS, "bias"))
    fields, words = fields_per_pack(q.bits), words_per_pack(q.bits)
    if qweight.dim() != 2 or qweight.shape[0] % words or 0 in qweight.shape:
        raise GPTQCheckpointError(f"{where}: qweight has shape {tuple(qweight.shape)}, expected 2-D and non-empty "
                                  f"with a multiple of {words} rows for {q.bits}-bit packing")
    K, N = qweight.shape[0] // words * fields, qweight.shape[1]
    groups = 1 if q.group_size == -1 else -(-K // q.group_size)  # integers: a config's size may be any int
    expect = {"qzeros": (groups, N // fields * words), "scales": (groups, N), "g_idx": (K,), "bias": (N,)}
    for key, shape in expect.items():
        if t[key] is not None and tuple(t[key].shape) != shape:
            # The other tensors are checked against qweight, so either side may be the corrupt one: name both.
            raise GPTQCheckpointError(f"{where}: {key} has shape {tuple(t[key].shape)}, expected {shape}: qweight "
                                      f"{tuple(qweight.shape)} packs {K} inputs x {N} outputs at {q.bits} bits, "
                                      f"with group_size {q.group_size}")
    if g_idx is not None and (error := g_idx_out_of_range(g_idx, groups)):
        raise GPTQCheckpointError(f"{where}: {error}")
    check_finite_floats(scales, bias, where)
    try:
        # The checkpoint's (memory-mapped) tensors themselves: a copy would
        # hold the weights twice while the file's other tensors keep it mapped.
        return GPTQLinear.from_tensors(qweight, qzeros, scales, g_idx, bias, q.bits, q.group_size, q.sym, q.desc_act,
                                       config.checkpoint_format)
    except ValueError as e:
        raise GPTQCheckpointError(f"{where}: {e}") from e


def check_finite_floats(scales: torch.Tensor, bias: torch.Tensor | None, where: str) -> None:
    """A corrupt module's inf or NaN scales (or bias) would make every output
    they touch NaN: refused, naming `where` (checkpoint and module) and the first.
    The bias is checked as the layer holds it too, in the scales' dtype: a
    finite float32 bias past float16's range would be inf there."""
    check_finite(scales, f"{where}: scales", GPTQCheckpointError)
    if bias is not None:
        check_finite(bias, f"{where}: bias", GPTQCheckpointError)
        if bias.dtype != scales.dtype:
            check_finite(bias.to(scales.dtype), f"{where}: bias, held in the scales' {scales.dtype},",
                         GPTQCheckpointError)


def _check_labelled_format(ckpt: GPTQCheckpoint) -> None:
    """Each module held in the format its checkpoint's words say (stored_format)."""
    symmetric = {name: (layer.qzeros, layer.bits) for name, layer in ckpt.modules.items() if layer.sym}
    actual = stored_format(ckpt.config.checkpoint_format, symmetric, ckpt.directory, stacklevel=4)
    for layer in ckpt.modules.values():
        layer.checkpoint_format = actual


def _check_forced_format(ckpt: GPTQCheckpoint, label: str) -> None:
    """forced_format_warning for the checkpoint_format a caller gave load_gptq against the config's `label`."""
    asymmetric = [name for name, layer in ckpt.modules.items() if not layer.sym]
    symmetric = {name: (layer.qzeros, layer.bits) for name, layer in ckpt.modules.items() if layer.sym}
    forced_format_warning(ckpt.directory, ckpt.config.source, ckpt.config.checkpoint_format, label, asymmetric,
                          symmetric, stacklevel=4)


def forced_format_warning(where: str, source: str | None, forced: str, label: str, asymmetric: list[str],
                          symmetric: dict[str, tuple[torch.Tensor, int]], stacklevel: int = 2) -> None:
    """Warns where a checkpoint_format `forced` given against the config's
    `label` (read from the config file `source`) is not borne out by the
    words: v1 and v2 read every zero point one step apart, so one of the two
    reads the whole checkpoint off. Only the words of symmetric modules (name
    -> (qzeros, bits)) tell the formats apart (stored_format); an asymmetric
    module's could be either. `where` names the checkpoint."""
    confirm = [name for name, (qzeros, bits) in symmetric.items() if _stores(label, qzeros, bits)]
    if asymmetric:
        why = (f"the words of its {len(asymmetric)} asymmetric modules (e.g. {asymmetric[0]}) cannot tell the "
               "formats apart: where the config is right, every zero point is read one step off")
    elif confirm:
        why = (f"{len(confirm)} symmetric modules store {label} zero points (e.g. {confirm[0]}.qzeros): every zero "
               "point is read one step off")
    else:  # the words say the format given: the config's label is the one that is wrong
        return
    warnings.warn(f"{where}: checkpoint_format={forced!r} overrides {source or 'the config'}'s {label!r}, and {why}",
                  stacklevel=stacklevel)


def _stores(fmt: str, qzeros: torch.Tensor, bits: int) -> bool:
    """Whether a symmetric module's qzeros all hold `fmt`'s zero point:
    2^(bits-1) - 1 in v1 words, 2^(bits-1) in v2 ones."""
    zeros = torch.ops.lowbit.gptq_unpack(qzeros, bits, 1)
    return bool((zeros == 2 ** (bits - 1) - (1 if fmt == "gptq" else 0)).all())


def stored_format(label: str, symmetric: dict[str, tuple[torch.Tensor, int]], where: str,
                  stacklevel: int = 2) -> str:
    """The zero format a checkpoint stores, from its symmetric modules' (name ->
    (qzeros, bits)) words: every stored zero is 2^(bits-1) - 1 in v1 and
    2^(bits-1) in v2. A checkpoint whose words all say the other format than
    its label (a known GPTQModel-era mislabelling) is read as what its words
    say, with a loud warning naming the evidence; `label` otherwise."""
    actual = "gptq" if label == "gptq_v2" else "gptq_v2"
    evidence = [(name, qzeros, bits) for name, (qzeros, bits) in symmetric.items() if _stores(actual, qzeros, bits)]
    if not evidence or len(evidence) != len(symmetric):
        return label
    name, qzeros, bits = evidence[0]
    word = int(qzeros.flatten()[0]) & 0xFFFFFFFF
    warnings.warn(
        f"{where}: the config says checkpoint_format={label!r} but all {len(evidence)} symmetric modules "
        f"store {actual} zero points (e.g. {name}.qzeros words 0x{word:08X} for {bits}-bit); loading it as "
        f"{actual!r}. Pass checkpoint_format={label!r} to force the label.",
        stacklevel=stacklevel,
    )
    return actual


# GPTQModel keeps v2 zeros and writes 2-, 4- and 8-bit v1 by subtracting this
# from every packed int32 qzeros word (and reads v1 back by adding it): one per
# field, so a v2 zero of 0 becomes a field of all ones and borrows one from the
# next field.
GPTQMODEL_V1_OFFSETS = {2: 0x55555555, 4: 0x11111111, 8: 0x01010101}


def v1_zeros_as_v2(qzeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, bool]:
    """(the v2 zero points [groups, N] of v1 `qzeros`, whether they were read as
    GPTQModel writes them). A v1 field of all ones (zero 2^bits) comes from no
    quantizer but is what GPTQModel writes for a zero of 0: where one is present
    the words are read as GPTQModel reads them, the exact inverse of its writing.
    Without one that reading is the per-field +1 of every other v1 reader."""
    fields = torch.ops.lowbit.gptq_unpack(qzeros, bits, 1)
    if not bool((fields == 2**bits - 1).any()):
        return fields + 1, False
    if bits == 3:  # 3-bit fields straddle words, so GPTQModel shifts each field alone, modulo 8
        return (fields + 1) % 8, True
    words = (qzeros.long() + GPTQMODEL_V1_OFFSETS[bits]) & 0xFFFFFFFF  # carries cross fields; the top one is lost
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return torch.ops.lowbit.gptq_unpack(words, bits, 1), True


def v2_zeros_as_gptqmodel_v1(zeros: torch.Tensor, bits: int) -> torch.Tensor:
    """The v1 qzeros words GPTQModel writes for the v2 zero points `zeros`
    [groups, N]: the inverse of v1_zeros_as_v2's GPTQModel reading."""
    if bits == 3:
        return torch.ops.lowbit.gptq_pack((zeros - 1) % 8, bits, 1)
    words = (torch.ops.lowbit.gptq_pack(zeros, bits, 1).long() - GPTQMODEL_V1_OFFSETS[bits]) & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def gptqmodel_warning(where: str, modules: list[str]) -> str:
    """What load_gptq and convert_checkpoint say of modules read by v1_zeros_as_v2 as GPTQModel's."""
    named = ", ".join(modules[:5]) + (", ..." if len(modules) > 5 else "")
    return (f"{where}: {len(modules)} modules ({named}) store v1 zero fields of all ones (zero point 2^bits, which "
            "no quantizer produces); their zeros were read as GPTQModel writes them (it stores a zero of 0 that "
            "way) and are held as exact v2 zeros")


def hold_gptqmodel_zeros_as_v2(layer: GPTQLinear) -> bool:
    """Whether `layer` is a v1 module that GPTQModel wrote with zeros of 0; if
    so its zeros become exact v2 zeros (lowbit's v1 reading would put such a
    zero 2^bits steps off). Whole words and whole 3-bit packs read alone, so
    a tensor-parallel shard of a module reads as the whole module does."""
    if layer.checkpoint_format != "gptq":
        return False
    zeros, by_gptqmodel = v1_zeros_as_v2(layer.qzeros, layer.bits)
    if by_gptqmodel:
        with torch.no_grad():
            layer.qzeros.copy_(torch.ops.lowbit.gptq_pack(zeros, layer.bits, 1))
        layer.checkpoint_format = "gptq_v2"
    return by_gptqmodel


def _read_gptqmodel_v1_zeros(ckpt: GPTQCheckpoint) -> None:
    """hold_gptqmodel_zeros_as_v2 for every module, with one warning."""
    found = [name for name, layer in ckpt.modules.items() if hold_gptqmodel_zeros_as_v2(layer)]
    if found:
        warnings.warn(gptqmodel_warning(ckpt.directory, found), stacklevel=3)


def check_layer_count(directory: str | os.PathLike) -> None:
    """Refuses a config.json whose num_hidden_layers is not the number of layers
    the checkpoint's tensors hold, before a loader builds that many: a count of
    100000 takes hours to build, and a count too small leaves layers of the
    checkpoint out. A stack of layers is the numbered modules at the first
    number in tensor names (model.layers.<i>, transformer.h.<i>, ...); some
    stack must hold exactly layers 0 .. num_hidden_layers - 1 (plus DeepSeek's
    num_nextn_predict_layers multi-token-prediction layers, which may follow).
    Reads only the safetensors headers; a config without the key passes."""
    directory, files = checkpoint_files(directory)
    path = os.path.join(directory, "config.json")
    if not os.path.lexists(path):
        return
    content = read_json(path, "config")
    count = content.get("num_hidden_layers")
    if count is None:
        return
    if not is_integer(count) or count < 0:
        raise GPTQCheckpointError(f"{path}: num_hidden_layers must be a non-negative integer, got {shown(count)}")
    extra = content.get("num_nextn_predict_layers")
    extra = extra if isinstance(extra, int) and not isinstance(extra, bool) else 0
    stacks: dict[str, set[int]] = {}  # stack -> the layer indices its tensors have
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise GPTQCheckpointError(f"{file}: unreadable safetensors file: {shown_text(e)}") from e
        for name in names:
            parts = name.split(".")
            i = next((i for i, p in enumerate(parts[:-1]) if p.isascii() and p.isdigit()), None)
            if i is not None:
                if len(parts[i]) > 18:  # past any model's modules (and past int()'s limit of 4300 digits)
                    raise GPTQCheckpointError(f"{file}: tensor {shown(name)} numbers its module with "
                                              f"{len(parts[i])} digits")
                stacks.setdefault(".".join(parts[:i]), set()).add(int(parts[i]))
    # A stack counts as its number of layers only without gaps: one tensor named
    # layers.99999 must not make 100000 layers acceptable.
    if any(idx == set(range(len(idx))) and count <= len(idx) <= count + extra for idx in stacks.values()):
        return
    held = shown_names(sorted(stacks.items()), lambda stack: f"{shown(stack[0]) if stack[0] else '(top level)'}: "
                       f"{len(stack[1])} numbered from {min(stack[1])} to {max(stack[1])}")
    raise GPTQCheckpointError(f"{path}: num_hidden_layers is {count}, but the checkpoint's tensors do not hold "
                              f"layers 0 .. {count - 1} of any stack (stacks of numbered modules: {held})")


def check_new_directory(who: str, name: str, path: str | os.PathLike) -> str:
    """os.fspath(path) for a checkpoint to write, checked before the work:
    refused naming `name` where it is empty (the working directory to
    os.path, which "already exists") or where something is there already;
    anything but a str or os.PathLike is a TypeError naming `name` (os.fspath's
    names no argument)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{who}: {name} must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{who}: {name} must be a directory path, got an empty one")
    if os.path.exists(path):
        raise FileExistsError(f"{who}: {path} already exists")
    return path


def write_checkpoint(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict[str, Any],
                     copy_from: str | None = None, max_shard_bytes: int | None = None,
                     quantize_config: dict[str, Any] | None = None) -> None:
    """Writes a checkpoint directory atomically: everything goes to a temporary
    directory beside `directory`, which is renamed into place at the end, so an
    interrupted write leaves no `directory`. `config` is the full config.json
    content (with "quantization_config"); quantize_config.json gets
    `quantize_config`, by default that part.
    Files of `copy_from` other than weights and configs are copied along."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory):
        raise FileExistsError(f"{directory} already exists")
    parent = os.path.dirname(directory)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        # Not mkdtemp, whose 0700 would become the checkpoint's: os.mkdir's mode follows the umask.
        tmp = os.path.join(parent, f".{os.path.basename(directory)}.{uuid.uuid4().hex}")
        os.mkdir(tmp)
        if copy_from is not None:
            _copy_other_files(copy_from, tmp)
        _write_shards(tmp, tensors, max_shard_bytes)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        with open(os.path.join(tmp, "quantize_config.json"), "w") as f:
            json.dump(config["quantization_config"] if quantize_config is None else quantize_config, f, indent=2)
        _sync_tree(tmp)  # the data is on disk before the name appears
        os.rename(tmp, directory)
    except BaseException as e:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        # A full disk or a read-only parent: say which checkpoint could not be written.
        if isinstance(e, (OSError, SafetensorError)):
            raise GPTQCheckpointError(f"{directory}: cannot write the checkpoint: {e}") from e
        raise


def source_configs(directory: str, config: GPTQConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config.json's content, the quantize config) of the checkpoint whose
    config read_config gave, each file's keys kept as written (config.json's
    quantization_config may hold keys the quantize config file does not, and
    the other way round): what a rewrite of the checkpoint writes back."""
    path = os.path.join(directory, "config.json")
    content = read_json(path, "config") if os.path.lexists(path) else {}
    raw = read_json(config.source, "config")
    quantize = dict(raw["quantization_config"] if os.path.basename(config.source) == "config.json" else raw)
    content["quantization_config"] = dict(content.get("quantization_config") or quantize)
    return content, quantize


def _copy_other_files(src: str, tmp: str) -> None:
    """Copies what `src` holds besides weights and configs into `tmp`, after
    _check_source_entry passes every entry of `src` (the weights and configs
    written anew from it too). Where the destination lies inside `src`, `tmp`
    (beside it) does too and is left out, so the output never holds a copy of
    itself."""
    roots = _source_roots(src)
    tmp_path = os.path.realpath(tmp)

    def checked(directory: str, names: list[str]) -> list[str]:  # copytree's ignore: sees each directory's names
        for name in names:
            _check_source_entry(os.path.join(directory, name), roots)
        return [n for n in names if os.path.realpath(os.path.join(directory, n)) == tmp_path]

    names = os.listdir(src)
    for name in sorted(set(names) - set(checked(src, names))):
        path = os.path.join(src, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(tmp, name), ignore=checked)
        elif not _is_weight_or_config(name):
            shutil.copy2(path, os.path.join(tmp, name))


def _source_roots(src: str) -> tuple[str, ...]:
    """The real directories the files of checkpoint `src` may lie in: its own,
    and for a Hugging Face hub cache snapshot (<repo>/snapshots/<revision>,
    whose files are links into <repo>/blobs) that repository's blobs."""
    root = os.path.realpath(src)
    parent = os.path.dirname(root)
    if os.path.basename(parent) == "snapshots":
        return root, os.path.join(os.path.dirname(parent), "blobs")
    return (root,)


def _check_source_entry(path: str, roots: tuple[str, ...]) -> None:
    """Refuses an entry of a checkpoint that a rewrite of it would publish
    from elsewhere or never finish reading: a link out of `roots` (to
    ~/.ssh/id_rsa, /etc/passwd; dangling ones too) would put a file the
    checkpoint does not hold into the output, a named pipe blocks forever, a
    device such as /dev/zero never ends, and a link to a directory holding it
    would be copied into itself forever."""
    target = os.path.realpath(path)
    if not any(os.path.commonpath([target, root]) == root for root in roots):
        raise GPTQCheckpointError(f"{path}: a link to {target}, outside the checkpoint directory {roots[0]}; "
                                  "only the checkpoint's own files are written to the new one")
    if not os.path.isdir(target):
        check_regular_file(path, "file", GPTQCheckpointError)
    elif os.path.islink(path) and os.path.commonpath([target, os.path.realpath(os.path.dirname(path))]) == target:
        raise GPTQCheckpointError(f"{path}: a link to {target}, which holds the link: its copy would never end")


def _sync_tree(directory: str) -> None:
    for root, _, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_weight_or_config(name: str) -> bool:
    return name.endswith(".safetensors") or name in (INDEX_FILE, "config.json", "quantize_config.json",
                                                      "quant_config.json")


def _write_shards(directory: str, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and max_shard_bytes is not None and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    umask = os.umask(0o022)
    os.umask(umask)

    def save(shard: dict[str, torch.Tensor], file: str) -> None:
        path = os.path.join(directory, file)
        save_file(shard, path, metadata={"format": "pt"})
        os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600 whatever the umask

    if len(shards) == 1:
        save(shards[0], "model.safetensors")
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save(shard, file)
        weight_map.update({name: file for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _float_tables_as_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model's state dict as its checkpoint has it: fused projections apart
    (lowbit.fusing.unfused_state_dict), and the float tables load_gptq_model
    holds as GGUF F32 / F16 / BF16 bytes (token embedding, LM head) as the
    float `weight` tensors the checkpoint had."""
    # Imported here: lowbit.gguf imports lowbit.ops, which imports this package.
    from ..gguf import GGUFEmbedding, GGUFLinear
    from ..gguf.linear import FLOAT_QTYPES

    state = unfused_state_dict(model)
    dtypes = {qtype: dtype for dtype, qtype in FLOAT_QTYPES.items()}
    for name, module in model.named_modules():
        if isinstance(module, (GGUFEmbedding, GGUFLinear)) and module.qtype in dtypes:
            prefix = f"{name}." if name else ""
            raw = state.pop(prefix + "qweight")
            state[prefix + "weight"] = raw.view(dtypes[module.qtype]).reshape(raw.shape[0], -1)
    return state


def save_gptq(model: torch.nn.Module, directory: str | os.PathLike, config: GPTQConfig,
              max_shard_bytes: int | None = None) -> None:
    """Writes `model` (its GPTQLinear layers hold the checkpoint tensors under
    their checkpoint names) as an HF GPTQ directory: config.json with
    `quantization_config` (the model's HF config too, if it has one),
    quantize_config.json, and safetensors, sharded above `max_shard_bytes`.
    `directory` must not exist (FileExistsError): it is written whole, then renamed into place.
    A model with PEFT adapter layers in it raises ValueError: the checkpoint
    is the base model's (save the adapter with the PEFT model's save_pretrained);
    so does one with no GPTQLinear, or with GGUF blocks other than float
    tables (a GGUF model's layers, Q8_0 / Q6_K float_tables), which a GPTQ
    checkpoint cannot hold; so does a config that misdescribes the layers
    (_check_config_describes)."""
    check_module("save_gptq", model)
    if not isinstance(config, GPTQConfig):
        raise TypeError(f"save_gptq: config must be a GPTQConfig, got {type(config).__name__}")
    # A shard limit of True (1 byte), 0 or below writes every tensor to a shard
    # of its own; NaN compares false and writes one shard: neither is asked for.
    if max_shard_bytes is not None and (not is_integer(max_shard_bytes) or max_shard_bytes < 1):
        raise ValueError(f"save_gptq: max_shard_bytes must be a positive int or None, got {max_shard_bytes!r}")
    check_new_directory("save_gptq", "directory", directory)
    _check_savable(model)
    adapted = _adapter_layers(model)
    if adapted:
        raise ValueError(f"save_gptq: the model has PEFT adapter layers ({', '.join(adapted[:3])}"
                         f"{', ...' if len(adapted) > 3 else ''}); a GPTQ checkpoint holds the base model: save the "
                         "adapter with the PEFT model's save_pretrained and the base without adapters (unload())")
    tensors, seen = {}, set()
    for name, t in _float_tables_as_weights(model).items():
        # Tied weights (an LM head sharing the embedding) appear twice; like HF, keep the first.
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        if key not in seen:
            seen.add(key)
            tensors[name] = t
    _check_config_describes(model, tensors, config)
    _zeros_as_labelled(model, tensors, config.checkpoint_format)
    hf_config = getattr(model, "config", None)
    content = hf_config.to_dict() if hasattr(hf_config, "to_dict") else {}
    content["quantization_config"] = config.to_dict()
    write_checkpoint(directory, tensors, content, max_shard_bytes=max_shard_bytes)


def _check_config_describes(model: torch.nn.Module, tensors: dict[str, torch.Tensor], config: GPTQConfig) -> None:
    """ValueError unless `config` (whose values GPTQConfig checks as it is
    made) says of each GPTQ layer in `tensors` what the layer holds: its
    bits and group_size, no symmetry or row order it lacks (readers take a sym layer's
    zero points as 2^(bits-1) without reading qzeros, and a desc_act=False
    layer's rows as in order), and no dynamic rule excluding it; and lm_head
    whether the LM head is quantized. The checkpoint would otherwise be
    refused at load, or read wrongly."""
    head = isinstance(getattr(model, "lm_head", None), (GPTQLinear, ProjectionSlice))
    if hasattr(model, "lm_head") and head != config.lm_head:  # vLLM builds the head from the flag alone
        raise ValueError(f"save_gptq: the config says lm_head {str(config.lm_head).lower()}, but the model's LM head "
                         f"is {'' if head else 'not '}GPTQ-quantized")
    for name, module in model.named_modules():
        layer = module.outputs.layer if isinstance(module, ProjectionSlice) else module
        if not isinstance(layer, GPTQLinear) or f"{name}.qweight" not in tensors:  # a fused layer: its parts
            continue
        quant = config.for_module(name)
        if quant is None:
            raise ValueError(f"save_gptq: the config's dynamic rules exclude {name}, a GPTQ layer")
        wrong = [f"{key} {getattr(quant, key)} (the layer's: {getattr(layer, key)})"
                 for key in ("bits", "group_size") if getattr(quant, key) != getattr(layer, key)]
        wrong += ["sym true (the layer is asymmetric)"] if quant.sym and not layer.sym else []
        wrong += ["desc_act false (the layer is act-order)"] if layer.desc_act and not quant.desc_act else []
        if wrong:
            raise ValueError(f"save_gptq: the config says {', '.join(wrong)} of {name}")


def _check_savable(model: torch.nn.Module) -> None:
    """ValueError unless the model has GPTQ layers and no GGUF blocks but
    float ones (what _float_tables_as_weights writes back as weights)."""
    from ..gguf import GGUFEmbedding, GGUFExperts, GGUFLinear  # lowbit.gguf imports this package
    from ..gguf.linear import FLOAT_QTYPES

    floats = set(FLOAT_QTYPES.values())
    blocks = [name or "(the model)" for name, m in model.named_modules()
              if (isinstance(m, (GGUFEmbedding, GGUFLinear)) and m.qtype not in floats)
              or (isinstance(m, GGUFExperts) and set(m.qtypes.values()) - floats)]
    if blocks:
        raise ValueError(f"save_gptq: {', '.join(blocks[:3])}{', ...' if len(blocks) > 3 else ''} hold GGUF "
                         "quantized blocks, which a GPTQ checkpoint cannot store (a model loaded with "
                         "float_tables='Q8_0' or 'Q6_K' saves when loaded without it)")
    if not any(isinstance(m, GPTQLinear) for m in model.modules()):
        raise ValueError("save_gptq: the model has no GPTQLinear layer: nothing of it is GPTQ-quantized "
                         "(lowbit.gptq.quantize or load_gptq_model make such layers)")


def _adapter_layers(model: torch.nn.Module) -> list[str]:
    """The names of the PEFT adapter layers (LoRA's, wrapping a base layer) in model."""
    if "peft" not in sys.modules:  # no adapter layer without PEFT imported
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


def _zeros_as_labelled(model: torch.nn.Module, tensors: dict[str, torch.Tensor], label: str) -> None:
    """Each layer's qzeros in `tensors` written in the zero format `label`
    says, where the layer holds the other one (a GPTQModel v1 module read as
    exact v2 zeros, a mislabelled checkpoint read as its words say): v1 as
    GPTQModel writes it (v2_zeros_as_gptqmodel_v1), which reads back as the
    same zeros; a zero of 0 so written is warned about (readers other than
    GPTQModel read its word 2^bits off, as convert_checkpoint says)."""
    zero_of_zero = []
    for name, module in model.named_modules():
        layer = module.outputs.layer if isinstance(module, ProjectionSlice) else module
        key = f"{name}.qzeros" if name else "qzeros"
        if not isinstance(layer, GPTQLinear) or layer.checkpoint_format == label or key not in tensors:
            continue
        if label == "gptq":
            zeros = torch.ops.lowbit.gptq_unpack(tensors[key], layer.bits, 1)
            tensors[key] = v2_zeros_as_gptqmodel_v1(zeros, layer.bits)
            if bool((zeros == 0).any()):
                zero_of_zero.append(name)
        else:
            tensors[key] = torch.ops.lowbit.gptq_pack(v1_zeros_as_v2(tensors[key], layer.bits)[0], layer.bits, 1)
    if zero_of_zero:
        named = ", ".join(zero_of_zero[:5]) + (", ..." if len(zero_of_zero) > 5 else "")
        warnings.warn(f"save_gptq: {len(zero_of_zero)} modules ({named}) have zero points of 0, written in v1 "
                      "('gptq') as GPTQModel writes them; vLLM and exllama read those words 2^bits off: save them "
                      "with checkpoint_format 'gptq_v2'", stacklevel=3)
