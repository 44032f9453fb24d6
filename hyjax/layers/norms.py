"""RMSNorm variants: plain ``w``, zero-centred ``(1 + w)``, and the gated norm of GDN."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x^2) + eps)`` in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """``normalize(x) * (1 + w)`` when ``zero_centred`` (Qwen3-Next), else ``* w`` (cast after)."""

    def __init__(self, dim: int, *, eps: float, zero_centred: bool, dtype: jnp.dtype):
        self.eps = eps
        self.zero_centred = zero_centred
        init = jnp.zeros if zero_centred else jnp.ones
        self.weight = nnx.Param(init((dim,), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.weight[...].astype(jnp.float32)
        scale = 1.0 + w if self.zero_centred else w
        if self.zero_centred:  # multiply in float32, then cast (HF Qwen3NextRMSNorm)
            return (rms_normalize(x, self.eps) * scale).astype(x.dtype)
        # plain: cast, then multiply in the input dtype (HF Llama-style norms)
        return rms_normalize(x, self.eps).astype(x.dtype) * self.weight[...].astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """GDN output norm: ``w * normalize(x) * silu(z)``, per head over the last axis."""

    def __init__(self, dim: int, *, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype))

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        dtype = x.dtype
        y = self.weight[...].astype(dtype) * rms_normalize(x, self.eps).astype(dtype)
        z = z.astype(jnp.float32)
        return (y.astype(jnp.float32) * z * jax.nn.sigmoid(z)).astype(dtype)
