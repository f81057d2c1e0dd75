"""Checks of inputs: on/off flags, integer arguments (a layer's sizes), tensor values (a
weight or Hessian to quantize, a checkpoint's scales, norms and biases) and
the files a loader opens; the bounds of a model config's values; and how a
file's own names and values appear in the messages that refuse them."""
import numbers
import os
import reprlib
import stat

import numpy
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor


def is_integer(value) -> bool:
    """Whether `value` is an integer (numpy's too) and not a bool: a float or
    bool passes `in` and `<=` tests (4.0 == 4, True == 1), then fails deep in
    torch or an op with an error that names no argument."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


# Bounds of a model config's values, a GGUF file's and a checkpoint's
# config.json alike. Sizes, counts and token ids: llama.cpp reads them as
# 32-bit integers, and a larger one (a context length of 2^63) is a corrupt
# file, which transformers would carry into int64 arithmetic that overflows.
MAX_INT = 2**31 - 1
# The rotary base: released models' reach a few 10^9 (Llama 3's million-token
# fine-tunes), and past 10^12 it is a corrupt file's: under 10^30 most of a
# head's frequencies would turn by less than a radian over any context.
MAX_ROPE_BASE = 1e12
# The norms' epsilon: models use 10^-6 to 10^-5; at 1 and above it outweighs
# the mean square of unit activations, and the norm no longer normalizes.
MAX_NORM_EPS = 1.0
# Multipliers and caps of activations, attention scores and logits (Granite's
# multipliers, softcaps, a rotary attention factor) and rotary scaling
# factors: released models' lie within 10^-3 .. 10^2 (Granite's 1/128 to 16,
# Gemma 2's softcaps 30 and 50, Llama 3.1's rope factor 8, DeepSeek-V3's 40).
# Above MAX_SCALE or below 1 / MAX_SCALE a unit activation scaled by one
# leaves float16's normal numbers (6e-5 .. 65504); far above, a rope factor
# makes NaN rotation tables.
MAX_SCALE = 1e4


# A file's names and values (a tensor's, a module's or a key's name, a config
# value) in a message: a hostile file's name may be megabytes long, and a
# list of them millions long. Each string is cut to SHOWN_CHARS, each list
# to SHOWN_ITEMS, another library's message about the file to SHOWN_TEXT.
SHOWN_CHARS = 100
SHOWN_ITEMS = 5
SHOWN_TEXT = 1000
_SHOWN = reprlib.Repr()
_SHOWN.maxstring = _SHOWN.maxother = _SHOWN.maxlong = SHOWN_CHARS
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = _SHOWN.maxfrozenset = SHOWN_ITEMS


def shown(value) -> str:
    """repr(value) for a message, where the value is a file's: strings cut
    to about SHOWN_CHARS characters (with their length), containers to
    SHOWN_ITEMS items, without building the whole repr first."""
    text = _SHOWN.repr(value)
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        text += f" ({len(value)} characters)"
    return text


def shown_names(names, show=shown) -> str:
    """A file's names (or what `show` makes of each item) for a message, as
    a list's repr: the first SHOWN_ITEMS, and how many more there are."""
    names = list(names)
    listed = ", ".join(show(name) for name in names[:SHOWN_ITEMS])
    more = len(names) - SHOWN_ITEMS
    return f"[{listed}{f', and {more} more' if more > 0 else ''}]"


def cut(text: str, limit: int) -> str:
    """`text` whole up to `limit` characters, else its first `limit` and its
    length: text a file supplies (a name, a merge an error quotes) can be
    megabytes long, which a message or a table row would carry whole."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def shown_text(e) -> str:
    """Another library's message (an exception's) about a file, on one line
    and cut to SHOWN_TEXT characters (with its length): transformers' config
    validators and safetensors' header parser quote the file's values whole."""
    return cut(" ".join(str(e).split()), SHOWN_TEXT)


def check_flag(who: str, name: str, value) -> bool:
    """`value` as a bool, or ValueError naming `name`: an on/off argument
    read by truthiness would do the opposite of a string's ("False", "off"),
    and None or 0 where they mean nothing would pass as False unnoticed.
    numpy's bools (a mask's element) pass as the bools they are."""
    if not isinstance(value, (bool, numpy.bool_)):
        raise ValueError(f"{who}: {name} must be True or False, got {value!r}")
    return bool(value)


def check_sizes(who: str, **sizes) -> None:
    """ValueError naming the first of `sizes` that is not a positive integer:
    a 0 passes every block- and pack-size check and would surface later as a
    reshape or kernel error that names neither the module nor the argument."""
    for name, size in sizes.items():
        if not is_integer(size) or size < 1:
            raise ValueError(f"{who}: {name} must be a positive integer, got {size!r}")


def check_float_dtype(who: str, dtype, name: str = "dtype") -> None:
    """ValueError naming `name` for a `dtype` that is not a torch float dtype:
    an integer dtype or a string ("float16") fails later in a cast or an op
    with an error that names neither the module nor the argument."""
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"{who}: {name} must be a float dtype, got {dtype!r}")


def check_module(who: str, model, name: str = "model") -> None:
    """TypeError naming `name` for a `model` that is not an nn.Module: any
    other object fails on its first module attribute with an AttributeError
    that names neither the function nor the argument."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{who}: {name} must be an nn.Module, got {type(model).__name__}")


def check_linear(who: str, linear, name: str = "linear") -> None:
    """TypeError naming `name` for a `linear` that is not an nn.Linear: the
    quantizers read its [out, in] weight, bias and in_features, which any
    other object lacks (a bare AttributeError) or holds in another layout
    (a convolution's weight)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{who}: {name} must be an nn.Linear, got {type(linear).__name__}")


def check_path(who: str, path, name: str = "path", kind: str = "file or directory") -> str:
    """`path` (a str, bytes or os.PathLike) as a str, or an error naming
    `name`: TypeError for anything else (os.fsdecode's names no argument),
    ValueError for an empty one (the working directory to os.path), which
    says that `name` must be a `kind` path."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"{who}: {name} must be a str or os.PathLike, got {type(path).__name__}")
    path = os.fsdecode(path)
    if not path:
        raise ValueError(f"{who}: {name} must be a {kind} path, got an empty one")
    return path


def has_values(t: torch.Tensor) -> bool:
    """Whether `t`'s values can be read on the host: not while torch.compile
    traces, and not a meta tensor, a fake one (FakeTensorMode: shapes only) or
    one a torch.func transform wraps (vmap's batched tensors)."""
    return not (torch.compiler.is_compiling() or t.is_meta or isinstance(t, FakeTensor)
                or torch._C._functorch.is_functorch_wrapped_tensor(t))


def check_values(who: str, t: torch.Tensor, name: str) -> None:
    """ValueError naming `name` for a tensor without readable values (meta,
    fake, traced): a quantizer reads them (the finite check, each group's
    range), which would fail on .item() naming no argument."""
    if not has_values(t):
        raise ValueError(f"{who}: {name} must hold values: a {'meta' if t.is_meta else 'fake or traced'} tensor "
                         "has none")


def check_finite(t: torch.Tensor, what: str, error: type[ValueError] = ValueError) -> None:
    """Refuses a NaN or inf in `t` as `error` (a loader's file error), naming
    the first: a quantizer's grid over it would store inf or NaN scales, a
    loaded one would turn every output it touches NaN."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise error(f"{what} holds a non-finite value ({t[tuple(at)].item()}) at {at}")


def check_positive(t: torch.Tensor, what: str, error: type[ValueError] = ValueError) -> None:
    """Refuses a value of `t` that is not finite and > 0, naming the first: a
    file's rotary-frequency divisors, which would otherwise make NaN or inf
    rotation tables without a NaN in the logits to show it."""
    check_finite(t, what, error)
    bad = t <= 0
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise error(f"{what} holds {t[tuple(at)].item()} at {at}, where every value must be > 0")


def check_regular_file(path: str, what: str = "file", error: type[ValueError] = ValueError) -> None:
    """Refuses anything but a regular file (after symlinks) before it is opened,
    as `error` naming it: reading a named pipe blocks forever, and a device
    such as /dev/zero never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise error(f"{path}: cannot read the {what}: {e}") from e
    if not stat.S_ISREG(mode):
        raise error(f"{path}: the {what} is not a regular file")
