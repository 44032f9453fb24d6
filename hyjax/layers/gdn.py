"""Qwen3-Next Gated DeltaNet layer on the state pool (conv window + recurrent state per slot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hyjax.batch import Batch
from hyjax.config import Qwen3NextConfig
from hyjax.layers.linear import Linear
from hyjax.layers.norms import GatedRMSNorm
from hyjax.ops import Ops
from pallas_kernels.gdn.fused_decode import unpack_conv_channels

StateCache = tuple[jax.Array, jax.Array]  # conv [slots, K-1, C], ssm f32[slots, Hv, Dk, Dv]


class GatedDeltaNet(nnx.Module):
    """in_proj -> causal conv1d + SiLU -> gated delta rule -> gated RMSNorm(z) -> out_proj.

    ``in_proj_qkvz`` / ``in_proj_ba`` keep the checkpoint's per-key-head-group interleave::

        qkvz row group g (one per key head): | q_g (Dk) | k_g (Dk) | v (r*Dv) | z (r*Dv) |
        ba   row group g:                    | b (r) | a (r) |          r = Hv // Hk

    and are de-interleaved here; the conv channels are ``q (all heads) | k | v``, or, under
    tensor parallelism over ``conv_shards`` devices, that order within each device's heads::

        | q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...     (s: the heads of device s)

    so each device's slice of the channels is a whole local ``q | k | v`` (no resharding
    around the conv and the kernels; ``hyjax.sharding`` permutes ``conv1d`` to match).
    """

    conv_shards: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: Qwen3NextConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = self.hv // self.hk
        d, kk = cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.in_proj_qkvz = Linear(
            d, 2 * cfg.linear_key_dim + 2 * cfg.linear_value_dim, dtype=dtype, rngs=rngs
        )
        self.in_proj_ba = Linear(d, 2 * self.hv, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.5)
        self.conv1d = nnx.Param(init(rngs.params(), (cfg.conv_dim, kk), dtype))  # [C, K]
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (self.hv,), minval=1.0, maxval=16.0))
        )
        self.dt_bias = nnx.Param(jnp.ones((self.hv,), jnp.float32))
        self.norm = GatedRMSNorm(self.dv, eps=cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(cfg.linear_value_dim, d, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: StateCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[StateCache, jax.Array]:
        n = x.shape[0]
        hk, hv, dk, dv, r = self.hk, self.hv, self.dk, self.dv, self.ratio
        qkvz = self.in_proj_qkvz(x).reshape(n, hk, 2 * dk + 2 * r * dv)
        ba = self.in_proj_ba(x).reshape(n, hk, 2 * r)
        q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
        v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(n, hv, dv)
        z = qkvz[..., 2 * dk + r * dv :].reshape(n, hv, dv)
        b, a = ba[..., :r].reshape(n, hv), ba[..., r:].reshape(n, hv)

        mixed = pack_conv_channels(q, k, v, self.conv_shards)  # [n, C]
        conv_state, ssm_state = cache
        slots, qsl = batch.slots, batch.query_start_loc
        gates = (self.A_log[...], self.dt_bias[...])
        if decode_only:  # one token per row: conv and delta rule in one pass over the slots
            o, conv_state, ssm_state = ops.conv_gdn_decode(
                mixed, self.conv1d[...], conv_state, a, b, *gates, ssm_state, slots,
                num_k_heads=hk,
            )  # fmt: skip
        else:
            mixed, conv_state = ops.conv1d_prefill(mixed, self.conv1d[...], conv_state, qsl, slots)
            q, k, v = unpack_conv_channels(mixed, (hk, dk), (hv, dv), self.conv_shards)
            o, ssm_state = ops.gdn_prefill(q, k, v, a, b, *gates, ssm_state, qsl, slots)
        o = self.norm(o, z).reshape(n, hv * dv)
        return (conv_state, ssm_state), self.out_proj(o)


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
