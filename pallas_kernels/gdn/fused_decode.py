"""Decode: causal conv1d update and the gated delta rule in one pass over the state slots.

``conv_gdn_decode`` takes the layer's pre-conv channels of one token per row,

    mixed [S, C]:  | q (Hk * Dk) | k (Hk * Dk) | v (Hv * Dv) |      C = conv_dim

runs the depthwise conv (window read from ``conv_state[src]``, new window written to
``conv_state[dst]`` and to checkpoints at offset 1), the SiLU, and the gated delta rule on
``ssm_state`` with the same slots. ``conv_gdn_decode_reference`` is the composition of the two
reference ops (the oracle); the GPU kernel below reads each slot once.

The GPU kernel: the two launches of :mod:`pallas_kernels.common.conv_decode_gpu` (a program
per row, value head and state block; the q / k windows shifted by a second small launch), with
the GDN gates (a scalar decay per value head).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.common.conv_decode_gpu import conv_decode_program, launch_conv_decode
from pallas_kernels.common.delta_rule_gpu import (
    DECODE_BLOCK_V,
    DECODE_NUM_WARPS,
    DecodeSlots,
    check_key_dim,
    pick_block_v,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d import gpu as conv1d_gpu
from pallas_kernels.conv1d.reference import causal_conv1d_update_reference
from pallas_kernels.gdn.gpu import _gates, gdn_decode
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


def conv_qkv(
    conv1d_update: Callable,
    mixed: jax.Array,
    conv_weight: jax.Array,
    conv_state: jax.Array,
    slots: StateSlots,
    qk_heads: tuple[int, int],  # (Hk, Dk)
    v_heads: tuple[int, int],  # (Hv, Dv)
    split_outputs: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The conv update's ``(q, k, v, conv_state)``. With ``split_outputs`` the update hands
    the three back apart (``splits=``: :func:`pallas_kernels.conv1d.gpu.causal_conv1d_update`),
    each contiguous, so no slice is copied before the decode kernel takes them."""
    (hk, dk), (hv, dv) = qk_heads, v_heads
    if not split_outputs:
        y, conv_state = conv1d_update(mixed, conv_weight, conv_state, slots)
        return (*unpack_conv_channels(y, qk_heads, v_heads, 1), conv_state)
    n = mixed.shape[0]
    q, k, v, conv_state = conv1d_update(
        mixed, conv_weight, conv_state, slots, splits=(hk * dk, hk * dk, hv * dv)
    )
    return q.reshape(n, hk, dk), k.reshape(n, hk, dk), v.reshape(n, hv, dv), conv_state


def composed_conv_gdn_decode(
    conv1d_update: Callable, gdn_decode: Callable, *, split_outputs: bool = False
) -> Callable:
    """The fused op's signature over two separate ops (conv update, then the delta rule);
    ``split_outputs``: see :func:`conv_qkv`."""

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
        _, hv, dv, dk = ssm_state.shape
        q, k, v, conv_state = conv_qkv(
            conv1d_update, mixed, conv_weight, conv_state, slots, (num_k_heads, dk), (hv, dv),
            split_outputs,
        )  # fmt: skip
        o, ssm_state = gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_state, slots)
        return o, conv_state, ssm_state

    return op


# Returns ``(o [S, Hv, Dv], conv_state, ssm_state)``: the two reference ops in turn (the oracle).
conv_gdn_decode_reference = composed_conv_gdn_decode(
    causal_conv1d_update_reference, gdn_decode_reference
)


def two_kernel_conv_gdn_decode(*args, interpret: bool = False, **kwargs):
    """The Pallas conv update (q, k, v handed back apart), then ``gdn_decode``: the fused
    op's signature in two kernels. The engine's decode on NVIDIA (``hyjax.ops``): faster on
    an H200 than :func:`conv_gdn_decode`'s two launches (its second a small q / k window
    shift), ``benchmarks.decode_variants``."""
    op = composed_conv_gdn_decode(
        functools.partial(conv1d_gpu.causal_conv1d_update, interpret=interpret),
        functools.partial(gdn_decode, interpret=interpret),
        split_outputs=True,
    )
    return op(*args, **kwargs)


def _kernel(
    p: DecodeSlots,
    alog_ref, dtb_ref,  # f32[Hv]: A_log, dt_bias
    a_ref, b_ref,  # [S, Hv]
    x_ref, w_ref, conv_in, ssm_in, o_ref, conv_out, ssm_out,  # conv_decode_program's
    *, hk: int, bv: int, scale: float,
):  # fmt: skip
    def gates(r, h):
        g, beta = _gates(alog_ref, dtb_ref, h, a_ref[r, h], b_ref[r, h])
        return beta, jnp.exp(g)

    conv_decode_program(
        p, x_ref, w_ref, conv_in, ssm_in, o_ref, conv_out, ssm_out,
        hk=hk, bv=bv, scale=scale, gates=gates,
    )  # fmt: skip


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
    return launch_conv_decode(
        _kernel,
        name="conv_gdn_decode_gpu",
        slots=slots,
        inputs=(A_log, dt_bias, a, b),
        mixed=mixed,
        conv_weight=conv_weight,
        conv_state=conv_state,
        ssm_state=ssm_state,
        num_k_heads=num_k_heads,
        bv=pick_block_v(dv, block_v, default=DECODE_BLOCK_V),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )
