"""replace_linear on each GGUF architecture it loads (llama, qwen2, qwen3),
through files written the way llama.cpp's converter writes them
(gguf_files.write_model_gguf: gguf-py's name map, llama's Q/K permutation of
weights and biases, gguf-py's quantizer), against the transformers model whose
weights went through gguf-py's quantize/dequantize round trip, which needs no
file and no lowbit loader code.

Each parameter must arrive exactly (the quantized blocks dequantize to the
reference's weights bit for bit, biases and norms are F32), and the logits
agree within the 8-bit activation rounding of lowbit's matmul (relative L2
under 2%; measured 0.3-0.6%)."""
import copy

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import lowbit
from gguf_files import write_model_gguf

transformers = pytest.importorskip("transformers")

MODELS = {
    # attention_bias gives the llama file Q/K biases, which the converter permutes like the weights.
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(attention_bias=True)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),  # Q/K/V biases
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),  # q_norm, k_norm
}


def tiny_model(arch, seed):
    config_class, model_class, extra = MODELS[arch]
    config = config_class(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                          **extra)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1, which would hide a misplaced one
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.3 + (1 if name.endswith("norm.weight") else 0))
    return model


def through_q8_0(model):
    """The model with every 2-D weight quantized and dequantized by gguf-py."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                q = quants.quantize(p.numpy(), T.Q8_0)
                p.copy_(torch.from_numpy(quants.dequantize(q, T.Q8_0).reshape(p.shape)))
    return model


@pytest.mark.parametrize("arch", list(MODELS))
def test_replace_linear_loads_the_architecture(tmp_path, arch):
    source = tiny_model(arch, seed=0)
    path = write_model_gguf(str(tmp_path / f"{arch}.gguf"), source, arch)
    reference = through_q8_0(source)
    model = tiny_model(arch, seed=1)  # other values everywhere: all must come from the file
    report = lowbit.replace_linear(model, path)
    assert report.unplaced == []

    expect = dict(reference.named_parameters(remove_duplicate=False))  # the tied lm_head too
    for name, module in model.named_modules():
        if isinstance(module, lowbit.GGUFLinear):
            torch.testing.assert_close(module.dequantize(), expect[f"{name}.weight"], rtol=0, atol=0, msg=name)
            if module.bias is not None:
                torch.testing.assert_close(module.bias, expect[f"{name}.bias"], rtol=0, atol=0, msg=name)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expect[name], rtol=0, atol=0, msg=name)
    assert sorted(report.replaced) == sorted(n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear))

    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids).logits, reference(ids).logits
    assert ((got - want).norm() / want.norm()).item() < 0.02


def test_an_architecture_of_unknown_row_order_is_refused(tmp_path):
    """gemma's tensors have the same names, but lowbit does not know how its
    converter orders their rows; loading must fail, not compute garbage."""
    path = write_model_gguf(str(tmp_path / "gemma.gguf"), tiny_model("qwen2", seed=0), "gemma")
    with pytest.raises(ValueError, match=r"architecture 'gemma' is not supported \(supported: llama, qwen2, qwen3\)"):
        lowbit.replace_linear(tiny_model("qwen2", seed=1), path)
