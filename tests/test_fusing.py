"""Fused projections (lowbit.fusing): q/k/v and gate/up of each decoder layer
as one GGUFLinear over their joined rows, with a ProjectionSlice in each
projection's place. The fused model computes exactly what the unfused one
does (each output row is its own dot product either way), whatever order
and inputs the slices are called with, under torch.compile and autograd."""
import copy
import gc
import io
import os
import shutil
import sys
import threading
import weakref
import zlib

import pytest
import torch
from torch import nn

import lowbit
from lowbit.fusing import ProjectionSlice, fuse_projections, unfused_state_dict
from lowbit.gguf.file import release_mapped
from tiny_models import tiny_model, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    # Qwen2: biases on q, k and v, so the fused layer joins biases too.
    return write_tiny_gguf(tmp_path_factory.mktemp("fusing") / "qwen2.gguf", tiny_model("qwen2", seed=1), "qwen2")


def test_fused_model_computes_what_the_unfused_one_does(qwen2_path):
    fused, plain = lowbit.load_gguf_model(qwen2_path), lowbit.load_gguf_model(qwen2_path, fuse=False)
    for layer, reference in zip(fused.model.layers, plain.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn.qkv_proj, lowbit.GGUFLinear) and isinstance(mlp.gate_up_proj, lowbit.GGUFLinear)
        names = ("q_proj", "k_proj", "v_proj")
        assert attn.qkv_proj.out_features == sum(getattr(reference.self_attn, n).out_features for n in names)
        for parent, ref_parent, group in ((attn, reference.self_attn, names), (mlp, reference.mlp, ("gate_proj", "up_proj"))):
            for name in group:
                part, whole = getattr(parent, name), getattr(ref_parent, name)
                assert isinstance(part, ProjectionSlice) and isinstance(whole, lowbit.GGUFLinear)
                assert (part.in_features, part.out_features) == (whole.in_features, whole.out_features)
                assert torch.equal(part.qweight, whole.qweight)
                assert torch.equal(part.dequantize(), whole.dequantize())
                assert (part.bias is None) == (whole.bias is None)
                if part.bias is not None:
                    assert torch.equal(part.bias, whole.bias)
    # per layer qkv, o, gate_up, down; and the LM head (tied: over the embedding's blocks)
    assert sum(isinstance(m, lowbit.GGUFLinear) for m in fused.modules()) == 2 * 4 + 1
    ids = torch.tensor([[3, 17, 40, 2, 9, 33, 61, 5, 12, 27, 8, 50]])  # 12 rows: the batched kernels
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, plain(ids).logits)
        assert torch.equal(fused(ids[:, :1]).logits, plain(ids[:, :1]).logits)  # one row: the matvec
    assert fuse_projections(fused) == []  # already fused: nothing left to join


def layers(parent):
    return parent.q_proj, parent.k_proj, parent.v_proj


def attention_pair(path):
    fused = lowbit.load_gguf_model(path).model.layers[0].self_attn
    plain = lowbit.load_gguf_model(path, fuse=False).model.layers[0].self_attn
    return fused, plain


def test_slices_take_one_call_only_for_the_same_unchanged_input(qwen2_path):
    fused, plain = attention_pair(qwen2_path)
    x, y = torch.randn(2, 3, 64), torch.randn(2, 3, 64)
    calls = []
    fused.qkv_proj.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        for got, want in zip([m(x) for m in layers(fused)], [m(x) for m in layers(plain)]):
            assert torch.equal(got, want)
        assert len(calls) == 1
        assert fused.q_proj.outputs.latest is None  # every part taken: no activation held
        # Another input for k, a write to x between q and v, q twice: each gets its own input's rows.
        q = fused.q_proj(x)
        assert torch.equal(fused.k_proj(y), plain.k_proj(y))
        assert torch.equal(q, plain.q_proj(x))
        fused.q_proj(x)
        x.mul_(2)
        assert torch.equal(fused.v_proj(x), plain.v_proj(x))
        assert torch.equal(fused.q_proj(x), plain.q_proj(x)) and torch.equal(fused.q_proj(x), plain.q_proj(x))
    with torch.inference_mode():
        z = torch.randn(1, 64)
        assert torch.equal(torch.cat([m(z) for m in layers(fused)], -1), torch.cat([m(z) for m in layers(plain)], -1))


def test_threads_sharing_a_fused_layer_each_get_their_own_rows(qwen2_path):
    fused, plain = attention_pair(qwen2_path)
    inputs = [torch.randn(3, 64) for _ in range(4)]
    with torch.no_grad():
        want = [[m(x) for m in layers(plain)] for x in inputs]
    wrong = []

    def run(i):
        with torch.no_grad():
            for _ in range(300):
                got = [m(inputs[i]) for m in layers(fused)]
                if not all(torch.equal(g, w) for g, w in zip(got, want[i])):
                    wrong.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the interpreter switches threads between nearly any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(switch)
    assert not wrong


def test_slices_under_torch_compile_and_autograd(qwen2_path):
    fused, plain = attention_pair(qwen2_path)

    def projections(attn, x):
        return torch.cat([m(x) for m in layers(attn)], -1)

    x = torch.randn(1, 5, 64)
    compiled = torch.compile(projections, fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(fused, x), projections(plain, x))
        assert torch.equal(compiled(fused, x[:, :1]), projections(plain, x[:, :1]))
    # The input's gradient: one product with the joined rows against three summed, equal to fp32 order.
    grads = []
    for attn in (fused, plain):
        leaf = x.clone().requires_grad_()
        (projections(attn, leaf) * torch.arange(1, 1 + 64 + 32 + 32)).sum().backward()
        grads.append(leaf.grad)
    torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-5 * grads[1].abs().max().item())


def test_a_slice_run_without_autograd_does_not_serve_one_with_it(qwen2_path):
    """q computed under no_grad, then k on the same input with grad: k records its graph (a part of the
    no_grad result would have no grad_fn: its gradient silently missing)."""
    fused, plain = attention_pair(qwen2_path)
    leaf = torch.randn(1, 3, 64, requires_grad=True)
    outs = {}
    for name, attn in (("fused", fused), ("plain", plain)):
        with torch.no_grad():
            attn.q_proj(leaf)
        k = attn.k_proj(leaf)
        assert k.requires_grad
        outs[name] = torch.autograd.grad(k.sum(), leaf)[0]
    torch.testing.assert_close(outs["fused"], outs["plain"], rtol=1e-5, atol=1e-5)


def test_a_copy_keeps_its_slices_on_its_own_fused_layer(qwen2_path):
    model = lowbit.load_gguf_model(qwen2_path)
    twin = copy.deepcopy(model)
    attn = twin.model.layers[0].self_attn
    assert attn.q_proj.outputs.layer is attn.qkv_proj is not model.model.layers[0].self_attn.qkv_proj
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(twin(ids).logits, model(ids).logits)


def freed_by_refcount(make):
    """Whether the module make() returns and every module below it go with
    its last reference, the cyclic collector off: a reference cycle through
    them would keep their tensors until a collection happens to run. A first
    call outside the check imports what transformers loads lazily (its
    caught import errors keep frames, the caller's too, in cycles)."""
    make()
    gc.collect()
    gc.disable()
    try:
        module = make()
        held = [weakref.ref(m) for m in module.modules()]
        del module
        return all(ref() is None for ref in held)
    finally:
        gc.enable()


def test_a_fused_model_is_freed_without_the_cycle_collector(qwen2_path):
    """A fused layer's load hook reaches its slices' outputs, which hold the
    layer: held strongly both ways, the pair would wait for the cyclic
    collector. (The loaders' forward and generate wrappers hold their model,
    which the README states; here they are off.)"""
    def fused():
        model = lowbit.load_gguf_model(qwen2_path)
        assert not lowbit.fast_decoding(model, False)
        lowbit.kernel_threads(model, False)
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))
        return model

    assert freed_by_refcount(fused)


def quantized(rows, qtype, bias=False, seed=0):
    linear = nn.Linear(64, rows, bias=bias)
    torch.manual_seed(seed)
    nn.init.normal_(linear.weight)
    return lowbit.GGUFLinear.from_linear(linear, qtype)


def test_only_projections_that_can_join_are_fused():
    Q8_0, Q4_0 = int(lowbit.GGMLType.Q8_0), int(lowbit.GGMLType.Q4_0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj, attn.v_proj = quantized(64, Q8_0), quantized(32, Q4_0), quantized(32, Q8_0, seed=1)
    mlp = nn.Module()
    mlp.gate_proj, mlp.up_proj = quantized(96, Q8_0), quantized(96, Q8_0, bias=True)  # one biased: not joined
    parent = nn.Module()
    parent.attn, parent.mlp = attn, mlp
    reference = copy.deepcopy(parent)
    assert fuse_projections(parent) == ["attn.qv_proj"]
    assert isinstance(attn.q_proj, ProjectionSlice) and isinstance(attn.v_proj, ProjectionSlice)
    assert attn.k_proj is not None and isinstance(attn.k_proj, lowbit.GGUFLinear)
    assert isinstance(mlp.gate_proj, lowbit.GGUFLinear) and isinstance(mlp.up_proj, lowbit.GGUFLinear)
    x = torch.randn(4, 64)
    with torch.no_grad():
        for got, want in zip(layers(attn), layers(reference.attn)):
            assert torch.equal(got(x), want(x))


def test_layers_held_in_several_places_are_fused_once_or_not_at_all():
    """Parents holding the same q and k (tied) share one fused layer and its slices; a layer also held beside
    another sibling, or twice in one parent, stays as it is: a fused copy would hold its weights twice."""
    Q8_0 = int(lowbit.GGMLType.Q8_0)
    a, b, c, d, e = (nn.Module() for _ in range(5))
    a.q_proj, a.k_proj = quantized(32, Q8_0), quantized(32, Q8_0, seed=1)
    b.q_proj, b.k_proj = a.q_proj, a.k_proj
    c.q_proj, c.k_proj = quantized(32, Q8_0, seed=2), quantized(32, Q8_0, seed=3)
    d.q_proj, d.k_proj = c.q_proj, quantized(32, Q8_0, seed=4)
    e.q_proj = e.k_proj = quantized(32, Q8_0, seed=5)
    model = nn.Module()
    model.a, model.b, model.c, model.d, model.e = a, b, c, d, e
    model.shared = model.a  # a whole parent under two names
    reference, state = copy.deepcopy(model), model.state_dict()
    assert fuse_projections(model) == ["a.qk_proj", "b.qk_proj"]
    assert b.qk_proj is a.qk_proj and b.q_proj is a.q_proj and b.k_proj is a.k_proj
    assert isinstance(a.q_proj, ProjectionSlice) and a.q_proj.outputs.layer is a.qk_proj
    for parent in (c, d, e):
        assert isinstance(parent.q_proj, lowbit.GGUFLinear) and isinstance(parent.k_proj, lowbit.GGUFLinear)
    x = torch.randn(4, 64)
    with torch.no_grad():
        for name in ("a", "b", "shared"):
            got, want = getattr(model, name), getattr(reference, name)
            assert all(torch.equal(g(x), w(x)) for g, w in zip((got.q_proj, got.k_proj), (want.q_proj, want.k_proj)))
    unfused = unfused_state_dict(model)
    assert unfused.keys() == state.keys() and all(torch.equal(unfused[k], t) for k, t in state.items())


def test_fuse_projections_and_unfused_state_dict_refuse_what_they_cannot_read():
    """A mapped that is no GGUFFile failed with an AttributeError at the first join (after the model had changed),
    and unfused_state_dict's model with one on its first attribute."""
    Q8_0 = int(lowbit.GGMLType.Q8_0)
    attn = nn.Module()
    attn.q_proj, attn.k_proj = quantized(32, Q8_0), quantized(32, Q8_0, seed=1)
    for bad in ("model.gguf", {}):
        with pytest.raises(TypeError, match="^fuse_projections: mapped must be a GGUFFile or None, got "):
            fuse_projections(attn, bad)
    assert isinstance(attn.q_proj, lowbit.GGUFLinear) and not hasattr(attn, "qk_proj")
    with pytest.raises(TypeError, match="^unfused_state_dict: model must be an nn.Module, got NoneType"):
        unfused_state_dict(None)


def test_a_load_between_sibling_calls_is_not_answered_with_the_old_weights():
    """The parts one slice's call leaves for its siblings were computed with the weights of then: after a
    load_state_dict, a sibling called on the same unchanged input runs the fused layer again (in a copy too)."""
    Q8_0 = int(lowbit.GGMLType.Q8_0)

    def attention(seed):
        attn = nn.Module()
        attn.q_proj, attn.k_proj, attn.v_proj = (quantized(32, Q8_0, bias=True, seed=seed + i) for i in range(3))
        return attn

    old, new = attention(0), attention(10)
    x = torch.randn(4, 64)
    with torch.no_grad():
        want = [layer(x) for layer in layers(new)]
        fuse_projections(old), fuse_projections(new)
        for model in [pickle_copy(old), copy.deepcopy(old), old]:  # the copies made before old loads
            model.q_proj(x)  # leaves k's and v's parts of the old weights
            model.load_state_dict(new.state_dict())
            assert all(torch.equal(got(x), w) for got, w in zip(layers(model)[1:], want[1:]))


def pickle_copy(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_joined_refuses_layers_that_cannot_join():
    """joined is public: layers that can_join refuses (another type, a repacked one, another act-order g_idx)
    would compute wrong rows silently."""
    Q8_0, Q4_0, Q4_1 = (int(t) for t in (lowbit.GGMLType.Q8_0, lowbit.GGMLType.Q4_0, lowbit.GGMLType.Q4_1))
    for layers in ([quantized(32, Q4_0), quantized(32, Q4_1)], [quantized(32, Q8_0), quantized(32, Q8_0).repack()],
                   []):
        with pytest.raises(ValueError, match="GGUFLinear.joined: layers must be one or more GGUFLinears that "
                                             "can_join the first"):
            lowbit.GGUFLinear.joined(layers)
    torch.manual_seed(0)
    gptq = [lowbit.GPTQLinear.from_linear(nn.Linear(64, 64), 4, 32, perm=torch.randperm(64)) for _ in range(2)]
    with pytest.raises(ValueError, match="GPTQLinear.joined: layers must be one or more GPTQLinears that can_join"):
        lowbit.GPTQLinear.joined(gptq)


def test_joined_refuses_a_back_to_back_that_is_not_callable_or_gives_other_rows():
    """back_to_back is public: a non-callable failed as a bare "not callable"
    TypeError, and rows of another count made a layer of that many outputs."""
    Q8_0 = int(lowbit.GGMLType.Q8_0)
    parts = [quantized(32, Q8_0, seed=seed) for seed in range(2)]
    with pytest.raises(TypeError, match="^GGUFLinear.joined: back_to_back must be None or callable "
                                        r"\(GGUFFile.back_to_back\), got int$"):
        lowbit.GGUFLinear.joined(parts, back_to_back=1)
    rows = torch.cat([p.qweight for p in parts])
    for bad, got in ((lambda q: q[0], r"torch.uint8 \[32, 68\]"), (lambda q: rows.float(), r"torch.float32 \[64, 68\]"),
                     (lambda q: q, "list")):
        with pytest.raises(ValueError, match=r"^GGUFLinear.joined: back_to_back must give None or the layers' rows "
                                             rf"as one uint8 \[64, 68\] tensor, got {got}$"):
            lowbit.GGUFLinear.joined(parts, back_to_back=bad)
    assert torch.equal(lowbit.GGUFLinear.joined(parts, back_to_back=lambda q: rows).qweight, rows)


def test_joined_takes_any_iterable_of_layers():
    """joined is public: a generator of layers (a caller's natural argument)
    is joined as its list is; what is not an iterable of layers is refused,
    naming layers, rather than failing on an index or an attribute."""
    Q8_0 = int(lowbit.GGMLType.Q8_0)
    parts = [quantized(32, Q8_0, seed=seed) for seed in range(3)]
    want = lowbit.GGUFLinear.joined(parts)
    got = lowbit.GGUFLinear.joined(layer for layer in parts)
    assert torch.equal(got.qweight, want.qweight) and got.out_features == 96
    assert torch.equal(lowbit.GGUFLinear.joined(iter(nn.ModuleList(parts))).qweight, want.qweight)
    torch.manual_seed(0)
    gptq = [lowbit.GPTQLinear.from_linear(nn.Linear(64, 64), 4, 32) for _ in range(2)]
    got = lowbit.GPTQLinear.joined(layer for layer in gptq)
    assert torch.equal(got.qweight, lowbit.GPTQLinear.joined(gptq).qweight) and got.out_features == 128
    for cls, layer in ((lowbit.GGUFLinear, parts[0]), (lowbit.GPTQLinear, gptq[0])):
        with pytest.raises(TypeError, match=f"^{cls.__name__}.joined: layers must be an iterable of "
                                            f"{cls.__name__}s, got {cls.__name__}$"):
            cls.joined(layer)
        with pytest.raises(ValueError, match=f"^{cls.__name__}.joined: layers must be one or more "):
            cls.joined([None, layer])


def test_file_rows_back_to_back_join_without_a_copy(qwen2_path):
    f = lowbit.load_gguf(qwen2_path)
    tensors = list(f.tensors.values())
    pairs = [(a, b) for a, b in zip(tensors, tensors[1:])
             if a.data.shape[1] == b.data.shape[1] and b.data.data_ptr() == a.data.data_ptr() + a.nbytes]
    assert pairs  # the writer puts some tensors of equal row bytes back to back
    a, b = pairs[0]
    joined = f.back_to_back([a.data, b.data])
    assert joined.data_ptr() == a.data.data_ptr() and torch.equal(joined, torch.cat([a.data, b.data]))
    assert f.back_to_back([b.data, a.data]) is None  # out of order
    assert f.back_to_back([a.data, b.data.clone()]) is None  # not the file's bytes
    assert f.back_to_back([a.data[:, :-1], b.data[:, :-1]]) is None  # not whole rows
    # Its storage holds its own bytes: torch.save and deepcopy copy those, not the whole file.
    assert joined.untyped_storage().nbytes() == a.nbytes + b.nbytes


def test_a_fused_model_saves_and_copies_about_its_file_s_bytes(qwen2_path):
    """Layers joined as views of the mapping hold only their own bytes: a
    fused model's state dict is about its file's size, not the file once per
    joined layer."""
    model = lowbit.load_gguf_model(qwen2_path)
    assert any(getattr(m, "fused_from", None) for m in model.modules())
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert buffer.tell() < 1.1 * os.path.getsize(qwen2_path)
    copied = copy.deepcopy(model)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in copied.state_dict().values() if t.device.type == "cpu"}
    assert sum(storages.values()) < 1.1 * os.path.getsize(qwen2_path)


def act_order_gptq_llama(bits):
    """A tiny Llama whose decoder Linears are act-order GPTQ layers, those of
    one input sharing their order (as GPTQ's, from one Hessian, do); biased
    q, k and v."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                                      attention_bias=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    for name, m in list(model.named_modules()):
        if isinstance(m, nn.Linear) and name != "lm_head":
            parent = name.rpartition(".")[0]
            order = torch.Generator().manual_seed(zlib.crc32(f"{parent} {m.in_features}".encode()))
            perm = torch.randperm(m.in_features, generator=order)
            model.set_submodule(name, lowbit.GPTQLinear.from_linear(m, bits, 32, sym=False, checkpoint_format="gptq_v2",
                                                                    perm=perm, dtype=torch.float32))
    return model


@pytest.mark.parametrize("bits", [3, 4])
def test_gptq_models_fuse_and_save_apart(tmp_path, bits):
    from lowbit.gptq import GPTQConfig

    config = GPTQConfig(bits=bits, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    lowbit.save_gptq(act_order_gptq_llama(bits), tmp_path / "ckpt", config)
    fused = lowbit.load_gptq_model(tmp_path / "ckpt")
    plain = lowbit.load_gptq_model(tmp_path / "ckpt", fuse=False)
    attn = fused.model.layers[1].self_attn
    assert isinstance(attn.qkv_proj, lowbit.GPTQLinear) and attn.qkv_proj.out_features == 128 + 64 + 64
    assert isinstance(attn.k_proj, ProjectionSlice) and isinstance(fused.model.layers[1].mlp.gate_proj, ProjectionSlice)
    for name in ("q_proj", "k_proj", "v_proj"):
        part, whole = getattr(attn, name), getattr(plain.model.layers[1].self_attn, name)
        assert torch.equal(part.dequantize(), whole.dequantize()) and torch.equal(part.bias, whole.bias)
        assert whole.rows_sorted and torch.equal(part.qweight, whole.checkpoint_qweight())
    ids = torch.tensor([[3, 17, 400, 2, 9, 33, 61, 5, 12, 27, 8, 50]])
    with torch.no_grad():
        for length in (12, 1):
            assert torch.equal(fused(ids[:, :length]).logits, plain(ids[:, :length]).logits)
    # The loaded act-order layers hold one copy of their weights: no private sorted copy was made.
    layers = [m for model in (fused, plain) for m in model.modules() if isinstance(m, lowbit.GPTQLinear)]
    assert all(m.rows_sorted and m._plan is None for m in layers)
    with torch.inference_mode():  # tensors without version counters load and run alike
        assert torch.equal(lowbit.load_gptq_model(tmp_path / "ckpt")(ids).logits, plain(ids).logits)
    # Saved from the fused model: the checkpoint it was loaded from, tensor for tensor.
    lowbit.save_gptq(fused, tmp_path / "again", config)
    original = lowbit.load_gptq(tmp_path / "ckpt")
    again = lowbit.load_gptq(tmp_path / "again")
    assert original.modules.keys() == again.modules.keys()
    for name, layer in original.modules.items():
        for key, tensor in layer.state_dict().items():
            assert torch.equal(again.modules[name].state_dict()[key], tensor), (name, key)
    with pytest.raises(TypeError, match="fuse=False"):
        lowbit.gptq.tp_aware(fused.model.layers[0].mlp)


@pytest.mark.parametrize("widths, joins", [((128, 64, 64), [True, True]), ((64, 32, 32), [False, False]),
                                           ((192, 96, 64), [False, True])])
def test_gptq_layers_join_only_in_whole_column_steps(cpu_isa, widths, joins):
    """GPTQ parts join where each is a whole number of the kernels' widest
    column step (JOIN_COLUMNS): the joined layer then gives each part's
    outputs bit for bit at every M (the fused kernel, its portable tail
    columns and the large-M GEMM alike); narrower parts stay apart, since a
    part's columns would move between a SIMD kernel and its portable tail."""
    from lowbit.gptq.rtn import quantize_rtn

    K, g = 320, torch.Generator().manual_seed(5)
    perm = torch.randperm(K, generator=g)
    parts = []
    for n in widths:
        q = quantize_rtn(torch.randn(n, K, generator=g) * 0.05, 4, 64, sym=False, checkpoint_format="gptq_v2", perm=perm)
        parts.append(lowbit.GPTQLinear.from_tensors(q.qweight, q.qzeros, q.scales, q.g_idx, None, 4, 64, False, True,
                                                    "gptq_v2"))
    assert [parts[0].can_join(p) for p in parts[1:]] == joins
    joinable = [parts[0]] + [p for p, ok in zip(parts[1:], joins) if ok]
    if len(joinable) < 2:
        return
    joined = lowbit.GPTQLinear.joined(joinable)
    with torch.no_grad():
        for M in (1, 12, 64, 65, 300):
            x = torch.randn(M, K, generator=g)
            assert torch.equal(joined(x), torch.cat([p(x) for p in joinable], 1)), M


def mapped_kb(path):
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and "-" in line.split()[0]:
            ours = line.rstrip().endswith(os.path.realpath(path))
        elif ours and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident pages from /proc/self/smaps")
def test_release_drops_copied_pages_and_the_bytes_stay_readable():
    from gguf_files import smollm2_gguf_path

    path = smollm2_gguf_path()
    f = lowbit.load_gguf(path)
    parts = [f.tensors[f"blk.0.ffn_{p}.weight"].data for p in ("gate", "up", "down")]
    copies = [p.clone() for p in parts]  # reads every page
    before = mapped_kb(path)
    f.release(parts)
    assert before - mapped_kb(path) >= 0.9 * sum(p.numel() for p in parts) / 1024
    assert all(torch.equal(p, c) for p, c in zip(parts, copies))  # read again from the file
    f.release([copies[0]])  # not the file's bytes: nothing to drop


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident pages from /proc/self/smaps")
def test_release_keeps_the_pages_written_in_place(tmp_path):
    """The mapping is copy-on-write: a page written through a view holds the
    only copy of what was written, and stays; the others go."""
    from gguf_files import smollm2_gguf_path

    path = tmp_path / "smollm2.gguf"
    shutil.copyfile(smollm2_gguf_path(), path)
    part = lowbit.load_gguf(path).tensors["blk.0.ffn_down.weight"].data
    written, row = part.clone(), part.shape[0] // 2  # a row on a page wholly inside the tensor
    written[row, :16] = torch.arange(16, dtype=torch.uint8)
    part[row, :16] = written[row, :16]
    before = mapped_kb(path)
    release_mapped([part])
    assert before - mapped_kb(path) >= 0.9 * part.numel() / 1024 - 8  # all but the written page (and the edges)
    assert torch.equal(part, written)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident pages from /proc/self/smaps")
def test_repacking_drops_the_file_pages_it_copied(tmp_path, monkeypatch):
    """repack_model copies the layers it takes out of the mapping: their
    pages leave memory, and the model's results stay those of the repacked
    layers (a tied embedding reads its rows from the file again)."""
    from gguf_files import smollm2_gguf_path
    from lowbit.gguf.file import _MAPPINGS

    path = tmp_path / "smollm2.gguf"
    shutil.copyfile(smollm2_gguf_path(), path)
    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5, 63]])
    layers = [m for m in model.modules() if isinstance(m, lowbit.GGUFLinear)]
    mapped = [m for m in layers if any(lo <= m.qweight.data_ptr() < hi for lo, hi in _MAPPINGS.items())]
    with torch.no_grad():
        model(ids)  # every weight's pages read
        before = mapped_kb(path)
        assert lowbit.repack_model(model)
        repacked = [m for m in mapped if m.repacked]
        assert repacked
        dropped = before - mapped_kb(path)
        assert dropped >= 0.9 * sum(m.qweight.numel() for m in repacked) / 1024
        monkeypatch.setattr(lowbit.gguf.linear, "release_mapped", lambda parts: None)
        reference = lowbit.load_gguf_model(path)
        lowbit.repack_model(reference)  # the same layers, their pages kept
        assert torch.equal(model(ids).logits, reference(ids).logits)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads the resident pages from /proc/self/smaps")
def test_loading_keeps_no_mapped_pages_of_copied_weights(tmp_path, monkeypatch):
    """SmolLM2's Q and K rows are unpermuted into copies, and the fused
    qkv_proj copies V's too: the mapping's pages they were read from leave
    memory (gate and up, back to back in the file, are joined as a view)."""
    from gguf_files import smollm2_gguf_path

    path = tmp_path / "smollm2.gguf"  # a path of its own: no other test's mapping counted
    shutil.copyfile(smollm2_gguf_path(), path)
    model = lowbit.load_gguf_model(path)
    kept = mapped_kb(path)
    del model
    gc.collect()
    assert mapped_kb(path) == 0
    monkeypatch.setattr(lowbit.GGUFFile, "release", lambda self, parts: None)
    model = lowbit.load_gguf_model(path)
    f = lowbit.load_gguf(path)
    copied = sum(f.tensors[f"blk.{i}.attn_{p}.weight"].nbytes for i in range(30) for p in "qkv")
    assert mapped_kb(path) - kept >= 0.9 * copied / 1024


def test_gptq_models_load_with_int8_activations(tmp_path):
    from lowbit.gptq import GPTQConfig

    config = GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    lowbit.save_gptq(act_order_gptq_llama(4), tmp_path / "ckpt", config)
    fused = lowbit.load_gptq_model(tmp_path / "ckpt", int8_activations=True)
    plain = lowbit.load_gptq_model(tmp_path / "ckpt", fuse=False, int8_activations=True)
    exact = lowbit.load_gptq_model(tmp_path / "ckpt")
    layers = [m for model in (fused, plain) for m in model.modules() if isinstance(m, lowbit.GPTQLinear)]
    assert layers and all(m.int8_activations for m in layers)
    assert not any(m.int8_activations for m in exact.modules() if isinstance(m, lowbit.GPTQLinear))
    ids = torch.tensor([[3, 17, 400, 2, 9, 33, 61, 5, 12, 27, 8, 50]])
    with torch.no_grad():
        got, want = fused(ids).logits, exact(ids).logits
        assert torch.equal(got, plain(ids).logits)  # joined layers: each column's sums unchanged
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
