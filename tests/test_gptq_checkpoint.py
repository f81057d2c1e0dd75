"""GPTQ checkpoints end to end: a small transformers Llama quantized with
GPTQLinear.from_linear, saved in the HF GPTQ layout, loaded back into a fresh
model with lowbit.replace_linear, and compared with the same model holding
the dequantized float weights.

Tolerance: both sides sum in fp32 over the same exactly dequantized weights,
only in a different order, so logits agree to ~1e-6 relative; the test
allows 1e-4 of the largest logit.

Then the corruption matrix: every tensor of a quantized module missing, of a
wrong dtype or shape, g_idx out of range; bad config values; unreadable
files. Each load must fail with the loader's own error type, naming the
module and tensor (or config key, or file), and leave the checkpoint as it was.

A checkpoint is untrusted input: shard indexes naming files outside it or no
files, named pipes and devices in place of its files, `dynamic` rules that
backtrack for hours and layer counts far from what its tensors hold are
refused, and promptly.
"""
import copy
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import numpy
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import lowbit
from gptq_checkpoints import make_checkpoint, tensors as checkpoint_tensors, tree_hashes
from lowbit.gptq import GPTQCheckpointError, GPTQConfig, GPTQConfigError
from lowbit.gptq.checkpoint import check_layer_count, write_checkpoint
from lowbit.gptq.config import parse_config

transformers = pytest.importorskip("transformers")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(seed=0, bias=False, hidden_size=128):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=hidden_size, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False, attention_bias=bias, mlp_bias=bias)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def quantize(model, config: GPTQConfig, act_order=False):
    """Swaps every Linear the config quantizes for GPTQLinear.from_linear, and
    returns the float model holding the same (dequantized) weights."""
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear):
            continue
        if name == "lm_head" and not config.lm_head:
            continue
        q = config.for_module(name)
        if q is None:
            continue
        perm = torch.randperm(module.in_features, generator=gen) if act_order else None
        layer = lowbit.GPTQLinear.from_linear(module, q.bits, q.group_size, q.sym, config.checkpoint_format, perm)
        model.set_submodule(name, layer)
        with torch.no_grad():
            reference.get_submodule(name).weight.copy_(layer.dequantize(torch.float32))
    return reference


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def assert_same_logits(got, expect):
    torch.testing.assert_close(got, expect, rtol=0, atol=1e-4 * expect.abs().max().item())


IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(0))
CASES = [(bits, sym, fmt) for bits in (2, 3, 4, 8) for sym in (True, False) for fmt in ("gptq", "gptq_v2")]


@pytest.mark.parametrize("bits, sym, fmt", CASES)
def test_round_trip_through_an_hf_gptq_directory(tmp_path, bits, sym, fmt):
    i = CASES.index((bits, sym, fmt))
    group_size = (32, 128, -1)[i % 3]
    act_order = i % 2 == 1
    config = GPTQConfig(bits=bits, group_size=group_size, desc_act=act_order, sym=sym, checkpoint_format=fmt)
    model = tiny_llama()
    reference = quantize(model, config, act_order)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)

    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert saved["bits"] == bits and saved["checkpoint_format"] == fmt and saved["quant_method"] == "gptq"
    fresh = tiny_llama(seed=123)
    report = lowbit.replace_linear(fresh, tmp_path / "ckpt")
    assert len(report.replaced) == 2 * len(LINEARS) and report.unplaced == []
    assert all(isinstance(fresh.get_submodule(n), lowbit.GPTQLinear) for n in report.replaced)
    assert_same_logits(logits(fresh, IDS), logits(reference, IDS))
    assert_same_logits(logits(fresh, IDS), logits(model, IDS))


def test_lm_head_quantized_sharded_and_single_file(tmp_path):
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2", lm_head=True)
    model = tiny_llama()
    reference = quantize(model, config)
    assert isinstance(model.lm_head, lowbit.GPTQLinear)
    lowbit.save_gptq(model, tmp_path / "sharded", config, max_shard_bytes=200_000)
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    fresh = tiny_llama(seed=5)
    lowbit.replace_linear(fresh, tmp_path / "sharded")
    assert isinstance(fresh.lm_head, lowbit.GPTQLinear)
    assert_same_logits(logits(fresh, IDS), logits(reference, IDS))

    lowbit.save_gptq(model, tmp_path / "single", config)
    with pytest.raises(ValueError, match="the config says lm_head false, but the model's LM head is GPTQ-quantized"):
        lowbit.save_gptq(model, tmp_path / "unsaid", dataclasses.replace(config, lm_head=False))
    fresh = tiny_llama(seed=6)
    lowbit.replace_linear(fresh, tmp_path / "single" / "model.safetensors")
    assert_same_logits(logits(fresh, IDS), logits(reference, IDS))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_tensors_on_threads_reads_every_shard_exactly(tmp_path, threads):
    """read_tensors reads the shards' tensors on up to torch's thread count:
    every tensor of every shard comes back with safetensors' own bytes, dtype
    and shape, whatever the thread count."""
    from lowbit.gptq.checkpoint import checkpoint_files, read_tensors

    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "sharded", config, max_shard_bytes=100_000)
    _, files = checkpoint_files(tmp_path / "sharded")
    assert len(files) > 3
    expect = {n: t for f in files for n, t in load_file(f).items()}
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = read_tensors(files)
    finally:
        torch.set_num_threads(saved)
    assert sorted(got) == sorted(expect)
    for name, tensor in expect.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("tied, lm_head, bias", [(False, False, True), (True, False, False), (False, True, False)])
def test_load_gptq_model_builds_the_model_from_the_directory(tmp_path, tied, lm_head, bias):
    """load_gptq_model builds the model from config.json on the meta device:
    the model replace_linear fills (the same hidden states bit for bit; the
    logits to fp32 summation order, the unquantized head being a GGUFLinear
    over the checkpoint's table), a tied LM head over the embedding's own
    bytes, and nothing left on meta."""
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2", lm_head=lm_head)
    model = tiny_llama(bias=bias)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)

    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    assert type(built) is transformers.LlamaForCausalLM and not built.training
    assert isinstance(built.lm_head, lowbit.GPTQLinear if lm_head else lowbit.GGUFLinear)
    assert isinstance(built.model.embed_tokens, lowbit.GGUFEmbedding)
    if tied:
        assert built.lm_head.qweight is built.model.embed_tokens.qweight
    assert not [n for n, t in [*built.named_parameters(), *built.named_buffers()] if t.is_meta]
    assert {p.dtype for p in built.parameters()} == {torch.float32}
    fresh = tiny_llama(seed=7, bias=bias)
    if tied:
        fresh.config.tie_word_embeddings = True
        fresh.lm_head.weight = fresh.model.embed_tokens.weight
    lowbit.replace_linear(fresh, tmp_path / "ckpt")
    with torch.no_grad():
        hidden = [m.model(IDS).last_hidden_state for m in (built, fresh)]
    torch.testing.assert_close(hidden[0], hidden[1], rtol=0, atol=0)
    torch.testing.assert_close(logits(built, IDS), logits(fresh, IDS), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(built.model.rotary_emb.inv_freq, fresh.model.rotary_emb.inv_freq, rtol=0, atol=0)


def tied_llama(tied, seed=0):
    """tiny_llama, its LM head tied to its embedding where `tied`."""
    model = tiny_llama(seed=seed)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def tables_checkpoint(path, tied, dtype):
    """A 4-bit checkpoint of tied_llama whose token embedding and LM head are `dtype`."""
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tied_llama(tied)
    quantize(model, config)
    model.model.embed_tokens.to(dtype)
    model.lm_head.to(dtype)
    lowbit.save_gptq(model, path, config)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype, qtype", [(torch.float16, 1), (torch.bfloat16, 30)])
def test_load_gptq_model_keeps_the_float_tables_as_stored(tmp_path, tied, dtype, qtype):
    """A checkpoint's 2-byte token embedding and unquantized LM head stay its
    bytes (GGUF F16 / BF16 tables, one table for a tied head): no float32
    copy anywhere in the model, and the logits of the same checkpoint loaded
    into float32 parameters, to fp32 summation order."""
    tables_checkpoint(tmp_path / "ckpt", tied, dtype)

    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    embedding, head = built.model.embed_tokens, built.lm_head
    assert (embedding.qtype, head.qtype) == (qtype, qtype)
    assert embedding.qweight.nbytes == 512 * 128 * 2
    assert (head.qweight.untyped_storage().data_ptr() == embedding.qweight.untyped_storage().data_ptr()) == tied
    table = 512 * 128
    assert not [n for n, t in [*built.named_parameters(), *built.named_buffers()] if t.numel() >= table
                and t.dtype.is_floating_point]
    fresh = tied_llama(tied, seed=7)
    lowbit.replace_linear(fresh, tmp_path / "ckpt")
    torch.testing.assert_close(logits(built, IDS), logits(fresh, IDS), rtol=1e-5, atol=1e-6)
    # An untied embedding is only looked up in: it stays in the file, read row
    # by row as tokens need it; a tied one is the head's weight, read whole.
    checkpoint = str(tmp_path / "ckpt" / "model.safetensors")
    assert (mapped_file(embedding.qweight) == checkpoint) == (not tied)
    assert mapped_file(head.qweight) is None
    # Its storage holds its own bytes: torch.save and deepcopy copy those, not the whole file.
    assert embedding.qweight.untyped_storage().nbytes() == embedding.qweight.nbytes


def mapped_file(t: torch.Tensor) -> str | None:
    """The file whose mapping holds t's bytes (/proc/self/maps), if any."""
    start, end = t.data_ptr(), t.data_ptr() + t.nbytes
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            if lo <= start and end <= hi:
                return fields[5] if len(fields) > 5 and fields[5].startswith("/") else None
    return None


def test_mapped_embedding_writes_stay_in_memory(tmp_path):
    """The file-mapped embedding of an untied checkpoint is copy-on-write: a
    write to it changes the model, never the checkpoint."""
    tables_checkpoint(tmp_path / "ckpt", False, torch.float16)
    before = (tmp_path / "ckpt" / "model.safetensors").read_bytes()
    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    embedding = built.model.embed_tokens
    assert mapped_file(embedding.qweight) == str((tmp_path / "ckpt" / "model.safetensors").resolve())
    embedding.qweight.fill_(0)
    with torch.no_grad():
        assert not built.model.embed_tokens(IDS).any()
    assert (tmp_path / "ckpt" / "model.safetensors").read_bytes() == before


def test_save_gptq_refuses_what_a_gptq_checkpoint_cannot_hold(tmp_path):
    """GGUF blocks (Q8_0 tables here) would be written as GPTQ tensors no
    loader reads; a model with nothing GPTQ-quantized is no GPTQ checkpoint."""
    tables_checkpoint(tmp_path / "ckpt", False, torch.float16)
    with pytest.raises(ValueError, match=r"save_gptq: model.embed_tokens, lm_head hold GGUF quantized blocks"):
        lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt", float_tables="Q8_0"), tmp_path / "out",
                         GPTQConfig(bits=4, group_size=32))
    with pytest.raises(ValueError, match="save_gptq: the model has no GPTQLinear layer"):
        lowbit.save_gptq(tied_llama(False), tmp_path / "out", GPTQConfig(bits=4, group_size=32))
    with pytest.raises(TypeError, match="save_gptq: config must be a GPTQConfig, got NoneType"):
        lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), tmp_path / "out", None)
    # An empty path is the working directory to os.path, which "already exists".
    with pytest.raises(ValueError, match="^save_gptq: directory must be a directory path, got an empty one$"):
        lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), "", GPTQConfig(bits=4, group_size=32, sym=False))
    for bad in (None, 3, ["out"]):
        with pytest.raises(TypeError, match=f"^save_gptq: directory must be a str or os.PathLike, got {type(bad).__name__}$"):
            lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), bad, GPTQConfig(bits=4, group_size=32, sym=False))
    for bad in (None, lowbit.load_gptq_model(tmp_path / "ckpt").state_dict()):
        with pytest.raises(TypeError, match=f"^save_gptq: model must be an nn.Module, got {type(bad).__name__}$"):
            lowbit.save_gptq(bad, tmp_path / "out", GPTQConfig(bits=4, group_size=32, sym=False))
    # 1 byte (True), 0 or less: a shard per tensor; NaN: one shard; a str: a bare TypeError from the comparison.
    for bad in (True, 0, -1, 2.0**20, float("nan"), "1GB"):
        with pytest.raises(ValueError, match=f"^save_gptq: max_shard_bytes must be a positive int or None, got "
                                             f"{re.escape(repr(bad))}$"):
            lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), tmp_path / "out",
                             GPTQConfig(bits=4, group_size=32, sym=False), max_shard_bytes=bad)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="^save_gptq: .*taken already exists$"):
        lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), tmp_path / "taken",
                         GPTQConfig(bits=4, group_size=32, sym=False))
    assert not (tmp_path / "out").exists()
    lowbit.save_gptq(lowbit.load_gptq_model(tmp_path / "ckpt"), tmp_path / "out",
                     GPTQConfig(bits=4, group_size=32, sym=False))


def test_loaders_refuse_a_bad_checkpoint_format_or_mapped_naming_themselves(tmp_path):
    """A format that is not "gptq" / "gptq_v2" was refused by the first
    module's GPTQLinear, as an error of the checkpoint's; a str `mapped`
    matched tensor names as substrings, and None failed as an unreadable file."""
    tables_checkpoint(tmp_path / "ckpt", False, torch.float16)
    model = lowbit.load_gptq_model(tmp_path / "ckpt")
    for bad in (True, "v2", ""):
        pattern = rf"checkpoint_format must be one of \('gptq', 'gptq_v2'\), got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match="^load_gptq: " + pattern):
            lowbit.load_gptq(tmp_path / "ckpt", bad)
        with pytest.raises(ValueError, match="^load_gptq_model: " + pattern):
            lowbit.load_gptq_model(tmp_path / "ckpt", checkpoint_format=bad)
        with pytest.raises(ValueError, match="^replace_linear: " + pattern):
            lowbit.replace_linear(model, tmp_path / "ckpt", bad)
    for bad in (None, "model.embed_tokens.weight", {"model.embed_tokens.weight": 1}, {1}, [1]):
        with pytest.raises(TypeError, match="^load_gptq: mapped must be a set of tensor names, got "):
            lowbit.load_gptq(tmp_path / "ckpt", mapped=bad)
    assert lowbit.load_gptq(tmp_path / "ckpt", "gptq_v2", {"model.embed_tokens.weight"}).modules
    assert lowbit.load_gptq(tmp_path / "ckpt", "gptq_v2", ["model.embed_tokens.weight"]).modules


@pytest.mark.parametrize("changes, says", [
    ({"bits": 8}, r"bits 8 \(the layer's: 4\)"), ({"group_size": 64}, r"group_size 64 \(the layer's: 32\)"),
    ({"sym": True}, r"sym true \(the layer is asymmetric\)"),
    ({"desc_act": False}, r"desc_act false \(the layer is act-order\)"),
    ({"dynamic": {r"-:.*\.up_proj": {}}}, r"dynamic rules exclude model\.layers\.0\.mlp\.up_proj"),
    ({"lm_head": True}, "the config says lm_head true, but the model's LM head is not GPTQ-quantized")],
    ids=lambda c: str(c)[:30])
def test_save_gptq_refuses_a_config_that_misdescribes_the_layers(tmp_path, changes, says):
    """A config that contradicts the layers' bits or group_size, or excludes one, writes a checkpoint no
    reader loads; one that says sym of asymmetric layers, or desc_act false of act-order ones, one that
    other readers (vLLM) read wrongly without a word: refused before anything is written."""
    config = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False)
    model = tiny_llama()
    quantize(model, config, act_order=True)
    with pytest.raises(ValueError, match=rf"^save_gptq: .*{says}"):
        lowbit.save_gptq(model, tmp_path / "out", dataclasses.replace(config, **changes))
    assert not (tmp_path / "out").exists()
    # Saying less than the layers hold is no error: asymmetric and act-order readers read their zeros and g_idx.
    plain = tiny_llama()
    quantize(plain, dataclasses.replace(config, sym=True, desc_act=False))
    lowbit.save_gptq(plain, tmp_path / "out", config)


@pytest.mark.parametrize("changes, says", [
    ({"bits": 5}, r"bits must be one of \(2, 3, 4, 8\), got 5"), ({"bits": "4"}, "bits must be one of"),
    ({"bits": True}, "bits must be one of"), ({"group_size": 0}, "group_size must be -1 or a positive integer"),
    ({"group_size": 32.0}, "group_size must be -1 or a positive integer"),
    ({"sym": "False"}, "sym must be true or false, got 'False'"), ({"desc_act": 1}, "desc_act must be true or false"),
    ({"lm_head": None}, "lm_head must be true or false"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
    ({"dynamic": [".*"]}, "dynamic must be a dict of rules"), ({"dynamic": {3: {}}}, "dynamic rule 3 must be a str"),
    ({"dynamic": {".*": 8}}, r"dynamic rule '\.\*' must map to a dict"),
    ({"dynamic": {"+:(": {}}}, r"dynamic rule '\+:\(' is not a valid regex"),
    ({"dynamic": {".*q_proj": {"bits": 6}}}, r"dynamic rule '\.\*q_proj': bits must be one of")],
    ids=lambda c: str(c)[:30])
def test_gptq_config_refuses_what_no_reader_takes_as_it_is_made(changes, says):
    """A GPTQConfig made in code is checked as the reader checks a file's
    (bits, group_size, flags, format, dynamic rules), where it is made, not
    first at save_gptq, naming its file where it has one; numpy's integers
    and bools become Python's, as JSON writes them."""
    with pytest.raises(GPTQConfigError, match=rf"^GPTQConfig: {says}"):
        GPTQConfig(**(dict(bits=4, group_size=32) | changes))
    with pytest.raises(GPTQConfigError, match=rf"^q\.json: {says}"):
        GPTQConfig(**(dict(bits=4, group_size=32, source="q.json") | changes))
    with pytest.raises(GPTQConfigError, match="^GPTQConfig: source must be a str, got 7$"):
        GPTQConfig(bits=4, group_size=32, source=7)
    made = GPTQConfig(bits=numpy.int64(4), group_size=numpy.int32(-1), sym=numpy.bool_(False))
    assert json.loads(json.dumps(made.to_dict())) == GPTQConfig(4, -1, sym=False).to_dict()
    assert type(made.bits) is int and type(made.group_size) is int and type(made.sym) is bool


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_load_gptq_model_holds_the_float_tables_as_q8_0(tmp_path, tied, dtype):
    """float_tables="Q8_0": the token embedding and the unquantized LM head
    are ggml_quantize's Q8_0 blocks of the checkpoint's tables (one table for
    a tied head); the hidden states are those of the model whose embedding is
    those blocks decoded, bit for bit, and the logits that model's final
    hidden states through the Q8_0 matmul."""
    tables_checkpoint(tmp_path / "ckpt", tied, dtype)
    tables = load_file(tmp_path / "ckpt" / "model.safetensors")

    built = lowbit.load_gptq_model(tmp_path / "ckpt", float_tables="Q8_0")
    embedding, head = built.model.embed_tokens, built.lm_head
    assert (embedding.qtype, head.qtype) == (8, 8)
    expect = {name: lowbit.ops.ggml_quantize(tables[name], 8)
              for name in ("model.embed_tokens.weight", "lm_head.weight") if name in tables}
    assert torch.equal(embedding.qweight, expect["model.embed_tokens.weight"])
    assert torch.equal(head.qweight, expect["model.embed_tokens.weight" if tied else "lm_head.weight"])
    assert (head.qweight.untyped_storage().data_ptr() == embedding.qweight.untyped_storage().data_ptr()) == tied

    fresh = tied_llama(tied, seed=7)
    lowbit.replace_linear(fresh, tmp_path / "ckpt")
    decoded = lowbit.ops.ggml_dequantize(embedding.qweight, 8, *fresh.model.embed_tokens.weight.shape, torch.float32)
    with torch.no_grad():
        fresh.model.embed_tokens.weight.copy_(decoded)
        hidden = [m.model(IDS).last_hidden_state for m in (built, fresh)]
        torch.testing.assert_close(hidden[0], hidden[1], rtol=0, atol=0)
        want = lowbit.ops.ggml_mul_mat_a8(head.qweight, hidden[1].reshape(-1, hidden[1].shape[-1]), 8,
                                          head.qweight.shape[0])
        torch.testing.assert_close(built(IDS).logits.reshape(want.shape), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tied", [False, True])
def test_load_gptq_model_holds_the_float_tables_as_q6_k(tmp_path, tied):
    """float_tables="Q6_K" (rows of whole 256-value blocks): ggml_quantize's
    Q6_K blocks of each table, one for a tied pair, and the logits the Q6_K
    head gives the final hidden states; 128-value rows are refused, naming
    the table."""
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama(hidden_size=256)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    tables = load_file(tmp_path / "ckpt" / "model.safetensors")
    built = lowbit.load_gptq_model(tmp_path / "ckpt", float_tables="Q6_K")
    embedding, head = built.model.embed_tokens, built.lm_head
    assert (embedding.qtype, head.qtype) == (14, 14)
    assert torch.equal(embedding.qweight, lowbit.ops.ggml_quantize(tables["model.embed_tokens.weight"], 14))
    assert torch.equal(head.qweight, lowbit.ops.ggml_quantize(tables["model.embed_tokens.weight" if tied
                                                                     else "lm_head.weight"], 14))
    assert (head.qweight.untyped_storage().data_ptr() == embedding.qweight.untyped_storage().data_ptr()) == tied
    with torch.no_grad():
        hidden = built.model(IDS).last_hidden_state.reshape(-1, 256)
        want = lowbit.ops.ggml_mul_mat_a8(head.qweight, hidden, 14, head.qweight.shape[0])
        torch.testing.assert_close(built(IDS).logits.reshape(want.shape), want, rtol=1e-6, atol=1e-6)
    narrow = tiny_llama()
    quantize(narrow, config)
    lowbit.save_gptq(narrow, tmp_path / "narrow", config)
    with pytest.raises(GPTQCheckpointError, match=r"narrow: float_tables: tensor 'model.embed_tokens.weight': "
                                                  r"ggml_quantize: x's rows \(n=128\) are not a multiple of the "
                                                  r"Q6_K block size 256"):
        lowbit.load_gptq_model(tmp_path / "narrow", float_tables="Q6_K")


def test_load_gptq_model_refuses_an_unknown_table_type_and_a_table_without_a_q8_0_form(tmp_path):
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    with torch.no_grad():
        model.model.embed_tokens.weight[3, 5] = float("nan")
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    for tables in ("Q4_0", "q8_0", True, ["Q8_0"]):  # a list is unhashable: a bare TypeError in a dict lookup
        with pytest.raises(ValueError, match=r"^load_gptq_model: float_tables must be one of \['Q6_K', 'Q8_0'\] or "
                                             rf"None, got {re.escape(repr(tables))}$"):
            lowbit.load_gptq_model(tmp_path / "ckpt", float_tables=tables)
    with pytest.raises(GPTQCheckpointError, match=r"ckpt: float_tables: tensor 'model.embed_tokens.weight': "
                                                  r"ggml_quantize: x holds a non-finite value \(nan\) at \[3, 5\]"):
        lowbit.load_gptq_model(tmp_path / "ckpt", float_tables="Q8_0")
    lowbit.load_gptq_model(tmp_path / "ckpt")  # the checkpoint's bytes as they are


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings from /proc")
def test_load_gptq_reads_the_checkpoint_into_memory_of_its_own(tmp_path):
    """Loaded tensors are read into fresh, aligned memory, and no mapping of
    the file outlives the load: views of a mapping run the kernels slower,
    and copies out of one that other tensors keep alive hold the weights twice."""
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    ckpt = lowbit.load_gptq(tmp_path / "ckpt")
    file = os.path.realpath(tmp_path / "ckpt" / "model.safetensors")
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if line.rstrip().endswith(file)]
    assert not mapped, mapped
    for name, layer in ckpt.modules.items():
        for key in ("qweight", "qzeros", "scales"):
            assert getattr(layer, key).data_ptr() % 64 == 0, f"{name}.{key}"
    assert all(t.data_ptr() % 64 == 0 for t in ckpt.tensors.values())
    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    fresh = tiny_llama(seed=7)
    lowbit.replace_linear(fresh, tmp_path / "ckpt")
    torch.testing.assert_close(logits(built, IDS), logits(fresh, IDS), rtol=1e-5, atol=1e-6)


def test_load_gptq_model_in_half_precision(tmp_path):
    config = GPTQConfig(bits=8, group_size=128, sym=True, checkpoint_format="gptq")
    model = tiny_llama()
    reference = quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    built = lowbit.load_gptq_model(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert {p.dtype for p in built.parameters()} == {torch.bfloat16}
    got, expect = logits(built, IDS).float(), logits(reference, IDS)
    assert ((got - expect).norm() / expect.norm()).item() < 0.02  # bf16 activations and norms
    # A dtype's name, as transformers' configs write it, is that dtype; anything else is refused by name.
    assert torch.equal(logits(lowbit.load_gptq_model(tmp_path / "ckpt", dtype="bfloat16"), IDS), logits(built, IDS))
    for dtype in ("auto", torch.int32, torch.float64):
        with pytest.raises(ValueError, match=r"load_gptq_model: dtype must be torch.float32, torch.float16 or "
                                             rf"torch.bfloat16 \(or its name\), got {re.escape(repr(dtype))}"):
            lowbit.load_gptq_model(tmp_path / "ckpt", dtype=dtype)


def test_zero_biases_of_bias_free_layers_are_dropped(tmp_path):
    """AutoGPTQ and GPTQ-for-LLaMa build every quantized layer with a bias,
    so their Llama checkpoints carry all-zero ones the model has no place
    for: dropped (as vLLM does), the same model as without them; a bias
    that is not zero is still refused."""
    config = GPTQConfig(bits=4, group_size=32, sym=True, checkpoint_format="gptq")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "plain", config)
    shutil.copytree(tmp_path / "plain", tmp_path / "zero-biases")
    file = tmp_path / "zero-biases" / "model.safetensors"
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(".qweight")]:
        tensors[name.replace(".qweight", ".bias")] = torch.zeros(tensors[name.replace(".qweight", ".scales")].shape[1],
                                                                 dtype=torch.float16)
    save_file(tensors, file, metadata={"format": "pt"})
    built = lowbit.load_gptq_model(tmp_path / "zero-biases")
    assert built.model.layers[0].mlp.down_proj.bias is None
    torch.testing.assert_close(logits(built, IDS), logits(lowbit.load_gptq_model(tmp_path / "plain"), IDS), rtol=0, atol=0)
    fresh = tiny_llama(seed=3)
    lowbit.replace_linear(fresh, tmp_path / "zero-biases")
    torch.testing.assert_close(logits(fresh, IDS), logits(built, IDS), rtol=1e-5, atol=1e-6)
    tensors["model.layers.0.mlp.down_proj.bias"][3] = 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(GPTQCheckpointError, match=r"module 'model.layers.0.mlp.down_proj': the checkpoint has a bias, "
                                                  r"the model has none"):
        lowbit.load_gptq_model(tmp_path / "zero-biases")

@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_load_gptq_model_of_a_scaled_embedding(tmp_path, arch, tied):
    """Gemma's embedding scales its rows by sqrt(hidden_size), a buffer no checkpoint stores: the model loads and
    gives the source model's logits (the tied head must not take the table and leave the scale empty)."""
    from tiny_models import tiny_model

    model = tiny_model(arch, 0, tie_word_embeddings=tied)
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            model.set_submodule(name, lowbit.GPTQLinear.from_linear(module, 4, 32, sym=False,
                                                                    checkpoint_format="gptq_v2"))
    lowbit.save_gptq(model, tmp_path / "ckpt", GPTQConfig(bits=4, group_size=32, sym=False,
                                                          checkpoint_format="gptq_v2"))
    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    assert isinstance(built.get_input_embeddings(), lowbit.GGUFEmbedding)
    ids = IDS % model.config.vocab_size
    torch.testing.assert_close(logits(built, ids), logits(model, ids), rtol=1e-5, atol=1e-5)


def starcoder(n_positions=64):
    """A tiny GPTBigCode (StarCoder) model: its base model owns a computed buffer (the causal mask) beside its
    loaded weights."""
    config = transformers.GPTBigCodeConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, n_positions=n_positions,
                                           n_inner=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPTBigCodeForCausalLM(config).eval()


def test_load_gptq_model_keeps_the_weights_of_a_module_with_a_computed_buffer(tmp_path):
    """The mask is built from the config; the loaded weights around it stay (rebuilding the module whole from
    its config would give random weights and no GPTQ layers)."""
    config = GPTQConfig(bits=4, group_size=32, checkpoint_format="gptq")
    model = starcoder()
    reference = quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    built = lowbit.load_gptq_model(tmp_path / "ckpt")
    assert sum(isinstance(m, lowbit.GPTQLinear) for m in built.modules()) == 8
    assert torch.equal(built.transformer.bias, reference.transformer.bias)
    assert_same_logits(logits(built, IDS % 64), logits(reference, IDS % 64))


def test_load_gptq_model_refuses_computed_buffers_past_the_limit(tmp_path):
    """n_positions is the config's to say, but its mask takes n_positions^2 bytes: refused before it is built."""
    config = GPTQConfig(bits=4, group_size=32, checkpoint_format="gptq")
    model = starcoder()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    positions = 33_000  # a 1.01 GiB mask
    edit_tensors(tmp_path / "ckpt", lambda t: t.update({"transformer.wpe.weight": torch.zeros(positions, 64)}))
    raw = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    raw["n_positions"] = positions
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(GPTQCheckpointError, match="1039 MiB of computed buffers .* more than the 1024 MiB"):
        lowbit.load_gptq_model(tmp_path / "ckpt")


def test_load_gptq_model_names_a_computed_buffer_it_cannot_build(tmp_path):
    """GPT-Neo's attention needs more than its config to be built: its mask stays unfilled, which is a
    GPTQCheckpointError naming the tensors, not a TypeError."""
    config = transformers.GPTNeoConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4,
                                       attention_types=[[["global", "local"], 1]], max_position_embeddings=64,
                                       bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPTNeoForCausalLM(config).eval()
    gptq = GPTQConfig(bits=4, group_size=32, checkpoint_format="gptq")
    quantize(model, gptq)
    lowbit.save_gptq(model, tmp_path / "ckpt", gptq)
    with pytest.raises(GPTQCheckpointError, match=re.escape("no value for ['transformer.h.0.attn.attention.bias'")):
        lowbit.load_gptq_model(tmp_path / "ckpt")


def test_load_gptq_model_names_what_is_wrong(tmp_path):
    with pytest.raises(GPTQCheckpointError, match="nowhere: no such file or directory"):
        lowbit.load_gptq_model(tmp_path / "nowhere")
    config = GPTQConfig(bits=4, group_size=32, checkpoint_format="gptq")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    files = [f for f in os.listdir(tmp_path / "ckpt") if f.endswith(".safetensors")]
    tensors = load_file(tmp_path / "ckpt" / files[0])
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "ckpt" / files[0], metadata={"format": "pt"})
    with pytest.raises(GPTQCheckpointError, match=r"has no tensor for model parameters \['model.norm.weight'\]"):
        lowbit.load_gptq_model(tmp_path / "ckpt")


def saved_tiny_llama(tmp_path):
    """The directory of a 4-bit g32 GPTQ (v1) checkpoint of tiny_llama() that lowbit saved."""
    config = GPTQConfig(bits=4, group_size=32, checkpoint_format="gptq")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    return tmp_path / "ckpt"


def test_model_loaders_warn_of_a_format_given_against_the_config(tmp_path):
    """load_gptq_model and replace_linear read a checkpoint_format as given, warning as load_gptq does where the
    words show the config's (a symmetric checkpoint: every zero point read one step off)."""
    directory = saved_tiny_llama(tmp_path)
    says = r"checkpoint_format='gptq_v2' overrides .*quantize_config.json's 'gptq', and \d+ symmetric modules store gptq"
    with pytest.warns(UserWarning, match=says):
        lowbit.load_gptq_model(directory, checkpoint_format="gptq_v2")
    with pytest.warns(UserWarning, match=says):
        lowbit.replace_linear(tiny_llama(), directory, checkpoint_format="gptq_v2")


def edit_saved_tensors(directory, edit):
    file = directory / next(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_saved_config(directory, changes):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_a_non_finite_float_tensor_is_a_checkpoint_error_naming_it(tmp_path):
    """A corrupt norm would turn every output after it NaN: refused at load."""
    directory = saved_tiny_llama(tmp_path)
    edit_saved_tensors(directory, lambda t: t["model.layers.1.input_layernorm.weight"].index_fill_(0, torch.tensor([7]),
                                                                                                  float("inf")))
    with pytest.raises(GPTQCheckpointError, match=r"ckpt: tensor 'model.layers.1.input_layernorm.weight' holds a "
                                                  r"non-finite value \(inf\) at \[7\]"):
        lowbit.load_gptq_model(directory)


def test_a_float_tensor_past_the_model_dtype_is_a_checkpoint_error_naming_it(tmp_path):
    """A finite float32 norm weight past float16's range would be inf in a float16 model: refused at load,
    as the model holds it; the same checkpoint loads as float32."""
    directory = saved_tiny_llama(tmp_path)

    def past_half(tensors):
        name = "model.layers.1.input_layernorm.weight"
        tensors[name] = tensors[name].float().index_fill_(0, torch.tensor([7]), 1e6)
    edit_saved_tensors(directory, past_half)
    with pytest.raises(GPTQCheckpointError, match=r"ckpt: tensor 'model.layers.1.input_layernorm.weight', held as "
                                                  r"the model's torch.float16, holds a non-finite value \(inf\) "
                                                  r"at \[7\]"):
        lowbit.load_gptq_model(directory, dtype=torch.float16)
    assert lowbit.load_gptq_model(directory).model.layers[1].input_layernorm.weight[7] == 1e6


def test_a_float64_token_embedding_is_checked_as_it_is_cast(tmp_path):
    """An untied embedding stays in the file, unread, where it is kept in its own float type; a float64 one is
    cast to the model's dtype, read whole: a NaN in it is refused as in any other tensor."""
    directory = saved_tiny_llama(tmp_path)

    def float64_nan(tensors):
        name = "model.embed_tokens.weight"
        tensors[name] = tensors[name].double().index_put_((torch.tensor(5), torch.tensor(3)),
                                                         torch.tensor(float("nan"), dtype=torch.float64))
    edit_saved_tensors(directory, float64_nan)
    with pytest.raises(GPTQCheckpointError, match=r"ckpt: tensor 'model.embed_tokens.weight' holds a non-finite "
                                                  r"value \(nan\) at \[5, 3\]"):
        lowbit.load_gptq_model(directory)


def test_an_integer_tensor_for_a_float_parameter_is_a_checkpoint_error(tmp_path):
    """An int32 norm would load as floats of its integers, silently: refused."""
    directory = saved_tiny_llama(tmp_path)
    edit_saved_tensors(directory, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(torch.int32)}))
    with pytest.raises(GPTQCheckpointError, match=r"ckpt: tensor 'model.norm.weight' is torch.int32, where the "
                                                  r"model's is torch.float32"):
        lowbit.load_gptq_model(directory)


@pytest.mark.parametrize("changes, says", [
    ({"rms_norm_eps": -1.0}, "rms_norm_eps must be a finite number > 0, got -1.0"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, r"\.rope_theta must be a finite number > 0, got 0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, r"\.factor must be a finite number > 0, got 0.0"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2.0}}, r"\.factor must be a finite number > 0, got -2.0"),
    # Past the bounds the GGUF loader holds its files to (lowbit._checks).
    ({"rms_norm_eps": 1e30}, r"rms_norm_eps must be at most 1.0, got 1e\+30"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e30}},
     r"\.rope_theta must be at most 1000000000000.0, got 1e\+30"),
    ({"max_position_embeddings": 2**63}, r"max_position_embeddings must be at most 2147483647, got 922337\d+$"),
    ({"max_position_embeddings": -5}, r"max_position_embeddings must be a finite number > 0, got -5"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2**40}},
     r"\.original_max_position_embeddings must be at most 2147483647"),
    ({"sliding_window": 1}, "sliding_window 1 is not supported"),
    ({"sliding_window": 0}, "sliding_window 0 is not supported: a window is a whole number of tokens from 2"),
    ({"sliding_window": 2**40}, "sliding_window 1099511627776 is not supported"),
    # Rotary factors transformers only warns of: below 1, past MAX_SCALE, factors of another length.
    ({"rope_parameters": {"rope_type": "linear", "factor": 1e-30, "rope_theta": 1e4}},
     r"\.factor must be at least 1.0, got 1e-30"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 1e300, "rope_theta": 1e4}},
     r"\.factor must be at most 10000.0, got 1e\+300"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1e300, "rope_theta": 1e4}},
     r"\.attention_factor must be at most 10000.0"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": float("nan"), "rope_theta": 1e4}},
     r"\.mscale must be a finite number >= 0, got nan"),
    ({"rope_parameters": {"rope_type": "longrope", "long_factor": [1.0], "short_factor": [1.0] * 16,
                          "original_max_position_embeddings": 16, "rope_theta": 1e4}},
     r"\.long_factor must be a list of one factor per rotated frequency \(16\), got \[1.0\]"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 5.0, "rope_theta": 1e4}},
     r"\.partial_rotary_factor must be at most 1.0, got 5.0"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1e-30, "rope_theta": 1e4}},
     r"\.partial_rotary_factor 1e-30 of a head of 32 dimensions rotates no frequency"),
    # Multipliers and softcaps: NaN, 0, or past MAX_SCALE either way.
    ({"logits_scaling": 1e-30}, r"logits_scaling must be at least 0.0001, got 1e-30"),
    ({"embedding_multiplier": float("nan")}, "embedding_multiplier must be a finite number > 0, got nan"),
    ({"residual_multiplier": 1e30}, r"residual_multiplier must be at most 10000.0, got 1e\+30"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be a finite number > 0, got 0.0"),
    ({"query_pre_attn_scalar": -32}, "query_pre_attn_scalar must be a finite number > 0, got -32"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a finite number > 0, got 0"),
    ({"num_local_experts": 4, "num_experts_per_tok": 5},
     r"num_experts_per_tok must be a whole number from 1 to num_local_experts \(4\), got 5"),
    ({"num_experts": 4, "num_experts_per_tok": 0},
     r"num_experts_per_tok must be a whole number from 1 to num_experts \(4\), got 0"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 does not divide num_attention_heads 4"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a whole number from 1 to 2147483647, got 0"),
    # transformers' config classes divide by the head count (ZeroDivisionError), or build tensors of negative size.
    ({"num_attention_heads": 0}, "num_attention_heads must be a whole number from 1 to 2147483647, got 0"),
    ({"num_attention_heads": -4}, "num_attention_heads must be a whole number from 1 to 2147483647, got -4"),
    ({"hidden_size": 0}, "hidden_size must be a whole number from 1 to 2147483647, got 0"),
    ({"head_dim": 2.5}, "head_dim must be a whole number from 1 to 2147483647, got 2.5"),
    # transformers only warns of a rotary type it does not have, then fails building the model (KeyError: 'bogus').
    ({"rope_parameters": {"rope_type": "bogus", "rope_theta": 1e4}},
     r"\.rope_type 'bogus' is not a rotary embedding transformers has \(default, linear, .*\)$"),
    ({"rope_scaling": {"type": "bogus", "factor": 2.0}}, r"\.rope_type 'bogus' is not a rotary embedding"),
])
def test_config_values_that_would_give_wrong_logits_are_refused(tmp_path, changes, says):
    """transformers takes these (a rope factor of 0 only warns); the model would
    give NaN or wrong logits. Refused, naming config.json and the key."""
    directory = saved_tiny_llama(tmp_path)
    edit_saved_config(directory, changes)
    with pytest.raises(GPTQCheckpointError, match=rf"config.json: (rope_parameters|rope_scaling)?.*{says}"):
        lowbit.load_gptq_model(directory)


@pytest.mark.parametrize("changes, says", [
    # A size whose byte count overflows: the model cannot even be built on the meta device.
    ({"intermediate_size": 2**62}, "Storage size calculation overflowed"),
    # Sizes transformers' config validation refuses (its own error type, not a ValueError).
    ({"hidden_size": 130}, "not a multiple of the number of attention heads"),
])
def test_a_config_json_that_makes_no_model_is_a_checkpoint_error(tmp_path, changes, says):
    directory = saved_tiny_llama(tmp_path)
    edit_saved_config(directory, changes)
    with pytest.raises(GPTQCheckpointError, match=rf"config.json: the config does not make a model: .*{says}"):
        lowbit.load_gptq_model(directory)


def test_a_config_json_value_transformers_quotes_is_cut(tmp_path):
    """transformers' validators quote a refused value whole: the error cuts their message."""
    directory = saved_tiny_llama(tmp_path)
    edit_saved_config(directory, {"intermediate_size": "z" * 10**5})
    with pytest.raises(GPTQCheckpointError, match=r"config.json: the config does not make a model: .*zzz\.\.\. "
                                                  r"\(\d+ characters\)$") as info:
        lowbit.load_gptq_model(directory)
    assert len(str(info.value)) < len(str(directory)) + 1200


def word_tokenizer(vocab_size):
    """A whitespace word-level tokenizer over the words w0 .. w{vocab_size - 2} and [UNK]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab_size - 1)}
    tok = Tokenizer(models.WordLevel({**words, "[UNK]": vocab_size - 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[UNK]")


def greedy_continuation(model, tokenizer, prompt: str, tokens: int) -> str:
    """The text of the model's greedy continuation of prompt, as the generate command prints it."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_generate_command_runs_a_gptq_directory(tmp_path, capsys, monkeypatch):
    from lowbit.__main__ import main
    from lowbit.gptq import placing

    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    with monkeypatch.context() as patched:  # the missing tokenizer is named before the model loads
        patched.setattr(placing, "load_gptq_model", lambda *a, **k: pytest.fail("the model loaded"))
        assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5"]) == 1
    err = capsys.readouterr().err
    assert "no tokenizer beside the checkpoint (none of tokenizer.json, " in err and len(err.splitlines()) == 1
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text("[1, 2")  # there, but broken: one line saying so
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5"]) == 1
    err = capsys.readouterr().err
    assert "the tokenizer beside the checkpoint does not load: " in err and len(err.splitlines()) == 1
    os.remove(tmp_path / "ckpt" / "tokenizer_config.json")

    tokenizer = word_tokenizer(512)
    tokenizer.save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5"]) == 0
    out, err = capsys.readouterr()
    text = greedy_continuation(model, tokenizer, "w1 w2 w3", 5)
    assert out.strip() == text
    assert "LlamaForCausalLM" in err and "prompt 3 tokens" in err
    # The checkpoint's single file: its directory's tokenizer.
    assert main(["generate", str(tmp_path / "ckpt" / "model.safetensors"), "w1 w2 w3", "--tokens", "5"]) == 0
    assert capsys.readouterr().out.strip() == text
    # --int8-activations: the same tokens as the loader's int8 model gives them.
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5", "--int8-activations"]) == 0
    int8_model = lowbit.load_gptq_model(tmp_path / "ckpt", int8_activations=True)
    int8_text = greedy_continuation(int8_model, tokenizer, "w1 w2 w3", 5)
    assert capsys.readouterr().out.strip() == int8_text
    # --repack: the same tokens from the panel layout, with --int8-activations and without.
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5", "--int8-activations",
                 "--repack"]) == 0
    assert capsys.readouterr().out.strip() == int8_text
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5", "--repack"]) == 0
    assert capsys.readouterr().out.strip() == text
    # --float-tables Q8_0: the loader's model with Q8_0 tables.
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5", "--float-tables", "Q8_0"]) == 0
    q8_model = lowbit.load_gptq_model(tmp_path / "ckpt", float_tables="Q8_0")
    assert q8_model.lm_head.qtype == 8
    assert capsys.readouterr().out.strip() == greedy_continuation(q8_model, tokenizer, "w1 w2 w3", 5)
    # --float-tables Q6_K: 128-value rows are not whole Q6_K blocks.
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5", "--float-tables", "Q6_K"]) == 1
    assert "are not a multiple of the Q6_K block size 256" in capsys.readouterr().err
    # A tokenizer with tokens past the model's 512 embedding rows.
    word_tokenizer(600).save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5"]) == 1
    assert "the tokenizer has 600 tokens, the model's vocabulary 512" in capsys.readouterr().err


def test_generate_command_reports_ids_past_the_tokenizer(tmp_path, capsys):
    """A model whose embedding has more rows than its tokenizer has tokens
    (a padded vocabulary) can generate ids the tokenizer has no text for:
    the text holds what the others decode to, and the counts line says how
    many of the generated ids had none, and which."""
    from lowbit.__main__ import main

    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    tokenizer = word_tokenizer(300)  # of the model's 512 rows
    tokenizer.save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "8"]) == 0
    out, err = capsys.readouterr()
    ids = tokenizer("w1 w2 w3", return_tensors="pt").input_ids
    with torch.no_grad():
        new = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
    past = [i for i in new if i >= 300]
    assert past and len(past) < len(new)  # both kinds, for the test to tell them apart
    assert out.strip() == tokenizer.decode([i for i in new if i < 300], skip_special_tokens=True).strip()
    assert (f"({len(new)} new tokens, {len(past)} of them ids past the tokenizer's 300 tokens, with no text in the "
            f"output: {', '.join(map(str, past))}, ") in err


def test_generate_command_runs_a_model_without_a_fixed_context(tmp_path, capsys):
    """Bloom's ALiBi positions have no fixed count (its config has no
    max_position_embeddings): no context bounds the prompt and --tokens."""
    from lowbit.__main__ import main

    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    torch.manual_seed(0)
    model = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=512, hidden_size=128, n_layer=2,
                                                                   n_head=4)).eval()
    assert not hasattr(model.config, "max_position_embeddings")
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    tokenizer = word_tokenizer(512)
    tokenizer.save_pretrained(tmp_path / "ckpt")
    assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == greedy_continuation(model, tokenizer, "w1 w2 w3", 5)
    assert "BloomForCausalLM" in err


def test_generate_command_refuses_tokenizer_files_of_odd_json(tmp_path, capsys):
    """The tokenizer's files are the checkpoint's: JSON of the wrong shape,
    which transformers indexes unchecked (KeyError, TypeError, AttributeError),
    or a config value that fails only when the prompt is tokenized, is one
    line naming the checkpoint, not a traceback."""
    from lowbit.__main__ import main

    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    word_tokenizer(512).save_pretrained(tmp_path / "ckpt")
    tokenizer_config = json.loads((tmp_path / "ckpt" / "tokenizer_config.json").read_text())
    for name, content, says in [
        ("tokenizer.json", "{}", "the tokenizer beside the checkpoint does not load: KeyError: 'added_tokens'"),
        ("tokenizer_config.json", "[1, 2]", "the tokenizer beside the checkpoint does not load: AttributeError: "),
        ("tokenizer_config.json", json.dumps({**tokenizer_config, "eos_token": 5}),
         "the tokenizer beside the checkpoint does not load: TypeError: "),
        ("tokenizer_config.json", json.dumps({**tokenizer_config, "model_max_length": "x"}),
         "its tokenizer does not tokenize the prompt: TypeError: "),
    ]:
        word_tokenizer(512).save_pretrained(tmp_path / "ckpt")
        (tmp_path / "ckpt" / name).write_text(content)
        assert main(["generate", str(tmp_path / "ckpt"), "w1 w2 w3", "--tokens", "2"]) == 1
        err = capsys.readouterr().err
        assert f"error: {tmp_path / 'ckpt'}: {says}" in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("int8_activations", [False, True])
def test_load_gptq_model_repack_holds_the_layers_in_panels(tmp_path, int8_activations):
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    plain = lowbit.load_gptq_model(tmp_path / "ckpt", int8_activations=int8_activations)
    packed = lowbit.load_gptq_model(tmp_path / "ckpt", int8_activations=int8_activations, repack=True)
    layers = [m for m in packed.modules() if isinstance(m, lowbit.GPTQLinear)]
    assert len(layers) == 8 and all(m.repacked and m.qweight.dim() == 3 for m in layers)  # fused: 4 a layer
    ids = torch.randint(0, 512, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(packed(ids).logits, plain(ids).logits)
        assert torch.equal(packed(ids[:, :1]).logits, plain(ids[:, :1]).logits)


def test_dynamic_overrides(tmp_path):
    dynamic = {r"-:.*\.o_proj": {}, r"+:.*\.mlp\..*": {"bits": 8, "group_size": 64}}
    config = GPTQConfig(bits=3, group_size=32, sym=True, checkpoint_format="gptq", dynamic=dynamic)
    assert config.for_module("model.layers.0.self_attn.o_proj") is None
    assert config.for_module("model.layers.1.mlp.up_proj").bits == 8
    assert config.for_module("model.layers.1.self_attn.q_proj").bits == 3
    model = tiny_llama()
    reference = quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    fresh = tiny_llama(seed=9)
    report = lowbit.replace_linear(fresh, tmp_path / "ckpt")
    assert isinstance(fresh.model.layers[0].self_attn.o_proj, torch.nn.Linear)
    assert "model.layers.0.self_attn.o_proj.weight" in report.loaded
    assert fresh.model.layers[1].mlp.up_proj.bits == 8 and fresh.model.layers[1].mlp.up_proj.group_size == 64
    assert fresh.model.layers[1].self_attn.q_proj.bits == 3
    assert_same_logits(logits(fresh, IDS), logits(reference, IDS))


# --- a checkpoint to corrupt -------------------------------------------------------------------
#
# Built once and copied for each test: 4-bit, group_size 32, asymmetric, gptq_v2, with biases,
# so every tensor kind of a quantized module is present. The corrupted module, down_proj of layer 1
# (256 inputs -> 128 outputs, 8 groups), holds tensors of these shapes:
MODULE = "model.layers.1.mlp.down_proj"
SHAPES = {"qweight": (32, 128), "qzeros": (8, 16), "scales": (8, 128), "g_idx": (256,), "bias": (128,)}
GROUPS = 8
WRONG_DTYPES = {"qweight": (torch.float32, torch.int64), "qzeros": (torch.float32, torch.int64),
                "scales": (torch.int32, torch.float64), "g_idx": (torch.float32, torch.int16),
                "bias": (torch.int32, torch.float64)}
INDEX = "model.safetensors.index.json"
DROP = object()  # edit_config: remove the key


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama(bias=True)
    quantize(model, config)
    directory = tmp_path_factory.mktemp("pristine") / "ckpt"
    lowbit.save_gptq(model, directory, config)
    with safe_open(directory / "model.safetensors", framework="pt") as f:
        assert {kind: tuple(f.get_slice(f"{MODULE}.{kind}").get_shape()) for kind in SHAPES} == SHAPES
    return directory


@pytest.fixture
def checkpoint(pristine, tmp_path):
    """A fresh copy of the pristine checkpoint, for one test to corrupt."""
    return shutil.copytree(pristine, tmp_path / "ckpt")


def load(path):
    model = tiny_llama(seed=7, bias=True)
    lowbit.replace_linear(model, path)
    return model


def edit_tensors(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file({name: t.contiguous() for name, t in tensors.items()}, path / "model.safetensors")


def edit_config(path, **changes):
    """Applies `changes` (a value of DROP removes the key) to config.json's quantization_config and to
    quantize_config.json."""
    for name in ("config.json", "quantize_config.json"):
        raw = json.loads((path / name).read_text())
        quant = raw["quantization_config"] if name == "config.json" else raw
        for key, value in changes.items():
            if value is DROP:
                quant.pop(key, None)
            else:
                quant[key] = value
        (path / name).write_text(json.dumps(raw))


def test_model_mismatch_is_refused(checkpoint):
    small = tiny_llama(bias=True)
    small.model.layers[1].mlp.down_proj = torch.nn.Linear(128, 128)
    with pytest.raises(GPTQCheckpointError, match=f"module '{MODULE}' is \\[128 x 256\\] in the checkpoint"):
        lowbit.replace_linear(small, checkpoint)


def test_names_from_the_checkpoint_are_cut_in_messages(checkpoint):
    """A checkpoint's names may be megabytes long, and many: the errors and
    warnings that name them show each cut, and a few of a list with how many
    more there are."""
    hostile = "model.layers.1.mlp." + "x" * 10**6

    def add_module(t):
        t.update({f"{hostile}.{kind}": t[f"{MODULE}.{kind}"].clone() for kind in SHAPES})

    edit_tensors(checkpoint, add_module)
    with pytest.raises(GPTQCheckpointError, match=r"module 'model\.layers\.1\.mlp\.x+\.\.\.x+' \(1000019 characters\) "
                                                  r"is quantized in the checkpoint but the model has no such module$") \
            as info:
        load(checkpoint)
    assert len(str(info.value)) < len(str(checkpoint)) + 300
    edit_tensors(checkpoint, lambda t: [t.pop(f"{hostile}.{kind}") for kind in SHAPES])
    extra = {f"unused.{i}." + "y" * 10**5: torch.ones(1) for i in range(20)}
    edit_tensors(checkpoint, lambda t: t.update(extra))
    with pytest.warns(UserWarning, match=r"tensors with no place in the model: \['unused\.0\.y+\.\.\.y+' "
                                         r"\(100009 characters\), .*, and 15 more\]$") as warned:
        load(checkpoint)
    assert max(len(str(w.message)) for w in warned) < len(str(checkpoint)) + 1000


def test_config_sources_in_order(checkpoint):
    assert lowbit.gptq.read_config(checkpoint).source.endswith("quantize_config.json")
    os.remove(checkpoint / "quantize_config.json")
    assert lowbit.gptq.read_config(checkpoint).source.endswith("config.json")
    config = json.loads((checkpoint / "config.json").read_text())
    del config["quantization_config"]  # not to disagree with the quant_config.json below
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "quant_config.json").write_text(json.dumps({"bits": 8, "group_size": 128, "format": "gptq_v2",
                                                              "true_sequential": True, "meta": {"damp_percent": 0.1}}))
    config = lowbit.gptq.read_config(checkpoint)
    assert config.source.endswith("quant_config.json") and config.bits == 8 and config.checkpoint_format == "gptq_v2"


@pytest.mark.parametrize("key, value", [("bits", 8), ("group_size", 64), ("desc_act", True), ("sym", False),
                                        ("checkpoint_format", "gptq"), ("format", "gptq"),
                                        ("lm_head", True), ("dynamic", {"-:.*down_proj": {}}),
                                        ("quant_method", "awq")])
def test_config_files_that_disagree_are_refused(checkpoint, key, value):
    """quantize_config.json is what lowbit (and AutoGPTQ, GPTQModel) read; transformers reads config.json: a
    checkpoint whose two configs disagree is refused, naming both, not read by one of them."""
    config = json.loads((checkpoint / "config.json").read_text())
    quant = config["quantization_config"]
    if key == "format":  # GPTQModel's quant_config.json name for it, read where checkpoint_format is absent
        del quant["checkpoint_format"]
    quant[key] = (not quant[key]) if isinstance(value, bool) and key in quant else value
    (checkpoint / "config.json").write_text(json.dumps(config))
    shown = "checkpoint_format" if key == "format" else key
    with pytest.raises(GPTQConfigError, match=f"quantize_config.json and .*config.json disagree on {shown}: "):
        lowbit.gptq.read_config(checkpoint)
    with pytest.raises(GPTQConfigError, match="disagree"):
        lowbit.replace_linear(tiny_llama(bias=True), checkpoint)


def test_config_files_with_dynamic_rules_in_another_order_disagree(checkpoint):
    """The first matching rule applies: the same rules in another order quantize a module two ways."""
    rules = {r"+:.*\.mlp\..*": {"bits": 8}, r"+:.*\.up_proj": {"bits": 2}}
    edit_config(checkpoint, dynamic=rules)
    config = json.loads((checkpoint / "config.json").read_text())
    config["quantization_config"]["dynamic"] = dict(reversed(rules.items()))
    (checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(GPTQConfigError, match="quantize_config.json and .*config.json disagree on dynamic: "):
        lowbit.gptq.read_config(checkpoint)


def test_config_files_agree_where_both_give_a_key(checkpoint):
    """A key one file leaves out (but `dynamic`: none is no rules), an empty `dynamic` against none, and keys that say how the checkpoint was made
    (damp_percent, meta) are no disagreement."""
    config = json.loads((checkpoint / "config.json").read_text())
    quant = config["quantization_config"]
    for key in ("desc_act", "sym", "checkpoint_format", "lm_head"):
        quant.pop(key, None)
    quant.update(dynamic={}, damp_percent=0.5, meta={"quantizer": "other"})
    (checkpoint / "config.json").write_text(json.dumps(config))
    assert lowbit.gptq.read_config(checkpoint).source.endswith("quantize_config.json")


# --- the corruption matrix ---------------------------------------------------------------------


def popped(kind):
    """An edit_tensors edit that removes MODULE's `kind` tensor."""
    key = f"{MODULE}.{kind}"
    return lambda tensors: tensors.pop(key)


def replaced(kind, change):
    """An edit_tensors edit that replaces MODULE's `kind` tensor t by change(t)."""
    key = f"{MODULE}.{kind}"
    return lambda tensors: tensors.update({key: change(tensors[key])})


def resized(t, dim, delta):
    """`t` with dimension `dim` one longer (its first slice repeated, so values stay valid) or one shorter."""
    return t.narrow(dim, 0, t.shape[dim] - 1) if delta < 0 else torch.cat([t, t.narrow(dim, 0, 1)], dim)


def set_first(value):
    """A change that sets the first element to `value` (in int64 where int32 cannot hold it)."""
    def change(t):
        t = t.long() if abs(value) >= 2**31 else t.clone()
        t[0] = value
        return t
    return change


def tensor_cases():
    """pytest params (edit, config changes, a regex the message matches after "module 'MODULE': ")."""
    for kind, shape in SHAPES.items():
        if kind == "g_idx":  # optional, the groups in order, unless the checkpoint is act-order
            yield pytest.param(popped(kind), {"desc_act": True}, re.escape(f"missing tensor '{MODULE}.g_idx', which an "
                                                                  "act-order (desc_act) checkpoint needs"),
                               id="g_idx-missing-with-desc_act")
        else:
            missing = ("the checkpoint has no bias, the model has one" if kind == "bias"  # only the model can tell
                       else re.escape(f"missing tensor '{MODULE}.{kind}'"))
            yield pytest.param(popped(kind), {}, missing, id=f"{kind}-missing")
        for dtype in WRONG_DTYPES[kind]:
            yield pytest.param(replaced(kind, lambda t, d=dtype: t.to(d)), {}, re.escape(f"{kind} has dtype {dtype}"),
                               id=f"{kind}-{str(dtype).removeprefix('torch.')}")
        shape_changes = [(f"dim{d}{'+' if s > 0 else '-'}1", lambda t, d=d, s=s: resized(t, d, s))
                         for d in range(len(shape)) for s in (1, -1)]
        shape_changes += [("rank-down", lambda t: t.flatten() if t.dim() == 2 else t[0]),
                          ("rank-up", lambda t: t.unsqueeze(0)), ("empty", lambda t: t[:0])]
        for name, change in shape_changes:
            bad = tuple(change(torch.empty(shape)).shape)
            # Tensors are checked against qweight, so a bad qweight shows as another tensor's mismatch, and
            # the message names qweight's shape ("qzeros has shape (8, 16), expected (9, 16): qweight (33, 128) ...").
            yield pytest.param(replaced(kind, change), {}, f"{kind} (has shape )?{re.escape(str(bad))}",
                               id=f"{kind}-{name}")
    in_range = re.escape(f"g_idx values must lie in [0, {GROUPS})")
    for name, value in (("groups", GROUPS), ("negative", -1), ("2^40", 2**40)):
        yield pytest.param(replaced("g_idx", set_first(value)), {}, in_range, id=f"g_idx-value-{name}")
    for kind in ("scales", "bias"):  # a NaN or inf there would make every output it touches NaN
        for value in (float("nan"), float("inf")):
            yield pytest.param(replaced(kind, lambda t, v=value: t.flatten().index_fill(0, torch.tensor([1]), v)
                                        .reshape(t.shape)), {},
                               re.escape(f"{kind} holds a non-finite value ({value}) at "), id=f"{kind}-{value}")

    def past_half(tensors):  # a finite float32 bias that the layer, holding it in the fp16 scales' dtype, makes inf
        tensors[f"{MODULE}.scales"] = tensors[f"{MODULE}.scales"].half()
        tensors[f"{MODULE}.bias"] = set_first(1e6)(tensors[f"{MODULE}.bias"].float())
    yield pytest.param(past_half, {}, re.escape("bias, held in the scales' torch.float16, holds a non-finite value "
                                                "(inf) at [0]"), id="bias-past-the-scales-dtype")


TENSOR_CASES = list(tensor_cases())


@pytest.mark.parametrize("edit, config, says", TENSOR_CASES)
def test_corrupt_tensors_name_the_module_and_tensor(checkpoint, edit, config, says):
    edit_tensors(checkpoint, edit)
    edit_config(checkpoint, **config)
    with pytest.raises(GPTQCheckpointError, match=f"^{re.escape(str(checkpoint))}: module '{MODULE}': .*{says}"):
        load(checkpoint)


def test_missing_plain_tensor_is_named(checkpoint):
    edit_tensors(checkpoint, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(GPTQCheckpointError, match=r"has no tensor for model parameters \['model.norm.weight'\]"):
        load(checkpoint)


# Config values that cannot describe a checkpoint, by key, and what the error says about each.
BAD_CONFIG_VALUES = {
    "bits": ((0, 1, 5, 16, "4", None, 4.0, True), "bits must be one of"),
    "group_size": ((0, -2, 3.5, "32", None, True), "group_size must be -1 or a positive integer"),
    "checkpoint_format": (("marlin", "awq", "", None), "checkpoint_format .* is not supported"),
    "quant_method": (("awq", "bitsandbytes"), "quant_method is .*, not 'gptq'"),
    "sym": (("false", 1), "sym must be true or false"),
    "desc_act": (("true", 0), "desc_act must be true or false"),
    "lm_head": (("false",), "lm_head must be true or false"),
    # AutoGPTQ's older key for checkpoint_format "marlin", which it, GPTQModel and vLLM read as that.
    "is_marlin_format": ((True, 1), "is_marlin_format .*: the checkpoint holds Marlin's repacked layout"),
    # GPTQModel rotates such a checkpoint's down_proj inputs at run time.
    "rotation": (("hadamard", "random"), "rotation .* is not supported: GPTQModel rotates"),
}
CONFIG_CASES = [pytest.param(key, value, says, id=f"{key}={value!r}")
                for key, (values, says) in BAD_CONFIG_VALUES.items() for value in values]
CONFIG_CASES += [pytest.param(key, DROP, f"missing '{key}'", id=f"{key}-missing") for key in ("bits", "group_size")]
CONFIG_CASES += [
    pytest.param("dynamic", [".*"], "dynamic must be a JSON object", id="dynamic-a-list"),
    pytest.param("dynamic", {r"+:.*\.mlp\..*": {"bits": 5}}, r"dynamic rule .*: bits must be one of",
                 id="dynamic-bits=5"),
    pytest.param("dynamic", {".*": {"sym": "no"}}, r"dynamic rule .*: sym must be true or false",
                 id="dynamic-sym='no'"),
    pytest.param("dynamic", {"(": {}}, r"dynamic rule '\(' is not a valid regex", id="dynamic-bad-regex"),
    pytest.param("dynamic", {"((a{1000}){1000}){1000}": {}}, r"dynamic rule .* repeats more than 10000 times",
                 id="dynamic-nested-repeats"),
    pytest.param("dynamic", {"+:" + "a" * 1001: {}}, r"dynamic rule .* is 1001 characters long",
                 id="dynamic-long-rule"),
    pytest.param("dynamic", {"(" * 499 + ")" * 499: {}}, r"dynamic rule .* nests its groups too deeply to compile",
                 id="dynamic-deeply-nested"),
    pytest.param("dynamic", {"(?x)a{1 0000}": {}}, r"dynamic rule .* sets the verbose flag \(x\)",
                 id="dynamic-verbose"),
    pytest.param("dynamic", {"(?ix:a{1 0000})": {}}, r"dynamic rule .* sets the verbose flag \(x\)",
                 id="dynamic-scoped-verbose"),
]
# Text the compiler reads as a class or a comment, where a scan that skipped classes would lose track of where
# they end and miss the repeats after them: braces count wherever they stand.
HIDING_RULES = {"comment": "(?#[)(a{200}){200}", "negated-class-with-a-literal-bracket": "[^]x[](a{200}){200}",
                "posix-class": "[[:digit:][](a{200}){200}", "V1": "(?V1)[[a]](a{200}){200}"}
CONFIG_CASES += [pytest.param("dynamic", {rule: {}}, r"dynamic rule .* repeats more than 10000 times",
                              id=f"dynamic-{name}") for name, rule in HIDING_RULES.items()]


@pytest.mark.parametrize("key, value, says", CONFIG_CASES)
def test_bad_config_values_name_the_key(checkpoint, key, value, says):
    edit_config(checkpoint, **{key: value})
    with pytest.raises(GPTQConfigError, match=f"^{re.escape(str(checkpoint / 'quantize_config.json'))}: {says}"):
        load(checkpoint)


@pytest.mark.parametrize("key, value, says", [
    ("quant_method", "a" * 10**6, r"quant_method is 'a+\.\.\.a+' \(1000000 characters\), not 'gptq'$"),
    ("checkpoint_format", ["gptq"] * 10**5, r"checkpoint_format \['gptq', 'gptq', 'gptq', 'gptq', 'gptq', \.\.\.\] is "
                                            r"not supported"),
    ("dynamic", {"-:" + "b" * 10**4: {}}, r"dynamic rule '-:b+\.\.\.b+' \(10002 characters\) is 10000 characters long"),
])
def test_config_values_are_cut_in_messages(checkpoint, key, value, says):
    """A config's values may be megabytes long: the error shows them cut."""
    edit_config(checkpoint, **{key: value})
    with pytest.raises(GPTQConfigError, match=says) as info:
        load(checkpoint)
    assert len(str(info.value)) < len(str(checkpoint)) + 400


def test_a_group_size_past_any_k_means_one_group(checkpoint):
    """A config's group_size is any JSON integer: one larger than every K
    (here past a float's range) describes one group, so this checkpoint's
    several groups are what the error names, not a count rounded to 0."""
    edit_config(checkpoint, group_size=10**400)
    with pytest.raises(GPTQCheckpointError, match=r"qzeros has shape \(\d+, \d+\), expected \(1, "):
        load(checkpoint)


def test_format_keys_that_disagree_are_refused(pristine, checkpoint):
    """GPTQModel reads "format" where it is given, vLLM "checkpoint_format" alone: one file giving both,
    differently, reads as garbage in one of them."""
    stored = json.loads((checkpoint / "quantize_config.json").read_text()).get("checkpoint_format", "gptq")
    other = "gptq" if stored == "gptq_v2" else "gptq_v2"
    edit_config(checkpoint, checkpoint_format=stored, format=other)
    with pytest.raises(GPTQConfigError, match=rf"quantize_config.json: checkpoint_format '{stored}' and format "
                                              rf"'{other}' disagree"):
        load(checkpoint)
    edit_config(checkpoint, format=stored)
    assert_same_logits(logits(load(checkpoint), IDS), logits(load(pristine), IDS))
    # Said by config.json alone (quantize_config.json, read first, silent on it): refused all the same.
    content = json.loads((checkpoint / "config.json").read_text())
    content["quantization_config"]["rotation"] = "hadamard"
    (checkpoint / "config.json").write_text(json.dumps(content))
    with pytest.raises(GPTQConfigError, match=r"config.json: rotation 'hadamard' is not supported"):
        load(checkpoint)


@pytest.mark.parametrize("rule", [r"-:.*\.layers\.\d{1,2}\.mlp\..*", r"+:.*\.(\d{2}){1,3}\..*", r".*\{9{0,9}\}.*",
                                  r"[{]123456}[\]{]{99}", "a" * 1000, r"(?i)[^]{]{99}\.(?P<p>up|down)_proj"])
def test_dynamic_rules_within_the_size_bounds_are_compiled(rule):
    """Counted repeats whose bounds multiply to at most 10000 (escaped braces, and braces that hold no count,
    are characters, not repeats) and rules of up to 1000 characters are taken."""
    config = parse_config({"bits": 4, "group_size": 128, "dynamic": {rule: {"bits": 8}}}, "q.json")
    assert rule in config.dynamic


def test_group_nesting_is_bounded_whatever_the_recursion_limit():
    """Rules nest groups up to 32 deep; one level more is refused as deeply nested, also where the interpreter's
    recursion limit is raised (torch raises it while it compiles) and the compiler would get through."""
    deepest = "(" * 32 + r"model\.norm" + ")" * 32
    assert parse_config({"bits": 4, "group_size": 128, "dynamic": {deepest: {"bits": 8}}},
                        "q.json").for_module("model.norm").bits == 8
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        for rule in ("(" * 33 + "a" + ")" * 33, "(" * 499 + ")" * 499):
            with pytest.raises(GPTQConfigError, match=r"^q\.json: dynamic rule .* nests its groups too deeply"):
                parse_config({"bits": 4, "group_size": 128, "dynamic": {rule: {}}}, "q.json")
    finally:
        sys.setrecursionlimit(limit)


def test_a_rule_for_every_module_of_a_large_model_is_compiled_once(monkeypatch):
    """One rule per module (48 layers of 128 experts' 3 projections: 18432 rules, 1.2 MB) is taken, and
    matching names against them compiles none again: every rule is tried on every name until one
    matches, so rules recompiled per name take a minute for a few names."""
    import lowbit.gptq.config as config_module

    compiled = []
    compile_rule = config_module._rule_pattern
    monkeypatch.setattr(config_module, "_rule_pattern",
                        lambda key, where: compiled.append(key) or compile_rule(key, where))
    names = [f"model.layers.{layer}.mlp.experts.{e}.{p}_proj" for layer in range(48) for e in range(128)
             for p in ("gate", "up", "down")]
    rules = {re.escape(name): {"bits": 8} for name in names}
    config = parse_config({"bits": 4, "group_size": 128, "dynamic": rules}, "q.json")
    assert sorted(compiled) == sorted(rules)
    for name in names[:3] + names[-20:]:  # within the shared matching budget
        assert config.for_module(name).bits == 8
    assert config.for_module("model.layers.0.self_attn.q_proj").bits == 4
    assert len(compiled) == len(rules)


def test_rules_past_the_total_size_are_refused_before_compiling(monkeypatch):
    """A million rules would take minutes to compile: past RULES_MAX_CHARS together they are refused,
    naming the file, before any is compiled."""
    import lowbit.gptq.config as config_module

    monkeypatch.setattr(config_module, "_rule_pattern", lambda *args: pytest.fail("compiled a rule"))
    rules = {f"model\\.layers\\.{i}\\.mlp": {"bits": 8} for i in range(200_000)}
    with pytest.raises(GPTQConfigError, match=r"^q\.json: dynamic holds 200000 rules of \d+ characters together, "
                                              r"more than the 2000000"):
        parse_config({"bits": 4, "group_size": 128, "dynamic": rules}, "q.json")


# Valid configs that contradict the tensors (group_size 512 > in_features is a legitimate single group, so
# the config accepts it, but these tensors have 8 groups): the first quantized module is refused.
CONTRADICTIONS = [{"bits": 8}, {"bits": 3}, {"bits": 2}, {"group_size": 64}, {"group_size": -1}, {"group_size": 512}]


@pytest.mark.parametrize("changes", CONTRADICTIONS, ids=lambda c: "{}={}".format(*next(iter(c.items()))))
def test_config_contradicting_the_tensors(checkpoint, changes):
    edit_config(checkpoint, **changes)
    with pytest.raises(GPTQCheckpointError, match=r"module 'model\.layers\.0\.mlp\.down_proj': (qweight|qzeros) "
                                                  r"has shape"):
        load(checkpoint)


def cut(name, keep):
    """Truncates file `name` to `keep` bytes (negative: drops that many from the end)."""
    def op(directory):
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[:keep])
    return op


def overwrite(name, offset, data):
    def op(directory):
        raw = bytearray((directory / name).read_bytes())
        raw[offset:offset + len(data)] = data
        (directory / name).write_bytes(bytes(raw))
    return op


def write(name, text):
    return lambda directory: (directory / name).write_text(text)


def remove(*names):
    def op(directory):
        for name in names:
            os.remove(directory / name)
    return op


ST, QC, HF = "model.safetensors", "quantize_config.json", "config.json"
# (operations, the file the message must name ("" for the directory), error type)
FILE_CASES = [
    pytest.param([cut(ST, -1000)], ST, GPTQCheckpointError, id="safetensors-truncated-data"),
    pytest.param([cut(ST, 4)], ST, GPTQCheckpointError, id="safetensors-truncated-header-length"),
    pytest.param([cut(ST, 0)], ST, GPTQCheckpointError, id="safetensors-empty"),
    pytest.param([overwrite(ST, 8, b"\xff" * 32)], ST, GPTQCheckpointError, id="safetensors-garbage-header"),
    pytest.param([overwrite(ST, 0, b"\xff" * 8)], ST, GPTQCheckpointError, id="safetensors-garbage-header-length"),
    pytest.param([remove(ST)], "", GPTQCheckpointError, id="no-safetensors"),
    pytest.param([write(INDEX, '{"weight_map": {"x": "model-00002-of-00002.safetensors"}}')], INDEX,
                 GPTQCheckpointError, id="index-lists-a-missing-shard"),
    pytest.param([write(INDEX, "{")], INDEX, GPTQCheckpointError, id="index-not-json"),
    # Nested past the JSON parser's recursion limit.
    pytest.param([write(INDEX, "[" * 100_000 + "]" * 100_000)], INDEX, GPTQCheckpointError, id="index-nested-deeply"),
    pytest.param([write(QC, "[" * 100_000 + "]" * 100_000)], QC, GPTQConfigError, id="quantize_config-nested-deeply"),
    pytest.param([remove(QC), write(HF, '{"a": ' * 100_000 + "1" + "}" * 100_000)], HF, GPTQConfigError,
                 id="config-nested-deeply"),
    pytest.param([write(QC, '{"bits": 4,')], QC, GPTQConfigError, id="quantize_config-not-json"),
    pytest.param([write(QC, "")], QC, GPTQConfigError, id="quantize_config-empty"),
    pytest.param([write(QC, "[4, 32]")], QC, GPTQConfigError, id="quantize_config-a-list"),
    pytest.param([remove(QC), write(HF, "{not json")], HF, GPTQConfigError, id="config-not-json"),
    pytest.param([remove(QC), write(HF, "[]")], HF, GPTQConfigError, id="config-a-list"),
    pytest.param([remove(QC, HF)], "", GPTQConfigError, id="no-config"),
]

# Shard indexes that are no map of tensor names to shard files of the checkpoint, by case id (a function of
# the directory where the case needs its name).
BAD_INDEXES = {
    "index-a-list": [1],
    "index-without-weight_map": {"metadata": {}},
    "weight_map-a-list": {"weight_map": [ST]},
    "weight_map-a-string": {"weight_map": ST},
    "weight_map-a-number": {"weight_map": 7},
    "weight_map-empty": {"weight_map": {}},
    "weight_map-value-a-number": {"weight_map": {"x": 3}},
    "weight_map-value-a-list": {"weight_map": {"x": [ST]}},
    "weight_map-value-not-safetensors": {"weight_map": {"x": HF}},
    # Both name the checkpoint's own (existing) shard, from outside the directory.
    "weight_map-value-escapes-the-directory": lambda d: {"weight_map": {"x": f"../{d.name}/{ST}"}},
    "weight_map-value-absolute": lambda d: {"weight_map": {"x": str(d / ST)}},
}
FILE_CASES += [pytest.param([lambda d, c=content: write(INDEX, json.dumps(c(d) if callable(c) else c))(d)], INDEX,
                            GPTQCheckpointError, id=case) for case, content in BAD_INDEXES.items()]


@pytest.mark.parametrize("ops, named, error", FILE_CASES)
def test_unreadable_files_name_the_path(checkpoint, ops, named, error):
    for op in ops:
        op(checkpoint)
    with pytest.raises(error, match=f"^{re.escape(str(checkpoint / named))}: "):
        load(checkpoint)


@pytest.mark.parametrize("lost", ["mlp.up_proj", "norm.weight"])
def test_index_listing_tensors_no_shard_holds_is_refused(tmp_path, lost):
    """A shard that lost tensors its index lists (a whole module, or a float tensor) is refused by the index,
    not read as a checkpoint without them; a tensor in another listed shard than the index names is read."""
    make_checkpoint(tmp_path / "ckpt", max_shard_bytes=3000)
    weight_map = json.loads((tmp_path / "ckpt" / INDEX).read_text())["weight_map"]
    names = [n for n in weight_map if n == lost or n.startswith(lost + ".")]
    for shard in {tmp_path / "ckpt" / weight_map[n] for n in names}:
        save_file({n: t for n, t in load_file(shard).items() if n not in names}, shard, metadata={"format": "pt"})
    with pytest.raises(GPTQCheckpointError, match=rf"^{re.escape(str(tmp_path / 'ckpt' / INDEX))}: lists "
                                                  rf"{len(names)} tensor\(s\) that no shard holds, e.g. "
                                                  rf"'{re.escape(names[0])}'"):
        lowbit.load_gptq(tmp_path / "ckpt")

    make_checkpoint(tmp_path / "moved", max_shard_bytes=3000)
    index = json.loads((tmp_path / "moved" / INDEX).read_text())
    weight_map = index["weight_map"]
    weight_map["norm.weight"], weight_map["mlp.up_proj.qweight"] = (weight_map["mlp.up_proj.qweight"],
                                                                    weight_map["norm.weight"])
    (tmp_path / "moved" / INDEX).write_text(json.dumps(index))
    ckpt = lowbit.load_gptq(tmp_path / "moved")
    assert set(ckpt.modules) == {"mlp.up_proj", "mlp.down_proj"} and "norm.weight" in ckpt.tensors


def run_isolated(script: str, timeout: float = 90) -> tuple[str, float]:
    """Runs `script` in a fresh Python, for loads that, unguarded, block or spin
    inside C code (reading a named pipe, matching a backtracking regular
    expression), where nothing in the process can interrupt them: past
    `timeout` the test fails instead of hanging. Returns (stdout, seconds)."""
    start = time.monotonic()
    try:
        result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                                timeout=timeout, cwd=os.path.dirname(__file__))
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s")
    assert result.returncode == 0, result.stderr
    return result.stdout, time.monotonic() - start


LOAD_EACH = """
    from lowbit.gptq.checkpoint import load_gptq
    for path in {paths!r}:
        try:
            load_gptq(path)
            print("loaded")
        except Exception as e:
            print(type(e).__name__, e)
"""


def non_regular_cases(checkpoint):
    """{what: (path to load, the file the error must name)}, each a checkpoint copy with one file a named
    pipe, a directory or a link to a device in its place."""
    def copy(name):
        return shutil.copytree(checkpoint, checkpoint.parent / name)

    def fifo(path):
        os.remove(path)
        os.mkfifo(path)

    cases = {}
    d = copy("shard-fifo")
    fifo(d / ST)
    cases["shard-fifo"] = (d, d / ST)
    d = copy("shard-fifo-as-file")
    fifo(d / ST)
    cases["shard-fifo-named-directly"] = (d / ST, d / ST)
    d = copy("shard-directory")
    (d / "extra.safetensors").mkdir()
    cases["shard-directory"] = (d, d / "extra.safetensors")
    d = copy("shard-dev-zero")
    os.remove(d / ST)
    os.symlink("/dev/zero", d / ST)
    cases["shard-link-to-dev-zero"] = (d, d / ST)
    d = copy("index-fifo")
    os.mkfifo(d / INDEX)
    cases["index-fifo"] = (d, d / INDEX)
    d = copy("indexed-shard-fifo")
    (d / INDEX).write_text(json.dumps({"weight_map": {"x": "model-00001-of-00001.safetensors"}}))
    os.mkfifo(d / "model-00001-of-00001.safetensors")
    cases["indexed-shard-fifo"] = (d, d / "model-00001-of-00001.safetensors")
    d = copy("quantize_config-fifo")
    fifo(d / QC)
    cases["quantize_config-fifo"] = (d, d / QC)
    d = copy("config-fifo")
    os.remove(d / QC)  # so that config.json is where the loader reads the config
    fifo(d / HF)
    cases["config-fifo"] = (d, d / HF)
    return cases


def test_non_regular_files_are_refused_before_opening(checkpoint):
    """A named pipe blocks the reader forever, /dev/zero never ends, a directory is no file: each is refused
    by name, without opening it."""
    cases = non_regular_cases(checkpoint)
    out, _ = run_isolated(LOAD_EACH.format(paths=[str(path) for path, _ in cases.values()]))
    lines = out.splitlines()
    assert len(lines) == len(cases)
    for (what, (_, named)), line in zip(cases.items(), lines):
        assert re.fullmatch(rf"GPTQCheckpointError {re.escape(str(named))}: the (config|shard index|safetensors "
                            "file) is not a regular file", line), (what, line)


# --- untrusted `dynamic` rules -----------------------------------------------------------------

LONG_NAME = "a" * 40 + "b"  # a module name that makes backtracking patterns take 2^40 steps


@pytest.fixture(scope="module")
def long_named(tmp_path_factory):
    """A v1 checkpoint whose one quantized module is named LONG_NAME."""
    directory = tmp_path_factory.mktemp("long")
    make_checkpoint(directory / "src")
    renamed = {name.replace("mlp.up_proj", LONG_NAME): t for name, t in checkpoint_tensors(directory / "src").items()
               if not name.startswith("mlp.down_proj")}
    config = json.loads((directory / "src" / "config.json").read_text())
    write_checkpoint(directory / "ckpt", renamed, config)
    return directory / "ckpt"


@pytest.mark.parametrize("rule, refused", [("+:(a+)+$", False), ("(a|a)+$", True), ("-:(a|aa|a)*$", True)])
def test_backtracking_dynamic_rules_are_bounded(long_named, tmp_path, rule, refused):
    """Rules that backtrack for hours on LONG_NAME (Python's `re` on all three) finish: they match, or past
    the config's matching budget the load names the config file and the rule."""
    directory = shutil.copytree(long_named, tmp_path / "ckpt")
    edit_config(directory, dynamic={rule: {"bits": 4}})
    out, seconds = run_isolated(LOAD_EACH.format(paths=[str(directory)]))
    if refused:
        assert out.startswith(f"GPTQCheckpointError {directory / QC}: dynamic rule {rule!r} did not finish matching")
    else:
        assert out == "loaded\n"
    assert seconds < 60


def test_dynamic_rule_budget_is_shared(monkeypatch):
    """The budget covers all matching of one config: a rule that takes a fraction of it on every name (about
    0.15 s here for 2^18 steps) is stopped after a few names, not allowed that much per name."""
    import lowbit.gptq.config as config_module

    monkeypatch.setattr(config_module, "RULE_MATCH_SECONDS", 0.5)
    config = GPTQConfig(bits=4, group_size=32, dynamic={"(a|a)+$": {}}, source="q.json")
    start = time.monotonic()
    with pytest.raises(GPTQCheckpointError, match=r"^q\.json: dynamic rule '\(a\|a\)\+\$' did not finish"):
        for i in range(100):
            config.for_module("a" * 18 + f"b{i}")
    assert time.monotonic() - start < 5


# --- num_hidden_layers -------------------------------------------------------------------------


@pytest.mark.parametrize("changes, says", [
    ({"num_hidden_layers": 100000}, "num_hidden_layers is 100000, but"),
    ({"num_hidden_layers": 1}, "num_hidden_layers is 1, but"),
    ({"num_hidden_layers": 3}, "num_hidden_layers is 3, but"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0, but"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a non-negative integer, got -1"),
    ({"num_hidden_layers": "2"}, "num_hidden_layers must be a non-negative integer, got '2'"),
    ({"num_hidden_layers": 2.0}, "num_hidden_layers must be a non-negative integer, got 2.0"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be a non-negative integer, got True"),
])
def test_layer_count_must_match_the_tensors(checkpoint, changes, says):
    raw = json.loads((checkpoint / HF).read_text())
    (checkpoint / HF).write_text(json.dumps({**raw, **changes}))
    with pytest.raises(GPTQCheckpointError, match=f"^{re.escape(str(checkpoint / HF))}: {says}"):
        check_layer_count(checkpoint)


def test_layer_count_counts_only_layers_without_gaps(checkpoint):
    """One tensor of layer 99999 does not make 100000 layers: every layer must have tensors."""
    check_layer_count(checkpoint)  # the pristine config says 2, the tensors hold model.layers.0 and .1
    edit_tensors(checkpoint, lambda t: t.update({"model.layers.99999.input_layernorm.weight": torch.ones(128)}))
    raw = json.loads((checkpoint / HF).read_text())
    (checkpoint / HF).write_text(json.dumps({**raw, "num_hidden_layers": 100000}))
    with pytest.raises(GPTQCheckpointError, match=r"'model\.layers': 3 numbered from 0 to 99999"):
        check_layer_count(checkpoint)
    # DeepSeek's multi-token-prediction layer follows the counted ones.
    edit_tensors(checkpoint, lambda t: t.pop("model.layers.99999.input_layernorm.weight"))
    (checkpoint / HF).write_text(json.dumps({**raw, "num_hidden_layers": 1, "num_nextn_predict_layers": 1}))
    check_layer_count(checkpoint)
    (checkpoint / HF).write_text(json.dumps({k: v for k, v in raw.items() if k != "num_hidden_layers"}))
    check_layer_count(checkpoint)


def test_a_module_number_past_any_model_is_refused_naming_the_tensor(checkpoint):
    """A number of thousands of digits is past int()'s limit (4300): refused
    naming the file and the tensor, not by int()'s bare ValueError."""
    name = "model.layers." + "9" * 5000 + ".input_layernorm.weight"
    edit_tensors(checkpoint, lambda t: t.update({name: torch.ones(128)}))
    with pytest.raises(GPTQCheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.9+\.\.\.9+\.input_layernorm"
                                                  r"\.weight' \(5036 characters\) numbers its module with 5000 digits$"):
        check_layer_count(checkpoint)


@pytest.mark.parametrize("layers", [1, 100000])
def test_load_gptq_model_checks_the_layer_count_first(checkpoint, layers):
    raw = json.loads((checkpoint / HF).read_text())
    (checkpoint / HF).write_text(json.dumps({**raw, "num_hidden_layers": layers}))
    start = time.monotonic()
    with pytest.raises(GPTQCheckpointError, match=f"^{re.escape(str(checkpoint / HF))}: num_hidden_layers is "
                                                  f"{layers}, but"):
        lowbit.load_gptq_model(checkpoint)
    assert time.monotonic() - start < 10


def test_failed_loads_leave_the_checkpoint_untouched(pristine, tmp_path):
    corruptions = {
        "qweight-missing": lambda d: edit_tensors(d, lambda t: t.pop(f"{MODULE}.qweight")),
        "scales-dim0+1": lambda d: edit_tensors(d, replaced("scales", lambda t: resized(t, 0, 1))),
        "g_idx-value-negative": lambda d: edit_tensors(d, replaced("g_idx", set_first(-1))),
        "bits=5": lambda d: edit_config(d, bits=5),
        "group_size=64": lambda d: edit_config(d, group_size=64),
        "safetensors-truncated-data": cut(ST, -1000),
        "quantize_config-not-json": write(QC, "{"),
    }
    for name, corrupt in corruptions.items():
        directory = shutil.copytree(pristine, tmp_path / name)
        corrupt(directory)
        before = tree_hashes(tmp_path)
        with pytest.raises(ValueError):
            load(directory)
        assert tree_hashes(tmp_path) == before, f"{name}: the failed load changed files under {tmp_path}"


@pytest.mark.parametrize("edit, config", [
    pytest.param(lambda t: t.pop(f"{MODULE}.g_idx"), {}, id="g_idx-missing-without-desc_act"),
    pytest.param(replaced("g_idx", lambda t: t.long()), {}, id="g_idx-int64"),
    pytest.param(replaced("scales", lambda t: t.float()), {}, id="scales-float32"),
    pytest.param(None, {"quant_method": DROP}, id="quant_method-missing"),
    pytest.param(None, {"desc_act": None}, id="desc_act-null"),
    # AutoGPTQ <= 0.7 writes is_marlin_format false into every plain checkpoint's config.
    pytest.param(None, {"is_marlin_format": False}, id="is_marlin_format-false"),
])
def test_legitimate_variations_load(pristine, checkpoint, edit, config):
    """What the matrix does not count as corrupt: these load, and compute what the pristine checkpoint does."""
    if edit is not None:
        edit_tensors(checkpoint, edit)
    edit_config(checkpoint, **config)
    assert_same_logits(logits(load(checkpoint), IDS), logits(load(pristine), IDS))


@pytest.mark.parametrize("directory", [None, 3])
def test_read_config_names_a_directory_that_is_not_a_path(directory):
    """os.fspath's TypeError names neither the function nor the argument."""
    with pytest.raises(TypeError, match=rf"^read_config: directory must be a str or os\.PathLike, got "
                                        rf"{type(directory).__name__}$"):
        lowbit.gptq.read_config(directory)


def test_read_config_refuses_an_empty_directory():
    """os.path reads "" as the working directory, whose config is no argument's."""
    with pytest.raises(ValueError, match="^read_config: directory must be a directory path, got an empty one$"):
        lowbit.gptq.read_config("")
