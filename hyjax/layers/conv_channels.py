"""The conv channel layout that GDN and KDA share: ``q | k | v`` within each device's heads.

Under tensor parallelism over ``shards`` devices the channels of the short convolution (and of
its window in the state pool) are ordered::

    | q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...     (s: the heads of device s)

so each device's slice of the channels is a whole local ``q | k | v``: no resharding around the
conv and the kernels. With one shard this is the plain ``q (all heads) | k | v``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def pack_conv_channels(
    q: jax.Array,  # [n, Hk, Dk]
    k: jax.Array,  # [n, Hk, Dk]
    v: jax.Array,  # [n, Hv, Dv]
    shards: int,
) -> jax.Array:
    """``[n, C]`` conv channels: ``q | k | v`` per group of ``H / shards`` heads (see above)."""
    n = q.shape[0]
    parts = [t.reshape(n, shards, -1) for t in (q, k, v)]  # [n, shards, local channels]
    return jnp.concatenate(parts, axis=-1).reshape(n, -1)


def split_qkvz(qkvz: jax.Array, num_k_heads: int, dk: int, dv: int, ratio: int):
    """A GDN input projection's output, ``[n, Hk * W]`` (``W = 2 Dk + 2 r Dv``: per key head
    ``q | k | v of its r value heads | z``), as ``q, k [n, Hk, Dk]``, ``v, z [n, Hk r, Dv]``."""
    n = qkvz.shape[0]
    per_head = qkvz.reshape(n, num_k_heads, 2 * dk + 2 * ratio * dv)
    q, k = per_head[..., :dk], per_head[..., dk : 2 * dk]
    v = per_head[..., 2 * dk : 2 * dk + ratio * dv].reshape(n, num_k_heads * ratio, dv)
    z = per_head[..., 2 * dk + ratio * dv :].reshape(n, num_k_heads * ratio, dv)
    return q, k, v, z


def conv_channel_order(
    qk_heads: tuple[int, int], v_heads: tuple[int, int], shards: int
) -> np.ndarray:
    """``order[i]`` = the checkpoint's conv channel at position ``i`` of the sharded layout."""
    (hk, dk), (hv, dv) = qk_heads, v_heads
    idx = np.arange(2 * hk * dk + hv * dv)
    q, k, v = idx[: hk * dk], idx[hk * dk : 2 * hk * dk], idx[2 * hk * dk :]
    parts = [t.reshape(shards, -1) for t in (q, k, v)]
    return np.concatenate(parts, axis=1).reshape(-1)
