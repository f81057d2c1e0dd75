"""Gradients of lowbit's ops.

The matmul ops differentiate with respect to their activations; the
quantized weights are frozen (integer tensors carry no gradient, and a float
tensor a weight is made of, such as GPTQ's scales, refuses to be
differentiated). The gradient is that of the dequantized weight W:
grad_x = grad_out @ W for the GGUF ops (x @ W.T), grad_out @ W.T for
gptq_gemm and gptq_gemm_a8 (x @ W). The 8-bit rounding of the activations
(the GGUF ops', gptq_gemm_a8's) counts as the identity, the straight-through
estimator of llama.cpp's training and of quantization-aware training. W is
decoded a tile of rows at a time, never whole in fp32, and the sums run in
fp32. The other ops with a float input refuse to be differentiated rather
than give no gradient silently.

Each op's autograd kernel is torch.library.register_autograd's, which
gives reverse mode through torch.autograd only (torch.func's grad, vjp and
jacrev refuse its ops; the layers refuse them by the op's name,
lowbit._frozen.call_layer_op), wrapped to carry forward-mode tangents
(forward_ad, torch.func.jvp, jacfwd), which that kernel alone would drop:
the matmuls' tangent is their product with the activations' tangent (its
8-bit rounding included, as of the activations), rms_norm's its
derivative's, and the other ops refuse a tangent as they refuse a gradient.
"""
import torch
import torch.autograd.forward_ad as fwAD
from torch._library.autograd import Info, make_autograd_impl

from ._frozen import has_tangent
from .gptq.packing import fields_per_pack, from_panels, words_per_pack

ops = torch.ops.lowbit
# Weights decoded per backward step: 4M fp32 values (16 MB), whole packs of K
# rows for GPTQ and whole 16-row tiles for the repacked GGUF layout.
TILE_VALUES = 1 << 22
_PACK_ROWS = 32  # a whole pack of K rows at every GPTQ bit width
_REPACK_ROWS = 16  # the repacked layout's tile (csrc/core/ggml_repack.h)


def _tiles(total: int, width: int, multiple: int, at_least: int = 1):
    """[start, end) tiles of `total` rows of `width` values: TILE_VALUES each,
    starts on a multiple of `multiple`, none shorter than `at_least` (the
    last absorbs a short remainder)."""
    step = max(at_least, TILE_VALUES // max(1, width))
    step = -(-step // multiple) * multiple
    start = 0
    while start < total:
        end = total if total - (start + step) < at_least else start + step
        yield start, end
        start = end


def _check_frozen(op: str, named: dict) -> None:
    for name, value in named.items():
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise RuntimeError(f"{op}: not differentiable with respect to {name} (lowbit's quantized weights are "
                               "frozen)")


def _refusing(op: str, names: tuple):
    """A setup_context that refuses any of `names` requiring grad."""
    def setup_context(ctx, inputs, output):
        _check_frozen(op, dict(zip(names, inputs)))
    return setup_context


def _no_backward(ctx, *grads):
    raise AssertionError("unreachable: setup_context refuses first")


_LIB = torch.library.Library("lowbit", "IMPL")


def _register(op: str, backward, setup_context, tangent=None) -> None:
    """register_autograd(op, backward, setup_context)'s kernel, carrying the
    forward-mode tangents of the op's inputs: tangent(args, tangents) gives
    the output's from the inputs' primals and tangents (None where an input
    has none); without `tangent` the op refuses them, naming the input, as
    setup_context refuses gradients."""
    reverse = make_autograd_impl(getattr(ops, op).default, Info(backward, setup_context))
    names = _arg_names(op)

    def kernel(keyset, *args):
        if not has_tangent(args):
            return reverse(keyset, *args)
        duals = [fwAD.unpack_dual(a) if isinstance(a, torch.Tensor) else (a, None) for a in args]
        primals, tangents = [p for p, _ in duals], [t for _, t in duals]
        if tangent is None:
            _refuse_tangents(op, names, tangents)
        out = reverse(keyset, *primals)
        return fwAD.make_dual(out, tangent(primals, tangents).to(out.dtype))

    _LIB.impl(op, kernel, "Autograd", with_keyset=True)


def _arg_names(op: str) -> list:
    return [a.name for a in getattr(ops, op).default._schema.arguments]


def _refuse_tangents(op: str, names, tangents, why: str = "lowbit's quantized weights are frozen") -> None:
    for name, t in zip(names, tangents):
        if t is not None:
            raise RuntimeError(f"{op}: not differentiable with respect to {name} (forward mode: {why})")


def _linear_in(op: str, index: int):
    """The tangent of an op linear in its argument `index` (the activations):
    the op of that argument's tangent. A tangent of another input (a
    weight's) is refused."""
    names = _arg_names(op)

    def tangent(args, tangents):
        _refuse_tangents(op, names[:index] + names[index + 1:], tangents[:index] + tangents[index + 1:])
        return getattr(ops, op)(*args[:index], tangents[index], *args[index + 1:])
    return tangent


# ---- gptq_gemm: out [..., N] = a [..., K] @ W [K, N] ------------------------------

_GPTQ_WEIGHT = ("b_q_weight", "b_gptq_qzeros", "b_gptq_scales", "b_g_idx")


def _gptq_setup(ctx, inputs, output):
    a, qweight, qzeros, scales, g_idx, use_exllama, use_v2_format, bit = inputs
    _check_frozen("gptq_gemm", dict(zip(_GPTQ_WEIGHT, inputs[1:5])))
    ctx.save_for_backward(qweight, qzeros, scales, g_idx)
    ctx.flags = (use_exllama, use_v2_format, bit, a.dtype)


def _gptq_backward(ctx, grad):
    return _gptq_grad(grad, *ctx.saved_tensors, *ctx.flags)


def _gptq_grad(grad, qweight, qzeros, scales, g_idx, use_exllama, use_v2_format, bit, dtype):
    if qweight.dim() == 3:  # the panel layout: the checkpoint's rows for gptq_dequantize
        qweight = from_panels(qweight)
    K = qweight.shape[0] // words_per_pack(bit) * fields_per_pack(bit)
    groups = scales.shape[0]
    g = grad.reshape(-1, grad.shape[-1]).float()
    # Shuffled weights (use_exllama): rows in g_idx's (q_perm's) order, row i
    # of group i // (K / groups); the plain ones carry their own g_idx.
    shuffled_or_even = use_exllama or g_idx.numel() == 0
    rows_of = lambda k0, k1: torch.arange(k0, k1, device=qweight.device, dtype=torch.int32) // (K // groups)
    parts = []
    # At least `groups` rows a tile: gptq_dequantize takes no more groups than rows.
    for k0, k1 in _tiles(K, qweight.shape[1], _PACK_ROWS, at_least=groups):
        rows = qweight[k0 * bit // 32:k1 * bit // 32]
        idx = rows_of(k0, k1) if shuffled_or_even else g_idx[k0:k1]
        W = ops.gptq_dequantize(rows, qzeros, scales.float(), idx, use_v2_format, bit)  # [k1 - k0, N]
        parts.append(g @ W.t())
    grad_a = torch.cat(parts, dim=1)
    if use_exllama and g_idx.numel():  # out = a[..., perm] @ W_shuffled
        grad_a = torch.empty_like(grad_a).index_copy_(1, g_idx.long(), grad_a)
    return (grad_a.to(dtype).reshape(*grad.shape[:-1], K),) + (None,) * 7


_register("gptq_gemm", _gptq_backward, _gptq_setup, _linear_in("gptq_gemm", 0))


# gptq_gemm_a8: gptq_gemm's gradient, its rounding of the activations the identity.
def _gptq_a8_setup(ctx, inputs, output):
    a, qweight, qzeros, scales, g_idx, use_v2_format, bit = inputs
    _check_frozen("gptq_gemm_a8", dict(zip(_GPTQ_WEIGHT, inputs[1:5])))
    ctx.save_for_backward(qweight, qzeros, scales, g_idx)
    ctx.flags = (False, use_v2_format, bit, a.dtype)


def _gptq_a8_backward(ctx, grad):
    return _gptq_grad(grad, *ctx.saved_tensors, *ctx.flags)[:7]


_register("gptq_gemm_a8", _gptq_a8_backward, _gptq_a8_setup, _linear_in("gptq_gemm_a8", 0))


# ---- GGUF matmuls: out [M, row] = X [M, n] @ W.T -----------------------------------

def _ggml_rows(W: torch.Tensor, type: int, n: int, repacked: bool, r0: int, r1: int) -> torch.Tensor:
    """fp32 rows [r0, r1) of a GGUF weight (r0 a whole tile of a repacked one)."""
    block, nbytes = ops.ggml_type_info(type)
    row_bytes = n // block * nbytes
    raw = W.reshape(-1)[r0 * row_bytes:r1 * row_bytes]
    if repacked:
        raw = ops.ggml_repack(raw, type, r1 - r0, n, True)
    return ops.ggml_dequantize(raw, type, r1 - r0, n, torch.float32)


def _grad_x(grad: torch.Tensor, W: torch.Tensor, type: int, rows: int, n: int, repacked: bool) -> torch.Tensor:
    """grad [P, rows] @ W [rows, n] in fp32, W decoded a tile at a time."""
    g = grad.float()
    out = g.new_zeros((g.shape[0], n))
    for r0, r1 in _tiles(rows, n, _REPACK_ROWS):
        out += g[:, r0:r1] @ _ggml_rows(W, type, n, repacked, r0, r1)
    return out


def _ggml_setup(ctx, inputs, output):
    W, X, type, row = inputs
    ctx.save_for_backward(W)
    ctx.args = (type, row, X.shape[1], X.dtype)


def _ggml_backward(repacked):
    def backward(ctx, grad):
        (W,) = ctx.saved_tensors
        type, row, n, dtype = ctx.args
        return None, _grad_x(grad, W, type, row, n, repacked).to(dtype), None, None
    return backward


for _op, _repacked in (("ggml_mul_mat_vec_a8", False), ("ggml_mul_mat_a8", False), ("ggml_mul_mat_repacked", True)):
    _register(_op, _ggml_backward(_repacked), _ggml_setup, _linear_in(_op, 1))


def _ggml_id_setup(ctx, inputs, output):
    W, X, ids, type, row = inputs
    ctx.save_for_backward(W, ids)
    ctx.args = (type, row, X.shape, X.dtype)


def _ggml_id_backward(repacked):
    def backward(ctx, grad):
        """Each expert's pairs at once: grad [pairs of e, row] @ W[e] (traced: every pair, masked)."""
        W, ids = ctx.saved_tensors
        qtype, row, x_shape, dtype = ctx.args
        n, tokens, slots = x_shape[-1], ids.shape[0], ids.shape[1]
        flat = ids.reshape(-1).long()
        g = grad.reshape(tokens * slots, row)  # -1 cannot be inferred where row == 0
        per_pair = g.new_zeros((tokens * slots, n), dtype=torch.float32)
        if type(flat) is torch.Tensor and not torch.compiler.is_compiling():  # values to group the pairs by
            for e in torch.unique(flat).tolist():
                pairs = (flat == e).nonzero().squeeze(1)
                per_pair[pairs] = _grad_x(g[pairs], W[e], qtype, row, n, repacked)
        else:  # traced: no shapes that hang on values; every expert over every pair (experts times the work)
            for e in range(W.shape[0]):
                per_pair = torch.where((flat == e).unsqueeze(1), _grad_x(g, W[e], qtype, row, n, repacked), per_pair)
        if len(x_shape) == 3:
            return None, per_pair.reshape(x_shape).to(dtype), None, None, None
        return None, per_pair.reshape(tokens, slots, n).sum(1).to(dtype), None, None, None
    return backward


for _op, _repacked in (("ggml_mul_mat_id", False), ("ggml_mul_mat_id_repacked", True)):
    _register(_op, _ggml_id_backward(_repacked), _ggml_id_setup, _linear_in(_op, 1))


# ---- ops that take a float input but are not differentiated -----------------------

for _op, _names in (("gptq_dequantize", _GPTQ_WEIGHT), ("gptq_permute_cols", ("qweight", "qzeros", "scales", "perm")),
                    ("ggml_quantize", ("x",))):
    _register(_op, _no_backward, _refusing(_op, _names))


# ---- rms_norm: y = weight * x r, r = rsqrt(mean(x^2) + eps) -----------------------

def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    """In fp32; the rounding of x r to x's dtype counts as the identity."""
    x, weight = ctx.saved_tensors
    xf, gw = x.float(), grad.float() * weight.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
    normed = xf * r
    grad_x = r * (gw - normed * (gw * normed).mean(-1, keepdim=True))
    products = grad.float() * normed
    grad_weight = products.flatten(0, -2).sum(0) if products.dim() > 1 else products  # a last dim of 0 too
    return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def _rms_norm_tangent(args, tangents):
    """d(weight * x r) = weight (dx r - x r^3 mean(x dx)) + dweight x r, in fp32."""
    (x, weight, eps), (dx, dweight, _) = args, tangents
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = torch.zeros_like(xf)
    if dx is not None:
        out = out + weight.float() * r * (dx.float() - xf * r.pow(2) * (xf * dx.float()).mean(-1, keepdim=True))
    if dweight is not None:
        out = out + dweight.float() * xf * r
    return out


_register("rms_norm", _rms_norm_backward, _rms_norm_setup, _rms_norm_tangent)



# ---- decode_attention: writes its caches, so autograd cannot take a formula -------

_DECODE_ATTENTION_ARGS = ("q", "k", "v", "cos", "sin", "key_cache", "value_cache", "sinks")


def _decode_attention_autograd(q, k, v, cos, sin, key_cache, value_cache, position, scale, start=0, sinks=None,
                               softcap=0.0):
    """Refuses inputs that require grad or carry a forward-mode tangent (an
    inference step); runs the op otherwise."""
    tensors = (q, k, v, cos, sin, key_cache, value_cache, sinks)
    _refuse_tangents("decode_attention", _DECODE_ATTENTION_ARGS,
                     [None if t is None else fwAD.unpack_dual(t).tangent for t in tensors],
                     "an inference step that writes its caches in place")
    if torch.is_grad_enabled():
        for name, value in zip(_DECODE_ATTENTION_ARGS, (q, k, v, cos, sin, key_cache, value_cache, sinks)):
            if value is not None and value.requires_grad:
                raise RuntimeError(f"decode_attention: not differentiable (an inference step that writes its caches "
                                   f"in place), and {name} requires grad")
    with torch._C._AutoDispatchBelowAutograd():
        out = ops.decode_attention(q, k, v, cos, sin, key_cache, value_cache, position, scale, start, sinks,
                                   softcap)
    # Below autograd nothing counts the caches' writes: a graph that saved
    # them for backward must see that they changed and refuse.
    torch.autograd.graph.increment_version([t for t in (key_cache, value_cache) if not t.is_inference()])
    return out


_LIB.impl("decode_attention", _decode_attention_autograd, "Autograd")
