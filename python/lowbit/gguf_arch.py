"""GGUF architectures: how a file that llama.cpp's converter wrote maps onto
a transformers model, from one table; no kernels.

Per architecture (ARCHITECTURES): the transformers class (another for a
file with experts where the architecture name is shared: a llama file's
Mixtral), the GGUF tensor names of a decoder layer and the module each
belongs to (a layer's 3-D expert tensors together make its experts module:
EXPERT_TENSORS), what the converter did to the HF checkpoint's values
(LlamaModel's Q/K row permutation, the Gemma models' + 1 on every norm
weight), and the transformers config kwargs read from the file's metadata
the way llama.cpp's loader reads them (defaults included: a key the
converter leaves out means what it means to llama.cpp). Facts from
llama.cpp's convert_hf_to_gguf.py (conversion/*.py) and
src/models/<arch>.cpp, llama-cpp-python 0.3.36's copy.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["Architecture", "ARCHITECTURES", "EXPERT_TENSORS", "architecture", "check_architecture", "hf_name",
           "expert_modules", "unpermute_rows", "rows_in_hf_order", "hf_value", "config_from_gguf"]

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# A decoder layer's tensors: GGUF base name -> module under model.layers.N.
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3's and gemma3's per-head RMSNorms
    "attn_k_norm": "self_attn.k_norm",
}
_GATED_FFN = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_BLOCK = {**_ATTENTION, **_GATED_FFN, "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma 2 and 3 norm each sublayer's input and output: llama.cpp's ffn_norm
# is the FFN's input norm, which transformers calls pre_feedforward_layernorm.
_GEMMA2_BLOCK = {**_ATTENTION, **_GATED_FFN, "attn_norm": "input_layernorm",
                 "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
# Mixture-of-experts layers: the router, and (EXPERT_TENSORS) the experts'
# 3-D tensors, which make one module together.
_MOE_BLOCK = {**_ATTENTION, "ffn_gate_inp": "mlp.gate", "attn_norm": "input_layernorm",
              "ffn_norm": "post_attention_layernorm"}
# Qwen2-MoE adds a shared expert, which every token goes through, scaled by
# a sigmoid gate of one row (a 1-D tensor in the file).
_QWEN2MOE_BLOCK = {**_MOE_BLOCK, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                   "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
                   "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}
# gpt-oss: biased attention with a learned sink logit per head (a parameter
# of the attention module itself: Architecture.parameters), a biased router,
# and the FFN's input norm under llama.cpp's name post_attention_norm.
_GPT_OSS_BLOCK = {**_ATTENTION, "ffn_gate_inp": "mlp.router", "attn_norm": "input_layernorm",
                  "post_attention_norm": "post_attention_layernorm"}
# Phi-3 keeps Q, K and V in one matrix and the FFN's gate and up in another,
# as transformers' Phi3 does ([q; k; v] and [gate; up] rows, unchanged).
_PHI3_BLOCK = {"attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def _no_extra(metadata: Mapping[str, Any], arch: str, tensors, config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    model_class: str  # the transformers class
    block: Mapping[str, str]  # a decoder layer's GGUF tensors -> modules under model.layers.N
    # The class AutoTokenizer picks for the file, named so that loading skips
    # AutoTokenizer's read of the whole file (None: AutoTokenizer finds it).
    tokenizer_class: str | None = None
    # The converter permuted attn_q's and attn_k's rows (and biases) from
    # HF's rotate-half order into llama.cpp's interleaved RoPE pairs.
    qk_rows_permuted: bool = False
    # The converter added this to every norm weight: Gemma's RMSNorm scales
    # by 1 + w, llama.cpp's by the stored value.
    norm_offset: float = 0.0
    # The transformers model multiplies token embeddings by sqrt(hidden_size)
    # (its ScaledWordEmbedding), as llama.cpp does after get_rows.
    scaled_embedding: bool = False
    # Whether the config can rotate only part of each head (rope.dimension_count
    # smaller than the head): transformers' Phi3 can, the others rotate all of it.
    partial_rotary: bool = False
    # The architecture of a file with experts ({arch}.expert_count > 0), where
    # that is another transformers class (a llama file's Mixtral).
    with_experts: Architecture | None = None
    # A decoder layer's GGUF tensors that are one parameter of a module (no
    # .weight of their own) -> that parameter under model.layers.N.
    parameters: Mapping[str, str] = field(default_factory=dict)
    # The architecture's own config kwargs: (metadata, arch, tensors, config
    # so far) -> kwargs. It may take out of the config so far what its class
    # spells otherwise (rope_theta and rope_scaling as rope_parameters).
    extra_config: Callable[[Mapping[str, Any], str, Any, dict], dict] = field(default=_no_extra)


def _attention_bias(tensors) -> dict:
    """Whether the attention projections have biases: the file's first
    layer's attn_q.bias."""
    return {"attention_bias": "blk.0.attn_q.bias" in set(tensors)}


def _rope_parameters(config: dict) -> dict:
    """transformers' rope_parameters, taken out of the config so far's
    rope_theta and rope_scaling (for the classes that spell them so)."""
    theta = config.pop("rope_theta")
    return {**(config.pop("rope_scaling", None) or {"rope_type": "default"}), "rope_theta": theta}


def _llama_extra(metadata, arch, tensors, config):
    return {**_attention_bias(tensors), "mlp_bias": "blk.0.ffn_up.bias" in set(tensors)}


def _smollm3_extra(metadata, arch, tensors, config):
    """llama.cpp's SmolLM3 skips RoPE in every 4th layer (its fixed
    n_no_rope_layer_step; the file says nothing of it)."""
    layers = config["num_hidden_layers"]
    return {**_llama_extra(metadata, arch, tensors, config), "no_rope_layer_interval": 4,
            "no_rope_layers": [int((il + 1) % 4 != 0) for il in range(layers)]}


def _granite_extra(metadata, arch, tensors, config):
    """Granite's multipliers under llama.cpp's names: the embeddings' and
    each sublayer's output scale (absent: 1), the attention's (absent: 1 /
    sqrt(head)), and the logits' divisor (required, as llama.cpp requires it)."""
    if f"{arch}.logit_scale" not in metadata:
        raise ValueError(f"config_from_gguf: metadata lacks {arch}.logit_scale")
    return {**_llama_extra(metadata, arch, tensors, config),
            "embedding_multiplier": float(metadata.get(f"{arch}.embedding_scale", 0.0)) or 1.0,
            "residual_multiplier": float(metadata.get(f"{arch}.residual_scale", 0.0)) or 1.0,
            "attention_multiplier": float(metadata.get(f"{arch}.attention.scale", 0.0)) or config["head_dim"] ** -0.5,
            "logits_scaling": float(metadata[f"{arch}.logit_scale"])}


def _qwen3_extra(metadata, arch, tensors, config):
    return _attention_bias(tensors)


def _experts_config(metadata, arch, count_key: str, used_key: str) -> dict:
    """The expert counts, and llama.cpp's routing: softmax over the experts,
    the top expert_used_count of them, their weights renormalized to sum to 1
    (build_moe_ffn with norm_w)."""
    count, used = metadata.get(f"{arch}.expert_count", 0), metadata.get(f"{arch}.expert_used_count", 0)
    if count <= 0 or not 0 < used <= count:
        raise ValueError(f"config_from_gguf: {arch} file with {arch}.expert_count {count} and "
                         f"{arch}.expert_used_count {used}")
    return {count_key: count, used_key: used}


def _mixtral_extra(metadata, arch, tensors, config):
    return _experts_config(metadata, arch, "num_local_experts", "num_experts_per_tok")


def _qwen_moe_config(metadata, arch, config, normalized: bool) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's: every layer routes, each expert's FFN
    size (llama.cpp's default: feed_forward_length / expert_used_count),
    and whether llama.cpp renormalizes the chosen experts' weights."""
    return {**_experts_config(metadata, arch, "num_experts", "num_experts_per_tok"),
            "moe_intermediate_size": metadata.get(f"{arch}.expert_feed_forward_length",
                                                  config["intermediate_size"] // metadata[f"{arch}.expert_used_count"]),
            "norm_topk_prob": normalized, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2moe_extra(metadata, arch, tensors, config):
    shared = metadata.get(f"{arch}.expert_shared_feed_forward_length", config["intermediate_size"])
    return {**_qwen_moe_config(metadata, arch, config, normalized=False), "shared_expert_intermediate_size": shared}


def _qwen3moe_extra(metadata, arch, tensors, config):
    return {**_qwen_moe_config(metadata, arch, config, normalized=True), **_attention_bias(tensors)}


def _layer_types(metadata: Mapping[str, Any], arch: str, layers: int, default_pattern: int) -> list[str]:
    """Each layer's attention as llama.cpp's load_swa_pattern sets it:
    attention.sliding_window_pattern is a per-layer array, or n (sliding but
    every n-th layer; 0: all sliding), default `default_pattern`."""
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ValueError(f"config_from_gguf: {arch}.attention.sliding_window_pattern has {len(pattern)} "
                             f"entries for {layers} layers")
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [pattern == 0 or il % pattern < pattern - 1 for il in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _query_pre_attn_scalar(config: dict, largest_layers: int) -> int:
    """The query scale's 1 / sqrt() argument, which the converter does not
    write: llama.cpp takes the head size, but hidden / heads for the 27B
    model (the one with `largest_layers` layers), as gemma_pytorch does."""
    if config["num_hidden_layers"] == largest_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _gemma_extra(metadata, arch, tensors, config):
    return {"hidden_act": "gelu_pytorch_tanh"}  # llama.cpp's GELU is the tanh form


def _gemma2_extra(metadata, arch, tensors, config):
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": metadata.get(f"{arch}.attention.sliding_window", 4096),
        "layer_types": _layer_types(metadata, arch, layers, 2),
        "attn_logit_softcapping": float(metadata.get(f"{arch}.attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(metadata.get(f"{arch}.final_logit_softcapping", 30.0)),
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, 46),
    }


def _gemma3_extra(metadata, arch, tensors, config):
    layers = config["num_hidden_layers"]
    window = metadata.get(f"{arch}.attention.sliding_window", 0)
    layer_types = _layer_types(metadata, arch, layers, 6) if window > 0 else ["full_attention"] * layers
    # Sliding layers rotate with their own base and no scaling (llama.cpp's
    # rope_freq_base_train_swa, default 10000, and freq_scale_train_swa 1).
    sliding = {"rope_type": "default", "rope_theta": float(metadata.get(f"{arch}.rope.freq_base_swa", 10000.0))}
    full = _rope_parameters(config)
    softcap = metadata.get(f"{arch}.final_logit_softcapping")
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": window if window > 0 else None,
        "layer_types": layer_types,
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
        "final_logit_softcapping": float(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, 62),
    }


def _gpt_oss_extra(metadata, arch, tensors, config):
    """gpt-oss's: experts (the top expert_used_count of the router's logits,
    softmax over those: llama.cpp's SOFTMAX_WEIGHT gating, as transformers'
    GptOss routes), each of expert_feed_forward_length; sliding layers every
    other one from the first (llama.cpp's pattern 2) with the same rotary
    embedding as the global ones; llama.cpp's fixed SwiGLU constants."""
    rope = _rope_parameters(config)
    if float(metadata.get(f"{arch}.rope.freq_base_swa", rope["rope_theta"])) != rope["rope_theta"]:
        raise ValueError(f"config_from_gguf: {arch}.rope.freq_base_swa differs from rope.freq_base; transformers' "
                         "GptOss rotates every layer alike")
    return {**_experts_config(metadata, arch, "num_local_experts", "num_experts_per_tok"),
            "intermediate_size": metadata[f"{arch}.expert_feed_forward_length"],
            "sliding_window": metadata[f"{arch}.attention.sliding_window"],
            "layer_types": _layer_types(metadata, arch, config["num_hidden_layers"], 2),
            "rope_parameters": rope, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, **_attention_bias(tensors)}


def _phi3_extra(metadata, arch, tensors, config):
    """Phi3's head is hidden / heads, and any partial rotation a factor of
    it; LongRoPE files carry their per-frequency factors as tensors."""
    head = config.pop("head_dim")
    if head * config["num_attention_heads"] != config["hidden_size"]:
        raise ValueError(f"config_from_gguf: {arch} heads have {head} dimensions, not hidden / heads = "
                         f"{config['hidden_size'] // config['num_attention_heads']}")
    rope = _rope_parameters(config)
    rope["partial_rotary_factor"] = metadata.get(f"{arch}.rope.dimension_count", head) / head
    original = metadata.get(f"{arch}.rope.scaling.original_context_length", config["max_position_embeddings"])
    if rope["rope_type"] == "longrope":
        rope.update(original_max_position_embeddings=original, **_longrope_factors(metadata, arch, tensors))
    window = metadata.get(f"{arch}.attention.sliding_window", 0)
    return {"rope_parameters": rope, "original_max_position_embeddings": original,
            "sliding_window": window if window > 0 else None}


def _longrope_factors(metadata, arch, tensors) -> dict:
    if not isinstance(tensors, Mapping):
        raise ValueError("config_from_gguf: a LongRoPE file's config needs its tensors' values (pass the mapping "
                         "name -> tensor), not only their names")
    factors = {}
    for kind in ("long", "short"):
        t = tensors.get(f"rope_factors_{kind}.weight")
        if t is None:
            raise ValueError(f"config_from_gguf: {arch}.rope.scaling.type is longrope but the file has no "
                             f"rope_factors_{kind}.weight")
        factors[f"{kind}_factor"] = t.dequantize().reshape(-1).tolist()
    attention = metadata.get(f"{arch}.rope.scaling.attn_factor")
    if attention is not None:
        factors["attention_factor"] = float(attention)
    return factors


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture("LlamaForCausalLM", _LLAMA_BLOCK, "TokenizersBackend", qk_rows_permuted=True,
                          extra_config=_llama_extra,
                          with_experts=Architecture("MixtralForCausalLM", _MOE_BLOCK, "TokenizersBackend",
                                                    qk_rows_permuted=True, extra_config=_mixtral_extra)),
    # SmolLM3's converter is llama's (LlamaModel: Q/K rows permuted).
    "smollm3": Architecture("SmolLM3ForCausalLM", _LLAMA_BLOCK, "TokenizersBackend", qk_rows_permuted=True,
                            extra_config=_smollm3_extra),
    # Granite's converter is llama's too, and writes its multipliers.
    "granite": Architecture("GraniteForCausalLM", _LLAMA_BLOCK, "TokenizersBackend", qk_rows_permuted=True,
                            extra_config=_granite_extra),
    "qwen2": Architecture("Qwen2ForCausalLM", _LLAMA_BLOCK, "Qwen2Tokenizer"),
    "qwen3": Architecture("Qwen3ForCausalLM", _LLAMA_BLOCK, "Qwen2Tokenizer", extra_config=_qwen3_extra),
    "gemma": Architecture("GemmaForCausalLM", _LLAMA_BLOCK, norm_offset=1.0, scaled_embedding=True,
                          extra_config=_gemma_extra),
    "gemma2": Architecture("Gemma2ForCausalLM", _GEMMA2_BLOCK, norm_offset=1.0, scaled_embedding=True,
                           extra_config=_gemma2_extra),
    "gemma3": Architecture("Gemma3ForCausalLM", _GEMMA2_BLOCK, norm_offset=1.0, scaled_embedding=True,
                           extra_config=_gemma3_extra),
    "phi3": Architecture("Phi3ForCausalLM", _PHI3_BLOCK, partial_rotary=True, extra_config=_phi3_extra),
    "qwen2moe": Architecture("Qwen2MoeForCausalLM", _QWEN2MOE_BLOCK, "Qwen2Tokenizer", extra_config=_qwen2moe_extra),
    "qwen3moe": Architecture("Qwen3MoeForCausalLM", _MOE_BLOCK, "Qwen2Tokenizer", extra_config=_qwen3moe_extra),
    "gpt-oss": Architecture("GptOssForCausalLM", _GPT_OSS_BLOCK, "TokenizersBackend", extra_config=_gpt_oss_extra,
                            parameters={"attn_sinks": "self_attn.sinks"}),
}

# A layer's expert tensors (3-D: [experts, rows, n]) -> their part of GGUFExperts.
EXPERT_TENSORS = {"ffn_gate_exps": "gate", "ffn_up_exps": "up", "ffn_down_exps": "down"}

_NAME_RE = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")


def check_architecture(metadata: Mapping[str, Any], where: str) -> str:
    """The file's general.architecture, or ValueError if lowbit does not know
    how its converter wrote it (a wrong guess would load and compute garbage)."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def architecture(metadata: Mapping[str, Any], where: str) -> Architecture:
    """The file's Architecture: its general.architecture's, or that one's
    with_experts where the file has experts."""
    arch = check_architecture(metadata, where)
    spec = ARCHITECTURES[arch]
    if spec.with_experts is not None and metadata.get(f"{arch}.expert_count", 0) > 0:
        return spec.with_experts
    return spec


def hf_name(gguf_name: str, arch: str | Architecture) -> str | None:
    """The transformers parameter name of a GGUF tensor in a file of
    architecture `arch` (a name of ARCHITECTURES, or the Architecture), or
    None for tensors with no HF parameter of their own (rope_freqs,
    rope_factors_*, the experts' tensors: expert_modules) or unknown names."""
    m = _NAME_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, base, suffix = m["layer"], m["base"], m["suffix"]
    if layer is None:
        prefix = _GLOBAL_NAMES.get(base)
    else:
        spec = ARCHITECTURES[arch] if isinstance(arch, str) else arch
        if base in spec.parameters:
            return f"model.layers.{layer}.{spec.parameters[base]}" if suffix == "weight" else None
        module = spec.block.get(base)
        prefix = None if module is None else f"model.layers.{layer}.{module}"
    return None if prefix is None else f"{prefix}.{suffix}"


def expert_modules(names: Iterable[str]) -> dict[str, dict[str, str]]:
    """The experts modules a file's tensors make: transformers' module name
    (model.layers.N.mlp.experts) -> {"gate" | "up" | "down": GGUF tensor name,
    and "gate.bias" | "up.bias" | "down.bias" for gpt-oss's biases}."""
    modules: dict[str, dict[str, str]] = {}
    for name in names:
        m = _NAME_RE.fullmatch(name)
        if m and m["layer"] is not None and m["base"] in EXPERT_TENSORS:
            part = EXPERT_TENSORS[m["base"]] + ("" if m["suffix"] == "weight" else ".bias")
            modules.setdefault(f"model.layers.{m['layer']}.mlp.experts", {})[part] = name
    return modules


def unpermute_rows(data: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf.py's Q/K row permutation (n_head = attention heads
    for attn_q, KV heads for attn_k).

    The converter turns HF's rotate-half layout into llama.cpp's interleaved
    RoPE pairs: per head it views the rows as (2, half) and transposes to
    (half, 2). Viewing them as (half, 2) and transposing back restores HF order.
    Only whole rows move, so this is exact on quantized [rows, row_bytes] data.
    Returns a new tensor (a copy, so a memory-mapped `data` is left untouched).
    """
    rows = data.shape[0]
    if n_head < 1 or rows % (2 * n_head):
        raise ValueError(f"unpermute_rows: {rows} rows do not split into {n_head} heads of pairs")
    # Source row of each HF row: HF (head, i, j) sits at GGUF (head, j, i).
    perm = torch.arange(rows, device=data.device).reshape(n_head, rows // n_head // 2, 2)
    return data.index_select(0, perm.transpose(1, 2).reshape(-1))


def rows_in_hf_order(name: str, rows: torch.Tensor, metadata: Mapping[str, Any]) -> torch.Tensor:
    """The rows of GGUF tensor `name` in HF order (a weight's rows, or a bias's
    elements): where the converter permuted them (a llama file's attn_q and
    attn_k weights and biases) unpermuted with the file's head counts;
    everything else is as stored."""
    arch = check_architecture(metadata, "rows_in_hf_order")
    if not architecture(metadata, "rows_in_hf_order").qk_rows_permuted:
        return rows
    n_head = metadata.get(f"{arch}.attention.head_count")
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_rows(rows, n_head)
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return unpermute_rows(rows, metadata.get(f"{arch}.attention.head_count_kv", n_head))
    return rows


def hf_value(name: str, value: torch.Tensor, metadata: Mapping[str, Any]) -> torch.Tensor:
    """A float GGUF tensor (norm, bias, embedding) as the transformers model
    holds it: in HF row order, and a norm weight less what the converter
    added to it (the Gemma models' 1; exact wherever the stored value is 0.5
    or more)."""
    value = rows_in_hf_order(name, value, metadata)
    offset = architecture(metadata, "hf_value").norm_offset
    if offset and name.endswith("norm.weight"):
        value = value - offset
    return value


# transformers config kwarg <- GGUF key without the "<arch>." prefix.
_REQUIRED_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "max_position_embeddings": "context_length",
}

_TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def config_from_gguf(metadata: Mapping[str, Any], tensors: Iterable[str] | Mapping[str, Any]) -> dict[str, Any]:
    """Kwargs for the transformers config class of the file's architecture
    (ARCHITECTURES[arch].model_class's) from a GGUF file's metadata, read the
    way llama.cpp reads it.

    `tensors` are the file's tensors, names or a mapping name -> GGUFTensor:
    a file without output.weight ties the LM head to the token embedding,
    llama / qwen3 files with Q or FFN biases need configs that give the model
    those biases (qwen2 always has Q/K/V biases), and a phi3 LongRoPE file's
    factors are tensors (their values need the mapping).
    """
    arch = check_architecture(metadata, "config_from_gguf")
    spec = architecture(metadata, "config_from_gguf")
    missing = [f"{arch}.{k}" for k in _REQUIRED_KEYS.values() if f"{arch}.{k}" not in metadata]
    if missing:
        raise ValueError(f"config_from_gguf: metadata lacks {', '.join(missing)}")

    config = {kwarg: metadata[f"{arch}.{key}"] for kwarg, key in _REQUIRED_KEYS.items()}
    config["vocab_size"] = _vocab_size(metadata, arch)
    # Absent head_count_kv means plain multi-head attention (llama.cpp's default too).
    config["num_key_value_heads"] = metadata.get(f"{arch}.attention.head_count_kv", config["num_attention_heads"])
    config["head_dim"] = _head_dim(metadata, arch, config["hidden_size"], config["num_attention_heads"],
                                   spec.partial_rotary)
    config["rope_theta"] = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(metadata, arch)
    if scaling is not None:
        config["rope_scaling"] = {**scaling, "rope_theta": config["rope_theta"]}
    config["tie_word_embeddings"] = "output.weight" not in set(tensors)
    # The file's special tokens, and none where it names none (a transformers
    # default could lie outside the file's vocabulary).
    for kwarg, key in _TOKEN_ID_KEYS.items():
        config[kwarg] = metadata.get(key)
    config.update(spec.extra_config(metadata, arch, tensors, config))
    return config


def _vocab_size(metadata: Mapping[str, Any], arch: str) -> int:
    if f"{arch}.vocab_size" in metadata:
        return metadata[f"{arch}.vocab_size"]
    if "tokenizer.ggml.tokens" in metadata:
        return len(metadata["tokenizer.ggml.tokens"])
    raise ValueError(f"config_from_gguf: metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")


def _head_dim(metadata: Mapping[str, Any], arch: str, hidden: int, n_head: int, partial_rotary: bool) -> int:
    """llama.cpp's head size: attention.key_length, else embedding / heads.
    The rotated part (rope.dimension_count) must be the whole head where the
    transformers class rotates every dimension."""
    head_dim = metadata.get(f"{arch}.attention.key_length", hidden // n_head)
    rotated = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotated > head_dim or rotated % 2 or (rotated != head_dim and not partial_rotary):
        raise ValueError(f"config_from_gguf: {arch}.rope.dimension_count is {rotated} but heads have {head_dim} "
                         f"dimensions; partial rotary embeddings are not supported for {arch}")
    return head_dim


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """transformers rope parameters for the file's rope.scaling.* keys (types
    none, linear and yarn, and phi3's longrope, the ones llama.cpp's
    converter writes for these architectures), or None without scaling."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "longrope" and arch == "phi3":  # its factors are tensors (_longrope_factors)
        return {"rope_type": "longrope"}
    factor = float(metadata[f"{arch}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        # llama.cpp's corrections range is whole dimensions (floor / ceil):
        # transformers' truncate, its default. The betas default alike; an
        # attention factor or extrapolation mix of the file's own, which
        # llama.cpp combines with its context parameters, is refused.
        rope = {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": metadata[f"{arch}.rope.scaling.original_context_length"]}
        for key in ("yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"):
            if f"{arch}.rope.scaling.{key}" in metadata:
                raise ValueError(f"config_from_gguf: {arch}.rope.scaling.{key} is not supported")
        for key, kwarg in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in metadata:
                rope[kwarg] = float(metadata[f"{arch}.rope.scaling.{key}"])
        return rope
    raise ValueError(f"config_from_gguf: {arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn"
                     f"{', longrope' if arch == 'phi3' else ''})")
