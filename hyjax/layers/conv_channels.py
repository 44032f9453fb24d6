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

from pallas_kernels.conv1d.reference import split_qkvz

__all__ = ["conv_channel_order", "pack_conv_channels", "split_qkvz"]


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


def conv_channel_order(
    qk_heads: tuple[int, int], v_heads: tuple[int, int], shards: int
) -> np.ndarray:
    """``order[i]`` = the checkpoint's conv channel at position ``i`` of the sharded layout."""
    (hk, dk), (hv, dv) = qk_heads, v_heads
    idx = np.arange(2 * hk * dk + hv * dv)
    q, k, v = idx[: hk * dk], idx[hk * dk : 2 * hk * dk], idx[2 * hk * dk :]
    parts = [t.reshape(shards, -1) for t in (q, k, v)]
    return np.concatenate(parts, axis=1).reshape(-1)
