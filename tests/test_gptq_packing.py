"""gptq_pack / gptq_unpack and lowbit.quantize_rtn against the NumPy reference."""
import numpy as np
import pytest
import torch

import gptq_reference as ref
import lowbit

BITS = (2, 3, 4, 8)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("bits", BITS)
def test_pack_and_unpack_match_reference(bits, dim):
    rng = np.random.default_rng([bits, dim])
    shape = [64, 96]
    shape[1 - dim] = 5
    values = rng.integers(0, 2**bits, size=shape).astype(np.int32)
    packed = torch.ops.lowbit.gptq_pack(torch.from_numpy(values), bits, dim)
    np.testing.assert_array_equal(packed.numpy(), ref.pack(values, bits, dim))
    words = rng.integers(-(2**31), 2**31, size=packed.shape).astype(np.int32)
    unpacked = torch.ops.lowbit.gptq_unpack(torch.from_numpy(words), bits, dim)
    np.testing.assert_array_equal(unpacked.numpy(), ref.unpack(words, bits, dim))


@pytest.mark.parametrize(
    "bits, fmt, word",
    [
        (4, "gptq", 0x77777777),
        (4, "gptq_v2", 0x88888888),
        (8, "gptq", 0x7F7F7F7F),
        (8, "gptq_v2", 0x80808080),
        (2, "gptq", 0x55555555),
        (2, "gptq_v2", 0xAAAAAAAA),
    ],
)
def test_quantize_rtn_symmetric_zero_words(bits, fmt, word):
    t = lowbit.quantize_rtn(torch.randn(64, 128), bits, 32, sym=True, checkpoint_format=fmt)
    assert t.qzeros.dtype == torch.int32 and t.qzeros.shape == (4, 64 * bits // 32)
    assert np.all(t.qzeros.numpy().view(np.uint32) == word)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("bits", BITS)
def test_quantize_rtn_is_a_valid_close_checkpoint(bits, sym, act_order):
    torch.manual_seed(bits)
    w = torch.randn(64, 256)
    perm = torch.randperm(256) if act_order else None
    t = lowbit.quantize_rtn(w, bits, 64, sym=sym, checkpoint_format="gptq_v2", perm=perm)
    assert t.qweight.shape == (256 * bits // 32, 64) and t.scales.shape == (4, 64)
    expect_g_idx = ref.make_g_idx(256, 64, None if perm is None else perm.numpy())
    np.testing.assert_array_equal(t.g_idx.numpy(), expect_g_idx)
    # Dequantized by the independent reference: a value quantized inside the
    # grid is within half a step (RTN); one clipped at a grid end is within one
    # step (the rounded zero point can shift the grid by half a step). The
    # 1e-3 covers fp32 evaluation of w / scale.
    W = ref.dequantize(t.qweight.numpy(), t.qzeros.numpy(), t.scales.numpy(), t.g_idx.numpy(), bits, "gptq_v2")
    step = t.scales.double().numpy()[t.g_idx.numpy()]
    err = np.abs(W - w.t().double().numpy()) / step
    q = ref.unpack(t.qweight.numpy(), bits, 0)
    inside = (q > 0) & (q < 2**bits - 1)
    assert np.all(err[inside] <= 0.5 + 1e-3)
    assert np.all(err <= 1.0 + 1e-3)


def test_quantize_rtn_v1_refuses_zero_point_zero():
    w = torch.rand(32, 64) + 0.1  # all positive: asymmetric zero points are 0
    with pytest.raises(ValueError, match="zero point of 0"):
        lowbit.quantize_rtn(w, 4, 32, sym=False, checkpoint_format="gptq")
    t = lowbit.quantize_rtn(w, 4, 32, sym=False, checkpoint_format="gptq_v2")
    assert np.all(ref.unpack(t.qzeros.numpy(), 4, 1) == 0)


def test_quantize_rtn_refuses_non_finite_weights_and_overflowing_scales():
    w = torch.randn(32, 64)
    w[4, 9] = float("nan")
    with pytest.raises(ValueError, match=r"quantize_rtn: weight holds a non-finite value \(nan\) at \[4, 9\]"):
        lowbit.quantize_rtn(w, 4, 32)
    w[4, 9] = 1e6  # output 4, group 0: a scale of 1e6 / 7.5 is beyond fp16
    with pytest.raises(ValueError, match=r"quantize_rtn: group 0 of output 4 needs a scale beyond torch.float16"):
        lowbit.quantize_rtn(w, 4, 32)
    assert bool(torch.isfinite(lowbit.quantize_rtn(w, 4, 32, scale_dtype=torch.float32).scales).all())


@pytest.mark.parametrize("sym", [True, False])
def test_quantize_rtn_keeps_ranges_below_fp16_scales(sym):
    """A group whose range is too small for an fp16 scale takes the smallest normal one (not 0, which
    divided to NaN codes): its weights dequantize to within half that scale, the others as before."""
    w = torch.randn(32, 64)
    w[0, :32] = 1e-8 * torch.randn(32)  # a scale of about 5e-9: 0 in fp16
    t = lowbit.quantize_rtn(w, 4, 32, sym=sym)
    assert t.scales[0, 0] == torch.finfo(torch.float16).tiny
    layer = lowbit.GPTQLinear.from_tensors(t.qweight, t.qzeros, t.scales, t.g_idx, None, 4, 32, sym=sym,
                                           checkpoint_format=t.checkpoint_format)
    W = layer.dequantize(torch.float32)
    assert torch.isfinite(W).all()
    assert (W[0, :32] - w[0, :32]).abs().max() <= torch.finfo(torch.float16).tiny
    other = w.clone()
    other[0] = 1.0
    assert torch.equal(t.scales[:, 1:], lowbit.quantize_rtn(other, 4, 32, sym=sym).scales[:, 1:])


def test_from_tensors_refuses_g_idx_that_int32_would_not_hold():
    """g_idx is stored as int32: a value beyond it, or a float, would narrow
    to another, valid-looking group id."""
    t = lowbit.quantize_rtn(torch.randn(32, 64), 4, 32)
    make = lambda g_idx: lowbit.GPTQLinear.from_tensors(t.qweight, t.qzeros, t.scales, g_idx, None, 4, 32)
    assert torch.equal(make(t.g_idx.long()).g_idx, t.g_idx)
    wrapped = t.g_idx.long()
    wrapped[0] = 2**32 + 1  # int32 1
    with pytest.raises(ValueError, match=r"from_tensors: g_idx holds 4294967297, beyond int32"):
        make(wrapped)
    with pytest.raises(ValueError, match=r"from_tensors: g_idx must hold integers, got torch.float32"):
        make(t.g_idx.float() + 0.5)


def test_quantize_rtn_rejects_bad_arguments():
    w = torch.randn(32, 64)
    with pytest.raises(ValueError, match="bits"):
        lowbit.quantize_rtn(w, 5, 32)
    with pytest.raises(ValueError, match="group_size"):
        lowbit.quantize_rtn(w, 4, 0)
    with pytest.raises(ValueError, match="checkpoint_format"):
        lowbit.quantize_rtn(w, 4, 32, checkpoint_format="awq")
    with pytest.raises(ValueError, match="perm"):
        lowbit.quantize_rtn(w, 4, 32, perm=torch.zeros(64, dtype=torch.long))
    # A float or bool passes `in` / `<=` tests (4.0 == 4, True == 1): refused by name, not failing in torch.
    for kwargs, pattern in [({"bits": 4.0}, r"bits must be one of \(2, 3, 4, 8\), got 4.0"),
                            ({"bits": True}, "bits must be"),
                            ({"group_size": 32.0}, r"group_size must be -1 or a positive integer, got 32.0"),
                            ({"group_size": True}, r"group_size must be -1 or a positive integer, got True"),
                            ({"scale_dtype": torch.int32}, r"scale_dtype must be one of .*, got torch.int32"),
                            ({"perm": torch.arange(64) + 0.5}, r"perm must hold integers, got torch.float32")]:
        with pytest.raises(ValueError, match=rf"quantize_rtn: {pattern}"):
            lowbit.quantize_rtn(w, **{"bits": 4, "group_size": 32, **kwargs})
    assert torch.equal(lowbit.quantize_rtn(w, 4, 32, perm=list(range(64))).g_idx,
                       lowbit.quantize_rtn(w, 4, 32).g_idx)


def test_quantize_rtn_last_group_may_be_shorter():
    """K = 96 with group_size 64: groups of 64 and 32 rows, as GPTQ writes them."""
    torch.manual_seed(0)
    w = torch.randn(32, 96)
    for perm in (None, torch.randperm(96)):
        t = lowbit.quantize_rtn(w, 4, 64, sym=False, perm=perm)
        assert t.scales.shape == (2, 32)
        order = np.arange(96) if perm is None else perm.numpy()
        expect = np.empty(96, dtype=np.int32)
        expect[order] = np.arange(96) // 64
        np.testing.assert_array_equal(t.g_idx.numpy(), expect)
        W = ref.dequantize(t.qweight.numpy(), t.qzeros.numpy(), t.scales.numpy(), t.g_idx.numpy(), 4, "gptq_v2")
        step = t.scales.double().numpy()[t.g_idx.numpy()]
        assert np.all(np.abs(W - w.t().double().numpy()) <= step * (1.0 + 1e-3))


def test_panel_layout_round_trips_and_refuses_other_shapes():
    from lowbit.gptq.packing import PANEL_COLS, from_panels, to_panels

    qweight = torch.randint(-2**31, 2**31 - 1, (16, 2 * PANEL_COLS), dtype=torch.int32)
    assert torch.equal(from_panels(to_panels(qweight)), qweight)
    for bad in (torch.zeros(16, PANEL_COLS + 8, dtype=torch.int32), torch.zeros(PANEL_COLS, dtype=torch.int32)):
        with pytest.raises(ValueError, match=rf"to_panels: qweight must be 2-D \[rows, N\] with N a multiple of 64"):
            to_panels(bad)
    with pytest.raises(ValueError, match=r"from_panels: panels must be 3-D \[N / 64, rows, 64\], got shape \(16, 128\)"):
        from_panels(qweight)  # a checkpoint-layout qweight, which came back transposed
