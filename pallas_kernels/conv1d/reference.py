"""Causal depthwise conv1d + SiLU over a ragged batch, with explicit state slots (pure JAX).

The conv window of a sequence is its last ``K - 1`` pre-conv inputs, oldest first, stored per
slot in ``conv_state[slot] : [K - 1, C]`` (model dtype). DESIGN.md §3:

- ``src_slot[s] == 0``: the window before the first new token is zeros (nothing is read);
- ``dst_slot[s] == 0``: the final window is not written;
- ``(ckpt_offsets[s, j], ckpt_slots[s, j])``: the window after that many of this step's tokens
  is written to that slot (0 = no write).

Window arithmetic for one sequence with K = 4 and 3 new tokens x0 x1 x2::

    prior window (src):  p0 p1 p2            y0 = w . [p0 p1 p2 x0]
    inputs:                       x0 x1 x2   y2 = w . [p2 x0 x1 x2]
    window after 2 tokens:     p2 x0 x1      (a checkpoint at offset 2)
    final window:                 x0 x1 x2   (written to dst)
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import (
    read_slots,
    token_seq_ids,
    write_decode_states,
    write_index,
)
from pallas_kernels.common.slots import StateSlots


def check_conv1d_args(x, weight, conv_state, slots: StateSlots, query_start_loc=None) -> None:
    """Raises ``ValueError`` naming the first inconsistent shape."""
    if x.ndim != 2:
        raise ValueError(f"x {x.shape} must be [T, C]")
    c = x.shape[1]
    if weight.ndim != 2 or weight.shape[0] != c:
        raise ValueError(f"weight {weight.shape} must be [C={c}, K]")
    km1 = weight.shape[1] - 1
    if not 1 <= km1 <= 8:
        raise ValueError(f"kernel width K={km1 + 1} must be in [2, 9]")
    if conv_state.ndim != 3 or conv_state.shape[1:] != (km1, c):
        raise ValueError(f"conv_state {conv_state.shape} must be [num_slots, {km1}, {c}]")
    slots.check(query_start_loc)


def _silu(x):
    return x * jax.nn.sigmoid(x)


def _window_after(
    x: jax.Array,  # [T, C]
    init: jax.Array,  # [S, K-1, C]
    qsl: jax.Array,  # i32[S+1]
    seq: jax.Array,  # i32[N]   sequences
    offset: jax.Array,  # i32[N]   number of new tokens consumed
) -> jax.Array:
    """The K-1 inputs preceding new-token index ``offset`` of each sequence: [N, K-1, C]."""
    km1 = init.shape[1]
    # local index of each window element: offset - (K-1) .. offset - 1
    local = offset[:, None] + jnp.arange(-km1, 0, dtype=jnp.int32)[None, :]  # [N, K-1]
    from_x = x[jnp.clip(qsl[seq][:, None] + local, 0, x.shape[0] - 1)]  # [N, K-1, C]
    from_state = init[seq[:, None], jnp.clip(km1 + local, 0, km1 - 1)]  # [N, K-1, C]
    return jnp.where((local >= 0)[..., None], from_x, from_state)


def _taps(window: jax.Array, weight: jax.Array) -> jax.Array:
    """``sum_k window[:, k, :] * weight[:, k]`` in f32, as elementwise products.

    Not an einsum: ``'TKC,CK->TC'`` is a batched contraction over K = 4 that XLA on GPU runs as
    a batched matmul at ~160 GB/s (1.2 ms for 4096 x 8192 channels on an H200); products and
    a sum fuse with the window gather into one loop.
    """
    w32 = weight.astype(jnp.float32)
    acc = window[:, 0, :].astype(jnp.float32) * w32[:, 0]
    for k in range(1, window.shape[1]):
        acc = acc + window[:, k, :].astype(jnp.float32) * w32[:, k]
    return acc


def causal_conv1d_prefill_reference(
    x: jax.Array,  # [T, C] pre-conv inputs, model dtype
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(y [T, C] in x.dtype, updated conv_state)``; padding tokens give 0."""
    num_tokens, _ = x.shape
    seq_id, local, live = token_seq_ids(query_start_loc, slots.num_seqs, num_tokens)
    init = read_slots(conv_state, slots.src_slot)  # [S, K-1, C]

    # Window of inputs for each token: the K-1 before it, then itself.
    prev = _window_after(x, init, query_start_loc, seq_id, local)  # [T, K-1, C]
    window = jnp.concatenate([prev, x[:, None, :]], axis=1)  # [T, K, C]
    y = _silu(_taps(window, weight))
    y = jnp.where(live[:, None], y, 0).astype(x.dtype)
    return y, write_windows(x, init, conv_state, query_start_loc, slots)


def write_windows(
    x: jax.Array,  # [T, C]
    init: jax.Array,  # [S, K-1, C]  each row's source window (zeros where src == 0)
    conv_state: jax.Array,  # [num_slots, K-1, C]
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,
) -> jax.Array:
    """The pool with each live row's final window in ``dst`` and its checkpoint windows in
    their slots (one scatter)."""
    num_slots = conv_state.shape[0]
    rows = jnp.arange(slots.num_rows, dtype=jnp.int32)
    row_live = rows < slots.num_seqs
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    final = _window_after(x, init, query_start_loc, rows, q_len)
    ckpt_seq = jnp.repeat(rows, slots.ckpt_offsets.shape[1])
    ckpt = _window_after(x, init, query_start_loc, ckpt_seq, slots.ckpt_offsets.reshape(-1))
    idx = jnp.concatenate(
        [
            write_index(slots.ckpt_slots.reshape(-1), row_live[ckpt_seq], num_slots),
            write_index(slots.dst_slot, row_live, num_slots),
        ]
    )
    vals = jnp.concatenate([ckpt, final]).astype(conv_state.dtype)
    return conv_state.at[idx].set(vals, mode="drop")


def causal_conv1d_update_reference(
    x: jax.Array,  # [S, C] one new token per sequence
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """Decode: one token per sequence. Returns ``(y [S, C], updated conv_state)``.

    The new window goes to ``dst_slot`` and, where ``ckpt_offsets == 1``, to that checkpoint.
    """
    init = read_slots(conv_state, slots.src_slot)  # [S, K-1, C]
    window = jnp.concatenate([init, x[:, None, :]], axis=1)  # [S, K, C]
    y = _silu(_taps(window, weight))
    live = jnp.arange(x.shape[0]) < slots.num_seqs
    y = jnp.where(live[:, None], y, 0).astype(x.dtype)
    conv_state = write_decode_states(conv_state, window[:, 1:], slots)
    return y, conv_state


# ----------------------------------------------------------------------------- GDN's q | k | v


def split_qkvz(qkvz: jax.Array, num_k_heads: int, dk: int, dv: int, ratio: int):
    """A GDN input projection's output, ``[n, Hk * W]`` (``W = 2 Dk + 2 r Dv``: per key head
    ``q | k | v of its r value heads | z``), as ``q, k [n, Hk, Dk]``, ``v, z [n, Hk r, Dv]``."""
    n = qkvz.shape[0]
    per_head = qkvz.reshape(n, num_k_heads, 2 * dk + 2 * ratio * dv)
    q, k = per_head[..., :dk], per_head[..., dk : 2 * dk]
    v = per_head[..., 2 * dk : 2 * dk + ratio * dv].reshape(n, num_k_heads * ratio, dv)
    z = per_head[..., 2 * dk + ratio * dv :].reshape(n, num_k_heads * ratio, dv)
    return q, k, v, z


def check_qkvz_args(qkvz: jax.Array, weight: jax.Array, num_k_heads: int, head_dims) -> int:
    """Raises ``ValueError`` unless ``weight``'s channels are ``q | k | v`` of ``num_k_heads``
    key heads of ``head_dims = (Dk, Dv)`` and ``qkvz`` is their projection's output; returns
    the value heads per key head ``r``."""
    hk, (dk, dv) = num_k_heads, head_dims
    c = weight.shape[0]
    hv = (c - 2 * hk * dk) // dv if dv > 0 else 0
    if hk < 1 or hv < 1 or c != 2 * hk * dk + hv * dv or hv % hk:
        raise ValueError(f"{c} conv channels are not q | k | v of {hk} key heads with {head_dims=}")
    ratio = hv // hk
    if qkvz.ndim != 2 or qkvz.shape[1] != hk * (2 * dk + 2 * ratio * dv):
        raise ValueError(f"qkvz {qkvz.shape} is not [T, {hk} * (2 Dk + 2 r Dv)] for {head_dims=}")
    return ratio


def packed_qkvz(conv_prefill: Callable) -> Callable:
    """The GDN conv of a projection's output ``qkvz`` through ``conv_prefill`` (the signature
    of :func:`causal_conv1d_prefill_reference`): ``q | k | v`` packed into ``[T, C]``, the
    conv, its output split back. The signature of ``causal_conv1d_prefill_qkvz``."""

    def conv1d_prefill_qkvz(
        qkvz: jax.Array,  # [T, Hk * (2 Dk + 2 r Dv)]
        weight: jax.Array,  # [C, K]  C = 2 Hk Dk + Hv Dv, channels q | k | v
        conv_state: jax.Array,  # [num_slots, K-1, C]
        query_start_loc: jax.Array,  # i32[S+1]
        slots: StateSlots,
        *,
        num_k_heads: int,
        head_dims: tuple[int, int],  # (Dk, Dv)
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """``(q [T, Hk Dk], k [T, Hk Dk], v [T, Hv Dv], conv_state)``."""
        hk, (dk, dv) = num_k_heads, head_dims
        ratio = check_qkvz_args(qkvz, weight, hk, head_dims)
        n = qkvz.shape[0]
        q, k, v, _ = split_qkvz(qkvz, hk, dk, dv, ratio)
        x = jnp.concatenate([t.reshape(n, -1) for t in (q, k, v)], axis=1)
        y, conv_state = conv_prefill(x, weight, conv_state, query_start_loc, slots)
        return y[:, : hk * dk], y[:, hk * dk : 2 * hk * dk], y[:, 2 * hk * dk :], conv_state

    return conv1d_prefill_qkvz


causal_conv1d_prefill_qkvz_reference = packed_qkvz(causal_conv1d_prefill_reference)


# ----------------------------------------------------------------------------- inputs apart


def check_split_args(xs, weight) -> None:
    """Raises ``ValueError`` unless ``xs`` are ``[T, n_i]`` arrays of one length and dtype whose
    widths sum to ``weight``'s channels."""
    if not xs or any(x.ndim != 2 for x in xs):
        raise ValueError(f"inputs {[x.shape for x in xs]} must be one or more [T, n] arrays")
    if len({(x.shape[0], x.dtype) for x in xs}) != 1:
        raise ValueError(f"inputs {[(x.shape, str(x.dtype)) for x in xs]} differ in T or dtype")
    if sum(x.shape[1] for x in xs) != weight.shape[0]:
        raise ValueError(
            f"inputs {[x.shape for x in xs]} are not the {weight.shape[0]} channels of weight"
        )


def packed_inputs(conv_prefill: Callable) -> Callable:
    """The conv of channels held apart (``xs``: ``[T, n_i]``, in channel order) through
    ``conv_prefill`` (the signature of :func:`causal_conv1d_prefill_reference`): the inputs
    concatenated, the conv, its output split back. Returns ``(ys, conv_state)``, ``ys`` one
    ``[T, n_i]`` array per input."""

    def conv1d_prefill_split(
        xs: tuple[jax.Array, ...],
        weight: jax.Array,  # [C, K]  C = sum n_i
        conv_state: jax.Array,  # [num_slots, K-1, C]
        query_start_loc: jax.Array,  # i32[S+1]
        slots: StateSlots,
    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
        check_split_args(xs, weight)
        y, conv_state = conv_prefill(
            jnp.concatenate(xs, axis=1), weight, conv_state, query_start_loc, slots
        )
        ys, lo = [], 0
        for x in xs:
            ys.append(y[:, lo : lo + x.shape[1]])
            lo += x.shape[1]
        return tuple(ys), conv_state

    return conv1d_prefill_split


causal_conv1d_prefill_split_reference = packed_inputs(causal_conv1d_prefill_reference)
