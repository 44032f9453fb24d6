"""Kimi-Linear's config (a frozen dataclass parsed from ``config.json``) and its presets."""

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
from hyjax.testing import tiny_kimi_linear_config

DENSE = "dense"
SPARSE = "sparse"


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(ModelConfig):
    """Kimi-Linear: KDA (per-channel gated delta rule) + NoPE MLA + sigmoid-routed MoE.

    Layer lists of the checkpoint's ``linear_attn_config`` are 1-indexed; here ``layer_types``
    and ``mlp_layer_types`` are 0-indexed tuples like transformers keeps them.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    # MLA (full attention, NoPE).
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # KDA.
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    # MoE.
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    routed_scaling_factor: float
    moe_renormalize: bool
    num_expert_group: int
    topk_group: int
    intermediate_size: int
    # Misc.
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | tuple[int, ...] | None
    dtype: str
    pad_token_id: int | None = None
    # ``kv_a_layernorm`` keeps the module default eps (1e-6) in the official code and HF.
    kv_a_layernorm_eps: float = 1e-6
    model_type: str = "kimi_linear"

    def __post_init__(self):
        check_layer_types(self.layer_types, self.num_hidden_layers)
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"{len(self.mlp_layer_types)=} does not match {self.num_hidden_layers=}"
            )
        bad = sorted(set(self.mlp_layer_types) - {DENSE, SPARSE})
        if bad:
            raise ValueError(f"unknown mlp layer types {bad}; expected 'dense' or 'sparse'")
        if SPARSE in self.mlp_layer_types and self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"{self.num_experts_per_tok=} must be at most {self.num_experts=}")
        if self.num_experts % self.num_expert_group:
            raise ValueError(f"{self.num_experts=} must be divisible by {self.num_expert_group=}")
        if not 1 <= self.topk_group <= self.num_expert_group:
            raise ValueError(f"{self.topk_group=} must be in [1, {self.num_expert_group=}]")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Cached per token and MLA layer: normalised ``c_kv`` then the shared ``k_rope``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def linear_dim(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the three short convolutions, cached side by side: q | k | v."""
        return 3 * self.linear_dim

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == SPARSE

    @property
    def cache_spec(self) -> CacheSpec:
        # MLA caches the compressed latent, not K/V; KDA keeps the q|k|v conv windows side by side.
        d = self.linear_head_dim
        return CacheSpec(
            kv_token_shapes=((self.latent_dim,),),
            num_attention_layers=len(self.attention_layers),
            conv_shape=(self.linear_conv_kernel_dim - 1, self.conv_dim),
            ssm_shape=(self.linear_num_heads, d, d),  # S^T: [H, Dv, Dk] (hyjax.cache)
            num_linear_layers=len(self.linear_layers),
        )

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> KimiLinearConfig:
        """Reads the original checkpoint's keys and transformers' (>= 5.17) names alike."""
        n = d.get("num_hidden_layers", 27)
        lin = d.get("linear_attn_config") or {}
        if d.get("mla_use_nope") is False or d.get("rope_scaling"):
            raise ValueError("only NoPE MLA (mla_use_nope: true) is supported for kimi_linear")
        if lin.get("gate_lower_bound") is not None or lin.get("use_full_rank_gate"):
            raise ValueError("KDA gate_lower_bound / use_full_rank_gate are not supported")
        layer_types = d.get("layer_types")
        if layer_types is None:
            if "full_attn_layers" in lin and "kda_layers" in lin:
                layer_types = [None] * n
                for i in lin["full_attn_layers"]:  # 1-indexed
                    layer_types[i - 1] = FULL_ATTENTION
                for i in lin["kda_layers"]:
                    layer_types[i - 1] = LINEAR_ATTENTION
                if None in layer_types:
                    missing = [i + 1 for i, t in enumerate(layer_types) if t is None]
                    raise ValueError(f"linear_attn_config names no kind for layers {missing}")
            else:
                layer_types = [
                    FULL_ATTENTION if i and i % 4 == 0 else LINEAR_ATTENTION for i in range(n)
                ]
        num_experts = d.get("num_experts", d.get("num_local_experts", 256))
        mlp_types = d.get("mlp_layer_types")
        if mlp_types is None:
            first_dense = d.get("first_k_dense_replace", 1)
            freq = d.get("moe_layer_freq", 1)
            mlp_types = [
                SPARSE if num_experts and i >= first_dense and i % freq == 0 else DENSE
                for i in range(n)
            ]
        eos = d.get("eos_token_id")
        heads = d.get("num_attention_heads", 32)
        return cls(
            vocab_size=d.get("vocab_size", 163840),
            hidden_size=d.get("hidden_size", 2304),
            num_hidden_layers=n,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            num_attention_heads=heads,
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d.get("kv_lora_rank", 512),
            qk_nope_head_dim=d.get("qk_nope_head_dim", 128),
            qk_rope_head_dim=d.get("qk_rope_head_dim", 64),
            v_head_dim=d.get("v_head_dim") or 128,
            linear_num_heads=lin.get("num_heads", d.get("linear_num_heads", 32)),
            linear_head_dim=lin.get("head_dim", d.get("linear_head_dim", 128)),
            linear_conv_kernel_dim=lin.get(
                "short_conv_kernel_size", d.get("linear_conv_kernel_dim", 4)
            ),
            num_experts=num_experts,
            num_experts_per_tok=d.get("num_experts_per_token", d.get("num_experts_per_tok", 8)),
            moe_intermediate_size=d.get("moe_intermediate_size", 1024),
            num_shared_experts=d.get("num_shared_experts", d.get("n_shared_experts", 1)) or 0,
            routed_scaling_factor=float(d.get("routed_scaling_factor", 2.446)),
            moe_renormalize=bool(d.get("moe_renormalize", d.get("norm_topk_prob", True))),
            num_expert_group=d.get("num_expert_group", d.get("n_group", 1)) or 1,
            topk_group=d.get("topk_group") or 1,
            intermediate_size=d.get("intermediate_size", 9216),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=d.get(
                "model_max_length", d.get("max_position_embeddings", 1048576)
            ),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=d.get("pad_token_id"),
            dtype=hf_dtype(d),
        )

    def to_hf(self) -> dict[str, Any]:
        """The ``config.json`` of the original checkpoint (transformers >= 5.17 reads it)."""
        full = [i + 1 for i in self.attention_layers]
        kda = [i + 1 for i in self.linear_layers]
        first_dense = next(
            (i for i, t in enumerate(self.mlp_layer_types) if t == SPARSE), self.num_hidden_layers
        )
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "first_k_dense_replace": first_dense,
            "linear_attn_config": {
                "full_attn_layers": full,
                "kda_layers": kda,
                "num_heads": self.linear_num_heads,
                "head_dim": self.linear_head_dim,
                "short_conv_kernel_size": self.linear_conv_kernel_dim,
            },
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_attention_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "mla_use_nope": True,
            "num_experts": self.num_experts,
            "num_experts_per_token": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_shared_experts": self.num_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_renormalize": self.moe_renormalize,
            "moe_router_activation_func": "sigmoid",
            "use_grouped_topk": True,
            "num_expert_group": self.num_expert_group,
            "topk_group": self.topk_group,
            "intermediate_size": self.intermediate_size,
            "rms_norm_eps": self.rms_norm_eps,
            "model_max_length": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
            "attention_bias": False,
            "torch_dtype": self.dtype,
        }


# Presets: named constructors (real sizes, and the tiny test model).


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
