"""Inputs at the edges of what PyTorch allows: activations with NaN or Inf,
and zero-width matrices. Each matmul op gives what a float matmul gives
(non-finite where a non-finite input reaches an output, zeros for an empty
sum), on every device and CPU ISA, never a crash. And arguments of the
wrong kind to the Python constructors, refused by an error that names the
function and the argument."""
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import gguf_blocks as gb
import gptq_reference as ref
import lowbit

ops = torch.ops.lowbit
N, ROWS, M = 512, 12, 6
REPACKED = [t for t in gb.TYPES if ops.ggml_has_repacked_layout(gb.type_id(t))]


def weight(name, rows=ROWS):
    rng = np.random.default_rng([7, gb.type_id(name)])
    return torch.from_numpy(gb.random_blocks(rng, name, rows, N))


def poisoned(dtype=torch.float32):
    """Rows 0-2 each carry one non-finite element (NaN, +Inf, -Inf); the rest are finite."""
    x = torch.randn(M, N, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[0, 37], x[1, 300], x[2, 511] = float("nan"), float("inf"), float("-inf")
    return x


def check_poisoned_rows(out, clean):
    """Rows with a non-finite input are non-finite in every output (every
    output reads the whole row); NaN stays NaN; the other rows are the clean
    call's, bit for bit (rows are independent)."""
    assert torch.isnan(out[0]).all(), out[0]
    assert not torch.isfinite(out[1:3]).any(), out[1:3]
    assert torch.equal(out[3:], clean[3:])


@pytest.mark.parametrize("op_name", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("qtype", gb.TYPES)
def test_non_finite_activations_propagate(device, op_name, qtype):
    W, x = weight(qtype).to(device), poisoned().to(device)
    out = getattr(ops, op_name)(W, x, gb.type_id(qtype), ROWS)
    clean = getattr(ops, op_name)(W, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), gb.type_id(qtype), ROWS)
    check_poisoned_rows(out.cpu(), clean.cpu())


@pytest.mark.parametrize("qtype", REPACKED)
def test_non_finite_activations_propagate_repacked(cpu_isa, qtype):
    t = gb.type_id(qtype)
    W = ops.ggml_repack(weight(qtype, rows=32), t, 32, N)
    x = poisoned()
    for rows_x in (x[:1], x):  # the matvec and the batched kernels
        out = ops.ggml_mul_mat_repacked(W, rows_x, t, 32)
        assert torch.isnan(out[0]).all()
    out = ops.ggml_mul_mat_repacked(W, x, t, 32)
    clean = ops.ggml_mul_mat_repacked(W, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), t, 32)
    check_poisoned_rows(out, clean)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "IQ4_XS", "F16"])
def test_non_finite_activations_propagate_through_experts(device, qtype):
    t = gb.type_id(qtype)
    W = torch.stack([weight(qtype), weight(qtype)]).to(device)
    ids = torch.tensor([[0, 1]] * M, dtype=torch.int32, device=device)
    x = poisoned().to(device)
    out = ops.ggml_mul_mat_id(W, x, ids, t, ROWS).cpu()
    clean = ops.ggml_mul_mat_id(W, torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), ids, t, ROWS).cpu()
    check_poisoned_rows(out, clean)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_non_finite_activations_propagate_gptq(device, bits, dtype):
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, N, 64, bits, 32, False, "gptq_v2", False)
    q, z, s, g = (torch.from_numpy(np.ascontiguousarray(ckpt[k])).to(device) for k in ("qweight", "qzeros", "scales", "g_idx"))
    x = poisoned(dtype).to(device)
    out = ops.gptq_gemm(x, q, z, s.to(dtype), g, False, True, bits).cpu()
    clean = ops.gptq_gemm(torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0), q, z, s.to(dtype), g, False, True,
                          bits).cpu()
    check_poisoned_rows(out, clean)


@pytest.mark.parametrize("op_name, qtype", [
    (op_name, qtype) for op_name in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_mul_mat_repacked")
    for qtype in ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ2_XXS", "F32")
    if op_name != "ggml_mul_mat_repacked" or qtype in REPACKED])  # the types with a repacked layout
def test_zero_width_activations_give_zeros(op_name, qtype):
    """X [M, 0] @ W[row, 0].T is an empty sum: zeros [M, row]. Run in a child
    process, so that a crash (a division by the width) fails the test
    instead of the run."""
    code = (
        "import torch, lowbit\n"
        f"for isa in ('portable', torch.ops.lowbit.cpu_isa('best')):\n"
        "    torch.ops.lowbit.cpu_isa(isa)\n"
        "    for m in (0, 1, 5, 40):\n"
        f"        out = torch.ops.lowbit.{op_name}(torch.empty(4, 0, dtype=torch.uint8), torch.randn(m, 0), {gb.type_id(qtype)}, 4)\n"
        "        assert out.shape == (m, 4) and not out.any(), out\n"
        "print('ok')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


def test_zero_width_experts_give_zeros():
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    out = ops.ggml_mul_mat_id(torch.empty(2, 4, 0, dtype=torch.uint8), torch.randn(1, 0), ids, gb.type_id("Q4_0"), 4)
    assert out.shape == (1, 2, 4) and not out.any()


@pytest.mark.parametrize("quantize", [
    ("GPTQLinear.from_linear", lambda linear: lowbit.GPTQLinear.from_linear(linear, 4, 32)),
    ("GGUFLinear.from_linear", lambda linear: lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q8_0"))),
], ids=lambda q: q[0])
def test_from_linear_refuses_what_is_not_a_linear(quantize):
    """Anything but an nn.Linear lacks the [out, in] weight the quantizers
    read: a bare AttributeError, or a convolution's weight in another layout."""
    who, call = quantize
    for bad in (None, torch.randn(8, 64), torch.nn.Conv1d(64, 8, 1)):
        with pytest.raises(TypeError, match=f"^{re.escape(who)}: linear must be an nn.Linear, got {type(bad).__name__}$"):
            call(bad)
    assert call(torch.nn.Linear(64, 8)).out_features == 8


def _flag_calls():
    """(function, argument, call(value)) for each public on/off argument; each
    call gets past every earlier argument's check (a path that is never read)."""
    w, linear = torch.randn(8, 64), torch.nn.Linear(64, 8)
    qt = lowbit.quantize_rtn(w, 4, 32)
    gptq = lowbit.gptq
    from lowbit.gptq.algorithm import gptq_weight, quantize_linear
    return [
        ("quantize_rtn", "sym", lambda v: lowbit.quantize_rtn(w, 4, 32, sym=v)),
        ("GPTQLinear", "sym", lambda v: lowbit.GPTQLinear(64, 8, 4, 32, sym=v)),
        ("GPTQLinear", "desc_act", lambda v: lowbit.GPTQLinear(64, 8, 4, 32, desc_act=v)),
        ("GPTQLinear", "bias", lambda v: lowbit.GPTQLinear(64, 8, 4, 32, bias=v)),
        ("GPTQLinear.from_linear", "sym", lambda v: lowbit.GPTQLinear.from_linear(linear, 4, 32, sym=v)),
        ("GPTQLinear.from_tensors", "sym",
         lambda v: lowbit.GPTQLinear.from_tensors(qt.qweight, qt.qzeros, qt.scales, qt.g_idx, None, 4, 32, sym=v)),
        ("GPTQLinear.from_tensors", "desc_act",
         lambda v: lowbit.GPTQLinear.from_tensors(qt.qweight, qt.qzeros, qt.scales, qt.g_idx, None, 4, 32, desc_act=v)),
        ("GPTQLinear", "int8_activations", lambda v: setattr(lowbit.GPTQLinear(64, 8, 4, 32), "int8_activations", v)),
        ("GGUFLinear", "bias", lambda v: lowbit.GGUFLinear(64, 8, gb.type_id("Q8_0"), bias=v)),
        ("load_gguf_model", "repack", lambda v: lowbit.load_gguf_model("/nonexistent.gguf", repack=v)),
        ("load_gguf_model", "fuse", lambda v: lowbit.load_gguf_model("/nonexistent.gguf", fuse=v)),
        ("load_gguf_model", "check_tensors", lambda v: lowbit.load_gguf_model("/nonexistent.gguf", check_tensors=v)),
        ("load_gptq_model", "fuse", lambda v: lowbit.load_gptq_model("/nonexistent", fuse=v)),
        ("load_gptq_model", "int8_activations", lambda v: lowbit.load_gptq_model("/nonexistent", int8_activations=v)),
        ("load_gptq_model", "repack", lambda v: lowbit.load_gptq_model("/nonexistent", repack=v)),
        ("gptq_weight", "sym", lambda v: gptq_weight(w, torch.eye(64), 4, 32, sym=v)),
        ("gptq_weight", "desc_act", lambda v: gptq_weight(w, torch.eye(64), 4, 32, desc_act=v)),
        ("quantize_linear", "sym", lambda v: quantize_linear(linear, torch.eye(64), 4, 32, sym=v)),
        ("quantize_linear", "desc_act", lambda v: quantize_linear(linear, torch.eye(64), 4, 32, desc_act=v)),
        ("quantize", "sym", lambda v: gptq.quantize(torch.nn.Module(), [], 4, sym=v)),
        ("quantize", "desc_act", lambda v: gptq.quantize(torch.nn.Module(), [], 4, desc_act=v)),
        ("quantize", "lm_head", lambda v: gptq.quantize(torch.nn.Module(), [], 4, lm_head=v)),
        ("quantize", "progress", lambda v: gptq.quantize(torch.nn.Module(), [], 4, progress=v)),
    ]


@pytest.mark.parametrize("case", _flag_calls(), ids=lambda c: f"{c[0]}-{c[1]}")
def test_flags_refuse_what_is_not_a_bool(case):
    """An on/off argument read by truthiness does the opposite of "False" or
    "no" and takes None or 0 for False: each is refused, naming the function
    and the argument, before any work."""
    who, name, call = case
    for bad in ("False", "no", None, 0, 1, 1.0, torch.tensor(True)):
        with pytest.raises(ValueError, match=f"^{re.escape(who)}: {name} must be True or False, got "
                                             f"{re.escape(repr(bad))}$"):
            call(bad)


def test_flags_take_numpy_bools():
    """numpy's bools (a mask's elements) are the bools they are."""
    w = torch.randn(8, 64)
    for flag in (False, True):
        assert torch.equal(lowbit.quantize_rtn(w, 4, 32, sym=np.bool_(flag)).qzeros,
                           lowbit.quantize_rtn(w, 4, 32, sym=flag).qzeros)
    assert lowbit.GGUFLinear(64, 8, gb.type_id("Q8_0"), bias=np.False_).bias is None
    layer = lowbit.GPTQLinear(64, 8, 4, 32, sym=np.False_, bias=np.True_)
    assert layer.sym is False and layer.bias is not None
    layer.int8_activations = np.True_
    assert layer.int8_activations is True


def test_quantizers_refuse_weights_without_values():
    """A meta weight (a model built on the meta device) or a fake one has
    shapes only: the quantizers read its values, which failed on .item()
    with an error that named no argument."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from lowbit.gptq.algorithm import gptq_weight

    meta = torch.empty(8, 64, device="meta")
    with pytest.raises(ValueError, match="^quantize_rtn: weight must hold values: a meta tensor has none$"):
        lowbit.quantize_rtn(meta, 4, 32)
    with pytest.raises(ValueError, match="^quantize_rtn: weight must hold values: a meta tensor has none$"):
        lowbit.GPTQLinear.from_linear(torch.nn.Linear(64, 8, device="meta"), 4, 32)
    with pytest.raises(ValueError, match="^gptq_weight: weight must hold values: a meta tensor has none$"):
        gptq_weight(meta, torch.eye(64), 4, 32)
    with pytest.raises(ValueError, match="^gptq_weight: hessian must hold values: a meta tensor has none$"):
        gptq_weight(torch.randn(8, 64), torch.eye(64, device="meta"), 4, 32)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.randn(8, 64))
        with pytest.raises(ValueError,
                           match="^quantize_rtn: weight must hold values: a fake or traced tensor has none$"):
            lowbit.quantize_rtn(fake, 4, 32)
