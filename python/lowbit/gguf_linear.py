"""GGUFLinear: an nn.Linear replacement that keeps a GGUF weight's quantized
blocks (not a dequantized copy) and multiplies through torch.ops.lowbit."""
import functools
import warnings
from typing import Optional

import torch
from torch import nn

# Batches of at most this many rows take the matrix-vector op; larger ones
# the batched op (the split vLLM's GGUF layers make).
VEC_MAX_M = 8


@functools.lru_cache(maxsize=None)
def has_repacked_layout(qtype: int) -> bool:
    """Whether ggml type `qtype` has the CPU kernels' repacked layout (the
    table lives with the kernels: this asks torch.ops.lowbit.ggml_repack)."""
    block, _ = torch.ops.lowbit.ggml_type_info(qtype)
    try:
        torch.ops.lowbit.ggml_repack(torch.empty(0, dtype=torch.uint8), qtype, 0, block)
    except ValueError:
        return False
    return True


def reads_repacked_layout(qtype: int) -> bool:
    """Whether the active CPU kernels read type `qtype`'s repacked layout as
    it is (AVX-512 VNNI: every type with the layout; AVX2: Q4_0, Q4_1, Q5_0,
    Q5_1, Q8_0, IQ4_NL, Q2_K, Q3_K, Q4_K, IQ4_XS). Otherwise each call puts the
    rows back into the file's layout first: correct, but several times slower
    than the file's layout (torch.ops.lowbit.cpu_reads_repacked)."""
    return torch.ops.lowbit.cpu_reads_repacked(qtype)


# The types repack_model leaves in the file's layout by default although
# they have a repacked one: Q6_K (14), whose file-layout matvec already reads
# at the memory's speed, while its repacked one ran 0.79-0.93x that for a
# 14336 x 4096 weight on Zen 4 over two runs (1.2-1.6x at 4096 x 14336,
# 1.4-1.6x at M = 8; benchmarks/results/cpu-amd-epyc-2t-gguf.txt).
REPACK_MODEL_SKIPS = (14,)


def repack_model(model: nn.Module, skip_types=REPACK_MODEL_SKIPS) -> list[str]:
    """GGUFLinear.repack() on every GGUFLinear of `model` on the CPU whose
    type has the layout, is read as it is by the active CPU kernels
    (reads_repacked_layout) and is not in `skip_types`; returns their names.
    It warns naming the types whose layout the kernels would put back on
    every call, and leaves those layers as they are."""
    names, unread = [], set()
    for name, module in model.named_modules():
        if (isinstance(module, GGUFLinear) and module.qweight.device.type == "cpu"
                and has_repacked_layout(module.qtype) and module.qtype not in skip_types):
            if reads_repacked_layout(module.qtype):
                module.repack()
                names.append(name)
            else:
                unread.add(module.qtype)
    if unread:
        warnings.warn(f"lowbit.repack_model: this CPU's {torch.ops.lowbit.cpu_isa()} kernels would put the "
                      f"repacked rows back on every call for ggml types {sorted(unread)}; those layers stay in "
                      f"the file's layout")
    return names


class GGUFLinear(nn.Module):
    """y = x @ W.T + b with W stored as raw ggml blocks of type `qtype`.

    Buffers: `qweight` (uint8 [out_features, in_features / block * type_size],
    the rows exactly as a GGUF file stores them) and `bias` (optional).
    Activations may have any leading batch dims and be fp32, fp16 or bf16;
    the output has the activations' dtype.

    `repack()` reorders qweight (on the CPU, for Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, IQ4_NL, the K-quants and IQ4_XS) into the interleaved layout the
    AVX-512 VNNI kernels read 16 rows at a time, and the AVX2 ones 8 at a
    time for most of those types (torch.ops.lowbit.ggml_repack): the same
    results bit for bit, but for the 32-element types where the kernels read
    their layout (they sum each block's dot in int32 first: the same to fp32
    rounding, each row its own matvec's bit for bit at every batch size);
    faster where reads_repacked_layout(qtype) (elsewhere each call puts the
    rows back first). The layer keeps the file's layout everywhere
    else: its state_dict, dequantize(), and a move to another device.
    """

    def __init__(self, in_features: int, out_features: int, qtype: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None, device=None):
        super().__init__()
        block, type_size = torch.ops.lowbit.ggml_type_info(qtype)
        if in_features % block:
            raise ValueError(f"GGUFLinear: in_features={in_features} is not a multiple of the block size {block} of type {qtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = qtype
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features // block * type_size, dtype=torch.uint8, device=device)
        )
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device))
        else:
            self.bias = None
        self.repacked = False

    @classmethod
    def from_raw(cls, qweight: torch.Tensor, qtype: int, in_features: int,
                 bias: Optional[torch.Tensor] = None) -> "GGUFLinear":
        """A layer over existing block bytes [out_features, row_bytes] (e.g. a GGUF tensor's data)."""
        layer = cls(in_features, qweight.shape[0], qtype, bias=bias is not None,
                    dtype=None if bias is None else bias.dtype, device=qweight.device)
        if tuple(qweight.shape) != tuple(layer.qweight.shape) or qweight.dtype != torch.uint8:
            raise ValueError(f"GGUFLinear.from_raw: qweight must be uint8 {tuple(layer.qweight.shape)} for "
                             f"{in_features} inputs of type {qtype}, got {qweight.dtype} {tuple(qweight.shape)}")
        layer.qweight = qweight
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, qtype: int) -> "GGUFLinear":
        """Quantizes an nn.Linear with gguf-py's quantizer (types gguf-py can quantize)."""
        from gguf import GGMLQuantizationType
        from gguf import quants

        weight = linear.weight.detach().to(torch.float32).cpu().numpy()
        try:
            raw = quants.quantize(weight, GGMLQuantizationType(qtype))
        except NotImplementedError as e:
            raise ValueError(f"GGUFLinear.from_linear: gguf-py cannot quantize type {qtype}: {e}") from e
        qweight = torch.from_numpy(raw.reshape(weight.shape[0], -1)).to(linear.weight.device)
        return cls.from_raw(qweight, qtype, linear.in_features, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.repacked:
            y = torch.ops.lowbit.ggml_mul_mat_repacked(self.qweight, x2, self.qtype, self.out_features)
        elif x2.shape[0] <= VEC_MAX_M:
            y = torch.ops.lowbit.ggml_mul_mat_vec_a8(self.qweight, x2, self.qtype, self.out_features)
        else:
            y = torch.ops.lowbit.ggml_mul_mat_a8(self.qweight, x2, self.qtype, self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out_features, in_features]."""
        return torch.ops.lowbit.ggml_dequantize(self.file_layout_qweight(), self.qtype, self.out_features,
                                                self.in_features, dtype)

    def repack(self) -> "GGUFLinear":
        """qweight in the CPU kernels' interleaved layout, in place; returns self."""
        if self.qweight.device.type != "cpu":
            raise ValueError(f"GGUFLinear.repack: the repacked layout is the CPU kernels'; qweight is on "
                             f"{self.qweight.device}")
        if not self.repacked:
            self.qweight = self._reorder(inverse=False)
            self.repacked = True
        return self

    def unrepack(self) -> "GGUFLinear":
        """qweight back in the file's layout, in place; returns self."""
        if self.repacked:
            self.qweight = self._reorder(inverse=True)
            self.repacked = False
        return self

    def file_layout_qweight(self) -> torch.Tensor:
        """qweight as the file stores it (a reordered copy when repacked)."""
        return self._reorder(inverse=True) if self.repacked else self.qweight

    def _reorder(self, inverse: bool) -> torch.Tensor:
        return torch.ops.lowbit.ggml_repack(self.qweight, self.qtype, self.out_features, self.in_features, inverse)

    def _apply(self, fn, recurse=True):
        # Only the CPU kernels read the repacked layout: going anywhere else,
        # the bytes go back to the file's layout first.
        if self.repacked and fn(torch.empty(0, dtype=torch.uint8)).device.type != "cpu":
            self.unrepack()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.repacked:  # a state dict holds the file's layout, whatever loads it
            destination[prefix + "qweight"] = self.file_layout_qweight()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.repacked:  # the file's layout was copied in
            self.repacked = False
            self.repack()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}" + (", repacked=True" if self.repacked else ""))
