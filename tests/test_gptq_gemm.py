"""gptq_gemm / gptq_dequantize / gptq_shuffle against the NumPy reference.

Tolerances (checked per element, relative to bound = |a| @ |W| in float64,
which bounds every partial sum of the dot product):
- fp32 accumulation of K terms: |out - ref| <= 1e-5 * bound. For K = 384 the
  worst case is K * 2^-24 = 2.3e-5 and the typical error sqrt(K) * 2^-24 =
  1.2e-6; an fp16 accumulator (vLLM's 2/3-bit path) errs by ~2^-11 * bound
  and fails this by two orders of magnitude.
- the output is then rounded once to a's dtype: + 2^-11 * |ref| for fp16,
  2^-8 * |ref| for bf16 (half an ulp), + the smallest subnormal for fp16.
The activations are converted exactly (fp16/bf16 -> fp32), so the reference
uses the same rounded activations and charges no input error.
"""
import numpy as np
import pytest
import torch

import gptq_reference as ref

K, N = 384, 96  # N > the fused kernel's 64-column tile, so tiles are partial
BITS = (2, 3, 4, 8)
GROUP_SIZES = (16, 32, 64, 128, 96, -1)  # 96: a divisor of K that is no power of two
MS = (1, 2, 7, 16, 64, 300)  # both sides of the fused / dequantize+mm crossover
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OUT_ROUNDING = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
SUBNORMAL = {torch.float32: 0.0, torch.float16: 2.0**-24, torch.bfloat16: 0.0}


def as_torch(ckpt, device):
    keys = ("qweight", "qzeros", "scales", "g_idx")
    return {k: torch.from_numpy(np.ascontiguousarray(ckpt[k])).to(device) for k in keys}


def assert_close_to_reference(out, a, W, what):
    a64 = a.double().cpu().numpy()
    expect = a64 @ W
    bound = np.abs(a64) @ np.abs(W)
    got = out.double().cpu().numpy()
    tol = 1e-5 * bound + OUT_ROUNDING[out.dtype] * np.abs(expect) + SUBNORMAL[out.dtype]
    err = np.abs(got - expect)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"{what}: error {err[worst]:.3g} > tol {tol[worst]:.3g} at {worst}"


@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "actorder"])
@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("sym", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("bits", BITS)
def test_gemm_matrix(device, bits, sym, fmt, group_size, act_order):
    """Every M x activation dtype x (shuffled, unshuffled) for one checkpoint."""
    rng = np.random.default_rng([bits, sym, group_size % 1000, act_order, fmt == "gptq"])
    ckpt = ref.random_checkpoint(rng, K, N, bits, group_size, sym, fmt, act_order)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, fmt)
    t = as_torch(ckpt, device)
    v2 = fmt == "gptq_v2"

    # gptq_shuffle with q_perm = argsort(g_idx), as vLLM and GPTQLinear do for act-order.
    perm = torch.argsort(t["g_idx"].cpu(), stable=True).to(torch.int32).to(device)
    if not act_order:
        perm = torch.empty(0, dtype=torch.int32, device=device)
    shuffled = t["qweight"].clone()
    torch.ops.lowbit.gptq_shuffle(shuffled, perm, bits)

    for M in MS:
        for dtype in DTYPES:
            a = torch.randn(M, K, generator=torch.Generator().manual_seed(M), dtype=torch.float32).to(dtype)
            a = a.to(device)
            out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, v2, bits)
            assert out.dtype == dtype and out.shape == (M, N)
            assert_close_to_reference(out, a, W, f"unshuffled M={M} {dtype}")
            out = torch.ops.lowbit.gptq_gemm(a, shuffled, t["qzeros"], t["scales"], perm, True, v2, bits)
            assert out.dtype == dtype and out.shape == (M, N)
            assert_close_to_reference(out, a, W, f"shuffled M={M} {dtype}")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("M", [1, 300])
def test_gemm_empty_g_idx_means_trivial_groups(device, bits, M):
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], None, bits, "gptq_v2")
    t = as_torch(ckpt, device)
    a = torch.randn(M, K, device=device)
    none = torch.empty(0, dtype=torch.int32, device=device)
    out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], none, False, True, bits)
    assert_close_to_reference(out, a, W, "empty g_idx")


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_compile_takes_a_g_idx_counted_at_run_time():
    """A g_idx gathered by a mask has a size known only when the graph runs
    (K entries, or none): the fake kernels trace it, and the kernels check it
    at the call."""
    rng = np.random.default_rng(1)
    ckpt = ref.random_checkpoint(rng, K, N, 4, 32, False, "gptq_v2", False)
    t = as_torch(ckpt, "cpu")
    a = torch.randn(3, K)

    def gemm(g_idx, mask):
        return (torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], g_idx[mask], False, True, 4),
                torch.ops.lowbit.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], g_idx[mask], True, 4))

    torch._dynamo.reset()
    compiled = torch.compile(gemm, fullgraph=True)
    for mask in (torch.ones(K, dtype=torch.bool), torch.zeros(K, dtype=torch.bool)):
        for got, want in zip(compiled(t["g_idx"], mask), gemm(t["g_idx"], mask)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"b_g_idx must have K=384 entries \(or be empty\), got 383"):
        compiled(t["g_idx"], torch.arange(K) > 0)


@pytest.mark.parametrize("M", [1, 300])
def test_gemm_arbitrary_g_idx_unshuffled(device, M):
    """Unshuffled weights take any g_idx, also groups of unequal size."""
    rng = np.random.default_rng(0)
    ckpt = ref.random_checkpoint(rng, K, N, 4, 32, False, "gptq_v2", False)
    g_idx = rng.integers(0, K // 32, size=K).astype(np.int32)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], g_idx, 4, "gptq_v2")
    t = as_torch(ckpt, device)
    a = torch.randn(M, K, device=device)
    g = torch.from_numpy(g_idx).to(device)
    out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], g, False, True, 4)
    assert_close_to_reference(out, a, W, "arbitrary g_idx")


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gemm_scale_dtypes(device, scale_dtype, bits, act_order):
    """Every kernel reads each group's scales in their stored dtype (and the
    v1 zero points) itself: the fused kernels at M = 1 (the SIMD ones for
    contiguous groups, the portable one for an act-order g_idx), dequantize +
    matmul at M = 64."""
    rng = np.random.default_rng(1)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 64, False, "gptq", act_order)
    # Scales exactly representable in scale_dtype, given to the reference as float64.
    scales = torch.from_numpy(ckpt["scales"]).float().mul(1.37).to(scale_dtype)
    ckpt["scales"] = scales.double().numpy()
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    t = as_torch(ckpt, device)
    for M in (1, 64):
        a = torch.randn(M, K, device=device, dtype=torch.float16)
        out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], scales.to(device), t["g_idx"], False, False,
                                         bits)
        assert out.dtype == torch.float16
        assert_close_to_reference(out, a, W, f"{scale_dtype} scales M={M}")


def test_gemm_batch_dims_and_strided_input(device):
    rng = np.random.default_rng(2)
    ckpt = ref.random_checkpoint(rng, K, N, 4, 128, True, "gptq", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], 4, "gptq")
    t = as_torch(ckpt, device)
    a = torch.randn(K, 2, 3, device=device).permute(1, 2, 0)  # [2, 3, K], not contiguous
    out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, False, 4)
    assert out.shape == (2, 3, N)
    assert_close_to_reference(out.reshape(6, N), a.reshape(6, K), W, "batched")
    empty = torch.ops.lowbit.gptq_gemm(a[:0], t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, False, 4)
    assert empty.shape == (0, 3, N)


@pytest.mark.parametrize("library", ["onednn", "blas"])
@pytest.mark.parametrize("bigK, bigN", [(32768, N), (512, 16384 + N)], ids=["tall", "wide"])
def test_gemm_large_m_decodes_w_in_strips(bigK, bigN, library):
    """M = 80 is past every fused kernel, so W is decoded in column strips
    over all of K for the fp32 GEMM, on either library: about 2 MB of fp32
    each, and at least 64 columns (8 MB for the tall W), the last one
    partial."""
    default = torch.ops.lowbit.cpu_float_gemm()
    if library == "onednn" and default != "onednn":
        pytest.skip("this torch has no oneDNN")
    rng = np.random.default_rng(3)
    ckpt = ref.random_checkpoint(rng, bigK, bigN, 2, 128, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], 2, "gptq_v2")
    t = as_torch(ckpt, "cpu")
    a = torch.randn(80, bigK)
    try:
        torch.ops.lowbit.cpu_float_gemm(library)
        out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, True, 2)
    finally:
        torch.ops.lowbit.cpu_float_gemm(default)
    a64 = a.double().numpy()
    # K = 32768 terms: the fp32 bound scales with K (see module docstring).
    err = np.abs(out.double().numpy() - a64 @ W)
    assert np.all(err <= 1e-4 * (np.abs(a64) @ np.abs(W)))


@pytest.mark.parametrize("library", ["onednn", "blas"])
def test_gemm_large_m_follows_float32_matmul_precision(device, library):
    """The large-M path multiplies decoded W with torch's own GEMM (on the
    CPU either library, cpu_float_gemm), so it follows
    torch.set_float32_matmul_precision as torch.mm does: "highest" keeps fp32
    products; "medium" lets the GEMM round both operands to bf16 (TF32 on
    CUDA), whose products then err by up to 2^-8 relative, summed in fp32.
    Where torch.mm rounds under "medium", gptq_gemm rounds too."""
    if device != "cpu" and library != "onednn":
        pytest.skip("cpu_float_gemm chooses the CPU's GEMM library")
    rng = np.random.default_rng(11)
    k, n = 1024, 512
    ckpt = ref.random_checkpoint(rng, k, n, 4, 128, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], 4, "gptq_v2")
    t = as_torch(ckpt, device)
    a = torch.randn(300, k, device=device)
    a64 = a.double().cpu().numpy()
    bound = np.abs(a64) @ np.abs(W)
    w32 = torch.from_numpy(W.astype(np.float32)).to(device)
    saved, default = torch.get_float32_matmul_precision(), torch.ops.lowbit.cpu_float_gemm()
    if library == "onednn" and default != "onednn":
        pytest.skip("this torch has no oneDNN")
    out, mm = {}, {}
    try:
        if device == "cpu":
            torch.ops.lowbit.cpu_float_gemm(library)
        for precision in ("highest", "medium"):
            torch.set_float32_matmul_precision(precision)
            out[precision] = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"],
                                                        False, True, 4)
            mm[precision] = a @ w32
    finally:
        torch.set_float32_matmul_precision(saved)
        torch.ops.lowbit.cpu_float_gemm(default)
    for precision, tol in (("highest", 1e-5), ("medium", 2.0**-7)):
        err = np.abs(out[precision].double().cpu().numpy() - a64 @ W)
        assert np.all(err <= tol * bound), (precision, float((err / bound).max()))
    # torch.mm has rounded its operands where its "medium" error passes 2^-14 of the bound (bf16's is near
    # 2^-11 here, fp32's below 2^-23); a change of library alone (MKL to oneDNN, both fp32) rounds nothing.
    if np.any(np.abs(mm["medium"].double().cpu().numpy() - a64 @ W) > 2.0**-14 * bound):
        assert not torch.equal(out["highest"], out["medium"])


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_is_exact(device, bits, fmt):
    """s * (q - z) is exact in fp32 (an fp16 scale times a <= 9-bit integer),
    so the only rounding is the final one to the scales' dtype."""
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 64, False, fmt, True)
    t = as_torch(ckpt, device)
    W = torch.ops.lowbit.gptq_dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], fmt == "gptq_v2", bits)
    expect = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, fmt)
    assert W.dtype == torch.float16 and W.shape == (K, N)
    np.testing.assert_array_equal(W.cpu().numpy(), expect.astype(np.float16))


@pytest.mark.parametrize("act_order", [False, True], ids=["groups", "actorder"])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits, n", [pytest.param(bits, n, id=f"{bits}-{name}") for bits in BITS
                                     for n, name in ((96, "whole_vectors"), (104, "ragged"))
                                     if n * bits % 32 == 0])  # N packs into bits-bit qzeros words
def test_dequantize_every_path_is_exact(device, bits, scale_dtype, n, act_order):
    """Contiguous groups take the SIMD tile dequantizer (N = 104 leaves 8
    columns past its last 16-lane vector for dequant_row), an act-order g_idx
    the portable rows; fp32 scales are written in place, the others rounded
    once from fp32. Both must give the reference's bits."""
    rng = np.random.default_rng([bits, n])
    ckpt = ref.random_checkpoint(rng, K, n, bits, 64, False, "gptq", act_order)
    scales = torch.from_numpy(ckpt["scales"]).float().mul(1.37).to(scale_dtype)
    ckpt["scales"] = scales.double().numpy()
    t = as_torch(ckpt, device)
    W = torch.ops.lowbit.gptq_dequantize(t["qweight"], t["qzeros"], scales.to(device), t["g_idx"], False, bits)
    expect = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq")
    assert W.dtype == scale_dtype and W.shape == (K, n)
    np.testing.assert_array_equal(W.cpu().float().numpy(), torch.from_numpy(expect).to(scale_dtype).float().numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", BITS)
def test_gemm_wide_half_activations_every_m(device, bits, dtype):
    """bf16 / fp16 activations against a weight wide enough for several
    column tasks (N = 1088: tasks of 256 columns, the last of 64) and groups
    of 256 rows (two of the vdpbf16ps kernel's 128-row chunks each), at M on
    both sides of each bit width's switch from decoding per row tile to
    shared panels (8-bit past 4 rows, 3-bit past 8, 2- and 4-bit past 32),
    with partial row tiles."""
    rng = np.random.default_rng([bits, dtype == torch.float16])
    k, n = 512, 1088
    ckpt = ref.random_checkpoint(rng, k, n, bits, 256, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], bits, "gptq_v2")
    t = as_torch(ckpt, device)
    for M in (3, 5, 9, 32, 35):
        a = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dtype).to(device)
        out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, True, bits)
        assert out.dtype == dtype and out.shape == (M, n)
        assert_close_to_reference(out, a, W, f"M={M}")


@pytest.mark.parametrize("mode", ["set", "gemm"])
@pytest.mark.parametrize("n", [96, 104], ids=["whole_vectors", "ragged"])
def test_gemm_bf16_large_m_rounds_once(device, n, mode):
    """bf16 activations at M = 100 must round the fp32-accurate product once:
    nearly every output is the correctly rounded bf16 of the exact result, and
    (this data has no near-cancelling output, where the vdpbf16ps kernel's
    level offsets may cost a few ulps within test_gemm_matrix's tolerance)
    none is off by more than one ulp. On AVX512-BF16 CPUs the path is the
    fused vdpbf16ps kernel where that runs at the FMA's rate (mode "set": the
    one the device fixture set), and with cpu_bf16_kernel("gemm") W as two
    bf16 planes in one bf16 GEMM; a single bf16 plane of W would miss about
    half an ulp on every output and fail the first check."""
    rng = np.random.default_rng(n)
    k = 1024
    ckpt = ref.random_checkpoint(rng, k, n, 4, 128, False, "gptq_v2", False)
    W = ref.dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], 4, "gptq_v2")
    t = as_torch(ckpt, device)
    a = torch.randn(100, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16).to(device)
    before = torch.ops.lowbit.cpu_bf16_kernel()
    try:
        if mode == "gemm":
            torch.ops.lowbit.cpu_bf16_kernel("gemm")
        out = torch.ops.lowbit.gptq_gemm(a, t["qweight"], t["qzeros"], t["scales"], t["g_idx"], False, True, 4)
    finally:
        torch.ops.lowbit.cpu_bf16_kernel(before)
    exact = torch.from_numpy(a.double().cpu().numpy() @ W)
    rounded = exact.to(torch.bfloat16)
    got = out.cpu()
    assert got.dtype == torch.bfloat16
    assert (got == rounded).double().mean() >= 0.99
    ulp = (rounded.float().abs() * 2.0**-7).clamp_min(2.0**-126)
    assert torch.all((got.float() - exact.float()).abs() <= ulp)


@pytest.mark.parametrize("bits", BITS)
def test_shuffle_permutes_rows(device, bits):
    """lowbit's fast layout: the GPTQ packing with rows in q_perm order."""
    rng = np.random.default_rng(bits)
    ckpt = ref.random_checkpoint(rng, K, N, bits, 32, True, "gptq_v2", True)
    perm = np.argsort(ckpt["g_idx"], kind="stable")
    qweight = as_torch(ckpt, device)["qweight"]
    torch.ops.lowbit.gptq_shuffle(qweight, torch.from_numpy(perm).to(device), bits)
    expect = ref.pack(ref.unpack(ckpt["qweight"], bits, 0)[perm], bits, 0)
    np.testing.assert_array_equal(qweight.cpu().numpy(), expect)
    # A shuffle without a permutation leaves the weight as it is.
    before = qweight.clone()
    torch.ops.lowbit.gptq_shuffle(qweight, torch.empty(0, dtype=torch.int32, device=device), bits)
    assert torch.equal(qweight, before)


@pytest.mark.parametrize("bits", BITS)
def test_the_panel_layout_gives_the_same_bits(cpu_isa, bits):
    """b_q_weight in the panel layout [N/64, rows, 64] (to_panels) gives the
    checkpoint layout's bits through every path: the fused kernels (fp32 and
    vdpbf16ps) and both large-M GEMM paths at every M, several column tasks
    (N = 1088: 17 panels), contiguous groups, an unsorted act-order g_idx and
    the shuffled layout."""
    from lowbit.gptq.packing import to_panels

    rng = np.random.default_rng([bits, 7])
    k, n = 512, 1088
    ckpt = ref.random_checkpoint(rng, k, n, bits, 128, False, "gptq_v2", True)
    t = as_torch(ckpt, "cpu")
    order = torch.argsort(t["g_idx"], stable=True).to(torch.int32)
    shuffled = t["qweight"].clone()
    torch.ops.lowbit.gptq_shuffle(shuffled, order, bits)
    sorted_rows = torch.ops.lowbit.gptq_permute_rows(t["qweight"], order, bits)
    layouts = {  # (qweight, g_idx, use_exllama)
        "sorted": (sorted_rows, t["g_idx"][order.long()], False),
        "unsorted": (t["qweight"], t["g_idx"], False),
        "shuffled": (shuffled, order, True),
    }
    for name, (qweight, g_idx, exllama) in layouts.items():
        panels = to_panels(qweight)
        for mode in ("always", "gemm", "auto"):
            torch.ops.lowbit.cpu_bf16_kernel(mode)
            for M in (1, 3, 9, 35, 70) if name == "sorted" else (1, 70):
                for dtype in DTYPES:
                    a = torch.randn(M, k, generator=torch.Generator().manual_seed(M)).to(dtype)
                    run = lambda q: torch.ops.lowbit.gptq_gemm(a, q, t["qzeros"], t["scales"], g_idx, exllama, True,
                                                               bits)
                    assert torch.equal(run(panels), run(qweight)), (name, mode, M, dtype)
    torch.ops.lowbit.cpu_bf16_kernel("always")  # the fixture's setting, which it resets
