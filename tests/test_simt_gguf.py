"""The CUDA GGUF matmul kernels (csrc/cuda/ggml_matvec_kernels.cuh,
ggml_mmq_kernel.cuh) run on the CPU emulator of the CUDA execution model
(tests/simt/simt.h), against the CPU's ggml_mul_mat_vec_a8 and ggml_mul_mat_id:
the activation quantizer (a warp per block, shuffles), the lane-group matvec
with the shared helpers' device paths (word loads, funnel shifts, __dp4a), the
device-side grouping of (token, slot) pairs by expert, and the int8
tensor-core kernel, dense and per expert (mma.sync m16n8k16 s8). The integer
sums are exact in both; only the order of the fp32 sums differs, hence the
tolerance. Built by simt_kernels.py.
"""
import numpy as np
import pytest
import torch

import gguf_blocks as gb
import simt_kernels

ops = torch.ops.lowbit
QUANTIZED = [name for name in gb.TYPES if name not in gb.FLOAT_TYPES]


@pytest.fixture(scope="module")
def emulated():
    return simt_kernels.load("gguf_kernels.cpp")


def _close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _close_rows(got, want):
    """_close on the rows of finite outputs; the others (those of a non-finite
    activation row) equal, NaN where the CPU's are NaN."""
    finite = torch.isfinite(want).all(dim=1)
    _close(got[finite], want[finite])
    torch.testing.assert_close(got[~finite], want[~finite], equal_nan=True)


@pytest.mark.parametrize("name", QUANTIZED)
def test_matvec_matches_the_cpu(emulated, name):
    """Every quantized type; 10 activation rows (a launch of 8, one of 2);
    rows that leave the last block's lane groups partly idle; a row of
    infinities (its blocks' non-finite form) and one of zeros."""
    rows, n = 37, 512
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(3), name, rows, n)).reshape(-1)
    x = torch.randn(10, n, generator=torch.Generator().manual_seed(4))
    x[6] = 0.0
    x[8, 100] = float("inf")
    want = ops.ggml_mul_mat_vec_a8(W, x, gb.type_id(name), rows)
    got = emulated.mul_mat(W, x, gb.type_id(name), rows, 3)
    _close_rows(got, want)


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped", "per-pair"])
@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q2_K", "MXFP4"])
@pytest.mark.parametrize("tokens, slots, per_slot", [(1, 2, False), (6, 3, False), (5, 2, True)])
def test_mul_mat_id_matches_the_cpu(emulated, name, tokens, slots, per_slot, grouped):
    """Each pair's product with its expert's rows, grouped by expert on the
    device (unchosen experts, an expert over one 8-pair pass, repeated
    experts) or a pass per pair."""
    experts, rows, n = 5, 24, 256
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(5), name, experts * rows, n)).view(experts, rows, -1)
    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, experts - 1, (tokens, slots), generator=g, dtype=torch.int32)  # expert 4 unchosen
    if tokens == 6:
        ids[:, :2] = 2  # two slots of every token on expert 2: 12+ pairs, two passes of 8
    x = torch.randn(*((tokens, slots, n) if per_slot else (tokens, n)), generator=g)
    want = ops.ggml_mul_mat_id(W, x, ids, gb.type_id(name), rows).view(-1, rows)
    got = emulated.mul_mat_id(W, x.reshape(-1, n), ids.reshape(-1), gb.type_id(name), rows, slots, per_slot, grouped,
                              False)
    _close(got, want)


def test_grouping_past_the_block_threads(emulated):
    """More experts (1500) than the grouping block's 1024 threads: a thread
    counts and lists two neighbouring experts, both chosen here, and the
    chosen ones reach the grouped matvec in expert order."""
    experts, rows, n = 1500, 8, 256
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(7), "Q4_0", experts * rows, n)).view(experts, rows, -1)
    ids = torch.tensor([[1001, 1000, 3], [1499, 1000, 1001], [2, 3, 1498]], dtype=torch.int32)
    x = torch.randn(3, n, generator=torch.Generator().manual_seed(7))
    want = ops.ggml_mul_mat_id(W, x, ids, gb.type_id("Q4_0"), rows).view(-1, rows)
    got = emulated.mul_mat_id(W, x, ids.reshape(-1), gb.type_id("Q4_0"), rows, 3, False, True, False)
    _close(got, want)


@pytest.mark.parametrize("name", QUANTIZED)
def test_mmq_matches_the_cpu(emulated, name):
    """The tensor-core kernel of every quantized type: 70 weight rows (a
    second row tile, mostly past the end), 70 activation rows (a second column
    tile, mostly past the end), a second 256-element stage of one block for the
    types of smaller blocks (of two for 256-element blocks), and an infinite
    and a zero activation row."""
    block = gb.block_shape(name)[0]
    rows, n, M = 70, 256 + (block if block < 256 else 256), 70
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(11), name, rows, n)).reshape(-1)
    x = torch.randn(M, n, generator=torch.Generator().manual_seed(12))
    x[3] = 0.0
    x[65, 7] = float("inf")
    want = ops.ggml_mul_mat_vec_a8(W, x, gb.type_id(name), rows)
    got = torch.empty(M, rows)
    emulated.mul_mat_mmq(W, x, gb.type_id(name), rows, 2, got)
    _close_rows(got, want)


def test_mmq_column_tiles_past_the_grid(emulated):
    """More activation tiles (3, M = 140) than the grid's column blocks (2):
    block 0 takes tiles 0 and 2, as the launch does past 65535 tiles."""
    rows, n, M = 24, 256, 140
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(13), "Q4_K", rows, n)).reshape(-1)
    x = torch.randn(M, n, generator=torch.Generator().manual_seed(14))
    want = ops.ggml_mul_mat_vec_a8(W, x, gb.type_id("Q4_K"), rows)
    got = torch.empty(M, rows)
    emulated.mul_mat_mmq(W, x, gb.type_id("Q4_K"), rows, 2, got)
    _close(got, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mmq_rounds_once_to_the_output_dtype(emulated, dtype):
    """fp16 / bf16 outputs: each the fp32 output rounded once, bit for bit."""
    rows, n, M = 20, 256, 9
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(17), "Q6_K", rows, n)).reshape(-1)
    x = torch.randn(M, n, generator=torch.Generator().manual_seed(18))
    want, got = torch.empty(M, rows), torch.empty(M, rows, dtype=dtype)
    emulated.mul_mat_mmq(W, x, gb.type_id("Q6_K"), rows, 1, want)
    emulated.mul_mat_mmq(W, x, gb.type_id("Q6_K"), rows, 1, got)
    assert torch.equal(got, want.to(dtype))


@pytest.mark.parametrize("per_slot", [False, True], ids=["per-token", "per-slot"])
@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "IQ2_XS", "TQ2_0"])
def test_mmq_per_expert_matches_the_cpu(emulated, name, per_slot):
    """The tensor-core tiles per chosen expert: 70 rows (two row tiles), 40
    tokens x 3 slots with expert 2 in two slots of every token (80+ pairs:
    two 64-pair tiles), expert 4 unchosen."""
    experts, rows, n, tokens, slots = 5, 70, 256, 40, 3
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(15), name, experts * rows, n)).view(experts, rows, -1)
    g = torch.Generator().manual_seed(16)
    ids = torch.randint(0, experts - 1, (tokens, slots), generator=g, dtype=torch.int32)
    ids[:, :2] = 2
    ids[::5, 0] = 3  # expert 3 first in some tokens' slots: a pair's place in its tile is not its slot
    x = torch.randn(*((tokens, slots, n) if per_slot else (tokens, n)), generator=g)
    want = ops.ggml_mul_mat_id(W, x, ids, gb.type_id(name), rows).view(-1, rows)
    got = emulated.mul_mat_id(W, x.reshape(-1, n), ids.reshape(-1), gb.type_id(name), rows, slots, per_slot, True, True)
    _close(got, want)
