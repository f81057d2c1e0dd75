"""Tiny GPTQ checkpoints on disk for checkpoint-level tests: a model of a few
GPTQLinear layers (quantized by round-to-nearest) plus a float LayerNorm,
saved with save_gptq next to a non-weight file."""
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch
from torch import nn

from lowbit.gptq.checkpoint import checkpoint_files, read_tensors, save_gptq
from lowbit.gptq.config import GPTQConfig
from lowbit.gptq.linear import GPTQLinear

HIDDEN, INTERMEDIATE = 64, 96  # multiples of 32, as 3-bit packing needs
LAYERS = {"mlp.up_proj": (HIDDEN, INTERMEDIATE), "mlp.down_proj": (INTERMEDIATE, HIDDEN)}
EXTRA_FILE = "tokenizer.json"
EXTRA_CONTENT = '{"model": {"type": "BPE"}, "note": "carried over byte for byte"}\n'


class TinyModel(nn.Module):
    """norm -> up_proj -> down_proj; module names as in an HF decoder layer."""

    def __init__(self, layers: dict[str, GPTQLinear]):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN, dtype=torch.float16)
        with torch.no_grad():  # not the default ones/zeros, so a copy that dropped them would show
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.1, 0.1)
        self.mlp = nn.Module()
        for name, layer in layers.items():
            setattr(self.mlp, name.split(".")[-1], layer)


def quantized_layers(bits: int, group_size: int, sym: bool, act_order: bool, fmt: str, seed: int = 0,
                     positive: bool = False) -> dict[str, GPTQLinear]:
    """RTN-quantized GPTQLinear layers for LAYERS. `positive` weights (all > 0)
    make every asymmetric zero point 0."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for name, (k, n) in LAYERS.items():
        linear = nn.Linear(k, n, bias=name.endswith("up_proj"))
        with torch.no_grad():
            w = torch.randn(n, k, generator=g)
            linear.weight.copy_(w.abs() + 0.01 if positive else w)
            if linear.bias is not None:
                linear.bias.copy_(torch.randn(n, generator=g))
        perm = torch.randperm(k, generator=g) if act_order else None
        layers[name] = GPTQLinear.from_linear(linear, bits, group_size, sym, fmt, perm)
    return layers


def make_checkpoint(directory, bits: int = 4, group_size: int = 32, sym: bool = True, act_order: bool = False,
                    fmt: str = "gptq", max_shard_bytes: int | None = None, seed: int = 0,
                    positive: bool = False) -> TinyModel:
    """Saves a TinyModel checkpoint (plus EXTRA_FILE) to `directory`; returns the model."""
    model = TinyModel(quantized_layers(bits, group_size, sym, act_order, fmt, seed, positive))
    save_gptq(model, directory, GPTQConfig(bits, group_size, act_order, sym, fmt), max_shard_bytes=max_shard_bytes)
    with open(os.path.join(directory, EXTRA_FILE), "w") as f:
        f.write(EXTRA_CONTENT)
    return model


def tensors(directory) -> dict[str, torch.Tensor]:
    return read_tensors(checkpoint_files(directory)[1])


def raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def tree_hashes(directory) -> dict[str, str]:
    """sha256 of every file under `directory`, by relative path."""
    out = {}
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = hashlib.sha256(f.read()).hexdigest()
    return out


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def relabel(directory, fmt: str) -> None:
    """Edits the checkpoint_format in both configs (what a mislabelled upload looks like)."""
    for name in ("config.json", "quantize_config.json"):
        path = os.path.join(directory, name)
        content = read_json(path)
        quant = content["quantization_config"] if name == "config.json" else content
        quant["checkpoint_format"] = fmt
        with open(path, "w") as f:
            json.dump(content, f)


# Links a source checkpoint may hold to files outside it, {case: (entry of the checkpoint, target beside it)}:
# a rewrite of the checkpoint refuses each (link_outside).
OUTSIDE_LINKS = {"file": ("vocab.txt", "secret.txt"), "file-in-a-subdirectory": ("sub/vocab.txt", "secret.txt"),
                 "directory": ("keys", "secrets"), "dangling": ("vocab.txt", "missing"),
                 "device": ("vocab.txt", "/dev/null"), "config": ("config.json", "secret.json"),
                 "weights": ("model.safetensors", "secret.safetensors")}


def link_outside(src, case: str) -> str:
    """Makes `src`'s entry of OUTSIDE_LINKS[case] a link out of it, to a private file, a directory of keys,
    nothing, a device, or another checkpoint's config or weights; returns the refusal that names it."""
    src = Path(src)
    name, target = OUTSIDE_LINKS[case]
    (src.parent / "secret.txt").write_text("private")
    (src.parent / "secrets").mkdir(exist_ok=True)
    (src.parent / "secrets" / "id_rsa").write_text("private")
    shutil.copy(src / "config.json", src.parent / "secret.json")
    shutil.copy(next(src.glob("*.safetensors")), src.parent / "secret.safetensors")
    link = src / name
    link.parent.mkdir(exist_ok=True)
    if link.exists():
        link.unlink()
    os.symlink(src.parent / target, link)
    return f"{link}: a link to {os.path.realpath(src.parent / target)}, outside the checkpoint directory {src}"

