"""Kimi-Linear: KDA + NoPE MLA + sigmoid-routed MoE. The family in one object."""

from hyjax.models.family import ModelFamily
from hyjax.models.kimi_linear import checkpoint
from hyjax.models.kimi_linear.config import (
    KimiLinearConfig,
    kimi_linear_48b_a3b,
    kimi_linear_tiny,
)
from hyjax.models.kimi_linear.model import KimiLinearForCausalLM

FAMILY = ModelFamily(
    config_class=KimiLinearConfig,
    model_class=KimiLinearForCausalLM,
    targets=checkpoint.targets,
    presets={"kimi-linear-48b-a3b": kimi_linear_48b_a3b, "kimi-linear-tiny": kimi_linear_tiny},
    float32_params=checkpoint.FLOAT32_PARAMS,
    checkpoint_name=checkpoint.checkpoint_name,
)

__all__ = ["FAMILY", "KimiLinearConfig", "KimiLinearForCausalLM"]
