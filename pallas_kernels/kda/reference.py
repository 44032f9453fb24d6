"""Kimi Delta Attention (KDA) over a ragged batch with explicit state slots (pure JAX, f32).

KDA is the gated delta rule with one decay per *key channel* instead of one per head. Per
head ``h`` and token ``t``, with state ``S: [Dk, Dv]`` (float32)::

    q, k  = l2norm(q_t), l2norm(k_t)                          # eps 1e-6 inside the sqrt
    g     = -exp(A_log[h]) * softplus(g_t + dt_bias[h])       # [Dk], log decay <= 0
    beta  = sigmoid(b_t)
    S     = diag(exp(g)) S                                    # decays the ROWS (key dims)
    S     = S + k (beta * (v_t - S^T k))^T
    o_t   = Dk**-0.5 * S^T q

The gate is computed inside the op (as FLA's ``use_gate_in_kernel``), so the layer hands
over the raw low-rank projection ``g_t`` and the beta logits ``b_t``.

The pool stores each state transposed, ``S^T: [Dv, Dk]`` (``[num_slots, H, Dv, Dk]``), as the
GDN ops do; the recurrence below is written on ``S^T`` (the decay scales its columns).

Slots follow DESIGN.md §3 exactly as the GDN ops do: ``src_slot`` 0 reads a zero state,
``dst_slot`` 0 writes nothing, and ``(ckpt_offsets, ckpt_slots)`` pairs write the state after
that many of the step's tokens. The pool holds float32 or bfloat16 states (``--state-dtype``): a
slot is read into float32, the recurrence runs in float32 and the state is rounded to the
pool's dtype where it is written. The prefill reference scans token by token: it is the oracle,
not the fast path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import ragged_state_scan, read_slots, write_decode_states
from pallas_kernels.common.slots import StateSlots, check_state_dtype

# IEEE float32 on every platform (no TF32 on NVIDIA): the recurrent state accumulates it.
EXACT = jax.lax.Precision.HIGHEST


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x^2) + eps)`` in float32 (FLA's and transformers' form)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def softplus(x: jax.Array) -> jax.Array:
    """PyTorch's softplus (beta 1, threshold 20), which the checkpoints were trained with."""
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def kda_gates(
    g: jax.Array,  # [..., H, Dk]  raw gate projection (f_b_proj output)
    b: jax.Array,  # [..., H]      beta logits
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(log decay f32[..., H, Dk], beta f32[..., H])``."""
    decay = -jnp.exp(A_log.astype(jnp.float32))[:, None] * softplus(
        g.astype(jnp.float32) + dt_bias.astype(jnp.float32)
    )
    return decay, jax.nn.sigmoid(b.astype(jnp.float32))


def check_kda_args(
    q, k, v, g, b, A_log, dt_bias, state, slots: StateSlots, query_start_loc=None
) -> None:
    """Shape checks with messages that name the bad argument."""
    n, h, dk = q.shape
    if k.shape != (n, h, dk):
        raise ValueError(f"k {k.shape} must match q {q.shape}")
    if v.shape[:2] != (n, h):
        raise ValueError(f"v {v.shape} must be [{n}, {h}, Dv]")
    if g.shape != (n, h, dk):
        raise ValueError(f"g {g.shape} must be [N={n}, H={h}, Dk={dk}] (per key channel)")
    if b.shape != (n, h):
        raise ValueError(f"b {b.shape} must be [N={n}, H={h}]")
    if A_log.shape != (h,) or dt_bias.shape != (h, dk):
        raise ValueError(f"A_log {A_log.shape} must be [{h}], dt_bias {dt_bias.shape} [{h}, {dk}]")
    if state.ndim != 4 or state.shape[1:] != (h, v.shape[2], dk):
        want = f"[num_slots, H={h}, Dv={v.shape[2]}, Dk={dk}]"
        raise ValueError(f"state {state.shape} must be {want}")
    check_state_dtype(state)
    slots.check(query_start_loc)


def _prepare(q, k, v, g, b, A_log, dt_bias):
    q = l2norm(q) * (q.shape[-1] ** -0.5)
    k = l2norm(k)
    decay, beta = kda_gates(g, b, A_log, dt_bias)
    return q, k, v.astype(jnp.float32), decay, beta


def _step(state, q, k, v, decay, beta):
    """One token of every head: state S^T [H, Dv, Dk]; q, k, decay [H, Dk]; v [H, Dv]; beta
    [H]."""
    state = state * jnp.exp(decay)[:, None, :]  # diag(exp(g)) S: S^T's columns
    pred = jnp.einsum("HVK,HK->HV", state, k, precision=EXACT)  # S^T k
    delta = beta[:, None] * (v - pred)
    state = state + jnp.einsum("HV,HK->HVK", delta, k, precision=EXACT)
    o = jnp.einsum("HVK,HK->HV", state, q, precision=EXACT)  # S^T q
    return state, o


def kda_prefill_reference(
    q: jax.Array,  # [T, H, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H, Dk]  raw gate projection
    b: jax.Array,  # [T, H]      beta logits
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  (S^T)
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """Ragged prefill (any mix of lengths). Returns ``(o [T, H, Dv] in v.dtype, state)``."""
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    q32, k32, v32, decay, beta = _prepare(q, k, v, g, b, A_log, dt_bias)
    o, state = ragged_state_scan(_step, (q32, k32, v32, decay, beta), state, query_start_loc, slots)
    return o.astype(v.dtype), state


def kda_decode_reference(
    q: jax.Array,  # [S, H, Dk]
    k: jax.Array,  # [S, H, Dk]
    v: jax.Array,  # [S, H, Dv]
    g: jax.Array,  # [S, H, Dk]
    b: jax.Array,  # [S, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  (S^T)
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """One token per sequence. Returns ``(o [S, H, Dv] in v.dtype, state)``.

    The new state goes to ``dst_slot`` and, where ``ckpt_offsets == 1``, to that checkpoint.
    """
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots)
    q32, k32, v32, decay, beta = _prepare(q, k, v, g, b, A_log, dt_bias)
    init = read_slots(state, slots.src_slot).astype(jnp.float32)
    new, o = jax.vmap(_step)(init, q32, k32, v32, decay, beta)
    live = jnp.arange(q.shape[0]) < slots.num_seqs
    state = write_decode_states(state, new, slots)
    return jnp.where(live[:, None, None], o, 0.0).astype(v.dtype), state
