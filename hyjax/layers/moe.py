"""Sparse MoE with a sigmoid-gated shared expert (Qwen3-Next), grouped with ``ragged_dot``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.layers.linear import Linear


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, f: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nnx.Module):
    """Softmax router -> top-k (renormalised) -> experts, plus ``sigmoid(g(x)) * shared(x)``."""

    def __init__(
        self,
        d: int,
        *,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        shared_dim: int,
        norm_topk_prob: bool,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.normal(0.02)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.gate = Linear(d, num_experts, dtype=dtype, rngs=rngs)
        self.experts_gate = nnx.Param(init(rngs.params(), (num_experts, d, expert_dim), dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (num_experts, d, expert_dim), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (num_experts, expert_dim, d), dtype))
        self.shared_expert = MLP(d, shared_dim, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(d, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        num_experts = self.experts_gate.shape[0]
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)

        # Sort the T*k (token, expert) pairs by expert so each expert sees one contiguous group.
        flat_expert = experts.reshape(-1)  # [T*k]
        order = jnp.argsort(flat_expert, stable=True)
        token = order // self.top_k  # [T*k]
        group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
        xs = x[token]  # [T*k, D]
        h = jax.lax.ragged_dot(xs, self.experts_gate[...], group_sizes)
        u = jax.lax.ragged_dot(xs, self.experts_up[...], group_sizes)
        out = jax.lax.ragged_dot(jax.nn.silu(h) * u, self.experts_down[...], group_sizes)
        out = out * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros_like(x).at[token].add(out)

        shared = self.shared_expert(x) * jax.nn.sigmoid(self.shared_expert_gate(x))
        return routed + shared
