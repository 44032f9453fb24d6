"""Qwen3-Next: Gated DeltaNet + gated full attention + sparse MoE. The family in one object."""

from hyjax.models.family import KernelRule, ModelFamily
from hyjax.models.qwen3_next import checkpoint
from hyjax.models.qwen3_next.config import Qwen3NextConfig, qwen3_next_80b_a3b, qwen3_next_tiny
from hyjax.models.qwen3_next.model import Qwen3NextForCausalLM
from hyjax.models.qwen3_next.sharding import SHARDING
from pallas_kernels.attention import gpu as attention_gpu
from pallas_kernels.gdn import gpu as gdn_gpu


def gpu_kernel_rules(cfg: Qwen3NextConfig) -> list[KernelRule]:
    """Which Triton kernels of the GDN and attention layers cannot take this config's dims
    (each kernel module's ``unsupported_reason``: their tiles are powers of two)."""
    gdn = gdn_gpu.unsupported_reason(cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    return [
        (("gdn_prefill", "gdn_decode", "conv_gdn_decode", "gdn_multi_decode"), gdn),
        (("paged_attention", "paged_attention_decode"),
         attention_gpu.unsupported_reason(cfg.head_dim)),
    ]  # fmt: skip


FAMILY = ModelFamily(
    config_class=Qwen3NextConfig,
    model_class=Qwen3NextForCausalLM,
    targets=checkpoint.targets,
    sharding=SHARDING,
    gpu_kernel_rules=gpu_kernel_rules,
    presets={"qwen3-next-80b-a3b": qwen3_next_80b_a3b, "qwen3-next-tiny": qwen3_next_tiny},
    float32_params=checkpoint.FLOAT32_PARAMS,
)

__all__ = ["FAMILY", "Qwen3NextConfig", "Qwen3NextForCausalLM"]
