"""lowbit.ops, the typed Python face of torch.ops.lowbit: one wrapper per
declared op with the schema's arguments, each the op itself (the same result
on the same input), and GGMLType, the ggml type ids by name, accepted
wherever a type id is."""
import inspect

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import lowbit
from lowbit import GGMLType, ops

# Every op of TORCH_LIBRARY(lowbit), from the dispatcher (dir(torch.ops.lowbit)
# lists only the ops that were looked up so far).
DECLARED = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("lowbit::"))
K, N, GS, BITS = 256, 64, 32, 4
ROWS, COLS, EXPERTS = 16, 256, 3


def test_every_declared_op_has_a_wrapper_with_the_schema_arguments():
    assert len(DECLARED) >= 20, DECLARED
    missing = [name for name in DECLARED if not callable(getattr(ops, name, None))]
    assert not missing, f"ops without a wrapper in lowbit.ops: {missing}"
    for name in DECLARED:
        schema = getattr(torch.ops.lowbit, name).default._schema
        params = inspect.signature(getattr(ops, name)).parameters.values()
        assert [p.name for p in params] == [a.name for a in schema.arguments], name
        for p, a in zip(params, schema.arguments):
            assert (p.default is not inspect.Parameter.empty) == a.has_default_value(), (name, p.name)
            if a.has_default_value():
                assert p.default == a.default_value, (name, p.name)
        assert getattr(ops, name).__doc__, f"lowbit.ops.{name} has no docstring"
    assert set(DECLARED) <= set(ops.__all__)


def _gptq():
    g = torch.Generator().manual_seed(0)
    words = lambda *shape: torch.randint(-2**31, 2**31, shape, generator=g, dtype=torch.int64).to(torch.int32)
    return dict(qweight=words(K * BITS // 32, N), qzeros=words(K // GS, N * BITS // 32),
                scales=torch.rand(K // GS, N, generator=g).to(torch.float16), g_idx=(torch.arange(K) // GS).int(),
                perm_k=torch.randperm(K, generator=g).int(), perm_n=torch.randperm(N, generator=g).int(),
                a=torch.randn(3, K, generator=g), values=torch.randint(0, 2**BITS, (K, N), generator=g).int())


def _ggml(type_id=GGMLType.Q4_0, rows=ROWS):
    """Random blocks of a 2-byte-scale type, every block's fp16 scale 1.0."""
    block, nbytes = ops.ggml_type_info(type_id)
    g = torch.Generator().manual_seed(1)
    raw = torch.randint(0, 256, (rows, COLS // block * nbytes), generator=g, dtype=torch.uint8)
    raw.view(-1, nbytes)[:, :2] = torch.tensor([0, 0x3C], dtype=torch.uint8)
    return raw


def _calls():
    """op name -> positional arguments of a valid call."""
    w = _gptq()
    W = _ggml()
    X = torch.randn(5, COLS, generator=torch.Generator().manual_seed(2))
    experts = _ggml(rows=EXPERTS * ROWS).view(EXPERTS, ROWS, -1)
    ids = torch.tensor([[0, 2], [1, 1], [2, 0]], dtype=torch.int32)
    repacked = torch.ops.lowbit.ggml_repack(W, GGMLType.Q4_0, ROWS, COLS)
    experts_repacked = torch.stack([torch.ops.lowbit.ggml_repack(e, GGMLType.Q4_0, ROWS, COLS) for e in experts])
    q4_0 = int(GGMLType.Q4_0)
    g = torch.Generator().manual_seed(3)
    return {
        "gptq_gemm": (w["a"], w["qweight"], w["qzeros"], w["scales"], w["g_idx"], False, True, BITS),
        "gptq_gemm_a8": (w["a"], w["qweight"], w["qzeros"], w["scales"], w["g_idx"], True, BITS),
        "gptq_dequantize": (w["qweight"], w["qzeros"], w["scales"], w["g_idx"], False, BITS),
        "gptq_permute_rows": (w["qweight"], w["perm_k"], BITS),
        "gptq_permute_cols": (w["qweight"], w["qzeros"], w["scales"], w["perm_n"], BITS),
        "gptq_pack": (w["values"], BITS, 0),
        "gptq_unpack": (w["qweight"], BITS, 0),
        "ggml_dequantize": (W, q4_0, ROWS, COLS, torch.float32),
        "ggml_mul_mat_vec_a8": (W, X[:1], q4_0, ROWS),
        "ggml_mul_mat_a8": (W, X, q4_0, ROWS),
        "ggml_mul_mat_id": (experts, X[:3], ids, q4_0, ROWS),
        "ggml_quantize": (X, int(GGMLType.Q8_0)),
        "ggml_repack": (W, q4_0, ROWS, COLS, False),
        "ggml_mul_mat_repacked": (repacked, X, q4_0, ROWS),
        "ggml_mul_mat_id_repacked": (experts_repacked, X[:3], ids, q4_0, ROWS),
        "rms_norm": (X, X[0], 1e-6),
        "decode_attention": (*(torch.randn(*shape, generator=g) for shape in ((4, 32), (2, 32), (2, 32), (32,), (32,),
                                                                               (2, 8, 32), (2, 8, 32))), 3, 0.125),
        "ggml_type_info": (int(GGMLType.Q4_K),),
        "ggml_type_name": (int(GGMLType.IQ4_XS),),
        "ggml_has_repacked_layout": (int(GGMLType.Q6_K),),
        "ggml_cpu_traits": (int(GGMLType.Q4_K),),
        "cpu_isa": (None,),
        "cpu_bf16_kernel": (None,),
        "cpu_float_gemm": (None,),
        "cpu_threads": (None,),
        "cpu_team": (None,),
        "cpu_torch_threads": (None,),
        "cpu_reads_repacked": (q4_0,),
    }


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", [name for name in sorted(_calls()) if name in DECLARED])
def test_wrapper_gives_the_op_s_result(name):
    args = _calls()[name]
    assert _same(getattr(ops, name)(*args), getattr(torch.ops.lowbit, name)(*args))


def test_gptq_shuffle_wrapper_shuffles_as_the_op():
    w = _gptq()
    ours, theirs = w["qweight"].clone(), w["qweight"].clone()
    assert ops.gptq_shuffle(ours, w["perm_k"], BITS) is None
    torch.ops.lowbit.gptq_shuffle(theirs, w["perm_k"], BITS)
    assert torch.equal(ours, theirs) and not torch.equal(ours, w["qweight"])


def test_ggml_type_is_the_type_table():
    """Every id the C++ table answers is a member, under its ggml name, and nothing else."""
    answered = {}
    for type_id in range(256):
        try:
            answered[type_id] = torch.ops.lowbit.ggml_type_name(type_id)
        except ValueError:
            pass
    assert {t.value: t.name for t in GGMLType} == answered
    assert GGMLType.Q4_K == 12 and GGMLType(12) is GGMLType.Q4_K and GGMLType["Q8_0"] == 8
    assert lowbit.GGMLType is GGMLType


def test_ggml_type_matches_gguf_py():
    """Names and ids agree with gguf-py's GGMLQuantizationType wherever it knows the id."""
    gguf = pytest.importorskip("gguf")
    known = {q.value: q.name for q in gguf.GGMLQuantizationType}
    shared = [t for t in GGMLType if t.value in known]
    assert len(shared) >= len(GGMLType) - 2, "gguf-py should know all but the newest types"
    assert [(t.value, t.name) for t in shared] == [(t.value, known[t.value]) for t in shared]
    for t in shared:  # and gguf-py accepts a member as its own type
        assert gguf.GGMLQuantizationType(t) is gguf.GGMLQuantizationType[t.name]


def test_ggml_type_members_work_in_the_ops():
    W, X = _ggml(), torch.randn(4, COLS)
    by_id = torch.ops.lowbit.ggml_mul_mat_a8(W, X, 2, ROWS)
    for fn in (ops.ggml_mul_mat_a8, torch.ops.lowbit.ggml_mul_mat_a8):
        assert torch.equal(fn(W, X, GGMLType.Q4_0, ROWS), by_id)
    assert torch.equal(ops.ggml_dequantize(W, GGMLType.Q4_0, ROWS, COLS),
                       torch.ops.lowbit.ggml_dequantize(W, 2, ROWS, COLS))
    assert ops.ggml_type_info(GGMLType.Q4_K) == [256, 144]
    assert ops.ggml_type_name(GGMLType.Q4_K) == "Q4_K" == GGMLType.Q4_K.name
    # The fake kernels take a member too (torch.compile traces with them).
    with FakeTensorMode() as mode:
        out = ops.ggml_mul_mat_a8(mode.from_tensor(W), mode.from_tensor(X), GGMLType.Q4_0, ROWS)
    assert out.shape == (4, ROWS) and out.dtype == X.dtype
    # And a refused type is named in the same words as for the id.
    for qtype in (GGMLType.Q1_0, 41):
        with pytest.raises(ValueError, match=r"ggml_repack: type 41 \(Q1_0\) has no repacked layout"):
            ops.ggml_repack(_ggml(GGMLType.Q1_0), qtype, ROWS, COLS)


def test_ggml_type_members_work_in_gguf_linear():
    raw = _ggml(GGMLType.Q4_0)
    x = torch.randn(3, COLS)
    by_id = lowbit.GGUFLinear.from_raw(raw, 2, COLS)
    by_member = lowbit.GGUFLinear.from_raw(raw, GGMLType.Q4_0, COLS)
    assert torch.equal(by_member(x), by_id(x))
    assert torch.equal(by_member.dequantize(), by_id.dequantize())
    layer = lowbit.GGUFLinear(COLS, ROWS, qtype=GGMLType.Q4_K, bias=False)
    assert layer.qweight.shape == (ROWS, COLS // 256 * 144) and layer(x).shape == (3, ROWS)
    linear = torch.nn.Linear(COLS, ROWS)
    assert torch.equal(lowbit.GGUFLinear.from_linear(linear, GGMLType.Q8_0).qweight,
                       lowbit.GGUFLinear.from_linear(linear, 8).qweight)


def test_wrappers_compile_with_a_ggml_type():
    W, X = _ggml(), torch.randn(4, COLS)
    compiled = torch.compile(lambda W, X: ops.ggml_mul_mat_a8(W, X, GGMLType.Q4_0, ROWS), fullgraph=True)
    assert torch.equal(compiled(W, X), torch.ops.lowbit.ggml_mul_mat_a8(W, X, 2, ROWS))
