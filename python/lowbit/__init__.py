"""lowbit: low-bit LLM weights (GPTQ, GGUF) as torch.ops.lowbit.* operators.

Importing lowbit loads the compiled operators into torch.ops.lowbit and
registers their fake kernels for torch.compile and their gradients.
"""
from . import _library

_library.load()

from . import _autograd, _fake  # noqa: E402,F401  (need the ops loaded first)
from . import gptq, tp  # noqa: E402,F401
from .gguf_embedding import GGUFEmbedding  # noqa: E402
from .gguf_experts import GGUFExperts  # noqa: E402
from .gguf_file import GGUFError, GGUFFile, GGUFTensor, load_gguf  # noqa: E402
from .gguf_linear import GGUFLinear  # noqa: E402
from .repacking import repack_model  # noqa: E402
from .gptq import GPTQLinear, GPTQTensors, load_gptq, quantize_rtn, save_gptq  # noqa: E402
from .models import load_gguf_model, load_gguf_tokenizer, load_gptq_model  # noqa: E402
from .replace import ReplaceReport, replace_linear  # noqa: E402

__version__ = "0.1.0"
__all__ = [
    "GGUFEmbedding", "GGUFError", "GGUFExperts", "GGUFFile", "GGUFLinear", "GGUFTensor", "GPTQLinear", "GPTQTensors",
    "ReplaceReport",
    "load_gguf", "load_gguf_model", "load_gguf_tokenizer", "load_gptq", "load_gptq_model", "quantize_rtn",
    "repack_model", "replace_linear", "save_gptq",
]
