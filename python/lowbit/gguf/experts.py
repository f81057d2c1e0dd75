"""GGUFExperts: a transformers mixture-of-experts `experts` module over a
GGUF file's 3-D expert tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps),
multiplied by torch.ops.lowbit.ggml_mul_mat_id, so that no expert is ever
dequantized."""
from __future__ import annotations

import torch
from torch import nn

from .._checks import check_sizes, is_integer, shown, shown_names
from .._frozen import call_layer_op
from .._stored import StoredBuffers, as_buffer
from ..moe import check_routing
from ..ops import GGMLType
from .file import dequantize_rows, release_mapped
from .linear import check_qtype


PROJECTIONS = ("gate", "up", "down")


def ggml_type_ids(who: str, types, argument: str) -> set[int]:
    """The ggml type ids of `types` (GGMLTypes, their ids, Python's or
    numpy's, or their names), or ValueError naming `argument`: anything else
    would be skipped by nothing, and one name alone would be read as its
    letters."""
    if isinstance(types, str):
        raise ValueError(f"{who}: {argument} must be a collection of ggml types, got the string {types!r} "
                         f"(pass [{types!r}])")
    try:
        items = list(types)
    except TypeError:
        raise ValueError(f"{who}: {argument} must be a collection of ggml types, got {types!r}") from None
    ids = set()
    for t in items:
        if isinstance(t, str) and t in GGMLType.__members__:
            ids.add(int(GGMLType[t]))
        elif is_integer(t) and int(t) in {int(g) for g in GGMLType}:  # numpy's too: an element of a type array
            ids.add(int(t))
        else:
            raise ValueError(f"{who}: {argument} holds {t!r}, not a ggml type (a GGMLType, its id or its name)")
    return ids


class ClampedSwiGLU(nn.Module):
    """gpt-oss's gated activation of (gate, up): gate clamped above at
    `limit`, up to [-limit, limit], then gate * sigmoid(alpha * gate) * (up + 1),
    as transformers' GptOssExperts and llama.cpp's swiglu_oai compute it."""

    def __init__(self, alpha: float, limit: float):
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        return gate * torch.sigmoid(gate * self.alpha) * (up.clamp(-self.limit, self.limit) + 1)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, limit={self.limit}"


class GGUFExperts(StoredBuffers):
    """forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]:
    the experts module of transformers' Qwen2Moe / Qwen3Moe / Mixtral /
    GptOss sparse MoE blocks, which route and call it so. Token t's output is
    the sum over its k slots of weight * down_e(act(gate_e(x)) * up_e(x)), e
    the slot's expert, as their experts modules compute it (the slots summed
    in slot order rather than by expert: the same to fp32 rounding). With
    `glu` (gpt-oss's ClampedSwiGLU), glu(gate_e(x), up_e(x)) replaces
    act(gate_e(x)) * up_e(x); with `biases` ({"gate", "up": [experts,
    intermediate], "down": [experts, hidden]}, float), each projection adds
    its expert's bias.

    `gate`, `up`, `down`: (uint8 block bytes [experts * rows, row_bytes], a
    GGUF expert tensor's data, and its ggml type); the types may differ (a
    Q4_K_M file's down experts are Q6_K or Q4_K by layer). The buffers
    `gate_qweight`, `up_qweight`, `down_qweight` are [experts, rows,
    row_bytes] views of those bytes: nothing is copied. Each projection is
    one ggml_mul_mat_id call for every token and slot, which quantizes each
    activation row once and runs every chosen expert in one parallel pass.

    `repack()` puts each expert of the projections whose type the active CPU
    kernels read in the repacked layout (GGUFLinear.repack: the same
    results, for the 32-element types to fp32 rounding; expert matrices have
    short rows, where it is several times faster); state_dict(),
    dequantize() and a move off the CPU keep the file's layout.
    """

    def __init__(self, gate: tuple[torch.Tensor, int], up: tuple[torch.Tensor, int], down: tuple[torch.Tensor, int],
                 experts: int, hidden_size: int, intermediate_size: int, act_fn: nn.Module | None,
                 glu: nn.Module | None = None, biases: dict[str, torch.Tensor] | None = None):
        super().__init__()
        if (act_fn is None) == (glu is None):
            raise ValueError("GGUFExperts: give act_fn or glu, not both")
        # forward calls them: a name ("silu") would fail only at the first call, naming nothing.
        for name, fn in (("act_fn", act_fn), ("glu", glu)):
            if fn is not None and not callable(fn):
                raise TypeError(f"GGUFExperts: {name} must be callable (an nn.Module such as nn.SiLU()), got "
                                f"{type(fn).__name__} {shown(fn)}")
        # Each projection unpacks as (blocks, qtype): None or a bare tensor would be a raw unpack error.
        for name, given in zip(PROJECTIONS, (gate, up, down)):
            if (not isinstance(given, (tuple, list)) or len(given) != 2 or not isinstance(given[0], torch.Tensor)
                    or not is_integer(given[1])):
                raise TypeError(f"GGUFExperts: {name} must be a (uint8 block tensor, ggml type id) pair, got "
                                f"{type(given).__name__}")
        check_sizes("GGUFExperts", experts=experts, hidden_size=hidden_size, intermediate_size=intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = experts, hidden_size, intermediate_size
        self.qtypes, self.repacked = {}, dict.fromkeys(PROJECTIONS, False)
        for (name, (rows, n)), (blocks, qtype) in zip(self._shapes().items(), (gate, up, down)):
            block, type_size = check_qtype(f"GGUFExperts: {name}", qtype)
            row_bytes = n // block * type_size
            if blocks.dtype != torch.uint8 or n % block or tuple(blocks.shape) != (experts * rows, row_bytes):
                raise ValueError(f"GGUFExperts: {name} must be uint8 [experts * rows, row_bytes] = "
                                 f"[{experts * rows}, {row_bytes}] for {experts} experts of [{rows}, {n}] type "
                                 f"{qtype} weights, got {blocks.dtype} {tuple(blocks.shape)}")
            self.register_buffer(f"{name}_qweight", as_buffer(blocks).view(experts, rows, row_bytes))
            self.qtypes[name] = int(qtype)
        self.act_fn, self.glu = act_fn, glu
        self.biased = biases is not None
        if biases is not None and not isinstance(biases, dict):  # else a bare AttributeError on .get
            raise TypeError(f"GGUFExperts: biases must be None or a dict of 'gate', 'up' and 'down' tensors, got "
                            f"{type(biases).__name__}")
        # A key other than the projections' (a typo: "down_proj") would be left out without a word.
        if biases is not None and set(biases) - set(PROJECTIONS):
            raise ValueError(f"GGUFExperts: biases must hold the keys 'gate', 'up' and 'down', got "
                             f"{shown_names(biases)}")
        device = self.gate_qweight.device
        for name, (rows, n) in self._shapes().items():
            if biases is None:
                break
            bias = biases.get(name)
            if not isinstance(bias, torch.Tensor) or not bias.is_floating_point() \
                    or tuple(bias.shape) != (experts, rows):
                got = (bias.dtype, tuple(bias.shape)) if isinstance(bias, torch.Tensor) else type(bias).__name__
                raise ValueError(f"GGUFExperts: biases[{name!r}] must be a float [experts, rows] = [{experts}, {rows}] "
                                 f"tensor, got {got}")
            self.register_buffer(f"{name}_bias", as_buffer(bias))
        # forward indexes every buffer on the activations' device: one elsewhere fails there, naming nothing.
        for name in PROJECTIONS:
            for given, buffer in ((name, f"{name}_qweight"), (f"biases[{name!r}]", f"{name}_bias")):
                if buffer in self._buffers and self._buffers[buffer].device != device:
                    raise RuntimeError(f"GGUFExperts: {given} is on {self._buffers[buffer].device}, gate on {device}: "
                                       "every tensor must be on one device")

    def layout(self) -> dict:
        return {"qtypes": {name: int(qtype) for name, qtype in self.qtypes.items()}}

    def _shapes(self) -> dict[str, tuple[int, int]]:
        """Each projection's [rows, n] per expert."""
        return {"gate": (self.intermediate_size, self.hidden_size), "up": (self.intermediate_size, self.hidden_size),
                "down": (self.hidden_size, self.intermediate_size)}

    def op_template(self, name: str, x: torch.Tensor, top_k_index: torch.Tensor) -> tuple:
        """(op, args): projection `name`'s call on x and the experts' ids, both
        among args (without the bias); lowbit.decoding's C++ step takes it."""
        op = torch.ops.lowbit.ggml_mul_mat_id_repacked if self.repacked[name] else torch.ops.lowbit.ggml_mul_mat_id
        return op, (getattr(self, f"{name}_qweight"), x, top_k_index, self.qtypes[name], self._shapes()[name][0])

    def _project(self, name: str, x: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
        y = call_layer_op(lambda v: self.op_template(name, v, top_k_index), x)
        return y + getattr(self, f"{name}_bias")[top_k_index].to(y.dtype) if self.biased else y

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        top_k_index = check_routing("GGUFExperts", hidden_states, top_k_index, top_k_weights, self.hidden_size)
        gate = self._project("gate", hidden_states, top_k_index)  # [T, k, intermediate]
        up = self._project("up", hidden_states, top_k_index)
        activation = self.glu(gate, up) if self.glu is not None else self.act_fn(gate) * up
        down = self._project("down", activation, top_k_index)  # [T, k, hidden]
        return (down * top_k_weights.unsqueeze(-1).to(down.dtype)).sum(dim=1)

    @torch.inference_mode(False)  # the new layout must serve later calls that save for backward
    def repack(self, skip_types=()) -> list[str]:
        """Each projection whose type has the repacked layout, is read as it
        is by the active CPU kernels and is not in `skip_types`, put in it in
        place; returns their names."""
        skip_types = ggml_type_ids("GGUFExperts.repack", skip_types, "skip_types")
        done = []
        for name in PROJECTIONS:
            qtype = self.qtypes[name]
            if getattr(self, f"{name}_qweight").device.type != "cpu":
                raise ValueError(f"GGUFExperts.repack: the repacked layout is the CPU kernels'; {name} is on "
                                 f"{getattr(self, f'{name}_qweight').device}")
            if (not self.repacked[name] and torch.ops.lowbit.cpu_reads_repacked(qtype)  # and so has the layout
                    and qtype not in skip_types):
                mapped = getattr(self, f"{name}_qweight")
                setattr(self, f"{name}_qweight", self._reorder(name, inverse=False))
                self.repacked[name] = True
                release_mapped([mapped])  # a file's bytes, copied: their pages go
            if self.repacked[name]:
                done.append(name)
        return done

    @torch.inference_mode(False)
    def unrepack(self) -> "GGUFExperts":
        """Every projection back in the file's layout, in place; returns self."""
        for name in PROJECTIONS:
            if self.repacked[name]:
                setattr(self, f"{name}_qweight", self._reorder(name, inverse=True))
                self.repacked[name] = False
        return self

    def file_layout_qweight(self, name: str) -> torch.Tensor:
        """Projection `name`'s blocks as the file stores them (a reordered copy when repacked)."""
        return self._reorder(name, inverse=True) if self.repacked[name] else getattr(self, f"{name}_qweight")

    def _reorder(self, name: str, inverse: bool) -> torch.Tensor:
        """ggml_repack of each expert's own rows (its tiles never take another's)."""
        blocks, (rows, n) = getattr(self, f"{name}_qweight"), self._shapes()[name]
        return torch.ops.lowbit.ggml_repack(blocks, self.qtypes[name], rows, n, inverse)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """The float weights {"gate", "up": [experts, intermediate, hidden], "down": [experts, hidden, intermediate]}."""
        out = {}
        for name, (rows, n) in self._shapes().items():
            blocks = self.file_layout_qweight(name)
            out[name] = dequantize_rows("GGUFExperts.dequantize", blocks.reshape(-1, blocks.shape[-1]),
                                        self.qtypes[name], self.num_experts * rows, n, dtype).view(-1, rows, n)
        return out

    def _apply(self, fn, recurse=True):
        # Only the CPU kernels read the repacked layout: going anywhere else,
        # the bytes go back to the file's layout first.
        if any(self.repacked.values()) and fn(torch.empty(0, dtype=torch.uint8)).device.type != "cpu":
            self.unrepack()
        return super()._apply(fn, recurse)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for name in PROJECTIONS:  # a state dict holds the file's layout, whatever loads it
            if self.repacked[name]:
                destination[f"{prefix}{name}_qweight"] = self.file_layout_qweight(name)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A state dict holds the file's layout: loaded into the file's layout,
        # so that what it leaves out (strict=False) or fails to load stays as it was.
        repacked = [name for name in PROJECTIONS if self.repacked[name]]
        self.unrepack()
        try:
            super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        finally:
            for name in repacked:
                setattr(self, f"{name}_qweight", self._reorder(name, inverse=False))
                self.repacked[name] = True

    def extra_repr(self) -> str:
        repacked = [name for name in PROJECTIONS if self.repacked[name]]
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"qtypes={self.qtypes}" + (", biased" if self.biased else "")
                + (f", repacked={repacked}" if repacked else ""))
