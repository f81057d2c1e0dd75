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
converter leaves out means what it means to llama.cpp), each through one
typed accessor (_Metadata.get) that refuses a value of the wrong type or
range with a GGUFError naming the file and the key. Facts from
llama.cpp's convert_hf_to_gguf.py (conversion/*.py) and
src/models/<arch>.cpp, llama-cpp-python 0.3.36's copy.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._checks import MAX_INT, MAX_NORM_EPS, MAX_ROPE_BASE, MAX_SCALE, check_positive, shown
from .file import GGUFError

__all__ = ["Architecture", "ARCHITECTURES", "EXPERT_TENSORS", "architecture", "check_architecture", "hf_name",
           "expert_modules", "unpermute_rows", "rows_in_hf_order", "hf_value", "config_from_gguf",
           "check_block_count"]

_REQUIRED = object()  # _Metadata.get's default: the key must be there
_KINDS = {int: "an integer", float: "a number", str: "a string", list: "an array", bool: "a boolean"}


class _Metadata:
    """A GGUF file's metadata read through one typed accessor: a missing key,
    a value of the wrong type or out of range is a GGUFError naming the file
    (`where`) and the key, not a KeyError, TypeError or ZeroDivisionError (or
    transformers' own error) somewhere later."""

    def __init__(self, metadata: Mapping[str, Any], where: str):
        self.metadata, self.where = metadata, where

    def __contains__(self, key: str) -> bool:
        return key in self.metadata

    def error(self, key: str, problem: str) -> GGUFError:
        return GGUFError(f"{self.where}: metadata {key!r}: {problem}")

    def get(self, key: str, kind: type, default: Any = _REQUIRED, minimum: float | None = None,
            positive: bool = False, maximum: float | None = None) -> Any:
        """metadata[key], else `default` (none given: the key is required), of
        `kind`: int (not a bool, at most MAX_INT), float (an int or a float,
        finite; returned as a float), str, bool or list; a number at least
        `minimum`, above 0 where `positive`, at most `maximum`."""
        if key not in self.metadata:
            if default is _REQUIRED:
                raise self.error(key, "missing")
            return default
        value = self.metadata[key]
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if kind is int:
            ok = number and isinstance(value, int)
        elif kind is float:
            ok = number and math.isfinite(value)
        else:
            ok = isinstance(value, kind)
        if not ok:
            raise self.error(key, f"expected {_KINDS[kind]}, got {type(value).__name__} {shown(value)}")
        if positive and value <= 0:
            raise self.error(key, f"must be > 0, got {shown(value)}")
        if minimum is not None and value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {shown(value)}")
        if maximum is None and kind is int:
            maximum = MAX_INT
        if maximum is not None and value > maximum:
            raise self.error(key, f"must be <= {maximum}, got {shown(value)}")
        return float(value) if kind is float else value


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


def _no_extra(m, arch: str, tensors, config: dict) -> dict:
    return {}


@dataclass(frozen=True)
class Architecture:
    """How a GGUF architecture becomes a transformers model: its class, its
    tensor names, and what llama.cpp's converter changed on the way."""

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
    # The architecture's own config kwargs: (the file's _Metadata, arch,
    # tensors, config so far) -> kwargs. It may take out of the config so far
    # what its class spells otherwise (rope_theta and rope_scaling as rope_parameters).
    extra_config: Callable[[_Metadata, str, Any, dict], dict] = field(default=_no_extra)


def _attention_bias(tensors) -> dict:
    """Whether the attention projections have biases: the file's first
    layer's attn_q.bias."""
    return {"attention_bias": "blk.0.attn_q.bias" in set(tensors)}


def _rope_base(m: _Metadata, key: str, default: float) -> float:
    return m.get(key, float, default, positive=True, maximum=MAX_ROPE_BASE)


def _scale(m: _Metadata, key: str, default: Any = _REQUIRED, zero: bool = False) -> float | None:
    """A multiplier or softcap, within 1 / MAX_SCALE .. MAX_SCALE (a unit
    activation scaled by one stays a float16 number), or 0 where `zero`
    (llama.cpp's: the default, or none)."""
    value = m.get(key, float, default, minimum=0.0, positive=not zero, maximum=MAX_SCALE)
    if value and value < 1 / MAX_SCALE:
        raise m.error(key, f"must be {'0 or ' if zero else ''}>= {1 / MAX_SCALE}, got {shown(value)}")
    return value


def _rope_parameters(config: dict) -> dict:
    """transformers' rope_parameters, taken out of the config so far's
    rope_theta and rope_scaling (for the classes that spell them so)."""
    theta = config.pop("rope_theta")
    return {**(config.pop("rope_scaling", None) or {"rope_type": "default"}), "rope_theta": theta}


def _llama_extra(m, arch, tensors, config):
    return {**_attention_bias(tensors), "mlp_bias": "blk.0.ffn_up.bias" in set(tensors)}


def _smollm3_extra(m, arch, tensors, config):
    """llama.cpp's SmolLM3 skips RoPE in every 4th layer (its fixed
    n_no_rope_layer_step; the file says nothing of it)."""
    layers = config["num_hidden_layers"]
    return {**_llama_extra(m, arch, tensors, config), "no_rope_layer_interval": 4,
            "no_rope_layers": [int((il + 1) % 4 != 0) for il in range(layers)]}


def _granite_extra(m, arch, tensors, config):
    """Granite's multipliers under llama.cpp's names: the embeddings' and
    each sublayer's output scale (absent or 0: 1), the attention's (absent
    or 0: 1 / sqrt(head)), and the logits' divisor (required, as llama.cpp requires it)."""
    return {**_llama_extra(m, arch, tensors, config),
            "embedding_multiplier": _scale(m, f"{arch}.embedding_scale", 0.0, zero=True) or 1.0,
            "residual_multiplier": _scale(m, f"{arch}.residual_scale", 0.0, zero=True) or 1.0,
            "attention_multiplier": _scale(m, f"{arch}.attention.scale", 0.0, zero=True)
            or config["head_dim"] ** -0.5,
            "logits_scaling": _scale(m, f"{arch}.logit_scale")}


def _qwen3_extra(m, arch, tensors, config):
    return _attention_bias(tensors)


def _experts_config(m, arch, count_key: str, used_key: str) -> dict:
    """The expert counts, and llama.cpp's routing: softmax over the experts,
    the top expert_used_count of them, their weights renormalized to sum to 1
    (build_moe_ffn with norm_w)."""
    count = m.get(f"{arch}.expert_count", int, positive=True)
    used = m.get(f"{arch}.expert_used_count", int, positive=True)
    if used > count:
        raise m.error(f"{arch}.expert_used_count", f"{used} experts per token, of {count} ({arch}.expert_count)")
    return {count_key: count, used_key: used}


def _mixtral_extra(m, arch, tensors, config):
    return _experts_config(m, arch, "num_local_experts", "num_experts_per_tok")


def _qwen_moe_config(m, arch, config, normalized: bool) -> dict:
    """Qwen2-MoE's and Qwen3-MoE's: every layer routes, each expert's FFN
    size (llama.cpp's default: feed_forward_length / expert_used_count),
    and whether llama.cpp renormalizes the chosen experts' weights."""
    experts = _experts_config(m, arch, "num_experts", "num_experts_per_tok")
    default_size = config["intermediate_size"] // experts["num_experts_per_tok"]
    return {**experts,
            "moe_intermediate_size": m.get(f"{arch}.expert_feed_forward_length", int, default_size, positive=True),
            "norm_topk_prob": normalized, "decoder_sparse_step": 1, "mlp_only_layers": []}


def _qwen2moe_extra(m, arch, tensors, config):
    shared = m.get(f"{arch}.expert_shared_feed_forward_length", int, config["intermediate_size"], positive=True)
    return {**_qwen_moe_config(m, arch, config, normalized=False), "shared_expert_intermediate_size": shared}


def _qwen3moe_extra(m, arch, tensors, config):
    return {**_qwen_moe_config(m, arch, config, normalized=True), **_attention_bias(tensors)}


def _layer_types(m: _Metadata, arch: str, layers: int, default_pattern: int) -> list[str]:
    """Each layer's attention as llama.cpp's load_swa_pattern sets it:
    attention.sliding_window_pattern is a per-layer array, or n (sliding but
    every n-th layer; 0: all sliding), default `default_pattern`."""
    key = f"{arch}.attention.sliding_window_pattern"
    if isinstance(m.metadata.get(key), list):
        pattern = m.get(key, list)
        if len(pattern) != layers or not all(isinstance(p, int) for p in pattern):
            raise m.error(key, f"{len(pattern)} entries for {layers} layers, expected a boolean per layer")
        sliding = [bool(p) for p in pattern]
    else:
        n = m.get(key, int, default_pattern, minimum=0)
        sliding = [n == 0 or il % n < n - 1 for il in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _query_pre_attn_scalar(config: dict, largest_layers: int) -> int:
    """The query scale's 1 / sqrt() argument, which the converter does not
    write: llama.cpp takes the head size, but hidden / heads for the 27B
    model (the one with `largest_layers` layers), as gemma_pytorch does."""
    if config["num_hidden_layers"] == largest_layers:
        return config["hidden_size"] // config["num_attention_heads"]
    return config["head_dim"]


def _sliding_window(m, arch, config, default=_REQUIRED, positive=False) -> int:
    """attention.sliding_window (0: none, where not `positive`), at most the
    context length: a longer window masks nothing a sequence within the
    context reaches (and a u64 one past int64 would overflow transformers'
    cache). A window of 1 is refused: transformers' sliding cache keeps a
    step's last window - 1 rows as rows[-0:], every row, so decoding would
    attend to all of them."""
    key = f"{arch}.attention.sliding_window"
    window = min(m.get(key, int, default, minimum=None if positive else 0, positive=positive),
                 config["max_position_embeddings"])
    if window == 1:
        raise m.error(key, "a window of 1 (each token attending to itself alone) is not supported: transformers' "
                      "sliding cache would keep every row")
    return window


def _gemma_extra(m, arch, tensors, config):
    return {"hidden_act": "gelu_pytorch_tanh"}  # llama.cpp's GELU is the tanh form


def _gemma2_extra(m, arch, tensors, config):
    layers = config["num_hidden_layers"]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": _sliding_window(m, arch, config, 4096, positive=True),
        "layer_types": _layer_types(m, arch, layers, 2),
        "attn_logit_softcapping": _scale(m, f"{arch}.attn_logit_softcapping", 50.0),
        "final_logit_softcapping": _scale(m, f"{arch}.final_logit_softcapping", 30.0),
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, 46),
    }


def _gemma3_extra(m, arch, tensors, config):
    layers = config["num_hidden_layers"]
    window = _sliding_window(m, arch, config, 0)
    layer_types = _layer_types(m, arch, layers, 6) if window > 0 else ["full_attention"] * layers
    # Sliding layers rotate with their own base and no scaling (llama.cpp's
    # rope_freq_base_train_swa, default 10000, and freq_scale_train_swa 1).
    sliding = {"rope_type": "default",
               "rope_theta": _rope_base(m, f"{arch}.rope.freq_base_swa", 10000.0)}
    full = _rope_parameters(config)
    softcap = _scale(m, f"{arch}.final_logit_softcapping", 0.0, zero=True)
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        # Without a window every layer is global, but transformers' Gemma3 builds
        # a sliding mask all the same and needs a window for it: the context's, which masks nothing.
        "sliding_window": window if window > 0 else config["max_position_embeddings"],
        "layer_types": layer_types,
        "rope_parameters": {"full_attention": full, "sliding_attention": sliding},
        "final_logit_softcapping": softcap or None,
        "attn_logit_softcapping": None,
        "query_pre_attn_scalar": _query_pre_attn_scalar(config, 62),
    }


def _gpt_oss_extra(m, arch, tensors, config):
    """gpt-oss's: experts (the top expert_used_count of the router's logits,
    softmax over those: llama.cpp's SOFTMAX_WEIGHT gating, as transformers'
    GptOss routes), each of expert_feed_forward_length; sliding layers every
    other one from the first (llama.cpp's pattern 2) with the same rotary
    embedding as the global ones; llama.cpp's fixed SwiGLU constants."""
    rope = _rope_parameters(config)
    if _rope_base(m, f"{arch}.rope.freq_base_swa", rope["rope_theta"]) != rope["rope_theta"]:
        raise m.error(f"{arch}.rope.freq_base_swa", "differs from rope.freq_base; transformers' GptOss rotates "
                      "every layer alike")
    return {**_experts_config(m, arch, "num_local_experts", "num_experts_per_tok"),
            "intermediate_size": m.get(f"{arch}.expert_feed_forward_length", int, positive=True),
            "sliding_window": _sliding_window(m, arch, config, positive=True),
            "layer_types": _layer_types(m, arch, config["num_hidden_layers"], 2),
            "rope_parameters": rope, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, **_attention_bias(tensors)}


def _phi3_extra(m, arch, tensors, config):
    """Phi3's head is hidden / heads, and any partial rotation a factor of
    it; LongRoPE files carry their per-frequency factors as tensors."""
    head = config.pop("head_dim")
    if head * config["num_attention_heads"] != config["hidden_size"]:
        raise m.error(f"{arch}.attention.key_length", f"{arch} heads have {head} dimensions, not hidden / heads = "
                      f"{config['hidden_size'] // config['num_attention_heads']}")
    rope = _rope_parameters(config)
    rotated = m.get(f"{arch}.rope.dimension_count", int, head, positive=True)
    # transformers rotates int(head * factor) dimensions, and rotated / head * head
    # may round below rotated (60 of 88: 59, which divides every frequency's exponent).
    factor = rotated / head
    while int(head * factor) < rotated:
        factor = math.nextafter(factor, math.inf)
    rope["partial_rotary_factor"] = factor
    original = m.get(f"{arch}.rope.scaling.original_context_length", int, config["max_position_embeddings"],
                     positive=True)
    # llama.cpp's converter writes a LongRoPE model's factors with no rope.scaling.type: the tensors say it.
    if rope["rope_type"] == "longrope" or (f"{arch}.rope.scaling.type" not in m
                                           and "rope_factors_long.weight" in tensors):
        rope.update(rope_type="longrope", original_max_position_embeddings=original,
                    **_longrope_factors(m, arch, tensors, rotated // 2))
    window = _sliding_window(m, arch, config, 0)
    # A window at least as long as the context (Phi-3.5-mini's and Phi-4-mini's
    # 262144 over 131072) masks nothing a sequence within it reaches: none,
    # so that the model's cache is transformers' plain one, which decode steps serve.
    if window >= config["max_position_embeddings"]:
        window = 0
    return {"rope_parameters": rope, "original_max_position_embeddings": original,
            "sliding_window": window if window > 0 else None}


def _longrope_factors(m, arch, tensors, frequencies: int) -> dict:
    """A LongRoPE file's factors: one per rotated frequency in each tensor,
    whose shape llama.cpp requires to be exactly that (checked before its
    values are read: a corrupt one may be of any size)."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"{m.where}: a LongRoPE file's config needs its tensors' values (pass the mapping "
                         "name -> tensor), not only their names")
    factors = {}
    for kind in ("long", "short"):
        t = tensors.get(f"rope_factors_{kind}.weight")
        if t is None:
            raise m.error(f"{arch}.rope.scaling.type", f"longrope, but the file has no rope_factors_{kind}.weight")
        if tuple(t.shape) != (frequencies,):
            raise GGUFError(f"{m.where}: tensor 'rope_factors_{kind}.weight' has shape {tuple(t.shape)}, but "
                            f"{arch}.rope.dimension_count rotates {frequencies} frequencies")
        values = t.dequantize().reshape(-1)
        check_positive(values, f"{m.where}: rope_factors_{kind}.weight", GGUFError)
        factors[f"{kind}_factor"] = values.tolist()
    attention = _scale(m, f"{arch}.rope.scaling.attn_factor", None)
    if attention is not None:
        factors["attention_factor"] = attention
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
    "gemma": Architecture("GemmaForCausalLM", _LLAMA_BLOCK, "GemmaTokenizer", norm_offset=1.0,
                          scaled_embedding=True, extra_config=_gemma_extra),
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
# ASCII digits: \d also matches other scripts' digits, which int() reads as another layer's.
_LAYER_RE = re.compile(r"blk\.([0-9]+)\.")


def check_architecture(metadata: Mapping[str, Any], where: str) -> str:
    """The file's general.architecture, or GGUFError if lowbit does not know
    how its converter wrote it (a wrong guess would load and compute garbage)."""
    m = _Metadata(metadata, where)
    arch = m.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise m.error("general.architecture", f"GGUF architecture {shown(arch)} is not supported "
                                              f"(supported: {', '.join(ARCHITECTURES)})")
    return arch


def architecture(metadata: Mapping[str, Any], where: str) -> Architecture:
    """The file's Architecture: its general.architecture's, or that one's
    with_experts where the file has experts."""
    arch = check_architecture(metadata, where)
    spec = ARCHITECTURES[arch]
    experts = _Metadata(metadata, where).get(f"{arch}.expert_count", int, 0, minimum=0)
    return spec.with_experts if spec.with_experts is not None and experts > 0 else spec


def check_not_split(metadata: Mapping[str, Any], where: str) -> None:
    """A model from one part of a file llama.cpp's gguf-split cut (split.count
    parts, split.no numbered from 0) would miss the tensors the other parts
    hold (a head missing from the first reads as tied to the embedding)."""
    m = _Metadata(metadata, where)
    count = m.get("split.count", int, 1, minimum=0)
    if count > 1:
        part = m.get("split.no", int, 0, minimum=0)
        if part >= count:
            raise m.error("split.no", f"{part}, but parts are numbered from 0 to split.count - 1 = {count - 1}")
        raise m.error("split.count", f"the file is part {part + 1} of a model split into {count} files, which "
                                     "spreads its tensors over them; merge them into one file first (llama.cpp's "
                                     "llama-gguf-split --merge FIRST_PART OUT.gguf)")


def check_block_count(metadata: Mapping[str, Any], names: Iterable[str], where: str) -> int:
    """The file's block_count, refused unless the blk.N tensors (`names`)
    are exactly layers 0 .. block_count - 1, before a model is built from
    it: a larger count would build layers no tensor fills (a corrupt 10^5
    or 2^63: a hang, a huge allocation), a smaller one drop layers unseen."""
    m = _Metadata(metadata, where)
    key = f"{check_architecture(metadata, where)}.block_count"
    count = m.get(key, int, positive=True)
    layers = set()
    for name in names:
        if match := _LAYER_RE.match(name):
            if len(match[1]) > 18:  # past any count (and past int()'s limit of 4300 digits)
                raise m.error(key, f"{count} layers, but the file has tensor {shown(name)}")
            layers.add(int(match[1]))
    beyond = min((il for il in layers if il >= count), default=None)
    if beyond is not None:
        raise m.error(key, f"{count} layers, but the file has tensors of layer {beyond} (blk.{beyond}.*)")
    if len(layers) < count:  # then one of 0 .. len(layers) has no tensor
        missing = min(set(range(len(layers) + 1)) - layers)
        raise m.error(key, f"{count} layers, but the file has no blk.{missing}.* tensors")
    return count


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
    m = _Metadata(metadata, "rows_in_hf_order")
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_rows(rows, m.get(f"{arch}.attention.head_count", int, positive=True))
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        n_head = m.get(f"{arch}.attention.head_count", int, positive=True)
        return unpermute_rows(rows, m.get(f"{arch}.attention.head_count_kv", int, n_head, positive=True))
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


# transformers config kwarg <- GGUF key without the "<arch>." prefix: the
# sizes every file must give, each a positive integer.
_REQUIRED_SIZES = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "max_position_embeddings": "context_length",
}

_TOKEN_ID_KEYS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


def config_from_gguf(metadata: Mapping[str, Any], tensors: Iterable[str] | Mapping[str, Any],
                     where: str = "config_from_gguf") -> dict[str, Any]:
    """Kwargs for the transformers config class of the file's architecture
    (ARCHITECTURES[arch].model_class's) from a GGUF file's metadata, read the
    way llama.cpp reads it; a key missing, of the wrong type or out of range
    is a GGUFError that names `where` (the caller and file) and the key.

    `tensors` are the file's tensors, names or a mapping name -> GGUFTensor:
    a file without output.weight ties the LM head to the token embedding,
    llama / qwen3 files with Q or FFN biases need configs that give the model
    those biases (qwen2 always has Q/K/V biases), and a phi3 LongRoPE file's
    factors are tensors (their values need the mapping).
    """
    arch = check_architecture(metadata, where)
    spec = architecture(metadata, where)
    m = _Metadata(metadata, where)
    config = {kwarg: m.get(f"{arch}.{key}", int, positive=True) for kwarg, key in _REQUIRED_SIZES.items()}
    config["rms_norm_eps"] = m.get(f"{arch}.attention.layer_norm_rms_epsilon", float, positive=True,
                                   maximum=MAX_NORM_EPS)
    config["vocab_size"] = _vocab_size(m, arch)
    # Absent head_count_kv means plain multi-head attention (llama.cpp's default too).
    n_head = config["num_attention_heads"]
    n_head_kv = m.get(f"{arch}.attention.head_count_kv", int, n_head, positive=True)
    if n_head % n_head_kv:
        raise m.error(f"{arch}.attention.head_count_kv", f"{n_head_kv} KV heads do not divide the {n_head} "
                                                         f"attention heads ({arch}.attention.head_count)")
    config["num_key_value_heads"] = n_head_kv
    config["head_dim"] = _head_dim(m, arch, config["hidden_size"], n_head, spec.partial_rotary)
    config["rope_theta"] = _rope_base(m, f"{arch}.rope.freq_base", 10000.0)
    scaling = _rope_scaling(m, arch)
    if scaling is not None:
        config["rope_scaling"] = {**scaling, "rope_theta": config["rope_theta"]}
    config["tie_word_embeddings"] = "output.weight" not in set(tensors)
    # The file's special tokens, and none where it names none (a transformers
    # default could lie outside the file's vocabulary, as may the file's own).
    for kwarg, key in _TOKEN_ID_KEYS.items():
        token = m.get(key, int, None, minimum=0)
        if token is not None and token >= config["vocab_size"]:
            raise m.error(key, f"token {token} is outside the vocabulary of {config['vocab_size']} tokens")
        config[kwarg] = token
    config.update(spec.extra_config(m, arch, tensors, config))
    if isinstance(tensors, Mapping):
        _check_against_tensors(m, arch, config, tensors)
    return config


def _check_against_tensors(m: _Metadata, arch: str, config: dict, tensors: Mapping[str, Any]) -> None:
    """The embedding size, vocabulary size and expert count against the
    tensors that hold them, so that a corrupt one is refused naming its key
    (a model built of it would be refused later by a tensor's shape alone)."""
    vocab_key = f"{arch}.vocab_size" if f"{arch}.vocab_size" in m else "tokenizer.ggml.tokens"
    sizes = [(f"{arch}.embedding_length", config["hidden_size"], "token_embd.weight", 1),
             (vocab_key, config["vocab_size"], "token_embd.weight", 0)]
    experts = config.get("num_local_experts", config.get("num_experts"))
    if experts is not None:
        sizes.append((f"{arch}.expert_count", experts, "blk.0.ffn_gate_inp.weight", 0))
    for key, size, name, dim in sizes:
        t = tensors.get(name)
        if t is not None and len(t.shape) > dim and t.shape[dim] != size:
            raise m.error(key, f"{size}, but tensor {name!r} has shape {tuple(t.shape)}")


def _vocab_size(m: _Metadata, arch: str) -> int:
    """{arch}.vocab_size, else the token list's length. A token list longer
    than {arch}.vocab_size is refused: its last tokens would index past the
    embedding (a shorter one leaves padding rows, as HF vocabularies do)."""
    size = m.get(f"{arch}.vocab_size", int, None, positive=True)
    if "tokenizer.ggml.tokens" in m:
        tokens = m.get("tokenizer.ggml.tokens", list)
        if not tokens:
            raise m.error("tokenizer.ggml.tokens", "empty")
        if size is None:
            return len(tokens)
        if len(tokens) > size:
            raise m.error("tokenizer.ggml.tokens", f"{len(tokens)} tokens, more than {arch}.vocab_size {size}")
    if size is None:
        raise m.error(f"{arch}.vocab_size", "missing, as is tokenizer.ggml.tokens (one of them gives the vocabulary "
                                            "size)")
    return size


def _head_dim(m: _Metadata, arch: str, hidden: int, n_head: int, partial_rotary: bool) -> int:
    """llama.cpp's head size: attention.key_length, else embedding / heads,
    and attention.value_length the same where given. The rotated part
    (rope.dimension_count) must be the whole head where the
    transformers class rotates every dimension."""
    key = f"{arch}.attention.key_length"
    if key not in m and hidden % n_head:
        raise m.error(f"{arch}.attention.head_count", f"{n_head} heads do not divide {arch}.embedding_length "
                                                      f"{hidden}, and no {key} gives the head size")
    head_dim = m.get(key, int, hidden // n_head, positive=True)
    value = m.get(f"{arch}.attention.value_length", int, head_dim, positive=True)
    if value != head_dim:  # transformers' classes give keys and values one head size
        raise m.error(f"{arch}.attention.value_length", f"{value}, but key heads have {head_dim} dimensions; "
                                                        f"values of another size are not supported for {arch}")
    rotated = m.get(f"{arch}.rope.dimension_count", int, head_dim, positive=True)
    if rotated > head_dim or rotated % 2 or (rotated != head_dim and not partial_rotary):
        raise m.error(f"{arch}.rope.dimension_count", f"{rotated}, but heads have {head_dim} dimensions; partial "
                                                      f"rotary embeddings are not supported for {arch}")
    return head_dim


def _rope_scaling(m: _Metadata, arch: str) -> dict[str, Any] | None:
    """transformers rope parameters for the file's rope.scaling.* keys (types
    none, linear and yarn, and phi3's longrope, the ones llama.cpp's
    converter writes for these architectures), or None without scaling."""
    key = f"{arch}.rope.scaling.type"
    # The factor's key, or the key older converters wrote it under, as llama.cpp reads them.
    factor_key = next((k for k in (f"{arch}.rope.scaling.factor", f"{arch}.rope.scale_linear") if k in m),
                      f"{arch}.rope.scaling.factor")
    kind = m.get(key, str, "linear")  # llama.cpp's default type
    if kind == "none":
        return None
    if kind == "longrope" and arch == "phi3":  # its factors are tensors (_longrope_factors)
        return {"rope_type": "longrope"}
    if kind not in ("linear", "yarn"):
        raise m.error(key, f"{shown(kind)} is not supported (none, linear, yarn"
                           f"{', longrope' if arch == 'phi3' else ''})")
    if kind == "linear":  # a factor of 0 or 1, or none, scales nothing (llama.cpp's reading)
        factor = m.get(factor_key, float, 0.0, minimum=0.0, maximum=MAX_SCALE)
        if 0.0 < factor < 1.0:  # transformers' linear scaling divides by it: a tiny one makes NaN rotation tables
            raise m.error(factor_key, f"{factor}: linear factors below 1 (but 0: none) are not supported")
        return None if factor in (0.0, 1.0) else {"rope_type": "linear", "factor": factor}
    # Below 1, llama.cpp scales attention by 1 + 0.1 ln(factor) (< 1), transformers by 1.
    factor = m.get(factor_key, float, minimum=1.0, maximum=MAX_SCALE)
    # llama.cpp's corrections range is whole dimensions (floor / ceil):
    # transformers' truncate, its default. The betas default alike; an
    # attention factor or extrapolation mix of the file's own, which
    # llama.cpp combines with its context parameters, is refused.
    rope = {"rope_type": "yarn", "factor": factor,
            "original_max_position_embeddings": m.get(f"{arch}.rope.scaling.original_context_length", int,
                                                      positive=True)}
    for name in ("yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier"):
        if f"{arch}.rope.scaling.{name}" in m:
            raise m.error(f"{arch}.rope.scaling.{name}", "not supported")
    for name, kwarg in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if f"{arch}.rope.scaling.{name}" in m:
            rope[kwarg] = m.get(f"{arch}.rope.scaling.{name}", float, positive=True)
    # A fast beta below the slow one reverses the ramp's ends: llama.cpp then
    # steps between them, transformers ramps the other way.
    fast, slow = rope.get("beta_fast", 32.0), rope.get("beta_slow", 1.0)
    if fast < slow:
        raise m.error(f"{arch}.rope.scaling.yarn_beta_fast", f"{fast}, below yarn_beta_slow {slow}")
    return rope
