"""The decode step's ops against what transformers computes: rms_norm
against its RMSNorm (fp32/bf16/fp16, any rank, strided rows, its gradient)
and decode_attention against the rotation and scaled_dot_product_attention
of its llama-family attention (grouped heads, the SIMD and portable head
sizes, the first and last cache row, a long context, sharp scores, 16-bit
heads as the fp32 sums rounded once), the cache rows it writes and those it
must not, on every CPU ISA and on CUDA; opcheck, torch.compile and the
refused gradient. Whole models: tests/test_decoding.py."""
import pytest
import torch
from torch.nn import functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from lowbit import ops

TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=2e-2, rtol=1e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


# ---- rms_norm -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (5, 64), (2, 3, 4096), (7,)])
def test_rms_norm_is_transformers_rms_norm(device, dtype, shape):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(shape[-1], eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = (torch.randn(shape) * 3).to(dtype)
    with torch.no_grad():
        want = norm(x)
        got = ops.rms_norm(x.to(device), norm.weight.to(device), norm.variance_epsilon).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_of_rows_with_other_strides():
    x = torch.randn(6, 128)[::2]  # rows 2 apart
    w = torch.randn(128)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), ops.rms_norm(x.contiguous(), w, 1e-6))
    assert ops.rms_norm(torch.randn(0, 128), w, 1e-6).shape == (0, 128)


def test_rms_norm_gradient_is_transformers_gradient():
    torch.manual_seed(1)
    norm = LlamaRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_(1, 0.3)
    x = torch.randn(3, 5, 48, requires_grad=True)
    grad = torch.randn(3, 5, 48)
    want = torch.autograd.grad(norm(x), (x, norm.weight), grad)
    got = torch.autograd.grad(ops.rms_norm(x, norm.weight, 1e-6), (x, norm.weight), grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_rms_norm_gradient_of_empty_rows():
    x = torch.randn(3, 0, requires_grad=True)
    w = torch.randn(0, requires_grad=True)
    got = torch.autograd.grad(ops.rms_norm(x, w, 1e-6).sum(), (x, w))
    assert got[0].shape == (3, 0) and got[1].shape == (0,)
    torch.library.opcheck(torch.ops.lowbit.rms_norm, (x, w, 1e-6))
    v = torch.randn(16, requires_grad=True)  # one row, no batch dimensions
    want = torch.autograd.grad(LlamaRMSNorm(16, eps=1e-6)(v).sum(), v)[0]
    torch.testing.assert_close(torch.autograd.grad(ops.rms_norm(v, torch.ones(16), 1e-6).sum(), v)[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_opcheck_and_compile(dtype):
    x = torch.randn(4, 64, dtype=dtype, requires_grad=True)
    w = torch.randn(64, dtype=dtype, requires_grad=True)
    torch.library.opcheck(torch.ops.lowbit.rms_norm, (x, w, 1e-6))
    compiled = torch.compile(lambda a, b: ops.rms_norm(a, b, 1e-6) * 2, fullgraph=True)
    assert torch.equal(compiled(x, w), ops.rms_norm(x, w, 1e-6) * 2)


# ---- decode_attention -------------------------------------------------------------

def rotary(position, dim, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = position * inv
    emb = torch.cat((angles, angles))
    return emb.cos(), emb.sin()


def rotated(x, cos, sin):
    """transformers' apply_rotary_pos_emb: the first len(cos) values of each
    head rotated (Phi-3's form, which passes the rest through)."""
    dims = cos.shape[-1]
    head, rest = x[..., :dims], x[..., dims:]
    half = dims // 2
    return torch.cat((head * cos + torch.cat((-head[..., half:], head[..., :half]), -1) * sin, rest), -1)


def reference(q, k, v, cos, sin, key_cache, value_cache, position, scale, start=0, sinks=None, softcap=0.0):
    """transformers' rotation and SDPA (its keys and values repeated per group)
    over rows [start, position], in fp32; with sinks, gpt-oss's eager
    attention: the softmax over the scores and each head's sink, the sink's
    column dropped; with a soft cap, Gemma 2's eager attention."""
    f = lambda t: t.float()
    keys, values = f(key_cache).clone(), f(value_cache).clone()
    keys[:, position] = rotated(f(k), f(cos), f(sin))
    values[:, position] = f(v)
    groups = q.shape[0] // k.shape[0]
    keys = keys[:, start:position + 1].repeat_interleave(groups, 0)
    values = values[:, start:position + 1].repeat_interleave(groups, 0)
    if sinks is None and not softcap:
        out = F.scaled_dot_product_attention(rotated(f(q), f(cos), f(sin))[:, None], keys, values, scale=scale)[:, 0]
    else:
        scores = torch.einsum("hd,hpd->hp", rotated(f(q), f(cos), f(sin)), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is None:
            probs = torch.softmax(scores, -1)
        else:
            probs = torch.softmax(torch.cat((scores, f(sinks)[:, None]), -1), -1)[:, :-1]
        out = torch.einsum("hp,hpd->hd", probs, values)
    return out, keys[::groups, -1], values[::groups, -1]


def attention_case(q_heads, kv_heads, dim, capacity, position, dtype, spread=1.0, seed=0, rotated_dims=None):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: (torch.randn(*shape, generator=g) * spread).to(dtype)
    cos, sin = rotary(position, rotated_dims or dim)
    return dict(q=r(q_heads, dim), k=r(kv_heads, dim), v=torch.randn(kv_heads, dim, generator=g).to(dtype),
                cos=cos.to(dtype), sin=sin.to(dtype), key_cache=r(kv_heads, capacity, dim),
                value_cache=torch.randn(kv_heads, capacity, dim, generator=g).to(dtype), position=position,
                scale=dim ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,capacity,position", [
    (9, 3, 64, 256, 160),   # SmolLM2's heads, the fp32 SIMD path
    (4, 4, 32, 8, 0),       # no grouping, the first token
    (8, 2, 48, 40, 39),     # a head size the SIMD path leaves to the portable loops; the last row
    (6, 2, 96, 200, 130),   # a head of 64 + 32 values over three blocks of value rows, keys short of 8
    (16, 2, 128, 2100, 2047),  # a long context
    (24, 8, (128, 96), 64, 40),  # Phi-4-mini's heads: the first 96 of 128 values rotated, the rest passed through
    (4, 2, (64, 2), 16, 9),  # the fewest rotated values
])
def test_decode_attention_is_rotation_and_sdpa(device, dtype, q_heads, kv_heads, dim, capacity, position):
    dim, rotated_dims = dim if isinstance(dim, tuple) else (dim, dim)
    case = attention_case(q_heads, kv_heads, dim, capacity, position, dtype, rotated_dims=rotated_dims)
    before = {name: case[name].clone() for name in ("key_cache", "value_cache")}
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device).cpu()
    want, key_row, value_row = reference(**case)
    assert out.dtype == dtype and out.shape == (q_heads, dim)
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    keys, values = on_device["key_cache"].cpu(), on_device["value_cache"].cpu()
    torch.testing.assert_close(keys[:, position].float(), key_row, **TOL[dtype])
    assert torch.equal(values[:, position].float(), value_row)
    others = [p for p in range(capacity) if p != position]
    assert torch.equal(keys[:, others], before["key_cache"][:, others])
    assert torch.equal(values[:, others], before["value_cache"][:, others])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,capacity,position,start", [
    (9, 3, 64, 256, 160, 100),  # a window of 61 rows, the SIMD path
    (8, 2, 48, 40, 39, 35),     # the portable loops
    (4, 4, 32, 8, 5, 5),        # the new row alone
])
def test_decode_attention_over_a_window(device, dtype, q_heads, kv_heads, dim, capacity, position, start):
    """start > 0 (a sliding window): rows [start, position] are attended,
    the older ones neither read nor written; poisoning them changes nothing."""
    case = attention_case(q_heads, kv_heads, dim, capacity, position, dtype)
    want, key_row, _ = reference(**case, start=start)
    case["key_cache"][:, :start] = float("nan")
    case["value_cache"][:, :start] = float("nan")
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device, start=start).cpu()
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    torch.testing.assert_close(on_device["key_cache"].cpu()[:, position].float(), key_row, **TOL[dtype])
    assert torch.isnan(on_device["key_cache"].cpu()[:, :start]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,capacity,position,start", [
    (8, 2, 64, 40, 30, 0),     # the SIMD path
    (6, 3, 48, 20, 12, 9),     # the portable loops, over a window
])
@pytest.mark.parametrize("spread", [0.3, 3.0])  # sinks below the scores, and above them (the divisor's largest term)
def test_decode_attention_with_sinks(device, dtype, q_heads, kv_heads, dim, capacity, position, start, spread):
    """gpt-oss's attention sinks: each head's logit joins its softmax's
    maximum and divisor and nothing else."""
    case = attention_case(q_heads, kv_heads, dim, capacity, position, dtype)
    sinks = (torch.randn(q_heads, generator=torch.Generator().manual_seed(1)) * spread * 4).to(dtype)
    want = reference(**case, start=start, sinks=sinks)[0]
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device, start=start, sinks=sinks.to(device)).cpu()
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    without = ops.decode_attention(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in on_device.items()},
                                   start=start).cpu()
    assert not torch.allclose(out, without, **TOL[dtype])  # the sinks matter at these sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_heads,kv_heads,dim,capacity,position", [(8, 4, 64, 50, 45), (4, 2, 48, 20, 19)])
def test_decode_attention_with_a_soft_cap(device, dtype, q_heads, kv_heads, dim, capacity, position):
    """Gemma 2's soft cap: scores far apart (spread 3) squeezed into
    (-cap, cap) before the softmax, on the SIMD and the portable paths."""
    case = attention_case(q_heads, kv_heads, dim, capacity, position, dtype, spread=3.0)
    want = reference(**case, softcap=5.0)[0]
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device, softcap=5.0).cpu()
    torch.testing.assert_close(out.float(), want, **TOL[dtype])
    assert not torch.allclose(out.float(), reference(**case)[0], **TOL[dtype])  # the cap matters here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dim", [64, 96, 48])
def test_16_bit_heads_are_the_fp32_sums_rounded_once(dtype, dim):
    """16-bit keys and values are read as the fp32 values they hold and summed
    in fp32, the result rounded to the dtype once, as torch rounds: the fp32
    op on the same values (the rotation left exact: cos 1, sin 0) rounded by
    torch gives the same bits, on the SIMD and portable head sizes."""
    case = attention_case(12, 4, dim, 150, 137, dtype)
    case.update(cos=torch.ones(dim, dtype=dtype), sin=torch.zeros(dim, dtype=dtype))
    wide = {k: v.float() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    got = ops.decode_attention(**case)
    want = ops.decode_attention(**wide)
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))


def test_decode_attention_with_sharp_scores(device):
    """Scores hundreds apart: the softmax's exponents far below its maximum."""
    case = attention_case(6, 2, 64, 300, 299, torch.float32, spread=12.0)
    on_device = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    out = ops.decode_attention(**on_device).cpu()
    want = reference(**case)[0]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_decode_attention_is_the_same_on_any_thread_count():
    """Key-value heads are split over lowbit's pool: each computed the same whoever runs it."""
    case = attention_case(12, 4, 64, 100, 70, torch.float32)
    results = []
    before = ops.cpu_threads()
    try:
        for threads in (1, 2, 3):
            ops.cpu_threads(threads)
            results.append(ops.decode_attention(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                                   for k, v in case.items()}))
    finally:
        ops.cpu_threads(before)
    assert all(torch.equal(r, results[0]) for r in results)


def test_decode_attention_refuses_gradients_and_opchecks():
    case = attention_case(4, 2, 32, 16, 5, torch.float32)
    torch.library.opcheck(torch.ops.lowbit.decode_attention, tuple(case.values()))
    torch.library.opcheck(torch.ops.lowbit.decode_attention, (*case.values(), 3))
    torch.library.opcheck(torch.ops.lowbit.decode_attention, (*case.values(), 0, torch.randn(4)))
    torch.library.opcheck(torch.ops.lowbit.decode_attention, (*case.values(), 2, None, 30.0))
    with pytest.raises(RuntimeError, match="sinks requires grad"):
        ops.decode_attention(**case, sinks=torch.randn(4, requires_grad=True))
    # Strided sinks of their own storage are taken; a strided view of a cache, which the op writes, is not.
    sinks = torch.randn(8)
    fresh = lambda: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    assert torch.equal(ops.decode_attention(**fresh(), sinks=sinks[::2]),
                       ops.decode_attention(**fresh(), sinks=sinks[::2].contiguous()))
    shared = fresh()
    with pytest.raises(RuntimeError, match="value_cache shares memory with sinks"):
        ops.decode_attention(**shared, sinks=shared["value_cache"].view(-1)[:8:2])
    q = case["q"].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="^decode_attention: not differentiable.*q requires grad"):
        ops.decode_attention(**{**case, "q": q})
    with torch.no_grad():
        assert not ops.decode_attention(**{**case, "q": q}).requires_grad


def test_decode_attention_counts_its_cache_writes_for_autograd():
    """A product that saved a cache for backward must refuse once the op wrote into that cache (the op runs
    below autograd, which would count no write): a silently wrong gradient otherwise."""
    case = attention_case(4, 2, 32, 16, 5, torch.float32)
    before = (case["key_cache"]._version, case["value_cache"]._version)
    ops.decode_attention(**case)
    assert (case["key_cache"]._version, case["value_cache"]._version) == (before[0] + 1, before[1] + 1)
    w = torch.randn_like(case["key_cache"], requires_grad=True)
    product = w * case["key_cache"]  # saves key_cache for w's gradient
    ops.decode_attention(**{**case, "position": 6})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        product.sum().backward()
    with torch.inference_mode():  # inference tensors count no versions: the op still runs
        fresh = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
        ops.decode_attention(**fresh)


def test_decode_attention_under_torch_compile_writes_the_caches():
    case = attention_case(4, 2, 32, 16, 5, torch.float32)
    eager = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    want = ops.decode_attention(**eager)

    @torch.compile(fullgraph=True)
    def step(q, k, v, cos, sin, key_cache, value_cache):
        return ops.decode_attention(q * 1.0, k, v, cos, sin, key_cache, value_cache, 5, 32 ** -0.5) + 0.0

    got = step(*(case[n] for n in ("q", "k", "v", "cos", "sin", "key_cache", "value_cache")))
    assert torch.equal(got, want)
    assert torch.equal(case["key_cache"], eager["key_cache"]) and torch.equal(case["value_cache"], eager["value_cache"])
