"""The decode step (lowbit.decoding.fast_decoding) on whole models: a served
decode call gives the logits the model's own forward gives (fp32 rounding),
generate gives its tokens, and every call a step cannot serve (batches,
padding, extra outputs, a cache edited in between, LoRA on a fused
projection, hooks) runs the model's own forward or honours what changed.
Its ops alone: tests/test_decode_ops.py."""
import pickle

import pytest
import torch
from transformers import DynamicCache

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


def own_forward_logits(model, ids, cache, token):
    fast_decoding(model, False)
    try:
        return model(input_ids=token, cache=cache).logits
    finally:
        assert fast_decoding(model)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("llama", dict(head_dim=32, hidden_size=128)),  # the fp32 SIMD attention
    ("qwen2", {}), ("qwen3", {}),
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
        # the steps were served: the cache's tensors are views of the step's buffers
        assert all(layer.keys.data_ptr() == layer._lowbit_buffers[0].data_ptr() for layer in served.layers)
        assert served.get_seq_length() == ids.shape[1] + 9


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tiny_models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("decoding") / "llama.gguf", tiny_model("llama", seed=0), "llama")


def generate(model, ids, **kwargs):
    with torch.inference_mode():
        return model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True, **kwargs)


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


@pytest.mark.parametrize("layout", ["unsorted", "sorted", "int8", "int8 panels"])
def test_gptq_models_generate_through_served_steps(layout, monkeypatch):
    """An act-order model's layers as a checkpoint holds them (the activations
    permuted per call), with their rows sorted, with int8 activations and in
    gptq_gemm_a8's panels: the steps call each layer's op directly."""
    from test_generation import act_order_gptq_model

    model = act_order_gptq_model(seed=2)
    layers = [m for m in model.modules() if isinstance(m, lowbit.GPTQLinear)]
    for m in layers:
        if layout != "unsorted":
            m.sort_rows()
        m.int8_activations = layout.startswith("int8")
        if layout == "int8 panels" and m.can_repack():
            m.repack()
    assert layout != "int8 panels" or any(m.repacked for m in layers)
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


def test_a_cache_edited_between_steps():
    """Tokens appended by the model's own forward (two at once) and the cache
    cropped: the next steps start from what the cache holds."""
    model = float_model("llama")
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
            cache.crop(-3)
            logits.append(model(input_ids=tokens[2], cache=cache).logits)
            logits.append(model(input_ids=tokens[0], cache=cache).logits)
        caches[serve] = (cache, logits)
    for a, b in zip(caches[False][1], caches[True][1]):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert caches[True][0].get_seq_length() == caches[False][0].get_seq_length() == 7


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
    model = tiny_model("gemma", seed=0)
    assert not fast_decoding(model)
    assert "forward" not in model.__dict__
    assert not fast_decoding(tiny_model("qwen3moe", seed=0))
    from transformers import MistralConfig, MistralForCausalLM

    small = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)
    assert not fast_decoding(MistralForCausalLM(MistralConfig(sliding_window=8, **small)))
    assert fast_decoding(MistralForCausalLM(MistralConfig(sliding_window=None, **small)))
    half = tiny_model("llama", seed=0)  # a rotary embedding over half of each head
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
