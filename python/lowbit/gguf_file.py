"""GGUF files as validated, zero-copy torch views.

gguf-py's GGUFReader parses the header, metadata and tensor infos; this module
checks every tensor against lowbit's type table (torch.ops.lowbit.ggml_type_info)
and the file size, and exposes each tensor's raw block bytes as a torch.uint8
[rows, row_bytes] view over a copy-on-write memory map.

    with load_gguf("model.gguf") as f:
        w = f.tensors["blk.0.attn_q.weight"]
        w.type_name, w.shape, w.data  # 'Q4_1', (576, 576), uint8 [576, 360]
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFEndian, GGUFReader, GGUFValueType

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "load_gguf"]

MAX_DIMS = 4  # GGML_MAX_DIMS


class GGUFError(ValueError):
    """A GGUF file is unreadable, corrupt, or uses something lowbit does not support."""


@dataclass(frozen=True, eq=False)  # eq would compare tensors
class GGUFTensor:
    name: str
    type: int  # ggml type id
    type_name: str
    shape: tuple[int, ...]  # torch order: reversed GGUF dims
    data: torch.Tensor  # uint8 [rows, row_bytes], raw block bytes (also for F32/F16/BF16)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.nbytes / self.n_elements


class GGUFFile:
    """A loaded GGUF file. Tensor views keep the memory map alive on their own,
    so close() only drops this object's references; the map goes when the
    last view does."""

    def __init__(self, path: str, version: int, alignment: int,
                 metadata: dict[str, Any], tensors: dict[str, GGUFTensor]):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.metadata = metadata
        self.tensors = tensors

    def close(self) -> None:
        self.metadata = {}
        self.tensors = {}

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, {len(self.tensors)} tensors, {len(self.metadata)} keys)"


class _Reader(GGUFReader):
    """GGUFReader with three hooks into its internals:

    - `_get` refuses reads past the end of the file. Upstream slices the memory
      map, so such a read quietly comes back short and a truncated file surfaces
      later as an unrelated numpy error or IndexError, or not at all.
    - `_get_field_parts` refuses arrays longer than the rest of the file could
      hold. Upstream reads arrays item by item, a few numpy objects per item, so
      a corrupt length in a large file would otherwise cost gigabytes first.
    - `_build_tensors` only records the tensor infos. Upstream builds numpy views
      itself and fails on unknown type ids without naming the tensor; we validate
      each tensor and build the views in `_tensor`.
    """

    def _get(self, offset, dtype, count=1, override_order=None):
        need = int(count) * np.dtype(dtype).itemsize
        if int(offset) + need > self.data.size:
            raise ValueError(f"truncated: needs {need} bytes at offset {offset}, "
                             f"file has {self.data.size} bytes")
        return super()._get(offset, dtype, count, override_order)

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            length = int(self._get(orig_offs + 4, np.uint64)[0])
            if orig_offs + 12 + length * _min_item_bytes(item_type) > self.data.size:
                raise ValueError(f"truncated: array at offset {orig_offs} claims {length} items, "
                                 f"more than the {self.data.size}-byte file can hold")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_tensors(self, start_offs, fields):
        self.tensor_infos = fields


def _min_item_bytes(value_type: int) -> int:
    if value_type == GGUFValueType.STRING:
        return 8  # u64 length
    if value_type == GGUFValueType.ARRAY:
        return 12  # u32 item type + u64 length
    scalar = GGUFReader.gguf_scalar_to_np.get(value_type)
    return 1 if scalar is None else np.dtype(scalar).itemsize  # unknown: upstream rejects it


def load_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file; raises GGUFError for any problem with it."""
    path = os.fspath(path)
    try:
        # "c": copy-on-write map, so views are writable (torch.from_numpy wants
        # that) and nothing is ever written back to the file.
        reader = _Reader(path, "c")
    except Exception as e:  # anything the parser trips over means a bad file
        raise GGUFError(f"{path}: not a readable GGUF file: {_describe(e)}") from e
    if reader.endianess != GGUFEndian.LITTLE:
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    alignment = int(reader.alignment)
    tensors = {}
    for field in reader.tensor_infos:
        if field.name in tensors:
            raise GGUFError(f"{path}: duplicate tensor {field.name!r}")
        tensors[field.name] = _tensor(reader, field, path, alignment)
    return GGUFFile(path, int(reader.fields["GGUF.version"].contents()), alignment,
                    _metadata(reader, path), tensors)


def _describe(e: Exception) -> str:
    return str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"


def _metadata(reader: GGUFReader, path: str) -> dict[str, Any]:
    metadata = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # GGUFReader's pseudo-keys for the header's version and counts
            continue
        try:
            metadata[key] = field.contents()
        except Exception as e:  # e.g. a string that is not UTF-8
            raise GGUFError(f"{path}: metadata key {key!r}: {_describe(e)}") from e
    return metadata


@lru_cache(maxsize=None)
def _type_info(type_id: int) -> tuple[int, int] | None:
    """(elements, bytes) per block from lowbit's type table, None if unsupported."""
    try:
        block, type_bytes = torch.ops.lowbit.ggml_type_info(type_id)
    except ValueError:
        return None
    return int(block), int(type_bytes)


def _type_name(type_id: int) -> str:
    try:
        return gguf.GGMLQuantizationType(type_id).name
    except ValueError:
        return "unknown"


def _tensor(reader: _Reader, field, path: str, alignment: int) -> GGUFTensor:
    # Tensor info parts, as laid out by GGUFReader._get_tensor_info_field.
    _, _, n_dims, dims, raw_type, rel_offset = field.parts
    where = f"{path}: tensor {field.name!r}"
    n_dims, type_id, rel_offset = int(n_dims[0]), int(raw_type[0]), int(rel_offset[0])
    dims = [int(d) for d in dims]  # GGUF order: dims[0] is the contiguous row

    info = _type_info(type_id)
    if info is None:
        raise GGUFError(f"{where}: ggml type {type_id} ({_type_name(type_id)}) "
                        "is not a weight type lowbit supports")
    block, type_bytes = info
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFError(f"{where}: {n_dims} dimensions, expected 1 to {MAX_DIMS}")
    if min(dims) < 1:
        raise GGUFError(f"{where}: empty dimension in {dims}")
    row_len = dims[0]
    if row_len % block:
        raise GGUFError(f"{where}: row length {row_len} is not a multiple of the "
                        f"{_type_name(type_id)} block size {block}")
    if rel_offset % alignment:
        raise GGUFError(f"{where}: data offset {rel_offset} is not a multiple of the alignment {alignment}")

    rows = math.prod(dims[1:])
    row_bytes = row_len // block * type_bytes
    nbytes = rows * row_bytes
    start = int(reader.data_offset) + rel_offset
    file_size = reader.data.size
    # Python ints: a corrupt dim cannot overflow here, and nothing is allocated.
    if start + nbytes > file_size:
        raise GGUFError(f"{where}: data [{start}, {start + nbytes}) runs past the end "
                        f"of the file ({file_size} bytes)")

    data = torch.from_numpy(reader.data[start:start + nbytes].reshape(rows, row_bytes))
    return GGUFTensor(field.name, type_id, _type_name(type_id), tuple(reversed(dims)), data)
