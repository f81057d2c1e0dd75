"""Tests of the NumPy GPTQ reference itself (tests/gptq_reference.py)."""

import numpy as np
import pytest

import gptq_reference as ref

ALL_BITS = [2, 3, 4, 8]
FMTS = ["gptq", "gptq_v2"]


def _unit(bits):
    """Packed-axis length granularity."""
    return 32 if bits == 3 else 32 // bits


def _u32(a):
    return np.asarray(a, dtype=np.int32).view(np.uint32)


# --------------------------------------------------------------------------
# pack / unpack
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("axis", [0, 1])
def test_pack_unpack_roundtrip(bits, axis):
    rng = np.random.default_rng(bits * 10 + axis)
    for _ in range(5):
        packed_len = _unit(bits) * int(rng.integers(1, 5))
        other = int(rng.integers(1, 7))
        shape = (packed_len, other) if axis == 0 else (other, packed_len)
        v = rng.integers(0, 1 << bits, size=shape)
        p = ref.pack(v, bits, axis)
        assert p.dtype == np.int32
        exp_shape = list(shape)
        exp_shape[axis] = packed_len * bits // 32
        assert p.shape == tuple(exp_shape)
        u = ref.unpack(p, bits, axis)
        assert u.dtype == np.int32
        np.testing.assert_array_equal(u, v)
        # unpack also accepts the same words as uint32
        np.testing.assert_array_equal(ref.unpack(_u32(p), bits, axis), v)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_unpack_pack_roundtrip_random_words(bits):
    # Any word pattern is a valid bit stream, so unpack -> pack is the identity.
    rng = np.random.default_rng(bits)
    # 12 words: a multiple of 3, so whole 3-bit values too.
    words = rng.integers(0, 1 << 32, size=(12, 5), dtype=np.uint64).astype(np.uint32)
    words = words.view(np.int32)
    for axis in (0, 1):
        w = words if axis == 0 else words.T.copy()
        v = ref.unpack(w, bits, axis)
        np.testing.assert_array_equal(ref.pack(v, bits, axis), w)


def test_pack_errors():
    with pytest.raises(ValueError):
        ref.pack(np.full((8, 1), 16), 4, 0)  # >= 2^bits
    with pytest.raises(ValueError):
        ref.pack(np.full((8, 1), -1), 4, 0)  # negative
    with pytest.raises(ValueError):
        ref.pack(np.zeros((32, 1), int), 5, 0)  # unsupported bits
    with pytest.raises(ValueError):
        ref.unpack(np.zeros((1, 1), np.int32), 6, 0)
    with pytest.raises(ValueError):
        ref.unpack(np.zeros((2, 1), np.int32), 3, 0)  # 64 bits: not whole 3-bit values
    with pytest.raises(ValueError):
        ref.pack(np.zeros((4, 2), int), 4, 0)  # 4-bit needs multiples of 8
    with pytest.raises(ValueError):
        ref.pack(np.zeros((2, 10), int), 8, 1)  # 8-bit needs multiples of 4
    with pytest.raises(ValueError):
        ref.pack(np.zeros((8, 1), int), 3, 0)  # 3-bit needs multiples of 32 (8*3=24)
    with pytest.raises(ValueError):
        ref.pack(np.zeros((1, 48), int), 3, 1)
    with pytest.raises(ValueError):
        ref.pack(np.zeros((8, 1), float), 4, 0)  # non-integer dtype


def test_3bit_hand_checked():
    # Values i % 8 for i = 0..31. Hand derivation: the values 0..7 in 3-bit
    # fields, LSB first, form the 24-bit pattern octal 76543210 = 0xFAC688, so
    # the 96-bit stream is 0xFAC688 repeated four times; as little-endian bytes
    #   88 C6 FA 88 | C6 FA 88 C6 | FA 88 C6 FA
    # giving words 0x88FAC688, 0xC688FAC6, 0xFAC688FA.
    # Straddling values: v10 = 2 = 0b010 -> word0 bits 30,31 = 0,1 (top nibble
    # 0x8) and word1 bit 0 = 0; v21 = 5 = 0b101 -> word1 bit 31 = 1 (top nibble
    # 0xC = 1100b) and word2 bits 0,1 = 0,1 (low nibble 0xA = 1010b).
    v = (np.arange(32) % 8).reshape(32, 1)
    p = ref.pack(v, 3, 0)
    assert _u32(p)[:, 0].tolist() == [0x88FAC688, 0xC688FAC6, 0xFAC688FA]
    np.testing.assert_array_equal(ref.unpack(p, 3, 0), v)
    # same along axis 1
    assert _u32(ref.pack(v.T, 3, 1))[0].tolist() == [0x88FAC688, 0xC688FAC6, 0xFAC688FA]


@pytest.mark.parametrize("idx, words", [
    (0, [0x00000007, 0, 0]),
    (9, [0x38000000, 0, 0]),           # bits 27..29
    (10, [0xC0000000, 0x00000001, 0]),  # bits 30,31 | bit 0
    (11, [0, 0x0000000E, 0]),           # bits 33..35 -> word1 bits 1..3
    (21, [0, 0x80000000, 0x00000003]),  # bit 31 | bits 0,1
    (22, [0, 0, 0x0000001C]),           # bits 66..68 -> word2 bits 2..4
    (31, [0, 0, 0xE0000000]),           # bits 93..95
])
def test_3bit_single_value_placement(idx, words):
    v = np.zeros((1, 32), int)
    v[0, idx] = 7
    p = ref.pack(v, 3, 1)
    assert _u32(p)[0].tolist() == words
    np.testing.assert_array_equal(ref.unpack(p, 3, 1), v)


def test_4bit_8bit_2bit_hand_checked():
    assert _u32(ref.pack(np.arange(8).reshape(8, 1), 4, 0))[0, 0] == 0x76543210
    assert _u32(ref.pack(np.array([[1, 2, 3, 0xAB]]), 8, 1))[0, 0] == 0xAB030201
    assert _u32(ref.pack(np.array([[1, 2, 3, 0] * 4]), 2, 1))[0, 0] == 0x39393939


# --------------------------------------------------------------------------
# zeros
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bits, fmt, word", [
    (2, "gptq", 0x55555555), (2, "gptq_v2", 0xAAAAAAAA),
    (4, "gptq", 0x77777777), (4, "gptq_v2", 0x88888888),
    (8, "gptq", 0x7F7F7F7F), (8, "gptq_v2", 0x80808080),
])
def test_symmetric_zero_words(bits, fmt, word):
    n = 32 // bits * 3
    z = np.full((2, n), 1 << (bits - 1))
    p = ref.pack(ref.encode_zeros(z, bits, fmt), bits, 1)
    assert p.shape == (2, 3)
    assert np.all(_u32(p) == word)
    np.testing.assert_array_equal(ref.decode_zeros(ref.unpack(p, bits, 1), bits, fmt), z)


@pytest.mark.parametrize("fmt", FMTS)
def test_3bit_symmetric_zero(fmt):
    z = np.full((1, 32), 4)
    stored = ref.encode_zeros(z, 3, fmt)
    assert np.all(stored == (3 if fmt == "gptq" else 4))
    p = ref.pack(stored, 3, 1)
    np.testing.assert_array_equal(ref.decode_zeros(ref.unpack(p, 3, 1), 3, fmt), z)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_zero_ranges(bits):
    top = 1 << bits
    # v1: [1, 2^bits] stored as [0, 2^bits - 1]
    z = np.arange(1, top + 1)
    np.testing.assert_array_equal(ref.encode_zeros(z, bits, "gptq"), z - 1)
    np.testing.assert_array_equal(ref.decode_zeros(z - 1, bits, "gptq"), z)
    with pytest.raises(ValueError):
        ref.encode_zeros(np.array([0, 1]), bits, "gptq")
    with pytest.raises(ValueError):
        ref.encode_zeros(np.array([top + 1]), bits, "gptq")
    # v2: [0, 2^bits - 1] stored as is
    z = np.arange(top)
    np.testing.assert_array_equal(ref.encode_zeros(z, bits, "gptq_v2"), z)
    np.testing.assert_array_equal(ref.decode_zeros(z, bits, "gptq_v2"), z)
    with pytest.raises(ValueError):
        ref.encode_zeros(np.array([top]), bits, "gptq_v2")
    with pytest.raises(ValueError):
        ref.encode_zeros(np.array([-1]), bits, "gptq_v2")


def test_bad_fmt():
    with pytest.raises(ValueError):
        ref.encode_zeros(np.array([1]), 4, "awq")


# --------------------------------------------------------------------------
# g_idx
# --------------------------------------------------------------------------

def test_g_idx_trivial():
    np.testing.assert_array_equal(ref.make_g_idx(8, 4), [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(ref.make_g_idx(8, -1), np.zeros(8))
    assert ref.make_g_idx(8, 4).dtype == np.int32
    with pytest.raises(ValueError):
        ref.make_g_idx(10, 4)


@pytest.mark.parametrize("K, gs", [(64, 16), (128, 32), (96, 32), (64, 64)])
def test_g_idx_act_order(K, gs):
    rng = np.random.default_rng(K + gs)
    perm = rng.permutation(K)
    g = ref.make_g_idx(K, gs, perm)
    assert g.shape == (K,) and g.dtype == np.int32
    np.testing.assert_array_equal(np.bincount(g), np.full(K // gs, gs))
    np.testing.assert_array_equal(g[perm], np.arange(K) // gs)


def test_g_idx_act_order_small_by_hand():
    # perm processes rows 2,0,3,1: rows 2,0 form group 0, rows 3,1 group 1.
    np.testing.assert_array_equal(ref.make_g_idx(4, 2, [2, 0, 3, 1]), [0, 1, 0, 1])
    with pytest.raises(ValueError):
        ref.make_g_idx(4, 2, [0, 0, 1, 2])


# --------------------------------------------------------------------------
# random_checkpoint / dequantize / gemm
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, -1])
def test_random_checkpoint_and_dequant(bits, fmt, sym, act_order, group_size):
    rng = np.random.default_rng(1234)
    K, N = 128, 64
    ck = ref.random_checkpoint(rng, K, N, bits, group_size, sym, fmt, act_order)
    G = 1 if group_size == -1 else K // group_size
    assert ck["qweight"].shape == (K * bits // 32, N) and ck["qweight"].dtype == np.int32
    assert ck["qzeros"].shape == (G, N * bits // 32) and ck["qzeros"].dtype == np.int32
    assert ck["scales"].shape == (G, N) and ck["scales"].dtype == np.float16
    assert ck["g_idx"].shape == (K,) and ck["g_idx"].dtype == np.int32
    assert (ck["perm"] is not None) == act_order
    z, q = ck["z"], ck["q"]
    if sym:
        assert np.all(z == 1 << (bits - 1))
    elif fmt == "gptq":
        assert z.min() >= 1 and z.max() <= 1 << bits
    else:
        assert z.min() >= 0 and z.max() <= (1 << bits) - 1
    assert np.all(ck["scales"] > 0)
    np.testing.assert_array_equal(ref.unpack(ck["qweight"], bits, 0), q)
    np.testing.assert_array_equal(
        ref.decode_zeros(ref.unpack(ck["qzeros"], bits, 1), bits, fmt), z)

    g = ck["g_idx"]
    expected = ck["scales"].astype(np.float64)[g] * (q - z[g])
    W = ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], g, bits, fmt)
    assert W.dtype == np.float64
    np.testing.assert_array_equal(W, expected)

    a = rng.standard_normal((2, 3, K))
    out = ref.gemm(a, ck["qweight"], ck["qzeros"], ck["scales"], g, bits, fmt)
    assert out.shape == (2, 3, N)
    np.testing.assert_allclose(out, a @ expected, rtol=1e-12, atol=1e-12)


def test_random_checkpoint_zero_coverage():
    # v2 asym does produce zero 0; v1 asym never does.
    rng = np.random.default_rng(0)
    z2 = ref.random_checkpoint(rng, 64, 64, 2, 16, False, "gptq_v2", False)["z"]
    z1 = ref.random_checkpoint(rng, 64, 64, 2, 16, False, "gptq", False)["z"]
    assert (z2 == 0).any() and not (z1 == 0).any() and (z1 == 4).any()


def test_dequantize_default_g_idx_and_v1_v2_agree():
    rng = np.random.default_rng(5)
    K, N, bits = 64, 32, 4
    ck = ref.random_checkpoint(rng, K, N, bits, 16, False, "gptq", False)
    W1 = ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], None, bits, "gptq")
    np.testing.assert_array_equal(
        W1, ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], bits, "gptq"))
    # Zeros in [1, 15] are representable in both formats; both encodings must
    # dequantize identically, and their stored words differ by 0x11111111.
    z = np.clip(ck["z"], 1, 15)
    qz1 = ref.pack(ref.encode_zeros(z, bits, "gptq"), bits, 1)
    qz2 = ref.pack(ref.encode_zeros(z, bits, "gptq_v2"), bits, 1)
    assert np.all(_u32(qz2) - _u32(qz1) == 0x11111111)
    np.testing.assert_array_equal(
        ref.dequantize(ck["qweight"], qz1, ck["scales"], None, bits, "gptq"),
        ref.dequantize(ck["qweight"], qz2, ck["scales"], None, bits, "gptq_v2"))


def test_dequantize_small_by_hand():
    # K = 8, N = 1, 4-bit, one group: q = 0..7, z = 8 (v2), scale = 0.5.
    qweight = np.array([[0x76543210]], dtype=np.int64).astype(np.int32)
    # One zero word holds 8 columns' fields; column 0's field is 8, the rest is padding.
    qzeros = np.array([[0x00000008]], dtype=np.int32)
    scales = np.array([[0.5]], dtype=np.float16)
    W = ref.dequantize(qweight, qzeros, scales, None, 4, "gptq_v2")
    assert W.shape == (8, 1)
    np.testing.assert_array_equal(W[:, 0], 0.5 * (np.arange(8) - 8))


# --------------------------------------------------------------------------
# quantize_rtn
# --------------------------------------------------------------------------

@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("sym, fmt", [(True, "gptq"), (True, "gptq_v2"), (False, "gptq_v2"),
                                      (False, "gptq")])
@pytest.mark.parametrize("group_size, act_order", [(32, False), (32, True), (-1, False)])
def test_quantize_rtn_error_bound(bits, sym, fmt, group_size, act_order):
    rng = np.random.default_rng(bits * 7 + group_size)
    K, N = 128, 32
    # Centred data so that asym groups straddle 0 (keeps v1 asym representable:
    # xmin < 0 gives a zero of round(-xmin/scale) >= 1 with these magnitudes).
    W = rng.standard_normal((K, N)) * 0.02
    perm = rng.permutation(K) if act_order else None
    g = ref.make_g_idx(K, group_size, perm)
    for gi in range(g.max() + 1):
        W[np.nonzero(g == gi)[0][0]] = -0.05  # a clearly negative row in every group
    ck = ref.quantize_rtn(W, bits, group_size, sym, fmt, perm=perm)
    g, q, z = ck["g_idx"], ck["q"], ck["z"]
    assert ck["scales"].dtype == np.float16
    np.testing.assert_array_equal(g, ref.make_g_idx(K, group_size, perm))
    if sym:
        assert np.all(z == 1 << (bits - 1))
    np.testing.assert_array_equal(ref.unpack(ck["qweight"], bits, 0), q)
    Wd = ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], g, bits, fmt)
    s = ck["scales"].astype(np.float64)[g]
    maxq = (1 << bits) - 1
    unclipped = (np.round(W / s) + z[g] >= 0) & (np.round(W / s) + z[g] <= maxq)
    assert unclipped.mean() > 0.9  # sym clips at most the max element per group/column
    err = np.abs(Wd - W)
    assert np.all(err[unclipped] <= s[unclipped] / 2 * (1 + 1e-9) + 1e-12)
    # Even clipped entries stay within about one step (fp16 scale rounding only).
    assert np.all(err <= s * 1.01)


def test_quantize_rtn_small_by_hand():
    # Each of 16 columns is [-1, 0, 1, 2] * 4, group_size=-1, 2-bit asym v2:
    # min=-1, max=2 -> scale=(2+1)/3=1, zero=round(1/1)=1, q = round(W)+1 = [0, 1, 2, 3].
    W = np.tile(np.array([[-1.0], [0.0], [1.0], [2.0]] * 4), (1, 16))
    ck = ref.quantize_rtn(W, 2, -1, False, "gptq_v2")
    assert np.all(ck["scales"] == 1) and np.all(ck["z"] == 1)
    np.testing.assert_array_equal(ck["q"][:4, 0], [0, 1, 2, 3])
    # q column = 0,1,2,3 repeated -> 2-bit fields 00 01 10 11 -> byte 0xE4 per 4 values.
    assert np.all(_u32(ck["qweight"]) == 0xE4E4E4E4)
    np.testing.assert_array_equal(
        ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 2, "gptq_v2"), W)


def test_quantize_rtn_zero_guard():
    # An all-zero column gets scale 1 (guard), not 0/NaN; sym has no v1 problem.
    W = np.zeros((32, 16))
    ck = ref.quantize_rtn(W, 4, -1, True, "gptq")
    assert np.all(ck["scales"] == 1)
    Wd = ref.dequantize(ck["qweight"], ck["qzeros"], ck["scales"], ck["g_idx"], 4, "gptq")
    np.testing.assert_array_equal(Wd, W)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_quantize_rtn_v1_refuses_zero_of_zero(bits):
    # All-positive weights: xmin = min(min, 0) = 0, so zero = 0, unrepresentable in v1.
    rng = np.random.default_rng(3)
    W = rng.uniform(0.1, 1.0, size=(64, 32))
    with pytest.raises(ValueError):
        ref.quantize_rtn(W, bits, 32, False, "gptq")
    # The same data is fine in v2, and has zero 0 there.
    ck = ref.quantize_rtn(W, bits, 32, False, "gptq_v2")
    assert np.all(ck["z"] == 0)
    # And sym v1 is fine too (zero is 2^(bits-1)).
    ref.quantize_rtn(W, bits, 32, True, "gptq")
