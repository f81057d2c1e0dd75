"""GPTQExperts: a transformers mixture-of-experts `experts` module over a
GPTQ checkpoint's per-expert layers (`<...>.experts.<e>.gate_proj`,
`up_proj`, `down_proj`, as GPTQModel and AutoGPTQ write Qwen-MoE models;
Mixtral checkpoints' older names are read as these: current_name), each a
GPTQLinear."""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from .._checks import is_integer
from ..moe import check_routing
from .linear import GPTQLinear

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# A checkpoint's per-expert layer: (experts module, expert, projection). The
# expert in ASCII digits, at most 18: \d also matches other scripts' digits,
# which int() reads as another expert's, and int() refuses past 4300 digits.
# A name past that matches no expert: the model has no such module to take it.
EXPERT_LAYER = re.compile(r"(?P<experts>.+\.experts)\.(?P<expert>[0-9]{1,18})\."
                          r"(?P<projection>gate_proj|up_proj|down_proj)")
# The names transformers 4 gave Mixtral's layers, which its GPTQ checkpoints
# (AutoGPTQ's, GPTQModel's, TheBloke's) keep: the block `block_sparse_moe`
# (now `mlp`, holding the router `gate` and the `experts`) and an expert's
# w1 / w3 / w2. transformers 5 renames float checkpoints the same way as it
# loads them (conversion_mapping.py, "mixtral").
LEGACY_BLOCK = (".block_sparse_moe.", ".mlp.")
LEGACY_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
LEGACY_EXPERT_LAYER = re.compile(r"(\.experts\.\d+)\.(w[123])\b")


def current_name(name: str) -> str:
    """A checkpoint name under transformers 5's names for it."""
    name = name.replace(*LEGACY_BLOCK)
    return LEGACY_EXPERT_LAYER.sub(lambda m: f"{m[1]}.{LEGACY_PROJECTIONS[m[2]]}", name)


class GPTQExpert(nn.Module):
    """One expert's three GPTQLinear projections, under the checkpoint's names
    (nn.Linear ones while lowbit.gptq.quantize works on them)."""

    def __init__(self, gate_proj: GPTQLinear, up_proj: GPTQLinear, down_proj: GPTQLinear):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = gate_proj, up_proj, down_proj


class GPTQExperts(nn.Module):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]:
    the experts module of transformers' Qwen2Moe / Qwen3Moe / Mixtral sparse
    MoE blocks, over experts whose projections are GPTQLinear layers. Expert
    e is the child module "e" (a GPTQExpert), so the state_dict keys are the
    checkpoint's own (`<e>.gate_proj.qweight`, ...) and save_gptq writes what
    load_gptq_model read. Each expert runs once, on all the tokens routed to it, and each
    token's outputs add up in ascending expert order, as transformers'
    eager experts module computes them; the host reads the ids' range and
    the per-expert token counts together (one device sync a layer, as that
    module has).
    """

    def __init__(self, experts: list[GPTQExpert], act_fn: nn.Module):
        super().__init__()
        # Checked here: forward would fail on the first token routed to a bad one,
        # with an AttributeError or TypeError that names neither the module nor the argument.
        if isinstance(experts, (str, bytes, nn.Module)) or not isinstance(experts, Iterable):
            raise TypeError(f"GPTQExperts: experts must be a list of GPTQExpert, got {type(experts).__name__}")
        experts = list(experts)
        for e, expert in enumerate(experts):
            if not isinstance(expert, GPTQExpert):
                raise TypeError(f"GPTQExperts: experts[{e}] must be a GPTQExpert, got {type(expert).__name__}")
        if not callable(act_fn):
            raise TypeError(f"GPTQExperts: act_fn must be callable (an nn.Module), got {type(act_fn).__name__}")
        self.num_experts = len(experts)
        for e, expert in enumerate(experts):
            self.add_module(str(e), expert)
        self.act_fn = act_fn

    def expert(self, e: int) -> GPTQExpert:
        """Expert `e`'s three projections."""
        if not (is_integer(e) and 0 <= e < self.num_experts):  # else a bare KeyError, or "-1" read as a name
            raise IndexError(f"GPTQExperts.expert: e must be an integer in [0, {self.num_experts}), got {e!r}")
        return self._modules[str(e)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        hidden = self.expert(0).gate_proj.in_features if self.num_experts else hidden_states.shape[-1]
        top_k_index = check_routing("GPTQExperts", hidden_states, top_k_index, top_k_weights, hidden)
        k, E = top_k_index.shape[-1], self.num_experts
        chosen = top_k_index.reshape(-1)
        counts = [0] * E
        if chosen.numel():
            # The ids' range and the per-expert counts in one read by the host.
            low, high, *counts = torch.cat([torch.stack(torch.aminmax(chosen)).long(),
                                            torch.bincount(chosen.clamp(0, max(E - 1, 0)).long(), minlength=E)]).tolist()
            if low < 0 or high >= E:
                raise IndexError(f"GPTQExperts: expert ids must lie in [0, {E}), got {low} .. {high}")
        order = torch.argsort(chosen, stable=True)  # (token, slot) pairs grouped by expert, in token order
        tokens, weights = order // k, top_k_weights.reshape(-1)[order]
        out = None  # in the experts' output dtype: hidden_states', or autocast's in an autocast region
        start = 0
        for e, count in enumerate(counts):
            if count:
                expert = self.expert(e)
                rows = tokens[start:start + count]
                x = hidden_states.index_select(0, rows)
                y = expert.down_proj(self.act_fn(expert.gate_proj(x)) * expert.up_proj(x))
                if out is None:
                    out = hidden_states.new_zeros(hidden_states.shape, dtype=y.dtype)
                out.index_add_(0, rows, y * weights[start:start + count, None].to(y.dtype))
                start += count
        return torch.zeros_like(hidden_states) if out is None else out

    def dequantize(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The float weights {"gate_proj", "up_proj": [experts, intermediate, hidden],
        "down_proj": [experts, hidden, intermediate]}."""
        return {p: torch.stack([getattr(self.expert(e), p).dequantize(dtype) for e in range(self.num_experts)])
                for p in PROJECTIONS}
