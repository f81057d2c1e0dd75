"""Weights whose rows, experts or columns lie past 2^31 (and 2^32) bytes or
elements: a 32-bit `row * row_bytes`, `expert * rows * row_bytes` or `k * N`
would read other rows there. The weights are NumPy zeros (calloc: pages
never written stay unallocated and read as zeros), so only the far rows
cost memory; those rows hold real blocks, and the results for them must be
the op's own results on a weight of just those rows."""
import numpy as np
import pytest
import torch

import gguf_blocks as gb
import gptq_reference as gr
import lowbit  # noqa: F401  (registers torch.ops.lowbit)

N = 4096        # weights per row
FAR = 32        # rows with data at the end of the weight
PAST = 2**32 + 2**20  # the far rows start past this byte offset


def lazy_zeros(nbytes, dtype=np.uint8):
    """A zero tensor whose untouched pages take no memory."""
    return torch.from_numpy(np.zeros(nbytes // np.dtype(dtype).itemsize, dtype=dtype))


def blocks(rng, name, rows):
    return torch.from_numpy(np.ascontiguousarray(gb.random_blocks(rng, name, rows, N)).reshape(-1).copy())


def row_bytes(name):
    block, nbytes = gb.block_shape(name)
    return N // block * nbytes


def has_repacked_layout(name):
    return torch.ops.lowbit.ggml_has_repacked_layout(gb.type_id(name))


ROW_TYPES = ["F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ2_XXS"]
ROW_CASES = [(name, "ggml_mul_mat_vec_a8") for name in ROW_TYPES]
ROW_CASES += [(name, "ggml_mul_mat_repacked") for name in ROW_TYPES if has_repacked_layout(name)]
EXPERT_TYPES = ["Q4_0", "Q4_K", "F16"]
EXPERT_CASES = [(name, False) for name in EXPERT_TYPES] + [(n, True) for n in EXPERT_TYPES if has_repacked_layout(n)]


def check_far_rows(name, op, M):
    t = gb.type_id(name)
    repacked = op == "ggml_mul_mat_repacked"
    rb = row_bytes(name)
    rows = (PAST // rb + FAR + 15) // 16 * 16  # whole 16-row tiles: the far rows are the last two
    rng = np.random.default_rng(7)
    tail = blocks(rng, name, FAR)
    if repacked:
        tail = torch.ops.lowbit.ggml_repack(tail, t, FAR, N)
    W = lazy_zeros(rows * rb)
    W[-FAR * rb:] = tail
    X = torch.from_numpy(rng.standard_normal((M, N)).astype(np.float32))
    run = getattr(torch.ops.lowbit, op)
    out = run(W, X, t, rows)
    assert torch.equal(out[:, -FAR:], run(tail, X, t, FAR))
    assert not out[:, -FAR:].eq(0).all()
    assert out[:, :-FAR].eq(0).all()


@pytest.mark.parametrize("name, op", ROW_CASES)
def test_rows_past_4gib(cpu_isa, name, op):
    check_far_rows(name, op, 3)


@pytest.mark.parametrize("name, op", [("F16", "ggml_mul_mat_a8"), ("Q4_0", "ggml_mul_mat_a8"),
                                      ("Q4_K", "ggml_mul_mat_repacked")])
def test_gemm_rows_past_4gib(name, op):
    """20 activation rows: the best ISA's GEMM kernels (the fp32 library for F16)."""
    check_far_rows(name, op, 20)


@pytest.mark.parametrize("name, repacked", EXPERT_CASES)
def test_experts_past_4gib(cpu_isa, name, repacked):
    t = gb.type_id(name)
    row = 64
    expert_bytes = row * row_bytes(name)
    experts = PAST // expert_bytes + 2
    chosen = [experts - 1, 2**31 // expert_bytes + 1]  # past 2^32 and past 2^31 bytes
    rng = np.random.default_rng(11)
    small = torch.stack([blocks(rng, name, row) for _ in chosen]).view(2, row, -1)
    if repacked:
        small = torch.ops.lowbit.ggml_repack(small, t, row, N)
    W = lazy_zeros(experts * expert_bytes).view(experts, row, -1)
    for e, weight in zip(chosen, small):
        W[e] = weight
    X = torch.from_numpy(rng.standard_normal((5, N)).astype(np.float32))
    slot = torch.tensor([[0, 1], [1, 0], [0, 0], [1, 1], [0, 1]])
    run = torch.ops.lowbit.ggml_mul_mat_id_repacked if repacked else torch.ops.lowbit.ggml_mul_mat_id
    out = run(W, X, torch.tensor(chosen)[slot], t, row)
    assert torch.equal(out, run(small, X, slot, t, row))
    assert not out.eq(0).all()


def available_bytes():
    """MemAvailable of /proc/meminfo, or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


@pytest.mark.parametrize("M", [1, 5])
def test_gptq_columns_past_2g_fields(cpu_isa, M):
    """4-bit K x N with K * N > 2^31: the last 64 columns against the NumPy reference. Writing those
    columns touches a page of every qweight row, about 1.4 GB in all with transparent huge pages."""
    available = available_bytes()
    if available is not None and available < 4 * 2**30:
        pytest.skip(f"needs about 1.4 GB; this machine has {available / 2**30:.1f} GB available")
    bits, K, N_cols, far, group = 4, 16384, 2**17 + 2**12, 64, 128
    rng = np.random.default_rng(3)
    ck = gr.random_checkpoint(rng, K, far, bits, group, False, "gptq_v2", False)
    qweight = lazy_zeros(K * bits // 32 * N_cols * 4, np.int32).view(K * bits // 32, N_cols)
    qweight[:, -far:] = torch.from_numpy(ck["qweight"].astype(np.int32))
    qzeros = torch.zeros(K // group, N_cols * bits // 32, dtype=torch.int32)
    qzeros[:, -far * bits // 32:] = torch.from_numpy(ck["qzeros"].astype(np.int32))
    scales = torch.zeros(K // group, N_cols, dtype=torch.float32)
    scales[:, -far:] = torch.from_numpy(ck["scales"].astype(np.float32))
    a = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
    out = torch.ops.lowbit.gptq_gemm(a, qweight, qzeros, scales, torch.empty(0, dtype=torch.int32), False, True, bits)
    W = gr.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], None, bits, "gptq_v2")
    a64 = a.double().numpy()
    # tests/README.md's gptq_gemm tolerance for fp32 accumulation.
    tol = 1e-5 * (np.abs(a64) @ np.abs(W))
    np.testing.assert_array_less(np.abs(out[:, -far:].double().numpy() - a64 @ W), tol + 1e-30)
    assert out[:, :-far].eq(0).all()
