"""A bias-free dense projection stored ``[in, out]`` (the transpose of a PyTorch weight)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.weight = nnx.Param(init(rngs.params(), (d_in, d_out), dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        return jnp.einsum("...D,DF->...F", x, self.weight[...])
