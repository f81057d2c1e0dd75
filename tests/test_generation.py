"""Compiled decoding (lowbit.compiled_decoding): model.generate with a static
KV cache and each decode step one torch.compile graph (no graph break) around
lowbit's ops gives the tokens the eager model gives, on a tiny Llama GGUF
file (Q8_0: the same kernels as any file, compiled in seconds) and on the
same model as act-order GPTQ layers."""
import re

import pytest
import torch

import lowbit
import tiny_models
from tiny_models import tiny_model, write_tiny_gguf

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("generation") / "llama.gguf", tiny_model("llama", seed=0), "llama")


def generate(model, ids):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def spy_on_steps(model):
    """The torch thread count of each compiled step generate runs from now on."""
    compiled, steps = model._compiled_call, []
    step = torch.compile(model.__call__, **compiled.compile_config.to_dict())
    compiled._step = lambda *a, **k: steps.append(torch.get_num_threads()) or step(*a, **k)
    return steps


def test_compiled_decoding_gives_the_eager_tokens(path, two_threads):
    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    eager = generate(model, ids)
    assert lowbit.compiled_decoding(model, max_cache_len=32) is model
    assert model.generation_config.cache_implementation == "static" and model.generation_config.max_cache_len == 32
    steps = spy_on_steps(model)
    torch._dynamo.utils.counters.clear()
    compiled = generate(model, ids)
    assert torch.equal(compiled, eager)
    # the step is one graph: no graph break, one frame compiled (the prefill is eager)
    counters = torch._dynamo.utils.counters
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)
    # generate ran the decode steps through the compiled call, torch's ops on one thread where it had more
    assert len(steps) == NEW_TOKENS - 1 and set(steps) == {1}
    assert generate(model, ids[:, :4]).shape == (1, 4 + NEW_TOKENS)  # another prompt length: the same graph
    assert torch.get_num_threads() == 2
    lowbit.compiled_decoding(model, enable=False)
    assert model.generation_config.cache_implementation is None and model.generation_config.compile_config is None
    assert not hasattr(model, "_compiled_call")
    assert torch.equal(generate(model, ids), eager)


def test_compiled_decoding_follows_copies_pickles_and_switches(path, two_threads):
    """A deep copy's and an unpickled model's steps compile the copy itself
    (a copy whose final norm is zeroed decodes token 0 only, its source the
    eager tokens); kernel_threads(model, False) leaves the steps torch's
    threads; switching off restores the generation config's own values."""
    import copy
    import pickle

    from transformers import CompileConfig

    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    eager = generate(model, ids)
    model.generation_config.update(cache_implementation="dynamic", max_cache_len=256)
    lowbit.compiled_decoding(model, max_cache_len=32)
    lowbit.compiled_decoding(model, max_cache_len=32)  # twice: the config before the first is what comes back
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.norm.weight.zero_()
    assert torch.equal(generate(twin, ids)[0, ids.shape[1]:], torch.zeros(NEW_TOKENS, dtype=torch.long))
    assert torch.equal(generate(model, ids), eager)
    assert torch.equal(generate(pickle.loads(pickle.dumps(model)), ids), eager)
    lowbit.kernel_threads(model, False)
    steps = spy_on_steps(model)
    assert torch.equal(generate(model, ids), eager) and set(steps) == {2}
    model.get_compiled_call(CompileConfig(fullgraph=False, dynamic=True))  # generate(compile_config=...) replaces it
    lowbit.compiled_decoding(model, enable=False)
    config = model.generation_config
    assert (config.cache_implementation, config.max_cache_len, config.compile_config) == ("dynamic", 256, None)


@pytest.mark.parametrize("arch, types", [("gemma2", "sliding_attention"), ("gemma3", "sliding_attention")])
def test_compiled_decoding_refuses_sliding_window_layers(tmp_path, arch, types):
    """transformers' static sliding-window cache guards each step on the tokens seen: a recompile per token until
    torch.compile's limit fails the generation. Refused at once, the model unchanged."""
    model = lowbit.load_gguf_model(write_tiny_gguf(tmp_path / f"{arch}.gguf", tiny_model(arch, seed=0), arch))
    with pytest.raises(ValueError, match=f"compiled_decoding: .* has {types} layers, whose static cache recompiles"):
        lowbit.compiled_decoding(model)
    assert model.generation_config.cache_implementation is None and not hasattr(model, "_compiled_call")


def test_compiled_decoding_refuses_bad_arguments(path):
    model = lowbit.load_gguf_model(path)
    for bad in (0, -5, 2.5, "x", True):
        with pytest.raises(ValueError, match=f"compiled_decoding: max_cache_len must be a positive int or None, got "
                                             f"{re.escape(repr(bad))}"):
            lowbit.compiled_decoding(model, max_cache_len=bad)
    assert model.generation_config.cache_implementation is None and not hasattr(model, "_compiled_call")
    for not_a_model in (None, torch.nn.Linear(2, 2)):
        with pytest.raises(TypeError, match="compiled_decoding: model must be a transformers generation model"):
            lowbit.compiled_decoding(not_a_model)
    with pytest.raises(TypeError, match="fast_decoding: model must be an nn.Module, got NoneType"):
        lowbit.fast_decoding(None)
    with pytest.raises(TypeError, match="fuse_projections: model must be an nn.Module, got NoneType"):
        lowbit.fusing.fuse_projections(None)


def test_decoding_switches_refuse_what_is_not_a_bool(path):
    """enable and cpp_wrapper are switches, as kernel_threads' enable: "off"
    or None read as truth would compile, serve or restore unasked. A refused
    call leaves the model as it was."""
    model = lowbit.load_gguf_model(path)
    served = type(model.__dict__["forward"])
    for bad in ("off", None, 0, 1.0):
        for name, call in (("enable", lambda: lowbit.compiled_decoding(model, bad)),
                           ("cpp_wrapper", lambda: lowbit.compiled_decoding(model, cpp_wrapper=bad))):
            with pytest.raises(ValueError, match=f"^compiled_decoding: {name} must be True or False, got "
                                                 f"{re.escape(repr(bad))}$"):
                call()
        with pytest.raises(ValueError, match=f"^fast_decoding: enable must be True or False, got {re.escape(repr(bad))}$"):
            lowbit.fast_decoding(model, bad)
    assert model.generation_config.cache_implementation is None and not hasattr(model, "_compiled_call")
    assert type(model.__dict__["forward"]) is served


def test_compiled_decoding_runs_what_it_cannot_compile_eagerly(path, two_threads):
    """Shapes past torch.compile's recompile limit (batch sizes, longer
    caches) and a call asking for attentions (transformers logs from inside
    the step) run eagerly, with the eager tokens, and later calls still run."""
    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    eager = {batch: generate(model, ids.repeat(batch, 1)) for batch in (1, 2, 3)}
    lowbit.compiled_decoding(model, max_cache_len=32)
    with torch._dynamo.config.patch(recompile_limit=1):
        for batch in (1, 2, 3, 1):
            assert torch.equal(generate(model, ids.repeat(batch, 1)), eager[batch]), batch
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                             output_attentions=True)
    assert torch.equal(out.sequences, eager[1][:, :ids.shape[1] + 3]) and len(out.attentions) == 3


def test_compiled_decoding_continues_a_cache_up_to_its_end(path, two_threads):
    """A generate call continuing an earlier one's static cache gives the eager
    tokens up to the cache's last row; a step that would write past it is
    refused by name (the compiled write's own failure names neither)."""
    model = lowbit.load_gguf_model(path)
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    eager = generate(model, ids)
    lowbit.compiled_decoding(model, max_cache_len=12)

    def continued(new_tokens):
        with torch.inference_mode():
            first = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0,
                                   return_dict_in_generate=True)
            assert first.cache.layers[0].max_cache_len == 12
            return model.generate(first.sequences, cache=first.cache, cache_implementation=None,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    assert torch.equal(continued(3), eager[:, :ids.shape[1] + 6])  # 13 tokens, the first 12 in its 12 rows
    with pytest.raises(ValueError, match=r"compiled_decoding: the static cache holds 12 tokens \(max_cache_len\) and "
                                         "this step would take it to 13: generate with a larger max_cache_len"):
        continued(4)


def test_compiled_embedding_still_checks_token_ids(path):
    table = lowbit.load_gguf_model(path).model.embed_tokens
    compiled = torch.compile(table, fullgraph=True)
    assert torch.equal(compiled(torch.tensor([[0, 63]])), table(torch.tensor([[0, 63]])))
    # The layer's own check where the graph keeps it, else the compiled kernel's bounds check.
    with pytest.raises((IndexError, RuntimeError, AssertionError),
                       match=r"token ids must lie in \[0, 64\)|index out of bounds"):
        compiled(torch.tensor([[0, 64]]))


def act_order_gptq_model(seed):
    return lowbit.kernel_threads(tiny_models.act_order_gptq_model(seed))


@pytest.mark.parametrize("rows_sorted,int8_activations", [(False, False), (True, False), (True, True)])
def test_compiled_decoding_of_an_act_order_gptq_model(two_threads, rows_sorted, int8_activations):
    """The layers' sorted copies are made in the eager prefill (or their rows
    are sorted in place, as the checkpoint loaders hold them); the compiled
    steps take them as they stand, gptq_gemm_a8 as gptq_gemm."""
    model = act_order_gptq_model(seed=1)
    for m in model.modules():
        if isinstance(m, lowbit.GPTQLinear):
            if rows_sorted:
                m.sort_rows()
            m.int8_activations = int8_activations
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    eager = generate(model, ids)
    lowbit.compiled_decoding(model, max_cache_len=32)
    assert torch.equal(generate(model, ids), eager)


def test_compiled_decoding_of_repacked_layers(path, two_threads):
    """Layers in the kernels' repacked layouts (the generate command's
    default: GGUF blocks, GPTQ panels) compile into the one step graph, and it
    gives the eager model's tokens."""
    ids = torch.tensor([[1, 7, 22, 5, 63, 40, 9]])
    gguf = lowbit.load_gguf_model(path, repack=True)
    gptq = act_order_gptq_model(seed=1)
    for m in gptq.modules():
        if isinstance(m, lowbit.GPTQLinear):
            m.int8_activations = True
    assert lowbit.repack_model(gptq)
    for model in (gguf, gptq):
        assert any(getattr(m, "repacked", False) for m in model.modules())
        eager = generate(model, ids)
        lowbit.compiled_decoding(model, max_cache_len=32)
        steps = spy_on_steps(model)
        torch._dynamo.utils.counters.clear()
        assert torch.equal(generate(model, ids), eager)
        assert len(steps) == NEW_TOKENS - 1 and not torch._dynamo.utils.counters["graph_break"]
