"""Checks of tensor values: a weight or Hessian to quantize, a checkpoint's
scales, norms and biases."""
import torch


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
