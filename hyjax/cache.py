"""Device caches: the paged KV pool (full-attention layers) and the state pool (GDN layers).

One state *slot* holds, for every linear-attention layer, the conv window (last K-1 pre-conv
inputs, model dtype) and the recurrent state (float32). Slot 0 is NULL; block 0 is null.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hyjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Caches:
    kv: tuple[tuple[jax.Array, jax.Array], ...]  # per attention layer: k, v [NB, bs, Hkv, D]
    conv: tuple[jax.Array, ...]  # per linear layer: [num_slots, K-1, conv_dim]
    ssm: tuple[jax.Array, ...]  # per linear layer: f32[num_slots, Hv, Dk, Dv]


def kv_block_bytes(cfg: ModelConfig, block_size: int, dtype: jnp.dtype) -> int:
    """Bytes of one KV block over all attention layers."""
    per_token = 2 * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    return per_token * block_size * len(cfg.attention_layers)


def state_slot_bytes(cfg: ModelConfig, dtype: jnp.dtype) -> int:
    """Bytes of one state slot over all linear-attention layers."""
    conv = (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * jnp.dtype(dtype).itemsize
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return (conv + ssm) * len(cfg.linear_layers)


def init_caches(
    cfg: ModelConfig,
    *,
    num_blocks: int,
    block_size: int,
    num_slots: int,
    dtype: jnp.dtype,
    fill: float = 0.0,
) -> Caches:
    """Allocates the pools. ``fill=nan`` poisons them so a stray read shows up in tests."""
    kv_shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    conv_shape = (num_slots, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim)
    ssm_shape = (
        num_slots,
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    )
    kv = tuple(
        (jnp.full(kv_shape, fill, dtype), jnp.full(kv_shape, fill, dtype))
        for _ in cfg.attention_layers
    )
    conv = tuple(jnp.full(conv_shape, fill, dtype) for _ in cfg.linear_layers)
    ssm = tuple(jnp.full(ssm_shape, fill, jnp.float32) for _ in cfg.linear_layers)
    return Caches(kv=kv, conv=conv, ssm=ssm)


def cache_nbytes(caches: Caches) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(caches)))
