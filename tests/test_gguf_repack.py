"""The repacked layout (torch.ops.lowbit.ggml_repack, csrc/core/ggml_repack.h)
and the matmul over it (ggml_mul_mat_repacked), and GGUFLinear.repack().

The layout is checked byte by byte against a NumPy statement of it written
from its description here; the matmul must give exactly (bit for bit) what
ggml_mul_mat_a8 / ggml_mul_mat_vec_a8 give for the file's layout, under
every CPU ISA, for every batch size, with and without rows past the last
whole 16-row tile. One exception: where the kernels read the layout of the
32-element types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4) as it is, they sum
each block's dot in int32 before fp32 (RepackedFloatGemm in
ggml_gemm_vnni.h, SumOrder::kBlockDot in ggml_repacked_avx2.h), so there
each output row must equal that row's own matvec bit for bit at every batch
size and the file layout's within fp32 rounding. The file-layout ops are
themselves checked against gguf-py (test_gguf_ops.py)."""
import copy
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import gguf_blocks as gb
from memory_maps import first_huge_page, vm_flags_at
import lowbit

ops = torch.ops.lowbit
REPACKED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
            "IQ4_XS"]
# Each type's fields as (first byte in the file's block, count, bytes each):
# the fp16 d, then m / dmin, and IQ4_XS's 16-bit scales_h; 2-, 3- and 6-bit
# K-quants keep theirs at the block's end; MXFP4's one E8M0 byte. Any other
# type: an fp16 d at byte 0.
FIELDS = {"Q4_1": (0, 2, 2), "Q5_1": (0, 2, 2), "Q4_K": (0, 2, 2), "Q5_K": (0, 2, 2), "IQ4_XS": (0, 2, 2),
          "Q2_K": (80, 2, 2), "Q3_K": (108, 1, 2), "Q6_K": (208, 1, 2), "MXFP4": (0, 1, 1)}
N = 512
TILE = 16


def blocks(name, rows, seed=0):
    return gb.random_blocks(np.random.default_rng([seed, gb.type_id(name), rows]), name, rows, N)


def numpy_repack(raw: np.ndarray, name: str) -> np.ndarray:
    """The layout as documented: per tile of 16 rows and per block, each
    field (FIELDS) of the 16 rows, then each 4-byte word of the rest of the
    block, in the file's order, of the 16 rows; rows past the last whole
    tile as they were."""
    rows = raw.shape[0]
    _, block_bytes = ops.ggml_type_info(gb.type_id(name))
    at, count, size = FIELDS.get(name, (0, 1, 2))
    blk = raw.reshape(rows, -1, block_bytes)
    out = raw.copy()
    for t in range(rows // TILE):
        tile = blk[t * TILE:(t + 1) * TILE]  # [16, blocks, bytes]
        parts = []
        for b in range(tile.shape[1]):
            fields = [tile[:, b, at + size * h:at + size * (h + 1)] for h in range(count)]
            rest = np.delete(tile[:, b], np.arange(at, at + size * count), axis=1)
            words = [rest[:, 4 * w:4 * w + 4] for w in range(rest.shape[1] // 4)]
            parts += [f.reshape(-1) for f in fields + words]
        out[t * TILE:(t + 1) * TILE] = np.concatenate(parts).reshape(TILE, -1)
    return out


@pytest.mark.parametrize("name", REPACKED)
@pytest.mark.parametrize("rows", [5, 16, 40])  # no whole tile; one; two and 8 rows past them
def test_layout_is_the_documented_one_and_inverts(name, rows):
    raw = blocks(name, rows)
    W = torch.from_numpy(raw)
    packed = ops.ggml_repack(W, gb.type_id(name), rows, N)
    assert packed.shape == W.shape and packed.dtype == torch.uint8
    np.testing.assert_array_equal(packed.numpy(), numpy_repack(raw, name))
    assert rows < TILE or not torch.equal(packed, W)
    assert torch.equal(ops.ggml_repack(packed, gb.type_id(name), rows, N, True), W)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="transparent huge pages are a Linux kernel's")
def test_repacked_weights_ask_for_huge_pages():
    """ggml_repack's output (either way) is a weight every matvec streams; on
    4 KB pages a repacked Q4_K matvec streamed 25% slower (huge_pages.h), so
    the op advises huge pages for the whole 2 MB pages inside it ("hg")."""
    rows, n = 1024, 16384  # 9.4 MB of Q4_K
    t = gb.type_id("Q4_K")
    W = torch.from_numpy(gb.random_blocks(np.random.default_rng(0), "Q4_K", rows, n))
    for out in (ops.ggml_repack(W, t, rows, n), ops.ggml_repack(W, t, rows, n, True)):
        assert "hg" in vm_flags_at(first_huge_page(out))


@pytest.mark.parametrize("name", REPACKED)
@pytest.mark.parametrize("rows", [24, 7])
def test_experts_are_each_repacked_as_a_weight_of_their_own(name, rows):
    """W [experts, rows, row bytes]: each expert's rows reordered alone, its
    tiles never reaching into the next expert's rows (rows not a multiple of
    16), and back."""
    t, n, experts = gb.type_id(name), N, 5
    W = torch.from_numpy(blocks(name, experts * rows, n)).view(experts, rows, -1)
    packed = ops.ggml_repack(W, t, rows, n)
    assert packed.shape == W.shape
    assert torch.equal(packed, torch.stack([ops.ggml_repack(w, t, rows, n) for w in W]))
    assert torch.equal(ops.ggml_repack(packed, t, rows, n, True), W)


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"),
                    reason="transparent huge pages are a Linux kernel's")
def test_experts_do_not_ask_for_huge_pages():
    """Experts' rows are read a few experts at a time, in short runs: their
    repacked copy keeps the allocator's pages (huge_pages.h's advice made a
    mixture of experts slower to load, for no faster decode). In a fresh
    process, whose memory no earlier repack has advised."""
    script = textwrap.dedent("""
        import numpy as np, torch
        import gguf_blocks as gb
        from lowbit import ops
        from memory_maps import first_huge_page, vm_flags_at
        experts, rows, n = 8, 256, 8192  # 9.4 MB of Q4_K
        raw = gb.random_blocks(np.random.default_rng(0), "Q4_K", experts * rows, n)
        out = ops.ggml_repack(torch.from_numpy(raw).view(experts, rows, -1), gb.type_id("Q4_K"), rows, n)
        print("hg" in vm_flags_at(first_huge_page(out)))
    """)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.join(os.path.dirname(here), "python"), here, os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False"]


def sums_in_block_order(qtype):
    """Whether the active kernels' repacked matmul of a type id sums each
    block's dot in int32 first (see the module's docstring)."""
    return ops.ggml_type_info(qtype)[0] == 32 and ops.cpu_reads_repacked(qtype)


def assert_same_outputs(got, expect, qtype, repacked=True):
    """A layer's outputs those of its file layout: bit for bit, or where the
    repacked kernels sum in block order, to fp32 rounding."""
    if repacked and sums_in_block_order(qtype):
        torch.testing.assert_close(got, expect, rtol=0, atol=1e-5 * expect.abs().max().item())
    else:
        assert torch.equal(got, expect)


def assert_repacked_outputs(model, x, before):
    """Each layer's outputs those of before it was repacked."""
    for name, m in model.items():
        assert_same_outputs(m(x), before[name], m.qtype, m.repacked)


@pytest.mark.parametrize("name", REPACKED)
@pytest.mark.parametrize("rows", [40, 64])
def test_matmul_equals_the_file_layout_bit_for_bit(cpu_isa, name, rows):
    """Every batch size (passes take up to 8 activation rows with AVX-512
    and up to 4 with AVX2, so the rows left over too; the integer-form types
    go through the GEMM driver from M = 16 or 64)
    against both file-layout ops, on every ISA (AVX-512 reads the layout,
    AVX2 reads it for the types cpu_reads_repacked names; the others put
    the rows back and run their own kernel). Where the kernels sum in block
    order: every row its own matvec's bit for bit (passes take 2, 4 or 8
    activation rows), and the file layout's to within 4e-6 of the sum of the
    products' magnitudes (fp32 sums of 16 blocks in two orders)."""
    t = gb.type_id(name)
    W = torch.from_numpy(blocks(name, rows))
    packed = ops.ggml_repack(W, t, rows, N)
    block_order = sums_in_block_order(t)
    magnitudes = ops.ggml_dequantize(W, t, rows, N, torch.float32).abs().double()
    g = torch.Generator().manual_seed(rows)
    for M in (1, 2, 3, 5, 6, 7, 8, 9, 33, 64, 65):
        x = torch.randn(M, N, generator=g) * torch.logspace(-2, 2, N)  # activation blocks of every scale
        got = ops.ggml_mul_mat_repacked(packed, x, t, rows)
        expect = ops.ggml_mul_mat_a8(W, x, t, rows)
        assert torch.equal(expect, ops.ggml_mul_mat_vec_a8(W, x, t, rows)), M
        if block_order:
            for m in range(M):
                assert torch.equal(got[m], ops.ggml_mul_mat_repacked(packed, x[m : m + 1], t, rows)[0]), (M, m)
            bound = 4e-6 * (x.abs().double() @ magnitudes.T)
            assert ((got.double() - expect.double()).abs() <= bound).all(), M
            assert not torch.equal(got, expect) or M < 3, "the block order's rounding never showed: is it on?"
        else:
            assert torch.equal(got, expect), M
        for dtype in (torch.float16, torch.bfloat16):
            # fp32 inside, rounded once to dtype: the same op's fp32 result, or the file layout's.
            expect = (ops.ggml_mul_mat_repacked(packed, x.to(dtype).float(), t, rows).to(dtype) if block_order
                      else ops.ggml_mul_mat_a8(W, x.to(dtype), t, rows))
            assert torch.equal(ops.ggml_mul_mat_repacked(packed, x.to(dtype), t, rows), expect)
    assert ops.ggml_mul_mat_repacked(packed, torch.zeros(0, N), t, rows).shape == (0, rows)


def test_results_do_not_depend_on_the_thread_count():
    t = gb.type_id("Q4_0")
    W = torch.from_numpy(blocks("Q4_0", 16 * 40))
    packed = ops.ggml_repack(W, t, W.shape[0], N)
    x = torch.randn(3, N)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append(ops.ggml_mul_mat_repacked(packed, x, t, W.shape[0]))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_types_without_the_layout_are_refused():
    raw = torch.from_numpy(blocks("TQ2_0", 16))
    with pytest.raises(ValueError, match=r"^ggml_repack: type 35 \(TQ2_0\) has no repacked layout; the types with one "
                                         r"are Q4_0 \(2\), Q4_1 \(3\), Q5_0 \(6\), .*, IQ4_XS \(23\), MXFP4 \(39\)$"):
        ops.ggml_repack(raw, 35, 16, N)
    with pytest.raises(ValueError, match=r"^ggml_mul_mat_repacked: type 35 \(TQ2_0\) has no repacked layout"):
        ops.ggml_mul_mat_repacked(raw, torch.randn(1, N), 35, 16)
    names = ("Q4_0", "Q5_1", "Q6_K", "IQ4_XS", "TQ2_0", "F16")
    assert [lowbit.gguf.repacking.has_repacked_layout(gb.type_id(n)) for n in names] == [True] * 4 + [False] * 2


# The CPU traits table's rows, written out apart from csrc/cpu/ggml_traits.h:
# [SIMD levels, GEMM form (0 none, 1 float, 2 integer), GEMM from M, repacked
# layout, ISAs reading it (1 AVX2, 2 AVX-512), AVX2 copies from M, repack_model default].
CPU_TRAITS = {
    "Q4_0": [1, 1, 32, 1, 3, 8, 1], "Q4_1": [1, 1, 8, 1, 3, 8, 1], "Q5_0": [1, 1, 32, 1, 3, 128, 1],
    "Q5_1": [1, 1, 8, 1, 3, 16, 1], "Q8_0": [1, 1, 32, 1, 3, 16, 1], "IQ4_NL": [1, 1, 32, 1, 3, 16, 1],
    "MXFP4": [1, 1, 32, 1, 3, 0, 1], "Q2_K": [1, 2, 8, 1, 3, 16, 1], "Q3_K": [1, 2, 8, 1, 3, 32, 1],
    "Q4_K": [1, 2, 8, 1, 3, 16, 1], "Q5_K": [1, 2, 8, 1, 2, 32, 1], "Q6_K": [1, 2, 8, 1, 2, 32, 0],
    "IQ4_XS": [1, 2, 8, 1, 3, 16, 1],
    **{n: [1, 0, 0, 0, 0, 0, 0] for n in ("TQ1_0", "TQ2_0", "NVFP4", "Q1_0", "Q2_0", "IQ2_XXS", "IQ2_XS", "IQ2_S",
                                          "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")},
}


def test_cpu_traits_table():
    """Every type's row of ggml_cpu_traits, and the predicates Python reads from it agree with it."""
    for name in gb.TYPES:
        t = gb.type_id(name)
        row = ops.ggml_cpu_traits(t)
        assert row == CPU_TRAITS.get(name, [0] * 7), name
        assert ops.ggml_has_repacked_layout(t) == bool(row[3])
        assert lowbit.gguf.repacking.repacked_by_default(t) == bool(row[6])
        isa = ops.cpu_isa()
        assert ops.cpu_reads_repacked(t) == bool(row[4] & {"avx2": 1, "avx512": 2}.get(isa, 0)), (name, isa)


def test_opcheck_and_compile():
    for name in REPACKED:
        t = gb.type_id(name)
        W = torch.from_numpy(blocks(name, 40))
        torch.library.opcheck(ops.ggml_repack, (W, t, 40, N))
        torch.library.opcheck(ops.ggml_repack, (W, t, 40, N, True))
        packed = ops.ggml_repack(W, t, 40, N)
        for M in (1, 5):
            torch.library.opcheck(ops.ggml_mul_mat_repacked, (packed, torch.randn(M, N), t, 40))

    t = gb.type_id("Q4_1")
    packed = ops.ggml_repack(torch.from_numpy(blocks("Q4_1", 40)), t, 40, N)

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x):
        return torch.relu(ops.ggml_mul_mat_repacked(packed, x, t, 40)) + 1

    for M in (1, 6):
        x = torch.randn(M, N)
        assert torch.equal(f(x), torch.relu(ops.ggml_mul_mat_repacked(packed, x, t, 40)) + 1)


def layer(name="Q4_0", out=40):
    return lowbit.GGUFLinear.from_raw(torch.from_numpy(blocks(name, out)), gb.type_id(name), N, torch.randn(out))


@pytest.mark.parametrize("name", REPACKED)
def test_gguf_linear_repack_computes_the_same(name):
    plain = layer(name)
    packed = copy.deepcopy(plain).repack()
    assert packed.repacked and "repacked=True" in repr(packed)
    assert not torch.equal(packed.qweight, plain.qweight) and packed.qweight.shape == plain.qweight.shape
    for shape in ((1, N), (3, N), (2, 9, N)):
        x = torch.randn(shape)
        assert_same_outputs(packed(x), plain(x), packed.qtype)
    assert torch.equal(packed.dequantize(), plain.dequantize())
    assert torch.equal(packed.file_layout_qweight(), plain.qweight)
    torch._dynamo.reset()  # each type's layer compiles anew: more types than the recompile limit
    assert torch.equal(torch.compile(packed, fullgraph=True)(x), packed(x))
    assert torch.equal(packed.unrepack().qweight, plain.qweight) and not packed.repacked


def test_gguf_linear_state_dict_and_moves_keep_the_file_layout():
    plain = layer()
    packed = copy.deepcopy(plain).repack()
    x = torch.randn(2, N)
    # A state dict holds the file's layout, loaded into a plain layer or a repacked one.
    assert torch.equal(packed.state_dict()["qweight"], plain.qweight)
    fresh = lowbit.GGUFLinear(N, 40, gb.type_id("Q4_0"))
    fresh.load_state_dict(packed.state_dict())
    assert torch.equal(fresh.qweight, plain.qweight) and torch.equal(fresh(x), plain(x))
    other = lowbit.GGUFLinear(N, 40, gb.type_id("Q4_0")).repack()
    other.load_state_dict(plain.state_dict())
    assert other.repacked and torch.equal(other.qweight, packed.qweight) and torch.equal(other(x), packed(x))
    # Off the CPU (meta stands in for a GPU here) the bytes go back to the file's layout.
    moved = copy.deepcopy(packed).to("meta")
    assert not moved.repacked and moved.qweight.device.type == "meta"
    assert copy.deepcopy(packed).to(torch.bfloat16).repacked  # a dtype change stays on the CPU
    with pytest.raises(ValueError, match="GGUFLinear.repack: the repacked layout is the CPU kernels'; qweight is on meta"):
        moved.repack()


@pytest.mark.parametrize("name", ["F16", "BF16", "Q1_0", "TQ2_0"])
def test_gguf_linear_repack_names_a_type_without_the_layout(name):
    """ggml_repack's error named the op, not the layer's method or its qtype."""
    layer = lowbit.GGUFLinear(256, 16, gb.type_id(name))
    with pytest.raises(ValueError, match=rf"^GGUFLinear.repack: qtype {gb.type_id(name)} \({name}\) has no "
                                         r"repacked layout"):
        layer.repack()
    assert not layer.repacked


def test_a_partial_or_failed_load_leaves_a_repacked_layer_as_it_was():
    """What a state dict leaves out (strict=False), or a load that fails, keeps the repacked bytes as they were
    (not repacked a second time: NaN outputs)."""
    packed = layer().repack()
    x = torch.randn(2, N)
    want = packed(x)
    packed.load_state_dict({"bias": packed.bias.clone()}, strict=False)
    assert packed.repacked and torch.equal(packed(x), want)
    with pytest.raises(RuntimeError, match="size mismatch for qweight"):
        packed.load_state_dict({"qweight": torch.zeros(5, 5, dtype=torch.uint8), "bias": packed.bias.clone()})
    assert packed.repacked and torch.equal(packed(x), want)


# The types whose layout the AVX2 kernels read as it is (the others' rows go back per call).
AVX2_READS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "IQ4_XS"]


def test_cpu_reads_repacked_names_the_kernels_that_read_the_layout(cpu_isa):
    isa = ops.cpu_isa()
    expect = {"avx512": REPACKED, "avx2": AVX2_READS, "portable": []}[isa]
    for name in gb.TYPES:
        assert ops.cpu_reads_repacked(gb.type_id(name)) == (name in expect), (isa, name)


@pytest.mark.skipif(torch.ops.lowbit.cpu_isa("best") == "portable", reason="no SIMD kernels read the layout")
def test_repack_model_on_avx2_takes_the_types_its_kernels_read():
    model = torch.nn.ModuleDict({"a": layer("Q4_0"), "c": layer("Q8_0", out=24), "k": layer("Q5_K", out=32),
                                 "n": layer("IQ4_NL", out=48)})
    x = torch.randn(3, N)
    isa = ops.cpu_isa()
    try:
        ops.cpu_isa("avx2")
        before = {name: m(x) for name, m in model.items()}
        with pytest.warns(UserWarning, match=r"this CPU's avx2 kernels would put the repacked rows back on every "
                                             r"call for ggml types \[13\]"):
            assert lowbit.repack_model(model) == ["a", "c", "n"]
        assert [m.repacked for m in model.values()] == [True, True, False, True]
        assert_repacked_outputs(model, x, before)
    finally:
        ops.cpu_isa(isa)


def test_repack_model_skip_types_are_ggml_types():
    """Types by GGMLType, id or name; anything else is refused, not skipped by nothing."""
    for skip in (["Q4_0"], [gb.type_id("Q4_0")], [lowbit.GGMLType.Q4_0], np.array([gb.type_id("Q4_0")])):
        model = torch.nn.ModuleDict({"a": layer("Q4_0")})
        assert lowbit.repack_model(model, skip_types=skip) == [] and not model["a"].repacked
    model = torch.nn.ModuleDict({"a": layer("Q4_0")})
    for skip, says in ((2, "skip_types must be a collection of ggml types, got 2"),
                       ({"bogus"}, "skip_types holds 'bogus', not a ggml type"), ([True], "skip_types holds True"),
                       ([9999], "skip_types holds 9999")):
        with pytest.raises(ValueError, match=f"repack_model: {says}"):
            lowbit.repack_model(model, skip_types=skip)
    with pytest.raises(ValueError, match="repack_model: expert_skip_types holds 'Q9'"):
        lowbit.repack_model(model, expert_skip_types=["Q9"])
    # One name alone is no collection of its letters.
    with pytest.raises(ValueError, match=r"^repack_model: skip_types must be a collection of ggml types, got the "
                                         r"string 'Q4_0' \(pass \['Q4_0'\]\)$"):
        lowbit.repack_model(model, skip_types="Q4_0")
    for bad in (None, "model", dict(model.items())):
        with pytest.raises(TypeError, match="^repack_model: model must be an nn.Module, got "):
            lowbit.repack_model(bad)
    assert not model["a"].repacked


def test_layers_repacked_in_inference_mode_serve_calls_that_record_a_graph():
    """repack (and GPTQ's sort_rows within it) under torch.inference_mode, as
    a server sets a model up: the new layout is no inference tensor, which a
    later call that saves for backward (a LoRA adapter in training) could not take."""
    torch.manual_seed(0)
    gptq = lowbit.GPTQLinear.from_linear(torch.nn.Linear(N, 64), 4, 32, perm=torch.randperm(N))
    for plain in (layer(), gptq):
        packed = copy.deepcopy(plain)
        with torch.inference_mode():
            packed.repack()
        assert packed.repacked and not any(t.is_inference() for t in packed.buffers())
        x = torch.randn(3, N, requires_grad=True)
        packed(x).sum().backward()
        want = x.grad.clone()
        x.grad = None
        plain(x).sum().backward()
        torch.testing.assert_close(x.grad, want)
        with torch.inference_mode():
            packed.unrepack()
        assert not any(t.is_inference() for t in packed.buffers())


@pytest.mark.skipif(torch.ops.lowbit.cpu_isa("best") != "avx512", reason="only the AVX-512 kernels read Q6_K repacked")
def test_repack_model_takes_the_layers_with_a_layout():
    model = torch.nn.ModuleDict({"a": layer("Q4_0"), "k": lowbit.GGUFLinear(N, 16, gb.type_id("TQ2_0")),
                                 "c": layer("Q8_0", out=24), "six": layer("Q6_K", out=32)})
    x = torch.randn(3, N)
    before = {name: m(x) for name, m in model.items()}
    assert lowbit.repack_model(model) == ["a", "c"]  # Q6_K: not repacked by default (csrc/cpu/ggml_traits.h)
    assert [m.repacked for m in model.values()] == [True, False, True, False]
    assert lowbit.repack_model(model, skip_types=()) == ["a", "c", "six"]
    assert [m.repacked for m in model.values()] == [True, False, True, True]
    assert_repacked_outputs(model, x, before)
    # Where the kernels would put the rows back on every call, nothing is repacked.
    model = torch.nn.ModuleDict({"a": layer("Q4_0")})
    before = torch.ops.lowbit.cpu_isa()
    try:
        torch.ops.lowbit.cpu_isa("portable")
        with pytest.warns(UserWarning, match="this CPU's portable kernels would put the repacked rows back"):
            assert lowbit.repack_model(model) == []
    finally:
        torch.ops.lowbit.cpu_isa(before)
    assert not model["a"].repacked
