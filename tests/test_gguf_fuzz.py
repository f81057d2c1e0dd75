"""GGUF fuzzing: structured mutations of a GGUF file written by gguf-py (the
toy llama of gguf_files: 14 tensors of 7 types, 24 metadata keys including
string arrays) fed to lowbit.load_gguf and, for every tensor of a file that
loads, to GGUFLinear and ggml_dequantize.

A mutation overwrites one field of the file's structure (header version and
counts, key/string/array lengths, value and item types, tensor dims, n_dims,
ggml types and data offsets, the alignment) with a boundary value, truncates
the file, inserts or deletes bytes, or damages a byte of the header or of the
tensor data (block scales and indices); each case applies one
to three. The contract checked per case:
- the only exception is lowbit.GGUFError, and its message names the file;
- a file that loads has no two tensors over the same bytes;
- no hang: a case takes under CASE_SECONDS (a watchdog aborts the run, with
  every thread's traceback, if one ever takes CASE_SECONDS * 10);
- no huge allocation: the peak of Python and NumPy allocations (tracemalloc)
  stays under the file size plus ALLOCATION_SLACK, and the process's peak RSS
  grows by less than RSS_GROWTH over the whole run (torch allocations are
  bounded by shapes that load_gguf checked against the file size).

The CI run tries LOWBIT_FUZZ_EXAMPLES cases (default 300, derandomized, so a
run is reproducible); `make fuzz` runs 20000 fresh random cases and prints
hypothesis' statistics.
"""
from __future__ import annotations

import faulthandler
import os
import re
import resource
import struct
import tempfile
import time
import tracemalloc
from dataclasses import dataclass

import gguf
import pytest
import torch

import gguf_files

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lowbit import GGUFLinear  # noqa: E402
from lowbit.gguf.file import GGUFError, load_gguf  # noqa: E402

EXAMPLES = int(os.environ.get("LOWBIT_FUZZ_EXAMPLES", "300"))
LONG_RUN = "LOWBIT_FUZZ_EXAMPLES" in os.environ
CASE_SECONDS = 5.0
ALLOCATION_SLACK = 8 << 20
RSS_GROWTH = 256 << 20

# GGUF value types (gguf.GGUFValueType) by the struct format of their payload.
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class Field:
    """One structural field of the file: little-endian `fmt` at `offset`."""
    offset: int
    fmt: str  # "I" (u32) or "Q" (u64)
    kind: str  # what it holds, for the statistics


def layout(data: bytes) -> list[Field]:
    """The structural fields of a well-formed GGUF v3 file, found by walking
    it from the format specification (independently of gguf-py's reader)."""
    fields = [Field(4, "I", "version"), Field(8, "Q", "tensor count"), Field(16, "Q", "kv count")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at = 24

    def string(kind: str) -> str:
        nonlocal at
        (length,) = struct.unpack_from("<Q", data, at)
        fields.append(Field(at, "Q", kind))
        text = data[at + 8:at + 8 + length].decode()
        at += 8 + length
        return text

    def value(value_type: int, key: str) -> None:
        nonlocal at
        if value_type == STRING:
            string("string length")
        elif value_type == ARRAY:
            (item_type,) = struct.unpack_from("<I", data, at)
            (count,) = struct.unpack_from("<Q", data, at + 4)
            fields.extend([Field(at, "I", "array item type"), Field(at + 4, "Q", "array length")])
            at += 12
            for _ in range(count):
                value(item_type, key)
        else:
            if key == "general.alignment":
                fields.append(Field(at, "I", "alignment"))
            at += struct.calcsize("<" + SCALAR_FORMATS[value_type])

    for _ in range(n_kv):
        key = string("key length")
        (value_type,) = struct.unpack_from("<I", data, at)
        fields.append(Field(at, "I", "value type"))
        at += 4
        value(value_type, key)
    for _ in range(n_tensors):
        string("tensor name length")
        (n_dims,) = struct.unpack_from("<I", data, at)
        fields.append(Field(at, "I", "n_dims"))
        fields.extend(Field(at + 4 + 8 * i, "Q", "dim") for i in range(n_dims))
        at += 4 + 8 * n_dims
        fields.extend([Field(at, "I", "ggml type"), Field(at + 4, "Q", "tensor data offset")])
        at += 12
    return fields


def _base_file() -> tuple[bytes, int]:
    """The toy file's bytes and where gguf-py's reader says its data starts."""
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_files.write_toy_gguf(os.path.join(tmp, "toy.gguf")).path
        return open(path, "rb").read(), int(gguf.GGUFReader(path).data_offset)


BASE, DATA_START = _base_file()
FIELDS = layout(BASE)
HEADER_END = max(f.offset + struct.calcsize(f.fmt) for f in FIELDS)


def boundary_values(field: Field) -> list[int]:
    width = 8 * struct.calcsize(field.fmt)
    (original,) = struct.unpack_from("<" + field.fmt, BASE, field.offset)
    values = [0, 1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 30, 31, 32, 33, 39, 40, 64, 255, 256, 4096, 2**16,
              2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1,
              len(BASE) - 1, len(BASE), len(BASE) + 1, original - 1, original + 1, 2 * original]
    return sorted({v % 2**width for v in values})


def set_field():
    return st.sampled_from(FIELDS).flatmap(
        lambda f: st.tuples(st.just("set"), st.just(f),
                            st.one_of(st.sampled_from(boundary_values(f)),
                                      st.integers(0, 2**(8 * struct.calcsize(f.fmt)) - 1))))


MUTATION = st.one_of(
    set_field(),
    set_field(),  # weighted: structural edits are the interesting ones
    st.tuples(st.just("truncate"), st.integers(0, len(BASE) - 1)),
    st.tuples(st.just("byte"), st.integers(0, HEADER_END - 1), st.integers(0, 255)),
    st.tuples(st.just("byte"), st.integers(DATA_START, len(BASE) - 1), st.integers(0, 255)),  # block contents
    st.tuples(st.just("insert"), st.integers(0, HEADER_END), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, HEADER_END - 1), st.integers(1, 16)),
)


# Edits at fixed offsets first, then those that move or cut the bytes after them.
ORDER = {"set": 0, "byte": 0, "insert": 1, "delete": 1, "truncate": 2}


def mutate(data: bytearray, mutation) -> str:
    """Applies one mutation in place (an edit beyond the end of the file is
    dropped); returns its label for the statistics."""
    what = mutation[0]
    if what == "set":
        _, field, value = mutation
        if field.offset + struct.calcsize(field.fmt) <= len(data):
            struct.pack_into("<" + field.fmt, data, field.offset, value)
        return f"set {field.kind}"
    if what == "truncate":
        del data[mutation[1]:]
    elif what == "byte" and mutation[1] < len(data):
        data[mutation[1]] = mutation[2]
    elif what == "insert":
        data[mutation[1]:mutation[1]] = mutation[2]
    elif what == "delete":
        del data[mutation[1]:mutation[1] + mutation[2]]
    return what


def outcome(message: str, path: str) -> str:
    """A GGUFError message without the path and numbers: one statistics bucket per kind of refusal."""
    text = re.sub(r"'[^']*'|\b0x[0-9a-f]+\b|\d+", "_", message.replace(path, ""))
    return "rejected: " + text.strip(": ")[:60]


def exercise(path: str) -> str:
    """load_gguf, then every tensor through GGUFLinear and ggml_dequantize.
    Returns the outcome for the statistics; raises on any contract breach."""
    try:
        f = load_gguf(path)
    except GGUFError as e:
        assert path in str(e), f"GGUFError does not name the file: {e}"
        return outcome(str(e), path)
    # Views into one mapping: no two tensors of a file that loads share a byte.
    spans = sorted((t.data.data_ptr(), t.data.data_ptr() + t.nbytes, t.name) for t in f.tensors.values())
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        assert end <= start, f"the data of {first!r} and {second!r} overlap"
    for t in f.tensors.values():
        in_features = t.shape[-1]
        layer = GGUFLinear.from_raw(t.data, t.type, in_features)
        layer(torch.ones(1, in_features))
        torch.ops.lowbit.ggml_dequantize(t.data, t.type, t.data.shape[0], in_features, torch.float32)
    f.close()
    return "loaded"


@pytest.fixture(scope="module")
def case_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fuzz") / "case.gguf")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    yield path
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan keeps freed memory in quarantine (make sanitize)
        assert growth < RSS_GROWTH, f"peak RSS grew by {growth / 2**20:.0f} MiB over the fuzz run"


def test_the_layout_walk_covers_the_whole_header():
    # The walk is the fuzzer's map of the file: it must reach the end of the
    # tensor infos exactly where gguf-py says they end (then padding, then data).
    assert HEADER_END <= DATA_START < HEADER_END + 32  # 32: the toy file's alignment
    kinds = {f.kind for f in FIELDS}
    assert {"dim", "ggml type", "tensor data offset", "alignment", "array length", "n_dims"} <= kinds


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not LONG_RUN, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3))
def test_mutated_files_raise_only_gguf_error(case_path, mutations):
    data = bytearray(BASE)
    for mutation in sorted(mutations, key=lambda m: ORDER[m[0]]):
        event(mutate(data, mutation))
    with open(case_path, "wb") as out:
        out.write(data)
    faulthandler.dump_traceback_later(CASE_SECONDS * 10, exit=True)
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        event(exercise(case_path))
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        faulthandler.cancel_dump_traceback_later()
    assert elapsed < CASE_SECONDS, f"case took {elapsed:.1f} s"
    assert peak < len(data) + ALLOCATION_SLACK, f"allocated {peak} bytes for a {len(data)}-byte file"
