"""The CPU kernels' run-time ISA choice and threading, and lowbit's GGUF
matmul against llama.cpp's own: ggml_mul_mat of llama-cpp-python's libggml
(tests/llama_cpp_peer.py) on identical blocks and activations.

Tolerance against llama.cpp: both quantize the activations to the same 8-bit
blocks and form the same integer sub-block sums, so only the order of the fp32
additions differs: |lowbit - ggml| <= 1e-5 * (|x| @ |W|.T). (Measured: bit-equal
for the legacy types, <= 4e-7 relative for the others.)
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import gguf_blocks as gb
import llama_cpp_peer
import gptq_reference as ref
from conftest import ISAS

ops = torch.ops.lowbit
QUANT_TYPES = [t for t in gb.TYPES if t not in gb.FLOAT_TYPES]
ROWS, N = 48, 512


def usable_isas():
    best = ops.cpu_isa("best")
    return ISAS[: ISAS.index(best) + 1]


def test_cpu_isa_reports_forces_and_validates():
    best = ops.cpu_isa("best")
    assert best in ISAS
    try:
        for isa in usable_isas():
            assert ops.cpu_isa(isa) == isa and ops.cpu_isa() == isa
        with pytest.raises(ValueError, match="cpu_isa: unknown ISA 'sse9'"):
            ops.cpu_isa("sse9")
        if best != "avx512":
            with pytest.raises(ValueError, match="cpu_isa: this CPU cannot run avx512"):
                ops.cpu_isa("avx512")
        assert ops.cpu_isa() == usable_isas()[-1]  # a refused request changes nothing
    finally:
        ops.cpu_isa("best")


def test_cpu_float_gemm_libraries_agree():
    """gptq_gemm's fp32 large-M path (M > 64) on oneDNN's GEMM and on torch's
    BLAS: each within test_gptq_gemm's tolerance of the exact product (1e-5
    of |a| @ |W|, fp32 sums in another order), over shapes of one column
    strip and of many, act-order included, and a refused name changes
    nothing."""
    default = ops.cpu_float_gemm()
    assert default in ("onednn", "blas")
    rng = np.random.default_rng(9)
    try:
        for bits, K, n, act_order in ((2, 512, 96, False), (3, 384, 224, True), (4, 1024, 64, False),
                                      (4, 256, 9000, False), (8, 640, 136, True), (2, 4096, 2048, False)):
            c = ref.random_checkpoint(rng, K, n, bits, 128, False, "gptq_v2", act_order)
            t = [torch.from_numpy(np.ascontiguousarray(c[k])) for k in ("qweight", "qzeros", "scales", "g_idx")]
            W = ref.dequantize(c["qweight"], c["qzeros"], c["scales"], c["g_idx"], bits, "gptq_v2")
            for M in (65, 300):
                a = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
                a64 = a.double().numpy()
                expect, bound = a64 @ W, np.abs(a64) @ np.abs(W)
                for library in ("onednn", "blas"):
                    if library == "onednn" and default == "blas":
                        continue  # a torch without oneDNN
                    assert ops.cpu_float_gemm(library) == library
                    out = ops.gptq_gemm(a, *t, False, True, bits)
                    err = np.abs(out.double().numpy() - expect)
                    assert np.all(err <= 1e-5 * bound), (bits, K, n, M, library)
        with pytest.raises(ValueError, match="cpu_float_gemm: unknown library 'mkl'"):
            ops.cpu_float_gemm("mkl")
        assert ops.cpu_float_gemm() == "blas"
    finally:
        ops.cpu_float_gemm(default)


def test_cpu_bf16_kernel_modes_agree():
    """The GPTQ kernels for bf16 activations (vdpbf16ps where the CPU has
    it, else the fp32 FMA one in every mode; past M = 64 the bf16 GEMM of
    mode gemm) compute the same exact products in fp32, so their bf16
    outputs differ only by the fp32 additions: each within test_gptq_gemm's
    tolerance of the exact product (1e-5 of |a| @ |W|, the vdpbf16ps
    kernel's level offsets cancelling, plus half a bf16 ulp), and nearly
    all of them identical."""
    assert ops.cpu_bf16_kernel() == "auto"
    rng = np.random.default_rng(5)
    K, n = 512, 128
    outs = {}
    try:
        for bits in (2, 3, 4, 8):
            c = ref.random_checkpoint(rng, K, n, bits, 128, False, "gptq_v2", False)
            t = [torch.from_numpy(np.ascontiguousarray(c[k])) for k in ("qweight", "qzeros", "scales", "g_idx")]
            W = ref.dequantize(c["qweight"], c["qzeros"], c["scales"], c["g_idx"], bits, "gptq_v2")
            for M in (1, 2, 8, 80):
                a = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).bfloat16()
                a64 = a.double().numpy()
                expect, bound = a64 @ W, np.abs(a64) @ np.abs(W)
                for mode in ("auto", "always", "gemm"):
                    assert ops.cpu_bf16_kernel(mode) == mode
                    outs[bits, M, mode] = ops.gptq_gemm(a, *t, False, True, bits).float()
                    err = np.abs(outs[bits, M, mode].double().numpy() - expect)
                    assert np.all(err <= 1e-5 * bound + 2.0**-8 * np.abs(expect)), (bits, M, mode)
                auto, always = outs[bits, M, "auto"], outs[bits, M, "always"]
                # The two fused kernels: at most one bf16 ulp apart, as before the gemm mode.
                assert torch.all((auto - always).abs() <= auto.abs().clamp_min(1e-30) * 2.0**-7)
                for other in (always, outs[bits, M, "gemm"]):
                    assert (auto == other).double().mean() >= 0.95
        with pytest.raises(ValueError, match="cpu_bf16_kernel: unknown mode 'fast'"):
            ops.cpu_bf16_kernel("fast")
    finally:
        ops.cpu_bf16_kernel("auto")


def run_with_env(value, code):
    env = dict(os.environ, LOWBIT_CPU_ISA=value)
    return subprocess.run([sys.executable, "-c", "import torch, lowbit; " + code], env=env,
                          capture_output=True, text=True, timeout=120)


def test_lowbit_cpu_isa_environment_variable():
    done = run_with_env("portable", "print(torch.ops.lowbit.cpu_isa())")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "portable"
    bad = run_with_env("bogus", "torch.ops.lowbit.cpu_isa()")
    assert bad.returncode != 0 and "unknown ISA 'bogus'" in bad.stderr


def gptq_case(bits, M):
    rng = np.random.default_rng(bits)
    K, N_out = 512, 320
    g = torch.Generator().manual_seed(bits)
    words = lambda *shape: torch.randint(-(2**31), 2**31, shape, dtype=torch.int64, generator=g).to(torch.int32)
    qweight, qzeros = words(K * bits // 32, N_out), words(K // 128, N_out * bits // 32)
    scales = torch.from_numpy(rng.random((K // 128, N_out), dtype=np.float32) / 2**bits).half()
    a = torch.randn(M, K, generator=g)
    empty = torch.empty(0, dtype=torch.int32)
    return lambda: ops.gptq_gemm(a, qweight, qzeros, scales, empty, False, True, bits)


@pytest.mark.parametrize("isa", ISAS)
def test_results_do_not_depend_on_the_thread_count(isa):
    """Tasks own disjoint outputs, so 1 and 2 threads give identical bits."""
    if isa not in usable_isas():
        pytest.skip(f"this CPU cannot run the {isa} kernels")
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(gb.random_blocks(rng, "Q4_K", ROWS * 8, N))
    x = torch.randn(8, N)
    cases = [gptq_case(bits, M) for bits in (2, 3, 4, 8) for M in (1, 5, 40)]
    cases += [lambda: ops.ggml_mul_mat_vec_a8(raw, x[:1], gb.type_id("Q4_K"), ROWS * 8),
              lambda: ops.ggml_mul_mat_a8(raw, x, gb.type_id("Q4_K"), ROWS * 8),
              lambda: ops.ggml_dequantize(raw, gb.type_id("Q4_K"), ROWS * 8, N, torch.float32)]
    threads = torch.get_num_threads()
    ops.cpu_isa(isa)
    try:
        torch.set_num_threads(1)
        serial = [case() for case in cases]
        torch.set_num_threads(2)
        for case, expect in zip(cases, serial):
            assert torch.equal(case(), expect)
    finally:
        torch.set_num_threads(threads)
        ops.cpu_isa("best")


def roundf(t):
    """C's roundf: halves away from zero."""
    r = np.trunc(t)
    return r + np.where(np.abs(t - r) >= 0.5, np.sign(t), 0).astype(t.dtype)


def llama_cpp_act_levels(x, act):
    """d * q per element of llama.cpp's 8-bit activation blocks, in float32:
    Q8_0 / Q8_1 (blocks of 32: d = amax / 127 kept as fp16, q = roundf(x / d)
    with the unrounded d) or Q8_K (blocks of 256: the first element of largest
    magnitude gives iscale = -127 / max, q = min(rint(iscale * x), 127),
    d = 1 / iscale)."""
    f = np.float32
    if act == "Q8_K":
        blocks = x.reshape(-1, 256)
        out = np.zeros_like(blocks)
        for b, blk in enumerate(blocks):
            j = int(np.argmax(np.abs(blk)))  # the first of equals
            if blk[j] == 0:
                continue
            iscale = f(-127.0) / blk[j]
            out[b] = (f(1.0) / iscale) * np.minimum(np.rint(iscale * blk), 127)
        return out.reshape(x.shape)
    blocks = x.reshape(-1, 32)
    dd = np.abs(blocks).max(axis=1, keepdims=True) / f(127.0)
    inv = np.where(dd != 0, f(1.0) / np.where(dd != 0, dd, f(1.0)), f(0.0)).astype(f)
    return (dd.astype(np.float16).astype(f) * roundf(blocks * inv)).reshape(x.shape)


@pytest.mark.parametrize("qtype,act", [("Q8_0", "Q8_0"), ("Q4_1", "Q8_1"), ("TQ2_0", "Q8_K")])
def test_activation_quantization_is_the_same_on_every_isa(qtype, act):
    """The matmul's activation blocks, read back one element per output through
    one-hot weight rows (out[r] = w[r, r] * d_x * q_x[r], a single product), on
    every ISA the CPU runs: the SIMD quantizer must equal the scalar one bit
    for bit and both llama.cpp's rounding. The activations hit its edges: blocks
    whose scale is 1 with elements on .5 (roundf goes away from zero, Q8_K's
    rint to even) and an all-zero block."""
    n = 768
    rng = np.random.default_rng(1)
    x = (rng.integers(-126, 126, n) + rng.choice([0.5, 0.25, 0.0], n)).astype(np.float32)
    blk = 32 if act != "Q8_K" else 256
    x[::blk] = 127.0 if act != "Q8_K" else -127.0  # scale 1: the halves stay halves
    x[blk : 2 * blk] = rng.standard_normal(blk).astype(np.float32)
    x[2 * blk : 3 * blk] = 0.0
    raw = gb.quantize(np.eye(n, dtype=np.float32), qtype)
    W = torch.from_numpy(raw)
    w = np.diagonal(gb.dequantize(raw, qtype)).astype(np.float32)
    expect = w * llama_cpp_act_levels(x, act)
    outs = {}
    try:
        for isa in usable_isas():
            ops.cpu_isa(isa)
            outs[isa] = ops.ggml_mul_mat_vec_a8(W, torch.from_numpy(x)[None], gb.type_id(qtype), n)[0].numpy()
    finally:
        ops.cpu_isa("best")
    for isa, got in outs.items():
        assert np.array_equal(got, outs["portable"]), isa
    np.testing.assert_allclose(outs["portable"], expect, rtol=1e-6, atol=0)


@pytest.mark.skipif(llama_cpp_peer.available() is not None, reason=str(llama_cpp_peer.available()))
@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_matmul_matches_llama_cpp(device, qtype, M):
    rng = np.random.default_rng([M, gb.type_id(qtype)])
    raw = gb.random_blocks(rng, qtype, ROWS, N)
    x = rng.standard_normal((M, N)).astype(np.float32)
    peer = llama_cpp_peer.GgmlMatmul(raw, gb.type_id(qtype), ROWS, N, M, threads=1)
    peer.set_input(x)
    peer.compute()
    expect = peer.result()
    op = ops.ggml_mul_mat_vec_a8 if M == 1 else ops.ggml_mul_mat_a8
    got = op(torch.from_numpy(raw).to(device), torch.from_numpy(x).to(device), gb.type_id(qtype), ROWS).cpu().numpy()
    assert_agrees_with_llama_cpp(got, expect, raw, x, qtype, qtype)


def assert_agrees_with_llama_cpp(got, expect, raw, x, qtype, what):
    """|lowbit - llama.cpp| <= 1e-5·|x|@|W| per output: both form the same
    integer sub-block sums, and only their fp32 sums may differ."""
    W = gb.dequantize(raw, qtype).astype(np.float64)
    bound = 1e-5 * (np.abs(x.astype(np.float64)) @ np.abs(W).T) + 1e-30
    err = np.abs(got.astype(np.float64) - expect)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert np.all(err <= bound), f"{what}: |lowbit - llama.cpp| {err[worst]:.3g} > {bound[worst]:.3g} at {worst}"


def activations_on_the_int8_grid(rng, M, n):
    """[M, n] fp32 values q·d, q in [-127, 127], d a power of two per 32
    elements with the block's first element at ±127·d, so that any 8-bit
    quantizer (blocks of 32 or 256) finds step d and the integers q exactly."""
    q = rng.integers(-127, 128, (M, n // 32, 32))
    q[:, :, 0] = rng.choice([-127, 127], (M, n // 32))
    d = np.exp2(rng.integers(-4, 2, (M, n // 32, 1)))
    return (q * d).reshape(M, n).astype(np.float32)


@pytest.mark.parametrize("M", [1, 5])
@pytest.mark.parametrize("buffer", llama_cpp_peer.extra_buffers())
def test_matmul_matches_llama_cpp_repacked(buffer, M):
    """The same against llama.cpp with the weight repacked into a layout its
    model loader uses (CPU_REPACK, AMX), which run their own kernels: every
    type the buffer type takes (at 64 rows: AMX takes none at 48) must agree
    with lowbit as closely as the plain blocks do. A configuration is tried
    in a child process first, since one that crashes llama.cpp (AMX at M > 1
    does on one VM) would end the test run.

    The activations lie on the 8-bit grid (per 32 elements a power-of-two
    step d, one element at 127·d), so that every way of rounding them to 8
    bits gives the same integers: llama.cpp's x86 quantizers multiply by
    127/amax where its reference divides by amax/127, and so round the odd
    activation to the neighbouring integer (lowbit rounds as the reference)."""
    rows, taken, crashed = 64, [], {}
    for qtype in QUANT_TYPES:
        rng = np.random.default_rng([M, gb.type_id(qtype), 1])
        raw = gb.random_blocks(rng, qtype, rows, N)
        if not llama_cpp_peer.buffer_takes(gb.type_id(qtype), rows, N, M, buffer):
            continue
        taken.append(qtype)
        why = llama_cpp_peer.runs_in_subprocess(raw.nbytes, gb.type_id(qtype), rows, N, M, 1, buffer)
        if why is not None:
            crashed[qtype] = why
            continue
        x = activations_on_the_int8_grid(rng, M, N)
        got = ops.ggml_mul_mat_a8(torch.from_numpy(raw), torch.from_numpy(x), gb.type_id(qtype), rows).numpy()
        peer = llama_cpp_peer.GgmlMatmul(raw, gb.type_id(qtype), rows, N, M, threads=1, buffer=buffer)
        peer.set_input(x)
        peer.compute()
        assert_agrees_with_llama_cpp(got, peer.result(), raw, x, qtype, f"{qtype} {buffer}")
    assert taken, f"{buffer} took none of the quant types: placing weights in it is broken"
    if len(crashed) == len(taken):
        pytest.skip(f"{buffer} at M = {M}: " + "; ".join(f"{q}: {why}" for q, why in crashed.items()))


def assert_batched_rows_equal_the_matvec(qtype, rows, M, n, seed):
    """ggml_mul_mat_a8 of M activation rows equals ggml_mul_mat_vec_a8 of
    each row bit for bit, on 1 and 2 threads."""
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(gb.random_blocks(rng, qtype, rows, n))
    x = torch.from_numpy(rng.standard_normal((M, n)).astype(np.float32))
    t = gb.type_id(qtype)
    threads = torch.get_num_threads()
    try:
        for k in (1, 2):
            torch.set_num_threads(k)
            batched = ops.ggml_mul_mat_a8(raw, x, t, rows)
            for m in range(M):
                assert torch.equal(batched[m], ops.ggml_mul_mat_vec_a8(raw, x[m : m + 1], t, rows)[0]), (k, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_batched_rows_equal_the_matvec_bit_for_bit(device, qtype):
    """The batched kernels tile weight rows (4 x 4 activation rows with
    AVX-512, the signed legacy types) and may feed signed levels through an
    offset instead of vpsignb; every output lane still sums the same integers
    in the same order as the untiled matvec. With AVX-512 the K-quants and
    IQ4_XS take a GEMM with 16 weight rows across the lanes from M = 8, the
    one-scale 32-element types from M = 8 (with mins) or 32 (signed): it
    forms each block's exact integer sums its own way and must meet fp32 in
    the matvec's order. 131 rows and M = 69 leave partial tiles in both
    directions (16-row GEMM tiles, the last 3 rows in the matvec form), 9
    blocks of 256 fill all 8 fp32 lanes of the integer form and one more,
    73 blocks of 32 leave the 32-element GEMM one block past its last
    4-block decode, M = 69 at n = 2304 spans six activation panels (12 rows
    each), and two threads split the rows unevenly."""
    if device != "cpu":
        pytest.skip("the CPU kernels' tiling")
    n = 2336 if gb.block_shape(qtype)[0] == 32 else 2304
    assert_batched_rows_equal_the_matvec(qtype, rows=131, M=69, n=n, seed=gb.type_id(qtype))


@pytest.mark.parametrize("qtype, M", [("Q4_0", 8), ("Q4_1", 9), ("IQ4_NL", 16), ("Q5_1", 17), ("Q4_K", 16),
                                      ("IQ4_XS", 19), ("Q8_0", 17), ("Q2_K", 18), ("Q3_K", 32), ("Q5_K", 33),
                                      ("Q6_K", 34), ("Q5_0", 128)])
def test_large_batches_through_the_repacked_kernel_equal_the_matvec(device, qtype, M):
    """From M = 8 to 128 by type (repacked_copy_rows in ggml_avx2.cpp) AVX2
    runs a file-layout weight through its type's repacked-layout kernel,
    each 16-row tile moved into a buffer first by repack_tile (a vector
    transpose of the words, the fields and Q5_0's, Q4_K's and Q5_K's last
    words one at a time; Q6_K's fields close its blocks); its passes take 2
    (one-scale types) or 4 activation rows, Q4_0 and Q5_0 start their dots
    from the activations' offsets, and Q6_K's levels come unsigned with its
    offset of 32 (Q3_K's of 4) through the activations' sums.
    Every row must still be the matvec's bit for bit: each type at or just
    past its threshold, 131 rows leave 3 past the last tile (the matvec form
    takes them), odd M a last pass of 1, and two threads split the tiles."""
    if device != "cpu":
        pytest.skip("the CPU kernels' tiling")
    n = 2336 if gb.block_shape(qtype)[0] == 32 else 2304
    assert_batched_rows_equal_the_matvec(qtype, rows=131, M=M, n=n, seed=7)


def test_isa_units_share_no_symbols():
    """Each SIMD unit compiles the kernel headers under its own target pragma.
    A function of those headers with a shared (weak) symbol exists once in the
    library, in whichever unit the linker kept: the AVX2 path could then run
    AVX-512 instructions (SIGILL on an AVX2-only CPU) or the AVX-512 path
    AVX2 code. The headers keep internal linkage; this checks the build."""
    import glob
    import shutil

    import lowbit

    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("needs binutils' nm")
    (path,) = glob.glob(os.path.join(os.path.dirname(lowbit.__file__), "_C*.so"))
    out = subprocess.run([nm, "-C", path], capture_output=True, text=True, check=True).stdout
    # nm lines: address, symbol type (W / V: weak), demangled name.
    shared = [line for line in out.splitlines()
              if line.split(maxsplit=2)[1:2] in (["W"], ["V"]) and "lowbit::cpu::" in line]
    assert not shared, "kernel functions with shared symbols:\n" + "\n".join(shared[:10])
