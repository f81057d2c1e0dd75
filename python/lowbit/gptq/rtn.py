"""Round-to-nearest GPTQ quantization: turns a float weight into exactly the
tensors a GPTQ tool writes (qweight, qzeros, scales, g_idx).

It is GPTQ's own per-group quantizer (min/max grid, symmetric zero
2^(bits-1)) without the Hessian error feedback; bit packing is done by the
C++ op lowbit::gptq_pack.
"""
from typing import NamedTuple, Optional

import torch

from .._checks import check_finite, check_flag, check_values
from .config import check_bits_group_size, check_format
from .packing import fields_per_pack


class GPTQTensors(NamedTuple):
    """One quantized weight as a GPTQ checkpoint stores it (quantize_rtn's result)."""

    qweight: torch.Tensor  # int32 [K*bits/32, N], packed along K
    qzeros: torch.Tensor  # int32 [groups, N*bits/32], packed along N, stored per checkpoint_format
    scales: torch.Tensor  # [groups, N]
    g_idx: torch.Tensor  # int32 [K], group of each input row
    bits: int
    group_size: int
    sym: bool
    checkpoint_format: str


# The dtypes scales can be quantized into: torch.finfo and isfinite serve them.
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_quant_args(who: str, bits: int, group_size: int, scale_dtype: torch.dtype,
                     dtype_name: str = "scale_dtype") -> None:
    """Refuses bits, group_size and scale dtype a quantizer cannot use, naming
    the argument."""
    check_bits_group_size(who, bits, group_size)
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"{who}: {dtype_name} must be one of {SCALE_DTYPES}, got {scale_dtype!r}")


def check_packable(who: str, weight: torch.Tensor, bits: int) -> None:
    """Refuses a weight [out=N, in=K] that `bits`-bit GPTQ tensors cannot
    hold, before any work: real floats, K and N filling whole packs of
    fields (qweight packs K, qzeros N)."""
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"{who}: weight must be a real floating-point tensor, got "
                         f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    fields = fields_per_pack(bits)
    # No outputs make tensors no GPTQLinear takes (its sizes are positive), as no inputs do.
    if weight.dim() != 2 or 0 in weight.shape or weight.shape[0] % fields or weight.shape[1] % fields:
        raise ValueError(f"{who}: weight must be 2-D [out, in] with in > 0, out > 0 and both multiples of {fields} "
                         f"({bits}-bit fields per pack), got shape {tuple(weight.shape)}")


def check_scales(scales: torch.Tensor, what: str) -> None:
    """Refuses scales [groups, N] that overflowed their storage dtype: a
    group whose range is beyond it would dequantize to inf."""
    bad = ~torch.isfinite(scales)
    if bool(bad.any()):
        group, column = (int(i) for i in bad.nonzero()[0])
        remedy = ("store float32 or bfloat16 scales" if scales.dtype == torch.float16
                  else "the group's weights span more than float32 holds")
        raise ValueError(f"{what}: group {group} of output {column} needs a scale beyond {scales.dtype}'s range "
                         f"({remedy})")


def quantize_rtn(
    weight: torch.Tensor,
    bits: int,
    group_size: int = 128,
    sym: bool = True,
    checkpoint_format: str = "gptq_v2",
    perm: Optional[torch.Tensor] = None,
    scale_dtype: torch.dtype = torch.float16,
) -> GPTQTensors:
    """Quantizes an nn.Linear weight [out=N, in=K] to GPTQ tensors.

    group_size -1 means one group over all of K. `perm` (a permutation of K)
    gives act-order: rows are grouped in `perm` order, so g_idx[perm[j]] =
    j // group_size. GPTQ v1 ("gptq") stores zero-1 and cannot represent a
    zero of 0: asymmetric groups that need one raise ValueError.
    """
    check_quant_args("quantize_rtn", bits, group_size, scale_dtype)
    sym = check_flag("quantize_rtn", "sym", sym)
    check_format(checkpoint_format, "quantize_rtn")
    check_packable("quantize_rtn", weight, bits)
    check_values("quantize_rtn", weight, "weight")
    check_finite(weight, "quantize_rtn: weight")
    w = weight.detach().to(torch.float32).t()  # [K, N]
    K, N = w.shape
    G = K if group_size == -1 else min(group_size, K)  # a group past K is the one group of K rows
    groups = -(-K // G)  # like GPTQ, a last group may be shorter

    if perm is not None:
        perm = torch.as_tensor(perm)
        if perm.is_floating_point() or perm.is_complex() or perm.dtype == torch.bool:  # .long() would truncate
            raise ValueError(f"quantize_rtn: perm must hold integers, got {perm.dtype}")
    order = torch.arange(K, device=w.device) if perm is None else perm.to(w.device, torch.long)
    if order.shape != (K,) or not torch.equal(order.sort().values, torch.arange(K, device=w.device)):
        raise ValueError(f"quantize_rtn: perm must be a permutation of range({K})")
    g_idx = torch.empty(K, dtype=torch.int32, device=w.device)
    g_idx[order] = (torch.arange(K, device=w.device) // G).to(torch.int32)

    maxq = 2**bits - 1
    # Rows in processing order, padded to whole groups by repeating the last
    # row (which changes no group's min or max); the padding is dropped below.
    padded = torch.cat([order, order[-1:].expand(groups * G - K)])
    wg = w[padded].reshape(groups, G, N)
    xmin = wg.amin(dim=1).clamp(max=0)
    xmax = wg.amax(dim=1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = -xmax
    scale = (xmax - xmin) / maxq
    scale = torch.where(scale > 0, scale, torch.ones_like(scale)).to(scale_dtype)
    check_scales(scale, "quantize_rtn")
    # A range too small for the storage dtype rounds to 0 (which would divide to NaN codes):
    # the smallest normal scale instead, as lowbit's GPTQ does.
    scale = torch.where(scale > 0, scale, torch.finfo(scale_dtype).tiny)
    if sym:
        zero = torch.full_like(xmin, (maxq + 1) // 2)
    else:
        zero = torch.round(-xmin / scale.float()).clamp(0, maxq)
    # Quantize against the scale as stored, so dequantization reproduces it.
    q = torch.clamp(torch.round(wg / scale.float()[:, None, :]) + zero[:, None, :], 0, maxq)
    q_rows = torch.empty_like(w)
    q_rows[order] = q.reshape(groups * G, N)[:K]

    zero = zero.to(torch.int32)
    if checkpoint_format == "gptq":
        if bool((zero == 0).any()):
            raise ValueError(
                "quantize_rtn: GPTQ v1 ('gptq') stores zero-1 and cannot represent a zero point of 0, "
                "which this asymmetric weight needs; use checkpoint_format='gptq_v2'"
            )
        zero = zero - 1
    # Packing is an offline step with a CPU kernel only; results go back to w's device.
    return GPTQTensors(
        qweight=torch.ops.lowbit.gptq_pack(q_rows.to(torch.int32).cpu(), bits, 0).to(w.device),
        qzeros=torch.ops.lowbit.gptq_pack(zero.cpu(), bits, 1).to(w.device),
        scales=scale,
        g_idx=g_idx,
        bits=bits,
        group_size=group_size,
        sym=sym,
        checkpoint_format=checkpoint_format,
    )
