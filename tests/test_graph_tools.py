"""lowbit's modules under torch's graph tools beyond torch.compile:
torch.export with dynamic sizes, FakeTensorMode's shape propagation and
torch.func.vmap, each against the eager module."""
import numpy as np
import pytest
import torch
from torch.export import Dim, export
from torch._subclasses.fake_tensor import FakeTensorMode

import gguf_blocks as gb
import lowbit

transformers = pytest.importorskip("transformers")


def gguf_linear():
    rng = np.random.default_rng(0)
    return lowbit.GGUFLinear.from_raw(torch.from_numpy(gb.random_blocks(rng, "Q4_K", 48, 256)), gb.type_id("Q4_K"),
                                      256, torch.randn(48, generator=torch.Generator().manual_seed(0)))


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    from tiny_models import tiny_model, write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("graph") / "llama.gguf", tiny_model("llama", seed=0), "llama")


class Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("strict", [False, True])
def test_export_takes_any_batch_size(strict):
    """A dynamic batch size spans every M: no choice of kernel by M guards
    the program to one side of it."""
    layer = gguf_linear()
    program = export(layer, (torch.randn(4, 256),), dynamic_shapes=({0: Dim("batch")},), strict=strict)
    for m in (1, 8, 9, 64):
        x = torch.randn(m, 256)
        assert torch.equal(program.module()(x), layer(x)), m


def test_export_of_a_model_takes_any_sequence_length(gguf_path):
    model = Logits(lowbit.load_gguf_model(gguf_path))
    with torch.no_grad():
        program = export(model, (torch.randint(0, 64, (1, 12)),), dynamic_shapes={"ids": {1: Dim("seq", max=32)}},
                         strict=True)
        for length in (1, 3, 12, 20):
            ids = torch.randint(0, 64, (1, length))
            torch.testing.assert_close(program.module()(ids), model(ids), rtol=0, atol=0)


def test_fake_tensor_mode_gives_the_shapes(gguf_path):
    """Shape propagation with fake inputs, as the float model of the same
    config allows: no host read of a fake tensor's values (the embedding's
    id range check, an act-order layer's row plan)."""
    ids = torch.randint(0, 64, (2, 12))
    torch.manual_seed(0)
    layers = [lowbit.GPTQLinear.from_linear(torch.nn.Linear(64, 32), 4, 32),  # never run: no plan yet
              act_order_layer(int8_activations=False), act_order_layer(int8_activations=True), gguf_linear()]
    model = lowbit.load_gguf_model(gguf_path)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        assert model(mode.from_tensor(ids), use_cache=False).logits.shape == (2, 12, 64)
        for layer in layers:
            assert layer(mode.from_tensor(torch.randn(3, layer.in_features))).shape == (3, layer.out_features)


def act_order_layer(int8_activations):
    """An act-order GPTQLinear whose rows are not sorted (it plans a sorted copy when it runs)."""
    torch.manual_seed(0)
    layer = lowbit.GPTQLinear.from_linear(torch.nn.Linear(64, 32), 4, 32, perm=torch.randperm(64))
    layer.int8_activations = int8_activations
    return layer


def test_vmap_over_the_embedding_and_an_act_order_layer(gguf_path):
    """vmap's batched inputs have no values to plan from: the unsorted
    act-order layer runs gptq_gemm over its own rows (which takes any group
    order), close to its eager int8 result."""
    table = lowbit.load_gguf_model(gguf_path).model.embed_tokens
    ids = torch.tensor([[1, 2], [3, 63]])
    assert torch.equal(torch.func.vmap(table)(ids), table(ids))
    x = torch.randn(2, 3, 64)
    for int8_activations in (False, True):
        layer = act_order_layer(int8_activations)
        torch.testing.assert_close(torch.func.vmap(layer)(x), layer(x), rtol=2e-2, atol=2e-2)
