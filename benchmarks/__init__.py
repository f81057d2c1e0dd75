"""lowbit's benchmarks and main job, run as modules from the repository root
(python -m benchmarks.bench_gguf, python -m benchmarks.demo) so that they
import each other and the tests' references (tests.gguf_blocks,
tests.llama_cpp_peer) by package name."""
