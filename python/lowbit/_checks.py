"""Checks of values a quantizer is given."""
import torch


def check_finite(t: torch.Tensor, what: str) -> None:
    """Refuses a NaN or inf in `t` (a weight or Hessian to quantize), naming
    the first: a grid over it would store inf or NaN scales."""
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(f"{what} holds a non-finite value ({t[tuple(at)].item()}) at {at}")
