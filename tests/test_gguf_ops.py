"""GGUF ops against gguf-py for every weight type.

ggml_dequantize must equal gguf.quants.dequantize bit for bit: lowbit evaluates
each weight in ggml's order of operations (one rounding per multiply/add), and
so does gguf-py for every type, so no type needs a 1-ulp allowance.

ggml_mul_mat_(vec_)a8 quantize the activations to 8-bit blocks as llama.cpp's
CPU backend does and compare against the float64 product of gguf-py's
dequantized weights with the unquantized activations. Tolerance per output,
with d_b = amax(x over activation block b) / 127:
  sum_i |W[r, i]| * 0.5625 * d_b(i)      activation rounding (half a step) plus,
                                        for Q8_0/Q8_1, d stored as fp16
                                        (127 * 2^-11 = 0.062 step)
+ sum_b |m_rb| * 3.97 * d_b              Q4_1/Q5_1 only: Q8_1's fp16 sum term
                                        (2^-10 * 32 * 127 steps)
+ 1e-5 * (|x| @ |W|.T)                   fp32 accumulation
"""
import numpy as np
import pytest
import torch

import gguf_blocks as gb
import llama_cpp_peer

ops = torch.ops.lowbit
N = 512  # two 256-element super-blocks, sixteen 32-element blocks
ROWS = 12


@pytest.fixture(params=gb.TYPES)
def qtype(request):
    return request.param


def blocks(name, rows=ROWS, n=N, seed=0):
    rng = np.random.default_rng([seed, gb.type_id(name)])
    return gb.random_blocks(rng, name, rows, n)


@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_is_bit_exact_with_gguf_py(device, qtype, seed):
    raw = blocks(qtype, seed=seed)
    expect = gb.dequantize(raw, qtype)
    W = torch.from_numpy(raw).to(device)
    got = ops.ggml_dequantize(W, gb.type_id(qtype), ROWS, N, torch.float32)
    assert got.dtype == torch.float32 and got.shape == (ROWS, N)
    np.testing.assert_array_equal(got.cpu().numpy(), expect)
    # Other output dtypes are the fp32 values rounded once; fp16 is the default.
    assert ops.ggml_dequantize(W, gb.type_id(qtype), ROWS, N).dtype == torch.float16
    for dtype in (torch.float16, torch.bfloat16):
        got = ops.ggml_dequantize(W, gb.type_id(qtype), ROWS, N, dtype)
        assert torch.equal(got.cpu(), torch.from_numpy(expect).to(dtype))


# Every class of fp16 bit pattern a scale field can hold: zeros, subnormals,
# normals, the largest finite, infinities, quiet and signalling NaNs.
SPECIAL_HALVES = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x8001, 0x0400, 0x3C00, 0xBC00, 0x7BFF,
                           0x7C00, 0xFC00, 0x7E00, 0x7C01, 0xFE01], dtype=np.uint16)


@pytest.mark.parametrize("qtype", sorted(gb.HALF_FIELDS))
def test_dequantize_special_scales_like_gguf_py(device, qtype):
    # The SIMD kernels convert scales with F16C, the portable ones in software;
    # every class must come out as gguf-py's does (NaNs compare equal to NaNs,
    # everything else bit for bit).
    raw = blocks(qtype).copy()
    block, nbytes = gb.block_shape(qtype)
    fields = raw.reshape(ROWS, N // block, nbytes)
    for i, off in enumerate(gb.HALF_FIELDS[qtype]):
        halves = np.resize(np.roll(SPECIAL_HALVES, i), fields.shape[:2])
        fields[:, :, off:off + 2] = halves.view(np.uint8).reshape(*fields.shape[:2], 2)
    expect = gb.dequantize(raw, qtype)
    got = ops.ggml_dequantize(torch.from_numpy(raw).to(device), gb.type_id(qtype), ROWS, N, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), expect)


def test_dequantize_every_nvfp4_scale_byte_like_gguf_py(device):
    # All 256 UE4M3 bytes as sub-block scales, against levels of every
    # nibble: zero and 0x7F (E4M3's NaN, read as zero by ggml and gguf-py),
    # the subnormals (exponent 0), and bit 7, which the format leaves unused.
    rows = 256 // 4
    raw = blocks("NVFP4", rows=rows, n=64).copy()
    raw[:, :4] = np.arange(256, dtype=np.uint8).reshape(rows, 4)
    raw[:, 4:] = (np.arange(32) * 17 % 256).astype(np.uint8)  # bytes 0x00, 0x11, .. 0xff: every nibble in both halves
    expect = gb.dequantize(raw, "NVFP4")
    got = ops.ggml_dequantize(torch.from_numpy(raw).to(device), gb.type_id("NVFP4"), rows, 64, torch.float32)
    np.testing.assert_array_equal(got.cpu().numpy(), expect)


@pytest.mark.skipif(llama_cpp_peer.available() is not None, reason=str(llama_cpp_peer.available()))
@pytest.mark.parametrize("qtype", ["NVFP4"] + sorted(gb.NUMPY_REFERENCE))
def test_reference_dequantization_is_ggml_own(qtype):
    """The oracle of the types newer than gguf-py's dequantizers (the NumPy
    reference of Q1_0 and Q2_0, and gguf-py's NVFP4) against ggml's own
    dequantize_row_* and block table, from llama-cpp-python's libggml."""
    assert llama_cpp_peer.block_shape(gb.type_id(qtype)) == gb.block_shape(qtype)
    raw = blocks(qtype).copy()
    if qtype in gb.HALF_FIELDS:  # every class of fp16 scale too
        fields = raw.reshape(ROWS, -1, gb.block_shape(qtype)[1])
        fields[:, :, :2] = np.resize(SPECIAL_HALVES, fields.shape[:2]).view(np.uint8).reshape(*fields.shape[:2], 2)
    np.testing.assert_array_equal(gb.dequantize(raw, qtype), llama_cpp_peer.dequantize(raw, gb.type_id(qtype)))


def test_type_table_matches_gguf_py(qtype):
    assert ops.ggml_type_info(gb.type_id(qtype)) == list(gb.block_shape(qtype))
    assert ops.ggml_type_name(gb.type_id(qtype)) == qtype


@pytest.mark.parametrize("type_id", [4, 5, 9, 15, 24, 28, 31, 36, 38, 99, -1])
def test_unknown_and_removed_types_raise(type_id):
    with pytest.raises(ValueError, match=f"type {type_id} is not a ggml weight type"):
        ops.ggml_type_info(type_id)
    with pytest.raises(ValueError, match=f"ggml_type_name: type {type_id} is not a ggml weight type"):
        ops.ggml_type_name(type_id)
    with pytest.raises(ValueError, match=f"ggml_dequantize: type {type_id} is not a ggml weight type"):
        ops.ggml_dequantize(torch.zeros(1024, dtype=torch.uint8), type_id, 1, 256, None)


def a8_tolerance(x, W, raw, name):
    """The documented bound (module docstring) for every output [M, rows]."""
    x64 = x.astype(np.float64)
    absW = np.abs(W.astype(np.float64))
    tol = 1e-5 * (np.abs(x64) @ absW.T)
    if name in gb.FLOAT_TYPES:
        return tol  # float weights take the activations unquantized
    ab = gb.act_block(name)
    d = np.abs(x64).reshape(x.shape[0], -1, ab).max(axis=2) / 127  # [M, act blocks]
    step = np.repeat(d, ab, axis=1)  # [M, n]
    tol += 0.5625 * (step @ absW.T)
    mins = gb.min_terms(raw, name)
    if mins is not None:
        tol += 3.97 * (d @ mins.T)
    return tol


@pytest.mark.parametrize("op", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("M", [1, 3, 17])
def test_mul_mat_a8_within_documented_tolerance(device, qtype, op, M):
    raw = blocks(qtype)
    W = gb.dequantize(raw, qtype)
    rng = np.random.default_rng(M)
    x = rng.standard_normal((M, N)).astype(np.float32)
    x[:, :32] *= 20  # one outlier block: scales must be per block, not per row
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        X = torch.from_numpy(x).to(dtype)
        xr = X.float().numpy()  # the activations as the op sees them
        expect = xr.astype(np.float64) @ W.astype(np.float64).T
        tol = a8_tolerance(xr, W, raw, qtype)
        got = getattr(ops, op)(torch.from_numpy(raw).to(device), X.to(device), gb.type_id(qtype), ROWS)
        assert got.dtype == dtype and got.shape == (M, ROWS)
        out_round = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
        err = np.abs(got.double().cpu().numpy() - expect)
        bound = tol + out_round * np.abs(expect) + 1e-30
        worst = np.unravel_index(np.argmax(err / bound), err.shape)
        assert np.all(err <= bound), f"{dtype}: error {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"


def activations_on_every_grid(rng, M, n):
    """[M, n] fp32 values q·d, d a power of two per 256 elements, every 32
    elements' first value at ±127·d and the others' q in [-60, 60]: Q8_0, Q8_1
    and Q8_K all find step d and the integers q exactly, and each 32 elements'
    sum of q stays below 2048, so that Q8_1's fp16 d·sum(q) is exact too."""
    q = rng.integers(-60, 61, (M, n // 32, 32))
    q[:, :, 0] = rng.choice([-127, 127], (M, n // 32))
    d = np.repeat(np.exp2(rng.integers(-4, 2, (M, n // 256, 1))), 8, axis=1)
    return (q * d).reshape(M, n).astype(np.float32)


@pytest.mark.parametrize("op", ["ggml_mul_mat_vec_a8", "ggml_mul_mat_a8"])
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("qtype", [t for t in gb.TYPES if t not in gb.FLOAT_TYPES])  # floats take x unquantized
def test_mul_mat_a8_of_activations_on_the_grid_is_the_float_product(device, qtype, op, M):
    """With activations that every 8-bit quantizer represents exactly, the
    integer dot products equal x @ dequant(W) (gguf-py's) up to fp32 sums: a
    level, scale or min decoded wrongly anywhere shows, as it may not against
    the quantization tolerance above."""
    rng = np.random.default_rng([M, gb.type_id(qtype), 2])
    raw = gb.random_blocks(rng, qtype, ROWS, N)
    W = gb.dequantize(raw, qtype).astype(np.float64)
    x = activations_on_every_grid(rng, M, N)
    expect = x.astype(np.float64) @ W.T
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(W).T) + 1e-30
    got = getattr(ops, op)(torch.from_numpy(raw).to(device), torch.from_numpy(x).to(device), gb.type_id(qtype), ROWS)
    err = np.abs(got.double().cpu().numpy() - expect)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"error {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"


@pytest.mark.parametrize("rows, n", [(7, 13), (9, 600)])
@pytest.mark.parametrize("M", [1, 2, 5, 7])
@pytest.mark.parametrize("qtype", sorted(gb.FLOAT_TYPES))
def test_float_weights_of_any_shape(device, qtype, M, rows, n):
    """Float weights need no blocks: rows of any length (13: one vector of 8
    and a scalar tail; 600 = 9 x 64 + 3 x 8: the matvec's unrolled and
    single-vector steps) and any row count (not whole 4-row tiles), at batch
    sizes that leave one activation row after the passes of 2, within fp32
    rounding."""
    rng = np.random.default_rng([M, rows, n])
    raw = gb.random_blocks(rng, qtype, rows, n)
    W = gb.dequantize(raw, qtype).astype(np.float64)
    x = rng.standard_normal((M, n)).astype(np.float32)
    expect = x.astype(np.float64) @ W.T
    bound = 1e-6 * n * (np.abs(x.astype(np.float64)) @ np.abs(W).T) + 1e-30
    for op in (ops.ggml_mul_mat_vec_a8, ops.ggml_mul_mat_a8):
        got = op(torch.from_numpy(raw).to(device), torch.from_numpy(x).to(device), gb.type_id(qtype), rows)
        err = np.abs(got.double().cpu().numpy() - expect)
        assert np.all(err <= bound), f"{op}: max error over bound {np.max(err / bound):.3g}"


@pytest.mark.parametrize("qtype", sorted(gb.FLOAT_TYPES))
def test_float_weights_at_large_m_on_both_gemm_libraries(qtype):
    """Above 16 activation rows, float weights go to the fp32 GEMM library
    (cpu_float_gemm): F16 / BF16 rows widened in strips of about 8 MB of fp32
    (1024 rows of 2048 here: three strips, the last partial), F32 rows as
    they are. Every output within fp32 rounding of the exact product, on
    oneDNN's GEMM and on torch's BLAS alike, at row counts a strip does not
    divide."""
    default = ops.cpu_float_gemm()
    rng = np.random.default_rng(gb.type_id(qtype))
    try:
        for rows, n, M in ((2100, 2048, 17), (70, 13, 40)):
            raw = gb.random_blocks(rng, qtype, rows, n)
            W = gb.dequantize(raw, qtype).astype(np.float64)
            x = rng.standard_normal((M, n)).astype(np.float32)
            expect = x.astype(np.float64) @ W.T
            bound = 1e-6 * n * (np.abs(x.astype(np.float64)) @ np.abs(W).T) + 1e-30
            for library in ("onednn", "blas"):
                if library == "onednn" and default == "blas":
                    continue  # a torch without oneDNN
                assert ops.cpu_float_gemm(library) == library
                got = ops.ggml_mul_mat_a8(torch.from_numpy(raw), torch.from_numpy(x), gb.type_id(qtype), rows)
                err = np.abs(got.double().numpy() - expect)
                assert np.all(err <= bound), (rows, n, M, library, np.max(err / bound))
    finally:
        ops.cpu_float_gemm(default)


def test_float_weights_at_large_m_follow_float32_matmul_precision():
    """That GEMM is torch's, so it follows torch.set_float32_matmul_precision
    as torch.mm does: under "medium" both operands may be rounded to bf16
    (products within 2^-8 relative, fp32 sums), and where torch.mm rounds,
    the F16 weights' product rounds too; "highest" stays within fp32."""
    rng = np.random.default_rng(5)
    rows, n, M = 300, 512, 40
    raw = gb.random_blocks(rng, "F16", rows, n)
    W = gb.dequantize(raw, "F16").astype(np.float64)
    x = rng.standard_normal((M, n)).astype(np.float32)
    bound = np.abs(x.astype(np.float64)) @ np.abs(W).T
    w32, x32 = torch.from_numpy(W.astype(np.float32)), torch.from_numpy(x)
    saved = torch.get_float32_matmul_precision()
    got, mm = {}, {}
    try:
        for precision in ("highest", "medium"):
            torch.set_float32_matmul_precision(precision)
            got[precision] = ops.ggml_mul_mat_a8(torch.from_numpy(raw), x32, gb.type_id("F16"), rows)
            mm[precision] = x32 @ w32.T
    finally:
        torch.set_float32_matmul_precision(saved)
    for precision, tol in (("highest", 1e-6 * n), ("medium", 2.0**-7)):
        err = np.abs(got[precision].double().numpy() - x.astype(np.float64) @ W.T)
        assert np.all(err <= tol * bound), (precision, np.max(err / bound))
    # torch.mm has rounded its operands where its "medium" error passes 2^-14 of the bound (bf16's is near
    # 2^-11 here, fp32's below 2^-23); a change of library alone (MKL to oneDNN, both fp32) rounds nothing.
    if np.any(np.abs(mm["medium"].double().cpu().numpy() - x.astype(np.float64) @ W.T) > 2.0**-14 * bound):
        assert not torch.equal(got["highest"], got["medium"])


def test_q8_0_activations_are_quantized_like_llama_cpp():
    """With Q8_0 weights the a8 product is sum_b d_w * d_x * sum(q_w * q_x),
    where (q_x, d_x) is llama.cpp's Q8_0 quantization of x (gguf-py has the
    same quantizer), so it matches that sum up to fp32 accumulation."""
    from gguf import GGMLQuantizationType as QT
    from gguf import quants as gq

    rng = np.random.default_rng(7)
    raw = blocks("Q8_0")
    x = rng.standard_normal((2, N)).astype(np.float32)
    xq = gq.quantize(x, QT.Q8_0).reshape(2, -1, 34)
    wq = raw.reshape(ROWS, -1, 34)
    dx = xq[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # [2, blocks]
    dw = wq[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)  # [rows, blocks]
    qx = xq[..., 2:].view(np.int8).astype(np.int64)
    qw = wq[..., 2:].view(np.int8).astype(np.int64)
    isum = np.einsum("mbi,rbi->mrb", qx, qw)
    expect = np.einsum("mb,rb,mrb->mr", dx, dw, isum)
    got = ops.ggml_mul_mat_a8(torch.from_numpy(raw), torch.from_numpy(x), gb.type_id("Q8_0"), ROWS).double().numpy()
    bound = 1e-5 * np.einsum("mb,rb,mrb->mr", np.abs(dx), np.abs(dw), np.abs(isum)) + 1e-30
    assert np.all(np.abs(got - expect) <= bound)


def test_zero_activations_and_empty_batch(qtype):
    raw = torch.from_numpy(blocks(qtype))
    out = ops.ggml_mul_mat_a8(raw, torch.zeros(2, N), gb.type_id(qtype), ROWS)
    assert torch.equal(out, torch.zeros(2, ROWS))
    assert ops.ggml_mul_mat_vec_a8(raw, torch.zeros(0, N), gb.type_id(qtype), ROWS).shape == (0, ROWS)


def test_opcheck_and_compile():
    for name in ("Q4_0", "Q4_K", "IQ2_XS", "F16"):
        raw = torch.from_numpy(blocks(name))
        t = gb.type_id(name)
        torch.library.opcheck(ops.ggml_dequantize, (raw, t, ROWS, N, torch.float32))
        torch.library.opcheck(ops.ggml_dequantize, (raw, t, ROWS, N, None))
        for M in (1, 5):
            x = torch.randn(M, N)
            torch.library.opcheck(ops.ggml_mul_mat_vec_a8, (raw, x, t, ROWS))
            torch.library.opcheck(ops.ggml_mul_mat_a8, (raw, x.bfloat16(), t, ROWS))

    raw = torch.from_numpy(blocks("Q6_K"))

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x):
        return torch.relu(ops.ggml_mul_mat_a8(raw, x, gb.type_id("Q6_K"), ROWS)) + 1

    for M in (1, 6):
        x = torch.randn(M, N)
        torch.testing.assert_close(f(x), torch.relu(ops.ggml_mul_mat_a8(raw, x, gb.type_id("Q6_K"), ROWS)) + 1)


BAD = {
    # name: (call, exception, message)
    "W float": (lambda W, x: ops.ggml_mul_mat_a8(W.float(), x, 2, ROWS), RuntimeError, "ggml_mul_mat_a8: W must be Byte"),
    "W strided": (lambda W, x: ops.ggml_mul_mat_a8(W.t().contiguous().t(), x, 2, ROWS), RuntimeError,
                  "ggml_mul_mat_a8: W must be contiguous"),
    "too few bytes": (lambda W, x: ops.ggml_mul_mat_a8(W[:-1], x, 2, ROWS), ValueError,
                      r"ggml_mul_mat_a8: W has 3168 bytes but 12 rows of 512 Q4_0 weights need 3456 \(288 per row\)"),
    "too many rows": (lambda W, x: ops.ggml_mul_mat_vec_a8(W, x, 2, ROWS + 1), ValueError,
                      "ggml_mul_mat_vec_a8: W has 3456 bytes but 13 rows"),
    "X int": (lambda W, x: ops.ggml_mul_mat_a8(W, x.int(), 2, ROWS), RuntimeError, "ggml_mul_mat_a8: X must be float32"),
    "X 3-D": (lambda W, x: ops.ggml_mul_mat_a8(W, x[None], 2, ROWS), ValueError, "ggml_mul_mat_a8: X must be 2-D"),
    "X not whole blocks": (lambda W, x: ops.ggml_mul_mat_a8(W, x[:, :500], 2, ROWS), ValueError,
                           "ggml_mul_mat_a8: n=500 is not a multiple of the Q4_0 block size 32"),
    "bytes of another type": (lambda W, x: ops.ggml_mul_mat_a8(W, x, 8, ROWS), ValueError,
                              r"ggml_mul_mat_a8: W has 3456 bytes but 12 rows of 512 Q8_0 weights need 6528"),
    "removed type": (lambda W, x: ops.ggml_mul_mat_a8(W, x, 31, ROWS), ValueError,
                     "ggml_mul_mat_a8: type 31 is not a ggml weight type"),
    "negative rows": (lambda W, x: ops.ggml_dequantize(W, 2, -1, N, None), ValueError,
                      "ggml_dequantize: m must be non-negative, got -1"),
    "overflowing shape": (lambda W, x: ops.ggml_dequantize(W, 2, 2**62, 2**10, None), ValueError,
                          "ggml_dequantize: .* overflow int64"),
    # 4 * (2^62 + 1) bytes wrap to 4: refused before the byte count is compared.
    "overflowing F32 row": (lambda W, x: ops.ggml_dequantize(torch.zeros(4, dtype=torch.uint8), 0, 1, 2**62 + 1, None),
                            ValueError, r"ggml_dequantize: n=4611686018427387905 F32 weights per row overflow int64"),
    "dequantize bad dtype": (lambda W, x: ops.ggml_dequantize(W, 2, ROWS, N, torch.int32), RuntimeError,
                             "ggml_dequantize: dtype must be float32, float16 or bfloat16"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_inputs_raise_naming_the_argument(case):
    call, exc, pattern = BAD[case]
    W = torch.from_numpy(blocks("Q4_0"))
    with pytest.raises(exc, match=pattern):
        call(W, torch.randn(2, N))
