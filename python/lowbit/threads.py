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
where the time goes, keep every thread, and nothing waits on a barrier. A
call over TORCH_TEAM_TOKENS tokens or more (a long prompt) runs lowbit's
kernels on torch's own threads instead (lowbit.ops.cpu_team("torch")): its
attention, which grows with the square of the prompt's length, and its
other torch ops want every thread too, and one team then runs everything,
where two would take turns on the same cores. Its parallel regions are
long, so a thread the OS has not scheduled stalls a smaller share of their
time than it would of a decode step's hundreds of short ones, though still
more than on the pool (benchmarks/bench_long_prompt.py measures both):
kernel_threads(model, torch_team_tokens=None) keeps every call on the pool.
A generate call holds the split from start to end, so that its own ops
between forward calls (logits processors, the next inputs) do not wake a
team of torch's threads beside lowbit's pool either. Under no_grad
(generate) a forward call also runs below autograd
(lowbit._frozen.below_autograd), which spares each op its autograd kernel.
load_gguf_model, load_gptq_model and replace_linear set it;
kernel_threads(model, False) removes it.
"""
from __future__ import annotations

import inspect
import os
import threading

import torch
from torch import nn

from ._checks import check_flag, check_module, is_integer
from ._frozen import below_autograd, leave_autograd

__all__ = ["kernel_threads"]

_STATE = "_lowbit_kernel_threads"  # the model's _KernelThreads

# Calls over at least this many tokens (batch x sequence) run lowbit's kernels
# on torch's team: from about here a prompt's attention is a large share of
# its time (benchmarks/bench_long_prompt.py).
TORCH_TEAM_TOKENS = 1024
# The most threads lowbit.ops.cpu_threads takes (parallel.h's kMaxPoolThreads).
MAX_POOL_THREADS = 1024
# The most lowbit.ops.cpu_torch_threads sets (cpu_settings.cpp's kMaxTorchThreads):
# a split could not restore a larger count that torch.set_num_threads took.
MAX_TORCH_THREADS = 8192


def _first_tensor(args, kwargs) -> torch.Tensor | None:
    """The call's first tensor argument (input_ids, inputs_embeds, x)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


# torch's count is set for the calling thread alone (lowbit.ops.cpu_torch_threads):
# torch.set_num_threads also sets the count each thread takes at its first
# torch call, which a thread starting during a split would keep for good.
# lowbit's pool settings (cpu_threads, cpu_team) are the process's: the first
# split call running on any thread saves them and the last one out restores
# them, so calls on several threads never restore one another's changes.
# Each call restores its thread's torch count itself.
_SETTINGS_LOCK = threading.Lock()
_SPLIT_CALLS = [0, None]  # split calls running, the settings before the first of them


class _OwnSplits(threading.local):
    calls = 0  # of _SPLIT_CALLS[0], those running on this thread


_OWN_SPLITS = _OwnSplits()


def _forked_child() -> None:
    """A forked child has only the forking thread: the split calls other
    threads ran at the fork never end there, so they leave the count, and
    with none of the child's own left the settings they changed go back (a
    DataLoader worker setting torch to one thread would keep lowbit's pool
    at the parent's count otherwise). The lock may have been held by one of
    those threads, and would never be released."""
    global _SETTINGS_LOCK
    _SETTINGS_LOCK = threading.Lock()
    own = _OWN_SPLITS.calls
    if _SPLIT_CALLS[0] > own == 0:
        torch.ops.lowbit.cpu_threads(_SPLIT_CALLS[1][0])
        torch.ops.lowbit.cpu_team(_SPLIT_CALLS[1][1])
    _SPLIT_CALLS[0] = own


os.register_at_fork(after_in_child=_forked_child)


def split_threads(args=(), kwargs=None, torch_team_tokens: int | None = TORCH_TEAM_TOKENS,
                  threads: int | None = None):
    """Before a call on CPU inputs: torch's ops on one thread and lowbit's
    kernels on `threads` (default: the threads torch has now), or, for
    torch_team_tokens tokens or more (the first tensor's dimensions 0 and 1,
    batch and tokens, as input_ids and inputs_embeds have them; None: never),
    torch's ops on `threads` and lowbit's kernels on torch's team.
    Returns what to restore_threads after the call (None where nothing
    changes: one thread, more than MAX_TORCH_THREADS, inputs elsewhere, or
    tracing under torch.compile, whose graph's kernels run on torch's threads)."""
    if torch.compiler.is_compiling():
        return None
    current, first = torch.get_num_threads(), _first_tensor(args, kwargs or {})
    threads = current if threads is None else threads
    if threads == 1 or max(current, threads) > MAX_TORCH_THREADS or first is None or first.device.type != "cpu":
        return None
    # Ctrl-C's KeyboardInterrupt is raised as a call returns, one here too,
    # and the caller then has nothing to restore: this call's changes are
    # undone here once counted (no call runs between the counts and
    # `counted`, so no interrupt lands there).
    counted = False
    try:
        with _SETTINGS_LOCK:
            if _SPLIT_CALLS[0] == 0:
                _SPLIT_CALLS[1] = (torch.ops.lowbit.cpu_threads(), torch.ops.lowbit.cpu_team())
            _SPLIT_CALLS[0] += 1
            _OWN_SPLITS.calls += 1
            counted = True
            pool_threads = _SPLIT_CALLS[1][0]
        if torch_team_tokens is not None and first.dim() >= 2 and first.shape[0] * first.shape[1] >= torch_team_tokens:
            torch.ops.lowbit.cpu_team("torch")
            if current != threads:
                torch.ops.lowbit.cpu_torch_threads(threads)
            return current
        torch.ops.lowbit.cpu_team("pool")
        if pool_threads == 0:  # lowbit follows torch's count: hold it at `threads`, within cpu_threads' range
            torch.ops.lowbit.cpu_threads(min(threads, MAX_POOL_THREADS))
        if current != 1:
            torch.ops.lowbit.cpu_torch_threads(1)
        return current
    except BaseException:
        if counted:
            restore_threads(current)
        raise


def restore_threads(saved) -> None:
    if saved is not None:
        try:
            torch.ops.lowbit.cpu_torch_threads(saved)
        finally:  # an interrupt raised as one setting returns leaves the others to restore still
            with _SETTINGS_LOCK:
                _SPLIT_CALLS[0] -= 1
                _OWN_SPLITS.calls -= 1
                if _SPLIT_CALLS[0] == 0:
                    try:
                        torch.ops.lowbit.cpu_threads(_SPLIT_CALLS[1][0])
                    finally:
                        torch.ops.lowbit.cpu_team(_SPLIT_CALLS[1][1])


class _KernelThreads:
    """A model's split (the model's attribute _STATE): per thread, the thread
    count of each running generate call. A class, not closures, so that the
    model still pickles."""

    def __init__(self, torch_team_tokens: int | None = TORCH_TEAM_TOKENS):
        self.torch_team_tokens = torch_team_tokens
        self._threads = threading.local()

    def __getstate__(self):
        return {"torch_team_tokens": self.torch_team_tokens}

    def __setstate__(self, state):
        self.__init__(state["torch_team_tokens"])

    @property
    def generating(self) -> list:
        return self._threads.__dict__.setdefault("generating", [])

    def run(self, args, kwargs, call):
        """call() within the split for a forward call on `args` and `kwargs`,
        everything restored however it ends: an interrupt (KeyboardInterrupt,
        SystemExit) too, which torch's always-called forward hooks miss."""
        if torch.compiler.is_compiling():
            return call()
        threads = split_threads(args, kwargs, self.torch_team_tokens, self.generating[-1] if self.generating else None)
        try:
            guard = below_autograd()
            try:
                return call()
            finally:
                leave_autograd(guard)
        finally:
            restore_threads(threads)


def split_call(model: nn.Module, args, kwargs, call):
    """call() (the model's forward on `args`, `kwargs`) within the model's
    split where kernel_threads set one, as it is otherwise."""
    state = model.__dict__.get(_STATE)
    return call() if state is None else state.run(args, kwargs, call)


class _ModelAttribute:
    """A model's own attribute that calls back into the model (its forward,
    its generate). A class, not a closure, so that the model still pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __getstate__(self):
        return {"model": self.model}

    def __setstate__(self, state):
        self.__init__(state["model"])

    def generated(self) -> None:
        """A generate call on the model has ended: what it kept for the next
        call's steps goes (it would hold the model's tensors past a model.to())."""


class ThreadedForward(_ModelAttribute):
    """model.forward where no decode step serves the model (lowbit.decoding):
    its own forward within the split."""

    @property
    def __signature__(self):
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        model = self.model
        return split_call(model, args, kwargs, lambda: type(model).forward(model, *args, **kwargs))


class _ThreadedGenerate(_ModelAttribute):
    """model.generate with kernel_threads' split (where the model has one)
    held for the whole call: the ops generate runs between forward calls (its
    logits processing, the next inputs) on torch's one thread too, not on a
    team of torch's threads that would wait for cores lowbit's pool has just
    left spinning. Its forward calls split as any other (a long prompt takes
    torch's team). As the call ends, the model's forward drops what it kept
    for the call's steps (lowbit.decoding's C++ step)."""

    @property
    def __signature__(self):
        return inspect.signature(type(self.model).generate.__get__(self.model))

    def __call__(self, *args, **kwargs):
        model = self.model
        state = model.__dict__.get(_STATE)
        saved = None if state is None else split_threads(args, kwargs, None)
        generating = None  # the thread's generate calls, once this one is among them
        try:  # an interrupt raised as state.generating returns still restores the split
            if saved is not None:
                generating = state.generating
                generating.append(saved)
            return type(model).generate(model, *args, **kwargs)
        finally:
            if generating is not None:
                generating.pop()
            restore_threads(saved)
            forward = model.__dict__.get("forward")
            if isinstance(forward, _ModelAttribute):
                forward.generated()


def wrap_generate(model: nn.Module) -> None:
    """model.generate as _ThreadedGenerate while kernel_threads' split or
    lowbit's own forward (ThreadedForward, lowbit.decoding's) is on the model,
    the class's own otherwise."""
    wanted = callable(getattr(type(model), "generate", None)) and (
        _STATE in model.__dict__ or isinstance(model.__dict__.get("forward"), _ModelAttribute))
    wrapped = isinstance(model.__dict__.get("generate"), _ThreadedGenerate)
    if wanted and not wrapped:
        model.generate = _ThreadedGenerate(model)
    elif wrapped and not wanted:
        del model.generate


def kernel_threads(model: nn.Module, enable: bool = True,
                   torch_team_tokens: int | None = TORCH_TEAM_TOKENS) -> nn.Module:
    """Runs each forward call of `model` on CPU inputs with torch's ops on one
    thread and lowbit's kernels on torch's thread count, and each over
    `torch_team_tokens` tokens or more (None: none) with lowbit's kernels on
    torch's threads (see the module's notes), and each generate call (if the
    model has one) with that split held throughout, restoring the settings
    however the call ends (an exception, an interrupt); enable=False removes
    that. The split wraps the model's forward (model.forward): a forward set
    on the model later, or one it had already, runs without it. Returns the
    model."""
    check_module("kernel_threads", model)
    enable = check_flag("kernel_threads", "enable", enable)
    if torch_team_tokens is not None and (not is_integer(torch_team_tokens) or torch_team_tokens < 1):
        raise ValueError(f"kernel_threads: torch_team_tokens must be a positive int or None, got {torch_team_tokens!r}")
    model.__dict__.pop(_STATE, None)
    if isinstance(model.__dict__.get("forward"), ThreadedForward):
        del model.forward
    if enable:
        model.__dict__[_STATE] = _KernelThreads(torch_team_tokens)
        if "forward" not in model.__dict__:  # a decode step's forward (lowbit.decoding) splits its calls itself
            model.forward = ThreadedForward(model)
    wrap_generate(model)
    return model
