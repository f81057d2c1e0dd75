"""Running code that an untrusted file supplies (a chat template is a
program: its loops and string products are the file's to size) where it
cannot hang or exhaust the caller: in a forked child, under a time limit
and an address-space limit, its result sent back pickled."""
import os
import pickle
import select
import signal
import time
import warnings


class BoundedError(Exception):
    """The bounded call raised (the message names the exception's type) or ran out of time."""


def run_bounded(fn, seconds: float, extra_bytes: int):
    """fn()'s (picklable) result, computed in a forked child that is killed
    after `seconds` and may map at most `extra_bytes` beyond this process's
    address space. Whatever fn raises comes back as a BoundedError
    "Type: message"; where the platform has no fork, fn runs here."""
    if not hasattr(os, "fork"):
        try:
            return fn()
        except Exception as e:
            raise BoundedError(f"{type(e).__name__}: {e}") from None
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():  # the child runs Python only: no lock another thread held is taken
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _child(fn, write_end, extra_bytes)
    os.close(write_end)
    data = None
    try:
        data = _read_until(read_end, time.monotonic() + seconds)
    finally:  # at the deadline, or interrupted (Ctrl-C): the child goes too
        os.close(read_end)
        if data is None:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if data is None:
        raise BoundedError(f"did not finish in {seconds:g} s")
    if not data:  # killed before it could answer (out of memory outside Python's reach)
        raise BoundedError("the process computing it died")
    ok, value = pickle.loads(data)
    if not ok:
        raise BoundedError(value)
    return value


def _child(fn, write_end: int, extra_bytes: int) -> None:
    """Runs fn under the address-space limit, writes (ok, result or message)
    and exits without the parent's atexit handlers or buffered output."""
    import resource  # Unix's, as fork is

    try:
        try:
            with open("/proc/self/statm") as f:
                mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            resource.setrlimit(resource.RLIMIT_AS, (mapped + extra_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
        except (OSError, ValueError):  # no /proc, or a hard limit below: the time limit still holds
            pass
        try:
            answer = (True, fn())
        except Exception as e:
            answer = (False, f"{type(e).__name__}: {e}")
        data = pickle.dumps(answer)
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    finally:
        os._exit(0)


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to fd until it closes, or None at the deadline."""
    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
