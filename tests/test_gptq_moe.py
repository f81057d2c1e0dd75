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
import re
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import lowbit
from lowbit.gptq import GPTQCheckpointError, GPTQConfig, quantize
from lowbit.gptq.algorithm import Hessian, quantize_linear

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


@pytest.mark.parametrize("extra", ["model.layers.0.mlp.experts.0.w1", "model.layers.0.block_sparse_moe.gate"])
def test_a_module_under_both_names_is_refused(tmp_path, extra):
    """A Mixtral checkpoint holding a module under transformers 4's name and today's (another expert's
    projection as expert 0's w1, a zero router as block_sparse_moe.gate) is refused naming both: read as
    one name, one of the two would be dropped without a word, whichever the names sort after."""
    model, _ = quantized(tiny_moe("mixtral"))
    lowbit.save_gptq(model, str(tmp_path / "new"), CONFIG)
    tensors = load_file(str(tmp_path / "new" / "model.safetensors"))
    current = "model.layers.0.mlp.experts.0.gate_proj" if "experts" in extra else "model.layers.0.mlp.gate"
    tensors.update({k.replace(current, extra): v.clone() if "experts" in extra else torch.zeros_like(v)
                    for k, v in tensors.items() if k.startswith(current + ".")})
    with pytest.raises(GPTQCheckpointError, match=rf"both: '({re.escape(extra)}|{re.escape(current)})[.'].* and "
                                                  rf"'({re.escape(extra)}|{re.escape(current)})[.'].* are both the "
                                                  rf"model's '{re.escape(current)}"):
        lowbit.load_gptq_model(copy_with(str(tmp_path / "new"), tensors, tmp_path / "both"))


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


def test_expert_numbers_int_would_misread_are_refused_naming_the_module(saved, tmp_path):
    """An expert numbered past int()'s 4300 digits, or in another script's
    digits (which int() reads as expert 3's number), is no expert of the
    model's: refused naming the directory and the module, not by int()'s bare
    ValueError nor loaded in expert 3's place."""
    directory, _ = saved
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    for number in ("9" * 5000, "\u0663"):  # ARABIC-INDIC DIGIT THREE
        assert lowbit.gptq.experts.EXPERT_LAYER.fullmatch(f"mlp.experts.{number}.up_proj") is None
        damaged = {**tensors, **{k.replace(".experts.0.", f".experts.{number}."): v.clone() for k, v in tensors.items()
                                 if ".experts.0." in k}}
        with pytest.raises(GPTQCheckpointError, match=rf"^{re.escape(str(tmp_path))}.*: module "
                                                      rf"'model\.layers\.\d\.mlp\.experts\.{number[:10]}[^']*'"
                                                      r"( \(\d+ characters\))? is "
                                                      r"quantized in the checkpoint but the model has no such module"):
            lowbit.load_gptq_model(copy_with(directory, damaged, tmp_path / str(len(number))))


def test_expert_ids_out_of_range():
    model, _ = quantized(tiny_moe("qwen3moe"))
    experts = next(m for m in model.modules() if isinstance(m, lowbit.gptq.GPTQExperts))
    for ids, got in (([[0, 4], [1, 2]], "0 .. 4"), ([[0, -1], [1, 2]], "-1 .. 2")):
        with pytest.raises(IndexError, match=rf"GPTQExperts: expert ids must lie in \[0, 4\), got {got}"):
            experts(torch.randn(2, 64), torch.tensor(ids), torch.ones(2, 2))


def test_experts_module_names_what_it_cannot_run():
    """What forward would meet only on the first token routed to it (a bare AttributeError or TypeError), and an
    expert number that is no expert's (a KeyError, or "-1" read as a child's name), are refused by name."""
    from lowbit.gptq import GPTQExpert, GPTQExperts

    def expert():
        return GPTQExpert(*(lowbit.GPTQLinear.from_linear(torch.nn.Linear(k, n, bias=False), 4, 32)
                            for k, n in ((64, 128), (64, 128), (128, 64))))

    for experts, act_fn, says in ((5, torch.nn.SiLU(), "experts must be a list of GPTQExpert, got int"),
                                  ([torch.nn.Linear(64, 64)], torch.nn.SiLU(), r"experts\[0\] must be a GPTQExpert, "
                                                                               "got Linear"),
                                  ([expert()], None, r"act_fn must be callable \(an nn.Module\), got NoneType")):
        with pytest.raises(TypeError, match=rf"^GPTQExperts: {says}$"):
            GPTQExperts(experts, act_fn)
    experts = GPTQExperts([expert(), expert()], torch.nn.SiLU())
    assert experts.expert(1) is experts._modules["1"]
    for e in (-1, 2, "0", 1.0):
        with pytest.raises(IndexError, match=rf"^GPTQExperts\.expert: e must be an integer in \[0, 2\), got "
                                             rf"{re.escape(repr(e))}$"):
            experts.expert(e)


@pytest.mark.parametrize("hidden, ids, weights, says", [
    ((2, 64), (2, 2), (2, 3), r"top_k_weights must have top_k_index's shape \[2, 2\], got torch.float32 \[2, 3\]"),
    ((2, 64), (2, 2), (4,), r"top_k_weights must have top_k_index's shape \[2, 2\], got torch.float32 \[4\]"),
    ((3, 64), (2, 2), (2, 2), r"top_k_index must be \[tokens=3, k\], got torch.int64 \[2, 2\]"),
    ((1, 2, 64), (2, 2), (2, 2), r"hidden_states must be a float \[tokens, hidden=64\] tensor, got torch.float32 "
                                 r"\[1, 2, 64\]"),
    ((2, 96), (2, 2), (2, 2), r"hidden_states must be a float \[tokens, hidden=64\]"),
])
def test_routing_of_other_shapes_is_refused(hidden, ids, weights, says):
    """Rows and weights pair up by position: a routing whose shapes disagree would mix them silently."""
    model, _ = quantized(tiny_moe("qwen3moe"))
    experts = next(m for m in model.modules() if isinstance(m, lowbit.gptq.GPTQExperts))
    with pytest.raises(ValueError, match=f"GPTQExperts: {says}"):
        experts(torch.randn(hidden), torch.zeros(ids, dtype=torch.long), torch.ones(weights))
    with pytest.raises(ValueError, match="GPTQExperts: top_k_index must hold integer expert ids, got torch.float32"):
        experts(torch.randn(2, 64), torch.zeros(2, 2), torch.ones(2, 2))
    # What is not a float tensor is named, not met inside a projection's op.
    with pytest.raises(ValueError, match=r"GPTQExperts: hidden_states must be a float .* got torch.int64 \[2, 64\]"):
        experts(torch.ones(2, 64, dtype=torch.long), torch.zeros(2, 2, dtype=torch.long), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"GPTQExperts: top_k_index must be \[tokens=2, k\], got list"):
        experts(torch.randn(2, 64), [[0, 1], [1, 0]], torch.ones(2, 2))


def calibration(count, seed, seq=16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (2, seq), generator=g) for _ in range(count)]


def with_correlated_inputs(model):
    """A low-rank embedding: activations correlated across features, as a
    real model's are (GPTQ's error feedback gains nothing on white noise)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        low_rank = torch.randn(96, 8, generator=g) @ torch.randn(8, 64, generator=g)
        model.model.embed_tokens.weight.copy_(0.25 * low_rank + 0.05 * torch.randn(96, 64, generator=g))
    return model


def experts_modules(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, lowbit.gptq.GPTQExperts)}


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "mixtral"])
def test_quantize_moe_round_trips_and_beats_rtn(tmp_path, arch):
    """lowbit.gptq.quantize on an MoE model: attention, shared expert and
    every expert's projections become GPTQLinear (the shared-expert gate, one
    output, stays float), the checkpoint loads back to the same logits, and
    the result is closer to the float model than round-to-nearest."""
    model, held_out = with_correlated_inputs(tiny_moe(arch)), torch.cat(calibration(2, seed=2))
    float_logits = model(held_out).logits.detach()
    rtn, _ = quantized(copy.deepcopy(model))
    config = quantize(model, calibration(8, seed=1), CONFIG.bits, CONFIG.group_size, CONFIG.sym, CONFIG.desc_act,
                      CONFIG.checkpoint_format, progress=False)
    experts = experts_modules(model)
    assert len(experts) == 2 and all(
        isinstance(getattr(m.expert(e), p), lowbit.GPTQLinear) for m in experts.values() for e in range(4)
        for p in ("gate_proj", "up_proj", "down_proj"))
    floats = [n for n, m in model.model.layers.named_modules() if type(m) is torch.nn.Linear]
    assert floats == (["0.mlp.shared_expert_gate", "1.mlp.shared_expert_gate"] if arch == "qwen2moe" else [])
    with torch.no_grad():
        got = model(held_out).logits
    lowbit.save_gptq(model, tmp_path / "ckpt", config)
    loaded = lowbit.load_gptq_model(tmp_path / "ckpt")
    with torch.no_grad():
        # Bit for bit up to the LM head, which the loaded model runs over the
        # checkpoint's float table (GGUFLinear): to fp32 summation order there.
        assert torch.equal(loaded.model(held_out).last_hidden_state, model.model(held_out).last_hidden_state)
        torch.testing.assert_close(loaded(held_out).logits, got, rtol=1e-5, atol=1e-5)
        mse_rtn = (rtn(held_out).logits - float_logits).pow(2).mean().item()
    mse_gptq = (got - float_logits).pow(2).mean().item()
    assert mse_gptq < 0.5 * mse_rtn, (mse_gptq, mse_rtn)  # measured 0.04-0.08


def test_each_expert_is_calibrated_on_the_tokens_routed_to_it():
    """Layer 0's experts, quantized by quantize, are bit for bit
    quantize_linear of each float expert with the Hessian of exactly the
    calibration tokens the router sends it (gate/up), and of its own
    quantized gate/up activations on them (down)."""
    model = tiny_moe("qwen3moe")
    original = copy.deepcopy(model).model.layers[0].mlp.experts
    batches = calibration(4, seed=1)
    quantize(model, batches, CONFIG.bits, CONFIG.group_size, CONFIG.sym, CONFIG.desc_act, CONFIG.checkpoint_format,
             progress=False)
    experts = model.model.layers[0].mlp.experts
    seen = []  # the experts module's (hidden states, routing) per batch; layer 0 sees them as quantize did
    hook = experts.register_forward_pre_hook(lambda module, args: seen.append((args[0], args[1])))
    with torch.no_grad():
        for ids in batches:
            model(ids)
    hook.remove()
    half = original.gate_up_proj.shape[1] // 2
    for e in range(4):
        expert = experts.expert(e)
        gate_up, down = Hessian(64), Hessian(32)
        with torch.no_grad():
            for hidden, routing in seen:
                x = hidden[(routing == e).any(dim=-1)]
                gate_up.add(x)
                down.add(experts.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
        assert gate_up.rows > 0, "the calibration should reach every expert"
        for proj, weight, hessian in (("gate_proj", original.gate_up_proj[e, :half], gate_up),
                                      ("up_proj", original.gate_up_proj[e, half:], gate_up),
                                      ("down_proj", original.down_proj[e], down)):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight)
            want = quantize_linear(linear, hessian.value(), CONFIG.bits, CONFIG.group_size, CONFIG.sym,
                                   CONFIG.desc_act, CONFIG.checkpoint_format)
            got = getattr(expert, proj)
            for t in ("qweight", "qzeros", "scales", "g_idx"):
                assert torch.equal(getattr(got, t), getattr(want, t)), (e, proj, t)


def test_padding_leaves_the_shared_expert_s_hessians():
    """Qwen2-MoE's shared expert takes the tokens flattened [batch * seq,
    hidden]: the positions the attention mask leaves out reach its Hessians
    no more than the attention's (routed experts take what the router sends)."""
    ids = torch.randint(5, 60, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    results = []
    for pad in (0, 7):
        model = tiny_moe("qwen2moe", seed=3)
        padded = ids.clone()
        padded[1, :5] = pad
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # experts no token reaches
            quantize(model, [{"input_ids": padded, "attention_mask": mask}], 4, group_size=32, progress=False)
        results.append({n: t for n, t in model.state_dict().items() if n.endswith("qweight")})
    # The first layer's (the routed experts' rounding reaches the next layer's inputs).
    dense = [n for n in results[0] if "layers.0." in n and ("shared_expert." in n or "self_attn" in n)]
    assert len(dense) == 3 + 4  # shared gate, up and down; q, k, v, o
    assert all(torch.equal(results[0][n], results[1][n]) for n in dense)


def test_experts_no_token_reaches_are_rounded_to_nearest():
    """One calibration token reaches 2 of the 4 experts per layer; the others
    are the round-to-nearest quantization of their float weights (GPTQ with
    an identity Hessian), with a warning naming them."""
    model = tiny_moe("qwen3moe")
    original = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"no calibration token reached \d experts of model\.layers\.\d") as record:
        quantize(model, [torch.tensor([[5]])], CONFIG.bits, CONFIG.group_size, CONFIG.sym, CONFIG.desc_act,
                 CONFIG.checkpoint_format, progress=False)
    messages = [str(w.message) for w in record if "model.layers.0 " in str(w.message)]
    assert "reached 2 experts" in messages[0]
    unreached = [int(n.split(".")[-1]) for n in messages[0].split("(")[1].split(")")[0].split(", ")]
    assert len(unreached) == 2
    float_experts, experts = original.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    half = float_experts.gate_up_proj.shape[1] // 2
    for e in unreached:
        for proj, weight in (("gate_proj", float_experts.gate_up_proj[e, :half]),
                             ("up_proj", float_experts.gate_up_proj[e, half:]), ("down_proj", float_experts.down_proj[e])):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight)
            rtn = lowbit.GPTQLinear.from_linear(linear, CONFIG.bits, CONFIG.group_size, CONFIG.sym,
                                                CONFIG.checkpoint_format)
            got = getattr(experts.expert(e), proj)
            assert torch.equal(got.dequantize(torch.float32), rtn.dequantize(torch.float32)), (e, proj)
            assert torch.equal(got.g_idx, rtn.g_idx)


def test_quantize_refuses_experts_it_cannot_compute():
    """gpt-oss's experts (biased, [in, out], gate and up interleaved, clamped
    SwiGLU) are not what GPTQExperts computes: refused naming the module,
    not quantized into something else."""
    config = transformers.GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                       num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"quantize: model.layers.0.mlp.experts \(GptOssExperts, parameters .*\) is not "
                                         r"an experts module GPTQExperts computes"):
        quantize(model, calibration(1, seed=0), CONFIG.bits, CONFIG.group_size, progress=False)


def _with_experts_of(model, make):
    """`model` with each experts module's class swapped for make(class)."""
    for module in model.modules():
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            module.__class__ = make(type(module))
    return model


def clamping(base):
    """DeepSeek-V4's gate: gate and up clamped before act_fn(gate) * up."""
    return type("ClampingExperts", (base,), {"_apply_gate": lambda self, gate_up: (
        lambda gate, up: self.act_fn(gate.clamp(max=7.0)) * up.clamp(-7.0, 7.0))(*gate_up.chunk(2, dim=-1))})


def plainly_gating(base):
    """A class of its own with the plain gate written out (as some transformers classes have it)."""
    return type("PlainGateExperts", (base,), {"_apply_gate": lambda self, gate_up: (
        lambda gate, up: self.act_fn(gate) * up)(*gate_up.chunk(2, dim=-1))})


class TwoInputSwiGLU(torch.nn.Module):
    def forward(self, gate, up):
        return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("kind", ["clamped gate", "two-input act_fn"])
def test_experts_of_another_gate_are_refused(saved, kind):
    """Experts whose gate is not act_fn(gate) * up (DeepSeek-V4's clamps it,
    Inkling 2's act_fn takes gate and up): quantizing or loading them as
    GPTQExperts would compute something else, so both refuse; the same
    experts with the plain gate written out load."""
    directory, _ = saved
    arch = {"Qwen3MoeForCausalLM": "qwen3moe", "Qwen2MoeForCausalLM": "qwen2moe", "MixtralForCausalLM": "mixtral"}[
        type(saved[1]).__name__]

    def other(model):
        if kind == "clamped gate":
            return _with_experts_of(model, clamping)
        for module in model.modules():
            if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
                module.act_fn = TwoInputSwiGLU()
        return model
    if kind == "clamped gate":  # (the two-input act_fn makes no model that runs, to calibrate with)
        with pytest.raises(ValueError, match=r"is not an experts module GPTQExperts computes"):
            quantize(other(tiny_moe(arch)), calibration(1, seed=0), CONFIG.bits, CONFIG.group_size, progress=False)
    with pytest.raises(GPTQCheckpointError, match=r"mlp.experts: the model's \w+ is not an experts module GPTQExperts "
                                                  r"computes"):
        lowbit.replace_linear(other(tiny_moe(arch)), directory)
    plain = _with_experts_of(tiny_moe(arch), plainly_gating)
    lowbit.replace_linear(plain, directory)
    assert sum(isinstance(m, lowbit.gptq.GPTQExperts) for m in plain.modules()) == 2

