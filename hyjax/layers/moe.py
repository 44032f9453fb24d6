"""Sparse MoE layers; the routed experts run through the backend's ``ops.moe_experts``.

The reference op groups the experts with ``ragged_dot`` (CPU, TPU); the ``pallas`` backend on
NVIDIA GPUs runs the grouped-matmul kernels of :mod:`pallas_kernels.moe.gpu` (XLA expands
``ragged_dot`` to dense matmuls over every expert there).

- :class:`SparseMoe` (Qwen3-Next): softmax router, a sigmoid-gated shared expert.
- :class:`SigmoidMoe` (Kimi-Linear): sigmoid scores, a selection-only bias, grouped top-k,
  renormalised and scaled weights, an ungated shared expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx

from hyjax.layers.linear import Linear
from pallas_kernels.moe.reference import moe_experts_reference

if TYPE_CHECKING:
    from hyjax.ops import Ops

# The experts op's signature: (x [T, D], weights [T, k], experts i32[T, k], w_gate [E, D, F],
# w_up [E, D, F], w_down [E, F, D]) -> [T, D]; expert ids outside [0, E) are skipped.
ExpertsOp = Callable[..., jax.Array]


def local_experts(
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # i32[T, k]  global expert ids
    first: jax.Array | int,  # i32[]  first expert of this device
    num_local: int,
) -> tuple[jax.Array, jax.Array]:
    """One expert-parallel device's view of the routing: ``(weights, ids)`` with ids local to
    its experts ``[first, first + num_local)``; other devices' pairs get the id ``num_local``
    (which the experts op skips) and weight 0."""
    local = experts - first  # [T, k]
    mine = (local >= 0) & (local < num_local)
    return jnp.where(mine, weights, 0), jnp.where(mine, local, num_local)


def parallel_routed_experts(
    x: jax.Array,  # [T, D]  replicated
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # i32[T, k]
    w_gate: jax.Array,  # [E, D, F]  sharded on F (tensor parallel) or E (expert parallel)
    w_up: jax.Array,  # [E, D, F]
    w_down: jax.Array,  # [E, F, D]
    *,
    mesh: jax.sharding.Mesh,
    axis: str,
    expert_parallel: bool,
    experts_op: ExpertsOp = moe_experts_reference,
) -> jax.Array:
    """``experts_op`` over the devices of ``mesh[axis]``; returns [T, D] replicated.

    Every device sees every token. Tensor parallel: each device runs all experts on its slice
    of the intermediate dim F. Expert parallel: each device runs its ``E / n`` experts on the
    (token, expert) pairs routed to them; the other pairs get an id outside ``[0, E / n)``,
    which the op skips (no row, no block). Either way the partial outputs are summed over
    devices.
    """
    P = jax.sharding.PartitionSpec

    def tensor_parallel(x, weights, experts, w_gate, w_up, w_down):
        return jax.lax.psum(experts_op(x, weights, experts, w_gate, w_up, w_down), axis)

    def expert_parallel_(x, weights, experts, w_gate, w_up, w_down):
        num_local = w_gate.shape[0]
        first = jax.lax.axis_index(axis) * num_local
        weights, local = local_experts(weights, experts, first, num_local)
        y = experts_op(x, weights, local, w_gate, w_up, w_down)
        return jax.lax.psum(y, axis)

    if expert_parallel:
        body, w_in, w_out = expert_parallel_, P(axis, None, None), P(axis, None, None)
    else:
        body, w_in, w_out = tensor_parallel, P(None, None, axis), P(None, axis, None)
    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(P(), P(), P(), w_in, w_in, w_out),
        out_specs=P(),
        check_vma=False,
    )
    return fn(x, weights, experts, w_gate, w_up, w_down)


def run_experts(
    module: nnx.Module,
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # i32[T, k]
    ops: Ops | None = None,
) -> jax.Array:
    """The module's experts on the device mesh ``hyjax.sharding`` gave it, if any, with the
    backend's experts op (``ops.moe_experts``; the reference when no ops are given)."""
    op = moe_experts_reference if ops is None else ops.moe_experts
    w = (module.experts_gate[...], module.experts_up[...], module.experts_down[...])
    if module.expert_mesh is None:
        return op(x, weights, experts, *w)
    return parallel_routed_experts(
        x, weights, experts, *w, mesh=module.expert_mesh, axis=module.expert_axis,
        expert_parallel=module.expert_parallel, experts_op=op,
    )  # fmt: skip


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, f: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        """``ops`` is unused (the decoder stack passes it to every MLP kind)."""
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nnx.Module):
    """Softmax router -> top-k (renormalised) -> experts, plus ``sigmoid(g(x)) * shared(x)``."""

    # Static; set by hyjax.sharding: the mesh (and its axis) the experts are split over.
    expert_mesh: jax.sharding.Mesh | None = None
    expert_axis: str = "model"
    expert_parallel: bool = False  # split the experts (True) or their intermediate dim

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

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)  # [T, E]
        weights, experts = jax.lax.top_k(probs, self.top_k)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        routed = run_experts(self, x, weights, experts, ops)

        shared = self.shared_expert(x) * jax.nn.sigmoid(self.shared_expert_gate(x))
        return routed + shared


class SigmoidMoe(nnx.Module):
    """Kimi-Linear's MoE (DeepSeek-V3 style routing)::

    s      = sigmoid(x @ router)                 # f32 [T, E]
    choice = s + e_score_correction_bias         # the bias only picks experts
    (groups: keep the topk_group groups of best top-2 choice sum, mask the rest)
    idx    = top_k(choice)                       # weights are the UNbiased s[idx]
    w      = s[idx] / (sum + 1e-20) if renormalize, then * routed_scaling_factor
    y      = sum_j w_j expert_{idx_j}(x) + shared_experts(x)     # shared: not gated
    """

    # Static; set by hyjax.sharding: the mesh (and its axis) the experts are split over.
    expert_mesh: jax.sharding.Mesh | None = None
    expert_axis: str = "model"
    expert_parallel: bool = False  # split the experts (True) or their intermediate dim

    def __init__(
        self,
        d: int,
        *,
        num_experts: int,
        top_k: int,
        expert_dim: int,
        shared_dim: int,
        renormalize: bool,
        scaling_factor: float,
        num_groups: int,
        topk_groups: int,
        dtype: jnp.dtype,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.normal(0.02)
        self.top_k, self.renormalize, self.scaling_factor = top_k, renormalize, scaling_factor
        self.num_groups, self.topk_groups = num_groups, topk_groups
        # Router and bias stay float32 (the checkpoint keeps them so).
        self.router = nnx.Param(init(rngs.params(), (d, num_experts), jnp.float32))
        self.e_score_correction_bias = nnx.Param(jnp.zeros((num_experts,), jnp.float32))
        self.experts_gate = nnx.Param(init(rngs.params(), (num_experts, d, expert_dim), dtype))
        self.experts_up = nnx.Param(init(rngs.params(), (num_experts, d, expert_dim), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (num_experts, expert_dim, d), dtype))
        self.shared_experts = MLP(d, shared_dim, dtype=dtype, rngs=rngs) if shared_dim else None

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns ``(weights f32[T, k], experts i32[T, k])``."""
        logits = jnp.einsum(
            "TD,DE->TE", x.astype(jnp.float32), self.router[...],
            precision=jax.lax.Precision.HIGHEST,
        )  # fmt: skip
        scores = jax.nn.sigmoid(logits)
        choice = scores + self.e_score_correction_bias[...]
        num_tokens, num_experts = choice.shape
        if self.num_groups > 1 and self.topk_groups < self.num_groups:
            grouped = choice.reshape(num_tokens, self.num_groups, -1)  # [T, G, E/G]
            group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
            _, keep = jax.lax.top_k(group_score, self.topk_groups)  # [T, topk_groups]
            kept = jnp.zeros((num_tokens, self.num_groups), bool)
            kept = kept.at[jnp.arange(num_tokens)[:, None], keep].set(True)
            kept = jnp.repeat(kept, num_experts // self.num_groups, axis=-1)  # [T, E]
            choice = jnp.where(kept, choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.scaling_factor, experts

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        weights, experts = self.route(x)
        y = run_experts(self, x, weights, experts, ops)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
