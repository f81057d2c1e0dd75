"""Converting a GPTQ checkpoint between the v1 ("gptq") and v2 ("gptq_v2")
zero-point formats.

v1 stores zero-1 per field, v2 the zero itself. The conversion unpacks every
qzeros field, adds or subtracts 1 and repacks: adding a constant to the packed
words would be wrong for 3-bit, whose fields straddle word boundaries. A v1
module with a field of all ones (zero 2^bits, which no quantizer produces) is
read as GPTQModel writes a zero of 0 (checkpoint.v1_zeros_as_v2), with a
warning. A zero of 0 has no v1 encoding lowbit's readers share, so converting
such zeros to v1 is refused rather than wrapped.
"""
from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .._checks import check_path, shown
from .checkpoint import (GPTQCheckpointError, check_new_directory, checkpoint_files, gptqmodel_warning, read_tensors,
                         source_configs, v1_zeros_as_v2, write_checkpoint)
from .config import FORMATS, GPTQConfig, read_config

MAX_NAMED_MODULES = 5  # refusals name this many modules, then give the count


def convert_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, to: str = "gptq_v2") -> dict[str, Any]:
    """Writes the checkpoint directory `src` to the new directory `dst` with its
    zero points in format `to` ("gptq_v2" or "gptq"). Every other tensor, and
    every other file of `src`, is carried over unchanged; config.json and
    quantize_config.json get the new checkpoint_format. A sharded source gives
    a sharded output (shards no larger than the source's largest).

    `src` is only read. `dst` must not exist; it appears only when complete:
    everything is written to a hidden temporary directory `.<dst name>.*`
    beside it and renamed at the end. A process killed mid-write (SIGKILL,
    power loss) can leave that hidden directory behind, never `dst`.

    Raises ValueError (GPTQConfigError / GPTQCheckpointError for unreadable
    checkpoints) before writing anything if the checkpoint already is in
    format `to`, if its config's format label contradicts its stored
    symmetric zeros, or if any zero cannot be expressed in format `to`;
    GPTQCheckpointError naming `dst` if writing fails (a full disk).
    Returns a summary: source, destination, from, to, modules, tensors, shards.
    """
    if to not in FORMATS:
        raise ValueError(f"convert_checkpoint: `to` must be one of {FORMATS}, got {to!r}")
    # An empty src is the working directory to os.path: ": not a checkpoint directory".
    src = check_path("convert_checkpoint", src, "src", "directory")
    if not os.path.isdir(src):
        raise GPTQCheckpointError(f"{src}: not a checkpoint directory")
    dst = check_new_directory("convert_checkpoint", "dst", dst)
    config = read_config(src)
    if config.checkpoint_format == to:
        raise ValueError(f"{src}: the checkpoint is already in {to!r} format; nothing to convert")
    _, files = checkpoint_files(src)
    tensors = read_tensors(files)
    zeros = _unpacked_zeros(src, config, tensors)
    _check_label(src, config, zeros)
    if to == "gptq":
        _check_v1_representable(src, zeros)
        converted = {prefix: (bits, z - 1) for prefix, (bits, z) in zeros.items()}
    else:
        converted, by_gptqmodel = {}, []
        for prefix, (bits, _) in zeros.items():
            z, read_as_gptqmodel = v1_zeros_as_v2(tensors[f"{prefix}.qzeros"], bits)
            converted[prefix] = (bits, z)
            if read_as_gptqmodel:
                by_gptqmodel.append(prefix)
        if by_gptqmodel:
            warnings.warn(gptqmodel_warning(src, by_gptqmodel), stacklevel=2)
    for prefix, (bits, z) in converted.items():
        tensors[f"{prefix}.qzeros"] = torch.ops.lowbit.gptq_pack(z, bits, 1)
    content, quantize = source_configs(src, config)
    for quant in (content["quantization_config"], quantize):
        quant["checkpoint_format"] = to
        if "format" in quant:  # newer GPTQModel writes the format under both keys
            quant["format"] = to
    write_checkpoint(dst, tensors, content, copy_from=src,
                     max_shard_bytes=_largest_shard_bytes(files) if len(files) > 1 else None, quantize_config=quantize)
    return {"source": src, "destination": dst, "from": config.checkpoint_format, "to": to,
            "modules": len(zeros), "tensors": len(tensors), "shards": len(checkpoint_files(dst)[1])}


def _unpacked_zeros(src: str, config: GPTQConfig,
                    tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
    """{module: (bits, stored zero fields [groups, N])} for every `.qzeros` tensor."""
    zeros = {}
    for name in sorted(n for n in tensors if n.endswith(".qzeros")):
        prefix = name[: -len(".qzeros")]
        quant = config.for_module(prefix)
        if quant is None:
            raise GPTQCheckpointError(f"{src}: module {shown(prefix)} has qzeros but the config's dynamic rules "
                                      "exclude it from quantization")
        packed = tensors[name]
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise GPTQCheckpointError(f"{src}: {shown(name)} must be a 2-D int32 tensor, got {packed.dtype} "
                                      f"{tuple(packed.shape)}")
        try:
            zeros[prefix] = (quant.bits, torch.ops.lowbit.gptq_unpack(packed, quant.bits, 1))
        except RuntimeError as e:  # e.g. a 3-bit qzeros whose width is not a multiple of 3 words
            raise GPTQCheckpointError(f"{src}: {shown(name)} does not fit {quant.bits}-bit packing: {e}") from e
    return zeros


def _check_label(src: str, config: GPTQConfig, zeros: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Refuses a checkpoint whose symmetric modules all store the other format's
    symmetric zero (published checkpoints labelled "gptq" holding v2 words
    exist). Converting it by its label would shift correct zeros off by one."""
    label = config.checkpoint_format
    sym = {p: (bits, z) for p, (bits, z) in zeros.items() if config.for_module(p).sym}
    other = "gptq" if label == "gptq_v2" else "gptq_v2"

    def stored_sym_zero(bits: int, fmt: str) -> int:
        return 2 ** (bits - 1) - (1 if fmt == "gptq" else 0)

    if sym and all(bool((z == stored_sym_zero(bits, other)).all()) for bits, z in sym.values()):
        prefix, (bits, _) = next(iter(sym.items()))
        word = int(torch.ops.lowbit.gptq_pack(torch.full((1, 32), stored_sym_zero(bits, other), dtype=torch.int32),
                                              bits, 1)[0, 0]) & 0xFFFFFFFF
        raise ValueError(
            f"{src}: the config says checkpoint_format={label!r} but all {len(sym)} symmetric modules store {other} "
            f"zero points (e.g. {prefix}.qzeros words 0x{word:08X} for {bits}-bit); the checkpoint is mislabelled. "
            f"Set checkpoint_format to {other!r} in its config instead of converting it.")


def _check_v1_representable(src: str, zeros: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Refuses, naming the modules, v2 zeros of 0: v1 stores zero-1 in [0, 2^bits-1]."""
    bad = [p for p, (_, z) in zeros.items() if bool((z == 0).any())]
    if bad:
        named = ", ".join(bad[:MAX_NAMED_MODULES]) + (", ..." if len(bad) > MAX_NAMED_MODULES else "")
        raise ValueError(f"{src}: cannot convert 'gptq_v2' to 'gptq': {len(bad)} of {len(zeros)} modules have zero "
                         f"points of 0, which v1 ('gptq') cannot store (it keeps zero-1) ({named}); nothing was "
                         "written")


def _largest_shard_bytes(files: list[str]) -> int:
    """The tensor bytes of the largest source shard: write_checkpoint's shard
    limit counts tensor bytes, so this keeps output shards that size or less."""
    largest = 0
    for file in files:
        # A safetensors file is an 8-byte header length, the JSON header, then the tensor bytes.
        with open(file, "rb") as f:
            header = int.from_bytes(f.read(8), "little")
        largest = max(largest, os.path.getsize(file) - 8 - header)
    return largest
