"""Tensor parallelism for act-order GPTQ (lowbit.gptq.tp): Algorithm 1
(make_sequential), Algorithm 3 (tp_aware, reorder_checkpoint), the sharded
layers, and TPAwareMLP / NaiveTPMLP over gloo process groups of 2 and 4 CPU
processes against the single-process unsharded MLP.

Tolerance: sharding changes only the order of fp32 sums (the row-parallel
AllReduce adds T partial products), so outputs must match the unsharded
reference to rtol 1e-4 with atol 1e-4 * max|reference|. The offline
reorderings move whole quantized fields, so their dequantized weights match
exactly.
"""
import json
import re
import shutil
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from gptq_checkpoints import OUTSIDE_LINKS, link_outside
from lowbit.gptq import GPTQCheckpointError, GPTQConfig, GPTQLinear, load_gptq, save_gptq
from lowbit.gptq.tp import (ColumnParallelGPTQLinear, NaiveTPMLP, RowParallelGPTQLinear, SequentialGPTQLinear,
                       TPAwareMLP, group_order, make_sequential, permute_inputs, permute_outputs, reorder_checkpoint,
                       tp_aware)
from lowbit.gptq.tp import MLP_PARTS

HIDDEN, INTER = 256, 512
# (bits, group_size, sym, checkpoint_format, bias): every bit width, both
# zero formats, with and without biases.
CASES = {
    2: (32, False, "gptq_v2", False),
    3: (64, True, "gptq", True),
    4: (64, False, "gptq_v2", True),
    8: (32, True, "gptq", False),
}
BITS = sorted(CASES)
PREFIXES = ["model.layers.0.mlp", "model.layers.1.mlp"]


def assert_matches(out, ref, what):
    atol = 1e-4 * ref.abs().max().item()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=atol, msg=lambda m: f"{what}: {m}")


def matches(out, ref):
    return torch.allclose(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


class SwiGLU(nn.Module):
    """The HF Llama MLP layout."""

    def __init__(self, gate_proj, up_proj, down_proj):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def act_order(in_features, out_features, bits, seed):
    """An act-order GPTQLinear (scattered g_idx) quantized from a random Linear."""
    group_size, sym, fmt, bias = CASES[bits]
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features, generator=g) / in_features**0.5)
        if bias:
            linear.bias.copy_(torch.randn(out_features, generator=g) / 10)
    perm = torch.randperm(in_features, generator=g)
    return GPTQLinear.from_linear(linear, bits, group_size, sym, fmt, perm=perm)


def act_order_mlp(bits, seed=0):
    return SwiGLU(act_order(HIDDEN, INTER, bits, seed), act_order(HIDDEN, INTER, bits, seed + 1),
                  act_order(INTER, HIDDEN, bits, seed + 2))


def inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, HIDDEN, generator=g) for m in (1, 5)]


def model_of(mlps):
    """A module tree whose MLPs are named model.layers.<i>.mlp, like HF Llama's."""
    root, layers = nn.Module(), nn.ModuleList()
    for mlp in mlps:
        layer = nn.Module()
        layer.mlp = mlp
        layers.append(layer)
    root.model = nn.Module()
    root.model.layers = layers
    root.model.norm = nn.Linear(4, 4)  # a tensor that is not part of any MLP
    return root


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per bit width: an act-order checkpoint with two MLPs, its tp_aware
    reordering, and the unsharded reference outputs of each MLP."""
    root = tmp_path_factory.mktemp("tp")
    cases = []
    for bits in BITS:
        group_size, sym, fmt, _ = CASES[bits]
        mlps = [act_order_mlp(bits, seed=10 * bits + i) for i in range(len(PREFIXES))]
        original, reordered = root / f"{bits}bit", root / f"{bits}bit-tp"
        save_gptq(model_of(mlps), original, GPTQConfig(bits, group_size, True, sym, fmt))
        assert reorder_checkpoint(original, reordered) == PREFIXES
        xs = inputs(bits)
        with torch.no_grad():
            refs = {p: [mlp(x) for x in xs] for p, mlp in zip(PREFIXES, mlps)}
        cases.append({"bits": bits, "original": str(original), "reordered": str(reordered), "xs": xs,
                      "refs": refs, "mlps": mlps})
    return cases


# ---------------------------------------------------------------------------
# Single process: the offline reorderings
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows_sorted", [False, True])  # True: as the checkpoint loaders hold act-order layers
@pytest.mark.parametrize("bits", BITS)
def test_make_sequential(bits, rows_sorted):
    layer = act_order(INTER, HIDDEN, bits, seed=bits)
    if rows_sorted:
        layer.sort_rows()
    seq = make_sequential(layer)
    perm = torch.argsort(layer.g_idx, stable=True)
    assert isinstance(seq, SequentialGPTQLinear) and not seq.desc_act
    assert torch.equal(seq.input_perm, perm)
    assert torch.equal(seq.g_idx, (torch.arange(INTER) // CASES[bits][0]).int())
    assert torch.equal(seq.scales, layer.scales) and torch.equal(seq.qzeros, layer.qzeros)
    assert torch.equal(seq.dequantize(torch.float32), layer.dequantize(torch.float32)[:, perm])
    g = torch.Generator().manual_seed(bits)
    for m in (1, 5):
        x = torch.randn(m, INTER, generator=g)
        assert_matches(seq(x), layer(x), f"{bits}-bit make_sequential, M={x.shape[0]}")


@pytest.mark.parametrize("rows_sorted", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_tp_aware(bits, rows_sorted):
    mlp = act_order_mlp(bits)
    if rows_sorted:
        for part in ("gate_proj", "up_proj", "down_proj"):
            getattr(mlp, part).sort_rows()
    before = {part: getattr(mlp, part) for part in ("gate_proj", "up_proj", "down_proj")}
    xs = inputs(bits)
    with torch.no_grad():
        refs = [mlp(x) for x in xs]
    assert tp_aware(mlp) is mlp
    perm = torch.argsort(before["down_proj"].g_idx, stable=True)
    assert torch.equal(mlp.down_proj.g_idx, (torch.arange(INTER) // CASES[bits][0]).int())
    assert not mlp.down_proj.desc_act and mlp.gate_proj.desc_act
    for part in ("gate_proj", "up_proj"):
        w = before[part].dequantize(torch.float32)
        assert torch.equal(getattr(mlp, part).dequantize(torch.float32), w[perm])
        assert torch.equal(getattr(mlp, part).g_idx, before[part].g_idx)
        if before[part].bias is not None:
            assert torch.equal(getattr(mlp, part).bias, before[part].bias[perm])
    w = before["down_proj"].dequantize(torch.float32)
    assert torch.equal(mlp.down_proj.dequantize(torch.float32), w[:, perm])
    for x, ref in zip(xs, refs):
        assert_matches(mlp(x), ref, f"{bits}-bit tp_aware MLP, M={x.shape[0]}")


@pytest.mark.parametrize("rows_sorted", [False, True])
@pytest.mark.parametrize("bits", BITS)
def test_permutation_round_trips(bits, rows_sorted):
    layer = act_order(HIDDEN, INTER, bits, seed=bits)
    if rows_sorted:
        layer.sort_rows()
    g = torch.Generator().manual_seed(bits)
    cols, rows = torch.randperm(INTER, generator=g), torch.randperm(HIDDEN, generator=g)
    x = torch.randn(3, HIDDEN, generator=g)
    assert_matches(permute_outputs(layer, cols)(x), layer(x)[:, cols], f"{bits}-bit permute_outputs")
    assert_matches(permute_inputs(layer, rows)(x[:, rows]), layer(x), f"{bits}-bit permute_inputs")
    back = permute_inputs(permute_outputs(permute_outputs(permute_inputs(layer, rows), cols), torch.argsort(cols)),
                          torch.argsort(rows))
    for name, buffer in layer.state_dict().items():
        assert torch.equal(back.state_dict()[name], buffer), f"{bits}-bit round trip changed {name}"
    # A sequential layer keeps its input order through further reorderings.
    seq = make_sequential(permute_inputs(layer, rows))
    assert_matches(make_sequential(seq)(x[:, rows]), layer(x), f"{bits}-bit make_sequential twice")
    out = permute_outputs(seq, cols)
    assert isinstance(out, SequentialGPTQLinear)
    assert_matches(out(x[:, rows]), layer(x)[:, cols], f"{bits}-bit permute_outputs of a sequential layer")
    with pytest.raises(TypeError, match="already permutes its input"):
        permute_inputs(seq, rows)


def test_reorder_checkpoint(checkpoints, tmp_path):
    for case in checkpoints:
        original, reordered = load_gptq(case["original"]), load_gptq(case["reordered"])
        assert reordered.config.to_dict() == original.config.to_dict()
        assert torch.equal(reordered.tensors["model.norm.weight"], original.tensors["model.norm.weight"])
        for prefix, mlp in zip(PREFIXES, case["mlps"]):
            loaded = SwiGLU(*(reordered.modules[f"{prefix}.{part}"] for part in ("gate_proj", "up_proj", "down_proj")))
            ref = tp_aware(SwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj))
            for name, buffer in ref.state_dict().items():
                assert torch.equal(loaded.state_dict()[name], buffer), f"{prefix}.{name} differs from tp_aware's"
            for x, y in zip(case["xs"], case["refs"][prefix]):
                assert_matches(loaded(x), y, f"{case['bits']}-bit reordered checkpoint {prefix}")
    # Only the named MLP is reordered.
    case = checkpoints[0]
    assert reorder_checkpoint(case["original"], tmp_path / "one", [PREFIXES[1]]) == [PREFIXES[1]]
    one = load_gptq(tmp_path / "one")
    assert torch.equal(one.modules[f"{PREFIXES[0]}.down_proj"].g_idx, case["mlps"][0].down_proj.g_idx)
    with pytest.raises(ValueError, match="MLP 'model.layers.7.mlp' has no quantized"):
        reorder_checkpoint(case["original"], tmp_path / "bad", ["model.layers.7.mlp"])
    with pytest.raises(FileExistsError, match="^reorder_checkpoint: .* already exists"):
        reorder_checkpoint(case["original"], tmp_path / "one")
    with pytest.raises(ValueError, match="^reorder_checkpoint: dst must be a directory path, got an empty one$"):
        reorder_checkpoint(case["original"], "")


@pytest.mark.parametrize("case", OUTSIDE_LINKS)
def test_reorder_checkpoint_refuses_links_out_of_the_source(checkpoints, tmp_path, case):
    """As convert_checkpoint: a link out of the source would publish what it points to with the output."""
    src = shutil.copytree(checkpoints[0]["original"], tmp_path / "src")
    with pytest.raises(GPTQCheckpointError, match=re.escape(link_outside(src, case))):
        reorder_checkpoint(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_reorder_checkpoint_keeps_each_config_file_s_keys(checkpoints, tmp_path):
    """config.json's quantization_config and quantize_config.json keep their own keys (HF reads
    modules_in_block_to_quantize from config.json alone)."""
    src = tmp_path / "src"
    shutil.copytree(checkpoints[0]["original"], src)
    content = json.loads((src / "config.json").read_text())
    content["quantization_config"]["modules_in_block_to_quantize"] = [["mlp.gate_proj"]]
    (src / "config.json").write_text(json.dumps(content))
    quantize = dict(json.loads((src / "quantize_config.json").read_text()), meta={"quantizer": ["gptqmodel:4.0"]})
    (src / "quantize_config.json").write_text(json.dumps(quantize))
    reorder_checkpoint(src, tmp_path / "dst")
    assert json.loads((tmp_path / "dst" / "config.json").read_text()) == content
    assert json.loads((tmp_path / "dst" / "quantize_config.json").read_text()) == quantize


# ---------------------------------------------------------------------------
# Single process: shard arithmetic without communication
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("rows_sorted", [False, True])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("world_size", [2, 4])
def test_shards_recombine(bits, world_size, rows_sorted):
    """Column shards concatenate and row shards (sorted g_idx) sum to the full layer."""
    layer = act_order(INTER, HIDDEN, bits, seed=bits)
    if rows_sorted:
        layer.sort_rows()
    x = torch.randn(5, INTER)
    cols = [ColumnParallelGPTQLinear.from_layer(layer, r, world_size) for r in range(world_size)]
    assert_matches(torch.cat([c(x) for c in cols], dim=-1), layer(x), f"{bits}-bit column shards")
    seq = make_sequential(layer)
    rows = [RowParallelGPTQLinear.from_layer(seq, r, world_size) for r in range(world_size)]
    xs = x[:, seq.input_perm].chunk(world_size, dim=-1)
    out = sum(r.local(xr) for r, xr in zip(rows, xs))
    if seq.bias is not None:
        out = out + rows[0].bias
    assert_matches(out, layer(x), f"{bits}-bit row shards")


def test_row_shards_one_group():
    """group_size -1: every rank keeps the single group's scales and zeros."""
    linear = nn.Linear(INTER, HIDDEN)
    layer = GPTQLinear.from_linear(linear, 4, -1, sym=False, checkpoint_format="gptq_v2")
    rows = [RowParallelGPTQLinear.from_layer(layer, r, 4) for r in range(4)]
    x = torch.randn(3, INTER)
    out = sum(r.local(xr) for r, xr in zip(rows, x.chunk(4, dim=-1))) + rows[0].bias
    assert_matches(out, layer(x), "group_size -1 row shards")


def test_one_row_shard_keeps_a_short_last_group():
    """world_size 1: the single shard is the whole layer, a short last group (K % group_size != 0) included;
    more ranks would split a group and are refused."""
    linear = nn.Linear(96, HIDDEN)
    layer = GPTQLinear.from_linear(linear, 4, 64, sym=False, checkpoint_format="gptq_v2")
    row = RowParallelGPTQLinear.from_layer(layer, 0, 1)
    x = torch.randn(3, 96)
    assert_matches(row.local(x) + row.bias, layer(x), "one row shard")
    with pytest.raises(ValueError, match="not a whole number of groups of 64"):
        RowParallelGPTQLinear.from_layer(layer, 0, 2)
    # model.to(dtype) keeps the checkpoint's scales and the bias as stored, as GPTQLinear does.
    bias, scales = row.bias.clone(), row.local.scales.clone()
    row = row.to(torch.bfloat16)
    assert torch.equal(row.bias, bias) and torch.equal(row.local.scales, scales) and bias.dtype == torch.float16


@pytest.mark.parametrize("bits, offset", [(2, 0x55555555), (4, 0x11111111), (8, 0x01010101)])
def test_reorder_checkpoint_of_gptqmodel_v1_zeros(tmp_path, bits, offset):
    """GPTQModel writes v1 zeros by subtracting `offset` from each packed word, so a zero point of 0 borrows from
    the next field: the reordered columns must carry their zero points, not fields of those words."""
    from safetensors.torch import load_file, save_file

    group_size, sym, _, _ = CASES[bits]
    save_gptq(model_of([act_order_mlp(bits, seed=3)]), tmp_path / "v2", GPTQConfig(bits, group_size, True, sym,
                                                                                   "gptq_v2"))
    tensors = load_file(tmp_path / "v2" / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_proj.qzeros", "up_proj.qzeros"))]:
        zeros = torch.ops.lowbit.gptq_unpack(tensors[name], bits, 1)
        zeros[:, ::3] = 0  # zero points of 0 throughout
        tensors[name] = torch.ops.lowbit.gptq_pack(zeros, bits, 1)
    save_file(tensors, tmp_path / "v2" / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".qzeros")]:
        words = (tensors[name].long() - offset) & 0xFFFFFFFF
        tensors[name] = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    shutil.copytree(tmp_path / "v2", tmp_path / "v1")
    save_file(tensors, tmp_path / "v1" / "model.safetensors")
    for config in ("config.json", "quantize_config.json"):
        content = json.loads((tmp_path / "v1" / config).read_text())
        (content["quantization_config"] if config == "config.json" else content)["checkpoint_format"] = "gptq"
        (tmp_path / "v1" / config).write_text(json.dumps(content))
    reorder_checkpoint(tmp_path / "v1", tmp_path / "v1-tp")
    with pytest.warns(UserWarning, match="as GPTQModel writes them"):
        reordered = load_gptq(tmp_path / "v1-tp").modules
    truth = load_gptq(tmp_path / "v2").modules
    parts = ("gate_proj", "up_proj", "down_proj")
    x = inputs(bits)[1]
    with torch.no_grad():
        want = SwiGLU(*(truth[f"{PREFIXES[0]}.{p}"] for p in parts))(x)
        assert_matches(SwiGLU(*(reordered[f"{PREFIXES[0]}.{p}"] for p in parts))(x), want, f"{bits}-bit")


def test_sharded_loading_reads_a_mislabelled_format_as_load_gptq_does(checkpoints, tmp_path):
    """A symmetric checkpoint labelled v1 whose words all hold v2 zero points: load_gptq reads the words' format
    (with a warning), and the sharded loaders decide the same for the whole checkpoint."""
    from safetensors.torch import load_file, save_file

    case = checkpoints[3]  # 8-bit, symmetric, labelled "gptq"
    tensors = load_file(f"{case['reordered']}/model.safetensors")
    for name in [n for n in tensors if n.endswith(".qzeros")]:  # the same zero points, written as v2 fields
        tensors[name] = torch.ops.lowbit.gptq_pack(torch.ops.lowbit.gptq_unpack(tensors[name], 8, 1) + 1, 8, 1)
    shutil.copytree(case["reordered"], tmp_path / "mislabelled")
    save_file(tensors, tmp_path / "mislabelled" / "model.safetensors")
    prefix = PREFIXES[0]
    with pytest.warns(UserWarning, match="the config says checkpoint_format='gptq' but all .* store gptq_v2"):
        TPAwareMLP.from_checkpoint(tmp_path / "mislabelled", prefix, 0, 1)
    with pytest.warns(UserWarning, match="store gptq_v2"):
        whole = load_gptq(tmp_path / "mislabelled").modules
    mlp = SwiGLU(*(whole[f"{prefix}.{p}"] for p in MLP_PARTS))
    for world_size in (1, 2):
        columns = [ColumnParallelGPTQLinear.from_checkpoint(tmp_path / "mislabelled", f"{prefix}.gate_proj", r,
                                                            world_size) for r in range(world_size)]
        rows = [RowParallelGPTQLinear.from_checkpoint(tmp_path / "mislabelled", f"{prefix}.down_proj", r,
                                                      world_size) for r in range(world_size)]
        x, h = case["xs"][1], torch.randn(5, INTER)
        with torch.no_grad():
            assert_matches(torch.cat([c(x) for c in columns], -1), mlp.gate_proj(x), "column shards")
            k = INTER // world_size
            assert_matches(sum(r.local(h[:, i * k:(i + 1) * k]) for i, r in enumerate(rows)), mlp.down_proj(h),
                           "row shards")

    # The format the warning advises forcing is read as given, without a warning, as load_gptq reads it.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forced = load_gptq(tmp_path / "mislabelled", checkpoint_format="gptq").modules
        column = ColumnParallelGPTQLinear.from_checkpoint(tmp_path / "mislabelled", f"{prefix}.gate_proj", 0, 1,
                                                          checkpoint_format="gptq")
        mlp = TPAwareMLP.from_checkpoint(tmp_path / "mislabelled", prefix, 0, 1, checkpoint_format="gptq")
    x = case["xs"][1]
    with torch.no_grad():
        want = forced[f"{prefix}.gate_proj"](x)
        assert not torch.allclose(want, whole[f"{prefix}.gate_proj"](x))  # the forced label reads other zeros
        assert torch.equal(column(x), want)
        assert torch.equal(mlp(x), SwiGLU(*(forced[f"{prefix}.{p}"] for p in MLP_PARTS))(x))
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        RowParallelGPTQLinear.from_checkpoint(tmp_path / "mislabelled", f"{prefix}.down_proj", 0, 1,
                                              checkpoint_format="v1")


def test_checkpoint_shards_equal_layer_shards(checkpoints):
    case = checkpoints[1]  # 3-bit: the straddling packing
    mlp, prefix = case["mlps"][0], PREFIXES[0]
    for r in range(2):
        a = ColumnParallelGPTQLinear.from_checkpoint(case["original"], f"{prefix}.up_proj", r, 2)
        b = ColumnParallelGPTQLinear.from_layer(mlp.up_proj, r, 2)
        assert a.state_dict().keys() == b.state_dict().keys()
        for name, t in a.state_dict().items():
            assert torch.equal(t, b.state_dict()[name]), f"column rank {r}: {name}"
        down = tp_aware(SwiGLU(mlp.gate_proj, mlp.up_proj, mlp.down_proj)).down_proj
        a = RowParallelGPTQLinear.from_checkpoint(case["reordered"], f"{prefix}.down_proj", r, 2)
        b = RowParallelGPTQLinear.from_layer(down, r, 2)
        for name, t in a.state_dict().items():
            assert torch.equal(t, b.state_dict()[name]), f"row rank {r}: {name}"


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

def test_errors(checkpoints):
    three, four = checkpoints[1], checkpoints[2]  # group_size 64 both
    gate, down = f"{PREFIXES[0]}.gate_proj", f"{PREFIXES[0]}.down_proj"
    with pytest.raises(ValueError, match=rf"{gate}: output features \(columns\) 512 is not divisible by world_size 3"):
        ColumnParallelGPTQLinear.from_checkpoint(four["original"], gate, 0, 3)
    with pytest.raises(ValueError, match=rf"{down}: input features \(rows\) 512 is not divisible by world_size 3"):
        RowParallelGPTQLinear.from_checkpoint(four["reordered"], down, 0, 3)
    with pytest.raises(ValueError, match=rf"{down}: each rank would hold 32 of the 512 input rows, which is not a "
                                         r"whole number of groups of 64"):
        RowParallelGPTQLinear.from_checkpoint(four["reordered"], down, 0, 16)
    with pytest.raises(ValueError, match=rf"{gate}: each rank would hold 16 of the 512 output features \(columns\), "
                                         r"but 3-bit packing stores 32 per 3 int32 word\(s\)"):
        ColumnParallelGPTQLinear.from_checkpoint(three["original"], gate, 0, 32)
    with pytest.raises(ValueError, match=rf"{down}: each rank would hold 16 of the 512 input features \(rows\)"):
        RowParallelGPTQLinear.from_checkpoint(three["reordered"], down, 0, 32)
    with pytest.raises(ValueError, match=rf"{down}: g_idx is act-order .* tp_aware\(mlp\) or reorder_checkpoint"):
        RowParallelGPTQLinear.from_checkpoint(four["original"], down, 1, 2)
    with pytest.raises(ValueError, match="g_idx is act-order"):
        TPAwareMLP.from_checkpoint(four["original"], PREFIXES[0], 0, 2)
    with pytest.raises(ValueError, match=rf"{gate}: rank 2 is not in \[0, world_size=2\)"):
        ColumnParallelGPTQLinear.from_checkpoint(four["original"], gate, 2, 2)
    missing = f"{PREFIXES[0]}.nothing"
    with pytest.raises(ValueError, match=rf"module '{missing}': missing tensor '{missing}.qweight'"):
        ColumnParallelGPTQLinear.from_checkpoint(four["original"], missing, 0, 2)


@pytest.mark.parametrize("edit, pattern", [
    (lambda t, m: t.pop(f"{m}.g_idx"), "missing tensor '{m}.g_idx', which an act-order"),
    (lambda t, m: t.update({f"{m}.qweight": t[f"{m}.qweight"].float()}), "qweight has dtype F32"),
    (lambda t, m: t.update({f"{m}.scales": t[f"{m}.scales"].to(torch.int32)}), "scales has dtype I32"),
    (lambda t, m: t.update({f"{m}.g_idx": t[f"{m}.g_idx"].float()}), "g_idx has dtype F32"),
    (lambda t, m: t[f"{m}.scales"].view(-1)[5:6].fill_(float("nan")), r"scales holds a non-finite value \(nan\)"),
    (lambda t, m: t[f"{m}.g_idx"].__setitem__(0, 1000), r"g_idx values must lie in \[0, 4\), found \[0, 1000\]"),
    (lambda t, m: t[f"{m}.g_idx"].__setitem__(0, -3), r"g_idx values must lie in \[0, 4\), found \[-3, 3\]"),
    # int64 values beyond int32 that the cast to int32 would wrap back into range.
    (lambda t, m: t.update({f"{m}.g_idx": t[f"{m}.g_idx"].long() + 2**32}), r"g_idx values must lie in \[0, 4\)"),
    (lambda t, m: t.update({f"{m}.{k}": t[f"{m}.{k}"][:0] for k in ("qweight", "qzeros", "scales", "g_idx")}),
     r"qweight has shape \(0, 512\), expected 2-D and non-empty"),
], ids=["act-order without g_idx", "float qweight", "int scales", "float g_idx", "NaN scale", "g_idx past the groups",
        "negative g_idx", "g_idx beyond int32", "empty qweight"])
def test_sharded_loading_refuses_corrupt_modules(checkpoints, tmp_path, edit, pattern):
    # What load_gptq refuses, the sharded loader (which reads headers, then
    # slices) refuses too, naming the module.
    from safetensors.torch import load_file, save_file

    src, gate = checkpoints[2]["original"], f"{PREFIXES[0]}.gate_proj"
    corrupt = tmp_path / "corrupt"
    shutil.copytree(src, corrupt)
    tensors = load_file(corrupt / "model.safetensors")
    edit(tensors, gate)
    save_file({k: v.contiguous() for k, v in tensors.items()}, corrupt / "model.safetensors")
    with pytest.raises(GPTQCheckpointError, match=f"module '{gate}': " + pattern.format(m=gate)):
        ColumnParallelGPTQLinear.from_checkpoint(corrupt, gate, 0, 2)


def test_sharded_loading_refuses_a_corrupt_header_naming_the_file(checkpoints, tmp_path):
    """A header safetensors cannot parse is the checkpoint's error naming the file, as in load_gptq: not
    safetensors' own error type."""
    corrupt = tmp_path / "corrupt"
    shutil.copytree(checkpoints[2]["original"], corrupt)
    with open(corrupt / "model.safetensors", "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 16)
    with pytest.raises(GPTQCheckpointError, match=rf"^{re.escape(str(corrupt / 'model.safetensors'))}: unreadable "
                                                  "safetensors file"):
        ColumnParallelGPTQLinear.from_checkpoint(corrupt, f"{PREFIXES[0]}.gate_proj", 0, 2)


@pytest.mark.parametrize("edit, pattern", [
    (lambda t, m: t.pop(f"{m}.gate_proj.scales"), "module '{m}.gate_proj': missing tensor '{m}.gate_proj.scales'"),
    (lambda t, m: t.update({f"{m}.down_proj.g_idx": t[f"{m}.down_proj.g_idx"][:-8]}),
     r"module '{m}.down_proj': g_idx has shape \(504,\)"),
    (lambda t, m: t[f"{m}.down_proj.g_idx"].__setitem__(0, 1000),
     r"module '{m}.down_proj': g_idx values must lie in \[0, 8\)"),
    (lambda t, m: t.update({f"{m}.gate_proj.bias": t[f"{m}.gate_proj.bias"][:10]}),
     r"module '{m}.gate_proj': bias has shape \(10,\)"),
    (lambda t, m: t[f"{m}.up_proj.scales"].view(-1)[5:6].fill_(float("nan")),
     r"module '{m}.up_proj': scales holds a non-finite value \(nan\)"),
], ids=["missing scales", "short g_idx", "g_idx beyond the groups", "short bias", "NaN scale"])
def test_reorder_checkpoint_refuses_corrupt_modules(checkpoints, tmp_path, edit, pattern):
    # Checked as load_gptq checks them, naming the checkpoint: not a bare
    # AttributeError / IndexError from the permute ops, nor written out reordered.
    from safetensors.torch import load_file, save_file

    corrupt, mlp = tmp_path / "corrupt", PREFIXES[0]
    shutil.copytree(checkpoints[2]["original"], corrupt)
    tensors = load_file(corrupt / "model.safetensors")
    edit(tensors, mlp)
    save_file({k: v.contiguous() for k, v in tensors.items()}, corrupt / "model.safetensors")
    with pytest.raises(GPTQCheckpointError, match=f"{corrupt}: " + pattern.format(m=mlp)):
        reorder_checkpoint(corrupt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reorder_checkpoint_refuses_an_mlp_of_mismatched_widths(tmp_path):
    mlp = act_order_mlp(4)
    mlp.gate_proj = act_order(HIDDEN, HIDDEN, 4, seed=0)  # 256 outputs where down_proj takes 512
    save_gptq(model_of([mlp]), tmp_path / "src", GPTQConfig(4, 64, True, False, "gptq_v2"))
    with pytest.raises(GPTQCheckpointError, match=rf"MLP '{PREFIXES[0]}': gate_proj and up_proj must have "
                                                  r"down_proj's 512 input features as outputs, got 256 and 512"):
        reorder_checkpoint(tmp_path / "src", tmp_path / "out")


def test_reorder_checkpoint_refuses_a_string_of_prefixes(checkpoints, tmp_path):
    with pytest.raises(TypeError, match=rf"mlp_prefixes must be a sequence of prefixes, got the string "
                                        rf"'{PREFIXES[0]}'"):
        reorder_checkpoint(checkpoints[2]["original"], tmp_path / "out", PREFIXES[0])


@pytest.mark.parametrize("call, message", [
    (lambda src, dst: reorder_checkpoint(None, dst),
     r"^reorder_checkpoint: src must be a str or os\.PathLike, got NoneType$"),
    (lambda src, dst: reorder_checkpoint(src, dst, 5),
     r"^reorder_checkpoint: mlp_prefixes must be a sequence of prefixes or None, got int$"),
    (lambda src, dst: ColumnParallelGPTQLinear.from_checkpoint(None, f"{PREFIXES[0]}.up_proj", 0, 1),
     rf"^{PREFIXES[0]}\.up_proj: path must be a str or os\.PathLike, got NoneType$"),
    (lambda src, dst: RowParallelGPTQLinear.from_checkpoint(3, f"{PREFIXES[0]}.down_proj", 0, 1),
     rf"^{PREFIXES[0]}\.down_proj: path must be a str or os\.PathLike, got int$"),
])
def test_checkpoint_readers_name_an_argument_of_the_wrong_type(checkpoints, tmp_path, call, message):
    """os.fspath's and list()'s TypeErrors name neither the function nor the argument."""
    with pytest.raises(TypeError, match=message):
        call(checkpoints[2]["original"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_row_shards_check_the_bias_and_hold_it_as_the_layer_does(checkpoints, tmp_path):
    """The bias a row-parallel layer adds after its reduction: refused where not finite, as load_gptq refuses it,
    and rounded to the scales' dtype, as load_gptq and the column shards hold it."""
    from safetensors.torch import load_file, save_file

    src, down = checkpoints[2]["reordered"], f"{PREFIXES[0]}.down_proj"  # 4-bit, biases
    for name, change in (("nan", lambda b: b.index_fill(0, torch.tensor([3]), float("nan"))),
                         ("fp32", lambda b: (b.float() + 1e-4))):
        edited = tmp_path / name
        shutil.copytree(src, edited)
        tensors = load_file(edited / "model.safetensors")
        tensors[f"{down}.bias"] = change(tensors[f"{down}.bias"])
        save_file({k: v.contiguous() for k, v in tensors.items()}, edited / "model.safetensors")
        if name == "nan":
            with pytest.raises(GPTQCheckpointError, match=rf"module '{down}': bias holds a non-finite value \(nan\)"):
                RowParallelGPTQLinear.from_checkpoint(edited, down, 0, 1)
            continue
        whole = load_gptq(edited).modules[down]
        row = RowParallelGPTQLinear.from_checkpoint(edited, down, 0, 1)
        assert row.bias.dtype == whole.bias.dtype == whole.scales.dtype
        x = torch.randn(3, INTER)
        torch.testing.assert_close(row(x), whole(x))


def test_sequential_layer_refuses_inputs_of_another_width():
    layer = make_sequential(act_order(INTER, HIDDEN, 4, seed=0))
    for width in (INTER + 16, INTER - 16):  # wider ones would be gathered from, narrower ones read past
        with pytest.raises(ValueError, match=f"SequentialGPTQLinear: input has {width} features, expected {INTER}"):
            layer(torch.randn(2, width))


def test_reorderings_keep_int8_activations():
    """They compute what the layer computes: with its int8 activations too."""
    layer = act_order(INTER, HIDDEN, 4, seed=0)
    layer.int8_activations = True
    x = torch.randn(3, INTER)
    perm = torch.randperm(INTER, generator=torch.Generator().manual_seed(0))
    flip = torch.arange(HIDDEN).flip(0)
    for copy, run, want in ((make_sequential(layer), lambda c: c(x), layer(x)),
                            (permute_inputs(layer, perm), lambda c: c(x[..., perm]), layer(x)),
                            (permute_outputs(layer, flip), lambda c: c(x), layer(x)[..., flip])):
        assert copy.int8_activations
        torch.testing.assert_close(run(copy), want)


def test_layer_shards_keep_int8_activations():
    """A shard of a layer multiplies as the layer does: with its int8 activations too."""
    layer = act_order(HIDDEN, INTER, 4, seed=0)
    layer.int8_activations = True
    x = torch.randn(3, HIDDEN)
    columns = [ColumnParallelGPTQLinear.from_layer(layer, rank, 2) for rank in range(2)]
    assert all(c.local.int8_activations for c in columns)
    torch.testing.assert_close(torch.cat([c(x) for c in columns], dim=-1), layer(x))
    seq = make_sequential(layer)
    assert RowParallelGPTQLinear.from_layer(seq, 0, 2).local.int8_activations
    assert RowParallelGPTQLinear.from_layer(seq, 0, 1)(x[..., seq.input_perm]).equal(seq(x))


def test_layer_errors():
    layer = act_order(INTER, HIDDEN, 4, seed=0)
    with torch.no_grad():
        layer.g_idx.zero_()  # sorted, but one group of 512 rows where the scales say 8 groups of 64
    with pytest.raises(ValueError, match=r"down: g_idx is sorted but its groups are not 64 rows each"):
        RowParallelGPTQLinear.from_layer(layer, 0, 2, name="down")
    mlp = act_order_mlp(4)
    mlp.up_proj = nn.Linear(HIDDEN, INTER)
    with pytest.raises(TypeError, match="mlp.up_proj must be a GPTQLinear, got Linear"):
        tp_aware(mlp)
    mlp = act_order_mlp(4)
    mlp.gate_proj = act_order(HIDDEN, HIDDEN, 4, seed=0)
    with pytest.raises(ValueError, match="gate_proj and up_proj must have down_proj's 512 input features"):
        tp_aware(mlp)
    # Not a GPTQLinear, or a rank that is not an int: refused by name, not an
    # AttributeError on `.bits` or a TypeError from slicing.
    plain = nn.Linear(HIDDEN, HIDDEN)
    for who, call in (("permute_inputs", lambda: permute_inputs(plain, torch.arange(HIDDEN))),
                      ("permute_outputs", lambda: permute_outputs(plain, torch.arange(HIDDEN))),
                      ("make_sequential", lambda: make_sequential(plain)),
                      ("down", lambda: ColumnParallelGPTQLinear.from_layer(plain, 0, 2, name="down")),
                      ("down", lambda: RowParallelGPTQLinear.from_layer(plain, 0, 2, name="down"))):
        with pytest.raises(TypeError, match=f"^{who}: layer must be a GPTQLinear, got Linear$"):
            call()
    layer = act_order(HIDDEN, INTER, 4, seed=0)
    with pytest.raises(TypeError, match=r"^down: rank must be an int, got 0.0$"):
        ColumnParallelGPTQLinear.from_layer(layer, 0.0, 2, name="down")
    with pytest.raises(TypeError, match=r"^down: world_size must be an int, got 2.0$"):
        RowParallelGPTQLinear.from_layer(make_sequential(layer), 0, 2.0, name="down")


# ---------------------------------------------------------------------------
# Process groups: one spawn per world size checks every case
# ---------------------------------------------------------------------------

def _tp_worker(rank, world_size, init_file, cases_file, result_dir):
    torch.set_num_threads(1)  # the ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    checked, failures = 0, []

    def check(mlp, case, prefix, what):
        nonlocal checked
        for x, ref in zip(case["xs"], case["refs"][prefix]):
            out = mlp(x)
            checked += 1
            if not matches(out, ref):
                failures.append(f"world {world_size} rank {rank}: {case['bits']}-bit {prefix} {what}, "
                                f"M={x.shape[0]}: max error {(out - ref).abs().max():.3g}, "
                                f"max |ref| {ref.abs().max():.3g}")

    cases = torch.load(cases_file)
    for case in cases:
        for prefix in PREFIXES:
            check(TPAwareMLP.from_checkpoint(case["reordered"], prefix, rank, world_size), case, prefix, "TPAwareMLP")
            check(NaiveTPMLP.from_checkpoint(case["original"], prefix, rank, world_size), case, prefix, "NaiveTPMLP")
    if world_size == 4:  # two independent TP=2 groups inside the world of four
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        case = cases[2]
        for cls, path in ((TPAwareMLP, case["reordered"]), (NaiveTPMLP, case["original"])):
            mlp = cls.from_checkpoint(path, PREFIXES[0], rank % 2, 2, group=groups[rank // 2])
            check(mlp, case, PREFIXES[0], f"{cls.__name__} in a subgroup")
    with open(f"{result_dir}/rank{rank}.json", "w") as f:
        json.dump({"checked": checked, "failures": failures}, f)
    dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_mlps(checkpoints, tmp_path, world_size):
    cases_file = tmp_path / "cases.pt"
    torch.save([{k: v for k, v in c.items() if k != "mlps"} for c in checkpoints], cases_file)
    mp.spawn(_tp_worker, args=(world_size, str(tmp_path / "init"), str(cases_file), str(tmp_path)),
             nprocs=world_size, join=True)
    expected = len(checkpoints) * len(PREFIXES) * 2 * 2 + (4 if world_size == 4 else 0)
    failures = []
    for rank in range(world_size):
        with open(tmp_path / f"rank{rank}.json") as f:
            result = json.load(f)
        assert result["checked"] == expected, f"rank {rank} checked {result['checked']} outputs, expected {expected}"
        failures += result["failures"]
    assert not failures, f"{len(failures)} sharded outputs differ from the unsharded MLP:\n" + "\n".join(failures)


def _act_order_layer(k: int = 128, n: int = 64) -> GPTQLinear:
    g = torch.Generator().manual_seed(0)
    return GPTQLinear.from_linear(nn.Linear(k, n), 4, 32, perm=torch.randperm(k, generator=g))


@pytest.mark.parametrize("call, error, message", [
    (lambda layer: permute_inputs(layer, torch.arange(128) + 0.5), ValueError,
     r"^permute_inputs: perm must hold integers, got torch\.float32$"),
    (lambda layer: permute_inputs(layer, list(range(128))), TypeError,
     r"^permute_inputs: perm must be a tensor of integers, got list$"),
    (lambda layer: permute_outputs(layer, torch.arange(64).double()), ValueError,
     r"^permute_outputs: perm must hold integers, got torch\.float64$"),
    (lambda layer: permute_outputs(layer, None), TypeError,
     r"^permute_outputs: perm must be a tensor of integers, got NoneType$"),
    (lambda layer: group_order(layer.g_idx.tolist()), TypeError,
     r"^group_order: g_idx must be a tensor of integers, got list$"),
    (lambda layer: group_order(layer.g_idx.float()), ValueError, r"^group_order: g_idx must hold integers, got "),
])
def test_permutations_must_be_integer_tensors(call, error, message):
    """A float perm would be truncated by .long() into other rows (arange + 0.5 passes as arange), and a list fails
    on .long() with an AttributeError that names neither the function nor the argument."""
    with pytest.raises(error, match=message):
        call(_act_order_layer())


def test_shards_of_several_ranks_need_torch_distributed_to_run():
    """Shards are made without a process group, but summing or gathering them needs one: torch's own error names
    neither the layer nor the call."""
    assert not dist.is_initialized()
    layer = make_sequential(_act_order_layer())
    row = RowParallelGPTQLinear.from_layer(layer, 0, 2)
    with pytest.raises(RuntimeError, match=r"^RowParallelGPTQLinear: a shard of world_size=2 .* torch\.distributed, "
                                           r"which is not initialized"):
        row(torch.randn(3, 64))
    up = ColumnParallelGPTQLinear.from_layer(_act_order_layer(128, 128), 0, 2)
    mlp = NaiveTPMLP(up, up, row, torch.arange(64))
    with pytest.raises(RuntimeError, match=r"^NaiveTPMLP: a shard of world_size=2 "):
        mlp(torch.randn(3, 128))
    assert torch.equal(up(torch.ones(2, 128)), up.local(torch.ones(2, 128)))  # a column shard communicates nothing


def test_sequential_layer_names_an_input_that_is_not_a_tensor():
    layer = make_sequential(_act_order_layer())
    with pytest.raises(TypeError, match="^SequentialGPTQLinear: input must be a tensor, got list$"):
        layer([0.0] * 128)
