"""Test data for the GGUF ops: block bytes of every weight type, made by
gguf-py's quantizer where it has one and as random bytes (with finite fp16
scale fields) otherwise. gguf-py (gguf.quants.dequantize) is the oracle; for
the types it cannot dequantize (Q1_0, Q2_0: NUMPY_REFERENCE) a NumPy
statement of ggml's dequantize_row_q1_0 / _q2_0 (ggml-quants.c), itself
checked against ggml's own code where llama-cpp-python is installed
(test_gguf_ops.py)."""
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq
from gguf.constants import GGML_QUANT_SIZES

# Every weight type lowbit supports, in ggml id order, written out apart from
# the C++ table so that a type the table loses fails the tests.
TYPES = [
    "F32", "F16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "IQ1_M", "BF16",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "Q1_0", "Q2_0",
]
# ggml ids and block shapes of the types newer than gguf-py's table (its
# GGMLQuantizationType stops at Q1_0).
NEWER_THAN_GGUF_PY = {"Q2_0": (42, (64, 18))}
# The types gguf-py cannot dequantize: their oracle is numpy_dequantize.
NUMPY_REFERENCE = {"Q1_0", "Q2_0"}
FLOAT_TYPES = {"F32", "F16", "BF16"}
# Types gguf-py can quantize (the rest get random blocks).
QUANTIZABLE = {"BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"}

# Byte offsets of the fp16 scale fields in each block (ggml-common.h layouts),
# so random blocks get finite scales instead of random inf / nan bit patterns.
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ3_XXS": [0], "IQ1_S": [0], "IQ4_NL": [0], "IQ3_S": [0],
    "IQ2_S": [0], "IQ4_XS": [0], "TQ1_0": [52], "TQ2_0": [64], "Q1_0": [0], "Q2_0": [0],
}
# Offsets of the fields that hold min terms (the "m" in w = d*q + m).
MIN_FIELD = {"Q4_1": 2, "Q5_1": 2}
# Elements per activation block of the 8-bit format each type's dot product uses.
ACT_BLOCK = {name: 32 for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "NVFP4", "Q1_0", "Q2_0")}


def type_id(name):
    return NEWER_THAN_GGUF_PY[name][0] if name in NEWER_THAN_GGUF_PY else int(QT[name])


def block_shape(name):
    """(elements per block, bytes per block) from gguf-py's own table."""
    return NEWER_THAN_GGUF_PY[name][1] if name in NEWER_THAN_GGUF_PY else GGML_QUANT_SIZES[QT[name]]


def act_block(name):
    return ACT_BLOCK.get(name, 256)


def random_blocks(rng, name, rows, n, scale=0.05):
    """Raw bytes [rows, n / block * bytes] of valid, finite blocks of `name`."""
    if name in FLOAT_TYPES or name in QUANTIZABLE:
        x = (rng.standard_normal((rows, n)) * 4 * scale).astype(np.float32)
        if name == "F32":
            return x.view(np.uint8)
        if name == "F16":
            return x.astype(np.float16).view(np.uint8)
        return quantize(x, name)
    block, nbytes = block_shape(name)
    raw = rng.integers(0, 256, (rows, n // block * nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, n // block, nbytes)
    for off in HALF_FIELDS.get(name, []):
        halves = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float16)
        blocks[:, :, off : off + 2] = halves.view(np.uint8).reshape(rows, -1, 2)
    if name == "NVFP4":
        # Its 4 UE4M3 sub-block scales (halved) between 2^-10 and 15 * 2^-5:
        # exponent fields 1-6, any mantissa (every byte: test_gguf_ops).
        blocks[:, :, :4] = rng.integers(1, 7, blocks[:, :, :4].shape, dtype=np.uint8) << 3 | (blocks[:, :, :4] & 7)
    if name == "IQ1_M":
        # IQ1_M's fp16 scale is spread over the top nibbles of its last 8 bytes;
        # fixing the top nibble of byte 55 keeps its exponent finite and moderate.
        blocks[:, :, 55] = (blocks[:, :, 55] & 0x0F) | 0x30
    return raw


def quantize(x, name):
    """gguf-py's quantization of float32 [rows, n] (the QUANTIZABLE types)."""
    return gq.quantize(x, QT[name])


def dequantize(raw, name):
    """gguf-py's dequantization as float32 [rows, n] (numpy_dequantize for NUMPY_REFERENCE)."""
    if name in NUMPY_REFERENCE:
        return numpy_dequantize(raw, name)
    return gq.dequantize(raw, QT[name]).astype(np.float32)


def numpy_dequantize(raw, name):
    """Q1_0 and Q2_0 as ggml-quants.c dequantizes them: an fp16 d, then the
    elements' bits little-end first; Q1_0 is +d for a set bit and -d for a
    clear one, Q2_0 (2-bit field - 1) * d."""
    block, nbytes = block_shape(name)
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    d = blocks[..., :2].copy().view(np.float16).astype(np.float32)  # [rows, blocks, 1]
    bits = np.unpackbits(blocks[..., 2:], axis=-1, bitorder="little")  # bit 8j + k: bit k of byte j
    if name == "Q1_0":
        q = np.where(bits == 1, np.float32(1), np.float32(-1))
    else:
        q = (bits[..., 0::2] + 2 * bits[..., 1::2]).astype(np.float32) - 1  # element e: bits 2e, 2e + 1
    return (d * q).reshape(raw.shape[0], -1)


def min_terms(raw, name):
    """|m| per weight block [rows, blocks] for the Q8_1-paired types, else None."""
    if name not in MIN_FIELD:
        return None
    block, nbytes = block_shape(name)
    blocks = raw.reshape(raw.shape[0], -1, nbytes)
    off = MIN_FIELD[name]
    return np.abs(blocks[:, :, off : off + 2].copy().view(np.float16)[..., 0].astype(np.float64))
