"""gptq_permute_rows / gptq_permute_cols against the NumPy reference."""
import numpy as np
import pytest
import torch

import gptq_reference as ref

K, N = 256, 96
ops = torch.ops.lowbit


def checkpoint(bits, seed=0, n=N):
    rng = np.random.default_rng([bits, seed])
    c = ref.random_checkpoint(rng, K, n, bits, 32, False, "gptq_v2", True)
    return rng, {k: torch.from_numpy(np.ascontiguousarray(c[k])) for k in ("qweight", "qzeros", "scales", "g_idx")}


@pytest.mark.parametrize("n", [N, 608])  # 608: the CPU kernel's column tiles of 256, the last one short
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_permute_rows(bits, n):
    rng, c = checkpoint(bits, n=n)
    perm = rng.permutation(K)
    got = ops.gptq_permute_rows(c["qweight"], torch.from_numpy(perm), bits)
    np.testing.assert_array_equal(got.numpy(), ref.pack(ref.unpack(c["qweight"].numpy(), bits, 0)[perm], bits, 0))
    back = ops.gptq_permute_rows(got, torch.from_numpy(np.argsort(perm)).int(), bits)
    assert torch.equal(back, c["qweight"])


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_permute_cols(bits):
    rng, c = checkpoint(bits)
    perm = rng.permutation(N)
    qweight, qzeros, scales = ops.gptq_permute_cols(c["qweight"], c["qzeros"], c["scales"], torch.from_numpy(perm), bits)
    assert torch.equal(qweight, c["qweight"][:, perm]) and torch.equal(scales, c["scales"][:, perm])
    np.testing.assert_array_equal(qzeros.numpy(), ref.pack(ref.unpack(c["qzeros"].numpy(), bits, 1)[:, perm], bits, 1))
    # The permuted layer computes the same outputs, in permuted order.
    x = torch.randn(3, K)
    before = ops.gptq_gemm(x, c["qweight"], c["qzeros"], c["scales"], c["g_idx"], False, True, bits)
    after = ops.gptq_gemm(x, qweight, qzeros, scales, c["g_idx"], False, True, bits)
    assert torch.equal(after, before[:, perm])


def test_opcheck():
    rng, c = checkpoint(3)
    torch.library.opcheck(ops.gptq_permute_rows, (c["qweight"], torch.from_numpy(rng.permutation(K)), 3))
    torch.library.opcheck(ops.gptq_permute_cols, (c["qweight"], c["qzeros"], c["scales"],
                                                  torch.from_numpy(rng.permutation(N)).int(), 3))


def test_bad_permutations():
    _, c = checkpoint(4)
    with pytest.raises(ValueError, match="gptq_permute_rows: perm must be a permutation of the K=256 rows, got 255"):
        ops.gptq_permute_rows(c["qweight"], torch.arange(255), 4)
    with pytest.raises(ValueError, match="gptq_permute_rows: perm is not a permutation: value 0 appears twice"):
        ops.gptq_permute_rows(c["qweight"], torch.zeros(K, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"gptq_permute_rows: perm values must lie in \[0, 256\)"):
        ops.gptq_permute_rows(c["qweight"], torch.arange(K) + 1, 4)
    with pytest.raises(ValueError, match="gptq_permute_cols: perm must be a permutation of the N=96 columns"):
        ops.gptq_permute_cols(c["qweight"], c["qzeros"], c["scales"], torch.arange(K), 4)
    with pytest.raises(ValueError, match="gptq_permute_cols: perm is not a permutation"):
        ops.gptq_permute_cols(c["qweight"], c["qzeros"], c["scales"], torch.ones(N, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="gptq_permute_cols: bit must be"):
        ops.gptq_permute_cols(c["qweight"], c["qzeros"], c["scales"], torch.arange(N), 6)
