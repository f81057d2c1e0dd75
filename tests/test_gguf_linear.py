"""GGUFLinear: a drop-in nn.Linear over quantized GGUF blocks."""
import re

import numpy as np
import pytest
import torch

import gguf_blocks as gb
import lowbit
from test_gguf_ops import a8_tolerance

IN, OUT = 512, 48


def reference_linear(name, seed=0, bias=True):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(IN, OUT, bias=bias)
    layer = lowbit.GGUFLinear.from_linear(linear, gb.type_id(name))
    return linear, layer


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "TQ2_0", "MXFP4", "BF16"])
@pytest.mark.parametrize("batch", [(1,), (3,), (2, 9)], ids=["M1", "M3", "2x9"])  # 2x9 = 18 rows: batched op
def test_forward_matches_the_dequantized_weight(name, batch):
    linear, layer = reference_linear(name)
    raw = layer.qweight.numpy()
    W = gb.dequantize(raw, name)
    np.testing.assert_array_equal(layer.dequantize().numpy(), W)
    x = torch.randn(*batch, IN)
    y = layer(x)
    assert y.shape == (*batch, OUT) and y.dtype == torch.float32
    x2 = x.reshape(-1, IN).numpy()
    expect = x2.astype(np.float64) @ W.astype(np.float64).T + linear.bias.detach().double().numpy()
    tol = a8_tolerance(x2, W, raw, name) + 1e-6 * np.abs(expect)
    assert np.all(np.abs(y.reshape(-1, OUT).double().numpy() - expect) <= tol)


def test_half_precision_activations_and_to_dtype():
    _, layer = reference_linear("Q8_0")
    layer = layer.to(torch.bfloat16)
    assert layer.qweight.dtype == torch.uint8 and layer.bias.dtype == torch.bfloat16
    x = torch.randn(4, IN)
    for dtype in (torch.float16, torch.bfloat16):
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), layer(x).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["Q5_1", "Q8_0", "BF16"])
def test_dequantize_takes_any_float_dtype_and_names_dtype_otherwise(name):
    """float64 is the float32 weight widened (exact), as GPTQLinear.dequantize
    gives it, not the op's refusal; a dtype that is no float is refused naming
    the method's argument."""
    _, layer = reference_linear(name)
    w = layer.dequantize()
    assert torch.equal(layer.dequantize(torch.float64), w.double())
    assert torch.equal(layer.dequantize(torch.float16), w.half())
    for dtype in (torch.int32, torch.complex64, "float64"):
        with pytest.raises(ValueError, match=rf"^GGUFLinear\.dequantize: dtype must be a float dtype, got "):
            layer.dequantize(dtype)
        with pytest.raises(ValueError, match=r"^GPTQLinear\.dequantize: dtype must be a float dtype, got "):
            lowbit.GPTQLinear(64, 64, 4, 32).dequantize(dtype)


def test_state_dict_round_trip():
    _, layer = reference_linear("Q5_0")
    fresh = lowbit.GGUFLinear(IN, OUT, gb.type_id("Q5_0"))
    assert not torch.equal(fresh.qweight, layer.qweight)
    fresh.load_state_dict(layer.state_dict())
    x = torch.randn(2, IN)
    assert torch.equal(fresh(x), layer(x))
    assert set(layer.state_dict()) == {"qweight", "bias"}


def test_no_bias_and_compile():
    _, layer = reference_linear("Q4_0", bias=False)
    assert layer.bias is None and "bias" not in layer.state_dict()
    compiled = torch.compile(layer, fullgraph=True)
    for M in (1, 12):
        x = torch.randn(M, IN)
        torch.testing.assert_close(compiled(x), layer(x))


def test_constructor_and_from_raw_validate():
    with pytest.raises(ValueError, match="in_features=500 is not a multiple of the block size 32"):
        lowbit.GGUFLinear(500, 8, gb.type_id("Q4_0"))
    with pytest.raises(ValueError, match=r"^GGUFLinear: qtype 4 is not a ggml weight type lowbit supports"):
        lowbit.GGUFLinear(512, 8, 4)
    with pytest.raises(ValueError, match=r"qweight must be uint8 \(8, 288\)"):
        lowbit.GGUFLinear.from_raw(torch.zeros(8, 287, dtype=torch.uint8), gb.type_id("Q4_0"), 512)


@pytest.mark.parametrize("qtype, message", [
    (999, "qtype 999 is not a ggml weight type lowbit supports"), (-1, "qtype -1 is not a ggml weight type"),
    (4, "qtype 4 is not a ggml weight type"), ("Q4_0", "qtype must be a ggml type id \\(an integer\\), got 'Q4_0'"),
    (True, "qtype must be a ggml type id"), (2.0, "qtype must be a ggml type id"),
    (gb.type_id("Q4_K"), r"no quantizer for Q4_K \(gguf-py writes"), (gb.type_id("IQ2_XXS"), "no quantizer for IQ2_XXS")],
    ids=["unknown", "negative", "removed", "a name", "a bool", "a float", "Q4_K", "IQ2_XXS"])
def test_from_linear_names_a_type_it_cannot_write(qtype, message):
    """from_linear checks qtype as the constructor does, naming itself and
    the argument, and a type no quantizer writes by its name, where gguf-py's
    own error was an enum's message or an empty NotImplementedError."""
    with pytest.raises(ValueError, match=rf"^GGUFLinear\.from_linear: {message}"):
        lowbit.GGUFLinear.from_linear(torch.nn.Linear(512, 8), qtype)
    with pytest.raises(ValueError, match=r"^GGUFLinear\.from_linear: in_features=500 is not a multiple of the block "
                                         r"size 32 of Q4_0$"):
        lowbit.GGUFLinear.from_linear(torch.nn.Linear(500, 8), gb.type_id("Q4_0"))


def test_from_linear_writes_q6_k_with_lowbit_s_quantizer():
    """Q6_K, which gguf-py cannot quantize, comes from ggml_quantize (llama.cpp's
    quantizer): the layer's blocks are its bytes, within Q6_K's error of the
    float layer; the types gguf-py writes stay gguf-py's."""
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 8)
    q6_k = lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q6_K"))
    assert torch.equal(q6_k.qweight, torch.ops.lowbit.ggml_quantize(linear.weight.detach(), gb.type_id("Q6_K")))
    assert q6_k.qtype == gb.type_id("Q6_K") and torch.equal(q6_k.bias, linear.bias.detach())
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert (q6_k(x) - linear(x)).abs().max() < 0.02 * linear(x).abs().max()
    assert (q6_k.dequantize() - linear.weight).abs().max() < 0.02 * linear.weight.abs().max()
    q8_0 = lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q8_0"))
    expected = quants.quantize(linear.weight.detach().numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(q8_0.qweight, torch.from_numpy(expected.reshape(8, -1)))


def _blocks(rows, row_bytes):
    return torch.zeros(rows, row_bytes, dtype=torch.uint8)


Q4_0 = gb.type_id("Q4_0")


# Each constructor, a size it is given (or reads off its blocks) empty,
# negative or not an integer, and the argument its error must name.
@pytest.mark.parametrize("build, message", [
    (lambda: lowbit.GGUFLinear(0, 8, Q4_0), "GGUFLinear: in_features must be a positive integer, got 0"),
    (lambda: lowbit.GGUFLinear(512, 0, Q4_0), "GGUFLinear: out_features must be a positive integer, got 0"),
    (lambda: lowbit.GGUFLinear(-32, 8, Q4_0), "GGUFLinear: in_features must be a positive integer, got -32"),
    (lambda: lowbit.GGUFLinear(512, -1, Q4_0), "GGUFLinear: out_features must be a positive integer, got -1"),
    (lambda: lowbit.GGUFLinear(512.0, 8, Q4_0), "GGUFLinear: in_features must be a positive integer, got 512.0"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(0, 288), Q4_0, 512), "out_features must be a positive integer, got 0"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 0), Q4_0, 0), "in_features must be a positive integer, got 0"),
    (lambda: lowbit.GGUFEmbedding(_blocks(0, 288), Q4_0, 512),
     "GGUFEmbedding: num_embeddings must be a positive integer, got 0"),
    (lambda: lowbit.GGUFEmbedding(_blocks(8, 0), Q4_0, 0),
     "GGUFEmbedding: embedding_dim must be a positive integer, got 0"),
    (lambda: lowbit.GGUFExperts(*[(_blocks(0, 36), Q4_0)] * 3, 0, 64, 64, torch.nn.SiLU()),
     "GGUFExperts: experts must be a positive integer, got 0"),
    (lambda: lowbit.GGUFExperts(*[(_blocks(0, 0), Q4_0)] * 3, 2, 0, 0, torch.nn.SiLU()),
     "GGUFExperts: hidden_size must be a positive integer, got 0"),
], ids=["in 0", "out 0", "in negative", "out negative", "in a float", "from_raw no rows", "from_raw no columns",
        "embedding no rows", "embedding dim 0", "experts 0", "experts hidden 0"])
def test_empty_sizes_are_refused(build, message):
    """Refused by name at construction, not left to fail as a reshape later."""
    with pytest.raises(ValueError, match=message):
        build()


def test_blocks_that_are_not_contiguous_load_by_assignment_and_build_a_layer():
    """from_raw and load_state_dict(assign=True) took a strided view of the blocks as it was: the first call,
    repack() and dequantize() then failed in the kernels ("W must be contiguous")."""
    torch.manual_seed(0)
    Q8_0 = gb.type_id("Q8_0")
    layer = lowbit.GGUFLinear.from_linear(torch.nn.Linear(IN, OUT), Q8_0)
    strided = layer.qweight.t().contiguous().t()
    x = torch.randn(3, IN)
    built = lowbit.GGUFLinear.from_raw(strided, Q8_0, IN, layer.bias)
    loaded = lowbit.GGUFLinear(IN, OUT, Q8_0, device="meta")
    loaded.load_state_dict({"qweight": strided, "bias": layer.bias}, assign=True)
    repacked = lowbit.GGUFLinear.from_raw(layer.qweight, Q8_0, IN, layer.bias).repack()
    strided_repacked = lowbit.GGUFLinear.from_raw(strided, Q8_0, IN, layer.bias).repack()
    for got, want in ((built, layer), (loaded, layer), (strided_repacked, repacked)):
        assert torch.equal(got.dequantize(), layer.dequantize())
        assert torch.equal(got(x), want(x))


@pytest.mark.parametrize("build, message", [
    (lambda: lowbit.GGUFLinear(512, 8, float(Q4_0)), "GGUFLinear: qtype must be a ggml type id"),
    (lambda: lowbit.GGUFLinear(512, 8, True), "GGUFLinear: qtype must be a ggml type id"),
    (lambda: lowbit.GGUFLinear(512, 8, Q4_0, dtype=torch.int32), "GGUFLinear: dtype .* must be a float dtype"),
    (lambda: lowbit.GGUFEmbedding(_blocks(8, 288), float(Q4_0), 512), "GGUFEmbedding: qtype must be a ggml type id"),
], ids=["linear qtype float", "linear qtype bool", "linear bias int", "embedding qtype float"])
def test_a_qtype_or_dtype_of_the_wrong_type_is_refused(build, message):
    """True would be taken as type 1 (F16), 8.0 fail in the op's argument parsing, an int32 bias be added to
    every output: each is refused by name at construction."""
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("build, message", [
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 288), Q4_0, 512, torch.zeros(7)),
     r"from_raw: bias must be a float tensor \[8\] \(one per row\), got torch.float32 \(7,\)"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 288), Q4_0, 512, torch.zeros(8, 1)), r"got torch.float32 \(8, 1\)"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 288), Q4_0, 512, torch.zeros(8, dtype=torch.int32)),
     r"bias must be a float tensor \[8\] \(one per row\), got torch.int32"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 288), Q4_0, 512, 8),
     r"from_raw: bias must be a float tensor \[8\] \(one per row\), got int$"),
    (lambda: lowbit.GGUFLinear.from_raw(torch.zeros((), dtype=torch.uint8), Q4_0, 512),
     r"from_raw: qweight must be a 2-D tensor \[out_features, row_bytes\], got \(\)"),
    (lambda: lowbit.GGUFLinear.from_raw(_blocks(8, 288).numpy(), Q4_0, 512),
     r"from_raw: qweight must be a 2-D tensor \[out_features, row_bytes\], got ndarray$"),
    (lambda: lowbit.GGUFEmbedding(_blocks(8, 288), Q4_0, 512, dtype=torch.int32),
     "GGUFEmbedding: dtype must be float32, float16 or bfloat16, got torch.int32"),
], ids=["bias length", "bias 2-D", "integer bias", "bias an int", "0-d qweight", "qweight an array",
        "integer embedding dtype"])
def test_construction_checks_what_forward_would_fail_on(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_from_raw_refuses_a_bias_on_another_device():
    """The bias's addition in forward failed on torch's device error, naming
    neither from_raw nor bias. A meta bias is a loader's placeholder, filled later."""
    with pytest.raises(RuntimeError, match=r"^GGUFLinear.from_raw: bias is on cpu, qweight on meta: both must be on "
                                           r"one device$"):
        lowbit.GGUFLinear.from_raw(_blocks(8, 288).to("meta"), Q4_0, 512, torch.zeros(8))
    assert lowbit.GGUFLinear.from_raw(_blocks(8, 288), Q4_0, 512, torch.zeros(8, device="meta")).bias.is_meta


# --- GGUFEmbedding ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ4_NL", "F16"])
def test_embedding_rows_are_the_dequantized_rows(name):
    rng = np.random.default_rng(gb.type_id(name))
    raw = torch.from_numpy(gb.random_blocks(rng, name, 40, 256))
    table = lowbit.GGUFEmbedding(raw, gb.type_id(name), 256)
    W = torch.from_numpy(gb.dequantize(raw.numpy(), name))
    assert torch.equal(table.dequantize(), W)
    ids = torch.tensor([[3, 0, 39], [7, 7, 12]])
    got = table(ids)
    assert got.shape == (2, 3, 256) and got.dtype == torch.float32
    assert torch.equal(got, W[ids])  # each row dequantizes on its own, exactly
    assert torch.equal(torch.compile(table)(ids), got)


def test_embedding_on_the_meta_device_gives_shapes():
    """As GGUFLinear and GPTQLinear do: meta ids have no values for the range check."""
    table = lowbit.GGUFEmbedding(torch.empty(10, 144, dtype=torch.uint8, device="meta"), gb.type_id("Q4_K"), 256)
    out = table(torch.zeros(2, 3, dtype=torch.long, device="meta"))
    assert out.is_meta and out.shape == (2, 3, 256) and out.dtype == torch.float32


def test_embedding_dtype_follows_to_and_validates():
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(gb.random_blocks(rng, "Q8_0", 10, 64))
    table = lowbit.GGUFEmbedding(raw, gb.type_id("Q8_0"), 64, dtype=torch.bfloat16)
    assert table(torch.tensor([1])).dtype == torch.bfloat16
    table = table.to(torch.float16)  # as a float weight would; the blocks stay uint8
    assert table(torch.tensor([1])).dtype == torch.float16 and table.qweight.dtype == torch.uint8
    rows = table.to(torch.float32)(torch.tensor([1, 4]))
    assert torch.equal(table.double()(torch.tensor([1, 4])), rows.double())  # model.double(): the rows exactly
    assert set(table.state_dict()) == {"qweight"}
    assert table(torch.zeros(0, dtype=torch.long)).shape == (0, 64)
    with pytest.raises(IndexError, match=r"token ids must lie in \[0, 10\), got 2 .. 10"):
        table(torch.tensor([2, 10]))
    with pytest.raises(IndexError, match=r"got -1 .. 3"):
        table(torch.tensor([-1, 3]))
    for ids in (torch.tensor([1.0, 2.0]), torch.tensor([True]), torch.tensor([1], dtype=torch.uint8)):
        with pytest.raises(TypeError, match=rf"GGUFEmbedding: ids must be an int64 or int32 tensor .* got {ids.dtype}"):
            table(ids)
    with pytest.raises(TypeError, match=r"GGUFEmbedding: ids must be .* got list"):
        table([1, 2])
    assert torch.equal(table(torch.tensor([1, 4], dtype=torch.int32)), table(torch.tensor([1, 4])))
    # Compiled, the gather's own bounds assertion refuses both ends (a negative id would wrap around).
    compiled = torch.compile(table, fullgraph=True)
    assert torch.equal(compiled(torch.tensor([2, 9])), table(torch.tensor([2, 9])))
    for ids in ([2, 10], [-1, 3]):
        with pytest.raises(Exception, match="out of bounds"):
            compiled(torch.tensor(ids))
    with pytest.raises(ValueError, match=r"qweight must be uint8 \[rows, 68\] for dimension 64"):
        lowbit.GGUFEmbedding(raw[:, :60], gb.type_id("Q8_0"), 64)
    with pytest.raises(ValueError, match=r"qweight must be uint8"):
        lowbit.GGUFEmbedding(raw.float(), gb.type_id("Q8_0"), 64)


def test_embedding_refuses_a_bad_scale_or_qweight():
    """A NaN, inf, zero or out-of-range scale would make every row NaN, inf
    or 0; True would read as 1. A qweight that is no tensor is named."""
    raw = torch.from_numpy(gb.random_blocks(np.random.default_rng(0), "Q8_0", 10, 64))
    for bad, dtype in [(float("nan"), torch.float32), (float("inf"), torch.float32), (0.0, torch.float32),
                       (-8.0, torch.float32), (True, torch.float32), ([8.0], torch.float32), ("8", torch.float32),
                       (1e6, torch.float16), (10**400, torch.float32)]:
        with pytest.raises(ValueError, match=rf"^GGUFEmbedding: embed_scale must be None or a finite number > 0 "
                                             rf"in {dtype}, got {re.escape(repr(bad))}$"):
            lowbit.GGUFEmbedding(raw, gb.type_id("Q8_0"), 64, dtype, embed_scale=bad)
    table = lowbit.GGUFEmbedding(raw, gb.type_id("Q8_0"), 64, embed_scale=np.float64(8.0))
    assert torch.equal(table(torch.tensor([3])), lowbit.GGUFEmbedding(raw, gb.type_id("Q8_0"), 64)(torch.tensor([3])) * 8)
    for bad in (None, raw.tolist()):
        with pytest.raises(TypeError, match=rf"^GGUFEmbedding: qweight must be a uint8 tensor, got {type(bad).__name__}$"):
            lowbit.GGUFEmbedding(bad, gb.type_id("Q8_0"), 64)


def test_inputs_of_another_width_are_refused_and_meta_inputs_give_shapes():
    _, layer = reference_linear("Q8_0")
    for shape in [(2, IN - 32), (4, IN // 2), (IN * 2,), ()]:
        with pytest.raises(ValueError, match=rf"^GGUFLinear: input must be \[\.\.\., in_features={IN}\], got"):
            layer(torch.randn(shape))
    for bad in ([0.0] * IN, np.zeros((2, IN), np.float32)):  # as nn.Linear, a TypeError; it named nothing
        with pytest.raises(TypeError, match=rf"^GGUFLinear: input must be a tensor, got {type(bad).__name__}$"):
            layer(bad)
    y = layer.to("meta")(torch.randn(3, 5, IN, device="meta"))
    assert y.shape == (3, 5, OUT) and y.is_meta


@pytest.mark.parametrize("name, value, says", [
    ("Q8_0", 1e7, "row 1 reaches magnitude 1e\\+07, beyond Q8_0's range \\(a value or block scale overflows"),
    ("Q4_0", 1e9, "row 1 reaches magnitude 1e\\+09, beyond Q4_0's range"),
    ("F16", 1e6, "row 1 reaches magnitude 1e\\+06, beyond F16's range .* at column 3\\)"),
    ("Q6_K", 1e9, "ggml_quantize: x's block \\[1, 0:256\\] reaches magnitude 1e\\+09, beyond Q6_K's range"),
])
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # NumPy's, in gguf-py's quantizer
def test_from_linear_refuses_weights_past_the_type_s_range(name, value, says):
    """gguf-py wrote a value or fp16 block scale past the type's range as inf
    without a word (every output of the row inf or NaN), and lowbit's
    quantizer's range error came back as "no quantizer for Q6_K"."""
    linear = torch.nn.Linear(256, 4)
    with torch.no_grad():
        linear.weight[1, 3] = value
    with pytest.raises(ValueError, match=rf"^GGUFLinear.from_linear: linear.weight.*{says}"):
        lowbit.GGUFLinear.from_linear(linear, gb.type_id(name))


def test_from_linear_refuses_a_layer_without_rows_columns_or_values():
    """nn.Linear takes 0 sizes and the meta device; from_linear failed on a bare reshape or .item() error."""
    for linear, says in ((torch.nn.Linear(64, 0), "linear.out_features must be a positive integer, got 0"),
                         (torch.nn.Linear(0, 8), "linear.in_features must be a positive integer, got 0"),
                         (torch.nn.Linear(64, 8, device="meta"), "linear.weight must hold values: a meta tensor")):
        with pytest.raises(ValueError, match=rf"^GGUFLinear.from_linear: {says}"):
            lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q8_0"))


def test_from_linear_refuses_non_finite_weights():
    linear = torch.nn.Linear(IN, OUT)
    with torch.no_grad():
        linear.weight[2, 7] = float("inf")
    with pytest.raises(ValueError, match=r"GGUFLinear.from_linear: linear.weight holds a non-finite value "
                                         r"\(inf\) at \[2, 7\]"):
        lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q4_0"))


def test_a_numpy_type_id_is_held_as_an_int():
    """A numpy integer type id (an element of a file's type array) is taken and
    held as the int the ops, the layout and repr take."""
    layer = lowbit.GGUFLinear.from_linear(torch.nn.Linear(64, 8), np.int64(gb.type_id("Q8_0")))
    assert type(layer.qtype) is int and layer.qtype == gb.type_id("Q8_0")
    assert type(lowbit.GGUFLinear(64, 8, np.int32(gb.type_id("Q4_0"))).qtype) is int
    embedding = lowbit.GGUFEmbedding(layer.qweight, np.int16(gb.type_id("Q8_0")), 64)
    assert type(embedding.qtype) is int and torch.equal(embedding(torch.tensor([1])), layer.dequantize()[1:2])
