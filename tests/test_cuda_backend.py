"""The CUDA backend: every op against the CPU kernels (the spec) and the
float64 reference, CUDA-graph capture, the current stream, devices, and
validation that matches the CPU's.

Skips (with conftest's reason) without a GPU or without a CUDA build of
lowbit. Needs neither gguf nor transformers: GGUF blocks are random bytes with
finite scale fields, decoded by lowbit's CPU kernels as the reference.

Not tested here on purpose: out-of-range g_idx / q_perm *values* given to
gptq_gemm on CUDA. Checking them on the host would need a device sync in
every call (no CUDA graphs, no CPU/GPU overlap), so the kernels assert on
them instead (a device-side assert, which ends the CUDA context, as torch's
own index kernels do). The offline ops (gptq_dequantize, gptq_shuffle,
gptq_permute_*, gptq_pack) check values on a host copy and raise exactly the
CPU's errors; those are tested below.
"""
import numpy as np
import pytest
import torch

import gptq_reference as ref
import lowbit

ops = torch.ops.lowbit
CUDA_OK = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm", "CUDA")
pytestmark = pytest.mark.skipif(not CUDA_OK, reason="CUDA cases need a GPU and a CUDA build of lowbit")

BITS = (2, 3, 4, 8)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SUBNORMAL = {torch.float32: 0.0, torch.float16: 2.0**-24, torch.bfloat16: 0.0}
I32 = torch.int32


def cuda(t):
    return t.to("cuda")


def gptq_tensors(ckpt, device):
    keys = ("qweight", "qzeros", "scales", "g_idx")
    return {k: torch.from_numpy(np.ascontiguousarray(ckpt[k])).to(device) for k in keys}


class GemmReference:
    """float64 a @ W and tests/test_gptq_gemm.py's tolerance for it: fp32
    accumulation (1e-5 of |a| @ |W|) plus one rounding to the output dtype."""

    def __init__(self, a, W):
        a64 = a.double().cpu().numpy()
        self.expect = a64 @ W
        self.bound = np.abs(a64) @ np.abs(W)
        self.dtype = a.dtype

    def tol(self):
        return 1e-5 * self.bound + OUT_ROUNDING[self.dtype] * np.abs(self.expect) + SUBNORMAL[self.dtype]

    def check(self, out, what):
        tol = self.tol()
        err = np.abs(out.double().cpu().numpy() - self.expect)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), f"{what}: error {err[worst]:.3g} > tol {tol[worst]:.3g} at {worst}"


def assert_gemm_close(out, a, W, what):
    GemmReference(a, W).check(out, what)


# ---------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------

# K = 1536: three 512-row chunks (split-K over chunks); N = 160: a full and a
# partial 128-column tile. M covers every fused row-tile size (1, 2, 4, 8),
# several M-chunks, the tensor-core kernel's one, two and four m16 tiles
# (fp16 / bf16 activations up to M = 64; 40: a partial third tile), and the
# dequantize + cuBLAS paths (the default crossover is M = 32, or 16 for
# 2/3/4-bit with fp16 / bf16 activations).
GEMM_K, GEMM_N = 1536, 160
GEMM_MS = (1, 2, 3, 5, 8, 9, 17, 40, 64, 65, 130)


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "actorder"])
@pytest.mark.parametrize("group_size", [16, 128, -1])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", BITS)
def test_gptq_gemm_matches_reference_and_cpu(bits, fmt, group_size, act_order):
    rng = np.random.default_rng([bits, group_size % 1000, act_order, fmt == "gptq"])
    ckpt = ref.random_checkpoint(rng, GEMM_K, GEMM_N, bits, group_size, False, fmt, act_order)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, fmt)
    c, g = gptq_tensors(ckpt, "cpu"), gptq_tensors(ckpt, "cuda")
    v2 = fmt == "gptq_v2"
    perm = torch.argsort(c["g_idx"], stable=True).to(I32) if act_order else torch.empty(0, dtype=I32)
    shuffled_c = c["qweight"].clone()
    ops.gptq_shuffle(shuffled_c, perm, bits)
    shuffled_g = g["qweight"].clone()
    ops.gptq_shuffle(shuffled_g, cuda(perm), bits)
    assert torch.equal(shuffled_g.cpu(), shuffled_c)
    for M in GEMM_MS:
        for dtype in DTYPES:
            a = torch.randn(M, GEMM_K, generator=torch.Generator().manual_seed(M)).to(dtype)
            reference = GemmReference(a, W)
            for name, args_c, args_g in (
                ("unshuffled", (c["qweight"], c["g_idx"], False), (g["qweight"], g["g_idx"], False)),
                ("shuffled", (shuffled_c, perm, True), (shuffled_g, cuda(perm), True)),
            ):
                out = ops.gptq_gemm(cuda(a), args_g[0], g["qzeros"], g["scales"], args_g[1], args_g[2], v2, bits)
                assert out.dtype == dtype and out.shape == (M, GEMM_N) and out.is_cuda
                reference.check(out, f"cuda {name} M={M} {dtype}")
                again = ops.gptq_gemm(cuda(a), args_g[0], g["qzeros"], g["scales"], args_g[1], args_g[2], v2, bits)
                assert torch.equal(out, again), "the CUDA kernels must be deterministic (no atomics)"
                on_cpu = ops.gptq_gemm(a, args_c[0], c["qzeros"], c["scales"], args_c[1], args_c[2], v2, bits)
                err = np.abs(out.double().cpu().numpy() - on_cpu.double().numpy())
                assert np.all(err <= 2 * reference.tol()), f"cuda vs cpu {name} M={M} {dtype}"


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("K, N, M", [(8192, 128, 1), (8192, 256, 3), (384, 4096, 8), (512, 16384, 64)])
def test_gptq_gemm_split_k_and_wide_shapes(bits, K, N, M):
    """Deep split-K (one column tile, 16 chunks), no split (one chunk), many tiles."""
    rng = np.random.default_rng([bits, K, N])
    ckpt = ref.random_checkpoint(rng, K, N, bits, 128, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq_v2")
    g = gptq_tensors(ckpt, "cuda")
    a = torch.randn(M, K, generator=torch.Generator().manual_seed(K), dtype=torch.float16)
    none = torch.empty(0, dtype=I32, device="cuda")
    out = ops.gptq_gemm(cuda(a), g["qweight"], g["qzeros"], g["scales"], none, False, True, bits)
    a64 = a.double().numpy()
    err = np.abs(out.double().cpu().numpy() - a64 @ W)
    # K terms in fp32 (the bound grows with K, see test_gptq_gemm.py) + fp16 output rounding.
    tol = 1e-5 * max(1.0, K / 1024) * (np.abs(a64) @ np.abs(W)) + 2.0**-11 * np.abs(a64 @ W) + 2.0**-24
    assert np.all(err <= tol)


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "actorder"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_gptq_gemm_large_m_half_activations_keep_fp32_weights(bits, dtype, act_order):
    """Above the fused kernel's M, fp16 / bf16 activations multiply W as two
    terms of their dtype (csrc/cuda/gptq_cuda.cuh): the result is the fp32
    sum over the fp32 weights rounded once, so it is the CPU's bit for bit but
    where the two fp32 sums straddle a rounding boundary (a few in a
    thousand), while W rounded to the activations' dtype changes 20-40% of the
    outputs. Scales spanning 2^-12 .. 2^3 across groups (fp16 subnormals
    among them) exercise each column's exponent."""
    rng = np.random.default_rng([bits, act_order, 11])
    K, N, M = 1536, 160, 100
    ckpt = ref.random_checkpoint(rng, K, N, bits, 128, False, "gptq", act_order)
    ckpt["scales"] = (ckpt["scales"] * np.exp2(rng.integers(-12, 4, size=ckpt["scales"].shape))).astype(np.float16)
    c, g = gptq_tensors(ckpt, "cpu"), gptq_tensors(ckpt, "cuda")
    perm = torch.argsort(c["g_idx"], stable=True).to(I32) if act_order else torch.empty(0, dtype=I32)
    ops.gptq_shuffle(g["qweight"], cuda(perm), bits)
    a = torch.randn(M, K, generator=torch.Generator().manual_seed(bits)).to(dtype)
    out = ops.gptq_gemm(cuda(a), g["qweight"], g["qzeros"], g["scales"], cuda(perm), True, False, bits).cpu()
    on_cpu = ops.gptq_gemm(a, c["qweight"], c["qzeros"], c["scales"], c["g_idx"], False, False, bits)
    assert torch.isfinite(out).all()
    differ = (out != on_cpu).float().mean().item()
    assert differ < 0.02, f"{differ:.1%} of the outputs differ from the CPU's"
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    assert_gemm_close(out, a, W, f"{bits}-bit {dtype}")


@pytest.mark.parametrize("bits, dtype, M, kernel", [
    (4, torch.float16, 1, "gptq_mma_kernel"), (2, torch.bfloat16, 16, "gptq_mma_kernel"),
    (8, torch.float16, 64, "gptq_mma_kernel"), (3, torch.float16, 16, "gptq_gemv_kernel"),
    (4, torch.float32, 16, "gptq_gemv_kernel"), (4, torch.float16, 65, "gptq_dequantize_kernel"),
])
def test_gptq_gemm_kernel_choice(bits, dtype, M, kernel):
    """fp16 / bf16 activations up to M = 64 run the tensor-core kernel (2/4/8-bit)
    on sm_80 and newer, 3-bit and fp32 activations (and every small M before
    sm_80, which has no mma.sync for them) the CUDA-core one, M = 65 the two-term
    tiles: a kernel that stopped serving would pass every result test through
    another path."""
    from torch.profiler import ProfilerActivity, profile

    if kernel == "gptq_mma_kernel" and torch.cuda.get_device_capability()[0] < 8:
        kernel = "gptq_gemv_kernel"
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, 512, 128, bits, 128, False, "gptq", False)
    g = gptq_tensors(ckpt, "cuda")
    a = torch.randn(M, 512, device="cuda", dtype=dtype)
    none = torch.empty(0, dtype=I32, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ops.gptq_gemm(a, g["qweight"], g["qzeros"], g["scales"], none, True, False, bits)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any(kernel in n for n in names), names
    if kernel != "gptq_mma_kernel":
        assert not any("gptq_mma_kernel" in n for n in names), names


@pytest.mark.parametrize("value", ["abc", "-1", "16x", "99999999999999999999"])
def test_crossover_override_that_is_not_a_count_raises(value):
    """LOWBIT_CUDA_GPTQ_MMA_MAX_M (a benchmark's override of a crossover) that
    is not a whole number >= 0 raises naming the variable, where reading it as
    0 would quietly send every M down one path."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, lowbit\n"
        "w = torch.zeros(64, 128, dtype=torch.int32, device='cuda')\n"
        "z = torch.zeros(4, 16, dtype=torch.int32, device='cuda')\n"
        "s = torch.ones(4, 128, dtype=torch.float16, device='cuda')\n"
        "a = torch.randn(1, 512, dtype=torch.float16, device='cuda')\n"
        "none = torch.empty(0, dtype=torch.int32, device='cuda')\n"
        "try:\n"
        "    torch.ops.lowbit.gptq_gemm(a, w, z, s, none, True, False, 4)\n"
        "except ValueError as e:\n"
        "    print('ValueError:', e)\n"
    )
    env = dict(os.environ, LOWBIT_CUDA_GPTQ_MMA_MAX_M=value)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "ValueError: LOWBIT_CUDA_GPTQ_MMA_MAX_M must be a whole number >= 0" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits", BITS)
def test_gptq_gemm_infinite_activations_as_on_the_cpu(bits, dtype):
    """An infinite activation in an act-order layer whose groups interleave
    (unshuffled g_idx): each row's product joins only its own group's sum, so
    the other groups' passes add no 0 * inf. NaN and +-inf where the CPU has
    them, the finite row as close as ever."""
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, 512, 160, bits, 32, False, "gptq", True)
    c, g = gptq_tensors(ckpt, "cpu"), gptq_tensors(ckpt, "cuda")
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    a = torch.randn(3, 512, generator=torch.Generator().manual_seed(bits)).to(dtype)
    a[0, 5], a[1, 17] = float("inf"), float("-inf")
    want = ops.gptq_gemm(a, c["qweight"], c["qzeros"], c["scales"], c["g_idx"], False, False, bits)
    got = ops.gptq_gemm(cuda(a), g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, False, bits).cpu()
    assert want[:2].isinf().any() and want[2].isfinite().all()
    for name, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(got), test(want)), f"{name} positions differ from the CPU's"
    assert_gemm_close(got[2:], a[2:], W, f"finite row, {bits}-bit {dtype}")


def test_gptq_gemm_large_m_over_two_column_tiles():
    """A weight of more than 2^26 values outgrows one 256 MiB column tile of
    the large-M paths, so both (fp32, and the two fp16 terms) run two tiles,
    the second one narrow (16384 + 256 columns)."""
    K, N, M, bits = 4096, 16640, 40, 4
    gen = torch.Generator().manual_seed(5)
    # Any packed words are a valid weight: random ones, drawn fast at this size.
    c = {"qweight": torch.randint(-(2**31), 2**31, (K * bits // 32, N), generator=gen).to(I32),
         "qzeros": torch.randint(-(2**31), 2**31, (K // 128, N * bits // 32), generator=gen).to(I32),
         "scales": (torch.rand(K // 128, N, generator=gen) / 16 + 1e-3).half()}
    g = {k: cuda(v) for k, v in c.items()}
    none = torch.empty(0, dtype=I32)
    a = torch.randn(M, K, generator=gen)
    for dtype in (torch.float32, torch.float16):
        x = a.to(dtype)
        got = ops.gptq_gemm(cuda(x), g["qweight"], g["qzeros"], g["scales"], cuda(none), False, True, bits).cpu()
        want = ops.gptq_gemm(x, c["qweight"], c["qzeros"], c["scales"], none, False, True, bits)
        # A wrong tile is off by the outputs' size; one fp16 rounding step is under 2^-10 of it.
        worst = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
        assert worst < 2e-3, f"{dtype}: largest difference {worst:.2e} of the largest output"
        if dtype == torch.float16:
            assert (got != want).float().mean().item() < 0.02


def test_gptq_gemm_misaligned_weight_and_strided_input():
    """qweight at a 4-byte offset (no 128-bit loads: the op copies it) and a
    non-contiguous a with batch dims."""
    K, N, bits = 256, 64, 4
    rng = np.random.default_rng(5)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, True, "gptq", True)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    g = gptq_tensors(ckpt, "cuda")
    buf = torch.empty(g["qweight"].numel() + 1, dtype=I32, device="cuda")
    qweight = buf[1:].view_as(g["qweight"])
    qweight.copy_(g["qweight"])
    assert qweight.data_ptr() % 16 != 0
    a = torch.randn(K, 2, 3, device="cuda").permute(1, 2, 0)
    out = ops.gptq_gemm(a, qweight, g["qzeros"], g["scales"], g["g_idx"], False, False, bits)
    assert out.shape == (2, 3, N)
    assert_gemm_close(out.reshape(6, N), a.reshape(6, K), W, "misaligned")
    empty = ops.gptq_gemm(a[:0], qweight, g["qzeros"], g["scales"], g["g_idx"], False, False, bits)
    assert empty.shape == (0, 3, N)


def test_gptq_gemm_refuses_the_cpu_panel_layout():
    """The panel layout is the CPU kernels': a 3-D qweight on CUDA is refused
    by the op and by its fake alike, and a repacked GPTQLinear moved to CUDA
    goes back to the checkpoint's layout."""
    from lowbit.gptq.packing import to_panels

    rng = np.random.default_rng(6)
    ckpt = ref.random_checkpoint(rng, 256, 128, 4, 64, True, "gptq", False)
    g = gptq_tensors(ckpt, "cuda")
    args = (to_panels(g["qweight"]), g["qzeros"], g["scales"], g["g_idx"], False, False, 4)
    a = torch.randn(2, 256, device="cuda")
    with pytest.raises(ValueError, match="gptq_gemm: b_q_weight must be 2-D"):
        ops.gptq_gemm(a, *args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in (a, *args)]
        with pytest.raises(ValueError, match="b_q_weight must be 2-D"):
            ops.gptq_gemm(*fake)
    layer = lowbit.GPTQLinear.from_linear(torch.nn.Linear(256, 128, bias=False), 4, 64).repack()
    assert layer.repacked
    layer.cuda()
    assert not layer.repacked and layer.qweight.shape == (32, 128)
    x = torch.randn(3, 256)
    W = layer.dequantize(torch.float32).t().double().cpu().numpy()
    assert_gemm_close(layer(x.cuda()), x, W, "moved from the panel layout")


@pytest.mark.parametrize("scale_dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", BITS)
def test_gptq_dequantize_bit_exact_with_cpu(bits, fmt, scale_dtype):
    rng = np.random.default_rng([bits, fmt == "gptq"])
    ckpt = ref.random_checkpoint(rng, 384, 96, bits, 64, False, fmt, True)
    c = gptq_tensors(ckpt, "cpu")
    c["scales"] = c["scales"].to(scale_dtype)
    g = {k: cuda(v) for k, v in c.items()}
    v2 = fmt == "gptq_v2"
    for g_idx_c, g_idx_g in ((c["g_idx"], g["g_idx"]), (c["g_idx"].long(), g["g_idx"].long())):
        got = ops.gptq_dequantize(g["qweight"], g["qzeros"], g["scales"], g_idx_g, v2, bits)
        expect = ops.gptq_dequantize(c["qweight"], c["qzeros"], c["scales"], g_idx_c, v2, bits)
        assert got.dtype == scale_dtype and torch.equal(got.cpu(), expect)
    none = torch.empty(0, dtype=I32)
    got = ops.gptq_dequantize(g["qweight"], g["qzeros"], g["scales"], cuda(none), v2, bits)
    assert torch.equal(got.cpu(), ops.gptq_dequantize(c["qweight"], c["qzeros"], c["scales"], none, v2, bits))


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("bits", BITS)
def test_gptq_pack_unpack_bit_exact_with_cpu(bits, dim):
    rng = np.random.default_rng([bits, dim])
    shape = [96, 160]
    shape[1 - dim] = 7
    values = torch.from_numpy(rng.integers(0, 2**bits, size=shape).astype(np.int32))
    packed = ops.gptq_pack(cuda(values), bits, dim)
    assert torch.equal(packed.cpu(), ops.gptq_pack(values, bits, dim))
    words = torch.from_numpy(rng.integers(-(2**31), 2**31, size=packed.shape).astype(np.int32))
    assert torch.equal(ops.gptq_unpack(cuda(words), bits, dim).cpu(), ops.gptq_unpack(words, bits, dim))
    assert torch.equal(ops.gptq_unpack(packed, bits, dim).cpu(), values)


@pytest.mark.parametrize("bits", BITS)
def test_gptq_shuffle_and_permutes_bit_exact_with_cpu(bits):
    rng = np.random.default_rng(bits)
    K, N = 256, 96
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", True)
    c = gptq_tensors(ckpt, "cpu")
    g = {k: cuda(v) for k, v in c.items()}
    perm = torch.from_numpy(rng.permutation(K))
    shuffled = g["qweight"].clone()
    ops.gptq_shuffle(shuffled, cuda(perm), bits)
    expect = c["qweight"].clone()
    ops.gptq_shuffle(expect, perm, bits)
    assert torch.equal(shuffled.cpu(), expect)
    assert torch.equal(ops.gptq_permute_rows(g["qweight"], cuda(perm.int()), bits).cpu(), expect)
    col_perm = torch.from_numpy(rng.permutation(N))
    got = ops.gptq_permute_cols(g["qweight"], g["qzeros"], g["scales"], cuda(col_perm), bits)
    want = ops.gptq_permute_cols(c["qweight"], c["qzeros"], c["scales"], col_perm, bits)
    for x, y in zip(got, want):
        assert x.is_cuda and torch.equal(x.cpu(), y)


# ---------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------

GGML_TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
    "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ2_XXS": 16, "IQ2_XS": 17, "IQ3_XXS": 18, "IQ1_S": 19, "IQ4_NL": 20,
    "IQ3_S": 21, "IQ2_S": 22, "IQ4_XS": 23, "IQ1_M": 29, "BF16": 30, "TQ1_0": 34, "TQ2_0": 35, "MXFP4": 39,
    "NVFP4": 40, "Q1_0": 41, "Q2_0": 42,
}
# Byte offsets of the fp16 scale fields (ggml-common.h), as tests/gguf_blocks.py keeps them.
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ3_XXS": [0], "IQ1_S": [0], "IQ4_NL": [0], "IQ3_S": [0],
    "IQ2_S": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64], "Q1_0": [0], "Q2_0": [0],
}
MIN_FIELD = {"Q4_1": 2, "Q5_1": 2}  # the fp16 m of w = d*q + m, paired with Q8_1's fp16 sum
ACT_BLOCK_32 = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "NVFP4", "Q1_0", "Q2_0"}


def ggml_blocks(name, rows, n, seed=0):
    """uint8 [rows, row_bytes] of finite blocks: random bytes, finite fp16 scales."""
    rng = np.random.default_rng([seed, GGML_TYPES[name]])
    if name in ("F32", "F16", "BF16"):
        x = torch.from_numpy((rng.standard_normal((rows, n)) * 0.2).astype(np.float32))
        x = {"F32": x, "F16": x.half(), "BF16": x.bfloat16()}[name]
        return x.view(torch.uint8).reshape(rows, -1).clone()
    block, nbytes = ops.ggml_type_info(GGML_TYPES[name])
    raw = rng.integers(0, 256, (rows, n // block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, n // block, nbytes)
    for off in HALF_FIELDS.get(name, []):
        # Small scales keep every product finite in fp16 outputs (Q6_K's int8
        # sub-scales times 6-bit levels reach 4000 x d).
        halves = (rng.standard_normal(blocks.shape[:2]) * 0.002).astype(np.float16)
        blocks[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    if name == "IQ1_M":
        blocks[:, :, 55] = (blocks[:, :, 55] & 0x0F) | 0x30  # a moderate fp16 exponent
    if name == "MXFP4":
        blocks[:, :, 0] = rng.integers(118, 130, blocks.shape[:2])  # E8M0 scales near 2^-6
    if name == "NVFP4":
        blocks[:, :, :4] = rng.integers(1, 5, blocks[:, :, :4].shape) << 3  # UE4M3 scales 2^-10 .. 2^-7
    return torch.from_numpy(raw)


@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_ggml_dequantize_bit_exact_with_cpu(name):
    rows, n = 37, 512
    raw = ggml_blocks(name, rows, n)
    t = GGML_TYPES[name]
    for dtype in (None, *DTYPES):
        got = ops.ggml_dequantize(cuda(raw), t, rows, n, dtype)
        expect = ops.ggml_dequantize(raw, t, rows, n, dtype)
        assert got.is_cuda and got.dtype == expect.dtype
        torch.testing.assert_close(got.cpu(), expect, rtol=0, atol=0, equal_nan=True)


def a8_tolerance(name, x, W, raw):
    """|CUDA - CPU| bound: fp32 sums in another order, plus (cuBLAS path,
    Q4_1/Q5_1) Q8_1's exact block sums where the CPU uses the fp16 ones."""
    x64 = x.double().numpy()
    absW = np.abs(W.double().numpy())
    tol = 3e-5 * (np.abs(x64) @ absW.T)
    if name in MIN_FIELD:
        nbytes = ops.ggml_type_info(GGML_TYPES[name])[1]
        blocks = raw.numpy().reshape(raw.shape[0], -1, nbytes)
        off = MIN_FIELD[name]
        mins = np.abs(blocks[:, :, off : off + 2].copy().view(np.float16)[..., 0].astype(np.float64))
        d = np.abs(x64).reshape(x.shape[0], -1, 32).max(axis=2) / 127
        tol += 4.0 * (d @ mins.T)
    return tol


@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_ggml_matmul_matches_cpu(name):
    t = GGML_TYPES[name]
    for rows, n in ((37, 512), (9, 4096)):
        raw = ggml_blocks(name, rows, n, seed=n)
        W = ops.ggml_dequantize(raw, t, rows, n, torch.float32)
        # ggml_mul_mat_a8's large-M path from 9 (from 33 for the sliced types): the int8 tensor-core kernel
        # on sm_80+, whose 64-row activation tiles M = 70 spans two of
        for M in (1, 3, 8, 9, 33, 40, 70):
            x = torch.randn(M, n, generator=torch.Generator().manual_seed(M))
            x[:, :32] *= 20  # an outlier block: activation scales are per block
            for dtype in DTYPES:
                X = x.to(dtype)
                tol = a8_tolerance(name, X.float(), W, raw)
                for op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
                    got = getattr(ops, op)(cuda(raw), cuda(X), t, rows)
                    expect = getattr(ops, op)(raw, X, t, rows)
                    assert got.is_cuda and got.dtype == dtype and got.shape == (M, rows)
                    bound = tol + 2 * OUT_ROUNDING[dtype] * np.abs(expect.double().numpy()) + 1e-30
                    g64, e64 = got.double().cpu().numpy(), expect.double().numpy()
                    err = np.where(g64 == e64, 0.0, np.abs(g64 - e64))  # equal infinities are equal
                    worst = np.unravel_index(np.argmax(err / bound), err.shape)
                    assert np.all(err <= bound), (
                        f"{op} M={M} n={n} {dtype}: |cuda-cpu| {err[worst]:.3g} > {bound[worst]:.3g} at {worst}")


def one_hot_weights(name, n):
    """[n, n] blocks of the identity (row r: one nonzero level at r), so that
    out[m, r] = w[r, r] * d_x * q_x[m, r]: one product per output, which the CPU
    and the GPU round alike, and the activation blocks can be compared bit for bit.
    Q8_0 and Q6_K (Q8_0 and Q8_K activations) from ggml_quantize, Q4_1 (Q8_1
    activations: d 1, min 0, level 1) written here."""
    if name != "Q4_1":
        return ops.ggml_quantize(torch.eye(n), GGML_TYPES[name])
    blocks = np.zeros((n, n // 32, 20), dtype=np.uint8)
    blocks[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    r = np.arange(n)
    e = r % 32
    blocks[r, r // 32, 4 + e % 16] = np.where(e < 16, 0x01, 0x10)
    return torch.from_numpy(blocks.reshape(n, -1))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_1", "Q6_K"])
def test_activation_blocks_bit_exact_with_cpu(name):
    """The activation quantizer (a warp per block on the GPU, a loop per block
    on the CPU) at its edges: steps of 1 with values on halves (roundf away
    from zero, Q8_K's rint to even), an all-zero block, a block holding a NaN,
    and Q8_K blocks whose largest magnitude appears with both signs, in one
    lane and across lanes (the first sets the scale's sign)."""
    n = 1024
    rng = np.random.default_rng(3)
    x = (rng.integers(-126, 126, (2, n)) + rng.choice([0.5, 0.25, 0.0], (2, n))).astype(np.float32)
    x[:, ::256] = -127.0
    x[:, ::32] = np.where(np.arange(n // 32) % 8 == 0, -127.0, 127.0)  # step 1 in every block of 32 and 256
    x[0, 256:288] = 0.0
    x[0, 288:512] = rng.standard_normal(224)
    x[0, 300] = np.nan
    x[1, 256:512] = 0.0  # a whole Q8_K block of zeros
    x[1, 512:768] = rng.standard_normal(256)
    x[1, 515], x[1, 517] = 9.0, -9.0  # equal magnitudes in one lane's eight values
    x[1, 768:] = rng.standard_normal(256)
    x[1, 800], x[1, 1000] = -9.0, 9.0  # ... and in two lanes
    W = one_hot_weights(name, n)
    for op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
        got = getattr(ops, op)(cuda(W), cuda(torch.from_numpy(x)), GGML_TYPES[name], n).cpu()
        expect = getattr(ops, op)(W, torch.from_numpy(x), GGML_TYPES[name], n)
        assert torch.equal(got.isnan(), expect.isnan()), f"{op}: NaNs differ"
        torch.testing.assert_close(got, expect, rtol=0, atol=0, equal_nan=True, msg=op)


def mul_mat_id_case(name, experts, rows, n, tokens, slots, per_slot, ids_dtype, seed=0):
    """W [experts, rows, row_bytes], X [tokens, n] or [tokens, slots, n], ids [tokens, slots] (distinct experts
    per token, as a router's top-k), and each pair's |CUDA - CPU| bound [tokens, slots, rows]."""
    raw = ggml_blocks(name, experts * rows, n, seed=seed)
    W = ops.ggml_dequantize(raw, GGML_TYPES[name], experts * rows, n, torch.float32).view(experts, rows, n)
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:slots] for _ in range(tokens)]).to(ids_dtype)
    x = torch.randn(tokens, *((slots,) if per_slot else ()), n, generator=g)
    rows_x = (x if per_slot else x[:, None].expand(tokens, slots, n)).reshape(-1, n)
    raw = raw.view(experts, rows, -1)
    per_expert = [a8_tolerance(name, rows_x, W[e], raw[e]) for e in range(experts)]  # [pairs, rows] each
    tol = np.stack(per_expert)[ids.reshape(-1).numpy(), np.arange(tokens * slots)].reshape(tokens, slots, rows)
    return raw, x, ids, tol


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "Q4_1", "IQ4_XS", "Q6_K", "F16"])
@pytest.mark.parametrize("per_slot, ids_dtype", [(False, torch.int32), (True, torch.int64)])
def test_ggml_mul_mat_id_matches_cpu(name, per_slot, ids_dtype):
    raw, x, ids, tol = mul_mat_id_case(name, 6, 40, 512, 13, 3, per_slot, ids_dtype)
    for dtype in DTYPES:
        X = x.to(dtype)
        got = ops.ggml_mul_mat_id(cuda(raw), cuda(X), cuda(ids), GGML_TYPES[name], 40)
        expect = ops.ggml_mul_mat_id(raw, X, ids, GGML_TYPES[name], 40)
        assert got.is_cuda and got.dtype == dtype and got.shape == expect.shape == (13, 3, 40)
        g64, e64 = got.double().cpu().numpy(), expect.double().numpy()
        bound = tol + 2 * OUT_ROUNDING[dtype] * np.abs(e64) + 1e-30
        assert np.all(np.where(g64 == e64, 0.0, np.abs(g64 - e64)) <= bound), f"{name} {dtype}"


def test_ggml_mul_mat_id_past_the_grid_s_y_limit():
    """More (token, slot) pairs than a grid's y dimension holds (65535)."""
    raw, x, ids, tol = mul_mat_id_case("Q8_0", 8, 8, 256, 8200, 8, True, torch.int32)
    got = ops.ggml_mul_mat_id(cuda(raw), cuda(x), cuda(ids), GGML_TYPES["Q8_0"], 8).cpu()
    expect = ops.ggml_mul_mat_id(raw, x, ids, GGML_TYPES["Q8_0"], 8)
    err = np.abs(got.double().numpy() - expect.double().numpy())
    assert ids.numel() > 65535 and np.all(err <= tol + 1e-30)

@pytest.mark.parametrize("tokens", [20, 40], ids=["grouped-matvec", "tensor-core-tiles"])
@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ4_XS", "IQ2_XS"])
def test_ggml_mul_mat_id_groups_pairs_by_expert(name, tokens):
    """Quantized experts run grouped: each expert's pairs (here over 8 of
    them, past one matvec pass) share its weight reads, experts no slot chose
    are skipped, and each pair's output is still its own row's. 20 tokens x 4
    slots (80 pairs, under 8 per expert) take the grouped matvec; 40 (160) the
    int8 tensor-core tiles per expert on sm_80 and later."""
    raw, x, ids, tol = mul_mat_id_case(name, 12, 24, 512, tokens, 4, False, torch.int32, seed=5)
    ids = torch.where(ids < 6, ids % 3, ids)  # experts 0-2 take many pairs, 3-5 none
    per_expert = [(ids == e).sum().item() for e in range(12)]
    assert max(per_expert) > 8 and per_expert[3:6] == [0, 0, 0]
    got = ops.ggml_mul_mat_id(cuda(raw), cuda(x), cuda(ids), GGML_TYPES[name], 24).cpu()
    expect = ops.ggml_mul_mat_id(raw, x, ids, GGML_TYPES[name], 24)
    W = ops.ggml_dequantize(raw.reshape(12 * 24, -1), GGML_TYPES[name], 12 * 24, 512, torch.float32).view(12, 24, 512)
    bound = np.stack([a8_tolerance(name, x, W[e], raw[e]) for e in range(12)])[ids.numpy(), np.arange(tokens)[:, None]]
    assert np.all(np.abs(got.double().numpy() - expect.double().numpy()) <= bound + 1e-30)


def test_ggml_mul_mat_id_past_the_grouping_limit():
    """More experts than the on-device grouping holds (8192) take one pass
    per pair."""
    experts, n = 8193, 64
    raw = ggml_blocks("Q8_0", experts, n, seed=1).view(experts, 1, -1)
    ids = torch.tensor([[8192, 0], [4096, 8192]], dtype=I32)
    x = torch.randn(2, n, generator=torch.Generator().manual_seed(1))
    got = ops.ggml_mul_mat_id(cuda(raw), cuda(x), cuda(ids), GGML_TYPES["Q8_0"], 1).cpu()
    expect = ops.ggml_mul_mat_id(raw, x, ids, GGML_TYPES["Q8_0"], 1)
    torch.testing.assert_close(got, expect, rtol=3e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_ggml_matmul_of_a_misaligned_weight_view(name):
    """A weight viewed 2 bytes into its storage (the slices read 16-byte
    aligned words of Q4_K, 2-byte aligned ones of Q6_K) gives the outputs of
    the same weight in its own allocation."""
    t = GGML_TYPES[name]
    raw = ggml_blocks(name, 2 * 6, 512)
    buf = cuda(torch.cat([torch.zeros(2, dtype=torch.uint8), raw.flatten()]))
    W = buf[2:].view(2 * 6, -1)
    x = cuda(torch.randn(3, 512, generator=torch.Generator().manual_seed(0)))
    for op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"):
        torch.testing.assert_close(getattr(ops, op)(W, x, t, 12), getattr(ops, op)(cuda(raw), x, t, 12), rtol=0,
                                   atol=0)
    ids = cuda(torch.tensor([[0, 1], [1, 1], [0, 0]], dtype=I32))
    torch.testing.assert_close(ops.ggml_mul_mat_id(W.view(2, 6, -1), x, ids, t, 6),
                               ops.ggml_mul_mat_id(cuda(raw).view(2, 6, -1), x, ids, t, 6), rtol=0, atol=0)


def test_ggml_matmul_empty_and_zero():
    raw = ggml_blocks("Q4_K", 5, 512)
    out = ops.ggml_mul_mat_a8(cuda(raw), torch.zeros(2, 512, device="cuda"), GGML_TYPES["Q4_K"], 5)
    assert torch.equal(out.cpu(), torch.zeros(2, 5))
    assert ops.ggml_mul_mat_vec_a8(cuda(raw), torch.zeros(0, 512, device="cuda"), 12, 5).shape == (0, 5)
    assert ops.ggml_dequantize(cuda(raw[:0]), 12, 0, 512, None).shape == (0, 512)


# ---------------------------------------------------------------------------
# CUDA graphs, streams, devices
# ---------------------------------------------------------------------------


def capture_and_replay(fn, make_input, exact=True):
    """Captures fn(static_x) in a CUDA graph, replays it on new inputs and
    compares with eager calls on the same inputs."""
    static_x = make_input(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up outside the capture (allocator, cuBLAS handles)
            fn(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(static_x)
    for trial in range(1, 4):
        x = make_input(trial)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        eager = fn(x)
        if exact:
            assert torch.equal(static_out, eager), f"replay {trial} differs from eager"
        else:
            torch.testing.assert_close(static_out, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M", [1, 5, 100])
@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_gemm_cuda_graph_replay_equals_eager(bits, shuffled, M):
    K, N = 1024, 256
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 128, False, "gptq_v2", True)
    g = gptq_tensors(ckpt, "cuda")
    qweight, idx = g["qweight"], g["g_idx"]
    if shuffled:
        idx = torch.argsort(g["g_idx"], stable=True).to(I32)
        qweight = qweight.clone()
        ops.gptq_shuffle(qweight, idx, bits)

    def fn(x):
        return ops.gptq_gemm(x, qweight, g["qzeros"], g["scales"], idx, shuffled, True, bits)

    def make_input(seed):
        return torch.randn(M, K, generator=torch.Generator().manual_seed(seed)).half().cuda()

    # M = 100 runs cuBLAS inside the graph: equal up to cuBLAS's own choices.
    capture_and_replay(fn, make_input, exact=M <= 64)


@pytest.mark.parametrize("name", ["Q4_K", "Q8_0", "IQ4_XS", "Q4_1", "F16"])
def test_ggml_matmul_cuda_graph_replay_equals_eager(name):
    rows, n = 64, 1024
    raw = cuda(ggml_blocks(name, rows, n))
    t = GGML_TYPES[name]

    def make_input(M):
        return lambda seed: torch.randn(M, n, generator=torch.Generator().manual_seed(seed)).cuda()

    capture_and_replay(lambda x: ops.ggml_mul_mat_vec_a8(raw, x, t, rows), make_input(1))
    capture_and_replay(lambda x: ops.ggml_mul_mat_vec_a8(raw, x, t, rows), make_input(11))
    capture_and_replay(lambda x: ops.ggml_mul_mat_a8(raw, x, t, rows), make_input(48), exact=False)


def test_ops_run_on_the_current_stream():
    """Each op reads an input that is written on a side stream after a long
    sleep there, and runs on that stream: launched on any other stream it
    would read the input before it is written."""
    K, N, bits = 1024, 256, 4
    rng = np.random.default_rng(0)
    g = gptq_tensors(ref.random_checkpoint(rng, K, N, bits, 128, False, "gptq_v2", False), "cuda")
    raw = cuda(ggml_blocks("Q4_K", 64, K))
    x = torch.randn(3, K, device="cuda")
    values = torch.randint(0, 16, (64, 96), dtype=I32, device="cuda")
    perm = torch.randperm(K, device="cuda").to(I32)
    cases = {
        # name: (the input the op reads, the op)
        "gptq_gemm": (x, lambda t: ops.gptq_gemm(t, g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, True,
                                                 bits)),
        "gptq_gemm large M": (x.repeat(40, 1), lambda t: ops.gptq_gemm(t, g["qweight"], g["qzeros"], g["scales"],
                                                                       g["g_idx"], False, True, bits)),
        "gptq_dequantize": (g["scales"], lambda t: ops.gptq_dequantize(g["qweight"], g["qzeros"], t, g["g_idx"], True,
                                                                       bits)),
        "gptq_permute_rows": (g["qweight"], lambda t: ops.gptq_permute_rows(t, perm, bits)),
        "gptq_pack": (values, lambda t: ops.gptq_pack(t, 4, 0)),
        "ggml_dequantize": (raw, lambda t: ops.ggml_dequantize(t, 12, 64, K, torch.float32)),
        "ggml_mul_mat_vec_a8": (x, lambda t: ops.ggml_mul_mat_vec_a8(raw, t, 12, 64)),
        "ggml_mul_mat_a8": (x.repeat(20, 1), lambda t: ops.ggml_mul_mat_a8(raw, t, 12, 64)),
    }
    for name, (value, fn) in cases.items():
        expect = fn(value)
        buf = torch.zeros_like(value)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)  # tens of milliseconds on the side stream
            buf.copy_(value)
            out = fn(buf)
        side.synchronize()
        assert torch.allclose(out, expect, rtol=1e-5, atol=1e-5), f"{name} did not run on the current stream"
    # gptq_shuffle rewrites its argument in place on the current stream.
    expect = g["qweight"].clone()
    ops.gptq_shuffle(expect, perm, bits)
    buf = torch.zeros_like(g["qweight"])
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        buf.copy_(g["qweight"])
        ops.gptq_shuffle(buf, perm, bits)
    side.synchronize()
    assert torch.equal(buf, expect)


def test_device_mismatch_raises_like_cpu():
    K, N, bits = 256, 64, 4
    rng = np.random.default_rng(1)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", False)
    g = gptq_tensors(ckpt, "cuda")
    a = torch.randn(2, K)
    with pytest.raises(RuntimeError, match="gptq_gemm: a is on cpu but the other arguments are on cuda:0"):
        ops.gptq_gemm(a, g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, True, bits)
    with pytest.raises(RuntimeError, match="gptq_gemm: b_gptq_scales is on cpu but the other arguments are on cuda"):
        ops.gptq_gemm(cuda(a), g["qweight"], g["qzeros"], g["scales"].cpu(), g["g_idx"], False, True, bits)
    with pytest.raises(RuntimeError, match="gptq_gemm: b_g_idx is on cpu"):
        ops.gptq_gemm(cuda(a), g["qweight"], g["qzeros"], g["scales"], g["g_idx"].cpu(), False, True, bits)
    raw = cuda(ggml_blocks("Q4_0", 4, 256))
    with pytest.raises(RuntimeError, match="ggml_mul_mat_a8: X is on cpu but the other arguments are on cuda:0"):
        ops.ggml_mul_mat_a8(raw, torch.randn(2, 256), 2, 4)
    with pytest.raises(RuntimeError, match="ggml_mul_mat_vec_a8: X is on cpu"):
        ops.ggml_mul_mat_vec_a8(raw, torch.randn(2, 256), 2, 4)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_device_uses_its_own_guard():
    K, N, bits = 512, 128, 4
    rng = np.random.default_rng(2)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 128, False, "gptq_v2", True)
    g0, g1 = gptq_tensors(ckpt, "cuda:0"), gptq_tensors(ckpt, "cuda:1")
    a = torch.randn(3, K)
    with torch.cuda.device(0):
        out1 = ops.gptq_gemm(a.to("cuda:1"), g1["qweight"], g1["qzeros"], g1["scales"], g1["g_idx"], False, True, bits)
    out0 = ops.gptq_gemm(a.to("cuda:0"), g0["qweight"], g0["qzeros"], g0["scales"], g0["g_idx"], False, True, bits)
    assert out1.device == torch.device("cuda:1") and torch.equal(out1.cpu(), out0.cpu())
    with pytest.raises(RuntimeError, match="gptq_gemm: a is on cuda:0 but the other arguments are on cuda:1"):
        ops.gptq_gemm(a.to("cuda:0"), g1["qweight"], g1["qzeros"], g1["scales"], g1["g_idx"], False, True, bits)


# ---------------------------------------------------------------------------
# Validation: the same exception type and message as on the CPU
# ---------------------------------------------------------------------------


def raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return type(e), str(e).split("\n")[0]
    return None


def validation_cases():
    K, N, bits = 256, 64, 4
    rng = np.random.default_rng(0)
    c = gptq_tensors(ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", True), "cpu")
    perm = torch.arange(K, dtype=I32)
    dup = perm.clone()
    dup[5] = 4

    def gemm(dev, **over):
        args = dict(a=torch.randn(3, K), b_q_weight=c["qweight"], b_gptq_qzeros=c["qzeros"], b_gptq_scales=c["scales"],
                    b_g_idx=c["g_idx"], use_exllama=False, use_v2_format=True, bit=bits)
        args.update(over)
        args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        return lambda: ops.gptq_gemm(**args)

    def on(dev, fn, *args):
        return lambda: fn(*[x.to(dev) if isinstance(x, torch.Tensor) else x for x in args])

    raw = ggml_blocks("Q4_0", 12, 512)
    return {
        "gemm bit 5": lambda d: gemm(d, bit=5),
        "gemm a int": lambda d: gemm(d, a=torch.ones(3, K, dtype=I32)),
        "gemm a wrong K": lambda d: gemm(d, a=torch.randn(3, K + 8)),
        "gemm qweight strided": lambda d: gemm(d, b_q_weight=c["qweight"].t().contiguous().t()),
        "gemm qzeros too few groups": lambda d: gemm(d, b_gptq_qzeros=c["qzeros"][:-1].contiguous()),
        "gemm scales wrong N": lambda d: gemm(d, b_gptq_scales=c["scales"][:, :-8].contiguous()),
        "gemm g_idx short": lambda d: gemm(d, b_g_idx=c["g_idx"][:-1]),
        "gemm g_idx float": lambda d: gemm(d, b_g_idx=c["g_idx"].float()),
        "gemm uneven groups": lambda d: gemm(d, b_g_idx=torch.empty(0, dtype=I32),
                                             b_gptq_scales=c["scales"][:7].contiguous(),
                                             b_gptq_qzeros=c["qzeros"][:7].contiguous()),
        "dequantize g_idx out of range": lambda d: on(d, ops.gptq_dequantize, c["qweight"], c["qzeros"], c["scales"],
                                                      c["g_idx"] + 8, True, bits),
        "dequantize g_idx int64 wraps": lambda d: on(d, ops.gptq_dequantize, c["qweight"], c["qzeros"], c["scales"],
                                                     c["g_idx"].long() + 2**32, True, bits),
        "shuffle perm out of range": lambda d: on(d, ops.gptq_shuffle, c["qweight"].clone(), perm + 1, bits),
        "shuffle perm duplicate": lambda d: on(d, ops.gptq_shuffle, c["qweight"].clone(), dup, bits),
        "permute_rows short": lambda d: on(d, ops.gptq_permute_rows, c["qweight"], perm[:-1], bits),
        "permute_cols duplicate": lambda d: on(d, ops.gptq_permute_cols, c["qweight"], c["qzeros"], c["scales"],
                                               torch.ones(N, dtype=I32), bits),
        "pack out of range": lambda d: on(d, ops.gptq_pack, torch.full((8, 8), 16, dtype=I32), 4, 0),
        "pack ragged": lambda d: on(d, ops.gptq_pack, torch.zeros(12, 8, dtype=I32), 4, 0),
        "unpack ragged": lambda d: on(d, ops.gptq_unpack, torch.zeros(8, 4, dtype=I32), 3, 1),
        "ggml too few bytes": lambda d: on(d, ops.ggml_mul_mat_a8, raw.flatten()[:-1], torch.randn(2, 512), 2, 12),
        "ggml X 3-D": lambda d: on(d, ops.ggml_mul_mat_vec_a8, raw, torch.randn(1, 2, 512), 2, 12),
        "ggml removed type": lambda d: on(d, ops.ggml_mul_mat_a8, raw, torch.randn(2, 512), 31, 12),
        "ggml dequantize dtype": lambda d: on(d, ops.ggml_dequantize, raw, 2, 12, 512, torch.int32),
    }


VALIDATION = validation_cases()


@pytest.mark.parametrize("case", list(VALIDATION), ids=list(VALIDATION))
def test_validation_matches_cpu(case):
    make = VALIDATION[case]
    on_cpu, on_cuda = raised(make("cpu")), raised(make("cuda"))
    assert on_cpu is not None, "the CPU kernel should reject this input"
    assert on_cuda == on_cpu


def test_rejected_shuffle_leaves_weight_untouched():
    rng = np.random.default_rng(0)
    g = gptq_tensors(ref.random_checkpoint(rng, 256, 64, 4, 32, False, "gptq_v2", True), "cuda")
    qweight = g["qweight"].clone()
    dup = torch.arange(256, dtype=I32, device="cuda")
    dup[5] = 4
    with pytest.raises(ValueError, match="gptq_shuffle: q_perm is not a permutation"):
        ops.gptq_shuffle(qweight, dup, 4)
    assert torch.equal(qweight, g["qweight"])


# ---------------------------------------------------------------------------
# opcheck with CUDA tensors (schema, fake kernels, aliasing of gptq_shuffle)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_opcheck_gptq_ops_on_cuda(bits):
    rng = np.random.default_rng(bits)
    g = gptq_tensors(ref.random_checkpoint(rng, 256, 64, bits, 32, False, "gptq_v2", True), "cuda")
    perm = torch.argsort(g["g_idx"], stable=True).to(I32)
    for M in (1, 80):
        a = torch.randn(M, 256, device="cuda", dtype=torch.float16)
        torch.library.opcheck(ops.gptq_gemm, (a, g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, True, bits))
    torch.library.opcheck(ops.gptq_dequantize, (g["qweight"], g["qzeros"], g["scales"], g["g_idx"], True, bits))
    torch.library.opcheck(ops.gptq_shuffle, (g["qweight"].clone(), perm, bits))
    torch.library.opcheck(ops.gptq_permute_rows, (g["qweight"], perm, bits))
    torch.library.opcheck(ops.gptq_permute_cols, (g["qweight"], g["qzeros"], g["scales"],
                                                  torch.randperm(64, device="cuda"), bits))
    values = torch.randint(0, 2**bits, (64, 96), dtype=I32, device="cuda")
    torch.library.opcheck(ops.gptq_pack, (values, bits, 0))
    torch.library.opcheck(ops.gptq_unpack, (g["qzeros"], bits, 1))


def test_opcheck_ggml_ops_on_cuda():
    for name in ("Q4_0", "Q4_K", "IQ2_XS", "F16"):
        raw = cuda(ggml_blocks(name, 12, 512))
        t = GGML_TYPES[name]
        torch.library.opcheck(ops.ggml_dequantize, (raw, t, 12, 512, torch.float32))
        for M in (1, 40):
            x = torch.randn(M, 512, device="cuda")
            torch.library.opcheck(ops.ggml_mul_mat_vec_a8, (raw, x, t, 12))
            torch.library.opcheck(ops.ggml_mul_mat_a8, (raw, x.bfloat16(), t, 12))


# ---------------------------------------------------------------------------
# Small runs of every kernel, for compute-sanitizer (.ci/device_run.sh sanitize)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
def test_sanitize_gptq_kernels(bits):
    """Every GPTQ kernel once on small shapes: the tensor-core kernel (bf16,
    one and two m16 tiles; but 3-bit) with steps of one group and of several,
    the CUDA-core fused kernel (fp32; 3-bit) at M = 1/2/4/8 with and without
    split-K and its row-by-row slow path, dequantize + cuBLAS (two-term bf16
    and fp32), dequantize, pack, unpack, shuffle, permutes."""
    K, N = 1024, 96
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 16, False, "gptq", True)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    g = gptq_tensors(ckpt, "cuda")
    perm = torch.argsort(g["g_idx"], stable=True).to(I32)
    shuffled = g["qweight"].clone()
    ops.gptq_shuffle(shuffled, perm, bits)
    for M, dtype in ((1, torch.bfloat16), (3, torch.bfloat16), (20, torch.bfloat16), (1, torch.float32),
                     (2, torch.float32), (3, torch.float32), (7, torch.float32),
                     (70, torch.bfloat16), (70, torch.float32)):  # M = 70: the two large-M paths
        a = torch.randn(M, K, device="cuda", dtype=dtype)
        assert_gemm_close(ops.gptq_gemm(a, g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, False, bits),
                          a.cpu(), W, f"unshuffled M={M}")
        assert_gemm_close(ops.gptq_gemm(a, shuffled, g["qzeros"], g["scales"], perm, True, False, bits),
                          a.cpu(), W, f"shuffled M={M}")
    ops.gptq_dequantize(g["qweight"], g["qzeros"], g["scales"], g["g_idx"], False, bits)
    ops.gptq_unpack(ops.gptq_pack(torch.randint(0, 2**bits, (64, 96), dtype=I32, device="cuda"), bits, 1), bits, 1)
    ops.gptq_permute_cols(g["qweight"], g["qzeros"], g["scales"], torch.randperm(N, device="cuda"), bits)
    torch.cuda.synchronize()


@pytest.mark.parametrize("name", list(GGML_TYPES))
def test_sanitize_ggml_kernels(name):
    t = GGML_TYPES[name]
    raw = cuda(ggml_blocks(name, 5, 512))
    ops.ggml_dequantize(raw, t, 5, 512, torch.bfloat16)
    for M in (1, 9, 40, 70):  # 40, 70: the int8 tensor-core kernel (sm_80+), one and two activation tiles
        x = torch.randn(M, 512, device="cuda", dtype=torch.float16)
        ops.ggml_mul_mat_vec_a8(raw, x, t, 5)
        ops.ggml_mul_mat_a8(raw, x, t, 5)
    experts = cuda(ggml_blocks(name, 3 * 5, 512).view(3, 5, -1))
    ids = torch.tensor([[0, 2], [1, 0], [2, 2]], device="cuda", dtype=I32)
    ops.ggml_mul_mat_id(experts, torch.randn(3, 512, device="cuda"), ids, t, 5)
    ops.ggml_mul_mat_id(experts, torch.randn(3, 2, 512, device="cuda", dtype=torch.bfloat16), ids.long(), t, 5)
    many = torch.randint(0, 3, (12, 2), device="cuda", dtype=I32)  # 8 pairs per expert: the tiles per expert
    ops.ggml_mul_mat_id(experts, torch.randn(12, 512, device="cuda"), many, t, 5)
    torch.cuda.synchronize()


@pytest.mark.parametrize("experts", [1500, 8193])
def test_sanitize_expert_grouping_edges(experts):
    """ggml_mul_mat_id's grouping where it branches: more experts than the
    grouping block's threads (threads owning several experts, and none), an
    expert with more than one 8-pair pass, experts no pair chose, and past
    the grouping's limit (8192 experts) the pass per pair."""
    n, tokens = 32, 20
    raw = ggml_blocks("Q8_0", experts, n).view(experts, 1, -1)
    ids = torch.stack([torch.zeros(tokens, dtype=I32), torch.full((tokens,), experts - 1, dtype=I32)], dim=1)
    ids[::3, 0] = 700  # expert 0: 13 pairs, expert experts - 1: 20, expert 700: 7
    x = torch.randn(tokens, n, generator=torch.Generator().manual_seed(experts))
    got = ops.ggml_mul_mat_id(cuda(raw), cuda(x), cuda(ids), GGML_TYPES["Q8_0"], 1).cpu()
    torch.cuda.synchronize()
    torch.testing.assert_close(got, ops.ggml_mul_mat_id(raw, x, ids, GGML_TYPES["Q8_0"], 1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sanitize_decode_kernels(dtype):
    """rms_norm and decode_attention (shared memory, block reductions) on
    small shapes: head sizes short of a warp and past a block, grouped
    heads, a window, sinks and a softcap."""
    for rows, n in ((1, 7), (3, 576), (2, 2049)):
        ops.rms_norm(torch.randn(rows, n, device="cuda", dtype=dtype), torch.randn(n, device="cuda", dtype=dtype), 1e-6)
    for q_heads, kv_heads, dim, capacity, position, start in ((9, 3, 64, 40, 33, 0), (4, 2, 24, 8, 7, 3),
                                                              (2, 1, 1040, 5, 4, 0)):
        c = lambda *shape: torch.randn(*shape, device="cuda", dtype=dtype)
        ops.decode_attention(c(q_heads, dim), c(kv_heads, dim), c(kv_heads, dim), c(dim), c(dim),
                             c(kv_heads, capacity, dim), c(kv_heads, capacity, dim), position, dim ** -0.5, start,
                             c(q_heads), 30.0)
    torch.cuda.synchronize()
