"""GPTQ v1 checkpoints written by GPTQModel with zero points of 0.

GPTQModel keeps v2 zeros and writes v1 by subtracting one per field from the
packed qzeros words: for 2, 4 and 8 bits as one whole-word subtraction
(0x55555555, 0x11111111, 0x01010101), so a zero of 0 becomes a field of all
ones and borrows one from the next field; for 3 bits (7.x) field by field,
modulo 8. lowbit reads such modules (load_gptq, convert_checkpoint) as
GPTQModel reads them, with a warning.

The reference is GPTQModel's own conversion code, taken from its source
distribution in .whl/ (`make reference-deps` downloads it; the tests skip
without it) by function name, so no GPTQModel dependency is imported. The
hand-built 4-bit words at the top need no download.
"""
import __future__
import ast
import re
import tarfile
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import gptq_reference as ref
from lowbit.gptq.checkpoint import load_gptq, save_gptq, write_checkpoint
from lowbit.gptq.config import read_config
from lowbit.gptq.convert import convert_checkpoint

GPTQMODEL_VERSION = "7.7.0"  # the Makefile's GPTQMODEL_PKG
SDIST = Path(__file__).resolve().parent.parent / ".whl" / f"gptqmodel-{GPTQMODEL_VERSION}.tar.gz"
# The functions the tests run, by file of the package; planar_packing.py (which needs only torch) runs whole.
GPTQMODEL_FUNCTIONS = {
    "utils/model.py": ("convert_gptq_v1_to_v2_format_module", "convert_gptq_v2_to_v1_format_module"),
    "utils/model_dequant.py": ("unpack_cols", "pack_cols", "_unpack_cols_3bit", "_pack_cols_3bit",
                               "_require_int32_words_for_3bit", "_shift_gptq_qzeros", "_correct_gptq_v1_qzeros",
                               "_revert_gptq_v1_qzeros_correction"),
}
WARNING = r"read as GPTQModel writes them"
MODULE = "proj"


def checkpoint(directory, bits, qweight, qzeros, scales, group_size):
    """A one-module v1 ("gptq") asymmetric checkpoint."""
    K = qweight.shape[0] * 32 // bits
    tensors = {f"{MODULE}.qweight": qweight, f"{MODULE}.qzeros": qzeros, f"{MODULE}.scales": scales,
               f"{MODULE}.g_idx": torch.arange(K, dtype=torch.int32) // group_size}
    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": False,
              "checkpoint_format": "gptq"}
    write_checkpoint(directory, tensors, {"quantization_config": config})


def as_int32(words):
    """Unsigned 32-bit words (Python ints or an int64 array) as int32 (two's complement)."""
    words = np.asarray(words, dtype=np.int64) & 0xFFFFFFFF
    return torch.from_numpy(np.where(words >= 2**31, words - 2**32, words).astype(np.int32))


def random_module(rng, bits, K, N, groups):
    q = rng.integers(0, 2**bits, size=(K, N))
    scales = torch.from_numpy((rng.uniform(0.5, 1.5, size=(groups, N)) / 2**bits).astype(np.float16))
    return q, torch.from_numpy(ref.pack(q, bits, 0)), scales


# --- hand-built 4-bit words (no GPTQModel needed) ----------------------------------------------

V2_ZEROS = [[0 if i == j else 8 for i in range(8)] for j in range(8)]  # a zero of 0 in field j (7: top field)
V2_ZEROS += [[0, 0, 8, 8, 8, 8, 8, 8],  # the borrow runs through a second zero
             [0, 1, 8, 8, 8, 8, 8, 8],  # and turns a one into all ones too
             [3, 0, 15, 0, 1, 0, 7, 0]]


@pytest.mark.parametrize("zeros", V2_ZEROS, ids=lambda z: "".join(f"{v:x}" for v in z))
def test_hand_built_4bit_word(tmp_path, zeros):
    """One qzeros word as GPTQModel writes it: the packed v2 zeros minus 0x11111111."""
    v2_word = sum(z << 4 * i for i, z in enumerate(zeros))
    v1_word = (v2_word - 0x11111111) % 2**32
    per_field_plus_one = [((v1_word >> 4 * i) & 15) + 1 for i in range(8)]
    assert per_field_plus_one != zeros  # the reading every other v1 reader does is wrong here
    rng = np.random.default_rng(0)
    q, qweight, scales = random_module(rng, 4, 32, 8, 1)
    checkpoint(tmp_path / "src", 4, qweight, as_int32([[v1_word]]), scales, 32)

    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'src'))}: 1 modules \({MODULE}\) .*{WARNING}"):
        layer = load_gptq(tmp_path / "src").modules[MODULE]
    expected = scales.double().numpy() * (q - np.array(zeros))  # W[k, n] = s[n] * (q[k, n] - z[n])
    np.testing.assert_array_equal(layer.dequantize(torch.float64).numpy().T, expected)
    assert layer.checkpoint_format == "gptq_v2" and int(layer.qzeros[0, 0]) == int(as_int32([v2_word])[0])

    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'src'))}: 1 modules \({MODULE}\) .*{WARNING}"):
        convert_checkpoint(tmp_path / "src", tmp_path / "v2")
    assert int(load_gptq(tmp_path / "v2").modules[MODULE].qzeros[0, 0]) == int(as_int32([v2_word])[0])

    # Saved again under its v1 label, the words are GPTQModel's again: the same zeros to any reader.
    model = torch.nn.Module()
    model.add_module(MODULE, layer)
    with pytest.warns(UserWarning, match=rf"save_gptq: 1 modules \({MODULE}\) have zero points of 0, written in v1"):
        save_gptq(model, tmp_path / "saved", read_config(str(tmp_path / "src")))
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert int(saved[f"{MODULE}.qzeros"][0, 0]) == int(as_int32([v1_word])[0])
    with pytest.warns(UserWarning, match=WARNING):
        again = load_gptq(tmp_path / "saved").modules[MODULE]
    assert torch.equal(again.dequantize(torch.float64), layer.dequantize(torch.float64))


# --- against GPTQModel's own code --------------------------------------------------------------


class QuantLinear:
    """What GPTQModel's conversions read and write of a quantized module."""

    def __init__(self, qzeros, bits):
        self.qzeros, self.bits, self.pack_dtype, self.planar = qzeros.clone(), bits, torch.int32, False

    def qzero_format(self, format):
        self.format = format


@pytest.fixture(scope="module")
def gptqmodel():
    """GPTQModel's functions, compiled from its sdist's source into one namespace."""
    if not SDIST.exists():
        pytest.skip(f"{SDIST} is missing (`make reference-deps` downloads it); GPTQModel is the reference here")
    root = f"gptqmodel-{GPTQMODEL_VERSION}/gptqmodel"
    with tarfile.open(SDIST) as tar:
        read = lambda path: tar.extractfile(f"{root}/{path}").read().decode()  # noqa: E731
        sources = {path: read(path) for path in (*GPTQMODEL_FUNCTIONS, "utils/planar_packing.py")}
    silent = types.SimpleNamespace(once=lambda *args, **kwargs: None)
    namespace = {"torch": torch, "BaseQuantLinear": QuantLinear, "log": types.SimpleNamespace(info=silent)}
    exec(compile(sources["utils/planar_packing.py"], f"{root}/utils/planar_packing.py", "exec"), namespace)
    flags = __future__.annotations.compiler_flag  # annotations name GPTQModel types this namespace lacks
    for path, names in GPTQMODEL_FUNCTIONS.items():
        found = [node for node in ast.parse(sources[path]).body
                 if isinstance(node, ast.FunctionDef) and node.name in names]
        assert sorted(n.name for n in found) == sorted(names), f"{path} of GPTQModel {GPTQMODEL_VERSION} changed"
        exec(compile(ast.Module(found, []), f"{root}/{path}", "exec", flags=flags, dont_inherit=True), namespace)
    return types.SimpleNamespace(**namespace)


def gptqmodel_v1(gm, v2_qzeros, bits):
    module = QuantLinear(v2_qzeros, bits)
    config = types.SimpleNamespace(bits=bits, pack_dtype=torch.int32)  # read only where the module lacks them
    gm.convert_gptq_v2_to_v1_format_module(module, quantize_config=config)
    assert module.format == 1
    return module.qzeros


def gptqmodel_v2(gm, v1_qzeros, bits):
    module = QuantLinear(v1_qzeros, bits)
    gm.convert_gptq_v1_to_v2_format_module(module, bits=bits, pack_dtype=torch.int32)
    assert module.format == 2
    return module.qzeros


def test_gptqmodel_3bit_shifts_each_field_alone(gptqmodel):
    """GPTQModel 7.x's 3-bit v1: zero - 1 per field, modulo 8 (0 -> 7), no borrow, straddling fields too."""
    zeros = torch.full((1, 32), 5, dtype=torch.int32)
    zeros[0, [0, 10, 21, 31]] = 0  # 10 and 21 straddle words
    v1 = gptqmodel_v1(gptqmodel, gptqmodel.pack_cols(zeros, 3, pack_dtype=torch.int32), 3)
    expected = torch.full((1, 32), 4, dtype=torch.int32)
    expected[0, [0, 10, 21, 31]] = 7
    assert torch.equal(torch.ops.lowbit.gptq_unpack(v1, 3, 1), expected)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptqmodel_written_v1_zeros(tmp_path, gptqmodel, bits):
    """Zeros of 0 among random v2 zeros, written as v1 by GPTQModel: lowbit loads and
    converts them to exactly the words GPTQModel reads back, and computes the weight
    the v2 zeros give."""
    rng = np.random.default_rng(bits)
    K, N, group_size = 64, 64, 32
    zeros = rng.integers(0, 2**bits, size=(K // group_size, N))
    zeros[rng.random(zeros.shape) < 0.3] = 0
    zeros[0, :2] = 0  # at least one zero of 0 in the first word
    v2 = gptqmodel.pack_cols(torch.from_numpy(zeros).int(), bits, pack_dtype=torch.int32)
    v1 = gptqmodel_v1(gptqmodel, v2, bits)
    read_back = gptqmodel_v2(gptqmodel, v1, bits)
    assert torch.equal(read_back, v2)  # GPTQModel's own round trip is exact
    q, qweight, scales = random_module(rng, bits, K, N, K // group_size)
    checkpoint(tmp_path / "src", bits, qweight, v1, scales, group_size)

    with pytest.warns(UserWarning, match=rf"{re.escape(str(tmp_path / 'src'))}: 1 modules \({MODULE}\) .*{WARNING}"):
        layer = load_gptq(tmp_path / "src").modules[MODULE]
    assert layer.checkpoint_format == "gptq_v2" and torch.equal(layer.qzeros, read_back)
    g_idx = np.arange(K) // group_size
    expected = ref.dequantize(qweight.numpy(), v2.numpy(), scales.numpy(), g_idx, bits, "gptq_v2")
    np.testing.assert_array_equal(layer.dequantize(torch.float64).numpy().T, expected)

    with pytest.warns(UserWarning, match=WARNING):
        convert_checkpoint(tmp_path / "src", tmp_path / "v2")
    converted = load_gptq(tmp_path / "v2").modules[MODULE]
    assert converted.checkpoint_format == "gptq_v2" and torch.equal(converted.qzeros, read_back)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_gptqmodel_v1_without_zeros_of_zero(tmp_path, gptqmodel, bits):
    """Without a zero of 0, GPTQModel's v1 is the per-field z - 1 every reader knows: no warning, words kept."""
    rng = np.random.default_rng(10 + bits)
    zeros = torch.from_numpy(rng.integers(1, 2**bits, size=(2, 64))).int()
    v2 = gptqmodel.pack_cols(zeros, bits, pack_dtype=torch.int32)
    v1 = gptqmodel_v1(gptqmodel, v2, bits)
    assert torch.equal(torch.ops.lowbit.gptq_unpack(v1, bits, 1), zeros - 1)
    _, qweight, scales = random_module(rng, bits, 64, 64, 2)
    checkpoint(tmp_path / "src", bits, qweight, v1, scales, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layer = load_gptq(tmp_path / "src").modules[MODULE]
        convert_checkpoint(tmp_path / "src", tmp_path / "v2")
    assert layer.checkpoint_format == "gptq" and torch.equal(layer.qzeros, v1)
    assert torch.equal(load_gptq(tmp_path / "v2").modules[MODULE].qzeros, gptqmodel_v2(gptqmodel, v1, bits))
