"""Calling lowbit's matmul ops from a layer whose weights are frozen.

The ops' gradients are registered from Python (lowbit._autograd), so every
call passes through a Python autograd kernel, even under no_grad: about as
much host time as a small matvec itself (15 us a call on a slow core, and a
decode step makes hundreds of calls). Where no argument needs a gradient
that kernel would only pass the call on, so call_frozen skips it, and
below_autograd lets a whole forward call (a lowbit model's, under no_grad:
generate) skip it for every op, torch's included.
"""
import torch
import torch.autograd.forward_ad as fwAD

_BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


def call_frozen(op, *args):
    """op(*args), below autograd where grad mode is off or no argument
    requires grad (the result then has no grad_fn either way), and none
    carries a forward-mode tangent; through autograd otherwise (the op's
    autograd kernel carries tangents: lowbit._autograd), and while
    torch.compile traces (it sees the op)."""
    if (torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args))
            or has_tangent(args)):
        return op(*args)
    with _BELOW_AUTOGRAD():
        return op(*args)


def has_tangent(args) -> bool:
    """Whether a tensor of `args` carries a forward-mode tangent. Outside a
    forward-AD level (fwAD.dual_level, torch.func.jvp) none does: no look at
    each argument (a direct op call's autograd kernel asks this every call)."""
    return fwAD._current_level >= 0 and any(
        isinstance(a, torch.Tensor) and fwAD.unpack_dual(a).tangent is not None for a in args)


def op_input(x: torch.Tensor) -> torch.Tensor:
    """x as the matmul ops take it: float64 (a model.double()) as float32,
    as the ops accumulate; call_layer_op casts the result back."""
    return x.float() if x.dtype == torch.float64 else x


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype torch.autocast casts to on `device_type` where a region is
    active there (csrc/ops/autocast.cpp casts the matmul ops' activations to
    it), None otherwise."""
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def call_layer_op(op_call, x: torch.Tensor) -> torch.Tensor:
    """op(*args) for (op, args) = op_call(op_input(x)), a layer's op on its
    input x: in the op's dtype, x's or autocast's inside an autocast region,
    as nn.Linear's; for a float64 x, which autocast leaves alone, fp32 sums
    outside autocast, back in float64. A forward-mode tangent of x
    (forward_ad, torch.func.jvp, jacfwd) goes through the op's autograd
    kernel, which carries it."""
    if not torch.compiler.is_compiling():  # dynamo does not trace the functorch calls there
        _check_transform(op_call, x)
    return _call_in_dtype(*op_call(op_input(x)), x)


def _call_in_dtype(op, args, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float64:
        return call_frozen(op, *args)
    if autocast_dtype(x.device.type) is None:
        return call_frozen(op, *args).to(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return call_frozen(op, *args).to(x.dtype)


def _check_transform(op_call, x: torch.Tensor) -> None:
    """Refuses, naming the op, an x that a torch.func transform wraps and
    that needs a gradient (grad, vjp, jacrev; vmap of an input that requires
    grad): torch.library's registered gradients run in torch.autograd only,
    and under vmap the op's output would silently leave the graph."""
    if not torch.is_grad_enabled() or not torch._C._functorch.is_functorch_wrapped_tensor(x):
        return
    t = x
    while torch._C._functorch.is_functorch_wrapped_tensor(t) and not t.requires_grad:
        t = torch._C._functorch.get_unwrapped(t)
    if t.requires_grad:
        op, _ = op_call(op_input(x))
        raise RuntimeError(f"{op.__name__}: torch.func's grad, vjp and jacrev (and vmap of an input that requires "
                           "grad) are not supported: its gradient runs in torch.autograd (backward(), "
                           "torch.autograd.grad); torch.func.jvp, jacfwd, forward_ad and vmap without gradients run "
                           "through the layer")


def linear_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """A quantized linear layer's forward: x [..., in_features] through
    layer.op_call's op (rows flattened; op_input), plus the bias."""
    if not isinstance(x, torch.Tensor):  # a list's AttributeError on .dim() would name neither layer nor input
        raise TypeError(f"{type(layer).__name__}: input must be a tensor, got {type(x).__name__}")
    if x.dim() == 0 or x.shape[-1] != layer.in_features:
        raise ValueError(f"{type(layer).__name__}: input must be [..., in_features={layer.in_features}], "
                         f"got {list(x.shape)}")
    parametrized = layer._modules.get("parametrizations")  # torch.nn.utils.parametrize's, by tensor name
    if parametrized is not None and set(parametrized) - {"bias"}:
        raise TypeError(f"{type(layer).__name__}: a parametrization of {sorted(set(parametrized) - {'bias'})} is not "
                        "supported: the kernels read the quantized tensors as stored")
    y = call_layer_op(layer.op_call, x.reshape(-1, layer.in_features))
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], layer.out_features)


def below_autograd():
    """Where grad mode is off and torch.compile is not tracing: a guard,
    entered, that dispatches every op below autograd until leave_autograd;
    None elsewhere. Nothing computed under no_grad gets a grad_fn either
    way; view and version tracking stay on."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return None
    guard = _BELOW_AUTOGRAD()
    guard.__enter__()
    return guard


def leave_autograd(guard) -> None:
    if guard is not None:
        guard.__exit__(None, None, None)
