"""Kimi-Linear: KDA + NoPE MLA + sigmoid-routed MoE. The family in one object."""

from hyjax.models.family import KernelRule, ModelFamily
from hyjax.models.kimi_linear import checkpoint
from hyjax.models.kimi_linear.config import (
    KimiLinearConfig,
    kimi_linear_48b_a3b,
    kimi_linear_tiny,
)
from hyjax.models.kimi_linear.model import KimiLinearForCausalLM
from hyjax.models.kimi_linear.sharding import SHARDING
from pallas_kernels.attention import mla_gpu
from pallas_kernels.kda import gpu as kda_gpu


def gpu_kernel_rules(cfg: KimiLinearConfig) -> list[KernelRule]:
    """Which Triton kernels of the KDA and MLA layers cannot take this config's dims
    (each kernel module's ``unsupported_reason``: their tiles are powers of two)."""
    return [
        (("kda_prefill", "kda_decode", "conv_kda_decode", "kda_multi_decode"),
         kda_gpu.unsupported_reason(cfg.linear_head_dim, cfg.linear_head_dim)),
        (("mla_prefill", "mla_decode"),
         mla_gpu.unsupported_reason(cfg.kv_lora_rank, cfg.qk_rope_head_dim)),
    ]  # fmt: skip


FAMILY = ModelFamily(
    config_class=KimiLinearConfig,
    model_class=KimiLinearForCausalLM,
    targets=checkpoint.targets,
    sharding=SHARDING,
    gpu_kernel_rules=gpu_kernel_rules,
    presets={"kimi-linear-48b-a3b": kimi_linear_48b_a3b, "kimi-linear-tiny": kimi_linear_tiny},
    float32_params=checkpoint.FLOAT32_PARAMS,
    checkpoint_name=checkpoint.checkpoint_name,
)

__all__ = ["FAMILY", "KimiLinearConfig", "KimiLinearForCausalLM"]
