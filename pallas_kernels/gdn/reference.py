"""The gated delta rule over a ragged batch with explicit state slots (pure JAX, float32).

Per value head ``h`` (key head ``h // (Hv // Hk)``) and token ``t``, with state
``S: [Dk, Dv]`` (float32)::

    q, k  = l2norm(q_t), l2norm(k_t)                 # eps 1e-6 inside the sqrt
    g     = -exp(A_log) * softplus(a_t + dt_bias)    # log decay <= 0
    beta  = sigmoid(b_t)
    S     = exp(g) * S
    S     = S + k (beta * (v_t - S^T k))^T
    o_t   = Dk**-0.5 * S^T q

The pool stores each state transposed, ``S^T: [Dv, Dk]`` (``[num_slots, Hv, Dv, Dk]``: a value
channel's row over the key channels is contiguous, so a decode kernel reduces over K along the
contiguous axis); the recurrence below is written on ``S^T`` directly.

Slots follow DESIGN.md §3: ``src_slot`` 0 reads a zero state, ``dst_slot`` 0 writes nothing,
and ``(ckpt_offsets, ckpt_slots)`` pairs write the state after that many of the step's tokens.
The pool holds float32 or bfloat16 states (``--state-dtype``): a slot is read into float32, the
recurrence runs in float32 and the state is rounded to the pool's dtype where it is written.
The prefill reference scans token by token: it is the oracle, not the fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import ragged_state_scan, read_slots, write_decode_states
from pallas_kernels.common.slots import StateSlots, check_state_dtype

# The oracle is IEEE float32 on every platform: at XLA's default precision an NVIDIA GPU may
# run f32 contractions in TF32 (10-bit mantissa), and the recurrent state accumulates that.
EXACT = jax.lax.Precision.HIGHEST


def check_gdn_args(
    q,
    k,
    v,
    a,
    b,
    A_log,
    dt_bias,
    state,
    slots: StateSlots,
    query_start_loc=None,
) -> None:
    """Raises ``ValueError`` naming the first inconsistent shape."""
    if q.ndim != 3 or k.shape != q.shape:
        raise ValueError(f"q {q.shape} and k {k.shape} must both be [T, Hk, Dk]")
    n, hk, dk = q.shape
    if v.ndim != 3 or v.shape[0] != n:
        raise ValueError(f"v {v.shape} must be [T, Hv, Dv] with T = {n}")
    _, hv, dv = v.shape
    if hv % hk:
        raise ValueError(f"{hv=} value heads must be a multiple of {hk=} key heads")
    if a.shape != (n, hv) or b.shape != (n, hv):
        raise ValueError(f"a {a.shape} and b {b.shape} must be [T, Hv] = {(n, hv)}")
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(f"A_log {A_log.shape} and dt_bias {dt_bias.shape} must be [{hv}]")
    if state.ndim != 4 or state.shape[1:] != (hv, dv, dk):
        raise ValueError(f"state {state.shape} must be [num_slots, Hv={hv}, Dv={dv}, Dk={dk}]")
    check_state_dtype(state)
    slots.check(query_start_loc)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def softplus(x: jax.Array) -> jax.Array:
    """PyTorch's softplus (beta 1, threshold 20), which the checkpoints were trained with."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def gdn_gates(
    a: jax.Array,  # [..., Hv]
    b: jax.Array,  # [..., Hv]
    A_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(g, beta)`` in float32."""
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    )
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    return g, beta


def _prepare(q, k, v, a, b, A_log, dt_bias):
    """l2norm, GVA expansion to value heads, gates. Shapes [N, Hv, D] / [N, Hv]."""
    ratio = v.shape[-2] // q.shape[-2]
    q = jnp.repeat(l2norm(q), ratio, axis=-2) * (q.shape[-1] ** -0.5)
    k = jnp.repeat(l2norm(k), ratio, axis=-2)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return q, k, v.astype(jnp.float32), g, beta


def _step(state, q, k, v, g, beta):
    """One token for every head: state S^T [Hv, Dv, Dk]; q, k [Hv, Dk]; v [Hv, Dv]; g, beta
    [Hv]."""
    state = state * jnp.exp(g)[:, None, None]
    pred = jnp.einsum("HVK,HK->HV", state, k, precision=EXACT)  # S^T k
    delta = beta[:, None] * (v - pred)
    state = state + jnp.einsum("HV,HK->HVK", delta, k, precision=EXACT)
    o = jnp.einsum("HVK,HK->HV", state, q, precision=EXACT)  # S^T q
    return state, o


def gdn_prefill_reference(
    q: jax.Array,  # [T, Hk, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    a: jax.Array,  # [T, Hv]  decay logits
    b: jax.Array,  # [T, Hv]  beta logits
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  (S^T)
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill (any mix of lengths). Returns ``(o [T, Hv, Dv] in v.dtype, state)``."""
    q32, k32, v32, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias)
    o, state = ragged_state_scan(_step, (q32, k32, v32, g, beta), state, query_start_loc, slots)
    return o.astype(v.dtype), state


def gdn_decode_reference(
    q: jax.Array,  # [S, Hk, Dk]
    k: jax.Array,  # [S, Hk, Dk]
    v: jax.Array,  # [S, Hv, Dv]
    a: jax.Array,  # [S, Hv]
    b: jax.Array,  # [S, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  (S^T)
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """One token per sequence. Returns ``(o [S, Hv, Dv] in v.dtype, state)``.

    The new state goes to ``dst_slot`` and, where ``ckpt_offsets == 1``, to the checkpoint
    slot too (a decode step that reaches a checkpoint boundary).
    """
    q32, k32, v32, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias)
    init = read_slots(state, slots.src_slot).astype(jnp.float32)
    new, o = jax.vmap(_step)(init, q32, k32, v32, g, beta)
    live = jnp.arange(q.shape[0]) < slots.num_seqs
    state = write_decode_states(state, new, slots)
    return jnp.where(live[:, None, None], o, 0.0).astype(v.dtype), state
