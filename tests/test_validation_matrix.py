"""The input-validation matrix: every op, every tensor argument, every way of
getting it wrong, generated from one table of what each op accepts.

For each op the table gives a valid call and, per tensor argument, the
dtypes it accepts, whether it must be contiguous and which dims may be empty.
Generated cases per tensor argument: every other dtype (RuntimeError), one
more and one fewer dimension (ValueError), a non-contiguous copy
(RuntimeError, or the same result where strides are accepted), and each
dimension emptied (ValueError, or an empty result where that is valid). Then
hand-written value cases per op: bit widths, group counts, index ranges,
non-permutations, byte counts of another type, sizes whose byte counts
overflow int64. Every rejection must be the documented exception type
(csrc/gptq_checks.h: dtype / device / layout -> RuntimeError, value / shape /
bit width -> ValueError) with a message that starts with the op's name and
names the argument. Device mixes are in tests/test_cuda_backend.py (they need
a GPU).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch

import lowbit

ops = torch.ops.lowbit
I32, F16, F32 = torch.int32, torch.float16, torch.float32
ALL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.uint8, torch.int8, torch.int16,
              torch.int32, torch.int64, torch.bool, torch.uint64, torch.complex64, torch.float8_e4m3fn)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
K, N, GS = 256, 64, 32  # GPTQ weight [K, N], 8 groups
GGML_ROWS, GGML_N, Q4_0, Q8_0, TQ2_0 = 12, 512, 2, 8, 35


@dataclass
class Arg:
    dtypes: tuple  # accepted dtypes
    contiguous: bool = True  # must be contiguous (else strides are accepted and give the same result)
    empty_ok: tuple = ()  # dims that may be empty (a valid empty call)
    rank_free: bool = False  # any rank is valid: activations [..., K], or raw GGUF bytes (only their count matters)
    # One more leading dim is another valid layout: the GPTQ matmuls' panels [N/64, rows, 64] (with N = 64, [1, rows, 64]).
    extra_dim_ok: bool = False


@dataclass
class Op:
    valid: Callable[[], dict]  # keyword arguments of a valid call
    args: dict  # tensor argument name -> Arg
    values: dict = field(default_factory=dict)  # case name -> (overrides(valid kwargs), exception, pattern)


def gptq_weight(bits=4):
    g = torch.Generator().manual_seed(0)
    rows = K * bits // 32
    words = lambda *shape: torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64).to(I32)
    return {"qweight": words(rows, N), "qzeros": words(K // GS, N * bits // 32),
            "scales": torch.rand(K // GS, N, generator=g).to(F16), "g_idx": (torch.arange(K) // GS).to(I32)}


def gemm():
    w = gptq_weight()
    return dict(a=torch.randn(3, K), b_q_weight=w["qweight"], b_gptq_qzeros=w["qzeros"], b_gptq_scales=w["scales"],
                b_g_idx=w["g_idx"], use_exllama=False, use_v2_format=True, bit=4)


def gemm_a8():
    kw = gemm()
    del kw["use_exllama"]
    return kw


def dequant():
    kw = gemm()
    del kw["a"], kw["use_exllama"]
    return kw


def ggml_blocks(type_id=Q4_0):
    block, type_bytes = ops.ggml_type_info(type_id)
    g = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (GGML_ROWS, GGML_N // block * type_bytes), generator=g, dtype=torch.uint8)
    raw.view(-1, type_bytes)[:, :2] = torch.tensor([0, 0x3C], dtype=torch.uint8)  # fp16 scale 1.0 per block
    return raw


BITS_CASES = {f"bit {b}": (lambda kw, b=b: {"bit": b}, ValueError, "bit must be 2, 3, 4 or 8") for b in (-1, 0, 1, 5, 16)}
PERM = lambda: torch.randperm(K, generator=torch.Generator().manual_seed(1)).to(I32)
NOT_A_PERM = lambda: torch.cat([torch.zeros(2, dtype=I32), torch.arange(2, K, dtype=I32)])
# Both GPTQ matmuls read the panel layout [N/64, rows, 64] on the CPU.
PANEL_CASES = {
    "panels of 32 columns": (lambda kw: {"b_q_weight": kw["b_q_weight"].view(-1, 2, 32).transpose(0, 1).contiguous()},
                             ValueError, "a 3-D b_q_weight is the panel layout"),
    "panels wider than the scales": (lambda kw: {"b_q_weight": torch.cat([kw["b_q_weight"][None]] * 2)},
                                     ValueError, "b_gptq_scales must be"),
    "b_q_weight 4-D": (lambda kw: {"b_q_weight": kw["b_q_weight"][None, None]}, ValueError,
                       "b_q_weight must be 2-D .* or the 3-D panel layout"),
}


OPS = {
    "gptq_gemm": Op(gemm, {
        "a": Arg(FLOATS, contiguous=False, empty_ok=(0,), rank_free=True),
        "b_q_weight": Arg((I32,), extra_dim_ok=True), "b_gptq_qzeros": Arg((I32,)), "b_gptq_scales": Arg(FLOATS),
        "b_g_idx": Arg((I32, torch.int64), contiguous=False, empty_ok=(0,)),
    }, {
        **BITS_CASES,
        **PANEL_CASES,
        "a has the wrong K": (lambda kw: {"a": torch.randn(3, K + 8)}, ValueError, "a must be"),
        "qweight rows of another bit width": (lambda kw: {"bit": 8}, ValueError, "b_gptq_qzeros|b_q_weight"),
        "qzeros one group short": (lambda kw: {"b_gptq_qzeros": kw["b_gptq_qzeros"][:-1].contiguous()}, ValueError,
                                   "b_gptq_qzeros"),
        "scales more groups than K": (lambda kw: {"b_gptq_scales": torch.ones(K + 1, N, dtype=F16),
                                                  "b_gptq_qzeros": torch.zeros(K + 1, N // 8, dtype=I32)},
                                      ValueError, "b_gptq_scales"),
        "g_idx negative": (lambda kw: {"b_g_idx": kw["b_g_idx"] - 1}, ValueError, r"b_g_idx values must lie in \[0, 8\)"),
        "g_idx past the groups": (lambda kw: {"b_g_idx": kw["b_g_idx"] + 1}, ValueError, "b_g_idx values must lie"),
        "g_idx int64 above 2^32": (lambda kw: {"b_g_idx": kw["b_g_idx"].long() + 2**32}, ValueError,
                                   "b_g_idx values must lie"),
        "g_idx short": (lambda kw: {"b_g_idx": kw["b_g_idx"][:-1]}, ValueError, "b_g_idx must have K=256"),
        "perm past K (shuffled layout)": (lambda kw: {"use_exllama": True, "b_g_idx": torch.full((K,), K, dtype=I32)},
                                          ValueError, "b_g_idx values must lie"),
        "groups do not divide K": (lambda kw: {"b_g_idx": torch.empty(0, dtype=I32),
                                               "b_gptq_scales": kw["b_gptq_scales"][:7].contiguous(),
                                               "b_gptq_qzeros": kw["b_gptq_qzeros"][:7].contiguous()},
                                   ValueError, "groups"),
    }),
    "gptq_gemm_a8": Op(gemm_a8, {
        "a": Arg(FLOATS, contiguous=False, empty_ok=(0,), rank_free=True),
        "b_q_weight": Arg((I32,), extra_dim_ok=True), "b_gptq_qzeros": Arg((I32,)), "b_gptq_scales": Arg(FLOATS),
        "b_g_idx": Arg((I32, torch.int64), contiguous=False, empty_ok=(0,)),
    }, {
        **BITS_CASES,
        "a has the wrong K": (lambda kw: {"a": torch.randn(3, K + 8)}, ValueError, "a must be"),
        **PANEL_CASES,
        "g_idx past the groups": (lambda kw: {"b_g_idx": kw["b_g_idx"] + 1}, ValueError, "b_g_idx values must lie"),
        "groups not contiguous": (lambda kw: {"b_g_idx": kw["b_g_idx"].flip(0).contiguous()}, ValueError,
                                  "b_g_idx must put the rows in contiguous groups"),
        "groups do not divide K": (lambda kw: {"b_g_idx": torch.empty(0, dtype=I32),
                                               "b_gptq_scales": kw["b_gptq_scales"][:7].contiguous(),
                                               "b_gptq_qzeros": kw["b_gptq_qzeros"][:7].contiguous()},
                                   ValueError, "groups"),
    }),
    "gptq_dequantize": Op(dequant, {
        "b_q_weight": Arg((I32,)), "b_gptq_qzeros": Arg((I32,)), "b_gptq_scales": Arg(FLOATS),
        "b_g_idx": Arg((I32, torch.int64), contiguous=False, empty_ok=(0,)),
    }, {
        **BITS_CASES,
        "g_idx past the groups": (lambda kw: {"b_g_idx": kw["b_g_idx"] + 8}, ValueError, "b_g_idx values must lie"),
        "g_idx negative": (lambda kw: {"b_g_idx": kw["b_g_idx"] - 1}, ValueError, "b_g_idx values must lie"),
        "scales one group short": (lambda kw: {"b_gptq_scales": kw["b_gptq_scales"][:-1].contiguous()}, ValueError,
                                   "b_gptq_qzeros|b_gptq_scales"),
    }),
    "gptq_shuffle": Op(lambda: {"q_weight": gptq_weight()["qweight"], "q_perm": PERM(), "bit": 4}, {
        "q_weight": Arg((I32,), empty_ok=(1,)), "q_perm": Arg((I32, torch.int64), contiguous=False, empty_ok=(0,)),
    }, {
        **BITS_CASES,
        "perm past K": (lambda kw: {"q_perm": kw["q_perm"] + 1}, ValueError, r"q_perm values must lie in \[0, 256\)"),
        "perm negative": (lambda kw: {"q_perm": kw["q_perm"] - 1}, ValueError, "q_perm values must lie"),
        "perm not a permutation": (lambda kw: {"q_perm": NOT_A_PERM()}, ValueError, "q_perm is not a permutation"),
        "perm short": (lambda kw: {"q_perm": kw["q_perm"][:-1]}, ValueError, "q_perm must have K=256"),
    }),
    "gptq_permute_rows": Op(lambda: {"qweight": gptq_weight()["qweight"], "perm": PERM(), "bit": 4}, {
        "qweight": Arg((I32,), empty_ok=(1,)), "perm": Arg((I32, torch.int64), contiguous=False),
    }, {
        **BITS_CASES,
        "perm past K": (lambda kw: {"perm": kw["perm"] + 1}, ValueError, "perm"),
        "perm negative": (lambda kw: {"perm": kw["perm"] - 1}, ValueError, "perm"),
        "perm not a permutation": (lambda kw: {"perm": NOT_A_PERM()}, ValueError, "perm"),
        "perm short": (lambda kw: {"perm": kw["perm"][:-1]}, ValueError, "perm"),
    }),
    "gptq_permute_cols": Op(lambda: {**{k: v for k, v in gptq_weight().items() if k != "g_idx"},
                                     "perm": torch.randperm(N, generator=torch.Generator().manual_seed(2)).to(I32),
                                     "bit": 4}, {
        "qweight": Arg((I32,)), "qzeros": Arg((I32,)), "scales": Arg(FLOATS),
        "perm": Arg((I32, torch.int64), contiguous=False),
    }, {
        **BITS_CASES,
        "perm past N": (lambda kw: {"perm": kw["perm"] + 1}, ValueError, "perm"),
        "perm not a permutation": (lambda kw: {"perm": torch.zeros(N, dtype=I32)}, ValueError, "perm"),
        "perm short": (lambda kw: {"perm": kw["perm"][:-1]}, ValueError, "perm"),
        "qzeros of another N": (lambda kw: {"qzeros": kw["qzeros"][:, :-1].contiguous()}, ValueError, "qzeros"),
    }),
    "gptq_pack": Op(lambda: {"values": torch.randint(0, 16, (64, 8), dtype=I32), "bit": 4, "dim": 0}, {
        "values": Arg((I32,), contiguous=False, empty_ok=(0, 1)),
    }, {
        **BITS_CASES,
        "value above 2^bit - 1": (lambda kw: {"values": torch.full((64, 8), 16, dtype=I32)}, ValueError, "values"),
        "negative value": (lambda kw: {"values": torch.full((64, 8), -1, dtype=I32)}, ValueError, "values"),
        "rows not whole words": (lambda kw: {"values": torch.zeros(60, 8, dtype=I32)}, ValueError, "values"),
        "dim 2": (lambda kw: {"dim": 2}, ValueError, "dim must be 0 or 1"),
        "dim -1": (lambda kw: {"dim": -1}, ValueError, "dim must be 0 or 1"),
    }),
    "gptq_unpack": Op(lambda: {"packed": torch.randint(-2**31, 2**31, (12, 8), dtype=torch.int64).to(I32), "bit": 3,
                               "dim": 0}, {
        "packed": Arg((I32,), contiguous=False, empty_ok=(0, 1)),
    }, {
        **BITS_CASES,
        "rows not whole 3-bit packs": (lambda kw: {"packed": kw["packed"][:10].contiguous()}, ValueError, "packed"),
        "dim 2": (lambda kw: {"dim": 2}, ValueError, "dim must be 0 or 1"),
    }),
    "ggml_dequantize": Op(lambda: {"W": ggml_blocks(), "type": Q4_0, "m": GGML_ROWS, "n": GGML_N, "dtype": F32}, {
        "W": Arg((torch.uint8,), rank_free=True),
    }, {
        "unknown type": (lambda kw: {"type": 4}, ValueError, "type 4 is not a ggml weight type"),
        "negative type": (lambda kw: {"type": -1}, ValueError, "type -1 is not a ggml weight type"),
        "bytes of another type": (lambda kw: {"type": Q8_0}, ValueError, "W has"),
        "n not whole blocks": (lambda kw: {"n": GGML_N - 16}, ValueError, "n=496 is not a multiple"),
        "negative m": (lambda kw: {"m": -1}, ValueError, "m must be non-negative"),
        "negative n": (lambda kw: {"n": -32}, ValueError, "n must be non-negative"),
        "m * n overflows": (lambda kw: {"m": 2**62, "n": 2**10}, ValueError, "overflow"),
        "row bytes overflow": (lambda kw: {"m": 1, "n": 2**63 - 2**5}, ValueError, "overflow|W has"),
        # 4 * (2^62 + 1) wraps to 4 bytes: refused before the byte count is compared.
        "F32 row bytes wrap": (lambda kw: {"W": torch.zeros(4, dtype=torch.uint8), "type": 0, "m": 1, "n": 2**62 + 1},
                               ValueError, "n=4611686018427387905 F32 weights per row overflow int64"),
        "integer dtype": (lambda kw: {"dtype": I32}, RuntimeError, "dtype must be float32, float16 or bfloat16"),
    }),
}


# The value cases of every GGUF matmul (W, X, type, row).
GGML_MATMUL_VALUES = {
    "unknown type": (lambda kw: {"type": 99}, ValueError, "type 99 is not a ggml weight type"),
    "bytes of another type": (lambda kw: {"type": Q8_0}, ValueError, "W has"),
    "more rows than W holds": (lambda kw: {"row": GGML_ROWS + 1}, ValueError, "W has"),
    "negative rows": (lambda kw: {"row": -1}, ValueError, "row must be non-negative"),
    "rows overflow": (lambda kw: {"row": 2**62}, ValueError, "overflow|W has"),
    "X not whole blocks": (lambda kw: {"X": kw["X"][..., :500].contiguous()}, ValueError, "n=500 is not a multiple"),
}


def ggml_mul_mat(op_name):
    return Op(lambda: {"W": ggml_blocks(), "X": torch.randn(2, GGML_N), "type": Q4_0, "row": GGML_ROWS}, {
        "W": Arg((torch.uint8,), rank_free=True), "X": Arg(FLOATS, contiguous=False, empty_ok=(0,)),
    }, dict(GGML_MATMUL_VALUES))


OPS["ggml_mul_mat_vec_a8"] = ggml_mul_mat("ggml_mul_mat_vec_a8")
OPS["ggml_mul_mat_a8"] = ggml_mul_mat("ggml_mul_mat_a8")
OPS["ggml_mul_mat_repacked"] = ggml_mul_mat("ggml_mul_mat_repacked")
NO_LAYOUT = (lambda kw: {"type": TQ2_0, "W": ggml_blocks(TQ2_0)}, ValueError, r"type 35 \(TQ2_0\) has no repacked layout")
OPS["ggml_mul_mat_repacked"].values["type without a repacked layout"] = NO_LAYOUT
GGML_EXPERTS = 3


def ggml_mul_mat_id():
    """3 experts of Q4_0 [GGML_ROWS, GGML_N], 2 tokens, 2 slots each."""
    return Op(lambda: {
        "W": torch.cat([ggml_blocks()] * GGML_EXPERTS).view(GGML_EXPERTS, GGML_ROWS, -1), "X": torch.randn(2, GGML_N),
        "ids": torch.tensor([[0, 2], [1, 0]], dtype=I32), "type": Q4_0, "row": GGML_ROWS}, {
        "W": Arg((torch.uint8,)), "X": Arg(FLOATS, contiguous=False),
        "ids": Arg((I32, torch.int64), contiguous=False, empty_ok=(1,)),  # no slots: an empty result
    }, {
        **GGML_MATMUL_VALUES,
        "X for other tokens": (lambda kw: {"X": torch.randn(3, GGML_N)}, ValueError, r"X must be \[tokens=2"),
        "X for other slots": (lambda kw: {"X": torch.randn(2, 3, GGML_N)}, ValueError, r"slots=2, n\]"),
        "expert past the last": (lambda kw: {"ids": torch.tensor([[0, 3], [1, 0]], dtype=I32)}, ValueError,
                                 r"ids values must lie in \[0, 3\), found min 0 and max 3"),
        "negative expert": (lambda kw: {"ids": torch.tensor([[0, -1], [1, 0]], dtype=I32)}, ValueError, "ids values"),
        "int64 expert that int32 would wrap": (lambda kw: {"ids": torch.tensor([[0, 2**32 + 1], [1, 0]])},
                                               ValueError, "ids values"),
    })


OPS["ggml_mul_mat_id"] = ggml_mul_mat_id()
OPS["ggml_mul_mat_id_repacked"] = ggml_mul_mat_id()
OPS["ggml_mul_mat_id_repacked"].values["type without a repacked layout"] = (
    lambda kw: {"type": TQ2_0, "W": torch.cat([ggml_blocks(TQ2_0)] * GGML_EXPERTS).view(GGML_EXPERTS, GGML_ROWS, -1)},
    ValueError, r"type 35 \(TQ2_0\) has no repacked layout")
OPS["ggml_quantize"] = Op(lambda: {"x": torch.randn(GGML_ROWS, GGML_N), "type": Q8_0}, {
    "x": Arg(FLOATS, empty_ok=(0, 1)),
}, {
    "unknown type": (lambda kw: {"type": 99}, ValueError, "type 99 is not a ggml weight type"),
    "type it does not write": (lambda kw: {"type": Q4_0}, ValueError, r"type 2 \(Q4_0\): lowbit writes Q8_0 \(8\) and Q6_K"),
    "n not whole blocks": (lambda kw: {"x": kw["x"][:, :-16].contiguous()}, ValueError,
                           r"x's rows \(n=496\) are not a multiple of the Q8_0 block size 32"),
    "NaN": (lambda kw: {"x": kw["x"].index_fill(1, torch.tensor([5]), float("nan"))}, ValueError,
            r"x holds a non-finite value \(nan\) at \[0, 5\]"),
    "scale beyond fp16": (lambda kw: {"x": kw["x"].index_fill(1, torch.tensor([40]), 1e8)}, ValueError,
                          r"x's block \[0, 32:64\] reaches magnitude 1e\+08"),
})
OPS["ggml_repack"] = Op(lambda: {"W": ggml_blocks(), "type": Q4_0, "row": GGML_ROWS, "n": GGML_N, "inverse": False}, {
    "W": Arg((torch.uint8,), rank_free=True),
}, {
    "unknown type": (lambda kw: {"type": 99}, ValueError, "type 99 is not a ggml weight type"),
    "bytes of another type": (lambda kw: {"type": Q8_0}, ValueError, "W has"),
    "more rows than W holds": (lambda kw: {"row": GGML_ROWS + 1}, ValueError, "W has"),
    "negative rows": (lambda kw: {"row": -1}, ValueError, "row must be non-negative"),
    "n not whole blocks": (lambda kw: {"n": GGML_N - 16}, ValueError, "n=496 is not a multiple"),
    "rows overflow": (lambda kw: {"row": 2**62}, ValueError, "overflow|W has"),
    "experts of other rows": (lambda kw: {"W": kw["W"].view(2, GGML_ROWS // 2, -1)}, ValueError,
                              "has 6 rows per expert, but row=12"),
    "type without a repacked layout": NO_LAYOUT,
})


def decode_attention():
    """9 query heads on 3 key-value heads of 64 values, row 5 of a 16-row cache."""
    g = torch.Generator().manual_seed(0)
    heads = lambda *shape: torch.randn(*shape, generator=g)
    return dict(q=heads(9, 64), k=heads(3, 64), v=heads(3, 64), cos=heads(64), sin=heads(64),
                key_cache=heads(3, 16, 64), value_cache=heads(3, 16, 64), position=5, scale=0.125)


OPS["rms_norm"] = Op(lambda: {"x": torch.randn(3, 96), "weight": torch.randn(96), "eps": 1e-6}, {
    "x": Arg(FLOATS, contiguous=False, empty_ok=(0,), rank_free=True),
    "weight": Arg(FLOATS, contiguous=False),
}, {
    "negative eps": (lambda kw: {"eps": -1e-6}, ValueError, "eps must be finite and non-negative"),
    "NaN eps": (lambda kw: {"eps": float("nan")}, ValueError, "eps must be finite and non-negative"),
    "weight of another length": (lambda kw: {"weight": kw["weight"][:95]}, ValueError, "weight must have x's last"),
})
OPS["decode_attention"] = Op(decode_attention, {
    name: Arg(FLOATS) for name in ("q", "k", "v", "cos", "sin", "key_cache", "value_cache")
}, {
    "position past the cache": (lambda kw: {"position": 16}, ValueError, r"position must lie in \[0, 16\)"),
    "negative position": (lambda kw: {"position": -1}, ValueError, "position must lie in"),
    "window past the position": (lambda kw: {"start": 6}, ValueError, r"start must lie in \[0, 5\].*got 6"),
    "negative soft cap": (lambda kw: {"softcap": -1.0}, ValueError, "softcap must be finite and >= 0"),
    "NaN soft cap": (lambda kw: {"softcap": float("nan")}, ValueError, "softcap must be finite and >= 0"),
    # Past fp32's range the kernels' cap is inf (NaN outputs); below its smallest value, 0 (no cap at all).
    "soft cap past fp32": (lambda kw: {"softcap": 1e39}, ValueError,
                           r"softcap must be finite and >= 0 \(0: none\) in fp32 \(0 or in \[1\.4013e-45, "
                           r"3\.40282e\+38\]\), got 1e\+39"),
    "soft cap below fp32": (lambda kw: {"softcap": 1e-46}, ValueError, "softcap must be finite and >= 0 .* got 1e-46"),
    "sinks for other heads": (lambda kw: {"sinks": torch.zeros(3)}, ValueError,
                              r"sinks must have one entry per query head \(9\), got 3"),
    "sinks of another dtype": (lambda kw: {"sinks": torch.zeros(9, dtype=torch.float64)}, RuntimeError,
                               "sinks must be Float"),
    "sinks of two dims": (lambda kw: {"sinks": torch.zeros(9, 1)}, ValueError, "sinks"),
    "sinks in the cache": (lambda kw: {"sinks": kw["key_cache"][0, 0, :9]}, RuntimeError,
                           "key_cache shares memory with sinks"),
    "negative window start": (lambda kw: {"start": -1}, ValueError, "start must lie in"),
    "heads not a multiple": (lambda kw: {"q": kw["q"][:8].contiguous()}, ValueError, "multiple of k's 3"),
    "odd head size": (lambda kw: {k: v[..., :63].contiguous() if isinstance(v, torch.Tensor) else v
                                  for k, v in kw.items()}, ValueError, "head size must be even"),
    "v of another shape": (lambda kw: {"v": kw["v"][:2].contiguous()}, ValueError, "k and v must be"),
    "cache of another head size": (lambda kw: {"key_cache": kw["key_cache"][..., :32].contiguous()}, ValueError,
                                   "key_cache must be"),
    "caches of other shapes": (lambda kw: {"value_cache": kw["value_cache"][:, :8].contiguous()}, ValueError,
                               "value_cache must have key_cache's shape"),
    "tables longer than a head": (lambda kw: {"cos": torch.ones(66), "sin": torch.zeros(66)}, ValueError,
                                  r"cos and sin must have one even number of entries in \[2, 64\].*got 66 and 66"),
    "tables of odd length": (lambda kw: {"cos": kw["cos"][:63].contiguous(), "sin": kw["sin"][:63].contiguous()},
                             ValueError, "cos and sin must have one even number of entries"),
    "tables of two lengths": (lambda kw: {"sin": kw["sin"][:32].contiguous()}, ValueError, "got 64 and 32"),
    "empty tables": (lambda kw: {"cos": kw["cos"][:0], "sin": kw["sin"][:0]}, ValueError,
                     "cos and sin must have one even number of entries"),
    "infinite scale": (lambda kw: {"scale": float("inf")}, ValueError, "scale must be finite"),
    "scale past fp32": (lambda kw: {"scale": -1e39}, ValueError,
                        r"scale must be finite in fp32 \(\|scale\| <= 3\.40282e\+38\), got -1e\+39"),
    "caches sharing memory": (lambda kw: {"value_cache": kw["key_cache"]}, RuntimeError,
                              "key_cache shares memory with value_cache"),
    "k in the cache": (lambda kw: {"k": kw["key_cache"][:, 0]}, RuntimeError, "key_cache shares memory with k|k must"),
})


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """The same values in a non-contiguous tensor (every other element of a wider buffer)."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype) if t.dim() else None
    if wide is None:
        return t
    wide[..., ::2] = t
    return wide[..., ::2]


def generated_cases():
    """(op, case id, overrides(kw), expectation): expectation is (exception, pattern) or "accepted"."""
    for op_name, op in OPS.items():
        valid = op.valid()
        for arg, spec in op.args.items():
            t = valid[arg]
            for dtype in ALL_DTYPES:
                if dtype not in spec.dtypes:
                    yield op_name, f"{arg} {str(dtype)[6:]}", (lambda kw, a=arg, d=dtype: {a: kw[a].to(d)}), \
                        (RuntimeError, f"{arg} must be")
            if not spec.rank_free:
                yield op_name, f"{arg} one more dim", (lambda kw, a=arg: {a: kw[a][None]}), \
                    ("accepted" if spec.extra_dim_ok else (ValueError, arg))
                yield op_name, f"{arg} one fewer dim", \
                    (lambda kw, a=arg: {a: kw[a].flatten() if kw[a].dim() > 1 else kw[a][0]}), (ValueError, arg)
            yield op_name, f"{arg} non-contiguous", (lambda kw, a=arg: {a: strided_copy(kw[a])}), \
                ("accepted" if not spec.contiguous else (RuntimeError, f"{arg} must be contiguous"))
            # An emptied tensor may contradict another argument first (an empty
            # qweight leaves K=0 rows for the permutation); either may be named.
            for d in range(t.dim()):
                yield op_name, f"{arg} dim {d} empty", (lambda kw, a=arg, d=d: {a: kw[a].narrow(d, 0, 0)}), \
                    ("accepted" if d in spec.empty_ok else (ValueError, "|".join(op.args)))
        for case, (over, exc, pattern) in op.values.items():
            yield op_name, case, over, (exc, pattern)


CASES = list(generated_cases())


@pytest.mark.parametrize("op_name, case, over, expect", CASES, ids=[f"{o}: {c}" for o, c, _, _ in CASES])
def test_validation_matrix(op_name, case, over, expect):
    kw = OPS[op_name].valid()
    call = getattr(ops, op_name)
    bad = {**kw, **over(kw)}
    if expect == "accepted":  # a valid call after all: the result of its contiguous twin
        twin = {**kw, **{k: v.contiguous() for k, v in over(kw).items()}}
        got, want = call(**bad), call(**twin)
        for g, w in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            assert (g is None and w is None) or torch.equal(g, w)
        for name in OPS[op_name].args:  # in-place ops (gptq_shuffle): the same tensors afterwards too
            assert torch.equal(bad[name].contiguous(), twin[name])
        return
    exc, pattern = expect
    with pytest.raises(exc, match=f"^{op_name}: .*({pattern})") as info:
        call(**bad)
    assert type(info.value) is exc or (exc is ValueError and isinstance(info.value, ValueError)), info.value


# Rejections that depend on tensor values, which a fake kernel never sees
# (memory shared with a written cache is not one: fake tensors keep their
# real ones' storages and offsets).
VALUE_CASES = {"g_idx negative", "g_idx past the groups", "g_idx int64 above 2^32", "perm past K (shuffled layout)",
               "perm past K", "perm negative", "perm not a permutation", "perm past N", "value above 2^bit - 1",
               "negative value", "expert past the last", "negative expert", "int64 expert that int32 would wrap",
               "groups not contiguous", "NaN", "scale beyond fp16"}
SHAPE_CASES = [c for c in CASES if c[3] != "accepted" and c[1] not in VALUE_CASES]


@pytest.mark.parametrize("op_name, case, over, expect", SHAPE_CASES, ids=[f"{o}: {c}" for o, c, _, _ in SHAPE_CASES])
def test_fake_kernels_refuse_what_the_kernels_refuse(op_name, case, over, expect):
    """Under FakeTensorMode (torch.compile's tracing, opcheck) each shape,
    dtype and layout rejection raises what the real kernel raises, so a bad
    call fails at trace time instead of returning a shape."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    kw = OPS[op_name].valid()
    bad = {**kw, **over(kw)}
    exc, pattern = expect
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in bad.items()}
        with pytest.raises(exc, match=f"^{op_name}: .*({pattern})") as info:
            getattr(ops, op_name)(**fake)
    assert type(info.value) is exc or (exc is ValueError and isinstance(info.value, ValueError)), info.value
    with pytest.raises(exc) as real:
        getattr(ops, op_name)(**bad)
    assert str(real.value).splitlines()[0] == str(info.value).splitlines()[0]


def test_the_matrix_covers_every_op():
    # The dispatcher's list: dir(torch.ops.lowbit) holds only the ops already called.
    declared = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("lowbit::")}
    # no tensors: test_scalar_ops_reject_bad_values
    declared -= {"ggml_type_info", "ggml_type_name", "ggml_has_repacked_layout", "ggml_cpu_traits", "cpu_isa",
                 "cpu_bf16_kernel", "cpu_float_gemm", "cpu_reads_repacked", "cpu_threads", "cpu_team",
                 "cpu_torch_threads"}
    assert declared <= set(OPS), declared - set(OPS)
    assert len(CASES) >= 200, len(CASES)


def test_scalar_ops_reject_bad_values():
    with pytest.raises(ValueError, match="^ggml_type_info: type 4 is not a ggml weight type"):
        ops.ggml_type_info(4)
    with pytest.raises(ValueError, match="^ggml_type_name: type 4 is not a ggml weight type"):
        ops.ggml_type_name(4)
    with pytest.raises(ValueError, match="^ggml_has_repacked_layout: type 4 is not a ggml weight type"):
        ops.ggml_has_repacked_layout(4)
    for bad in (4, -1, 1000):
        with pytest.raises(ValueError, match=f"^ggml_cpu_traits: type {bad} is not a ggml weight type"):
            ops.ggml_cpu_traits(bad)
    assert ops.ggml_has_repacked_layout(Q4_0) and not ops.ggml_has_repacked_layout(TQ2_0)
    with pytest.raises(ValueError, match="^cpu_isa: unknown ISA 'sse9'"):
        ops.cpu_isa("sse9")
    with pytest.raises(ValueError, match="^cpu_bf16_kernel: unknown mode 'fast'"):
        ops.cpu_bf16_kernel("fast")
    with pytest.raises(ValueError, match="^cpu_float_gemm: unknown library 'mkl'"):
        ops.cpu_float_gemm("mkl")
    for bad in (-1, 1025):
        with pytest.raises(ValueError, match=f"^cpu_threads: threads must be 0 .* got {bad}"):
            ops.cpu_threads(bad)
    # lowbit.ops' wrapper: the op's schema reads True as 1 thread, and refuses a float or str by a RuntimeError.
    for bad in (-1, True, 2.0, "2"):
        with pytest.raises(ValueError, match=f"^cpu_threads: threads must be 0 .* got {re.escape(repr(bad))}$"):
            lowbit.ops.cpu_threads(bad)
    assert lowbit.ops.cpu_threads(np.int64(0)) == 0
    for bad in (0, -1, 8193):
        with pytest.raises(ValueError, match=f"^cpu_torch_threads: threads must be 1 to 8192, got {bad}$"):
            ops.cpu_torch_threads(bad)
    for bad in (0, True, 2.0, "2"):
        says = f"^cpu_torch_threads: threads must be 1 to 8192, got {re.escape(repr(bad))}$"
        with pytest.raises(ValueError, match=says):
            lowbit.ops.cpu_torch_threads(bad)
    with pytest.raises(ValueError, match="^cpu_team: unknown team 'omp'"):
        ops.cpu_team("omp")
    for bad in (4, -1, 1000):
        with pytest.raises(ValueError, match=f"^cpu_reads_repacked: type {bad} is not a ggml weight type"):
            ops.cpu_reads_repacked(bad)


def test_cpu_torch_threads_stops_at_linux_s_most_cpus():
    """More threads than Linux has CPUs never run at once, and a count near the pid space (32768 by default) makes
    libgomp's first parallel region fail to start them and exit the process: refused instead. The bound itself is
    taken; no parallel region runs before the caller's count is back."""
    saved = torch.get_num_threads()
    try:  # a count an unfixed op took stays off later tests' parallel regions
        for threads in (8193, 65536, 2**31):
            for op in (ops.cpu_torch_threads, lowbit.ops.cpu_torch_threads):
                with pytest.raises(ValueError, match=f"^cpu_torch_threads: threads must be 1 to 8192, got {threads}$"):
                    op(threads)
        assert lowbit.ops.cpu_torch_threads(8192) == 8192
    finally:
        assert lowbit.ops.cpu_torch_threads(saved) == saved
