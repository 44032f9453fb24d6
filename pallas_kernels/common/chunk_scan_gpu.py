"""The chunked delta-rule prefill after its parallel launch, shared by the GDN and KDA GPU kernels.

Both families' prefills start with an *intra* launch, one program per (chunk, head), that
computes everything of a chunk that does not depend on the state (the gates, the UT transform,
the decayed rows and the intra-chunk scores) and leaves it as :class:`ChunkRefs`. Only how the
pairwise decays are formed differs (one gate per head for GDN, one per key channel for KDA),
so what follows the intra launch is written once, here (:func:`scan_launches`):

- two launches (the default): ``_serial_kernel``, one program per (row, head, Dv block)
  (:func:`~pallas_kernels.common.delta_rule_gpu.serial_grid`), walks the row's chunks in order
  with ``S [Dk, BV]`` (f32) in registers: ``V' = U - W S``, ``o = (q e^gam) S + Aqk V'``,
  ``S = e^gam_last S + (k e^(gam_last - gam))^T V'``
  (:func:`~pallas_kernels.common.delta_rule.chunk_recurrence`), storing checkpoints and ``dst``
  (:func:`~pallas_kernels.common.delta_rule_gpu.scan_row_chunks`). Two of the four products
  (``W S``, then the state update) are the serial chain; the other two hang off it. There is no
  per-chunk scratch of states, so no sequence is too long for it.
- three launches (``three_launches=True``): ``_state_kernel`` keeps only ``V'`` and ``S`` on
  the serial chain and stores each chunk's starting state (``[NC, H, Dk, Dv]`` in the operand
  dtype, a scratch that grows with the chunks), then ``_output_kernel`` computes every (chunk,
  head, Dv block)'s ``o`` in parallel.

The scratch is head-major (``[H, Tp, D]``: a chunk's rows are one contiguous run per head), in
the operand dtype, written for the valid rows only; ``decay`` is ``e^gam_last`` per chunk and
head, a scalar (``[NC, H]``, GDN) or per key channel (``[NC, H, Dk]``, KDA).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltr

from pallas_kernels.common.delta_rule import TN, chunk_recurrence, group_refs, mm
from pallas_kernels.common.delta_rule_gpu import (
    RowPlan,
    compiler_params,
    pick_block_v,
    scan_row_chunks,
    serial_grid,
    serial_ids,
    window,
)


class ChunkRefs(NamedTuple):
    """What the intra launch leaves for the serial one (module docstring)."""

    w: jax.Array  # [H, Tp, Dk]  W = Tm (beta k e^gam)
    u: jax.Array  # [H, Tp, Dv]  U = Tm (beta v)
    q_dec: jax.Array  # [H, Tp, Dk]  q e^gam (l2-normed, scaled)
    k_dec: jax.Array  # [H, Tp, Dk]  k e^(gam_last - gam) (l2-normed)
    a_qk: jax.Array  # [H, Tp, C]  incl_lower(q k^T e^(gam_i - gam_j)), 0 above; window columns
    decay: jax.Array  # f32[NC, H] (one gate per head) | f32[NC, H, Dk] (one per key channel)


def chunk_refs_shapes(
    heads, tokens, dk, dv, chunk, num_chunks, dtype, per_channel_decay, tma_layout=False
):
    """The intra launch's outputs, :class:`ChunkRefs` order: the scratch in ``dtype`` and the
    decay in f32, ``[NC, H]`` or (``per_channel_decay``) ``[NC, H, Dk]``. ``tma_layout`` (the
    Mosaic GPU serial launch's, :mod:`pallas_kernels.common.chunk_scan_mgpu`): ``U^T``
    (``[H, Dv, Tp]``), ``Tp`` a multiple of ``chunk``."""
    sds = jax.ShapeDtypeStruct
    decay = (num_chunks, heads, dk) if per_channel_decay else (num_chunks, heads)
    if tma_layout and tokens % chunk:
        raise ValueError(f"tma_layout: {tokens} tokens, not a multiple of {chunk} (pad_tokens)")
    return ChunkRefs(
        w=sds((heads, tokens, dk), dtype),
        u=sds((heads, dv, tokens) if tma_layout else (heads, tokens, dv), dtype),
        q_dec=sds((heads, tokens, dk), dtype),
        k_dec=sds((heads, tokens, dk), dtype),
        a_qk=sds((heads, tokens, chunk), dtype),
        decay=sds(decay, jnp.float32),
    )


def chunk_loads(x: ChunkRefs, ci, win, h, vs):
    """Chunk ``ci``'s operands for head ``h`` and Dv columns ``vs`` (rows outside the chunk
    read as zeros); the decay as a scalar or a ``[Dk, 1]`` column (it scales ``S``'s rows)."""
    rows = win.valid[:, None]

    def ld(ref, cols=slice(None)):
        return pltr.load(ref.at[h, win.rows, cols], mask=rows, other=0.0)

    if x.decay.ndim == 2:
        decay = x.decay[ci, h]
    else:
        decay = x.decay[ci, h, :][:, None]
    return ld(x.w), ld(x.u, vs), ld(x.q_dec), ld(x.k_dec), ld(x.a_qk), decay


def _serial_kernel(
    p: RowPlan,
    x: ChunkRefs,
    pool_in,  # [num_slots, H, Dv, Dk]
    o_ref,  # [Tp, H, Dv]  (rows outside every chunk are left unwritten)
    pool_out,
    *, bv: int, precision, vb_first: bool,
):  # fmt: skip
    """The two-launch path's serial launch, one program per (row, head, Dv block): the state
    walks the row's chunks and each chunk's output is finished on the way."""
    r, h, vb = serial_ids(vb_first)
    vs = pl.ds(vb * bv, bv)

    def step(ci, win, s):
        w, u, q_dec, k_dec, a_qk, decay = chunk_loads(x, ci, win, h, vs)
        o, s = chunk_recurrence(s, w, u, q_dec, a_qk, k_dec, decay, precision, x.w.dtype)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=win.valid[:, None])
        return s

    scan_row_chunks(p, pool_in, pool_out, r=r, h=h, vs=vs, num_tokens=o_ref.shape[0],
                    chunk=x.a_qk.shape[2], step=step)  # fmt: skip


def _state_kernel(
    p: RowPlan,
    x: ChunkRefs,
    pool_in,  # [num_slots, H, Dv, Dk]
    h_ref,  # [NC, H, Dk, Dv]  out: the state before each chunk (operand dtype)
    vnew_ref,  # [H, Tp, Dv]   out: V' = U - W S
    pool_out,
    *, bv: int, precision, vb_first: bool,
):  # fmt: skip
    """The three-launch path's serial launch: only the state recurrence."""
    r, h, vb = serial_ids(vb_first)
    vs = pl.ds(vb * bv, bv)
    op = x.w.dtype

    def step(ci, win, s):
        w, u, _, k_dec, _, decay = chunk_loads(x, ci, win, h, vs)
        sb = s.astype(op)
        h_ref[ci, h, :, vs] = sb
        vnew = (u.astype(jnp.float32) - mm(w, sb, precision=precision)).astype(op)  # [C, BV]
        pltr.store(vnew_ref.at[h, win.rows, vs], vnew, mask=win.valid[:, None])
        return s * decay + mm(k_dec, vnew, TN, precision)

    scan_row_chunks(p, pool_in, pool_out, r=r, h=h, vs=vs, num_tokens=vnew_ref.shape[1],
                    chunk=x.a_qk.shape[2], step=step)  # fmt: skip


def _output_kernel(
    c_start_ref, c_len_ref,  # i32[NC]
    qd_ref,  # [H, Tp, Dk]
    aqk_ref,  # [H, Tp, C]
    h_ref,  # [NC, H, Dk, Dv]
    vnew_ref,  # [H, Tp, Dv]
    o_ref,  # [Tp, H, Dv]
    *, bv: int, precision,
):  # fmt: skip
    """The three-launch path's last launch, every (chunk, head, Dv block) in parallel:
    ``o = (q e^gam) S + Aqk V'``."""
    ci, h, vb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    vs = pl.ds(vb * bv, bv)
    start, length = c_start_ref[ci], c_len_ref[ci]

    @pl.when(length > 0)
    def _():
        win = window(start, length, o_ref.shape[0], aqk_ref.shape[2])
        rows = win.valid[:, None]
        q_dec = pltr.load(qd_ref.at[h, win.rows, :], mask=rows, other=0.0)
        a_qk = pltr.load(aqk_ref.at[h, win.rows, :], mask=rows, other=0.0)
        vnew = pltr.load(vnew_ref.at[h, win.rows, vs], mask=rows, other=0.0)
        o = mm(q_dec, h_ref[ci, h, :, vs], precision=precision)
        o = o + mm(a_qk, vnew, precision=precision)
        pltr.store(o_ref.at[win.rows, h, vs], o.astype(o_ref.dtype), mask=rows)


def _rows_and_chunks(kernel):
    """``kernel(p, x: ChunkRefs, *rest)`` taking its :class:`ChunkRefs` as one group too."""

    def grouped(p, *refs, **params):
        n = len(ChunkRefs._fields)
        return kernel(p, ChunkRefs(*refs[:n]), *refs[n:], **params)

    return grouped


def scan_launches(
    rp: RowPlan,
    x: ChunkRefs,
    state: jax.Array,  # f32 | bf16[num_slots, H, Dv, Dk]  donated: updated in place
    plan_start: jax.Array,  # i32[NC]  the chunk plan's starts and lengths (output launch)
    plan_length: jax.Array,
    *,
    out_dtype,
    bv: int,
    precision,
    num_warps: int,
    num_stages: int,
    vb_first: bool,
    three_launches: bool,
    block_v_out: int | None,
    interpret: bool,
    name: str,  # the family's prefix of the launches' names, e.g. "gdn_prefill"
) -> tuple[jax.Array, jax.Array]:
    """The launches after the intra one (module docstring). Returns ``(o [Tp, H, Dv], state)``;
    rows outside every chunk of ``o`` are left unwritten."""
    h, tp, dk = x.w.shape
    dv = x.u.shape[2]
    nc = x.decay.shape[0]
    op = x.w.dtype
    rows = rp.src.shape[0]
    grid = serial_grid(rows, h, dv // bv, vb_first)
    params = compiler_params(num_warps, num_stages)
    sds = jax.ShapeDtypeStruct
    state_out = sds(state.shape, state.dtype)
    kw = dict(bv=bv, precision=precision, vb_first=vb_first)
    args = (*rp, *x, state)
    if not three_launches:
        return pl.pallas_call(
            group_refs(_rows_and_chunks(_serial_kernel), RowPlan, **kw),
            grid=grid,
            out_shape=[sds((tp, h, dv), out_dtype), state_out],
            input_output_aliases={len(args) - 1: 1},
            compiler_params=params,
            interpret=interpret,
            name=f"{name}_serial_gpu",
        )(*args)
    h_all, vnew, state = pl.pallas_call(
        group_refs(_rows_and_chunks(_state_kernel), RowPlan, **kw),
        grid=grid,
        out_shape=[sds((nc, h, dk, dv), op), sds((h, tp, dv), op), state_out],
        input_output_aliases={len(args) - 1: 2},
        compiler_params=params,
        interpret=interpret,
        name=f"{name}_state_gpu",
    )(*args)
    bo = pick_block_v(dv, block_v_out, default=64)
    o = pl.pallas_call(
        functools.partial(_output_kernel, bv=bo, precision=precision),
        grid=(nc, h, dv // bo),
        out_shape=sds((tp, h, dv), out_dtype),
        compiler_params=params,
        interpret=interpret,
        name=f"{name}_output_gpu",
    )(plan_start, plan_length, x.q_dec, x.a_qk, h_all, vnew)
    return o, state
