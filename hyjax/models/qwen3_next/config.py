"""Qwen3-Next's config (a frozen dataclass parsed from ``config.json``) and its presets."""

from __future__ import annotations

import dataclasses
from typing import Any

from hyjax.cache import CacheSpec
from hyjax.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ModelConfig,
    check_layer_types,
    hf_dtype,
)
from hyjax.testing import tiny_qwen3_next_config


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(ModelConfig):
    """Qwen3-Next: Gated DeltaNet + gated full attention + sparse MoE."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # Full attention.
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    # Gated DeltaNet.
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    intermediate_size: int
    # Misc.
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    dtype: str  # the checkpoint's own dtype: "bfloat16" | "float32" | "float16"
    model_type: str = "qwen3_next"
    # Multi-token prediction layers (checkpoint ``mtp.*``) the model builds: 0 = none. Parsed
    # from ``num_nextn_predict_layers`` or ``mtp_num_hidden_layers``; Qwen3-Next-80B's
    # config.json names neither, so ``load_model(mtp=True)`` counts them in the checkpoint.
    num_mtp_layers: int = 0

    def __post_init__(self):
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"{self.linear_num_value_heads=} must be divisible by {self.linear_num_key_heads=}"
            )
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok=} must be at most {self.num_experts=}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"{self.num_attention_heads=} must be divisible by {self.num_key_value_heads=}"
            )
        if self.num_mtp_layers < 0:
            raise ValueError(f"{self.num_mtp_layers=} must be >= 0")

    # Derived values.
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q | k | v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @property
    def cache_spec(self) -> CacheSpec:
        kv = (self.num_key_value_heads, self.head_dim)  # k and v, per token and layer
        return CacheSpec(
            kv_token_shapes=(kv, kv),
            num_attention_layers=len(self.attention_layers),
            conv_shape=(self.linear_conv_kernel_dim - 1, self.conv_dim),
            ssm_shape=(  # S^T: [H, Dv, Dk] (hyjax.cache)
                self.linear_num_value_heads,
                self.linear_value_head_dim,
                self.linear_key_head_dim,
            ),
            num_linear_layers=len(self.linear_layers),
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> Qwen3NextConfig:
        n = d.get("num_hidden_layers", 48)
        layer_types = d.get("layer_types")
        if layer_types is None:
            interval = d.get("full_attention_interval", 4)
            layer_types = [
                FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)
            ]
        eos = d.get("eos_token_id")
        rope_theta = d.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it in rope_parameters.
            rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        prf = d.get("partial_rotary_factor")
        if prf is None:
            prf = (d.get("rope_parameters") or {}).get("partial_rotary_factor", 0.25)
        hidden = d.get("hidden_size", 2048)
        heads = d.get("num_attention_heads", 16)
        return cls(
            vocab_size=d.get("vocab_size", 151936),
            hidden_size=hidden,
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads", 2),
            head_dim=d.get("head_dim") or hidden // heads,
            partial_rotary_factor=float(prf),
            rope_theta=float(rope_theta),
            linear_num_key_heads=d.get("linear_num_key_heads", 16),
            linear_num_value_heads=d.get("linear_num_value_heads", 32),
            linear_key_head_dim=d.get("linear_key_head_dim", 128),
            linear_value_head_dim=d.get("linear_value_head_dim", 128),
            linear_conv_kernel_dim=d.get("linear_conv_kernel_dim", 4),
            num_experts=d.get("num_experts", 512),
            num_experts_per_tok=d.get("num_experts_per_tok", 10),
            moe_intermediate_size=d.get("moe_intermediate_size", 512),
            shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 512),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            decoder_sparse_step=d.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            intermediate_size=d.get("intermediate_size", 5632),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            dtype=hf_dtype(d),
            num_mtp_layers=int(
                d.get("num_nextn_predict_layers") or d.get("mtp_num_hidden_layers") or 0
            ),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` dict transformers reads (used by presets and tests)."""
        mtp = {"num_nextn_predict_layers": self.num_mtp_layers} if self.num_mtp_layers else {}
        return mtp | {
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rope_theta": self.rope_theta,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }


# Presets: named constructors (real sizes, and the tiny test model).


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
