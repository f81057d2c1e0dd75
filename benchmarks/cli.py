"""Argument types the benchmarks' command lines share. Plain Python: bench_e2e
reads its arguments before it imports torch."""
import argparse


def positive_int(text: str) -> int:
    """argparse type: a whole number from 1 (threads, rounds, repetitions, steps)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def require_llama_cpp(benchmark: str) -> None:
    """Ends the run with a message where llama-cpp-python, the peer a
    generation benchmark measures against (and the quantizer of its generated
    files), cannot be imported."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"{benchmark}: needs llama-cpp-python, the llama.cpp it measures against ({e}); "
                         "pip install llama-cpp-python (make reference-deps)") from None
