"""Independent NumPy reference for the GPTQ checkpoint format.

Layout (AutoGPTQ / GPTQModel / HF), for a Linear with math-orientation weight
W[K=in, N=out] (out = x @ W):

    qweight  int32 [K*bits/32, N]        q packed along K (axis 0)
    qzeros   int32 [groups, N*bits/32]   stored zeros packed along N (axis 1)
    scales   float [groups, N]
    g_idx    int32 [K]                   group of each input row

    W[k, n] = scales[g, n] * (q[k, n] - z[g, n]),  g = g_idx[k]

Packing is deliberately implemented through a bit-stream view (np.unpackbits /
np.packbits, little bit order, on little-endian bytes) rather than shift/mask
formulas, so that it is independent of the code under test: along the packed
axis the words form one continuous little-endian bit stream and element i
occupies stream bits [bits*i, bits*i + bits).  This handles 3-bit values that
straddle words (elements 10 and 21 of every 32) with no special case.

Zero formats: "gptq" (v1) stores z - 1 (readers add 1), "gptq_v2" stores z.
"""

import numpy as np

BITS = (2, 3, 4, 8)
FORMATS = ("gptq", "gptq_v2")


def _check_bits(bits):
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")


def _check_fmt(fmt):
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")


def _check_int(a, what):
    if not (np.issubdtype(a.dtype, np.integer) or a.dtype == np.bool_):
        raise ValueError(f"{what} must be an integer array, got {a.dtype}")


# --------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------

def pack(values, bits, axis):
    """Pack ints in [0, 2^bits) along `axis` into int32 words (bit-stream view)."""
    _check_bits(bits)
    v = np.asarray(values)
    _check_int(v, "values")
    if v.ndim == 0:
        raise ValueError("values must have at least one dimension")
    if v.size and (v.min() < 0 or v.max() >= (1 << bits)):
        raise ValueError(f"values out of range [0, {1 << bits}) for {bits}-bit")
    v = np.moveaxis(v, axis, -1)
    L = v.shape[-1]
    # bits*L % 32 == 0  <=>  L % 32 == 0 for 3-bit, L % (32/bits) == 0 otherwise
    if (L * bits) % 32:
        need = 32 if bits == 3 else 32 // bits
        raise ValueError(f"packed-axis length {L} is not a multiple of {need}")
    lead = v.shape[:-1]
    # Each value -> its `bits` lowest bits, LSB first (values < 2^bits <= 256 fit in a byte).
    vbits = np.unpackbits(v.astype(np.uint8)[..., None], axis=-1, bitorder="little")
    stream = vbits[..., :bits].reshape(lead + (L * bits,))
    # Stream -> bytes (LSB first) -> little-endian 32-bit words.
    byts = np.ascontiguousarray(np.packbits(stream, axis=-1, bitorder="little"))
    words = byts.view("<u4").astype(np.uint32).view(np.int32)
    return np.moveaxis(words, -1, axis)


def unpack(packed, bits, axis):
    """Inverse of pack: int32 words along `axis` -> int32 values in [0, 2^bits)."""
    _check_bits(bits)
    p = np.asarray(packed)
    _check_int(p, "packed")
    if p.ndim == 0:
        raise ValueError("packed must have at least one dimension")
    # Reinterpret as 32-bit words whatever the int dtype (int32 / uint32 / int64 holding them).
    w = np.moveaxis((p.astype(np.int64) & 0xFFFFFFFF).astype("<u4"), axis, -1)
    lead, nw = w.shape[:-1], w.shape[-1]
    if (32 * nw) % bits:
        raise ValueError(f"{nw} words do not hold a whole number of {bits}-bit values")
    byts = np.ascontiguousarray(w).view(np.uint8)  # little-endian byte order
    stream = np.unpackbits(byts, axis=-1, bitorder="little")  # lead + (32*nw,)
    L = 32 * nw // bits
    fields = stream.reshape(lead + (L, bits))
    # Zero-pad each field to 8 bits and re-pack it into one byte = the value.
    pad = np.zeros(lead + (L, 8 - bits), dtype=np.uint8)
    vals = np.packbits(np.concatenate([fields, pad], axis=-1), axis=-1, bitorder="little")
    return np.moveaxis(vals[..., 0].astype(np.int32), -1, axis)


# --------------------------------------------------------------------------
# Zero points
# --------------------------------------------------------------------------

def encode_zeros(z, bits, fmt):
    """True zeros -> stored ints. v1 ("gptq") stores z-1, so z == 0 is unrepresentable."""
    _check_bits(bits)
    _check_fmt(fmt)
    z = np.asarray(z)
    _check_int(z, "zeros")
    z = z.astype(np.int64)
    if fmt == "gptq":
        if np.any(z == 0):
            raise ValueError("a zero point of 0 cannot be stored in v1 (gptq) format")
        lo, hi = 1, 1 << bits
    else:
        lo, hi = 0, (1 << bits) - 1
    if z.size and (z.min() < lo or z.max() > hi):
        raise ValueError(f"zero points out of range [{lo}, {hi}] for {bits}-bit {fmt}")
    return (z - 1 if fmt == "gptq" else z).astype(np.int32)


def decode_zeros(stored, bits, fmt):
    """Stored ints -> true zeros (v1 adds 1 per field)."""
    _check_bits(bits)
    _check_fmt(fmt)
    s = np.asarray(stored).astype(np.int32)
    return s + 1 if fmt == "gptq" else s


# --------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------

def make_g_idx(K, group_size, perm=None):
    """Group index per input row; with act-order perm: g_idx[perm[j]] = j // group_size."""
    if group_size == -1:
        return np.zeros(K, dtype=np.int32)
    if group_size <= 0 or K % group_size:
        raise ValueError(f"K={K} is not a positive multiple of group_size={group_size}")
    if perm is None:
        return (np.arange(K) // group_size).astype(np.int32)
    perm = np.asarray(perm)
    if perm.shape != (K,) or not np.array_equal(np.sort(perm), np.arange(K)):
        raise ValueError("perm must be a permutation of range(K)")
    invperm = np.argsort(perm)  # invperm[perm[j]] = j
    return (invperm // group_size).astype(np.int32)


def _num_groups(K, group_size):
    return 1 if group_size == -1 else K // group_size


# --------------------------------------------------------------------------
# Checkpoint construction
# --------------------------------------------------------------------------

def _assemble(q, z, scales, g_idx, perm, bits, fmt):
    return {
        "qweight": pack(q, bits, 0),
        "qzeros": pack(encode_zeros(z, bits, fmt), bits, 1),
        "scales": scales,
        "g_idx": g_idx,
        "perm": perm,
        "q": q.astype(np.int32),
        "z": z.astype(np.int32),
    }


def random_checkpoint(rng, K, N, bits, group_size, sym, fmt, act_order,
                      scale_dtype=np.float16):
    """A random but valid checkpoint (q, zeros and scales drawn directly)."""
    _check_bits(bits)
    _check_fmt(fmt)
    perm = rng.permutation(K) if act_order else None
    g_idx = make_g_idx(K, group_size, perm)
    G = _num_groups(K, group_size)
    maxq = (1 << bits) - 1
    q = rng.integers(0, maxq + 1, size=(K, N))
    if sym:
        z = np.full((G, N), 1 << (bits - 1))
    elif fmt == "gptq":
        z = rng.integers(1, maxq + 2, size=(G, N))  # v1 range [1, 2^bits]
    else:
        z = rng.integers(0, maxq + 1, size=(G, N))  # v2 range [0, 2^bits-1]
    scales = (rng.uniform(0.5, 1.5, size=(G, N)) / (1 << bits)).astype(scale_dtype)
    return _assemble(q, z, scales, g_idx, perm, bits, fmt)


def quantize_rtn(W, bits, group_size, sym, fmt, perm=None):
    """GPTQ's round-to-nearest quantizer per (group, output column) of W[K, N].

    q is computed with the float16-rounded scale that is actually stored, so
    dequantize() reproduces the quantizer exactly and |dequant - W| <= scale/2
    holds for every element that was not clipped.
    """
    _check_bits(bits)
    _check_fmt(fmt)
    W = np.asarray(W, dtype=np.float64)
    K, N = W.shape
    g_idx = make_g_idx(K, group_size, perm)
    G = _num_groups(K, group_size)
    maxq = (1 << bits) - 1
    scales = np.empty((G, N), dtype=np.float16)
    z = np.empty((G, N), dtype=np.int64)
    q = np.empty((K, N), dtype=np.int64)
    for g in range(G):
        rows = np.nonzero(g_idx == g)[0]
        Wg = W[rows]
        xmin = np.minimum(Wg.min(axis=0), 0.0)
        xmax = np.maximum(Wg.max(axis=0), 0.0)
        if sym:
            xmax = np.maximum(np.abs(xmin), xmax)
            xmin = -xmax
        s16 = ((xmax - xmin) / maxq).astype(np.float16)
        s16[s16 == 0] = 1  # guard: constant-zero column (or fp16 underflow)
        if not np.all(np.isfinite(s16)):
            raise ValueError("scale overflows float16")
        s = s16.astype(np.float64)
        if sym:
            zg = np.full(N, (maxq + 1) // 2)
        else:
            zg = np.clip(np.round(-xmin / s), 0, maxq).astype(np.int64)
        scales[g], z[g] = s16, zg
        q[rows] = np.clip(np.round(Wg / s) + zg, 0, maxq).astype(np.int64)
    # encode_zeros (inside _assemble) raises ValueError for v1 with a zero of 0.
    return _assemble(q, z, scales, g_idx, None if perm is None else np.asarray(perm),
                     bits, fmt)


# --------------------------------------------------------------------------
# Dequantization / GEMM
# --------------------------------------------------------------------------

def dequantize(qweight, qzeros, scales, g_idx, bits, fmt):
    """float64 W[K, N] = scales[g] * (q - z[g]), g = g_idx[k]."""
    q = unpack(qweight, bits, 0).astype(np.int64)
    z = decode_zeros(unpack(qzeros, bits, 1), bits, fmt).astype(np.int64)
    s = np.asarray(scales).astype(np.float64)  # exact for fp16/bf16/fp32
    K, N = q.shape
    G = s.shape[0]
    if s.shape != (G, N) or z.shape[0] != G or z.shape[1] < N:
        raise ValueError(f"inconsistent shapes: q {q.shape}, zeros {z.shape}, scales {s.shape}")
    z = z[:, :N]  # drop padding fields of a last, partly used zero word (if any)
    if g_idx is None:
        g = np.arange(K) // (K // G)
    else:
        g = np.asarray(g_idx).astype(np.int64)
    return s[g] * (q - z[g]).astype(np.float64)


def gemm(a, qweight, qzeros, scales, g_idx, bits, fmt):
    """float64 a @ dequantize(...), a of shape [..., K]."""
    W = dequantize(qweight, qzeros, scales, g_idx, bits, fmt)
    return np.asarray(a, dtype=np.float64) @ W


def gemm_a8(a, qweight, qzeros, scales, bits, fmt, group_size):
    """float32 out [M, N] of gptq_gemm_a8 (csrc/README.md), contiguous groups of
    group_size rows (-1: one group): each row of a quantized per group to
    q = rint(a * (127 / amax)) in float32 arithmetic (a and amax first scaled
    by 2^64 where amax < 2^-64, so the quotient stays finite) with scale d = amax / 127
    (NaN where the group holds a NaN or an infinity, q = 0 there), the
    group's integer dot product r = sum q_a * (q_w - z), and out = fma(s * d,
    r, out) in float32 group by group (the fma in float64, exact for these
    24-bit operands but for one rounding of the sum)."""
    a = np.asarray(a, dtype=np.float32)
    q = unpack(qweight, bits, 0).astype(np.int64)
    K, N = q.shape
    z = decode_zeros(unpack(qzeros, bits, 1), bits, fmt).astype(np.int64)[:, :N]
    s = np.asarray(scales).astype(np.float32)
    gs = K if group_size == -1 else group_size
    out = np.zeros((a.shape[0], N), dtype=np.float32)
    for g, k0 in enumerate(range(0, K, gs)):
        block = a[:, k0:k0 + gs]
        finite = np.isfinite(block).all(axis=1)
        amax = np.abs(np.where(finite[:, None], block, 0)).max(axis=1).astype(np.float32)
        # Below 2^-64, amax and the row are scaled by 2^64 (exact) so that 127 / amax cannot overflow.
        pre = np.where(amax < np.float32(2.0**-64), np.float32(2.0**64), np.float32(1)).astype(np.float32)
        inv = np.zeros_like(amax)
        ok = finite & (amax > 0)
        inv[ok] = np.float32(127) / (amax[ok] * pre[ok])
        scaled = np.where(finite[:, None], block, 0) * pre[:, None] * inv[:, None]
        qa = np.where(finite[:, None], np.rint(scaled), 0).astype(np.int64)
        d = np.where(finite, amax / np.float32(127), np.float32(np.nan)).astype(np.float32)
        r = qa @ (q[k0:k0 + gs] - z[g])  # exact: int64
        sd = (s[g][None, :] * d[:, None]).astype(np.float32)
        out = (sd.astype(np.float64) * r.astype(np.float32).astype(np.float64) + out).astype(np.float32)
    return out
