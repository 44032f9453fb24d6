"""Model families by ``model_type``."""

from __future__ import annotations

from flax import nnx

from hyjax.config import ModelConfig
from hyjax.models.kimi_linear import KimiLinearForCausalLM
from hyjax.models.qwen3_next import Qwen3NextForCausalLM

MODELS: dict[str, type[nnx.Module]] = {
    "qwen3_next": Qwen3NextForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[nnx.Module]:
    return MODELS[cfg.model_type]
