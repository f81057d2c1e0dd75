"""The benchmarks' command lines (benchmarks/README.md): every module's --help
prints its usage and measures nothing, and a bad option value ends in
argparse's usage error (exit status 2) before any measurement, not in a
traceback. Each main() runs in this process: it exits while it parses."""
import argparse
import importlib
import sys

import pytest

from benchmarks.cli import positive_int

MODULES = ["bench_cuda", "bench_e2e", "bench_gguf", "bench_gguf_moe", "bench_gptq_gemm", "bench_long_prompt",
           "bench_shared_cores", "bench_tp_mlp", "demo", "finetune_lora", "gptq_calibration", "perplexity_noise",
           "profile_cuda", "results_tables"]


def exit_status(monkeypatch, module, *argv):
    # benchmarks.common sets THP_MEM_ALLOC_ENABLE=1 when imported; the test leaves the environment as it was.
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    main = importlib.import_module(f"benchmarks.{module}").main
    monkeypatch.setattr(sys, "argv", [f"{module}.py", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code


@pytest.mark.parametrize("module", MODULES)
def test_help_prints_the_usage_and_runs_nothing(monkeypatch, capsys, module):
    assert exit_status(monkeypatch, module, "--help") == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("module, argv", [
    ("bench_gguf", ["--isa", "sse2"]),
    ("bench_gguf", ["--types", "Q4_0", "--shapes", "100x7"]),
    ("bench_gguf", ["--shapes", "0x256"]),
    ("bench_gguf", ["--types", "Q4_K", "--shapes", "2048x100"]),
    ("bench_gguf", ["--types", "q4_0"]),
    ("bench_gguf_moe", ["--isa", "sse2"]),
    ("bench_gguf_moe", ["--layers", "Llama"]),
    ("bench_gptq_gemm", ["--device", "gpu"]),
    ("bench_gptq_gemm", ["--device", "meta"]),
    ("bench_tp_mlp", ["--reps", "0"]),
    ("bench_e2e", ["--threads", "0"]),
    ("bench_e2e", ["--rounds", "-1"]),
    ("bench_e2e", ["--models", "smollm3"]),
    ("bench_long_prompt", ["--tokens", "2k"]),
    ("bench_long_prompt", ["--models", "moe"]),
    ("bench_shared_cores", ["--rounds", "0"]),
    ("finetune_lora", ["--steps", "0"]),
    ("finetune_lora", ["--bases", "int4"]),
    ("demo", ["--heldout-tokens", "0"]),
    ("gptq_calibration", ["--quick"]),
    ("perplexity_noise", ["--quick"]),
    ("profile_cuda", ["summarize", "no-such-raw.csv", "no-such-kernels.json"]),
    ("profile_cuda", ["trace"]),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_bad_option_value_is_a_usage_error(monkeypatch, capsys, module, argv):
    assert exit_status(monkeypatch, module, *argv) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("1", 1), ("16", 16)])
def test_positive_int_takes_whole_numbers_from_one(text, value):
    assert positive_int(text) == value


@pytest.mark.parametrize("text", ["0", "-2", "1.5", "two", ""])
def test_positive_int_refuses_the_rest(text):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_int(text)


@pytest.mark.parametrize("argv, types", [
    (["--quick"], ["Q4_0", "Q4_1", "Q5_0"]),
    (["--quick", "--types", "Q4_0,Q8_0,Q4_K,Q6_K"], ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]),
])
def test_bench_gguf_quick_measures_every_named_type(monkeypatch, argv, types):
    """--quick shortens the main types' list, never the one --types names."""
    bench = importlib.import_module("benchmarks.bench_gguf")
    measured = []

    class Measured(Exception):
        pass

    def matmul_table(rng, shapes, matmul_types, *args, **kwargs):
        measured.append(list(matmul_types))
        raise Measured

    monkeypatch.setattr(bench, "matmul_table", matmul_table)
    monkeypatch.setattr(bench, "CopyBandwidth", lambda threads: None)
    monkeypatch.setattr(sys, "argv", ["bench_gguf.py", *argv])
    with pytest.raises(Measured):
        bench.main()
    assert measured == [types]
