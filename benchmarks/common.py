"""Shared benchmark plumbing: timing, the machine's measured memory bandwidth,
a description of the machine, and result files under benchmarks/results/."""
import contextlib
import io
import json
import os
import platform
import statistics
import sys
import time

# Large CPU tensors on transparent huge pages (torch's own switch, read at
# the first large allocation): otherwise every fresh 64 MB output pays ~20 ms
# of 4 KB page faults, which NumPy (gguf-py) avoids by default. Set before any
# benchmark allocates, so every side of a comparison gets it.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from benchmarks.machine import RESULTS, device_name, machine_slug, results_dir  # noqa: F401  (re-exported)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device=torch.device("cpu"), min_reps=5, budget_s=1.0):
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    sync(device)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= 200:
            break
    return statistics.median(times)


def time_rounds_ms(fns, device=torch.device("cpu"), rounds=3, min_reps=5, budget_s=0.2):
    """The time of each function in fns (None gives nan) on a shared machine:
    `rounds` rounds in which every function takes its turn (time_ms, the
    median of its calls), and per function its fastest round. Taking turns
    puts a burst of load from elsewhere on every side of a comparison alike,
    instead of on one side's whole measurement; the fastest round is the
    machine at its quietest, for each side."""
    best = [float("inf") if fn else float("nan") for fn in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            if fn:
                best[i] = min(best[i], time_ms(fn, device, min_reps=min_reps, budget_s=budget_s))
    return best


def copy_bandwidth_gbs(device=torch.device("cpu"), nbytes=1 << 29):
    """Read+write bandwidth of a large tensor copy, in GB/s (1e9 bytes), from
    its fastest of three rounds (time_rounds_ms), as the kernels are timed."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    (ms,) = time_rounds_ms([lambda: dst.copy_(src)], device, budget_s=0.7)
    return 2 * nbytes / (ms * 1e-3) / 1e9


class CopyBandwidth:
    """The machine's copy bandwidth sampled across a run (sample() at each
    shape and at the end) and the fastest sample taken: on a shared VM it
    swings by half, and one moment of it is no yardstick. With `threads`
    (CPU), every sample is taken at each of those thread counts: one core
    cannot draw what two can, and a kernel on one thread is measured against
    what one thread's copy reaches as well as against the machine's (gbs, the
    most threads)."""

    def __init__(self, device=torch.device("cpu"), threads=None):
        self.device = device
        self.threads = sorted(threads) if threads and device.type == "cpu" else None
        self.by_threads = {}

    def sample(self):
        current = torch.get_num_threads()
        for t in self.threads or [current]:
            torch.set_num_threads(t)
            self.by_threads.setdefault(t, []).append(copy_bandwidth_gbs(self.device))
        torch.set_num_threads(current)

    @property
    def samples(self):
        return self.by_threads[max(self.by_threads)]

    @property
    def gbs(self):
        return max(self.samples)

    def gbs_at(self, threads):
        """The fastest copy measured on `threads` threads (the machine's where not sampled)."""
        return max(self.by_threads.get(threads, self.samples))

    def describe(self):
        most = max(self.by_threads)
        text = (f"measured copy bandwidth: {self.gbs:.1f} GB/s (read + write, {most} threads), the fastest of "
                f"{len(self.samples)} measurements across the run: {', '.join(f'{g:.1f}' for g in self.samples)}")
        for t in sorted(self.by_threads):
            if t != most:
                text += (f"\n  on {t} thread{'s' if t > 1 else ''}: {self.gbs_at(t):.1f} GB/s "
                         f"(of {', '.join(f'{g:.1f}' for g in self.by_threads[t])})")
        return text

    def as_record(self):
        return dict(copy_bandwidth_gbs=self.gbs, copy_bandwidth_samples_gbs=self.samples,
                    copy_bandwidth_by_threads_gbs={str(t): max(v) for t, v in self.by_threads.items()})


def machine(device=torch.device("cpu")):
    """A description of the machine and a short name for result files."""
    return {
        "name": device_name(device),
        "slug": machine_slug(device),
        "device": device.type,
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


ISAS = ("portable", "avx2", "avx512")


def add_isa_argument(parser):
    """--isa: lowbit's CPU kernels of one ISA (torch.ops.lowbit.cpu_isa)."""
    parser.add_argument("--isa", choices=ISAS, help="lowbit's CPU kernels to run; default: the best this CPU runs")


def force_isa(parser, isa):
    """Runs lowbit's CPU kernels of `isa` (none: the best), or ends with the
    parser's usage error where this CPU cannot run them."""
    if isa:
        try:
            torch.ops.lowbit.cpu_isa(isa)
        except ValueError as e:
            parser.error(f"--isa {isa}: {e}")


def openmp_header() -> str:
    """The OpenMP wait policy, and the team lowbit's kernels run on under it
    (said in the result's header): with OMP_WAIT_POLICY=ACTIVE the OpenMP
    threads torch and ggml share spin between calls and hold the cores, so
    lowbit's kernels join that team (cpu_team("torch")) instead of running
    their own pool beside it, which would get the cores those threads leave."""
    policy = os.environ.get("OMP_WAIT_POLICY", "(unset)")
    if policy.upper() == "ACTIVE":
        torch.ops.lowbit.cpu_team("torch")
    return f"OMP_WAIT_POLICY={policy}, lowbit's kernels on {torch.ops.lowbit.cpu_team()} threads"


def unmeasured(cell: str) -> bool:
    """A formatted NaN ("nan", "nanx", "nan%"): a peer or kernel that did not run for that row."""
    return cell.rstrip("x%") == "nan"


def print_table(headers, rows):
    """Right-aligned columns; a cell that was not measured (NaN) prints as "-"."""
    cells = [["-" if unmeasured(str(c)) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = "  ".join(h.rjust(w) for h, w in zip(headers, widths))
    print(line)
    print("-" * len(line))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def write_results(name, payload):
    """payload as JSON to results/<name> (or to `name` where it is a path)."""
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(f"wrote {path}")
    return path


def cuda_time_ms(fn, warmup=3, samples=15, min_sample_ms=1.0):
    """Median device time of one fn() call in milliseconds, from CUDA events.

    After `warmup` calls, each sample times a run of back-to-back calls on the
    current stream between two events (enough calls to last about
    min_sample_ms, so launch gaps and event resolution do not dominate small
    kernels) and divides by their number.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    calls = max(1, min(1000, int(min_sample_ms / once)))
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def cuda_copy_bandwidth_gbs(device, nbytes=1 << 30):
    """Read+write bandwidth of a large device-to-device tensor copy (GB/s, 1e9
    bytes), timed with CUDA events."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = cuda_time_ms(lambda: dst.copy_(src), warmup=3, samples=10)
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s):
        for stream in self.streams:
            stream.write(s)
        return len(s)


@contextlib.contextmanager
def printed_to(name):
    """Prints as usual and also saves everything printed as results/<name>
    (or as `name` where it is a path)."""
    log = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, log)):
        yield
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name), "w") as f:
        f.write(log.getvalue())
