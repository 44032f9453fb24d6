"""Kimi-Linear's KDA layer on the state pool (q|k|v conv windows + recurrent state per slot)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.batch import Batch
from hyjax.config import KimiLinearConfig
from hyjax.layers.gdn import pack_conv_channels, unpack_conv_channels
from hyjax.layers.linear import Linear
from hyjax.layers.norms import rms_normalize
from hyjax.ops import Ops

StateCache = tuple[jax.Array, jax.Array]  # conv [slots, K-1, 3P], ssm f32[slots, H, Dk, Dv]


class SigmoidGatedRMSNorm(nnx.Module):
    """KDA output norm (FLA ``FusedRMSNormGated``, sigmoid): ``w * normalize(x) * sigmoid(g)``.

    All in float32, per head over the last axis; cast to ``x.dtype`` at the end.
    """

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        y = rms_normalize(x, self.eps) * self.weight[...].astype(jnp.float32)
        return (y * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(x.dtype)


class KimiDeltaAttention(nnx.Module):
    """q/k/v projections -> three short convs + SiLU -> KDA -> gated o_norm -> o_proj.

    The three depthwise convolutions are kept as the checkpoint stores them (``q_conv1d``,
    ``k_conv1d``, ``v_conv1d``) and run as one conv over the channels ``q | k | v``: the conv
    window of a slot holds the three windows side by side. The forget gate is low rank
    (``f_a_proj`` then ``f_b_proj``) with one decay per key channel; the KDA op applies
    ``A_log`` / ``dt_bias`` / softplus itself, like the GDN op does.

    Under tensor parallelism over ``conv_shards`` devices the conv channels are ``q | k | v``
    within each device's heads (the layout of :class:`hyjax.layers.gdn.GatedDeltaNet`)::

        | q_0 | k_0 | v_0 | q_1 | k_1 | v_1 | ...     (s: the heads of device s)

    so each device's slice of the channels, and of the conv window pool, is a whole local
    ``q | k | v``. The checkpoint keeps the three filters apart, so the layout is built at
    trace time and nothing is permuted on load or save.
    """

    conv_shards: int = 1  # static; set by hyjax.sharding

    def __init__(self, cfg: KimiLinearConfig, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.h, self.d = cfg.linear_num_heads, cfg.linear_head_dim
        p, hidden, kk = cfg.linear_dim, cfg.hidden_size, cfg.linear_conv_kernel_dim
        self.q_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        self.k_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        self.v_proj = Linear(hidden, p, dtype=dtype, rngs=rngs)
        init = nnx.initializers.normal(0.5)
        self.q_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))  # [P, K]
        self.k_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))
        self.v_conv1d = nnx.Param(init(rngs.params(), (p, kk), dtype))
        self.f_a_proj = Linear(hidden, self.d, dtype=dtype, rngs=rngs)
        self.f_b_proj = Linear(self.d, p, dtype=dtype, rngs=rngs)
        self.A_log = nnx.Param(
            jnp.log(jax.random.uniform(rngs.params(), (self.h,), minval=1.0, maxval=16.0))
        )
        self.dt_bias = nnx.Param(jnp.ones((p,), jnp.float32))  # per head x key channel
        self.b_proj = Linear(hidden, self.h, dtype=dtype, rngs=rngs)
        self.g_a_proj = Linear(hidden, self.d, dtype=dtype, rngs=rngs)
        self.g_b_proj = Linear(self.d, p, dtype=dtype, rngs=rngs)
        self.o_norm = SigmoidGatedRMSNorm(self.d, eps=cfg.rms_norm_eps, dtype=dtype)
        self.o_proj = Linear(p, hidden, dtype=dtype, rngs=rngs)

    def __call__(
        self, x: jax.Array, cache: StateCache, batch: Batch, ops: Ops, *, decode_only: bool
    ) -> tuple[StateCache, jax.Array]:
        n, h, d = x.shape[0], self.h, self.d
        p = h * d
        shards = self.conv_shards
        # [T, 3P]: the conv channels q | k | v (per device's heads), one depthwise filter each.
        mixed = pack_conv_channels(self.q_proj(x), self.k_proj(x), self.v_proj(x), shards)
        filters = (self.q_conv1d[...].T, self.k_conv1d[...].T, self.v_conv1d[...].T)  # [K, P]
        weight = pack_conv_channels(*filters, shards).T  # [3P, K], same channel order
        g = self.f_b_proj(self.f_a_proj(x)).reshape(n, h, d)  # raw per-channel gate
        b = self.b_proj(x)  # [T, H] beta logits
        conv_state, ssm_state = cache
        slots, qsl = batch.slots, batch.query_start_loc
        gates = (self.A_log[...], self.dt_bias[...].reshape(h, d))
        if decode_only:
            mixed, conv_state = ops.conv1d_update(mixed, weight, conv_state, slots)
        else:
            mixed, conv_state = ops.conv1d_prefill(mixed, weight, conv_state, qsl, slots)
        q, k, v = unpack_conv_channels(mixed, (h, d), (h, d), shards)  # [T, H, D] each
        if decode_only:
            o, ssm_state = ops.kda_decode(q, k, v, g, b, *gates, ssm_state, slots)
        else:
            o, ssm_state = ops.kda_prefill(q, k, v, g, b, *gates, ssm_state, qsl, slots)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(n, h, d)
        o = self.o_norm(o, gate).reshape(n, p)
        return (conv_state, ssm_state), self.o_proj(o)
