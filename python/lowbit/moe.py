"""What lowbit reads of transformers' mixture-of-experts `experts` modules,
which hold every expert's weights in two 3-D parameters (gate_up_proj and
down_proj) and which GGUFExperts and GPTQExperts replace."""
from __future__ import annotations

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
            and {n for n, _ in module.named_parameters()} == {"gate_up_proj", "down_proj"})
