"""Compiled decoding for a lowbit model, the transformers way.

compiled_decoding(model) sets the model's generation config so that
model.generate keeps its keys and values in a static cache (shapes that do
not change from step to step) and runs each decode step as one graph,
torch.compile with lowbit's ops in it: no Python, module
calls or per-layer host work between the kernels of a step. The prefill
stays eager (its length changes from prompt to prompt). Models with
sliding-window layers (Gemma 2 and 3, gpt-oss) are refused: transformers'
static sliding cache would recompile the step for every token.

The first generate call compiles (on a 2-core CPU about a minute for a
30-layer model; inductor's cache on disk makes later processes faster).
Without it, the loaders' llama-family models decode through
lowbit.fast_decoding, an eager loop with most of the host time taken out
already; benchmarks/bench_e2e.py measures both.
"""
from __future__ import annotations

import torch
from torch import nn

from ._checks import check_flag, is_integer
from ._frozen import below_autograd, leave_autograd
from .threads import _STATE, _ModelAttribute, split_call

__all__ = ["compiled_decoding"]


class _ThreadedStep(_ModelAttribute):
    """The model's compiled call (transformers' _compiled_call): the decode
    step compiled at its first call, run within lowbit.kernel_threads' split
    where the model has one and, under no_grad, below autograd: the model's
    hooks that do this in eager calls are inside the compiled region, where
    they do nothing. It compiles the model it belongs to, so that a copy or an
    unpickled model compiles its own (the compiled function is not kept)."""

    def __init__(self, model: nn.Module, compile_config):
        super().__init__(model)
        self.compile_config, self._step = compile_config, None

    def __getstate__(self):
        return {"model": self.model, "compile_config": self.compile_config}

    def __setstate__(self, state):
        self.__init__(state["model"], state["compile_config"])

    def __call__(self, *args, **kwargs):
        _check_room(kwargs)
        if self._step is None:
            self._step = torch.compile(self.model.__call__, **self.compile_config.to_dict())
        if _STATE in self.model.__dict__:
            return split_call(self.model, args, kwargs, lambda: self._step(*args, **kwargs))
        guard = below_autograd()
        try:
            return self._step(*args, **kwargs)
        finally:
            leave_autograd(guard)


def _check_room(kwargs) -> None:
    """Refuses a step whose tokens would go past the end of its static cache
    (a generate call continuing a cache made for a shorter one): eager
    index_copy_ refuses that by name, the compiled step's write fails inside
    its kernel with a message naming a temporary of the generated code."""
    from transformers.cache_utils import StaticLayer

    cache, input_ids = kwargs.get("cache"), kwargs.get("input_ids")
    layer = cache.layers[0] if getattr(cache, "layers", None) else None
    if type(layer) is not StaticLayer or input_ids is None:
        return  # other caches grow, a sliding window's static layer rolls over
    # The first layer's end is every layer's: compiled_decoding refuses models with windows.
    end = int(layer.get_seq_length()) + input_ids.shape[-1]
    if end > layer.max_cache_len:
        raise ValueError(f"compiled_decoding: the static cache holds {layer.max_cache_len} tokens (max_cache_len) and "
                         f"this step would take it to {end}: generate with a larger max_cache_len, or continue a cache "
                         "with room for the new tokens")


# transformers' attributes for the compiled call and the config it was made for.
_COMPILED_CALL = ("_compiled_call", "_last_compile_config")
# The generation config's fields compiled_decoding sets, and the model's
# attribute holding their values from before it, restored when it is switched off.
_CONFIG_FIELDS = ("cache_implementation", "compile_config", "max_cache_len")
_PREVIOUS = "_lowbit_compiled_decoding"


def compiled_decoding(model: nn.Module, enable: bool = True, max_cache_len: int | None = None,
                      cpp_wrapper: bool = False) -> nn.Module:
    """model.generate with a static KV cache and its decode steps compiled
    (enable=False: eager steps, and the generation config's cache and compile
    fields as they were before compiled_decoding). Returns the model.
    A model with sliding-window layers raises ValueError (see the module's notes).

    max_cache_len: the cache's length, at least; each generate call needs
    prompt + new tokens, and a longer call than any before recompiles (the
    cache only grows); a call continuing a static cache (past_key_values)
    past its end raises ValueError at the step that would write there.
    cpp_wrapper: inductor calls the step's kernels from generated C++ rather
    than Python, which takes out most of the remaining per-op host time and
    makes the compile several times longer.
    Call it where the model runs (the compile mode follows its device); calls
    that pass their own cache_implementation or compile_config keep them, and
    a call that continues its own cache (past_key_values) passes
    cache_implementation=None, as transformers requires of both together."""
    from transformers import CompileConfig

    if not isinstance(model, nn.Module) or not hasattr(model, "generation_config"):
        raise TypeError(f"compiled_decoding: model must be a transformers generation model (with a "
                        f"generation_config), got {type(model).__name__}")
    enable = check_flag("compiled_decoding", "enable", enable)
    cpp_wrapper = check_flag("compiled_decoding", "cpp_wrapper", cpp_wrapper)
    if max_cache_len is not None and (not is_integer(max_cache_len) or max_cache_len <= 0):
        raise ValueError(f"compiled_decoding: max_cache_len must be a positive int or None, got {max_cache_len!r}")
    config = model.generation_config
    for attribute in _COMPILED_CALL:
        if hasattr(model, attribute):
            delattr(model, attribute)
    if not enable:
        previous = model.__dict__.pop(_PREVIOUS, {})  # the config as it was before compiled_decoding
        for field, value in previous.items():
            setattr(config, field, value)
        return model
    windowed = _windowed_layer_types(model.config)
    if windowed:
        # transformers' static sliding-window layers guard each compiled step
        # on how many tokens they have seen: a recompile per step, then a
        # failure once torch.compile's recompile limit is reached.
        raise ValueError(f"compiled_decoding: {type(model).__name__} has {', '.join(sorted(windowed))} layers, whose "
                         "static cache recompiles the step for every token; decode it eagerly (the loaders' fast "
                         "decode steps)")
    # On CUDA, CUDA graphs take the launch overhead away too; inductor's CPU
    # code has no such mode. (torch.compile takes a mode or options, not both.)
    # Not fullgraph: the step is one graph (tests/test_generation.py), and what
    # torch.compile cannot take (a call asking for attentions logs from inside
    # the step; more shapes than its recompile limit, a batch size or a longer
    # cache each) then runs eagerly instead of failing every later call.
    if cpp_wrapper:
        compile_config = CompileConfig(fullgraph=False, dynamic=False, mode=None, options={"cpp_wrapper": True})
    else:
        compile_config = CompileConfig(fullgraph=False, dynamic=False,
                                       mode="reduce-overhead" if model.device.type == "cuda" else "default")
    # transformers compiles generate's steps on accelerators only unless told.
    compile_config._compile_all_devices = True
    model.__dict__.setdefault(_PREVIOUS, {field: getattr(config, field, None) for field in _CONFIG_FIELDS})
    config.cache_implementation = "static"
    config.compile_config = compile_config
    config.max_cache_len = max_cache_len
    # generate calls model.get_compiled_call(config), which reuses the model's
    # compiled call made for an equal config: this one, in the thread split.
    model._compiled_call = _ThreadedStep(model, compile_config)
    model._last_compile_config = compile_config
    return model


def _windowed_layer_types(config) -> set[str]:
    """The attention layer types of the model's config that see a window of
    the past (sliding or chunked), as transformers' static cache reads them."""
    text = config.get_text_config(decoder=True)
    types = getattr(text, "layer_types", None)
    if types is None:  # every layer alike, as transformers infers it
        types = (["sliding_attention"] if getattr(text, "sliding_window", None) is not None
                 else ["chunked_attention"] if getattr(text, "attention_chunk_size", None) is not None else [])
    return {t for t in types if t in ("sliding_attention", "chunked_attention", "hybrid_sliding")}
