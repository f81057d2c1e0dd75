"""What lowbit reads of transformers' mixture-of-experts `experts` modules,
which hold every expert's weights in two 3-D parameters (gate_up_proj and
down_proj) and which GGUFExperts and GPTQExperts replace."""
from __future__ import annotations

import torch
from torch import nn


def _described(value) -> str:
    """A forward argument's dtype and shape, or its type where it is no tensor."""
    return f"{value.dtype} {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__


def check_routing(owner: str, hidden_states, top_k_index, top_k_weights, hidden_size: int) -> torch.Tensor:
    """top_k_index as int64 or int32 ids, after checking an experts module's
    forward arguments: float hidden_states [T, hidden_size], integer
    top_k_index [T, k] and top_k_weights of its shape. The shapes decide which
    rows and weights pair up, so nothing is broadcast into place (weights
    [T, 1] for ids [T, k] would weigh every slot by the first one's weight)."""
    if (not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point()
            or hidden_states.dim() != 2 or hidden_states.shape[1] != hidden_size):
        raise ValueError(f"{owner}: hidden_states must be a float [tokens, hidden={hidden_size}] tensor, "
                         f"got {_described(hidden_states)}")
    if (not isinstance(top_k_index, torch.Tensor) or top_k_index.dim() != 2
            or top_k_index.shape[0] != hidden_states.shape[0]):
        raise ValueError(f"{owner}: top_k_index must be [tokens={hidden_states.shape[0]}, k], "
                         f"got {_described(top_k_index)}")
    if top_k_index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"{owner}: top_k_index must hold integer expert ids, got {top_k_index.dtype}")
    if not isinstance(top_k_weights, torch.Tensor) or top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{owner}: top_k_weights must have top_k_index's shape {list(top_k_index.shape)}, "
                         f"got {_described(top_k_weights)}")
    # The weights come in last, after every expert's matmuls: there torch's device error names neither.
    if top_k_weights.device != hidden_states.device:
        raise RuntimeError(f"{owner}: top_k_weights is on {top_k_weights.device}, hidden_states on "
                           f"{hidden_states.device}: both must be on one device")
    return top_k_index if top_k_index.dtype in (torch.int64, torch.int32) else top_k_index.long()


def experts_dims(module: nn.Module) -> tuple[int, int, int] | None:
    """(experts, hidden, intermediate) of a transformers experts module with
    3-D weights: gate_up_proj [E, 2I, H] and down_proj [E, H, I], or [E, H,
    2I] and [E, I, H] where the module says is_transposed (gpt-oss's); None
    for any other module."""
    if not isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):
        return None
    experts, *down = module.down_proj.shape
    hidden, intermediate = reversed(down) if getattr(module, "is_transposed", False) else down
    return experts, hidden, intermediate


def plain_experts(module: nn.Module) -> bool:
    """Whether the experts module computes down(act_fn(gate) * up) from
    [out, in] weights, gate_up_proj's gate rows first, without biases: what
    GPTQExperts computes (Qwen2-MoE's, Qwen3-MoE's, Mixtral's; not gpt-oss's)."""
    return (experts_dims(module) is not None and hasattr(module, "act_fn")
            and not getattr(module, "is_transposed", False) and getattr(module, "is_concatenated", True)
            and {n for n, _ in module.named_parameters()} == {"gate_up_proj", "down_proj"} and _plain_gate(module))


def _plain_gate(module: nn.Module) -> bool:
    """Whether the module gates gate_up's output as act_fn(gate) * up over its
    halves, gate first: its class's own _apply_gate where it has one
    (DeepSeek-V4's clamps gate and up first), probed on values past any
    clamp; an act_fn of two inputs (a SwiGLU of its own) is not that."""
    probe = torch.linspace(-60.0, 60.0, 32).repeat(2, 2)  # gate and up halves each spanning +-60
    gate, up = probe.chunk(2, dim=-1)
    try:
        want = module.act_fn(gate) * up
        got = module._apply_gate(probe) if callable(getattr(type(module), "_apply_gate", None)) else want
    except Exception:  # an act_fn or gate that does not take these
        return False
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
