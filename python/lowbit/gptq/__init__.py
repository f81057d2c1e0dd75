"""GPTQ checkpoints: the GPTQLinear layer, config parsing, loading and saving."""
from .algorithm import quantize
from .checkpoint import GPTQCheckpoint, GPTQCheckpointError, load_gptq, save_gptq
from .convert import convert_checkpoint
from .experts import GPTQExpert, GPTQExperts
from .config import GPTQConfig, GPTQConfigError, ModuleQuant, read_config
from .linear import GPTQLinear
from .rtn import GPTQTensors, quantize_rtn

__all__ = [
    "GPTQCheckpoint", "GPTQCheckpointError", "GPTQConfig", "GPTQConfigError", "GPTQExpert", "GPTQExperts",
    "GPTQLinear", "GPTQTensors",
    "ModuleQuant", "convert_checkpoint", "load_gptq", "quantize", "quantize_rtn", "read_config", "save_gptq",
]
