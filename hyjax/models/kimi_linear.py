"""Kimi-Linear for causal LM, in Flax NNX, on the ragged, paged and slotted serving interface.

Decoder layer ``i`` (pre-norm residual, plain RMSNorm ``w * normalize(x)`` everywhere)::

    h = h + self_attn(input_layernorm(h))        self_attn: KDA, or MLA (NoPE) on the latent cache
    h = h + mlp(post_attention_layernorm(h))     mlp: dense SwiGLU (the first layers) or SigmoidMoe

The stack around the layers (embedding, cache walk, final norm, logits) is
:mod:`hyjax.models.hybrid`'s; this file says what fills it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hyjax.config import KimiLinearConfig
from hyjax.layers.kda import KimiDeltaAttention
from hyjax.layers.mla import MultiHeadLatentAttention
from hyjax.layers.moe import MLP, SigmoidMoe
from hyjax.models.hybrid import HybridDecoderLayer, HybridForCausalLM


class KimiDecoderLayer(HybridDecoderLayer):
    """The mixer is ``self_attn`` in every layer, MLA or KDA (the checkpoint's names)."""

    zero_centred_norm = False

    def __init__(self, cfg: KimiLinearConfig, i: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg, i, dtype=dtype)
        if self.is_attention:
            self.self_attn = MultiHeadLatentAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype, rngs=rngs)
        if cfg.is_moe_layer(i):
            self.mlp = SigmoidMoe(
                cfg.hidden_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                expert_dim=cfg.moe_intermediate_size,
                shared_dim=cfg.moe_intermediate_size * cfg.num_shared_experts,
                renormalize=cfg.moe_renormalize,
                scaling_factor=cfg.routed_scaling_factor,
                num_groups=cfg.num_expert_group,
                topk_groups=cfg.topk_group,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def mixer(self) -> nnx.Module:
        return self.self_attn


class KimiLinearForCausalLM(HybridForCausalLM):
    layer_class = KimiDecoderLayer
