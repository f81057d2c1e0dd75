"""GGUF files: the file reader, the architecture table, the GGUFLinear,
GGUFEmbedding and GGUFExperts layers over a file's blocks, the CPU kernels'
repacked layout, and the loaders that make a file a transformers model."""
from .arch import ARCHITECTURES, Architecture
from .embedding import GGUFEmbedding
from .experts import ClampedSwiGLU, GGUFExperts
from .file import GGUFError, GGUFFile, GGUFTensor, load_gguf
from .linear import GGUFLinear
from .model import load_gguf_model, load_gguf_tokenizer, place_gguf_tensors
from .repacking import has_repacked_layout, reads_repacked_layout, repack_model

__all__ = [
    "ARCHITECTURES", "Architecture", "ClampedSwiGLU", "GGUFEmbedding", "GGUFError", "GGUFExperts", "GGUFFile",
    "GGUFLinear", "GGUFTensor",
    "has_repacked_layout", "load_gguf", "load_gguf_model", "load_gguf_tokenizer", "place_gguf_tensors",
    "reads_repacked_layout", "repack_model",
]
