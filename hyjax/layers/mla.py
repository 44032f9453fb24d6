"""Kimi-Linear's multi-head latent attention (NoPE) on the paged latent cache.

Per token only the latent ``[c_kv (kv_lora_rank) | k_rope (rope dims)]`` is cached
(:mod:`pallas_kernels.attention.mla_reference` draws the layout); ``kv_b_proj`` turns it into
keys and values inside the attention op: decompressed for prefill, absorbed for decode.
Kimi-Linear applies no rotary embedding anywhere: the "rope" dims enter the dot product as
they are, shared by every head and not normalised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.config import KimiLinearConfig
from hyjax.layers.linear import Linear
from hyjax.layers.norms import RMSNorm
from hyjax.ops import Ops

LatentCache = tuple[jax.Array]  # ([num_blocks, block_size, kv_lora_rank + rope dims],)


class MultiHeadLatentAttention(nnx.Module):
    def __init__(self, cfg: KimiLinearConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads, self.lora = heads, cfg.kv_lora_rank
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.scale = cfg.qk_head_dim**-0.5
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        else:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
            # The module default eps, as for kv_a_layernorm.
            self.q_a_layernorm = RMSNorm(
                cfg.q_lora_rank, eps=cfg.kv_a_layernorm_eps, zero_centred=False, dtype=dtype
            )
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, dtype=dtype, rngs=rngs)
        self.kv_a_proj_with_mqa = Linear(hidden, cfg.latent_dim, dtype=dtype, rngs=rngs)
        self.kv_a_layernorm = RMSNorm(
            cfg.kv_lora_rank, eps=cfg.kv_a_layernorm_eps, zero_centred=False, dtype=dtype
        )
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, heads * (self.nope + self.v_dim), dtype=dtype, rngs=rngs
        )
        self.o_proj = Linear(heads * self.v_dim, hidden, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: LatentCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[LatentCache, jax.Array]:
        n = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(n, self.num_heads, self.nope + self.rope)  # per head: q_nope | q_rope
        ckv = self.kv_a_proj_with_mqa(x)  # [T, L + R]
        c_kv = self.kv_a_layernorm(ckv[:, : self.lora])  # normalised; k_rope is not
        latent = jnp.concatenate([c_kv, ckv[:, self.lora :]], axis=-1)
        (latent_cache,) = cache
        latent_cache = ops.write_latent(latent, latent_cache, batch.slot_mapping)
        w_kv_b = self.kv_b_proj.weight[...].reshape(self.lora, self.num_heads, -1)  # [L, H, Dn+Dv]
        attn = dict(nope_dim=self.nope, scale=self.scale)
        if decode_only:
            o = ops.mla_decode(
                q, latent_cache, w_kv_b, batch.seq_lens, batch.block_tables, batch.num_seqs, **attn
            )
        else:
            o = ops.mla_prefill(
                q,
                latent_cache,
                w_kv_b,
                batch.query_start_loc,
                batch.seq_lens,
                batch.block_tables,
                batch.num_seqs,
                **attn,
            )
        return (latent_cache,), self.o_proj(o.reshape(n, self.num_heads * self.v_dim))
