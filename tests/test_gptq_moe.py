"""GPTQ checkpoints of mixture-of-experts models: per-expert layers
(`model.layers.N.mlp.experts.E.gate_proj.qweight`, ..., as GPTQModel writes
Qwen-MoE models; `block_sparse_moe.experts.E.w1`, ..., as Mixtral
checkpoints made under transformers 4 name them) into transformers' models,
whose experts are 3-D parameters, as GPTQExperts. A tiny Qwen3-MoE /
Qwen2-MoE / Mixtral is quantized
(GPTQLinear.from_linear per expert and projection, act-order for some),
saved with save_gptq, loaded with load_gptq_model, and compared with the
same model holding the dequantized weights (both sides sum the same exactly
dequantized weights in fp32: 1e-4 of the largest logit, as
test_gptq_checkpoint.py); then the checkpoint's experts are damaged."""
import copy
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from lowbit.gptq import GPTQCheckpointError, GPTQConfig

transformers = pytest.importorskip("transformers")

CONFIG = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2")


def tiny_moe(arch, seed=0):
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_experts_per_tok=2, pad_token_id=None, tie_word_embeddings=False)
    if arch == "mixtral":
        config = transformers.MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
        model_class = transformers.MixtralForCausalLM
    else:
        common.update(intermediate_size=96, num_experts=4, moe_intermediate_size=32)
    if arch == "qwen3moe":
        config, model_class = transformers.Qwen3MoeConfig(**common, norm_topk_prob=True), transformers.Qwen3MoeForCausalLM
    elif arch == "qwen2moe":
        config, model_class = (transformers.Qwen2MoeConfig(**common, shared_expert_intermediate_size=64),
                               transformers.Qwen2MoeForCausalLM)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # decisive routing
                p.normal_(0, 0.5)
    return model


def quantized(model):
    """(the model with every decoder Linear a GPTQLinear and every experts
    module a GPTQExperts, the float model holding the same dequantized weights)."""
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)

    def gptq(linear):
        perm = torch.randperm(linear.in_features, generator=gen)
        return lowbit.GPTQLinear.from_linear(linear, CONFIG.bits, CONFIG.group_size, CONFIG.sym,
                                             CONFIG.checkpoint_format, perm)

    def expert(weight):
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            linear.weight.copy_(weight)
        return gptq(linear)

    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head" and module.out_features > 1:
            layer = gptq(module)
            model.set_submodule(name, layer)
            with torch.no_grad():
                reference.get_submodule(name).weight.copy_(layer.dequantize(torch.float32))
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            half = module.gate_up_proj.shape[1] // 2
            experts = [lowbit.gptq.GPTQExpert(expert(w[:half]), expert(w[half:]), expert(d))
                       for w, d in zip(module.gate_up_proj, module.down_proj)]
            layer = lowbit.gptq.GPTQExperts(experts, module.act_fn)
            model.set_submodule(name, layer)
            w = layer.dequantize(torch.float32)
            with torch.no_grad():
                reference.get_submodule(name).gate_up_proj.copy_(torch.cat([w["gate_proj"], w["up_proj"]], dim=1))
                reference.get_submodule(name).down_proj.copy_(w["down_proj"])
    return model, reference


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe", "mixtral"])
def saved(request, tmp_path_factory):
    model, reference = quantized(tiny_moe(request.param))
    directory = str(tmp_path_factory.mktemp(request.param) / "ckpt")
    lowbit.save_gptq(model, directory, CONFIG)
    return directory, reference


def test_checkpoint_names_the_experts_as_gptqmodel_does(saved):
    directory, _ = saved
    names = set(load_file(os.path.join(directory, "model.safetensors")))
    for e in range(4):
        for p in ("gate_proj", "up_proj", "down_proj"):
            assert {f"model.layers.1.mlp.experts.{e}.{p}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx")} <= names
    assert "model.layers.0.mlp.gate.weight" in names  # the router, in float
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in names)


def test_load_gptq_model_runs_the_experts(saved):
    directory, reference = saved
    model = lowbit.load_gptq_model(directory)
    experts = [m for m in model.modules() if isinstance(m, lowbit.gptq.GPTQExperts)]
    assert len(experts) == 2 and all(m.num_experts == 4 for m in experts)
    assert not any(type(m) is torch.nn.Linear and n != "lm_head" and m.out_features > 1
                   for n, m in model.named_modules())
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    # And saved again as it was loaded: the same tensors under the same names.
    again = os.path.join(os.path.dirname(directory), "again")
    lowbit.save_gptq(model, again, CONFIG)
    first, second = load_file(os.path.join(directory, "model.safetensors")), load_file(
        os.path.join(again, "model.safetensors"))
    assert set(first) == set(second) and all(torch.equal(first[k], second[k]) for k in first)


def copy_with(directory, tensors, to):
    """The checkpoint at `directory` with `tensors` as its weights, at `to`."""
    os.makedirs(to)
    for f in os.listdir(directory):
        if f != "model.safetensors":
            with open(os.path.join(directory, f), "rb") as src, open(os.path.join(to, f), "wb") as dst:
                dst.write(src.read())
    save_file(tensors, os.path.join(to, "model.safetensors"))
    return str(to)


LEGACY = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def test_mixtral_checkpoint_under_transformers_4_names(tmp_path):
    """A Mixtral checkpoint as AutoGPTQ / GPTQModel wrote it under
    transformers 4 (`block_sparse_moe`, w1 / w3 / w2 experts, float router
    `block_sparse_moe.gate`) runs as the same checkpoint under today's names;
    saved again, it has today's names."""
    model, reference = quantized(tiny_moe("mixtral"))
    lowbit.save_gptq(model, str(tmp_path / "new"), CONFIG)
    tensors = load_file(str(tmp_path / "new" / "model.safetensors"))

    def legacy(name):
        name = name.replace(".mlp.", ".block_sparse_moe.")
        for new, old in LEGACY.items():
            name = name.replace(f".{new}.", f".{old}.") if ".experts." in name else name
        return name

    old = {legacy(k): v for k, v in tensors.items()}
    assert "model.layers.1.block_sparse_moe.experts.3.w2.qweight" in old
    assert "model.layers.0.block_sparse_moe.gate.weight" in old
    loaded = lowbit.load_gptq_model(copy_with(str(tmp_path / "new"), old, tmp_path / "old"))
    assert sum(isinstance(m, lowbit.gptq.GPTQExperts) for m in loaded.modules()) == 2
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = loaded(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    lowbit.save_gptq(loaded, str(tmp_path / "again"), CONFIG)
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert set(again) == set(tensors) and all(torch.equal(again[k], tensors[k]) for k in tensors)
    # A projection missing under the old names is named as the model names it.
    old = {k: v for k, v in old.items() if ".block_sparse_moe.experts.2.w3." not in k}
    with pytest.raises(GPTQCheckpointError, match=r"checkpoint lacks model.layers.0.mlp.experts.2.up_proj"):
        lowbit.load_gptq_model(copy_with(str(tmp_path / "new"), old, tmp_path / "broken"))


def test_damaged_experts_are_refused(saved, tmp_path):
    directory, _ = saved
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    cases = {
        "missing expert": ({k: v for k, v in tensors.items() if ".experts.3.up_proj." not in k},
                           r"mlp.experts: the model has 4 experts; the checkpoint lacks model.layers.\d.mlp.experts.3.up_proj"),
        "extra expert": ({**tensors, **{k.replace(".experts.0.", ".experts.4."): v.clone() for k, v in tensors.items()
                                        if ".experts.0." in k}}, "the model has 4 experts; the checkpoint has expert 4"),
        "projection of another shape": ({**{k: v for k, v in tensors.items() if ".experts.2.gate_proj." not in k},
                                         **{k.replace(".experts.2.down_proj.", ".experts.2.gate_proj."): v.clone()
                                            for k, v in tensors.items() if ".experts.2.down_proj." in k}},
                                        r"module 'model.layers.\d.mlp.experts.2.gate_proj' is \[64 x 32\] in the "
                                        r"checkpoint but \[32 x 64\] in the model's experts"),
    }
    for case, (damaged, pattern) in cases.items():
        with pytest.raises(GPTQCheckpointError, match=pattern):
            lowbit.load_gptq_model(copy_with(directory, damaged, tmp_path / case.replace(" ", "_")))


def test_expert_ids_out_of_range():
    model, _ = quantized(tiny_moe("qwen3moe"))
    experts = next(m for m in model.modules() if isinstance(m, lowbit.gptq.GPTQExperts))
    with pytest.raises(IndexError, match=r"GPTQExperts: expert ids must lie in \[0, 4\), got 4"):
        experts(torch.randn(2, 64), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2))
