"""ggml_mul_mat_id, the mixture-of-experts matmul: every (token, slot)'s
product equals ggml_mul_mat_a8 of the slot's expert alone, bit for bit on the
CPU (every type, every ISA, both activation forms, int32 and int64 ids);
llama.cpp's own ggml_mul_mat_id on the same blocks agrees; opcheck (and of
ggml_mul_mat_id_repacked, tested against each expert's
ggml_mul_mat_repacked in test_gguf_experts.py), torch.compile. Validation:
test_validation_matrix.py."""
import numpy as np
import pytest
import torch

import gguf_blocks as gb
import llama_cpp_peer

ops = torch.ops.lowbit
EXPERTS, ROWS, N = 5, 48, 256


def experts_blocks(name, seed=0):
    """Random blocks of EXPERTS weights [ROWS, N], as [EXPERTS, ROWS, row_bytes]."""
    raw = gb.random_blocks(np.random.default_rng(seed), name, EXPERTS * ROWS, N)
    return torch.from_numpy(raw).view(EXPERTS, ROWS, -1)


def routing(tokens, slots, seed=0, dtype=torch.int32):
    """ids [tokens, slots]: each token's slots distinct experts, as a router's top-k are."""
    g = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(EXPERTS, generator=g)[:slots] for _ in range(tokens)]
    return (torch.stack(rows) if rows else torch.empty(0, slots, dtype=torch.int64)).to(dtype)


def each_expert_alone(W, x, ids, qtype):
    """out[t, s] = ggml_mul_mat_a8 of expert ids[t, s] on its activation row."""
    out = torch.empty(*ids.shape, W.shape[1], dtype=x.dtype, device=x.device)
    for t in range(ids.shape[0]):
        for s in range(ids.shape[1]):
            row = x[t, s] if x.dim() == 3 else x[t]
            out[t, s] = ops.ggml_mul_mat_a8(W[int(ids[t, s])], row[None], qtype, W.shape[1])[0]
    return out


@pytest.mark.parametrize("name", gb.TYPES)
@pytest.mark.parametrize("tokens, slots, per_slot", [(1, 2, False), (1, 4, True), (6, 3, False), (19, 2, True)])
def test_equals_each_experts_matmul(device, name, tokens, slots, per_slot):
    W = experts_blocks(name).to(device)
    shape = (tokens, slots, N) if per_slot else (tokens, N)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(tokens)).to(device)
    ids = routing(tokens, slots, seed=tokens, dtype=torch.int64 if per_slot else torch.int32).to(device)
    got = ops.ggml_mul_mat_id(W, x, ids, gb.type_id(name), ROWS)
    want = each_expert_alone(W, x, ids, gb.type_id(name))
    assert got.shape == (tokens, slots, ROWS) and got.dtype == x.dtype
    if device == "cpu" and name not in gb.FLOAT_TYPES:
        # Each expert's pairs are a batch of its rows: each row its own matvec's, bit for bit. (The float
        # types' matvec sums a row over more partial sums than a batch's tiles do: fp32 rounding apart.)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def test_half_activations_and_repeated_experts(device):
    """bf16 / fp16 activations are taken as fp32 and the result rounded once;
    a token may send two slots to one expert (ids need not be distinct)."""
    W = experts_blocks("Q4_K").to(device)
    ids = torch.tensor([[3, 3], [0, 3], [4, 1]], dtype=torch.int32, device=device)
    x = torch.randn(3, N, generator=torch.Generator().manual_seed(1)).to(device)
    for dtype in (torch.float16, torch.bfloat16):
        got = ops.ggml_mul_mat_id(W, x.to(dtype), ids, gb.type_id("Q4_K"), ROWS)
        want = ops.ggml_mul_mat_id(W, x.to(dtype).float(), ids, gb.type_id("Q4_K"), ROWS).to(dtype)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    both = ops.ggml_mul_mat_id(W, x, ids, gb.type_id("Q4_K"), ROWS)
    torch.testing.assert_close(both[0, 0], both[0, 1], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "Q2_K", "MXFP4"])
@pytest.mark.parametrize("per_slot", [False, True])
def test_agrees_with_llama_cpp(name, per_slot):
    """llama.cpp's ggml_mul_mat_id on the same blocks, activations and ids: the
    same 8-bit products, summed in another order (relative 1e-5 of the largest
    output; measured under 2e-7)."""
    missing = llama_cpp_peer.available()
    if missing:
        pytest.skip(missing)
    tokens, slots = 7, 3
    W = experts_blocks(name, seed=2)
    ids = routing(tokens, slots, seed=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((tokens, slots, N) if per_slot else (tokens, N)).astype(np.float32)
    peer = llama_cpp_peer.GgmlMulMatId(W.numpy(), gb.type_id(name), EXPERTS, ROWS, N, tokens, slots, 1,
                                       per_slot=per_slot)
    peer.set_input(x, ids.numpy())
    peer.compute()
    want = peer.result()
    got = ops.ggml_mul_mat_id(W, torch.from_numpy(x), ids, gb.type_id(name), ROWS).numpy()
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_opcheck_and_compile():
    W = experts_blocks("Q4_K")
    t = gb.type_id("Q4_K")
    packed = torch.stack([ops.ggml_repack(w, t, ROWS, N) for w in W])
    for x, ids in ((torch.randn(3, N), routing(3, 2)), (torch.randn(2, 4, N).bfloat16(), routing(2, 4).long())):
        torch.library.opcheck(ops.ggml_mul_mat_id, (W, x, ids, t, ROWS))
        torch.library.opcheck(ops.ggml_mul_mat_id_repacked, (packed, x, ids, t, ROWS))

    @torch.compile(fullgraph=True, dynamic=True)
    def f(x, ids):
        return torch.relu(ops.ggml_mul_mat_id(W, x, ids, t, ROWS)).sum(dim=1)

    for tokens in (1, 5):
        x, ids = torch.randn(tokens, N), routing(tokens, 2, seed=tokens)
        torch.testing.assert_close(f(x, ids), torch.relu(ops.ggml_mul_mat_id(W, x, ids, t, ROWS)).sum(dim=1))


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_compile_takes_tokens_counted_at_run_time():
    """Tokens gathered by a mask (an expert group's, a batch's unfinished
    rows) are a size known only when the graph runs: the fake kernel traces
    it, and a call whose X and ids disagree there gets the kernel's message."""
    W = experts_blocks("Q4_0")
    t = gb.type_id("Q4_0")
    packed = torch.stack([ops.ggml_repack(w, t, ROWS, N) for w in W])
    for op, weight in ((ops.ggml_mul_mat_id, W), (ops.ggml_mul_mat_id_repacked, packed)):
        def gathered(x, ids, x_mask, ids_mask):
            return op(weight, x[x_mask], ids[ids_mask], t, ROWS)

        torch._dynamo.reset()
        compiled = torch.compile(gathered, fullgraph=True)
        x, ids = torch.randn(6, N), routing(6, 2)
        for mask in (torch.tensor([1, 0, 1, 1, 0, 1]).bool(), torch.zeros(6, dtype=torch.bool)):
            torch.testing.assert_close(compiled(x, ids, mask, mask), gathered(x, ids, mask, mask), rtol=0, atol=0)
        with pytest.raises(ValueError, match=r"X must be \[tokens=5, n\] .* got \[4, 256\]"):
            compiled(x, ids, torch.tensor([1, 0, 1, 1, 0, 1]).bool(), torch.tensor([1, 1, 1, 1, 0, 1]).bool())


@pytest.mark.parametrize("per_slot", [False, True])
def test_gradient_opcheck_and_compiled_backward(per_slot):
    """The backward groups pairs by expert from the ids' values in eager; traced, it has none to group by and
    runs every expert over every pair, masked: the same gradient, and opcheck's traced backward passes."""
    W = experts_blocks("Q8_0")
    t = gb.type_id("Q8_0")
    packed = torch.stack([ops.ggml_repack(w, t, ROWS, N) for w in W])
    ids = torch.tensor([[0, 2], [2, 2], [1, 0]], dtype=torch.int32)
    x = torch.randn((3, 2, N) if per_slot else (3, N), requires_grad=True)
    for op, weight in ((ops.ggml_mul_mat_id, W), (ops.ggml_mul_mat_id_repacked, packed)):
        torch.library.opcheck(op, (weight, x, ids, t, ROWS))

        def step(x):
            return op(weight, x, ids, t, ROWS).square().sum()

        eager = torch.autograd.grad(step(x), x)[0]
        torch._dynamo.reset()
        compiled = torch.autograd.grad(torch.compile(step, fullgraph=True)(x), x)[0]
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_empty_calls():
    W = experts_blocks("Q8_0")
    t = gb.type_id("Q8_0")
    assert ops.ggml_mul_mat_id(W, torch.randn(0, N), routing(0, 2), t, ROWS).shape == (0, 2, ROWS)
    assert ops.ggml_mul_mat_id(W, torch.randn(3, N), routing(3, 0), t, ROWS).shape == (3, 0, ROWS)
