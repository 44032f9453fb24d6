"""k-token decode (speculative verify) Triton GPU kernels for the GDN and KDA families.

A verify step runs a few tokens per row (the draft tokens) and needs the state after EACH of
them in its own slot, so that after accepting ``j`` tokens the engine continues from the slot
of token ``j`` without recomputation. In the slot contract (DESIGN.md §3) that is a prefill
with checkpoints at offsets ``1..k`` of the row; the chunked prefill kernels cut a chunk at
every checkpoint and would read each one-token chunk as a 64-row window. These kernels take
the same arguments as the families' prefill ops (:func:`gdn_multi_decode` ~ ``gdn_prefill``,
:func:`kda_multi_decode` ~ ``kda_prefill``), so the ops layer can route a verify step here,
and run the decode recurrence token by token instead.

grid = (S, H, Dv // BV); program ``(r, h, vb)`` owns ``state[slot, h, v0:v0+BV, :]`` of row
``r``: a ``[BV, Dk]`` tile of ``S^T``, the pool's layout (``[num_slots, H, Dv, Dk]``), the
reductions over K along its contiguous axis, as in the one-token decode::

    S^T = src > 0 ? pool[src, h, vblk, :] : 0          one read (masked: nothing read if 0)
    for t in 0 .. max_tokens-1 (static, unrolled):     the row's tokens qsl[r] + t
        valid = t < len(r)                             else a no-op (decay 1, beta 0)
        S = decay_t S;  S += k (beta (v - S^T k))^T;  o_t = S^T q        (decode_update)
        pool[ckpt_slots[r, m]] = S  where ckpt_offsets[r, m] == t + 1     (masked stores)
        pool[dst[r]]           = S  where t + 1 == len(r)

    tokens:  | r0 r0 r0 | r1 | r2 r2 r2 r2 | pad ...       qsl = [0, 3, 4, 8, 8, ...]
    slots:     ck@1 ck@2 ck@3=dst ...                      one state block, k + 1 stores

The caller guarantees ``qsl[r + 1] - qsl[r] <= max_tokens`` for every live row (the verify
step's static k + 1). Only a concrete ``query_start_loc`` (outside ``jit``) can be checked on
the host; under ``jit`` a longer row is poisoned instead of silently truncated: its outputs
and its ``dst`` state come out NaN (its checkpoints at offsets ``<= max_tokens`` are exact).
Tokens past ``qsl[num_seqs]`` and rows ``>= num_seqs`` read and write nothing; their outputs
are 0, as in the references.

Speed (H200, ``benchmarks/multi_decode.py``, measured with the pool in the earlier ``[Dk, Dv]``
layout, a ``[Dk, BV]`` tile; not re-measured in ``[Dv, Dk]``), a checkpoint per token, dst in
place: at k = 1
the one-token decode kernel's time (B=64 GDN 124 vs 119 us), 81-89 % of copy bandwidth;
at k = 4, 354 us (B=64) and 1.32 ms (B=256) for GDN, 57-61 % of copy bandwidth, against
86 ms for the chunked prefill on the same slots. ``block_v=128`` was 12-15 % faster than the
default 64 at B=64 k=4 (both families; 8 warps slower); not measured at other k yet.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common import decode_mgpu, multi_decode_mgpu
from pallas_kernels.common.delta_rule import group_refs
from pallas_kernels.common.delta_rule_gpu import (
    check_key_dim,
    compiler_params,
    decode_update,
    load_state,
    pick_block_v,
    store_state,
)
from pallas_kernels.common.slots import StateSlots
from pallas_kernels.gdn import gpu as gdn_gpu
from pallas_kernels.gdn.reference import check_gdn_args
from pallas_kernels.kda import gpu as kda_gpu
from pallas_kernels.kda.reference import check_kda_args

# The unrolled token loop grows the kernel with max_tokens (a masked store per checkpoint pair
# per token); a verify step has a handful of draft tokens. Longer rows belong to the prefill.
MAX_TOKENS_LIMIT = 16
# Every token's inputs and the row's checkpoint slots read before the first store (Triton
# issues a load written after a store after it: the intra launches gained 7-12 % from this,
# session 33), instead of each token's after the previous token's stores. Timed on an H200
# (session 34, GDN, chains of 50): mixed, 0.89-1.10x of the default by k and rows
# (BENCHMARKS.md), so off; HYJAX_MULTI_DECODE_INPUTS_FIRST=1 for a process.
INPUTS_FIRST = os.environ.get("HYJAX_MULTI_DECODE_INPUTS_FIRST", "0") == "1"


class MultiSlots(NamedTuple):
    """A multi-decode kernel's row refs: the token ranges, then ``StateSlots.arrays()``."""

    qsl: jax.Array  # i32[S+1]
    src: jax.Array  # i32[S]
    dst: jax.Array  # i32[S]
    ck_off: jax.Array  # i32[S, M]
    ck_slot: jax.Array  # i32[S, M]
    num_seqs: jax.Array  # i32[1]


def multi_decode_program(
    p: MultiSlots,
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [T, H, Dv]
    pool_out,  # aliased to pool_in
    *,
    bv: int,
    max_tokens: int,
    inputs: Callable,  # inputs(tok, h, vs) -> (q, k [Dk], v [BV], beta, decay: exp(g))
    inputs_first: bool = False,  # INPUTS_FIRST's order
):
    """Program ``(r, h, vb)``: row ``r``'s state block of head ``h`` through its (at most
    ``max_tokens``) tokens; see the module docstring."""
    r, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    num_tokens = o_ref.shape[0]
    live = r < p.num_seqs[0]
    start = p.qsl[r]
    length = jnp.where(live, p.qsl[r + 1] - start, 0)
    too_long = length > max_tokens  # the caller's guarantee broken: poison, don't truncate
    src, dst = p.src[r], p.dst[r]
    s = load_state(pool_in, src, h, vs, (length > 0) & (src > 0))  # [BV, Dk]
    # A token past the row reads a clamped (in-bounds, finite) row and changes nothing:
    # decay 1, beta 0 leave S exactly as it was; its output and stores are masked off.
    toks = [jnp.minimum(start + t, num_tokens - 1) for t in range(max_tokens)]
    num_ckpt = p.ck_off.shape[1]

    def ckpt(m):  # checkpoint m's slot and offset
        return p.ck_slot[r, m], p.ck_off[r, m]

    first = [inputs(tok, h, vs) for tok in toks] if inputs_first else None
    ckpts = [ckpt(m) for m in range(num_ckpt)] if inputs_first else None
    for t in range(max_tokens):
        valid = t < length
        tok = toks[t]
        q, k, v, beta, decay = first[t] if inputs_first else inputs(tok, h, vs)
        decay = jnp.where(valid, decay, 1.0)
        o, s = decode_update(s * decay, q, k, v, jnp.where(valid, beta, 0.0))
        o = jnp.where(too_long, jnp.nan, o)
        # Masked: a clamped token past the row is another row's (or the last) token.
        pltr.store(o_ref.at[tok, h, vs], o.astype(o_ref.dtype), mask=jnp.full((bv,), valid))
        for m in range(num_ckpt):  # (not inputs_first: read here, after the output's store)
            slot, off = ckpts[m] if inputs_first else ckpt(m)
            hit = valid & (slot > 0) & (off == t + 1)
            store_state(pool_out, slot, h, vs, s, hit)
        last = jnp.where(too_long, jnp.nan, s)
        store_state(pool_out, dst, h, vs, last, valid & (dst > 0) & ((t + 1 == length) | too_long))


def check_max_tokens(max_tokens: int, query_start_loc: jax.Array, num_seqs) -> None:
    """``max_tokens`` in range, and every live row at most that long where the row lengths
    are known on the host (concrete arrays; under ``jit`` the kernel poisons a longer row)."""
    if not (isinstance(max_tokens, int) and 1 <= max_tokens <= MAX_TOKENS_LIMIT):
        raise ValueError(f"{max_tokens=} must be a static int in [1, {MAX_TOKENS_LIMIT}]")
    if isinstance(query_start_loc, jax.core.Tracer) or isinstance(num_seqs, jax.core.Tracer):
        return
    qsl = np.asarray(query_start_loc)
    lens = np.diff(qsl)[: int(num_seqs)]
    if lens.size and lens.max() > max_tokens:
        row = int(lens.argmax())
        raise ValueError(f"row {row} has {lens[row]} tokens, more than {max_tokens=}")


def launch_multi_decode(
    kernel: Callable,  # kernel(MultiSlots, *inputs, pool_in, o, pool_out, *, bv, max_tokens, ...)
    *,
    name: str,
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,
    inputs: tuple[jax.Array, ...],  # the gate parameters, then the token-major activations
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    out_dtype,
    max_tokens: int,
    bv: int,
    num_warps: int,
    num_stages: int,
    interpret: bool,
    **params,
) -> tuple[jax.Array, jax.Array]:
    """One ``pallas_call`` over grid ``(S, H, Dv // BV)``; returns ``(o [T, H, Dv], state)``
    with the outputs of tokens past ``qsl[num_seqs]`` zeroed."""
    check_max_tokens(max_tokens, query_start_loc, slots.num_seqs)
    rows = slots.num_rows
    _, h, dv, _ = state.shape
    num_tokens = inputs[-1].shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    args = (qsl, *slots.arrays(), *inputs, state)
    o, state = pl.pallas_call(
        group_refs(kernel, MultiSlots, bv=bv, max_tokens=max_tokens, **params),
        grid=(rows, h, dv // bv),
        out_shape=[
            jax.ShapeDtypeStruct((num_tokens, h, dv), out_dtype),
            jax.ShapeDtypeStruct(state.shape, state.dtype),
        ],
        input_output_aliases={len(args) - 1: 1},
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )(*args)
    # Tokens no live row owns are never written by the kernel (uninitialised memory).
    live = jnp.arange(num_tokens) < qsl[jnp.asarray(slots.num_seqs, jnp.int32)]
    return jnp.where(live[:, None, None], o, 0).astype(out_dtype), state


def _on_mgpu(kernel, make_inputs, acts, vectors, state, qsl, slots, max_tokens, interpret):
    """Mosaic GPU's kernel's ``(o, state)`` where ``kernel`` (or its default) picks it
    (``multi_decode_mgpu.multi_decode_is_mgpu``), else None. ``acts``: the family's
    activations (``q, k, v, ...``), ``make_inputs`` its ``decode_mgpu`` token inputs."""
    if not multi_decode_mgpu.multi_decode_is_mgpu(
        kernel, state, slots, max_tokens, vectors, interpret
    ):
        return None
    check_max_tokens(max_tokens, qsl, slots.num_seqs)
    name = "gdn_multi_decode" if vectors == 2 else "kda_multi_decode"
    return multi_decode_mgpu.multi_decode_mgpu(
        make_inputs(*acts), state, qsl, slots, max_tokens=max_tokens, out_dtype=acts[2].dtype,
        name=name, interpret=interpret,
    )  # fmt: skip


# ----------------------------------------------------------------------------- GDN


def _gdn_kernel(
    p: MultiSlots,
    alog_ref, dtb_ref,  # f32[Hv]: A_log, dt_bias
    q_ref, k_ref,  # [T, Hk, Dk]
    v_ref,  # [T, Hv, Dv]
    a_ref, b_ref,  # [T, Hv]
    pool_in,  # f32 | bf16[num_slots, Hv, Dv, Dk]
    o_ref,  # [T, Hv, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, max_tokens: int, ratio: int, scale: float, inputs_first: bool,
):  # fmt: skip
    refs = (alog_ref, dtb_ref, q_ref, k_ref, v_ref, a_ref, b_ref)
    inputs = functools.partial(gdn_gpu.token_inputs, *refs, ratio=ratio, scale=scale)
    multi_decode_program(
        p, pool_in, o_ref, pool_out, bv=bv, max_tokens=max_tokens, inputs=inputs,
        inputs_first=inputs_first,
    )  # fmt: skip


def gdn_multi_decode(
    q: jax.Array,  # [T, Hk, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, Hk, Dk]
    v: jax.Array,  # [T, Hv, Dv]
    a: jax.Array,  # [T, Hv]
    b: jax.Array,  # [T, Hv]
    A_log: jax.Array,  # f32[Hv]
    dt_bias: jax.Array,  # f32[Hv]
    state: jax.Array,  # f32 | bf16[num_slots, Hv, Dv, Dk]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    max_tokens: int,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    kernel: str | None = None,
    inputs_first: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``gdn_prefill`` for rows of at most ``max_tokens`` tokens (the caller guarantees it);
    see the module docstring. Returns ``(o [T, Hv, Dv], state)``. ``kernel``:
    ``"mgpu"`` runs the Mosaic GPU kernel (``multi_decode_mgpu``), None its default;
    ``inputs_first`` (None: :data:`INPUTS_FIRST`) the Triton kernel's order of loads."""
    check_gdn_args(q, k, v, a, b, A_log, dt_bias, state, slots, query_start_loc)
    _, hk, dk = q.shape
    _, hv, dv = v.shape
    check_key_dim(dk)
    acts = (q, k, v, a, b, A_log, dt_bias)
    if mgpu := _on_mgpu(kernel, decode_mgpu.gdn_inputs, acts, 2, state, query_start_loc,
                        slots, max_tokens, interpret):  # fmt: skip
        return mgpu
    return launch_multi_decode(
        _gdn_kernel,
        name="gdn_multi_decode_gpu",
        query_start_loc=query_start_loc,
        slots=slots,
        inputs=(A_log, dt_bias, q, k, v, a, b),
        state=state,
        out_dtype=v.dtype,
        max_tokens=max_tokens,
        bv=pick_block_v(dv, block_v, default=64),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        ratio=hv // hk,
        scale=float(dk) ** -0.5,
        inputs_first=INPUTS_FIRST if inputs_first is None else inputs_first,
    )


# ----------------------------------------------------------------------------- KDA


def _kda_kernel(
    p: MultiSlots,
    alog_ref,  # f32[H]: A_log
    dt_ref,  # f32[H, Dk]
    q_ref, k_ref, g_ref,  # [T, H, Dk]
    v_ref,  # [T, H, Dv]
    b_ref,  # [T, H]
    pool_in,  # f32 | bf16[num_slots, H, Dv, Dk]
    o_ref,  # [T, H, Dv]
    pool_out,  # aliased to pool_in
    *, bv: int, max_tokens: int, scale: float, inputs_first: bool,
):  # fmt: skip
    refs = (alog_ref, dt_ref, q_ref, k_ref, g_ref, v_ref, b_ref)
    inputs = functools.partial(kda_gpu.token_inputs, *refs, scale=scale)
    multi_decode_program(
        p, pool_in, o_ref, pool_out, bv=bv, max_tokens=max_tokens, inputs=inputs,
        inputs_first=inputs_first,
    )  # fmt: skip


def kda_multi_decode(
    q: jax.Array,  # [T, H, Dk]  post-conv, before l2norm
    k: jax.Array,  # [T, H, Dk]
    v: jax.Array,  # [T, H, Dv]
    g: jax.Array,  # [T, H, Dk]  raw gate projection
    b: jax.Array,  # [T, H]
    A_log: jax.Array,  # f32[H]
    dt_bias: jax.Array,  # f32[H, Dk]
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    query_start_loc: jax.Array,  # i32[S+1]
    slots: StateSlots,  # DESIGN.md §3
    *,
    max_tokens: int,
    block_v: int | None = None,
    num_warps: int = 4,
    num_stages: int = 1,
    kernel: str | None = None,
    inputs_first: bool | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``kda_prefill`` for rows of at most ``max_tokens`` tokens (the caller guarantees it);
    see the module docstring. Returns ``(o [T, H, Dv], state)``. ``kernel``:
    ``"mgpu"`` runs the Mosaic GPU kernel (``multi_decode_mgpu``), None its default;
    ``inputs_first`` (None: :data:`INPUTS_FIRST`) the Triton kernel's order of loads."""
    check_kda_args(q, k, v, g, b, A_log, dt_bias, state, slots, query_start_loc)
    dk = q.shape[2]
    dv = v.shape[2]
    check_key_dim(dk)
    acts = (q, k, v, g, b, A_log, dt_bias)
    if mgpu := _on_mgpu(kernel, decode_mgpu.kda_inputs, acts, 3, state, query_start_loc,
                        slots, max_tokens, interpret):  # fmt: skip
        return mgpu
    return launch_multi_decode(
        _kda_kernel,
        name="kda_multi_decode_gpu",
        query_start_loc=query_start_loc,
        slots=slots,
        inputs=(A_log, dt_bias, q, k, g, v, b),
        state=state,
        out_dtype=v.dtype,
        max_tokens=max_tokens,
        bv=pick_block_v(dv, block_v, default=64),
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
        scale=float(dk) ** -0.5,
        inputs_first=INPUTS_FIRST if inputs_first is None else inputs_first,
    )
