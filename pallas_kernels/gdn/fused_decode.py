"""Decode: causal conv1d update and the gated delta rule in one pass over the state slots.

``conv_gdn_decode`` takes the layer's pre-conv channels of one token per row,

    mixed [S, C]:  | q (Hk * Dk) | k (Hk * Dk) | v (Hv * Dv) |      C = conv_dim

runs the depthwise conv (window read from ``conv_state[src]``, new window written to
``conv_state[dst]`` and to checkpoints at offset 1), the SiLU, and the gated delta rule on
``ssm_state`` with the same slots. ``conv_gdn_decode_reference`` is the composition of the two
reference ops (the oracle); the GPU kernel below reads each slot once.

GPU kernels (Triton lowering), two launches::

    1. grid (S * Dv / BV, Hv), gdn_decode's tiling: program (i, h) owns row r = i // (Dv / BV),
       value head h and its state block of BV rows; it computes the key head's q and k from
       their conv window (read only: every program of the key head reads it) and this
       token's channels, the conv of its own BV v channels (whose window it shifts: those
       channels are its alone), and the delta-rule update of its block.
    2. grid (S, 2 * Hk): program (r, c) shifts the conv window of q / k channels
       [c * Dk, (c + 1) * Dk) of row r. It takes launch 1's conv pool, so it runs after every
       read of the old windows.

No channel or state block is read by one program of a launch and written by another, so
reading ``src`` and writing ``dst`` in place (``src == dst``) is race free. The windows and
states also go to the row's checkpoints at offset 1.

Why two launches: the first version ran one program per (row, key head), which shifted the
q / k window itself and walked its value heads' state blocks in turn (a program per value block
would read a window another program had already shifted). It was race free in one launch but
latency-bound: at 8 rows, 128 programs (64 per device under TP 2) each walking 16 blocks, 3.9x
its bytes in the 80B's decode step, 0.63 of the copy bandwidth at 64 rows against gdn_decode's
0.85. Now each program does what a ``gdn_decode`` program does plus two 128-wide convolutions
(the key head's window is read from L2 by each of its programs), and the q / k shift is a
second, small launch (2 * Hk * Dk channels of K-1 taps a row).
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
    DECODE_BLOCK_V,
    DECODE_NUM_WARPS,
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


def _row_writes(r, live, dst_ref, ck_off_ref, ck_slot_ref) -> list[tuple]:
    """Row ``r``'s ``(slot, enabled)`` writes: ``dst``, then the checkpoints at offset 1."""
    dst = dst_ref[r]
    writes = [(dst, live & (dst > 0))]
    for m in range(ck_off_ref.shape[1]):
        slot = ck_slot_ref[r, m]
        writes.append((slot, live & (slot > 0) & (ck_off_ref[r, m] == 1)))
    return writes


def _conv_window(conv_in, x_ref, r, src, live, cs: pl.Slice, width: int) -> list[jax.Array]:
    """Row ``r``'s window of channels ``cs``: the K-1 taps of ``conv_in[src]`` (zeros when the
    row starts from zero), then this token's pre-conv channels."""
    read = jnp.full((width,), live & (src > 0))
    taps = [jnp.int32(j) for j in range(conv_in.shape[1])]  # traced: Pallas indexers want arrays
    window = [pltr.load(conv_in.at[src, j, cs], mask=read, other=0.0) for j in taps]
    window.append(x_ref[r, cs])
    return window


def _store_window(conv_out, window: list[jax.Array], writes, cs: pl.Slice, width: int) -> None:
    """The window shifted by this token (its last K-1 entries) into every slot of ``writes``."""
    for slot, enabled in writes:
        for j, row in enumerate(window[1:]):
            pltr.store(
                conv_out.at[slot, jnp.int32(j), cs], row.astype(conv_out.dtype),
                mask=jnp.full((width,), enabled),
            )  # fmt: skip


def _silu_conv(window: list[jax.Array], w_ref, cs: pl.Slice, width: int) -> jax.Array:
    acc = jnp.zeros((width,), jnp.float32)
    for j, row in enumerate(window):
        acc += row.astype(jnp.float32) * w_ref[cs, jnp.int32(j)].astype(jnp.float32)
    return acc * jax.nn.sigmoid(acc)


def _kernel(
    src_ref, dst_ref, ck_off_ref, ck_slot_ref, n_ref,  # i32[S], i32[S], i32[S, M] x2, i32[1]
    gates_ref,  # f32[2, Hv]: -exp(A_log), dt_bias
    x_ref,  # [S, C]
    w_ref,  # [C, K]
    a_ref, b_ref,  # [S, Hv]
    conv_in,  # [num_slots, K-1, C]
    ssm_in,  # f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [S, Hv, Dv]
    conv_out,  # aliased to conv_in: this launch writes the v channels' windows only
    ssm_out,  # aliased to ssm_in
    *, hk: int, bv: int, scale: float,
):  # fmt: skip
    """Program ``(i, h)``: row ``r = i // (Dv / BV)``, value head ``h``, state block ``vs``."""
    i, h = pl.program_id(0), pl.program_id(1)
    _, hv, dv, dk = ssm_in.shape
    nvb = dv // bv
    r, vb = i // nvb, i % nvb
    g = h // (hv // hk)  # the key head
    vs = pl.ds(vb * bv, bv)
    live = r < n_ref[0]
    src = src_ref[r]
    # The tile's load is issued first: the convolutions and the gates run under it.
    s = load_state(ssm_in, src, h, vs, live & (src > 0))  # [BV, Dk]
    qs, ks = pl.ds(g * dk, dk), pl.ds(hk * dk + g * dk, dk)
    # q and k: read only (the key head's other programs read the same window; the second
    # launch shifts it), each program computes them itself
    q = l2norm(_silu_conv(_conv_window(conv_in, x_ref, r, src, live, qs, dk), w_ref, qs, dk))
    k = l2norm(_silu_conv(_conv_window(conv_in, x_ref, r, src, live, ks, dk), w_ref, ks, dk))
    # v: this block's channels are this program's alone; their window is shifted here
    cv = pl.ds(2 * hk * dk + h * dv + vb * bv, bv)
    window = _conv_window(conv_in, x_ref, r, src, live, cv, bv)
    v = _silu_conv(window, w_ref, cv, bv)
    writes = _row_writes(r, live, dst_ref, ck_off_ref, ck_slot_ref)
    _store_window(conv_out, window, writes, cv, bv)
    g_h, beta = _gates(gates_ref, h, a_ref[r, h], b_ref[r, h])
    o, s = decode_update(s * jnp.exp(g_h), q * scale, k, v, beta)
    o_ref[r, h, vs] = jnp.where(live, o, 0.0).astype(o_ref.dtype)
    for slot, enabled in writes:
        store_state(ssm_out, slot, h, vs, s, enabled)


def _qk_window_kernel(
    src_ref, dst_ref, ck_off_ref, ck_slot_ref, n_ref,  # as above
    x_ref,  # [S, C]
    conv_in,  # [num_slots, K-1, C]
    conv_out,  # aliased to conv_in
    *, dk: int,
):  # fmt: skip
    """Program ``(r, c)``: the window of q / k channels ``[c * Dk, (c + 1) * Dk)`` of row
    ``r`` shifted by its token. Each program reads and writes its own channels."""
    r, c = pl.program_id(0), pl.program_id(1)
    live = r < n_ref[0]
    cs = pl.ds(c * dk, dk)
    window = _conv_window(conv_in, x_ref, r, src_ref[r], live, cs, dk)
    _store_window(conv_out, window, _row_writes(r, live, dst_ref, ck_off_ref, ck_slot_ref), cs, dk)


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
    num_warps: int = DECODE_NUM_WARPS,
    num_stages: int = 1,
    min_rows: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused GPU decode; see the module docstring. Same results as the reference.

    Below ``min_rows`` rows (a static shape) the XLA conv update and the GDN decode kernel run
    in turn instead. The one-launch kernel this replaced kept only Hk SMs busy with one row
    (H200, B=1: 28 us fused vs 15 us unfused) and needed ``min_rows=8``; the two launches have
    gdn_decode's grid (Hv * Dv / BV programs a row), so every row count takes them (not yet
    timed on a GPU: ``benchmarks.decode_variants``).
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
    bv = pick_block_v(dv, block_v, default=DECODE_BLOCK_V)
    args = (
        *slots.arrays(), gate_params(A_log, dt_bias),
        mixed, conv_weight, a, b, conv_state, ssm_state,
    )  # fmt: skip
    kernel = functools.partial(_kernel, hk=num_k_heads, bv=bv, scale=float(dk) ** -0.5)
    params = compiler_params(num_warps, num_stages)
    o, conv_state, ssm_state = pl.pallas_call(
        kernel,
        grid=(rows * (dv // bv), hv),
        out_shape=[
            jax.ShapeDtypeStruct((rows, hv, dv), mixed.dtype),
            jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
            jax.ShapeDtypeStruct(ssm_state.shape, ssm_state.dtype),
        ],
        input_output_aliases={len(args) - 2: 1, len(args) - 1: 2},
        compiler_params=params,
        interpret=interpret,
        name="conv_gdn_decode_gpu",
    )(*args)
    # Then the q / k windows, which every program of a key head read: the second launch takes
    # the first one's conv pool, so it runs after it.
    args = (*slots.arrays(), mixed, conv_state)
    conv_state = pl.pallas_call(
        functools.partial(_qk_window_kernel, dk=dk),
        grid=(rows, 2 * num_k_heads),
        out_shape=jax.ShapeDtypeStruct(conv_state.shape, conv_state.dtype),
        input_output_aliases={len(args) - 1: 0},
        compiler_params=params,
        interpret=interpret,
        name="conv_qk_window_gpu",
    )(*args)
    return o, conv_state, ssm_state
