"""gptq_gemm's CUDA kernels run on the CPU emulator of the CUDA execution model
(tests/simt/simt.h), against the NumPy GPTQ reference: the tensor-core kernel
(csrc/cuda/gptq_mma_kernel.cuh) and the fused CUDA-core one
(csrc/cuda/gptq_gemv_kernel.cuh).

The kernels' own source is compiled as host code: fragment layouts, bit
decoding, group handling, the cp.async pipeline and split-K run as written,
with mma.sync, cp.async and the warp votes and shuffles emulated from the PTX
ISA's definitions. What the emulator cannot check (the PTX strings themselves,
timing, memory-model subtleties beyond cp.async's two orders) the GPU runs of
tests/test_gptq_gemm.py check. Built by simt_kernels.py.
"""

import numpy as np
import pytest
import torch

import gptq_reference as ref
import simt_kernels
from test_gptq_gemm import assert_close_to_reference


@pytest.fixture(scope="module")
def emulated():
    return simt_kernels.load("gptq_kernels.cpp")


MMA_DTYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])


def _mma(emulated, a, b, c=None):
    c = torch.zeros(16, 8) if c is None else c
    return emulated.mma_tile(a, b, c.float()).double()


@MMA_DTYPES
def test_mma_tile_matches_the_product(emulated, dtype):
    """The emulated mma.sync.m16n8k16.row.col.f32.{f16,bf16} against A @ B + C,
    each lane's fragments built by gptq_kernels.cpp's mma_tile from the layout
    the PTX ISA gives (section "Matrix Fragments for mma.m16n8k16 with floating
    point type"; CUTLASS's cute MMA_Traits<SM80_16x8x16_F16F16F16F16_TN>, which
    the F32 accumulator traits inherit, states the same as (thread, value) ->
    (m, k) / (n, k) / (m, n) maps), not from the emulator or the kernels.

    A lane splits into group = lane // 4 (0..7) and tig = lane % 4. Its A
    fragment is 8 values in 4 registers, two to a register with the lower
    index in the low 16 bits: value i sits at row group (+ 8 where bit 1 of i
    is set) and column 2 * tig + (i & 1) (+ 8 where bit 2 is set), so the
    registers cover (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15),
    (rows 8-15, k 8-15). B (16 x 8, "col": a lane's values run down K) is 4
    values in 2 registers: value i at row 2 * tig + (i & 1) (+ 8 where bit 1 is
    set), column group. C and D are 4 fp32 values: value i at row group (+ 8
    for i >= 2), column 2 * tig + (i & 1).

    Identity and distinct-integer matrices place every element of A, B and D
    (a swapped row half, K half, register half or lane role moves a distinct
    value and fails exactly); small-integer sums are exact in fp32, so those
    compare with ==; random values compare within (K + 1) fp32 roundings of
    the sum of the terms' magnitudes, far below what a misplaced element adds.
    One misreading no product can show: the same permutation of K in A and B
    (both operands' register halves swapped, say) leaves A @ B as it is."""
    eye = torch.eye(16, dtype=dtype)
    a_ids = (torch.arange(256).reshape(16, 16) + 1).to(dtype)  # 1..256, exact in fp16 and bf16
    b_ids = (torch.arange(128).reshape(16, 8) + 1).to(dtype)
    c_ids = -(torch.arange(128).reshape(16, 8) + 1).float() * 1024
    # A = I: D is B itself, every B element in its place; C offsets every D element distinctly.
    assert torch.equal(_mma(emulated, eye, b_ids, c_ids), b_ids.double() + c_ids.double())
    # B picks A's columns 0-7, then 8-15: D is those columns of A.
    for half in (0, 1):
        pick = eye[:, 8 * half:8 * half + 8].contiguous()
        assert torch.equal(_mma(emulated, a_ids, pick), a_ids[:, 8 * half:8 * half + 8].double()), f"K half {half}"
    # One nonzero of A at a time (row m, column k) against B = distinct integers: D is row k of B in row m.
    for m in range(16):
        for k in range(16):
            a = torch.zeros(16, 16, dtype=dtype)
            a[m, k] = 1
            want = torch.zeros(16, 8, dtype=torch.float64)
            want[m] = b_ids[k].double()
            assert torch.equal(_mma(emulated, a, b_ids), want), f"A[{m}, {k}]"

    gen = torch.Generator().manual_seed(11)
    for _ in range(4):
        a = torch.randint(-8, 9, (16, 16), generator=gen).to(dtype)
        b = torch.randint(-8, 9, (16, 8), generator=gen).to(dtype)
        c = torch.randint(-64, 65, (16, 8), generator=gen).float()
        assert torch.equal(_mma(emulated, a, b, c), a.double() @ b.double() + c.double())
        a = torch.randn(16, 16, generator=gen).to(dtype)
        b = torch.randn(16, 8, generator=gen).to(dtype)
        c = torch.randn(16, 8, generator=gen)
        want = a.double() @ b.double() + c.double()
        bound = 17 * 2.0 ** -24 * (a.double().abs() @ b.double().abs() + c.double().abs())
        assert torch.all((_mma(emulated, a, b, c) - want).abs() <= bound)


def test_ldmatrix_gives_the_mma_a_fragment(emulated):
    """The kernel's A fragments come from one ldmatrix .x4 per m16 tile (the
    emulated instruction: lane 8i + r addresses row r of 8x8 matrix i; lane l
    gets elements 2 (l % 4), 2 (l % 4) + 1 of row l / 4 of each): every lane
    holds exactly the registers the m16n8k16 A layout names, the PTX ISA's
    a0..a7 at row group + 8 * bit 1, column 2 * tig + bit 0 + 8 * bit 2."""
    A = torch.arange(256, dtype=torch.int16).view(16, 16)
    got = emulated.a_fragments(A)
    for lane in range(32):
        group, tig = lane // 4, lane % 4
        for r in range(4):
            row, col = group + 8 * (r & 1), 2 * tig + 8 * (r >> 1)
            want = int(A[row, col]) | int(A[row, col + 1]) << 16
            assert int(got[lane, r]) & 0xFFFFFFFF == want, f"lane {lane}, a{2 * r}/a{2 * r + 1}"


K, N = 256, 272  # 4 pipeline chunks; 3 column tiles, the last of 16 columns


def _case(bits, fmt, group_size, act_order, seed, shape=(K, N)):
    """A random asymmetric checkpoint (every zero point in its range)."""
    rng = np.random.default_rng(seed)
    ckpt = ref.random_checkpoint(rng, *shape, bits, group_size, False, fmt, act_order)
    return {k: torch.from_numpy(np.ascontiguousarray(ckpt[k])) for k in ("qweight", "qzeros", "scales", "g_idx")}


def _layout(t, bits, layout):
    """qweight, g_idx and q_perm as gptq_gemm hands them to its kernels:
    shuffled weights (rows sorted by group, no g_idx, the activations read
    through q_perm), the checkpoint's rows with its g_idx, or trivial groups."""
    qweight, g_idx, perm = t["qweight"], t["g_idx"], torch.empty(0, dtype=torch.int32)
    if layout == "shuffled":
        perm = torch.argsort(g_idx, stable=True).to(torch.int32)
        qweight = qweight.clone()
        torch.ops.lowbit.gptq_shuffle(qweight, perm, bits)
    if layout != "unshuffled":
        g_idx = torch.empty(0, dtype=torch.int32)
    return qweight, g_idx, perm


def _run(emulated, a, t, bits, fmt, layout, splits=1, copies_at_issue=False):
    """The tensor-core kernel's output for a, which it takes in the weight's row order."""
    qweight, g_idx, perm = _layout(t, bits, layout)
    rows = a[:, perm.long()] if perm.numel() else a
    return emulated.gptq_mma(rows.contiguous(), qweight, t["qzeros"], t["scales"], g_idx, bits, fmt == "gptq_v2",
                             splits, copies_at_issue)


def _reference(t, bits, fmt, g_idx=None):
    g = t["g_idx"] if g_idx is None else g_idx
    return ref.dequantize(t["qweight"].numpy(), t["qzeros"].numpy(), t["scales"].numpy(), g.numpy(), bits, fmt)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"], ids=["v1", "v2"])
@pytest.mark.parametrize("layout,group_size", [("trivial", 32), ("trivial", 16), ("shuffled", 64), ("unshuffled", 64)])
def test_kernel_matches_the_reference(emulated, dtype, bits, fmt, layout, group_size):
    """Every bit width and zero format, both dtypes; sorted groups (one pass per
    k16 step) and act-order rows left unsorted (a pass per group in a step)."""
    t = _case(bits, fmt, group_size, layout != "trivial", [bits, group_size, len(fmt)])
    W = _reference(t, bits, fmt)
    # One m16 tile with 15 rows of padding; two with a partial second; four with a partial third and an empty fourth.
    for M in (1, 17, 40):
        a = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
        out = _run(emulated, a, t, bits, fmt, layout)
        assert out.dtype == dtype and out.shape == (M, N)
        assert_close_to_reference(out, a, W, f"{layout} M={M}")


@pytest.mark.parametrize("copies_at_issue", [False, True], ids=["copies-at-wait", "copies-at-issue"])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_pipeline_and_split_k(emulated, splits, copies_at_issue):
    """Whatever the split of K and whenever cp.async's copies land (the latest
    and the earliest a GPU may complete them), the same result; rows past M
    (M = 80: a second block of four m16 tiles, 16 rows of them real) stay out."""
    t = _case(4, "gptq_v2", 32, False, 7)
    W = _reference(t, 4, "gptq_v2")
    a = torch.randn(80, K, generator=torch.Generator().manual_seed(3)).to(torch.float16)
    out = _run(emulated, a, t, 4, "gptq_v2", "trivial", splits, copies_at_issue)
    assert_close_to_reference(out, a, W, f"splits={splits}")


@pytest.mark.parametrize("order", ["random", "sorted-17", "one-row-moved"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_any_g_idx(emulated, dtype, order):
    """Groups of unequal sizes: in any row order (every k16 step mixes groups);
    sorted in groups of 17 rows, whose boundaries fall on every row of a step
    in turn; and groups of 16 rows but for one row of step s, row s % 16, moved
    to the next group (each of a lane's four rows, in every lane, is once the
    only one of another group: the step takes a pass per group)."""
    rng = np.random.default_rng(5)
    t = _case(4, "gptq", 16, False, 5)
    if order == "random":
        g_idx = torch.from_numpy(rng.integers(0, K // 16, size=K).astype(np.int32))
    elif order == "sorted-17":
        g_idx = torch.arange(K, dtype=torch.int32) // 17
    else:
        g_idx = torch.arange(K, dtype=torch.int32) // 16
        moved = torch.arange(K // 16) * 17  # step s, row s % 16 (K // 16 == 16 steps)
        g_idx[moved] = (g_idx[moved] + 1) % (K // 16)
    W = _reference(t, 4, "gptq", g_idx)
    a = torch.randn(5, K, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = _run(emulated, a, dict(t, g_idx=g_idx), 4, "gptq", "unshuffled")
    assert_close_to_reference(out, a, W, f"{order} g_idx")


def test_an_infinite_activation_stays_in_its_group(emulated):
    """A step whose rows span groups zeroes the other groups' activations as
    well as their weights: an infinite activation reaches only its own output
    sums (inf where its weight is nonzero), never 0 * inf = NaN elsewhere."""
    t = _case(4, "gptq_v2", 16, False, 9)
    g_idx = (torch.arange(K, dtype=torch.int32) // 8) % (K // 16)  # 8-row groups: two per k16 step
    a = torch.randn(1, K, generator=torch.Generator().manual_seed(9)).to(torch.float16)
    a[0, 3] = float("inf")
    W = _reference(t, 4, "gptq_v2", g_idx)
    out = _run(emulated, a, dict(t, g_idx=g_idx), 4, "gptq_v2", "unshuffled")[0].double().numpy()
    w3 = W[3]
    assert np.all(np.isposinf(out[w3 > 0])) and np.all(np.isneginf(out[w3 < 0]))
    assert np.all(np.isnan(out[w3 == 0])), "inf times a zero weight is NaN, as in any product"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("layout,group_size", [("trivial", 64), ("trivial", 96), ("shuffled", 64), ("unshuffled", 64)])
def test_fused_kernel_matches_the_reference(emulated, dtype, bits, layout, group_size):
    """The fused kernel (fp32 activations, 3-bit, and K or groups the
    tensor-core kernel does not take): every bit width, each of its row
    counts per block (1, 2, 4, 8), two 512-row chunks the second partial (in
    two K splits), a partial column tile, groups that split a 3-bit pack of 32 rows (96), shuffled weights reading
    the activations through q_perm, unsorted act-order rows row by row."""
    K2, N2 = 576, 288  # 3-bit zeros pack 32 columns to 3 words
    t = _case(bits, "gptq_v2", group_size, layout != "trivial", [bits, group_size, len(layout)], (K2, N2))
    W = _reference(t, bits, "gptq_v2")
    qweight, g_idx, perm = _layout(t, bits, layout)
    for M in (1, 2, 3, 7):
        a = torch.randn(M, K2, generator=torch.Generator().manual_seed(M)).to(dtype)
        out = emulated.gptq_gemv(a, qweight, t["qzeros"], t["scales"], g_idx, perm, bits, True, 2)
        assert out.dtype == dtype and out.shape == (M, N2)
        assert_close_to_reference(out, a, W, f"{layout} M={M}")
