"""Whole models on a GPU: a GGUF file's model and a GPTQ checkpoint's model,
loaded on the CPU as the loaders give them and moved with .to("cuda"), give
the CPU model's logits and greedy tokens; a repacked (CPU-layout) model moves
back to the file's layout on the way; half dtypes, backward through the
quantized layers and torch.compile run there too. The ops alone:
tests/test_cuda_backend.py.

Tolerance: both devices quantize activations (GGUF) and decode weights with
the same code, and sum in fp32 in different orders: the logits agree to about
1e-6 relative; 1e-4 allows for an activation that lands on the other side of
a Q8 rounding boundary. Half dtypes: against the fp32 CPU model, 2e-2.

Skips without a GPU and a CUDA build of lowbit."""
import pytest
import torch
from gguf import GGMLQuantizationType as T

import lowbit
from lowbit.gptq import GPTQConfig, save_gptq
from tiny_models import act_order_gptq_model, tiny_model, write_tiny_gguf

CUDA_OK = torch.cuda.is_available() and torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm", "CUDA")
pytestmark = pytest.mark.skipif(not CUDA_OK, reason="CUDA cases need a GPU and a CUDA build of lowbit")

IDS = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
NEW_TOKENS = 8


def logits(model, ids):
    with torch.inference_mode():
        return model(ids.to(model.device)).logits.float().cpu()


def generate(model, ids):
    ids = ids.to(model.device)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    return out.cpu()


def relative_error(got, want):
    return ((got - want).norm() / want.norm()).item()


def assert_on_cuda(model):
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.is_cuda, f"{name} stayed on {t.device}"


def assert_same_model(gpu, cpu):
    assert_on_cuda(gpu)
    err = relative_error(logits(gpu, IDS), logits(cpu, IDS))
    assert err < 1e-4, f"logits differ by {err:.2e}"
    assert torch.equal(generate(gpu, IDS), generate(cpu, IDS))


@pytest.fixture(scope="module")
def gguf_paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda_models")
    return {(arch, qtype): write_tiny_gguf(folder / f"{arch}-{qtype.name}.gguf", tiny_model(arch, seed=0), arch,
                                           qtype=qtype)
            for arch in ("llama", "mixtral") for qtype in (T.Q8_0, T.Q4_0)}


@pytest.mark.parametrize("repack", [False, True], ids=["file-layout", "repacked"])
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_gguf_model_moves_to_cuda(gguf_paths, arch, qtype, repack):
    path = gguf_paths[(arch, qtype)]
    cpu = lowbit.load_gguf_model(path, repack=repack)
    gpu = lowbit.load_gguf_model(path, repack=repack).to("cuda")
    assert_same_model(gpu, cpu)
    back = gpu.to("cpu")  # and back to the CPU
    assert torch.equal(generate(back, IDS), generate(cpu, IDS))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gguf_model_in_half_dtypes_on_cuda(gguf_paths, dtype):
    path = gguf_paths[("llama", T.Q8_0)]
    want = logits(lowbit.load_gguf_model(path), IDS)
    gpu = lowbit.load_gguf_model(path, dtype=dtype).to("cuda")
    got = logits(gpu, IDS)
    assert relative_error(got, want) < 2e-2
    assert generate(gpu, IDS).shape == (1, IDS.shape[1] + NEW_TOKENS)


@pytest.fixture(scope="module")
def gptq_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cuda_gptq") / "model"
    config = GPTQConfig(4, 32, desc_act=True, sym=False, checkpoint_format="gptq_v2")
    save_gptq(act_order_gptq_model(seed=1), directory, config)
    return directory


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float", "int8-on-cpu"])
def test_gptq_checkpoint_model_moves_to_cuda(gptq_dir, int8_activations):
    """The loader's model (rows sorted for act-order, int8 activations where
    asked: a CPU kernel, so on the GPU the layers multiply float activations,
    and the reference is the CPU model without them)."""
    cpu = lowbit.load_gptq_model(gptq_dir)
    gpu = lowbit.load_gptq_model(gptq_dir, int8_activations=int8_activations).to("cuda")
    assert_same_model(gpu, cpu)


def test_gptq_layers_built_on_the_cpu_move_to_cuda():
    """GPTQLinear.from_linear's layers with their g_idx (rows not sorted), as a user builds them."""
    model = act_order_gptq_model(seed=2)
    cpu = act_order_gptq_model(seed=2)
    assert_same_model(model.to("cuda"), cpu)


def test_backward_through_gptq_layers_on_cuda(gptq_dir):
    """Gradients reach the inputs through every quantized layer as on the CPU."""
    grads = []
    for device in ("cpu", "cuda"):
        model = lowbit.load_gptq_model(gptq_dir).to(device)
        embeds = model.get_input_embeddings()(IDS.to(device)).detach().requires_grad_()
        model(inputs_embeds=embeds).logits.float().square().sum().backward()
        grads.append(embeds.grad.cpu())
    assert relative_error(grads[1], grads[0]) < 1e-4


def test_compiled_gguf_model_on_cuda(gguf_paths):
    path = gguf_paths[("llama", T.Q4_0)]
    model = lowbit.load_gguf_model(path).to("cuda")
    eager = logits(model, IDS)
    compiled = torch.compile(model)
    with torch.inference_mode():
        got = compiled(IDS.cuda()).logits.float().cpu()
    assert relative_error(got, eager) < 1e-5
