"""The README's Python API and Operators sections against the code: each
signature it writes out (a function's or class's parameters and defaults,
an op's schema) is the one the code has, so that a renamed parameter or a
changed default fails here rather than reaching a reader."""
import ast
import inspect
import pathlib
import re

import torch

import lowbit
import lowbit.fusing
import lowbit.gptq
import lowbit.gptq.tp
import lowbit.lora

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
# Where a README name without a module prefix is looked up, in order.
NAMESPACES = (lowbit, lowbit.lora, lowbit.gptq, lowbit.gptq.tp, lowbit.fusing)
# The public names whose signature the Python API section must write out.
DOCUMENTED = {
    "load_gguf_model", "load_gguf_tokenizer", "fuse_projections", "load_gptq_model", "replace_linear", "load_gguf",
    "GGUFLinear", "GGUFEmbedding", "GGUFExperts", "repack_model", "GPTQLinear", "load_gptq", "save_gptq",
    "quantize_rtn", "kernel_threads", "fast_decoding", "compiled_decoding", "lowbit.gptq.convert_checkpoint",
    "lowbit.gptq.quantize", "lowbit.fusing.unfused_state_dict", "load_adapter", "LoraConfig",
}


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end]


def resolve(name: str):
    if name.startswith("lowbit."):
        module, _, attr = name.rpartition(".")
        obj = lowbit
        for part in module.split(".")[1:]:
            obj = getattr(obj, part)
        return getattr(obj, attr, None)
    for namespace in NAMESPACES:
        if hasattr(namespace, name):
            return getattr(namespace, name)
    return None


def documented_signatures() -> dict[str, str]:
    """name -> the parameter text of each `name(...)` the Python API section
    writes for a lowbit function or class (calls such as
    `model.gradient_checkpointing_enable()` resolve to nothing and are left)."""
    text, found = section("Python API"), {}
    for match in re.finditer(r"`((?:lowbit\.)?[A-Za-z_][\w.]*)\(", text):
        depth, end = 1, match.end()
        while depth:  # to the matching parenthesis: defaults such as () hold their own
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        if callable(resolve(match[1])):
            found.setdefault(match[1], text[match.end():end - 1])
    return found


def test_python_api_signatures_are_the_code_s():
    documented = documented_signatures()
    assert DOCUMENTED <= set(documented), sorted(DOCUMENTED - set(documented))
    for name, params in documented.items():
        # "..." stands for parameters left out at the end: the written ones are a prefix.
        prefix_only = params.rstrip().endswith("...")
        text = re.sub(r",?\s*\.\.\.\s*$", "", params)
        tree = ast.parse(f"def _({text}): pass").body[0].args
        code = list(inspect.signature(resolve(name)).parameters.values())
        if tree.kwarg is not None:  # **kw: the code takes keyword arguments under any name
            assert code and code[-1].kind is inspect.Parameter.VAR_KEYWORD, name
            continue
        written = tree.args
        defaults = [None] * (len(written) - len(tree.defaults)) + tree.defaults
        names = [a.arg for a in written]
        assert names == [p.name for p in code[:len(names)]], (name, names, [p.name for p in code])
        for default, p in zip(defaults, code):
            if default is None:
                assert p.default is inspect.Parameter.empty, (name, p.name, p.default)
            else:
                assert eval(ast.unparse(default), {"torch": torch}) == p.default, (name, p.name, p.default)
        rest = code[len(names):]
        if not prefix_only:
            # Parameters the README leaves out have defaults: a documented call still works.
            assert all(p.default is not inspect.Parameter.empty for p in rest), (name, rest)


def schemas_cpp() -> dict[str, str]:
    """op name -> its schema's text after the name, from csrc/ops/schemas.cpp's m.def calls."""
    source = (ROOT / "csrc" / "ops" / "schemas.cpp").read_text()
    schemas = {}
    for literals in re.findall(r"m\.def\(\s*((?:\"[^\"]*\"\s*)+)\)", source):
        text = "".join(re.findall(r"\"([^\"]*)\"", literals))
        name, _, rest = text.partition("(")
        schemas[name] = "(" + rest
    return schemas


def test_operator_table_schemas_are_schemas_cpp_s():
    schemas = schemas_cpp()
    declared = sorted(name.split("::")[1] for name in torch._C._dispatch_get_all_op_names()
                      if name.startswith("lowbit::"))
    assert sorted(schemas) == declared
    table = section("Operators")
    rows = {}
    for ops_cell, schema_cell in re.findall(r"^\| (`[^|]*`) \| (`[^|]*`) \|", table, re.M):
        ops, written = re.findall(r"`(\w+)`", ops_cell), re.findall(r"`([^`]*)`", schema_cell)
        if len(written) == 1:  # one schema for every op of the row
            written *= len(ops)
        assert len(ops) == len(written), ops_cell
        rows.update(zip(ops, written))
    assert sorted(rows) == declared, sorted(set(declared) ^ set(rows))
    for op, schema in rows.items():
        assert schema == schemas[op], (op, schema, schemas[op])
