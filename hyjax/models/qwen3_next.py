"""Qwen3-Next for causal LM, in Flax NNX, on the ragged, paged and slotted serving interface.

Decoder layer ``i``::

    h = h + mixer(input_layernorm(h))       mixer: GatedDeltaNet or GatedAttention
    h = h + mlp(post_attention_layernorm(h))  mlp: SparseMoe (or a dense MLP)

The forward takes one flat ragged batch (:class:`hyjax.batch.Batch`) and the device caches,
and returns the updated caches with the logits of the tokens at ``batch.logits_indices``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.cache import Caches
from hyjax.config import FULL_ATTENTION, Qwen3NextConfig
from hyjax.layers.attention import GatedAttention
from hyjax.layers.gdn import GatedDeltaNet
from hyjax.layers.linear import Linear
from hyjax.layers.moe import MLP, SparseMoe
from hyjax.layers.norms import RMSNorm
from hyjax.ops import Ops

# flax >= 0.12 wants lists of modules wrapped; older versions take plain lists.
_ModuleList = getattr(nnx, "List", list)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, i: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.is_attention = cfg.layer_types[i] == FULL_ATTENTION
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
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

    def __call__(self, h, cache, batch: Batch, ops: Ops, *, decode_only: bool):
        x = self.input_layernorm(h)
        if self.is_attention:
            cache, y = self.self_attn(x, cache, batch, ops, decode_only=decode_only)
        else:
            cache, y = self.linear_attn(x, cache, batch, ops, decode_only=decode_only)
        h = h + y
        h = h + self.mlp(self.post_attention_layernorm(h))
        return cache, h


class Qwen3NextForCausalLM(nnx.Module):
    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.config = cfg
        self.dtype = dtype
        init = nnx.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = _ModuleList(
            [DecoderLayer(cfg, i, dtype=dtype, rngs=rngs) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype, rngs=rngs)

    def __call__(
        self, batch: Batch, caches: Caches, ops: Ops, *, decode_only: bool = False
    ) -> tuple[Caches, jax.Array]:
        """Runs every layer over the batch. Returns ``(caches, logits f32[S, vocab])``."""
        h = self.embed_tokens[...][batch.input_ids]  # [T, D]
        kv, conv, ssm = list(caches.kv), list(caches.conv), list(caches.ssm)
        attn_i = lin_i = 0
        for layer in self.layers:
            if layer.is_attention:
                kv[attn_i], h = layer(h, kv[attn_i], batch, ops, decode_only=decode_only)
                attn_i += 1
            else:
                (conv[lin_i], ssm[lin_i]), h = layer(
                    h, (conv[lin_i], ssm[lin_i]), batch, ops, decode_only=decode_only
                )
                lin_i += 1
        h = self.norm(h[batch.logits_indices])  # [S, D]
        return Caches(kv=tuple(kv), conv=tuple(conv), ssm=tuple(ssm)), self.logits(h)

    def logits(self, h: jax.Array) -> jax.Array:
        if self.config.tie_word_embeddings:
            w = self.embed_tokens[...].T
        else:
            w = self.lm_head.weight[...]
        return jnp.einsum("SD,DV->SV", h, w, preferred_element_type=jnp.float32)
