"""Chunk plans for the ragged prefill kernels (GDN, causal conv1d), computed in XLA.

A ragged batch is cut into *chunks* of at most ``chunk`` tokens. A chunk never straddles two
sequences and never straddles a checkpoint offset, so the state after every chunk is a state
the contract may have to write (a checkpoint, or the final state). Chunks restart at each
sequence start and every ``chunk`` tokens after it; a checkpoint offset that is not a multiple
of ``chunk`` (the scheduler avoids those, DESIGN.md §4) only adds one more chunk boundary::

    tokens (T = 12, chunk = 4):  | a0 a1 a2 a3 a4 a5 | b0 b1 b2 | c0 | pad pad |
    ckpt offsets: a -> 5
    chunks:                      |  0          |1 |2 |  3       |4   | (5, 6, ... empty)
    chunk:     0   1   2   3   4     5..
    seq:       0   0   0   1   2     0
    start:     0   4   5   6   9     0       first token of the chunk (flat index)
    length:    4   1   1   3   1     0       0 = empty (capacity padding)
    end:       4   5   6   3   1     0       tokens of its sequence consumed after the chunk
    first:     1   0   0   1   1     0
    last:      0   0   1   1   1     0

Kernels read a chunk as a block of ``chunk`` rows, **right-aligned**: the chunk's tokens sit
in the last ``length`` rows and the rows before them are zeros (or, for conv1d, the window
that precedes the chunk). Right alignment puts the state after the chunk at the block's end,
so a kernel never needs a dynamic row offset::

    block rows:      0 .. chunk-length-1   |  chunk-length .. chunk-1
                     zeros / conv halo     |  the chunk's tokens, in order

The number of chunks is bounded statically by ``T // chunk + S * (1 + M)`` (each sequence
adds at most one partial chunk and one per checkpoint offset), and by ``T``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import token_seq_ids
from pallas_kernels.common.slots import StateSlots


class ChunkPlan(NamedTuple):
    seq: jax.Array  # i32[NC]  row of each chunk (0 for empty chunks)
    start: jax.Array  # i32[NC]  flat index of the chunk's first token
    length: jax.Array  # i32[NC]  tokens in the chunk; 0 = empty
    end: jax.Array  # i32[NC]  tokens of the sequence consumed after the chunk
    first: jax.Array  # i32[NC]  1 if the chunk starts its sequence
    last: jax.Array  # i32[NC]  1 if the chunk ends its sequence
    num_chunks: jax.Array  # i32[1]  non-empty chunks (they come first)
    token_chunk: jax.Array  # i32[T]  chunk of each token (capacity for padding tokens)
    token_row: jax.Array  # i32[T]  row of each token inside its right-aligned block
    live: jax.Array  # bool[T]  False for padding tokens


def live_end(plan: ChunkPlan) -> jax.Array:
    """i32[1]: the end of the plan's last chunk, the batch's live token count."""
    return jnp.max(plan.start + plan.length, keepdims=True)


def max_chunks(num_tokens: int, num_rows: int, max_ckpt: int, chunk: int) -> int:
    """The static capacity of a chunk plan."""
    return max(1, min(num_tokens, num_tokens // chunk + num_rows * (1 + max_ckpt)))


def plan_chunks(
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # the rows' checkpoint offsets cut chunks; num_seqs ends the batch
    *,
    num_tokens: int,
    chunk: int,
    token_aligned: bool = False,
) -> ChunkPlan:
    """Cuts a ragged batch into chunks (see the module docstring). ``token_aligned``: chunks
    restart at every multiple of ``chunk`` of the flat token index, not of the sequence's, so
    each chunk lies inside one ``chunk``-token block of the batch (the Mosaic GPU prefill reads
    whole blocks: ``pallas_kernels.common.chunk_scan_mgpu``). The capacity bound holds: a
    sequence adds at most one chunk at its start's block and one a checkpoint offset."""
    ckpt_offsets = slots.ckpt_offsets
    num_rows, max_ckpt = ckpt_offsets.shape
    cap = max_chunks(num_tokens, num_rows, max_ckpt, chunk)
    seq_id, local, live = token_seq_ids(query_start_loc, slots.num_seqs, num_tokens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    at_ckpt = jnp.any(ckpt_offsets[seq_id] == local[:, None], axis=1)
    boundary = (local == 0) | (t % chunk == 0) if token_aligned else local % chunk == 0
    starts = live & (boundary | at_ckpt)
    cid = jnp.cumsum(starts.astype(jnp.int32)) - 1  # [T]
    start_idx = jnp.where(starts, cid, cap)  # scatter index, dropped unless a chunk start
    live_idx = jnp.where(live, cid, cap)
    zeros = jnp.zeros(cap, jnp.int32)
    start = zeros.at[start_idx].set(t, mode="drop")
    seq = zeros.at[start_idx].set(seq_id, mode="drop")
    length = zeros.at[live_idx].add(1, mode="drop")
    nonempty = length > 0
    end = jnp.where(nonempty, local[start] + length, 0)
    first = nonempty & (local[start] == 0)
    last = nonempty & (end == q_len[seq])
    token_chunk = jnp.where(live, cid, cap)
    token_row = chunk - length[jnp.minimum(cid, cap - 1)] + t - start[jnp.minimum(cid, cap - 1)]
    return ChunkPlan(
        seq=seq,
        start=start,
        length=length,
        end=end,
        first=first.astype(jnp.int32),
        last=last.astype(jnp.int32),
        num_chunks=jnp.sum(starts.astype(jnp.int32)).reshape(1),
        token_chunk=token_chunk,
        token_row=jnp.where(live, token_row, 0),
        live=live,
    )


def chunk_token_index(plan: ChunkPlan, chunk: int, num_tokens: int) -> jax.Array:
    """``i32[NC, chunk]``: the flat token each right-aligned block row reads.

    Row ``r`` of chunk ``c`` holds token ``start + r - (chunk - length)``; the rows before the
    chunk's first token, and every row of an empty chunk, give ``num_tokens`` (out of bounds,
    so a gather with ``mode="fill"`` reads 0).
    """
    r = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    pad = chunk - plan.length[:, None]
    return jnp.where(r >= pad, plan.start[:, None] + r - pad, num_tokens)


def gather_chunks(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x [T, ...]`` -> ``[NC, rows, ...]`` with out-of-bounds rows zero."""
    return jnp.take(x, index, axis=0, mode="fill", fill_value=0)


def scatter_tokens(blocks: jax.Array, plan: ChunkPlan) -> jax.Array:
    """Inverse of :func:`gather_chunks` for outputs: ``[NC, chunk, ...]`` -> ``[T, ...]``.

    Padding tokens give 0.
    """
    nc, chunk = blocks.shape[:2]
    flat = blocks.reshape((nc * chunk,) + blocks.shape[2:])
    idx = jnp.minimum(plan.token_chunk, nc - 1) * chunk + plan.token_row
    out = flat[idx]
    mask = plan.live.reshape((-1,) + (1,) * (out.ndim - 1))
    return jnp.where(mask, out, jnp.zeros_like(out))
