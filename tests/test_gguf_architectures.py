"""replace_linear and load_gguf_model on each GGUF architecture they load
(tiny_models.MODELS: llama and Mixtral, smollm3, granite, qwen2, qwen3, the Qwen MoEs,
gpt-oss, gemma, gemma2, gemma3, phi3), through files written the
way llama.cpp's converter writes them (gguf_files.write_model_gguf: gguf-py's
name map, llama's Q/K permutation of weights and biases, the Gemma models'
+ 1 on norm weights, each converter's hyperparameter keys, gguf-py's
quantizer), against the transformers model whose weights went through
gguf-py's quantize/dequantize round trip, which needs no file and no lowbit
loader code. (test_llama_cpp_architectures.py runs the same files through
llama.cpp itself.)

Each parameter must arrive exactly (the quantized blocks dequantize to the
reference's weights bit for bit, biases and norms are F32); with every
GGUFLinear swapped for an nn.Linear of its dequantized weight the logits
equal the reference's to fp32 rounding, and as loaded they agree within the
8-bit activation rounding of lowbit's matmul: relative L2 under 2% (measured
0.4-1.0% over 5 seeds), 5% for gemma2 and gemma3 (1.6-1.9% and 2.0-3.7%),
whose norm on each sublayer's output scales a small rounding in a sublayer
that nearly cancels up to the size of the rest."""
import copy
import functools
import re
import warnings

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import lowbit
from gguf_files import byte_level_alphabet, with_embedding, write_model_gguf, write_tokenizer_gguf
from lowbit.fusing import ProjectionSlice
from lowbit.gguf.arch import ARCHITECTURES

transformers = pytest.importorskip("transformers")
from tiny_models import MODELS, PHI3_LONGROPE, is_router, through_q8_0, tiny_model, write_tiny_gguf  # noqa: E402

# Relative L2 of the logits that lowbit's 8-bit activations may cost (see above).
TOLERANCE = {"gemma2": 0.05, "gemma3": 0.05}


def assert_logits_close(got, want, arch):
    assert ((got - want).norm() / want.norm()).item() < TOLERANCE.get(arch, 0.02)


def assert_weights_arrived(model, reference):
    """Every lowbit layer of the loaded model holds the reference's weights
    bit for bit: a GGUFLinear or GGUFEmbedding its module's weight (the tied
    lm_head too) and bias, a GGUFExperts the experts' 3-D gate_up_proj (gate
    rows first; gpt-oss's [in, out] with gate and up interleaved, and its
    biases) and down_proj."""
    expect = dict(reference.named_parameters(remove_duplicate=False))
    # A fused layer (qkv_proj, gate_up_proj) is checked through its slices, each a projection's rows.
    fused = {id(m.outputs.layer) for m in model.modules() if isinstance(m, ProjectionSlice)}
    for name, module in model.named_modules():
        if id(module) in fused and f"{name}.weight" not in expect:
            continue
        if isinstance(module, (lowbit.GGUFLinear, lowbit.GGUFEmbedding, ProjectionSlice)):
            torch.testing.assert_close(module.dequantize(), expect[f"{name}.weight"], rtol=0, atol=0, msg=name)
            if getattr(module, "bias", None) is not None:
                torch.testing.assert_close(module.bias, expect[f"{name}.bias"], rtol=0, atol=0, msg=name)
        elif isinstance(module, lowbit.GGUFExperts):
            w = module.dequantize()
            gate_up, down = expect[f"{name}.gate_up_proj"], expect[f"{name}.down_proj"]
            if module.biased:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
                gate_up = torch.cat([gate_up[:, ::2], gate_up[:, 1::2]], dim=1)
                bias = expect[f"{name}.gate_up_proj_bias"]
                torch.testing.assert_close(torch.cat([module.gate_bias, module.up_bias], dim=1),
                                           torch.cat([bias[:, ::2], bias[:, 1::2]], dim=1), rtol=0, atol=0, msg=name)
                torch.testing.assert_close(module.down_bias, expect[f"{name}.down_proj_bias"], rtol=0, atol=0, msg=name)
            torch.testing.assert_close(torch.cat([w["gate"], w["up"]], dim=1), gate_up, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(w["down"], down, rtol=0, atol=0, msg=name)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expect[name], rtol=0, atol=0, msg=name)


def is_experts(module):
    """transformers' experts module: its experts' weights in 3-D parameters."""
    return isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter)


def replaced_modules(source):
    """The modules replace_linear must replace: every nn.Linear, and every experts module."""
    return sorted(n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear) or is_experts(m))


def with_float_linears(model):
    """A copy of `model` with every GGUFLinear (and projection of a fused
    one) an nn.Linear of its dequantized weight, every GGUFExperts one of F32 blocks (ggml type 0) of its own:
    what the loader placed, without the kernels' 8-bit activations."""
    model = copy.deepcopy(model)
    for name, module in list(model.named_modules()):
        if isinstance(module, lowbit.GGUFExperts):
            f32 = {k: (w.reshape(-1, w.shape[-1]).view(torch.uint8), 0) for k, w in module.dequantize().items()}
            biases = {p: getattr(module, f"{p}_bias") for p in f32} if module.biased else None
            model.set_submodule(name, lowbit.GGUFExperts(f32["gate"], f32["up"], f32["down"], module.num_experts,
                                                         module.hidden_size, module.intermediate_size, module.act_fn,
                                                         glu=module.glu, biases=biases))
        if isinstance(module, (lowbit.GGUFLinear, ProjectionSlice)):  # a fused layer's slices: their rows
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                linear.weight.copy_(module.dequantize())
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            model.set_submodule(name, linear)
    return model


@pytest.mark.parametrize("arch", list(MODELS))
def test_replace_linear_loads_the_architecture(tmp_path, arch):
    source = tiny_model(arch, seed=0)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", source, arch)
    reference = through_q8_0(source)
    model = tiny_model(arch, seed=1)  # other values everywhere: all must come from the file
    report = lowbit.replace_linear(model, path)
    assert report.unplaced == []

    assert_weights_arrived(model, reference)
    assert sorted(report.replaced) == replaced_modules(source)

    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
        exact = with_float_linears(model)(ids).logits
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert_logits_close(got, want, arch)


def test_an_architecture_of_unknown_row_order_is_refused(tmp_path):
    """minicpm's tensors have llama's names, but its converter writes
    multipliers lowbit does not apply; loading must fail, not compute garbage."""
    path = write_model_gguf(str(tmp_path / "minicpm.gguf"), tiny_model("qwen2", seed=0), "minicpm")
    with pytest.raises(ValueError, match=r"architecture 'minicpm' is not supported \(supported: llama, smollm3, granite, "
                                         r"qwen2, qwen3, gemma, gemma2, gemma3, phi3, qwen2moe, qwen3moe, gpt-oss\)"):
        lowbit.replace_linear(tiny_model("qwen2", seed=1), path)


@pytest.mark.parametrize("arch, overrides", [*((arch, {}) for arch in MODELS), ("phi3", PHI3_LONGROPE)],
                         ids=[*MODELS, "phi3-longrope"])
def test_load_gguf_model_builds_the_architecture(tmp_path, arch, overrides):
    """load_gguf_model builds the model from the file alone: the transformers
    class and config of the source, every linear a GGUFLinear, every other
    parameter exactly the file's, no tensor left on the meta device."""
    source = tiny_model(arch, seed=0, **overrides)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", source, arch)
    reference = through_q8_0(source)
    model = lowbit.load_gguf_model(path)

    assert type(model) is type(source) and not model.training
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "tie_word_embeddings", "attention_bias",
                "hidden_act", "hidden_activation", "layer_types", "sliding_window", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "original_max_position_embeddings",
                "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
                "shared_expert_intermediate_size", "norm_topk_prob"):
        assert getattr(model.config, key, None) == getattr(source.config, key, None), key
    assert model.config.rms_norm_eps == pytest.approx(source.config.rms_norm_eps)  # an F32 in the file
    assert model.model.layers[0].self_attn.head_dim == source.model.layers[0].self_attn.head_dim
    # LongRoPE's attention factor: the file's (an F32) where the source computed the same from its config.
    rope = dict(model.config.rope_parameters)
    if "attention_factor" not in source.config.rope_parameters:
        rope.pop("attention_factor", None)
    assert rope == source.config.rope_parameters
    scaling = getattr(source.model.rotary_emb, "attention_scaling", None)  # gemma3's: per layer type
    assert getattr(model.model.rotary_emb, "attention_scaling", None) == pytest.approx(scaling)
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in model.modules())
    assert_weights_arrived(model, reference)
    assert sum(isinstance(m, lowbit.GGUFExperts) for m in model.modules()) == sum(map(is_experts, source.modules()))
    # Nothing float bigger than a norm or bias (or a router, or gpt-oss's
    # experts' biases, which files keep F32, or a fused layer's biases, its
    # projections' joined): every matrix stays in its blocks.
    floats = [*model.named_parameters(), *model.named_buffers()]
    assert max(t.numel() for n, t in floats if t.is_floating_point() and not is_router(n)
               and not n.endswith(("experts.gate_bias", "experts.up_bias", "experts.down_bias",
                                   "qkv_proj.bias", "qk_proj.bias", "gate_up_proj.bias"))) <= 64
    for name, b in model.named_buffers():
        assert not b.is_meta, name
    rotary = dict(model.model.rotary_emb.named_buffers())  # gemma3's: one inv_freq per layer type
    for name, b in reference.model.rotary_emb.named_buffers():
        torch.testing.assert_close(rotary[name], b, rtol=0, atol=0, msg=name)

    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
        exact = with_float_linears(model)(ids).logits
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert_logits_close(got, want, arch)


def test_load_gguf_model_applies_rope_freqs(tmp_path):
    """Llama 3.1+ files carry their rope scaling as rope_freqs (llama.cpp
    divides each frequency by its factor); the model must rotate the same:
    exactly what replace_linear gives a model whose frequencies were divided
    by hand, and not what it gives one whose were not."""
    source = tiny_model("llama", seed=0)
    with torch.no_grad():  # sharper attention, so that positions move the logits
        for name, p in source.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4)
    factors = np.linspace(1.0, 8.0, source.config.head_dim // 2, dtype=np.float32)
    path = write_model_gguf(str(tmp_path / "llama31.gguf"), source, "llama", extra_tensors={"rope_freqs.weight": factors})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rope_freqs has a place: no "unplaced" warning
        model = lowbit.load_gguf_model(path)
    expect = source.model.rotary_emb.inv_freq / torch.from_numpy(factors)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, expect, rtol=0, atol=0)

    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    logits = {}
    for divided in (True, False):
        by_hand = tiny_model("llama", seed=1)
        if divided:
            by_hand.model.rotary_emb.inv_freq = expect.clone()
        with pytest.warns(UserWarning, match=r"no place in the model: \['rope_freqs.weight'\]"):
            lowbit.replace_linear(by_hand, path)
        with torch.no_grad():
            logits[divided] = by_hand(ids).logits
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, logits[True], rtol=0, atol=0)
    assert ((got - logits[False]).norm() / got.norm()).item() > 1e-3  # measured 6e-3


def test_rope_freqs_where_the_rotary_embedding_has_no_single_table_is_refused(tmp_path):
    source = tiny_model("gemma3", seed=0)
    factors = np.ones(source.config.head_dim // 2, dtype=np.float32)
    path = write_model_gguf(str(tmp_path / "gemma3.gguf"), source, "gemma3",
                            extra_tensors={"rope_freqs.weight": factors})
    with pytest.raises(lowbit.GGUFError, match=re.escape(f"{path}: rope_freqs.weight: the Gemma3ForCausalLM's rotary "
                                                         "embedding has no single frequency table")):
        lowbit.load_gguf_model(path)


@pytest.mark.parametrize("arch, name, module", [
    ("llama", "blk.1.attn_q.bias", "model.layers.1.self_attn.q_proj"),  # attention_bias is read from blk.0
    ("qwen2", "blk.0.attn_output.bias", "model.layers.0.self_attn.o_proj"),  # qwen2's o_proj has none
])
def test_a_bias_of_a_layer_built_without_one_is_refused(tmp_path, arch, name, module):
    source = tiny_model(arch, seed=0, **({"attention_bias": False} if arch == "llama" else {}))
    path = write_model_gguf(str(tmp_path / f"{arch}.gguf"), source, arch,
                            extra_tensors={name: np.zeros(source.config.hidden_size, np.float32)})
    with pytest.raises(lowbit.GGUFError, match=re.escape(f"{path}: tensor {name!r} is a bias of {module}, which the "
                                                         "model has none of")):
        lowbit.load_gguf_model(path)


def test_replace_linear_takes_any_path_spelling_of_a_gguf_file(tmp_path):
    """A bytes path and an upper-case .GGUF are the GGUF file still (not a GPTQ checkpoint); a checkpoint_format,
    which only GPTQ checkpoints have, is refused rather than ignored."""
    source = tiny_model("llama", seed=0)
    path = write_model_gguf(str(tmp_path / "upper.GGUF"), source, "llama")
    for spelling in (path, path.encode()):
        model = tiny_model("llama", seed=1)
        lowbit.replace_linear(model, spelling)
        assert isinstance(model.model.layers[0].self_attn.q_proj, lowbit.GGUFLinear)
    with pytest.raises(ValueError, match="replace_linear: checkpoint_format is a GPTQ checkpoint's; .* is a GGUF"):
        lowbit.replace_linear(tiny_model("llama", seed=1), path, checkpoint_format="gptq_v2")
    # Neither a path nor a model: refused naming the argument, before anything is read.
    for bad, error, says in ((None, TypeError, "path must be a str or os.PathLike, got NoneType"),
                             (3, TypeError, "path must be a str or os.PathLike, got int"),
                             ("", ValueError, "path must be a file or directory path, got an empty one")):
        with pytest.raises(error, match=f"^replace_linear: {says}$"):
            lowbit.replace_linear(tiny_model("llama", seed=1), bad)
    for bad in (None, tiny_model("llama", seed=1).state_dict()):
        with pytest.raises(TypeError, match="^replace_linear: model must be an nn.Module, got "):
            lowbit.replace_linear(bad, path)


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_load_gguf_model_in_bf16(tmp_path, arch):
    source = tiny_model(arch, seed=0)
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", source, arch), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32  # positions stay exact
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    embedding = model.get_input_embeddings()
    assert embedding(ids).dtype == torch.bfloat16
    if arch == "gemma2":  # scaled as transformers' ScaledWordEmbedding scales: in the output's dtype
        assert embedding.embed_scale.dtype == torch.bfloat16
        rows = embedding.dequantize()[ids[0]]
        torch.testing.assert_close(embedding(ids)[0], rows * embedding.embed_scale, rtol=0, atol=0)
    with torch.no_grad():
        got, want = model(ids).logits.float(), through_q8_0(source)(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.05  # bf16 activations and norms (measured 0.8-1.9%)


def test_load_gguf_model_refuses_bad_files(tmp_path):
    path = write_model_gguf(str(tmp_path / "minicpm.gguf"), tiny_model("qwen2", seed=0), "minicpm")
    with pytest.raises(lowbit.GGUFError, match=r"load_gguf_model: .*minicpm.gguf: metadata 'general.architecture': "
                                               r"GGUF architecture 'minicpm' is not supported"):
        lowbit.load_gguf_model(path)
    wrong = np.ones(5, dtype=np.float32)
    path = write_model_gguf(str(tmp_path / "llama.gguf"), tiny_model("llama", seed=0), "llama",
                            extra_tensors={"rope_freqs.weight": wrong})
    with pytest.raises(ValueError, match=r"llama.gguf: rope_freqs.weight has shape \(5,\), the model's rotary embedding \(8,\)"):
        lowbit.load_gguf_model(path)
    # Divisors that would make NaN or inf rotation tables (whose logits stay finite).
    for value, says in ((np.nan, "a non-finite value"), (0.0, r"0.0 at \[3\], where every value must be > 0"),
                        (-2.0, r"-2.0 at \[3\]")):
        bad = np.ones(8, dtype=np.float32)
        bad[3] = value
        path = write_model_gguf(str(tmp_path / "freqs.gguf"), tiny_model("llama", seed=0), "llama",
                                extra_tensors={"rope_freqs.weight": bad})
        with pytest.raises(ValueError, match=rf"load_gguf_model: .*freqs.gguf: rope_freqs.weight holds {says}"):
            lowbit.load_gguf_model(path)


def test_a_file_s_names_are_cut_in_messages(tmp_path):
    """A GGUF file's strings may be megabytes long, and its tensors many:
    the errors and warnings that name them show each cut, and a few of a
    list with how many more there are."""
    model = cached_tiny_model("llama")
    path = write_tiny_gguf(tmp_path / "arch.gguf", model, "llama", extra_metadata={"general.architecture": "m" * 10**6})
    with pytest.raises(lowbit.GGUFError, match=r"metadata 'general.architecture': GGUF architecture 'm+\.\.\.m+' "
                                               r"\(1000000 characters\) is not supported") as info:
        lowbit.load_gguf_model(path)
    assert len(str(info.value)) < len(path) + 400
    extra = {f"unused.{i}." + "y" * 10**5 + ".weight": np.zeros(4, np.float32) for i in range(20)}
    path = write_tiny_gguf(tmp_path / "extra.gguf", model, "llama", extra_tensors=extra)
    with pytest.warns(UserWarning, match=r"tensors with no place in the model: \['unused\.0\.y+\.\.\.y+\.weight' "
                                         r"\(100016 characters\), .*, and 15 more\]$") as warned:
        lowbit.load_gguf_model(path)
    assert max(len(str(w.message)) for w in warned) < len(path) + 1000


@functools.cache
def cached_tiny_model(arch):
    return tiny_model(arch, seed=0)


def refused(tmp_path, arch, changes, key):
    """The tiny `arch` model's file with metadata `changes` (None: the key
    left out) must be refused by load_gguf_model with a GGUFError naming the
    file and `key`, and no other exception."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", cached_tiny_model(arch), arch, extra_metadata=changes)
    with pytest.raises(lowbit.GGUFError) as info:
        lowbit.load_gguf_model(path)
    assert path in str(info.value) and repr(key) in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("count, problem", [
    (3, "no blk.2.* tensors"),  # a layer no tensor fills
    (100000, "no blk.2.* tensors"),  # checked before a model of that many layers is built
    (2**31 - 1, "no blk.2.* tensors"),
    (2**63, "must be <= 2147483647"),  # past the 32 bits llama.cpp reads it in
    (1, "tensors of layer 1 (blk.1.*)"),  # a layer the model would drop
])
def test_block_count_must_match_the_layers_of_the_file(tmp_path, count, problem):
    """The tiny llama has 2 layers: llama.block_count says how many the model
    builds, and must be exactly the layers the file's blk.N tensors hold."""
    assert problem in refused(tmp_path, "llama", {"llama.block_count": count}, "llama.block_count")


def test_a_layer_number_of_thousands_of_digits_is_refused_naming_the_file(tmp_path):
    """Past int()'s 4300 digits a layer number raised a bare ValueError."""
    name = f"blk.{'9' * 5000}.attn_q.weight"
    path = write_tiny_gguf(tmp_path / "llama.gguf", cached_tiny_model("llama"), "llama",
                           extra_tensors={name: np.zeros(4, np.float32)})
    with pytest.raises(lowbit.GGUFError, match=rf"^load_gguf_model: {re.escape(path)}: metadata 'llama.block_count': "
                                               r"2 layers, but the file has tensor 'blk.9999"):
        lowbit.load_gguf_model(path)


# Per case: the tiny model, its metadata changes (None: the key left out),
# and the key the error must name. The tiny llama: hidden 64, 4 heads of 16
# (2 KV heads), FFN 96, vocabulary 64, 2 layers.
BAD_METADATA = {
    "head count 0": ("llama", {"llama.attention.head_count": 0}, "llama.attention.head_count"),
    "head count a string": ("llama", {"llama.attention.head_count": "4"}, "llama.attention.head_count"),
    "head count missing": ("llama", {"llama.attention.head_count": None}, "llama.attention.head_count"),
    "head count not dividing the embedding": (
        "llama", {"llama.attention.head_count": 6, "llama.attention.key_length": None}, "llama.attention.head_count"),
    "KV head count 0": ("llama", {"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv"),
    "KV head count not dividing the heads": ("llama", {"llama.attention.head_count_kv": 3},
                                             "llama.attention.head_count_kv"),
    "embedding length 0": ("llama", {"llama.embedding_length": 0}, "llama.embedding_length"),
    "embedding length negative": ("llama", {"llama.embedding_length": -64}, "llama.embedding_length"),
    "embedding length missing": ("llama", {"llama.embedding_length": None}, "llama.embedding_length"),
    "context length 0": ("llama", {"llama.context_length": 0}, "llama.context_length"),
    # Integers past the 32 bits llama.cpp reads them in.
    "context length 2^63": ("llama", {"llama.context_length": 2**63}, "llama.context_length"),
    "context length 2^31": ("llama", {"llama.context_length": 2**31}, "llama.context_length"),
    "embedding length 2^40": ("llama", {"llama.embedding_length": 2**40}, "llama.embedding_length"),
    "expert count 2^40": ("qwen3moe", {"qwen3moe.expert_count": 2**40}, "qwen3moe.expert_count"),
    "window 2^63": ("gemma2", {"gemma2.attention.sliding_window": 2**63}, "gemma2.attention.sliding_window"),
    # Sizes the tensors contradict, refused before a model is built of them.
    "embedding length not the embedding's": ("llama", {"llama.embedding_length": 128}, "llama.embedding_length"),
    "vocabulary size not the embedding's": ("llama", {"llama.vocab_size": 100}, "llama.vocab_size"),
    "more experts than the router's": ("qwen3moe", {"qwen3moe.expert_count": 1000}, "qwen3moe.expert_count"),
    "fewer experts than the router's": ("mixtral", {"llama.expert_count": 3}, "llama.expert_count"),
    "gpt-oss experts not the router's": ("gpt-oss", {"gpt-oss.expert_count": 8}, "gpt-oss.expert_count"),
    "feed-forward length 0": ("llama", {"llama.feed_forward_length": 0}, "llama.feed_forward_length"),
    "feed-forward length a float": ("llama", {"llama.feed_forward_length": 96.0}, "llama.feed_forward_length"),
    "block count a bool": ("llama", {"llama.block_count": True}, "llama.block_count"),
    "block count a string": ("llama", {"llama.block_count": "2"}, "llama.block_count"),
    "block count missing": ("llama", {"llama.block_count": None}, "llama.block_count"),
    "norm epsilon a string": ("llama", {"llama.attention.layer_norm_rms_epsilon": "1e-5"},
                              "llama.attention.layer_norm_rms_epsilon"),
    "norm epsilon 0": ("llama", {"llama.attention.layer_norm_rms_epsilon": 0.0},
                       "llama.attention.layer_norm_rms_epsilon"),
    "norm epsilon NaN": ("llama", {"llama.attention.layer_norm_rms_epsilon": float("nan")},
                         "llama.attention.layer_norm_rms_epsilon"),
    "norm epsilon negative": ("llama", {"llama.attention.layer_norm_rms_epsilon": -1e-5},
                              "llama.attention.layer_norm_rms_epsilon"),
    "norm epsilon 1e30": ("llama", {"llama.attention.layer_norm_rms_epsilon": 1e30},
                          "llama.attention.layer_norm_rms_epsilon"),
    "key length 0": ("llama", {"llama.attention.key_length": 0}, "llama.attention.key_length"),
    "rotary dimensions a string": ("llama", {"llama.rope.dimension_count": "16"}, "llama.rope.dimension_count"),
    "rope base a string": ("llama", {"llama.rope.freq_base": "1e4"}, "llama.rope.freq_base"),
    "rope base 0": ("llama", {"llama.rope.freq_base": 0.0}, "llama.rope.freq_base"),
    "rope base negative": ("llama", {"llama.rope.freq_base": -1e4}, "llama.rope.freq_base"),
    "rope base NaN": ("llama", {"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base"),
    "rope base inf": ("llama", {"llama.rope.freq_base": float("inf")}, "llama.rope.freq_base"),
    "rope base 1e30": ("llama", {"llama.rope.freq_base": 1e30}, "llama.rope.freq_base"),
    "sliding rope base 1e30": ("gemma3", {"gemma3.rope.freq_base_swa": 1e30}, "gemma3.rope.freq_base_swa"),
    # (linear scaling without a factor, or with one of 0, is none: llama.cpp's reading)
    "rope scaling without its factor": ("llama", {"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.factor"),
    "rope scaling factor 0": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 0.0},
                              "llama.rope.scaling.factor"),
    "yarn without its original context": ("llama", {"llama.rope.scaling.type": "yarn",
                                                    "llama.rope.scaling.factor": 4.0},
                                          "llama.rope.scaling.original_context_length"),
    # Below 1, llama.cpp scales attention by 1 + 0.1 ln(factor), transformers by 1.
    "yarn factor below 1": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 0.25,
                                      "llama.rope.scaling.original_context_length": 16}, "llama.rope.scaling.factor"),
    # Reversed betas: llama.cpp steps between the correction dimensions, transformers ramps backwards.
    "yarn betas reversed": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                      "llama.rope.scaling.original_context_length": 16,
                                      "llama.rope.scaling.yarn_beta_slow": 64.0}, "llama.rope.scaling.yarn_beta_fast"),
    "rope scaling type a number": ("llama", {"llama.rope.scaling.type": 2}, "llama.rope.scaling.type"),
    # Scales past lowbit._checks.MAX_SCALE either way: NaN or inf logits, or float16 activations
    # overflowing or flushed to zero.
    "linear rope factor 1e-30": ("llama", {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 1e-30},
                                 "llama.rope.scaling.factor"),
    "linear rope factor 1e30": ("llama", {"llama.rope.scaling.factor": 1e30}, "llama.rope.scaling.factor"),
    "yarn factor 1e30": ("llama", {"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 1e30,
                                   "llama.rope.scaling.original_context_length": 16}, "llama.rope.scaling.factor"),
    "granite embedding scale 1e30": ("granite", {"granite.embedding_scale": 1e30}, "granite.embedding_scale"),
    "granite residual scale 1e30": ("granite", {"granite.residual_scale": 1e30}, "granite.residual_scale"),
    "granite attention scale 1e-30": ("granite", {"granite.attention.scale": 1e-30}, "granite.attention.scale"),
    "granite logit scale 1e-30": ("granite", {"granite.logit_scale": 1e-30}, "granite.logit_scale"),
    "softcap 1e-30": ("gemma2", {"gemma2.attn_logit_softcapping": 1e-30}, "gemma2.attn_logit_softcapping"),
    "final softcap 1e30": ("gemma2", {"gemma2.final_logit_softcapping": 1e30}, "gemma2.final_logit_softcapping"),
    "gemma3 final softcap 1e-30": ("gemma3", {"gemma3.final_logit_softcapping": 1e-30},
                                   "gemma3.final_logit_softcapping"),
    "vocabulary size 0": ("llama", {"llama.vocab_size": 0}, "llama.vocab_size"),
    "vocabulary size missing": ("llama", {"llama.vocab_size": None}, "llama.vocab_size"),
    "bos outside the vocabulary": ("llama", {"tokenizer.ggml.bos_token_id": 64}, "tokenizer.ggml.bos_token_id"),
    "eos negative": ("llama", {"tokenizer.ggml.eos_token_id": -1}, "tokenizer.ggml.eos_token_id"),
    "padding outside the vocabulary": ("llama", {"tokenizer.ggml.padding_token_id": 1000},
                                       "tokenizer.ggml.padding_token_id"),
    "padding a string": ("llama", {"tokenizer.ggml.padding_token_id": "0"}, "tokenizer.ggml.padding_token_id"),
    "architecture a number": ("llama", {"general.architecture": 7}, "general.architecture"),
    "expert count a string": ("llama", {"llama.expert_count": "4"}, "llama.expert_count"),
    "experts without a used count": ("llama", {"llama.expert_count": 4}, "llama.expert_used_count"),
    "more experts used than exist": ("qwen3moe", {"qwen3moe.expert_used_count": 5}, "qwen3moe.expert_used_count"),
    "shared expert FFN 0": ("qwen2moe", {"qwen2moe.expert_shared_feed_forward_length": 0},
                            "qwen2moe.expert_shared_feed_forward_length"),
    "softcap a string": ("gemma2", {"gemma2.attn_logit_softcapping": "50"}, "gemma2.attn_logit_softcapping"),
    "window pattern for 3 layers": ("gemma3", {"gemma3.attention.sliding_window_pattern": [1, 0, 1]},
                                    "gemma3.attention.sliding_window_pattern"),
    "gpt-oss without its window": ("gpt-oss", {"gpt-oss.attention.sliding_window": None},
                                   "gpt-oss.attention.sliding_window"),
    "granite without its logit scale": ("granite", {"granite.logit_scale": None}, "granite.logit_scale"),
    "granite logit scale 0": ("granite", {"granite.logit_scale": 0.0}, "granite.logit_scale"),
    "phi3 original context 0": ("phi3", {"phi3.rope.scaling.original_context_length": 0},
                                "phi3.rope.scaling.original_context_length"),
}


@pytest.mark.parametrize("arch, changes, key", BAD_METADATA.values(), ids=BAD_METADATA)
def test_bad_metadata_is_a_gguf_error_naming_the_key(tmp_path, arch, changes, key):
    refused(tmp_path, arch, changes, key)


@pytest.mark.parametrize("arch, changes, says", [
    # Heads that do not divide the embedding, with a head size of their own: transformers' validator refuses them.
    ("llama", {"llama.attention.head_count": 3, "llama.attention.head_count_kv": 1},
     "not a multiple of the number of attention heads"),
])
def test_metadata_that_makes_no_model_is_a_gguf_error(tmp_path, arch, changes, says):
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", cached_tiny_model(arch), arch, extra_metadata=changes)
    with pytest.raises(lowbit.GGUFError, match=rf"load_gguf_model: {re.escape(path)}: the config does not make a "
                                               rf"model: .*{says}"):
        lowbit.load_gguf_model(path)


@pytest.mark.parametrize("arch, key, value", [
    ("qwen2", "qwen2.attention.layer_norm_rms_epsilon", 0.5),
    ("llama", "llama.attention.head_count", 2),
    ("gemma2", "gemma2.rope.freq_base", 5e5),
])
def test_replace_linear_compares_the_config_where_the_file_makes_none(tmp_path, arch, key, value):
    """A file with no vocabulary size (no token list, no {arch}.vocab_size)
    makes no whole config, but its epsilon, head counts and rotary base
    still fix the results: a model's config contradicting them is refused,
    one agreeing with them filled."""
    model = cached_tiny_model(arch)
    no_vocab = {"tokenizer.ggml.tokens": None, f"{arch}.vocab_size": None}
    path = write_tiny_gguf(tmp_path / "agrees.gguf", model, arch, extra_metadata=no_vocab)
    lowbit.replace_linear(copy.deepcopy(model), path)
    path = write_tiny_gguf(tmp_path / "contradicts.gguf", model, arch, extra_metadata={**no_vocab, key: value})
    with pytest.raises(lowbit.GGUFError, match=rf"^replace_linear: {re.escape(path)}: the model's config has .* the "
                                               rf"file's metadata {value!r}"):
        lowbit.replace_linear(copy.deepcopy(model), path)


@pytest.mark.parametrize("arch, key, value", [
    ("qwen3moe", "qwen3moe.expert_used_count", 1),
    ("mixtral", "llama.expert_used_count", 1),
    ("granite", "granite.logit_scale", 40.0),
    ("granite", "granite.attention.scale", None),  # llama.cpp's default: 1 / sqrt(head)
    ("gemma2", "gemma2.final_logit_softcapping", 3.0),
])
def test_replace_linear_refuses_a_model_routing_or_scaling_otherwise(tmp_path, arch, key, value):
    """The experts each token takes, a softcap or a Granite multiplier fit
    every weight and change every result: the model's config against the file's."""
    model = cached_tiny_model(arch)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", model, arch, extra_metadata={key: value})
    with pytest.raises(lowbit.GGUFError, match=rf"^replace_linear: {re.escape(path)}: the model's config has "):
        lowbit.replace_linear(copy.deepcopy(model), path)


@pytest.mark.parametrize("shape", [(1,), (2, 2), (8,)])
def test_longrope_factors_of_another_shape_are_refused(tmp_path, shape):
    """One LongRoPE factor per rotated frequency (4 here), as llama.cpp
    requires: one factor would broadcast over all of them, a [2, 2] tensor
    read flat."""
    factors = {"rope_factors_long.weight": np.full(shape, 2.0, np.float32),
               "rope_factors_short.weight": np.ones(4, np.float32)}
    path = write_tiny_gguf(tmp_path / "phi3.gguf", cached_tiny_model("phi3"), "phi3",
                           extra_metadata={"phi3.rope.scaling.type": "longrope"}, extra_tensors=factors)
    with pytest.raises(lowbit.GGUFError, match=rf"^load_gguf_model: {re.escape(path)}: tensor "
                                               rf"'rope_factors_long.weight' has shape {re.escape(str(shape))}, but "
                                               rf"phi3.rope.dimension_count rotates 4 frequencies"):
        lowbit.load_gguf_model(path)


def test_a_phi3_rotated_part_that_rounds_down_as_a_factor_is_rotated_whole(tmp_path):
    """60 of 88 dimensions rotated: as a factor (60 / 88) times 88 it is
    59.99..., which transformers truncates to 59, the divisor of every
    frequency's exponent; llama.cpp's is 60."""
    source = tiny_model("phi3", seed=0, hidden_size=352, num_attention_heads=4, num_key_value_heads=4, head_dim=88)
    path = write_tiny_gguf(tmp_path / "phi3.gguf", source, "phi3", extra_metadata={"phi3.rope.dimension_count": 60})
    inv_freq = lowbit.load_gguf_model(path).model.rotary_emb.inv_freq
    torch.testing.assert_close(inv_freq, 1.0 / 10000.0 ** (torch.arange(0, 60, 2, dtype=torch.float) / 60))


def test_a_gemma3_file_without_a_window_runs_every_layer_global(tmp_path):
    """sliding_window 0: every layer global; transformers' Gemma3 still builds
    a sliding mask, which needed a window (a bare ValueError at the first forward)."""
    path = write_tiny_gguf(tmp_path / "gemma3.gguf", cached_tiny_model("gemma3"), "gemma3",
                           extra_metadata={"gemma3.attention.sliding_window": 0})
    model = lowbit.load_gguf_model(path)
    assert model.config.layer_types == ["full_attention"] * 2
    tokens = torch.arange(1, 13)[None]
    assert model(tokens).logits.isfinite().all()
    assert model.generate(tokens, max_new_tokens=3, do_sample=False).shape == (1, 15)


def test_a_part_of_a_split_file_is_refused(tmp_path):
    """One part of a file llama.cpp's gguf-split cut holds only some of the
    tensors (a head missing from the first part would read as tied to the
    embedding): refused before a model is built or filled from it."""
    model = cached_tiny_model("llama")
    split = {"split.count": 2, "split.no": 0}
    path = write_tiny_gguf(tmp_path / "part.gguf", model, "llama", extra_metadata=split)
    says = r"metadata 'split.count': the file is part 1 of a model split into 2 files"
    with pytest.raises(lowbit.GGUFError, match=rf"^load_gguf_model: {re.escape(path)}: {says}"):
        lowbit.load_gguf_model(path)
    with pytest.raises(lowbit.GGUFError, match=rf"^replace_linear: {re.escape(path)}: {says}"):
        lowbit.replace_linear(copy.deepcopy(model), path)
    bad = write_tiny_gguf(tmp_path / "bad.gguf", model, "llama", extra_metadata={"split.count": 3, "split.no": 7})
    with pytest.raises(lowbit.GGUFError, match=r"metadata 'split.no': 7, but parts are numbered from 0 to "
                                               r"split.count - 1 = 2"):
        lowbit.load_gguf_model(bad)
    whole = write_tiny_gguf(tmp_path / "whole.gguf", model, "llama", extra_metadata={"split.count": 1})
    assert isinstance(lowbit.load_gguf_model(whole), type(model))

@pytest.mark.parametrize("window, expect", [(2047, 2047), (4096, None), (262144, None)])
def test_a_phi3_window_as_long_as_the_context_is_no_window(tmp_path, window, expect):
    """Phi-3.5-mini's files carry a window of 262144 over a context of 131072:
    it masks nothing within the context, and the model gets none (a plain
    cache its decode steps serve); a shorter one (Phi-3-mini-4k's 2047) stays."""
    source = tiny_model("phi3", seed=0)  # a context of 4096
    path = write_tiny_gguf(tmp_path / "phi3.gguf", source, "phi3",
                           extra_metadata={"phi3.attention.sliding_window": window})
    assert lowbit.load_gguf_model(path).config.sliding_window == expect


@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_a_non_finite_float_tensor_is_a_gguf_error_naming_it(tmp_path, value):
    """A corrupt norm would turn every output after it NaN: refused at load."""
    model = tiny_model("llama", seed=0)
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[3] = value
    path = write_tiny_gguf(tmp_path / "llama.gguf", model, "llama")
    with pytest.raises(lowbit.GGUFError, match=rf"{re.escape(path)}: tensor 'blk.1.ffn_norm.weight' holds a "
                                               rf"non-finite value \({value}\) at \[3\]"):
        lowbit.load_gguf_model(path)


@pytest.mark.parametrize("changes, says", [
    (dict(types=[1, 1, 3]),
     r"metadata 'tokenizer.ggml.token_type': has 3 values, fewer than the 262 tokens of tokenizer.ggml.tokens"),
    (dict(extra={"tokenizer.ggml.scores": (["a"] * 262, "ARRAY")}),
     r"metadata 'tokenizer.ggml.scores': must hold numbers, one per token; holds str 'a'"),
    (dict(types=[1.0] * 262), r"metadata 'tokenizer.ggml.token_type': must hold integers, one per token; holds float"),
    (dict(eos=262), r"metadata 'tokenizer.ggml.eos_token_id': token 262 is outside the 262 tokens"),
    (dict(model=None), r"metadata 'tokenizer.ggml.model': missing"),
    (dict(model="llama"), r"metadata 'tokenizer.ggml.scores': missing: a sentencepiece \('llama'\) vocabulary"),
    (dict(model="t5"), r"metadata 'tokenizer.ggml.scores': missing: a unigram \('t5'\) vocabulary"),
    (dict(extra={"tokenizer.ggml.scores": ([0.0] * 261 + [float("nan")], "ARRAY")}),
     r"metadata 'tokenizer.ggml.scores': must be finite"),
    # A string where llama.cpp reads a bool: "false" would add a BOS token.
    (dict(extra={"tokenizer.ggml.add_bos_token": ("false", "STRING")}),
     r"metadata 'tokenizer.ggml.add_bos_token': expected a boolean, got str 'false'"),
    (dict(extra={"tokenizer.chat_template": (7, "UINT32")}), r"metadata 'tokenizer.chat_template': expected a string"),
    # A token list longer than the model's vocabulary: its last ids would index past the embedding.
    (dict(embd_rows=200), r"tokenizer.ggml.tokens has 262 tokens, token_embd.weight only 200 rows"),
    (dict(extra={"llama.vocab_size": (200, "UINT32")}),
     r"metadata 'tokenizer.ggml.tokens': 262 tokens, more than llama.vocab_size 200"),
    # llama.cpp refuses a byte-level vocabulary without merges; transformers' converter looks for scores.
    (dict(merges=None),
     r"metadata 'tokenizer.ggml.merges': missing: a byte-level \('gpt2'\) vocabulary needs its merges"),
    (dict(model="gemma4", merges=None, extra={"tokenizer.ggml.scores": ([0.0] * 262, "ARRAY")}),
     r"metadata 'tokenizer.ggml.merges': missing: a BPE \('gemma4'\) vocabulary needs its merges"),
    (dict(merges=["Ġ t", "Ġ t h"]),
     r"metadata 'tokenizer.ggml.merges': merge 1 is str 'Ġ t h', not two tokens joined"),
    (dict(merges=["he"]), r"metadata 'tokenizer.ggml.merges': merge 0 is str 'he', not two tokens joined"),
    (dict(merges=None, extra={"tokenizer.ggml.merges": ("h e", "STRING")}),
     r"metadata 'tokenizer.ggml.merges': expected an array, got str 'h e'"),
    # One text at two ids (llama.cpp refuses it too), and two texts transformers spells alike: a
    # byte-level " " is respelled "Ġ", token 220. One id would decode as another's text.
    (dict(words=("Ġt", "he", "he"), merges=("Ġ t", "h e")),
     r"metadata 'tokenizer.ggml.tokens': tokens 257 and 258 are both 'he'; each id needs a text of its own"),
    (dict(words=("Ġt", "he", "x" * 30_000, "x" * 30_000), merges=("Ġ t", "h e")),
     r"metadata 'tokenizer.ggml.tokens': tokens 258 and 259 are both 'x{47}\.\.\.x{48}' \(30000 characters\); each id"),
    (dict(words=("Ġt", "he", "Ġthe", " ")),
     r"metadata 'tokenizer.ggml.tokens': tokens 220 'Ġ' and 259 ' ' are one entry 'Ġ' of transformers' vocabulary"),
    # A sentencepiece vocabulary with no byte tokens and no <unk> (rows to spare for the one the class
    # adds): a character outside it was dropped, or raised a bare Exception; llama.cpp aborts on one.
    (dict(model="llama", embd_rows=300, extra={"tokenizer.ggml.scores": ([0.0] * 262, "ARRAY")}),
     r"metadata 'tokenizer.ggml.tokens': its sentencepiece \('llama'\) vocabulary has no byte token <0x00>, and "
     r"transformers' TokenizersBackend no unknown token among its tokens"),
    # What only transformers' converter finds: a merge of two tokens whose result is no token.
    (dict(merges=["q z"]), r"transformers builds no tokenizer from its tokenizer.ggml.\* metadata: Exception: .*`qz`"),
    # transformers' error quotes a merge of a megabyte whole: the GGUFError keeps its first 1000 characters.
    (dict(merges=["Ġ t", "a" * 1_000_000 + " b"]),
     r"transformers builds no tokenizer from its tokenizer.ggml.\* metadata: Exception: .*`a{800,}\.\.\. "
     r"\(\d+ characters\)$"),
    # A merge whose result is no token and longer than every token: tokenizers' BPE panics (a BaseException).
    (dict(merges=["<|im_start|> <|im_end|>"]),
     r"transformers builds no tokenizer from its tokenizer.ggml.\* metadata: PanicException"),
])
def test_load_gguf_tokenizer_refuses_broken_tokenizer_metadata(tmp_path, changes, says):
    path = write_tokenizer_gguf(str(tmp_path / "tokenizer.gguf"), "llama", **changes)
    with pytest.raises(lowbit.GGUFError, match=rf"^load_gguf_tokenizer: {re.escape(path)}: {says}"):
        lowbit.load_gguf_tokenizer(path)


def test_load_gguf_tokenizer_reads_per_token_arrays_longer_than_the_tokens(tmp_path):
    """llama.cpp reads token types and scores as far as the token list goes
    and ignores the rest: the file's tokenizer is the one without them."""
    types = [1] * 259 + [3] * 3
    longer = write_tokenizer_gguf(str(tmp_path / "longer.gguf"), "llama", types=types + [1] * 5,
                                  extra={"tokenizer.ggml.scores": ([0.0] * 270, "ARRAY")})
    exact = write_tokenizer_gguf(str(tmp_path / "exact.gguf"), "llama", types=types)
    assert_same_tokenizer(lowbit.load_gguf_tokenizer(longer), lowbit.load_gguf_tokenizer(exact))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "gpt-oss", "phi3"])
def test_load_gguf_tokenizer_matches_autotokenizer(tmp_path, monkeypatch, arch):
    """load_gguf_tokenizer gives what AutoTokenizer gives for the file (its
    class, ids, text back, chat prompt, special tokens), and for the
    architectures it names a class for, without AutoTokenizer's detour
    through gguf-py's whole-file reader (3-4 s for a real vocabulary); phi3,
    which it names none for, goes through AutoTokenizer."""
    path = write_tokenizer_gguf(str(tmp_path / f"{arch}.gguf"), arch)
    expect = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
    if ARCHITECTURES[arch].tokenizer_class:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        def refuse(*args, **kwargs):
            raise AssertionError("went through load_gguf_checkpoint")
        monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", refuse)
    assert_same_tokenizer(lowbit.load_gguf_tokenizer(path), expect)


@pytest.mark.parametrize("arch", ["smollm3", "granite"])
def test_load_gguf_tokenizer_reads_files_transformers_does_not(tmp_path, arch):
    """transformers' GGUF support does not know smollm3 and granite files
    (AutoTokenizer refuses them); their tokenizer metadata is llama's kind,
    and lowbit builds from it what AutoTokenizer builds from the same
    metadata in a llama file."""
    path = write_tokenizer_gguf(str(tmp_path / f"{arch}.gguf"), arch)
    write_tokenizer_gguf(str(tmp_path / "llama.gguf"), "llama")
    assert_same_tokenizer(lowbit.load_gguf_tokenizer(path),
                          transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="llama.gguf"))


def write_sentencepiece_gguf(path: str, arch: str, embd_rows: int | None = None) -> str:
    """A GGUF file with a sentencepiece ("llama") vocabulary as Gemma's
    converter writes one: its special tokens first, then scored pieces."""
    import gguf

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "▁", "t", "h", "e", "m", "▁t", "he", "▁the"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3, 2, 3] + [1] * (len(tokens) - 5))
    writer.add_token_scores([0.0] * 5 + [-float(i) for i in range(len(tokens) - 5)])
    for add, token in ((writer.add_pad_token_id, 0), (writer.add_eos_token_id, 1), (writer.add_bos_token_id, 2),
                       (writer.add_unk_token_id, 3)):
        add(token)
    return with_embedding(writer, path, embd_rows or len(tokens))


def test_load_gguf_tokenizer_bounds_the_converter_s_work(tmp_path, monkeypatch):
    """transformers' converter spends time growing with each token's length
    squared: a vocabulary past MAX_TOKEN_WORK is refused before it runs."""
    import lowbit.gguf.model

    path = write_tokenizer_gguf(str(tmp_path / "tokenizer.gguf"), "llama")
    tokens = lowbit.load_gguf(path).metadata["tokenizer.ggml.tokens"]
    work = sum(len(t) ** 2 for t in tokens)
    monkeypatch.setattr(lowbit.gguf.model, "MAX_TOKEN_WORK", work - 1)
    with pytest.raises(lowbit.GGUFError, match=rf"'tokenizer.ggml.tokens': its tokens' squared lengths sum to {work}, "
                                               rf"more than {work - 1} \(the longest token has 13 characters"):
        lowbit.load_gguf_tokenizer(path)
    monkeypatch.setattr(lowbit.gguf.model, "MAX_TOKEN_WORK", work)
    assert len(lowbit.load_gguf_tokenizer(path)) == len(tokens)


def test_load_gguf_tokenizer_reads_gemma_files(tmp_path):
    """transformers' GGUF support knows gemma2 and gemma3 files but not
    gemma's (AutoTokenizer refuses them): their vocabulary is the same kind,
    and lowbit builds the GemmaTokenizer AutoTokenizer builds for a gemma2 file."""
    path = write_sentencepiece_gguf(str(tmp_path / "gemma.gguf"), "gemma")
    write_sentencepiece_gguf(str(tmp_path / "gemma2.gguf"), "gemma2")
    got = lowbit.load_gguf_tokenizer(path)
    expect = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="gemma2.gguf")
    assert type(got) is type(expect) is transformers.GemmaTokenizer
    text = "the theme <mask> then"
    assert got(text).input_ids == expect(text).input_ids == [2, 6, 11, 12, 9, 8, 5, 4, 12, 3]
    assert (got.bos_token, got.eos_token, got.pad_token) == ("<bos>", "<eos>", "<pad>")


def test_load_gguf_tokenizer_reads_the_file_alone(tmp_path, monkeypatch):
    """A tokenizer.json or tokenizer_config.json beside the file (where
    convert_hf_to_gguf.py writes it: the HF model's directory) is not the
    file's tokenizer: the file's metadata alone builds it (with no link to
    it, which not every file system or user may make)."""
    import os

    import tokenizers

    def refuse(*args, **kwargs):
        raise PermissionError("no links here")
    monkeypatch.setattr(os, "symlink", refuse)

    path = write_tokenizer_gguf(str(tmp_path / "model.gguf"), "llama")
    clean = tmp_path / "clean"
    clean.mkdir()
    expect = lowbit.load_gguf_tokenizer(write_tokenizer_gguf(str(clean / "model.gguf"), "llama"))
    foreign = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    foreign.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": null, "eos_token": null, "chat_template": "x"}')
    got = lowbit.load_gguf_tokenizer(path)
    assert_same_tokenizer(got, expect)
    assert len(got) == 262 and got.name_or_path == str(tmp_path)


def test_load_gguf_tokenizer_refuses_tokens_the_embedding_does_not_hold(tmp_path):
    """A class that adds special tokens the file's list lacks (GemmaTokenizer:
    <pad>, <mask>, ...) would give ids past the embedding's rows. (Its <unk>
    is the file's: a character outside the vocabulary encodes as it.)"""
    path = write_tokenizer_gguf(str(tmp_path / "gemma2.gguf"), "gemma2", model="llama",
                                words=("Ġt", "he", "Ġthe", "<unk>"),
                                extra={"tokenizer.ggml.scores": ([0.0] * 263, "ARRAY")})
    with pytest.raises(lowbit.GGUFError, match=r"transformers' GemmaTokenizer holds 26\d tokens \(the file's 263 and "
                                               r"those it adds\), token_embd.weight only 263 rows"):
        lowbit.load_gguf_tokenizer(path)


@pytest.mark.parametrize("pre, warns", [
    ("smollm", False), ("gpt-2", False), ("qwen2", False), ("llama-bpe", False),
    ("made-up", "tokenizer.ggml.pre 'made-up'"), (None, "has no tokenizer.ggml.pre"),
    (["smollm"], r"tokenizer.ggml.pre \['smollm'\]"),
    # A hostile name is cut short in the warning, not written out whole.
    pytest.param("x" * 100_000, r"tokenizer.ggml.pre 'x{47}\.\.\.x{48}' \(100000 characters\)", id="long-name"),
    pytest.param(["x" * 100_000], r"tokenizer.ggml.pre \['x{47}\.\.\.x{48}'\]", id="long-list"),
])
def test_load_gguf_tokenizer_warns_of_a_split_it_does_not_know(tmp_path, pre, warns):
    """A byte-level vocabulary's tokenizer.ggml.pre names llama.cpp's split of
    its text: one lowbit sets (smollm: digits isolated), one transformers sets
    (qwen2, llama-bpe) and GPT-2's are silent; any other name (or none) is
    split as GPT-2 with a warning that the ids may differ from llama.cpp's."""
    path = write_tokenizer_gguf(str(tmp_path / "tokenizer.gguf"), "llama", pre=pre, words=("Ġ1", "12"),
                                merges=("Ġ 1", "1 2"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokenizer = lowbit.load_gguf_tokenizer(path)
    said = [str(w.message) for w in caught if "split" in str(w.message)]
    if warns:
        assert len(said) == 1 and re.search(rf"{re.escape(path)}: {warns}: its text is split as GPT-2 splits it", said[0])
    else:
        assert not said
    digits = tokenizer.convert_ids_to_tokens(tokenizer(" 12", add_special_tokens=False).input_ids)
    # llama.cpp's splits of " 12": each digit alone, up to three digits together, GPT-2's " 12" whole.
    splits = {"smollm": ["Ġ", "1", "2"], "qwen2": ["Ġ", "1", "2"], "llama-bpe": ["Ġ", "12"]}
    assert digits == splits.get(pre if isinstance(pre, str) else None, ["Ġ1", "2"])


def assert_same_tokenizer(got, expect):
    """Same class, ids, text back, chat prompt and special tokens."""
    assert type(got) is type(expect)
    text = "the  theme<|im_start|> then\n\n tthe<|im_end|>é ✓"
    ids = got(text).input_ids
    assert ids == expect(text).input_ids and len(ids) < len(text.encode())  # the merges and specials were applied
    assert got.decode(ids) == expect.decode(ids) == text
    chat = [{"role": "user", "content": "the question"}]
    assert got.apply_chat_template(chat, tokenize=False) == expect.apply_chat_template(chat, tokenize=False)
    assert (got.bos_token, got.eos_token) == (expect.bos_token, expect.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("arch", ["qwen3moe", "mixtral", "gpt-oss"])
def test_load_gguf_model_repacks_the_experts(tmp_path, arch):
    """repack=True repacks the experts too (each projection whose type the
    active kernels read): the same model, to the 32-element types' fp32
    rounding (Q8_0 here)."""
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=0), arch)
    plain, packed = lowbit.load_gguf_model(path), lowbit.load_gguf_model(path, repack=True)
    experts = [m for m in packed.modules() if isinstance(m, lowbit.GGUFExperts)]
    assert experts and all(m.repacked == dict.fromkeys(("gate", "up", "down"), torch.ops.lowbit.cpu_reads_repacked(8))
                           for m in experts)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = plain(ids).logits, packed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("arch", list(MODELS))
def test_generate_with_the_cache_is_the_models_greedy_choice(tmp_path, arch):
    """transformers' generate (prefill, then one token at a time through its
    cache: sliding windows, experts at one token) picks at every step the
    token the whole sequence's forward pass ranks first (to rounding: ties
    within 1e-4 of the largest logit count)."""
    source = tiny_model(arch, seed=0)
    with torch.no_grad():
        source.get_input_embeddings().weight.mul_(30)  # logits far apart
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", source, arch))
    ids = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)
        logits = model(out).logits[0, 6:-1]
    assert out.shape == (1, 17)
    chosen = logits.gather(1, out[0, 7:, None])[:, 0]
    assert torch.all(chosen >= logits.max(dim=1).values - 1e-4 * logits.abs().max())


def test_load_gguf_tokenizer_keeps_byte_level_specials_at_their_ids(tmp_path):
    """A byte-level vocabulary's control tokens spelled outside the byte
    alphabet (DeepSeek-R1-Distill-Qwen's "<｜begin▁of▁sentence｜>", its BOS,
    with padding rows past the tokens) are matched whole at the file's ids,
    as llama.cpp matches them: not a BOS appended at a new id past the file's
    tokens, which every prompt would begin with."""
    import gguf

    bos, eos, user = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>"
    tokens = byte_level_alphabet() + ["the", "he", bos, eos, user]
    path = str(tmp_path / "qwen2.gguf")
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_block_count(1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("deepseek-r1-qwen")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 258 + [3] * 3)
    writer.add_token_merges(["h e", "t he"])
    writer.add_bos_token_id(258)
    writer.add_eos_token_id(259)
    writer.add_add_bos_token(True)
    tokenizer = lowbit.load_gguf_tokenizer(with_embedding(writer, path, 300))
    assert (tokenizer.bos_token, tokenizer.bos_token_id, tokenizer.eos_token, tokenizer.eos_token_id) == (bos, 258, eos, 259)
    ids = tokenizer(f"{user}the").input_ids
    assert ids == [258, 260, 256]
    assert tokenizer.decode(ids) == f"{bos}{user}the"
    assert tokenizer.decode(ids, skip_special_tokens=True) == "the"
