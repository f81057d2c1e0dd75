"""A quantized module's checkpoint bytes through what nn.Module does to every
buffer. Its integer buffers hold codes, indices and raw blocks: a cast
(module.type(dtype), or any _apply that casts every tensor) would destroy
them, and load_state_dict would cast a tensor of another dtype into them
without a word (int64 values past 255 wrapping into uint8 blocks)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _applied_as_stored(module: nn.Module, apply, floats: tuple[str, ...]):
    """apply() (the module's _apply) with its integer buffers, and the float
    ones `floats` names, keeping their dtype: only their device follows (fp16
    scales rounded to bf16 by model.to(dtype) would change every weight)."""
    stored = {name: t for name, t in module._buffers.items()
              if t is not None and (name in floats or not t.is_floating_point())}
    out = apply()
    for name, tensor in stored.items():
        now = module._buffers.get(name)
        if now is not None and now.dtype != tensor.dtype:
            module._buffers[name] = tensor.to(now.device)
    return out


def beyond(value: torch.Tensor, dtype: torch.dtype) -> int | None:
    """A value of the integer tensor `value` that the integer `dtype` cannot
    hold (its lowest if too low, else its highest), or None: a narrowing
    cast would wrap it into a valid-looking index."""
    if value.dtype == dtype or not value.numel() or value.device.type == "meta":
        return None
    info, low, high = torch.iinfo(dtype), int(value.min()), int(value.max())
    return low if low < info.min else high if high > info.max else None


def as_buffer(t: torch.Tensor) -> torch.Tensor:
    """`t` as a module holds it in a buffer: detached where it is an
    nn.Parameter (a Linear's bias, which would be registered as a
    parameter) or has a graph (a result of one, which deepcopy refuses),
    else itself (tied modules' tensors stay one); contiguous (the kernels
    read whole rows: a view is copied)."""
    return (t.detach() if isinstance(t, nn.Parameter) or t.requires_grad else t).contiguous()


def holds_integers(value) -> bool:
    """Whether `value` is a tensor of an integer dtype (not bool)."""
    return isinstance(value, torch.Tensor) and not (value.is_floating_point() or value.is_complex()
                                                    or value.dtype == torch.bool)


CODES = ("qweight", "qzeros")  # the buffers (names ending so) of packed codes and raw blocks


def _layout_matches(module: StoredBuffers, local_metadata: dict, prefix: str, error_msgs: list[str]) -> bool:
    """Whether each value of the module's layout() that the state's metadata
    records is the module's; an error for each that is not goes to
    `error_msgs` (the module is then left as it was)."""
    match = True
    for name, value in module.layout().items():
        if name in local_metadata and local_metadata[name] != value:
            error_msgs.append(f"{type(module).__name__}: the state of {prefix[:-1] or 'the module'} records "
                              f"{name}={local_metadata[name]!r}, where the module reads {name}={value!r}")
            match = False
    return match


def _dtypes_match(module: nn.Module, state_dict, prefix: str, error_msgs: list[str]) -> bool:
    """Whether each of `state_dict`'s tensors for the module's buffers of
    codes (CODES) has that buffer's dtype, and each for its other integer
    buffers (indices: g_idx) an integer dtype, with values that buffer can
    hold, as the checkpoint loaders take them; an error for each that does
    not goes to `error_msgs`, which load_state_dict raises together (the
    module is then left as it was)."""
    match = True
    for name, buffer in module._buffers.items():
        value = state_dict.get(prefix + name)
        if buffer is None or buffer.is_floating_point() or name in module._non_persistent_buffers_set \
                or not hasattr(value, "dtype") or value.dtype == buffer.dtype:
            continue
        if name.endswith(CODES):
            error_msgs.append(f"{type(module).__name__}: {prefix}{name} must be {buffer.dtype}, got {value.dtype} "
                              "(quantized codes are not cast)")
            match = False
        elif not holds_integers(value):
            error_msgs.append(f"{type(module).__name__}: {prefix}{name} must be an integer tensor, got {value.dtype}")
            match = False
        elif (v := beyond(value, buffer.dtype)) is not None:
            error_msgs.append(f"{type(module).__name__}: {prefix}{name} holds {v}, beyond {buffer.dtype}")
            match = False
    return match


def joinable(cls: type, layers, rule: str) -> list:
    """`layers` (any iterable: a generator is read once into the list, which
    joined() indexes and reads again) when they are one or more `cls` layers
    that can_join the first, else an error naming `layers` (`rule`: what
    can_join asks)."""
    if not isinstance(layers, Iterable):
        raise TypeError(f"{cls.__name__}.joined: layers must be an iterable of {cls.__name__}s, got "
                        f"{type(layers).__name__}")
    layers = list(layers)
    if not layers or not isinstance(layers[0], cls) or not all(layers[0].can_join(o) for o in layers[1:]):
        raise ValueError(f"{cls.__name__}.joined: layers must be one or more {cls.__name__}s that can_join the "
                         f"first ({rule})")
    return layers


class StoredBuffers(nn.Module):
    """A module holding checkpoint tensors as buffers: through _apply its
    integer buffers, and the float ones STORED_FLOATS names, keep their
    dtype; load_state_dict refuses tensors of another dtype for them
    (_dtypes_match) and a state recording another layout()
    (_layout_matches), and holds what assign=True gives it as contiguous
    buffers, its integer buffers in their own dtypes. Subclasses' own
    _apply, _save_to_state_dict and _load_from_state_dict (layout changes
    around the load) call these through super()."""

    STORED_FLOATS: tuple[str, ...] = ()

    def layout(self) -> dict:
        """How the buffers' bytes are read (a ggml type, a GPTQ zero format),
        as plain values: state_dict records them in its metadata, which
        torch.save keeps (weights_only too), and load_state_dict refuses a
        state that records others (a BF16 file's blocks, as many bytes a row
        as an F16 layer's)."""
        return {}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        metadata = getattr(destination, "_metadata", {}).get(prefix[:-1])
        if metadata is not None:
            metadata.update(self.layout())

    def _apply(self, fn, recurse=True):
        return _applied_as_stored(self, lambda: super(StoredBuffers, self)._apply(fn, recurse), self.STORED_FLOATS)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if not (_layout_matches(self, local_metadata, prefix, error_msgs)
                and _dtypes_match(self, state_dict, prefix, error_msgs)):
            return
        order, held = list(self._buffers), {name: t.dtype for name, t in self._buffers.items() if t is not None}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        # assign=True takes the state's tensors themselves, held here as
        # as_buffer holds them (a view of a fused layer's columns; an
        # nn.Parameter of state_dict(keep_vars=True), which takes the buffer's
        # place as a parameter), an index of another integer dtype in its
        # buffer's, as a copy is.
        for name, dtype in held.items():
            if prefix + name in state_dict:
                assigned = self._parameters.pop(name, None)
                tensor = self._buffers[name] if assigned is None else assigned
                self._buffers[name] = as_buffer(tensor.to(tensor.dtype if tensor.is_floating_point() else dtype))
        if list(self._buffers) != order:  # a buffer back from the parameters: in its place, for state_dict's order
            for name in order:
                self._buffers[name] = self._buffers.pop(name)
