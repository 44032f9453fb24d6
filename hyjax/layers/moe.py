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
from typing import TYPE_CHECKING, NamedTuple

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
    shared: SharedExpert | None = None,
) -> jax.Array:
    """``experts_op`` over the devices of ``mesh[axis]``; returns [T, D] replicated.

    Every device sees every token. Tensor parallel: each device runs all experts on its slice
    of the intermediate dim F. Expert parallel: each device runs its ``E / n`` experts on the
    (token, expert) pairs routed to them; the other pairs get an id outside ``[0, E / n)``,
    which the op skips (no row, no block). Either way the partial outputs are summed over
    devices. ``shared``: a shared expert split on its intermediate dim (column / row parallel,
    either way) whose partial output joins the routed experts' before that sum: one
    all-reduce per MoE layer, not one for each.
    """
    P = jax.sharding.PartitionSpec

    def body(x, weights, experts, w_gate, w_up, w_down, *shared_args):
        if expert_parallel:
            num_local = w_gate.shape[0]
            first = jax.lax.axis_index(axis) * num_local
            weights, experts = local_experts(weights, experts, first, num_local)
        y = experts_op(x, weights, experts, w_gate, w_up, w_down)
        if shared_args:
            y = y + SharedExpert(*shared_args).output(x)
        return jax.lax.psum(y, axis)

    if expert_parallel:
        w_in, w_out = P(axis, None, None), P(axis, None, None)
    else:
        w_in, w_out = P(None, None, axis), P(None, axis, None)
    args, specs = (x, weights, experts, w_gate, w_up, w_down), [P(), P(), P(), w_in, w_in, w_out]
    if shared is not None:
        args += tuple(shared)
        specs += [P(None, axis), P(None, axis), P(axis, None), P()]
    fn = jax.shard_map(body, mesh=mesh, in_specs=tuple(specs), out_specs=P(), check_vma=False)
    return fn(*args)


# Up to this many [T, E, E] comparisons, the router's top-k on a GPU ranks every expert against
# every other (:func:`router_top_k`) instead of calling ``lax.top_k``: 16 tokens at 512 experts.
PAIRWISE_TOP_K_MAX = 1 << 22


def router_top_k(x: jax.Array, k: int, pairwise: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """``lax.top_k(x, k)`` over the experts of a router's scores x[T, E], values and indices
    alike (ties to the lower index). At decode sizes, no sort: each score's rank is the count
    of scores above it plus the equal ones before it (a [T, E, E] comparison reduced along its
    last axis), and the r-th pick is the one score of rank r. ``lax.top_k`` lowers to a sort
    on a GPU, one kernel of its own a layer (~5 us at T = 8, E = 512 on an H200); the ranks
    fuse with the router's other elementwise work. Larger T keeps ``lax.top_k``: the
    comparisons grow with T * E^2. ``pairwise`` None: on a GPU only (a CPU takes ~20x
    ``lax.top_k``'s time for the comparisons)."""
    t, e = x.shape
    if pairwise is None:
        pairwise = jax.default_backend() == "gpu" and t * e * e <= PAIRWISE_TOP_K_MAX
    if not pairwise or k > e:
        return jax.lax.top_k(x, k)
    xi, xj = x[:, :, None], x[:, None, :]  # [T, E(i), 1], [T, 1, E(j)]
    j_before_i = jnp.arange(e)[None, :] < jnp.arange(e)[:, None]  # [E(i), E(j)]
    beats = (xj > xi) | ((xj == xi) & j_before_i)
    rank = jnp.sum(beats, axis=-1, dtype=jnp.int32)  # [T, E]: a permutation of 0..E-1
    pick = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [T, k, E]
    values = jnp.max(jnp.where(pick, x[:, None, :], -jnp.inf), axis=-1)
    indices = jnp.sum(jnp.where(pick, jnp.arange(e, dtype=jnp.int32), 0), axis=-1)
    return values.astype(x.dtype), indices


class SharedExpert(NamedTuple):
    """A shared expert's SwiGLU weights and the per-token factor of its output (Qwen3-Next's
    sigmoid gate; ``None``: ungated)."""

    w_gate: jax.Array  # [D, F]
    w_up: jax.Array  # [D, F]
    w_down: jax.Array  # [F, D]
    scale: jax.Array | None  # [T, 1]

    def output(self, x: jax.Array) -> jax.Array:
        y = swiglu(x, self.w_gate, self.w_up, self.w_down)
        return y if self.scale is None else y * self.scale


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """``down(silu(gate(x)) * up(x))`` with the weights as :class:`Linear` holds them."""
    h = jax.nn.silu(jnp.einsum("...D,DF->...F", x, w_gate)) * jnp.einsum("...D,DF->...F", x, w_up)
    return jnp.einsum("...F,FD->...D", h, w_down)


def run_experts(
    module: nnx.Module,
    x: jax.Array,  # [T, D]
    weights: jax.Array,  # [T, k]
    experts: jax.Array,  # i32[T, k]
    ops: Ops | None = None,
    shared: SharedExpert | None = None,
) -> jax.Array:
    """The module's experts on the device mesh ``hyjax.sharding`` gave it, if any, with the
    backend's experts op (``ops.moe_experts``; the reference when no ops are given), plus the
    ``shared`` expert's output (on a mesh, inside the routed experts' all-reduce)."""
    op = moe_experts_reference if ops is None else ops.moe_experts
    w = (module.experts_gate[...], module.experts_up[...], module.experts_down[...])
    if module.expert_mesh is None:
        y = op(x, weights, experts, *w)
        return y if shared is None else y + shared.output(x)
    return parallel_routed_experts(
        x, weights, experts, *w, mesh=module.expert_mesh, axis=module.expert_axis,
        expert_parallel=module.expert_parallel, experts_op=op, shared=shared,
    )  # fmt: skip


class MLP(nnx.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d: int, f: int, *, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.gate_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(d, f, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(f, d, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        """``ops`` is unused (the decoder stack passes it to every MLP kind)."""
        return swiglu(x, *self.weights())

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.gate_proj.weight[...], self.up_proj.weight[...], self.down_proj.weight[...]


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
        weights, experts = router_top_k(probs, self.top_k)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        weights = weights.astype(x.dtype)
        gate = jax.nn.sigmoid(self.shared_expert_gate(x))  # [T, 1]
        shared = SharedExpert(*self.shared_expert.weights(), gate)
        return run_experts(self, x, weights, experts, ops, shared)


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
        _, experts = router_top_k(choice, self.top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.renormalize:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        return weights * self.scaling_factor, experts

    def __call__(self, x: jax.Array, ops: Ops | None = None) -> jax.Array:
        weights, experts = self.route(x)
        shared = None
        if self.shared_experts is not None:
            shared = SharedExpert(*self.shared_experts.weights(), None)
        return run_experts(self, x, weights, experts, ops, shared)
