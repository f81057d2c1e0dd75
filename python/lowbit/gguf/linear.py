"""GGUFLinear: an nn.Linear replacement that keeps a GGUF weight's quantized
blocks (not a dequantized copy) and multiplies through torch.ops.lowbit."""
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from .._checks import (check_finite, check_flag, check_float_dtype, check_linear, check_sizes, check_values,
                       is_integer)
from .._frozen import linear_forward
from .._stored import StoredBuffers, as_buffer, joinable
from .file import dequantize_rows, release_mapped

# The ggml float weight types (F32, F16, BF16) of torch's dtypes.
FLOAT_QTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
# The types torch.ops.lowbit.ggml_quantize writes (Q8_0, Q6_K).
LOWBIT_QUANTIZES = (8, 14)


def check_qtype(owner: str, qtype) -> tuple[int, int]:
    """(values per block, bytes per block) of ggml type `qtype`; ValueError
    naming `owner` and qtype for one that is not an integer type id (a bool
    passes ggml_type_info as its id, True as F16; a float fails in the op's
    argument parsing) or not a type lowbit supports."""
    if not is_integer(qtype):
        raise ValueError(f"{owner}: qtype must be a ggml type id (an integer), got {qtype!r}")
    try:
        return tuple(torch.ops.lowbit.ggml_type_info(int(qtype)))
    except ValueError:
        raise ValueError(f"{owner}: qtype {int(qtype)} is not a ggml weight type lowbit supports (unknown or "
                         "removed id)") from None


class GGUFLinear(StoredBuffers):
    """y = x @ W.T + b with W stored as raw ggml blocks of type `qtype`.

    Buffers: `qweight` (uint8 [out_features, in_features / block * type_size],
    the rows exactly as a GGUF file stores them) and `bias` (optional).
    Activations may have any leading batch dims and be fp32, fp16 or bf16;
    the output has the activations' dtype.

    `repack()` reorders qweight (on the CPU, for Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0, IQ4_NL, MXFP4, the K-quants and IQ4_XS) into the interleaved layout the
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
        check_sizes("GGUFLinear", in_features=in_features, out_features=out_features)
        block, type_size = check_qtype("GGUFLinear", qtype)
        bias = check_flag("GGUFLinear", "bias", bias)
        if dtype is not None:
            check_float_dtype("GGUFLinear", dtype, "dtype (the bias's)")
        if in_features % block:
            raise ValueError(f"GGUFLinear: in_features={in_features} is not a multiple of the block size {block} of type {qtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.qtype = int(qtype)  # a numpy integer id as the int the ops and state take
        self.register_buffer(
            "qweight", torch.zeros(out_features, in_features // block * type_size, dtype=torch.uint8, device=device)
        )
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype or torch.float32, device=device))
        else:
            self.bias = None
        self.repacked = False

    def layout(self) -> dict:
        return {"qtype": int(self.qtype)}

    @classmethod
    def from_raw(cls, qweight: torch.Tensor, qtype: int, in_features: int,
                 bias: Optional[torch.Tensor] = None) -> "GGUFLinear":
        """A layer over existing block bytes [out_features, row_bytes] (e.g. a GGUF tensor's data)."""
        # What is not a tensor (an int where the bias goes, a NumPy array) fails below on .shape, naming nothing.
        if not isinstance(qweight, torch.Tensor) or qweight.dim() != 2:
            raise ValueError(f"GGUFLinear.from_raw: qweight must be a 2-D tensor [out_features, row_bytes], got "
                             f"{tuple(qweight.shape) if isinstance(qweight, torch.Tensor) else type(qweight).__name__}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (qweight.shape[0],)
                                 or not bias.dtype.is_floating_point):
            got = f"{bias.dtype} {tuple(bias.shape)}" if isinstance(bias, torch.Tensor) else type(bias).__name__
            raise ValueError(f"GGUFLinear.from_raw: bias must be a float tensor [{qweight.shape[0]}] (one per row), "
                             f"got {got}")
        # Forward's addition would fail, naming neither; a meta bias is a placeholder a loader fills (a model
        # built on the meta device, its biases placed after its weights).
        if bias is not None and not bias.is_meta and bias.device != qweight.device:
            raise RuntimeError(f"GGUFLinear.from_raw: bias is on {bias.device}, qweight on {qweight.device}: both "
                               "must be on one device")
        # Built on the meta device: a zero-filled qweight the size of the
        # blocks would be allocated only to be replaced.
        layer = cls(in_features, qweight.shape[0], qtype, bias=bias is not None,
                    dtype=None if bias is None else bias.dtype, device="meta")
        if tuple(qweight.shape) != tuple(layer.qweight.shape) or qweight.dtype != torch.uint8:
            raise ValueError(f"GGUFLinear.from_raw: qweight must be uint8 {tuple(layer.qweight.shape)} for "
                             f"{in_features} inputs of type {qtype}, got {qweight.dtype} {tuple(qweight.shape)}")
        layer.qweight = as_buffer(qweight)
        if bias is not None:
            layer.bias = bias.detach().clone()
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, qtype: int) -> "GGUFLinear":
        """Quantizes an nn.Linear with gguf-py's quantizer, or, for the types
        gguf-py has none for, lowbit's (llama.cpp's quantizer: Q6_K);
        ValueError naming the type where neither quantizes it."""
        from gguf import GGMLQuantizationType
        from gguf import quants

        check_linear("GGUFLinear.from_linear", linear)
        block, _ = check_qtype("GGUFLinear.from_linear", qtype)
        name = torch.ops.lowbit.ggml_type_name(int(qtype))
        # nn.Linear takes 0; a layer of no rows or columns fails below as a bare reshape error.
        check_sizes("GGUFLinear.from_linear", **{"linear.in_features": linear.in_features,
                                                 "linear.out_features": linear.out_features})
        if linear.in_features % block:
            raise ValueError(f"GGUFLinear.from_linear: in_features={linear.in_features} is not a multiple of the block "
                             f"size {block} of {name}")
        check_values("GGUFLinear.from_linear", linear.weight, "linear.weight")  # a meta one fails on .item()
        check_finite(linear.weight.detach(), "GGUFLinear.from_linear: linear.weight")
        weight = linear.weight.detach().to(torch.float32).cpu()
        try:
            raw = torch.from_numpy(quants.quantize(weight.numpy(), GGMLQuantizationType(int(qtype))).view("uint8"))
        except NotImplementedError:  # gguf-py has no quantizer for the type: lowbit's, where it writes the type
            if int(qtype) not in LOWBIT_QUANTIZES:
                raise ValueError(f"GGUFLinear.from_linear: no quantizer for {name} (gguf-py writes the legacy types, "
                                 "the float ones, TQ1_0, TQ2_0 and MXFP4, lowbit Q8_0 and Q6_K); llama.cpp's "
                                 "llama-quantize writes every type into a GGUF file, which load_gguf_model "
                                 "reads") from None
            try:
                raw = torch.ops.lowbit.ggml_quantize(weight, int(qtype))
            except ValueError as e:  # a block past the type's range
                raise ValueError(f"GGUFLinear.from_linear: linear.weight: {e}") from None
        # The float types come back as float arrays: their bytes are the blocks.
        qweight = raw.reshape(weight.shape[0], -1)
        # gguf-py writes a value or block scale past the type's range (an fp16 scale past 65504) as inf,
        # without a word: every output the row reaches would be inf or NaN.
        bad = ~torch.isfinite(dequantize_rows("GGUFLinear.from_linear", qweight, int(qtype), weight.shape[0],
                                              weight.shape[1], torch.float32))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"GGUFLinear.from_linear: linear.weight's row {row} reaches magnitude "
                             f"{weight[row].abs().max().item():g}, beyond {name}'s range (a value or block scale "
                             f"overflows at column {col})")
        return cls.from_raw(qweight.to(linear.weight.device), int(qtype), linear.in_features, linear.bias)

    def can_join(self, other: nn.Module) -> bool:
        """Whether `other`'s rows can follow this layer's in one layer (joined)."""
        return (type(other) is type(self) and other.qtype == self.qtype and other.in_features == self.in_features
                and not (self.repacked or other.repacked) and other.qweight.device == self.qweight.device
                and (None if self.bias is None else self.bias.dtype) == (None if other.bias is None else other.bias.dtype))

    @classmethod
    def joined(cls, layers: Iterable["GGUFLinear"], back_to_back=None) -> "GGUFLinear":
        """One layer over the rows of `layers` (which can_join), in order:
        back_to_back(qweights) where it gives them as one view (a file's
        mapping: no copy), else a concatenated copy."""
        layers = joinable(cls, layers, "the same type, input size, device and bias dtype, none repacked")
        if back_to_back is not None and not callable(back_to_back):  # else a bare "not callable" TypeError
            raise TypeError(f"GGUFLinear.joined: back_to_back must be None or callable (GGUFFile.back_to_back), got "
                            f"{type(back_to_back).__name__}")
        qweights = [layer.qweight for layer in layers]
        rows = back_to_back(qweights) if back_to_back is not None else None
        shape = (sum(q.shape[0] for q in qweights), qweights[0].shape[1])
        if rows is None:
            rows = torch.cat(qweights)
        # Rows of another count would make a layer of as many outputs (without biases: a bare misfit error).
        elif not isinstance(rows, torch.Tensor) or rows.shape != shape or rows.dtype != torch.uint8:
            got = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"GGUFLinear.joined: back_to_back must give None or the layers' rows as one uint8 "
                             f"{list(shape)} tensor, got {got}")
        bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
        return cls.from_raw(rows, layers[0].qtype, layers[0].in_features, bias)

    def op_call(self, x2: torch.Tensor) -> tuple:
        """(op, args): op(*args) multiplies the rows x2 [rows, in_features] by
        this layer's weight as it is held, without the bias (forward's call,
        and lowbit.decoding's, which skips the module)."""
        return self.op_template(x2)[:2]

    def op_template(self, x2: torch.Tensor) -> tuple:
        """(op, args, perm) as GPTQLinear.op_template gives them: op_call's
        call with x2 itself among args; no column order (perm None)."""
        # ggml_mul_mat_a8 takes ggml_mul_mat_vec_a8's kernel at the M where that
        # one is faster: no choice by M here to guard a traced graph to one side of it.
        op = torch.ops.lowbit.ggml_mul_mat_repacked if self.repacked else torch.ops.lowbit.ggml_mul_mat_a8
        return op, (self._buffers["qweight"], x2, self.qtype, self.out_features), None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_forward(self, x)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out_features, in_features] in `dtype`."""
        return dequantize_rows("GGUFLinear.dequantize", self.file_layout_qweight(), self.qtype, self.out_features,
                               self.in_features, dtype)

    @torch.inference_mode(False)  # the new layout must serve later calls that save for backward
    def repack(self) -> "GGUFLinear":
        """qweight in the CPU kernels' interleaved layout, in place; returns self."""
        if self.qweight.device.type != "cpu":
            raise ValueError(f"GGUFLinear.repack: the repacked layout is the CPU kernels'; qweight is on "
                             f"{self.qweight.device}")
        if not torch.ops.lowbit.ggml_has_repacked_layout(int(self.qtype)):  # else ggml_repack's error, naming it
            raise ValueError(f"GGUFLinear.repack: qtype {int(self.qtype)} "
                             f"({torch.ops.lowbit.ggml_type_name(int(self.qtype))}) has no repacked layout "
                             "(lowbit.gguf.repacking.has_repacked_layout)")
        if not self.repacked:
            mapped = self.qweight
            self.qweight = self._reorder(inverse=False)
            self.repacked = True
            release_mapped([mapped])  # a file's bytes, copied: their pages go
        return self

    @torch.inference_mode(False)
    def unrepack(self) -> "GGUFLinear":
        """qweight back in the file's layout, in place; returns self."""
        if self.repacked:
            self.qweight = self._reorder(inverse=True)
            self.repacked = False
        return self

    def part_state(self, rows: slice) -> dict[str, torch.Tensor]:
        """The state of a layer of output rows `rows` of this one: their
        blocks in the file's layout, and their biases."""
        state = {"qweight": self.file_layout_qweight()[rows]}
        if self.bias is not None:
            state["bias"] = self.bias[rows]
        return state

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
        # A state dict holds the file's layout: loaded into the file's layout,
        # so that what it leaves out (strict=False) or fails to load stays as it was.
        repacked = self.repacked
        self.unrepack()
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            if repacked:
                self.repack()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}" + (", repacked=True" if self.repacked else ""))
