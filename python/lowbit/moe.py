"""What lowbit reads of transformers' mixture-of-experts `experts` modules,
which hold every expert's weights in two 3-D parameters (gate_up_proj and
down_proj) and which GGUFExperts and GPTQExperts replace."""
from __future__ import annotations

import torch
from torch import nn


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
