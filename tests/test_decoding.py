"""The decode step (lowbit.decoding.fast_decoding) on whole models: a served
decode call gives the logits the model's own forward gives (fp32 rounding),
generate gives its tokens, and every call a step cannot serve (batches,
padding, extra outputs, a cache edited in between, LoRA on a fused
projection, hooks) runs the model's own forward or honours what changed.
Its ops alone: tests/test_decode_ops.py."""
import copy
import os
import pickle
import weakref

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

import lowbit
from lowbit.decoding import fast_decoding


def tiny_model(arch, seed, **overrides):
    # Imported here: tiny_models needs gguf-py, which the op tests above (and a GPU machine) do without.
    from tiny_models import tiny_model

    return tiny_model(arch, seed, **overrides)


def float_model(arch, **overrides):
    model = tiny_model(arch, seed=3, **overrides)
    lowbit.kernel_threads(model)
    return model


# Phi-3-mini's rotation of whole heads (the tiny phi3 rotates half of each, as Phi-4-mini does).
FULL_ROTARY = {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}
# LongRoPE over half of each head, its original context shorter than the test's prompt.
PHI3_LONGROPE = dict(max_position_embeddings=1024, original_max_position_embeddings=4, rope_parameters={
    "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
    "long_factor": [1.0, 3.0, 9.0, 27.0], "short_factor": [1.0, 1.5, 2.0, 4.0]})


def own_forward_logits(model, ids, cache, token):
    fast_decoding(model, False)
    try:
        return model(input_ids=token, cache=cache).logits
    finally:
        assert fast_decoding(model)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama", dict(head_dim=32, hidden_size=128)),  # the fp32 SIMD attention
    ("qwen2", {}), ("qwen3", {}),
    ("smollm3", {}),  # its fourth layer is NoPE: no rotation
    ("granite", {}),  # embedding, residual, attention and logits multipliers
    ("phi3", dict(rope_parameters=FULL_ROTARY)),  # one qkv_proj and one gate_up_proj of its own
    ("phi3", {}),  # half of each head rotated, as Phi-4-mini rotates 3/4
    ("phi3", PHI3_LONGROPE),  # and LongRoPE's divisors, past the original context from the prompt on
    ("qwen3moe", {}), ("mixtral", {}),  # mixtures of experts: the blocks' own routing in the Python loop
    ("qwen2moe", {}),  # and a shared expert
    # Gemma 3: a sliding window of 5 (the prompt and steps run past it) and a
    # full layer, each with its own tables; norms after each sublayer, GELU,
    # soft-capped logits
    ("gemma3", {}),
    ("gemma", {}),  # Gemma 1: the 1 + weight norms, GELU and scaled embeddings, no norms after the sublayers
    # the same without q and k norms, one table, soft-capped attention scores (a cap tight enough to matter)
    ("gemma2", dict(attn_logit_softcapping=0.5)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),  # a window on layer 1 only
    ("phi3", dict(sliding_window=4)),  # the config's window over every layer (Phi-3's, Mistral's)
    ("llama", dict(hidden_act="gelu_pytorch_tanh")),  # another activation: the MLP's own module
    # gpt-oss: attention sinks, a window of 5 on one layer, YaRN tables holding each frequency once, biases,
    # clamped SwiGLU experts
    ("gpt-oss", {}),
])
@pytest.mark.parametrize("grad_mode", [torch.no_grad, torch.inference_mode])
def test_served_steps_give_the_model_s_logits(arch, overrides, grad_mode):
    model = float_model(arch, **overrides)
    assert fast_decoding(model)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    with grad_mode():
        own, served = DynamicCache(config=model.config), DynamicCache(config=model.config)
        fast_decoding(model, False)
        model(input_ids=ids, cache=own)
        fast_decoding(model)
        model(input_ids=ids, cache=served)
        for step, token in enumerate([3, 61, 17, 17, 2, 40, 8, 30]):
            token = torch.tensor([[token]])
            want = own_forward_logits(model, ids, own, token)
            got = model(input_ids=token, cache=served).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            for a, b in zip(own.layers, served.layers):
                torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-5)
        # input_ids as the first positional argument, as the forward takes it
        token = torch.tensor([[12]])
        want = own_forward_logits(model, ids, own, token)
        torch.testing.assert_close(model(token, cache=served).logits, want, atol=1e-5, rtol=1e-5)
        # the steps were served: the cache's tensors are views of the step's buffers (a window's: its last rows)
        assert all(layer.keys.untyped_storage().data_ptr() == layer._lowbit_buffers[0].untyped_storage().data_ptr()
                   for layer in served.layers)
        assert served.get_seq_length() == ids.shape[1] + 9


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tiny_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("decoding") / "llama.gguf", tiny_model("llama", seed=0), "llama")


def generate(model, ids, **kwargs):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


def with_plan(model, call):
    """(call(), the C++ step plan the model's decode steps held when a generate
    call in it ended: a _StepPlan, False for the Python loop, None for the
    model's own forward). generate drops the plan as it ends."""
    forward, seen = model.__dict__["forward"], []
    forward.generated = lambda: seen.append(forward._plan) or type(forward).generated(forward)
    try:
        out = call()
    finally:
        del forward.generated
    assert forward._plan is None and seen
    return out, seen[-1]


def test_loaded_gguf_models_generate_through_served_steps(gguf_path):
    model = lowbit.load_gguf_model(gguf_path)
    assert isinstance(model.__dict__["forward"], lowbit.decoding._DecodingForward)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    served = generate(model, ids, attention_mask=torch.ones_like(ids))
    assert not fast_decoding(model, False)
    own = generate(model, ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("layout", ["unsorted", "sorted", "panels", "int8", "int8 panels"])
def test_gptq_models_generate_through_served_steps(layout, monkeypatch):
    """An act-order model's layers as a checkpoint holds them (the activations
    permuted per call), with their rows sorted, in the panel layout, with int8
    activations and both: the steps call each layer's op directly."""
    from test_generation import act_order_gptq_model

    model = act_order_gptq_model(seed=2)
    layers = [m for m in model.modules() if isinstance(m, lowbit.GPTQLinear)]
    for m in layers:
        if layout != "unsorted":
            m.sort_rows()
        m.int8_activations = layout.startswith("int8")
        if layout.endswith("panels") and m.can_repack():
            m.repack()
    assert not layout.endswith("panels") or any(m.repacked for m in layers)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    own = generate(model, ids)
    calls = []
    forward = lowbit.GPTQLinear.forward
    monkeypatch.setattr(lowbit.GPTQLinear, "forward", lambda self, x: calls.append(x.shape) or forward(self, x))
    assert fast_decoding(model)
    served = generate(model, ids)
    assert len(calls) == len(layers)  # the prompt's forward; no module call in a step
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch,loop", [("qwen3moe", "C++"), ("mixtral", "C++"), ("qwen3moe", "Python"),
                                       ("qwen2moe", "Python"), ("gpt-oss", "Python")])
def test_gguf_mixtures_of_experts_generate_through_served_steps(arch, loop, tmp_path, monkeypatch):
    """A mixture-of-experts file's layers (GGUFExperts) decode with the tokens
    and logits of the model's own forward: Qwen3-MoE's and Mixtral's blocks in
    the C++ step (its router and the experts' ops; the module runs for the
    prompt only), the others (a shared expert; gpt-oss's sinks, biases and
    GLU) in the Python loop, which calls each block once a step."""
    from tiny_models import write_tiny_gguf

    if loop == "Python":
        python_loop_only(monkeypatch)
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=4), arch))
    experts = [m for m in model.modules() if isinstance(m, lowbit.GGUFExperts)]
    assert len(experts) == model.config.num_hidden_layers
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    assert not fast_decoding(model, False)
    own = generate(model, ids)
    calls = []
    forward = lowbit.GGUFExperts.forward
    monkeypatch.setattr(lowbit.GGUFExperts, "forward", lambda self, *a: calls.append(a[0].shape) or forward(self, *a))
    assert fast_decoding(model)
    served, plan = with_plan(model, lambda: generate(model, ids))
    assert (plan is False) == (loop == "Python")
    steps = 11 if loop == "Python" else 0
    hidden = model.config.hidden_size
    assert calls == [(7, hidden)] * len(experts) + [(1, hidden)] * steps * len(experts)
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("loop", ["C++", "Python"])
@pytest.mark.parametrize("kind", ["gguf gemma3", "float phi3"])
def test_windowed_models_decode_past_their_buffers(kind, loop, tmp_path, monkeypatch):
    """100 new tokens through windows of 5 and 4 rows: each window's cache
    moves along its buffer a row a step and into a new buffer when it
    reaches the end; the tokens stay those of the model's own forward (a
    Gemma 3 file's through lowbit's layers) and the logits those of its
    forward over the whole sequence at once, without a cache, in the C++
    step and in the Python loop. (transformers' own cached steps drift from
    that by 1e-2 after about 90 tokens for the Gemma 3 file.)"""
    from tiny_models import write_tiny_gguf

    if loop == "Python":
        python_loop_only(monkeypatch)
    if kind == "gguf gemma3":
        path = write_tiny_gguf(tmp_path / "gemma3.gguf", tiny_model("gemma3", seed=5), "gemma3")
        model = lowbit.load_gguf_model(path)
    else:
        model = float_model("phi3", sliding_window=4)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    run = lambda: model.generate(ids, max_new_tokens=100, min_new_tokens=100, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
    with torch.inference_mode():
        assert fast_decoding(model)
        served, plan = with_plan(model, run)
        assert (plan is False) == (loop == "Python")
        fast_decoding(model, False)
        own = run()
        whole = model(served.sequences[:, :-1], use_cache=False).logits[0, ids.shape[1] - 1:]
    assert torch.equal(served.sequences, own.sequences) and len(served.logits) == len(whole) == 100
    for a, b in zip(served.logits, whole):
        torch.testing.assert_close(a[0], b, atol=1e-4, rtol=1e-4)


def test_calls_a_step_cannot_serve_run_the_model_s_forward():
    model = float_model("llama")
    assert fast_decoding(model)
    prompts = torch.tensor([[0, 0, 5, 9, 33], [4, 8, 15, 16, 23]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    batched = generate(model, prompts, attention_mask=mask)
    hidden = generate(model, prompts[1:], output_hidden_states=True)
    fast_decoding(model, False)
    assert torch.equal(batched.sequences, generate(model, prompts, attention_mask=mask).sequences)
    own_hidden = generate(model, prompts[1:], output_hidden_states=True)
    assert torch.equal(hidden.sequences, own_hidden.sequences)
    assert len(hidden.hidden_states) == len(own_hidden.hidden_states)
    # padding in a batch of one: the mask has zeros, so the step leaves it to the model
    fast_decoding(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompts[:1], attention_mask=mask[:1], cache=cache)
        model(input_ids=torch.tensor([[7]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]), cache=cache)
    assert not hasattr(cache.layers[0], "_lowbit_buffers")


@pytest.mark.parametrize("output", ["hidden_states", "attentions"])
def test_steps_are_served_after_a_call_asking_for_outputs(output):
    """The first call asking for hidden states or attentions leaves
    transformers' output-capturing hooks on the model's layers; they record
    only in calls asking for outputs, so later calls asking for none are
    served still (the C++ step), with the model's tokens."""
    model = float_model("llama", attn_implementation="eager")  # sdpa has no attentions to give
    assert fast_decoding(model)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    asked = generate(model, ids, **{f"output_{output}": True})
    assert any(m._forward_hooks for m in model.modules())
    served, plan = with_plan(model, lambda: generate(model, ids))
    assert isinstance(plan, lowbit.decoding._StepPlan)
    fast_decoding(model, False)
    own = generate(model, ids)
    assert torch.equal(served.sequences, own.sequences) and torch.equal(asked.sequences, own.sequences)
    for got, want in zip(served.logits, own.logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(getattr(asked, output)) == len(own.logits)


@pytest.mark.parametrize("arch,output_class", [
    ("llama", CausalLMOutputWithPast), ("qwen3moe", MoeCausalLMOutputWithPast), ("mixtral", MoeCausalLMOutputWithPast)])
def test_served_steps_return_the_forward_s_output_class(arch, output_class):
    """A mixture of experts' forward returns MoeCausalLMOutputWithPast, its
    router logits and aux loss None where no call or config asks for them:
    a served step's output is of that class as well."""
    model = float_model(arch)
    assert fast_decoding(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 7, 22, 5, 63, 40, 9]]), cache=cache)
        out = model(input_ids=torch.tensor([[3]]), cache=cache)
    assert hasattr(cache.layers[0], "_lowbit_buffers")  # the step was served
    assert type(out) is output_class and getattr(out, "router_logits", None) is None
    assert getattr(out, "aux_loss", None) is None


@pytest.mark.parametrize("arch,output", [("llama", "hidden_states"), ("llama", "attentions"),
                                         ("qwen3moe", "router_logits")])
def test_outputs_the_config_asks_for_are_returned(arch, output):
    """A decode call naming no outputs returns those the model's config asks
    for, as the model's forward reads them there: set after the prompt, so
    that no output hook of transformers' is on the model yet. A model each:
    the forward that runs first leaves its hooks on its model."""
    ids, token = torch.tensor([[1, 7, 22, 5, 63, 40, 9]]), torch.tensor([[3]])
    results = []
    for fast in (False, True):
        model = float_model(arch, attn_implementation="eager")  # sdpa has no attentions to give
        fast_decoding(model, fast)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            setattr(model.config, f"output_{output}", True)
            results.append(model(input_ids=token, cache=cache))
    own, served = results
    assert type(served) is type(own)
    torch.testing.assert_close(served.logits, own.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(getattr(served, "aux_loss", None), getattr(own, "aux_loss", None))  # router logits'
    layers = len(model.model.layers)
    assert len(getattr(served, output)) == len(getattr(own, output)) == layers + (output == "hidden_states")
    for got, want in zip(getattr(served, output), getattr(own, output)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,overrides", [("llama", {}), ("phi3", dict(sliding_window=16)), ("gemma3", {})])
def test_a_cache_edited_between_steps(arch, overrides):
    """Tokens appended by the model's own forward (two at once) and the cache
    cropped: the next steps start from what the cache holds (window caches
    too: DynamicSlidingWindowLayer, here within a window of 16; Gemma 3's
    window of 5 is passed, so only its full layers are cropped)."""
    model = float_model(arch, **overrides)
    ids = torch.tensor([[1, 7, 22, 5]])
    tokens = [torch.tensor([[t]]) for t in (9, 13, 2)]
    two = torch.tensor([[40, 41]])
    caches = {}
    for serve in (False, True):
        fast_decoding(model, serve)
        cache = DynamicCache(config=model.config)
        logits = []
        with torch.no_grad():
            model(input_ids=ids, cache=cache)
            logits.append(model(input_ids=tokens[0], cache=cache).logits)
            model(input_ids=two, cache=cache)  # not served: two tokens
            logits.append(model(input_ids=tokens[1], cache=cache).logits)
            if arch != "gemma3":  # a window's cache past its window refuses to be cropped (transformers')
                cache.crop(-3)
            logits.append(model(input_ids=tokens[2], cache=cache).logits)
            logits.append(model(input_ids=tokens[0], cache=cache).logits)
        caches[serve] = (cache, logits)
    for a, b in zip(caches[False][1], caches[True][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert caches[True][0].get_seq_length() == caches[False][0].get_seq_length() == (10 if arch == "gemma3" else 7)


def test_lora_on_a_fused_projection_is_honoured(gguf_path):
    peft = pytest.importorskip("peft")
    import lowbit.lora

    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    model = lowbit.load_gguf_model(gguf_path)
    config = lowbit.lora.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config).eval()
    served = generate(lora, ids)
    assert fast_decoding(model, False) is False
    own = generate(lora, ids)
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


def test_other_architectures_are_left_to_their_forward():
    from transformers import MistralConfig, MistralForCausalLM, Olmo2Config, Olmo2ForCausalLM

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    model = Olmo2ForCausalLM(Olmo2Config(eos_token_id=1, pad_token_id=0, **small))  # norms after the sublayers only
    assert not fast_decoding(model)
    assert "forward" not in model.__dict__
    assert not fast_decoding(tiny_model("gemma3", seed=0, use_bidirectional_attention=True))
    assert fast_decoding(MistralForCausalLM(MistralConfig(sliding_window=8, **small)))
    assert fast_decoding(MistralForCausalLM(MistralConfig(sliding_window=None, **small)))
    assert fast_decoding(tiny_model("phi3", seed=0))  # half of each head rotated, the rest passed through
    assert fast_decoding(tiny_model("phi3", seed=0, rope_parameters=FULL_ROTARY))
    half = tiny_model("llama", seed=0)  # Llama's layers rotate whole heads: tables over half of each do not fit
    half.model.rotary_emb.inv_freq = half.model.rotary_emb.inv_freq[:4]
    assert not fast_decoding(half)


def test_a_model_with_fast_decoding_pickles(gguf_path):
    model = lowbit.load_gguf_model(gguf_path)
    ids = torch.tensor([[1, 7, 22, 5]])
    again = pickle.loads(pickle.dumps(model))
    assert isinstance(again.__dict__["forward"], lowbit.decoding._DecodingForward)
    assert again.__dict__["forward"].model is again
    assert torch.equal(generate(again, ids).sequences, generate(model, ids).sequences)


def test_hooks_of_the_projections_run_in_served_steps(gguf_path):
    """A GGUFLinear with a hook goes through its module call; the others may not."""
    model = lowbit.load_gguf_model(gguf_path)
    seen = []
    model.model.layers[1].self_attn.o_proj.register_forward_hook(lambda module, args, out: seen.append(out.shape))
    out = generate(model, torch.tensor([[1, 7, 22, 5]]))
    assert len(seen) == len(out.logits)  # the prompt's call, then one per decode step
    assert seen[-1][-1] == model.config.hidden_size


@pytest.mark.parametrize("where", ["layers.0", "layers.0.self_attn", "layers.0.mlp", "layers.1.input_layernorm",
                                   "layers.0.self_attn.o_proj", "layers.1.mlp.act_fn", "norm", ""])
@pytest.mark.parametrize("after_a_step", [False, True])
def test_hooks_on_modules_a_step_skips_are_honoured(gguf_path, where, after_a_step):
    """A hook that steers a decoder layer, its attention or MLP, a norm or the model (added before generating or
    after the step was made): every call runs it, and the tokens are those of the model's own forward."""
    models = [lowbit.load_gguf_model(gguf_path) for _ in range(2)]
    fast_decoding(models[1], False)
    ids = torch.tensor([[1, 7, 22, 5]])
    if after_a_step:
        assert isinstance(with_plan(models[0], lambda: generate(models[0], ids))[1], lowbit.decoding._StepPlan)
    calls = []
    for model in models:
        module = model.model.get_submodule(where)
        module.register_forward_hook(lambda m, args, out, calls=calls: calls.append(1) or (
            (out[0] + 3.0, *out[1:]) if isinstance(out, tuple) else out + 3.0 if torch.is_tensor(out) else None))
    served, own = (generate(m, ids) for m in models)
    assert torch.equal(served.sequences, own.sequences)
    assert len(calls) == 2 * len(own.logits)  # the prompt's call and each step's, on both models
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("where", ["layers.0.mlp.act_fn", "layers.1.post_attention_layernorm", "layers.0"])
def test_a_hook_added_between_two_steps_is_honoured(gguf_path, where):
    """Within one generation the C++ step is made once: a hook added on a module it computes without calling
    (an activation, a norm, a layer) sends the next step to the model's own forward."""
    models = [lowbit.load_gguf_model(gguf_path) for _ in range(2)]
    fast_decoding(models[1], False)
    caches = [DynamicCache(config=m.config) for m in models]
    with torch.no_grad():
        for m, cache in zip(models, caches):
            m(input_ids=torch.tensor([[1, 7, 22, 5]]), cache=cache)
            m(input_ids=torch.tensor([[9]]), cache=cache)
        assert isinstance(models[0].forward._plan, lowbit.decoding._StepPlan)
        for m in models:
            m.model.get_submodule(where).register_forward_hook(
                lambda module, args, out: (out[0] * 2, *out[1:]) if isinstance(out, tuple) else out * 2)
        got, want = (m(input_ids=torch.tensor([[13]]), cache=c).logits for m, c in zip(models, caches))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def python_loop_only(monkeypatch):
    """Every step on the Python loop: the C++ step is never made."""
    def refuse(*args):
        raise lowbit.decoding._Unplannable("off")

    monkeypatch.setattr(lowbit.decoding, "_StepPlan", refuse)


def steps_of(model, ids, tokens):
    """The logits and the cache's keys of `tokens` decoded one by one after `ids`."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, cache=cache)
        logits = [model(input_ids=torch.tensor([[t]]), cache=cache).logits for t in tokens]
    return logits, [layer.keys for layer in cache.layers]


def gptq_model(layout, seed=2):
    from test_generation import act_order_gptq_model

    model = act_order_gptq_model(seed=seed)
    for m in model.modules():
        if isinstance(m, lowbit.GPTQLinear):
            if layout != "unsorted":
                m.sort_rows()
            m.int8_activations = layout.startswith("int8")
            if layout.endswith("panels") and m.can_repack():
                m.repack()
    return model


def write_tiny_gguf(*args):
    from tiny_models import write_tiny_gguf

    return write_tiny_gguf(*args)


def partly_fused_gguf_model(path):
    """q and k fused, v (of another type) apart, as in a Q4_K_M file."""
    from lowbit.fusing import fuse_projections

    model = lowbit.load_gguf_model(path, fuse=False)
    for layer in model.model.layers:
        v = layer.self_attn.v_proj
        linear = torch.nn.Linear(v.in_features, v.out_features, bias=False)
        linear.weight.data = v.dequantize()
        layer.self_attn.v_proj = lowbit.GGUFLinear.from_linear(linear, 2)  # Q4_0
    fused = fuse_projections(model)
    assert any(name.endswith("self_attn.qk_proj") for name in fused)
    return model


def repacked_experts_model(path):
    """Every experts module in the repacked layout where the active kernels
    read it so (ggml_mul_mat_id_repacked; Q8_0 on the AVX2 and AVX-512 kernels)."""
    model = lowbit.load_gguf_model(path)
    experts = [m for m in model.modules() if isinstance(m, lowbit.GGUFExperts)]
    repacked = [m.repack() for m in experts]
    assert experts and all(repacked) == bool(torch.ops.lowbit.cpu_reads_repacked(8))  # 8: Q8_0
    return model


def repacked_gguf_model(path):
    """Every layer of a type with the repacked layout in it (repack_model
    takes only those the active kernels read faster so)."""
    model = lowbit.load_gguf_model(path)
    layers = [m for m in model.modules()
              if isinstance(m, lowbit.GGUFLinear) and torch.ops.lowbit.ggml_has_repacked_layout(m.qtype)]
    assert layers
    for m in layers:
        m.repack()
    return model


STEP_MODELS = {
    "float llama": lambda path: float_model("llama"),
    "float qwen2 (biases)": lambda path: float_model("qwen2"),
    "float qwen3 (q and k norms)": lambda path: float_model("qwen3"),
    "gguf (fused)": lambda path: lowbit.load_gguf_model(path),
    "gguf (unfused)": lambda path: lowbit.load_gguf_model(path, fuse=False),
    "gguf (q and k fused)": partly_fused_gguf_model,
    "gguf qwen2 (biases)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "qwen2.gguf"), tiny_model("qwen2", seed=1), "qwen2")),
    "gguf qwen3 (q and k norms)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "qwen3.gguf"), tiny_model("qwen3", seed=1), "qwen3")),
    "gguf smollm3 (NoPE layer)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "smollm3.gguf"), tiny_model("smollm3", seed=1), "smollm3")),
    "gguf granite (multipliers)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "granite.gguf"), tiny_model("granite", seed=1), "granite")),
    "gguf phi3 (its own fused projections)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "phi3.gguf"),
                        tiny_model("phi3", seed=1, rope_parameters=FULL_ROTARY), "phi3")),
    "gguf phi3 (half of each head rotated, LongRoPE)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "phi3-longrope.gguf"),
                        tiny_model("phi3", seed=1, **PHI3_LONGROPE), "phi3")),
    "gguf gemma3 (windows, norms after each sublayer, GELU, tables per layer type, soft-capped logits)":
        lambda path: lowbit.load_gguf_model(write_tiny_gguf(os.path.join(os.path.dirname(path), "gemma3.gguf"),
                                                            tiny_model("gemma3", seed=1), "gemma3")),
    "gguf gemma (1 + weight norms, GELU, scaled embeddings)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "gemma.gguf"), tiny_model("gemma", seed=1), "gemma")),
    "gguf gemma2 (soft-capped attention scores)":
        lambda path: lowbit.load_gguf_model(write_tiny_gguf(
            os.path.join(os.path.dirname(path), "gemma2.gguf"),
            tiny_model("gemma2", seed=1, attn_logit_softcapping=0.5), "gemma2")),
    "float qwen2 (a window on one layer)": lambda path: float_model(
        "qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "float phi3 (a window on every layer, half of each head rotated)": lambda path: float_model(
        "phi3", sliding_window=3),
    "gguf qwen3moe (experts and their router)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "qwen3moe.gguf"), tiny_model("qwen3moe", seed=1),
                        "qwen3moe")),
    "gguf mixtral (experts, weights kept fp32)": lambda path: lowbit.load_gguf_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "mixtral.gguf"), tiny_model("mixtral", seed=1), "mixtral")),
    "gguf qwen3moe repacked": lambda path: repacked_experts_model(
        write_tiny_gguf(os.path.join(os.path.dirname(path), "qwen3moe-r.gguf"), tiny_model("qwen3moe", seed=2),
                        "qwen3moe")),
    "gguf bf16": lambda path: lowbit.load_gguf_model(path, dtype=torch.bfloat16),
    "gguf repacked": lambda path: repacked_gguf_model(path),
    "gptq unsorted": lambda path: gptq_model("unsorted"),
    "gptq sorted": lambda path: gptq_model("sorted"),
    "gptq panels": lambda path: gptq_model("panels"),
    "gptq int8 panels": lambda path: gptq_model("int8 panels"),
}


@pytest.mark.parametrize("kind", list(STEP_MODELS))
def test_the_cpp_step_gives_the_python_loop_s_results(kind, gguf_path, monkeypatch):
    """Where every projection is a lowbit layer or an nn.Linear, a step is one
    C++ call (DecodeStep) computing the Python loop's ops in its order: the
    same bits."""
    model = STEP_MODELS[kind](gguf_path)
    assert fast_decoding(model)
    ids, tokens = torch.tensor([[1, 7, 22, 5, 63, 40, 9]]), [3, 61, 17, 17, 2, 40, 8, 30]
    cpp_logits, cpp_keys = steps_of(model, ids, tokens)
    plan = model.forward._plan
    assert isinstance(plan, lowbit.decoding._StepPlan)
    assert plan.step.num_layers() == model.config.num_hidden_layers
    with monkeypatch.context() as m:
        python_loop_only(m)
        py_logits, py_keys = steps_of(model, ids, tokens)
        assert model.forward._plan is False
    for a, b in zip(cpp_logits, py_logits):
        assert torch.equal(a, b)
    for a, b in zip(cpp_keys, py_keys):
        assert torch.equal(a, b)
    if model.dtype == torch.float32:  # the model's own forward sums in another order
        fast_decoding(model, False)
        own_logits, _ = steps_of(model, ids, tokens)
        for a, b in zip(cpp_logits, own_logits):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_lora_and_hooks_keep_the_step_in_python(gguf_path):
    peft = pytest.importorskip("peft")
    import lowbit.lora

    ids = torch.tensor([[1, 7, 22, 5]])
    model = lowbit.load_gguf_model(gguf_path)
    handle = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda module, args: None)
    assert with_plan(model, lambda: generate(model, ids))[1] is None  # a hooked model runs its own forward
    handle.remove()
    assert isinstance(with_plan(model, lambda: generate(model, ids))[1], lowbit.decoding._StepPlan)
    config = lowbit.lora.LoraConfig(r=4, target_modules=["o_proj"], init_lora_weights=False)
    peft.get_peft_model(model, config).eval()
    assert with_plan(model, lambda: generate(model, ids))[1] is False


def test_the_cpp_step_follows_the_model_between_steps(gguf_path):
    """A module put in a projection's place, or a hook added, between two
    steps of one generation: the next step honours it."""
    model = lowbit.load_gguf_model(gguf_path)
    reference = lowbit.load_gguf_model(gguf_path)
    fast_decoding(reference, False)
    ids = torch.tensor([[1, 7, 22, 5]])
    caches = [DynamicCache(config=m.config) for m in (model, reference)]
    replacement = torch.nn.Linear(model.config.hidden_size, model.config.hidden_size, bias=False)
    seen = []
    with torch.no_grad():
        for m, cache in zip((model, reference), caches):
            m(input_ids=ids, cache=cache)
            m(input_ids=torch.tensor([[9]]), cache=cache)
        assert isinstance(model.forward._plan, lowbit.decoding._StepPlan)
        for m in (model, reference):
            m.model.layers[1].self_attn.o_proj = replacement
        got, want = (m(input_ids=torch.tensor([[13]]), cache=c).logits for m, c in zip((model, reference), caches))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        replacement.register_forward_hook(lambda module, args, out: seen.append(out.shape))
        model(input_ids=torch.tensor([[2]]), cache=caches[0])
    assert len(seen) == 1


@pytest.mark.parametrize("kind", ["gguf repacked", "gptq rows sorted", "gptq rows unsorted"])
def test_the_cpp_step_follows_weights_load_state_dict_replaces(kind, gguf_path, tmp_path):
    """load_state_dict puts new tensors into a repacked GGUF layer or an
    act-order GPTQ layer with sorted rows (the file's order undone, then
    redone), or copies into an unsorted one's buffers, whose step runs on a
    private sorted copy: the next step of the same generation multiplies by
    the new weights."""
    if kind == "gguf repacked":
        model = repacked_gguf_model(gguf_path)
        other = repacked_gguf_model(write_tiny_gguf(tmp_path / "other.gguf", tiny_model("llama", seed=1), "llama"))
    else:
        layout = kind.rpartition(" ")[2]
        model, other = (fast_decoding(m) and m for m in (gptq_model(layout), gptq_model(layout, seed=3)))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 7, 22, 5]]), cache=cache)
        model(input_ids=torch.tensor([[9]]), cache=cache)
        assert isinstance(model.forward._plan, lowbit.decoding._StepPlan)
        model.load_state_dict(other.state_dict())
        token, before = torch.tensor([[13]]), copy.deepcopy(cache)
        got = model(input_ids=token, cache=cache).logits
        want = own_forward_logits(model, token, before, token)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("threads", [True, False])
def test_a_generate_call_leaves_no_hold_on_the_model_s_tensors(gguf_path, threads):
    """The C++ step holds every projection's tensors: it goes when the call
    ends, so that model.to() frees the tensors it replaces, with or without
    kernel_threads' split."""
    model = lowbit.kernel_threads(lowbit.load_gguf_model(gguf_path), threads)
    assert isinstance(with_plan(model, lambda: generate(model, torch.tensor([[1, 7]])))[1], lowbit.decoding._StepPlan)
    held = weakref.ref(model.model.layers[1].self_attn.o_proj.qweight)
    model.to("meta")
    assert held() is None


def test_generate_is_wrapped_while_the_split_or_a_decode_step_needs_it(gguf_path):
    model = lowbit.load_gguf_model(gguf_path)  # both

    def wrapped():
        return isinstance(model.__dict__.get("generate"), lowbit.threads._ThreadedGenerate)

    assert wrapped()
    lowbit.kernel_threads(model, False)
    assert wrapped()  # the decode step still goes as each call ends
    assert not fast_decoding(model, False) and not wrapped()
    lowbit.kernel_threads(model)
    assert wrapped()
    lowbit.kernel_threads(model, False)
    assert not wrapped() and "forward" not in model.__dict__
    assert fast_decoding(model) and wrapped()


def test_a_model_pickles_after_its_cpp_step_is_made(gguf_path):
    model = lowbit.load_gguf_model(gguf_path)
    ids = torch.tensor([[1, 7, 22, 5]])
    first = generate(model, ids).sequences
    steps_of(model, ids, [3])  # decode calls outside generate keep their step
    assert isinstance(model.forward._plan, lowbit.decoding._StepPlan)
    again = pickle.loads(pickle.dumps(model))
    assert again.__dict__["forward"]._plan is None
    assert torch.equal(generate(again, ids).sequences, first)


def test_decode_step_refuses_what_it_cannot_run():
    step = torch.classes.lowbit.DecodeStep()
    w = torch.randn(8, 4)
    with pytest.raises(RuntimeError, match="no operator aten::nonexistent"):
        step.projection("aten::nonexistent", "", [w], 0, None, None)
    with pytest.raises(RuntimeError, match="takes 3 arguments; got 1"):
        step.projection("aten::linear", "", [w], 0, None, None)
    with pytest.raises(RuntimeError, match="argument bias takes Tensor"):
        step.projection("aten::linear", "", [w, 3], 0, None, None)
    with pytest.raises(RuntimeError, match="x_index 5 is out of range"):
        step.projection("aten::linear", "", [w, None], 5, None, None)
    with pytest.raises(RuntimeError, match="argument other .x_index. is not a Tensor"):
        step.projection("aten::mul", "Scalar", [w], 1, None, None)
    with pytest.raises(RuntimeError, match="must return one tensor and write none"):
        step.projection("aten::add_", "Tensor", [w, 1], 0, None, None)
    with pytest.raises(RuntimeError, match="perm must be a 1-D int32 or int64 tensor, got Float"):
        step.projection("aten::linear", "", [w, None], 0, torch.arange(4.0), None)
    for perm in (torch.tensor([0, 1, 2, 99]), torch.tensor([0, 1, 1, 3], dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"perm must be a permutation of \[0, 4\)"):
            step.projection("aten::linear", "", [w, None], 0, perm, None)
    p = step.projection("aten::linear", "", [w, None], 0, None, None)
    norm = torch.ones(4)
    with pytest.raises(RuntimeError, match="qkv is projection 7"):
        step.layer(norm, 1e-5, [7], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [p], [4, 4], p, 4, 0.5, True, 1.0)
    with pytest.raises(RuntimeError, match="qkv holds 1 to 3 projections"):
        step.layer(norm, 1e-5, [p, p, p, p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [p], [4, 4], p, 4, 0.5, True,
                   1.0)
    with pytest.raises(RuntimeError, match="gate_up_sizes must be the equal widths"):
        step.layer(norm, 1e-5, [p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [p], [4, 5], p, 4, 0.5, True, 1.0)
    with pytest.raises(RuntimeError, match="head_dim 3 does not divide"):
        step.layer(norm, 1e-5, [p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [p], [4, 4], p, 3, 0.5, True, 1.0)
    with pytest.raises(RuntimeError, match="head.. was not called"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [], [], [], 0)
    with pytest.raises(RuntimeError, match="layer_extras: no layer to extend"):
        step.layer_extras(0, 0, None, None, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="activation must be .silu. or .gelu_tanh.; got .relu."):
        step.style(0.0, "relu", 0.0)
    with pytest.raises(RuntimeError, match="softcap finite and >= 0"):
        step.style(0.0, "silu", -1.0)
    step.layer(norm, 1e-5, [p, p, p], [8, 8, 8], None, None, 0.0, p, norm, 1e-5, [p, p], [8, 8], p, 4, 0.5, True, 1.0)
    with pytest.raises(RuntimeError, match="window and table must be >= 0"):
        step.layer_extras(-1, 0, None, None, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="attn_softcap must be finite and >= 0"):
        step.layer_extras(0, 0, None, None, 0.0, float("inf"))
    with pytest.raises(RuntimeError, match="attn_out_norm and mlp_out_norm come together"):
        step.layer_extras(0, 0, norm, None, 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="residual_scale must be finite"):
        step.layer(norm, 1e-5, [p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [p], [4, 4], p, 4, 0.5, True,
                   float("inf"))
    with pytest.raises(RuntimeError, match="logits_divisor must be finite and non-zero"):
        step.head(norm, 1e-5, p, 0.0)
    step.head(norm, 1e-5, p, 1.0)
    keys = torch.zeros(1, 2, 3, 4)
    with pytest.raises(RuntimeError, match="1 layers take as many keys"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [keys], [keys], [None], 3)
    with pytest.raises(RuntimeError, match="layer 0's cache holds keys"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [keys], [keys], [None, None], 5)
    with pytest.raises(RuntimeError, match="cos and sin must be one table"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(2, 4), [keys], [keys], [None, None], 3)
    step.layer_extras(0, 1, None, None, 0.0, 0.0)  # the second table of two
    with pytest.raises(RuntimeError, match="layer 0 takes rotary table 1 of 1"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [keys], [keys], [None, None], 3)
    step.layer_extras(4, 0, None, None, 0.0, 0.0)  # a window of 4: its cache may keep 3 rows of 5
    with pytest.raises(RuntimeError, match=r"layer 0's cache holds keys .*\(or its window's last rows\)"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [keys[:, :, :2]], [keys[:, :, :2]], [None, None],
                 5)
    # Experts: projections taking x and the ids, a layer without an MLP of its own.
    ew = torch.zeros(4, 8, 34, dtype=torch.uint8)  # 4 experts of 8 Q8_0 rows of 32 values
    with pytest.raises(RuntimeError, match="x_index and ids_index are both 1"):
        step.expert_projection("lowbit::ggml_mul_mat_id", "", [ew, 8, 8], 1, 1)
    with pytest.raises(RuntimeError, match="ids_index 5 is out of range"):
        step.expert_projection("lowbit::ggml_mul_mat_id", "", [ew, 8, 8], 1, 5)
    e = step.expert_projection("lowbit::ggml_mul_mat_id", "", [ew, 8, 8], 1, 2)
    with pytest.raises(RuntimeError, match="the last layer must be one without an MLP"):
        step.layer_experts(torch.zeros(4, 4), 2, True, True, e, e, e)
    with pytest.raises(RuntimeError, match="gate_up is projection .*, an experts projection"):
        step.layer(norm, 1e-5, [p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [e], [4, 4], p, 4, 0.5, True, 1.0)
    step.layer(norm, 1e-5, [p], [4, 4, 4], None, None, 0.0, p, norm, 1e-5, [], [], -1, 4, 0.5, True, 1.0)
    with pytest.raises(RuntimeError, match="gate is projection .*, not an experts projection"):
        step.layer_experts(torch.zeros(4, 4), 2, True, True, p, e, e)
    with pytest.raises(RuntimeError, match="top_k in .1, experts."):
        step.layer_experts(torch.zeros(4, 4), 5, True, True, e, e, e)
    with pytest.raises(RuntimeError, match="lm_head is projection .*, an experts projection"):
        step.head(torch.ones(4), 1e-5, e, 1.0)  # run would call it without its ids
    with pytest.raises(RuntimeError, match="layer 1 has no MLP"):
        step.run(torch.zeros(1, 1, 4), torch.ones(4), torch.zeros(4), [keys] * 2, [keys] * 2, [None] * 4, 3)


def test_decode_step_writes_only_into_buffers_of_its_own_layout():
    """Buffers handed back that the step did not make (an expanded view whose
    rows share one address, a transposed one), with the cache a view of
    them: not written into; the step copies the cache into new buffers and
    gives the logits it gives with none."""
    torch.manual_seed(0)
    step = torch.classes.lowbit.DecodeStep()
    D = 4

    def lin(o, i):
        return step.projection("aten::linear", "", [torch.randn(o, i), None], 0, None, None)

    q, k, v, o, g, u, d, lm = lin(D, 4), lin(D, 4), lin(D, 4), lin(4, D), lin(8, 4), lin(8, 4), lin(4, 8), lin(10, 4)
    step.layer(torch.ones(4), 1e-6, [q, k, v], [D, D, D], None, None, 1e-6, o, torch.ones(4), 1e-6, [g, u], [8, 8],
               d, D, 0.5, True, 1.0)
    step.head(torch.ones(4), 1e-6, lm, 1.0)
    x, cos, sin = torch.randn(1, 1, 4), torch.ones(D), torch.zeros(D)
    shared = torch.randn(1, 1, 1, D).expand(1, 1, 8, D)  # stride 0 along the rows
    transposed = torch.randn(1, 1, D, 8).transpose(2, 3)
    for buffer in (shared, transposed):
        before = buffer.clone()
        keys = buffer[:, :, :2]
        expect = step.run(x, cos, sin, [keys], [keys.clone()], [None, None], 2)[0]
        got = step.run(x, cos, sin, [keys], [keys.clone()], [buffer, buffer], 2)[0]
        assert torch.equal(got, expect) and torch.equal(buffer, before)


def test_threads_decode_one_model_through_the_cpp_step(gguf_path):
    """Threads decoding their own caches on one model (a server's requests)
    share its C++ step, and each prompt call makes a new one: every thread
    gets the tokens it gets alone."""
    import threading

    model = lowbit.load_gguf_model(gguf_path)
    prompts = [torch.tensor([[1 + i, 7, 22, 5 + i]]) for i in range(4)]
    alone = [generate(model, p).sequences for p in prompts]
    got, errors = [None] * len(prompts), []

    def run(i):
        try:
            for _ in range(3):
                got[i] = generate(model, prompts[i]).sequences
        except Exception as e:  # reported below: an exception in a thread would pass unseen
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for a, b in zip(got, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_a_double_model_generates_through_its_own_forward(arch, tmp_path):
    """model.double(): the layers (experts too) multiply float64 activations
    as float32 and the decode step (whose ops take float32, float16 and
    bfloat16) leaves its calls to the model's own forward: the fp32 model's tokens."""
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=0), arch))
    ids = torch.tensor([[1, 7, 22, 5]])
    want = generate(model, ids).sequences
    model.double()
    assert torch.equal(generate(model, ids).sequences, want)
    with torch.no_grad():
        assert model(ids).logits.dtype == torch.float64


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_fp32_norms_over_a_bf16_model_decode_as_its_forward(arch, tmp_path):
    """QLoRA's preparation (peft.prepare_model_for_kbit_training) turns a
    bf16 model's float parameters, its norms, to fp32 while the embedding
    still gives bf16: the forward then promotes q and k to fp32 against the
    rotary tables' bf16, and so do the served steps: the tokens and logits
    of the model's own forward."""
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=0), arch),
                                   dtype=torch.bfloat16)
    for p in model.parameters():
        p.data = p.data.float()
    ids = torch.tensor([[1, 7, 22, 5, 63]])
    served, plan = with_plan(model, lambda: generate(model, ids, attention_mask=torch.ones_like(ids)))
    assert plan is not None  # a step served the calls
    assert not fast_decoding(model, False)
    own = generate(model, ids, attention_mask=torch.ones_like(ids))
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("arch,overrides", [("phi3", dict(resid_pdrop=0.5)), ("qwen2", dict(attention_dropout=0.5)),
                                            ("mixtral", dict(router_jitter_noise=0.5))])
def test_a_model_in_training_mode_keeps_its_dropout(arch, overrides):
    """model.train() under no_grad: the model's forward draws its dropout
    masks (router jitter), which a served step would leave out; without
    dropout a model in training mode is served."""
    logits, served = {}, {}
    for serve in (False, True):
        model = float_model(arch, **overrides).train()
        fast_decoding(model, serve)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            torch.manual_seed(0)
            model(input_ids=torch.tensor([[1, 7, 22, 5]]), cache=cache)
            torch.manual_seed(1)
            logits[serve] = model(input_ids=torch.tensor([[9]]), cache=cache).logits
        served[serve] = hasattr(cache.layers[0], "_lowbit_buffers")
    assert served == {False: False, True: False}
    torch.testing.assert_close(logits[True], logits[False], rtol=0, atol=0)
    model = float_model("llama").train()
    assert fast_decoding(model)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 7, 22, 5]]), cache=cache)
        model(input_ids=torch.tensor([[9]]), cache=cache)
    assert hasattr(cache.layers[0], "_lowbit_buffers")


@pytest.mark.parametrize("cache_dtypes", ["autocast prompt", "bf16"])
@pytest.mark.parametrize("loop", ["C++", "Python"])
def test_a_cache_of_narrower_dtypes_is_promoted_as_the_forward_promotes_it(gguf_path, cache_dtypes, loop,
                                                                          monkeypatch):
    """A prompt run under torch.autocast leaves bf16 values beside fp32 keys
    (a cache may hold bf16 throughout): the model's forward promotes them to
    its fp32 as it appends the new token's, and so do the served steps."""
    if loop == "Python":
        monkeypatch.setattr(lowbit.decoding._StepPlan, "__init__", lambda *a: (_ for _ in ()).throw(
            lowbit.decoding._Unplannable("test")))
    model = lowbit.load_gguf_model(gguf_path)
    logits = {}
    for serve in (False, True):
        fast_decoding(model, serve)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            with torch.autocast("cpu", torch.bfloat16, enabled=cache_dtypes == "autocast prompt"):
                model(input_ids=torch.tensor([[1, 7, 22, 5]]), cache=cache)
            if cache_dtypes == "bf16":
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
            assert any(layer.values.dtype == torch.bfloat16 for layer in cache.layers)
            logits[serve] = torch.cat([model(input_ids=torch.tensor([[t]]), cache=cache).logits for t in (9, 3, 61)])
        assert all(layer.keys.dtype == layer.values.dtype == torch.float32 for layer in cache.layers)
    assert hasattr(cache.layers[0], "_lowbit_buffers")
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)
