"""GGUFExperts: a transformers mixture-of-experts `experts` module over a
GGUF file's 3-D expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
each expert's blocks a GGUFLinear, so that no expert is ever dequantized."""
from __future__ import annotations

import torch
from torch import nn

from .gguf_linear import GGUFLinear


def _per_expert(blocks: torch.Tensor, qtype: int, experts: int, in_features: int, name: str) -> nn.ModuleList:
    """One GGUFLinear per expert over the rows of `blocks` (uint8 [experts *
    rows, row_bytes], the file's 3-D tensor with its expert dim folded into
    the rows): each expert's rows are contiguous, so each layer is a view."""
    if blocks.dim() != 2 or blocks.shape[0] % experts:
        raise ValueError(f"GGUFExperts: {name} must be uint8 [experts * rows, row_bytes] for {experts} experts, "
                         f"got {tuple(blocks.shape)}")
    rows = blocks.shape[0] // experts
    return nn.ModuleList(GGUFLinear.from_raw(blocks[e * rows:(e + 1) * rows], qtype, in_features, None)
                         for e in range(experts))


class GGUFExperts(nn.Module):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]:
    the experts module of transformers' Qwen2Moe / Qwen3Moe / Mixtral sparse
    MoE blocks, which route and call it so. Token t's output is the sum over
    its k experts e, in ascending e, of weight * down_e(act(gate_e(x)) *
    up_e(x)), as their eager experts compute it; each expert runs once on
    all the tokens routed to it.

    `gate`, `up`, `down`: uint8 block bytes [experts * rows, row_bytes] (a
    GGUF expert tensor's data) and their ggml types, which may differ (a
    Q4_K_M file's down experts are Q6_K or Q4_K by layer). Each expert's
    projections are GGUFLinear layers (gate_proj[e], up_proj[e],
    down_proj[e]), views of those bytes, so lowbit.repack_model repacks
    them like any other layer.
    """

    def __init__(self, gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int], down: tuple[torch.Tensor, int],
                 experts: int, hidden_size: int, intermediate_size: int, act_fn: nn.Module):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden_size, intermediate_size
        self.gate_proj = _per_expert(*gate, experts, hidden_size, "gate")
        self.up_proj = _per_expert(*up, experts, hidden_size, "up")
        self.down_proj = _per_expert(*down, experts, intermediate_size, "down")
        for name, layers, out in (("gate", self.gate_proj, intermediate_size), ("up", self.up_proj, intermediate_size),
                                  ("down", self.down_proj, hidden_size)):
            if layers[0].out_features != out:
                raise ValueError(f"GGUFExperts: each {name} expert has {layers[0].out_features} rows, not {out}")
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        # (token, slot) pairs grouped by expert, each group in token order.
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()  # the host picks the experts
        if len(counts) > self.num_experts:
            raise IndexError(f"GGUFExperts: expert ids must lie in [0, {self.num_experts}), got {len(counts) - 1}")
        tokens, weights = order // k, top_k_weights.reshape(-1)[order]
        out = torch.zeros_like(hidden_states)
        start = 0
        for e, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start:start + count]
            x = hidden_states.index_select(0, rows)
            y = self.down_proj[e](self.act_fn(self.gate_proj[e](x)) * self.up_proj[e](x))
            out.index_add_(0, rows, y * weights[start:start + count, None].to(y.dtype))
            start += count
        return out

    def extra_repr(self) -> str:
        types = {name: layers[0].qtype for name, layers in
                 (("gate", self.gate_proj), ("up", self.up_proj), ("down", self.down_proj))}
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"qtypes={types}")
