"""Rotary position embedding, NeoX rotate-half, applied to the first ``rotary_dim`` dims."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_partial_rope(
    x: jax.Array,  # [T, H, D]
    positions: jax.Array,  # i32[T]
    *,
    rotary_dim: int,
    theta: float,
) -> jax.Array:
    half = rotary_dim // 2
    inv_freq = theta ** (-jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)  # [half]
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, half]
    cos = jnp.cos(freqs)[:, None, :]  # [T, 1, half]
    sin = jnp.sin(freqs)[:, None, :]
    xr = x[..., :rotary_dim].astype(jnp.float32)
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., rotary_dim:]], axis=-1)
