"""GPTQLinear: checkpoint-exact buffers, the fast act-order layout, dtypes."""
import weakref

import numpy as np
import pytest
import torch

import gptq_reference as ref
import lowbit

IN, OUT = 256, 96


def layer_and_linear(bits=4, group_size=64, sym=False, fmt="gptq_v2", act_order=False, bias=True, seed=0):
    torch.manual_seed(seed)
    linear = torch.nn.Linear(IN, OUT, bias=bias)
    perm = torch.randperm(IN) if act_order else None
    return lowbit.GPTQLinear.from_linear(linear, bits, group_size, sym, fmt, perm=perm), linear


@pytest.mark.parametrize("group_size", [64, 96])  # 96: a short last group (K % group_size != 0)
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_forward_equals_x_at_the_reference_dequantized_weight(bits, act_order, group_size):
    layer, linear = layer_and_linear(bits, group_size, act_order=act_order)
    W = ref.dequantize(layer.qweight.numpy(), layer.qzeros.numpy(), layer.scales.numpy(), layer.g_idx.numpy(),
                       bits, "gptq_v2")  # [K, N], independent of the C++ code
    np.testing.assert_array_equal(layer.dequantize(torch.float32).t().numpy(), W.astype(np.float32))
    for shape in [(1, IN), (2, 5, IN), (40, IN)]:
        x = torch.randn(*shape)
        expect = x.double().reshape(-1, IN).numpy() @ W + layer.bias.double().numpy()
        got = layer(x)
        assert got.shape == (*shape[:-1], OUT)
        np.testing.assert_allclose(got.reshape(-1, OUT).double().numpy(), expect, rtol=1e-5, atol=1e-5)
    # A quantized layer is close to the float layer it came from (RTN error only).
    x = torch.randn(8, IN)
    rel = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert rel < {2: 0.6, 3: 0.3, 4: 0.15, 8: 0.01}[bits]


@pytest.mark.parametrize("group_size", [64, 96])  # 96: a short last group (K % group_size != 0)
def test_act_order_runs_sorted_and_resorts_after_load_state_dict(group_size):
    layer, _ = layer_and_linear(act_order=True, group_size=group_size)
    x = torch.randn(3, IN)
    y = layer(x)
    qweight, g_idx, perm = layer._prepare(torch.empty(0, layer.in_features))
    assert perm is not None and not torch.equal(qweight, layer.qweight)  # a private sorted copy
    assert torch.equal(g_idx, (torch.arange(IN) // group_size).int())  # contiguous groups
    assert layer.state_dict()["qweight"].data_ptr() == layer.qweight.data_ptr()
    other, _ = layer_and_linear(act_order=True, group_size=group_size, seed=1)
    layer.load_state_dict(other.state_dict())
    assert torch.equal(layer(x), other(x)) and not torch.equal(layer(x), y)


@pytest.mark.parametrize("write", ["whole", "row slice", "column slice", "g_idx only"])
def test_act_order_sees_writes_through_data(write):
    """Loaders copy weights in through `.data`, which bumps no version counter:
    the shuffled copy must still follow them."""
    layer, _ = layer_and_linear(act_order=True)
    other, _ = layer_and_linear(act_order=True, seed=1)
    x = torch.randn(3, IN)
    layer(x)  # builds the shuffled copy
    rows = layer.qweight.shape[0]
    if write == "whole":
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            getattr(layer, name).data.copy_(getattr(other, name))
    elif write == "row slice":
        layer.qweight.data[rows // 2:rows // 2 + 2].copy_(other.qweight[rows // 2:rows // 2 + 2])
    elif write == "column slice":
        layer.qweight.data[:, 8:16].copy_(other.qweight[:, 8:16])
    else:
        layer.g_idx.data.copy_(other.g_idx)
    fresh = lowbit.GPTQLinear(IN, OUT, 4, layer.group_size, sym=False, desc_act=True, checkpoint_format="gptq_v2")
    fresh.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x), fresh(x), rtol=0, atol=0)


@pytest.mark.parametrize("bits", [3, 4])
def test_sorted_rows_hold_one_copy_and_give_the_checkpoint_back(bits):
    layer, _ = layer_and_linear(bits=bits, act_order=True)
    x = torch.randn(5, IN)
    y, state, w = layer(x), {k: v.clone() for k, v in layer.state_dict().items()}, layer.dequantize()
    checkpoint_rows = layer.qweight
    assert layer.sort_rows() is layer and layer.rows_sorted and layer._plan is None  # the private copy is gone
    order = torch.argsort(layer.g_idx, stable=True)
    fields = ref.unpack(layer.qweight.numpy(), bits, 0)  # [K, N] fields of the sorted rows
    np.testing.assert_array_equal(fields, ref.unpack(checkpoint_rows.numpy(), bits, 0)[order.numpy()])
    torch.testing.assert_close(layer(x), y, rtol=0, atol=0)  # the same sorted sums as the private copy's
    assert layer._plan is None
    sd = layer.state_dict()
    assert list(sd) == list(state) and all(torch.equal(sd[k], v) for k, v in state.items())
    assert torch.equal(layer.dequantize(), w)
    assert torch.equal(layer.unsort_rows().qweight, checkpoint_rows) and not layer.rows_sorted


def test_sorted_layer_runs_its_buffers_with_no_checks():
    layer, _ = layer_and_linear(act_order=True, bias=False)
    layer.sort_rows()
    x = torch.randn(1, IN)
    layer(x)
    views = ("aten.view", "aten.reshape", "aten._unsafe_view")
    ops = [op for op in ops_dispatched(lambda: layer(x)) if op not in views]
    assert ops == ["aten.index_select", "lowbit.gptq_gemm"], ops


def test_sorted_layer_sorts_what_load_state_dict_brings():
    layer, _ = layer_and_linear(act_order=True)
    other, _ = layer_and_linear(act_order=True, seed=1)
    x = torch.randn(3, IN)
    expect = other(x)
    layer.sort_rows().load_state_dict(other.state_dict())
    assert layer.rows_sorted and torch.equal(layer(x), expect)
    assert all(torch.equal(v, other.state_dict()[k]) for k, v in layer.state_dict().items())


def test_sorted_layer_copies_and_pickles():
    import copy
    import io

    layer, _ = layer_and_linear(act_order=True)
    x = torch.randn(2, IN)
    expect = layer.sort_rows()(x)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert other.rows_sorted and other.qweight.data_ptr() != layer.qweight.data_ptr()
        assert torch.equal(other(x), expect)


def test_int8_activations_is_checked_when_set_and_kept_by_copies():
    """Set after construction, int8_activations is refused unless a bool (a
    string would turn the mode on), the layer left as it was; copies, pickles
    and those of layers that held it as a plain attribute keep the mode."""
    import copy
    import io
    import pickle

    layer, _ = layer_and_linear(act_order=False)
    x = torch.randn(2, IN)
    with pytest.raises(ValueError, match="^GPTQLinear: int8_activations must be True or False, got 'no'$"):
        layer.int8_activations = "no"
    assert layer.int8_activations is False and "int8_activations=True" not in repr(layer)
    layer.int8_activations = True
    expect = layer(x)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    state = pickle.loads(pickle.dumps(layer)).__getstate__()
    state["int8_activations"] = state.pop("_int8_activations")  # as a layer pickled with it in its __dict__
    old = lowbit.GPTQLinear.__new__(lowbit.GPTQLinear)
    old.__setstate__(state)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False), old):
        assert other.int8_activations is True and torch.equal(other(x), expect)
    assert set(layer.state_dict()) == {"qweight", "qzeros", "scales", "g_idx", "bias"}


def test_copies_of_an_unsorted_layer_leave_out_its_private_copy():
    """The private sorted copy of qweight an unsorted act-order layer runs
    on is not copied (deepcopy, torch.save): a copy holds its weights once
    and plans its own when it runs."""
    import copy
    import io

    layer, _ = layer_and_linear(act_order=True)
    x = torch.randn(2, IN)
    expect = layer(x)
    assert layer.private_copy() is not None
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(layer), torch.load(buffer, weights_only=False)):
        assert other.private_copy() is None and layer.private_copy() is not None
        assert torch.equal(other(x), expect) and other.private_copy() is not None


def test_a_move_drops_the_private_copy_of_the_buffers_it_left():
    """A move to other buffers (model.to(device), to("meta")) leaves the private
    sorted copy of the old ones behind: it goes with the move, not at the
    layer's next call, which a model moved off the CPU for good never makes.
    A cast that keeps qweight and g_idx (half()) keeps it."""
    layer, _ = layer_and_linear(act_order=True)
    x = torch.randn(2, IN)
    layer(x)
    kept = layer.private_copy()
    assert kept is not None and layer.half().private_copy() is kept
    held = weakref.ref(kept[1][0])
    del kept
    layer.to("meta")
    assert layer.private_copy() is None and held() is None


def test_sorted_layer_refuses_weights_written_in_place():
    layer, _ = layer_and_linear(act_order=True)
    other, _ = layer_and_linear(act_order=True, seed=1)
    layer.sort_rows()
    with torch.no_grad():
        layer.qweight.copy_(other.qweight)
    with pytest.raises(RuntimeError, match="load_state_dict"):
        layer(torch.randn(1, IN))


@pytest.mark.parametrize("act_order", [False, True])
def test_layers_made_under_inference_mode_run(act_order):
    """Inference tensors have no version counter for the per-call checks."""
    x = torch.randn(2, IN)
    expect, _ = layer_and_linear(act_order=act_order)
    with torch.inference_mode():
        layer, _ = layer_and_linear(act_order=act_order)
        assert layer.qweight.is_inference()
        torch.testing.assert_close(layer(x), expect(x), rtol=0, atol=0)
        torch.testing.assert_close(layer.sort_rows()(x), expect(x), rtol=0, atol=0)


def test_sorting_an_in_order_layer_changes_nothing():
    layer, _ = layer_and_linear()
    qweight = layer.qweight
    assert not layer.sort_rows().rows_sorted and layer.qweight is qweight


@pytest.mark.parametrize("write", ["qweight", "act-order g_idx"])
def test_plain_layer_sees_writes_through_data(write):
    """A layer without act-order multiplies its own buffers as they are now:
    a write through `.data` (no version bump) takes effect on the next call."""
    layer, _ = layer_and_linear()
    other, _ = layer_and_linear(act_order=True, seed=1)
    x = torch.randn(3, IN)
    layer(x)
    names = ("qweight", "qzeros", "scales") if write == "qweight" else ("qweight", "qzeros", "scales", "g_idx")
    for name in names:
        getattr(layer, name).data.copy_(getattr(other, name))
    fresh = lowbit.GPTQLinear(IN, OUT, 4, layer.group_size, sym=False, desc_act=True, checkpoint_format="gptq_v2")
    fresh.load_state_dict(layer.state_dict())
    # Unshuffled and shuffled kernels sum in different orders: equal to fp32 rounding.
    torch.testing.assert_close(layer(x), fresh(x))


def ops_dispatched(fn) -> list[str]:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record() as record:
        fn()
    return record.ops


@pytest.mark.parametrize("group_size", [64, 96])  # 96: a short last group (K % group_size != 0)
def test_plain_layer_does_no_per_call_checks(group_size):
    """A decode step calls every layer once per token: a layer without
    act-order runs the matmul and no tensor op besides."""
    layer, _ = layer_and_linear(group_size=group_size, bias=False)
    x = torch.randn(1, IN)
    layer(x)
    ops = [op for op in ops_dispatched(lambda: layer(x)) if op not in ("aten.view", "aten.reshape", "aten._unsafe_view")]
    assert ops == ["lowbit.gptq_gemm"], ops


def test_unequal_groups():
    layer, _ = layer_and_linear(group_size=64)
    g = torch.randint(0, 4, (IN,), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    layer.g_idx.copy_(g)
    x = torch.randn(2, IN)
    W = ref.dequantize(layer.qweight.numpy(), layer.qzeros.numpy(), layer.scales.numpy(), g.numpy(), 4, "gptq_v2")
    np.testing.assert_allclose(layer(x).double().numpy(), x.double().numpy() @ W + layer.bias.double().numpy(),
                               rtol=1e-5, atol=1e-5)


def test_state_dict_is_the_checkpoint():
    layer, _ = layer_and_linear(bits=3, act_order=True)
    sd = layer.state_dict()
    assert list(sd) == ["qweight", "qzeros", "scales", "g_idx", "bias"]
    assert sd["qweight"].dtype == torch.int32 and sd["qweight"].shape == (IN * 3 // 32, OUT)
    assert sd["qzeros"].shape == (4, OUT * 3 // 32) and sd["scales"].dtype == torch.float16
    assert sd["g_idx"].dtype == torch.int32 and sd["g_idx"].shape == (IN,)
    nobias, _ = layer_and_linear(bias=False)
    assert "bias" not in nobias.state_dict()


def test_dtypes_and_to():
    """model.to(dtype) leaves the checkpoint's scales and bias as stored (fp16
    scales rounded to bf16 would change every weight): the layer's weight is
    the same, its outputs follow the input's dtype, float64 included."""
    layer, _ = layer_and_linear(act_order=True)
    x = torch.randn(4, IN)
    y32 = layer(x)
    weight, scales, bias = layer.dequantize(), layer.scales.clone(), layer.bias.clone()
    for dtype in (torch.bfloat16, torch.float64, torch.float32):
        layer = layer.to(dtype)
        assert layer.qweight.dtype == torch.int32 and torch.equal(layer.scales, scales) and torch.equal(layer.bias, bias)
        assert layer.scales.dtype == layer.bias.dtype == torch.float16 and torch.equal(layer.dequantize(), weight)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        y = layer(x.to(dtype))
        assert y.dtype == dtype
        torch.testing.assert_close(y.float(), y32, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(layer(x.double()), y32.double(), rtol=1e-6, atol=1e-6)  # multiplied as float32


def test_compile():
    layer, _ = layer_and_linear(act_order=True)
    compiled = torch.compile(layer)
    for M in (1, 7):
        x = torch.randn(M, IN)
        torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.parametrize("eager_first", [True, False])
def test_compiled_act_order_layer_follows_new_weights(eager_first):
    """An act-order layer whose rows are not sorted, compiled with fullgraph, computes with the weights it
    holds at each call (new ones loaded in place included), not a sorted copy planned before."""
    layer, _ = layer_and_linear(act_order=True, seed=1)
    other, _ = layer_and_linear(act_order=True, seed=2)
    x = torch.randn(3, IN)
    if eager_first:
        layer(x)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x))
    layer.load_state_dict(other.state_dict())
    torch.testing.assert_close(compiled(x), other(x))


def test_compiled_int8_act_order_layer_with_unsorted_rows_runs():
    """gptq_gemm_a8 needs contiguous groups: traced over its own unsorted rows, the layer runs gptq_gemm (fp32
    activations), which the int8 products of eager approximate; sorted, compiled and eager are the same."""
    layer, _ = layer_and_linear(act_order=True)
    x = torch.randn(3, IN)
    exact = layer(x)
    layer.int8_activations = True
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), exact)
    torch.testing.assert_close(compiled(x), layer(x), rtol=0.02, atol=0.02)  # eager: int8 activations
    layer.sort_rows()
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def test_a_layer_run_in_inference_mode_trains_after():
    """The sorted copy an unsorted act-order layer plans in inference mode is an ordinary tensor: a later call
    that saves it for backward works."""
    layer, linear = layer_and_linear(act_order=True)
    x = torch.randn(3, IN)
    with torch.inference_mode():
        layer(x)
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    want = xg.detach().clone().requires_grad_()
    torch.nn.functional.linear(want, layer.dequantize(torch.float32)).sum().backward()
    torch.testing.assert_close(xg.grad, want.grad)


def test_constructor_validates():
    with pytest.raises(ValueError, match="bits must be one of"):
        lowbit.GPTQLinear(IN, OUT, 5, 128)
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        lowbit.GPTQLinear(IN, OUT, 4, 128, checkpoint_format="awq")
    with pytest.raises(ValueError, match="group_size must be -1 or a positive integer"):
        lowbit.GPTQLinear(IN, OUT, 4, 0)
    with pytest.raises(ValueError, match="multiples of 32"):
        lowbit.GPTQLinear(IN, 48, 3, 128)


def test_constructor_names_arguments_of_the_wrong_type():
    """A float or bool passes `in` and `<=` tests (4.0 == 4, True == 1): each is refused naming its argument, not
    by torch.zeros; an integer scales dtype is refused where the layer is made, not by its first call."""
    for args, match in (((IN, OUT, 4.0, 128), "bits must be one of"), ((IN, OUT, True, 128), "bits must be one of"),
                        ((IN, OUT, 4, 128.0), "group_size must be"), ((IN, OUT, 4, True), "group_size must be"),
                        ((float(IN), OUT, 4, 128), "in_features must be"), ((-8, OUT, 4, 128), "in_features must be"),
                        ((IN, float(OUT), 4, 128), "out_features must be")):
        with pytest.raises(ValueError, match=match):
            lowbit.GPTQLinear(*args)
    for dtype in (torch.int32, torch.float64):  # float64: gptq_gemm reads fp16, bf16 or fp32 scales
        with pytest.raises(ValueError, match=rf"^GPTQLinear: dtype must be one of .*, got {dtype}$"):
            lowbit.GPTQLinear(IN, OUT, 4, 128, dtype=dtype)


def test_scales_dtype_the_kernels_do_not_read_is_refused_where_the_layer_is_made():
    """A layer of float64 scales was made, but failed on its first call in gptq_gemm; from_linear and
    quantize_linear refuse it before their work."""
    from lowbit.gptq.algorithm import quantize_linear

    linear = torch.nn.Linear(IN, OUT)
    with pytest.raises(ValueError, match=r"^GPTQLinear\.from_linear: dtype must be one of .*, got torch\.float64$"):
        lowbit.GPTQLinear.from_linear(linear, 4, 128, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^quantize_linear: dtype must be one of .*, got torch\.float64$"):
        quantize_linear(linear, torch.eye(IN), 4, 128, dtype=torch.float64)
    t = lowbit.GPTQLinear.from_linear(linear, 4, 128).state_dict()
    with pytest.raises(ValueError, match=r"^GPTQLinear\.from_tensors: scales must be one of .*, got torch\.float64$"):
        lowbit.GPTQLinear.from_tensors(t["qweight"], t["qzeros"], t["scales"].double(), t["g_idx"], t["bias"], 4, 128)


@pytest.mark.parametrize("name, value, error, match", [
    ("qweight", lambda t: t.tolist(), TypeError, "qweight must be a tensor, got list"),
    ("qzeros", lambda t: None, TypeError, "qzeros must be a tensor, got NoneType"),
    ("scales", lambda t: t.numpy(), TypeError, "scales must be a tensor, got ndarray"),
    ("g_idx", lambda t: t.tolist(), TypeError, "g_idx must be a tensor, got list"),
    ("bias", lambda t: t.to(torch.complex64), ValueError, r"bias must be a float tensor, got torch\.complex64"),
    ("bias", lambda t: t.long(), ValueError, r"bias must be a float tensor, got torch\.int64"),
])
def test_from_tensors_names_an_argument_that_is_not_a_tensor_of_its_kind(name, value, error, match):
    """A list's or None's AttributeError names no argument; a complex bias cast to the scales' dtype would lose its
    imaginary part without an error."""
    t = lowbit.GPTQLinear.from_linear(torch.nn.Linear(IN, OUT), 4, 128).state_dict()
    t[name] = value(t[name])
    with pytest.raises(error, match=rf"^GPTQLinear\.from_tensors: {match}$"):
        lowbit.GPTQLinear.from_tensors(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], t["bias"], 4, 128)


def test_zero_sizes_are_refused_naming_the_argument():
    """A layer of no inputs or outputs has packs of nothing the kernels cannot
    read: refused where it is made (as GGUFLinear refuses them), not by its
    first call's reshape or kernel error."""
    for args, match in (((0, OUT, 4, 128), "in_features"), ((IN, 0, 4, 128), "out_features")):
        with pytest.raises(ValueError, match=rf"^GPTQLinear: {match} must be a positive integer, got 0$"):
            lowbit.GPTQLinear(*args)
    with pytest.raises(ValueError, match="out_features must be a positive integer, got 0"):
        lowbit.GPTQLinear.from_tensors(torch.zeros(IN // 8, 0, dtype=torch.int32), torch.zeros(1, 0, dtype=torch.int32),
                                       torch.zeros(1, 0, dtype=torch.float16), None, None, 4, -1)
    assert lowbit.GPTQLinear(np.int64(IN), np.int64(OUT), np.int64(4), np.int64(128)).scales.shape == (IN // 128, OUT)


def test_a_group_past_in_features_is_one_group():
    """group_size is any positive int: one past in_features (however large) is the one group of -1."""
    for group_size in (IN + 1, 10**400):
        layer = lowbit.GPTQLinear(IN, OUT, 4, group_size)
        assert layer.scales.shape == (1, OUT) and not layer.g_idx.any()
    linear = torch.nn.Linear(IN, OUT)
    one, huge = (lowbit.GPTQLinear.from_linear(linear, 4, g, False) for g in (-1, 10**12))
    for name in ("qweight", "qzeros", "scales", "g_idx"):
        assert torch.equal(getattr(one, name), getattr(huge, name)), name


def test_default_g_idx():
    assert torch.equal(lowbit.GPTQLinear(IN, OUT, 4, -1).g_idx, torch.zeros(IN, dtype=torch.int32))
    assert torch.equal(lowbit.GPTQLinear(IN, OUT, 4, 64).g_idx, (torch.arange(IN) // 64).int())


@pytest.mark.parametrize("act_order", [False, True])
def test_inputs_of_another_width_are_refused_and_meta_inputs_give_shapes(act_order):
    layer, _ = layer_and_linear(act_order=act_order)
    # [4, 128] has as many elements as [2, 256]: a flattening reshape alone would accept it.
    for shape in [(2, IN - 1), (4, IN // 2), (IN * 2,), ()]:
        with pytest.raises(ValueError, match=rf"^GPTQLinear: input must be \[\.\.\., in_features={IN}\], got"):
            layer(torch.randn(shape))
    meta = layer.to("meta")  # shape inference, as accelerate's empty-weight models do
    y = meta(torch.randn(3, 5, IN, device="meta"))
    assert y.shape == (3, 5, OUT) and y.is_meta


def test_from_tensors_names_bits_and_a_qweight_it_cannot_read_shapes_from():
    """The layer's sizes are read off qweight with the packing of `bits`: bits 0 divided by zero, bits None or "4"
    and a 1-D qweight raised bare TypeError, ZeroDivisionError, IndexError."""
    layer, _ = layer_and_linear()
    tensors = layer.qweight, layer.qzeros, layer.scales, layer.g_idx, layer.bias
    for bits in (0, None, "4", 4.0):
        with pytest.raises(ValueError, match=r"^GPTQLinear.from_tensors: bits must be one of"):
            lowbit.GPTQLinear.from_tensors(*tensors, bits, 64)
    with pytest.raises(ValueError, match=r"^GPTQLinear.from_tensors: qweight must be 2-D"):
        lowbit.GPTQLinear.from_tensors(layer.qweight.flatten(), *tensors[1:], 4, 64)


def test_from_tensors_refuses_a_g_idx_naming_a_group_it_has_not():
    """The kernels refuse it on every call: refused where the layer is built."""
    layer, _ = layer_and_linear()
    for bad, found in ((1000, r"\[0, 1000\]"), (-1, r"\[-1, 3\]")):
        g_idx = layer.g_idx.clone()
        g_idx[0] = bad
        with pytest.raises(ValueError, match=rf"^GPTQLinear.from_tensors: g_idx values must lie in \[0, 4\), "
                                             rf"found {found}$"):
            lowbit.GPTQLinear.from_tensors(layer.qweight, layer.qzeros, layer.scales, g_idx, layer.bias, 4, 64)


@pytest.mark.parametrize("act_order", [False, True])
def test_columns_of_another_layer_load_by_assignment_and_build_a_layer(act_order):
    """part_state's tensors are views of columns (not contiguous): from_tensors and load_state_dict(assign=True)
    hold them contiguous, which the kernels require, and the layer gives the columns' outputs (to fp32 rounding:
    the kernels' column tiles, and so their order of summation, follow the layer's width)."""
    layer, _ = layer_and_linear(act_order=act_order)
    part = layer.part_state(slice(32, 64))
    assert not part["qweight"].is_contiguous() or not part["scales"].is_contiguous()
    x = torch.randn(3, IN)
    want = layer(x)[:, 32:64]
    built = lowbit.GPTQLinear.from_tensors(**part, bits=4, group_size=64, sym=False, desc_act=act_order,
                                           checkpoint_format="gptq_v2")
    loaded = lowbit.GPTQLinear(IN, 32, 4, 64, False, act_order, "gptq_v2", device="meta")
    loaded.load_state_dict(part, assign=True)
    for got in (built, loaded.sort_rows()):
        got.int8_activations = False
        torch.testing.assert_close(got(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        got.int8_activations = True
        assert got(x).shape == want.shape


def test_part_state_refuses_columns_the_zero_packs_cannot_cut():
    """qzeros are cut by whole packs from start to stop: a step kept every
    column's zeros beside half the columns' weights, an end inside a pack
    other columns' zeros; an open end failed on None // int."""
    layer, _ = layer_and_linear()
    out = layer.out_features
    for bad in (slice(0, 32, 2), slice(4, 32), slice(0, 36), slice(None), slice(-8, None), slice(32, 32),
                slice(0, out + 8), 3, None):
        with pytest.raises(ValueError, match=rf"^GPTQLinear.part_state: cols must be a slice\(start, stop\) with "
                                             rf"0 <= start < stop <= {out}, both multiples of 8, got "):
            layer.part_state(bad)
    assert layer.part_state(slice(8, 16))["qzeros"].shape == (layer.qzeros.shape[0], 1)


def test_a_meta_layer_sorts_and_joins_without_values():
    """A meta g_idx has no values: sort_rows leaves the layer as it is (a later load sorts nothing it cannot see) and
    can_join says no, where aten::equal raised a bare NotImplementedError; a load with assign=True then runs."""
    layer, _ = layer_and_linear(act_order=True)
    meta = lowbit.GPTQLinear(IN, 128, 4, 64, False, True, "gptq_v2", device="meta")
    assert not meta.sort_rows().rows_sorted
    assert not meta.can_join(lowbit.GPTQLinear(IN, 128, 4, 64, False, True, "gptq_v2", device="meta"))
    meta = lowbit.GPTQLinear(IN, OUT, 4, 64, False, True, "gptq_v2", device="meta").sort_rows()
    meta.load_state_dict(layer.state_dict(), assign=True)
    x = torch.randn(3, IN)
    torch.testing.assert_close(meta(x), layer(x), rtol=0, atol=0)


def test_forward_names_an_input_that_is_not_a_tensor():
    """nn.Linear refuses a list by its argument's name; the layer failed on .dim() with a bare AttributeError."""
    layer = lowbit.GPTQLinear.from_linear(torch.nn.Linear(IN, OUT), 4, 128)
    for x in ([0.0] * IN, None, np.zeros(IN, dtype=np.float32)):
        with pytest.raises(TypeError, match=rf"^GPTQLinear: input must be a tensor, got {type(x).__name__}$"):
            layer(x)
