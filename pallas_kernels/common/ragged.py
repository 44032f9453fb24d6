"""Index helpers shared by the ragged reference ops (pure jnp, traced inside jit)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.common.slots import ROUND_EVERY, StateSlots


def token_seq_ids(
    query_start_loc: jax.Array,  # i32[S + 1]
    num_seqs: jax.Array,  # i32[]
    num_tokens: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Maps every token of a flat ragged batch to its sequence.

    Returns:
      seq_id: i32[T], the sequence of each token, clamped to S - 1 for padding tokens.
      local: i32[T], the token's index inside its sequence's new tokens.
      live: bool[T], False for padding tokens (past ``query_start_loc[num_seqs]``).
    """
    num_rows = query_start_loc.shape[0] - 1
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    #   query_start_loc: | 0 | 4 | 5 | 7 | 7 ... |   tokens 0..3 -> 0, 4 -> 1, 5..6 -> 2
    # searchsorted(side="right") as one compare-and-sum: jnp.searchsorted's default method is a
    # while loop, and on GPU every trip of an XLA while loop syncs with the host.
    ends = query_start_loc[1:]
    seq_id = jnp.sum((t[:, None] >= ends[None, :]).astype(jnp.int32), axis=1)
    live = t < query_start_loc[num_seqs]
    seq_id = jnp.minimum(seq_id, num_rows - 1)
    local = t - query_start_loc[seq_id]
    return seq_id, local, live


def write_index(slot: jax.Array, enabled: jax.Array, num_slots: int) -> jax.Array:
    """A scatter index that drops the write (out of bounds) unless enabled and slot != 0."""
    return jnp.where(enabled & (slot > 0), slot, num_slots)


def read_slots(pool: jax.Array, src_slot: jax.Array) -> jax.Array:
    """Gathers ``pool[src_slot]`` with slot 0 meaning a zero state (nothing read).

    One row is gathered as two (the slot twice, the copy dropped): XLA turns a one-row gather
    into a dynamic slice and fuses it into every op that consumes the state, so the old pool
    stays live past the scatter that writes the new state, and the donated pool is copied
    whole to be updated (seen in the one-row decode step: two copies of every layer's pool per
    step, 88 MB of temporaries on the embedded model instead of 20).
    """
    rows = src_slot.shape[0]
    idx = jnp.concatenate([src_slot, src_slot]) if rows == 1 else src_slot
    gathered = pool[idx][:rows]
    mask = (src_slot > 0).reshape((-1,) + (1,) * (pool.ndim - 1))
    return jnp.where(mask, gathered, jnp.zeros_like(gathered))


def set_rows(
    pool: jax.Array,  # [N, ...]
    idx: jax.Array,  # i32[R]  rows of ``pool``; out of bounds -> dropped
    vals: jax.Array,  # [R, ...]
) -> jax.Array:
    """``pool.at[idx].set(vals, mode="drop")``, kept a scatter when ``R == 1``.

    XLA expands a one-index scatter into dynamic update slices, and may expand it twice (one
    for the step's output, one for the ops that read the new pool), copying the donated pool
    for each: a dropped second row keeps it one in-place scatter.
    """
    if idx.shape[0] == 1:
        idx = jnp.concatenate([idx, jnp.full((1,), pool.shape[0], idx.dtype)])
        vals = jnp.concatenate([vals, vals])
    return pool.at[idx].set(vals.astype(pool.dtype), mode="drop")


def write_decode_states(
    pool: jax.Array,  # [num_slots, ...]
    new: jax.Array,  # [S, ...]  the state after each row's one token
    slots: StateSlots,
) -> jax.Array:
    """Scatters decode states of live rows to ``dst_slot`` and to checkpoint slots at offset 1."""
    num_slots = pool.shape[0]
    m = slots.ckpt_slots.shape[1]
    live = jnp.arange(slots.num_rows) < slots.num_seqs
    at_one = live[:, None] & (slots.ckpt_offsets == 1)
    ckpt_idx = write_index(slots.ckpt_slots, at_one, num_slots)
    idx = jnp.concatenate([ckpt_idx.reshape(-1), write_index(slots.dst_slot, live, num_slots)])
    vals = jnp.concatenate([jnp.repeat(new, m, axis=0), new]).astype(pool.dtype)
    return pool.at[idx].set(vals, mode="drop")


def ragged_state_scan(
    step: Callable[..., tuple[jax.Array, jax.Array]],
    xs: tuple[jax.Array, ...],  # each [T, ...]: the step's per-token inputs
    state: jax.Array,  # f32 | bf16[num_slots, ...]  the pool
    query_start_loc: jax.Array,  # i32[S + 1]
    slots: StateSlots,
) -> tuple[jax.Array, jax.Array]:
    """A recurrence run token by token over a flat ragged batch: the delta-rule references'
    prefill (``step(cur, *x[t]) -> (cur, o)`` on a float32 state).

    Each sequence starts from its ``src_slot`` (slot 0: zeros), writes its state at every
    checkpoint offset and its last token's to ``dst_slot``; a bf16 pool's state is rounded to
    bf16 every ``ROUND_EVERY`` tokens, as the chunked kernels carry it. Returns ``(o [T, ...]
    float32, zeros for padding tokens; the pool)``."""
    num_tokens = xs[0].shape[0]
    num_slots = state.shape[0]
    seq_id, local, live = token_seq_ids(query_start_loc, slots.num_seqs, num_tokens)
    # [S, ...] f32, read before any write; the pool may be bf16 (--state-dtype)
    init = read_slots(state, slots.src_slot).astype(jnp.float32)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    row_live = jnp.arange(slots.num_rows) < slots.num_seqs

    def body(carry, t):
        cur, pool = carry
        s, i = seq_id[t], local[t]
        cur = jnp.where(i == 0, init[s], cur)
        cur, o = step(cur, *(x[t] for x in xs))
        ok = live[t] & row_live[s]
        n = i + 1  # tokens of this sequence consumed so far
        if state.dtype != jnp.float32:  # the carried state too, every ROUND_EVERY tokens
            rounded = cur.astype(state.dtype).astype(jnp.float32)
            cur = jnp.where(n % ROUND_EVERY == 0, rounded, cur)
        idx = jnp.concatenate(
            [
                write_index(slots.ckpt_slots[s], ok & (slots.ckpt_offsets[s] == n), num_slots),
                write_index(slots.dst_slot[s][None], ok & (n == q_len[s])[None], num_slots),
            ]
        )
        vals = jnp.broadcast_to(cur, (idx.shape[0],) + cur.shape).astype(pool.dtype)
        pool = pool.at[idx].set(vals, mode="drop")
        return (cur, pool), jnp.where(live[t], o, 0.0)

    cur0 = jnp.zeros(state.shape[1:], jnp.float32)
    (_, state), o = jax.lax.scan(body, (cur0, state), jnp.arange(num_tokens))
    return o, state
