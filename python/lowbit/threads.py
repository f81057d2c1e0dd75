"""Threads of a lowbit model on the CPU.

lowbit's kernels run on their own thread pool (lowbit.ops.cpu_threads), whose
callers never wait for a thread that has not started; torch's ops run on
torch's OpenMP threads, whose parallel regions end on a barrier every thread
must reach. Two pools on the same cores get in each other's way (each one's
threads poll for work while the other's run), and on a machine whose cores
are shared one of torch's threads that the OS has not scheduled yet stalls
each of its ops, a few hundred times per decoded token.

kernel_threads(model) makes each forward call on CPU inputs run torch's ops
on one thread and lowbit's kernels on the threads torch had: the matmuls,
where the time goes, keep every thread, and nothing waits on a barrier.
Under no_grad (generate) a forward call also runs below autograd
(lowbit._frozen.below_autograd), which spares each op its autograd kernel.
load_gguf_model, load_gptq_model and replace_linear set it;
kernel_threads(model, False) removes it.
"""
from __future__ import annotations

import torch
from torch import nn

from ._frozen import below_autograd, leave_autograd

__all__ = ["kernel_threads"]

_HANDLES = "_lowbit_kernel_threads"


def _on_cpu(args, kwargs) -> bool:
    """Whether the call's first tensor argument (input_ids, inputs_embeds, x) is on the CPU."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device.type == "cpu"
    return False


def split_threads(args=(), kwargs=None):
    """Before a call on CPU inputs: torch's ops on one thread, lowbit's kernels
    on the threads torch had. Returns what to restore_threads after the call
    (None where nothing changed: one thread, inputs elsewhere, or tracing
    under torch.compile, whose graph's kernels run on torch's threads)."""
    if torch.compiler.is_compiling():
        return None
    threads = torch.get_num_threads()
    if threads == 1 or not _on_cpu(args, kwargs or {}):
        return None
    saved = (threads, torch.ops.lowbit.cpu_threads())
    if saved[1] == 0:  # lowbit follows torch's count: hold it at torch's
        torch.ops.lowbit.cpu_threads(threads)
    torch.set_num_threads(1)
    return saved


def restore_threads(saved) -> None:
    if saved is not None:
        torch.set_num_threads(saved[0])
        torch.ops.lowbit.cpu_threads(saved[1])


class _KernelThreads:
    """The hooks' state: the settings each running forward call replaced, a
    stack (a model may call itself: an assistant model, a nested forward).
    A class, not closures, so that a model with the hooks still pickles."""

    def __init__(self):
        self.saved = []

    def __getstate__(self):
        return {"saved": []}

    def before(self, module, args, kwargs):
        if not torch.compiler.is_compiling():
            self.saved.append((split_threads(args, kwargs), below_autograd()))

    def after(self, module, args, kwargs, output):
        if not torch.compiler.is_compiling() and self.saved:
            threads, guard = self.saved.pop()
            leave_autograd(guard)
            restore_threads(threads)


def kernel_threads(model: nn.Module, enable: bool = True) -> nn.Module:
    """Runs each forward call of `model` on CPU inputs with torch's ops on one
    thread and lowbit's kernels on torch's thread count, restoring both after
    the call (also when it raises); enable=False removes that. Returns the model."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    if hasattr(model, _HANDLES):
        delattr(model, _HANDLES)
    if not enable:
        return model
    state = _KernelThreads()
    handles = (model.register_forward_pre_hook(state.before, with_kwargs=True),
               model.register_forward_hook(state.after, with_kwargs=True, always_call=True))
    setattr(model, _HANDLES, handles)
    return model
