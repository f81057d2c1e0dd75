"""lowbit: low-bit LLM weights (GPTQ, GGUF) as torch.ops.lowbit.* operators.

Importing lowbit loads the compiled operators into torch.ops.lowbit and
registers their fake kernels for torch.compile and their gradients. Each
format has its own subpackage: lowbit.gguf and lowbit.gptq.
"""
import sys as _sys
from importlib import import_module as _import_module

from . import _library

_library.load()

from . import _autograd, ops  # noqa: E402,F401  (need the ops loaded first)
from .ops import GGMLType  # noqa: E402
from . import gguf, gptq  # noqa: E402,F401
from .gguf import (GGUFEmbedding, GGUFError, GGUFExperts, GGUFFile, GGUFLinear, GGUFTensor, load_gguf,  # noqa: E402
                   load_gguf_model, load_gguf_tokenizer, repack_model)
from .gptq import GPTQLinear, GPTQTensors, load_gptq, load_gptq_model, quantize_rtn, save_gptq  # noqa: E402
from .replace import ReplaceReport, replace_linear  # noqa: E402
from .fusing import fuse_projections  # noqa: E402
from .decoding import fast_decoding  # noqa: E402
from .generation import compiled_decoding  # noqa: E402
from .threads import kernel_threads  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "GGUFEmbedding", "GGUFError", "GGUFExperts", "GGUFFile", "GGUFLinear", "GGUFTensor", "GPTQLinear", "GPTQTensors",
    "GGMLType", "ReplaceReport",
    "load_gguf", "load_gguf_model", "load_gguf_tokenizer", "load_gptq", "load_gptq_model", "quantize_rtn",
    "repack_model", "replace_linear", "save_gptq", "kernel_threads", "compiled_decoding", "fast_decoding",
    "fuse_projections",
]

# Legacy module paths that stay importable (`import lowbit.tp`, `from
# lowbit.gguf_file import GGUFError`): each names the module that holds its
# contents, registered in sys.modules and as an attribute of lowbit. The
# loaders of lowbit.models are lowbit's own names, so it names lowbit itself.
_LEGACY_MODULES = {
    "gguf_arch": "gguf.arch", "gguf_embedding": "gguf.embedding", "gguf_experts": "gguf.experts",
    "gguf_file": "gguf.file", "gguf_linear": "gguf.linear", "repacking": "gguf.repacking",
    "packing": "gptq.packing", "tp": "gptq.tp", "models": "",
}
for _old, _new in _LEGACY_MODULES.items():
    _module = _import_module(f"{__name__}.{_new}" if _new else __name__)
    _sys.modules[f"{__name__}.{_old}"] = _module
    globals()[_old] = _module
del _old, _new, _module
