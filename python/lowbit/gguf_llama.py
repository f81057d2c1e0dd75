"""Llama-family GGUF plumbing: tensor names, Q/K row order and config, no kernels.

Maps a llama.cpp GGUF (as written by convert_hf_to_gguf.py) of the llama, qwen2
or qwen3 architecture onto the parameter names of transformers'
LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM (which share them), and
a file's metadata onto the matching transformers config.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["QK_ROWS_PERMUTED", "hf_name", "unpermute_rows", "rows_in_hf_order", "check_architecture",
           "HF_MODEL_CLASSES", "HF_TOKENIZER_CLASSES", "config_from_gguf"]

# Whether llama.cpp's converter stored an architecture's Q and K projections
# (weights and biases) permuted: LlamaModel turns HF's rotate-half order into
# interleaved RoPE pairs, Qwen2Model and Qwen3Model write them as HF has them.
# Other architectures may do either (or fuse QKV), so they are refused rather
# than guessed: a wrong guess loads without error and computes garbage.
QK_ROWS_PERMUTED = {"llama": True, "qwen2": False, "qwen3": False}

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",  # qwen3's per-head RMSNorms
    "attn_k_norm": "self_attn.k_norm",
}

_NAME_RE = re.compile(r"(?:blk\.(?P<layer>\d+)\.)?(?P<base>\w+)\.(?P<suffix>weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """The LlamaForCausalLM parameter name for a GGUF tensor name, or None for
    tensors with no HF counterpart (e.g. rope_freqs) or unknown names."""
    m = _NAME_RE.fullmatch(gguf_name)
    if m is None:
        return None
    layer, base, suffix = m["layer"], m["base"], m["suffix"]
    if layer is None:
        prefix = _GLOBAL_NAMES.get(base)
    else:
        module = _BLOCK_NAMES.get(base)
        prefix = None if module is None else f"model.layers.{layer}.{module}"
    return None if prefix is None else f"{prefix}.{suffix}"


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


def check_architecture(metadata: Mapping[str, Any], where: str) -> str:
    """The file's general.architecture, or ValueError if its Q/K row order is
    not known (QK_ROWS_PERMUTED)."""
    arch = metadata.get("general.architecture")
    if arch not in QK_ROWS_PERMUTED:
        raise ValueError(f"{where}: GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(QK_ROWS_PERMUTED)})")
    return arch


def rows_in_hf_order(name: str, rows: torch.Tensor, metadata: Mapping[str, Any]) -> torch.Tensor:
    """The rows of GGUF tensor `name` in HF order (a weight's rows, or a bias's
    elements): in a llama file the attn_q and attn_k weights and biases are
    unpermuted with the file's head counts; everything else is as stored."""
    arch = check_architecture(metadata, "rows_in_hf_order")
    if not QK_ROWS_PERMUTED[arch]:
        return rows
    n_head = metadata.get(f"{arch}.attention.head_count")
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return unpermute_rows(rows, n_head)
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return unpermute_rows(rows, metadata.get(f"{arch}.attention.head_count_kv", n_head))
    return rows


# transformers model class of each architecture (they share LlamaForCausalLM's
# parameter names, see _BLOCK_NAMES).
HF_MODEL_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# The tokenizer class transformers' AutoTokenizer picks for each
# architecture's GGUF file. Named here because AutoTokenizer finds it by
# first building the model config from the file with gguf-py (3-4 s for a
# 49k-token vocabulary), where the class alone reads only the tokenizer keys.
HF_TOKENIZER_CLASSES = {"llama": "TokenizersBackend", "qwen2": "Qwen2Tokenizer", "qwen3": "Qwen2Tokenizer"}

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


def config_from_gguf(metadata: Mapping[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """Kwargs for the transformers config class of the file's architecture
    (LlamaConfig, Qwen2Config or Qwen3Config) from a GGUF file's metadata,
    read the way llama.cpp reads it.

    `tensor_names` are the file's tensor names: a file without output.weight
    ties the LM head to the token embedding, and llama / qwen3 files with Q or
    FFN biases need configs that give the model those biases (qwen2 always has
    Q/K/V biases).
    """
    arch = check_architecture(metadata, "config_from_gguf")
    missing = [f"{arch}.{k}" for k in _REQUIRED_KEYS.values() if f"{arch}.{k}" not in metadata]
    if missing:
        raise ValueError(f"config_from_gguf: metadata lacks {', '.join(missing)}")
    names = set(tensor_names)

    config = {kwarg: metadata[f"{arch}.{key}"] for kwarg, key in _REQUIRED_KEYS.items()}
    config["vocab_size"] = _vocab_size(metadata, arch)
    # Absent head_count_kv means plain multi-head attention (llama.cpp's default too).
    config["num_key_value_heads"] = metadata.get(f"{arch}.attention.head_count_kv", config["num_attention_heads"])
    config["head_dim"] = _head_dim(metadata, arch, config["hidden_size"], config["num_attention_heads"])
    config["rope_theta"] = float(metadata.get(f"{arch}.rope.freq_base", 10000.0))
    scaling = _rope_scaling(metadata, arch)
    if scaling is not None:
        config["rope_scaling"] = {**scaling, "rope_theta": config["rope_theta"]}
    config["tie_word_embeddings"] = "output.weight" not in names
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for kwarg, key in _TOKEN_ID_KEYS.items():
        if key in metadata:
            config[kwarg] = metadata[key]
    return config


def _vocab_size(metadata: Mapping[str, Any], arch: str) -> int:
    if f"{arch}.vocab_size" in metadata:
        return metadata[f"{arch}.vocab_size"]
    if "tokenizer.ggml.tokens" in metadata:
        return len(metadata["tokenizer.ggml.tokens"])
    raise ValueError(f"config_from_gguf: metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")


def _head_dim(metadata: Mapping[str, Any], arch: str, hidden: int, n_head: int) -> int:
    """llama.cpp's head size: attention.key_length, else embedding / heads. The
    rotated part (rope.dimension_count) must be the whole head: these
    transformers classes rotate every dimension."""
    head_dim = metadata.get(f"{arch}.attention.key_length", hidden // n_head)
    rotated = metadata.get(f"{arch}.rope.dimension_count", head_dim)
    if rotated != head_dim:
        raise ValueError(f"config_from_gguf: {arch}.rope.dimension_count is {rotated} but heads have {head_dim} "
                         f"dimensions; partial rotary embeddings are not supported")
    return head_dim


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """transformers rope parameters for the file's rope.scaling.* keys (types
    none, linear and yarn, the ones llama.cpp's converter writes for these
    architectures), or None without scaling."""
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(metadata[f"{arch}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return {"rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": metadata[f"{arch}.rope.scaling.original_context_length"]}
    raise ValueError(f"config_from_gguf: {arch}.rope.scaling.type {kind!r} is not supported (none, linear, yarn)")
