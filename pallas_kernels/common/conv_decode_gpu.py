"""Decode with the causal conv1d update fused in: the GPU launches the GDN and KDA fused
decodes share (Triton lowering).

A layer's pre-conv channels of one token per row, ``x [S, C]`` with
``C = 2 * Hk * Dk + Hv * Dv`` laid out ``| q (Hk * Dk) | k (Hk * Dk) | v (Hv * Dv) |``, go
through the depthwise conv (window read from ``conv_state[src]``, new window written to
``conv_state[dst]`` and to the checkpoints at offset 1), the SiLU, then the delta rule on
``ssm_state`` with the same slots. Two launches::

    1. grid (S * Dv / BV, Hv), the decode kernels' tiling: program (i, h) owns row
       r = i // (Dv / BV), value head h and its state block of BV rows; it computes its key
       head's q and k from their conv window (read only: every program of the key head reads
       it) and this token's channels, the conv of its own BV v channels (whose window it
       shifts: those channels are its alone), and the delta-rule update of its block.
    2. grid (S, 2 * Hk): program (r, c) shifts the conv window of q / k channels
       [c * Dk, (c + 1) * Dk) of row r. It takes launch 1's conv pool, so it runs after every
       read of the old windows.

No channel or state block is read by one program of a launch and written by another, so
reading ``src`` and writing ``dst`` in place (``src == dst``) is race free.

Why two launches: a single one needs one program per (row, key head), which shifts the key
head's q / k window itself and walks its value heads' state blocks in turn (a program per value
block would read a window another program had already shifted). That GDN kernel was race free
but latency-bound: at 8 rows 128 programs (64 per device under TP 2) each walking 16 blocks,
3.9x its bytes in the 80B's decode step, 0.63 of the copy bandwidth at 64 rows against the
unfused decode's 0.85. Here each program does what a decode program does plus two Dk-wide
convolutions (the key head's window is read from L2 by each of its programs), and the q / k
shift is a second, small launch (2 * Hk * Dk channels of K-1 taps a row).

The family supplies ``gates(r, h) -> (beta, decay)``: a scalar decay (GDN) or ``[1, Dk]``
per key channel (KDA).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.delta_rule import group_refs, l2norm
from pallas_kernels.common.delta_rule_gpu import (
    DecodeSlots,
    compiler_params,
    decode_update,
    load_state,
    store_state,
)
from pallas_kernels.common.slots import StateSlots


def row_writes(p: DecodeSlots, r, live) -> list[tuple]:
    """Row ``r``'s ``(slot, enabled)`` writes: ``dst``, then the checkpoints at offset 1."""
    dst = p.dst[r]
    writes = [(dst, live & (dst > 0))]
    for m in range(p.ck_off.shape[1]):
        slot = p.ck_slot[r, m]
        writes.append((slot, live & (slot > 0) & (p.ck_off[r, m] == 1)))
    return writes


def window_of(conv_in, x_ref, r, src, live, cs: pl.Slice, width: int) -> list[jax.Array]:
    """Row ``r``'s window of channels ``cs``: the K-1 taps of ``conv_in[src]`` (zeros when the
    row starts from zero), then this token's pre-conv channels."""
    read = jnp.full((width,), live & (src > 0))
    taps = [jnp.int32(j) for j in range(conv_in.shape[1])]  # traced: Pallas indexers want arrays
    window = [pltr.load(conv_in.at[src, j, cs], mask=read, other=0.0) for j in taps]
    window.append(x_ref[r, cs])
    return window


def shift_window(conv_out, window: list[jax.Array], writes, cs: pl.Slice, width: int) -> None:
    """The window shifted by this token (its last K-1 entries) into every slot of ``writes``."""
    for slot, enabled in writes:
        for j, row in enumerate(window[1:]):
            pltr.store(
                conv_out.at[slot, jnp.int32(j), cs], row.astype(conv_out.dtype),
                mask=jnp.full((width,), enabled),
            )  # fmt: skip


def silu_conv(window: list[jax.Array], w_ref, cs: pl.Slice, width: int) -> jax.Array:
    acc = jnp.zeros((width,), jnp.float32)
    for j, row in enumerate(window):
        acc += row.astype(jnp.float32) * w_ref[cs, jnp.int32(j)].astype(jnp.float32)
    return acc * jax.nn.sigmoid(acc)


def conv_decode_program(
    p: DecodeSlots,
    x_ref,  # [S, C]
    w_ref,  # [C, K]
    conv_in,  # [num_slots, K-1, C]
    ssm_in,  # f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [S, Hv, Dv]
    conv_out,  # aliased to conv_in: launch 1 writes the v channels' windows only
    ssm_out,  # aliased to ssm_in
    *,
    hk: int,
    bv: int,
    scale: float,
    gates: Callable,  # gates(r, h) -> (beta, decay: a scalar or [1, Dk])
):
    """Program ``(i, h)`` of launch 1: row ``r = i // (Dv / BV)``, value head ``h``, block
    ``vs``. Padding rows write zeros to ``o`` and nothing to the pools."""
    i, h = pl.program_id(0), pl.program_id(1)
    _, hv, dv, dk = ssm_in.shape
    nvb = dv // bv
    r, vb = i // nvb, i % nvb
    g = h // (hv // hk)  # the key head
    vs = pl.ds(vb * bv, bv)
    live = r < p.num_seqs[0]
    src = p.src[r]
    # The tile's load is issued first: the convolutions and the gates run under it.
    s = load_state(ssm_in, src, h, vs, live & (src > 0))  # [BV, Dk]
    qs, ks = pl.ds(g * dk, dk), pl.ds(hk * dk + g * dk, dk)
    q = l2norm(silu_conv(window_of(conv_in, x_ref, r, src, live, qs, dk), w_ref, qs, dk))
    k = l2norm(silu_conv(window_of(conv_in, x_ref, r, src, live, ks, dk), w_ref, ks, dk))
    cv = pl.ds(2 * hk * dk + h * dv + vb * bv, bv)
    window = window_of(conv_in, x_ref, r, src, live, cv, bv)
    v = silu_conv(window, w_ref, cv, bv)
    writes = row_writes(p, r, live)
    shift_window(conv_out, window, writes, cv, bv)
    beta, decay = gates(r, h)
    o, s = decode_update(s * decay, q * scale, k, v, beta)
    o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
    for slot, enabled in writes:
        store_state(ssm_out, slot, h, vs, s, enabled)


def _qk_window_kernel(p: DecodeSlots, x_ref, conv_in, conv_out, *, dk: int):
    """Program ``(r, c)`` of launch 2: the window of q / k channels ``[c * Dk, (c + 1) * Dk)``
    of row ``r`` shifted by its token. Each program reads and writes its own channels."""
    r, c = pl.program_id(0), pl.program_id(1)
    live = r < p.num_seqs[0]
    cs = pl.ds(c * dk, dk)
    window = window_of(conv_in, x_ref, r, p.src[r], live, cs, dk)
    shift_window(conv_out, window, row_writes(p, r, live), cs, dk)


def launch_conv_decode(
    kernel: Callable,  # kernel(DecodeSlots, *inputs, x, w, conv_in, ssm_in, o, conv_out, ssm_out,
    #                           *, hk, bv, **params), calling conv_decode_program
    *,
    name: str,
    slots: StateSlots,
    inputs: Sequence[jax.Array],  # the family's gate parameters and activations
    mixed: jax.Array,  # [S, C]
    conv_weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    ssm_state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  donated: updated in place
    num_k_heads: int,
    bv: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    **params,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The two launches; returns ``(o [S, Hv, Dv], conv_state, ssm_state)``."""
    rows = mixed.shape[0]
    _, hv, dv, dk = ssm_state.shape
    cp = compiler_params(num_warps, num_stages)
    args = (*slots.arrays(), *inputs, mixed, conv_weight, conv_state, ssm_state)
    o, conv_state, ssm_state = pl.pallas_call(
        group_refs(kernel, DecodeSlots, hk=num_k_heads, bv=bv, **params),
        grid=(rows * (dv // bv), hv),
        out_shape=[
            jax.ShapeDtypeStruct((rows, hv, dv), mixed.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
            jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype),
        ],
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        compiler_params=cp,
        interpret=interpret,
        name=name,
    )(*args)
    args = (*slots.arrays(), mixed, conv_state)
    conv_state = pl.pallas_call(
        group_refs(functools.partial(_qk_window_kernel, dk=dk), DecodeSlots),
        grid=(rows, 2 * num_k_heads),
        out_shape=jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=cp,
        interpret=interpret,
        name="conv_qk_window_gpu",
    )(*args)
    return o, conv_state, ssm_state
