"""The model registry: which class serves which architecture.

Loaders translate their format's architecture name into `ModelConfig.architecture` (config.json's
`model_type`, or its `architectures` class name when `model_type` is absent; GGUF's
`general.architecture`, with `llama` plus experts read as `mixtral` and `qwen2moe` as `qwen2_moe`).
DeepSeek-V2 and V3 share one class (`deepseek.py`): their differences are routing settings in `MoEConfig`.
The engine and the draft-model proposer build every model through `build_model`, never a class by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.config.model import ConfigError, ModelConfig
from deepinfer.engine.models.base import CausalLM
from deepinfer.engine.models.deepseek import DeepseekModel
from deepinfer.engine.models.llama import LlamaModel
from deepinfer.engine.models.moe import MoEModel

# (config, our-name state dict, max positions, device) -> model
ModelFactory = Callable[[ModelConfig, dict[str, torch.Tensor], int, str], CausalLM]

MODEL_CLASSES: dict[str, ModelFactory] = {
    "llama": LlamaModel,
    "qwen2": LlamaModel,
    "mistral": LlamaModel,
    "mixtral": MoEModel,
    "qwen2_moe": MoEModel,
    "deepseek_v2": DeepseekModel,
    "deepseek_v3": DeepseekModel,
}


def model_factory(config: ModelConfig) -> ModelFactory:
    try:
        return MODEL_CLASSES[config.architecture]
    except KeyError:
        raise ConfigError(f"no model class serves architecture {config.architecture!r}; "
                          f"registered: {', '.join(MODEL_CLASSES)}") from None


def build_model(config: ModelConfig, state_dict: dict[str, torch.Tensor], max_positions: int,
                device: str = "cpu") -> CausalLM:
    """The model for `config.architecture`, holding `state_dict` (our names, see weights.py) on `device`,
    with position tables for `max_positions` tokens."""
    return model_factory(config)(config, state_dict, max_positions, device)
