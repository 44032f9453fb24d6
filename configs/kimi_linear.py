"""Kimi-Linear presets."""

from hyjax.config import KimiLinearConfig
from hyjax.testing import tiny_kimi_linear_config


def kimi_linear_48b_a3b() -> KimiLinearConfig:
    """``moonshotai/Kimi-Linear-48B-A3B-Instruct`` (its config.json values)."""
    return KimiLinearConfig.from_hf(
        {
            "model_type": "kimi_linear",
            "vocab_size": 163840,
            "hidden_size": 2304,
            "num_hidden_layers": 27,
            "linear_attn_config": {
                "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                "kda_layers": [
                    *(1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15),
                    *(17, 18, 19, 21, 22, 23, 25, 26),
                ],
                "num_heads": 32,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
            },
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "head_dim": 72,
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "rope_theta": 10000.0,
            "num_experts": 256,
            "num_experts_per_token": 8,
            "moe_intermediate_size": 1024,
            "num_shared_experts": 1,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "routed_scaling_factor": 2.446,
            "use_grouped_topk": True,
            "num_expert_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "intermediate_size": 9216,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "model_max_length": 1048576,
            "tie_word_embeddings": False,
            "num_nextn_predict_layers": 0,
            "bos_token_id": 163584,
            "eos_token_id": 163586,
            "pad_token_id": 163839,
            "torch_dtype": "bfloat16",
        }
    )


def kimi_linear_tiny(**overrides) -> KimiLinearConfig:
    """The 4-layer test model (KDA, MLA, KDA, MLA; dense layer 0; 2 expert groups), float32."""
    return KimiLinearConfig.from_hf(
        {
            "model_type": "kimi_linear",
            "torch_dtype": "float32",
            **tiny_kimi_linear_config(**overrides),
        }
    )
