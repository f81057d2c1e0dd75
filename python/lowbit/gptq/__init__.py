"""GPTQ checkpoints: the GPTQLinear layer and the experts module over such
layers, config parsing, loading, saving and v1 <-> v2 conversion, the
transformers model of a checkpoint, quantization (round to nearest, and the
GPTQ algorithm on a model), and tensor parallelism (tp)."""
from .algorithm import quantize
from .checkpoint import GPTQCheckpoint, GPTQCheckpointError, load_gptq, save_gptq
from .convert import convert_checkpoint
from .experts import GPTQExpert, GPTQExperts
from .config import GPTQConfig, GPTQConfigError, ModuleQuant, read_config
from .linear import GPTQLinear
from .placing import load_gptq_model, place_gptq_checkpoint
from .rtn import GPTQTensors, quantize_rtn
from .tp import (ColumnParallelGPTQLinear, NaiveTPMLP, RowParallelGPTQLinear, SequentialGPTQLinear, TPAwareMLP,
                 group_order, make_sequential, permute_inputs, permute_outputs, reorder_checkpoint, tp_aware)

__all__ = [
    "ColumnParallelGPTQLinear", "GPTQCheckpoint", "GPTQCheckpointError", "GPTQConfig", "GPTQConfigError", "GPTQExpert",
    "GPTQExperts", "GPTQLinear", "GPTQTensors", "ModuleQuant", "NaiveTPMLP", "RowParallelGPTQLinear",
    "SequentialGPTQLinear", "TPAwareMLP",
    "convert_checkpoint", "group_order", "load_gptq", "load_gptq_model", "make_sequential", "permute_inputs",
    "permute_outputs", "place_gptq_checkpoint", "quantize", "quantize_rtn", "read_config", "reorder_checkpoint",
    "save_gptq", "tp_aware",
]
