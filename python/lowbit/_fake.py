"""Fake (meta) kernels: output shapes and dtypes of every lowbit op, so the ops
trace under torch.compile and pass torch.library.opcheck.

Each fake kernel refuses what the real kernels refuse from shapes, dtypes,
devices and layouts alone, with the same exception class and message
(csrc/gptq_checks.h, ggml_checks.h and *_prepare.h: RuntimeError for dtype,
device and layout, ValueError for values and shapes), so a bad call fails at
trace time rather than when the compiled graph runs. Checks of tensor values
(index ranges, permutations, packed values) stay with the real kernels."""
from functools import lru_cache

import torch

from .packing import fields_per_pack, words_per_pack

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_INDEX = (torch.int32, torch.int64)
# c10::ScalarType's names, as the C++ messages print dtypes.
_NAMES = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float64: "Double",
          torch.int32: "Int", torch.int64: "Long", torch.int16: "Short", torch.int8: "Char", torch.uint8: "Byte",
          torch.bool: "Bool"}


def _value(cond, op: str, *msg) -> None:
    torch._check_value(cond, lambda: f"{op}: " + "".join(str(m) for m in msg))


def _runtime(cond, op: str, *msg) -> None:
    torch._check(cond, lambda: f"{op}: " + "".join(str(m) for m in msg))


def _shape(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _dtype(op, name, t, want) -> None:
    _runtime(t.dtype == want, op, name, " must be ", _NAMES[want], ", got ", _NAMES.get(t.dtype, t.dtype))


def _float_dtype(op, name, t) -> None:
    _runtime(t.dtype in _FLOATS, op, name, " must be float32, float16 or bfloat16, got ", _NAMES.get(t.dtype, t.dtype))


def _same_device(op, name, t, ref) -> None:
    _runtime(t.device == ref.device, op, name, " is on ", t.device, " but the other arguments are on ", ref.device)


def _contiguous(op, name, t) -> None:
    _runtime(t.is_contiguous(), op, name, " must be contiguous")


def _dim(op, name, t, dim) -> None:
    _value(t.dim() == dim, op, name, " must be ", dim, "-D, got shape ", _shape(t))


def _bits(op, bit) -> None:
    _value(bit in (2, 3, 4, 8), op, "bit must be 2, 3, 4 or 8, got ", bit)


def _gptq_weight(op, qweight, qzeros, scales, bit, names=("b_q_weight", "b_gptq_qzeros", "b_gptq_scales")):
    """check_gptq_weight: (K, N, groups)."""
    nq, nz, ns = names
    _bits(op, bit)
    _dtype(op, nq, qweight, torch.int32)
    _dtype(op, nz, qzeros, torch.int32)
    _float_dtype(op, ns, scales)
    _same_device(op, nz, qzeros, qweight)
    _same_device(op, ns, scales, qweight)
    for name, t in zip(names, (qweight, qzeros, scales)):
        _dim(op, name, t, 2)
    for name, t in zip(names, (qweight, qzeros, scales)):
        _contiguous(op, name, t)
    rows, N = qweight.shape
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
    """check_index_vector, less its value range."""
    _runtime(idx.dtype in _INDEX, op, name, " must be int32 or int64, got ", _NAMES.get(idx.dtype, idx.dtype))
    _same_device(op, name, idx, ref)
    if idx.numel() == 0:
        return
    _dim(op, name, idx, 1)
    _value(idx.shape[0] == K, op, name, " must have K=", K, " entries (or be empty), got ", idx.shape[0])


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
    _value(X.shape[0] == tokens and (X.dim() == 2 or X.shape[1] == slots), op, "X must be [tokens=", tokens,
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


@torch.library.register_fake("lowbit::gptq_gemm")
def _gptq_gemm(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, use_v2_format, bit):
    op = "gptq_gemm"
    K, N, groups = _gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit)
    _float_dtype(op, "a", a)
    _same_device(op, "a", a, b_q_weight)
    _value(a.dim() >= 1 and a.shape[-1] == K, op, "a must be [..., K=", K, "] to match b_q_weight, got ", _shape(a))
    _index_vector(op, "b_g_idx", b_g_idx, b_q_weight, K)
    if use_exllama or b_g_idx.numel() == 0:
        _even_groups(op, K, groups, "as shuffled (use_exllama) weights need" if use_exllama
                     else "so b_g_idx must be given")
    return a.new_empty((*a.shape[:-1], N))


@torch.library.register_fake("lowbit::gptq_shuffle")
def _gptq_shuffle(q_weight, q_perm, bit):
    _row_permutation("gptq_shuffle", "q_weight", q_weight, "q_perm", q_perm, bit, True)


@torch.library.register_fake("lowbit::gptq_dequantize")
def _gptq_dequantize(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit):
    op = "gptq_dequantize"
    K, N, groups = _gptq_weight(op, b_q_weight, b_gptq_qzeros, b_gptq_scales, bit)
    _index_vector(op, "b_g_idx", b_g_idx, b_q_weight, K)
    if b_g_idx.numel() == 0:
        _even_groups(op, K, groups, "so b_g_idx must be given")
    return b_gptq_scales.new_empty((K, N))


@torch.library.register_fake("lowbit::gptq_permute_rows")
def _gptq_permute_rows(qweight, perm, bit):
    _row_permutation("gptq_permute_rows", "qweight", qweight, "perm", perm, bit, False)
    return torch.empty_like(qweight)


@torch.library.register_fake("lowbit::gptq_permute_cols")
def _gptq_permute_cols(qweight, qzeros, scales, perm, bit):
    op = "gptq_permute_cols"
    _, N, _ = _gptq_weight(op, qweight, qzeros, scales, bit, ("qweight", "qzeros", "scales"))
    _value(perm.numel() == N, op, "perm must be a permutation of the N=", N, " columns, got ", perm.numel(),
           " entries")
    _index_vector(op, "perm", perm, qweight, N)
    return torch.empty_like(qweight), torch.empty_like(qzeros), torch.empty_like(scales)


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


@torch.library.register_fake("lowbit::ggml_dequantize")
def _ggml_dequantize(W, type, m, n, dtype=None):
    op = "ggml_dequantize"
    _ggml_weight(op, W, type, "m", m, n)
    dtype = dtype or torch.float16
    _runtime(dtype in _FLOATS, op, "dtype must be float32, float16 or bfloat16, got ", _NAMES.get(dtype, dtype))
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


for _op in ("ggml_mul_mat_vec_a8", "ggml_mul_mat_a8", "ggml_mul_mat_repacked"):
    torch.library.register_fake(f"lowbit::{_op}")(_ggml_mul_mat_fake(_op, repacked=_op.endswith("repacked")))
for _op in ("ggml_mul_mat_id", "ggml_mul_mat_id_repacked"):
    torch.library.register_fake(f"lowbit::{_op}")(_ggml_mul_mat_id_fake(_op, repacked=_op.endswith("repacked")))


@torch.library.register_fake("lowbit::ggml_repack")
def _ggml_repack(W, type, row, n, inverse=False):
    op = "ggml_repack"
    _ggml_weight(op, W, type, "row", row, n)
    _ggml_repacked_type(op, type)
    return torch.empty_like(W)
