"""Causal conv1d prefill as one XLA loop fusion: the taps as static shifts of ``x``.

Same signature and results as :func:`pallas_kernels.conv1d.reference.
causal_conv1d_prefill_reference` (the same float32 sums in the same order, so bit-equal), for
any backend. The reference gathers each token's window (``x[qsl[seq] + local - (K-1) ..]``)
and concatenates it with the token into a ``[T, K, C]`` array; here tap ``j`` of every token
is the slice ``x_pad[j : j + T]`` of ``x`` padded with ``K-1`` rows in front (a static shift
XLA fuses into the loop that reads ``x``), replaced by the row's source window only where the
tap falls before the row's first token (a row gather from the small ``[S, K-1, C]`` copy of the
source windows). ``y`` is then one pass that reads ``x`` and writes ``y``; the windows written
to the pool are the reference's (a few rows a sequence).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common.ragged import read_slots, token_seq_ids
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import check_conv1d_args, write_windows


def causal_conv1d_prefill_shifted(
    x: jax.Array,  # [T, C] pre-conv inputs, model dtype
    weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
) -> tuple[jax.Array, jax.Array]:
    """Returns ``(y [T, C] in x.dtype, updated conv_state)``; padding tokens give 0."""
    check_conv1d_args(x, weight, conv_state, slots, query_start_loc)
    num_tokens, _ = x.shape
    km1 = weight.shape[1] - 1
    seq_id, local, live = token_seq_ids(query_start_loc, slots.num_seqs, num_tokens)
    init = read_slots(conv_state, slots.src_slot)  # [S, K-1, C]
    x_pad = jnp.pad(x, ((km1, 0), (0, 0)))
    w32 = weight.astype(jnp.float32)
    acc = None
    for j in range(km1 + 1):  # tap j reads x[t + j - (K-1)]: the reference's order of sums
        tap = x_pad[j : j + num_tokens]
        if j < km1:
            pos = local + j - km1  # the tap's index in the row's new tokens
            from_state = init[seq_id, jnp.clip(km1 + pos, 0, km1 - 1)]  # [T, C]
            tap = jnp.where((pos < 0)[:, None], from_state, tap)
        term = tap.astype(jnp.float32) * w32[:, j]
        acc = term if acc is None else acc + term
    y = jnp.where(live[:, None], acc * jax.nn.sigmoid(acc), 0).astype(x.dtype)
    return y, write_windows(x, init, conv_state, query_start_loc, slots)
