"""GPTQ v1 <-> v2 checkpoint conversion (lowbit.gptq.convert), the
`convert-gptq` and GPTQ `inspect` commands, and the warnings of load_gptq
and the tensor-parallel loaders for checkpoints whose format label, or a
format given against it, contradicts their stored zeros."""
import errno
import json
import os
import re
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from gptq_checkpoints import (EXTRA_CONTENT, EXTRA_FILE, LAYERS, OUTSIDE_LINKS, TinyModel, link_outside,
                              make_checkpoint, quantized_layers, raw_bytes, read_json, relabel, tensors, tree_hashes)
import lowbit.gptq.checkpoint
from lowbit.gptq.checkpoint import GPTQCheckpointError, load_gptq, save_gptq, write_checkpoint
from lowbit.gptq.config import GPTQConfig, read_config
from lowbit.gptq.convert import convert_checkpoint
from lowbit.gptq.tp import ColumnParallelGPTQLinear, RowParallelGPTQLinear, TPAwareMLP

X = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).half()


def same_outputs(model, loaded) -> bool:
    """Every quantized layer of `loaded` computes exactly what `model`'s does."""
    assert sorted(loaded.modules) == sorted(LAYERS)
    up, down = (loaded.modules[f"mlp.{n}"] for n in ("up_proj", "down_proj"))
    return torch.equal(up(X), model.mlp.up_proj(X)) and torch.equal(down(up(X)), model.mlp.down_proj(up(X)))


def check_converted(dst, fmt: str) -> None:
    """dst says `fmt` in both configs and carries the extra file unchanged."""
    assert read_json(os.path.join(dst, "config.json"))["quantization_config"]["checkpoint_format"] == fmt
    assert read_json(os.path.join(dst, "quantize_config.json"))["checkpoint_format"] == fmt
    assert read_config(dst).checkpoint_format == fmt
    with open(os.path.join(dst, EXTRA_FILE)) as f:
        assert f.read() == EXTRA_CONTENT


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act_order"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_round_trip(tmp_path, bits, sym, act_order):
    src, v2, v1 = tmp_path / "src", tmp_path / "v2", tmp_path / "v1"
    model = make_checkpoint(src, bits, 32, sym, act_order, "gptq")
    before = tree_hashes(src)

    summary = convert_checkpoint(src, v2, to="gptq_v2")
    assert summary["from"] == "gptq" and summary["to"] == "gptq_v2" and summary["modules"] == len(LAYERS)
    check_converted(v2, "gptq_v2")
    # The v2 zeros are exactly what quantizing straight to v2 stores (3-bit: fields straddling words too).
    direct = quantized_layers(bits, 32, sym, act_order, "gptq_v2")
    original, converted = tensors(src), tensors(v2)
    for name, layer in direct.items():
        assert raw_bytes(converted[f"{name}.qzeros"]) == raw_bytes(layer.qzeros)
    for name in original:  # everything but the zeros is carried over byte for byte
        if not name.endswith(".qzeros"):
            assert raw_bytes(converted[name]) == raw_bytes(original[name]), name
    assert same_outputs(model, load_gptq(v2))

    convert_checkpoint(v2, v1, to="gptq")
    check_converted(v1, "gptq")
    back = tensors(v1)
    assert back.keys() == original.keys()
    assert all(back[n].dtype == original[n].dtype and raw_bytes(back[n]) == raw_bytes(original[n]) for n in original)
    assert same_outputs(model, load_gptq(v1))
    assert tree_hashes(src) == before


@pytest.mark.parametrize("max_shard_bytes", [None, 4096], ids=["single", "sharded"])
def test_shards_kept(tmp_path, max_shard_bytes):
    model = make_checkpoint(tmp_path / "src", bits=3, sym=False, max_shard_bytes=max_shard_bytes)
    files = sorted(f for f in os.listdir(tmp_path / "src") if f.endswith(".safetensors"))
    summary = convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    out = sorted(f for f in os.listdir(tmp_path / "dst") if f.endswith(".safetensors"))
    assert summary["shards"] == len(out)
    if max_shard_bytes is None:
        assert out == files == ["model.safetensors"]
    else:
        assert len(files) > 1 and len(out) > 1 and "model.safetensors.index.json" in os.listdir(tmp_path / "dst")
    assert same_outputs(model, load_gptq(tmp_path / "dst"))


def test_dynamic_bits_per_module(tmp_path):
    """Bits come from config.for_module: a 4-bit checkpoint whose down_proj is 3-bit by a `dynamic` rule."""
    layers = quantized_layers(4, 32, False, False, "gptq")
    layers["mlp.down_proj"] = quantized_layers(3, 32, False, False, "gptq")["mlp.down_proj"]
    model = TinyModel(layers)
    save_gptq(model, tmp_path / "src", GPTQConfig(4, 32, False, False, "gptq", dynamic={r"+:.*down_proj": {"bits": 3}}))
    convert_checkpoint(tmp_path / "src", tmp_path / "v2")
    loaded = load_gptq(tmp_path / "v2")
    assert loaded.modules["mlp.down_proj"].bits == 3 and loaded.modules["mlp.up_proj"].bits == 4
    assert same_outputs(model, loaded)


def test_config_keys_kept(tmp_path):
    """Keys lowbit does not read (model config, `meta`) survive; GPTQModel's `format` key is relabelled too."""
    src = tmp_path / "src"
    make_checkpoint(src)
    content = read_json(src / "config.json")
    content["model_type"] = "tiny"
    content["quantization_config"].update(format="gptq", meta={"quantizer": ["gptqmodel:4.0"]})
    (src / "config.json").write_text(json.dumps(content))
    (src / "quantize_config.json").write_text(json.dumps(content["quantization_config"]))
    convert_checkpoint(src, tmp_path / "dst")
    out = read_json(tmp_path / "dst" / "config.json")
    expected = dict(content["quantization_config"], checkpoint_format="gptq_v2", format="gptq_v2")
    assert out == dict(content, quantization_config=expected)
    assert read_json(tmp_path / "dst" / "quantize_config.json") == expected


def test_each_config_file_keeps_its_own_keys(tmp_path):
    """config.json's quantization_config may hold keys quantize_config.json
    does not (HF's modules_in_block_to_quantize decides which Linears
    transformers quantizes) and the other way round: each file keeps its own."""
    src = tmp_path / "src"
    make_checkpoint(src)
    content = read_json(src / "config.json")
    content["quantization_config"].update(modules_in_block_to_quantize=[["self_attn.q_proj"]], use_exllama=False)
    (src / "config.json").write_text(json.dumps(content))
    quantize = dict(read_json(src / "quantize_config.json"), meta={"quantizer": ["gptqmodel:4.0"]})
    (src / "quantize_config.json").write_text(json.dumps(quantize))
    convert_checkpoint(src, tmp_path / "dst")
    out = read_json(tmp_path / "dst" / "config.json")["quantization_config"]
    assert out == dict(content["quantization_config"], checkpoint_format="gptq_v2")
    assert read_json(tmp_path / "dst" / "quantize_config.json") == dict(quantize, checkpoint_format="gptq_v2")


# --- refusals -----------------------------------------------------------------------------------


def test_v2_to_v1_refuses_zero_of_zero(tmp_path):
    # All-positive weights: every asymmetric group's minimum is clamped to 0, so its zero point is 0.
    src = tmp_path / "src"
    make_checkpoint(src, bits=4, sym=False, fmt="gptq_v2", positive=True)
    before = tree_hashes(src)
    with pytest.raises(ValueError, match=r"2 of 2 modules have zero points of 0") as e:
        convert_checkpoint(src, tmp_path / "dst", to="gptq")
    assert "mlp.down_proj" in str(e.value) and "mlp.up_proj" in str(e.value)
    assert not (tmp_path / "dst").exists() and os.listdir(tmp_path) == ["src"]
    assert tree_hashes(src) == before


def test_v1_field_of_all_ones_is_read_as_gptqmodel_writes_it(tmp_path):
    """A v1 field of 2^bits-1 (zero 2^bits) comes from no quantizer; GPTQModel writes it for a zero of 0,
    subtracting 0x11111111 from each packed v2 word. The module's words are read back by adding it (carries
    and all), which is the per-field +1 wherever no field is all ones; the other module is untouched."""
    src = tmp_path / "src"
    model = make_checkpoint(src, bits=4, sym=False)
    state = dict(model.state_dict())
    zeros = torch.ops.lowbit.gptq_unpack(state["mlp.up_proj.qzeros"], 4, 1)
    zeros[0, 0] = 15
    state["mlp.up_proj.qzeros"] = torch.ops.lowbit.gptq_pack(zeros, 4, 1)
    write_checkpoint(tmp_path / "edited", state, read_json(src / "config.json"))
    with pytest.warns(UserWarning, match=r"edited: 1 modules \(mlp.up_proj\) store v1 zero fields of all ones"):
        convert_checkpoint(tmp_path / "edited", tmp_path / "dst")
    v1, v2 = state["mlp.up_proj.qzeros"], tensors(tmp_path / "dst")["mlp.up_proj.qzeros"]
    assert torch.equal(v2.long() & 0xFFFFFFFF, (v1.long() + 0x11111111) & 0xFFFFFFFF)
    assert torch.ops.lowbit.gptq_unpack(v2, 4, 1)[0, 0] == 0
    direct = quantized_layers(4, 32, False, False, "gptq_v2")["mlp.down_proj"]
    assert raw_bytes(tensors(tmp_path / "dst")["mlp.down_proj.qzeros"]) == raw_bytes(direct.qzeros)


def test_same_format_refused(tmp_path):
    make_checkpoint(tmp_path / "src", fmt="gptq_v2")
    with pytest.raises(ValueError, match="already in 'gptq_v2' format"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst", to="gptq_v2")
    assert not (tmp_path / "dst").exists()


def test_existing_dst_refused(tmp_path):
    make_checkpoint(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="already exists"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert os.listdir(tmp_path / "dst") == ["keep.txt"]


def test_mislabelled_refused(tmp_path):
    """Converting by a wrong label would shift correct zeros off by one, so it is refused."""
    make_checkpoint(tmp_path / "src", bits=4, sym=True, fmt="gptq_v2")
    relabel(tmp_path / "src", "gptq")
    with pytest.raises(ValueError, match=r"mislabelled.*0x88888888"):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_interrupted_conversion_leaves_no_dst(tmp_path):
    """SIGKILL right after the first shard is written: dst never appears (the
    hidden temporary directory beside it may remain, as convert_checkpoint documents)."""
    make_checkpoint(tmp_path / "src", bits=3, sym=False, max_shard_bytes=4096)
    script = textwrap.dedent(f"""
        import os, signal, sys
        import lowbit.gptq.checkpoint as checkpoint
        from lowbit.gptq.convert import convert_checkpoint
        real_save = checkpoint.save_file
        def save_then_die(*args, **kwargs):
            real_save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.save_file = save_then_die
        convert_checkpoint({str(tmp_path / "src")!r}, {str(tmp_path / "dst")!r})
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == -9, result.stderr
    assert not (tmp_path / "dst").exists()
    leftovers = [n for n in os.listdir(tmp_path) if n != "src"]
    assert leftovers and all(n.startswith(".dst.") for n in leftovers)  # killed mid-write, as intended
    assert any(f.endswith(".safetensors") for f in os.listdir(tmp_path / leftovers[0]))


def test_full_disk_names_the_destination(tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "src")

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(lowbit.gptq.checkpoint, "save_file", disk_full)
    dst = tmp_path / "dst"
    with pytest.raises(GPTQCheckpointError, match=f"^{re.escape(str(dst))}: cannot write the checkpoint: .*No "
                                                  "space left on device") as e:
        convert_checkpoint(tmp_path / "src", dst)
    assert e.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["src"]  # neither dst nor its temporary directory


def tree(directory) -> set[str]:
    """Every file and directory under `directory`, by relative path."""
    out = set()
    for root, dirs, files in os.walk(directory):
        out.update(os.path.relpath(os.path.join(root, n), directory) for n in dirs + files)
    return out


@pytest.mark.parametrize("inside", ["out", "sub/out"], ids=["in-src", "in-a-subdirectory-of-src"])
def test_destination_inside_the_source(tmp_path, inside):
    """The temporary directory lies beside dst, so inside src: it is not copied into the output."""
    src = tmp_path / "src"
    model = make_checkpoint(src, bits=3, sym=False)
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("kept")
    before = tree(src)
    convert_checkpoint(src, src / inside)
    assert tree(src / inside) == {"config.json", "quantize_config.json", "model.safetensors", EXTRA_FILE, "sub",
                                  os.path.join("sub", "notes.txt")}
    assert tree(src) == before | {inside} | {os.path.join(inside, p) for p in tree(src / inside)}  # no leftovers
    assert same_outputs(model, load_gptq(src / inside))


def test_non_regular_extra_files_are_refused(tmp_path):
    """Files carried over are copied only if regular: a named pipe would block the copy forever."""
    make_checkpoint(tmp_path / "src")
    os.mkfifo(tmp_path / "src" / "merges.txt")
    with pytest.raises(GPTQCheckpointError, match=re.escape(f"{tmp_path / 'src' / 'merges.txt'}: the file is not a "
                                                            "regular file")):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize("case", OUTSIDE_LINKS)
def test_links_out_of_the_source_are_refused(tmp_path, case):
    """A source checkpoint's link to a file outside it (a user's private key, another model's config or
    weights) is refused by name: its content would be published with the output."""
    make_checkpoint(tmp_path / "src")
    refusal = link_outside(tmp_path / "src", case)
    with pytest.raises(GPTQCheckpointError, match=re.escape(refusal)):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert not os.path.lexists(tmp_path / "dst")


def test_links_within_the_source_are_copied(tmp_path):
    """A link to a file of the checkpoint itself, and a Hugging Face hub cache snapshot's links into its
    repository's blobs, are the checkpoint's own files: copied as their content."""
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abcd"
    model = make_checkpoint(snapshot)
    blobs = tmp_path / "models--org--tiny" / "blobs"
    blobs.mkdir()
    for name in os.listdir(snapshot):
        os.rename(snapshot / name, blobs / name)
        os.symlink(os.path.join("..", "..", "blobs", name), snapshot / name)
    os.symlink(EXTRA_FILE, snapshot / "tokenizer_copy.json")
    convert_checkpoint(snapshot, tmp_path / "dst")
    check_converted(tmp_path / "dst", "gptq_v2")
    assert (tmp_path / "dst" / "tokenizer_copy.json").read_text() == EXTRA_CONTENT
    assert not os.path.islink(tmp_path / "dst" / "tokenizer_copy.json")
    assert same_outputs(model, load_gptq(tmp_path / "dst"))


@pytest.mark.parametrize("target", [".", "..", "/"])
def test_links_to_a_directory_holding_them_are_refused(tmp_path, target):
    """A link to the checkpoint itself or above it would copy the tree into itself until paths overflow."""
    make_checkpoint(tmp_path / "src")
    (tmp_path / "src" / "sub").mkdir()
    link = tmp_path / "src" / "sub" / "loop"
    os.symlink(target, link)
    with pytest.raises(GPTQCheckpointError, match=re.escape(f"{link}: a link to ")):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    assert os.listdir(tmp_path) == ["src"]


def test_config_json_must_be_an_object(tmp_path):
    make_checkpoint(tmp_path / "src")
    config = tmp_path / "src" / "config.json"
    quant = json.loads(config.read_text())["quantization_config"]
    (tmp_path / "src" / "quantize_config.json").write_text(json.dumps(quant))  # the config read_config takes
    config.write_text("[1, 2]")
    with pytest.raises(GPTQCheckpointError, match=re.escape(f"{config}: the config must be a JSON object, got list")):
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")


def test_output_directory_mode_follows_the_umask(tmp_path):
    make_checkpoint(tmp_path / "src")
    old = os.umask(0o022)
    try:
        convert_checkpoint(tmp_path / "src", tmp_path / "dst")
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "dst").st_mode & 0o777 == 0o755
    assert {os.stat(tmp_path / "dst" / f).st_mode & 0o777 for f in os.listdir(tmp_path / "dst")} == {0o644}


# --- the format label check in load_gptq --------------------------------------------------------


@pytest.mark.parametrize("label, stored, word", [("gptq", "gptq_v2", "0x88888888"), ("gptq_v2", "gptq", "0x77777777")])
def test_load_warns_on_mislabelled(tmp_path, label, stored, word):
    src, dst = tmp_path / "src", tmp_path / "dst"
    model = make_checkpoint(src, bits=4, sym=True, fmt="gptq")
    if stored == "gptq_v2":
        convert_checkpoint(src, dst, to="gptq_v2")
    else:
        os.rename(src, dst)
    relabel(dst, label)
    with pytest.warns(UserWarning, match=rf"checkpoint_format='{label}' but all 2 symmetric modules store {stored} "
                                         rf".*words {word} for 4-bit"):
        loaded = load_gptq(dst)
    assert all(m.checkpoint_format == stored for m in loaded.modules.values())
    assert same_outputs(model, loaded)
    # The label the warning says to pass is read as given, without a warning.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = load_gptq(dst, checkpoint_format=label)
    assert all(m.checkpoint_format == label for m in forced.modules.values())


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("fmt, other", [("gptq", "gptq_v2"), ("gptq_v2", "gptq")])
def test_load_warns_where_a_given_format_contradicts_the_config(tmp_path, sym, fmt, other):
    """A checkpoint_format given against the config's reads every zero point
    one step off where the config is right: asymmetric modules' words cannot
    tell, symmetric ones' show it. The format is still read as given."""
    model = make_checkpoint(tmp_path / "ckpt", sym=sym, fmt=fmt)
    quantize_config = re.escape(str(tmp_path / "ckpt" / "quantize_config.json"))
    why = "2 symmetric modules store" if sym else "the words of its 2 asymmetric modules"
    with pytest.warns(UserWarning, match=rf"ckpt: checkpoint_format='{other}' overrides {quantize_config}'s "
                                         rf"'{fmt}', and {why} .* read one step off"):
        forced = load_gptq(tmp_path / "ckpt", checkpoint_format=other)
    assert all(m.checkpoint_format == other for m in forced.modules.values()) and not same_outputs(model, forced)
    with warnings.catch_warnings():  # the config's own format, given, is no contradiction
        warnings.simplefilter("error")
        assert same_outputs(model, load_gptq(tmp_path / "ckpt", checkpoint_format=fmt))


def test_load_takes_a_given_format_that_a_symmetric_checkpoints_words_show(tmp_path):
    """Given against a mislabelled config, the format the words store is read without a warning."""
    model = make_checkpoint(tmp_path / "ckpt", bits=4, sym=True, fmt="gptq")
    relabel(tmp_path / "ckpt", "gptq_v2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert same_outputs(model, load_gptq(tmp_path / "ckpt", checkpoint_format="gptq"))


# The tensor-parallel loaders, each reading one module (or an MLP's three) of a checkpoint with a gate_proj.
TP_LOADERS = {
    "column": lambda path, fmt: ColumnParallelGPTQLinear.from_checkpoint(path, "mlp.up_proj", 0, 1,
                                                                         checkpoint_format=fmt),
    "row": lambda path, fmt: RowParallelGPTQLinear.from_checkpoint(path, "mlp.down_proj", 0, 1, checkpoint_format=fmt),
    "mlp": lambda path, fmt: TPAwareMLP.from_checkpoint(path, "mlp", 0, 1, checkpoint_format=fmt),
}


def make_mlp_checkpoint(directory, sym: bool, fmt: str) -> None:
    """make_checkpoint's layers plus a gate_proj of up_proj's shape, as TPAwareMLP reads them."""
    layers = quantized_layers(4, 32, sym, False, fmt)
    layers["mlp.gate_proj"] = quantized_layers(4, 32, sym, False, fmt, seed=1)["mlp.up_proj"]
    save_gptq(TinyModel(layers), directory, GPTQConfig(4, 32, False, sym, fmt))


def warning_of(load) -> str:
    with pytest.warns(UserWarning) as caught:
        load()
    assert len(caught) == 1, [str(w.message) for w in caught]
    return str(caught[0].message)


@pytest.mark.parametrize("loader", sorted(TP_LOADERS))
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("fmt, other", [("gptq", "gptq_v2"), ("gptq_v2", "gptq")])
def test_tp_loaders_warn_where_a_given_format_contradicts_the_config(tmp_path, loader, sym, fmt, other):
    """The sharded loaders take the same checkpoint_format override and say what load_gptq says of it, naming
    both formats and the config file."""
    make_mlp_checkpoint(tmp_path / "ckpt", sym, fmt)
    said = warning_of(lambda: TP_LOADERS[loader](tmp_path / "ckpt", other))
    quantize_config = str(tmp_path / "ckpt" / "quantize_config.json")
    assert f"checkpoint_format='{other}' overrides {quantize_config}'s '{fmt}'" in said
    assert said == warning_of(lambda: load_gptq(tmp_path / "ckpt", checkpoint_format=other))


@pytest.mark.parametrize("loader", sorted(TP_LOADERS))
@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_tp_loaders_take_the_config_s_format_silently(tmp_path, loader, sym, fmt):
    """No override, or the config's own format given, is no contradiction."""
    make_mlp_checkpoint(tmp_path / "ckpt", sym, fmt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TP_LOADERS[loader](tmp_path / "ckpt", None)
        TP_LOADERS[loader](tmp_path / "ckpt", fmt)


@pytest.mark.parametrize("loader", sorted(TP_LOADERS))
def test_tp_loaders_take_a_given_format_that_a_symmetric_checkpoints_words_show(tmp_path, loader):
    """Given against a mislabelled config, the format the words store is read without a warning, as load_gptq
    reads it."""
    make_mlp_checkpoint(tmp_path / "ckpt", sym=True, fmt="gptq")
    relabel(tmp_path / "ckpt", "gptq_v2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TP_LOADERS[loader](tmp_path / "ckpt", "gptq")


# --- command line -------------------------------------------------------------------------------


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "lowbit", *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def test_cli_convert_and_inspect(tmp_path):
    make_checkpoint(tmp_path / "src", bits=3, sym=False, act_order=True)
    result = run_cli("convert-gptq", tmp_path / "src", tmp_path / "v2", "--to", "v2")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"converted {tmp_path / 'src'} (gptq) -> {tmp_path / 'v2'} (gptq_v2): 2 modules, " \
                            "11 tensors, 1 shard\n"
    check_converted(tmp_path / "v2", "gptq_v2")

    result = run_cli("inspect", tmp_path / "v2")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "  checkpoint_format = 'gptq_v2'" in lines and "  bits = 3" in lines
    rows = {line.split()[0]: line.split() for line in lines if line.startswith("mlp.")}
    # qweight + qzeros + scales + g_idx: up_proj [64 -> 96] 3-bit, 2 groups of 32.
    up_bytes = 6 * 96 * 4 + 2 * 9 * 4 + 2 * 96 * 2 + 64 * 4
    down_bytes = 9 * 64 * 4 + 3 * 6 * 4 + 3 * 64 * 2 + 96 * 4
    assert rows["mlp.up_proj"] == ["mlp.up_proj", "3", "32", "yes", "no", "gptq_v2", "96x64", str(up_bytes),
                                   f"{8 * up_bytes / (64 * 96):.2f}"]
    assert rows["mlp.down_proj"][:8] == ["mlp.down_proj", "3", "32", "yes", "no", "gptq_v2", "64x96",
                                         str(down_bytes)]
    total = up_bytes + down_bytes
    assert lines[-1] == f"total: 2 modules, 12288 weights, {total} bytes, {8 * total / 12288:.2f} bits per weight"


def test_cli_inspect_safetensors_file(tmp_path):
    make_checkpoint(tmp_path / "src", bits=4, sym=True)
    result = run_cli("inspect", tmp_path / "src" / "model.safetensors")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("mlp.")]
    assert [r[:7] for r in rows] == [["mlp.down_proj", "4", "32", "no", "yes", "gptq", "64x96"],
                                     ["mlp.up_proj", "4", "32", "no", "yes", "gptq", "96x64"]]


@pytest.mark.parametrize("args", [("inspect", "{tmp}/missing"), ("convert-gptq", "{tmp}/missing", "{tmp}/dst",
                                                                  "--to", "v2")], ids=["inspect", "convert"])
def test_cli_error_exit(tmp_path, args):
    result = run_cli(*(a.format(tmp=tmp_path) for a in args))
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and f"{tmp_path}/missing" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("empty", ["src", "dst"])
def test_cli_refuses_an_empty_path_naming_it(tmp_path, capsys, monkeypatch, empty):
    """An empty path reads as the working directory: refused naming the
    argument, not as "<cwd> already exists" or ": not a checkpoint directory"."""
    from lowbit.__main__ import main

    make_checkpoint(tmp_path / "src", bits=4)
    monkeypatch.chdir(tmp_path)
    paths = {"src": str(tmp_path / "src"), "dst": str(tmp_path / "dst"), empty: ""}
    assert main(["convert-gptq", paths["src"], paths["dst"], "--to", "v2"]) == 1
    out, err = capsys.readouterr()
    assert err == f"error: convert_checkpoint: {empty} must be a directory path, got an empty one\n" and out == ""
    assert sorted(os.listdir(tmp_path)) == ["src"]


@pytest.mark.parametrize("src", [None, 3])
def test_convert_checkpoint_names_a_src_that_is_not_a_path(tmp_path, src):
    """os.fspath's TypeError names neither the function nor the argument."""
    with pytest.raises(TypeError, match=rf"^convert_checkpoint: src must be a str or os\.PathLike, got "
                                        rf"{type(src).__name__}$"):
        convert_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
