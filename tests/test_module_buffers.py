"""The quantized modules' checkpoint tensors through what nn.Module does to
every buffer: a cast (module.type, an _apply that casts every tensor) and
load_state_dict of tensors of another dtype or another layout leave the
quantized codes as stored; what load_state_dict assigns and the
constructors are given is held as plain contiguous buffers;
parametrizations of them are refused by name."""
import copy
import io

import numpy as np
import pytest
import torch
import torch.nn.utils.parametrize as parametrize

import gguf_blocks as gb
import lowbit

IN, OUT = 256, 32


def gguf_linear():
    rng = np.random.default_rng(0)
    return lowbit.GGUFLinear.from_raw(torch.from_numpy(gb.random_blocks(rng, "Q4_K", OUT, IN)), gb.type_id("Q4_K"), IN,
                                      torch.randn(OUT, generator=torch.Generator().manual_seed(0)))


def gptq_linear():
    torch.manual_seed(0)
    layer = lowbit.GPTQLinear.from_linear(torch.nn.Linear(IN, OUT), 4, 64, False, "gptq_v2", perm=torch.randperm(IN))
    return layer.sort_rows()


def gguf_embedding():
    rng = np.random.default_rng(1)
    return lowbit.GGUFEmbedding(torch.from_numpy(gb.random_blocks(rng, "Q8_0", 10, IN)), gb.type_id("Q8_0"), IN)


def gguf_experts():
    rng = np.random.default_rng(2)

    def blocks(rows, n, name):
        return torch.from_numpy(gb.random_blocks(rng, name, 3 * rows, n)), gb.type_id(name)

    return lowbit.GGUFExperts(blocks(64, IN, "Q8_0"), blocks(64, IN, "Q8_0"), blocks(IN, 64, "Q4_0"), experts=3,
                              hidden_size=IN, intermediate_size=64, act_fn=torch.nn.SiLU())


def run(module):
    """The module's output on fixed inputs, as float32."""
    if isinstance(module, lowbit.GGUFEmbedding):
        return module(torch.tensor([1, 7, 3])).float()
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(5))
    if isinstance(module, lowbit.GGUFExperts):
        ids = torch.tensor([[0, 2], [1, 0], [2, 1]])
        return module(x, ids, torch.full((3, 2), 0.5)).float()
    return module(x).float()


MODULES = {"GGUFLinear": gguf_linear, "GPTQLinear": gptq_linear, "GGUFEmbedding": gguf_embedding,
           "GGUFExperts": gguf_experts}


def quantized(module):
    return {name: t for name, t in module.named_buffers() if not t.is_floating_point()}


@pytest.mark.parametrize("make", MODULES.values(), ids=MODULES.keys())
def test_type_casts_keep_the_quantized_codes(make):
    """nn.Module.type() casts every tensor, integer buffers too: the codes
    keep their dtype and values, the float tensors follow."""
    module = make()
    codes, expect = {k: v.clone() for k, v in quantized(module).items()}, run(module)
    assert codes
    for dtype in (torch.float16, torch.float32):
        module.type(dtype)
        for name, t in quantized(module).items():
            assert t.dtype == codes[name].dtype and torch.equal(t, codes[name]), name
    torch.testing.assert_close(run(module), expect, rtol=1e-3, atol=1e-3)  # a float bias rounded through fp16


@pytest.mark.parametrize("make", MODULES.values(), ids=MODULES.keys())
def test_load_state_dict_refuses_codes_of_another_dtype(make):
    """torch would cast them (int64 values past 255 wrapping into uint8
    blocks): refused by name, and the module left as it was."""
    module, other = make(), make()
    expect = run(module)
    state = other.state_dict()
    name = next(k for k, v in state.items() if not v.is_floating_point())
    state[name] = state[name].to(torch.int64) + 256
    with pytest.raises(RuntimeError, match=rf"{name} must be {module.state_dict()[name].dtype}, got torch.int64"):
        module.load_state_dict(state)
    assert torch.equal(run(module), expect)
    state[name] = state[name].float()
    with pytest.raises(RuntimeError, match=rf"{name} must be .*, got torch.float32"):
        module.load_state_dict(state, strict=False)
    assert torch.equal(run(module), expect)
    module.load_state_dict(other.state_dict())  # the same dtypes load as before
    assert torch.equal(run(module), run(other))


@pytest.mark.parametrize("assign", [False, True])
def test_load_state_dict_takes_g_idx_of_any_integer_dtype(assign):
    """An index, not a code: int64 g_idx (as some checkpoints store it, and
    the checkpoint loaders take) loads as int32, assigned too."""
    layer, other = gptq_linear(), gptq_linear()
    state = other.state_dict()
    state["g_idx"] = state["g_idx"].long()
    layer.load_state_dict(state, assign=assign)
    assert layer.g_idx.dtype == layer.state_dict()["g_idx"].dtype == torch.int32
    assert torch.equal(run(layer), run(other))
    state["g_idx"] = state["g_idx"] + 0.7  # not an index: refused, not truncated
    with pytest.raises(RuntimeError, match="g_idx must be an integer tensor, got torch.float32"):
        layer.load_state_dict(state)
    before = run(layer)
    for wraps in (2**32 + 1, -(2**32) + 1):  # int32 would narrow each to the valid group 1: refused instead
        state["g_idx"] = other.state_dict()["g_idx"].long()
        state["g_idx"][0] = wraps
        with pytest.raises(RuntimeError, match=rf"g_idx holds {wraps}, beyond torch.int32"):
            layer.load_state_dict(state)
        assert torch.equal(run(layer), before)  # left as it was


@pytest.mark.parametrize("strict", [True, False])
def test_load_state_dict_refuses_g_idx_naming_a_group_the_layer_has_not(strict):
    """The kernels would refuse it on every later call: refused by name,
    as the checkpoint loaders refuse it, and the layer left as it was."""
    layer = gptq_linear()
    expect = run(layer)
    for bad, found in ((4, r"\[0, 4\]"), (-1, r"\[-1, 3\]")):
        state = gptq_linear().state_dict()
        state["g_idx"][7] = bad
        with pytest.raises(RuntimeError, match=rf"GPTQLinear: g_idx values must lie in \[0, 4\), found {found}"):
            layer.load_state_dict(state, strict=strict)
        assert torch.equal(run(layer), expect)


def repacked(make):
    def build():
        module = make()
        module.repack()
        return module
    return build


ASSIGNED = {**MODULES, "GGUFLinear repacked": repacked(gguf_linear), "GGUFExperts repacked": repacked(gguf_experts)}


# Tensors load_state_dict(assign=True) takes as they are: views that are not
# contiguous (a fused layer's columns), and nn.Parameters
# (state_dict(keep_vars=True)'s), which would take the buffers' places as
# parameters (the codes then cast by module.type(), the forward's buffers gone).
GIVEN = {"views": lambda t: torch.stack([t, t], -1)[..., 0],
         "parameters": lambda t: torch.nn.Parameter(t, requires_grad=t.is_floating_point())}


@pytest.mark.parametrize("given", GIVEN.values(), ids=GIVEN.keys())
@pytest.mark.parametrize("make", ASSIGNED.values(), ids=ASSIGNED.keys())
def test_load_state_dict_holds_what_it_assigns_as_contiguous_buffers(make, given):
    """Held as contiguous buffers, as the kernels read them, in the repacked
    layout too."""
    module, source = make(), make()
    names = [name for name, _ in module.named_buffers()]
    with torch.no_grad():  # nothing of what it computes comes from before the load
        for t in quantized(module).values():
            t.zero_()
    module.load_state_dict({name: given(t) for name, t in source.state_dict().items()}, assign=True)
    assert not list(module.parameters()) and [name for name, _ in module.named_buffers()] == names
    assert all(t.is_contiguous() for t in module.state_dict().values())
    assert torch.equal(run(module), run(source))


def saved_and_loaded(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_load_state_dict_refuses_a_state_recording_another_layout():
    """state_dict records how its bytes are read (in its metadata, which
    torch.save keeps): a state of another ggml type of as many bytes a row
    (Q4_0 and IQ4_NL blocks), or of GPTQ zeros of the other format, is
    refused by name, and the module left as it was."""
    rng = np.random.default_rng(3)
    q4_0, iq4_nl, q8_0 = gb.type_id("Q4_0"), gb.type_id("IQ4_NL"), gb.type_id("Q8_0")
    blocks = torch.from_numpy(gb.random_blocks(rng, "Q4_0", OUT, IN))

    def experts(down):
        def part(rows, n, name):
            return torch.from_numpy(gb.random_blocks(rng, name, 3 * rows, n)), gb.type_id(name)
        return lowbit.GGUFExperts(part(64, IN, "Q8_0"), part(64, IN, "Q8_0"), part(IN, 64, down), experts=3,
                                  hidden_size=IN, intermediate_size=64, act_fn=torch.nn.SiLU())

    def gptq(checkpoint_format):
        torch.manual_seed(0)
        return lowbit.GPTQLinear.from_linear(torch.nn.Linear(IN, OUT), 4, 64, False, checkpoint_format)

    pairs = [(lowbit.GGUFLinear.from_raw(blocks, q4_0, IN), lowbit.GGUFLinear.from_raw(blocks, iq4_nl, IN),
              f"qtype={q4_0}", f"qtype={iq4_nl}"),
             (lowbit.GGUFEmbedding(blocks, q4_0, IN), lowbit.GGUFEmbedding(blocks, iq4_nl, IN), f"qtype={q4_0}",
              f"qtype={iq4_nl}"),
             (experts("Q4_0"), experts("IQ4_NL"), rf"qtypes=\{{'gate': {q8_0}, 'up': {q8_0}, 'down': {q4_0}\}}",
              rf"qtypes=\{{'gate': {q8_0}, 'up': {q8_0}, 'down': {iq4_nl}\}}"),
             (gptq("gptq_v2"), gptq("gptq"), "checkpoint_format='gptq_v2'", "checkpoint_format='gptq'")]
    for source, module, recorded, read in pairs:
        source, module = torch.nn.ModuleDict({"layer": source}), torch.nn.ModuleDict({"layer": module})
        expect = run(module["layer"])
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=rf"{type(module['layer']).__name__}: the state of layer records "
                                                   rf"{recorded}, where the module reads {read}"):
                module.load_state_dict(saved_and_loaded(source.state_dict()), strict=strict)
            assert torch.equal(run(module["layer"]), expect)
        source.load_state_dict(saved_and_loaded(source.state_dict()))  # its own layout loads


def parameter(t):
    return torch.nn.Parameter(t, requires_grad=t.is_floating_point())


def test_modules_built_of_parameters_hold_them_as_buffers():
    """nn.Parameters given to the constructors (a Linear's bias; a float32
    one beside float16 scales is cast, a result with a graph) are held as
    plain buffers: not registered as parameters, and without a graph, which
    deepcopy refuses."""
    bias = torch.nn.Linear(IN, OUT).bias
    linear, gptq, table, experts = (make().state_dict() for make in MODULES.values())
    q4_k, q8_0 = gb.type_id("Q4_K"), gb.type_id("Q8_0")
    biases = {"gate": torch.randn(3, 64), "up": torch.randn(3, 64), "down": torch.randn(3, IN)}
    built = [
        lowbit.GPTQLinear.from_tensors(*(parameter(gptq[k]) for k in ("qweight", "qzeros", "scales", "g_idx")), bias,
                                       4, 64, False, True, "gptq_v2"),
        lowbit.GGUFLinear.from_raw(parameter(linear["qweight"]), q4_k, IN, bias),
        lowbit.GGUFEmbedding(parameter(table["qweight"]), q8_0, IN),
        lowbit.GGUFExperts(*((parameter(experts[f"{name}_qweight"].flatten(0, 1)), qtype)
                             for name, qtype in (("gate", q8_0), ("up", q8_0), ("down", gb.type_id("Q4_0")))),
                           experts=3, hidden_size=IN, intermediate_size=64, act_fn=torch.nn.SiLU(),
                           biases={k: parameter(v) for k, v in biases.items()}),
    ]
    for module in built:
        assert not list(module.parameters()) and all(type(t) is torch.Tensor for t in module.buffers())
        assert not any(t.requires_grad for t in module.buffers()), type(module).__name__
        assert torch.equal(run(copy.deepcopy(module)), run(module))


@pytest.mark.parametrize("make", [gguf_linear, gptq_linear], ids=["GGUFLinear", "GPTQLinear"])
def test_parametrizing_the_codes_is_refused(make):
    class Zero(torch.nn.Module):
        def forward(self, w):
            return torch.zeros_like(w)

    layer = make()
    parametrize.register_parametrization(layer, "bias", Zero())  # a float tensor the forward reads as itself
    torch.testing.assert_close(run(layer), run(make()) - make().bias.float())
    parametrize.register_parametrization(layer, "qweight", Zero())
    with pytest.raises(TypeError, match=r"parametrization of \['qweight'\] is not supported"):
        run(layer)


def test_gptq_dequantize_refuses_integer_dtypes():
    with pytest.raises(ValueError, match="dtype must be a float dtype, got torch.int32"):
        gptq_linear().dequantize(torch.int32)


def test_from_linear_names_a_row_of_partial_blocks():
    with pytest.raises(ValueError, match=r"^GGUFLinear\.from_linear: in_features=100 is not a multiple of the block "
                                         r"size 32 of Q8_0$"):
        lowbit.GGUFLinear.from_linear(torch.nn.Linear(100, 4), gb.type_id("Q8_0"))
