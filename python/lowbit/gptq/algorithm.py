"""GPTQ post-training quantization (Frantar et al. 2022, "GPTQ: Accurate
Post-Training Quantization for Generative Pre-trained Transformers").

Each nn.Linear weight W [N, K] is quantized to minimise the layer-wise error
||W X - Wq X||^2 over calibration inputs X, whose Hessian is H = 2 X X^T
(paper, eq. 1-2). Columns of W are quantized one at a time; the rounding
error of each is spread over the columns not yet quantized through the
inverse Hessian (the OBQ update, eq. 3), computed from the Cholesky factor
of H^-1 (step 3 of the paper, "Cholesky reformulation") and applied lazily
block by block (step 2, "lazy batch-updates"). Columns go in the order of
decreasing diag(H) with act-order (`desc_act`, the paper's appendix on
LLaMA / GPTQ's "act-order" heuristic).

The quantizer grid is GPTQ's own min/max grid, the one lowbit.quantize_rtn
uses; scales are rounded to their storage dtype before any column is
quantized against them, so the error feedback sees exactly the weight the
checkpoint dequantizes to.

`quantize` runs the whole model block by block ("sequential" in the paper):
each decoder layer is quantized from the outputs of the already-quantized
layers before it, with the mask and rotary embedding the model gives that
layer (they differ between Gemma's sliding and global layers). Inside a layer the Linears are quantized in the order the
layer calls them, in groups that read the same input (q/k/v, then o, then
gate/up, then down for Llama): every group's Hessian comes from inputs that
already went through the quantized groups before it (the reference code's
"true sequential" mode).

Mixture-of-experts layers (transformers' experts modules with 3-D
gate_up_proj / down_proj parameters) are split into one Linear per expert
and projection first, as GPTQModel quantizes them: each expert's gate/up
share the Hessian of the tokens routed to it, its down that of its own
activations; all experts' gate/up are calibrated in one pass over the
inputs, then all downs. The layer keeps them as a GPTQExperts, under the
names GPTQ MoE checkpoints use (`mlp.experts.<e>.gate_proj`, ...).
"""
from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from tqdm.auto import tqdm

from .._checks import check_finite, check_flag, check_sizes, check_values, has_values, is_integer
from .._placing import GPTQ_SAVE_ADVICE, refuse_save_pretrained
from .config import GPTQConfig, check_format
from ..moe import experts_dims, plain_experts
from .experts import EXPERT_LAYER, GPTQExpert, GPTQExperts
from .linear import GPTQLinear, check_scale_dtype
from .rtn import check_packable, check_quant_args, check_scales

BLOCK_SIZE = 128  # columns per lazy batch-update (the paper's B = 128)


class Hessian:
    """H = 2/n * sum over the n input rows x of x x^T, the Hessian of the
    layer-wise squared error (paper eq. 2). Each batch's x^T x is an fp32
    GEMM (a float64 one is ~10x slower on CPUs); the running sum over batches
    is float64, so many calibration tokens lose nothing to rounding. (The reference code divides
    by the number of sequences rather than rows; any positive factor gives
    the same quantization, as damping is relative to mean(diag(H)).)"""

    def __init__(self, features: int, device=None):
        check_sizes("Hessian", features=features)  # torch.zeros' error for a float or -1 names no argument
        self.sum = torch.zeros(features, features, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        # Rows of the layer's inputs: a reshape would take any size that divides, mixing features across rows.
        features = self.sum.shape[0]
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != features or x.is_complex():
            got = f"{x.dtype} {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"Hessian.add: x must be a real tensor [..., {features}], got {got}")
        x = x.detach().reshape(-1, self.sum.shape[0]).to(torch.float32)
        self.sum += (x.t() @ x).to(torch.float64)
        self.rows += x.shape[0]

    def value(self) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("Hessian: no inputs were added")
        return self.sum * (2.0 / self.rows)


class GPTQResult(NamedTuple):
    codes: torch.Tensor  # int32 [K, N], the integers q in [0, 2^bits - 1], rows in the Linear's input order
    scales: torch.Tensor  # [groups, N] in the storage dtype
    zeros: torch.Tensor  # int32 [groups, N], the zero points themselves (not v1's zero-1)
    g_idx: torch.Tensor  # int32 [K], the group of each input row
    weight: torch.Tensor  # float32 [N, K], scales * (q - zeros): the weight the error feedback assumed


def gptq_weight(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True,
                desc_act: bool = False, damp_percent: float = 0.01,
                scale_dtype: torch.dtype = torch.float16) -> GPTQResult:
    """GPTQ of one weight [N, K] given the Hessian [K, K] of its inputs
    (the reference implementation's `fasterquant`, static_groups=False)."""
    _check_args(bits, group_size, damp_percent, scale_dtype)
    sym, desc_act = check_flag("gptq_weight", "sym", sym), check_flag("gptq_weight", "desc_act", desc_act)
    # A list fails on .dim() naming nothing, and a complex Hessian's cast to float64 drops its imaginary part. The
    # weight is a layer's floats (as quantize_rtn takes it); a Hessian of integers is read exactly as float64.
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise ValueError(f"gptq_weight: weight must be a real floating-point tensor, got "
                         f"{weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if not isinstance(hessian, torch.Tensor) or hessian.is_complex() or hessian.dtype == torch.bool:
        raise ValueError(f"gptq_weight: hessian must be a real tensor, got "
                         f"{hessian.dtype if isinstance(hessian, torch.Tensor) else type(hessian).__name__}")
    if weight.dim() != 2 or weight.shape[1] == 0:
        raise ValueError(f"gptq_weight: weight must be 2-D [out, in] with in > 0, got shape {tuple(weight.shape)}")
    check_values("gptq_weight", weight, "weight")
    check_finite(weight, "gptq_weight: weight")
    N, K = weight.shape
    if hessian.shape != (K, K):
        raise ValueError(f"gptq_weight: hessian must be [{K}, {K}] for a weight [{N}, {K}], "
                         f"got {tuple(hessian.shape)}")
    check_values("gptq_weight", hessian, "hessian")
    check_finite(hessian, "gptq_weight: hessian")  # else it reads as a Hessian no dampening makes definite
    W = weight.detach().to(torch.float32).clone()
    H = hessian.detach().to(device=W.device, dtype=torch.float64).clone()
    _check_symmetric(H, "gptq_weight: hessian")
    # Inputs that are always 0 carry no information: their weights do not
    # matter to the layer's output, so they are set to 0, and H gets a 1 on
    # the diagonal to stay invertible.
    dead = H.diagonal() == 0
    H.diagonal()[dead] = 1
    W[:, dead] = 0
    # Any positive factor of H gives the same quantization, but U is taken in
    # float32: H brought to a mean diagonal near 1 by a power of 4, which
    # scales every step of the Cholesky factors by a power of 2, exactly.
    # (The largest diagonal value where the mean's sum overflows; the power
    # applied as two powers of 2, as 4^515 is beyond float64.)
    mean = H.diagonal().mean()
    half = -(int(torch.frexp(mean if torch.isfinite(mean) else H.diagonal().max()).exponent) // 2)
    H.mul_(2.0**half).mul_(2.0**half)
    # Act-order: quantize the columns with the largest activations first,
    # while many columns are still left to absorb their error.
    # (Stable, so that equal activations keep their order: an expert that no
    # calibration token reached, H = I, keeps the plain g_idx.)
    perm = (torch.argsort(H.diagonal(), descending=True, stable=True) if desc_act
            else torch.arange(K, device=W.device))
    W, H = W[:, perm], H[perm][:, perm]
    # Dampening (paper, step 3): a fraction of the mean diagonal keeps the
    # Cholesky decomposition stable on large models.
    H.diagonal().add_(damp_percent * H.diagonal().mean())
    U = _upper_cholesky_of_inverse(H).to(torch.float32)
    grid = _Grid(bits, sym, group_size, K, N, scale_dtype, W.device)
    Q = _quantize_columns(W, U, grid)
    check_scales(grid.scales, "gptq_weight")  # the feedback can carry a group beyond the dtype too
    codes, weight_q = torch.empty_like(grid.codes), torch.empty_like(Q)
    codes[perm], weight_q[:, perm] = grid.codes, Q
    # Groups are formed in processing order: the j-th column processed
    # belongs to group j // group_size.
    g_idx = torch.empty(K, dtype=torch.int32, device=W.device)
    g_idx[perm] = (torch.arange(K, device=W.device) // grid.group_size).to(torch.int32)
    return GPTQResult(codes, grid.scales, grid.zeros, g_idx, weight_q)


# How far apart H[i, j] and H[j, i] may lie, relative to sqrt(|H[i, i]| |H[j, j]|)
# (which bounds |H[i, j]| for an X^T X). Hessian sums fp32 GEMMs of the batches,
# whose two triangles can differ by their accumulation order: at most about
# rows * 2^-24 of that bound per batch, typically far less. A matrix further apart
# than this is not a Hessian of inputs; the Cholesky factor would read one triangle.
SYMMETRY_TOLERANCE = 1e-3
_SYMMETRY_BLOCK = 1 << 22  # elements of H compared at a time: bounded temporaries at any K


def _check_symmetric(H: torch.Tensor, what: str) -> None:
    """Refuses H (float64, finite, square) whose triangles differ beyond
    SYMMETRY_TOLERANCE, naming the first pair; O(K^2) in row blocks."""
    K = H.shape[0]
    root = H.diagonal().abs().sqrt()  # each root apart: the product of two diagonals can overflow float64
    rows = max(1, _SYMMETRY_BLOCK // max(K, 1))
    for start in range(0, K, rows):
        block = H[start:start + rows]
        apart = (block - H[:, start:start + rows].t()).abs()
        bad = apart > SYMMETRY_TOLERANCE * root[start:start + rows, None] * root[None, :]
        if bool(bad.any()):
            i, j = (int(v) for v in bad.nonzero()[0])
            i += start
            raise ValueError(f"{what} is not symmetric: [{i}, {j}] holds {H[i, j].item()!r} and [{j}, {i}] "
                             f"{H[j, i].item()!r}, further apart than {SYMMETRY_TOLERANCE:g} of the root of their "
                             "diagonal entries' product (a Hessian of inputs is X^T X)")


def _check_args(bits: int, group_size: int, damp_percent: float, scale_dtype: torch.dtype = torch.float16,
                dtype_name: str = "scale_dtype") -> None:
    check_quant_args("GPTQ", bits, group_size, scale_dtype, dtype_name)
    if isinstance(damp_percent, bool) or not isinstance(damp_percent, (int, float)) or not 0 < damp_percent < 1:
        raise ValueError(f"GPTQ: damp_percent must lie in (0, 1), got {damp_percent}")


def _upper_cholesky_of_inverse(H: torch.Tensor) -> torch.Tensor:
    """U with H^-1 = U^T U (upper): row j of U, divided by U[j, j], holds the
    OBQ update of the columns after j once column j is quantized, with the
    columns before j already eliminated (paper, step 3)."""
    L, info = torch.linalg.cholesky_ex(H)
    if info == 0:
        U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if info != 0:
        raise ValueError("GPTQ: the dampened Hessian is not positive definite; raise damp_percent")
    return U


class _Grid:
    """GPTQ's per-group min/max quantizer and the tensors it produces, filled
    in processing order (column j of the permuted weight)."""

    def __init__(self, bits, sym, group_size, K, N, scale_dtype, device):
        self.maxq, self.sym = 2**bits - 1, sym
        self.group_size = K if group_size == -1 else min(group_size, K)  # past K: one group
        groups = -(-K // self.group_size)
        self.scales = torch.empty(groups, N, dtype=scale_dtype, device=device)
        self.zeros = torch.empty(groups, N, dtype=torch.int32, device=device)
        self.codes = torch.empty(K, N, dtype=torch.int32, device=device)
        self.scale = self.zero = None  # the current group's, float32 [N]

    def start_group(self, group: int, w: torch.Tensor) -> None:
        """Sets the grid of `group` from its columns' current weights w [N, g]."""
        xmin = w.amin(dim=1).clamp(max=0)
        xmax = w.amax(dim=1).clamp(min=0)
        if self.sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = -xmax
        empty = (xmin == 0) & (xmax == 0)
        xmin, xmax = torch.where(empty, -1.0, xmin), torch.where(empty, 1.0, xmax)
        scale = ((xmax - xmin) / self.maxq).to(self.scales.dtype)
        # A range too small for the storage dtype would round to a scale of 0.
        scale = torch.where(scale > 0, scale, torch.finfo(scale.dtype).tiny)
        self.scale = scale.float()
        if self.sym:
            self.zero = torch.full_like(self.scale, (self.maxq + 1) // 2)
        else:
            self.zero = torch.round(-xmin / self.scale).clamp(0, self.maxq)
        self.scales[group], self.zeros[group] = scale, self.zero.to(torch.int32)

    def quantize(self, j: int, w: torch.Tensor) -> torch.Tensor:
        """Records the codes of column j and returns its dequantized value."""
        q = torch.clamp(torch.round(w / self.scale) + self.zero, 0, self.maxq)
        self.codes[j] = q.to(torch.int32)
        return self.scale * (q - self.zero)


def _quantize_columns(W: torch.Tensor, U: torch.Tensor, grid: _Grid) -> torch.Tensor:
    """The column loop of GPTQ (paper, Algorithm 1): returns the dequantized
    weight Q [N, K] (W itself is left as it was). The loop runs on a
    transposed copy of W, which takes the error feedback, so that each
    column it reads and writes is contiguous (on [N, K] every column touches
    N cache lines); the arithmetic is the same, element for element."""
    N, K = W.shape
    Wt = W.t().contiguous()
    Qt = torch.empty_like(Wt)
    for b0 in range(0, K, BLOCK_SIZE):
        b1 = min(b0 + BLOCK_SIZE, K)
        block = Wt[b0:b1].clone()
        errors = torch.empty(b1 - b0, N, dtype=W.dtype, device=W.device)
        for i in range(b1 - b0):
            j = b0 + i
            if j % grid.group_size == 0:
                grid.start_group(j // grid.group_size, _current_group(Wt, block, errors, U, b0, i,
                                                                      min(j + grid.group_size, K)))
            q = Qt[j] = grid.quantize(j, block[i])
            # Eq. 3: delta_F = -(w_j - q_j) / [H_F^-1]_jj * (H_F^-1)_{j,F}; only the
            # columns in this block are updated now.
            err = errors[i] = (block[i] - q) / U[j, j]
            block[i + 1:] -= U[j, j + 1:b1, None] * err
        # Lazy batch-update: the rest of W gets the whole block's feedback at once.
        Wt[b1:] -= U[b0:b1, b1:].t() @ errors
    return Qt.t()


def _current_group(Wt, block, errors, U, b0, i, end) -> torch.Tensor:
    """The current weights [N, end - b0 - i] of the group of columns b0+i ..
    end-1, from the transposed weight Wt [K, N] and block [B, N]: those in
    the block carry every update so far; those past it still lack the
    pending feedback of the block's first i columns."""
    b1 = b0 + block.shape[0]
    inside = block[i:min(end, b1) - b0]
    if end <= b1:
        return inside.t()
    outside = Wt[b1:end] - U[b0:b0 + i, b1:end].t() @ errors[:i]
    return torch.cat([inside, outside], dim=0).t()


def quantize_linear(linear: nn.Linear, hessian: torch.Tensor, bits: int, group_size: int = 128, sym: bool = True,
                    desc_act: bool = False, checkpoint_format: str = "gptq_v2", damp_percent: float = 0.01,
                    dtype: torch.dtype = torch.float16) -> GPTQLinear:
    """A GPTQLinear holding the GPTQ quantization of `linear` (scales and bias
    in `dtype`). GPTQ v1 ("gptq") stores zero-1 and cannot hold a zero point
    of 0: asymmetric groups that need one raise ValueError."""
    check_format(checkpoint_format, "GPTQ")
    _check_args(bits, group_size, damp_percent, dtype, "dtype")
    check_scale_dtype("quantize_linear", dtype)  # the layer's: before the work
    sym, desc_act = check_flag("quantize_linear", "sym", sym), check_flag("quantize_linear", "desc_act", desc_act)
    check_packable("quantize_linear", linear.weight, bits)  # before the work
    r = gptq_weight(linear.weight, hessian, bits, group_size, sym, desc_act, damp_percent, dtype)
    zeros = r.zeros
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise ValueError("GPTQ: GPTQ v1 ('gptq') stores zero-1 and cannot represent a zero point of 0, which "
                             "this asymmetric weight needs; use checkpoint_format='gptq_v2'")
        zeros = zeros - 1
    device = linear.weight.device
    layer = GPTQLinear(linear.in_features, linear.out_features, bits, group_size, sym, desc_act, checkpoint_format,
                       linear.bias is not None, dtype, device)
    with torch.no_grad():
        # Packing is an offline step with a CPU kernel only.
        layer.qweight.copy_(torch.ops.lowbit.gptq_pack(r.codes.cpu(), bits, 0))
        layer.qzeros.copy_(torch.ops.lowbit.gptq_pack(zeros.cpu(), bits, 1))
        layer.scales.copy_(r.scales)
        layer.g_idx.copy_(r.g_idx)
        if linear.bias is not None:
            layer.bias.copy_(linear.bias)
    return layer


def quantize(model: nn.Module, calibration_batches: Iterable[Any], bits: int, group_size: int = 128,
             sym: bool = True, desc_act: bool = False, checkpoint_format: str = "gptq_v2",
             damp_percent: float = 0.01, lm_head: bool = False, progress: bool = True) -> GPTQConfig:
    """GPTQ-quantizes an HF LlamaForCausalLM-style model in place: every
    nn.Linear of its decoder layers (model.model.layers) but one-output ones
    (Qwen2-MoE's shared-expert gate, which GPTQ checkpoints keep in float),
    and the LM head with `lm_head`, becomes a GPTQLinear; every
    mixture-of-experts experts module (Qwen3-MoE, Qwen2-MoE, Mixtral) a
    GPTQExperts. Experts that no calibration token reaches are rounded to
    nearest (the GPTQ of an identity Hessian), with a warning. Returns the
    config that lowbit.save_gptq needs to write it as an HF GPTQ checkpoint.

    `calibration_batches` are token id tensors [batch, seq] or dicts of
    model(**batch) keyword arguments (input_ids, attention_mask), read once
    (a generator will do); positions an attention_mask [batch, seq] masks
    (padding) add nothing to a Hessian (but for experts', whose inputs are
    the tokens routed to them). Work happens on the model's device; besides the
    model it holds one layer's inputs for all batches and one Hessian.
    A refusal raised midway (a v1 zero point of 0) leaves the Linears before
    it quantized.
    """
    _check_args(bits, group_size, damp_percent)
    check_format(checkpoint_format, "GPTQ")
    sym, desc_act = check_flag("quantize", "sym", sym), check_flag("quantize", "desc_act", desc_act)
    lm_head, progress = check_flag("quantize", "lm_head", lm_head), check_flag("quantize", "progress", progress)
    decoder = getattr(model, "model", None)
    if not isinstance(getattr(decoder, "layers", None), nn.ModuleList):
        raise ValueError("quantize: expected an HF causal LM with decoder layers at model.model.layers")
    if not isinstance(calibration_batches, Iterable):  # a for loop's TypeError would name no argument
        raise TypeError(f"quantize: calibration_batches must be an iterable of batches, got "
                        f"{type(calibration_batches).__name__}")
    if lm_head and (getattr(model.config, "tie_word_embeddings", False)
                    or getattr(getattr(model, "lm_head", None), "weight", None) is model.get_input_embeddings().weight):
        # vLLM loads such a checkpoint's head as the embedding, skipping the quantized one; GPTQModel refuses it.
        raise ValueError("quantize: lm_head=True, but the LM head is tied to the token embedding "
                         "(tie_word_embeddings): untie it first (its own weight and tie_word_embeddings=False)")

    def quantize_one(linear: nn.Linear, hessian: torch.Tensor) -> GPTQLinear:
        return quantize_linear(linear, hessian, bits, group_size, sym, desc_act, checkpoint_format, damp_percent)

    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            hidden, extras, kept = _layer_inputs(model, decoder.layers, calibration_batches)
            for index, layer in enumerate(tqdm(decoder.layers, desc="GPTQ layers", disable=not progress)):
                inputs = [_with_hidden(args, kwargs, h) for h, (args, kwargs) in zip(hidden, extras[index])]
                _quantize_layer(layer, f"model.layers.{index}", inputs, kept, quantize_one)
                hidden = [_run(layer, args, kwargs) for args, kwargs in inputs]
            if lm_head:
                _quantize_lm_head(model, decoder.norm, hidden, kept, quantize_one)
    finally:
        model.train(training)
    refuse_save_pretrained(model, GPTQ_SAVE_ADVICE)
    return GPTQConfig(bits=bits, group_size=group_size, desc_act=desc_act, sym=sym,
                      checkpoint_format=checkpoint_format, lm_head=lm_head)


class _Captured(Exception):
    """Stops the model's forward once the last decoder layer's inputs are in."""


class _StageInputsIn(Exception):
    """Stops a decoder layer's forward once a stage's Linear has its input."""


def _layer_inputs(model: nn.Module, layers: nn.ModuleList, batches: Iterable[Any]) -> tuple[list, list, list]:
    """(the first decoder layer's hidden states per calibration batch, per
    layer and batch the (args, kwargs) the float model gives that layer with
    its hidden states left out: None, per batch its attention_mask [batch,
    seq] as bools where it gives one). Each layer's own, as masks and rotary
    embeddings can differ by layer type (Gemma 2/3's sliding and global
    layers, Qwen2's sliding-window ones); they do not depend on the weights,
    so one forward of the float model finds them; only the first layer's
    hidden states are kept."""
    hidden, extras, kept = [], [[] for _ in layers], []

    def capture(index, module, args, kwargs):
        h, args, kwargs = (args[0], (None, *args[1:]), kwargs) if args else (
            kwargs["hidden_states"], args, {**kwargs, "hidden_states": None})
        if index == 0:
            hidden.append(h)
        extras[index].append((args, kwargs))
        if index == len(layers) - 1:
            raise _Captured

    hooks = [layer.register_forward_pre_hook(lambda module, args, kwargs, i=i: capture(i, module, args, kwargs),
                                             with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for number, batch in enumerate(batches):
            kwargs = dict(batch) if isinstance(batch, Mapping) else {"input_ids": batch}
            _check_token_ids(model, number, kwargs.get("input_ids"))
            mask = kwargs.get("attention_mask")
            kept.append(mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None)
            try:
                # No KV cache: each layer will run again on the same inputs.
                model(**kwargs, use_cache=False)
            except _Captured:
                pass
    finally:
        for hook in hooks:
            hook.remove()
    if not hidden:
        raise ValueError("quantize: calibration_batches is empty")
    if any(len(e) != len(hidden) for e in extras):
        raise ValueError("quantize: the model's forward did not run every decoder layer once per batch")
    return hidden, extras, kept


def _check_token_ids(model: nn.Module, number: int, ids) -> None:
    """Refuses calibration batch `number`'s input_ids unless they are token ids
    [batch, seq] of the model's vocabulary (None: the batch gives none, as
    with inputs_embeds): a list, floats, a 1-D row (a 2-D tensor iterated as
    the batches), an empty sequence or an id past the embedding fail inside
    the model, with errors that name neither quantize nor the batch."""
    if ids is None:
        return
    where = f"quantize: calibration batch {number}: input_ids"
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{where} must be a tensor of token ids [batch, seq], got {type(ids).__name__}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or ids.dim() != 2 or not ids.numel():
        raise ValueError(f"{where} must be token ids [batch, seq] with batch, seq > 0, got {ids.dtype} "
                         f"{list(ids.shape)}")
    vocab = getattr(getattr(model, "get_input_embeddings", lambda: None)(), "num_embeddings", None)
    if is_integer(vocab) and has_values(ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab:
            raise ValueError(f"{where} must lie in [0, {vocab}) (the embedding's rows), found [{low}, {high}]")


def _kept_rows(x: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """A Linear's input [batch, seq, in] (or [batch * seq, in], as Qwen2-MoE's
    shared expert takes it) without the positions the batch's attention mask
    leaves out (padding); any other input (routed experts') as it is."""
    if kept is None:
        return x
    if x.shape[:-1] == kept.shape:
        return x[kept]
    return x[kept.reshape(-1)] if x.shape[:-1] == (kept.numel(),) else x


def _run(layer: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor:
    out = layer(*args, **kwargs)
    return out[0] if isinstance(out, tuple) else out  # transformers 4 layers return tuples


def _with_hidden(args: tuple, kwargs: dict, hidden: torch.Tensor) -> tuple[tuple, dict]:
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}


def _quantize_layer(layer: nn.Module, prefix: str, inputs, kept: list, quantize_one) -> None:
    """Quantizes the Linears of one decoder layer, stage after stage, each
    from inputs that went through the stages quantized before it. A stage is
    one Linear group (Linears sharing an input share its Hessian), or every
    expert's gate/up, or every expert's down, of one experts module."""
    _split_experts(layer, prefix)
    linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear) and m.out_features > 1}
    repeated = set()
    for stage in _stages(layer, linears, inputs[0], prefix, repeated):
        hessians = [Hessian(linears[group[0]].in_features, linears[group[0]].weight.device) for group in stage]
        # A stage of one group that the layer calls once has all its inputs when
        # that call starts: the rest of the layer's forward is skipped.
        stop = len(stage) == 1 and stage[0][0] not in repeated

        batch = [None]  # the attention mask of the batch running

        def add(h: Hessian, x: torch.Tensor) -> None:
            h.add(_kept_rows(x, batch[0]))
            if stop:
                raise _StageInputsIn

        hooks = [linears[group[0]].register_forward_pre_hook(lambda module, args, h=h: add(h, args[0]))
                 for group, h in zip(stage, hessians)]
        try:
            for (args, kwargs), mask in zip(inputs, kept):
                batch[0] = mask
                try:
                    _run(layer, args, kwargs)
                except _StageInputsIn:
                    pass
        finally:
            for hook in hooks:
                hook.remove()
        unreached = []
        for group, hessian in zip(stage, hessians):
            if hessian.rows == 0:  # only an expert's: every other Linear ran on the sample
                unreached.append(group[0].rpartition(".")[0])
                H = torch.eye(hessian.sum.shape[0], dtype=torch.float64, device=hessian.sum.device)
            else:
                H = hessian.value()
            for name in group:
                try:
                    layer.set_submodule(name, quantize_one(linears[name], H))
                except ValueError as e:
                    raise ValueError(f"quantize: {prefix}.{name}: {e}") from e
        if unreached:
            warnings.warn(f"quantize: no calibration token reached {len(unreached)} experts of {prefix} "
                          f"({', '.join(unreached[:4])}{', ...' if len(unreached) > 4 else ''}): rounded to nearest")


def _split_experts(layer: nn.Module, prefix: str) -> None:
    """Each transformers experts module of the layer (3-D gate_up_proj [E,
    2I, H], gate rows first, and down_proj [E, H, I]) becomes a GPTQExperts
    of float nn.Linear experts computing the same."""
    for name, module in list(layer.named_modules()):
        if experts_dims(module) is None:
            continue
        if not plain_experts(module):
            params = sorted(n for n, _ in module.named_parameters())
            raise ValueError(f"quantize: {prefix}.{name} ({type(module).__name__}, parameters {params}) is "
                             "not an experts module GPTQExperts computes (gate_up_proj and down_proj, act_fn)")
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        half = gate_up.shape[1] // 2
        layer.set_submodule(name, GPTQExperts([GPTQExpert(_linear(w[:half]), _linear(w[half:]), _linear(d))
                                               for w, d in zip(gate_up, down)], module.act_fn))


def _linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear over `weight` itself (no copy)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _stages(layer: nn.Module, linears: dict[str, nn.Linear], sample, prefix: str,
            repeated: set[str]) -> list[list[list[str]]]:
    """The layer's Linear groups in call order (_groups_by_input), each its
    own stage, with the experts' in two stages per experts module: all the
    gate/up groups where its first gate/up runs, all the downs where its
    first down runs. Adds the Linears called more than once to `repeated`."""
    experts: dict[str, dict[int, None]] = {}
    for name in linears:
        m = EXPERT_LAYER.fullmatch(name)
        if m:
            experts.setdefault(m["experts"], {})[int(m["expert"])] = None
    stages, placed = [], set()
    for group in _groups_by_input(layer, linears, sample, prefix, repeated, optional=experts.keys()):
        m = EXPERT_LAYER.fullmatch(group[0])
        if m is None:
            stages.append([group])
            continue
        down = m["projection"] == "down_proj"
        if (m["experts"], down) not in placed:
            placed.add((m["experts"], down))
            stages.append([[f"{m['experts']}.{e}.down_proj"] if down else
                           [f"{m['experts']}.{e}.gate_proj", f"{m['experts']}.{e}.up_proj"]
                           for e in experts[m["experts"]]])
    return stages


def _groups_by_input(layer: nn.Module, linears: dict[str, nn.Linear], sample, prefix: str, repeated: set[str],
                     optional: Iterable[str] = ()) -> list[list[str]]:
    """The layer's Linears in call order, grouped by the input tensor they
    read (q/k/v all read the normed hidden states), from one forward pass;
    those called more than once go into `repeated`. Linears under the
    `optional` modules (experts: the sample need not reach all of them) may
    not run; every other one must."""
    calls = []
    hooks = [m.register_forward_hook(lambda module, args, out, name=name: calls.append((name, args[0])))
             for name, m in linears.items()]
    try:
        _run(layer, *sample)
    finally:
        for hook in hooks:
            hook.remove()
    groups, seen, previous = [], set(), None
    for name, x in calls:  # `calls` keeps the inputs alive, so `is` cannot confuse two tensors
        if name in seen:
            repeated.add(name)
            continue
        if x is previous:
            groups[-1].append(name)
        else:
            groups.append([name])
        seen.add(name)
        previous = x
    unused = sorted(n for n in set(linears) - seen if not any(n.startswith(f"{o}.") for o in optional))
    if unused:
        raise ValueError(f"quantize: {[f'{prefix}.{n}' for n in unused]} never run in the forward pass, "
                         "so they have no calibration inputs")
    return groups


def _quantize_lm_head(model: nn.Module, norm: nn.Module, hidden, kept: list, quantize_one) -> None:
    """The LM head reads the final norm of the last layer's outputs."""
    head = model.lm_head
    hessian = Hessian(head.in_features, head.weight.device)
    for h, mask in zip(hidden, kept):
        hessian.add(_kept_rows(norm(h), mask))
    model.lm_head = quantize_one(head, hessian.value())
