"""Model architectures, built through the registry (`build_model`) to the `CausalLM` contract."""

from deepinfer.engine.models.base import CausalLM
from deepinfer.engine.models.registry import MODEL_CLASSES, build_model

__all__ = ["MODEL_CLASSES", "CausalLM", "build_model"]
