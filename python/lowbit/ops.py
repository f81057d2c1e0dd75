"""lowbit's operators as typed Python functions, and their fake kernels.

Each function here calls its op, `torch.ops.lowbit.<name>`, with the same
arguments in the same order as the schema (csrc/ops/schemas.cpp), and does
nothing else: it exists for type hints, docstrings and a named ggml type
(`GGMLType`), so `lowbit.ops.ggml_mul_mat_a8(W, X, GGMLType.Q4_K, rows)` and
`torch.ops.lowbit.ggml_mul_mat_a8(W, X, 12, rows)` are the same call. csrc/README.md
("The operators in detail") has the full semantics.

Beside each function is its op's fake (meta) kernel: output shapes and dtypes,
so the ops trace under torch.compile and pass torch.library.opcheck. Each fake
kernel refuses what the real kernels refuse from shapes, dtypes, devices and
layouts alone, with the same exception class and message
(csrc/ops/gptq_checks.h, ggml_checks.h: RuntimeError for dtype, device and
layout, ValueError for values and shapes), so a bad call fails at trace time
rather than when the compiled graph runs. Checks of tensor values (index
ranges, permutations, packed values) stay with the real kernels.
"""
from __future__ import annotations

import enum
import math
import re
from functools import lru_cache
from typing import List, Optional, Tuple, Union

import torch
from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true, sym_and, sym_or

from ._checks import is_integer
from .gptq.packing import PANEL_COLS, fields_per_pack, words_per_pack

Tensor = torch.Tensor
# A SymInt argument: an int, or a symbolic size while torch.compile traces.
SymInt = Union[int, torch.SymInt]

__all__ = [
    "GGMLType", "cpu_bf16_kernel", "cpu_float_gemm", "cpu_isa", "cpu_reads_repacked", "cpu_team", "cpu_threads",
    "cpu_torch_threads", "ggml_cpu_traits",
    "ggml_dequantize", "ggml_has_repacked_layout", "ggml_mul_mat_a8", "ggml_mul_mat_id", "ggml_mul_mat_id_repacked",
    "ggml_mul_mat_repacked", "ggml_mul_mat_vec_a8", "ggml_quantize", "ggml_repack", "ggml_type_info", "ggml_type_name",
    "gptq_dequantize", "gptq_gemm", "gptq_gemm_a8", "gptq_pack", "gptq_permute_cols", "gptq_permute_rows",
    "gptq_shuffle", "gptq_unpack", "decode_attention", "rms_norm",
]


def _ggml_types() -> List[Tuple[str, int]]:
    """(name, id) of every ggml weight type the C++ type table holds: the ids
    ggml_type_name answers (ggml's ids are far below 64)."""
    members = []
    for type_id in range(64):
        try:
            members.append((torch.ops.lowbit.ggml_type_name(type_id), type_id))
        except ValueError:
            pass
    return members


GGMLType = enum.IntEnum("GGMLType", _ggml_types(), module=__name__, qualname="GGMLType")
GGMLType.__doc__ = """The ggml weight types lowbit supports, ggml's names and ids (GGMLType.Q4_K == 12),
from the C++ type table (LOWBIT_GGML_TYPES in csrc/core/ggml_types.h). An int: every op and
layer that takes a type id takes a member."""
# str() of a member is its id on every Python (as IntEnum's is from 3.11), so messages
# that print a type (the fake kernels') read the same for a member as for its int.
GGMLType.__str__ = int.__repr__


# ---------------------------------------------------------------------------
# Checks the fake kernels share: each mirrors a C++ check of csrc/ops/*_checks.h.
# ---------------------------------------------------------------------------

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)
# c10::ScalarType's names, as the C++ messages print dtypes.
_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
          torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
          torch.bool: "Bool", torch.complex32: "ComplexHalf", torch.complex64: "ComplexFloat",
          torch.complex128: "ComplexDouble"}


def _dtype_name(dtype: torch.dtype) -> str:
    """c10's name of a dtype, as the C++ checks print it (UInt16, Float8_e4m3fn, ...)."""
    if dtype in _NAMES:
        return _NAMES[dtype]
    name = str(dtype).removeprefix("torch.")
    if m := re.fullmatch(r"(u?)int(\d+)", name):
        return ("UInt" if m[1] else "Int") + m[2]
    return name[:1].upper() + name[1:]


# A condition on a size unknown until the call (data-dependent: rows gathered
# by a mask) counts as met while tracing: the kernel checks it at the call, in
# its own words, where a deferred assertion would fail naming only symbols.
def _value(cond, op: str, *msg) -> None:
    torch._check_value(guard_or_true(cond), lambda: f"{op}: " + "".join(str(m) for m in msg))


def _runtime(cond, op: str, *msg) -> None:
    torch._check(guard_or_true(cond), lambda: f"{op}: " + "".join(str(m) for m in msg))


# fp32's largest and smallest positive values, which bound the scalars the kernels take in fp32.
FP32_MAX, FP32_MIN = torch.finfo(torch.float32).max, math.ldexp(1.0, -149)


def _cpp_double(x: float) -> str:
    """x as C++'s ostream prints a double (six significant digits), as the kernels' messages show it."""
    return format(x, "g")


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(op, name, t, want) -> None:
    _runtime(t.dtype == want, op, name, " must be ", _dtype_name(want), ", got ", _dtype_name(t.dtype))


def _float_dtype(op, name, t) -> None:
    _runtime(t.dtype in _FLOATS, op, name, " must be float32, float16 or bfloat16, got ", _dtype_name(t.dtype))


def _same_device(op, name, t, ref) -> None:
    _runtime(t.device == ref.device, op, name, " is on ", t.device, " but the other arguments are on ", ref.device)


def _contiguous(op, name, t) -> None:
    _runtime(t.is_contiguous(), op, name, " must be contiguous")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two non-overlapping dense tensors' bytes meet, as
    at::get_overlap_status sees it: one storage (fake tensors keep their
    real ones' sharing) and intersecting byte ranges."""
    if a.numel() == 0 or b.numel() == 0 or a.untyped_storage()._cdata != b.untyped_storage()._cdata:
        return False
    start_a, start_b = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return start_a < start_b + b.numel() * b.element_size() and start_b < start_a + a.numel() * a.element_size()


def _dim(op, name, t, dim) -> None:
    _value(t.dim() == dim, op, name, " must be ", dim, "-D, got shape ", _shape(t))


def _bits(op, bit) -> None:
    _value(bit in (2, 3, 4, 8), op, "bit must be 2, 3, 4 or 8, got ", bit)


def _gptq_weight(op, qweight, qzeros, scales, bit, names=("b_q_weight", "b_gptq_qzeros", "b_gptq_scales"),
                 panels=False):
    """check_gptq_weight: (K, N, groups)."""
    nq, nz, ns = names
    _bits(op, bit)
    _dtype(op, nq, qweight, torch.int32)
    _dtype(op, nz, qzeros, torch.int32)
    _float_dtype(op, ns, scales)
    _same_device(op, nz, qzeros, qweight)
    _same_device(op, ns, scales, qweight)
    paneled = panels and qweight.dim() == 3
    if paneled:
        _value(qweight.shape[2] == PANEL_COLS, op, "a 3-D ", nq, " is the panel layout [N/", PANEL_COLS,
               ", K*bit/32, ", PANEL_COLS, "], got shape ", _shape(qweight))
    elif panels:
        _value(qweight.dim() == 2, op, nq, " must be 2-D [K*bit/32, N] or the 3-D panel layout [N/", PANEL_COLS,
               ", K*bit/32, ", PANEL_COLS, "], got shape ", _shape(qweight))
    else:
        _dim(op, nq, qweight, 2)
    for name, t in zip(names[1:], (qzeros, scales)):
        _dim(op, name, t, 2)
    for name, t in zip(names, (qweight, qzeros, scales)):
        _contiguous(op, name, t)
    rows, N = (qweight.shape[1], qweight.shape[0] * PANEL_COLS) if paneled else qweight.shape
    _value(rows > 0 and N > 0, op, nq, " must be non-empty, got shape ", _shape(qweight))
    _value(rows % words_per_pack(bit) == 0, op, nq, " has ", rows, " rows, not a multiple of ", words_per_pack(bit),
           " as ", bit, "-bit packing needs")
    K = rows // words_per_pack(bit) * fields_per_pack(bit)
    groups = scales.shape[0]
    _value(groups > 0, op, ns, " must have at least one group, got shape ", _shape(scales))
    _value(groups <= K, op, ns, " has ", groups, " groups but K is only ", K)
    _value(scales.shape[1] == N, op, ns, " must be [groups, N=", N, "], got ", _shape(scales))
    _value(N % fields_per_pack(bit) == 0, op, "N=", N, " (", nq, ".size(1)) must be a multiple of ",
           fields_per_pack(bit), " so that ", bit, "-bit ", nz, " pack whole words")
    zero_cols = N // fields_per_pack(bit) * words_per_pack(bit)
    _value(qzeros.shape[0] == groups and qzeros.shape[1] == zero_cols, op, nz, " must be [groups=", groups,
           ", N*bit/32=", zero_cols, "], got ", _shape(qzeros))
    return K, N, groups


def _index_vector(op, name, idx, ref, K) -> None:
    """check_index_vector, less its value range. An empty vector passes in
    any shape; each check holds for one, so a size unknown while tracing
    (ggml_mul_mat_id's ids for a data-dependent number of tokens) needs no
    guess at whether it is empty."""
    _runtime(idx.dtype in _INDEX, op, name, " must be int32 or int64, got ", _dtype_name(idx.dtype))
    _same_device(op, name, idx, ref)
    empty = idx.numel() == 0
    _value(sym_or(empty, idx.dim() == 1), op, name, " must be 1-D, got shape ", _shape(idx))
    if idx.dim() == 1:
        _value(sym_or(empty, idx.shape[0] == K), op, name, " must have K=", K, " entries (or be empty), got ",
               idx.shape[0])


def _even_groups(op, K, groups, why) -> None:
    _value(K % groups == 0, op, "K=", K, " is not a multiple of the ", groups, " groups in b_gptq_scales, ", why)


def _row_permutation(op, weight_name, qweight, perm_name, perm, bit, optional_perm) -> None:
    _bits(op, bit)
    _dtype(op, weight_name, qweight, torch.int32)
    _dim(op, weight_name, qweight, 2)
    _contiguous(op, weight_name, qweight)
    rows = qweight.shape[0]
    _value(rows % words_per_pack(bit) == 0, op, weight_name, " has ", rows, " rows, not a multiple of ",
           words_per_pack(bit), " as ", bit, "-bit packing needs")
    K = rows // words_per_pack(bit) * fields_per_pack(bit)
    _value(optional_perm or perm.numel() == K, op, perm_name, " must be a permutation of the K=", K, " rows, got ",
           perm.numel(), " entries")
    _index_vector(op, perm_name, perm, qweight, K)


def _pack_args(op, name, t, bit, dim) -> None:
    _bits(op, bit)
    _dtype(op, name, t, torch.int32)
    _dim(op, name, t, 2)
    _value(dim in (0, 1), op, "dim must be 0 or 1, got ", dim)


@lru_cache(maxsize=None)
def _type_info(op: str, type: int) -> tuple[int, int, str]:
    """(elements, bytes, name) per block of a ggml type, from the C++ table."""
    try:
        block, nbytes = torch.ops.lowbit.ggml_type_info(type)
    except ValueError:
        raise ValueError(f"{op}: type {type} is not a ggml weight type lowbit supports (unknown or removed id)") from None
    return block, nbytes, torch.ops.lowbit.ggml_type_name(type)


def _ggml_weight(op, W, type, rows_name, rows, cols) -> tuple[int, int, str]:
    """check_ggml_weight."""
    block, nbytes, name = _type_info(op, type)
    _dtype(op, "W", W, torch.uint8)
    _contiguous(op, "W", W)
    _value(rows >= 0, op, rows_name, " must be non-negative, got ", rows)
    _value(cols >= 0, op, "n must be non-negative, got ", cols)
    _value(cols % block == 0, op, "n=", cols, " is not a multiple of the ", name, " block size ", block)
    row_bytes = cols // block * nbytes
    _value(row_bytes < 2**63, op, "n=", cols, " ", name, " weights per row overflow int64 in bytes")
    total = rows * row_bytes
    _value(total < 2**63, op, rows, " rows of ", row_bytes, " bytes overflow int64")
    _value(W.numel() == total, op, "W has ", W.numel(), " bytes but ", rows, " rows of ", cols, " ", name,
           " weights need ", total, " (", row_bytes, " per row)")
    return block, nbytes, name


def _ggml_matmul(op, W, X, type, row) -> None:
    _float_dtype(op, "X", X)
    _same_device(op, "X", X, W)
    _dim(op, "X", X, 2)
    _ggml_weight(op, W, type, "row", row, X.shape[1])


def _ggml_matmul_id(op, W, X, ids, type, row) -> None:
    _float_dtype(op, "X", X)
    _same_device(op, "X", X, W)
    _value(X.dim() in (2, 3), op, "X must be [tokens, n] or [tokens, slots, n], got shape ", _shape(X))
    _dim(op, "W", W, 3)
    _dim(op, "ids", ids, 2)
    tokens, slots = ids.shape
    # sym_and, not `and`: X's and ids' token counts may be sizes unknown while
    # tracing (rows gathered by a mask), which `and` would have to guess.
    _value(sym_and(X.shape[0] == tokens, X.dim() == 2 or X.shape[1] == slots), op, "X must be [tokens=", tokens,
           ", n] or [tokens=", tokens, ", slots=", slots, ", n] for ids ", _shape(ids), ", got ", _shape(X))
    weight_rows = W.shape[0] * row
    _value(weight_rows < 2**63, op, W.shape[0], " experts of ", row, " rows overflow int64")
    _ggml_weight(op, W, type, "row", weight_rows, X.shape[-1])
    _value(W.shape[1] == row, op, "W must be [experts, row=", row, ", row_bytes], got shape ", _shape(W))
    _value(W.shape[0] > 0 or tokens * slots == 0, op, "W holds no experts for the ", tokens * slots,
           " (token, slot) pairs of ids ", _shape(ids))
    _index_vector(op, "ids", ids.reshape(-1), W, tokens * slots)


@lru_cache(maxsize=None)
def _repacked_types() -> str:
    ids = []
    for t in range(256):  # ggml type ids are small; GGML_TYPE_COUNT is far below 256
        try:
            if torch.ops.lowbit.ggml_has_repacked_layout(t):
                ids.append(t)
        except ValueError:
            pass
    return ", ".join(f"{torch.ops.lowbit.ggml_type_name(t)} ({t})" for t in ids)


def _ggml_repacked_type(op, type) -> None:
    """check_ggml_repacked_type."""
    _value(torch.ops.lowbit.ggml_has_repacked_layout(type), op, "type ", type, " (", _type_info(op, type)[2],
           ") has no repacked layout; the types with one are ", _repacked_types())



# ---------------------------------------------------------------------------
# GPTQ. Tensors follow the checkpoint layout: qweight int32 [K*bit/32, N] packed
# along K, qzeros int32 [groups, N*bit/32] packed along N, scales
# fp16/bf16/fp32 [groups, N], g_idx int32 or int64 [K]; bit is 2, 3, 4 or 8.
# ---------------------------------------------------------------------------

def gptq_gemm(a: Tensor, b_q_weight: Tensor, b_gptq_qzeros: Tensor, b_gptq_scales: Tensor, b_g_idx: Tensor,
              use_exllama: bool, use_v2_format: bool, bit: int) -> Tensor:
    """a [..., K] @ W -> [..., N] in a's dtype, summed in fp32, for the GPTQ weight
    W[k, n] = scales[g, n] * (q[k, n] - (z[g, n] + off)), z the stored zero, off 0 if
    use_v2_format else 1 (v1 checkpoints store zero - 1).

    Unshuffled (use_exllama False): g = b_g_idx[k], or k // (K / groups) when b_g_idx is
    empty. Shuffled (use_exllama True): b_q_weight went through gptq_shuffle(q_perm) and
    b_g_idx is that q_perm (or empty); the op computes a[..., q_perm] @ W_shuffled, with
    shuffled row i in group i // (K / groups), so groups must be of equal size. vLLM's
    argument names and order. On the CPU b_q_weight may also be in the panel layout
    [N/64, K*bit/32, 64] (as gptq_gemm_a8 takes it), with the same bits."""
    return torch.ops.lowbit.gptq_gemm(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama,
                                      use_v2_format, bit)


def _gemm_args(op, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, bit, panels=False):
    """check_gemm_args (csrc/ops/gptq_checks.h): (K, N, groups)."""
    K, N, groups = _gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit, panels=panels)
    _float_dtype(op, "a", a)
    _same_device(op, "a", a, b_q_weight)
    _value(a.dim() >= 1 and a.shape[-1] == K, op, "a must be [..., K=", K, "] to match b_q_weight, got ", _shape(a))
    _index_vector(op, "b_g_idx", b_g_idx, b_q_weight, K)
    # A g_idx gathered at run time may be empty or not: the kernel checks the groups then.
    if use_exllama or guard_or_false(b_g_idx.numel() == 0):
        _even_groups(op, K, groups, "as shuffled (use_exllama) weights need" if use_exllama
                     else "so b_g_idx must be given")
    return K, N, groups


@torch.library.register_fake("lowbit::gptq_gemm")
def _gptq_gemm(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, use_v2_format, bit):
    _, N, _ = _gemm_args("gptq_gemm", a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, bit,
                         panels=b_q_weight.device.type != "cuda")
    return a.new_empty((*a.shape[:-1], N))


# gptq_gemm_a8's integer sums of one group stay exact up to groups of this many
# rows (csrc/ops/gptq_checks.h).
A8_MAX_GROUP_ROWS = 32768


def gptq_gemm_a8(a: Tensor, b_q_weight: Tensor, b_gptq_qzeros: Tensor, b_gptq_scales: Tensor, b_g_idx: Tensor,
                 use_v2_format: bool, bit: int) -> Tensor:
    """gptq_gemm of an unshuffled weight with contiguous groups (b_g_idx empty or
    k // group_size) and int8 activations: each row of a is quantized per weight
    group, q = round(a * 127 / amax) with scale amax / 127, and every group's dot
    product is summed exactly in int32, then scaled and summed across groups in fp32.
    About 2^-8 of |a| @ |W| from gptq_gemm (the rounding of the activations, as
    llama.cpp rounds them for its integer dot products); the matvec is bound by
    memory where gptq_gemm's fp32 one is bound by its instructions. CPU; the SIMD
    kernels (vpdpbusd on AVX-512 VNNI, vpmaddubsw on AVX2) take 2-, 4- and 8-bit
    weights; 3-bit ones take a portable loop, slower than gptq_gemm's.
    b_q_weight may also be in the panel layout [N/64, K*bit/32, 64]
    (lowbit.gptq.packing.to_panels: the checkpoint's rows of each 64 columns,
    one contiguous stream), which gives the same bits and streams faster
    from memory."""
    return torch.ops.lowbit.gptq_gemm_a8(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit)


@torch.library.register_fake("lowbit::gptq_gemm_a8")
def _gptq_gemm_a8(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit):
    op = "gptq_gemm_a8"
    K, N, groups = _gemm_args(op, a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, False, bit, panels=True)
    # Contiguous groups hold at least K / groups rows each (the values are checked on the CPU).
    _value(K // groups <= A8_MAX_GROUP_ROWS, op, "b_gptq_scales has groups of ", K // groups, " rows; at most ",
           A8_MAX_GROUP_ROWS, " keep the int32 sums exact")
    return a.new_empty((*a.shape[:-1], N))


def gptq_shuffle(q_weight: Tensor, q_perm: Tensor, bit: int) -> None:
    """Rewrites q_weight in place with its rows in q_perm order (argsort(g_idx) for
    act-order; empty: no permutation), for gptq_gemm(use_exllama=True). The packing
    itself does not change, so a weight shuffled on one device runs on any other."""
    return torch.ops.lowbit.gptq_shuffle(q_weight, q_perm, bit)


@torch.library.register_fake("lowbit::gptq_shuffle")
def _gptq_shuffle(q_weight, q_perm, bit):
    _row_permutation("gptq_shuffle", "q_weight", q_weight, "q_perm", q_perm, bit, True)


def gptq_dequantize(b_q_weight: Tensor, b_gptq_qzeros: Tensor, b_gptq_scales: Tensor, b_g_idx: Tensor,
                    use_v2_format: bool, bit: int) -> Tensor:
    """The float weight W [K, N] of an unshuffled GPTQ weight (gptq_gemm's W), in the
    scales' dtype, computed in fp32 and rounded once."""
    return torch.ops.lowbit.gptq_dequantize(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit)


@torch.library.register_fake("lowbit::gptq_dequantize")
def _gptq_dequantize(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit):
    op = "gptq_dequantize"
    K, N, groups = _gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit)
    _index_vector(op, "b_g_idx", b_g_idx, b_q_weight, K)
    if guard_or_false(b_g_idx.numel() == 0):
        _even_groups(op, K, groups, "so b_g_idx must be given")
    return b_gptq_scales.new_empty((K, N))


def gptq_permute_rows(qweight: Tensor, perm: Tensor, bit: int) -> Tensor:
    """A new qweight whose input row k is row perm[k] of `qweight` (unpack, gather,
    repack; perm a permutation of K), for tensor-parallel reordering."""
    return torch.ops.lowbit.gptq_permute_rows(qweight, perm, bit)


@torch.library.register_fake("lowbit::gptq_permute_rows")
def _gptq_permute_rows(qweight, perm, bit):
    _row_permutation("gptq_permute_rows", "qweight", qweight, "perm", perm, bit, False)
    return torch.empty_like(qweight)


def gptq_permute_cols(qweight: Tensor, qzeros: Tensor, scales: Tensor, perm: Tensor,
                      bit: int) -> Tuple[Tensor, Tensor, Tensor]:
    """New (qweight, qzeros, scales) whose output column n is column perm[n] of each
    (perm a permutation of N), for tensor-parallel reordering."""
    return torch.ops.lowbit.gptq_permute_cols(qweight, qzeros, scales, perm, bit)


@torch.library.register_fake("lowbit::gptq_permute_cols")
def _gptq_permute_cols(qweight, qzeros, scales, perm, bit):
    op = "gptq_permute_cols"
    _, N, _ = _gptq_weight(op, qweight, qzeros, scales, bit, ("qweight", "qzeros", "scales"))
    _value(perm.numel() == N, op, "perm must be a permutation of the N=", N, " columns, got ", perm.numel(),
           " entries")
    _index_vector(op, "perm", perm, qweight, N)
    return torch.empty_like(qweight), torch.empty_like(qzeros), torch.empty_like(scales)


def gptq_pack(values: Tensor, bit: int, dim: int) -> Tensor:
    """int32 values in [0, 2**bit), 2-D, packed into int32 words along `dim` (0 as for
    qweight, 1 as for qzeros): the fields of a packed axis form one little-endian bit
    stream, 32 fields in 3 words for 3-bit, 32 / bit fields per word otherwise."""
    return torch.ops.lowbit.gptq_pack(values, bit, dim)


@torch.library.register_fake("lowbit::gptq_pack")
def _gptq_pack(values, bit, dim):
    op = "gptq_pack"
    _pack_args(op, "values", values, bit, dim)
    length = values.shape[dim]
    _value(length % fields_per_pack(bit) == 0, op, "values.size(", dim, ")=", length, " must be a multiple of ",
           fields_per_pack(bit), " for ", bit, "-bit packing")
    shape = list(values.shape)
    shape[dim] = length // fields_per_pack(bit) * words_per_pack(bit)
    return values.new_empty(shape)


def gptq_unpack(packed: Tensor, bit: int, dim: int) -> Tensor:
    """The inverse of gptq_pack: the int32 value of every field packed along `dim`."""
    return torch.ops.lowbit.gptq_unpack(packed, bit, dim)


@torch.library.register_fake("lowbit::gptq_unpack")
def _gptq_unpack(packed, bit, dim):
    op = "gptq_unpack"
    _pack_args(op, "packed", packed, bit, dim)
    words = packed.shape[dim]
    _value(words % words_per_pack(bit) == 0, op, "packed.size(", dim, ")=", words, " must be a multiple of ",
           words_per_pack(bit), " for ", bit, "-bit packing")
    shape = list(packed.shape)
    shape[dim] = words // words_per_pack(bit) * fields_per_pack(bit)
    return packed.new_empty(shape)


# ---------------------------------------------------------------------------
# GGUF. W is the raw uint8 block data of a matrix, rows of n / block * bytes as
# stored in the file; `type` is the ggml type id (an int or a GGMLType).
# ---------------------------------------------------------------------------

def ggml_dequantize(W: Tensor, type: int, m: SymInt, n: SymInt, dtype: Optional[torch.dtype] = None) -> Tensor:
    """The float [m, n] matrix of the blocks W (fp16 unless `dtype` says float32 or
    bfloat16), decoded in fp32 and rounded once: gguf-py's values, bit for bit."""
    return torch.ops.lowbit.ggml_dequantize(W, type, m, n, dtype)


@torch.library.register_fake("lowbit::ggml_dequantize")
def _ggml_dequantize(W, type, m, n, dtype=None):
    op = "ggml_dequantize"
    _ggml_weight(op, W, type, "m", m, n)
    dtype = dtype or torch.float16
    _runtime(dtype in _FLOATS, op, "dtype must be float32, float16 or bfloat16, got ", _dtype_name(dtype))
    return W.new_empty((m, n), dtype=dtype)


def _ggml_mul_mat_fake(op, repacked=False):
    def fake(W, X, type, row):
        _ggml_matmul(op, W, X, type, row)
        if repacked:
            _ggml_repacked_type(op, type)
        return X.new_empty((X.shape[0], row))
    return fake


def _ggml_mul_mat_id_fake(op, repacked=False):
    def fake(W, X, ids, type, row):
        _ggml_matmul_id(op, W, X, ids, type, row)
        if repacked:
            _ggml_repacked_type(op, type)
        return X.new_empty((ids.shape[0], ids.shape[1], row))
    return fake


def ggml_mul_mat_vec_a8(W: Tensor, X: Tensor, type: int, row: SymInt) -> Tensor:
    """X [M, n] @ dequant(W).T -> [M, row] in X's dtype, W the blocks of a [row, n]
    weight. X is quantized to the 8-bit blocks the type's dot products take (Q8_0, Q8_1
    or Q8_K, as llama.cpp's CPU backend does) and multiplied in integer dot products
    summed in fp32; F32/F16/BF16 weights take fp32 activations as they are. On CUDA
    it runs the small-M kernel at every M; on the CPU it is ggml_mul_mat_a8."""
    return torch.ops.lowbit.ggml_mul_mat_vec_a8(W, X, type, row)


torch.library.register_fake("lowbit::ggml_mul_mat_vec_a8")(_ggml_mul_mat_fake("ggml_mul_mat_vec_a8"))


def ggml_mul_mat_a8(W: Tensor, X: Tensor, type: int, row: SymInt) -> Tensor:
    """X [M, n] @ dequant(W).T -> [M, row] in X's dtype, as ggml_mul_mat_vec_a8
    computes it (8-bit activation blocks, integer dot products, fp32 sums), at any M:
    on CUDA the small-M kernel up to 32 rows for the types with slice decoders (8
    for the others), a dequantized weight past them (csrc/cuda/README.md)."""
    return torch.ops.lowbit.ggml_mul_mat_a8(W, X, type, row)


torch.library.register_fake("lowbit::ggml_mul_mat_a8")(_ggml_mul_mat_fake("ggml_mul_mat_a8"))


def ggml_mul_mat_id(W: Tensor, X: Tensor, ids: Tensor, type: int, row: SymInt) -> Tensor:
    """llama.cpp's mixture-of-experts matmul: W [experts, row, row_bytes] (a GGUF expert
    tensor's data), ids [tokens, slots] (int32 or int64) the expert of each slot, X
    [tokens, n] (every slot's row) or [tokens, slots, n]; out [tokens, slots, row], each
    (token, slot) pair ggml_mul_mat_a8 of its expert alone. Ids outside [0, experts)
    raise ValueError on the CPU and trip a device-side assert on CUDA."""
    return torch.ops.lowbit.ggml_mul_mat_id(W, X, ids, type, row)


torch.library.register_fake("lowbit::ggml_mul_mat_id")(_ggml_mul_mat_id_fake("ggml_mul_mat_id"))


def ggml_quantize(x: Tensor, type: int) -> Tensor:
    """CPU: the float matrix x [m, n] as blocks of a ggml type, the bytes llama.cpp's
    reference quantizer writes: Q8_0, uint8 [m, n / 32 * 34] (per 32 values d = amax /
    127 stored as fp16 and q = round(x / d), half away from zero, as gguf-py rounds),
    or Q6_K, uint8 [m, n / 256 * 210] (per 16 values the scale of a least-squares
    search weighted by x^2, quantized to int8 against the block's fp16 d; 6-bit
    levels). A NaN or Inf in x, or a block beyond fp16's range for its scale,
    raises ValueError."""
    return torch.ops.lowbit.ggml_quantize(x, type)


@torch.library.register_fake("lowbit::ggml_quantize")
def _ggml_quantize(x, type):
    op = "ggml_quantize"
    block, nbytes, name = _type_info(op, type)
    _value(type in (GGMLType.Q8_0, GGMLType.Q6_K), op, "type ", type, " (", name,
           "): lowbit writes Q8_0 (8) and Q6_K (14) only")
    _float_dtype(op, "x", x)
    _contiguous(op, "x", x)
    _dim(op, "x", x, 2)
    _value(x.shape[1] % block == 0, op, "x's rows (n=", x.shape[1], ") are not a multiple of the ", name,
           " block size ", block)
    return x.new_empty((x.shape[0], x.shape[1] // block * nbytes), dtype=torch.uint8)


def ggml_repack(W: Tensor, type: int, row: SymInt, n: SymInt, inverse: bool = False) -> Tensor:
    """CPU: the blocks W of a [row, n] weight reordered into the CPU kernels' repacked
    layout (or back, `inverse`): same bytes, size and shape; W [experts, row, row bytes]
    (ggml_mul_mat_id's) reorders each expert's rows as a weight of its own. For the
    types ggml_has_repacked_layout names; others are refused."""
    return torch.ops.lowbit.ggml_repack(W, type, row, n, inverse)


@torch.library.register_fake("lowbit::ggml_repack")
def _ggml_repack(W, type, row, n, inverse=False):
    op = "ggml_repack"
    experts = W.shape[0] if W.dim() == 3 else 1
    _value(W.dim() != 3 or W.shape[1] == row, op, "W [experts, rows, row bytes] has ", W.shape[1] if W.dim() == 3
           else 0, " rows per expert, but row=", row)
    _ggml_weight(op, W, type, "row", experts * row, n)
    _ggml_repacked_type(op, type)
    return torch.empty_like(W)


def ggml_mul_mat_repacked(W: Tensor, X: Tensor, type: int, row: SymInt) -> Tensor:
    """CPU: ggml_mul_mat_a8 of a weight in the repacked layout (ggml_repack). Bit for bit
    the file layout's result, but for the 32-element types whose repacked layout the
    active kernels read as it is (cpu_reads_repacked): those agree to fp32 rounding."""
    return torch.ops.lowbit.ggml_mul_mat_repacked(W, X, type, row)


torch.library.register_fake("lowbit::ggml_mul_mat_repacked")(
    _ggml_mul_mat_fake("ggml_mul_mat_repacked", repacked=True))


def ggml_mul_mat_id_repacked(W: Tensor, X: Tensor, ids: Tensor, type: int, row: SymInt) -> Tensor:
    """CPU: ggml_mul_mat_id of experts each in the repacked layout (ggml_repack of its
    own rows)."""
    return torch.ops.lowbit.ggml_mul_mat_id_repacked(W, X, ids, type, row)


torch.library.register_fake("lowbit::ggml_mul_mat_id_repacked")(
    _ggml_mul_mat_id_fake("ggml_mul_mat_id_repacked", repacked=True))


# ---------------------------------------------------------------------------
# A decode step's small ops (lowbit.decoding): fp32 math, any float dtype.
# ---------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm over x's last dimension: x * rsqrt(mean(x^2) + eps)
    in fp32, rounded to x's dtype, times weight (x's dtype); any shape."""
    return torch.ops.lowbit.rms_norm(x, weight, eps)


@torch.library.register_fake("lowbit::rms_norm")
def _rms_norm(x, weight, eps):
    op = "rms_norm"
    _float_dtype(op, "x", x)
    _runtime(weight.dtype == x.dtype, op, "weight must be ", _dtype_name(x.dtype), " (x's dtype), got ",
             _dtype_name(weight.dtype))
    _same_device(op, "weight", weight, x)
    _value(x.dim() >= 1, op, "x must have at least 1 dimension, got a scalar")
    _dim(op, "weight", weight, 1)
    _value(weight.shape[0] == x.shape[-1], op, "weight must have x's last dimension ", x.shape[-1], " entries, got ",
           weight.shape[0])
    _value(math.isfinite(eps) and eps >= 0, op, "eps must be finite and non-negative")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def decode_attention(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, key_cache: Tensor,
                     value_cache: Tensor, position: int, scale: float, start: int = 0,
                     sinks: Optional[Tensor] = None, softcap: float = 0.0) -> Tensor:
    """One new token's attention (batch 1), its key and value appended in place:
    q [q_heads, dim], k and v [kv_heads, dim], cos and sin [rotated] (the rotary
    tables at `position`, rotate-half convention, as transformers' llama-family
    models apply them: the first `rotated` values of each head rotate, the rest,
    where a partial rotary factor leaves any, pass through; rotated even, at most
    dim). Writes k rotated and v to row `position` of key_cache and
    value_cache [kv_heads, capacity, dim]; returns [q_heads, dim]: each query head,
    rotated, attending with softmax(scale * q.K^T) V in fp32 to rows [start, position]
    of key-value head h // (q_heads // kv_heads) (start > 0: a sliding window,
    the rows before it left unread). sinks [q_heads] (gpt-oss's attention
    sinks): each head's logit that joins its softmax's divisor, as a softmax
    over the scores and the sink with the sink's column dropped. softcap > 0
    (Gemma 2's attention logit soft cap): the scaled scores become
    softcap * tanh(score / softcap) before the softmax. All arguments
    contiguous (sinks need not be), of one float dtype and device; the caches
    share memory with no other argument."""
    return torch.ops.lowbit.decode_attention(q, k, v, cos, sin, key_cache, value_cache, position, scale, start,
                                             sinks, softcap)


@torch.library.register_fake("lowbit::decode_attention")
def _decode_attention(q, k, v, cos, sin, key_cache, value_cache, position, scale, start=0, sinks=None, softcap=0.0):
    op = "decode_attention"
    _float_dtype(op, "q", q)
    named = (("k", k), ("v", v), ("cos", cos), ("sin", sin), ("key_cache", key_cache), ("value_cache", value_cache))
    for name, t in named:
        _runtime(t.dtype == q.dtype, op, name, " must be ", _dtype_name(q.dtype), " (q's dtype), got ",
                 _dtype_name(t.dtype))
        _same_device(op, name, t, q)
    for name, t, dim in (("q", q, 2), ("k", k, 2), ("v", v, 2), ("cos", cos, 1), ("sin", sin, 1),
                         ("key_cache", key_cache, 3), ("value_cache", value_cache, 3)):
        _dim(op, name, t, dim)
    q_heads, dim, kv_heads, capacity = q.shape[0], q.shape[1], k.shape[0], key_cache.shape[1]
    _value(dim > 0 and dim % 2 == 0, op, "q's head size must be even and positive, got ", dim)
    _value(kv_heads > 0 and q_heads > 0 and q_heads % kv_heads == 0, op, "q's ", q_heads,
           " heads must be a positive multiple of k's ", kv_heads)
    _value(k.shape[1] == dim and v.shape == k.shape, op, "k and v must be [", kv_heads, ", ", dim, "], got ",
           _shape(k), " and ", _shape(v))
    rotated = cos.shape[0]
    _value(sin.shape[0] == rotated and 0 < rotated <= dim and rotated % 2 == 0, op,
           "cos and sin must have one even number of entries in [2, ", dim, "] (q's head size), got ", cos.shape[0],
           " and ", sin.shape[0])
    _value(key_cache.shape[0] == kv_heads and key_cache.shape[2] == dim, op, "key_cache must be [", kv_heads,
           ", capacity, ", dim, "], got ", _shape(key_cache))
    _value(value_cache.shape == key_cache.shape, op, "value_cache must have key_cache's shape ", _shape(key_cache),
           ", got ", _shape(value_cache))
    _value(0 <= position < capacity, op, "position must lie in [0, ", capacity, ") (the caches' capacity), got ",
           position)
    _value(0 <= start <= position, op, "start must lie in [0, ", position, "] (position), got ", start)
    _value(math.isfinite(scale) and abs(scale) <= FP32_MAX, op, "scale must be finite in fp32 (|scale| <= ",
           _cpp_double(FP32_MAX), "), got ", _cpp_double(scale))
    _value(softcap == 0 or FP32_MIN <= softcap <= FP32_MAX, op, "softcap must be finite and >= 0 (0: none) in fp32 "
           "(0 or in [", _cpp_double(FP32_MIN), ", ", _cpp_double(FP32_MAX), "]), got ", _cpp_double(softcap))
    if sinks is not None:
        _runtime(sinks.dtype == q.dtype, op, "sinks must be ", _dtype_name(q.dtype), " (q's dtype), got ",
                 _dtype_name(sinks.dtype))
        _same_device(op, "sinks", sinks, q)
        _dim(op, "sinks", sinks, 1)
        _value(sinks.shape[0] == q_heads, op, "sinks must have one entry per query head (", q_heads, "), got ",
               sinks.shape[0])
    every = (("q", q), *named)
    for name, t in every:
        _contiguous(op, name, t)
    # The caches are written: they may share memory with no other argument
    # (sinks, which may be strided: not its storage).
    for cache_name, cache in named[4:]:
        for name, t in every:
            _runtime(name == cache_name or not _overlap(cache, t), op, cache_name, " shares memory with ", name)
        if sinks is not None and sinks.numel():
            dense = sinks.is_contiguous()  # C++ asks is_non_overlapping_and_dense; a 1-D one is dense when contiguous
            _runtime(not (_overlap(cache, sinks) if dense else
                          sinks.untyped_storage()._cdata == cache.untyped_storage()._cdata),
                     op, cache_name, " shares memory with sinks")
    return torch.empty_like(q)


# ---------------------------------------------------------------------------
# The type table and the CPU kernels' switches: no tensors, so no fake kernels.
# ---------------------------------------------------------------------------

def ggml_type_info(type: int) -> List[int]:
    """[elements per block, bytes per block] of a ggml type; an unknown or removed id
    raises ValueError."""
    return torch.ops.lowbit.ggml_type_info(type)


def ggml_type_name(type: int) -> str:
    """ggml's name of a type id ("Q4_K" for 12); an unknown or removed id raises
    ValueError."""
    return torch.ops.lowbit.ggml_type_name(type)


def ggml_has_repacked_layout(type: int) -> bool:
    """Whether a ggml type has the CPU kernels' repacked layout (ggml_repack takes it);
    an unknown or removed id raises ValueError."""
    return torch.ops.lowbit.ggml_has_repacked_layout(type)


def ggml_cpu_traits(type: int) -> List[int]:
    """The CPU kernels' facts of a ggml type, its row of LOWBIT_GGML_CPU_TRAITS
    (csrc/cpu/ggml_traits.h): [SIMD levels, GEMM form (0 none, 1 float, 2 integer), the
    M the GEMM starts at, repacked layout, the ISAs that read it as it is (bit 0 AVX2,
    bit 1 AVX-512), the M from which AVX2 copies file-layout tiles into it, whether
    repack_model takes it]. An unknown or removed id raises ValueError."""
    return torch.ops.lowbit.ggml_cpu_traits(type)


def cpu_isa(force: Optional[str] = None) -> str:
    """The x86 vector ISA the CPU kernels use ("portable", "avx2" or "avx512"), chosen
    from the CPU's features at load (or LOWBIT_CPU_ISA), after switching to `force` if
    given ("best" for the best this CPU runs)."""
    return torch.ops.lowbit.cpu_isa(force)


def cpu_bf16_kernel(mode: Optional[str] = None) -> str:
    """Which GPTQ kernel bf16 / fp16 activations take on AVX512-BF16 CPUs ("auto",
    "always" or "gemm"), after setting it to `mode` if given."""
    return torch.ops.lowbit.cpu_bf16_kernel(mode)


def cpu_float_gemm(library: Optional[str] = None) -> str:
    """The fp32 GEMM of the CPU's large-M paths, gptq_gemm's and the GGUF float
    weights' ("onednn", the default where torch has oneDNN, or "blas": torch's
    at::mm), after setting it to `library` if given."""
    return torch.ops.lowbit.cpu_float_gemm(library)


def cpu_threads(threads: Optional[int] = None) -> int:
    """The thread count of lowbit's CPU kernels, after setting it to `threads` if
    given: 0, the default, follows torch.get_num_threads(). The kernels run on
    their own pool, whose callers never wait for a thread the OS has not scheduled
    yet; a count set here holds apart from torch's (lowbit.kernel_threads runs a
    model's torch ops on one thread and its quantized matmuls on several)."""
    # The op's schema reads True as 1 and refuses a float with a RuntimeError naming its schema.
    if threads is not None and not is_integer(threads):
        raise ValueError(f"cpu_threads: threads must be 0 (torch's count) to 1024, got {threads!r}")
    return torch.ops.lowbit.cpu_threads(None if threads is None else int(threads))


def cpu_team(team: Optional[str] = None) -> str:
    """Which threads run lowbit's CPU kernels, after setting it to `team` if given:
    "pool" (their own pool, the default: see cpu_threads) or "torch" (torch's
    OpenMP threads, as torch's own ops: for calls whose torch ops want every thread
    too; lowbit.kernel_threads sets it for a model's calls over a prompt). The
    results are the same bit for bit."""
    return torch.ops.lowbit.cpu_team(team)


def cpu_torch_threads(threads: Optional[int] = None) -> int:
    """torch's intra-op thread count on the calling thread (torch.get_num_threads()
    there), after setting it to `threads` (1 to 8192) for that thread alone, as
    lowbit.kernel_threads does: torch.set_num_threads also sets the count every
    thread takes at its first torch call."""
    if threads is not None and not is_integer(threads):
        raise ValueError(f"cpu_torch_threads: threads must be 1 to 8192, got {threads!r}")
    return torch.ops.lowbit.cpu_torch_threads(None if threads is None else int(threads))


def cpu_reads_repacked(type: int) -> bool:
    """Whether the active ISA's CPU kernels read a weight of this type in the repacked
    layout as it is; elsewhere each call puts the rows back in the file's layout first
    (the same results, slower). An unknown or removed id raises ValueError."""
    return torch.ops.lowbit.cpu_reads_repacked(type)
