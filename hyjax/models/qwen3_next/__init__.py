"""Qwen3-Next: Gated DeltaNet + gated full attention + sparse MoE. The family in one object."""

from hyjax.models.family import ModelFamily
from hyjax.models.qwen3_next import checkpoint
from hyjax.models.qwen3_next.config import Qwen3NextConfig, qwen3_next_80b_a3b, qwen3_next_tiny
from hyjax.models.qwen3_next.model import Qwen3NextForCausalLM

FAMILY = ModelFamily(
    config_class=Qwen3NextConfig,
    model_class=Qwen3NextForCausalLM,
    targets=checkpoint.targets,
    presets={"qwen3-next-80b-a3b": qwen3_next_80b_a3b, "qwen3-next-tiny": qwen3_next_tiny},
    float32_params=checkpoint.FLOAT32_PARAMS,
)

__all__ = ["FAMILY", "Qwen3NextConfig", "Qwen3NextForCausalLM"]
