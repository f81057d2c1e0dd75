"""GGUF files as validated, zero-copy torch views.

The header, metadata and tensor infos are parsed here from the GGUF
specification, every read bounds-checked against the file size (gguf-py's
GGUFReader, the tests' independent reference, builds NumPy objects per array
item: seconds for a 150k-token vocabulary, against milliseconds here). Every
tensor is checked against lowbit's type table (torch.ops.lowbit.ggml_type_info),
the file size and llama.cpp's layout (each tensor's data right after the
previous one's, padded to the alignment), and its raw block bytes exposed as
a torch.uint8 [rows, row_bytes] view over a copy-on-write memory map.

    with load_gguf("model.gguf") as f:
        w = f.tensors["blk.0.attn_q.weight"]
        w.type_name, w.shape, w.data  # 'Q4_1', (576, 576), uint8 [576, 360]
"""
from __future__ import annotations

import ctypes
import math
import mmap
import os
import struct
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .._checks import check_float_dtype, check_path, check_regular_file, shown
from .._mapping import map_private

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "load_gguf", "release_mapped"]

MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ENTRIES = 1 << 16  # tensors, and metadata keys, of one file


class GGUFError(ValueError):
    """A GGUF file is unreadable, corrupt, or uses something lowbit does not support."""


# The dtypes ggml_dequantize writes. Another float dtype is cast from float32,
# as GPTQLinear.dequantize gives it: exact into float64, which holds every float32.
DEQUANTIZE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dequantize_rows(who: str, blocks: torch.Tensor, qtype: int, rows: int, n: int, dtype) -> torch.Tensor:
    """ggml_dequantize's [rows, n] in any float `dtype`; another `dtype` is
    refused naming the argument (the op's error names neither it nor `who`)."""
    check_float_dtype(who, dtype)
    out = dtype if dtype in DEQUANTIZE_DTYPES else torch.float32
    return torch.ops.lowbit.ggml_dequantize(blocks, qtype, rows, n, out).to(dtype)


@dataclass(frozen=True, eq=False)  # eq would compare tensors
class GGUFTensor:
    """One tensor of a GGUF file: its name, ggml type, shape and raw block
    bytes (a view of the memory-mapped file)."""

    name: str
    type: int  # ggml type id
    type_name: str
    shape: tuple[int, ...]  # torch order: reversed GGUF dims
    data: torch.Tensor  # uint8 [rows, row_bytes], raw block bytes (also for F32/F16/BF16)

    @property
    def nbytes(self) -> int:
        """The block bytes the tensor holds in the file."""
        return self.data.numel()

    @property
    def n_elements(self) -> int:
        """The values the blocks decode to (the product of `shape`)."""
        return math.prod(self.shape)

    @property
    def bits_per_weight(self) -> float:
        """Block bits per value, the type's scales and mins included."""
        return 8 * self.nbytes / self.n_elements

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float values, in `shape` (lowbit's bit-exact ggml_dequantize)."""
        rows, row_len = self.data.shape[0], self.shape[-1]
        return dequantize_rows("GGUFTensor.dequantize", self.data, self.type, rows, row_len, dtype).reshape(self.shape)

    def check_finite(self, where: str) -> None:
        """Refuses, as GGUFError naming `where`, the tensor and its first such
        row, a value that is not finite: a NaN or infinity in a block's scales
        (which makes its whole block so) or in a float tensor, the values
        llama.cpp's --check-tensors refuses. Decoded about 256k values at a time."""
        rows, row_len = self.data.shape[0], self.shape[-1]
        step = max(1, (1 << 18) // row_len)
        for r0 in range(0, rows, step):
            part = self.data[r0:r0 + step]
            values = torch.ops.lowbit.ggml_dequantize(part, self.type, part.shape[0], row_len, torch.float32)
            bad = (~torch.isfinite(values)).any(dim=1).nonzero()
            if bad.numel():
                raise GGUFError(f"{where}: tensor {shown(self.name)} ({self.type_name}) holds a NaN or infinity in row "
                                f"{r0 + int(bad[0])} of its {rows} (a corrupt block scale or value)")


class GGUFFile:
    """A loaded GGUF file. Tensor views keep the memory map alive on their own,
    so close() only drops this object's references; the map goes when the
    last view does."""

    def __init__(self, path: str, version: int, alignment: int,
                 metadata: dict[str, Any], tensors: dict[str, GGUFTensor], mapping: np.ndarray | None = None):
        self.path = path
        self.version = version
        self.alignment = alignment
        self.metadata = metadata
        self.tensors = tensors
        self._mapping = mapping

    def _offset(self, t: torch.Tensor) -> int | None:
        """The byte offset in this file's mapping of `t`, a contiguous CPU view
        that lies wholly inside it; None for anything else (a copy, another
        file's bytes, a closed file)."""
        if self._mapping is None or t.device.type != "cpu" or not t.is_contiguous():
            return None
        base = self._mapping.ctypes.data
        start = t.data_ptr() - base
        nbytes = t.numel() * t.element_size()
        return start if 0 <= start and start + nbytes <= self._mapping.nbytes else None

    def back_to_back(self, parts: list[torch.Tensor]) -> torch.Tensor | None:
        """Row blocks of equal row bytes that lie back to back in this file's
        mapping, in this order (tensors the file stores one after the other,
        with no padding between), as one view of the mapping: joining them
        copies nothing. None for any that do not (a copy, another file, a gap)."""
        parts = _tensor_list("GGUFFile.back_to_back", parts)
        if not parts or parts[0].dim() != 2:
            return None
        row_bytes = parts[0].shape[-1]
        start = end = self._offset(parts[0])
        for p in parts:
            if (end is None or p.dtype != torch.uint8 or p.dim() != 2 or p.shape[1] != row_bytes
                    or self._offset(p) != end):
                return None
            end += p.numel()
        # A view with a storage of its own bytes (no bytes are read): a view
        # of the whole mapping would make torch.save, deepcopy and safetensors
        # copy the whole file once per joined layer.
        return torch.from_numpy(self._mapping[start:end]).view(-1, row_bytes)

    def release(self, parts: list[torch.Tensor]) -> None:
        """release_mapped(parts): the pages of views whose bytes now live in a
        copy (a joined layer's), read once to be copied."""
        release_mapped(_tensor_list("GGUFFile.release", parts))

    def close(self) -> None:
        """Drops this object's metadata, tensors and mapping (see the class
        docstring: views already taken keep the map alive)."""
        self.metadata = {}
        self.tensors = {}
        self._mapping = None

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, {len(self.tensors)} tensors, {len(self.metadata)} keys)"


def _tensor_list(who: str, parts) -> list[torch.Tensor]:
    """`parts` (any iterable of tensors: a generator is read once) as a list,
    or TypeError naming it: a tensor would be taken row by row, and anything
    else fails on an attribute or an index, naming nothing."""
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Iterable):
        raise TypeError(f"{who}: parts must be a list of tensors, got {type(parts).__name__}")
    parts = list(parts)
    for p in parts:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{who}: parts must be a list of tensors, got one holding {type(p).__name__}")
    return parts


# madvise from the C library where there is one (Linux, macOS): release_mapped.
_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", 4)
try:
    _MADVISE = ctypes.CDLL(None, use_errno=True).madvise
    _MADVISE.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
except (OSError, AttributeError):
    _MADVISE = None

# Every live file mapping's address range (start -> end), for release_mapped;
# an entry goes with its mapping.
_MAPPINGS: dict[int, int] = {}


def _register_mapping(mapping: np.ndarray) -> None:
    start = mapping.ctypes.data
    _MAPPINGS[start] = start + mapping.nbytes
    weakref.finalize(mapping, _MAPPINGS.pop, start, None)


def release_mapped(parts: list[torch.Tensor]) -> None:
    """Drops the resident pages of GGUF file mappings that lie wholly inside
    `parts`, views whose bytes live in a copy now (a joined or repacked
    layer's): read once to be copied, they would otherwise stay in the
    process's memory beside the copy. Any later read of them (a tied
    embedding's lookups) reads the file again. A page a write has made a
    private copy of (the mapping is copy-on-write: a weight written in place)
    is kept, as are all where the process cannot read its page flags
    (/proc/self/pagemap); parts of no mapping are left alone."""
    if _MADVISE is None:
        return
    for p in parts:
        if p.device.type != "cpu" or not p.is_contiguous():
            continue
        start = p.data_ptr()
        end = start + p.numel() * p.element_size()
        if not any(lo <= start and end <= hi for lo, hi in _MAPPINGS.items()):
            continue
        first, last = -(-start // _PAGE) * _PAGE, end // _PAGE * _PAGE
        for a, b in _unwritten_runs(first, last):
            _MADVISE(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_DONTNEED)


def _unwritten_runs(first: int, last: int) -> list[tuple[int, int]]:
    """The runs of pages in [first, last) holding no private copy: not
    resident, or resident pages of the file (pagemap bit 61; bit 63 resident,
    62 swapped, which only a private page can be)."""
    pages = (last - first) // _PAGE
    if pages <= 0:
        return []
    try:
        with open("/proc/self/pagemap", "rb") as f:
            f.seek(first // _PAGE * 8)
            flags = np.frombuffer(f.read(pages * 8), dtype="<u8")
    except OSError:
        return []
    if flags.size != pages:
        return []
    private = (((flags >> 63) & 1) & ~((flags >> 61) & 1) | ((flags >> 62) & 1)).astype(bool)
    edges = np.diff(np.concatenate(([0], (~private).astype(np.int8), [0])))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [(first + int(a) * _PAGE, first + int(b) * _PAGE) for a, b in zip(starts, ends)]

# GGUF metadata value types (gguf.GGUFValueType's numbering) by the struct
# format of their payload; 8 and 9 are strings and arrays.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_U64 = struct.Struct("<Q")
_STRING, _ARRAY = 8, 9
SUPPORTED_VERSIONS = (2, 3)  # v1 had 32-bit counts and lengths; llama.cpp reads 2 and 3
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT, when general.alignment is absent


class _Cursor:
    """Reads the header's little-endian fields in order, refusing any read
    past the end of the file: a truncated or corrupt file fails here, with
    where and how much, never as a short read that surfaces later.

    Fields are read from a bytes copy of the file's start, doubled as the
    header needs (a header is a small part of its file): reads of bytes cost
    less than reads through the memory map's buffer (a vocabulary parses in
    three quarters of the time)."""

    FIRST_COPY = 1 << 20
    MAX_ARRAY_ITEMS = 1 << 25  # about 1 GiB as Python lists
    # Real headers (a 262k-token vocabulary and its merges, a chat template)
    # take tens of MB; a corrupt string length would otherwise copy and
    # decode as much of the file as it claims.
    MAX_HEADER_BYTES = 1 << 28

    def __init__(self, data: np.ndarray):
        self.data = data
        self.size = data.size
        self.pos = 0
        self.head = b""
        self.array_items = 0

    def reach(self, start: int, n: int) -> bytes:
        """The header copy, holding the n bytes at start."""
        end = start + n
        if end > self.size:
            raise ValueError(f"truncated: needs {n} bytes at offset {start}, file has {self.size} bytes")
        if end > self.MAX_HEADER_BYTES:
            raise ValueError(f"the header runs past {self.MAX_HEADER_BYTES >> 20} MiB ({n} bytes claimed at offset "
                             f"{start}), more than any model's header holds: a corrupt length?")
        if end > len(self.head):
            self.head = bytes(memoryview(self.data)[:min(self.size, max(end, 2 * len(self.head), self.FIRST_COPY))])
        return self.head

    def take(self, n: int) -> int:
        """Claims the next n bytes; returns where they start."""
        start = self.pos
        self.reach(start, n)
        self.pos = start + n
        return start

    def scalar(self, fmt: str):
        start = self.take(struct.calcsize(fmt))
        return struct.unpack_from("<" + fmt, self.head, start)[0]

    def string(self) -> str:
        return self.strings(1)[0]

    def value(self, value_type: int):
        """A metadata value: Python scalars, str, and lists of them."""
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type} at offset {self.pos - 4}")
        at = self.pos
        item_type, length = self.scalar("I"), self.scalar("Q")
        # Checked before any item is read: a corrupt length fails at once,
        # instead of after a loop that builds an object per claimed item.
        if self.pos + length * _min_item_bytes(item_type) > self.size:
            raise ValueError(f"truncated: array at offset {at} claims {length} items, "
                             f"more than the {self.size}-byte file can hold")
        # Each item becomes a Python object of up to 8 times its bytes in the file.
        self.array_items += length
        if self.array_items > self.MAX_ARRAY_ITEMS:
            raise ValueError(f"metadata arrays hold more than {self.MAX_ARRAY_ITEMS} items in all (the array at "
                             f"offset {at} claims {length}): a vocabulary and its scores hold a few million at most")
        if item_type in _SCALAR_FORMATS:  # one NumPy read for the whole array
            dtype = np.dtype("<" + _SCALAR_FORMATS[item_type])
            start = self.take(length * dtype.itemsize)
            return np.frombuffer(self.data, dtype, count=length, offset=start).tolist()
        if item_type == _STRING:
            return self.strings(length)
        return [self.value(item_type) for _ in range(length)]

    def strings(self, length: int) -> list[str]:
        """`length` strings in a row (a key, a vocabulary, its merges): each a
        u64 length and its UTF-8 bytes, bounds-checked, in one loop over
        locals (a vocabulary's strings take half the time of a call each)."""
        head, pos = self.head, self.pos
        limit = len(head)
        unpack = _U64.unpack_from
        out = [""] * length
        for i in range(length):
            if pos + 8 > limit:
                head = self.reach(pos, 8)
                limit = len(head)
            n = unpack(head, pos)[0]
            pos += 8
            end = pos + n
            if end > limit:
                head = self.reach(pos, n)
                limit = len(head)
            out[i] = head[pos:end].decode()
            pos = end
        self.pos = pos
        return out


def _min_item_bytes(value_type: int) -> int:
    if value_type == _STRING:
        return 8  # u64 length
    if value_type == _ARRAY:
        return 12  # u32 item type + u64 length
    if value_type in _SCALAR_FORMATS:
        return struct.calcsize(_SCALAR_FORMATS[value_type])
    raise ValueError(f"unknown metadata value type {value_type} in an array")


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: list[int]  # GGUF order: dims[0] is the contiguous row
    type_id: int
    rel_offset: int


def _parse(data: np.ndarray, path: str) -> tuple[int, dict[str, Any], list[_TensorInfo], int, int]:
    """(version, metadata, tensor infos, alignment, offset of the tensor data)
    of the file's header, laid out as the GGUF specification (ggml/docs/gguf.md) says."""
    c = _Cursor(data)
    start = c.take(4)
    magic = c.head[start:start + 4]
    if magic != b"GGUF":
        raise ValueError(f"bad magic {magic!r} (a GGUF file starts with b'GGUF')")
    version = c.scalar("I")
    if version & 0xFFFF == 0 and version >> 16:  # 2 or 3 read the wrong way round
        raise GGUFError(f"{path}: big-endian GGUF files are not supported")
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF version {version} is not supported (versions 2 and 3 are)")
    n_tensors, n_kv = c.scalar("Q"), c.scalar("Q")
    # Each becomes Python objects of about 1.5 KiB: a count no model reaches is refused before any is read.
    for what, count in (("tensors", n_tensors), ("metadata keys", n_kv)):
        if count > MAX_ENTRIES:
            raise ValueError(f"{count} {what}, more than {MAX_ENTRIES} (models hold a few thousand at most)")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = c.string()
        value_type = c.scalar("I")
        try:
            value = c.value(value_type)
        except UnicodeDecodeError as e:
            raise GGUFError(f"{path}: metadata key {shown(key)}: {e}") from e
        if key in metadata:
            raise ValueError(f"duplicate metadata key {shown(key)}")
        metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        n_dims = c.scalar("I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {shown(name)}: {n_dims} dimensions, expected 1 to {MAX_DIMS}")
        dims = [c.scalar("Q") for _ in range(n_dims)]
        infos.append(_TensorInfo(name, dims, c.scalar("I"), c.scalar("Q")))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {shown(alignment)} is not a power of two")
    return version, metadata, infos, alignment, c.pos + (-c.pos % alignment)


def is_gguf_path(path: str | os.PathLike) -> bool:
    """Whether `path` names a GGUF file (a .gguf suffix in any case), as
    replace_linear and the command line tell it from a GPTQ checkpoint."""
    return os.fsdecode(path).lower().endswith(".gguf")


def load_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse and validate a GGUF file; raises GGUFError for any problem with it.

    Its tensors are views of the file's pages, read as they are used (as
    llama.cpp maps a file): the file must not change while they are in use.
    Deleting it or renaming a new file over it is safe; writing into it
    changes the tensors, and truncating it ends the process (SIGBUS) at
    the next read of a page past the new end."""
    path = check_path("load_gguf", path)
    check_regular_file(path, "GGUF file", GGUFError)
    try:
        data = map_private(path)
        version, metadata, infos, alignment, data_offset = _parse(data, path)
    except GGUFError:
        raise
    except Exception as e:  # anything the parser trips over means a bad file
        raise GGUFError(f"{path}: not a readable GGUF file: {_describe(e)}") from e
    # llama.cpp's rule (gguf_init_from_file): in file order, each tensor's data
    # starts where the previous tensor's ends, padded to the alignment. So no
    # two tensors share a byte: an offset or type edited to alias another
    # tensor's data, or a gap that hides bytes, is refused.
    tensors: dict[str, GGUFTensor] = {}
    expected, previous = 0, None
    for info in infos:
        if info.name in tensors:
            raise GGUFError(f"{path}: duplicate tensor {shown(info.name)}")
        t = _tensor(data, data_offset, info, path)
        if info.rel_offset != expected:
            follows = (f"where {shown(previous)} ends, padded to the alignment {alignment}" if previous
                       else "the start of the data section")
            raise GGUFError(f"{path}: tensor {shown(info.name)}: data offset {info.rel_offset}, expected {expected} "
                            f"({follows}): tensor data must not overlap or leave gaps")
        tensors[info.name] = t
        expected, previous = expected + t.nbytes + -t.nbytes % alignment, info.name
    _register_mapping(data)
    return GGUFFile(path, version, alignment, metadata, tensors, data)


def _describe(e: Exception) -> str:
    return str(e) if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"


@lru_cache(maxsize=None)
def _type_info(type_id: int) -> tuple[int, int] | None:
    """(elements, bytes) per block from lowbit's type table, None if unsupported."""
    try:
        block, type_bytes = torch.ops.lowbit.ggml_type_info(type_id)
    except ValueError:
        return None
    return int(block), int(type_bytes)


def _type_name(type_id: int) -> str:
    """lowbit's name of a type it supports, else gguf-py's, else "unknown"."""
    try:
        return torch.ops.lowbit.ggml_type_name(type_id)
    except ValueError:
        pass
    try:  # only here: `import lowbit` needs no gguf-py (the GPU machines' image has none)
        import gguf

        return gguf.GGMLQuantizationType(type_id).name
    except (ImportError, ValueError):
        return "unknown"


def _tensor(data: np.ndarray, data_offset: int, info: _TensorInfo, path: str) -> GGUFTensor:
    where = f"{path}: tensor {shown(info.name)}"
    type_id, dims, rel_offset = info.type_id, info.dims, info.rel_offset
    type_info = _type_info(type_id)
    if type_info is None:
        raise GGUFError(f"{where}: ggml type {type_id} ({_type_name(type_id)}) "
                        "is not a weight type lowbit supports")
    block, type_bytes = type_info
    if min(dims) < 1:
        raise GGUFError(f"{where}: empty dimension in {dims}")
    row_len = dims[0]
    if row_len % block:
        raise GGUFError(f"{where}: row length {row_len} is not a multiple of the "
                        f"{_type_name(type_id)} block size {block}")

    rows = math.prod(dims[1:])
    row_bytes = row_len // block * type_bytes
    nbytes = rows * row_bytes
    start = data_offset + rel_offset
    # Python ints: a corrupt dim cannot overflow here, and nothing is allocated.
    if start + nbytes > data.size:
        raise GGUFError(f"{where}: data [{start}, {start + nbytes}) runs past the end "
                        f"of the file ({data.size} bytes)")

    view = torch.from_numpy(data[start:start + nbytes].reshape(rows, row_bytes))
    return GGUFTensor(info.name, type_id, _type_name(type_id), tuple(reversed(dims)), view)
