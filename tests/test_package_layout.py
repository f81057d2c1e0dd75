"""lowbit's module layout: one subpackage per format (lowbit.gguf,
lowbit.gptq), every legacy module path still importable as the same module
and the same objects, and no import cycle between lowbit's modules."""
import ast
import importlib
import os
import subprocess
import sys

import pytest

import lowbit

# Legacy module path -> the module that holds its contents, and names that
# users import from it.
LEGACY = {
    "lowbit.gguf_arch": ("lowbit.gguf.arch", ["ARCHITECTURES", "config_from_gguf", "hf_name", "unpermute_rows"]),
    "lowbit.gguf_embedding": ("lowbit.gguf.embedding", ["GGUFEmbedding"]),
    "lowbit.gguf_experts": ("lowbit.gguf.experts", ["ClampedSwiGLU", "GGUFExperts"]),
    "lowbit.gguf_file": ("lowbit.gguf.file", ["GGUFError", "GGUFFile", "GGUFTensor", "load_gguf"]),
    "lowbit.gguf_linear": ("lowbit.gguf.linear", ["GGUFLinear", "check_sizes"]),
    "lowbit.repacking": ("lowbit.gguf.repacking", ["has_repacked_layout", "reads_repacked_layout", "repack_model"]),
    "lowbit.packing": ("lowbit.gptq.packing", ["fields_per_pack", "words_per_pack"]),
    "lowbit.tp": ("lowbit.gptq.tp", ["ColumnParallelGPTQLinear", "NaiveTPMLP", "RowParallelGPTQLinear",
                                     "TPAwareMLP", "reorder_checkpoint", "tp_aware"]),
    "lowbit.models": ("lowbit", ["load_gguf_model", "load_gguf_tokenizer", "load_gptq_model"]),
}
# Where each public name of lowbit.models is defined.
MODELS = {"load_gguf_model": "lowbit.gguf.model", "load_gguf_tokenizer": "lowbit.gguf.model",
          "load_gptq_model": "lowbit.gptq.placing"}


def test_the_alias_table_holds_every_legacy_path():
    table = {f"lowbit.{old}": f"lowbit.{new}" if new else "lowbit" for old, new in lowbit._LEGACY_MODULES.items()}
    assert table == {old: new for old, (new, _) in LEGACY.items()}


@pytest.mark.parametrize("old", LEGACY)
def test_a_legacy_path_is_its_module(old):
    new, names = LEGACY[old]
    module = importlib.import_module(old)
    assert module is importlib.import_module(new) and sys.modules[old] is module
    assert getattr(lowbit, old.split(".")[1]) is module  # `import lowbit.tp; lowbit.tp.x`
    for name in names:
        defined = importlib.import_module(MODELS.get(name, new))
        assert getattr(module, name) is getattr(defined, name), name


def test_legacy_paths_import_first_in_a_fresh_interpreter():
    """`from lowbit.<legacy> import name` as a program's first lowbit import."""
    lines = [f"from {old} import {', '.join(names)}" for old, (_, names) in LEGACY.items()]
    lines += ["import lowbit.tp, lowbit.models", "assert lowbit.tp.tp_aware is lowbit.gptq.tp.tp_aware",
              "assert lowbit.models.load_gptq_model is lowbit.gptq.placing.load_gptq_model", "print('ok')"]
    result = subprocess.run([sys.executable, "-c", "\n".join(lines)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_public_names_import_from_their_packages():
    for package in (lowbit, lowbit.gguf, lowbit.gptq):
        missing = [name for name in package.__all__ if not hasattr(package, name)]
        assert not missing, (package.__name__, missing)
    for name in ("GGUFEmbedding", "GGUFError", "GGUFExperts", "GGUFFile", "GGUFLinear", "GGUFTensor", "load_gguf",
                 "load_gguf_model", "load_gguf_tokenizer", "repack_model"):
        assert getattr(lowbit, name) is getattr(lowbit.gguf, name), name
    for name in ("GPTQLinear", "GPTQTensors", "load_gptq", "load_gptq_model", "quantize_rtn", "save_gptq"):
        assert getattr(lowbit, name) is getattr(lowbit.gptq, name), name


def _module_imports():
    """{module: lowbit modules its body imports at load time}, read from the
    sources: imports inside functions run later and are left out. Importing
    a.b.c runs package a.b first, unless the importer is itself inside a.b."""
    root = os.path.dirname(lowbit.__file__)
    graph = {}
    for directory, _, files in os.walk(root):
        for file in files:
            if not file.endswith(".py"):
                continue
            parts = ["lowbit", *os.path.relpath(os.path.join(directory, file), root)[:-3].split(os.sep)]
            is_package = parts[-1] == "__init__"
            name = ".".join(parts[:-1] if is_package else parts)
            package = name if is_package else name.rpartition(".")[0]
            with open(os.path.join(directory, file)) as f:
                tree = ast.parse(f.read())
            targets = set()
            for node in tree.body:
                if isinstance(node, ast.Import):
                    targets.update(a.name for a in node.names)
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:
                        anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                        base = ".".join([*anchor, *([base] if base else [])])
                    targets.add(base)
                    targets.update(f"{base}.{a.name}" for a in node.names)  # `from . import gguf`
            deps = set()
            for target in targets:
                if target.split(".")[0] != "lowbit":
                    continue
                pieces = target.split(".")
                for i in range(1, len(pieces) + 1):
                    prefix = ".".join(pieces[:i])
                    if prefix != name and not (name + ".").startswith(prefix + "."):
                        deps.add(prefix)
            graph[name] = deps
    return graph


def test_no_import_cycles():
    graph = _module_imports()
    assert {"lowbit", "lowbit.gguf.model", "lowbit.gptq.placing", "lowbit.replace"} <= set(graph)
    state = {}

    def visit(module, path):
        state[module] = "open"
        for dep in sorted(graph.get(module, ())):
            if dep not in graph:
                continue  # a name imported from a module, not a module
            assert state.get(dep) != "open", f"import cycle: {' -> '.join([*path, module, dep])}"
            if dep not in state:
                visit(dep, [*path, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
