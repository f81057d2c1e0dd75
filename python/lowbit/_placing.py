"""What placing a GGUF file (lowbit.gguf.model) and a GPTQ checkpoint
(lowbit.gptq.placing) into a model have in common: the report, looking up
and filling a model's modules and tensors, and building a model on the meta
device, so that no float copy of a quantized weight is made."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from ._checks import shown_text


@dataclass
class ReplaceReport:
    """What replace_linear (and the loaders) did with a checkpoint's tensors, by name."""

    replaced: list[str] = field(default_factory=list)  # modules now lowbit layers
    loaded: list[str] = field(default_factory=list)  # parameters loaded as plain tensors
    unplaced: list[str] = field(default_factory=list)  # checkpoint tensors with no place in the model


class _SavePretrainedRefused:
    """A transformers model's save_pretrained (and so push_to_hub) once
    lowbit's layers hold its weights: transformers would write their tensors
    under the float model's config, a directory that nothing loads. A class,
    not a closure, so that the model still pickles (torch.save)."""

    def __init__(self, advice: str):
        self.advice = advice

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"save_pretrained: {self.advice}")


GPTQ_SAVE_ADVICE = ("this model's GPTQ layers would be written under a float model's config, which nothing loads; "
                    "lowbit.save_gptq(model, directory, config) writes the HF GPTQ directory that lowbit, vLLM and "
                    "GPTQModel load")
GGUF_SAVE_ADVICE = ("this model's GGUF layers would be written under a float model's config, which nothing loads; "
                    "lowbit writes no GGUF files: the GGUF file it was loaded from is its checkpoint")


def refuse_save_pretrained(model: nn.Module, advice: str) -> None:
    """Makes `model.save_pretrained` (a transformers model's) raise `advice`."""
    if callable(getattr(model, "save_pretrained", None)):
        model.save_pretrained = _SavePretrainedRefused(advice)


def get_module(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else None
    except AttributeError:
        return None


def tensor_holders(model: nn.Module) -> dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]]:
    """Where the model holds each of its parameters and buffers, by id: the
    tensor and its (module, name) places (a tied one has several), for
    load_tensor calls in a row. Entries of modules replaced since stay,
    holding what they held."""
    holders: dict[int, tuple[torch.Tensor, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        for name, t in [*module._parameters.items(), *module._buffers.items()]:
            if t is not None:
                holders.setdefault(id(t), (t, []))[1].append((module, name))
    return holders


def load_tensor(model: nn.Module, target: torch.Tensor, value: torch.Tensor, holders: dict | None = None) -> None:
    """Copies `value` into the model's tensor `target`, or, where that tensor
    is on the meta device (a model built without memory), puts a CPU tensor
    of the target's dtype and kind (parameter or buffer) in its place wherever
    the model holds it, so tied parameters (an LM head tied to the embedding)
    stay tied, as they do under copy_. `holders`: tensor_holders(model) from
    before, to find those places without a walk over the model per call."""
    if not target.is_meta:
        with torch.no_grad():
            target.copy_(value)
        return
    new = value.to(target.dtype)
    if isinstance(target, nn.Parameter):
        new = nn.Parameter(new, requires_grad=target.requires_grad)
    entry = None if holders is None else holders.get(id(target))
    if entry is None or entry[0] is not target:
        entry = tensor_holders(model).get(id(target), (target, []))
    for module, name in entry[1]:
        setattr(module, name, new)


MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def model_dtype(dtype, who: str) -> torch.dtype:
    """A loader's `dtype` argument as a torch dtype: one of MODEL_DTYPES, or
    its name as transformers' configs write it ("bfloat16")."""
    named = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if named not in MODEL_DTYPES:
        raise ValueError(f"{who}: dtype must be torch.float32, torch.float16 or torch.bfloat16 (or its name), got "
                         f"{dtype!r}; a float64 model is the loaded one's .double()")
    return named


def on_meta(make_config, build, dtype: torch.dtype, where: str, error: type[Exception]) -> nn.Module:
    """build(config) with every tensor on the meta device (no memory, no
    init), config = make_config(). The config's values come from an untrusted
    file: where its class refuses them (transformers' validators raise their
    own error types) or the model cannot be built from them (sizes whose
    byte counts overflow), that is `error`, naming `where`."""
    try:
        config = make_config()
        config.dtype = dtype
        with torch.device("meta"):
            return build(config).to(dtype)
    except error:
        raise
    except Exception as e:
        raise error(f"{where}: the config does not make a model: {type(e).__name__}: {shown_text(e)}") from e


# The most bytes a model's computed buffers (rotary frequencies, causal masks)
# may take: real architectures' come to megabytes (StarCoder's 8192-position
# mask: 64 MiB); a config asking for more is refused before they are built.
COMPUTED_BUFFER_LIMIT = 1 << 30


def rebuild_computed_buffers(model: nn.Module, where: str, error: type[Exception]) -> None:
    """Fills the buffers that modules compute from their config (rotary
    inverse frequencies, causal masks), which no checkpoint stores and the
    meta build left empty: each module owning such a buffer is built again
    from its config with its parameters on the meta device, and takes the
    place of one without parameters (a rotary embedding); one holding loaded
    weights takes only those buffers from it. A module that cannot
    be built from its config alone keeps them empty, for `checked` to report.
    More than COMPUTED_BUFFER_LIMIT bytes of them is `error`, naming `where`."""
    owners = [(name, m) for name, m in model.named_modules()
              if name and hasattr(m, "config") and any(b.is_meta for b in m.buffers(recurse=False))]
    empty = {id(b): b for _, m in owners for b in m.buffers() if b.is_meta}  # an owner's owners see them too
    nbytes = sum(b.numel() * b.element_size() for b in empty.values())
    if nbytes > COMPUTED_BUFFER_LIMIT:
        raise error(f"{where}: the config makes {nbytes / 2**20:.0f} MiB of computed buffers (rotary tables, "
                    f"masks), more than the {COMPUTED_BUFFER_LIMIT >> 20} MiB lowbit builds")
    for name, module in owners:
        try:
            with _parameters_on_meta():
                fresh = type(module)(config=module.config)
        except Exception:  # needs more than its config (a layer index, ...): left for checked()
            continue
        if next(module.parameters(), None) is None:  # nothing loaded (a rotary embedding): the new one whole
            model.set_submodule(name, fresh)
            continue
        computed = dict(fresh.named_buffers())
        for buffer_name, buffer in list(module.named_buffers()):
            new = computed.get(buffer_name)
            if buffer.is_meta and new is not None and not new.is_meta and new.shape == buffer.shape:
                owner, _, leaf = buffer_name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = new


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built inside put their parameters on the meta device (no
    memory, no initialisation) and their buffers on the CPU."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_tensors(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_no_meta(model: nn.Module, where: str, error: type[Exception]) -> None:
    """`error` naming `where` and the model's tensors left on the meta device, if any."""
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise error(f"{where}: no value for {still_meta[:8]}{' ...' if len(still_meta) > 8 else ''} (this "
                    f"{type(model).__name__} has tensors that neither the checkpoint nor lowbit fills)")


def checked(model: nn.Module, where: str, error: type[Exception]) -> nn.Module:
    """The model in eval mode, once no tensor of it is left on the meta
    device (check_no_meta)."""
    check_no_meta(model, where, error)
    return model.eval()
