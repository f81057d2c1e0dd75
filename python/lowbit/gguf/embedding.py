"""GGUFEmbedding: an nn.Embedding replacement that keeps a GGUF token
embedding's blocks and dequantizes only the rows it looks up, as llama.cpp's
get_rows does (a float copy of a 128k-token table costs GBs)."""
import numbers

import torch

from .._checks import check_sizes, has_values
from .._stored import StoredBuffers, as_buffer
from .linear import check_qtype


class GGUFEmbedding(StoredBuffers):
    """out[..., :] = dequantized row `ids[...]` of the blocks, in `dtype`
    (times `embed_scale`, where given).

    Buffer `qweight`: uint8 [num_embeddings, embedding_dim / block * type_size],
    the rows exactly as a GGUF file stores them (one row per token, whole
    blocks, so a row dequantizes on its own, exactly). `embed_scale` stands in
    for transformers' ScaledWordEmbedding (the Gemma models' sqrt(hidden)):
    held as a buffer that follows model.to(dtype), and applied as that
    module applies it, in the output's dtype.
    """

    def __init__(self, qweight: torch.Tensor, qtype: int, embedding_dim: int, dtype: torch.dtype = torch.float32,
                 embed_scale: float | None = None):
        super().__init__()
        check_sizes("GGUFEmbedding", embedding_dim=embedding_dim)
        check_qtype("GGUFEmbedding", qtype)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):  # what ggml_dequantize writes
            raise ValueError(f"GGUFEmbedding: dtype must be float32, float16 or bfloat16, got {dtype}")
        if not isinstance(qweight, torch.Tensor):  # its .dtype below would be a bare AttributeError
            raise TypeError(f"GGUFEmbedding: qweight must be a uint8 tensor, got {type(qweight).__name__}")
        # A NaN, inf or zero scale (or one past the dtype's range) turns every
        # looked-up row NaN, inf or 0 without an error; True would read as 1.
        # An integer past float64's range fails float() itself: it is compared first.
        if embed_scale is not None and (
                not isinstance(embed_scale, numbers.Real) or isinstance(embed_scale, bool)
                or not 0 < embed_scale <= torch.finfo(torch.float64).max
                or not torch.isfinite(torch.tensor(float(embed_scale)).to(dtype))):
            raise ValueError(f"GGUFEmbedding: embed_scale must be None or a finite number > 0 in {dtype}, "
                             f"got {embed_scale!r}")
        block, type_size = torch.ops.lowbit.ggml_type_info(qtype)
        if embedding_dim % block or qweight.dtype != torch.uint8 or qweight.dim() != 2 \
                or qweight.shape[1] != embedding_dim // block * type_size:
            raise ValueError(f"GGUFEmbedding: qweight must be uint8 [rows, {embedding_dim // block * type_size}] "
                             f"for dimension {embedding_dim} of type {qtype}, got {qweight.dtype} "
                             f"{tuple(qweight.shape)}")
        check_sizes("GGUFEmbedding", num_embeddings=qweight.shape[0])
        self.num_embeddings, self.embedding_dim, self.qtype = qweight.shape[0], embedding_dim, int(qtype)
        self.register_buffer("qweight", as_buffer(qweight))
        # The output dtype, held by an empty float buffer so that it follows
        # model.to(dtype) as a float weight would (the blocks stay uint8).
        self.register_buffer("out_dtype", torch.empty(0, dtype=dtype), persistent=False)
        self.register_buffer("embed_scale", None if embed_scale is None else torch.tensor(embed_scale).to(dtype),
                             persistent=False)

    def layout(self) -> dict:
        return {"qtype": int(self.qtype)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # The ids nn.Embedding takes; index_select's own error would name neither the module nor `ids`.
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"GGUFEmbedding: ids must be an int64 or int32 tensor of token ids, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        flat = ids.reshape(-1)
        # A compiled graph bounds-checks the gather itself (inductor asserts
        # its indirect indices below the size); a host-side check would break
        # the graph. Negative ids, which it would wrap around, go past the end.
        if torch.compiler.is_compiling():
            flat = torch.where(flat < 0, self.num_embeddings, flat)
        elif flat.numel() and has_values(flat):  # meta and fake ids have none: the shapes are all there is
            low, high = torch.stack(torch.aminmax(flat)).tolist()  # one pass, one device sync
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"GGUFEmbedding: token ids must lie in [0, {self.num_embeddings}), "
                                 f"got {low} .. {high}")
        out = self._decoded(self.qweight.index_select(0, flat))
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(out.dtype)
        return out.reshape(*ids.shape, self.embedding_dim)

    def dequantize(self) -> torch.Tensor:
        """The whole float table [num_embeddings, embedding_dim]."""
        return self._decoded(self.qweight)

    def _decoded(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` of blocks as floats of the output dtype: ggml_dequantize
        writes float32, float16 and bfloat16; float64 (model.double()) is
        their float32 values, exactly."""
        dtype = self.out_dtype.dtype
        written = dtype if dtype in (torch.float16, torch.bfloat16) else torch.float32
        out = torch.ops.lowbit.ggml_dequantize(rows, self.qtype, rows.shape[0], self.embedding_dim, written)
        return out.to(dtype)

    def extra_repr(self) -> str:
        scale = "" if self.embed_scale is None else f", embed_scale={self.embed_scale.item():g}"
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}, dtype={self.out_dtype.dtype}{scale}"
