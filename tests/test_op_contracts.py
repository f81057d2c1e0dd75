"""Every op passes torch.library.opcheck (schema, fake kernel, AOT dispatch)
and gptq_gemm works inside torch.compile(fullgraph=True)."""
import numpy as np
import pytest
import torch

import gptq_reference as ref

K, N = 256, 64


def checkpoint(bits, act_order=True):
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", act_order)
    return [torch.from_numpy(np.ascontiguousarray(ckpt[k])) for k in ("qweight", "qzeros", "scales", "g_idx")]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_opcheck_gptq_ops(bits):
    qweight, qzeros, scales, g_idx = checkpoint(bits)
    perm = torch.argsort(g_idx, stable=True).to(torch.int32)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for M in (1, 33):
            a = torch.randn(M, K, dtype=dtype)
            torch.library.opcheck(torch.ops.lowbit.gptq_gemm, (a, qweight, qzeros, scales, g_idx, False, True, bits))
    torch.library.opcheck(torch.ops.lowbit.gptq_dequantize, (qweight, qzeros, scales, g_idx, False, bits))
    torch.library.opcheck(torch.ops.lowbit.gptq_shuffle, (qweight.clone(), perm, bits))
    shuffled = qweight.clone()
    torch.ops.lowbit.gptq_shuffle(shuffled, perm, bits)
    a = torch.randn(2, 3, K)
    torch.library.opcheck(torch.ops.lowbit.gptq_gemm, (a, shuffled, qzeros, scales, perm, True, False, bits))
    values = torch.randint(0, 2**bits, (64, 96), dtype=torch.int32)
    torch.library.opcheck(torch.ops.lowbit.gptq_pack, (values, bits, 0))
    torch.library.opcheck(torch.ops.lowbit.gptq_pack, (values, bits, 1))
    torch.library.opcheck(torch.ops.lowbit.gptq_unpack, (qweight, bits, 0))
    torch.library.opcheck(torch.ops.lowbit.gptq_unpack, (qzeros, bits, 1))


def test_gptq_gemm_under_torch_compile_fullgraph():
    qweight, qzeros, scales, g_idx = checkpoint(4)

    @torch.compile(fullgraph=True, dynamic=True)
    def layer(x):
        y = torch.ops.lowbit.gptq_gemm(x, qweight, qzeros, scales, g_idx, False, True, 4)
        return torch.nn.functional.silu(y) * 2.0

    for M in (1, 5, 40):
        x = torch.randn(M, K)
        eager = torch.nn.functional.silu(torch.ops.lowbit.gptq_gemm(x, qweight, qzeros, scales, g_idx, False, True, 4)) * 2.0
        torch.testing.assert_close(layer(x), eager)


def test_torch_compile_refuses_a_bad_call_while_tracing():
    """The fake kernels validate as the real ones: a weight one byte short
    fails when torch.compile traces the call, naming the op and argument."""
    W = torch.zeros(8 * 2 * 18 - 1, dtype=torch.uint8)  # 8 rows of 64 Q4_0 weights, one byte short
    compiled = torch.compile(lambda x: torch.ops.lowbit.ggml_mul_mat_a8(W, x, 2, 8), fullgraph=True, backend="eager")
    # Dynamo's error for a failed fake-tensor call, carrying the fake kernel's ValueError.
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError, match="ggml_mul_mat_a8: W has 287 bytes"):
        compiled(torch.randn(3, 64))
