"""Fake (meta) kernels: output shapes and dtypes of every lowbit op, so the ops
trace under torch.compile and pass torch.library.opcheck. Only shape
arithmetic lives here; validation and math are in C++."""
import torch

from .packing import fields_per_pack, words_per_pack


@torch.library.register_fake("lowbit::gptq_gemm")
def _gptq_gemm(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_exllama, use_v2_format, bit):
    return a.new_empty((*a.shape[:-1], b_q_weight.shape[1]))


@torch.library.register_fake("lowbit::gptq_shuffle")
def _gptq_shuffle(q_weight, q_perm, bit):
    return None


@torch.library.register_fake("lowbit::gptq_dequantize")
def _gptq_dequantize(b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, use_v2_format, bit):
    k = b_q_weight.shape[0] // words_per_pack(bit) * fields_per_pack(bit)
    return b_gptq_scales.new_empty((k, b_q_weight.shape[1]))


@torch.library.register_fake("lowbit::gptq_permute_rows")
def _gptq_permute_rows(qweight, perm, bit):
    return torch.empty_like(qweight)


@torch.library.register_fake("lowbit::gptq_permute_cols")
def _gptq_permute_cols(qweight, qzeros, scales, perm, bit):
    return torch.empty_like(qweight), torch.empty_like(qzeros), torch.empty_like(scales)


@torch.library.register_fake("lowbit::gptq_pack")
def _gptq_pack(values, bit, dim):
    shape = list(values.shape)
    shape[dim] = shape[dim] // fields_per_pack(bit) * words_per_pack(bit)
    return values.new_empty(shape)


@torch.library.register_fake("lowbit::gptq_unpack")
def _gptq_unpack(packed, bit, dim):
    shape = list(packed.shape)
    shape[dim] = shape[dim] // words_per_pack(bit) * fields_per_pack(bit)
    return packed.new_empty(shape)


@torch.library.register_fake("lowbit::ggml_dequantize")
def _ggml_dequantize(W, type, m, n, dtype=None):
    return W.new_empty((m, n), dtype=dtype or torch.float16)


@torch.library.register_fake("lowbit::ggml_mul_mat_vec_a8")
def _ggml_mul_mat_vec_a8(W, X, type, row):
    return X.new_empty((X.shape[0], row))


@torch.library.register_fake("lowbit::ggml_mul_mat_a8")
def _ggml_mul_mat_a8(W, X, type, row):
    return X.new_empty((X.shape[0], row))


@torch.library.register_fake("lowbit::ggml_mul_mat_id")
def _ggml_mul_mat_id(W, X, ids, type, row):
    return X.new_empty((ids.shape[0], ids.shape[1], row))


@torch.library.register_fake("lowbit::ggml_mul_mat_id_repacked")
def _ggml_mul_mat_id_repacked(W, X, ids, type, row):
    return X.new_empty((ids.shape[0], ids.shape[1], row))


@torch.library.register_fake("lowbit::ggml_mul_mat_repacked")
def _ggml_mul_mat_repacked(W, X, type, row):
    return X.new_empty((X.shape[0], row))


@torch.library.register_fake("lowbit::ggml_repack")
def _ggml_repack(W, type, row, n, inverse=False):
    return torch.empty_like(W)
