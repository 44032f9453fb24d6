"""Routed SwiGLU experts of a sparse MoE layer, grouped with ``jax.lax.ragged_dot`` (pure JAX).

For token ``t`` with chosen experts ``e_j`` and routing weights ``w_j`` (``j < k``)::

    y_t = sum_j w_j * down_e(silu(x_t @ W_gate[e]) * (x_t @ W_up[e]))     e = e_j

An expert id outside ``[0, E)`` is skipped: its pair contributes nothing, whatever its weight
(expert parallelism gives the pairs of another device's experts such an id, so one op serves
the whole layer and each device's share). The matmuls run in the input dtype, as the model
always ran them; the oracle in the tests calls this on float32 inputs. This is the CPU and TPU
path; on NVIDIA GPUs XLA expands ``ragged_dot`` to dense matmuls over every expert (~6 ms per
call at Qwen3-Next-80B layer shapes on an H100), which :mod:`pallas_kernels.moe.gpu` replaces.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check_moe_args(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # i32[T, k]
    w_gate: jax.Array,  # [E, D, F]
    w_up: jax.Array,  # [E, D, F]
    w_down: jax.Array,  # [E, F, D]
) -> None:
    """Raises ValueError naming the first argument whose shape or dtype does not fit."""
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D]; got {x.shape=}")
    num_tokens, d = x.shape
    if experts.ndim != 2 or experts.shape[0] != num_tokens:
        raise ValueError(f"experts must be [T={num_tokens}, k]; got {experts.shape=}")
    if not jnp.issubdtype(experts.dtype, jnp.integer):
        raise ValueError(f"experts must hold integer ids; got {experts.dtype=}")
    if weights.shape != experts.shape:
        raise ValueError(f"{weights.shape=} must equal {experts.shape=}")
    if w_gate.ndim != 3 or w_gate.shape[1] != d:
        raise ValueError(f"w_gate must be [E, D={d}, F]; got {w_gate.shape=}")
    e, _, f = w_gate.shape
    if w_up.shape != w_gate.shape:
        raise ValueError(f"{w_up.shape=} must equal {w_gate.shape=}")
    if w_down.shape != (e, f, d):
        raise ValueError(f"w_down must be [E={e}, F={f}, D={d}]; got {w_down.shape=}")


def moe_experts_reference(
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k]  routing weight of each chosen expert
    experts: jax.Array,  # i32[T, k]  ids outside [0, E) are skipped
    w_gate: jax.Array,  # [E, D, F]
    w_up: jax.Array,  # [E, D, F]
    w_down: jax.Array,  # [E, F, D]
) -> jax.Array:
    """``sum_j weights[:, j] * expert_j(x)`` with SwiGLU experts. Returns [T, D] in x.dtype."""
    check_moe_args(x, weights, experts, w_gate, w_up, w_down)
    num_experts, top_k = w_gate.shape[0], experts.shape[1]
    # Sort the T*k (token, expert) pairs by expert so each expert sees one contiguous group;
    # skipped pairs get the id E and sort past the last group, where ragged_dot computes
    # nothing.
    flat = experts.reshape(-1).astype(jnp.int32)  # [T*k]
    valid = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(valid, flat, num_experts)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k  # [T*k]
    group_sizes = jnp.bincount(flat, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    xs = x[token]  # [T*k, D]
    h = jax.lax.ragged_dot(xs, w_gate, group_sizes)
    u = jax.lax.ragged_dot(xs, w_up, group_sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(h) * u, w_down, group_sizes)
    out = out * weights.reshape(-1)[order][:, None]
    out = jnp.where(valid[order][:, None], out, 0)  # a skipped pair's weight may be anything
    return jnp.zeros_like(x).at[token].add(out.astype(x.dtype))
