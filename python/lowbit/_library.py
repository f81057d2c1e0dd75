"""Loads lowbit's compiled operator library (lowbit._C) into torch.ops.lowbit."""
import importlib.util

import torch


def load() -> None:
    spec = importlib.util.find_spec("lowbit._C")
    if spec is None or spec.origin is None:
        raise ImportError(
            "lowbit's compiled extension lowbit._C was not found; build it with "
            "`pip install --no-build-isolation -e .` in the lowbit checkout"
        )
    # The library registers its ops through TORCH_LIBRARY when loaded; it has
    # no Python module init of its own.
    torch.ops.load_library(spec.origin)
