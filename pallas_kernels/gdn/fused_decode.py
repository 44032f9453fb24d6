"""Decode: causal conv1d update and the gated delta rule in one pass over the state slots.

``conv_gdn_decode`` takes the layer's pre-conv channels of one token per row,

    mixed [S, C]:  | q (Hk * Dk) | k (Hk * Dk) | v (Hv * Dv) |      C = conv_dim

runs the depthwise conv (window read from ``conv_state[src]``, new window written to
``conv_state[dst]`` and to checkpoints at offset 1), the SiLU, and the gated delta rule on
``ssm_state`` with the same slots. ``conv_gdn_decode_reference`` is the composition of the two
reference ops (the oracle); the GPU kernel below reads each slot once.

GPU kernel (Triton lowering), grid = (S, Hk)::

    program (r, g) owns, in row r's slots, the conv channels of key head g (its q and k slices
    and the v slices of the value heads g*R .. g*R+R-1, R = Hv // Hk) and those value heads'
    recurrent states. No channel or state block is read by one program and written by
    another, so reading ``src`` and writing ``dst`` in place (src == dst) is race free.

Inside a program, the value heads and their ``BV``-row blocks are a static loop: the state
block ``ssm_state[slot, h, v0:v0+BV, :]`` (``[BV, Dk]``, a contiguous run of the pool's
``[num_slots, Hv, Dv, Dk]`` layout, DESIGN.md §3) is loaded, decayed, updated with both
reductions over K along its contiguous axis, stored; q and k (after the conv, l2-normed) are
computed once per program, each block's v channels by the block itself.

Why one program per key head and not per value block (the unfused decode's grid): q and k need
the key head's conv window, which the program also rewrites (to ``dst``, in place when
``src == dst``); a program per value block would read a window another program of the same
head may already have shifted. Keeping the head in one program keeps the conv race free and
computes its q / k convolution once; the price is fewer, longer programs (``Hk`` per row, each
walking ``R * Dv / BV`` tiles). ``block_v`` 16 / 4 warps is a guess on the transposed layout,
not yet timed on a GPU (the unfused kernel's 16 rows / 1 warp was, at 0.89 of copy).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.delta_rule import l2norm
from pallas_kernels.common.delta_rule_gpu import (
    check_key_dim,
    compiler_params,
    decode_update,
    load_state,
    pick_block_v,
    store_state,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d.reference import causal_conv1d_update_reference
from pallas_kernels.gdn.gpu import _gates, gate_params, gdn_decode
from pallas_kernels.gdn.reference import check_gdn_args, gdn_decode_reference


def unpack_conv_channels(
    mixed: jax.Array,  # [n, C]
    qk_heads: tuple[int, int],  # (Hk, Dk)
    v_heads: tuple[int, int],  # (Hv, Dv)
    shards: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The conv output's channels as ``(q, k [n, Hk, Dk], v [n, Hv, Dv])``.

    Laid out per shard (``hyjax.layers.conv_channels.pack_conv_channels``: each device's q, k,
    v heads side by side); ``shards=1`` is the checkpoint's plain ``q | k | v`` order.
    """
    (hk, dk), (hv, dv) = qk_heads, v_heads
    n, qk = mixed.shape[0], hk * dk // shards
    local = mixed.reshape(n, shards, -1)  # [n, shards, q_s | k_s | v_s]
    q = local[..., :qk].reshape(n, hk, dk)
    k = local[..., qk : 2 * qk].reshape(n, hk, dk)
    v = local[..., 2 * qk :].reshape(n, hv, dv)
    return q, k, v


def check_conv_gdn_decode_args(mixed, conv_weight, conv_state, ssm_state, num_k_heads: int) -> None:
    """Raises ``ValueError`` naming the first inconsistent shape."""
    if ssm_state.ndim != 4:
        raise ValueError(f"ssm_state {ssm_state.shape} must be [num_slots, Hv, Dv, Dk]")
    _, hv, dv, dk = ssm_state.shape
    c = 2 * num_k_heads * dk + hv * dv
    if mixed.ndim != 2 or mixed.shape[1] != c:
        raise ValueError(f"mixed {mixed.shape} must be [S, 2*Hk*Dk + Hv*Dv = {c}]")
    if conv_weight.ndim != 2 or conv_weight.shape[0] != c:
        raise ValueError(f"conv_weight {conv_weight.shape} must be [{c}, K]")
    km1 = conv_weight.shape[1] - 1
    if conv_state.ndim != 3 or conv_state.shape[1:] != (km1, c):
        raise ValueError(f"conv_state {conv_state.shape} must be [num_slots, {km1}, {c}]")


def composed_conv_gdn_decode(conv1d_update: Callable, gdn_decode: Callable) -> Callable:
    """The fused op's signature over two separate ops (conv update, then the delta rule)."""

    def op(
        mixed: jax.Array,  # [S, C] pre-conv q | k | v channels, one token per row
        conv_weight: jax.Array,  # [C, K]
        conv_state: jax.Array,  # [num_slots, K-1, C]
        a: jax.Array,  # [S, Hv]
        b: jax.Array,  # [S, Hv]
        A_log: jax.Array,  # f32[Hv]
        dt_bias: jax.Array,  # f32[Hv]
        ssm_state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]
        slots: StateSlots,  # DESIGN.md §3
        *,
        num_k_heads: int,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        check_conv_gdn_decode_args(mixed, conv_weight, conv_state, ssm_state, num_k_heads)
        y, conv_state = conv1d_update(mixed, conv_weight, conv_state, slots)
        _, hv, dv, dk = ssm_state.shape
        q, k, v = unpack_conv_channels(y, (num_k_heads, dk), (hv, dv), 1)
        o, ssm_state = gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_state, slots)
        return o, conv_state, ssm_state

    return op


# Returns ``(o [S, Hv, Dv], conv_state, ssm_state)``: the two reference ops in turn (the oracle).
conv_gdn_decode_reference = composed_conv_gdn_decode(
    causal_conv1d_update_reference, gdn_decode_reference
)


def _kernel(
    src_ref, dst_ref, ck_off_ref, ck_slot_ref, n_ref,  # i32[S], i32[S], i32[S, M] x2, i32[1]
    gates_ref,  # f32[2, Hv]: -exp(A_log), dt_bias
    x_ref,  # [S, C]
    w_ref,  # [C, K]
    a_ref, b_ref,  # [S, Hv]
    conv_in,  # [num_slots, K-1, C]
    ssm_in,  # f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [S, Hv, Dv]
    conv_out,  # aliased to conv_in
    ssm_out,  # aliased to ssm_in
    *, hk: int, bv: int, scale: float,
):  # fmt: skip
    r, g = pl.program_id(0), pl.program_id(1)
    _, hv, dv, dk = ssm_in.shape
    km1 = conv_in.shape[1]
    ratio = hv // hk
    live = r < n_ref[0]
    src, dst = src_ref[r], dst_ref[r]
    writes = [(dst, live & (dst > 0))]
    for m in range(ck_off_ref.shape[1]):
        slot = ck_slot_ref[r, m]
        writes.append((slot, live & (slot > 0) & (ck_off_ref[r, m] == 1)))

    taps = [jnp.int32(j) for j in range(km1 + 1)]  # traced ints: Pallas indexers want arrays

    def conv(offset: int | jax.Array, width: int) -> jax.Array:
        """SiLU(conv) of channels [offset, offset + width); writes their new window."""
        cs = pl.ds(offset, width)
        read = jnp.full((width,), live & (src > 0))
        window = [pltr.load(conv_in.at[src, j, cs], mask=read, other=0.0) for j in taps[:-1]]
        window.append(x_ref[r, cs])
        acc = jnp.zeros((width,), jnp.float32)
        for j, row in zip(taps, window):
            acc += row.astype(jnp.float32) * w_ref[cs, j].astype(jnp.float32)
        for slot, enabled in writes:
            for j, row in zip(taps, window[1:]):
                row = row.astype(conv_out.dtype)
                pltr.store(conv_out.at[slot, j, cs], row, mask=jnp.full((width,), enabled))
        return acc * jax.nn.sigmoid(acc)

    q = l2norm(conv(g * dk, dk)) * scale  # [Dk]
    k = l2norm(conv(hk * dk + g * dk, dk))
    for h_in_group in range(ratio):
        h = g * ratio + h_in_group
        g_h, beta = _gates(gates_ref, h, a_ref[r, h], b_ref[r, h])
        decay = jnp.exp(g_h)
        for vb in range(dv // bv):
            vs = pl.ds(vb * bv, bv)
            s = load_state(ssm_in, src, h, vs, live & (src > 0))  # [BV, Dk], issued first
            v = conv(2 * hk * dk + h * dv + vb * bv, bv)  # [BV]
            o, s = decode_update(s * decay, q, k, v, beta)
            o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
            for slot, enabled in writes:
                store_state(ssm_out, slot, h, vs, s, enabled)


def conv_gdn_decode(
    mixed: jax.Array,  # [S, C]
    conv_weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    a: jax.Array,  # [S, Hv]
    b: jax.Array,  # [S, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    ssm_state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    num_k_heads: int,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    min_rows: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused GPU decode; see the module docstring. Same results as the reference.

    Below ``min_rows`` rows (a static shape) the XLA conv update and the GDN decode kernel run
    in turn instead: with one program per key head, one row keeps only Hk SMs busy (H200,
    B=1: 28 us fused vs 15 us unfused; from B=16 on the fused kernel is ahead).
    """
    check_conv_gdn_decode_args(mixed, conv_weight, conv_state, ssm_state, num_k_heads)
    rows = mixed.shape[0]
    if rows < min_rows:
        unfused = composed_conv_gdn_decode(  # gdn_decode in its own (measured) tiling
            causal_conv1d_update_reference, functools.partial(gdn_decode, interpret=interpret)
        )
        return unfused(
            mixed, conv_weight, conv_state, a, b, A_log, dt_bias, ssm_state, slots,
            num_k_heads=num_k_heads,
        )  # fmt: skip
    _, hv, dv, dk = ssm_state.shape
    q, k, v = unpack_conv_channels(mixed, (num_k_heads, dk), (hv, dv), 1)  # shapes, for checks
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, ssm_state, slots)
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    check_key_dim(dk)
    bv = pick_block_v(dv, block_v, default=16)
    args = (
        *slots.arrays(), gate_params(A_log, dt_bias),
        mixed, conv_weight, a, b, conv_state, ssm_state,
    )  # fmt: skip
    kernel = functools.partial(_kernel, hk=num_k_heads, bv=bv, scale=float(dk) ** -0.5)
    return pl.pallas_call(
        kernel,
        grid=(rows, num_k_heads),
        out_shape=[
            jax.ShapeDtypeStruct((rows, hv, dv), mixed.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
            jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype),
        ],
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="conv_gdn_decode_gpu",
    )(*args)
