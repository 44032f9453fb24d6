"""Qwen3-Next presets."""

from hyjax.config import Qwen3NextConfig
from hyjax.testing import tiny_qwen3_next_config


def qwen3_next_80b_a3b() -> Qwen3NextConfig:
    """``Qwen/Qwen3-Next-80B-A3B-Instruct`` (its config.json values)."""
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "vocab_size": 151936,
            "hidden_size": 2048,
            "num_hidden_layers": 48,
            "full_attention_interval": 4,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10_000_000,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "intermediate_size": 5120,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
        }
    )


def qwen3_next_tiny(**overrides) -> Qwen3NextConfig:
    """The 4-layer test model (GVA 3, GQA 2, Dk != Dv, one dense layer), float32."""
    return Qwen3NextConfig.from_hf(
        {
            "model_type": "qwen3_next",
            "torch_dtype": "float32",
            **tiny_qwen3_next_config(**overrides),
        }
    )
