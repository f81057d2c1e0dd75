"""GGUFExperts against transformers' own experts module (Qwen3MoeExperts)
holding the dequantized weights: the same routing, the same per-expert
sums in the same order; validation; repacking; device and dtype moves."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import lowbit

transformers = pytest.importorskip("transformers")

EXPERTS, HIDDEN, INTERMEDIATE = 6, 64, 96


def blocks(rng, shape, qtype):
    """gguf-py's blocks of a random [experts, rows, n] weight, with the expert
    dim folded into the rows as a GGUF file's data is, and their dequantized floats."""
    w = rng.standard_normal(shape).astype(np.float32) * 0.1
    raw = quants.quantize(w, qtype)
    floats = torch.from_numpy(quants.dequantize(raw, qtype).reshape(shape))
    return torch.from_numpy(raw.reshape(shape[0] * shape[1], -1)), floats


@pytest.fixture(scope="module")
def pair():
    """(GGUFExperts, transformers' Qwen3MoeExperts with the same dequantized weights);
    down's type differs from gate's and up's, as in a Q4_K_M file."""
    rng = np.random.default_rng(0)
    gate, gate_f = blocks(rng, (EXPERTS, INTERMEDIATE, HIDDEN), T.Q8_0)
    up, up_f = blocks(rng, (EXPERTS, INTERMEDIATE, HIDDEN), T.Q8_0)
    down, down_f = blocks(rng, (EXPERTS, HIDDEN, INTERMEDIATE), T.Q4_0)
    config = transformers.Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS)
    reference = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with torch.no_grad():
        reference.gate_up_proj.copy_(torch.cat([gate_f, up_f], dim=1))
        reference.down_proj.copy_(down_f)
    ours = lowbit.GGUFExperts((gate, T.Q8_0), (up, T.Q8_0), (down, T.Q4_0), experts=EXPERTS, hidden_size=HIDDEN,
                              intermediate_size=INTERMEDIATE, act_fn=reference.act_fn)
    return ours, reference


def routing(tokens, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS, generator=g)[:k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, k, generator=g), dim=-1)
    return index, weights


def float_copy(experts):
    """GGUFExperts with each expert's layers nn.Linear of their dequantized weights."""
    import copy

    experts = copy.deepcopy(experts)
    for layers in (experts.gate_proj, experts.up_proj, experts.down_proj):
        for e, layer in enumerate(layers):
            linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
            with torch.no_grad():
                linear.weight.copy_(layer.dequantize())
            layers[e] = linear
    return experts


@pytest.mark.parametrize("tokens, k", [(1, 2), (1, 6), (5, 1), (9, 2), (40, 3)])
def test_matches_transformers_experts(pair, tokens, k):
    ours, reference = pair
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    index, weights = routing(tokens, k, seed=tokens)
    with torch.no_grad():
        want = reference(x, index, weights)
        exact = float_copy(ours)(x, index, weights)
        got = ours(x, index, weights)
    # The routing and the sums' order are transformers': with float layers, equal to fp32 rounding.
    torch.testing.assert_close(exact, want, rtol=1e-6, atol=1e-6 * want.abs().max().item())
    # The 8-bit activations of lowbit's matmuls (relative L2 measured 0.5-0.8%).
    assert ((got - want).norm() / want.norm()).item() < 0.02


def test_unrouted_experts_cost_nothing_and_tokens_stay_apart(pair):
    ours, _ = pair
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    index = torch.tensor([[4], [4], [1]])
    weights = torch.ones(3, 1)
    calls = []
    hooks = [layer.register_forward_hook(lambda m, i, o, e=e: calls.append((e, i[0].shape[0])))
             for e, layer in enumerate(ours.gate_proj)]
    try:
        with torch.no_grad():
            together = ours(x, index, weights)
    finally:
        for h in hooks:
            h.remove()
    assert calls == [(1, 1), (4, 2)]  # each routed expert once, on all of its tokens
    with torch.no_grad():
        for t in range(3):  # each token's output is its own: batching experts' tokens mixes nothing
            torch.testing.assert_close(together[t], ours(x[t:t + 1], index[t:t + 1], weights[t:t + 1])[0])


def test_bf16_and_leading_dims_of_transformers_blocks(pair):
    ours, reference = pair
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    index, weights = routing(4, 2, seed=2)
    with torch.no_grad():
        got = ours(x, index, weights.bfloat16())
        want = reference(x.float(), index, weights)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 0.03


def test_repack_model_repacks_the_experts(pair):
    ours, _ = pair
    import copy

    packed = copy.deepcopy(ours)
    names = lowbit.repack_model(packed)
    if not torch.ops.lowbit.cpu_reads_repacked(int(T.Q8_0)):
        pytest.skip(f"the {torch.ops.lowbit.cpu_isa()} kernels do not read Q8_0's repacked layout")
    assert {f"gate_proj.{e}" for e in range(EXPERTS)} <= set(names)
    x = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(3))
    index, weights = routing(7, 2, seed=3)
    with torch.no_grad():
        want, got = ours(x, index, weights), packed(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_validation(pair):
    ours, reference = pair
    rows = torch.cat([layer.qweight for layer in ours.gate_proj])
    down = torch.cat([layer.qweight for layer in ours.down_proj])
    with pytest.raises(ValueError, match=r"GGUFExperts: gate must be uint8 \[experts \* rows, row_bytes\] for 4 "):
        lowbit.GGUFExperts((rows[:-1], T.Q8_0), (rows, T.Q8_0), (down, T.Q4_0), experts=4, hidden_size=HIDDEN,
                           intermediate_size=INTERMEDIATE, act_fn=reference.act_fn)
    with pytest.raises(ValueError, match="each gate expert has 192 rows, not 96"):  # 6 experts' rows read as 3
        lowbit.GGUFExperts((rows, T.Q8_0), (rows, T.Q8_0), (down, T.Q4_0), experts=3, hidden_size=HIDDEN,
                           intermediate_size=INTERMEDIATE, act_fn=reference.act_fn)
    with pytest.raises(ValueError, match="GGUFLinear.from_raw"):  # rows of the wrong byte count for the type
        lowbit.GGUFExperts((rows, T.Q4_0), (rows, T.Q8_0), (down, T.Q4_0), experts=EXPERTS, hidden_size=HIDDEN,
                           intermediate_size=INTERMEDIATE, act_fn=reference.act_fn)
    x = torch.randn(2, HIDDEN)
    with pytest.raises(IndexError, match=r"expert ids must lie in \[0, 6\), got 6"):
        ours(x, torch.tensor([[0], [EXPERTS]]), torch.ones(2, 1))


def test_experts_are_views_of_the_blocks():
    rng = np.random.default_rng(1)
    gate, _ = blocks(rng, (3, 32, 32), T.Q8_0)
    down, _ = blocks(rng, (3, 32, 32), T.Q8_0)
    experts = lowbit.GGUFExperts((gate, T.Q8_0), (gate, T.Q8_0), (down, T.Q8_0), experts=3, hidden_size=32,
                                 intermediate_size=32, act_fn=torch.nn.SiLU())
    row_bytes = gate.shape[1]
    for e, layer in enumerate(experts.gate_proj):
        assert layer.qweight.data_ptr() == gate.data_ptr() + e * 32 * row_bytes  # no copy of a file's blocks
    assert "experts=3, hidden=32, intermediate=32" in repr(experts)


def test_torch_compile(pair):
    """Under torch.compile (the host's read of the expert counts breaks the
    graph there), the same results as eager."""
    ours, _ = pair
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    index, weights = routing(5, 2, seed=4)
    with torch.no_grad():
        want = ours(x, index, weights)
        got = torch.compile(ours)(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
