"""torch.autocast: the matmul ops take their activations in autocast's dtype
and nothing else in it (csrc/ops/autocast.cpp), so lowbit's layers, experts
and models give inside an autocast region what nn.Linear's give."""
import numpy as np
import pytest
import torch
from torch import nn

import gguf_blocks as gb
import gptq_reference as ref
import lowbit

DTYPES = [torch.bfloat16, torch.float16]
K, N = 256, 96


def gptq_args(a):
    rng = np.random.default_rng(4)
    ckpt = ref.random_checkpoint(rng, K, N, 4, 32, False, "gptq_v2", True)  # fp16 scales
    return (a, *(torch.from_numpy(np.ascontiguousarray(ckpt[k])) for k in ("qweight", "qzeros", "scales", "g_idx")))


def ggml_weight(rows=N, experts=None):
    rng = np.random.default_rng(5)
    if experts is None:
        return torch.from_numpy(gb.random_blocks(rng, "Q4_0", rows, K))
    return torch.stack([torch.from_numpy(gb.random_blocks(rng, "Q4_0", rows, K)) for _ in range(experts)])


def op_calls(a):
    """(name, op, args, the activations' index among args) of every matmul op
    with activations a [M, K] (ggml_mul_mat_vec_a8: its first row)."""
    q4_0 = gb.type_id("Q4_0")
    ids = torch.tensor([[0, 2], [1, 0], [2, 2]])[:a.shape[0]]
    gptq = gptq_args(a)
    calls = [("gptq_gemm", torch.ops.lowbit.gptq_gemm, (*gptq, False, True, 4), 0),
             ("gptq_gemm_a8", torch.ops.lowbit.gptq_gemm_a8, (*gptq[:4], torch.empty(0, dtype=torch.int32), True, 4),
              0),
             ("ggml_mul_mat_a8", torch.ops.lowbit.ggml_mul_mat_a8, (ggml_weight(), a, q4_0, N), 1),
             ("ggml_mul_mat_vec_a8", torch.ops.lowbit.ggml_mul_mat_vec_a8, (ggml_weight(), a[:1], q4_0, N), 1),
             ("ggml_mul_mat_id", torch.ops.lowbit.ggml_mul_mat_id, (ggml_weight(experts=3), a, ids, q4_0, N), 1)]
    if torch.ops.lowbit.cpu_reads_repacked(q4_0):
        repacked = torch.ops.lowbit.ggml_repack(ggml_weight(), q4_0, N, K)
        calls.append(("ggml_mul_mat_repacked", torch.ops.lowbit.ggml_mul_mat_repacked, (repacked, a, q4_0, N), 1))
        experts = torch.stack([torch.ops.lowbit.ggml_repack(w, q4_0, N, K) for w in ggml_weight(experts=3)])
        calls.append(("ggml_mul_mat_id_repacked", torch.ops.lowbit.ggml_mul_mat_id_repacked,
                      (experts, a, ids, q4_0, N), 1))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
def test_ops_take_their_activations_in_autocast_s_dtype(dtype):
    """Inside the region each op gives, bit for bit, what it gives outside
    for activations cast to autocast's dtype and every other argument as it
    is (the GPTQ weight's fp16 scales too)."""
    a = torch.randn(3, K)
    for name, op, args, index in op_calls(a):
        with torch.autocast("cpu", dtype=dtype):
            got = op(*args)
        cast = list(args)
        cast[index] = args[index].to(dtype)
        want = op(*cast)
        assert got.dtype == dtype and torch.equal(got, want), name
    for name, op, args, _ in op_calls(a.to(torch.bfloat16 if dtype == torch.float16 else torch.float16)):
        with torch.autocast("cpu", dtype=dtype):
            assert op(*args).dtype == dtype, name  # a half dtype other than autocast's is cast as well


def linear_layers(bias=True):
    torch.manual_seed(0)
    linear = nn.Linear(K, N, bias=bias)
    return linear, [lowbit.GGUFLinear.from_linear(linear, gb.type_id("Q8_0")),
                    lowbit.GPTQLinear.from_linear(linear, 4, 32, False, "gptq_v2"),
                    lowbit.GPTQLinear.from_linear(linear, 4, 32, False, "gptq_v2", dtype=torch.float32)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_follow_autocast_as_nn_linear_does(dtype):
    """The output in autocast's dtype (nn.Linear's), equal to the layer's
    output for the cast input outside the region; the gradient reaches the
    fp32 input through the cast."""
    linear, layers = linear_layers()
    x = torch.randn(2, 5, K)
    with torch.autocast("cpu", dtype=dtype):
        reference = linear(x)
    for layer in layers:
        xg = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            y = layer(xg)
        assert y.dtype == reference.dtype == dtype
        assert torch.equal(y, layer(x.to(dtype)))
        y.float().sum().backward()
        assert xg.grad.dtype == torch.float32 and xg.grad.abs().sum() > 0
    # Under no_grad too (below autograd: call_frozen), and float64 inputs, which autocast leaves alone.
    with torch.no_grad():
        outside = [layer(x.double()) for layer in layers]
        with torch.autocast("cpu", dtype=dtype):
            for layer, want in zip(layers, outside):
                assert layer(x).dtype == dtype and torch.equal(layer(x.double()), want)


def test_fused_projections_share_a_call_only_within_one_autocast_state(tmp_path):
    """q_proj, k_proj and v_proj take their parts of one fused call: a part
    computed inside an autocast region serves no call outside it."""
    from tiny_models import tiny_model, write_tiny_gguf

    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / "llama.gguf", tiny_model("llama", seed=0), "llama"))
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, lowbit.fusing.ProjectionSlice)
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad():
        want = attn.k_proj(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert attn.q_proj(x).dtype == torch.bfloat16
        assert torch.equal(attn.k_proj(x), want)


def test_layers_follow_autocast_under_torch_compile():
    """The cast is in the compiled graph: eager's bits (without a bias,
    whose add inductor fuses at its own rounding)."""
    _, layers = linear_layers(bias=False)
    x = torch.randn(4, K)
    for layer in layers:
        def f(t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return layer(t)

        got = torch.compile(f, fullgraph=True)(x)
        assert got.dtype == torch.bfloat16 and torch.equal(got, f(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gptq_experts_follow_autocast(dtype):
    torch.manual_seed(1)
    hidden, intermediate, count = 64, 96, 3

    def expert():
        return lowbit.gptq.experts.GPTQExpert(*(lowbit.GPTQLinear.from_linear(nn.Linear(i, o, bias=False), 4, 32)
                                                for i, o in ((hidden, intermediate), (hidden, intermediate),
                                                             (intermediate, hidden))))

    experts = lowbit.gptq.experts.GPTQExperts([expert() for _ in range(count)], nn.SiLU())
    x, ids, weights = torch.randn(5, hidden), torch.randint(0, count, (5, 2)), torch.rand(5, 2)
    with torch.autocast("cpu", dtype=dtype):
        y = experts(x, ids, weights)
    assert y.dtype == dtype
    want = experts(x, ids, weights)
    # Half-precision activations: measured within 0.6% of the largest output.
    torch.testing.assert_close(y.float(), want, atol=0.03 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3moe"])
def test_models_run_under_another_half_dtype_s_autocast(arch, tmp_path):
    """A bf16 lowbit model inside an fp16 autocast region (and the converse)
    runs as a model of nn.Linear layers does: every projection in autocast's
    dtype, so that torch.cat of q's halves (rotary) sees one dtype."""
    from tiny_models import tiny_model, write_tiny_gguf

    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=0), arch)
    ids = torch.tensor([[1, 7, 22, 5]])
    with torch.no_grad():
        want = lowbit.load_gguf_model(path)(ids).logits
        for model_dtype, region in ((torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)):
            model = lowbit.load_gguf_model(path, dtype=model_dtype)
            with torch.autocast("cpu", dtype=region):
                logits = model(ids).logits
            assert logits.dtype == region
            # Half-precision weights and activations: measured within 1.3% of the largest logit.
            torch.testing.assert_close(logits.float(), want, atol=0.05 * want.abs().max().item(), rtol=0)


def test_generate_inside_autocast_runs_the_model_s_own_forward(tmp_path):
    """Decode calls inside an autocast region go to the model's own forward,
    whose ops follow the region (the C++ decode step computes in the model's
    dtype): the tokens of the same calls with fast decoding off."""
    from tiny_models import tiny_model, write_tiny_gguf

    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / "llama.gguf", tiny_model("llama", seed=0), "llama"))
    ids = torch.tensor([[1, 7, 22, 5, 63]])

    def generate():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                                  pad_token_id=0, output_logits=True, return_dict_in_generate=True)

    served = generate()
    assert not lowbit.fast_decoding(model, False)
    own = generate()
    assert torch.equal(served.sequences, own.sequences)
    for a, b in zip(served.logits, own.logits):
        assert torch.equal(a, b)
