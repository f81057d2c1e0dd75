"""GPTQ checkpoints end to end: a small transformers Llama quantized with
GPTQLinear.from_linear, saved in the HF GPTQ layout, loaded back into a fresh
model with lowbit.replace_linear, and compared with the same model holding
the dequantized float weights.

Tolerance: both sides sum in fp32 over the same exactly dequantized weights,
only in a different order, so logits agree to ~1e-6 relative; the test
allows 1e-4 of the largest logit.
"""
import json
import os

import pytest
import torch

import lowbit
from lowbit.gptq import GPTQCheckpointError, GPTQConfig, GPTQConfigError

transformers = pytest.importorskip("transformers")

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def tiny_llama(seed=0):
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def quantize(model, config: GPTQConfig, act_order=False):
    """Swaps every Linear the config quantizes for GPTQLinear.from_linear, and
    returns the float model holding the same (dequantized) weights."""
    reference = tiny_llama()
    reference.load_state_dict(model.state_dict())
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
    fresh = tiny_llama(seed=6)
    lowbit.replace_linear(fresh, tmp_path / "single" / "model.safetensors")
    assert_same_logits(logits(fresh, IDS), logits(reference, IDS))


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


@pytest.fixture
def checkpoint(tmp_path):
    config = GPTQConfig(bits=4, group_size=32, sym=False, checkpoint_format="gptq_v2")
    model = tiny_llama()
    quantize(model, config)
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    return tmp_path / "ckpt"


def edit_tensors(path, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def edit_config(path, **changes):
    for name in ("config.json", "quantize_config.json"):
        raw = json.loads((path / name).read_text())
        (raw["quantization_config"] if name == "config.json" else raw).update(changes)
        (path / name).write_text(json.dumps(raw))


MODULE = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("edit, pattern", [
    (lambda t: t.pop(f"{MODULE}.qzeros"), f"module '{MODULE}': missing tensor {MODULE}.qzeros"),
    (lambda t: t.update({f"{MODULE}.scales": t[f"{MODULE}.scales"][:-1]}), f"module '{MODULE}': scales has shape"),
    (lambda t: t.update({f"{MODULE}.qweight": t[f"{MODULE}.qweight"].float()}), f"module '{MODULE}': qweight has dtype"),
    (lambda t: t.update({f"{MODULE}.g_idx": t[f"{MODULE}.g_idx"] + 100}), f"module '{MODULE}': g_idx values"),
    (lambda t: t.pop("model.norm.weight"), r"has no tensor for model parameters \['model.norm.weight'\]"),
])
def test_corrupt_checkpoints_name_the_module(checkpoint, edit, pattern):
    edit_tensors(checkpoint, edit)
    with pytest.raises(ValueError, match=pattern):
        lowbit.replace_linear(tiny_llama(), checkpoint)


@pytest.mark.parametrize("changes, pattern", [
    ({"bits": 5}, "bits must be one of"),
    ({"group_size": 0}, "group_size must be -1 or a positive integer"),
    ({"checkpoint_format": "marlin"}, "checkpoint format 'marlin' is not supported"),
    ({"quant_method": "awq"}, "quant_method is 'awq'"),
])
def test_bad_configs_are_refused(checkpoint, changes, pattern):
    edit_config(checkpoint, **changes)
    with pytest.raises(GPTQConfigError, match=pattern):
        lowbit.replace_linear(tiny_llama(), checkpoint)


def test_model_mismatch_is_refused(checkpoint):
    small = tiny_llama()
    small.model.layers[1].mlp.down_proj = torch.nn.Linear(128, 128)
    with pytest.raises(GPTQCheckpointError, match=f"module '{MODULE}' is \\[128 x 256\\] in the checkpoint"):
        lowbit.replace_linear(small, checkpoint)


def test_config_sources_in_order(checkpoint):
    assert lowbit.gptq.read_config(checkpoint).source.endswith("quantize_config.json")
    os.remove(checkpoint / "quantize_config.json")
    assert lowbit.gptq.read_config(checkpoint).source.endswith("config.json")
    (checkpoint / "quant_config.json").write_text(json.dumps({"bits": 8, "group_size": 128, "format": "gptq_v2",
                                                              "true_sequential": True, "meta": {"damp_percent": 0.1}}))
    config = lowbit.gptq.read_config(checkpoint)
    assert config.source.endswith("quant_config.json") and config.bits == 8 and config.checkpoint_format == "gptq_v2"
