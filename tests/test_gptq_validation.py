"""Bad inputs to the GPTQ ops raise a clear error naming the argument.

Convention (csrc/gptq_checks.h): wrong dtype / device / layout -> RuntimeError,
wrong value / shape / bit width -> ValueError.
"""
import numpy as np
import pytest
import torch

import gptq_reference as ref

K, N, BITS = 256, 64, 4
ops = torch.ops.lowbit


@pytest.fixture
def ckpt():
    rng = np.random.default_rng(0)
    c = ref.random_checkpoint(rng, K, N, BITS, 32, False, "gptq_v2", True)
    return {k: torch.from_numpy(np.ascontiguousarray(c[k])) for k in ("qweight", "qzeros", "scales", "g_idx")}


def gemm_args(ckpt, **over):
    args = dict(
        a=torch.randn(3, K),
        b_q_weight=ckpt["qweight"],
        b_gptq_qzeros=ckpt["qzeros"],
        b_gptq_scales=ckpt["scales"],
        b_g_idx=ckpt["g_idx"],
        use_exllama=False,
        use_v2_format=True,
        bit=BITS,
    )
    args.update(over)
    return args


I32 = torch.int32
GEMM_CASES = {
    # name: (overrides, exception, message pattern)
    "bit 5": (lambda c: {"bit": 5}, ValueError, "bit must be 2, 3, 4 or 8"),
    "bit 0": (lambda c: {"bit": 0}, ValueError, "bit must be 2, 3, 4 or 8"),
    "a int": (lambda c: {"a": torch.ones(3, K, dtype=I32)}, RuntimeError, "a must be float32"),
    "a wrong K": (lambda c: {"a": torch.randn(3, K + 8)}, ValueError, r"a must be \[\.\.\., K=256\]"),
    "a 0-d": (lambda c: {"a": torch.tensor(1.0)}, ValueError, r"a must be \[\.\.\., K=256\]"),
    "qweight float": (lambda c: {"b_q_weight": c["qweight"].float()}, RuntimeError, "b_q_weight must be Int"),
    "qweight 1-D": (lambda c: {"b_q_weight": c["qweight"].flatten()}, ValueError, "b_q_weight must be 2-D"),
    "qweight strided": (lambda c: {"b_q_weight": c["qweight"].t().contiguous().t()}, RuntimeError,
                        "b_q_weight must be contiguous"),
    "qweight empty": (lambda c: {"b_q_weight": c["qweight"][:0]}, ValueError, "b_q_weight must be non-empty"),
    "qzeros int64": (lambda c: {"b_gptq_qzeros": c["qzeros"].long()}, RuntimeError, "b_gptq_qzeros must be Int"),
    "qzeros too few groups": (lambda c: {"b_gptq_qzeros": c["qzeros"][:-1].contiguous()}, ValueError,
                              r"b_gptq_qzeros must be \[groups=8"),
    "qzeros too narrow": (lambda c: {"b_gptq_qzeros": c["qzeros"][:, :-1].contiguous()}, ValueError,
                          "b_gptq_qzeros must be"),
    "scales int": (lambda c: {"b_gptq_scales": c["scales"].int()}, RuntimeError, "b_gptq_scales must be float32"),
    "scales zero groups": (lambda c: {"b_gptq_scales": c["scales"][:0]}, ValueError,
                           "b_gptq_scales must have at least one group"),
    "scales wrong N": (lambda c: {"b_gptq_scales": c["scales"][:, :-8].contiguous()}, ValueError,
                       r"b_gptq_scales must be \[groups, N=64\]"),
    "scales more groups than K": (lambda c: {"b_gptq_scales": torch.ones(K + 1, N, dtype=torch.float16)}, ValueError,
                                  "b_gptq_scales has 257 groups"),
    "g_idx float": (lambda c: {"b_g_idx": c["g_idx"].float()}, RuntimeError, "b_g_idx must be int32 or int64"),
    "g_idx short": (lambda c: {"b_g_idx": c["g_idx"][:-1]}, ValueError, "b_g_idx must have K=256 entries"),
    "g_idx 2-D": (lambda c: {"b_g_idx": c["g_idx"].view(2, -1)}, ValueError, "b_g_idx must be 1-D"),
    "g_idx negative": (lambda c: {"b_g_idx": c["g_idx"] - 1}, ValueError, r"b_g_idx values must lie in \[0, 8\)"),
    "g_idx too large": (lambda c: {"b_g_idx": c["g_idx"] + 1}, ValueError, r"b_g_idx values must lie in \[0, 8\)"),
    "g_idx int64 wraps": (lambda c: {"b_g_idx": c["g_idx"].long() + 2**32}, ValueError, "b_g_idx values must lie"),
    "perm out of range": (lambda c: {"use_exllama": True, "b_g_idx": torch.full((K,), K, dtype=I32)}, ValueError,
                          r"b_g_idx values must lie in \[0, 256\)"),
    "perm repeats a row": (lambda c: {"use_exllama": True, "b_g_idx": torch.zeros(K, dtype=I32)}, ValueError,
                           "b_g_idx is not a permutation: value 0 appears twice"),
    "uneven groups": (lambda c: {"b_g_idx": torch.empty(0, dtype=I32), "b_gptq_scales": c["scales"][:7].contiguous(),
                                 "b_gptq_qzeros": c["qzeros"][:7].contiguous()}, ValueError,
                      "K=256 is not a multiple of the 7 groups"),
    "uneven groups shuffled": (lambda c: {"use_exllama": True, "b_g_idx": torch.empty(0, dtype=I32),
                                          "b_gptq_scales": c["scales"][:7].contiguous(),
                                          "b_gptq_qzeros": c["qzeros"][:7].contiguous()}, ValueError,
                               "shuffled"),
}


@pytest.mark.parametrize("case", list(GEMM_CASES), ids=list(GEMM_CASES))
def test_gptq_gemm_rejects(ckpt, case):
    over, exc, pattern = GEMM_CASES[case]
    with pytest.raises(exc, match=f"gptq_gemm: .*{pattern}|gptq_gemm: {pattern}"):
        ops.gptq_gemm(**gemm_args(ckpt, **over(ckpt)))


def test_three_bit_shapes_must_hold_whole_packs():
    qweight = torch.zeros(4, 32, dtype=I32)  # 4 rows: not a multiple of 3 words
    scales = torch.ones(1, 32, dtype=torch.float16)
    qzeros = torch.zeros(1, 3, dtype=I32)
    with pytest.raises(ValueError, match="b_q_weight has 4 rows, not a multiple of 3"):
        ops.gptq_gemm(torch.randn(1, 32), qweight, qzeros, scales, torch.empty(0, dtype=I32), False, True, 3)
    qweight = torch.zeros(3, 16, dtype=I32)  # N=16: 3-bit zeros need N % 32 == 0
    with pytest.raises(ValueError, match="N=16 .* must be a multiple of 32"):
        ops.gptq_gemm(torch.randn(1, 32), qweight, qzeros, torch.ones(1, 16), torch.empty(0, dtype=I32), False, True, 3)


def test_dequantize_rejects(ckpt):
    with pytest.raises(ValueError, match="gptq_dequantize: bit must be"):
        ops.gptq_dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"], True, 7)
    with pytest.raises(ValueError, match=r"gptq_dequantize: b_g_idx values must lie in \[0, 8\)"):
        ops.gptq_dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"], ckpt["g_idx"] + 8, True, BITS)
    with pytest.raises(RuntimeError, match="gptq_dequantize: b_gptq_scales must be float32"):
        ops.gptq_dequantize(ckpt["qweight"], ckpt["qzeros"], ckpt["scales"].double(), ckpt["g_idx"], True, BITS)


def test_shuffle_rejects(ckpt):
    qweight = ckpt["qweight"].clone()
    perm = torch.arange(K, dtype=I32)
    with pytest.raises(ValueError, match="gptq_shuffle: bit must be"):
        ops.gptq_shuffle(qweight, perm, 6)
    with pytest.raises(RuntimeError, match="gptq_shuffle: q_weight must be Int"):
        ops.gptq_shuffle(qweight.float(), perm, BITS)
    with pytest.raises(ValueError, match="gptq_shuffle: q_perm must have K=256 entries"):
        ops.gptq_shuffle(qweight, perm[:-1], BITS)
    with pytest.raises(ValueError, match=r"gptq_shuffle: q_perm values must lie in \[0, 256\)"):
        ops.gptq_shuffle(qweight, perm + 1, BITS)
    dup = perm.clone()
    dup[5] = 4
    with pytest.raises(ValueError, match="gptq_shuffle: q_perm is not a permutation: value 4 appears twice"):
        ops.gptq_shuffle(qweight, dup, BITS)
    assert torch.equal(qweight, ckpt["qweight"]), "a rejected shuffle must leave the weight untouched"


def test_pack_and_unpack_reject():
    with pytest.raises(ValueError, match=r"gptq_pack: values must lie in \[0, 16\)"):
        ops.gptq_pack(torch.full((8, 8), 16, dtype=I32), 4, 0)
    with pytest.raises(ValueError, match=r"gptq_pack: values must lie in \[0, 16\)"):
        ops.gptq_pack(torch.full((8, 8), -1, dtype=I32), 4, 0)
    with pytest.raises(ValueError, match=r"gptq_pack: values.size\(0\)=12 must be a multiple of 8"):
        ops.gptq_pack(torch.zeros(12, 8, dtype=I32), 4, 0)
    with pytest.raises(ValueError, match="gptq_pack: dim must be 0 or 1"):
        ops.gptq_pack(torch.zeros(8, 8, dtype=I32), 4, 2)
    with pytest.raises(RuntimeError, match="gptq_pack: values must be Int"):
        ops.gptq_pack(torch.zeros(8, 8, dtype=torch.long), 4, 0)
    with pytest.raises(ValueError, match=r"gptq_unpack: packed.size\(1\)=4 must be a multiple of 3"):
        ops.gptq_unpack(torch.zeros(8, 4, dtype=I32), 3, 1)
    with pytest.raises(ValueError, match="gptq_unpack: packed must be 2-D"):
        ops.gptq_unpack(torch.zeros(8, dtype=I32), 4, 0)
