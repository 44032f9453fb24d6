"""Qwen3-Next gated full attention on the paged KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.config import Qwen3NextConfig
from hyjax.layers.linear import Linear
from hyjax.layers.norms import RMSNorm
from hyjax.layers.rope import apply_partial_rope
from hyjax.ops import Ops

KVCache = tuple[jax.Array, jax.Array]


class GatedAttention(nnx.Module):
    """q/k RMSNorm -> partial RoPE -> paged GQA attention -> ``* sigmoid(gate)`` -> o_proj.

    ``q_proj`` rows interleave per head ``[query(D) | gate(D)]``, as the checkpoint stores them.
    With more tensor-parallel devices than kv heads, each kv head is repeated ``kv_repeat``
    times after the projection (and cached so), so every device holds the kv head its query
    heads read.
    """

    kv_repeat: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        d, hq, hkv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.num_heads, self.num_kv_heads, self.head_dim = hq, hkv, hd
        self.rotary_dim, self.rope_theta = cfg.rotary_dim, cfg.rope_theta
        self.q_proj = Linear(d, hq * hd * 2, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(d, hkv * hd, dtype=dtype, rngs=rngs)
        self.o_proj = Linear(hq * hd, d, dtype=dtype, rngs=rngs)
        norm = dict(eps=cfg.rms_norm_eps, zero_centred=True, dtype=dtype)
        self.q_norm = RMSNorm(hd, **norm)
        self.k_norm = RMSNorm(hd, **norm)

    def __call__(
        self, x: jax.Array, cache: KVCache, batch: Batch, ops: Ops, *, decode_only: bool = False
    ) -> tuple[KVCache, jax.Array]:
        num_tokens = x.shape[0]
        qg = self.q_proj(x).reshape(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., : self.head_dim], qg[..., self.head_dim :]
        k = self.k_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.kv_repeat > 1:  # [T, Hkv * kv_repeat, D], copies of a head side by side
            k = jnp.repeat(k, self.kv_repeat, axis=1)
            v = jnp.repeat(v, self.kv_repeat, axis=1)
        rope = dict(rotary_dim=self.rotary_dim, theta=self.rope_theta)
        q = apply_partial_rope(self.q_norm(q), batch.positions, **rope)
        k = apply_partial_rope(self.k_norm(k), batch.positions, **rope)

        k_cache, v_cache = ops.write_kv(k, v, cache[0], cache[1], batch.slot_mapping)
        attend = ops.paged_attention_decode if decode_only else ops.paged_attention
        o = attend(
            q,
            k_cache,
            v_cache,
            batch.query_start_loc,
            batch.seq_lens,
            batch.block_tables,
            batch.num_seqs,
            scale=self.head_dim**-0.5,
        )
        o = o.reshape(num_tokens, -1) * jax.nn.sigmoid(gate.reshape(num_tokens, -1))
        return (k_cache, v_cache), self.o_proj(o)
