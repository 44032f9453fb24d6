"""Decode: causal conv1d update and KDA in one pass over the state slots.

``conv_kda_decode`` takes a KDA layer's pre-conv channels of one token per row,

    mixed [S, 3 * H * D]:  | q (H * D) | k (H * D) | v (H * D) |

(Kimi-Linear's three depthwise filters packed in that order, ``conv_weight [3 * H * D, K]``),
runs the conv (window read from ``conv_state[src]``, new window written to ``conv_state[dst]``
and to checkpoints at offset 1), the SiLU, and the KDA recurrence on ``ssm_state`` with the
same slots. ``conv_kda_decode_reference`` is the composition of the two reference ops (the
oracle).

The GPU kernel: the two launches of :mod:`pallas_kernels.common.conv_decode_gpu` (a program
per row, head and state block; the q / k windows shifted by a second small launch), with the
KDA gates (a decay per key channel). It replaces XLA's conv update (a gather of the windows, the
conv, a scatter back) before the ``kda_decode`` kernel.
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
    pick_block_v,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.conv1d import gpu as conv1d_gpu
from pallas_kernels.conv1d.reference import causal_conv1d_update_reference
from pallas_kernels.gdn.fused_decode import conv_qkv, unpack_conv_channels
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda.gpu import _check as check_kda_gpu_args
from pallas_kernels.kda.gpu import decode_gate
from pallas_kernels.kda.reference import kda_decode_reference


def check_conv_kda_decode_args(mixed, conv_weight, conv_state, ssm_state) -> None:
    """Raises ``ValueError`` naming the first inconsistent shape."""
    if ssm_state.ndim != 4:
        raise ValueError(f"ssm_state {ssm_state.shape} must be [num_slots, H, Dv, Dk]")
    _, h, dv, dk = ssm_state.shape
    c = h * (2 * dk + dv)
    if mixed.ndim != 2 or mixed.shape[1] != c:
        raise ValueError(f"mixed {mixed.shape} must be [S, H*(2*Dk + Dv) = {c}]")
    if conv_weight.ndim != 2 or conv_weight.shape[0] != c:
        raise ValueError(f"conv_weight {conv_weight.shape} must be [{c}, K]")
    km1 = conv_weight.shape[1] - 1
    if conv_state.ndim != 3 or conv_state.shape[1:] != (km1, c):
        raise ValueError(f"conv_state {conv_state.shape} must be [num_slots, {km1}, {c}]")


def composed_conv_kda_decode(
    conv1d_update: Callable, kda_decode: Callable, *, split_outputs: bool = False
) -> Callable:
    """The fused op's signature over two separate ops (conv update, then KDA);
    ``split_outputs``: see :func:`pallas_kernels.gdn.fused_decode.conv_qkv`."""

    def op(
        mixed: jax.Array,  # [S, C] pre-conv q | k | v channels, one token per row
        conv_weight: jax.Array,  # [C, K]
        conv_state: jax.Array,  # [num_slots, K-1, C]
        g: jax.Array,  # [S, H, Dk]  raw gate projection
        b: jax.Array,  # [S, H]
        A_log: jax.Array,  # f32[H]
        dt_bias: jax.Array,  # f32[H, Dk]
        ssm_state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]
        slots: StateSlots,  # DESIGN.md §3
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        check_conv_kda_decode_args(mixed, conv_weight, conv_state, ssm_state)
        _, h, dv, dk = ssm_state.shape
        q, k, v, conv_state = conv_qkv(
            conv1d_update, mixed, conv_weight, conv_state, slots, (h, dk), (h, dv), split_outputs
        )
        o, ssm_state = kda_decode(q, k, v, g, b, A_log, dt_bias, ssm_state, slots)
        return o, conv_state, ssm_state

    return op


# Returns ``(o [S, H, Dv], conv_state, ssm_state)``: the two reference ops in turn (the oracle).
conv_kda_decode_reference = composed_conv_kda_decode(
    causal_conv1d_update_reference, kda_decode_reference
)


def two_kernel_conv_kda_decode(*args, interpret: bool = False):
    """The Pallas conv update (q, k, v handed back apart), then ``kda_decode``: as
    :func:`pallas_kernels.gdn.fused_decode.two_kernel_conv_gdn_decode`, for KDA."""
    op = composed_conv_kda_decode(
        functools.partial(conv1d_gpu.causal_conv1d_update, interpret=interpret),
        functools.partial(kda_gpu.kda_decode, interpret=interpret),
        split_outputs=True,
    )
    return op(*args)


def _kernel(
    p: DecodeSlots,
    alog_ref,  # f32[H]: A_log
    dt_ref,  # f32[H, Dk]
    g_ref,  # [S, H, Dk]
    b_ref,  # [S, H]
    x_ref, w_ref, conv_in, ssm_in, o_ref, conv_out, ssm_out,  # conv_decode_program's
    *, hk: int, bv: int, scale: float,
):  # fmt: skip
    def gates(r, h):
        g = decode_gate(alog_ref, dt_ref, g_ref[r, h, :], h)  # [Dk]
        beta = jax.nn.sigmoid(b_ref[r, h].astype(jnp.float32))
        return beta, jnp.exp(g)[None, :]  # S^T's columns (S's rows), per key channel

    conv_decode_program(
        p, x_ref, w_ref, conv_in, ssm_in, o_ref, conv_out, ssm_out,
        hk=hk, bv=bv, scale=scale, gates=gates,
    )  # fmt: skip


def conv_kda_decode(
    mixed: jax.Array,  # [S, C]
    conv_weight: jax.Array,  # [C, K]
    conv_state: jax.Array,  # [num_slots, K-1, C]  donated: updated in place
    g: jax.Array,  # [S, H, Dk]
    b: jax.Array,  # [S, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    ssm_state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    slots: StateSlots,  # DESIGN.md §3
    *,
    block_v: int | None = None,
    num_warps: int = DECODE_NUM_WARPS,
    num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The fused GPU decode; see the module docstring. Same results as the reference."""
    check_conv_kda_decode_args(mixed, conv_weight, conv_state, ssm_state)
    _, h, dv, dk = ssm_state.shape
    q, k, v = unpack_conv_channels(mixed, (h, dk), (h, dv), 1)  # shapes, for the checks
    check_kda_gpu_args(q, k, v, g, b, A_log, dt_bias, ssm_state, slots)  # kda_decode's
    rows = mixed.shape[0]
    if rows != slots.num_rows:
        raise ValueError(f"decode rows {rows} must equal {slots.num_rows=} (one token each)")
    return launch_conv_decode(
        _kernel,
        name="conv_kda_decode_gpu",
        slots=slots,
        inputs=(A_log, dt_bias, g, b),
        mixed=mixed,
        conv_weight=conv_weight,
        conv_state=conv_state,
        ssm_state=ssm_state,
        num_k_heads=h,
        bv=pick_block_v(dv, block_v, default=DECODE_BLOCK_V),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        scale=float(dk) ** -0.5,
    )
