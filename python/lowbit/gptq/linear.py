"""GPTQLinear: an nn.Linear replacement whose buffers are exactly a GPTQ
checkpoint's tensors, multiplied by torch.ops.lowbit.gptq_gemm."""
from __future__ import annotations

import math

import torch
from torch import nn

from .packing import fields_per_pack, words_per_pack
from .config import BITS, FORMATS
from .rtn import quantize_rtn


class GPTQLinear(nn.Module):
    """y = x @ W.T + b for a GPTQ weight W.

    Buffers (state_dict) are the checkpoint's own: `qweight` int32
    [K*bits/32, N], `qzeros` int32 [groups, N*bits/32], `scales` [groups, N],
    `g_idx` int32 [K] and optional `bias` [N], so `load_state_dict` reads a
    checkpoint and `state_dict()` writes one. For act-order weights whose
    groups all have `group_size` rows, the layer shuffles a private copy of
    `qweight` into lowbit's fast layout the first time it runs (again after
    its buffers change); any other g_idx runs unshuffled.
    """

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, sym: bool = True,
                 desc_act: bool = False, checkpoint_format: str = "gptq", bias: bool = True,
                 dtype: torch.dtype = torch.float16, device=None):
        super().__init__()
        if bits not in BITS:
            raise ValueError(f"GPTQLinear: bits must be one of {BITS}, got {bits}")
        if checkpoint_format not in FORMATS:
            raise ValueError(f"GPTQLinear: checkpoint_format must be one of {FORMATS}, got {checkpoint_format!r}")
        if group_size != -1 and group_size <= 0:
            raise ValueError(f"GPTQLinear: group_size must be -1 or positive, got {group_size}")
        if in_features % fields_per_pack(bits) or out_features % fields_per_pack(bits):
            raise ValueError(f"GPTQLinear: {bits}-bit packing needs in_features and out_features to be multiples "
                             f"of {fields_per_pack(bits)}, got {in_features} and {out_features}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.sym, self.desc_act = bits, group_size, sym, desc_act
        self.checkpoint_format = checkpoint_format
        groups = 1 if group_size == -1 else math.ceil(in_features / group_size)
        words = words_per_pack(bits)
        self.register_buffer("qweight", torch.zeros(in_features // fields_per_pack(bits) * words, out_features,
                                                    dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // fields_per_pack(bits) * words,
                                                   dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=dtype, device=device))
        g = in_features if group_size == -1 else group_size
        self.register_buffer("g_idx", (torch.arange(in_features, device=device) // g).to(torch.int32))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None
        # How to run (_new_plan), one attribute so that threads sharing the layer never see one
        # plan's key with another plan's tensors.
        self._plan = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, bits: int, group_size: int, sym: bool = True,
                    checkpoint_format: str = "gptq", perm: torch.Tensor | None = None,
                    dtype: torch.dtype = torch.float16) -> GPTQLinear:
        """Round-to-nearest GPTQ quantization of `linear` (act-order when `perm`
        gives the order in which GPTQ would process the input rows)."""
        t = quantize_rtn(linear.weight, bits, group_size, sym, checkpoint_format, perm, scale_dtype=dtype)
        layer = cls(linear.in_features, linear.out_features, bits, group_size, sym, perm is not None,
                    checkpoint_format, linear.bias is not None, dtype, linear.weight.device)
        with torch.no_grad():
            for name in ("qweight", "qzeros", "scales", "g_idx"):
                getattr(layer, name).copy_(getattr(t, name))
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    @property
    def use_v2_format(self) -> bool:
        return self.checkpoint_format == "gptq_v2"

    def _prepare(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """gptq_gemm's (b_q_weight, b_g_idx, use_exllama) for this layer.

        Any g_idx runs on the checkpoint's own buffers (the op recognises
        contiguous groups, a short last one included), so a plain layer needs
        no checks per call: the plan only records that g_idx was not act-order
        when last looked at. Act-order weights whose groups all have the same
        size run on a shuffled private copy of qweight, whose source is checked
        on every call: writes through `.data` (how many loaders copy weights
        in) bump no version counter, so besides g_idx's values the check reads
        a diagonal of qweight words that meets every packed row and every
        column. While torch.compile traces, the plan is taken as it stands.
        """
        plan = self._plan
        if plan is not None and (torch.compiler.is_compiling() or self._still_valid(plan)):
            return plan[1] if plan[1] is not None else (self.qweight, self.g_idx, False)
        plan = self._plan = self._new_plan()
        return plan[1] if plan[1] is not None else (self.qweight, self.g_idx, False)

    def _key(self) -> tuple:
        q, g = self.qweight, self.g_idx
        return q.data_ptr(), q._version, g.data_ptr(), g._version

    def _still_valid(self, plan: tuple) -> bool:
        key, shuffled, g_idx, where, sample = plan
        now = self._key()
        if shuffled is None:  # plain: only a new act-order g_idx would call for a new plan
            return now[2:] == key[2:]
        return (now == key and torch.equal(self.g_idx, g_idx)
                and torch.equal(self.qweight.view(-1)[where], sample))

    def _new_plan(self) -> tuple:
        """(key, shuffled (qweight, perm, True) or None for plain, g_idx copy,
        sampled qweight positions, their words)."""
        key = self._key()
        K, groups = self.in_features, self.scales.shape[0]
        g_idx = self.g_idx
        perm = torch.argsort(g_idx, stable=True)
        trivial = (torch.arange(K, device=g_idx.device) // max(1, K // groups)).to(g_idx.dtype)
        if K % groups or torch.equal(perm, torch.arange(K, device=perm.device)) or not torch.equal(g_idx[perm], trivial):
            return key, None, None, None, None  # in order already, or groups of unequal size
        perm = perm.to(torch.int32)
        shuffled = self.qweight.clone()
        torch.ops.lowbit.gptq_shuffle(shuffled, perm, self.bits)
        rows, cols = self.qweight.shape
        i = torch.arange(max(rows, cols), device=g_idx.device)
        where = i % rows * cols + i % cols
        return key, (shuffled, perm, True), g_idx.clone(), where, self.qweight.view(-1)[where]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qweight, idx, shuffled = self._prepare()
        y = torch.ops.lowbit.gptq_gemm(x.reshape(-1, self.in_features), qweight, self.qzeros, self.scales, idx,
                                       shuffled, self.use_v2_format, self.bits)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The float weight [out_features, in_features] in `dtype` (default: the
        scales' dtype), computed exactly in fp32 and rounded once."""
        w = torch.ops.lowbit.gptq_dequantize(self.qweight, self.qzeros, self.scales.float(), self.g_idx,
                                             self.use_v2_format, self.bits)
        return w.t().to(dtype or self.scales.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, sym={self.sym}, desc_act={self.desc_act}, "
                f"checkpoint_format={self.checkpoint_format!r}, bias={self.bias is not None}")
