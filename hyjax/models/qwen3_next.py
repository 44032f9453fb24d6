"""Qwen3-Next for causal LM, in Flax NNX, on the ragged, paged and slotted serving interface.

Decoder layer ``i`` (zero-centred RMSNorm ``(1 + w) * normalize(x)`` everywhere)::

    h = h + mixer(input_layernorm(h))       mixer: GatedDeltaNet or GatedAttention
    h = h + mlp(post_attention_layernorm(h))  mlp: SparseMoe (or a dense MLP)

The stack around the layers (embedding, cache walk, final norm, logits) is
:mod:`hyjax.models.hybrid`'s; this file says what fills it.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from hyjax.config import Qwen3NextConfig
from hyjax.layers.attention import GatedAttention
from hyjax.layers.gdn import GatedDeltaNet
from hyjax.layers.moe import MLP, SparseMoe
from hyjax.models.hybrid import HybridDecoderLayer, HybridForCausalLM


class DecoderLayer(HybridDecoderLayer):
    """The mixer is ``self_attn`` (attention layers) or ``linear_attn`` (GDN layers)."""

    zero_centred_norm = True

    def __init__(self, cfg: Qwen3NextConfig, i: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        super().__init__(cfg, i, dtype=dtype)
        if self.is_attention:
            self.self_attn = GatedAttention(cfg, dtype=dtype, rngs=rngs)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype, rngs=rngs)
        if cfg.is_moe_layer(i):
            self.mlp = SparseMoe(
                cfg.hidden_size,
                num_experts=cfg.num_experts,
                top_k=cfg.num_experts_per_tok,
                expert_dim=cfg.moe_intermediate_size,
                shared_dim=cfg.shared_expert_intermediate_size,
                norm_topk_prob=cfg.norm_topk_prob,
                dtype=dtype,
                rngs=rngs,
            )
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, rngs=rngs)

    def mixer(self) -> nnx.Module:
        return self.self_attn if self.is_attention else self.linear_attn


class Qwen3NextForCausalLM(HybridForCausalLM):
    layer_class = DecoderLayer
