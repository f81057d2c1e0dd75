"""Gradients through lowbit's ops and layers: the gradient of the dequantized
weight with respect to the activations (python/lowbit/_autograd.py), checked
in float64 against the NumPy / gguf-py dequantized references; the weights
refuse to be differentiated; opcheck and torch.compile with gradients."""
import os
import re
import sys

import numpy as np
import pytest
import torch

import gguf_blocks as gb
import gptq_reference as ref
import lowbit
import lowbit._autograd as autograd_mod

ops = torch.ops.lowbit
K, N = 256, 64
N_GGML, ROWS = 512, 40  # 40 rows: two whole 16-row tiles and a partial one in the repacked layout


@pytest.fixture(params=["one tile", "many tiles"])
def tiles(request, monkeypatch):
    """The backward decodes W in tiles: whole and in several pieces (a tail included)."""
    if request.param == "many tiles":
        monkeypatch.setattr(autograd_mod, "TILE_VALUES", 16 * 32)
    return request.param


def gptq_case(bits, layout):
    rng = np.random.default_rng([bits, len(layout)])
    act_order = layout != "plain"
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", act_order)
    q, z, s, g = (torch.from_numpy(np.ascontiguousarray(ckpt[k])) for k in ("qweight", "qzeros", "scales", "g_idx"))
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq_v2")  # [K, N]
    if layout == "shuffled":
        perm = torch.argsort(g, stable=True).to(torch.int32)
        ops.gptq_shuffle(q, perm, bits)
        return (q, z, s, perm, True), W
    if layout == "plain":
        g = torch.empty(0, dtype=torch.int32)
    return (q, z, s, g, False), W


@pytest.mark.parametrize("layout", ["plain", "act-order", "shuffled"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptq_gemm_gradient_is_that_of_the_dequantized_weight(device, tiles, bits, layout):
    (q, z, s, g, shuffled), W = gptq_case(bits, layout)
    q, z, s, g = (t.to(device) for t in (q, z, s, g))
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(2, 3, K, dtype=dtype, device=device, requires_grad=True)
        out = ops.gptq_gemm(a, q, z, s.to(dtype), g, shuffled, True, bits)
        grad_out = torch.randn_like(out)
        (grad_a,) = torch.autograd.grad(out, a, grad_out)
        assert grad_a.dtype == dtype and grad_a.shape == a.shape
        a64 = a.detach().double().cpu().requires_grad_()
        (expect,) = torch.autograd.grad(a64 @ torch.from_numpy(W), a64, grad_out.double().cpu())
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(grad_a.double().cpu(), expect, rtol=tol, atol=tol * expect.abs().max().item())


GGML_TYPES = ["Q4_0", "Q4_1", "Q5_K", "Q6_K", "IQ2_XS", "Q8_0", "F16", "NVFP4"]


def ggml_case(name, rows=ROWS, seed=0):
    rng = np.random.default_rng([seed, gb.type_id(name)])
    raw = gb.random_blocks(rng, name, rows, N_GGML)
    return torch.from_numpy(raw), torch.from_numpy(gb.dequantize(raw, name).astype(np.float64))


@pytest.mark.parametrize("op_name", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("qtype", GGML_TYPES)
def test_ggml_gradient_is_that_of_the_dequantized_weight(device, tiles, op_name, qtype):
    raw, W = ggml_case(qtype)
    x = torch.randn(5, N_GGML, device=device, requires_grad=True)
    out = getattr(ops, op_name)(raw.to(device), x, gb.type_id(qtype), ROWS)
    grad_out = torch.randn_like(out)
    (grad_x,) = torch.autograd.grad(out, x, grad_out)
    expect = grad_out.double().cpu() @ W  # d(x @ W.T)/dx, the 8-bit activation rounding as identity
    torch.testing.assert_close(grad_x.double().cpu(), expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "MXFP4"])
def test_ggml_repacked_gradient(cpu_isa, tiles, qtype):
    raw, W = ggml_case(qtype)
    t = gb.type_id(qtype)
    packed = ops.ggml_repack(raw, t, ROWS, N_GGML)
    x = torch.randn(3, N_GGML, requires_grad=True)
    grad_out = torch.randn(3, ROWS)
    (grad_x,) = torch.autograd.grad(ops.ggml_mul_mat_repacked(packed, x, t, ROWS), x, grad_out)
    expect = grad_out.double() @ W
    torch.testing.assert_close(grad_x.double(), expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())


@pytest.mark.parametrize("repacked", [False, True])
@pytest.mark.parametrize("per_slot", [False, True])
def test_ggml_mul_mat_id_gradient(tiles, per_slot, repacked):
    experts = [ggml_case("Q4_K", seed=e) for e in range(3)]
    t = gb.type_id("Q4_K")
    W = torch.stack([raw for raw, _ in experts])
    if repacked:
        W = torch.stack([ops.ggml_repack(raw, t, ROWS, N_GGML) for raw, _ in experts])
    ids = torch.tensor([[0, 2], [2, 2], [1, 0], [2, 1]], dtype=torch.int32)
    x = torch.randn(4, 2, N_GGML, requires_grad=True) if per_slot else torch.randn(4, N_GGML, requires_grad=True)
    op = ops.ggml_mul_mat_id_repacked if repacked else ops.ggml_mul_mat_id
    out = op(W, x, ids, t, ROWS)
    grad_out = torch.randn_like(out)
    (grad_x,) = torch.autograd.grad(out, x, grad_out)
    expect = torch.zeros(4, 2, N_GGML, dtype=torch.float64)
    for tok in range(4):
        for slot in range(2):
            expect[tok, slot] = grad_out[tok, slot].double() @ experts[ids[tok, slot]][1]
    expect = expect if per_slot else expect.sum(1)
    torch.testing.assert_close(grad_x.double(), expect, rtol=1e-5, atol=1e-5 * expect.abs().max().item())


@pytest.mark.parametrize("per_slot", [False, True])
def test_ggml_mul_mat_id_gradient_of_no_rows(per_slot):
    """Experts of 0 rows: an empty output, and a zero gradient of x's shape."""
    t = gb.type_id("Q4_0")
    W = torch.empty(2, 0, N_GGML // 32 * 18, dtype=torch.uint8)
    ids = torch.tensor([[0, 1], [1, 0], [1, 1]], dtype=torch.int32)
    x = torch.randn(3, *((2,) if per_slot else ()), N_GGML, requires_grad=True)
    out = ops.ggml_mul_mat_id(W, x, ids, t, 0)
    assert out.shape == (3, 2, 0)
    (grad_x,) = torch.autograd.grad(out.sum(), x)
    assert torch.equal(grad_x, torch.zeros_like(x))


def test_weights_refuse_to_be_differentiated():
    (q, z, s, g, _), _ = gptq_case(4, "act-order")
    a = torch.randn(2, K, requires_grad=True)
    with pytest.raises(RuntimeError, match="gptq_gemm: not differentiable with respect to b_gptq_scales"):
        ops.gptq_gemm(a, q, z, s.float().requires_grad_(), g, False, True, 4)
    with pytest.raises(RuntimeError, match="gptq_dequantize: not differentiable with respect to b_gptq_scales"):
        ops.gptq_dequantize(q, z, s.float().requires_grad_(), g, True, 4)
    with pytest.raises(RuntimeError, match="gptq_permute_cols: not differentiable with respect to scales"):
        ops.gptq_permute_cols(q, z, s.float().requires_grad_(), torch.arange(N, dtype=torch.int32), 4)


def test_opcheck_with_gradients():
    (q, z, s, g, _), _ = gptq_case(4, "act-order")
    a = torch.randn(3, K, requires_grad=True)
    torch.library.opcheck(ops.gptq_gemm, (a, q, z, s.float(), g, False, True, 4))
    raw, _ = ggml_case("Q4_K")
    x = torch.randn(3, N_GGML, requires_grad=True)
    for op in (ops.ggml_mul_mat_vec_a8, ops.ggml_mul_mat_a8):
        torch.library.opcheck(op, (raw, x, gb.type_id("Q4_K"), ROWS))
    torch.library.opcheck(ops.ggml_mul_mat_repacked, (ops.ggml_repack(raw, 12, ROWS, N_GGML), x, 12, ROWS))


def test_layers_pass_gradients_below_them_under_torch_compile():
    """A float Linear under a GPTQLinear and a GGUFLinear trains: its gradient
    is that of the same stack with the dequantized weights, eager and compiled."""
    torch.manual_seed(0)
    gptq = lowbit.GPTQLinear.from_linear(torch.nn.Linear(K, N), 4, 32, sym=False, checkpoint_format="gptq_v2",
                                         perm=torch.randperm(K))
    raw, _ = ggml_case("Q4_K", rows=K)
    gguf = lowbit.GGUFLinear(N_GGML, K, gb.type_id("Q4_K"), bias=False)
    gguf.qweight.copy_(raw)
    below = torch.nn.Linear(32, N_GGML)
    stack = lambda x: gptq(gguf(below(x)))
    dense = lambda x: torch.nn.functional.linear(torch.nn.functional.linear(below(x), gguf.dequantize(torch.float32)),
                                                 gptq.dequantize(torch.float32), gptq.bias.float())
    x = torch.randn(4, 32)
    grads = {}
    for name, f in (("lowbit", stack), ("compiled", torch.compile(stack)), ("dense", dense)):
        below.zero_grad()
        f(x).square().sum().backward()
        grads[name] = below.weight.grad.clone()
    scale = grads["dense"].abs().max().item()
    # The GGUF layer's 8-bit activations move the forward a little; the gradients follow.
    torch.testing.assert_close(grads["lowbit"], grads["dense"], rtol=0.05, atol=0.02 * scale)
    torch.testing.assert_close(grads["compiled"], grads["lowbit"], rtol=1e-4, atol=1e-5 * scale)


def python_autograd_calls(f):
    """The Python functions of torch.library's autograd kernel (which the ops'
    registered gradients run in) that a call of f enters."""
    seen = []

    def probe(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.endswith(os.path.join("_library", "autograd.py")):
            seen.append(frame.f_code.co_name)

    sys.setprofile(probe)
    try:
        f()
    finally:
        sys.setprofile(None)
    return seen


def test_layers_skip_autograd_where_nothing_needs_a_gradient():
    """Frozen layers call their op below autograd under no_grad and on inputs
    that need no gradient (no Python autograd kernel, the host time of a small
    matvec), and through it where the input needs one."""
    torch.manual_seed(0)
    gptq = lowbit.GPTQLinear.from_linear(torch.nn.Linear(K, N), 4, 32, sym=False, checkpoint_format="gptq_v2")
    raw, _ = ggml_case("Q4_K", rows=K)
    gguf = lowbit.GGUFLinear.from_raw(raw, gb.type_id("Q4_K"), N_GGML)
    for layer, n in ((gptq, K), (gguf, N_GGML)):
        x = torch.randn(2, n)
        with torch.no_grad():
            assert python_autograd_calls(lambda: layer(x)) == []
            expect = layer(x)
        assert python_autograd_calls(lambda: layer(x)) == []
        y = layer(x)
        assert y.grad_fn is None and torch.equal(y, expect)
        x.requires_grad_()
        assert python_autograd_calls(lambda: layer(x))  # the probe sees the kernel where it runs
        y = layer(x)
        assert y.grad_fn is not None and torch.equal(y.detach(), expect)


def transform_layers():
    """{name: (layer, in_features)}: a GPTQLinear (its op exact in fp32) and a GGUFLinear, without bias."""
    torch.manual_seed(0)
    gptq = lowbit.GPTQLinear.from_linear(torch.nn.Linear(K, N, bias=False), 4, 32, sym=False, checkpoint_format="gptq_v2")
    raw, _ = ggml_case("Q4_K", rows=K)
    gguf = lowbit.GGUFLinear.from_raw(raw, gb.type_id("Q4_K"), N_GGML)
    return {"gptq": (gptq, K), "gguf": (gguf, N_GGML)}


@pytest.mark.parametrize("name", ["gptq", "gguf"])
def test_forward_mode_tangents_go_through_the_layers(name):
    """forward_ad, torch.func.jvp and jacfwd carry the tangent through the op (the registered gradients are
    reverse-mode only; the op alone gives a zero tangent): the tangent is the op's product with it, that is
    t @ W.T up to the GGUF op's 8-bit rounding of t, as of x."""
    layer, n = transform_layers()[name]
    x, t = torch.randn(2, 3, n), torch.randn(2, 3, n)
    W = layer.dequantize(torch.float32)
    y, tangent = torch.func.jvp(layer, (x,), (t,))
    assert torch.equal(y, layer(x)) and torch.equal(tangent, layer(t))
    with torch.autograd.forward_ad.dual_level():
        dual = layer(torch.autograd.forward_ad.make_dual(x, t))
        assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual).tangent, tangent)
    torch.testing.assert_close(torch.func.jacfwd(layer)(x[0, 0]), W, rtol=1e-5, atol=1e-5 * W.abs().max().item())
    if name == "gptq":
        torch.testing.assert_close(tangent, t @ W.T, rtol=1e-5, atol=1e-5 * W.abs().max().item())


def test_forward_mode_tangents_go_through_the_ops():
    """Called directly, the matmul ops carry an activation's tangent too (forward_ad, torch.func.jvp, jacfwd):
    the op's product with it (register_autograd's kernel alone gives none)."""
    (q, z, s, g, _), W = gptq_case(4, "act-order")
    raw, _ = ggml_case("Q4_K")
    experts = torch.stack([raw, ggml_case("Q4_K", seed=1)[0]])
    ids = torch.tensor([[0, 1], [1, 1], [1, 0]], dtype=torch.int32)
    q4k = gb.type_id("Q4_K")
    calls = {"gptq_gemm": (lambda a: ops.gptq_gemm(a, q, z, s.float(), g, False, True, 4), K),
             "gptq_gemm_a8": (lambda a: ops.gptq_gemm_a8(a, q, z, s.float(), torch.empty(0, dtype=torch.int32), True,
                                                         4), K),
             "ggml_mul_mat_vec_a8": (lambda x: ops.ggml_mul_mat_vec_a8(raw, x, q4k, ROWS), N_GGML),
             "ggml_mul_mat_a8": (lambda x: ops.ggml_mul_mat_a8(raw, x, q4k, ROWS), N_GGML),
             "ggml_mul_mat_repacked": (lambda x: ops.ggml_mul_mat_repacked(ops.ggml_repack(raw, q4k, ROWS, N_GGML), x,
                                                                           q4k, ROWS), N_GGML),
             "ggml_mul_mat_id": (lambda x: ops.ggml_mul_mat_id(experts, x, ids, q4k, ROWS), N_GGML)}
    for name, (op, n) in calls.items():
        x, t = torch.randn(3, n), torch.randn(3, n)
        y, tangent = torch.func.jvp(op, (x,), (t,))
        assert torch.equal(y, op(x)) and torch.equal(tangent, op(t)), name
        with torch.autograd.forward_ad.dual_level():
            dual = op(torch.autograd.forward_ad.make_dual(x, t))
            assert torch.equal(torch.autograd.forward_ad.unpack_dual(dual).tangent, tangent), name
    jacobian = torch.func.jacfwd(lambda a: calls["gptq_gemm"][0](a[None])[0])(torch.randn(K))
    torch.testing.assert_close(jacobian.double(), torch.from_numpy(W).T, rtol=1e-5, atol=1e-5 * abs(W).max())


def test_rms_norm_forward_mode_tangent_is_its_derivative():
    x, w, tx, tw = torch.randn(3, 64), torch.randn(64), torch.randn(3, 64), torch.randn(64)
    reference = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    for primals, tangents in (((x, w), (tx, tw)), ((x, w), (tx, torch.zeros(64))), ((x, w), (torch.zeros(3, 64), tw))):
        _, got = torch.func.jvp(lambda x, w: ops.rms_norm(x, w, 1e-6), primals, tangents)
        _, want = torch.func.jvp(reference, primals, tangents)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, got = torch.func.jvp(lambda x: ops.rms_norm(x, w, 1e-6), (x,), (tx,))
    torch.testing.assert_close(got, torch.func.jvp(lambda x: reference(x, w), (x,), (tx,))[1], rtol=1e-5, atol=1e-5)


def test_forward_mode_tangents_of_weights_and_of_inference_ops_are_refused():
    (q, z, s, g, _), _ = gptq_case(4, "act-order")
    a, scales = torch.randn(2, K), s.float()
    refusals = {
        "gptq_gemm: not differentiable with respect to b_gptq_scales": (
            lambda v: ops.gptq_gemm(a, q, z, v, g, False, True, 4), scales),
        "gptq_dequantize: not differentiable with respect to b_gptq_scales": (
            lambda v: ops.gptq_dequantize(q, z, v, g, True, 4), scales),
        "ggml_quantize: not differentiable with respect to x": (
            lambda v: ops.ggml_quantize(v, gb.type_id("Q8_0")), torch.randn(4, 64)),
        "decode_attention: not differentiable with respect to q": (
            lambda v: ops.decode_attention(v, torch.randn(2, 32), torch.randn(2, 32), torch.ones(16), torch.zeros(16),
                                           torch.zeros(2, 8, 32), torch.zeros(2, 8, 32), 0, 0.125), torch.randn(4, 32)),
    }
    for says, (call, primal) in refusals.items():
        with pytest.raises(RuntimeError, match=re.escape(says) + r" \(forward mode"):
            torch.func.jvp(call, (primal,), (torch.ones_like(primal),))
        with torch.autograd.forward_ad.dual_level(), pytest.raises(RuntimeError, match=re.escape(says)):
            call(torch.autograd.forward_ad.make_dual(primal, torch.ones_like(primal)))


@pytest.mark.parametrize("name", ["gptq", "gguf"])
def test_reverse_mode_torch_func_transforms_are_refused_by_name(name):
    """torch.func's grad, vjp, jacrev and a vmap over an input that requires grad are refused naming the op
    (torch.library's gradients run in torch.autograd only; under vmap the output would leave the graph);
    vmap without gradients runs."""
    layer, n = transform_layers()[name]
    op = {"gptq": "gptq_gemm", "gguf": "ggml_mul_mat_a8"}[name]
    x = torch.randn(3, n)
    refused = re.escape(f"{op}: torch.func's grad, vjp and jacrev (and vmap of an input that requires grad) are "
                        "not supported")
    for transform in (lambda: torch.func.grad(lambda v: layer(v).sum())(x),
                      lambda: torch.func.vjp(layer, x)[1](torch.ones(3, layer.out_features)),
                      lambda: torch.func.jacrev(layer)(x[0]),
                      lambda: torch.func.vmap(layer)(x.clone().requires_grad_())):
        with pytest.raises(RuntimeError, match=refused):
            transform()
    assert torch.equal(torch.func.vmap(layer)(x), layer(x))
