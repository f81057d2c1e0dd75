"""gptq_gemm_a8: gptq_gemm with int8 activations.

Against the NumPy statement of its arithmetic (gptq_reference.gemm_a8) to one
float32 ulp, the VNNI kernel against the portable one bit for bit, and
against the exact float product within the bound that the rounding of the
activations allows: each activation moves by at most half its group's step
amax / 127, so |out - a @ W| <= sum_g amax_g / 254 * sum_{k in g} |W[k, n]|
(plus fp32 summation, far smaller).
"""
import pickle

import numpy as np
import pytest
import torch

import gptq_reference as ref
import lowbit
from lowbit.gptq import GPTQLinear
from lowbit.gptq.packing import from_panels, to_panels

ops = torch.ops.lowbit
BITS = (2, 3, 4, 8)
ISAS = [isa for isa in ("portable", "avx2", "avx512") if isa in ("portable", ops.cpu_isa())
        or (isa == "avx2" and ops.cpu_isa() == "avx512")]


def weight(rng, K, N, bits, group_size, fmt="gptq_v2"):
    """Random q, zeros and scales with contiguous groups (the last one short
    where group_size does not divide K), packed as a checkpoint stores them."""
    gs = K if group_size == -1 else group_size
    groups = -(-K // gs)
    maxq = (1 << bits) - 1
    q = rng.integers(0, maxq + 1, size=(K, N))
    z = rng.integers(1 if fmt == "gptq" else 0, maxq + 1, size=(groups, N))
    scales = (rng.uniform(0.5, 1.5, size=(groups, N)) / (1 << bits)).astype(np.float16)
    packed = lambda x: torch.from_numpy(np.ascontiguousarray(x))
    return {"qweight": packed(ref.pack(q, bits, 0)), "qzeros": packed(ref.pack(ref.encode_zeros(z, bits, fmt), bits, 1)),
            "scales": packed(scales),
        "g_idx": (torch.arange(K) // gs).to(torch.int32), "gs": group_size}


def run(a, w, bits, fmt="gptq_v2"):
    return ops.gptq_gemm_a8(a, w["qweight"], w["qzeros"], w["scales"], w["g_idx"], fmt == "gptq_v2", bits)


@pytest.fixture
def isa():
    yield
    ops.cpu_isa("best")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("K,N,group_size", [(384, 96, 128), (512, 224, 64), (384, 64, 256),
                                            (256, 128, -1), (1024, 320, 32)])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_matches_the_numpy_statement_on_every_isa(bits, K, N, group_size, fmt, isa):
    rng = np.random.default_rng(bits * 1000 + K + N)
    w = weight(rng, K, N, bits, group_size, fmt)
    a = torch.from_numpy(rng.standard_normal((9, K)).astype(np.float32))  # row tiles of 4, 4 and 1
    a[3] *= 1e-30  # a tiny row: its own scale, no underflow to zero
    a[5] = 0.0
    a[7] *= 1e-40  # subnormal: 127 / amax overflows fp32 unless the group is scaled first
    expect = ref.gemm_a8(a.numpy(), w["qweight"].numpy(), w["qzeros"].numpy(), w["scales"].numpy(), bits, fmt,
                         group_size)
    outs = []
    for name in ISAS:
        ops.cpu_isa(name)
        out = run(a, w, bits, fmt)
        ulp = np.spacing(np.abs(expect)).astype(np.float32)
        np.testing.assert_array_less(np.abs(out.numpy() - expect), ulp + 1e-45, err_msg=f"{name}")
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.equal(outs[0][5], torch.zeros(N))
    assert torch.isfinite(outs[0][7]).all() and (outs[0][7] != 0).any()


@pytest.mark.parametrize("bits", BITS)
def test_extreme_levels_and_activations_do_not_saturate(bits, isa):
    """Every level at its largest or smallest against activations at +-127 on
    the int8 grid: the largest products any kernel's narrow sums meet (AVX2
    adds u8 x s8 pairs in int16)."""
    K, N, maxq = 256, 96, (1 << bits) - 1
    w = weight(np.random.default_rng(5), K, N, bits, 128, "gptq_v2")
    q = np.full((K, N), maxq)
    q[:, ::2] = 0
    w["qweight"] = torch.from_numpy(np.ascontiguousarray(ref.pack(q, bits, 0)))
    a = torch.ones(6, K)
    a[1] = -1.0
    a[2, ::2] = -1.0
    a[3, 1::3] = -1.0
    expect = ref.gemm_a8(a.numpy(), w["qweight"].numpy(), w["qzeros"].numpy(), w["scales"].numpy(), bits,
                         "gptq_v2", 128)
    for name in ISAS:
        ops.cpu_isa(name)
        out = run(a, w, bits)
        np.testing.assert_array_less(np.abs(out.numpy() - expect), np.spacing(np.abs(expect)) + 1e-45,
                                     err_msg=name)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_within_the_activation_rounding_of_the_exact_product(bits, dtype):
    K, N, gs = 512, 192, 128
    rng = np.random.default_rng(bits)
    w = weight(rng, K, N, bits, gs)
    a = torch.from_numpy(rng.standard_normal((5, K)).astype(np.float32)).to(dtype)
    W = ref.dequantize(w["qweight"].numpy(), w["qzeros"].numpy(), w["scales"].numpy(), None, bits, "gptq_v2")
    a64 = a.double().numpy()
    exact = a64 @ W
    amax = np.abs(a64).reshape(5, K // gs, gs).max(axis=2)  # [M, groups]
    absW = np.abs(W).reshape(K // gs, gs, N).sum(axis=1)  # [groups, N]
    bound = (amax / 254) @ absW + 1e-5 * (np.abs(a64) @ np.abs(W))
    out = run(a, w, bits)
    assert out.dtype == dtype and out.shape == (5, N)
    out_rounding = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    err = np.abs(out.double().numpy() - exact)
    assert np.all(err <= bound + out_rounding * np.abs(exact)), float((err / (bound + 1e-30)).max())
    # The bound is met, not trivially: the rounding does move the result.
    assert err.max() > 1e-3 * bound.max()


def test_non_finite_activations_poison_their_row_only():
    rng = np.random.default_rng(0)
    w = weight(rng, 256, 64, 4, 128)
    a = torch.randn(3, 256)
    a[0, 7] = float("inf")
    a[2, 200] = float("nan")
    out = run(a, w, 4)
    assert torch.isnan(out[0]).all() and torch.isnan(out[2]).all()
    clean = run(torch.nan_to_num(a, nan=0.0, posinf=0.0), w, 4)
    assert torch.equal(out[1], clean[1])  # the finite row as in a call without the others' NaN and Inf


def test_leading_dims_and_empty_rows():
    rng = np.random.default_rng(1)
    w = weight(rng, 256, 64, 4, 128)
    a = torch.randn(2, 3, 256)
    assert torch.equal(run(a, w, 4), run(a.reshape(6, 256), w, 4).reshape(2, 3, 64))
    assert run(torch.empty(0, 256), w, 4).shape == (0, 64)


def test_refuses_groups_that_are_not_contiguous():
    rng = np.random.default_rng(2)
    w = weight(rng, 256, 64, 4, 128)
    w["g_idx"] = w["g_idx"].flip(0).contiguous()
    with pytest.raises(ValueError, match="gptq_gemm_a8: b_g_idx must put the rows in contiguous groups"):
        run(torch.randn(1, 256), w, 4)


def test_refuses_groups_too_long_for_exact_int32_sums():
    K = 65536
    w = weight(np.random.default_rng(3), K, 32, 8, -1)
    w["g_idx"] = torch.empty(0, dtype=torch.int32)
    with pytest.raises(ValueError, match="gptq_gemm_a8: b_gptq_scales has groups of 65536 rows"):
        run(torch.randn(1, K), w, 8)
    with pytest.raises(ValueError, match="gptq_gemm_a8: b_gptq_scales has groups of 65536 rows"):
        run(torch.randn(1, K, device="meta"), {k: v.to("meta") if torch.is_tensor(v) else v for k, v in w.items()},
            8)


def test_opcheck_compile_and_gradient():
    rng = np.random.default_rng(4)
    w = weight(rng, 256, 128, 4, 64)
    args = (w["qweight"], w["qzeros"], w["scales"], w["g_idx"], True, 4)
    a = torch.randn(3, 256)
    torch.library.opcheck(ops.gptq_gemm_a8, (a, *args))
    compiled = torch.compile(lambda x: torch.relu(ops.gptq_gemm_a8(x, *args)) * 2, fullgraph=True)
    assert torch.equal(compiled(a), torch.relu(ops.gptq_gemm_a8(a, *args)) * 2)
    # The rounding of the activations counts as the identity: gptq_gemm's gradient.
    x = a.clone().requires_grad_()
    ops.gptq_gemm_a8(x, *args).sum().backward()
    y = a.clone().requires_grad_()
    ops.gptq_gemm(y, w["qweight"], w["qzeros"], w["scales"], w["g_idx"], False, True, 4).sum().backward()
    torch.testing.assert_close(x.grad, y.grad)
    with pytest.raises(RuntimeError, match="gptq_gemm_a8: not differentiable with respect to b_gptq_scales"):
        ops.gptq_gemm_a8(a, w["qweight"], w["qzeros"], w["scales"].float().requires_grad_(), w["g_idx"], True, 4)


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_linear_with_int8_activations(act_order):
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 128)
    perm = torch.randperm(256) if act_order else None
    layer = GPTQLinear.from_linear(linear, 4, 64, sym=False, checkpoint_format="gptq_v2", perm=perm)
    if act_order:
        layer.sort_rows()
    x = torch.randn(2, 5, 256)
    exact = layer(x)
    layer.int8_activations = True
    assert "int8_activations=True" in repr(layer)
    got = layer(x)
    # What the op gives on the layer's (row-sorted) weight and permuted inputs.
    qweight, g_idx, order = layer._prepare(torch.empty(0, layer.in_features))
    x2 = x.reshape(-1, 256) if order is None else x.reshape(-1, 256)[:, order]
    direct = ops.gptq_gemm_a8(x2, qweight, layer.qzeros, layer.scales, g_idx, True, 4).float() + layer.bias.float()
    torch.testing.assert_close(got.reshape(-1, 128), direct, rtol=0, atol=1e-6)
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, exact, rtol=0, atol=0.05 * exact.abs().max().item())
    joined = GPTQLinear.joined([layer, layer])
    assert joined.int8_activations
    plain = GPTQLinear.from_linear(linear, 4, 64, sym=False, checkpoint_format="gptq_v2", perm=perm)
    if act_order:
        plain.sort_rows()
    assert not layer.can_join(plain)


def test_three_bit_layers_keep_fp32_activations():
    """No integer kernel reads 3-bit fields; the layer keeps gptq_gemm."""
    torch.manual_seed(1)
    layer = GPTQLinear.from_linear(torch.nn.Linear(256, 128), 3, 64, sym=False, checkpoint_format="gptq_v2")
    x = torch.randn(3, 256)
    exact = layer(x)
    layer.int8_activations = True
    assert torch.equal(layer(x), exact)


@pytest.mark.parametrize("bits", BITS)
def test_the_panel_layout_gives_the_same_bits_on_every_isa(bits, isa):
    """b_q_weight as panels [N/64, rows, 64] (to_panels) is read to the same
    bits as the checkpoint's layout, at every row count a kernel tiles."""
    rng = np.random.default_rng(bits)
    w = weight(rng, 512, 320, bits, 128)
    panels = {**w, "qweight": to_panels(w["qweight"])}
    assert panels["qweight"].shape == (5, 512 * bits // 32, 64)
    assert torch.equal(from_panels(panels["qweight"]), w["qweight"])
    a = torch.from_numpy(rng.standard_normal((9, 512)).astype(np.float32))
    for name in ISAS:
        ops.cpu_isa(name)
        for rows in (1, 2, 5, 9):
            assert torch.equal(run(a[:rows], panels, bits), run(a[:rows], w, bits)), (name, rows)


@pytest.mark.parametrize("op_name", ["gptq_gemm_a8", "gptq_gemm"])
def test_the_panel_layout_under_opcheck_compile_and_gradient(op_name):
    rng = np.random.default_rng(5)
    w = weight(rng, 256, 192, 4, 64)
    op = getattr(ops, op_name)
    flags = (True, 4) if op_name == "gptq_gemm_a8" else (False, True, 4)
    args = (to_panels(w["qweight"]), w["qzeros"], w["scales"], w["g_idx"], *flags)
    a = torch.randn(3, 256)
    torch.library.opcheck(op, (a, *args))
    compiled = torch.compile(lambda x: op(x, *args) * 2, fullgraph=True)
    assert torch.equal(compiled(a), op(a, *args) * 2)
    x = a.clone().requires_grad_()
    op(x, *args).sum().backward()
    y = a.clone().requires_grad_()
    op(y, w["qweight"], *args[1:]).sum().backward()
    assert torch.equal(x.grad, y.grad)


@pytest.mark.parametrize("act_order", [False, True])
def test_a_repacked_gptq_linear(act_order):
    """GPTQLinear.repack(): the same outputs bit for bit, the checkpoint's
    tensors in its state dict, its layout wherever else it goes."""
    torch.manual_seed(2)
    linear = torch.nn.Linear(256, 192)
    perm = torch.randperm(256) if act_order else None
    layer = GPTQLinear.from_linear(linear, 4, 64, sym=False, checkpoint_format="gptq_v2", perm=perm)
    checkpoint = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.int8_activations = True
    x = torch.randn(2, 3, 256)
    expect = layer(x)
    assert layer.repack() is layer and layer.repacked and "repacked=True" in repr(layer)
    assert layer.qweight.shape == (3, 32, 64) and layer.rows_sorted == act_order
    assert torch.equal(layer(x), expect)
    state = layer.state_dict()
    assert all(torch.equal(state[k], v) for k, v in checkpoint.items())
    assert torch.equal(layer.checkpoint_qweight(), checkpoint["qweight"])
    assert torch.equal(layer.dequantize(), GPTQLinear.from_linear(linear, 4, 64, sym=False, checkpoint_format="gptq_v2",
                                                                  perm=perm).dequantize())
    assert not layer.can_join(layer)
    copy = pickle.loads(pickle.dumps(layer))
    assert copy.repacked and torch.equal(copy(x), expect)
    # load_state_dict reads the checkpoint's layout and repacks it.
    other = GPTQLinear.from_linear(torch.nn.Linear(256, 192), 4, 64, sym=False, checkpoint_format="gptq_v2", perm=perm)
    other.int8_activations = True
    other_expect = other(x)
    layer.load_state_dict(other.state_dict())
    assert layer.repacked and torch.equal(layer(x), other_expect)
    layer.int8_activations = other.int8_activations = False  # gptq_gemm reads the panels too
    assert layer.repacked and torch.equal(layer(x), other(x))
    layer.int8_activations = True
    assert not layer.unsort_rows().repacked and not layer.rows_sorted and torch.equal(layer(x), other_expect)
    layer.repack().to("meta")
    assert not layer.repacked and layer.qweight.shape == (32, 192)


def test_repack_model_takes_the_gptq_layers_of_whole_panels():
    torch.manual_seed(3)
    make = lambda n, bits: GPTQLinear.from_linear(torch.nn.Linear(256, n), bits, 64, checkpoint_format="gptq_v2")
    model = torch.nn.ModuleDict({"a": make(128, 4), "b": make(96, 4), "c": make(128, 3), "d": make(128, 2),
                                 "e": make(128, 8)})
    for name in "abcd":
        model[name].int8_activations = True
    x = torch.randn(3, 256)
    expect = {name: layer(x) for name, layer in model.items()}
    assert lowbit.repack_model(model) == ["a", "c", "d", "e"]  # b: not whole panels
    assert all(torch.equal(layer(x), expect[name]) for name, layer in model.items())
    with pytest.raises(ValueError, match="^GPTQLinear.repack: the panel layout is the CPU kernels'; out_features=96 is "
                                         "not a multiple of its 64 columns$"):
        model["b"].repack()
    # A layer of whole panels off the CPU is refused for where it is, not for its width.
    with pytest.raises(ValueError, match="^GPTQLinear.repack: the panel layout is the CPU kernels'; qweight is on meta$"):
        make(128, 4).to("meta").repack()
