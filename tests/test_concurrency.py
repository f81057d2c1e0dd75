"""Ops and layers called from 8 Python threads at once give exactly the serial
results (the kernels keep no shared mutable state; a GPTQLinear's lazily built
fast path is published atomically), and one GGUF file loads in several
processes at once (read-only, copy-on-write memory maps)."""
import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

import gguf_blocks as gb
import lowbit
from gguf_files import write_toy_gguf

THREADS = 8


def run_concurrently(calls):
    """Runs every call THREADS times at once; returns {index: [results]}."""
    with ThreadPoolExecutor(THREADS) as pool:
        futures = [(i, pool.submit(call)) for _ in range(THREADS) for i, call in enumerate(calls)]
        results = {}
        for i, f in futures:
            results.setdefault(i, []).append(f.result())
    return results


def test_ops_and_layers_from_eight_threads():
    torch.manual_seed(0)
    x = torch.randn(5, 256)
    gptq = [lowbit.GPTQLinear.from_linear(torch.nn.Linear(256, 96), bits, 64, False, "gptq_v2",
                                          perm=torch.randperm(256)) for bits in (2, 3, 4, 8)]
    raw = torch.from_numpy(gb.random_blocks(np.random.default_rng(0), "Q4_K", 96, 256))
    gguf = lowbit.GGUFLinear.from_raw(raw, gb.type_id("Q4_K"), 256)
    calls = [lambda layer=layer: layer(x) for layer in gptq]  # first calls race to build the shuffled plan
    calls += [lambda: gguf(x), lambda: gguf(x.repeat(4, 1)),
              lambda: torch.ops.lowbit.ggml_dequantize(raw, gb.type_id("Q4_K"), 96, 256, torch.float32),
              lambda: torch.ops.lowbit.gptq_dequantize(gptq[1].qweight, gptq[1].qzeros, gptq[1].scales,
                                                       gptq[1].g_idx, True, 3)]
    serial = [call() for call in calls]
    for i, outputs in run_concurrently(calls).items():
        assert all(torch.equal(out, serial[i]) for out in outputs), f"call {i} differs under threads"


def test_one_gguf_file_loads_in_several_processes(tmp_path):
    path = tmp_path / "toy.gguf"
    write_toy_gguf(path)
    with lowbit.load_gguf(path) as f:
        expect = {name: t.data.sum().item() for name, t in f.tensors.items()}
    script = ("import sys, lowbit\n"
              "with lowbit.load_gguf(sys.argv[1]) as f:\n"
              "    print(repr({n: t.data.sum().item() for n, t in f.tensors.items()}))\n")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE, text=True)
             for _ in range(4)]
    before = path.read_bytes()
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0 and ast.literal_eval(out) == expect
    assert path.read_bytes() == before  # no loader writes to its input
