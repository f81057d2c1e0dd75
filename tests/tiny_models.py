"""Tiny transformers models of every GGUF architecture lowbit loads, each
with the features its file must carry, written as llama.cpp's converter
writes them (gguf_files.write_model_gguf), and the float reference they
must load as (test_gguf_architectures.py, test_llama_cpp_architectures.py)."""
import copy

import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as T
from gguf import quants

from gguf_files import write_model_gguf

# Per architecture: the transformers config class, model class and config
# kwargs that give the tiny model each feature its file must carry.
MODELS = {
    # attention_bias gives the llama file Q/K biases, which the converter permutes like the weights.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True)),
    # Four layers: the fourth skips RoPE (NoPE), as every fourth does.
    "smollm3": (transformers.SmolLM3Config, transformers.SmolLM3ForCausalLM,
                dict(num_hidden_layers=4, pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    # Granite: every multiplier away from 1 (the attention's far from 1 / sqrt(16), softening the
    # sharpened attention of test_llama_cpp_architectures.py).
    "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM,
                dict(embedding_multiplier=0.3, attention_multiplier=0.03, residual_multiplier=2.0, logits_scaling=4.0,
                     pad_token_id=None, bos_token_id=None, eos_token_id=None)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # Q/K/V biases
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),  # q_norm, k_norm
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, {}),
    # A window shorter than the tests' 12 and 24 tokens, so that it masks;
    # heads wider than hidden / heads, and the query scale llama.cpp gives a
    # model of this size (head_dim; the converter writes none).
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(head_dim=32, sliding_window=5, query_pre_attn_scalar=32, attn_logit_softcapping=20.0,
                    final_logit_softcapping=10.0)),
    # One sliding and one global layer, each rotating with its own base (the
    # global one scaled), a final softcap (optional in gemma3 files).
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(head_dim=32, sliding_window=5, query_pre_attn_scalar=32,
                    layer_types=["sliding_attention", "full_attention"],
                    final_logit_softcapping=10.0,
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    # Mixtures of experts: 4 experts, 2 per token, so that 12 tokens give each several.
    "qwen3moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                 dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
    # A shared expert beside the routed ones, its gate a 1-D tensor in the
    # file; an LM head of its own (llama.cpp's qwen2moe requires output.weight).
    "qwen2moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                 dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, tie_word_embeddings=False)),
    # Mixtral: a llama file with experts (FILE_ARCH).
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    # gpt-oss: sinks, biases everywhere, biased experts stored [in, out] with
    # gate and up interleaved, clamped SwiGLU, a window of 5 on every other
    # layer, YaRN (its betas written, as the converter does).
    "gpt-oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=5,
                     tie_word_embeddings=False,
                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "original_max_position_embeddings": 16, "rope_theta": 1e4})),
    # Fused QKV and gate/up projections, half of each head rotated (as Phi-4-mini's 3/4).
    "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM,
             dict(pad_token_id=None, bos_token_id=None, eos_token_id=None,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})),
}
# Phi-3.5's and Phi-4-mini's LongRoPE (tiny_model("phi3", seed, **PHI3_LONGROPE)):
# per-frequency divisors, the short ones within the original context, as
# llama.cpp takes them for a context of up to 256 tokens (its smallest).
PHI3_LONGROPE = dict(max_position_embeddings=1024, original_max_position_embeddings=256, rope_parameters={
    "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
    "long_factor": [1.0, 3.0, 9.0, 27.0], "short_factor": [1.0, 1.5, 2.0, 4.0]})
# The metadata a converter writes that lowbit must read, beyond its defaults:
# gemma3's sliding-window pattern (llama.cpp's default is 5 sliding layers to
# a global one; this two-layer model alternates).
EXTRA_METADATA = {"gemma3": {"gemma3.attention.sliding_window_pattern": 2}}


# The general.architecture of each model's file, where it is not the model's name.
FILE_ARCH = {"mixtral": "llama"}


def tiny_model(arch, seed, **overrides):
    """The tiny `arch` model of MODELS, seeded; its norms and biases random."""
    config_class, model_class, extra = MODELS[arch]
    config = config_class(**{**dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    tie_word_embeddings=True), **extra, **overrides})
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1, which would hide a misplaced one
        for name, p in model.named_parameters():
            if p.ndim == 1 or name.endswith("_bias"):  # gpt-oss's experts' biases are [experts, rows]
                value = torch.randn_like(p) * 0.3 + (1 if name.endswith("norm.weight") else 0)
                p.copy_(torch.round(value * 1024) / 1024)  # a Gemma converter's + 1 exact
            elif is_router(name):  # routers decisive: no near-ties for two runs to break apart
                p.normal_(0, 0.5)
    return model


def act_order_gptq_model(seed):
    """tiny_model's Llama with every decoder Linear an act-order 4-bit GPTQ layer (asymmetric, g32, v2 zeros)."""
    import lowbit

    model = tiny_model("llama", seed=seed).eval()
    order = torch.Generator().manual_seed(seed)
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear) and name != "lm_head":
            perm = torch.randperm(m.in_features, generator=order)
            model.set_submodule(name, lowbit.GPTQLinear.from_linear(m, 4, 32, sym=False, checkpoint_format="gptq_v2",
                                                                    perm=perm))
    return model


def write_tiny_gguf(path, model, name, extra_metadata=None, **kwargs):
    """Model `name` of MODELS as llama.cpp's converter writes it, with EXTRA_METADATA."""
    extra = {**EXTRA_METADATA.get(name, {}), **(extra_metadata or {})}
    return write_model_gguf(str(path), model, FILE_ARCH.get(name, name), extra_metadata=extra, **kwargs)


def is_router(name):
    return name.endswith(("mlp.gate.weight", "mlp.router.weight"))


def through_q8_0(model):
    """The model with every weight matrix quantized and dequantized by gguf-py
    (experts' 3-D ones row by row, the rows of the file's [out, in] layout
    where the model keeps them [in, out]; not a router's or a bias, which
    files keep F32)."""
    model = copy.deepcopy(model)
    transposed = {n for n, m in model.named_modules() if getattr(m, "is_transposed", False)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and not is_router(name) and not name.endswith("_bias"):
                w = p.transpose(-1, -2) if name.rpartition(".")[0] in transposed else p
                q = quants.quantize(np.ascontiguousarray(w.numpy()), T.Q8_0)
                w.copy_(torch.from_numpy(quants.dequantize(q, T.Q8_0).reshape(w.shape)))
    return model


