"""LoRA over lowbit models with PEFT (python/lowbit/lora.py): adapters wrap
the quantized layers, their gradients are those of the same LoRA over an
nn.Linear holding the dequantized weight, a model trains, and a saved
adapter reloads to the same outputs; merging is refused."""
import os
import re

import pytest
import torch

import gguf_blocks as gb
import lowbit
from lowbit.gptq import GPTQConfig

peft = pytest.importorskip("peft")
import lowbit.lora  # noqa: E402  (needs peft)
import tiny_models  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(**kw):
    # init_lora_weights=False: B is random too, so every adapter weight gets a gradient at once.
    return lowbit.lora.LoraConfig(**{**dict(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False), **kw})


def quantized_layer(kind):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96)
    if kind == "gptq":
        return lowbit.GPTQLinear.from_linear(linear, 4, 32, sym=False, checkpoint_format="gptq_v2",
                                             perm=torch.randperm(256), dtype=torch.float32)
    return lowbit.GGUFLinear.from_linear(linear, gb.type_id(kind))


def dense_twin(layer):
    """nn.Linear holding the quantized layer's dequantized weight (and bias)."""
    dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        dense.weight.copy_(layer.dequantize(torch.float32))
        if layer.bias is not None:
            dense.bias.copy_(layer.bias)
    return dense


@pytest.mark.parametrize("kind, tol", [("gptq", 1e-5), ("F16", 1e-5), ("Q4_0", 3e-2), ("Q8_0", 1e-2)])
def test_adapter_gradients_equal_those_over_the_dequantized_linear(kind, tol):
    """The same adapter over the quantized layer and over nn.Linear(dequantized
    W): equal gradients, to fp32 rounding where the layer's forward is exact
    (GPTQ, F16) and to its 8-bit activation rounding otherwise (stated tol)."""
    layer = quantized_layer(kind)
    dense = dense_twin(layer)
    # A norm after the layer: PEFT needs a model with a parameter of its own.
    torch.manual_seed(1)
    ours = peft.get_peft_model(torch.nn.Sequential(layer, torch.nn.LayerNorm(96)), lora_config())
    torch.manual_seed(1)
    theirs = peft.get_peft_model(torch.nn.Sequential(dense, torch.nn.LayerNorm(96)),
                                 peft.LoraConfig(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False))
    assert type(ours.base_model.model[0]).__name__ == "QuantizedLoraLinear"
    x, weights = torch.randn(6, 256), torch.randn(6, 96)
    for model in (ours, theirs):
        (model(x) * weights).sum().backward()
    theirs_params = dict(theirs.named_parameters())
    adapters = [(n, p) for n, p in ours.named_parameters() if "lora_" in n]
    assert len(adapters) == 2 and all(p.requires_grad for _, p in adapters)
    for name, p in adapters:
        q = theirs_params[name]
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol * q.grad.abs().max().item())
    assert not any(p.requires_grad for n, p in ours.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("kind", ["gptq", "F16"])
def test_mixed_batch_adapters_are_peft_s(kind):
    """PEFT's adapter_names: each row of the batch through its own adapter ("__base__": none), as over
    nn.Linear; the model keeps working after."""
    layer = quantized_layer(kind)
    dense = dense_twin(layer)
    models = []
    for base, config in ((layer, lora_config), (dense, peft.LoraConfig)):
        torch.manual_seed(1)
        model = peft.get_peft_model(torch.nn.Sequential(base, torch.nn.LayerNorm(96)),
                                    config(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False))
        torch.manual_seed(2)
        model.add_adapter("other", config(r=4, lora_alpha=8, target_modules=["0"], init_lora_weights=False))
        models.append(model.eval())
    x = torch.randn(4, 256)
    names = ["default", "other", "__base__", "default"]
    with torch.no_grad():
        ours, theirs = (m(x, adapter_names=names) for m in models)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
        for i, name in enumerate(names):  # each row as the whole batch through its adapter gives it
            alone = models[0]
            if name == "__base__":
                with alone.disable_adapter():
                    torch.testing.assert_close(ours[i], alone(x[i:i + 1])[0])
            else:
                alone.set_adapter(name)
                torch.testing.assert_close(ours[i], alone(x[i:i + 1])[0])
        models[0].set_adapter("default")
        torch.testing.assert_close(models[0](x), models[1](x), rtol=1e-5, atol=1e-5)


GPTQ_CONFIG = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2")


def gptq_checkpoint(model, path):
    """model's decoder Linear layers as act-order GPTQ layers, saved to path."""
    for name, module in list(model.named_modules()):
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            model.set_submodule(name, lowbit.GPTQLinear.from_linear(module, 4, 32, sym=False,
                                                                    checkpoint_format="gptq_v2",
                                                                    perm=torch.randperm(module.in_features)))
    lowbit.save_gptq(model, path, GPTQ_CONFIG)
    return str(path)


@pytest.fixture(params=["gguf", "gptq"])
def model_path(request, tmp_path):
    model = tiny_models.tiny_model("llama", 0, num_hidden_layers=2)
    if request.param == "gguf":
        return request.param, tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", model, "llama")
    return request.param, gptq_checkpoint(model, tmp_path / "tiny-gptq")


def load(kind, path):
    return lowbit.load_gguf_model(path) if kind == "gguf" else lowbit.load_gptq_model(path)


def test_lora_trains_saves_and_reloads(model_path, tmp_path):
    kind, path = model_path
    torch.manual_seed(0)
    model = peft.get_peft_model(load(kind, path), lora_config(target_modules=TARGETS, init_lora_weights=True))
    wrapped = [n for n, m in model.named_modules() if isinstance(m, lowbit.lora.QuantizedLoraLinear)]
    assert len(wrapped) == 2 * len(TARGETS)
    model.gradient_checkpointing_enable()  # recomputes each decoder layer, lowbit's ops included, in backward
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(40):
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0], losses  # from log(64): the adapters learn the batch
    model.eval()
    model.save_pretrained(tmp_path / "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(tmp_path / "adapter"))
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    reloaded = lowbit.lora.load_adapter(load(kind, path), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, trained)
    with pytest.raises(ValueError, match="merging a LoRA adapter into a quantized"):
        reloaded.merge_and_unload()


def test_save_gptq_refuses_a_model_with_adapters_in_it(tmp_path):
    """save_gptq writes the base model: with LoRA layers in the model its
    keys would be base_layer's and the adapter's, which no loader reads."""
    path = gptq_checkpoint(tiny_models.tiny_model("llama", 0, num_hidden_layers=2), tmp_path / "tiny-gptq")
    model = peft.get_peft_model(lowbit.load_gptq_model(path), lora_config(target_modules=TARGETS))
    with pytest.raises(ValueError, match="save_gptq: the model has PEFT adapter layers .*q_proj"):
        lowbit.save_gptq(model.base_model.model, tmp_path / "with-adapter", GPTQ_CONFIG)
    assert not os.path.exists(tmp_path / "with-adapter")
    lowbit.save_gptq(model.unload(), tmp_path / "unloaded", GPTQ_CONFIG)
    ids = torch.tensor([[1, 7, 22, 5]])
    with torch.no_grad():
        assert torch.equal(lowbit.load_gptq_model(tmp_path / "unloaded")(ids).logits,
                           lowbit.load_gptq_model(path)(ids).logits)


def test_lora_trains_under_torch_compile():
    model = peft.get_peft_model(torch.nn.Sequential(quantized_layer("Q4_0"), torch.nn.LayerNorm(96)), lora_config())
    x, weights = torch.randn(4, 256), torch.randn(4, 96)
    step = torch.compile(lambda x: (model(x) * weights).sum())
    step(x).backward()
    compiled = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(n.split(".")[-3] for n in compiled) == ["lora_A", "lora_B"], sorted(compiled)
    model.zero_grad()
    (model(x) * weights).sum().backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(compiled[n], p.grad, rtol=1e-4, atol=1e-5 * p.grad.abs().max().item())


def test_a_regex_adapts_the_model_s_own_projections_not_the_fused_layers(model_path):
    """A regex matching both the fused layers (qkv_proj, gate_up_proj) and
    their slices adapts the projections the model has without fusing, as PEFT
    would there: the same adapter names, each one trained, the same outputs."""
    kind, path = model_path
    models = []
    for fuse in (True, False):
        base = lowbit.load_gguf_model(path, fuse=fuse) if kind == "gguf" else lowbit.load_gptq_model(path, fuse=fuse)
        torch.manual_seed(0)
        models.append(peft.get_peft_model(base, lora_config(target_modules=r".*_proj")))
    fused, unfused = models
    assert kind == "gptq" or any(getattr(m, "fused_from", None) for m in fused.modules())  # act-order q, k, v apart
    names = [sorted(n for n, p in m.named_parameters() if p.requires_grad) for m in models]
    assert names[0] == names[1] and len(names[0]) == 2 * 2 * len(TARGETS)  # lora_A and lora_B, 2 layers
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    fused(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in fused.parameters() if p.requires_grad)
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, unfused(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_eva_initializes_the_fused_model_s_projections_as_the_unfused_one_s(tmp_path):
    """EVA (PEFT's data-driven init) with a regex that matches the fused layers: the slices' adapters start
    from the SVD of their inputs as the unfused model's do, and the adapter saved reloads onto the fused model."""
    path = tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", tiny_models.tiny_model("llama", 0), "llama")
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": ids[i:i + 2], "attention_mask": torch.ones_like(ids[i:i + 2])} for i in range(0, 8, 2)]
    models = []
    for fuse in (True, False):
        config = lora_config(target_modules=r".*_proj", init_lora_weights="eva", eva_config=peft.EvaConfig(rho=1.0))
        model = peft.get_peft_model(lowbit.load_gguf_model(path, fuse=fuse), config)
        peft.initialize_lora_eva_weights(model, batches, show_progress_bar=False)
        models.append(model)
    fused, unfused = models
    assert any(getattr(m, "fused_from", None) for m in fused.modules())
    assert fused.peft_config["default"].target_modules == unfused.peft_config["default"].target_modules
    want = peft.get_peft_model_state_dict(unfused)
    got = peft.get_peft_model_state_dict(fused)
    assert got.keys() == want.keys() and len(want) == 2 * 2 * len(TARGETS)
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=1e-5, atol=1e-6)
    fused.save_pretrained(tmp_path / "adapter")
    reloaded = lowbit.lora.load_adapter(lowbit.load_gguf_model(path), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, fused(input_ids=ids).logits)


@pytest.mark.parametrize("targets", [["gate_up_proj"], r".*\.gate_up_proj", r".*(gate_up|down)_proj"])
def test_a_fused_layer_targeted_without_its_slices_is_refused(tmp_path, targets):
    """Named, or matched by a regex that none of its slices matches, a fused
    layer would take an adapter of its own, which the model without fusing
    has no module for (and which its slices' calls would skip)."""
    path = tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", tiny_models.tiny_model("llama", 0), "llama")
    with pytest.raises(ValueError, match=r"mlp.gate_up_proj is lowbit's fused layer of gate_proj, up_proj "
                                         r"\(lowbit.fusing\): name those in target_modules"):
        peft.get_peft_model(lowbit.load_gguf_model(path), lora_config(target_modules=targets))


def test_a_wrapper_made_directly_over_a_fused_layer_is_refused(tmp_path):
    """Its slices call the fused layer itself: a QuantizedLoraLinear built by
    hand over it would hold an adapter that never runs."""
    path = tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", tiny_models.tiny_model("llama", 0), "llama")
    fused = lowbit.load_gguf_model(path).model.layers[0].mlp.gate_up_proj
    with pytest.raises(ValueError, match=r"the base layer is lowbit's fused layer of gate_proj, up_proj"):
        lowbit.lora.QuantizedLoraLinear(fused, "default", config=lora_config(target_modules=TARGETS), r=4)


@pytest.mark.parametrize("config, says", [
    (dict(target_modules="all-linear"), r"target_modules='all-linear' picks torch.nn.Linear modules"),
    (dict(target_modules=TARGETS, init_lora_weights="pissa"), r"init_lora_weights='pissa' reads the base layer's"),
    (dict(target_modules=TARGETS, init_lora_weights="orthogonal"), r"init_lora_weights='orthogonal' reads the base"),
    (dict(target_modules=TARGETS, init_lora_weights="mica"), r"init_lora_weights='mica' reads the base"),
    (dict(target_modules=TARGETS, use_qalora=True), r"QA-LoRA \(use_qalora\) pools the adapter's inputs"),
    (dict(target_modules=TARGETS, bias="lora_only"), r"bias='lora_only' trains biases, and a quantized layer's"),
    (dict(target_modules=TARGETS, bias="all"), r"bias='all' trains biases"),
    (dict(target_modules=TARGETS, trainable_token_indices={"embed_tokens": [1, 2]}),
     r"trainable_token_indices trains rows of the token embedding"),
])
def test_targets_and_inits_lowbit_cannot_adapt_are_refused(model_path, config, says):
    kind, path = model_path
    with pytest.raises(ValueError, match=says):
        peft.get_peft_model(load(kind, path), lora_config(**config))


@pytest.mark.parametrize("name, says", [
    ("down_proj", "model.layers.0.mlp.down_proj, which is lowbit's quantized GGUFLinear"),
    ("gate_proj", "model.layers.0.mlp.gate_proj, which is lowbit's quantized ProjectionSlice"),
    ("embed_tokens", "model.embed_tokens, which is lowbit's quantized GGUFEmbedding"),
    ("layers.1", "model.layers.1, which holds lowbit's quantized ProjectionSlice"),
])
def test_modules_to_save_refuses_quantized_layers(tmp_path, name, says):
    """PEFT trains a copy of each module in modules_to_save: a quantized layer's copy holds frozen blocks that
    would train nothing. Refused before the model changes; a float module (the norms) is still PEFT's to copy."""
    path = tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", tiny_models.tiny_model("llama", 0), "llama")
    model = lowbit.load_gguf_model(path)
    with pytest.raises(ValueError, match=f"lowbit.lora: modules_to_save names {re.escape(says)}: a trainable copy "
                                         r".* train LoRA adapters on lowbit's linear layers \(target_modules\)"):
        peft.get_peft_model(model, lora_config(target_modules=["q_proj"], modules_to_save=[name]))
    wrappers = (peft.tuners.lora.LoraLayer, peft.utils.ModulesToSaveWrapper)
    assert not any(isinstance(m, wrappers) for m in model.modules())
    adapted = peft.get_peft_model(model, lora_config(target_modules=["q_proj"], modules_to_save=["norm"]))
    assert "base_model.model.model.norm.modules_to_save.default.weight" in dict(adapted.named_parameters())


def gptq_experts():
    """A model holding a GPTQExperts of two experts (hidden 64, intermediate 32) and a float Linear."""
    torch.manual_seed(0)

    def layer(n_in, n_out):
        return lowbit.GPTQLinear.from_linear(torch.nn.Linear(n_in, n_out, bias=False), 4, 32)

    experts = [lowbit.gptq.GPTQExpert(layer(64, 32), layer(64, 32), layer(32, 64)) for _ in range(2)]
    model = torch.nn.Module()
    model.experts, model.proj = lowbit.gptq.GPTQExperts(experts, torch.nn.SiLU()), torch.nn.Linear(64, 64)
    return model


@pytest.mark.parametrize("kind, config, says", [
    ("gguf", dict(target_modules=["experts"]), "target_modules matches it"),
    ("gguf", dict(target_modules=r".*mlp\..*"), "target_modules matches it"),
    # PEFT moves these names of transformers' MoE experts into target_parameters (gate_up_proj, down_proj).
    ("gguf", dict(target_modules=TARGETS), "target_parameters holds 'down_proj', one of its weights"),
    ("gguf", dict(target_modules=["q_proj"], target_parameters=["mlp.experts.gate_up_proj"]),
     "target_parameters holds 'mlp.experts.gate_up_proj'"),
    ("gptq", dict(target_modules=["experts"]), "target_modules matches it"),
    ("gptq", dict(target_modules=["proj"], target_parameters=["experts.down_proj"]),
     "target_parameters holds 'experts.down_proj'"),
])
def test_lora_on_moe_experts_is_refused_naming_the_module(tmp_path, kind, config, says):
    """PEFT adapts transformers' experts through their 3-D weight parameters, which lowbit's experts modules hold
    as quantized blocks: refused, naming the module, before the model changes; its other layers take adapters."""
    if kind == "gguf":
        path = tiny_models.write_tiny_gguf(tmp_path / "moe.gguf", tiny_models.tiny_model("qwen3moe", 0), "qwen3moe")
        model, name, module = lowbit.load_gguf_model(path), "model.layers.0.mlp.experts", "GGUFExperts"
    else:
        model, name, module = gptq_experts(), "experts", "GPTQExperts"
    with pytest.raises(ValueError, match=f"lowbit.lora: {re.escape(name)} is lowbit's {module}, and "
                                         f"{re.escape(says)}.*: LoRA on MoE experts is not supported"):
        peft.get_peft_model(model, lora_config(**config))
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    # The model's other layers still take adapters.
    adapted = peft.get_peft_model(model, lora_config(target_modules=["q_proj"] if kind == "gguf" else ["proj"]))
    assert any(isinstance(m, peft.tuners.lora.LoraLayer) for m in adapted.modules())


def test_an_adapter_with_biases_loads_but_does_not_train_on_lowbit(tmp_path):
    """An adapter saved with bias='all' over the float model loads onto the
    lowbit model of the same weights, its biases written into the quantized
    layers' bias buffers (the float PEFT model's logits); loading it to train
    is refused, as is making one: those biases would not train."""
    float_model = tiny_models.tiny_model("qwen2", 0)
    path = tiny_models.write_tiny_gguf(tmp_path / "qwen2.gguf", float_model, "qwen2")
    adapted = peft.get_peft_model(float_model, peft.LoraConfig(r=4, target_modules=["q_proj"], bias="all",
                                                               init_lora_weights=False))
    ids = torch.tensor([[1, 7, 22, 5]])
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        unbiased = adapted(input_ids=ids).logits
        for name, p in adapted.named_parameters():
            if name.endswith("q_proj.base_layer.bias"):
                p.add_(10 * torch.randn(p.shape, generator=g))
        want = adapted(input_ids=ids).logits
    adapted.save_pretrained(tmp_path / "adapter")
    model = lowbit.lora.load_adapter(lowbit.load_gguf_model(path, fuse=False), tmp_path / "adapter")
    # The quantized weights move the logits by 0.6% of the largest (measured), the biases by 10%.
    tolerance = dict(atol=0.02 * want.abs().max().item(), rtol=0)
    assert not torch.allclose(unbiased, want, **tolerance)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, **tolerance)
    with pytest.raises(ValueError, match="bias='all' trains biases"):
        lowbit.lora.load_adapter(lowbit.load_gguf_model(path, fuse=False), tmp_path / "adapter", is_trainable=True)
    # The fused model holds q, k and v's biases as qkv_proj's.
    with pytest.raises(ValueError, match="its biases are the projections' own: load the model with fuse=False"):
        lowbit.lora.load_adapter(lowbit.load_gguf_model(path), tmp_path / "adapter")


def test_load_adapter_refuses_a_file_that_does_not_fit(model_path, tmp_path):
    """Tensors that find no layer (PEFT only warns, and the adapter adds
    nothing there) and non-finite values (every logit NaN) are refused,
    naming the file."""
    import json

    from safetensors.torch import load_file, save_file

    kind, path = model_path
    torch.manual_seed(0)
    peft.get_peft_model(load(kind, path), lora_config(target_modules=TARGETS)).save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    good = load_file(weights)
    renamed = {k.replace("q_proj", "o_proj") if "q_proj" in k else k: v for k, v in good.items()}
    save_file(renamed, weights)
    with pytest.raises(ValueError, match="load_adapter: .*adapter: the adapter's tensors do not match its layers"):
        lowbit.lora.load_adapter(load(kind, path), tmp_path / "adapter")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_file.read_text())
    save_file(good, weights)
    config_file.write_text(json.dumps({**config, "target_modules": ["o_proj"]}))
    with pytest.raises(ValueError, match="the adapter's tensors do not match its layers"):
        lowbit.lora.load_adapter(load(kind, path), tmp_path / "adapter")
    config_file.write_text(json.dumps(config))
    name = next(k for k in good if "lora_B" in k)
    save_file({**good, name: torch.full_like(good[name], float("nan"))}, weights)
    with pytest.raises(ValueError, match=f"load_adapter: .*tensor '{re.escape(name)}' holds a NaN or infinity"):
        lowbit.lora.load_adapter(load(kind, path), tmp_path / "adapter")


def test_adapters_combine_by_svd(model_path):
    """add_weighted_adapter's default (SVD of the weighted sum of the adapters'
    deltas), at a rank that holds the sum: the combined adapter's delta is
    that sum in every adapted layer."""
    kind, path = model_path
    torch.manual_seed(0)
    model = peft.get_peft_model(load(kind, path), lora_config(target_modules=TARGETS), adapter_name="one")
    model.add_adapter("two", lora_config(target_modules=TARGETS))
    model.add_weighted_adapter(["one", "two"], [1.0, 0.5], "both", combination_type="svd", svd_rank=8)
    layers = [m for m in model.modules() if isinstance(m, lowbit.lora.QuantizedLoraLinear) and "both" in m.lora_A]
    assert layers
    for m in layers:
        x = torch.randn(3, m.in_features)
        with torch.no_grad():
            base = m.base_layer(x)

            def delta(name):
                m.set_adapter(name)
                return m(x) - base

            torch.testing.assert_close(delta("both"), delta("one") + 0.5 * delta("two"), atol=1e-4, rtol=1e-4)


def test_a_saved_adapter_loads_as_a_second_adapter(model_path, tmp_path):
    """lowbit.lora.load_adapter onto a PEFT model of the base adds the adapter
    beside its own: set active, the saving model's outputs."""
    kind, path = model_path
    torch.manual_seed(0)
    saved = peft.get_peft_model(load(kind, path), lora_config(target_modules=TARGETS))
    saved.save_pretrained(tmp_path / "adapter")
    ids = torch.tensor([[1, 7, 22, 5]])
    with torch.no_grad():
        want = saved(input_ids=ids).logits
    model = peft.get_peft_model(load(kind, path), lora_config(target_modules=["q_proj"]), adapter_name="own")
    assert lowbit.lora.load_adapter(model, tmp_path / "adapter", adapter_name="second") is model
    model.set_adapter("second")
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    with pytest.raises(ValueError, match="already has an adapter named 'second'"):
        lowbit.lora.load_adapter(model, tmp_path / "adapter", adapter_name="second")


@pytest.mark.parametrize("merge", ["merge_adapter", "merge_and_unload"])
def test_a_refused_merge_leaves_every_layer_as_it_was(merge):
    """A model whose float layer comes before its quantized one: the refusal
    comes before PEFT merges (or unloads) the float layer's adapter."""
    torch.manual_seed(0)
    model = peft.get_peft_model(torch.nn.Sequential(torch.nn.Linear(256, 256), quantized_layer("Q8_0"),
                                                    torch.nn.LayerNorm(96)), lora_config(target_modules=["0", "1"]))
    x = torch.randn(3, 256)
    with torch.no_grad():
        before = model(x)
    with pytest.raises(ValueError, match="merging a LoRA adapter into a quantized"):
        getattr(model, merge)()
    first = model.base_model.model[0]
    assert isinstance(first, peft.tuners.lora.LoraLayer) and not first.merged
    with torch.no_grad():
        assert torch.equal(model(x), before)
    assert len(peft.get_peft_model_state_dict(model)) == 4


def test_a_refused_adapter_file_leaves_the_model_as_it_came(model_path, tmp_path):
    """PEFT puts an adapter's layers into the model before load_adapter checks
    the file: a refused one leaves a fresh model without them (its outputs,
    not the NaN ones of the refused adapter) and a PEFT model without the
    refused adapter (save_pretrained would write it beside the model's own)."""
    from safetensors.torch import load_file, save_file

    kind, path = model_path
    torch.manual_seed(0)
    peft.get_peft_model(load(kind, path), lora_config(target_modules=TARGETS)).save_pretrained(tmp_path / "adapter")
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    good = load_file(weights)
    save_file({k: torch.full_like(v, float("nan")) for k, v in good.items()}, weights)
    ids = torch.tensor([[1, 7, 22, 5]])
    model = load(kind, path)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with pytest.raises(ValueError, match="holds a NaN or infinity"):
        lowbit.lora.load_adapter(model, tmp_path / "adapter")
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    assert trainable and [n for n, p in model.named_parameters() if p.requires_grad] == trainable
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    own = peft.get_peft_model(model, lora_config(target_modules=["q_proj"]), adapter_name="own")
    with pytest.raises(ValueError, match="holds a NaN or infinity"):
        lowbit.lora.load_adapter(own, tmp_path / "adapter", adapter_name="second")
    assert list(own.peft_config) == ["own"]
    assert all(set(m.lora_A) <= {"own"} for m in own.modules() if isinstance(m, lowbit.lora.QuantizedLoraLinear))
    save_file(good, weights)
    assert lowbit.lora.load_adapter(own, tmp_path / "adapter", adapter_name="second") is own


def saving_model(tmp_path, trained=False, safe_serialization=True, **config):
    """A tiny GGUF model's path, an adapter saved over it (lora_config's
    r=4, lora_alpha=8 on q_proj and v_proj, or as `config` says; lora_B drawn
    at random where `trained`, so that it changes the logits), and the PEFT
    model that saved it."""
    path = tiny_models.write_tiny_gguf(tmp_path / "tiny.gguf", tiny_models.tiny_model("llama", 0), "llama")
    torch.manual_seed(0)
    saved = peft.get_peft_model(lowbit.load_gguf_model(path),
                                lora_config(**{"target_modules": ["q_proj", "v_proj"], **config}))
    if trained:
        with torch.no_grad():
            for name, p in saved.named_parameters():
                if "lora_B" in name:
                    p.normal_()
    saved.save_pretrained(tmp_path / "adapter", safe_serialization=safe_serialization)
    return path, tmp_path / "adapter", saved


def saved_adapter(tmp_path):
    """saving_model's model path and adapter directory."""
    return saving_model(tmp_path)[:2]


def assert_loads_as_saved(path, adapter, saved):
    """load_adapter puts `adapter` onto the model at `path` with the logits of `saved`, the model that saved it;
    returns the PEFT model."""
    ids = torch.tensor([[1, 7, 22, 5]])
    model = lowbit.lora.load_adapter(lowbit.load_gguf_model(path), adapter)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, saved(input_ids=ids).logits)
    return model


def assert_refused_as_it_came(path, adapter, match):
    """load_adapter refuses `adapter` with a ValueError matching `match`, the model left without adapter layers."""
    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with pytest.raises(ValueError, match=match):
        lowbit.lora.load_adapter(model, adapter)
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


@pytest.mark.parametrize("key, value, says", [
    ("r", 10**9, "r must be an integer from 1 to 64"),  # PEFT would allocate 10^9 x in_features per layer
    ("r", 0, "r must be an integer from 1 to 64"),
    ("r", 4.0, "r must be an integer"),
    ("r", "4", "r must be an integer"),
    ("rank_pattern", {"q_proj": 10**9}, r"rank_pattern\['q_proj'\] must be an integer from 1 to 64"),
    ("rank_pattern", [4], "rank_pattern must be an object"),
    ("lora_alpha", float("nan"), "lora_alpha must be a number of magnitude"),  # every logit NaN
    ("lora_alpha", float("inf"), "lora_alpha must be a number of magnitude"),
    ("lora_alpha", 1e300, "lora_alpha must be a number of magnitude"),
    ("lora_alpha", 0, "lora_alpha must be a number of magnitude"),  # the adapter would add nothing
    ("lora_alpha", "8", "lora_alpha must be a number"),
    ("alpha_pattern", {"v_proj": float("nan")}, r"alpha_pattern\['v_proj'\] must be a number"),
    ("peft_type", "IA3", "peft_type must be 'LORA'"),
    ("target_modules", ["q_proj", 1], "target_modules must be a regex or a list of module names"),
    ("layers_to_transform", "0", "layers_to_transform must be a layer index or a list of them"),
    ("bias", "some", "bias must be one of"),  # PEFT refuses it after putting the adapter's layers in
])
def test_load_adapter_refuses_config_values_before_peft_reads_them(tmp_path, key, value, says):
    """Ranks the file's lora_A tensors do not hold, alphas that are not a
    finite, non-zero scale, values of types PEFT fails on deep inside, and
    what PEFT refuses only after it has changed the model are refused naming
    adapter_config.json and the key, the model left as it came."""
    import json

    path, adapter = saved_adapter(tmp_path)
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), key: value}))
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(config_file))}: {says}")


def test_an_adapter_whose_rank_pattern_covers_every_layer_loads(tmp_path):
    """The config's r, overridden by rank_pattern in every layer, is no rank
    of the file's tensors: the adapter loads, to the saving model's logits."""
    assert_loads_as_saved(*saving_model(tmp_path, r=64, rank_pattern={"q_proj": 2, "v_proj": 4}))


def test_an_adapter_saved_in_torchs_pickle_format_loads(tmp_path):
    """PEFT's other weights file, adapter_model.bin (save_pretrained with
    safe_serialization=False), is checked as the safetensors one is and
    loads, to the saving model's logits; an unreadable one is refused naming it."""
    path, adapter, saved = saving_model(tmp_path, trained=True, safe_serialization=False)
    weights = adapter / "adapter_model.bin"
    assert weights.exists() and not (adapter / "adapter_model.safetensors").exists()
    assert_loads_as_saved(path, adapter, saved)
    weights.write_bytes(weights.read_bytes()[:100])
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(weights))}: unreadable")


def test_load_adapter_refuses_unreadable_files_naming_them(tmp_path):
    """A config that is no JSON, weights truncated, missing (PEFT would look
    for the directory on the Hugging Face Hub, its adapter's layers already
    in the model) or a symlink loop: each refused naming the file, the model
    left as it came."""
    path, adapter = saved_adapter(tmp_path)
    config_file, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    config, good = config_file.read_text(), weights.read_bytes()
    config_file.write_text(config[:100])
    assert_refused_as_it_came(path, adapter, f"{re.escape(str(config_file))}: unreadable adapter config")
    config_file.write_text(config)
    weights.write_bytes(good[:100])
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(weights))}: unreadable")
    weights.unlink()
    assert_refused_as_it_came(path, adapter, f"{re.escape(str(weights))}: cannot read the adapter weights file")
    weights.symlink_to(weights)
    assert_refused_as_it_came(path, adapter, f"{re.escape(str(weights))}: cannot read the adapter weights file")


def test_load_adapter_refuses_arguments_of_the_wrong_kind(tmp_path, monkeypatch):
    """An empty path is the working directory, whose adapter would be read;
    None failed in os.fspath naming no argument; is_trainable="False" read
    as truth; a model that is no module failed only after the files."""
    path, adapter = saved_adapter(tmp_path)
    monkeypatch.chdir(adapter)  # an adapter in the working directory: "" would load it
    model = lowbit.load_gguf_model(path)
    with pytest.raises(ValueError, match="^lowbit.lora.load_adapter: path must be a file or directory path, got an "
                                         "empty one$"):
        lowbit.lora.load_adapter(model, "")
    for bad in (None, 3):
        with pytest.raises(TypeError, match=f"^lowbit.lora.load_adapter: path must be a str or os.PathLike, got "
                                            f"{type(bad).__name__}$"):
            lowbit.lora.load_adapter(model, bad)
    for bad in ("False", None, 0):
        with pytest.raises(ValueError, match=f"^lowbit.lora.load_adapter: is_trainable must be True or False, got "
                                             f"{re.escape(repr(bad))}$"):
            lowbit.lora.load_adapter(model, adapter, is_trainable=bad)
    with pytest.raises(TypeError, match="^lowbit.lora.load_adapter: model must be an nn.Module, got NoneType$"):
        lowbit.lora.load_adapter(None, adapter)
    # torch's ModuleDict refused these inside PEFT, by a KeyError or TypeError that named no argument.
    for bad in ("", "a.b"):
        with pytest.raises(ValueError, match=f"^lowbit.lora.load_adapter: adapter_name must be a non-empty name "
                                             f"without '.', got {re.escape(repr(bad))}$"):
            lowbit.lora.load_adapter(model, adapter, adapter_name=bad)
    for bad in (None, 5):
        with pytest.raises(TypeError, match=f"^lowbit.lora.load_adapter: adapter_name must be a str, got "
                                            f"{type(bad).__name__}$"):
            lowbit.lora.load_adapter(model, adapter, adapter_name=bad)
    assert not any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())


def test_load_adapter_refuses_tensors_apart_from_their_layers(tmp_path):
    """A rank_pattern rank the file's tensor does not hold, and a lora_A one
    input column short: torch's load fails after PEFT has put the adapter's
    layers into the model; refused naming the file, the model left as it came."""
    import json

    from safetensors.torch import load_file, save_file

    path, adapter = saved_adapter(tmp_path)
    config_file, weights = adapter / "adapter_config.json", adapter / "adapter_model.safetensors"
    config, good = json.loads(config_file.read_text()), load_file(weights)
    config_file.write_text(json.dumps({**config, "rank_pattern": {"v_proj": 2}}))
    says = f"load_adapter: {re.escape(str(adapter))}: the adapter's tensors do not fit its layers in the model: .*"
    assert_refused_as_it_came(path, adapter, says + "v_proj.lora_A")
    config_file.write_text(json.dumps(config))
    name = next(k for k in good if "q_proj.lora_A" in k)
    save_file({**good, name: good[name][:, 1:].contiguous()}, weights)
    assert_refused_as_it_came(path, adapter, says + "q_proj.lora_A")


@pytest.mark.parametrize("change, says", [
    (lambda t: t.to(torch.int32), "is torch.int32, not a float tensor"),  # loads as zeros: the adapter adds nothing
    (lambda t: t > 0, "is torch.bool, not a float tensor"),
    (lambda t: t.double() * 1e300, "holds a NaN or infinity"),  # finite in float64, inf in the float32 layer
])
def test_load_adapter_refuses_tensors_the_layers_cannot_hold(tmp_path, change, says):
    """Integer and bool tensors, which torch's load casts into the float
    layers, and float64 values past float32's range, inf once loaded, are
    refused naming the file and the tensor, the model left as it came."""
    from safetensors.torch import load_file, save_file

    path, adapter = saved_adapter(tmp_path)
    weights = adapter / "adapter_model.safetensors"
    good = load_file(weights)
    name = next(k for k in good if "lora_B" in k)
    save_file({**good, name: change(good[name])}, weights)
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(adapter))}: tensor "
                                             f"'{re.escape(name)}' {says}")


def test_load_adapter_refuses_named_pipes_without_opening_them(tmp_path):
    """A named pipe for either file would block the reader for good: refused by name."""
    from test_gptq_checkpoint import run_isolated

    path, adapter = saved_adapter(tmp_path)
    for name, what in (("adapter_model.safetensors", "adapter weights file"),
                       ("adapter_config.json", "adapter config")):
        (adapter / name).unlink()
        os.mkfifo(adapter / name)
        out, _ = run_isolated(f"""
            import lowbit, lowbit.lora
            try:
                lowbit.lora.load_adapter(lowbit.load_gguf_model({str(path)!r}), {str(adapter)!r})
            except ValueError as e:
                print(type(e).__name__, e)
        """, timeout=60)
        assert out == f"ValueError {adapter / name}: the {what} is not a regular file\n"


@pytest.mark.parametrize("key, value", [
    ("target_modules", "(.*.)*q_proj"), ("exclude_modules", "(.*.)*x"), ("layers_pattern", "(.*.)*x"),
    ("rank_pattern", {"(.*.)*q_proj": 2}), ("alpha_pattern", {"(.*.)*v_proj": 4}),
])
def test_load_adapter_refuses_patterns_that_backtrack(tmp_path, key, value):
    """A regular expression of the config that backtracks catastrophically
    over the model's module names would hang PEFT's load for good (Python's
    re has no timeout): refused naming adapter_config.json and the key, in
    about PATTERN_SECONDS."""
    import json

    from test_gptq_checkpoint import run_isolated

    path, adapter = saved_adapter(tmp_path)
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), key: value}))
    out, seconds = run_isolated(f"""
        import lowbit, lowbit.lora
        lowbit.lora.PATTERN_SECONDS = 2.0
        try:
            lowbit.lora.load_adapter(lowbit.load_gguf_model({str(path)!r}), {str(adapter)!r})
        except ValueError as e:
            print(type(e).__name__, e)
    """, timeout=90)
    expression = value if isinstance(value, str) else next(iter(value))
    assert out.startswith(f"ValueError lowbit.lora.load_adapter: {config_file}: {key} holds {expression!r}, which "
                          "takes more than 2 s to match the model's "), out


@pytest.mark.parametrize("key, value", [("target_modules", "(q_proj"), ("rank_pattern", {"v_proj)": 2})])
def test_load_adapter_refuses_patterns_that_do_not_compile(tmp_path, key, value):
    """An expression that is no regular expression raises re.error inside
    PEFT, naming neither file nor key: refused naming both, the model left as it came."""
    import json

    path, adapter = saved_adapter(tmp_path)
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), key: value}))
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(config_file))}: {key} holds .*, no "
                                             "regular expression PEFT can use")


def test_an_adapter_targeting_by_regular_expression_loads(tmp_path):
    """The pattern check passes the regular expressions PEFT users write:
    target_modules as one, a rank_pattern key; the adapter gives the saving
    model's logits."""
    assert_loads_as_saved(*saving_model(tmp_path, trained=True, target_modules=r".*\.(q_proj|v_proj)",
                                        rank_pattern={r"layers\.0\.self_attn\.q_proj": 2}))


# PEFT warns, naming every one of the 1024 excluded names, that none of them is a module: as the test means.
@pytest.mark.filterwarnings("ignore:You have passed exclude_modules:UserWarning")
@pytest.mark.parametrize("key", ["target_modules", "exclude_modules"])
def test_load_adapter_refuses_lists_of_names_of_no_module(tmp_path, key):
    """More than MAX_UNMATCHED_NAMES distinct names of no module in a list
    (PEFT's matching and minimal-suffix search take time growing with their
    square) are refused naming the file and the key; as many as that load."""
    import json

    path, adapter = saved_adapter(tmp_path)
    config_file = adapter / "adapter_config.json"
    config = json.loads(config_file.read_text())
    listed = config["target_modules"] if key == "target_modules" else []
    names = [f"absent_{i}" for i in range(lowbit.lora.MAX_UNMATCHED_NAMES)]
    config_file.write_text(json.dumps({**config, key: listed + names}))
    lowbit.lora.load_adapter(lowbit.load_gguf_model(path), adapter)
    config_file.write_text(json.dumps({**config, key: listed + names + ["absent_x"]}))
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(config_file))}: {key} lists 1025 names of "
                                             "no module of the model \\(at most 1024\\), such as 'absent_0'")


@pytest.mark.parametrize("layer_map", [[[0, 3]], [[1, 0]], [[0, 1]] * 17, "0-2", [[0, "2"]], [[0, 1], 1]])
def test_load_adapter_refuses_layer_replication_past_the_layers(tmp_path, layer_map):
    """layer_replication ranges outside the model's layers, reversed, of
    more than MAX_REPLICATION times its layers (a range repeated a million
    times clones a million layers) or not ranges are refused naming the
    file and the key, the model left as it came."""
    import json

    path, adapter = saved_adapter(tmp_path)  # a model of 2 decoder layers
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "layer_replication": layer_map}))
    assert_refused_as_it_came(path, adapter, f"load_adapter: {re.escape(str(config_file))}: layer_replication must "
                                             r"be \[start, end\) ranges of the model's 2 decoder layers, at most 16")


def test_a_refused_adapter_with_layer_replication_leaves_the_layers(tmp_path):
    """An adapter with layer_replication loads, its layers rebuilt from the
    model's, to the saving model's logits; refused (a tensor that does not
    fit), the model keeps its own layers and layer count."""
    from safetensors.torch import load_file, save_file

    path, adapter, saved = saving_model(tmp_path, layer_replication=[[0, 2], [1, 2]])
    model = assert_loads_as_saved(path, adapter, saved)
    assert len(model.base_model.model.model.layers) == model.config.num_hidden_layers == 3
    weights = adapter / "adapter_model.safetensors"
    good = load_file(weights)
    name = next(k for k in good if "lora_A" in k)
    save_file({**good, name: good[name][:, 1:].contiguous()}, weights)
    model = lowbit.load_gguf_model(path)
    layers = list(model.model.layers)
    with pytest.raises(ValueError, match="the adapter's tensors do not fit its layers"):
        lowbit.lora.load_adapter(model, adapter)
    assert list(model.model.layers) == layers and model.config.num_hidden_layers == 2
    # Onto a PEFT model, it would rebuild the layers the model's adapters are on.
    save_file(good, weights)
    (tmp_path / "other").mkdir()
    other = saved_adapter(tmp_path / "other")[1]
    model = lowbit.lora.load_adapter(lowbit.load_gguf_model(path), other)
    with pytest.raises(ValueError, match="layer_replication rebuilds the decoder layers, which the model's adapters"):
        lowbit.lora.load_adapter(model, adapter, adapter_name="second")
    assert list(model.peft_config) == ["default"] and len(model.base_model.model.model.layers) == 2
