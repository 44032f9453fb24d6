"""Shared pieces of the benchmark scripts: a Qwen3-Next-shaped random model, device info."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.config import Qwen3NextConfig
from hyjax.models.qwen3_next import Qwen3NextForCausalLM


def bench_config(num_layers: int = 8, num_experts: int = 64) -> Qwen3NextConfig:
    """Qwen3-Next-80B-A3B's layer shapes (GDN 16/32 heads x 128, attention 16/2 x 256, MoE
    top-10 of 512-wide experts), with fewer layers and experts so it fits one GPU quickly."""
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "num_hidden_layers": num_layers,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10_000_000,
            "num_experts": num_experts,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "max_position_embeddings": 262144,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
        }
    )


def random_model(cfg: Qwen3NextConfig, seed: int = 0):
    """Builds the model directly on the device (jit-initialised, bf16)."""

    @nnx.jit
    def build():
        return Qwen3NextForCausalLM(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed))

    return build()


def device_name() -> str:
    d = jax.devices()[0]
    return f"{d.platform}:{getattr(d, 'device_kind', '?')}"
