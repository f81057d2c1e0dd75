"""The decode step (lowbit.decoding.fast_decoding) and its two ops.

rms_norm against transformers' RMSNorm and decode_attention against the
rotation and scaled_dot_product_attention transformers' llama-family
attention runs, on every CPU ISA and on CUDA; then whole models: a served
decode call gives the logits the model's own forward gives (fp32 rounding),
generate gives its tokens, and every call a step cannot serve (batches,
padding, extra outputs, a cache edited in between, LoRA on a fused
projection) runs the model's own forward or honours what changed."""
import pickle

import pytest
import torch
from torch.nn import functional as F
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import lowbit
from lowbit import ops
from lowbit.decoding import fast_decoding

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


# ---- rms_norm -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (5, 64), (2, 3, 4096), (7,)])
def test_rms_norm_is_transformers_rms_norm(device, dtype, shape):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = ops.rms_norm(x.to(device), norm.weight.to(device), norm.variance_epsilon).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_of_rows_with_other_strides():
    x = torch.randn(6, 128)[::2]  # rows 2 apart
    w = torch.randn(128)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.contiguous(), w, 1e-6))
    assert ops.rms_norm(torch.randn(0, 128), w, 1e-6).shape == (0, 128)


def test_rms_norm_gradient_is_transformers_gradient():
    torch.manual_seed(1)
    norm = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = torch.randn(3, 5, 48, requires_grad=True)
    grad = torch.randn(3, 5, 48)
    want = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    got = torch.autograd.grad(ops.rms_norm(x, norm.weight, 1e-6), (x, norm.weight), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_opcheck_and_compile(dtype):
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(64, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.lowbit.rms_norm, (x, w, 1e-6))
    compiled = torch.compile(lambda a, b: ops.rms_norm(a, b, 1e-6) * 2, fullgraph=True)
    assert torch.equal(compiled(x, w), ops.rms_norm(x, w, 1e-6) * 2)


# ---- decode_attention -------------------------------------------------------------

def rotary(position, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = position * inv
    emb = torch.cat((angles, angles))
    return emb.cos(), emb.sin()


def rotated(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def reference(q, k, v, cos, sin, key_cache, value_cache, position, scale):
    """transformers' rotation and SDPA (its keys and values repeated per group), in fp32."""
    f = lambda t: t.float()
    keys, values = f(key_cache).clone(), f(value_cache).clone()
    keys[:, position] = rotated(f(k), f(cos), f(sin))
    values[:, position] = f(v)
    groups = q.shape[0] // k.shape[0]
    keys = keys[:, :position + 1].repeat_interleave(groups, 0)
    values = values[:, :position + 1].repeat_interleave(groups, 0)
    out = F.scaled_dot_product_attention(rotated(f(q), f(cos), f(sin))[:, None], keys, values, scale=scale)
    return out[:, 0], keys[::groups, position], values[::groups, position]


def attention_case(q_heads, kv_heads, dim, capacity, position, dtype, spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: (torch.randn(*shape, generator=g) * spread).to(dtype)
    cos, sin = rotary(position, dim)
    return dict(q=r(q_heads, dim), k=r(kv_heads, dim), v=torch.randn(kv_heads, dim, generator=g).to(dtype),
                cos=cos.to(dtype), sin=sin.to(dtype), key_cache=r(kv_heads, capacity, dim),
                value_cache=torch.randn(kv_heads, capacity, dim, generator=g).to(dtype), position=position,
                scale=dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,capacity,position", [
    (9, 3, 64, 256, 160),   # SmolLM2's heads, the fp32 SIMD path
    (4, 4, 32, 8, 0),       # no grouping, the first token
    (8, 2, 48, 40, 39),     # a head size the SIMD path leaves to the portable loops; the last row
    (16, 2, 128, 2100, 2047),  # a long context
])
def test_decode_attention_is_rotation_and_sdpa(device, dtype, q_heads, kv_heads, dim, capacity, position):
    case = attention_case(q_heads, kv_heads, dim, capacity, position, dtype)
    before = {name: case[name].clone() for name in ("key_cache", "value_cache")}
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device).cpu()
    want, key_row, value_row = reference(**case)
    assert out.dtype == dtype and out.shape == (q_heads, dim)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    keys, values = on_device["key_cache"].cpu(), on_device["value_cache"].cpu()
    torch.testing.assert_close(keys[:, position].float(), key_row, **TOL[dtype])
    assert torch.equal(values[:, position].float(), value_row)
    others = [p for p in range(capacity) if p != position]
    assert torch.equal(keys[:, others], before["key_cache"][:, others])
    assert torch.equal(values[:, others], before["value_cache"][:, others])


def test_decode_attention_with_sharp_scores(device):
    """Scores hundreds apart: the softmax's exponents far below its maximum."""
    case = attention_case(6, 2, 64, 300, 299, torch.float32, spread=12.0)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device).cpu()
    want = reference(**case)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_decode_attention_is_the_same_on_any_thread_count():
    """Key-value heads are split over lowbit's pool: each computed the same whoever runs it."""
    case = attention_case(12, 4, 64, 100, 70, torch.float32)
    results = []
    before = ops.cpu_threads()
    try:
        for threads in (1, 2, 3):
            ops.cpu_threads(threads)
            results.append(ops.decode_attention(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                                   for k, v in case.items()}))
    finally:
        ops.cpu_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_decode_attention_refuses_gradients_and_opchecks():
    case = attention_case(4, 2, 32, 16, 5, torch.float32)
    torch.library.opcheck(torch.ops.lowbit.decode_attention, tuple(case.values()))
    q = case["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="^decode_attention: not differentiable.*q requires grad"):
        ops.decode_attention(**{**case, "q": q})
    with torch.no_grad():
        assert not ops.decode_attention(**{**case, "q": q}).requires_grad


def test_decode_attention_under_torch_compile_writes_the_caches():
    case = attention_case(4, 2, 32, 16, 5, torch.float32)
    eager = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    want = ops.decode_attention(**eager)

    @torch.compile(fullgraph=True)
    def step(q, k, v, cos, sin, key_cache, value_cache):
        return ops.decode_attention(q * 1.0, k, v, cos, sin, key_cache, value_cache, 5, 32 ** -0.5) + 0.0

    got = step(*(case[n] for n in ("q", "k", "v", "cos", "sin", "key_cache", "value_cache")))
    assert torch.equal(got, want)
    assert torch.equal(case["key_cache"], eager["key_cache"]) and torch.equal(case["value_cache"], eager["value_cache"])


# ---- whole models -----------------------------------------------------------------

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


def test_gptq_models_generate_through_served_steps():
    from test_generation import act_order_gptq_model

    model = act_order_gptq_model(seed=2)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    own = generate(model, ids)
    assert fast_decoding(model)
    served = generate(model, ids)
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
