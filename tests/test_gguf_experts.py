"""GGUFExperts against transformers' own experts module (Qwen3MoeExperts)
holding the dequantized weights: the same routing and sums (to fp32
rounding, with the weights in float blocks); validation; views; bf16;
torch.compile."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import quants

import gguf_blocks as gb
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
    """The same GGUFExperts with its dequantized weights as F32 blocks (ggml
    type 0): the same module without 8-bit activations."""
    def f32(w):
        return w.reshape(-1, w.shape[-1]).contiguous().view(torch.uint8), 0

    w = experts.dequantize()
    return lowbit.GGUFExperts(f32(w["gate"]), f32(w["up"]), f32(w["down"]), experts=EXPERTS, hidden_size=HIDDEN,
                              intermediate_size=INTERMEDIATE, act_fn=experts.act_fn)


def test_dequantize_to_float64_is_the_float32_weights_widened(pair):
    ours, _ = pair
    want = ours.dequantize()
    assert all(torch.equal(w, want[k].double()) for k, w in ours.dequantize(torch.float64).items())
    with pytest.raises(ValueError, match=r"^GGUFExperts\.dequantize: dtype must be a float dtype, got torch.int8$"):
        ours.dequantize(torch.int8)


@pytest.mark.parametrize("tokens, k", [(1, 2), (1, 6), (5, 1), (9, 2), (40, 3)])
def test_matches_transformers_experts(pair, tokens, k):
    ours, reference = pair
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    index, weights = routing(tokens, k, seed=tokens)
    with torch.no_grad():
        want = reference(x, index, weights)
        exact = float_copy(ours)(x, index, weights)
        got = ours(x, index, weights)
    # The routing and the sums are transformers': with float weights, equal to fp32 rounding.
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    # The 8-bit activations of lowbit's matmuls (relative L2 measured 0.5-0.8%).
    assert ((got - want).norm() / want.norm()).item() < 0.02


def test_forward_mode_tangents_match_transformers_experts(pair):
    """torch.func.jvp carries x's tangent through the experts' ops (which alone drop it): with float
    weights, transformers' tangent to fp32 rounding."""
    ours, reference = pair
    g = torch.Generator().manual_seed(2)
    x, t = torch.randn(5, HIDDEN, generator=g), torch.randn(5, HIDDEN, generator=g)
    index, weights = routing(5, 2, seed=2)
    _, want = torch.func.jvp(lambda v: reference(v, index, weights), (x,), (t,))
    _, got = torch.func.jvp(lambda v: float_copy(ours)(v, index, weights), (x,), (t,))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_tokens_stay_apart(pair):
    """Each token's output is its own: running a batch mixes nothing between tokens."""
    ours, _ = pair
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    index = torch.tensor([[4], [4], [1]])
    weights = torch.ones(3, 1)
    with torch.no_grad():
        together = ours(x, index, weights)
        for t in range(3):
            torch.testing.assert_close(together[t], ours(x[t:t + 1], index[t:t + 1], weights[t:t + 1])[0],
                                       rtol=0, atol=0)


def test_bf16_and_leading_dims_of_transformers_blocks(pair):
    ours, reference = pair
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    index, weights = routing(4, 2, seed=2)
    with torch.no_grad():
        got = ours(x, index, weights.bfloat16())
        want = reference(x.float(), index, weights)
    assert got.dtype == torch.bfloat16
    assert ((got.float() - want).norm() / want.norm()).item() < 0.03


def test_validation(pair):
    ours, reference = pair
    rows = ours.gate_qweight.reshape(EXPERTS * INTERMEDIATE, -1)
    down = ours.down_qweight.reshape(EXPERTS * HIDDEN, -1)
    build = lambda gate=(rows, T.Q8_0), experts=EXPERTS: lowbit.GGUFExperts(
        gate, (rows, T.Q8_0), (down, T.Q4_0), experts=experts, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        act_fn=reference.act_fn)
    with pytest.raises(ValueError, match=r"GGUFExperts: gate must be uint8 \[experts \* rows, row_bytes\] = "
                                         r"\[576, 68\] for 6 experts of \[96, 64\] type 8 weights, got torch.uint8 "
                                         r"\(575, 68\)"):
        build(gate=(rows[:-1], T.Q8_0))
    with pytest.raises(ValueError, match=r"gate must be .* got torch.uint8 \(576, 68\)"):  # 6 experts' rows as 3
        build(experts=3)
    with pytest.raises(ValueError, match=r"gate must be .* type 2 weights"):  # rows of another type's byte count
        build(gate=(rows, T.Q4_0))
    with pytest.raises(ValueError, match=r"GGUFExperts: give act_fn or glu, not both"):
        lowbit.GGUFExperts((rows, T.Q8_0), (rows, T.Q8_0), (down, T.Q4_0), EXPERTS, HIDDEN, INTERMEDIATE,
                           reference.act_fn, glu=lowbit.gguf.experts.ClampedSwiGLU(1.702, 7.0))
    biases = {"gate": torch.zeros(EXPERTS, INTERMEDIATE), "up": torch.zeros(EXPERTS, INTERMEDIATE),
              "down": torch.zeros(EXPERTS, INTERMEDIATE)}
    with pytest.raises(ValueError, match=r"GGUFExperts: biases\['down'\] must be a float \[experts, rows\] = "
                                         r"\[6, 64\] tensor, got \(torch.float32, \(6, 96\)\)"):
        lowbit.GGUFExperts((rows, T.Q8_0), (rows, T.Q8_0), (down, T.Q4_0), EXPERTS, HIDDEN, INTERMEDIATE,
                           reference.act_fn, biases=biases)
    x = torch.randn(2, HIDDEN)
    with pytest.raises(ValueError, match=r"ggml_mul_mat_id: ids values must lie in \[0, 6\), found min 0 and max 6"):
        ours(x, torch.tensor([[0], [EXPERTS]]), torch.ones(2, 1))


def test_construction_refuses_what_forward_could_not_call_or_unpack(pair):
    """An act_fn that is not callable ("silu") fails only at the first
    forward call, and a projection that is not a (blocks, type) pair (None, a
    bare tensor) as a raw unpack error: both are refused at construction,
    naming the argument."""
    ours, reference = pair
    rows = ours.gate_qweight.reshape(EXPERTS * INTERMEDIATE, -1)
    down = ours.down_qweight.reshape(EXPERTS * HIDDEN, -1)
    projections = {"gate": (rows, T.Q8_0), "up": (rows, T.Q8_0), "down": (down, T.Q4_0)}
    for bad in ("silu", 1, torch.zeros(1)):
        with pytest.raises(TypeError, match=f"^GGUFExperts: act_fn must be callable .*got {type(bad).__name__} "):
            lowbit.GGUFExperts(*projections.values(), EXPERTS, HIDDEN, INTERMEDIATE, act_fn=bad)
    with pytest.raises(TypeError, match="^GGUFExperts: glu must be callable .*got str 'swiglu'$"):
        lowbit.GGUFExperts(*projections.values(), EXPERTS, HIDDEN, INTERMEDIATE, act_fn=None, glu="swiglu")
    for name in projections:
        for bad in (None, rows, (rows,), (rows, T.Q8_0, 0), (rows, "Q8_0"), (rows.numpy(), T.Q8_0), "Q8_0"):
            given = {**projections, name: bad}
            with pytest.raises(TypeError, match=f"^GGUFExperts: {name} must be a \\(uint8 block tensor, ggml type "
                                                f"id\\) pair, got {type(bad).__name__}$"):
                lowbit.GGUFExperts(*given.values(), EXPERTS, HIDDEN, INTERMEDIATE, act_fn=reference.act_fn)
    built = lowbit.GGUFExperts(*[list(p) for p in projections.values()], EXPERTS, HIDDEN, INTERMEDIATE,
                               act_fn=reference.act_fn)  # a list pair is a pair
    assert built.qtypes == {"gate": T.Q8_0, "up": T.Q8_0, "down": T.Q4_0}


def test_construction_refuses_unknown_types_odd_biases_and_mixed_devices(pair):
    """An unknown type id failed in ggml_type_info, a biases list or a bias
    that is not a tensor as a bare AttributeError, a misspelt key was left
    out, and a projection or bias on another device failed at the first
    forward call: each is refused at construction, naming the argument."""
    ours, reference = pair
    rows = ours.gate_qweight.reshape(EXPERTS * INTERMEDIATE, -1)
    down = ours.down_qweight.reshape(EXPERTS * HIDDEN, -1)
    projections = {"gate": (rows, T.Q8_0), "up": (rows, T.Q8_0), "down": (down, T.Q4_0)}
    biases = {"gate": torch.zeros(EXPERTS, INTERMEDIATE), "up": torch.zeros(EXPERTS, INTERMEDIATE),
              "down": torch.zeros(EXPERTS, HIDDEN)}
    build = lambda given=projections, **kw: lowbit.GGUFExperts(*given.values(), EXPERTS, HIDDEN, INTERMEDIATE,
                                                               act_fn=reference.act_fn, **kw)
    with pytest.raises(ValueError, match=r"^GGUFExperts: up: qtype 999 is not a ggml weight type"):
        build({**projections, "up": (rows, 999)})
    with pytest.raises(TypeError, match=r"^GGUFExperts: biases must be None or a dict .* got list$"):
        build(biases=list(biases.values()))
    with pytest.raises(ValueError, match=r"^GGUFExperts: biases\['up'\] must be a float .* got int$"):
        build(biases={**biases, "up": 0})
    with pytest.raises(ValueError, match=r"^GGUFExperts: biases must hold the keys .* got \['gate', 'up', 'down', "
                                         r"'down_proj'\]$"):
        build(biases={**biases, "down_proj": torch.zeros(EXPERTS, HIDDEN)})
    with pytest.raises(RuntimeError, match=r"^GGUFExperts: down is on meta, gate on cpu"):
        build({**projections, "down": (down.to("meta"), T.Q4_0)})
    with pytest.raises(RuntimeError, match=r"^GGUFExperts: biases\['gate'\] is on meta, gate on cpu"):
        build(biases={**biases, "gate": biases["gate"].to("meta")})
    assert build(biases=biases).biased


@pytest.mark.parametrize("hidden, ids, weights, says", [
    ((3, HIDDEN), (3, 2), (3, 1), r"top_k_weights must have top_k_index's shape \[3, 2\], got torch.float32 \[3, 1\]"),
    ((3, HIDDEN), (3, 2), (2,), r"top_k_weights must have top_k_index's shape \[3, 2\], got torch.float32 \[2\]"),
    ((3, HIDDEN), (3, 2), (2, 3), r"top_k_weights must have top_k_index's shape"),
    ((3, HIDDEN + 32), (3, 2), (3, 2), r"hidden_states must be a float \[tokens, hidden=64\] tensor, got "
                                       r"torch.float32 \[3, 96\]"),
    ((1, 3, HIDDEN), (3, 2), (3, 2), r"hidden_states must be a float \[tokens, hidden=64\]"),
    ((3, HIDDEN), (2, 2), (2, 2), r"top_k_index must be \[tokens=3, k\], got torch.int64 \[2, 2\]"),
])
def test_routing_of_other_shapes_is_refused(pair, hidden, ids, weights, says):
    """Weights of another shape than the ids' would broadcast into place
    ([T, 1]: every slot weighed by the first one's weight): refused, as
    GPTQExperts refuses them, as is input of another width."""
    ours, _ = pair
    with pytest.raises(ValueError, match="GGUFExperts: " + says):
        ours(torch.randn(hidden), torch.zeros(ids, dtype=torch.long), torch.ones(weights))


def test_routing_weights_on_another_device_are_refused(pair):
    """The weights meet the experts' outputs last: torch's device error there named neither argument."""
    index, weights = routing(3, 2)
    with pytest.raises(RuntimeError, match=r"^GGUFExperts: top_k_weights is on meta, hidden_states on cpu: both "
                                           r"must be on one device$"):
        pair[0](torch.randn(3, HIDDEN), index, weights.to("meta"))


def test_routing_of_other_dtypes(pair):
    ours, _ = pair
    x, index, weights = torch.randn(3, HIDDEN), torch.tensor([[0, 5], [2, 3], [4, 1]]), torch.full((3, 2), 0.5)
    with pytest.raises(ValueError, match=r"GGUFExperts: top_k_index must hold integer expert ids, got torch.float32"):
        ours(x, index.float(), weights)
    with pytest.raises(ValueError, match=r"GGUFExperts: hidden_states must be a float .* got torch.int64"):
        ours(x.long(), index, weights)
    with torch.no_grad():  # ids of any integer dtype, as GPTQExperts takes them
        want = ours(x, index, weights)
        for dtype in (torch.int32, torch.int16, torch.uint8):
            torch.testing.assert_close(ours(x, index.to(dtype), weights), want, rtol=0, atol=0)


def test_dequantize_gives_the_files_weights(pair):
    ours, reference = pair
    w = ours.dequantize()
    torch.testing.assert_close(torch.cat([w["gate"], w["up"]], dim=1), reference.gate_up_proj.detach(), rtol=0, atol=0)
    torch.testing.assert_close(w["down"], reference.down_proj.detach(), rtol=0, atol=0)


def test_experts_are_views_of_the_blocks():
    rng = np.random.default_rng(1)
    gate, _ = blocks(rng, (3, 32, 32), T.Q8_0)
    down, _ = blocks(rng, (3, 32, 32), T.Q8_0)
    experts = lowbit.GGUFExperts((gate, T.Q8_0), (gate, T.Q8_0), (down, T.Q8_0), experts=3, hidden_size=32,
                                 intermediate_size=32, act_fn=torch.nn.SiLU())
    assert experts.gate_qweight.data_ptr() == gate.data_ptr() and experts.gate_qweight.shape == (3, 32, 34)
    assert experts.down_qweight.data_ptr() == down.data_ptr()  # no copy of a file's blocks
    assert "experts=3, hidden=32, intermediate=32" in repr(experts)
    assert set(experts.state_dict()) == {"gate_qweight", "up_qweight", "down_qweight"}


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


def test_repack_skips_types_by_name_id_or_ggmltype_and_refuses_anything_else(pair):
    """A name ("Q8_0") compared with the type ids skipped nothing: every projection was repacked."""
    import copy

    for skip in (["Q8_0", "Q4_0"], [T.Q8_0, T.Q4_0], [lowbit.GGMLType.Q8_0, lowbit.GGMLType.Q4_0]):
        packed = copy.deepcopy(pair[0])
        assert packed.repack(skip) == [] and not any(packed.repacked.values())
    for skip, says in ((None, "must be a collection of ggml types, got None"), ("Q8_0", "must be a collection of ggml types, got the string 'Q8_0'"),
                       (["Q9"], "holds 'Q9', not a ggml type")):
        with pytest.raises(ValueError, match=f"^GGUFExperts.repack: skip_types {says}"):
            copy.deepcopy(pair[0]).repack(skip)


def test_repack_keeps_the_results(pair):
    """GGUFExperts.repack (and repack_model) put the projections whose type
    the active kernels read in the repacked layout: the same outputs (the
    integer-form types bit for bit, the 32-element ones to fp32 rounding),
    the file's layout in state_dict() and dequantize(), undone by unrepack()."""
    ours, _ = pair
    import copy

    packed = copy.deepcopy(ours)
    names = lowbit.repack_model(torch.nn.ModuleDict({"experts": packed}))
    read = [p for p in ("gate", "up", "down") if torch.ops.lowbit.cpu_reads_repacked(packed.qtypes[p])]
    assert names == [f"experts.{p}" for p in read] and [p for p, on in packed.repacked.items() if on] == read
    if not read:
        pytest.skip(f"the {torch.ops.lowbit.cpu_isa()} kernels read neither Q8_0's nor Q4_0's repacked layout")
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(5))
    index, weights = routing(9, 3, seed=5)
    with torch.no_grad():
        want, got = ours(x, index, weights), packed(x, index, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert all(torch.equal(packed.state_dict()[k], v) for k, v in ours.state_dict().items())
    for p, w in ours.dequantize().items():
        torch.testing.assert_close(packed.dequantize()[p], w, rtol=0, atol=0)
    assert not torch.equal(packed.gate_qweight, ours.gate_qweight) or "gate" not in read
    packed.load_state_dict({}, strict=False)  # nothing loaded: the repacked bytes stay as they were
    with torch.no_grad():
        assert torch.equal(packed(x, index, weights), got)
    packed.load_state_dict(ours.state_dict())  # the file's layout, loaded into a repacked module
    with torch.no_grad():
        assert [p for p, on in packed.repacked.items() if on] == read and torch.equal(packed(x, index, weights), got)
    packed.unrepack()
    assert not any(packed.repacked.values()) and torch.equal(packed.gate_qweight, ours.gate_qweight)


def test_repacked_expert_matmul_equals_each_expert_repacked(cpu_isa):
    """ggml_mul_mat_id_repacked of experts each repacked = ggml_mul_mat_repacked
    of each expert alone, bit for bit (what each expert's own kernels give)."""
    rng = np.random.default_rng(6)
    for name in ("Q4_K", "Q6_K", "Q4_0", "IQ4_XS", "MXFP4"):  # MXFP4: gpt-oss's experts
        t = gb.type_id(name)
        W = torch.from_numpy(gb.random_blocks(rng, name, 4 * 32, 256)).view(4, 32, -1)
        packed = torch.stack([torch.ops.lowbit.ggml_repack(w, t, 32, 256) for w in W])
        x = torch.randn(5, 256, generator=torch.Generator().manual_seed(t))
        ids = torch.tensor([[0, 3], [3, 1], [2, 0], [1, 2], [3, 0]], dtype=torch.int32)
        got = torch.ops.lowbit.ggml_mul_mat_id_repacked(packed, x, ids, t, 32)
        for i in range(5):
            for s in range(2):
                want = torch.ops.lowbit.ggml_mul_mat_repacked(packed[ids[i, s]], x[i:i + 1], t, 32)[0]
                torch.testing.assert_close(got[i, s], want, rtol=0, atol=0, msg=f"{name} token {i} slot {s}")
