"""Decode steps without transformers' per-layer machinery.

A decode step of a small model is mostly host time: transformers runs each
layer through a dozen module calls, builds an attention mask, applies the
rotary embedding with a handful of ops per tensor and appends each token's
keys and values to its cache by copying the whole cache (torch.cat).

fast_decoding(model) lets a llama-family model (DECODER_LAYERS) run each
decode call that needs none of that (one new token, batch 1, CPU, no
gradients, no autocast region, a DynamicCache, no outputs beyond the
logits and the cache) as one loop over its layers, per layer two lowbit
ops besides the projections: rms_norm and decode_attention (the rotation,
the new key and value, and the attention in one call). Where every
projection is a lowbit layer or an
nn.Linear, the loop is C++ (torch.classes.lowbit.DecodeStep, described from
the model's modules once per generation: at the first step after a call the
step does not serve, such as the prompt's, and dropped as the model's
generate call ends, since it holds every projection's tensors), so a step
costs one call from Python; otherwise it is Python over the model's own
modules (LoRA adapters and all). Keys and values go into buffers that grow
by doubling, whose rows the model's DynamicCache holds as views, so a token
costs a row of each rather than a copy of the cache (a sliding window's
cache keeps its last rows: a view moving along its buffer). Results match
the model's own forward to fp32 rounding (the attention sums in another
order). Every other call (a prompt, a batch, a static cache, torch.compile,
training: gradients, or dropout or router jitter in training mode; a
forward hook on any module below the model: a layer, its attention, MLP,
norms or projections, other than transformers' output-capturing hooks,
which record nothing in a call asking for no outputs) runs the model's own
forward on the same cache.
Within one generation the C++ step sees new tensor values, new modules in
a projection's place and new hooks, but not a layer changed in its own
state between two steps (a repack, a switch of int8_activations): those
take effect from the next generation. load_gguf_model and load_gptq_model
set it.
"""
from __future__ import annotations

import functools
import inspect
import operator
import sys

import torch
from torch import nn
from torch.nn import functional as F

from ._checks import check_flag, check_module
from ._frozen import autocast_dtype, below_autograd, leave_autograd
from .fusing import PROJECTION_GROUPS, ProjectionSlice
from .threads import _STATE, ThreadedForward, _ModelAttribute, split_call, wrap_generate

__all__ = ["DECODER_LAYERS", "fast_decoding"]

# The decoder layers a step reproduces: pre-norm attention (q, k and v
# projections, an optional RMSNorm per head on q and k, the rotary
# embedding, grouped-query attention, over a sliding window where the layer
# has one) and a gated MLP, each added to the residual. SmolLM3 leaves the
# rotation out of its NoPE layers; Granite scales the embeddings, each
# sublayer's output and the logits (_Scales); Phi-3 holds q, k and v as one
# qkv_proj and gate and up as one gate_up_proj (_native_qkv_sizes,
# _native_gate_up_sizes). The mixture-of-experts layers (Qwen2-MoE,
# Qwen3-MoE, Mixtral, gpt-oss) put a sparse block in the MLP's place, which
# the Python loop calls as it stands (its router and experts). Gemma scales
# its norms by 1 + weight and gates with GELU; Gemma 2 and 3 add a norm
# after each sublayer and may soft-cap the logits; Gemma 2 soft-caps the
# attention scores too (decode_attention's softcap), Gemma 3 has rotary
# tables per layer type (sliding or full attention). gpt-oss adds attention
# sinks (decode_attention's sinks) and rotary tables that hold each
# frequency once. The C++ step computes Qwen3-MoE's and Mixtral's blocks over
# GGUFExperts (their router and the experts' ops); it declines the other
# experts and Gemma in 16 bits, which the Python loop serves.
DECODER_LAYERS = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                  "SmolLM3DecoderLayer", "GraniteDecoderLayer", "Phi3DecoderLayer",
                  "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "GemmaDecoderLayer",
                  "Gemma2DecoderLayer", "Gemma3DecoderLayer", "GptOssDecoderLayer")
# The norms that scale by 1 + weight in fp32 before rounding (Gemma's).
_ONE_PLUS_WEIGHT_NORMS = ("GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm")
# The norms that scale in fp32 before rounding (gpt-oss's): lowbit's op,
# which rounds first, is theirs in fp32 only.
_FP32_SCALING_NORMS = ("GptOssRMSNorm",)
# The rotary embeddings whose tables hold each frequency once, for both
# halves of a head (gpt-oss's): decode_attention takes them twice over.
_HALF_TABLE_ROTARY = ("GptOssRotaryEmbedding",)
# The layers whose rotation covers each head's first len(cos) values and
# passes the rest through (a partial rotary factor: Phi-4-mini's 96 of 128),
# as decode_attention does; the others rotate whole heads only.
_PARTIAL_ROTARY_LAYERS = ("Phi3DecoderLayer",)

STEP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the step's ops take
# The keyword arguments a served call may carry beyond input_ids, cache,
# attention_mask and position_ids, with the values it may carry them with.
_SERVED_VALUES = {"inputs_embeds": (None,), "labels": (None,), "output_attentions": (None, False),
                  "output_hidden_states": (None, False), "return_dict": (None, True), "use_cache": (None, True),
                  "logits_to_keep": (0, 1)}


class _Scales:
    """Granite's multipliers, as its modules apply them: the embeddings'
    (GraniteModel), each sublayer output's before it is added to the residual
    (GraniteDecoderLayer) and the logits' divisor (GraniteForCausalLM's
    config.logits_scaling); 1 for the other served models."""

    def __init__(self, model: nn.Module):
        granite = type(model).__name__ == "GraniteForCausalLM"
        self.embedding = float(model.model.embedding_multiplier) if granite else 1.0
        self.logits_divisor = float(model.config.logits_scaling) if granite else 1.0

    @staticmethod
    def residual(layer: nn.Module) -> float:
        return float(getattr(layer, "residual_multiplier", 1.0))


def _native_qkv_sizes(attn: nn.Module) -> list[int] | None:
    """Phi-3's attention: one qkv_proj, no q_proj; the widths of q, k and v
    in its output. None for attention with q, k and v projections of its own."""
    if "q_proj" in attn._modules:
        return None
    kv = attn.num_key_value_heads * attn.head_dim
    return [attn.config.num_attention_heads * attn.head_dim, kv, kv]


def _native_gate_up_sizes(mlp: nn.Module) -> list[int] | None:
    """Phi-3's MLP: one gate_up_proj, gate's rows then up's; None otherwise."""
    if "gate_proj" in mlp._modules:
        return None
    half = mlp._modules["gate_up_proj"].out_features // 2
    return [half, half]


def _mixture_of_experts(mlp: nn.Module) -> bool:
    """Whether the MLP is a sparse mixture-of-experts block (a router and
    experts) rather than one gated MLP."""
    return "experts" in mlp._modules


def _rotary(attn: nn.Module) -> bool:
    """Whether the layer rotates q and k (SmolLM3's use_rope is 0 in its NoPE layers)."""
    return bool(getattr(attn, "use_rope", True))


def _scaled(out: torch.Tensor, scale: float) -> torch.Tensor:
    return out if scale == 1.0 else out * scale


def _norm_form(norm: nn.Module, dtype: torch.dtype) -> tuple[float, float] | None:
    """(offset, eps) with which lowbit's rms_norm op, given weight + offset,
    computes `norm` on activations of `dtype`: transformers' llama-family
    RMSNorm (normalized in fp32, scaled in the input's dtype) with offset 0;
    gpt-oss's, which scales in fp32, the same in fp32 only; Gemma's, which
    scales by 1 + weight in fp32, with offset 1 in fp32 only. None where the
    op does not compute it."""
    kind = type(norm).__name__
    if hasattr(norm, "variance_epsilon") and (kind not in _FP32_SCALING_NORMS or dtype == torch.float32):
        return 0.0, float(norm.variance_epsilon)
    if kind in _ONE_PLUS_WEIGHT_NORMS and dtype == torch.float32:
        return 1.0, float(norm.eps)
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """norm(x): by lowbit's op where _norm_form says it computes it (a
    llama-family weight of another dtype scaling the op's fp32 result), by
    the norm's own forward otherwise."""
    weight, form = norm.weight, _norm_form(norm, x.dtype)
    if form is None or (form[0] and weight.dtype != x.dtype):
        return norm(x)
    offset, eps = form
    if weight.dtype == x.dtype:
        return torch.ops.lowbit.rms_norm(x, weight + offset if offset else weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def _project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x) for one token's x ([1, 1, in] -> [1, out] or [1, 1, out]).
    A layer whose own class has an `op_call` (GGUFLinear, GPTQLinear: their
    forward is that op on the flattened rows, then the bias; not a subclass
    or a wrapper) and no hooks gets that op called directly, below autograd
    as the whole step is: the module call, its reshapes and its autograd
    check are a good part of a small matvec's host time."""
    op_call = type(module).__dict__.get("op_call")
    if op_call is None or module._forward_hooks or module._forward_pre_hooks or _global_hooks():
        return module(x)
    op, args = op_call(module, x.view(1, -1))
    y, bias = op(*args), module.bias
    return y if bias is None else y + bias.to(y.dtype)


def _global_hooks() -> bool:
    return bool(nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks)


# The module of transformers' output-capturing hooks: the first call asking
# for hidden states, attentions or router logits puts them on the model's
# layers for good; they record only while a call asking for outputs runs
# (its collector set), and a served call asks for none.
_CAPTURING = "transformers.utils.output_capturing"


def _live(hooks: dict) -> bool:
    """Whether `hooks` (a module's forward or pre-forward hooks) hold one that
    would act in a served call: any but transformers' idle output-capturing
    hooks (idle unless a model's call around this one collects outputs)."""
    if not hooks:
        return False
    collector = getattr(sys.modules.get(_CAPTURING), "_active_collector", None)
    return (collector is None or bool(collector.get())
            or any(getattr(hook, "__module__", None) != _CAPTURING for hook in hooks.values()))


def _skipped_hooks(model: nn.Module) -> bool:
    """Whether a forward hook would see a module the decode step runs
    without calling it (anything below model.model, the head): then the
    model's own forward serves the call, hooks and all."""
    return _global_hooks() or any(_live(m._forward_hooks) or _live(m._forward_pre_hooks)
                                  for part in (model.model, model.lm_head) for m in part.modules())


def _projections(attn: nn.Module, h: torch.Tensor):
    """q, k and v of h: one call of the fused layer where the three are its
    untouched slices (lowbit.fusing), the three modules otherwise."""
    modules = attn._modules
    native = _native_qkv_sizes(attn)
    if native is not None:
        return _project(modules["qkv_proj"], h).split(native, -1)
    q, k, v = modules["q_proj"], modules["k_proj"], modules["v_proj"]
    fused = modules.get("qkv_proj")
    if fused is not None and type(q) is ProjectionSlice and type(k) is ProjectionSlice and type(v) is ProjectionSlice:
        return _project(fused, h).split((q.out_features, k.out_features, v.out_features), -1)
    return _project(q, h), _project(k, h), _project(v, h)


def _mlp(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    modules = mlp._modules
    if _mixture_of_experts(mlp):
        out = mlp(h)  # the block's own routing and experts: a handful of ops, as the model runs them
        return out[0] if isinstance(out, tuple) else out  # gpt-oss's block returns the router's scores too
    native = _native_gate_up_sizes(mlp)
    if native is not None:
        g, u = _project(modules["gate_up_proj"], h).split(native, -1)
    else:
        gate, up, fused = modules["gate_proj"], modules["up_proj"], modules.get("gate_up_proj")
        if fused is not None and type(gate) is ProjectionSlice and type(up) is ProjectionSlice:
            gate_up = _project(fused, h)
            g, u = gate_up[..., :gate.out_features], gate_up[..., gate.out_features:]
        else:
            g, u = _project(gate, h), _project(up, h)
    return _project(modules["down_proj"], (F.silu(g) if _silu(mlp) else _activation(mlp)(g)) * u)


def _activation(mlp: nn.Module) -> nn.Module | None:
    """The gated MLP's activation module (act_fn; Phi-3's activation_fn)."""
    modules = mlp._modules
    act = modules.get("act_fn")
    return act if act is not None else modules.get("activation_fn")


def _silu(mlp: nn.Module) -> bool:
    """Whether the MLP gates with SiLU (transformers' SiLUActivation or torch's)."""
    return type(_activation(mlp)).__name__ in ("SiLUActivation", "SiLU")


def _gelu_tanh(mlp: nn.Module) -> bool:
    """Whether the MLP gates with torch's tanh GELU (transformers' GELUTanh)."""
    act = getattr(_activation(mlp), "act", None)
    return (type(_activation(mlp)).__name__ == "GELUTanh" and isinstance(act, functools.partial)
            and act.func is F.gelu and act.keywords == {"approximate": "tanh"} and not act.args)


def _buffers(cache_layer, rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Key and value buffers [1, heads, capacity, dim] and the row `first`
    where cache_layer's `rows` keys and values stand in them, row first +
    rows free: those of the last step where its tensors are still rows of
    them (a sliding window's move on by a row a step), new ones (the cache's
    rows copied in at row 0, twice the room) where not, or where they are full."""
    buffers = cache_layer.__dict__.get("_lowbit_buffers")
    keys, values = cache_layer.keys, cache_layer.values
    if buffers is not None:
        key_buffer, value_buffer = buffers
        row_bytes = key_buffer.stride(2) * key_buffer.element_size()
        offset = keys.data_ptr() - key_buffer.data_ptr()
        first = offset // row_bytes
        if (offset >= 0 and offset % row_bytes == 0 and first + rows < key_buffer.shape[2]
                and values.data_ptr() - value_buffer.data_ptr() == offset and keys.stride() == key_buffer.stride()
                and values.stride() == value_buffer.stride() and keys.shape[:2] == key_buffer.shape[:2]):
            return key_buffer, value_buffer, first
    capacity = max(2 * rows, rows + 64)
    buffers = tuple(t.new_empty(1, t.shape[1], capacity, t.shape[3]) for t in (keys, values))
    buffers[0][:, :, :rows] = keys
    buffers[1][:, :, :rows] = values
    cache_layer._lowbit_buffers = buffers
    return *buffers, 0


def _promote(cache_layer, dtype: torch.dtype) -> None:
    """The layer's keys and values in `dtype` where they are of a dtype that
    promotes to it (a prompt run under autocast leaves bf16 values, fp32
    keys), as the model's forward promotes them when it concatenates the new
    token's; those of a wider dtype stay as they are, for decode_attention to
    refuse them as the model's attention does."""
    for name in ("keys", "values"):
        t = getattr(cache_layer, name)
        if t.dtype != dtype and torch.promote_types(t.dtype, dtype) == dtype:
            setattr(cache_layer, name, t.to(dtype))


class _Unplannable(Exception):
    """A model part the C++ step does not take (the Python loop runs the step)."""


class _StepPlan:
    """The C++ step of a model (DecodeStep) and what it was made from: the
    modules in each projection's and norm's place and their tensors (checked
    before each step: a new module, a tensor replaced in one, as
    load_state_dict replaces a repacked or sorted layer's, or a hook there
    makes the step again or sends it back to Python)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.step = torch.classes.lowbit.DecodeStep()
        self.dtype = dtype
        # Each watched module's parent's _modules, its name there, the module;
        # and the hook dicts of those (and the model below the head) whose
        # forward the step skips: intact() compares them in bulk.
        self.parents: list[dict] = []
        self.names: list[str] = []
        self.modules: list[nn.Module] = []
        self.hook_dicts: list[dict] = []
        # Each watched module's _parameters and _buffers, a name there and the
        # tensor it held (kept alive here: the step holds the same storage).
        self.tensor_dicts: list[dict] = []
        self.tensor_names: list[str] = []
        self.tensors: list[torch.Tensor | None] = []
        # Layers whose template holds a private copy of their rows (act-order
        # GPTQ layers with unsorted rows), each with that copy's plan: checked
        # as the layer's own forward checks it (a write in place changes no tensor).
        self.copies: list[tuple[nn.Module, tuple]] = []
        self.norm_offset: float | None = None  # 1 for Gemma's norms, 0 for the others; one kind per model
        self.activation: str | None = None
        # The layer types with rotary tables of their own (run's cos and sin rows), in their order there.
        self.table_kinds = sorted(set(model.config.layer_types)) if _layer_rotary(model) else None
        inner = model.model
        self.hook_dicts += [inner._forward_hooks, inner._forward_pre_hooks]
        for i in range(len(inner.layers)):
            self._layer(self._watch(inner.layers, str(i)))
        norm_weight, norm_eps = self._norm(inner, "norm")
        self.step.head(norm_weight, norm_eps, self._projection(model, "lm_head"), _Scales(model).logits_divisor)
        softcap = getattr(model.config, "final_logit_softcapping", None) or 0.0
        self.step.style(self.norm_offset, self.activation, softcap)
        if not self.intact():
            raise _Unplannable("hooks")

    def _watch(self, parent: nn.Module, name: str) -> nn.Module:
        module = parent._modules.get(name)
        if module is None:
            raise _Unplannable(name)
        self.parents.append(parent._modules)
        self.names.append(name)
        self.modules.append(module)
        self.hook_dicts += [module._forward_hooks, module._forward_pre_hooks]  # the step skips its forward
        for tensors in (module._parameters, module._buffers):
            for key, tensor in tensors.items():
                self.tensor_dicts.append(tensors)
                self.tensor_names.append(key)
                self.tensors.append(tensor)
        return module

    def _norm(self, parent: nn.Module, name: str) -> tuple[torch.Tensor, float]:
        """The weight and eps of a norm the step's rms_norm computes
        (_norm_form), its offset the same for every norm of the model."""
        norm = self._watch(parent, name)
        weight, form = norm._parameters.get("weight"), _norm_form(norm, self.dtype)
        if form is None or weight is None or weight.dtype != self.dtype or self.norm_offset not in (None, form[0]):
            raise _Unplannable(name)
        self.norm_offset, eps = form
        return weight, eps

    def _projection(self, parent: nn.Module, name: str) -> int:
        module = self._watch(parent, name)
        probe = torch.empty(1, module.in_features, dtype=self.dtype)
        if type(module) is nn.Linear:
            op, args, perm, bias = torch.ops.aten.linear.default, (probe, module.weight, module.bias), None, None
        elif "op_template" in type(module).__dict__:
            op, args, perm = module.op_template(probe)
            bias = module.bias
            copy = module.private_copy() if hasattr(module, "private_copy") else None
            if copy is not None:
                self.copies.append((module, copy))
        else:
            raise _Unplannable(name)
        at = [i for i, a in enumerate(args) if a is probe]
        if len(at) != 1:
            raise _Unplannable(name)
        op = op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
        name_, overload = op._schema.name, op._schema.overload_name
        rest = [a for i, a in enumerate(args) if i != at[0]]
        return self.step.projection(name_, overload, rest, at[0], perm, bias)

    def _group(self, parent: nn.Module, names: tuple[str, ...]) -> tuple[list[int], list[int]]:
        """The projections whose outputs, side by side, are those of `names`
        (lowbit.fusing's fused layers where they stand for a run of them):
        their ids, and each name's width."""
        modules = [self._watch(parent, name) for name in names]
        ids, i = [], 0
        while i < len(modules):
            part = modules[i]
            if type(part) is not ProjectionSlice:
                ids.append(self._projection(parent, names[i]))
                i += 1
                continue
            outputs = part.outputs
            run = modules[i:i + len(outputs.sizes)]
            whole = len(run) == len(outputs.sizes) and all(
                type(m) is ProjectionSlice and m.outputs is outputs and m.index == j for j, m in enumerate(run))
            if not whole or parent._modules.get(part.fused_name) is not outputs.layer:
                raise _Unplannable(names[i])
            ids.append(self._projection(parent, part.fused_name))
            i += len(run)
        return ids, [m.out_features for m in modules]

    def _layer(self, layer: nn.Module) -> None:
        attn, mlp = self._watch(layer, "self_attn"), self._watch(layer, "mlp")
        if attn._parameters.get("sinks") is not None:
            raise _Unplannable("sinks")
        experts = self._experts(mlp) if _mixture_of_experts(mlp) else None
        activation = "silu" if _silu(experts or mlp) else "gelu_tanh" if _gelu_tanh(experts or mlp) else None
        if activation is None or self.activation not in (None, activation):
            raise _Unplannable("act_fn")
        self.activation = activation
        act_fn = _activation(experts or mlp)
        self.hook_dicts += [act_fn._forward_hooks, act_fn._forward_pre_hooks]  # the step computes it
        input_norm, input_eps = self._norm(layer, "input_layernorm")
        attn_out_norm = mlp_out_norm = None
        out_eps = 0.0
        if "pre_feedforward_layernorm" in layer._modules:  # Gemma: norms after each sublayer too
            (attn_out_norm, out_eps), (mlp_out_norm, mlp_out_eps) = (
                self._norm(layer, "post_attention_layernorm"), self._norm(layer, "post_feedforward_layernorm"))
            if mlp_out_eps != out_eps:
                raise _Unplannable("post_feedforward_layernorm")
            post_norm, post_eps = self._norm(layer, "pre_feedforward_layernorm")
        else:
            post_norm, post_eps = self._norm(layer, "post_attention_layernorm")
        qkv_sizes = _native_qkv_sizes(attn)
        qkv, qkv_sizes = (([self._projection(attn, "qkv_proj")], qkv_sizes) if qkv_sizes is not None
                          else self._group(attn, PROJECTION_GROUPS[0]))
        q_norm = k_norm = None
        qk_eps = 0.0
        if attn._modules.get("q_norm") is not None:
            (q_norm, qk_eps), (k_norm, k_eps) = self._norm(attn, "q_norm"), self._norm(attn, "k_norm")
            if k_eps != qk_eps:
                raise _Unplannable("k_norm")
        if experts is not None:  # the MLP layer_experts gives
            gate_up, gate_up_sizes, down = [], [], -1
        else:
            gate_up_sizes = _native_gate_up_sizes(mlp)
            gate_up, gate_up_sizes = (([self._projection(mlp, "gate_up_proj")], gate_up_sizes)
                                      if gate_up_sizes is not None else self._group(mlp, PROJECTION_GROUPS[1]))
            if gate_up_sizes[0] != gate_up_sizes[1]:
                raise _Unplannable("up_proj")
            down = self._projection(mlp, "down_proj")
        self.step.layer(input_norm, input_eps, qkv, qkv_sizes, q_norm, k_norm, qk_eps,
                        self._projection(attn, "o_proj"), post_norm, post_eps, gate_up, gate_up_sizes, down,
                        attn.head_dim, float(attn.scaling), _rotary(attn), _Scales.residual(layer))
        if experts is not None:
            router, top_k, normalize, weights_in_dtype = self._router(mlp)
            self.step.layer_experts(router, top_k, normalize, weights_in_dtype,
                                    *(self._expert_projection(experts, name) for name in ("gate", "up", "down")))
        table = self.table_kinds.index(attn.layer_type) if self.table_kinds is not None else 0
        self.step.layer_extras(_window(layer) or 0, table, attn_out_norm, mlp_out_norm, out_eps, _softcap(attn))

    # The sparse blocks whose router the step computes (softmax over the
    # logits in fp32, the top k, renormalized): Qwen3-MoE's where its config
    # says so, Mixtral's always; their weights rounded to the logits' dtype
    # (Qwen3-MoE) or kept fp32 (Mixtral).
    _ROUTERS = {"Qwen3MoeSparseMoeBlock": (None, True), "MixtralSparseMoeBlock": (True, False)}

    def _experts(self, mlp: nn.Module) -> nn.Module:
        """The block's GGUFExperts, where the step computes the block: a
        router of _ROUTERS' and experts without biases or gpt-oss's GLU;
        the block, its router and its experts watched without hooks."""
        from .gguf.experts import GGUFExperts

        if type(mlp).__name__ not in self._ROUTERS or (mlp.training and getattr(mlp, "jitter_noise", 0)):
            raise _Unplannable("mlp")
        self._watch(mlp, "gate")  # the router: _router reads it
        experts = self._watch(mlp, "experts")
        if type(experts) is not GGUFExperts or experts.glu is not None or experts.biased:
            raise _Unplannable("experts")
        return experts

    def _router(self, mlp: nn.Module) -> tuple[torch.Tensor, int, bool, bool]:
        normalize, weights_in_dtype = self._ROUTERS[type(mlp).__name__]
        router = mlp._modules["gate"]
        weight = router._parameters.get("weight")
        if weight is None or weight.dtype != self.dtype:
            raise _Unplannable("gate")
        normalize = router.norm_topk_prob if normalize is None else normalize
        return weight, int(router.top_k), bool(normalize), weights_in_dtype

    def _expert_projection(self, experts: nn.Module, name: str) -> int:
        x, ids = torch.empty(1, 1, dtype=self.dtype), torch.empty(1, 1, dtype=torch.long)
        op, args = experts.op_template(name, x, ids)
        at = [[i for i, a in enumerate(args) if a is probe] for probe in (x, ids)]
        if any(len(places) != 1 for places in at):
            raise _Unplannable(name)
        op = op.default if isinstance(op, torch._ops.OpOverloadPacket) else op
        rest = [a for i, a in enumerate(args) if i not in (at[0][0], at[1][0])]
        return self.step.expert_projection(op._schema.name, op._schema.overload_name, rest, at[0][0], at[1][0])

    def intact(self) -> bool:
        """Whether the step still describes the model: the same modules in
        place (decoder layers, norms, projections) holding the same tensors,
        no hooks on them that would act (_live)."""
        return (not _global_hooks() and list(map(dict.get, self.parents, self.names)) == self.modules
                and (not any(self.hook_dicts) or not any(map(_live, self.hook_dicts)))
                and all(map(operator.is_, map(dict.get, self.tensor_dicts, self.tensor_names), self.tensors))
                and all(module.copy_current(copy) for module, copy in self.copies))

    def run(self, x, cos, sin, cache, n: int):
        layers = cache.layers
        buffers = []
        for c in layers:
            _promote(c, self.dtype)
            buffers.extend(c.__dict__.get("_lowbit_buffers") or (None, None))
        logits, keys, values, new = self.step.run(x, cos, sin, [c.keys for c in layers], [c.values for c in layers],
                                                  buffers, n)
        for i, c in enumerate(layers):
            k, v = keys[i], values[i]
            if c.is_sliding:  # a window's cache keeps its last window - 1 rows
                first = max(0, k.shape[2] - (c.sliding_window - 1))
                k, v = k[:, :, first:], v[:, :, first:]
                c.cumulative_length += 1
            c.keys, c.values, c._lowbit_buffers = k, v, (new[2 * i], new[2 * i + 1])
        return logits


def _servable_layer(layer: nn.Module) -> bool:
    """A decoder layer of DECODER_LAYERS' kinds whose attention is causal
    and whose MLP is experts or gated by an activation module."""
    modules = layer._modules
    attn, mlp = modules.get("self_attn"), modules.get("mlp")
    return (type(layer).__name__ in DECODER_LAYERS and attn is not None and mlp is not None
            and getattr(attn, "is_causal", True) and (_mixture_of_experts(mlp) or _activation(mlp) is not None))


def _stochastic(model: nn.Module) -> bool:
    """Whether a module of the model in training mode draws random numbers in
    its forward, which a step would leave out: a dropout of p > 0 (nn.Dropout's,
    attention's attention_dropout: Phi-3's resid_pdrop, Qwen2's) or router
    jitter (Mixtral's jitter_noise)."""
    return any(m.training and ((isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
                               or any(isinstance(v := getattr(m, name, None), (int, float)) and v > 0
                                      for name in ("attention_dropout", "jitter_noise")))
               for m in model.modules())


def _softcap(attn: nn.Module) -> float:
    """The attention scores' soft cap (Gemma 2's attn_logit_softcapping; 0: none)."""
    return float(getattr(attn, "attn_logit_softcapping", None) or 0.0)


def _window(layer: nn.Module) -> int | None:
    """The layer's sliding window (each token attends to itself and the
    window - 1 before it), None for none, as the models' masks take it: the
    config's sliding_window on the layers its layer_types call sliding
    (Qwen2, Qwen3, SmolLM3, Qwen2-MoE, Gemma 3), on every layer where it
    has no layer_types (Mistral, Mixtral, Phi-3, Qwen3-MoE)."""
    attn = layer._modules["self_attn"]
    config = attn.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and layer_types[attn.layer_idx] != "sliding_attention":
        return None
    return getattr(config, "sliding_window", None)


def _layer_rotary(model: nn.Module) -> bool:
    """Whether the model's rotary embedding takes a layer type (Gemma 3's:
    tables per sliding and full attention)."""
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    return rotary is not None and "layer_type" in inspect.signature(type(rotary).forward).parameters


def _servable(model: nn.Module) -> bool:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if (layers is None or len(layers) == 0 or not hasattr(model, "lm_head") or not hasattr(inner, "embed_tokens")
            or not all(_servable_layer(layer) for layer in layers)):
        return False
    # Every value of each head rotated, or the leading ones in a layer that rotates part of a head.
    rotary = getattr(inner, "rotary_emb", None)
    by_type = _layer_rotary(model)
    for layer in layers:
        attn = layer.self_attn
        inv_freq = getattr(rotary, f"{getattr(attn, 'layer_type', None)}_inv_freq" if by_type else "inv_freq", None)
        if inv_freq is None:
            return False
        rotated = 2 * inv_freq.numel()
        if rotated != attn.head_dim and (rotated > attn.head_dim or type(layer).__name__ not in _PARTIAL_ROTARY_LAYERS):
            return False
    return True


class _DecodingForward(_ModelAttribute):
    """The model's forward: a decode step where one can serve the call, the
    model's own forward otherwise, within kernel_threads' split where the
    model has one. A class, not a closure, so that the model still pickles
    (the C++ step is made again after unpickling)."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._plan = None  # the C++ step (_StepPlan), False where the model has none, None until made
        # (tables per layer type, tables holding each frequency once) of its rotary embedding, None until read
        self._tables: tuple[bool, bool] | None = None
        self._output = None  # the class of the model's forward's output, None until read

    @property
    def __signature__(self):
        # generate reads the forward's parameters (logits_to_keep, cache).
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        return split_call(self.model, args, kwargs, lambda: self._forward(args, kwargs))

    def generated(self) -> None:
        self._plan = None  # it holds every projection's tensors: made again (milliseconds) by the next call

    def _forward(self, args, kwargs):
        if len(args) == 1 and "input_ids" not in kwargs:  # model(input_ids, ...), as the forward's first parameter
            args, kwargs = (), {"input_ids": args[0], **kwargs}
        if not args:
            served = self._served(kwargs)
            if served is not None:
                guard = below_autograd()  # no gradients here: the ops skip their autograd kernels
                try:
                    return self._step(kwargs["input_ids"], *served)
                finally:
                    leave_autograd(guard)
        self._plan = None  # a call the step does not serve: the next step describes the model again
        return type(self.model).forward(self.model, *args, **kwargs)

    def _served(self, kwargs):
        """(the cache, its length, whether the C++ step made for the model
        still describes it) where a decode step serves this call; None otherwise."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        input_ids, cache = kwargs.get("input_ids"), kwargs.get("cache")
        # Inside torch.autocast the model's own forward runs: its ops follow the region's dtype.
        if (input_ids is None or input_ids.shape != (1, 1) or type(cache) is not DynamicCache
                or input_ids.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling()
                or autocast_dtype("cpu") is not None):
            return None
        for name, value in kwargs.items():
            if name not in ("input_ids", "cache", "attention_mask", "position_ids") and not any(
                    value is v or (type(value) is type(v) and value == v) for v in _SERVED_VALUES.get(name, ())):
                return None
        # Outputs a call leaves out (or passes as None) are the config's, as transformers reads them.
        if any(kwargs.get(name) is None and getattr(self.model.config, name, False)
               for name in ("output_attentions", "output_hidden_states", "output_router_logits")):
            return None
        layers, model_layers = cache.layers, self.model.model.layers
        # rms_norm and decode_attention take float32, float16 and bfloat16 (not a model.double()'s float64).
        if len(layers) != len(model_layers) or not all(c.is_initialized and c.keys.shape[0] == 1 and c.keys.dtype
                                                         in STEP_DTYPES for c in layers):
            return None
        n = layers[0].get_seq_length()
        for c, layer in zip(layers, model_layers):
            rows = c.keys.shape[-2]
            if type(c) is DynamicLayer:
                if rows != n:
                    return None
            # A sliding window's cache: the last window - 1 rows, those the next token attends to.
            elif (type(c) is not DynamicSlidingWindowLayer or c.record_past or c.cumulative_length != n
                  or c.sliding_window != _window(layer) or rows != min(n, c.sliding_window - 1)):
                return None
        if n == 0:
            return None
        mask, positions = kwargs.get("attention_mask"), kwargs.get("position_ids")
        if mask is not None and (mask.shape != (1, n + 1) or not bool(mask.all())):
            return None
        if positions is not None and (positions.numel() != 1 or int(positions) != n):
            return None
        # A model in training mode draws its dropout masks (and Mixtral's router jitter) in its own forward.
        if self.model.training and _stochastic(self.model):
            return None
        # An intact C++ step was made for these very layers, which were servable then.
        plan = self._plan
        intact = bool(plan) and plan.intact()
        if not intact and (not all(_servable_layer(layer) for layer in model_layers) or _skipped_hooks(self.model)):
            return None
        return cache, n, intact

    def _step(self, input_ids: torch.Tensor, cache, n: int, intact: bool):
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        model, scales = self.model.model, _Scales(self.model)
        x = _scaled(model.embed_tokens(input_ids), scales.embedding)
        position = torch.full((1, 1), n, dtype=torch.long)
        if self._tables is None:
            self._tables = (_layer_rotary(self.model), type(model.rotary_emb).__name__ in _HALF_TABLE_ROTARY)
        by_type, half = self._tables
        if self._output is None:  # a mixture of experts' forward returns its router logits' fields too (None here)
            self._output = (MoeCausalLMOutputWithPast if any(_mixture_of_experts(layer.mlp) for layer in model.layers)
                            else CausalLMOutputWithPast)
        if by_type:  # a table per layer type
            tables = {kind: tuple(t.view(-1) for t in model.rotary_emb(x, position, kind))
                      for kind in set(self.model.config.layer_types)}
            cos = sin = None
        else:
            cos, sin = (t.view(-1) for t in model.rotary_emb(x, position))
            if half:
                cos, sin = torch.cat((cos, cos)), torch.cat((sin, sin))
        plan = self._plan
        if plan is None or (plan is not False and not (intact and plan.dtype == x.dtype)):
            try:
                plan = _StepPlan(self.model, x.dtype)
            except _Unplannable:
                plan = False
            self._plan = plan
        if plan is not False:
            if by_type:  # the tables as rows, in the plan's order of layer types
                cos, sin = (torch.stack([tables[kind][j] for kind in plan.table_kinds]) for j in (0, 1))
            return self._output(logits=plan.run(x, cos, sin, cache, n), cache=cache)
        identity = None  # made for the first layer without rotation
        for layer, cache_layer in zip(model.layers, cache.layers):
            modules = layer._modules
            attn = modules["self_attn"]
            q, k, v = (t.view(-1, attn.head_dim) for t in _projections(attn, _rms_norm(x, modules["input_layernorm"])))
            q_norm = attn._modules.get("q_norm")
            if q_norm is not None:
                q, k = _rms_norm(q, q_norm), _rms_norm(k, attn._modules["k_norm"])
            _promote(cache_layer, q.dtype)
            rows = cache_layer.keys.shape[-2]
            key_buffer, value_buffer, first = _buffers(cache_layer, rows)
            layer_tables = tables[attn.layer_type] if by_type else (cos, sin)
            if not _rotary(attn):  # the identity's tables: q * 1 + rotate_half(q) * 0 is q exactly
                identity = identity or tuple(f(t) for f, t in zip((torch.ones_like, torch.zeros_like), layer_tables))
                layer_tables = identity
            # Tables in the embedding's dtype, q in its norm's (fp32 norms over a bf16 model, as
            # peft.prepare_model_for_kbit_training leaves it): the model's forward promotes them to q's.
            layer_tables = tuple(t.to(q.dtype) for t in layer_tables)
            row, window = first + rows, _window(layer)  # the new token's row; its window's first row:
            start = first if window is None else max(first, row + 1 - window)
            o = torch.ops.lowbit.decode_attention(q, k, v, *layer_tables, key_buffer[0], value_buffer[0], row,
                                                  attn.scaling, start, attn._parameters.get("sinks"), _softcap(attn))
            kept = first  # the cache's first row from now on
            if cache_layer.is_sliding:  # a window's cache keeps the last window - 1 rows
                kept = row + 1 - min(rows + 1, cache_layer.sliding_window - 1)
                cache_layer.cumulative_length += 1
            cache_layer.keys, cache_layer.values = key_buffer[:, :, kept:row + 1], value_buffer[:, :, kept:row + 1]
            residual = _Scales.residual(layer)
            out = _project(attn._modules["o_proj"], o.view(1, 1, -1))
            sandwich = "pre_feedforward_layernorm" in modules  # Gemma: a norm after each sublayer too
            if sandwich:
                out = _rms_norm(out, modules["post_attention_layernorm"])
            x = x + _scaled(out, residual)
            out = _mlp(modules["mlp"], _rms_norm(x, modules["pre_feedforward_layernorm" if sandwich
                                                            else "post_attention_layernorm"]))
            if sandwich:
                out = _rms_norm(out, modules["post_feedforward_layernorm"])
            x = x + _scaled(out, residual)
        logits = _project(self.model.lm_head, _rms_norm(x, model.norm)).view(1, 1, -1)
        if scales.logits_divisor != 1.0:
            logits = logits / scales.logits_divisor
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap is not None:  # Gemma's: cap * tanh(logits / cap), as its forward computes it
            logits = torch.tanh(logits / cap) * cap
        return self._output(logits=logits, cache=cache)


def fast_decoding(model: nn.Module, enable: bool = True) -> bool:
    """Serves `model`'s decode calls with one loop over its layers where it
    can (see the module's notes); enable=False: every call on the model's
    own forward again. Returns whether its decode calls are served: its
    decoder layers are all of DECODER_LAYERS' kinds, with gated MLPs (or
    experts), causal attention (soft-capped scores too) and whole heads
    rotated (or their leading values, in Phi-3's layers)."""
    check_module("fast_decoding", model)
    enable = check_flag("fast_decoding", "enable", enable)
    if isinstance(model.__dict__.get("forward"), _DecodingForward):
        del model.forward
    if not enable or not _servable(model):
        if _STATE in model.__dict__ and "forward" not in model.__dict__:  # kernel_threads' split stays
            model.forward = ThreadedForward(model)
        wrap_generate(model)
        return False
    if isinstance(model.__dict__.get("forward"), ThreadedForward):
        del model.forward  # the decode step's forward splits its calls itself
    model.forward = _DecodingForward(model)
    wrap_generate(model)  # the step goes as each generate call ends
    return True
