"""lowbit.load_gguf_model against llama.cpp itself (llama-cpp-python, the
optional extra `make deps` builds) on the same tiny file of every
architecture lowbit loads (tiny_models.py, written as llama.cpp's converter
writes them). What llama.cpp computes from a file is what the file means, so
this checks lowbit's reading of it against an implementation that shares
none of its code: tensor names and row order, the Gemma norms' + 1, the
embedding scale, the query scale the converter leaves unwritten, logit
softcaps, sliding windows and their layer pattern, each layer type's rope
base and scaling (YaRN too), partial rotation, SmolLM3's layers without
RoPE, Granite's multipliers, fused projections, and the experts: their routing, renormalized or
not, which rows are gate and which up, and gpt-oss's attention sinks,
biased experts and clamped SwiGLU (its experts also in MXFP4, as its files
hold them).

The files hold F32 weights and llama.cpp keeps its KV cache in F32, so
that both sides compute in fp32 and only what the file means can set them
apart (the 8-bit products are checked against llama.cpp's on their own,
test_cpu_kernels.py). The models are sharpened (queries and keys x16,
values and attention outputs x4, embeddings x30, experts x8) so that each of
those features moves the logits; llama.cpp runs 24 tokens from an empty
context, so a window of 5 masks most of each sliding layer's keys.
Tolerance: the largest |logit difference| within 0.5% of the largest
|logit|. Measured over 4 seeds: at most 0.0004% for llama, smollm3, granite, qwen2,
qwen3, qwen2moe, qwen3moe, mixtral, gpt-oss (F32 or MXFP4 experts) and phi3
(with and without LongRoPE), 0.002% for gemma and 0.12-0.16% for gemma2 and
gemma3 (llama.cpp's GELU reads an fp16 table); each feature read wrongly
(MISREADINGS) moved it by 9.3% (qwen3moe's top-k weights not renormalized)
to 720% (a final softcap).
"""
import dataclasses
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

import lowbit

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (make deps builds it)")
pytest.importorskip("transformers")
from gguf_files import LLAMA_CONVERTERS  # noqa: E402
from llama_cpp_peer import LlamaCppLogits, llama_without_extra_buffers  # noqa: E402
from tiny_models import FILE_ARCH, MODELS, PHI3_LONGROPE, tiny_model, write_tiny_gguf  # noqa: E402

F32 = 0  # ggml's type id, for llama.cpp's KV cache
TOKENS = 24
SHARPEN = 16  # queries and keys: attention sharp enough that softcaps, windows and rotations show
EXPERTS_SCALE = 8  # the experts' weights: their share of the residual stream as large as attention's
# Values and attention outputs: attention's share of the residual stream
# large enough beside the (scaled) embeddings that a misread rotation shows.
ATTENTION_OUTPUT_SCALE = 4
TOLERANCE = 0.005


# Each architecture's tiny model, and phi3's with LongRoPE; gpt-oss's also
# with its experts in MXFP4, as its files hold them (the products then go
# through 8-bit activations on both sides).
CASES = {**{arch: (arch, {}) for arch in MODELS}, "phi3-longrope": ("phi3", PHI3_LONGROPE),
         "gpt-oss-mxfp4": ("gpt-oss", {})}
EXPERT_QTYPES = {"gpt-oss-mxfp4": T.MXFP4}


def sharpened(arch, seed=0, **overrides):
    model = tiny_model(arch, seed, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                p.mul_(SHARPEN)
            elif name.endswith("embed_tokens.weight"):
                p.mul_(30)
            elif ".experts." in name:
                p.mul_(EXPERTS_SCALE)
            elif name.endswith(("v_proj.weight", "o_proj.weight")):
                p.mul_(ATTENTION_OUTPUT_SCALE)
    return model


def write_for_llama_cpp(path, model, name, expert_qtype=None):
    """The converter's file of model `name`, with a vocabulary llama.cpp takes
    without a tokenizer (tokenizer.ggml.model "none" and a vocab_size)."""
    arch = FILE_ARCH.get(name, name)
    extra = {"tokenizer.ggml.model": "none"}
    if arch not in LLAMA_CONVERTERS:  # LlamaModel's writer puts vocab_size there already
        extra[f"{arch}.vocab_size"] = model.config.vocab_size
    return write_tiny_gguf(path, model, name, extra_metadata=extra, qtype=T.F32, expert_qtype=expert_qtype)


def logits_difference(path, ids):
    """max |lowbit - llama.cpp| / max |llama.cpp| over every position's logits."""
    ours = lowbit.load_gguf_model(path)
    llm = llama_without_extra_buffers(model_path=str(path), n_ctx=32, n_batch=32, logits_all=True, verbose=False,
                                      n_threads=torch.get_num_threads(), type_k=F32, type_v=F32)
    with torch.no_grad():
        got = ours(ids).logits[0].numpy()
    want = LlamaCppLogits(llm)(ids).logits[0].numpy()
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("case", list(CASES))
def test_logits_agree_with_llama_cpp(tmp_path, case):
    name, overrides = CASES[case]
    path = write_for_llama_cpp(tmp_path / f"{case}.gguf", sharpened(name, **overrides), name, EXPERT_QTYPES.get(case))
    ids = torch.randint(0, 64, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    assert logits_difference(path, ids) < TOLERANCE


def unscaled_embedding(model):
    model.get_input_embeddings().embed_scale = None


def gate_and_up_swapped(model):
    for m in model.modules():
        if isinstance(m, lowbit.GGUFExperts):
            m.gate_qweight, m.up_qweight = m.up_qweight, m.gate_qweight


def without_sinks(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("self_attn.sinks"):
                p.fill_(-math.inf)


def without_expert_biases(model):
    for m in model.modules():
        if isinstance(m, lowbit.GGUFExperts):
            for part in ("gate", "up", "down"):
                getattr(m, f"{part}_bias").zero_()


def unclamped_swiglu(model):
    for m in model.modules():
        if isinstance(m, lowbit.GGUFExperts):
            m.glu.limit = math.inf


_GEMMA3_ROPE = MODELS["gemma3"][2]["rope_parameters"]
# Ways to misread a file, each applied to lowbit's load of it: fields of its
# Architecture, config kwargs, or a change to the loaded model.
MISREADINGS = {
    "llama: Q/K rows left in llama.cpp's order": ("llama", dict(arch=dict(qk_rows_permuted=False))),
    "granite: embeddings unscaled": ("granite", dict(config=dict(embedding_multiplier=1.0))),
    "granite: sublayer outputs unscaled": ("granite", dict(config=dict(residual_multiplier=1.0))),
    "granite: attention scaled by 1 / sqrt(head)": ("granite", dict(config=dict(attention_multiplier=0.25))),
    "granite: logits unscaled": ("granite", dict(config=dict(logits_scaling=1.0))),
    "smollm3: RoPE in every layer": ("smollm3", dict(config=dict(no_rope_layers=[1, 1, 1, 1]))),
    "smollm3: NoPE layers counted from 0": ("smollm3", dict(config=dict(no_rope_layers=[0, 1, 1, 1]))),
    "gemma: norms keeping the converter's + 1": ("gemma", dict(arch=dict(norm_offset=0.0))),
    "gemma: embeddings unscaled": ("gemma", dict(model=unscaled_embedding)),
    "gemma2: norms keeping the converter's + 1": ("gemma2", dict(arch=dict(norm_offset=0.0))),
    "gemma2: queries scaled by hidden / heads": ("gemma2", dict(config=dict(query_pre_attn_scalar=16))),
    "gemma2: no attention softcap": ("gemma2", dict(config=dict(attn_logit_softcapping=None))),
    "gemma2: no final softcap": ("gemma2", dict(config=dict(final_logit_softcapping=None))),
    "gemma2: no sliding window": ("gemma2", dict(config=dict(sliding_window=4096))),
    "gemma2: layer pattern the other way": ("gemma2", dict(config=dict(
        layer_types=["full_attention", "sliding_attention"]))),
    "gemma3: sliding layers with the global base": ("gemma3", dict(config=dict(rope_parameters={
        **_GEMMA3_ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}))),
    "gemma3: global layers unscaled": ("gemma3", dict(config=dict(rope_parameters={
        **_GEMMA3_ROPE, "full_attention": {"rope_type": "default", "rope_theta": 1e6}}))),
    "gemma3: llama.cpp's default layer pattern": ("gemma3", dict(config=dict(
        layer_types=["sliding_attention", "sliding_attention"]))),
    "gemma3: no final softcap": ("gemma3", dict(config=dict(final_logit_softcapping=None))),
    "phi3: whole heads rotated": ("phi3", dict(config=dict(rope_parameters={
        **MODELS["phi3"][2]["rope_parameters"], "partial_rotary_factor": 1.0}))),
    "qwen2moe: top-k weights renormalized": ("qwen2moe", dict(config=dict(norm_topk_prob=True))),
    "qwen3moe: top-k weights not renormalized": ("qwen3moe", dict(config=dict(norm_topk_prob=False))),
    "mixtral: experts' gate and up swapped": ("mixtral", dict(model=gate_and_up_swapped)),
    "gpt-oss: no attention sinks": ("gpt-oss", dict(model=without_sinks)),
    "gpt-oss: experts' biases dropped": ("gpt-oss", dict(model=without_expert_biases)),
    "gpt-oss: SwiGLU unclamped": ("gpt-oss", dict(model=unclamped_swiglu)),
    "gpt-oss: every layer sliding": ("gpt-oss", dict(config=dict(layer_types=["sliding_attention"] * 2))),
    "gpt-oss: YaRN ignored": ("gpt-oss", dict(config=dict(rope_parameters={"rope_type": "default",
                                                                            "rope_theta": 1e4}))),
    "phi3-longrope: LongRoPE's factors ignored": ("phi3-longrope", dict(config=dict(rope_parameters={
        **MODELS["phi3"][2]["rope_parameters"]}))),
}


@pytest.mark.parametrize("case", list(MISREADINGS))
def test_each_feature_moves_the_logits(tmp_path, monkeypatch, case):
    """The comparison above would catch each misreading: loaded that way,
    lowbit's logits leave the tolerance by 4x or more (measured 18.6x for
    qwen3moe's top-k weights not renormalized, 18.8x for gpt-oss's SwiGLU
    unclamped, 49x and up for the rest)."""
    case_name, misread = MISREADINGS[case]
    name, overrides = CASES[case_name]
    path = write_for_llama_cpp(tmp_path / f"{case_name}.gguf", sharpened(name, **overrides), name)
    arch = FILE_ARCH.get(name, name)
    spec = lowbit.gguf.arch.ARCHITECTURES[arch]
    monkeypatch.setitem(lowbit.gguf.arch.ARCHITECTURES, arch, dataclasses.replace(spec, **misread.get("arch", {})))
    config_from_gguf = lowbit.gguf.model.config_from_gguf
    monkeypatch.setattr(lowbit.gguf.model, "config_from_gguf",
                        lambda *args: {**config_from_gguf(*args), **misread.get("config", {})})
    load = lowbit.load_gguf_model

    def load_misread(path):
        model = load(path)
        misread.get("model", lambda m: None)(model)
        return model
    monkeypatch.setattr(lowbit, "load_gguf_model", load_misread)
    ids = torch.randint(0, 64, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    assert logits_difference(path, ids) > 4 * TOLERANCE
