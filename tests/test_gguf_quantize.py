"""ggml_quantize against gguf-py's quantizer (llama.cpp's quantize_row_q8_0_ref
written in NumPy) and, for Q6_K, llama.cpp's own quantize_row_q6_K_ref
(tests/llama_cpp_peer.py): the same bytes for every input, including ties at
half a step, all-zero and subnormal blocks, and fp16 / bf16 inputs; its
blocks decode back through ggml_dequantize within half a step; opcheck and
torch.compile; NaN / Inf and the types it does not write are refused."""
import numpy as np
import pytest
import torch

import llama_cpp_peer

ops = torch.ops.lowbit
Q8_0, Q6_K = 8, 14


def gguf_py_q8_0(x: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType as QT
    from gguf import quants as gq

    return gq.quantize(x.astype(np.float32), QT.Q8_0)


def awkward_rows(rng, rows=16, n=256):
    """Normal values, then blocks built to hit the rounding's corners: exact
    ties at half a step (x = (k + 0.5) * d), a block of zeros, a block of
    subnormals, a block of one nonzero value, and magnitudes near the top of
    Q8_0's range (fp16 d = amax / 127)."""
    x = rng.standard_normal((rows, n)).astype(np.float32) * rng.uniform(1e-3, 1e3, (rows, 1)).astype(np.float32)
    x[1, :32] = np.arange(32) - 15.5  # d = 1 below: x / d lands on every tie between -15.5 and 14.5 ...
    x[1, 0] = 127.0  # ... (half away from zero: -16 and 15, not -16 and 14 as ties to even would)
    x[1, 32:64] = np.float32(127.0) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[2, :32] = 0.0
    x[3, :32] = np.float32(1e-40) * np.arange(32, dtype=np.float32)  # 1 / d overflows: q = 0
    # d rounds to 0 in fp16 but 1 / d does not overflow: q is still round(x / d).
    for block, amax in enumerate((1e-36, 1e-30, 1e-20, 1e-10, 4e-6)):
        x[3, 32 * (block + 1):32 * (block + 2)] = np.float32(amax) * np.linspace(-1, 1, 32, dtype=np.float32)
    x[4, 32:64] = 0.0
    x[4, 40] = -3.0
    x[5, :32] = np.float32(65504 * 127) * np.sign(rng.standard_normal(32)).astype(np.float32)
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q8_0_blocks_are_gguf_py_s_bytes(cpu_isa, seed):
    x = awkward_rows(np.random.default_rng(seed))
    got = ops.ggml_quantize(torch.from_numpy(x), Q8_0)
    assert got.dtype == torch.uint8 and got.shape == (16, 256 // 32 * 34)
    assert np.array_equal(got.numpy(), gguf_py_q8_0(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_quantize_their_float32_values(cpu_isa, dtype):
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(3)).to(dtype)
    assert torch.equal(ops.ggml_quantize(x, Q8_0), ops.ggml_quantize(x.float(), Q8_0))
    assert np.array_equal(ops.ggml_quantize(x, Q8_0).numpy(), gguf_py_q8_0(x.float().numpy()))


def test_blocks_decode_within_half_a_step():
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(4)) * 5
    back = ops.ggml_dequantize(ops.ggml_quantize(x, Q8_0), Q8_0, 12, 512, torch.float32)
    step = x.reshape(12, -1, 32).abs().amax(-1, keepdim=True) / 127
    err = (back - x).reshape(12, -1, 32).abs()
    # half a step, plus d's fp16 rounding (2^-11 of d per unit of |q| <= 127)
    assert torch.all(err <= step * (0.5 + 127 * 2.0**-11) + 1e-6)


def test_empty_inputs_give_empty_blocks():
    assert ops.ggml_quantize(torch.zeros(0, 64), Q8_0).shape == (0, 68)
    assert ops.ggml_quantize(torch.zeros(3, 0), Q8_0).shape == (3, 0)


def test_opcheck_and_compile():
    x = torch.randn(6, 96)
    torch.library.opcheck(ops.ggml_quantize, (x, Q8_0))
    torch.library.opcheck(ops.ggml_quantize, (x.half(), Q8_0))
    torch.library.opcheck(ops.ggml_quantize, (torch.randn(3, 512), Q6_K))

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x):
        return ops.ggml_quantize(x * 2, Q8_0)

    for rows in (1, 7):
        y = torch.randn(rows, 64)
        assert torch.equal(f(y), ops.ggml_quantize(y * 2, Q8_0))


def test_refuses_to_be_differentiated():
    x = torch.randn(2, 32, requires_grad=True)
    with pytest.raises(RuntimeError, match="ggml_quantize: not differentiable with respect to x"):
        ops.ggml_quantize(x, Q8_0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_values_raise_naming_where(cpu_isa, bad):
    x = torch.randn(4, 64)
    x[2, 37] = bad
    with pytest.raises(ValueError, match=r"ggml_quantize: x holds a non-finite value \(.*\) at \[2, 37\]"):
        ops.ggml_quantize(x, Q8_0)


def test_values_beyond_the_fp16_scale_raise():
    x = torch.randn(3, 96)
    x[1, 70] = 1e7  # d = 1e7 / 127 overflows fp16
    with pytest.raises(ValueError, match=r"ggml_quantize: x's block \[1, 64:96\] reaches magnitude 1e\+07, beyond"):
        ops.ggml_quantize(x, Q8_0)


@pytest.mark.skipif(llama_cpp_peer.available() is not None, reason=str(llama_cpp_peer.available()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q6_k_blocks_are_llama_cpp_s_bytes(seed):
    """awkward_rows, heavy tails, sparse and one-hot rows, and magnitudes from
    1e-20 to 1e6: every byte as llama.cpp's reference quantizer writes it, and
    ggml_dequantize reads them as ggml's dequantize_row_q6_K does."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([
        awkward_rows(rng, 8, 512)[:, :512] / np.float32(65504),  # Q8_0's top magnitudes overflow Q6_K's d
        rng.standard_t(2, (8, 512)).astype(np.float32),
        (rng.standard_normal((8, 512)) * (rng.random((8, 512)) < 0.05)).astype(np.float32),
        np.eye(8, 512, dtype=np.float32) * -3,
        rng.standard_normal((8, 512)).astype(np.float32) * np.logspace(-20, 6, 8, dtype=np.float32)[:, None],
    ])
    got = ops.ggml_quantize(torch.from_numpy(x), Q6_K)
    assert got.dtype == torch.uint8 and got.shape == (40, 512 // 256 * 210)
    assert np.array_equal(got.numpy(), llama_cpp_peer.quantize(x, Q6_K))
    back = ops.ggml_dequantize(got, Q6_K, 40, 512, torch.float32).numpy()
    assert np.array_equal(back, llama_cpp_peer.dequantize(got.numpy(), Q6_K))


def test_q6_k_blocks_decode_close_to_their_values():
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(5)) * 5
    back = ops.ggml_dequantize(ops.ggml_quantize(x, Q6_K), Q6_K, 12, 512, torch.float32)
    # 6-bit levels over each 16 values' range: within a step of amax / 31 (the
    # int8 sub-block scales and fp16 d add a little to half a step)
    step = x.reshape(12, -1, 16).abs().amax(-1, keepdim=True) / 31
    assert torch.all((back - x).reshape(12, -1, 16).abs() <= step)
    assert torch.equal(ops.ggml_quantize(x.to(torch.bfloat16), Q6_K), ops.ggml_quantize(x.to(torch.bfloat16).float(), Q6_K))


def test_q6_k_refuses_non_finite_values_and_partial_blocks():
    x = torch.randn(2, 512)
    x[1, 300] = float("nan")
    with pytest.raises(ValueError, match=r"ggml_quantize: x holds a non-finite value \(nan\) at \[1, 300\]"):
        ops.ggml_quantize(x, Q6_K)
    x[1, 300] = 3e9  # d = amax / 4096 or so: beyond fp16
    with pytest.raises(ValueError, match=r"x's block \[1, 256:512\] reaches magnitude 3e\+09, beyond Q6_K's range"):
        ops.ggml_quantize(x, Q6_K)
    # Past ~1.8e19 the scale search's weights x^2 overflow: every such block is refused, not written as zeros.
    x[1, 300] = 0.0
    for value in (1e20, 3e38):
        x[1, 288:304] = value  # one sub-block of 16 values
        with pytest.raises(ValueError, match=r"x's block \[1, 256:512\] reaches magnitude .*, beyond Q6_K's range"):
            ops.ggml_quantize(x, Q6_K)
        with pytest.raises(ValueError, match=r"beyond Q6_K's range"):
            ops.ggml_quantize(torch.full((1, 256), value), Q6_K)
    with pytest.raises(ValueError, match=r"x's rows \(n=384\) are not a multiple of the Q6_K block size 256"):
        ops.ggml_quantize(torch.randn(2, 384), Q6_K)


@pytest.mark.parametrize("type_id, message", [(2, r"type 2 \(Q4_0\): lowbit writes Q8_0 \(8\) and Q6_K \(14\) only"),
                                              (99, "type 99 is not a ggml weight type")])
def test_types_it_does_not_write_raise(type_id, message):
    for call in (lambda: ops.ggml_quantize(torch.randn(2, 64), type_id),
                 lambda: torch.compile(lambda x: ops.ggml_quantize(x, type_id), fullgraph=True,
                                       backend="eager")(torch.randn(2, 64))):
        with pytest.raises((ValueError, torch._dynamo.exc.TorchRuntimeError), match=message):
            call()
